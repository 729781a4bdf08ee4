"""Start a real ``lockgate serve`` in a subprocess on a free loopback port; always stop it by pid."""

from __future__ import annotations

import atexit
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(ports: range) -> bool:
    socks = []
    try:
        for p in ports:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", p))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port_run(n: int = 1) -> int:
    """A port P such that P .. P+n-1 are all free now (for ``serve --dp``, which uses consecutive ports).

    Picked above the kernel's ephemeral range where there is room: a port the kernel hands out to
    outgoing connections can be taken by any connection (another test's client, a server's own
    keep-alive) between this probe and the server's bind; a port outside that range only by a bind."""
    lo, hi = _ephemeral_range()
    rng = random.Random()
    outside = [r for r in ((1024, lo - n), (hi + 1, 65536 - n)) if r[1] - r[0] >= 256]
    for _ in range(200):
        if outside:
            a, b = rng.choice(outside)
            base = rng.randrange(a, b)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = int(s.getsockname()[1])
            if base + n > 65536:
                continue
        if _bindable(range(base, base + n)):
            return base
    raise RuntimeError(f"no run of {n} free ports found")


def free_port() -> int:
    return free_port_run(1)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class ServerProc:
    def __init__(self, *args: str, env: dict[str, str] | None = None, command: str = "serve",
                 port: int | None = None, warmup: bool = False) -> None:
        """``warmup``: let ``serve`` run its warm-up steps (the tests' servers skip them by default,
        ``--skip-server-warmup``: ~7 CPU-seconds of a real model's start that only first-request latency needs)."""
        if command == "serve" and not warmup:
            args = (*args, "--skip-server-warmup")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="lockgate-test-server-", suffix=".log")[1])
        if not os.environ.get("LOCKGATE_KEEP_TEST_LOGS"):  # tests read it after stop(): gone when pytest exits
            atexit.register(self.log_path.unlink, missing_ok=True)
        self._log = self.log_path.open("wb")
        cmd = [sys.executable, "-m", "lockgate.cli", command, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> dict[str, int]:
        """Every process this server started, by name (``scheduler``, ``replica1``, ``scheduler#2`` ...)."""
        log = self.log()
        found: dict[str, int] = {}
        started = [*re.findall(r"started (\w+) process, pid (\d+)", log),
                   *((f"replica{i}", pid) for i, pid in re.findall(r"started replica (\d+)/\d+ on port \d+ \(pid (\d+)",
                                                                log)),
                   *((f"replica{i}", pid) for i, pid in re.findall(r"replica (\d+) restarted \(pid (\d+)", log))]
        for name, pid in started:
            key, k = name, 1
            while key in found:
                k += 1
                key = f"{name}#{k}"
            found[key] = int(pid)
        return found

    def wait_ready(self, timeout: float = 120.0) -> ServerProc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()[-4000:]}")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL; children killed by pid if anything was left. Returns the exit code."""
        children = self.child_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in children.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self._log.close()
        return int(self.proc.returncode)

    def wait_children_gone(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(pid_alive(p) for p in self.child_pids().values()):
                return True
            time.sleep(0.1)
        return False
