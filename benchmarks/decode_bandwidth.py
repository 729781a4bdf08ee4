"""Decode at the memory limit: the machine's bandwidth (a STREAM-like triad) beside the bytes a
batch-1 decode step reads and the time it takes.

    .venv/bin/python benchmarks/decode_bandwidth.py --model /work/synth/l1b-q4_0.gguf [--tokens 128] [--rounds 3]
        [--activation-quant none,int8]

Prints one JSON line: the CPU (model name, flags, threads), the triad's best GB/s over ``--rounds``
(``a = b + s * c`` over three 256 MiB float32 arrays with torch's threads, counted as STREAM counts
it: three arrays' bytes per pass), the model's weight bytes a decode step streams (every projection's
served form and the LM head: ``Linear`` forms' tensors; the embedding rows a step reads are left
out, a few KB), the time per output token of one request alone with speculation off (``--tokens``
tokens, ``ignore_eos``; the median over ``--rounds`` runs, TTFT left out), and their ratio:
``weights / TPOT / triad`` is the share of the machine's bandwidth the decode step reaches.
``--activation-quant none,int8`` measures the tiers side by side (rounds interleaved) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch


def cpu() -> dict[str, object]:
    info = Path("/proc/cpuinfo").read_text()
    name = re.search(r"model name\s*:\s*(.*)", info)
    flags = (re.search(r"flags\s*:\s*(.*)", info) or re.search("x^", "")).group(1).split()  # type: ignore[union-attr]
    notable = [f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")]
    return {"cpu": name.group(1).strip() if name else "?", "flags": " ".join(notable), "threads": torch.get_num_threads()}


def triad_gbs(rounds: int, mib: int = 256) -> float:
    n = mib * 1024 * 1024 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)  # fault the pages in
    best = 0.0
    for _ in range(rounds * 3):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = max(best, 3 * n * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def weight_bytes(model: object) -> int:
    """Bytes of the forms a batch-1 decode step calls (each projection's form for 1 row)."""
    total = 0
    for lin in model.all_linears():  # type: ignore[attr-defined]
        form = lin.form_for(1)
        for attr in ("packed", "scales", "zeros", "qweight", "weight", "scales_zeros"):
            t = getattr(form, attr, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--activation-quant", default="none",
                   help="comma-separated tiers measured side by side, rounds interleaved (e.g. none,int8)")
    a = p.parse_args()
    from lockgate import LLM, SamplingParams

    tiers = a.activation_quant.split(",")
    llms = {t: LLM(a.model, dtype=a.dtype, max_total_tokens=4096, speculative_tokens=0, activation_quant=t)
            for t in tiers}
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    for llm in llms.values():
        llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    tpots: dict[str, list[float]] = {t: [] for t in tiers}
    for r in range(a.rounds):
        for t, llm in llms.items():  # interleaved: a slow spell of the host hits every tier alike
            prompt = [[5 + r, 6, 7, 8, 9]]
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=prompt, sampling_params=params)
            tpots[t].append((time.perf_counter() - t0 - ttft) / (a.tokens - 1))
    triad = triad_gbs(a.rounds)
    result: dict[str, object] = {**cpu(), "model": a.model, "triad_gbs": round(triad, 2)}
    for t, llm in llms.items():
        model = llm.engine.runner.model
        wb = weight_bytes(model)
        tpot = statistics.median(tpots[t])
        result[f"activation_quant={t}"] = {
            "dtype": str(llm.engine.runner.dtype).removeprefix("torch."), "weight_bytes": wb,
            "tpot_ms": round(tpot * 1e3, 2), "decode_gbs": round(wb / tpot / 1e9, 2),
            "share_of_triad": round(wb / tpot / 1e9 / triad, 3),
            "forms": {role: str(lins[0].choice) for role, lins in model.projections().items()}}
    if len(tiers) > 1:
        base = statistics.median(tpots[tiers[0]])
        result["speedup_vs_" + tiers[0]] = {t: round(base / statistics.median(tpots[t]), 3) for t in tiers[1:]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
