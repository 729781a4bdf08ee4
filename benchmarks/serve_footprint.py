"""What serving a model costs before the first request: start time, memory, disk.

    .venv/bin/python benchmarks/serve_footprint.py --model /work/synth/l1b-q4_0.gguf [--kv-cache-memory 1GiB]
        [--fresh-cache] [--starts 2] [-- more serve flags]

Starts ``lockgate serve`` ``--starts`` times in a row (the first with an empty cache directory when
``--fresh-cache``: the conversion, the kernels' tuning; later ones find both cached), and for each
prints one JSON line: seconds until ``/health`` answers 200, the resident memory of every process
of the server (API, scheduler, detokenizer, grammar workers) summed and by process, the KV pool's
bytes (from the scheduler's log), the model file's size, the on-disk cache the start added, and the
issue-49 bound ``1.15 x file + KV pool + 400 MB`` beside the measured total. The machine (CPU model
and flags) is in every line. Servers bind 127.0.0.1 on a free port and are stopped by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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


def cpu() -> dict[str, str]:
    info = Path("/proc/cpuinfo").read_text()
    name = re.search(r"model name\s*:\s*(.*)", info)
    flags = re.search(r"flags\s*:\s*(.*)", info)
    notable = [f for f in (flags.group(1).split() if flags else []) if f in (
        "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "avx_vnni")]
    return {"cpu": name.group(1).strip() if name else "?", "flags": " ".join(notable), "cores": str(os.cpu_count())}


def tree(pid: int) -> list[int]:
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parent[int(d)] = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = {pid}, {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return sorted(found)


def rss(pid: int) -> tuple[str, int]:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?", 0
    kb = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) if "VmRSS" in status else 0  # type: ignore[union-attr]
    module = next((c.decode() for c in cmd if c.startswith(b"lockgate.") and b"." in c), "api")
    return module.removeprefix("lockgate."), kb * 1024


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.exists() else 0


def one_start(args: argparse.Namespace, cache: Path, extra: list[str]) -> dict[str, object]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="footprint-", suffix=".log", delete=False)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LOCKGATE_CACHE_DIR": str(cache)}
    before = dir_bytes(cache)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "lockgate.cli", "serve", "--model", args.model, "--host",
                             "127.0.0.1", "--port", str(port), "--kv-cache-memory", args.kv_cache_memory, *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {Path(log.name).read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > args.timeout:
                raise TimeoutError(f"not ready in {args.timeout} s")
            time.sleep(0.25)
        ready = time.monotonic() - t0
        time.sleep(args.settle)
        by_process: dict[str, int] = {}
        for pid in tree(proc.pid):
            name, b = rss(pid)
            by_process[name] = by_process.get(name, 0) + b
        text = Path(log.name).read_text()
        pool = re.search(r"KV pool: (\d+) tokens x (\d+) bytes", text)
        pool_bytes = int(pool.group(1)) * int(pool.group(2)) if pool else 0
        file_bytes = Path(args.model).stat().st_size if Path(args.model).is_file() else 0
        total = sum(by_process.values())
        bound = 1.15 * file_bytes + pool_bytes + 400e6
        return {"ready_s": round(ready, 1), "rss_total": total, "rss_by_process": by_process,
                "kv_pool_bytes": pool_bytes, "file_bytes": file_bytes, "cache_added_bytes": dir_bytes(cache) - before,
                "bound_bytes": int(bound), "within_bound": total <= bound, **cpu(), "model": args.model}
    finally:
        for pid in reversed(tree(proc.pid)):
            try:
                os.kill(pid, signal.SIGTERM if pid == proc.pid else signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log.name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--fresh-cache", action="store_true", help="start with an empty cache directory (kernels copied)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds after /health before memory is read")
    p.add_argument("--timeout", type=float, default=900.0)
    args, extra = p.parse_known_args()
    extra = [e for e in extra if e != "--"]
    home = Path(os.environ.get("LOCKGATE_CACHE_DIR", Path.home() / ".cache" / "lockgate"))
    cache = home
    if args.fresh_cache:
        cache = Path(tempfile.mkdtemp(prefix="footprint-cache-"))
        if (home / "kernels").is_dir():  # the kernels' build is not what is measured
            shutil.copytree(home / "kernels", cache / "kernels")
    try:
        for i in range(args.starts):
            print(json.dumps({"start": i + 1, **one_start(args, cache, extra)}), flush=True)
    finally:
        if args.fresh_cache:
            shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
