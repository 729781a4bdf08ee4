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
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="lockgate-test-server-", suffix=".log")[1])
        self._log = self.log_path.open("wb")
        cmd = [sys.executable, "-m", "lockgate.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> dict[str, int]:
        return {m[0]: int(m[1]) for m in re.findall(r"started (\w+) process, pid (\d+)", self.log())}

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
