"""Engine replicas as Ray actors: ``lockgate serve --ray --replicas N [--replica-cpus K] [--ray-address A]``.

Owns two things:

* ``ReplicaServer``, the actor: on whatever node Ray places it (``SPREAD`` over the cluster's nodes,
  ``--replica-cpus`` CPUs reserved), it starts an ordinary ``lockgate serve`` process on that node's
  address and a free port, and watches it. If the server exits on its own, the actor exits too and
  Ray restarts it (``max_restarts=-1``): a new server, on a new port. If the actor's process dies,
  the kernel sends its server SIGTERM (``PR_SET_PDEATHSIG``), so no server outlives its actor, and
  Ray restarts the actor. ``drain`` stops the server with SIGTERM, which lets its in-flight requests
  finish (``--shutdown-timeout``) before it exits.
* ``RayFleet``, in the gateway's process (the Ray driver): the list of actors, the wanted count
  (``scale``: add replicas, or drain the newest ones), and ``urls``, the gateway's membership
  source: the URL of every replica that answers, not draining. A replica that is being restarted
  does not answer for a moment and is left out of the fleet until it does; the gateway's health
  checks then decide when it takes traffic again (cold: the gateway forgets its cached prefixes).

Draining: a replica leaving (``scale`` down, ``shutdown``) is first left out of ``urls`` (the
gateway sends it nothing new at its next membership poll), then, after ``drain_delay`` seconds,
its server gets SIGTERM and finishes what it is running, and only then is the actor killed.

Invariants: ``urls`` never lists a draining replica; every actor this fleet started is either
listed in ``members`` or has been killed; the gateway's own process never runs an engine.

Without ``--ray-address`` the fleet starts a local cluster private to this process (``private_ray_dir``:
its own temp directory and ``address="local"``), which ``ray.shutdown()`` stops when the server exits.

Addresses: a replica listens on its node's IP as Ray sees it, and the gateway (or anything routing to
it) must reach that address. On one machine, start Ray on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
makes Ray use 127.0.0.1; the tests do this).
"""

from __future__ import annotations

import asyncio
import ctypes
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
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("lockgate.fleet")

NAMESPACE = "lockgate"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the server's process before exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the actor's own exit still stops the server in the usual cases
        pass


RAY_DIR_PREFIX = "lockgate-ray-"


