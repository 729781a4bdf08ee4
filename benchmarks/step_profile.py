"""Engine step times: decode at batch 1 / 32 / 64 and one long prefill, per dtype and thread count.

Prints one JSON line (machine, command, median milliseconds per step for every case and
variant). Plans are built directly (no scheduler) so the figures are the runner's own cost:
metadata, the model forward, the LM head and the sampler. Decode contexts are laid out the way
the scheduler lays them out: each sequence's prompt in one contiguous run, then the decoded
tokens interleaved with the other sequences' (one run per decode step). Variants (dtype x
threads) are measured interleaved, round by round, so a noisy machine hits them alike.

``--profile`` adds a torch.profiler breakdown per case and variant: the share of the step's wall
time in matmuls, attention, K/V gathers and writes, other ops, and what is left (Python and
dispatch), plus the top ops.

Usage:  .venv/bin/python benchmarks/step_profile.py [--dtypes bfloat16,float32] [--quantization auto,none]
        [--fp32-matmul-rows auto,off] [--cpu-kernels auto,off] [--matmul-forms "auto;dense;int-gemm:64,dense"]
        [--tuning auto,off] [--exact-prefill off,on] [--threads 2,1] [--mixed 256]
        [--batches 1,32,64] [--prompt-len 256] [--decoded 64] [--prefill 1024] [--rounds 5] [--profile]
        [--shared-prefix 1024 --group-size 8 [--no-prefix-attention]] [--kv-cache-dtypes auto,int8]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from _common import command, machine

from lockgate.config import CacheConfig, ModelConfig
from lockgate.layers import attention_meta, kv_quant
from lockgate.plan import ForwardPlan, SamplingBatch
from lockgate.runner.model_runner import ModelRunner

I64 = np.int64

# torch.profiler op name -> bucket (first matching prefix wins; the rest is "other ops").
BUCKETS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn::_linear",
                "aten::_weight_int4pack_mm", "lockgate::quant_linear", "lockgate::int_linear")),
    ("attention", ("aten::_scaled_dot_product", "aten::scaled_dot_product", "lockgate::decode_attention",
                   "lockgate::prefill_attention")),
    ("kv gather/write", ("aten::index_select", "aten::index_copy", "aten::index")),
    ("sampler", ("aten::argmax", "aten::logsumexp", "aten::topk")),
)


def greedy(s: int) -> SamplingBatch:
    return SamplingBatch(
        temperature=np.zeros(s, np.float32), top_p=np.ones(s, np.float32), top_k=np.zeros(s, I64),
        min_p=np.zeros(s, np.float32), repetition_penalty=np.ones(s, np.float32),
        frequency_penalty=np.zeros(s, np.float32), presence_penalty=np.zeros(s, np.float32),
        seeds=np.zeros(s, I64), has_seed=np.zeros(s, bool), seed_steps=np.zeros(s, I64),
        num_logprobs=np.full(s, -1, I64))


def decode_plan(batch: int, prompt_len: int, decoded: int, vocab: int, shared: int = 0,
                group: int = 8) -> ForwardPlan:
    """``batch`` sequences of prompt_len + decoded tokens, each decoding its next token.

    With ``shared`` > 0, sequences come in groups of ``group`` whose first ``shared`` prompt tokens
    are the same slot run (prefix-cache hits on one prompt prefix)."""
    ctx = []
    own = prompt_len - shared
    groups = -(-batch // group) if shared else 0
    base = groups * shared  # slots 0 .. base - 1: the groups' shared prefixes
    for b in range(batch):
        prompt = base + np.arange(b * own, (b + 1) * own, dtype=I64)  # one run per prompt (its own part)
        if shared:
            g = b // group
            prompt = np.concatenate([np.arange(g * shared, (g + 1) * shared, dtype=I64), prompt])
        steps = base + batch * own + np.arange(decoded + 1, dtype=I64) * batch + b  # one run per step
        ctx.append(np.concatenate([prompt, steps]))
    seq_len = prompt_len + decoded + 1
    kv_slots = np.concatenate(ctx)
    return ForwardPlan(
        input_ids=(np.arange(batch, dtype=I64) * 7919) % vocab, positions=np.full(batch, seq_len - 1, I64),
        out_slots=np.array([c[-1] for c in ctx], I64), query_lens=np.ones(batch, I64),
        seq_lens=np.full(batch, seq_len, I64), kv_slots=kv_slots,
        kv_offsets=np.arange(batch + 1, dtype=I64) * seq_len, sample_rows=np.arange(batch, dtype=I64),
        sampling=greedy(batch))


def prompt_plan(seqs: list[tuple[int, int, int]], first_slot: int, vocab: int) -> ForwardPlan:
    """One prompt step of several sequences, each given as (keys it already holds, new tokens, the
    first slot of the held keys: a prefix already in the pool, read in place). The new tokens take
    one contiguous slot run from ``first_slot`` on, sequence after sequence; every sequence is
    sampled at its last row."""
    ids, pos, out, kv, offs = [], [], [], [], [0]
    nxt = first_slot
    for held, new, held_from in seqs:
        fresh = np.arange(nxt, nxt + new, dtype=I64)
        nxt += new
        kv.append(np.concatenate([np.arange(held_from, held_from + held, dtype=I64), fresh]))
        offs.append(offs[-1] + held + new)
        ids.append((np.arange(held, held + new, dtype=I64) * 7919) % vocab)
        pos.append(np.arange(held, held + new, dtype=I64))
        out.append(fresh)
    n = len(seqs)
    return ForwardPlan(
        input_ids=np.concatenate(ids), positions=np.concatenate(pos), out_slots=np.concatenate(out),
        query_lens=np.array([new for _, new, _ in seqs], I64), seq_lens=np.array([h + w for h, w, _ in seqs], I64),
        kv_slots=np.concatenate(kv), kv_offsets=np.array(offs, I64), sample_rows=np.arange(n, dtype=I64),
        sampling=greedy(n))


def prefill_plan(n: int, first_slot: int, vocab: int) -> ForwardPlan:
    """One sequence prefilling ``n`` prompt tokens into a contiguous slot run."""
    return prompt_plan([(0, n, 0)], first_slot, vocab)


def mixed_plan(dec: ForwardPlan, pre: ForwardPlan) -> ForwardPlan:
    """A decode step and a prefill chunk in one step (decode rows first, as the scheduler lays
    them out); their slots must not overlap."""
    b = dec.num_seqs
    return ForwardPlan(
        input_ids=np.concatenate([dec.input_ids, pre.input_ids]), positions=np.concatenate([dec.positions, pre.positions]),
        out_slots=np.concatenate([dec.out_slots, pre.out_slots]), query_lens=np.concatenate([dec.query_lens, pre.query_lens]),
        seq_lens=np.concatenate([dec.seq_lens, pre.seq_lens]), kv_slots=np.concatenate([dec.kv_slots, pre.kv_slots]),
        kv_offsets=np.concatenate([dec.kv_offsets, dec.kv_offsets[-1] + pre.kv_offsets[1:]]),
        sample_rows=np.concatenate([dec.sample_rows, b + pre.sample_rows]), sampling=greedy(b + 1), num_decode_rows=b)


def bucket_of(name: str) -> str:
    for bucket, prefixes in BUCKETS:
        if name.startswith(prefixes):
            return bucket
    return "other ops"


def profile(runner: ModelRunner, plan: ForwardPlan, steps: int) -> dict[str, Any]:
    """Share of wall time per bucket (self CPU time of top-level aten ops) and the top ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.execute(plan)
        wall_us = (time.perf_counter() - t0) * 1e6
    per_bucket: dict[str, float] = defaultdict(float)
    per_op: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        per_op[ev.key] += ev.self_cpu_time_total
        per_bucket[bucket_of(ev.key)] += ev.self_cpu_time_total
    covered = sum(per_bucket.values())
    share = {k: round(100 * v / wall_us, 1) for k, v in sorted(per_bucket.items(), key=lambda kv: -kv[1])}
    share["python/dispatch (rest)"] = round(100 * (wall_us - covered) / wall_us, 1)
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:8]
    return {"step_ms_profiled": round(wall_us / steps / 1e3, 2), "share_pct": share,
            "top_ops_ms_per_step": {k: round(v / steps / 1e3, 2) for k, v in top}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--quantization", default="auto", help="comma list of --quantization modes (auto,none,int4)")
    ap.add_argument("--fp32-matmul-rows", default="auto", help="comma list of --fp32-matmul-rows settings")
    ap.add_argument("--cpu-kernels", default="auto", help="comma list of --cpu-kernels settings (auto,off)")
    ap.add_argument("--matmul-forms", default="auto", help="semicolon list of --matmul-forms settings (auto = "
                    "the measured table; a form, e.g. dense or int-gemm; or spans, e.g. int-gemm:64,dense)")
    ap.add_argument("--tuning", default="auto", help="comma list of --tuning settings (auto, off, refresh)")
    ap.add_argument("--deterministic", default="off", help="comma list of --deterministic settings (off,on)")
    ap.add_argument("--exact-prefill", default="on", help="comma list of --exact-prefill settings (off,on)")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma list of --kv-cache-dtype settings (auto,int8,fp8)")
    ap.add_argument("--mixed", type=int, default=0,
                    help="add a case: the largest decode batch and a prefill chunk of this many tokens in one step")
    ap.add_argument("--threads", default=str(torch.get_num_threads()), help="comma list of torch thread counts")
    ap.add_argument("--batches", default="1,32,64", help="decode batch sizes")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of each decoding sequence")
    ap.add_argument("--decoded", type=int, default=64, help="tokens each decoding sequence generated so far")
    ap.add_argument("--prefill", type=int, default=1024, help="tokens of the prefill case (0: skip)")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="decode cases: the first N prompt tokens are shared by groups of --group-size sequences")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--no-prefix-attention", action="store_true",
                    help="attend to shared prefixes like any other keys (gathered per sequence): the old path")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each times every case")
    ap.add_argument("--steps", type=int, default=0, help="steps per timing (default: by batch size)")
    ap.add_argument("--profile", action="store_true", help="add a torch.profiler breakdown")
    args = ap.parse_args()
    if args.shared_prefix and args.shared_prefix >= args.prompt_len:
        ap.error(f"--shared-prefix ({args.shared_prefix}) is part of each prompt: give a longer --prompt-len "
                 f"(got {args.prompt_len}), e.g. --prompt-len {args.shared_prefix + 64}")
    if args.no_prefix_attention:
        attention_meta.MIN_SHARED_PREFIX = 1 << 40  # read by AttentionMetadata.build

    batches = [int(b) for b in args.batches.split(",") if b]
    threads = [int(t) for t in args.threads.split(",")]
    seq = args.prompt_len + args.decoded + 1
    capacity = max(batches) * seq + max(batches) + args.prefill + args.mixed + 8
    runners = {f"{d}/{q}/fp32-{f}/kernels-{k}/forms-{m}/tuning-{t}" + ("/deterministic" if det == "on" else "")
               + ("/inexact" if ex == "off" else "") + ("" if kv == "auto" else f"/kv-{kv}"):
               ModelRunner(ModelConfig(model=args.model, dtype=d, quantization=q, fp32_matmul_rows=f, cpu_kernels=k,
                                       matmul_forms=m, tuning=t, deterministic=det == "on", exact_prefill=ex == "on"),
                           CacheConfig(max_total_tokens=capacity, kv_cache_dtype=kv))
               for d in args.dtypes.split(",") for q in args.quantization.split(",")
               for f in args.fp32_matmul_rows.split(",") for k in args.cpu_kernels.split(",")
               for m in args.matmul_forms.split(";") for t in args.tuning.split(",")
               for det in args.deterministic.split(",") for ex in args.exact_prefill.split(",")
               for kv in args.kv_cache_dtypes.split(",")}
    for r in runners.values():  # give the synthetic contexts finite K/V (an 8-bit pool: quantized normal values)
        for pool in (r.k_cache, r.v_cache):
            for layer in pool:
                if kv_quant.is_quantized(layer):
                    kind = "int8" if layer.dtype == torch.int8 else "fp8"
                    layer.copy_(kv_quant.quantize(torch.randn(*layer.shape[:-1], kv_quant.head_dim(layer)), kind))
                else:
                    layer.normal_()
    vocab = next(iter(runners.values())).vocab_size
    cases: dict[str, ForwardPlan] = {f"decode_b{b}": decode_plan(b, args.prompt_len, args.decoded, vocab,
                                                                  args.shared_prefix, args.group_size)
                                     for b in batches}
    if args.prefill:
        cases[f"prefill_{args.prefill}"] = prefill_plan(args.prefill, capacity - args.prefill, vocab)
    if args.mixed:
        b = max(batches)
        cases[f"mixed_b{b}+{args.mixed}"] = mixed_plan(
            cases[f"decode_b{b}"], prefill_plan(args.mixed, capacity - args.prefill - args.mixed, vocab))
    variants = list(itertools.product(runners, threads))

    def steps_for(plan: ForwardPlan) -> int:
        return args.steps or max(2, min(10, 512 // plan.num_tokens))

    for (dtype, n_threads), plan in itertools.product(variants, cases.values()):  # warm-up: every shape once
        torch.set_num_threads(n_threads)
        runners[dtype].execute(plan)
    times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(args.rounds):
        for (dtype, n_threads), (name, plan) in itertools.product(variants, cases.items()):
            torch.set_num_threads(n_threads)
            n = steps_for(plan)
            t0 = time.perf_counter()
            for _ in range(n):
                runners[dtype].execute(plan)
            times[f"{dtype}/t{n_threads}"][name].append((time.perf_counter() - t0) / n * 1e3)
    result: dict[str, Any] = {
        "benchmark": "step_profile", "command": command(), "machine": machine(),
        "setup": {"prompt_len": args.prompt_len, "decoded": args.decoded, "context": seq, "rounds": args.rounds,
                  "shared_prefix": args.shared_prefix, "group_size": args.group_size,
                  "prefix_attention": not args.no_prefix_attention},
        "median_step_ms": {v: {c: round(statistics.median(ts), 2) for c, ts in per.items()}
                           for v, per in times.items()},
    }
    if args.profile:
        result["profile"] = {}
        for (dtype, n_threads), (name, plan) in itertools.product(variants, cases.items()):
            torch.set_num_threads(n_threads)
            result["profile"][f"{dtype}/t{n_threads}/{name}"] = profile(runners[dtype], plan, steps_for(plan))
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
