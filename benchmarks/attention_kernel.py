"""lockgate's attention kernel at serving shapes, per layer: prefill runs, decode batches, a mixed step,
guess rows, decode rows on shared prefixes.

Prints one JSON line (machine, command, median milliseconds per layer for every case and build).
The KV pool has ``--layers`` layers and every timing cycles through them, as a step does, so the
keys come from memory and not from a cache that holds one layer (a decode batch of 32 at 321
keys reads 7.9 MB of K/V per layer; 30 layers do not fit in any cache). Builds are measured
interleaved, round by round, so a noisy machine hits them alike.

``--compare NAME=PATH`` adds another build of the same operators: a shared library made from an
edited or older copy of ``decode_attention.cpp`` whose ``TORCH_LIBRARY`` namespace was renamed to
NAME (how the kernel's before/after figures in docs/performance.md are measured: the old kernel's source from
git with ``lockgate`` replaced by ``lgold``, built with ``torch.utils.cpp_extension.load``).

Usage:  .venv/bin/python benchmarks/attention_kernel.py [--heads 9 --kv-heads 3 --head-dim 64]
        [--dtype bfloat16] [--layers 30] [--rounds 5] [--compare lgold=/tmp/build/lgold.so]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _common import command, machine

from lockgate import kernels


def csr(ctx: list[torch.Tensor], new: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots, key offsets and query offsets for sequences with these key slots and new tokens."""
    offsets, q_offsets = [0], [0]
    for s, n in zip(ctx, new, strict=True):
        offsets.append(offsets[-1] + len(s))
        q_offsets.append(q_offsets[-1] + n)
    return torch.cat(ctx), torch.tensor(offsets), torch.tensor(q_offsets)


def cases(heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, tuple]:
    """Prompts on contiguous slot runs (as the allocator hands them out), decode contexts as the
    scheduler leaves them: a prompt run, then one token per step interleaved with the batch's."""
    def prompt(first: int, n: int) -> torch.Tensor:
        return torch.arange(first, first + n)

    def decode_ctx(batch: int, prompt_len: int, decoded: int, base: int) -> list[torch.Tensor]:
        own = [prompt(base + b * prompt_len, prompt_len) for b in range(batch)]
        steps = base + batch * prompt_len
        return [torch.cat([own[b], steps + torch.arange(decoded) * batch + b]) for b in range(batch)]

    dec = decode_ctx(32, 256, 65, 0)
    # 32 decode rows in 4 groups of 8 on 1,024-token prompt prefixes (one slot run each, as the prefix
    # cache hands them out), 100 keys of their own each; and the same key counts with no prefix shared
    prefixes = [prompt(g * 1024, 1024) for g in range(4)]
    shared = [torch.cat([prefixes[b // 8], prompt(4096 + b * 100, 100)]) for b in range(32)]
    unshared = [prompt(b * 1124, 1124) for b in range(32)]
    # the same rows in the order a shared-prefix workload's batch has them: the groups taken in turn
    interleaved = [shared[(i % 4) * 8 + i // 4] for i in range(32)]
    # 32 requests each fed its newest token and 2 guesses: rows whose keys extend each other by one
    guessed = [c[:len(c) - 2 + j] for c in decode_ctx(32, 256, 67, 0) for j in range(3)]
    out = {
        "prefill_256": ([prompt(0, 256)], [256]),
        "prefill_4x256": ([prompt(i * 256, 256) for i in range(4)], [256] * 4),
        "prefill_1024": ([prompt(0, 1024)], [1024]),
        "chunk_1024_on_2048": ([prompt(0, 2048)], [1024]),
        "decode_b1_ctx321": (decode_ctx(1, 256, 65, 0), [1]),
        "decode_b32_ctx321": (dec, [1] * 32),
        "decode_b128_ctx321": (decode_ctx(128, 256, 65, 0), [1] * 128),
        "mixed_b32_ctx321+256": (dec + [prompt(20000, 256)], [1] * 32 + [256]),
        "decode_b32_x3_guess_rows": (guessed, [1] * 96),
        "decode_b32_shared_4x1024+100": (shared, [1] * 32),
        "decode_b32_shared_interleaved": (interleaved, [1] * 32),
        "decode_b32_unshared_1124": (unshared, [1] * 32),
    }
    gen = torch.Generator().manual_seed(0)
    built = {}
    for name, (ctx, new) in out.items():
        slots, offsets, q_offsets = csr(ctx, new)
        q = torch.randn(int(q_offsets[-1]), heads, head_dim, generator=gen).to(dtype)
        built[name] = (q, slots, offsets, q_offsets)
    return built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--capacity", type=int, default=48000, help="pool slots per layer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare", action="append", default=[], metavar="NAME=PATH",
                    help="another build of the operators, its namespace renamed to NAME")
    args = ap.parse_args()
    if not kernels.load():
        raise SystemExit(f"lockgate's kernels did not build: {kernels.error()}")
    builds = {"lockgate": torch.ops.lockgate}
    for spec in args.compare:
        name, _, path = spec.partition("=")
        torch.ops.load_library(path)
        builds[name] = getattr(torch.ops, name)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(1)
    shape = (args.layers, args.capacity, args.kv_heads, args.head_dim)
    k_pool = torch.randn(shape, generator=gen).to(dtype)
    v_pool = torch.randn(shape, generator=gen).to(dtype)
    scale = args.head_dim ** -0.5
    work = cases(args.heads, args.head_dim, dtype)
    times: dict[str, dict[str, list[float]]] = {b: {c: [] for c in work} for b in builds}
    for _ in range(args.rounds):
        for case, (q, slots, offsets, q_offsets) in work.items():
            for name, ops in builds.items():
                ops.prefill_attention(q, k_pool[0], v_pool[0], slots, offsets, q_offsets, scale)
                t0 = time.perf_counter()
                for layer in range(args.layers):
                    ops.prefill_attention(q, k_pool[layer], v_pool[layer], slots, offsets, q_offsets, scale)
                times[name][case].append((time.perf_counter() - t0) / args.layers * 1e3)
    median = {b: {c: round(statistics.median(v), 3) for c, v in per.items()} for b, per in times.items()}
    result = {"benchmark": "attention_kernel", "command": command(), "machine": machine(),
              "setup": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                        "dtype": args.dtype, "layers": args.layers, "rounds": args.rounds},
              "median_ms_per_layer": median}
    if len(builds) > 1:
        result["speedup_vs"] = {b: {c: round(median[b][c] / median["lockgate"][c], 2) for c in work}
                                for b in builds if b != "lockgate"}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
