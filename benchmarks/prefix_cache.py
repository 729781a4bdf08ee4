"""Prefix-cache benchmark: shared-prefix workload with the cache on vs off, and per policy.

Workload (issue 4): G groups x M requests; each group shares a P-token prefix (real text),
each request adds a U-token unique suffix and generates O tokens (ignore_eos). Requests
arrive all at once, groups interleaved in a seeded random order (so policies matter).
Each configuration gets a fresh engine; prints one JSON line.

Usage: .venv/bin/python benchmarks/prefix_cache.py [--model default] [--groups 16 --per-group 8
       --prefix 1024 --suffix 64 --output 64] [--configs off,fcfs,lpm,dfs-weight,lof,random]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from _common import command, machine, run

from lockgate import LLM
from lockgate.bench.corpus import PromptMaker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--configs", default="off,fcfs,lpm,dfs-weight,lof,random")
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    result: dict = {"benchmark": "prefix_cache", "model": a.model, "command": command(),
                    "workload": {k: getattr(a, k) for k in ("groups", "per_group", "prefix", "suffix", "output")}}
    prompts: list[list[int]] | None = None
    for cfg in a.configs.split(","):
        llm = LLM(a.model, dtype=a.dtype, max_total_tokens=a.max_total_tokens, disable_prefix_cache=cfg == "off",
                  schedule_policy="fcfs" if cfg == "off" else cfg)
        if prompts is None:
            tok = llm.tokenizer
            maker = PromptMaker(lambda t, tok=tok: tok.encode(t, add_special_tokens=False), seed=a.seed)
            prompts = []
            for _ in range(a.groups):
                head = maker.ids_of_length(a.prefix)
                prompts += [head + maker.ids_of_length(a.suffix) for _ in range(a.per_group)]
            order = np.random.default_rng(a.seed).permutation(len(prompts))
            prompts = [prompts[i] for i in order]
            result["machine"] = machine()
        row = run(llm, prompts, [a.output] * len(prompts))
        result["cache_off" if cfg == "off" else f"cache_on_{cfg}"] = row
        print(json.dumps({cfg: row}), file=sys.stderr)
        del llm
    on, off = result.get("cache_on_fcfs"), result.get("cache_off")
    if on and off:
        result["ratio_on_vs_off_total_tok_s"] = round(on["total_tok_s"] / off["total_tok_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
