"""``lockgate serve --ray``: a gateway whose replicas are Ray actors, and its admin routes.

Owns the process of ``serve --ray``: it joins (``--ray-address``) or starts a Ray cluster, starts
``--replicas`` engine replicas as actors (``ray_fleet.RayFleet``: each one an ordinary ``lockgate
serve`` with this command's engine and server flags, listening on its node), and serves the gateway
on ``--host``/``--port`` with the Ray fleet as its membership source. The gateway's routing flags
apply as with ``serve --dp``.

Admin routes (behind ``--api-key`` when one is set, like every gateway route but /health):

* ``GET /admin/replicas``: the wanted count and every replica (index, URL, node, server pid,
  draining or not);
* ``POST /admin/replicas`` ``{"replicas": N}``: scale to N (0 <= N <= 1024): new replicas are
  started, surplus ones drained (no new requests, in-flight ones finish) and stopped.

On SIGINT/SIGTERM the gateway stops taking requests, every replica is drained, and the actors are
killed; a Ray cluster this command started goes with it. A local cluster (no ``--ray-address``)
is this server's own (a new cluster in its own temp directory, never one another server left) and
runs on loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's switch for that).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lockgate.config import EngineConfig, config_to_args
from lockgate.httpguard import key_env
from lockgate.server_config import ServerConfig

log = logging.getLogger("lockgate.fleet")

MAX_REPLICAS = 1024


def add_admin_routes(app: FastAPI, fleet: Any) -> None:
    """GET/POST /admin/replicas on ``app``, ahead of the gateway's catch-all proxy route."""

    async def get_replicas() -> Response:
        return JSONResponse({"replicas": fleet.wanted, "members": fleet.describe()})

    async def set_replicas(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        n = body.get("replicas") if isinstance(body, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_REPLICAS:
            return JSONResponse({"error": {"message": f"body must be {{\"replicas\": N}} with an integer 0 <= N <= "
                                                      f"{MAX_REPLICAS}", "type": "invalid_request_error",
                                           "param": "replicas", "code": 400}}, status_code=400)
        await asyncio.to_thread(fleet.scale, n)
        return JSONResponse({"replicas": fleet.wanted, "members": fleet.describe()})

    before = len(app.router.routes)
    app.add_api_route("/admin/replicas", get_replicas, methods=["GET"])
    app.add_api_route("/admin/replicas", set_replicas, methods=["POST"])
    added = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[0:0] = added  # before the proxy's catch-all


def serve_ray(engine: EngineConfig, server: ServerConfig, routing: Any, log_level: str, cors: Any = None) -> int:
    from lockgate.gateway.command import build_gateway, run_gateway

    try:
        from lockgate.fleet.ray_fleet import RayFleet
    except ImportError as e:  # pragma: no cover (ray is in the test extra)
        print(f"lockgate: error: --ray needs Ray: pip install 'lockgate[ray]' ({e})", file=sys.stderr)
        return 2
    threads = max(1, int(-(-server.replica_cpus // 1)))
    replica_engine = engine if engine.model.num_threads is not None else \
        dataclasses.replace(engine, model=dataclasses.replace(engine.model, num_threads=threads))
    rserver = dataclasses.replace(server, host="127.0.0.1", port=0, ray=False, ray_address=None, replicas=1,
                                  replica_cpus=1.0, api_key=(), api_key_file=None)
    serve_args = ["--log-level", log_level, *config_to_args(replica_engine), *config_to_args(rserver, ServerConfig)]
    env = key_env(server.api_key, server.api_key_file)
    if server.ray_address is None:  # a local cluster: keep Ray and the replicas on loopback
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        fleet = RayFleet(serve_args, replicas=server.replicas, replica_cpus=server.replica_cpus,
                         address=server.ray_address, env=env, grace=server.shutdown_timeout + 10.0)
    except Exception as e:  # noqa: BLE001 (cannot reach the cluster, not enough CPUs declared, ...)
        print(f"lockgate: error: --ray: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        try:
            gw = build_gateway([], None, routing, engine.model.model, server.api_key,
                               server.max_request_bytes or "16MiB", source=fleet, api_key_file=server.api_key_file)
        except ValueError as e:
            print(f"lockgate: error: {e}", file=sys.stderr)
            return 2
        log.info("serve --ray: %d replicas (%.3g CPUs each) on %s", server.replicas, server.replica_cpus,
                 server.ray_address or "a local Ray cluster")
        return run_gateway(gw, server.host, server.port, log_level, grace=server.shutdown_timeout + 5.0,
                           on_app=lambda app: add_admin_routes(app, fleet), header_timeout=server.http_header_timeout,
                           keep_alive_timeout=server.http_keep_alive_timeout, body_timeout=server.http_body_timeout,
                           max_connections=server.http_max_connections, cors=cors)
    finally:
        fleet.shutdown()
        import ray

        ray.shutdown()  # a cluster this command started stops; one it joined stays
        if fleet.temp_dir is not None:
            shutil.rmtree(fleet.temp_dir, ignore_errors=True)
