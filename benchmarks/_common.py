"""Shared bits of the benchmark scripts: machine description, one engine run, and a ``lockgate serve``
started on a free loopback port and waited for through ``/health``."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from lockgate import LLM, SamplingParams
from lockgate.bench.stats import summarize_ms


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and the /proc/cpuinfo flags that tell CPU classes apart (AVX2, FMA,
    F16C, AVX-VNNI, AVX-512 F/BW/VNNI/BF16, AMX); ``machine()`` also keeps the full list."""
    from lockgate.runner.tuning_cache import cpu_description, notable_flags

    cpu = cpu_description()
    return cpu["cpu"], notable_flags(cpu["flags"]).split()


def machine() -> dict[str, Any]:
    import torch

    from lockgate.runner.tuning_cache import cpu_description

    name, flags = cpu_model_and_flags()
    cpu = cpu_description()
    return {"cpu": name, "cpu_flags": flags, "cpu_flags_all": cpu["flags"].split(), "cores": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": platform.python_version()}


def command() -> str:
    return " ".join([os.path.basename(sys.executable), *sys.argv])


def run(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
    """All requests submitted at once; throughput, TTFT percentiles, cache hits."""
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    sched = llm.engine.scheduler
    row = {"seconds": round(dt, 2), "output_tok_s": round(n_out / dt, 1), "total_tok_s": round((n_in + n_out) / dt, 1),
           "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs), "retractions": sched.num_retractions,
           **summarize_ms([o.metrics.time_to_first_token for o in outs], "ttft")}
    return row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(flags: list[str], log_path: Path, timeout: float = 900) -> tuple[subprocess.Popen[bytes], str]:
    """``lockgate serve FLAGS`` on a free loopback port in its own session (stop it by process group),
    its output in ``log_path``; returns (process, url) once ``/health`` is 200. RuntimeError with the
    log's tail if it exits first, TimeoutError (after killing it) if it is not ready in ``timeout`` s."""
    port = free_port()
    argv = [sys.executable, "-m", "lockgate.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    with log_path.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, HF_HUB_OFFLINE="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({' '.join(flags)}): {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server not ready ({' '.join(flags)}): {log_path}")


def run_bench(url: str, args: list[str], out: Path, seed: int = 0) -> dict[str, Any]:
    """``lockgate bench --url URL ARGS`` (no progress bar); its JSON report, also left in ``out``.
    ``seed`` makes the prompts: workloads run one after another on one server need their own, or
    the later ones find the earlier ones' prompts in the prefix cache."""
    subprocess.run([sys.executable, "-m", "lockgate.cli", "bench", "--url", url, "--seed", str(seed), "--no-progress",
                    "--out", str(out), *args], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())  # type: ignore[no-any-return]
