"""``lockgate gateway`` and ``lockgate serve --dp N``: flags, start-up, shutdown.

``GatewayConfig`` holds the routing knobs (validated when built, each error naming its flag).
``run_gateway`` serves the gateway app on uvicorn until SIGINT/SIGTERM. ``serve_dp`` starts N
``lockgate serve`` replicas on the loopback ports after ``--port`` (each scheduler with cores/N torch
threads unless ``--num-threads`` is given) and the gateway on ``--port``. The gateway process binds each
replica's port itself before anything starts and hands the bound socket to the replica
(``--listen-fd``), so no other socket (not even the gateway's own connections to the other replicas,
whose local ports come from the same ephemeral range) can take a replica's port, at start or across
its restarts; on a signal the gateway
stops accepting and at once sends SIGTERM to the replicas, which finish in-flight work within their
``--shutdown-timeout`` (what is still running then ends with their own abort + error event, relayed
by the gateway, which waits that long plus 5 s); then what is left is killed. A replica that dies on its own (a crash, or its
server exiting because its engine stopped answering) is logged, taken out of routing by the health
checks, and restarted with backoff (``ReplicaProcess``); the others keep serving meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from lockgate.config import EngineConfig, config_to_args, option, parse_size
from lockgate.gateway.metrics import GatewayMetrics
from lockgate.gateway.policy import POLICIES, PREFIX_POLICIES, Router
from lockgate.gateway.proxy import Gateway, create_gateway_app
from lockgate.gateway.replicas import Fleet, MembershipSource, Replica, file_path
from lockgate.httpguard import key_entries, key_env, parse_api_keys
from lockgate.httpserver import uvicorn_config
from lockgate.server_config import CorsConfig, ServerConfig

log = logging.getLogger("lockgate.gateway")

DEFAULT_BLOCK_SIZE = {"character": 128, "model": 16}


@dataclass(frozen=True)
class RoutingConfig:
    """Routing knobs shared by ``lockgate gateway`` and ``lockgate serve --dp``."""

    # forecast is the default: on the sim fleet (docs/performance.md, "What features cost") it matched or beat
    # prefix-cache on every workload and fleet size, and it falls back to prefix-cache's affinity and
    # least-request's balance where the replicas report no forecast
    policy: str = option("forecast", "routing policy", choices=list(POLICIES))
    prefix_tokenizer: str = option("character", "prefix keys (prefix-cache, forecast): 'character' (the prompt text) or 'model' "
                                   "(the served model's token ids after its chat template)",
                                   choices=["character", "model"])
    prefix_block_size: int | None = option(None, "keys per hashed prefix block (default: 128 for character, "
                                           "16 for model)")
    prefix_block_number: int = option(200_000, "most prefix blocks remembered (LRU)")
    imbalance_abs_count: int = option(16, "max - min replica load above which the least loaded replica wins "
                                      "over cache affinity")
    std_dev_factor: float = option(2.0, "a matching replica is acceptable while its load <= mean + factor x stddev")
    forecast_work_weight: float = option(1.0, "forecast: weight of the prefill a choice adds beyond the best cached "
                                         "replica's, on top of the request's own estimated time to first token")
    max_attempts: int = option(3, "replicas a request is tried on at most (a refused connection, a dropped one "
                               "before any answer, a 503 or a 429 moves it to the next)")
    health_interval: float = option(2.0, "seconds between replica health checks")
    routing_seed: int = option(0, "seed of random / power-of-two choices and tie breaks")

    def __post_init__(self) -> None:
        if self.prefix_block_size is not None and self.prefix_block_size < 1:
            raise ValueError(f"--prefix-block-size must be >= 1, got {self.prefix_block_size}")
        if self.prefix_block_number < 1:
            raise ValueError(f"--prefix-block-number must be >= 1, got {self.prefix_block_number}")
        if self.imbalance_abs_count < 0:
            raise ValueError(f"--imbalance-abs-count must be >= 0, got {self.imbalance_abs_count}")
        if not (math.isfinite(self.std_dev_factor) and self.std_dev_factor >= 0):
            raise ValueError(f"--std-dev-factor must be a finite number >= 0, got {self.std_dev_factor}")
        if not (math.isfinite(self.forecast_work_weight) and self.forecast_work_weight >= 0):
            raise ValueError(f"--forecast-work-weight must be a finite number >= 0, got {self.forecast_work_weight}")
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if not (math.isfinite(self.health_interval) and self.health_interval > 0):
            raise ValueError(f"--health-interval must be a finite number of seconds > 0, got {self.health_interval}")

    @property
    def block_size(self) -> int:
        return self.prefix_block_size or DEFAULT_BLOCK_SIZE[self.prefix_tokenizer]


@dataclass(frozen=True)
class RoutingFlags:
    """Flag container for ``add_config_args(parser, RoutingFlags)``."""

    routing: RoutingConfig = dataclasses.field(default_factory=RoutingConfig)


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    from lockgate.config import add_config_args
    from lockgate.server_config import CorsFlags

    g = p.add_argument_group("gateway")
    g.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="engine replica base URL, e.g. http://127.0.0.1:8001 (repeatable)")
    g.add_argument("--replicas-file", default=None, metavar="PATH",
                   help="file with one replica URL per line ('#' comments); re-read when it changes")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--model", default="default", help="model whose tokenizer --prefix-tokenizer model uses")
    g.add_argument("--api-key", action="append", default=[], help="require 'Authorization: Bearer KEY' on every "
                   "route but /health (NAME=KEY names the key's tenant; repeatable); the client's key goes on to the "
                   "replica, which must accept it (default: $LOCKGATE_API_KEY, one entry per line)")
    g.add_argument("--api-key-file", default=None, help="more API keys, one NAME=KEY (or KEY) per line")
    g.add_argument("--max-request-bytes", default="16MiB", help="largest request body accepted (413 beyond it)")
    g.add_argument("--http-header-timeout", type=float, default=10.0, help="seconds a client has to send a "
                   "request's headers, from connecting or from its previous response; a slower connection is closed")
    g.add_argument("--http-keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--http-body-timeout", type=float, default=60.0,
                   help="seconds a client has to send a request's body once its headers arrived")
    g.add_argument("--http-max-connections", type=int, default=0, help="connections (or requests) served at "
                   "once; more get a 503 at once (0: half the open-file limit, raised to its hard limit)")
    add_config_args(p, RoutingFlags)
    add_config_args(p, CorsFlags)


def routing_from_args(ns: argparse.Namespace) -> RoutingConfig:
    return RoutingConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RoutingConfig)})


def _load_tokenizer(model: str):  # type: ignore[no-untyped-def]
    from lockgate.checkpoint.loader import prepare_model_dir
    from lockgate.tokenizer.tokenizer import load_tokenizer

    return load_tokenizer(model, None if model == "sim" else prepare_model_dir(model))


def build_gateway(urls: list[str], replicas_file: str | None, routing: RoutingConfig, model: str,
                  api_key: str | Sequence[str] | None = None, max_request_bytes: str = "16MiB",
                  source: MembershipSource | None = None, api_key_file: str | None = None) -> Gateway:
    """Validate everything and build the gateway (raises ValueError naming the bad flag); ``source``:
    where more replicas come from (``serve --ray``)."""
    try:
        body_limit = parse_size(max_request_bytes)
    except ValueError as e:
        raise ValueError(f"--max-request-bytes: {e}") from None
    if body_limit < 1024:
        raise ValueError(f"--max-request-bytes must be at least 1KiB, got {max_request_bytes}")
    entries = key_entries([api_key] if isinstance(api_key, str) else (api_key or ()), api_key_file)
    keys = parse_api_keys(entries) or None
    metrics = GatewayMetrics()
    router = Router(routing.policy, block_number=routing.prefix_block_number,
                    imbalance_abs_count=routing.imbalance_abs_count, std_dev_factor=routing.std_dev_factor,
                    seed=routing.routing_seed, work_weight=routing.forecast_work_weight)
    def on_health(replica: Replica, healthy: bool) -> None:
        metrics.health(replica.url, healthy)
        if not healthy:
            router.forget(replica.url)  # it may come back restarted, with a cold cache

    def on_removed(url: str) -> None:
        router.forget(url)
        metrics.forget(url)

    fleet = Fleet(urls, file_path(replicas_file), health_interval=routing.health_interval, on_health=on_health,
                  on_removed=on_removed, api_key=next(iter(keys)) if keys else None, source=source)
    tokenizer = None
    if routing.policy in PREFIX_POLICIES and routing.prefix_tokenizer == "model":
        t0 = time.perf_counter()
        tokenizer = _load_tokenizer(model)
        log.info("prefix keys: %s tokenizer loaded in %.1fs", model, time.perf_counter() - t0)
    return Gateway(fleet=fleet, router=router, metrics=metrics, block_size=routing.block_size, tokenizer=tokenizer,
                   api_key=keys, max_request_bytes=body_limit, max_attempts=routing.max_attempts)


def run_gateway(gw: Gateway, host: str, port: int, log_level: str, grace: float = 10.0,
                on_stop: Callable[[], None] | None = None, on_app: Callable[[FastAPI], None] | None = None,
                header_timeout: float = 10.0, keep_alive_timeout: float = 5.0, body_timeout: float = 60.0,
                max_connections: int = 0, cors: CorsConfig | None = None) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean stop, 1 if uvicorn could not start. On the signal,
    ``on_stop`` runs at once (``serve --dp`` stops its replicas then, so their own shutdown grace and
    its final events reach the clients through the gateway), and open responses get ``grace``
    seconds to end before uvicorn cancels them."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per proxied request otherwise
    app = create_gateway_app(gw, cors.middleware_options() if cors is not None else None)
    if on_app is not None:  # e.g. serve --ray's admin routes
        on_app(app)
    config = uvicorn_config(app, host, port, log_level, header_timeout=header_timeout,
                            keep_alive_timeout=keep_alive_timeout, graceful_timeout=grace, body_timeout=body_timeout,
                            max_connections=max_connections)
    server = uvicorn.Server(config)
    log.info("gateway on http://%s:%d, policy %s, %d replicas", host, port, gw.router.policy,
             len(gw.fleet.replicas))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: None)  # uvicorn installs its own while serving; after it, stay alive

    async def main() -> None:
        async def watch() -> None:
            while not server.should_exit:
                await asyncio.sleep(0.05)
            if on_stop is not None:
                on_stop()

        watcher = asyncio.create_task(watch())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    asyncio.run(main())
    return 0 if server.started else 1


def gateway_main(ns: argparse.Namespace) -> int:
    from lockgate.server_config import cors_from_args

    try:
        routing = routing_from_args(ns)
        cors = cors_from_args(ns)
        if not 0 <= ns.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {ns.port}")
        for flag, v in (("--http-header-timeout", ns.http_header_timeout),
                        ("--http-keep-alive-timeout", ns.http_keep_alive_timeout),
                        ("--http-body-timeout", ns.http_body_timeout)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{flag} must be > 0 seconds, got {v}")
        if ns.http_max_connections < 0:
            raise ValueError(f"--http-max-connections must be >= 0, got {ns.http_max_connections}")
        gw = build_gateway(ns.replica, ns.replicas_file, routing, ns.model, ns.api_key, ns.max_request_bytes,
                           api_key_file=ns.api_key_file)
    except ValueError as e:
        print(f"lockgate: error: {e}", file=sys.stderr)
        return 2
    return run_gateway(gw, ns.host, ns.port, ns.log_level, header_timeout=ns.http_header_timeout,
                       keep_alive_timeout=ns.http_keep_alive_timeout, body_timeout=ns.http_body_timeout,
                       max_connections=ns.http_max_connections, cors=cors)


# ---- serve --dp N ------------------------------------------------------------------------
def replica_threads(engine: EngineConfig, dp: int) -> int:
    if engine.model.num_threads is not None:
        return engine.model.num_threads
    return max(1, (os.cpu_count() or 1) // dp)


def serve_dp(engine: EngineConfig, server: ServerConfig, routing: RoutingConfig, log_level: str,
             cors: CorsConfig | None = None) -> int:
    """N replicas on ports ``port+1 .. port+N`` and the gateway on ``port`` (CORS is the gateway's: the
    replicas, on loopback, get none); see the module docstring."""
    dp = server.dp
    if server.port == 0 or server.port + dp > 65535:
        print(f"lockgate: error: --dp {dp} needs --port P with P >= 1 and P + {dp} <= 65535 (replicas use "
              "the ports after it)", file=sys.stderr)
        return 2
    threads = replica_threads(engine, dp)
    replica_engine = dataclasses.replace(engine, model=dataclasses.replace(engine.model, num_threads=threads))
    stopping = threading.Event()
    urls = [f"http://127.0.0.1:{server.port + i}" for i in range(1, dp + 1)]
    try:
        gw = build_gateway(urls, None, routing, engine.model.model, server.api_key,
                           server.max_request_bytes or "16MiB", api_key_file=server.api_key_file)
    except ValueError as e:
        print(f"lockgate: error: {e}", file=sys.stderr)
        return 2
    replicas: list[ReplicaProcess] = []
    try:
        for i, url in enumerate(urls, 1):
            port = server.port + i
            # replicas listen on loopback only (clients go through the gateway); the key goes by env, not argv
            def command(fd: int, port: int = port) -> list[str]:
                rserver = dataclasses.replace(server, host="127.0.0.1", port=port, dp=1, api_key=(),
                                              api_key_file=None, listen_fd=fd)
                return [sys.executable, "-m", "lockgate.cli", "serve", "--log-level", log_level,
                        *config_to_args(replica_engine), *config_to_args(rserver, ServerConfig)]
            env = {**os.environ, **key_env(server.api_key, server.api_key_file)}
            try:
                rep = ReplicaProcess(i, port, command, env, stopping, on_restart=gw.metrics.restarts.labels(url).inc)
            except OSError as e:
                print(f"lockgate: error: replica {i} of --dp {dp} needs port {port} (--port + {i}), which is not "
                      f"free: {e.strerror}", file=sys.stderr)
                return 2
            replicas.append(rep)
        for i, rep in enumerate(replicas, 1):
            rep.start()
            log.info("started replica %d/%d on port %d (pid %d, %d torch threads)", i, dp, rep.port,
                     rep.proc.pid, threads)
        def stop_replicas_now() -> None:  # the gateway got the signal: the replicas start their grace too
            stopping.set()
            _signal_replicas(replicas)

        # The gateway waits for the replicas' grace (their streams end with their own final events) and a bit.
        code = run_gateway(gw, server.host, server.port, log_level, grace=server.shutdown_timeout + 5.0,
                           on_stop=stop_replicas_now, header_timeout=server.http_header_timeout,
                           keep_alive_timeout=server.http_keep_alive_timeout, body_timeout=server.http_body_timeout,
                           max_connections=server.http_max_connections, cors=cors)
    finally:
        stopping.set()
        _stop_replicas(replicas, server.shutdown_timeout + 10.0)
    return code


class ReplicaProcess:
    """One ``lockgate serve`` replica of ``serve --dp``, restarted whenever it exits on its own with an
    error (exit code 0 is a clean stop, e.g. a signal to the process group: not restarted).

    The replica's port is reserved here: built, this object holds a socket bound to it (not
    listening, so a connection to a replica that is down is refused at once and the gateway retries it
    elsewhere); each replica process gets that socket's descriptor (``--listen-fd``) and listens on it.
    When the replica dies the socket is closed (what queued on it is refused) and the port bound
    again at once for the next start.

    Restarts back off exponentially (``RESTART_BACKOFF`` seconds, doubling to ``RESTART_BACKOFF_MAX``),
    and the backoff resets once a replica has run ``RESTART_RESET_AFTER`` seconds. Each restart is
    logged and counted (``lockgate:gateway_replica_restarts``); the gateway's health checks take the
    replica out of routing while it is down and back in once it answers (``/health`` says
    ``degraded`` meanwhile)."""

    RESTART_BACKOFF = 1.0
    RESTART_BACKOFF_MAX = 30.0
    RESTART_RESET_AFTER = 60.0

    def __init__(self, index: int, port: int, command: Callable[[int], list[str]], env: dict[str, str],
                 stopping: threading.Event, on_restart: Callable[[], None]) -> None:
        """``command(fd)`` is the replica's argv given its listening socket's descriptor. Raises
        ``OSError`` if ``port`` cannot be bound on 127.0.0.1."""
        self.index, self.port, self.command, self.env = index, port, command, env
        self.url = f"http://127.0.0.1:{port}"
        self.stopping = stopping
        self.on_restart = on_restart
        self.sock: socket.socket | None = reserve_port(port)
        self.proc: subprocess.Popen[bytes] = None  # type: ignore[assignment]  # set by start()
        self.lock = threading.Lock()  # start vs stop: a replica is never started after stop began

    def start(self) -> None:
        self.proc = self._spawn()
        threading.Thread(target=self._supervise, name=f"replica-{self.index}", daemon=True).start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        if self.sock is None:
            self.sock = reserve_port(self.port)  # OSError: the port was taken while the replica was down
        fd = self.sock.fileno()
        return subprocess.Popen(self.command(fd), env=self.env, pass_fds=(fd,))

    def release(self) -> None:
        """Close the reserved socket (the replica is down, or everything is stopping)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _supervise(self) -> None:
        backoff = self.RESTART_BACKOFF
        while True:
            began = time.monotonic()
            code = self.proc.wait()
            with self.lock:
                self.release()  # the replica listened on it: connections queued there are refused now
                if not self.stopping.is_set():
                    try:
                        self.sock = reserve_port(self.port)
                    except OSError as e:  # tried again at the restart
                        log.warning("replica %d: could not bind port %d again at once: %s", self.index, self.port, e)
            if self.stopping.is_set():
                return
            if code == 0:  # a clean stop (a signal sent to it, e.g. Ctrl-C to the process group): not a crash
                log.info("replica %d (%s, pid %d) stopped cleanly; not restarting it", self.index, self.url,
                         self.proc.pid)
                return
            if time.monotonic() - began >= self.RESTART_RESET_AFTER:
                backoff = self.RESTART_BACKOFF
            log.error("replica %d (%s, pid %d) exited unexpectedly with code %d; restarting it in %.0fs "
                      "(the gateway routes around it meanwhile)", self.index, self.url, self.proc.pid, code, backoff)
            while True:
                if self.stopping.wait(backoff):
                    return
                backoff = min(backoff * 2, self.RESTART_BACKOFF_MAX)
                with self.lock:
                    if self.stopping.is_set():
                        return
                    try:
                        self.proc = self._spawn()
                        break
                    except OSError as e:
                        log.error("replica %d: port %d is taken (%s); trying again in %.0fs", self.index,
                                  self.port, e.strerror, backoff)
            self.on_restart()
            log.info("replica %d restarted (pid %d)", self.index, self.proc.pid)


def reserve_port(port: int) -> socket.socket:
    """A TCP socket bound to 127.0.0.1:``port`` and not listening: the port is ours (no connect() picks it
    as its local port, no other bind gets it) and a connection to it is refused until a replica
    listens on it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past a dead replica's TIME_WAITs
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return sock


def _signal_replicas(replicas: list[ReplicaProcess]) -> list[subprocess.Popen[bytes]]:
    """SIGTERM to every live replica (each then finishes in-flight work within its grace)."""
    procs = []
    for r in replicas:
        with r.lock:  # no restart can slip in after this (``stopping`` is set)
            if r.proc is not None:  # None: never started (start-up failed before its turn)
                procs.append(r.proc)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    return procs


def _stop_replicas(replicas: list[ReplicaProcess], timeout: float) -> None:
    procs = _signal_replicas(replicas)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("replica pid %d did not stop in %.0fs; killing it", p.pid, timeout)
            p.kill()
            p.wait()
    for r in replicas:
        with r.lock:
            r.release()
    log.info("all %d replicas stopped", len(procs))
