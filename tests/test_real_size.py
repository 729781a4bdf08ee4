"""A GGUF served in its file's memory (issue 49): real processes on a synthetic checkpoint of a real
architecture's layout (Llama, SmolLM2's tokenizer, random Q4_0 blocks) written in the test.

The file is ~230M parameters (a quarter of the 1B class, to keep the suite short): large enough that
a dense float32 copy (4 bytes a parameter, 7x the file) or a second packed copy would show, small
enough to load in seconds. Figures at real sizes are ``benchmarks/serve_footprint.py``'s.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_util import ServerProc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from synthetic_checkpoint import write_gguf  # noqa: E402  (benchmarks/ is not a package)

SHAPE = dict(hidden=1024, layers=12, heads=16, kv_heads=4, ffn=4096, vocab=49152, tied=True, theta=500000.0)
SLACK = 200 * 1024**2  # one step's activations at the 1,024-token prefill budget, the logits buffer, a first start's tuning


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, Path]:
    """(the GGUF, a lockgate cache of its own holding only the built kernels)."""
    where = tmp_path_factory.mktemp("synthetic")
    path = where / "llama-230m-q4_0.gguf"
    write_gguf(SHAPE, "Q4_0", path, "default", seed=0)
    cache = where / "cache"
    home = Path(os.environ.get("LOCKGATE_CACHE_DIR", Path.home() / ".cache" / "lockgate"))
    if (home / "kernels").is_dir():
        shutil.copytree(home / "kernels", cache / "kernels")
    return path, cache


def rss(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024  # type: ignore[union-attr]


def baseline_rss() -> int:
    """A scheduler process before any model: Python, torch, lockgate's engine and kernels imported."""
    code = ("import re, pathlib\nimport torch\nfrom lockgate import kernels\nkernels.load()\n"
            "import lockgate.engine.process\n"
            "print(re.search(r'VmRSS:\\s+(\\d+)', pathlib.Path('/proc/self/status').read_text()).group(1))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.strip()) * 1024


def test_a_gguf_is_served_in_its_files_memory_and_caches_almost_nothing(synthetic) -> None:
    path, cache = synthetic
    file_bytes = path.stat().st_size
    s = ServerProc("--model", str(path), "--kv-cache-memory", "256MiB", env={"LOCKGATE_CACHE_DIR": str(cache)})
    try:
        s.wait_ready(600)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 8,
                                                        "ignore_eos": True}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        log = s.log()
        engine = s.child_pids()["scheduler"]
        used = rss(engine)
        pool = re.search(r"KV pool: (\d+) tokens x (\d+) bytes", log)
        assert pool, log[-2000:]
        pool_bytes = int(pool.group(1)) * int(pool.group(2))
        plan = re.search(r"memory plan: weights ([\d.]+) GiB", log)
        assert plan and float(plan.group(1)) * 1024**3 <= 1.15 * file_bytes, log[-2000:]  # planned as packed
    finally:
        s.stop()
    base = baseline_rss()
    weights = used - base - pool_bytes
    assert weights <= 1.15 * file_bytes + SLACK, (
        f"engine {used / 2**20:.0f} MiB = baseline {base / 2**20:.0f} + pool {pool_bytes / 2**20:.0f} + "
        f"{weights / 2**20:.0f} MiB, for a {file_bytes / 2**20:.0f} MiB file")
    entry = next(p for p in (cache / "models").iterdir() if p.name.startswith(path.stem))
    cached = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
    assert cached <= 0.10 * file_bytes, f"{cached} bytes cached for a {file_bytes}-byte file"
    assert not list(entry.glob("*.safetensors"))  # no converted weights


def test_a_model_that_cannot_fit_is_refused_with_the_figures_before_it_loads(synthetic) -> None:
    path, cache = synthetic
    s = ServerProc("--model", str(path), "--kv-cache-memory", "4096GiB", env={"LOCKGATE_CACHE_DIR": str(cache)})
    try:
        assert s.proc.wait(300) != 0
        log = s.log()
        assert "does not fit this machine's memory" in log and "KV pool 4096.00 GiB" in log, log[-2000:]
        assert "GiB available" in log and "Traceback" not in log
    finally:
        s.stop()
