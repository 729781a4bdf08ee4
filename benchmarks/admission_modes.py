"""Admission-mode benchmark: the mixed long/short workload under peak, reserve and ratio.

Workload (issue 4): N requests, half want 16 output tokens, half 512 (ignore_eos), prompt
lengths uniform in [64, 512] tokens of real text, all submitted at once in a seeded random
order. The KV pool is deliberately small (``--max-total-tokens``) so admission, not compute
alone, decides how many requests run together: this is the Efficient Router case of the
LightLLM paper. Each mode gets a fresh engine; prints one JSON line with ratios vs reserve.

Usage: .venv/bin/python benchmarks/admission_modes.py [--model default] [--num-requests 64]
       [--max-total-tokens 12000] [--modes peak,reserve,ratio]
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
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=12000)
    ap.add_argument("--modes", default="peak,reserve,ratio")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    rng = np.random.default_rng(a.seed)
    out_lens = [16, 512] * (a.num_requests // 2) + [16] * (a.num_requests % 2)
    out_lens = [int(x) for x in rng.permutation(out_lens)]
    in_lens = [int(x) for x in rng.integers(64, 513, a.num_requests)]
    result: dict = {"benchmark": "admission_modes", "model": a.model, "command": command(),
                    "workload": {"requests": a.num_requests, "outputs": "half 16, half 512", "prompts": "64..512",
                                 "max_total_tokens": a.max_total_tokens}}
    prompts = None
    for mode in a.modes.split(","):
        llm = LLM(a.model, dtype=a.dtype, max_total_tokens=a.max_total_tokens, admission=mode,
                  disable_prefix_cache=True)
        if prompts is None:
            tok = llm.tokenizer
            maker = PromptMaker(lambda t, tok=tok: tok.encode(t, add_special_tokens=False), seed=a.seed)
            prompts = [maker.ids_of_length(n) for n in in_lens]
            result["machine"] = machine()
        result[mode] = run(llm, prompts, out_lens)
        print(json.dumps({mode: result[mode]}), file=sys.stderr)
        del llm
    if "reserve" in result:
        for mode in a.modes.split(","):
            result[f"{mode}_vs_reserve_output_tok_s"] = round(result[mode]["output_tok_s"]
                                                              / result["reserve"]["output_tok_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
