"""The three projection kernels of ``lockgate.layers.linear`` side by side, per row count.

For each row count, times one pass over all projections of a model's layers (QKV, O, gate/up,
down; distinct random weights per layer, so they stream from memory as in a real step) plus the
LM head, with each kernel: oneDNN-packed bf16 (the dense form), torch's int4 weight-only kernel
(groups of 32) and float32 sgemm on bf16 activations (cast up and back, as the float32 form does).
The crossovers are where ``INT4_MAX_ROWS`` (int4 below) and ``FP32_MIN_ROWS`` (float32 above)
come from; run it on another CPU to see whether they hold there. Kernels are timed interleaved,
round by round, and the median is kept. Prints one JSON line (machine, command, ms per pass).

Usage:  .venv/bin/python benchmarks/matmul_tiers.py [--rows 1,4,16,32,64,256,1024] [--rounds 5]
        [--hidden 576 --intermediate 1536 --qkv 960 --layers 30 --vocab 49152]   (default: SmolLM2-135M)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import command, machine

GROUP = 32


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,48,64,128,256,512,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--qkv", type=int, default=960, help="rows of the fused QKV weight ((H + 2 Hkv) * D)")
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    torch.manual_seed(0)
    h, f = args.hidden, args.intermediate
    shapes = [(args.qkv, h), (h, h), (2 * f, h), (h, f)]  # [N, K] of qkv, o, gate_up, down

    def forms(n: int, k: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        w = torch.randn(n, k) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1)
        codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        sz = (torch.rand(k // GROUP, n, 2) * 0.01).bfloat16()
        return {
            "bf16_packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            "int4": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, GROUP, sz),
            "fp32_sgemm": lambda x: F.linear(x.float(), w).to(x.dtype),
        }

    layers = [[(k, forms(n, k)) for n, k in shapes] for _ in range(args.layers)]
    head = forms(args.vocab, h)

    def one_pass(kernel: str, rows: int) -> float:
        xs = {k: torch.randn(rows, k).bfloat16() for k in (h, f)}
        t0 = time.perf_counter()
        for layer in layers:
            for k, fs in layer:
                fs[kernel](xs[k])
        head[kernel](xs[h])
        return (time.perf_counter() - t0) * 1e3

    row_counts = [int(r) for r in args.rows.split(",")]
    kernels = ("bf16_packed", "int4", "fp32_sgemm")
    times: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    with torch.inference_mode():
        for rows in row_counts:
            for kernel in kernels:
                one_pass(kernel, rows)  # warm-up
        for _ in range(args.rounds):
            for rows in row_counts:
                for kernel in kernels:
                    times[kernel][rows].append(one_pass(kernel, rows))
    med = {kern: {r: round(statistics.median(ts), 2) for r, ts in per.items()} for kern, per in times.items()}
    result = {
        "benchmark": "matmul_tiers", "command": command(), "machine": machine(),
        "shapes": {"layers": args.layers, "per_layer_NK": shapes, "lm_head": [args.vocab, h]},
        "ms_per_pass": med,
        "bf16_over_int4": {r: round(med["bf16_packed"][r] / med["int4"][r], 2) for r in row_counts},
        "bf16_over_fp32": {r: round(med["bf16_packed"][r] / med["fp32_sgemm"][r], 2) for r in row_counts},
    }
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
