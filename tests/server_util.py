"""Start a real ``lockgate serve`` in a subprocess on a free loopback port; always stop it by pid."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_run(n: int) -> int:
    """A port P such that P .. P+n-1 are all free now (for ``serve --dp``, which uses consecutive ports)."""
    for _ in range(100):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")


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
                 port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="lockgate-test-server-", suffix=".log")[1])
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
