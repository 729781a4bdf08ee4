"""What lockgate's own steps make of compare_peers' throughput workloads on this CPU, what the
arithmetic alone allows, and where a 1.5x lead over a peer's measured figure falls between them.

For each workload of ``benchmarks/compare_peers.py`` that issue 16 sets a throughput target on
(uniform at c = 32, uniform-high at c = 128, mixed, shared-prefix; their default sizes), this script
times the model runner's steps directly (``step_profile``'s way: plans built by hand, no scheduler,
no server) and prices the workload's rows with them:

* prompt rows in steps of ``--chunk`` rows (the server's ``--max-prefill-tokens`` default), packed
  from whole prompts; a shared prefix once per group (one 1,024-row step), the groups' suffixes
  packed 16 to a step on top of their prefixes;
* decoded tokens (every output token but each request's first, which its last prompt step samples)
  at the per-row time of a full decode step of the workload's concurrency at its mean context
  (shared-prefix: 8 rows to a prefix, the most its batches can share).

``steps_s`` is that sum: an estimate of the engine's work, not a bound. The server lands near it
(round 32's run: 0.87-1.03 of its output tok/s): above it where n-gram speculation's guesses are
accepted (a guess row shares its request's key reads and fills the step's matmuls), below it where
batches run partly empty, the scheduler and the server's processes take their share, or the host
has a slow minute. ``matmul_floor_s`` is a bound: the workload's projection and LM-head FLOPs (from
the model's shapes) at this CPU's bf16 instruction peak (``VDPBF16PS`` on every CPU the process may
use; ``instruction_peak.py``, the best of three), attention left out. No exact bf16 kernel gets below
it. It is given for bf16 runs only: a float32 run's forms include the integer GEMM, whose VNNI
instructions do more multiply-adds than float32 FMA, so a float32 floor would bound nothing.

``--compare DIR`` (a ``compare_peers.py --out-dir``) adds each server's measured output tok/s, the
ratio, and 1.5x the peer's figure against both: ``target_vs_steps`` above 1 means the target needs
steps cheaper than lockgate's kernels make them (or more speculation than the workload gives);
``target_vs_floor`` above 1 would mean no exact kernel could reach it.

Prints one JSON line (machine, command, per workload: the work, the step times, the estimate, the
floor and the comparison). About 40 s on 2 cores. Usage:

  .venv/bin/python benchmarks/workload_bound.py [--compare /tmp/run] [--peer vllm-allcores] [--rounds 5]

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
from typing import Any

import numpy as np
import torch
from _common import command, machine
from instruction_peak import measure as instruction_peak
from step_profile import decode_plan, greedy

from lockgate.config import CacheConfig, ModelConfig
from lockgate.plan import ForwardPlan
from lockgate.runner.model_runner import ModelRunner
from lockgate.server.launch import scheduler_env

I64 = np.int64
LEAD = 1.5  # issue 16's target ratio


@dataclass(frozen=True)
class Workload:
    """A compare_peers workload at its default size (compare_peers.py's module docstring)."""

    name: str
    requests: int
    prompt: int  # tokens per prompt (for shared-prefix: the unique suffix)
    outputs: tuple[int, ...]  # output tokens, cycled over the requests
    batch: int  # the concurrency: decode rows per full step
    prefix: int = 0  # shared-prefix: the prefix every request of a group shares
    groups: int = 0

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs[i % len(self.outputs)] for i in range(self.requests))

    @property
    def mean_context(self) -> int:
        """The mean keys a decode row attends to: prefix, prompt and half the mean output."""
        return self.prefix + self.prompt + self.output_tokens // (2 * self.requests)


WORKLOADS = (
    Workload("uniform", 128, 256, (128,), 32),
    Workload("uniform-high", 128, 256, (128,), 128),
    Workload("mixed", 128, 256, (16, 512), 32),
    Workload("shared-prefix", 128, 64, (64,), 32, prefix=1024, groups=16),
)


