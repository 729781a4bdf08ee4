"""Serving throughput of the 8-bit KV tiers beside the exact pool, one run: ``lockgate serve`` per
tier at the same ``--kv-cache-memory``, measured with ``lockgate bench`` (OpenAI client path,
streaming), rounds interleaved so a noisy host hits every tier alike.

    .venv/bin/python benchmarks/kv_cache_dtype.py [--model default] [--tiers auto,int8]
        [--kv-cache-memory 2GiB] [--rounds 2] [--workloads c128,shared-prefix]

Workloads: ``c128``: 128 requests of 384 prompt and 128 output tokens at concurrency 128 (random
text; 65k tokens of KV at once, more than an exact float32 pool of the default 2 GiB holds for the
default model, so the exact pool admits fewer at a time); ``shared-prefix``: 4 groups of 32
requests on 1,024-token shared prefixes (64 own prompt tokens, 128 output) at concurrency 128 (fits
either pool: the attention's reads decide). Prints one JSON line: the CPU, the command, each tier's
capacity and per workload its output tok/s (median over rounds) and the ratio to the first tier.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from _common import command, machine, run_bench, start_server

WORKLOADS = {
    "c128": ["--workload", "random", "--input-len", "384", "--output-len", "128", "--num-requests", "128",
             "--max-concurrency", "128"],
    "shared-prefix": ["--workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "32", "--prefix-len",
                      "1024", "--suffix-len", "64", "--output-len", "128", "--max-concurrency", "128"],
}


def serve(model: str, tier: str, memory: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    return start_server(["--model", model, "--kv-cache-memory", memory, "--kv-cache-dtype", tier], log)



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tiers", default="auto,int8")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default="c128,shared-prefix")
    a = p.parse_args()
    tiers, names = a.tiers.split(","), a.workloads.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="kv-cache-dtype-"))
    tok_s: dict[str, dict[str, list[float]]] = {t: {w: [] for w in names} for t in tiers}
    info: dict[str, dict[str, object]] = {}
    for r in range(a.rounds):
        for tier in tiers:
            proc, url = serve(a.model, tier, a.kv_cache_memory, tmp / f"serve-{tier}-{r}.log")
            try:
                loads = httpx.get(url + "/v1/loads", timeout=10).json()
                info[tier] = {"capacity_tokens": loads["capacity"], "kv_cache_dtype": loads.get("kv_cache_dtype")}
                for i, w in enumerate(names):  # each workload its own prompts (seed): none finds another's cached
                    res = run_bench(url, WORKLOADS[w], tmp / f"{w}-{tier}-{r}.json", seed=i)
                    tok_s[tier][w].append(float(res["summary"]["output_throughput"]))  # type: ignore[index]
                    print(f"round {r} {tier} {w}: {tok_s[tier][w][-1]:.1f} output tok/s", file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(60)
    base = tiers[0]
    result: dict[str, object] = {"command": command(), **machine(), "model": a.model,
                                 "kv_cache_memory": a.kv_cache_memory, "rounds": a.rounds, "tiers": info}
    for w in names:
        med = {t: statistics.median(tok_s[t][w]) for t in tiers}
        result[w] = {"args": " ".join(WORKLOADS[w]), "output_tok_s": {t: round(v, 1) for t, v in med.items()},
                     "all_rounds": tok_s_round(tok_s, w),
                     f"ratio_to_{base}": {t: round(med[t] / med[base], 3) for t in tiers[1:]}}
    print(json.dumps(result))
    return 0


def tok_s_round(tok_s: dict[str, dict[str, list[float]]], w: str) -> dict[str, list[float]]:
    return {t: [round(v, 1) for v in per[w]] for t, per in tok_s.items()}


if __name__ == "__main__":
    sys.exit(main())
