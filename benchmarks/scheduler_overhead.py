"""Scheduler overhead: milliseconds of engine-side Python per step, one checkout against another.

Drives ``EngineCore`` on the sim model with a zero-cost step (``--sim-step-ms 0``), so what is
timed is the scheduler (admission, prefix cache, speculation, plan building, update) and the sim
runner's trivial work. The workload mixes everything the scheduler does: prompts sharing
prefixes, chunked prefill, greedy requests that speculate and sampled ones that do not.

The JSON also gives a digest of every request's output tokens: equal digests mean the checkouts
scheduled the same tokens (the sim model's tokens depend on the positions and contexts it is given).

With ``--trees A,B`` (paths of lockgate checkouts; default: this one) each round runs every tree
once, in a fresh interpreter, alternating, so a noisy machine hits them alike; the JSON line gives
each tree's median ms/step and the ratios to the first. Use it to show a refactor costs nothing:

    git worktree add /tmp/before HEAD~1
    .venv/bin/python benchmarks/scheduler_overhead.py --trees /tmp/before,. --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _common import machine

ONE_RUN = r"""
import json, time, numpy as np
from lockgate.config import EngineConfig
from lockgate.sampling import SamplingParams
try:
    from lockgate.engine.core import EngineCore
except ImportError:  # checkouts from before the engine package
    from lockgate.scheduler.loop import EngineCore
n, seed = {n}, {seed}
eng = EngineCore(EngineConfig.build(model="sim", sim_step_ms=0.0, max_total_tokens=65536, max_prefill_tokens=2048,
                                    speculative_tokens=4))
rng = np.random.default_rng(seed)
prefixes = [rng.integers(3, 250, size=int(rng.integers(64, 512))) for _ in range(8)]
for i in range(n):
    tail = rng.integers(3, 250, size=int(rng.integers(16, 256)))
    prompt = np.concatenate([prefixes[i % 8], tail])
    greedy = i % 2 == 0
    eng.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(16, 256)), temperature=0.0 if greedy else 0.8,
                                           seed=i, ignore_eos=True))
import hashlib
tokens = {{}}
steps, t0 = 0, time.perf_counter()
while eng.has_work:
    for ev in eng.step():
        tokens.setdefault(ev.rid, []).extend(ev.new_token_ids)
    steps += 1
ms = (time.perf_counter() - t0) * 1000 / steps
digest = hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:16]
print(json.dumps({{"steps": steps, "ms_per_step": ms, "outputs_sha256": digest}}))
"""


def run_once(tree: Path, n: int, seed: int) -> dict[str, float | str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "LOCKGATE_LOG_LEVEL": "ERROR"}
    out = subprocess.run([sys.executable, "-c", ONE_RUN.format(n=n, seed=seed)], cwd=tree, env=env,
                         capture_output=True, text=True, check=True, timeout=1200)
    result: dict[str, float | str] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", default=".", help="comma-separated lockgate checkouts to compare (first = baseline)")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    times: dict[str, list[float]] = {str(t): [] for t in trees}
    steps: dict[str, int] = {}
    digests: dict[str, str] = {}
    for _ in range(args.rounds):
        for t in trees:
            r = run_once(t, args.requests, args.seed)
            times[str(t)].append(float(r["ms_per_step"]))
            steps[str(t)] = int(r["steps"])
            digests[str(t)] = str(r["outputs_sha256"])
    med = {t: statistics.median(v) for t, v in times.items()}
    base = med[str(trees[0])]
    print(json.dumps({"command": " ".join(sys.argv), "machine": machine(), "requests": args.requests,
                      "rounds": args.rounds, "steps": steps, "outputs_sha256": digests, "ms_per_step_median": med,
                      "ms_per_step_all": times, "ratio_to_first": {t: m / base for t, m in med.items()}}))


if __name__ == "__main__":
    main()