def chunk_plan(seqs: list[tuple[int, int, int]], first_slot: int, vocab: int) -> ForwardPlan:
    """One prompt step: per sequence (keys it holds before the step on a shared run starting at
    ``shared_slot``, or 0 for none: ``held``; its new tokens: ``new``; ``shared_slot``), each new
    token's slot taken from a fresh run from ``first_slot``; every sequence sampled (its last row)."""
    ids, pos, out, qlens, slens, kv, offs = [], [], [], [], [], [], [0]
    nxt = first_slot
    for held, new, shared_slot in seqs:
        fresh = np.arange(nxt, nxt + new, dtype=I64)
        nxt += new
        kv.append(np.concatenate([np.arange(shared_slot, shared_slot + held, dtype=I64), fresh]))
        offs.append(offs[-1] + held + new)
        ids.append((np.arange(held, held + new, dtype=I64) * 7919) % vocab)
        pos.append(np.arange(held, held + new, dtype=I64))
        out.append(fresh)
        qlens.append(new)
        slens.append(held + new)
    return ForwardPlan(
        input_ids=np.concatenate(ids), positions=np.concatenate(pos), out_slots=np.concatenate(out),
        query_lens=np.array(qlens, I64), seq_lens=np.array(slens, I64), kv_slots=np.concatenate(kv),
        kv_offsets=np.array(offs, I64), sample_rows=np.arange(len(seqs), dtype=I64), sampling=greedy(len(seqs)))


StepKey = tuple  # ("prompt", ((held, new, shared_slot), ...)) or ("decode", batch, prompt_len, decoded, shared)


def timed(runner: ModelRunner, plans: dict[StepKey, ForwardPlan], rounds: int) -> dict[StepKey, float]:
    """Median seconds of one ``runner.execute`` per plan, the plans timed in turn round by round (so
    a slow minute of a shared host hits them alike), after one warm-up each."""
    for plan in plans.values():
        runner.execute(plan)
    ts: dict[StepKey, list[float]] = {k: [] for k in plans}
    for _ in range(rounds):
        for key, plan in plans.items():
            t0 = time.perf_counter()
            runner.execute(plan)
            ts[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in ts.items()}


def flops_per_token(runner: ModelRunner) -> tuple[float, float]:
    """(The decoder layers' projection FLOPs per token, the LM head's per sampled token.)"""
    a = runner.model.args
    if a.moe is not None:
        raise SystemExit("workload_bound.py counts dense models' FLOPs only (this model has experts)")
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    per_layer = a.hidden_size * (q + 2 * kv) + q * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
    return 2.0 * a.num_layers * per_layer, 2.0 * a.hidden_size * a.vocab_size


