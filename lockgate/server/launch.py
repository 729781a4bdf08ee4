"""``lockgate serve``: start the three processes, supervise them, stop them all.

Owns process start-up and shutdown. The API process is this one (FastAPI on uvicorn); it
starts the scheduler process (scheduler + model runner) and the detokenizer process as
``python -m`` children talking over ZeroMQ ``ipc://`` endpoints in a private temp directory.

Lifecycle:

* ``/health`` answers 503 until the scheduler has loaded the model and run a warm-up step
  and the detokenizer has loaded the tokenizer (a ``Ready`` message travels
  scheduler -> detokenizer -> API), then 200.
* SIGINT / SIGTERM: uvicorn stops accepting connections and gives in-flight requests up to
  ``--shutdown-timeout`` seconds; the rest end with finish reason ``abort`` and an error (a
  stream's last event says the server is shutting down; a whole response is a 503) and are
  aborted in the engine; then the children are told to shut
  down, waited for, and killed if they do not exit within a few seconds. Exit code 0. The
  children ignore SIGINT and SIGTERM, so a signal sent to the whole process group (Ctrl-C,
  ``kill -- -PGID``) stops the server the same way.
* A child that dies on its own (crash, kill, watchdog): a supervisor thread logs which one,
  its exit code and what that means, fails every in-flight request with an error, stops the
  server and kills the other child. Exit code 1.
* A child that stops answering without dying (SIGSTOP, a hang outside an engine step): once
  ready, each child sends a heartbeat every second; after ``--heartbeat-timeout`` seconds of
  silence the API process does the same as for a death, naming the silent process and its
  state (``/health`` answers 503 from then until the server is gone). Exit code 1. Children also exit by themselves when this
  process disappears (they watch their parent pid), so no orphans remain.

The scheduler process starts with glibc's malloc asked to put its large allocations on
transparent huge pages (``scheduler_env``): the packed weights and a step's activations are
hundreds of MB read every step, and on 4 KB pages their TLB misses cost a decode step of 32 rows
about 3%; the KV pool on them (faulted in at start, ``lockgate.runner.pool_memory``) makes decode
attention over long contexts faster (docs/performance.md, "What features cost").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import uvicorn

from lockgate.config import EngineConfig
from lockgate.httpguard import key_entries, parse_api_keys
from lockgate.httpserver import uvicorn_config
from lockgate.ipc.child import (
    DETOKENIZER_MODULE,
    SCHEDULER_MODULE,
    TENSOR_PARALLEL_EXIT_CODE,
    WATCHDOG_EXIT_CODE,
    DetokProcArgs,
    SchedulerProcArgs,
)
from lockgate.server_config import CorsConfig, ServerConfig

if TYPE_CHECKING:
    from lockgate.server.frontend import EngineClient

log = logging.getLogger("lockgate.server")

CHILD_STOP_SECONDS = 5.0


@dataclass
class Endpoints:
    scheduler: str
    detokenizer: str
    api: str

    @staticmethod
    def in_dir(d: str) -> Endpoints:
        return Endpoints(f"ipc://{d}/scheduler", f"ipc://{d}/detokenizer", f"ipc://{d}/api")


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"  # malloc madvises its mmap'd chunks MADV_HUGEPAGE


def scheduler_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What the scheduler process's environment adds to ``environ``: ``GLIBC_TUNABLES`` with
    ``glibc.malloc.hugetlb=1`` (glibc 2.35+: malloc's mmap'd chunks advised onto transparent huge
    pages; older glibc and kernels with THP off ignore it), appended to the user's tunables unless
    they already set ``glibc.malloc.hugetlb`` themselves (``=0`` opts out)."""
    current = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return {}
    return {"GLIBC_TUNABLES": f"{current}:{HUGE_PAGES_TUNABLE}" if current else HUGE_PAGES_TUNABLE}


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    expected_exit: bool = False


