"""Placing engine replicas on a cluster engine (today: Ray, ``ray_fleet``), for the gateway to route to.

The gateway (``lockgate.gateway``) knows replicas as URLs; this package starts and supervises the
processes behind those URLs on other machines and tells the gateway which ones are live
(``Fleet``'s membership source). Ray is an optional dependency: nothing here is imported unless
``serve --ray`` asks for it, and the one-machine paths (``serve``, ``serve --dp``, ``gateway``) never
import it.
"""