def steps_of(w: Workload, chunk: int) -> tuple[list[tuple[StepKey, int]], StepKey]:
    """The workload's prompt steps (shape, how many) and its decode step's shape; see the module
    docstring. Suffixes of shared-prefix requests sit on their group's prefix at slots 0 .. prefix."""
    prompts: list[tuple[StepKey, int]] = []
    if w.prefix:
        prompts.append((("prompt", ((0, w.prefix, 0),)), w.groups))
    per = max(1, chunk // w.prompt)
    full, rest = divmod(w.requests, per)
    for n, count in ((per, full), (rest, 1)):
        if n and count:
            prompts.append((("prompt", ((w.prefix, w.prompt, 0),) * n), count))
    prompt_len = w.prefix + w.prompt
    return prompts, ("decode", w.batch, prompt_len, w.mean_context - prompt_len, w.prefix)


def build(runner: ModelRunner, key: StepKey, chunk: int) -> ForwardPlan:
    """The plan of one step shape (prompt steps write their fresh tokens at the pool's top)."""
    if key[0] == "prompt":
        return chunk_plan(list(key[1]), runner.capacity - chunk - 8, runner.vocab_size)
    _, batch, prompt_len, decoded, shared = key
    return decode_plan(batch, prompt_len, decoded, runner.vocab_size, shared=shared, group=8)


def estimate(runner: ModelRunner, w: Workload, chunk: int, step_s: dict[StepKey, float]) -> dict[str, Any]:
    """The workload's rows priced at the timed steps (see the module docstring)."""
    prompts, decode = steps_of(w, chunk)
    prompt_s = sum(step_s[key] * n for key, n in prompts)
    decode_rows = w.output_tokens - w.requests  # each request's first token comes from its prompt step
    decode_s = step_s[decode] / w.batch * decode_rows
    prompt_rows = w.groups * w.prefix + w.requests * w.prompt
    layer_flops, head_flops = flops_per_token(runner)
    flops = (prompt_rows + decode_rows) * layer_flops + w.output_tokens * head_flops
    total = prompt_s + decode_s
    return {"requests": w.requests, "concurrency": w.batch, "prompt_rows": prompt_rows, "decode_rows": decode_rows,
            "output_tokens": w.output_tokens, "mean_decode_context": w.mean_context,
            "decode_step_ms": round(step_s[decode] * 1e3, 2), "prompt_s": round(prompt_s, 2),
            "decode_s": round(decode_s, 2), "steps_s": round(total, 2),
            "steps_output_tok_s": round(w.output_tokens / total, 1), "matmul_tflop": round(flops / 1e12, 3)}


def measured(out_dir: Path, workload: str, server: str) -> float | None:
    """A compare_peers run's output tok/s for one server and workload, or None if it has none."""
    path = out_dir / f"bench-{workload}-{server}.json"
    if not path.is_file():
        return None
    try:
        return float(json.loads(path.read_text())["summary"]["output_throughput"])
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{path}: not a lockgate bench result ({e})") from e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--chunk", type=int, default=1024, help="prompt rows per step (the server's --max-prefill-tokens)")
    ap.add_argument("--rounds", type=int, default=5, help="timings per step shape (median)")
    ap.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS))
    ap.add_argument("--compare", type=Path, help="a compare_peers.py --out-dir to set the estimate beside")
    ap.add_argument("--peer", default="vllm-allcores", help="the peer's name in that directory's file names")
    args = ap.parse_args()
    if not 64 <= args.chunk <= 16384:
        ap.error(f"--chunk must be within 64 .. 16384, got {args.chunk}")
    if not 1 <= args.rounds <= 100:
        ap.error(f"--rounds must be within 1 .. 100, got {args.rounds}")
    chosen = [w for w in WORKLOADS if w.name in args.workloads.split(",")]
    unknown = set(args.workloads.split(",")) - {w.name for w in WORKLOADS}
    if unknown or not chosen:
        ap.error(f"--workloads: unknown {sorted(unknown)}; choose from {[w.name for w in WORKLOADS]}")
    if args.compare is not None and not args.compare.is_dir():
        ap.error(f"--compare: {args.compare} is not a directory")

    extra = scheduler_env(os.environ)  # the pool on huge pages, as `lockgate serve` has it
    if extra:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **extra})
    # the peak is a maximum: the best of three short measurements (another tenant's minute on the
    # second CPU shows up as a lower figure, never a higher one)
    runs = [instruction_peak(0.3) for _ in range(3)]
    cpus = runs[0][0]
    peak = {kind: None if runs[0][1][kind] is None else
            {label: max(r[1][kind][label] for r in runs) for label in runs[0][1][kind]} for kind in runs[0][1]}
    # the largest decode plan (128 x ~321 keys) and a prompt step's fresh slots above it
    runner = ModelRunner(ModelConfig(model=args.model, dtype="auto"), CacheConfig(max_total_tokens=60_000))
    runner.k_cache.normal_()  # the pool is torch.empty: give the synthetic contexts finite K/V
    runner.v_cache.normal_()
    # The floor is a bound only for a bf16 run on VDPBF16PS: a float32 run's forms include the integer
    # GEMM (VNNI), which does more multiply-adds per instruction than float32 FMA; none is given then.
    bf16 = runner.dtype == torch.bfloat16 and peak.get("bf16_dot") is not None
    kind = "bf16_dot" if bf16 else None
    peak_gflops = peak["bf16_dot"]["all_threads"] if bf16 else None
    result: dict[str, Any] = {"benchmark": "workload_bound", "command": command(), "machine": machine(),
                              "dtype": str(runner.dtype).removeprefix("torch."),
                              "instruction_peak_gflops": {"kind": kind, "threads": cpus, "all_threads": peak_gflops},
                              "workloads": {}}
    shapes: dict[StepKey, None] = {}  # every step shape the workloads need, each timed once
    for w in chosen:
        prompts, decode = steps_of(w, args.chunk)
        shapes.update(dict.fromkeys([key for key, _ in prompts] + [decode]))
    step_s = timed(runner, {key: build(runner, key, args.chunk) for key in shapes}, args.rounds)
    for w in chosen:
        row = estimate(runner, w, args.chunk, step_s)
        if peak_gflops:
            floor = row["matmul_tflop"] * 1e12 / (peak_gflops * 1e9)
            row["matmul_floor_s"] = round(floor, 2)
            row["floor_output_tok_s"] = round(w.output_tokens / floor, 1)
        if args.compare is not None:
            ours, peer = measured(args.compare, w.name, "lockgate"), measured(args.compare, w.name, args.peer)
            row["measured_output_tok_s"] = {"lockgate": ours, args.peer: peer}
            if ours:
                row["lockgate_vs_steps"] = round(ours / row["steps_output_tok_s"], 3)
            if ours and peer:
                row["ratio"] = round(ours / peer, 3)
            if peer:
                row["target_output_tok_s"] = round(LEAD * peer, 1)
                row["target_vs_steps"] = round(LEAD * peer / row["steps_output_tok_s"], 3)
                if peak_gflops:
                    row["target_vs_floor"] = round(LEAD * peer / row["floor_output_tok_s"], 3)
        result["workloads"][w.name] = row
        print(f"[workload_bound] {w.name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