def private_ray_dir(base: str | None = None) -> str:
    """A new temp directory for a local Ray cluster of this process's own (``ray.init(address="local",
    _temp_dir=...)``): a new cluster, never whatever ``/tmp/ray/ray_current_cluster`` names, so a
    cluster left by a server that was killed hard cannot stop this one from starting. Directories
    of earlier servers whose process is gone are removed first (a ``kill -9`` leaves its directory)."""
    base = base or tempfile.gettempdir()
    for entry in os.listdir(base):
        if not entry.startswith(RAY_DIR_PREFIX):
            continue
        pid = entry[len(RAY_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(base, entry), ignore_errors=True)
    # short: Ray puts unix sockets under it, and a socket path has at most 107 bytes
    return tempfile.mkdtemp(prefix=f"{RAY_DIR_PREFIX}{os.getpid()}-", dir=base)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ReplicaServer:
    """A Ray actor (wrapped with ``ray.remote`` by ``RayFleet``) owning one ``lockgate serve`` process."""

    def __init__(self, serve_args: list[str], env: dict[str, str]) -> None:
        import ray

        self.host = ray.util.get_node_ip_address()
        self.port = _free_port(self.host)
        cmd = [sys.executable, "-m", "lockgate.cli", "serve", *serve_args, "--host", self.host, "--port", str(self.port)]
        self.stopping = False
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=_die_with_parent)
        threading.Thread(target=self._watch, daemon=True, name="lockgate-replica-watch").start()

    def _watch(self) -> None:
        rc = self.proc.wait()
        if not self.stopping:  # the server died on its own: so does the actor, and Ray restarts both
            print(f"lockgate replica server pid {self.proc.pid} exited with {rc}; restarting the actor",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def info(self) -> dict[str, Any]:
        return {"url": f"http://{self.host}:{self.port}", "pid": self.proc.pid, "actor_pid": os.getpid(),
                "node": self.host, "started": self.started, "running": self.proc.poll() is None}

    def drain(self, grace: float) -> int | None:
        """SIGTERM the server (it finishes its in-flight requests within its --shutdown-timeout) and
        wait up to ``grace`` seconds; the exit code, or None if it had to be killed."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode


@dataclass
class Member:
    index: int
    handle: Any  # ray.actor.ActorHandle
    draining: bool = False
    url: str | None = None  # the last URL it answered with
    info: dict[str, Any] | None = None


class RayFleet:
    """The replicas of one ``serve --ray``: start, scale, drain and list them (see the module docstring)."""

    def __init__(self, serve_args: list[str], *, replicas: int, replica_cpus: float, address: str | None = None,
                 env: dict[str, str] | None = None, drain_delay: float = 3.0, grace: float = 20.0,
                 info_timeout: float = 2.0) -> None:
        import ray

        self._ray = ray
        self.temp_dir: str | None = None  # a private local cluster's (removed by shutdown)
        if not ray.is_initialized():
            if address:
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
            else:
                self.temp_dir = private_ray_dir()
                ray.init(address="local", _temp_dir=self.temp_dir, namespace=NAMESPACE, log_to_driver=False,
                         include_dashboard=False, object_store_memory=128 * 1024 * 1024)
        self.serve_args = serve_args
        self.env = env or {}
        self.replica_cpus = replica_cpus
        self.drain_delay, self.grace, self.info_timeout = drain_delay, grace, info_timeout
        self._actor = ray.remote(ReplicaServer).options(  # type: ignore[attr-defined]
            num_cpus=replica_cpus, max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD")
        self.members: list[Member] = []
        self._next = 0
        self._lock = threading.Lock()
        self._draining: list[threading.Thread] = []
        self.scale(replicas)

    @property
    def wanted(self) -> int:
        return sum(not m.draining for m in self.members)

    def scale(self, n: int) -> None:
        """Make ``n`` replicas serve: start new ones, or drain the newest beyond ``n``."""
        if n < 0:
            raise ValueError(f"replicas must be >= 0, got {n}")
        with self._lock:
            live = [m for m in self.members if not m.draining]
            for _ in range(n - len(live)):
                handle = self._actor.remote(self.serve_args, self.env)
                self.members.append(Member(self._next, handle))
                log.info("replica %d: actor started", self._next)
                self._next += 1
            for m in live[n:][::-1] if n < len(live) else []:
                m.draining = True
                t = threading.Thread(target=self._drain, args=(m,), daemon=True, name=f"lockgate-drain-{m.index}")
                self._draining.append(t)
                t.start()

    def _drain(self, m: Member) -> None:
        time.sleep(self.drain_delay)  # the gateway's next membership poll stops sending it anything
        log.info("replica %d (%s): draining", m.index, m.url)
        try:
            self._ray.get(m.handle.drain.remote(self.grace), timeout=self.grace + 10)
        except Exception as e:  # noqa: BLE001 (a dead actor has nothing left to drain)
            log.warning("replica %d: drain: %s", m.index, e)
        self._ray.kill(m.handle, no_restart=True)
        with self._lock:
            self.members = [x for x in self.members if x is not m]
        log.info("replica %d: stopped", m.index)

    async def urls(self) -> list[str]:
        """The URLs of the replicas that answer now and are not draining (the gateway's membership)."""
        members = [m for m in self.members if not m.draining]

        async def ask(m: Member) -> str | None:
            try:
                info = await asyncio.wait_for(m.handle.info.remote(), self.info_timeout)
            except Exception:  # noqa: BLE001 (restarting, or placed on a node still coming up)
                return None
            m.info, m.url = info, info["url"]
            return str(info["url"])

        got = await asyncio.gather(*(ask(m) for m in members))
        return [u for u in got if u is not None]

    def describe(self) -> list[dict[str, Any]]:
        return [{"index": m.index, "draining": m.draining, "url": m.url, **(m.info or {})} for m in self.members]

    def shutdown(self) -> None:
        """Drain every replica at once (each finishes its in-flight requests), then kill the actors."""
        self.drain_delay = 0.0
        self.scale(0)
        for t in list(self._draining):
            t.join(self.grace + 15)