@dataclass
class Supervisor:
    """Watches the children; ``on_death(name, message)`` runs (in a thread) if one dies unexpectedly."""

    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    died: str | None = None

    def start(self, name: str, module: str, args: msgspec.Struct, env: dict[str, str] | None = None) -> Child:
        cmd = [sys.executable, "-m", module, msgspec.json.encode(args).decode()]
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
        child = Child(name, proc)
        self.children.append(child)
        log.info("started %s process, pid %d", name, proc.pid)
        return child

    def watch(self, on_death: object) -> None:
        for c in self.children:
            threading.Thread(target=self._wait, args=(c, on_death), name=f"watch-{c.name}", daemon=True).start()

    def _wait(self, c: Child, on_death: object) -> None:
        code = c.proc.wait()
        if self.stopping or self.died is not None:
            return  # we are stopping it (or another child's death already took the server down)
        why = describe_exit(code)
        message = f"{c.name} process (pid {c.proc.pid}) exited unexpectedly with {why}"
        log.error("%s; shutting the server down", message)
        if self.died is None:
            self.died = message
            assert callable(on_death)
            on_death(c.name, message)

    def stop(self) -> None:
        """Children should be exiting (Shutdown sent); wait, then terminate, then kill."""
        self.stopping = True
        deadline = time.monotonic() + CHILD_STOP_SECONDS
        for c in self.children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s process (pid %d) did not exit; killing it", c.name, c.proc.pid)
                c.proc.kill()  # children ignore SIGTERM (see their main); KILL is the fallback
                c.proc.wait()
        log.info("all child processes have exited")


