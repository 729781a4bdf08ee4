"""Model files, torch-free: a ``--model`` spec -> a local Hugging Face style directory.

``loader``: resolving ``default`` / a ``.gguf`` file / a directory, converting GGUF (cached,
atomic), reading eos ids and a checkpoint's content fingerprint; ``rope_scaling``: the rope
arithmetic GGUF conversion needs, in numpy. Imported by every process that needs a model's
files without its weights in torch (the gateway, bench, CLI, tokenizer side) and by the runner.
The architectures that turn these files into torch modules live in ``lockgate.models``.
"""
