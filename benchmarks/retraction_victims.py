"""Which request to retract when decode runs out of KV slots: the cheapest to recompute vs the last admitted.

Workload: ``--groups`` groups of ``--per-group`` requests; the requests of a group share a prompt
prefix of ``--prefix-len`` tokens, then a unique suffix of 16..``--max-suffix`` tokens; output lengths
16..``--max-output`` (seeded, ``ignore_eos``), all submitted at once in a seeded order. ``--admission
ratio`` with a low starting new-token ratio admits optimistically and the small pool
(``--max-total-tokens``) makes decode run short, so requests are retracted and resumed from the
prefix cache. Each rule (``--retract-victim last`` / ``cost``) gets a fresh engine over the same
requests; one JSON line: per rule the retractions, the tokens recomputed on resumption, the
throughput, and their ratios cost / last.

Usage: .venv/bin/python benchmarks/retraction_victims.py [--model sim|default] [--groups 8] [--per-group 8]
       [--prefix-len 256] [--max-suffix 256] [--max-output 256] [--max-total-tokens 6000]
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
    ap.add_argument("--model", default="sim")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--max-suffix", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    rng = np.random.default_rng(a.seed)
    n = a.groups * a.per_group
    suffix = [int(x) for x in rng.integers(16, a.max_suffix + 1, n)]
    outs = [int(x) for x in rng.integers(16, a.max_output + 1, n)]
    order = [int(i) for i in rng.permutation(n)]
    result: dict = {"benchmark": "retraction_victims", "model": a.model, "command": command(), "machine": machine(),
                    "workload": {"requests": n, "groups": a.groups, "prefix_len": a.prefix_len,
                                 "suffix": f"16..{a.max_suffix}", "output": f"16..{a.max_output}",
                                 "max_total_tokens": a.max_total_tokens}}
    prompts: list[list[int]] | None = None
    for rule in ("last", "cost"):
        llm = LLM(a.model, max_total_tokens=a.max_total_tokens, admission="ratio", init_new_token_ratio=0.1,
                  min_new_token_ratio=0.05, retract_victim=rule, speculative_tokens=0)
        if prompts is None:
            if a.model == "sim":
                ids = rng.integers(3, 30000, a.groups * a.prefix_len + sum(suffix))
                heads = [ids[g * a.prefix_len:(g + 1) * a.prefix_len].tolist() for g in range(a.groups)]
                tails, at = [], a.groups * a.prefix_len
                for s in suffix:
                    tails.append(ids[at:at + s].tolist())
                    at += s
            else:
                tok = llm.tokenizer
                maker = PromptMaker(lambda t, tok=tok: tok.encode(t, add_special_tokens=False), seed=a.seed)
                heads = [maker.ids_of_length(a.prefix_len) for _ in range(a.groups)]
                tails = [maker.ids_of_length(s) for s in suffix]
            prompts = [heads[i // a.per_group] + tails[i] for i in range(n)]
        row = run(llm, [prompts[i] for i in order], [outs[i] for i in order])
        row["recomputed_tokens"] = llm.engine.scheduler.num_recomputed_tokens
        result[rule] = row
        print(json.dumps({rule: row}), file=sys.stderr)
        del llm
    last, cost = result["last"], result["cost"]
    result["cost_vs_last"] = {
        "retractions": round(cost["retractions"] / max(last["retractions"], 1), 3),
        "recomputed_tokens": round(cost["recomputed_tokens"] / max(last["recomputed_tokens"], 1), 3),
        "output_tok_s": round(cost["output_tok_s"] / last["output_tok_s"], 3)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
