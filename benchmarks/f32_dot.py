"""lockgate's float32 kernel (``f32-dot``, ``lockgate::f32_linear``) against MKL's sgemm at a model's
projection shapes, and a float32 greedy decode with and without the form.

Prints one JSON line: the machine, the command, and per shape and row count the median
milliseconds of ``f32_linear``, of ``F.linear`` as called (not row-invariant below 16 rows on the
CPUs measured) and of ``F.linear`` padded to 16 rows (what an exact-prefill float32 run did before
the form: row_invariance.py), with the padded / f32-dot ratio; then ``decode``: seconds for a
greedy float32 decode of ``--tokens`` tokens on the default model, with the form and with it
forbidden (``--matmul-forms dense``: sgemm, padded to its row-invariant floor). Cases are
interleaved round by round, so a noisy machine hits them alike.

Usage:  .venv/bin/python benchmarks/f32_dot.py [--rounds 7] [--tokens 24] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from _common import command, machine

from lockgate import LLM, SamplingParams, kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # the default model's qkv, o, gate_up, down, head
ROWS = [1, 2, 4, 8, 16, 64, 256, 512]
PAD = 16


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def matmuls(rounds: int) -> list[dict[str, object]]:
    out = []
    for n, k in SHAPES:
        w = torch.randn(n, k)
        for m in ROWS:
            x = torch.randn(m, k)
            xp = torch.cat([x, x.new_zeros(PAD - m, k)]) if m < PAD else x
            cases = {"f32_dot": lambda x=x, w=w: torch.ops.lockgate.f32_linear(x, w, None),
                     "sgemm": lambda x=x, w=w: F.linear(x, w),
                     "sgemm_padded": lambda xp=xp, w=w: F.linear(xp, w)}
            reps = max(2, int(2e8 / (2 * max(m, PAD) * n * k)))
            for fn in cases.values():
                fn()
            times: dict[str, list[float]] = {c: [] for c in cases}
            for r in range(rounds):
                for c in list(cases)[r % 3:] + list(cases)[:r % 3]:
                    times[c].append(timed(cases[c], reps))
            med = {c: round(statistics.median(v), 4) for c, v in times.items()}
            out.append({"n": n, "k": k, "rows": m, "ms": med,
                        "padded_over_f32_dot": round(med["sgemm_padded"] / med["f32_dot"], 2)})
    return out


def decode(tokens: int, rounds: int) -> dict[str, object]:
    llms = {"f32_dot": LLM("default", dtype="float32", max_total_tokens=2048),
            "sgemm_only": LLM("default", dtype="float32", max_total_tokens=2048, matmul_forms="dense")}
    ids = llms["f32_dot"].tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {c: [] for c in llms}
    texts = {}
    for r in range(rounds):
        for c in list(llms)[r % 2:] + list(llms)[:r % 2]:
            t = time.perf_counter()
            texts[c] = llms[c].generate(prompt_token_ids=[ids], sampling_params=params)[0].outputs[0].token_ids
            times[c].append(time.perf_counter() - t)
    med = {c: round(statistics.median(v), 3) for c, v in times.items()}
    return {"tokens": tokens, "seconds": med, "speedup": round(med["sgemm_only"] / med["f32_dot"], 2),
            "same_tokens": texts["f32_dot"] == texts["sgemm_only"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    assert kernels.load() and torch.ops.lockgate.f32_linear_available(), "needs lockgate's kernels with AVX2 + FMA"
    print(json.dumps({"machine": machine(), "command": command(), "matmuls": matmuls(a.rounds),
                      "decode": decode(a.tokens, max(3, a.rounds // 2))}))


if __name__ == "__main__":
    main()
