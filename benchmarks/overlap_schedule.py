"""Overlap scheduling on a real server, one run: ``lockgate serve`` with ``--overlap-schedule`` off
and on, speculation on (the default, 2 guesses) and off, measured with ``lockgate bench`` (OpenAI
client path, streaming), rounds interleaved so a noisy host hits every variant alike.

    .venv/bin/python benchmarks/overlap_schedule.py [--model default] [--rounds 2]
        [--workloads c1-greedy,c1-sampled,c32-greedy,c32-sampled]

Workloads: ``c1-*``: 8 requests of 128 prompt and 128 output tokens one at a time (TPOT);
``c32-*``: 64 requests of 256 prompt and 128 output tokens at concurrency 32 (output tok/s);
``greedy`` at temperature 0 (requests speculate when speculation is on, and a step after one with
a speculating request waits for its result), ``sampled`` at temperature 0.8 (no guesses: every
step after the first is overlapped). Prints one JSON line: the CPU, the command, per workload and
variant the median TPOT and output tok/s over rounds, and each variant's ratio to overlap off with
the same speculation. The share of the engine's own time overlap hides is
``benchmarks/scheduler_overhead.py --overlap``'s to measure (simulated steps, no CPU contention).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _common import command, machine, run_bench, start_server

WORKLOADS = {
    "c1": ["--workload", "random", "--input-len", "128", "--output-len", "128", "--num-requests", "8",
           "--max-concurrency", "1"],
    "c32": ["--workload", "random", "--input-len", "256", "--output-len", "128", "--num-requests", "64",
            "--max-concurrency", "32"],
}
TEMPERATURE = {"greedy": "0", "sampled": "0.8"}
VARIANTS = {  # name -> serve flags
    "spec-on overlap-off": [],
    "spec-on overlap-on": ["--overlap-schedule"],
    "spec-off overlap-off": ["--speculative-tokens", "0"],
    "spec-off overlap-on": ["--speculative-tokens", "0", "--overlap-schedule"],
}



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workloads", default="c1-greedy,c1-sampled,c32-greedy,c32-sampled")
    a = p.parse_args()
    names = a.workloads.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="overlap-schedule-"))
    got: dict[str, dict[str, dict[str, list[float]]]] = {w: {v: {"tpot_ms": [], "tok_s": []} for v in VARIANTS}
                                                          for w in names}
    for r in range(a.rounds):
        for v, flags in VARIANTS.items():
            proc, url = start_server(["--model", a.model, *flags], tmp / f"serve-{v.replace(' ', '_')}-{r}.log")
            try:
                for i, w in enumerate(names):  # each workload its own prompts (seed): none finds another's cached
                    shape, temp = w.split("-")
                    res = run_bench(url, [*WORKLOADS[shape], "--temperature", TEMPERATURE[temp]], tmp / f"{w}-{r}.json",
                                    seed=i)
                    s = res["summary"]  # type: ignore[index]
                    got[w][v]["tpot_ms"].append(float(s["tpot_p50_ms"]))  # type: ignore[index]
                    got[w][v]["tok_s"].append(float(s["output_throughput"]))  # type: ignore[index]
                    print(f"round {r} {v} {w}: TPOT {got[w][v]['tpot_ms'][-1]:.2f} ms, "
                          f"{got[w][v]['tok_s'][-1]:.1f} output tok/s", file=sys.stderr)
            finally:
                proc.terminate()
                proc.wait(60)
    result: dict[str, object] = {"command": command(), **machine(), "model": a.model, "rounds": a.rounds}
    for w in names:
        med = {v: {k: statistics.median(x) for k, x in m.items()} for v, m in got[w].items()}
        result[w] = {
            "args": " ".join([*WORKLOADS[w.split("-")[0]], "--temperature", TEMPERATURE[w.split("-")[1]]]),
            "tpot_ms_median": {v: round(m["tpot_ms"], 2) for v, m in med.items()},
            "output_tok_s": {v: round(m["tok_s"], 1) for v, m in med.items()},
            "overlap_on_over_off_tok_s": {s: round(med[f"{s} overlap-on"]["tok_s"] / med[f"{s} overlap-off"]["tok_s"], 3)
                                          for s in ("spec-on", "spec-off")},
            "overlap_on_over_off_tpot": {s: round(med[f"{s} overlap-on"]["tpot_ms"] / med[f"{s} overlap-off"]["tpot_ms"], 3)
                                         for s in ("spec-on", "spec-off")},
            "all_rounds": got[w],
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
