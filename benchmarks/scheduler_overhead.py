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

With ``--overlap`` it measures overlap scheduling instead (``--overlap-schedule``): this checkout
with overlap off and on, speculation off and on, on simulated steps that take ``--sim-step-ms``
(the runner sleeps, as a real forward leaves the interpreter to other threads while torch computes):
the runner's idle time per step, and the share of it that overlap hides.

    .venv/bin/python benchmarks/scheduler_overhead.py --overlap --rounds 3
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
eng = EngineCore(EngineConfig.build(model="sim", sim_step_ms={step_ms}, max_total_tokens=65536, max_prefill_tokens=2048,
                                    speculative_tokens={spec}{extra}))
import sys
if {switch}:
    from lockgate.engine.core import OVERLAP_SWITCH_INTERVAL
    sys.setswitchinterval(OVERLAP_SWITCH_INTERVAL)  # as the scheduler process does with overlap on
busy = [0.0]
_execute = eng.runner.execute
def timed(plan):
    t = time.perf_counter()
    try:
        return _execute(plan)
    finally:
        busy[0] += time.perf_counter() - t
eng.runner.execute = timed
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
wall = time.perf_counter() - t0
ms = wall * 1000 / steps
digest = hashlib.sha256(json.dumps(sorted(tokens.items())).encode()).hexdigest()[:16]
print(json.dumps({{"steps": steps, "ms_per_step": ms, "runner_idle_ms_per_step": (wall - busy[0]) * 1000 / steps,
                  "outputs_sha256": digest}}))
"""


def run_once(tree: Path, n: int, seed: int, step_ms: float = 0.0, spec: int = 4,
             overlap: bool | None = None) -> dict[str, float | str]:
    extra = "" if overlap is None else f", overlap_schedule={overlap}"
    code = ONE_RUN.format(n=n, seed=seed, step_ms=step_ms, spec=spec, extra=extra, switch=bool(overlap))
    env = {**os.environ, "PYTHONPATH": str(tree), "LOCKGATE_LOG_LEVEL": "ERROR"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env,
                         capture_output=True, text=True, check=True, timeout=1200)
    result: dict[str, float | str] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", default=".", help="comma-separated lockgate checkouts to compare (first = baseline)")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overlap", action="store_true",
                    help="instead: this checkout with overlap scheduling off and on, speculation off and on, on "
                    "simulated steps of --sim-step-ms; reports the runner's idle time per step and the share of it "
                    "overlap hides")
    ap.add_argument("--sim-step-ms", type=float, default=10.0, help="--overlap: the simulated step's duration")
    args = ap.parse_args()
    if args.overlap:
        overlap_main(args)
        return
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


def overlap_main(args: argparse.Namespace) -> None:
    """Overlap off vs on (speculation off and on), interleaved round by round. Without overlap the
    runner idles for all of the engine's own work between steps; with it, only for what must
    happen between one step's result and the next launch. Hidden share = 1 - idle(on) / idle(off)."""
    tree = Path(args.trees.split(",")[0]).resolve()
    cases = [(spec, ov) for spec in (0, 4) for ov in (False, True)]
    idle: dict[str, list[float]] = {}
    per_step: dict[str, list[float]] = {}
    digests: dict[str, str] = {}
    for _ in range(args.rounds):
        for spec, ov in cases:
            key = f"speculation {'on' if spec else 'off'}, overlap {'on' if ov else 'off'}"
            r = run_once(tree, args.requests, args.seed, args.sim_step_ms, spec, ov)
            idle.setdefault(key, []).append(float(r["runner_idle_ms_per_step"]))
            per_step.setdefault(key, []).append(float(r["ms_per_step"]))
            digests[key] = str(r["outputs_sha256"])
    med = {k: statistics.median(v) for k, v in idle.items()}
    hidden = {f"speculation {s}": 1.0 - med[f"speculation {s}, overlap on"] / med[f"speculation {s}, overlap off"]
              for s in ("off", "on")}
    print(json.dumps({"command": " ".join(sys.argv), "machine": machine(), "requests": args.requests,
                      "rounds": args.rounds, "sim_step_ms": args.sim_step_ms, "outputs_sha256": digests,
                      "runner_idle_ms_per_step_median": med,
                      "ms_per_step_median": {k: statistics.median(v) for k, v in per_step.items()},
                      "share_of_engine_time_hidden": hidden}))


if __name__ == "__main__":
    main()