def describe_exit(code: int) -> str:
    if code == WATCHDOG_EXIT_CODE:
        return f"code {code} (watchdog: an engine step exceeded --watchdog-timeout)"
    if code == TENSOR_PARALLEL_EXIT_CODE:
        return f"code {code} (a tensor-parallel rank died: the scheduler's log names it)"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def serve(engine: EngineConfig, server: ServerConfig, log_level: str = "INFO", cors: CorsConfig | None = None) -> int:
    """Run the server until a signal or a child's death; return the process exit code."""
    from lockgate.server.app import create_app
    from lockgate.server.frontend import EngineClient
    from lockgate.server.metrics import Metrics
    from lockgate.server.tenants import Tenants

    t_start = time.monotonic()
    listen: list[socket.socket] | None = None
    if server.listen_fd is not None:
        try:
            listen = [inherited_socket(server.listen_fd)]
        except ValueError as e:
            print(f"lockgate: error: {e}", file=sys.stderr)
            return 2
    try:
        api_key = parse_api_keys(key_entries(server.api_key, server.api_key_file)) or None
    except ValueError as e:
        print(f"lockgate: error: {e}", file=sys.stderr)
        return 2
    name = server.model_name(engine.model.model)
    tmp = tempfile.mkdtemp(prefix="lockgate-")
    ep = Endpoints.in_dir(tmp)
    sup = Supervisor()
    exit_code = 0
    uv_server: uvicorn.Server | None = None
    loop_ref: dict[str, asyncio.AbstractEventLoop] = {}

    def on_death(child: str, message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        loop = loop_ref.get("loop")
        if loop is not None and client is not None:
            loop.call_soon_threadsafe(client.fail, message)
        if uv_server is not None:
            uv_server.should_exit = True
        for c in sup.children:
            if c.proc.poll() is None:
                c.proc.kill()

    def on_unresponsive(child: str, message: str) -> None:
        if sup.died is None:
            sup.died = message  # the watcher threads then stay quiet about the kill below
            on_death(child, message)

    client: EngineClient | None = None
    try:
        sup.start("scheduler", SCHEDULER_MODULE, SchedulerProcArgs(
            engine=engine, model_name=name, in_endpoint=ep.scheduler, detok_endpoint=ep.detokenizer,
            watchdog_timeout=server.watchdog_timeout, decode_log_interval=server.decode_log_interval,
            parent_pid=os.getpid(), log_level=log_level, warmup=not server.skip_server_warmup),
            env=scheduler_env(os.environ))
        sup.start("detokenizer", DETOKENIZER_MODULE, DetokProcArgs(
            model=engine.model.model, in_endpoint=ep.detokenizer, api_endpoint=ep.api,
            scheduler_endpoint=ep.scheduler, parent_pid=os.getpid(), log_level=log_level))

        metrics = Metrics(name, engine)

        async def main() -> None:
            nonlocal client, uv_server
            loop_ref["loop"] = asyncio.get_running_loop()
            client = EngineClient(name, engine.model.model, ep.scheduler, ep.api, metrics,
                                  heartbeat_timeout=server.heartbeat_timeout, on_unresponsive=on_unresponsive,
                                  chat_template=engine.model.chat_template)
            # the children's exits from here on are the shutdown's, not deaths to report
            known = [*(n for n in (api_key or {}).values() if n), *engine.scheduler.tenant_weights]
            app = create_app(client, server, api_key, metrics, on_stopping=lambda: setattr(sup, "stopping", True),
                             tenants=Tenants(known), cors=cors)
            config = uvicorn_config(app, server.host, server.port, log_level,
                                    header_timeout=server.http_header_timeout,
                                    keep_alive_timeout=server.http_keep_alive_timeout,
                                    graceful_timeout=server.shutdown_timeout, body_timeout=server.http_body_timeout,
                                    max_connections=server.http_max_connections)
            uv_server = uvicorn.Server(config)
            cutter = asyncio.create_task(cut_at_grace_end(uv_server, client, server.shutdown_timeout))
            announcer = asyncio.create_task(announce(uv_server, client, server.host, t_start))
            sup.watch(on_death)
            if sup.died is not None:  # died before we were watching
                client.fail(sup.died)
                return
            try:
                await uv_server.serve(sockets=listen)
            finally:
                cutter.cancel()
                announcer.cancel()

        # Our own no-op handlers: uvicorn re-raises a captured signal after its graceful
        # shutdown; landing here lets us stop the children and exit 0 instead of dying.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, f: None)
        asyncio.run(main())
        if uv_server is not None and not uv_server.started and sup.died is None and exit_code == 0:
            exit_code = 1  # uvicorn could not start (port in use, ...); it logged why
    finally:
        sup.stop()  # the app's lifespan sent Shutdown to the scheduler (which tells the detokenizer)
        shutil.rmtree(tmp, ignore_errors=True)
    if sup.died is not None:
        exit_code = 1
    log.info("server stopped (exit code %d)", exit_code)
    return exit_code


def inherited_socket(fd: int) -> socket.socket:
    """The TCP socket behind ``--listen-fd`` (bound by the parent; uvicorn makes it listen)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise ValueError(f"--listen-fd {fd} is not an open socket ({e.strerror})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise ValueError(f"--listen-fd {fd} is not a TCP socket")
    return sock


def bound_url(uv: uvicorn.Server, host: str) -> str:
    """``http://HOST:PORT`` of the socket uvicorn listens on (the port it got, also for port 0 or
    ``--listen-fd``)."""
    for srv in getattr(uv, "servers", []):
        for sock in srv.sockets:
            addr = sock.getsockname()
            h = host if sock.family != socket.AF_INET6 else f"[{addr[0]}]"
            return f"http://{h}:{addr[1]}"
    return f"http://{host}"


async def announce(uv: uvicorn.Server, client: EngineClient, host: str, t_start: float) -> None:
    """Say when the socket is open that ``/health`` answers 503 until the model is loaded, and once
    the engine is ready (the moment ``/health`` turns 200) one ``lockgate ready:`` line with the URL."""
    while not uv.started:
        await asyncio.sleep(0.05)
    url = bound_url(uv, host)
    if not client.ready.is_set():
        log.info("listening on %s; /health answers 503 until the model is loaded and warmed up (progress "
                 "below)", url)
    await client.ready.wait()
    info = client.info
    what = "" if info is None else (f" (model {info.model}, {info.dtype}, context {info.max_model_len} tokens, "
                                    f"KV capacity {info.capacity} tokens as {info.kv_cache_dtype})")
    log.info("lockgate ready: %s%s; /health answers 200 (%.1fs after start)", url, what, time.monotonic() - t_start)


GRACE_MARGIN_SECONDS = 0.5  # before uvicorn cancels what is left, so the last events still get written


async def cut_at_grace_end(uv: uvicorn.Server, client: EngineClient, grace: float) -> None:
    """Once a shutdown begins, wait out the grace (less a margin), then end what is still running
    with finish reason ``abort`` and an error event, instead of letting uvicorn drop the connections."""
    while not uv.should_exit:
        await asyncio.sleep(0.1)
    await asyncio.sleep(max(0.0, grace - GRACE_MARGIN_SECONDS))
    n = client.cut_all(f"the server is shutting down: the request did not finish within --shutdown-timeout {grace:g}s")
    if n:
        log.warning("shutdown grace over: ended %d unfinished requests with an error", n)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from lockgate.config import add_config_args
    from lockgate.server_config import CorsFlags, ServerFlags

    add_config_args(p)
    add_config_args(p, ServerFlags)
    add_config_args(p, CorsFlags)
