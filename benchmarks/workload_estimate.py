"""What lockgate's own steps make of compare_peers' throughput workloads on this CPU, what the
arithmetic alone allows, and where a 1.5x lead over a peer's measured figure falls between them.

Owns the pricing of a workload's rows with timed runner steps. It relies on ``step_profile``'s
decode-plan builder (contexts laid out as the scheduler lays them out), on ``instruction_peak`` for
the CPU's arithmetic ceiling, and on ``compare_peers``' workload sizes, read from its own argument
defaults (``WORKLOADS``).

For each workload issue 16 sets a throughput target on (uniform at c = 32, uniform-high at c = 128,
mixed, shared-prefix), the script times the model runner's steps directly (plans built by hand, no
scheduler, no server) and prices the workload's rows with them:

* prompt rows: in steps of ``--chunk`` rows (the server's ``--max-prefill-tokens``; at least the
  longest prompt here, 1,024), packed from whole prompts. A shared prefix is computed once per group
  (one 1,024-row step). The suffixes are packed 16 to a step, each on its own group's prefix (the
  benchmark shuffles the requests).
* decoded tokens (every output token but each request's first, which its last prompt step samples):
  at the per-row time of a full decode step of the workload's concurrency. The step's context is the
  mean over the workload's decode rows (mixed: ~505 keys, the long requests' rows weigh most).
  Shared-prefix's 32 rows are 2 to a prefix, as shuffled requests spread over 16 groups.

``steps_s`` is that sum: an **estimate** of the engine's work, not a bound. The server runs prompt
chunks and decode rows in one step where priced here apart. It lands near the sum (on the Zen 4 class CPU:
0.94-0.95 of its output tok/s, 1.07 on mixed). It comes out above where n-gram speculation's guesses are taken: a
guess row shares its request's key reads and fills the step's matmuls. It comes out below where
batches run partly empty, the scheduler and the server's processes take their share, or the host has
a slow minute.

``matmul_floor_s`` is a **bound**: the workload's projection and LM-head FLOPs (from the model's
shapes) at the fastest multiply-add instruction lockgate's forms use on this CPU. That is the best
of float32 FMA, ``VDPBF16PS`` and ``VPDPWSSD``, on every CPU the process may use
(``instruction_peak.py``, the best of three short runs), with attention left out. No form of
lockgate's, exact or integer, gets below it. It is not given on a CPU with AMX, whose tiles oneDNN
may use.

``--compare DIR`` (a ``compare_peers.py --out-dir``) adds each server's measured output tok/s, the
ratio, and 1.5x the peer's figure against both. The peer is the faster of the ``vllm-*`` runs of the
workload, as compare_peers' ratios take it, unless ``--peer`` names one. ``target_vs_steps`` above 1
means the target needs steps cheaper than lockgate's kernels make them (or more speculation than the
workload gives). ``target_vs_floor`` above 1 would mean no form could reach it. A result file whose
request count is not the workload's, or with failed requests, is refused.

Prints one JSON line (machine, command, per workload: the work, the step times, the estimate, the
floor and the comparison). About 30 s on 2 cores. Usage:

  .venv/bin/python benchmarks/workload_estimate.py [--compare /tmp/run] [--peer vllm-allcores] [--rounds 5]

The process runs itself again with ``GLIBC_TUNABLES`` set as ``lockgate serve`` sets it for the
scheduler (``lockgate.server.launch.scheduler_env``: the KV pool on transparent huge pages).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import compare_peers
import instruction_peak
from _common import command, machine
from step_profile import decode_plan, prompt_plan

from lockgate.bench.workloads import MIXED_SHORT
from lockgate.config import CacheConfig, ModelConfig
from lockgate.plan import ForwardPlan
from lockgate.runner.model_runner import ModelRunner
from lockgate.runner.tuning_cache import cpu_description
from lockgate.server.launch import scheduler_env

LEAD = 1.5  # issue 16's target ratio
# the pool: the largest decode plan reads slots below 41,088 (128 x 321 keys), the prefixes below
# 16,384; a prompt step (at most 16,384 rows) writes at the top, above both
POOL_SLOTS = 60_000


@dataclass(frozen=True)
class PeerWorkload:
    """A compare_peers throughput workload at its default size."""

    name: str
    requests: int
    prompt: int  # tokens per prompt (shared-prefix: the unique suffix)
    outputs: tuple[int, ...]  # output tokens, cycled over the requests
    batch: int  # the concurrency: decode rows per full step
    prefix: int = 0  # shared-prefix: the prefix every request of a group shares
    groups: int = 0

    def output_of(self, i: int) -> int:
        return self.outputs[i % len(self.outputs)]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_of(i) for i in range(self.requests))

    @property
    def decode_rows(self) -> int:
        """Every output token but each request's first (its last prompt step samples that one)."""
        return self.output_tokens - self.requests

    @property
    def mean_context(self) -> int:
        """The keys a decode row attends to, averaged over the decode rows: decode row j (1 ..
        o - 1) of a request of o output tokens has its prefix, prompt and j more."""
        outs = [self.output_of(i) for i in range(self.requests)]
        extra = sum(o * (o - 1) // 2 for o in outs)  # sum over each request's rows j = 1 .. o - 1
        return self.prefix + self.prompt + round(extra / max(1, sum(o - 1 for o in outs)))


def peer_workloads() -> tuple[PeerWorkload, ...]:
    """compare_peers' throughput workloads at its default sizes (read from its own parser)."""
    a = compare_peers.parse_args([])
    return (
        PeerWorkload("uniform", a.num_requests, a.input_len, (a.output_len,), a.concurrency),
        PeerWorkload("uniform-high", a.num_requests_high, a.input_len, (a.output_len,), a.concurrency_high),
        # half the requests short, half long (lockgate.bench.workloads: the order does not matter here)
        PeerWorkload("mixed", a.num_requests, a.input_len, (MIXED_SHORT, a.mixed_output_len), a.concurrency),
        PeerWorkload("shared-prefix", a.groups * a.per_group, a.suffix_len, (a.prefix_output_len,), a.concurrency,
                     prefix=a.prefix_len, groups=a.groups),
    )


WORKLOADS = peer_workloads()


class PromptStep(NamedTuple):
    """A prompt step: per sequence (keys it already holds, new tokens, first slot of the held keys)."""

    seqs: tuple[tuple[int, int, int], ...]


class DecodeStep(NamedTuple):
    """A full decode step (``step_profile.decode_plan``'s arguments)."""

    batch: int
    prompt_len: int
    decoded: int
    shared: int
    group: int


def steps_of(w: PeerWorkload, chunk: int) -> tuple[list[tuple[PromptStep, int]], DecodeStep]:
    """The workload's prompt steps (shape, how many) and its decode step's shape (module docstring).
    Group g's prefix sits at slots g * prefix ..; suffix i of a step reads prefix i % groups."""
    prompts: list[tuple[PromptStep, int]] = []
    if w.prefix:
        prompts.append((PromptStep(((0, w.prefix, 0),)), w.groups))
    per = chunk // w.prompt
    full, rest = divmod(w.requests, per)
    for n, count in ((per, full), (rest, 1)):
        if n and count:
            seqs = tuple((w.prefix, w.prompt, (i % w.groups) * w.prefix if w.prefix else 0) for i in range(n))
            prompts.append((PromptStep(seqs), count))
    prompt_len = w.prefix + w.prompt
    group = max(1, w.batch // w.groups) if w.prefix else 1
    return prompts, DecodeStep(w.batch, prompt_len, w.mean_context - prompt_len, w.prefix, group)


def build(runner: ModelRunner, step: PromptStep | DecodeStep) -> ForwardPlan:
    if isinstance(step, PromptStep):  # its fresh slots at the pool's top, above anything a plan reads
        rows = sum(new for _, new, _ in step.seqs)
        return prompt_plan(list(step.seqs), runner.capacity - rows, runner.vocab_size)
    return decode_plan(step.batch, step.prompt_len, step.decoded, runner.vocab_size, shared=step.shared,
                       group=step.group)


def timed(runner: ModelRunner, plans: dict[Any, ForwardPlan], rounds: int) -> dict[Any, float]:
    """Median seconds of one ``runner.execute`` per plan, the plans timed in turn round by round (so
    a slow minute of a shared host hits them alike), after one warm-up each."""
    for plan in plans.values():
        runner.execute(plan)
    ts: dict[Any, list[float]] = {k: [] for k in plans}
    for _ in range(rounds):
        for key, plan in plans.items():
            t0 = time.perf_counter()
            runner.execute(plan)
            ts[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in ts.items()}


def flops_per_token(runner: ModelRunner) -> tuple[float, float]:
    """(The decoder layers' projection FLOPs per token, the LM head's per sampled token), from
    ``ModelArgs.matmul_parameters``."""
    a = runner.model.args
    if a.moe is not None:  # matmul_parameters counts every expert; a token runs only some
        raise SystemExit("workload_estimate.py counts dense models' FLOPs only (this model has experts)")
    head = a.vocab_size * a.hidden_size
    return 2.0 * (a.matmul_parameters - head), 2.0 * head


def estimate(runner: ModelRunner, w: PeerWorkload, chunk: int, step_s: dict[Any, float],
             peak_gflops: float | None) -> dict[str, Any]:
    """The workload's rows priced at the timed steps, and its FLOPs at the peak (module docstring)."""
    prompts, decode = steps_of(w, chunk)
    prompt_s = sum(step_s[step] * n for step, n in prompts)
    decode_s = step_s[decode] / w.batch * w.decode_rows
    prompt_rows = w.groups * w.prefix + w.requests * w.prompt
    layer_flops, head_flops = flops_per_token(runner)
    flops = (prompt_rows + w.decode_rows) * layer_flops + w.output_tokens * head_flops
    total = prompt_s + decode_s
    row: dict[str, Any] = {
        "requests": w.requests, "concurrency": w.batch, "prompt_rows": prompt_rows, "decode_rows": w.decode_rows,
        "output_tokens": w.output_tokens, "mean_decode_context": w.mean_context,
        "decode_step_ms": round(step_s[decode] * 1e3, 2), "prompt_s": round(prompt_s, 2),
        "decode_s": round(decode_s, 2), "steps_s": round(total, 2),
        "steps_output_tok_s": round(w.output_tokens / total, 1), "matmul_tflop": round(flops / 1e12, 3)}
    if peak_gflops:
        floor = flops / (peak_gflops * 1e9)
        row["matmul_floor_s"] = round(floor, 2)
        row["floor_output_tok_s"] = round(w.output_tokens / floor, 1)
    return row


def measured(out_dir: Path, w: PeerWorkload, server: str) -> float:
    """A compare_peers result's output tok/s for one server, checked to be this workload's full run."""
    path = out_dir / f"bench-{w.name}-{server}.json"
    try:
        summary = json.loads(path.read_text())["summary"]
        done, failed, n = int(summary["completed"]), int(summary["failed"]), int(summary["num_requests"])
        rate = float(summary["output_throughput"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a readable lockgate bench result ({e})") from e
    if n != w.requests or done != n or failed:
        raise SystemExit(f"{path}: {done} of {n} requests completed, {failed} failed; this script prices the "
                         f"{w.name} workload's {w.requests} requests (a --quick run does not compare)")
    return rate


def compare(row: dict[str, Any], out_dir: Path, w: PeerWorkload, peer: str | None) -> None:
    """The measured figures of a compare_peers run beside the estimate (module docstring)."""
    peers = [peer] if peer else sorted(p.name.removeprefix(f"bench-{w.name}-").removesuffix(".json")
                                       for p in out_dir.glob(f"bench-{w.name}-vllm*.json"))
    if not (out_dir / f"bench-{w.name}-lockgate.json").is_file() or not peers:
        row["measured"] = None  # this run did not have the workload
        return
    ours = measured(out_dir, w, "lockgate")
    rates = {p: measured(out_dir, w, p) for p in peers}
    best = max(rates, key=lambda p: rates[p])
    row["measured_output_tok_s"] = {"lockgate": ours, **rates}
    row["peer"] = best
    row["lockgate_vs_steps"] = round(ours / row["steps_output_tok_s"], 3)
    row["ratio"] = round(ours / rates[best], 3)
    row["target_output_tok_s"] = round(LEAD * rates[best], 1)
    row["target_vs_steps"] = round(LEAD * rates[best] / row["steps_output_tok_s"], 3)
    if "floor_output_tok_s" in row:
        row["target_vs_floor"] = round(LEAD * rates[best] / row["floor_output_tok_s"], 3)


def arithmetic_peak() -> tuple[dict[str, Any], float | None]:
    """The record of the CPU's peaks and the floor's rate (GFLOP/s on every CPU), or None where
    the floor is not given (AMX, or nothing measurable)."""
    if "amx_bf16" in cpu_description()["flags"].split():
        return {"none": "this CPU has AMX, whose tiles oneDNN may use: no floor is given"}, None
    try:
        # the best of three short runs: another tenant's minute on the second CPU shows up as a
        # lower figure, never a higher one
        runs = [instruction_peak.measure(0.3) for _ in range(3)]
    except SystemExit as e:
        return {"none": str(e)}, None
    cpus = runs[0][0]
    best = {kind: max(r[1][kind]["all_threads"] for r in runs) for kind in runs[0][1] if runs[0][1][kind]}
    kind = max(best, key=lambda k: best[k])
    return {"threads": cpus, "all_threads_gflops": best, "floor_kind": kind}, best[kind]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--chunk", type=int, default=1024,
                    help="prompt rows per step (the server's --max-prefill-tokens), 1024 .. 16384")
    ap.add_argument("--rounds", type=int, default=5, help="timings per step shape (median)")
    ap.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS))
    ap.add_argument("--compare", type=Path, help="a compare_peers.py --out-dir to set the estimate beside")
    ap.add_argument("--peer", help="the peer's name in that directory's file names (default: the faster vllm-*)")
    args = ap.parse_args()
    longest = max(w.prefix or w.prompt for w in WORKLOADS)
    if not longest <= args.chunk <= 16384:
        ap.error(f"--chunk must be within {longest} .. 16384 (whole prompts and prefixes per step), got {args.chunk}")
    if not 1 <= args.rounds <= 100:
        ap.error(f"--rounds must be within 1 .. 100, got {args.rounds}")
    names = args.workloads.split(",")
    unknown = set(names) - {w.name for w in WORKLOADS}
    chosen = [w for w in WORKLOADS if w.name in names]
    if unknown or not chosen:
        ap.error(f"--workloads: unknown {sorted(unknown)}; choose from {[w.name for w in WORKLOADS]}")
    if args.compare is not None and not args.compare.is_dir():
        ap.error(f"--compare: {args.compare} is not a directory")

    extra = scheduler_env(os.environ)  # the server's malloc tunables (module docstring), then run again
    if extra:
        os.execve(sys.executable, sys.orig_argv, {**os.environ, **extra})
    peak_record, peak_gflops = arithmetic_peak()
    runner = ModelRunner(ModelConfig(model=args.model, dtype="auto"), CacheConfig(max_total_tokens=POOL_SLOTS))
    runner.k_cache.normal_()  # the pool is torch.empty: give the synthetic contexts finite K/V
    runner.v_cache.normal_()
    steps: dict[Any, None] = {}  # every step shape the workloads need, each timed once
    for w in chosen:
        prompts, decode = steps_of(w, args.chunk)
        steps.update(dict.fromkeys([step for step, _ in prompts] + [decode]))
    step_s = timed(runner, {step: build(runner, step) for step in steps}, args.rounds)
    result: dict[str, Any] = {"benchmark": "workload_estimate", "command": command(), "machine": machine(),
                              "dtype": str(runner.dtype).removeprefix("torch."), "peak": peak_record,
                              "workloads": {}}
    for w in chosen:
        row = estimate(runner, w, args.chunk, step_s, peak_gflops)
        if args.compare is not None:
            compare(row, args.compare, w, args.peer)
        result["workloads"][w.name] = row
        print(f"[workload_estimate] {w.name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
