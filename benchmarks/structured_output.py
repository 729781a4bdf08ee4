"""What constrained decoding costs: the same requests with a JSON schema on every one and with none.

Prints one JSON line (machine, command, per concurrency and variant): output tok/s, TPOT p50 (ms per
output token after the first), TTFT p50, tokens generated, and for the schema variant the grammar's own
cost as the engine counts it (``EngineCore.grammar_*``): mask milliseconds per step that had constrained
rows, microseconds per constrained row, and that time as a share of the run's wall time.

The offline engine on the default model (the same engine the server drives), greedy. Prompts ask for a
user record (``tests/test_structured.py``'s nested schema: objects, an enum, a bounded array, required
keys). Each round runs the constrained requests, then the same prompts unconstrained with ``ignore_eos``
and ``max_tokens`` set to the length each constrained output had, so both variants generate the same
number of tokens per request and wall time, tok/s and TPOT compare directly. c = 1 runs the requests one
after another; c = 32 submits them 32 at a time. Each output of the schema variant is checked to parse
and validate.

Usage:  .venv/bin/python benchmarks/structured_output.py [--requests 64] [--max-tokens 128] [--rounds 2]
        [--concurrency 1,32] [--speculative-tokens N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
from _common import command, machine

from lockgate import LLM, SamplingParams
from lockgate.sampling import StructuredOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_structured import PROMPTS, RECORD  # noqa: E402  (the same schema and prompts as the tests)


def run(llm: LLM, prompts: list[str], params: list[SamplingParams], conc: int, check: bool) -> dict[str, Any]:
    eng = llm.engine
    g0 = (eng.grammar_steps, eng.grammar_rows, eng.grammar_seconds)
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), conc):
        outs += llm.generate(prompts[i:i + conc], params[i:i + conc])
    wall = time.perf_counter() - t0
    n_out = [len(o.outputs[0].token_ids) for o in outs]
    tpot = [(o.metrics.e2e - o.metrics.time_to_first_token) / (n - 1) * 1e3
            for o, n in zip(outs, n_out, strict=True) if n > 1]
    if check:
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), RECORD)
    steps, rows, secs = (eng.grammar_steps - g0[0], eng.grammar_rows - g0[1], eng.grammar_seconds - g0[2])
    row: dict[str, Any] = {"lengths": n_out, "wall_s": wall, "output_tokens": sum(n_out), "output_tok_s": sum(n_out) / wall,
                           "tpot_p50_ms": statistics.median(tpot),
                           "ttft_p50_ms": statistics.median(o.metrics.time_to_first_token for o in outs) * 1e3}
    if steps:
        row.update(mask_ms_per_step=secs / steps * 1e3, mask_us_per_row=secs / rows * 1e6,
                   mask_share_of_wall=secs / wall)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--speculative-tokens", type=int, default=None, help="the engine's (default: its own)")
    args = ap.parse_args()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    llm = LLM("default", max_total_tokens=65536, **({} if args.speculative_tokens is None
                                                     else {"speculative_tokens": args.speculative_tokens}))
    so = StructuredOutput("json", json.dumps(RECORD))
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=so)
    llm.generate(prompts[:2], constrained)  # compile and warm up
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for conc in (int(c) for c in args.concurrency.split(",")):
        n = args.requests if conc > 1 else max(4, args.requests // 8)  # c = 1 is slow: fewer requests
        for _ in range(args.rounds):
            r = run(llm, prompts[:n], [constrained] * n, conc, check=True)
            results.setdefault(f"c{conc}", {}).setdefault("json_schema", []).append(r)
            # the same prompts, unconstrained, each made to generate exactly as many tokens
            free = [SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True) for k in r["lengths"]]
            results[f"c{conc}"].setdefault("none", []).append(run(llm, prompts[:n], free, conc, check=False))
    summary: dict[str, Any] = {}
    for key, by_variant in results.items():
        summary[key] = {name: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0] if k != "lengths"}
                        for name, rs in by_variant.items()}
        a, b = summary[key]["json_schema"], summary[key]["none"]
        summary[key]["ratio_tok_s"] = round(a["output_tok_s"] / b["output_tok_s"], 3)
        summary[key]["ratio_tpot"] = round(a["tpot_p50_ms"] / b["tpot_p50_ms"], 3)
    print(json.dumps({"benchmark": "structured_output", "command": command(), "machine": machine(),
                      "requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
                      "results": summary}))


if __name__ == "__main__":
    main()
