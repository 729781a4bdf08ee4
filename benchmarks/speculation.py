"""N-gram speculation: what a guess row costs, and what guesses buy on the benchmark's c = 1 workload.

Prints one JSON line (machine, command, two parts):

1. ``rows``: the runner's step time for ``--batch`` sequences at ``--context`` tokens, each fed 1 to
   ``--max-rows`` rows (row j sees the keys through row j, as the scheduler lays out a request
   and its guesses), median over ``--rounds`` interleaved rounds. This is the price of a guess.
2. ``engine``: the offline engine on ``lockgate bench``'s ``random`` workload (the same real-text
   prompts, ``--input-len`` / ``--output-len``, greedy, ignore_eos), one request at a time, once
   per ``--speculative-tokens`` value (0 = off), variants interleaved per request: steps, guesses
   made and accepted, tokens per step and decode milliseconds per output token. Greedy outputs
   are checked equal across the variants.

Usage:  .venv/bin/python benchmarks/speculation.py [--num-requests 8] [--input-len 256]
        [--output-len 128] [--speculative-tokens 0,1,2,3] [--context 321] [--max-rows 6] [--batch 1]
        [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from _common import command, machine
from step_profile import greedy

from lockgate import LLM, SamplingParams
from lockgate.bench.tokens import load_bench_tokenizer
from lockgate.bench.workloads import WorkloadSpec, build_workload
from lockgate.plan import ForwardPlan
from lockgate.runner.model_runner import ModelRunner

I64 = np.int64


def guess_rows_plan(rows: int, context: int, vocab: int, batch: int = 1) -> ForwardPlan:
    """``batch`` sequences of ``context`` tokens (sequence b in slots b * (context + rows) ..), each
    fed ``rows`` one-token rows, as the scheduler lays out a request and its guesses."""
    seq = np.tile(np.arange(rows, dtype=I64) + context, batch)  # row j: the context plus guesses 1..j
    first = np.repeat(np.arange(batch, dtype=I64) * (context + rows), rows)
    kv = np.concatenate([f + np.arange(s, dtype=I64) for f, s in zip(first, seq, strict=True)])
    off = np.zeros(rows * batch + 1, I64)
    np.cumsum(seq, out=off[1:])
    n = rows * batch
    return ForwardPlan(input_ids=(np.arange(n, dtype=I64) * 7919) % vocab, positions=seq - 1,
                       out_slots=first + seq - 1, query_lens=np.ones(n, I64), seq_lens=seq, kv_slots=kv,
                       kv_offsets=off, sample_rows=np.arange(n, dtype=I64), sampling=greedy(n))


def row_costs(runner: ModelRunner, context: int, max_rows: int, rounds: int, batch: int = 1) -> dict[str, float]:
    plans = {q: guess_rows_plan(q, context, runner.vocab_size, batch) for q in range(1, max_rows + 1)}
    times: dict[int, list[float]] = {q: [] for q in plans}
    for p in plans.values():
        runner.execute(p)
    for _ in range(rounds):
        for q, p in plans.items():
            t = time.perf_counter()
            for _ in range(5):
                runner.execute(p)
            times[q].append((time.perf_counter() - t) / 5 * 1e3)
    return {f"rows_{q}": round(statistics.median(v), 2) for q, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--speculative-tokens", default="0,1,2,3")
    ap.add_argument("--context", type=int, default=321)
    ap.add_argument("--max-rows", type=int, default=6)
    ap.add_argument("--batch", type=int, default=1, help="part 1: sequences per step, each fed 1..max-rows rows")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    ks = [int(k) for k in a.speculative_tokens.split(",")]

    pool = max(4096, a.batch * (a.context + a.max_rows) + 64)
    llms = {k: LLM("default", max_total_tokens=pool, speculative_tokens=k, speculative_max_rows=k + 1,
                   speculative_min_acceptance=1.0) for k in ks}
    runner = next(iter(llms.values())).engine.runner
    assert isinstance(runner, ModelRunner)
    rows = row_costs(runner, a.context, a.max_rows, a.rounds, a.batch)

    tok = load_bench_tokenizer("default", "", None, {})
    wl = build_workload(WorkloadSpec("random", a.num_requests, a.input_len, a.output_len), tok, a.seed)
    sp = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    outs: dict[int, list[list[int]]] = {k: [] for k in ks}
    decode_s = dict.fromkeys(ks, 0.0)
    steps = dict.fromkeys(ks, 0)
    for session in wl.sessions:
        for k, llm in llms.items():  # interleaved: a slow spell hits every variant alike
            eng = llm.engine
            eng.add_request(tok.encode(session.turns[0].text), sp)
            eng.step()  # the prefill (and first token)
            n0, t0 = eng.num_steps, time.perf_counter()
            got = []
            while eng.has_work:
                for ev in eng.step():
                    got += ev.new_token_ids
            decode_s[k] += time.perf_counter() - t0
            steps[k] += eng.num_steps - n0
            outs[k].append(got)
    ref = outs[ks[0]]
    engine = {}
    for k, llm in llms.items():
        sched = llm.engine.scheduler
        made = a.num_requests * (a.output_len - 1)  # decode steps' tokens (the first came with the prefill)
        engine[f"k{k}"] = {"same_tokens_as_first": outs[k] == ref, "steps": steps[k],
                           "guesses": sched.speculator.num_draft_tokens, "accepted": sched.speculator.num_accepted_tokens,
                           "tokens_per_step": round(made / max(steps[k], 1), 2),
                           "ms_per_token": round(decode_s[k] / made * 1e3, 2)}
    print(json.dumps({"benchmark": "speculation", "command": command(), "machine": machine(),
                      "setup": {"num_requests": a.num_requests, "input_len": a.input_len, "output_len": a.output_len,
                                "context": a.context, "batch": a.batch, "rounds": a.rounds, "seed": a.seed},
                      "rows_ms": rows, "engine": engine}))


if __name__ == "__main__":
    main()
