"""A burst of prompts, offline, by ``--max-decode-stall``: when the last first token comes, what it
costs the requests already decoding, and throughput.

The offline engine (the server's ``EngineCore``, no HTTP) on ``lockgate bench``'s ``random``
workload (real-text prompts of ``--input-len`` tokens, ``--output-len`` tokens each, greedy,
ignore_eos) or its ``shared-prefix`` workload (``--workload shared-prefix``: 16 groups x 8 prompts,
a 1,024-token prefix and 64 own tokens, as ``compare_peers.py``), kept at ``--concurrency``
requests in flight (a finished request is replaced at once, like the benchmark client). Each
``--stalls`` value is run ``--rounds`` times, values interleaved, every run on fresh prompts (the
prefix cache would otherwise serve the next run's prompts). Per run: wall seconds, output tok/s,
TTFT max and median (from submission), the longest and the 99th-percentile gap between a request's
consecutive token events, and the split of steps into those with prompt tokens and decode-only
ones. Prints one JSON line (machine, command, runs).

Usage:  .venv/bin/python benchmarks/decode_stall.py [--stalls 0,0.5,1] [--concurrency 128]
        [--num-requests 128] [--workload random|shared-prefix] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

from _common import command, machine

from lockgate import LLM, SamplingParams
from lockgate.bench.tokens import LocalTokenizer
from lockgate.bench.workloads import WorkloadSpec, build_workload


def prompts_for(llm: LLM, args: argparse.Namespace, seed: int) -> tuple[list[list[int]], int]:
    tok = LocalTokenizer(llm.tokenizer, "default")
    if args.workload == "shared-prefix":
        spec = WorkloadSpec("shared-prefix", args.num_requests, groups=16, prompts_per_group=8, prefix_len=1024,
                            suffix_len=64, output_len=64)
    else:
        spec = WorkloadSpec("random", args.num_requests, args.input_len, args.output_len)
    wl = build_workload(spec, tok, seed)
    return [llm.tokenizer.encode(s.turns[0].text) for s in wl.sessions], wl.sessions[0].turns[0].output_len


def one_run(llm: LLM, prompts: list[list[int]], out_len: int, concurrency: int) -> dict[str, Any]:
    eng = llm.engine
    params = SamplingParams(max_tokens=out_len, min_tokens=out_len, temperature=0.0, ignore_eos=True)
    queue, submitted, last = list(prompts), {}, {}
    ttft: list[float] = []
    gaps: list[float] = []
    split = {"prompt_steps": 0, "prompt_step_s": 0.0, "decode_steps": 0, "decode_step_s": 0.0}

    def submit() -> None:
        r = eng.add_request(queue.pop(0), params)
        submitted[r.rid] = time.monotonic()

    t0 = time.monotonic()
    while queue and len(submitted) < concurrency:
        submit()
    while eng.has_work:
        outs = eng.step()
        now, info = time.monotonic(), eng.last_step
        if info is not None:
            kind = "prompt" if info.num_prefill_tokens else "decode"
            split[f"{kind}_steps"] += 1
            split[f"{kind}_step_s"] += info.seconds
        for o in outs:
            if o.rid in last:
                gaps.append(now - last[o.rid])
            else:
                ttft.append(now - submitted[o.rid])
            last[o.rid] = now
            if o.finish_reason is not None:
                del submitted[o.rid], last[o.rid]
                if queue:
                    submit()
    wall = time.monotonic() - t0
    gaps.sort()
    return {"wall_s": round(wall, 2), "output_tok_s": round(len(prompts) * out_len / wall, 1),
            "ttft_max_s": round(max(ttft), 2), "ttft_p50_s": round(statistics.median(ttft), 2),
            "gap_max_s": round(gaps[-1], 2), "gap_p99_s": round(gaps[int(0.99 * (len(gaps) - 1))], 3),
            **{k: round(v, 2) if isinstance(v, float) else v for k, v in split.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stalls", default="0,0.5,1", help="comma list of --max-decode-stall values (seconds)")
    ap.add_argument("--workload", default="random", choices=["random", "shared-prefix"])
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="4GiB")
    args = ap.parse_args()
    stalls = [float(x) for x in args.stalls.split(",")]
    if any(s < 0 for s in stalls) or args.concurrency < 1 or args.num_requests < 1 or args.rounds < 1:
        raise SystemExit("--stalls must be >= 0; --concurrency, --num-requests and --rounds >= 1")
    llm = LLM("default", kv_cache_memory=args.kv_cache_memory)
    runs: dict[str, list[dict[str, Any]]] = {str(s): [] for s in stalls}
    seed = 100
    for _ in range(args.rounds):
        for stall in stalls:
            seed += 1
            prompts, out_len = prompts_for(llm, args, seed)
            sched = llm.engine.scheduler
            sched.cfg = dataclasses.replace(sched.cfg, max_decode_stall=stall)
            runs[str(stall)].append(one_run(llm, prompts, out_len, args.concurrency))
    print(json.dumps({"benchmark": "decode_stall", "command": command(), "machine": machine(),
                      "setup": {k: v for k, v in vars(args).items() if k != "stalls"}, "runs": runs}))


if __name__ == "__main__":
    main()
