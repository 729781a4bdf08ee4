"""Shared bits of the offline benchmark scripts: machine description and one engine run."""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any

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
