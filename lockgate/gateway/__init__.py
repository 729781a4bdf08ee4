"""The gateway: one HTTP front for several engine replicas (``lockgate gateway``, ``serve --dp N``).

Layers, lowest first: ``prefix_index`` (block hashes of prompts and which replica holds them),
``policy`` (pure routing decisions from loads and matches), ``replicas`` (the live fleet: health,
loads, the replicas file), ``proxy`` (the HTTP app that routes, retries and streams), ``command``
(flags, start-up, ``serve --dp``). Nothing here imports the engine: the gateway talks HTTP only.
"""
