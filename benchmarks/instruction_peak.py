"""The CPU's arithmetic ceiling at the instruction: what "x% of the ceiling" in docs/performance.md
is measured against.

Compiles a small C program with the machine's compiler (``-O2 -march=native -fopenmp``) into a
temporary directory and runs it on 1 thread and on every CPU. Each thread runs a loop of 12
independent multiply-adds on the widest vector the build has, so the figure is issue rate, not
latency or memory:

* ``fp32_fma``: ``vfmadd`` on 16 (AVX-512) or 8 (AVX2 + FMA) float32 lanes, 2 FLOP per lane
  (float32 sgemm's ceiling);
* ``bf16_dot``: ``VDPBF16PS`` on 16 float32 lanes, each adding two bf16 products (4 FLOP per
  lane), where the target has AVX512-BF16 (the bf16 matmul's ceiling); null elsewhere;
* ``int16_dot``: ``VPDPWSSD`` on 16 int32 lanes, each adding two int16 products (4 operations per
  lane, counted as FLOP), where the target has AVX512-VNNI (the integer GEMM's ceiling: it
  multiplies int16 activations by widened int4/int8 weights with it); null elsewhere.

Prints one JSON line: machine, command, GFLOP/s per kind for 1 thread and for every CPU the
process may use (all threads' work over the time from their common start to the last one's end). Usage: ``.venv/bin/python benchmarks/instruction_peak.py [--seconds 1.0]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from _common import command, machine

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define ZERO() _mm512_setzero_ps()
#define FMA(a, x, y) _mm512_fmadd_ps(x, y, a)
#define SUM(v) _mm512_reduce_add_ps(v)
#define SET(x) _mm512_set1_ps(x)
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vec;
#define LANES 8
#define ZERO() _mm256_setzero_ps()
#define FMA(a, x, y) _mm256_fmadd_ps(x, y, a)
static float SUM(__m256 v) { float f[8]; _mm256_storeu_ps(f, v); float s = 0; for (int i = 0; i < 8; ++i) s += f[i]; return s; }
#define SET(x) _mm256_set1_ps(x)
#endif

/* the 12 statements written out (a loop over k left the accumulators in memory at -O2) */
#define ONE(stmt, k) { enum { K = k }; stmt; }
#define TWELVE(stmt) ONE(stmt, 0) ONE(stmt, 1) ONE(stmt, 2) ONE(stmt, 3) ONE(stmt, 4) ONE(stmt, 5) \
                     ONE(stmt, 6) ONE(stmt, 7) ONE(stmt, 8) ONE(stmt, 9) ONE(stmt, 10) ONE(stmt, 11)

/* kind 0: fp32 FMA, kind 1: bf16 dot products, kind 2: int16 dot products; prints GFLOP/s over all threads */
int main(int argc, char** argv) {
  int kind = atoi(argv[1]);
  long n = atol(argv[2]);
  double total = 0, start = 0, end = 0;
  float sink = 0;
#pragma omp parallel reduction(+ : total, sink)
  {
    double flop = 0;
#pragma omp barrier
#pragma omp single
    start = now();
    /* (the single's own barrier: every thread starts after start was taken) */
    if (kind == 0) {
#if defined(LANES)
      vec a[12];
      for (int i = 0; i < 12; ++i) a[i] = ZERO();
      vec x = SET(1e-8f), y = SET(1e-8f);
      for (long i = 0; i < n; ++i) {
        TWELVE(a[K] = FMA(a[K], x, y))
        __asm__ volatile("" : "+x"(x));
      }
      for (int i = 0; i < 12; ++i) sink += SUM(a[i]);
      flop = (double)n * 12 * LANES * 2;
#endif
    } else if (kind == 2) {
#if defined(__AVX512VNNI__)
      __m512i a[12];
      for (int i = 0; i < 12; ++i) a[i] = _mm512_setzero_si512();
      __m512i x = _mm512_set1_epi16(1), y = _mm512_set1_epi16(1);
      for (long i = 0; i < n; ++i) {
        TWELVE(a[K] = _mm512_dpwssd_epi32(a[K], x, y))
        __asm__ volatile("" : "+v"(x));
      }
      for (int i = 0; i < 12; ++i) sink += (float)_mm512_reduce_add_epi32(a[i]);
      flop = (double)n * 12 * 16 * 4;
#endif
    } else {
#if defined(__AVX512BF16__)
      __m512 a[12];
      for (int i = 0; i < 12; ++i) a[i] = _mm512_setzero_ps();
      __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3f80);
      for (long i = 0; i < n; ++i) {
        TWELVE(a[K] = _mm512_dpbf16_ps(a[K], x, y))
        __asm__ volatile("" : "+v"(x));
      }
      for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(a[i]);
      flop = (double)n * 12 * 16 * 4;
#endif
    }
    total += flop;
#pragma omp barrier
#pragma omp single
    end = now();
  }
  /* every thread's work over the time from the common start to the last one's end */
  printf("%.1f %g\n", total / (end - start) / 1e9, (double)sink);
  return 0;
}
"""


def has(macro: str, cc: str) -> bool:
    out = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", os.devnull],
                         capture_output=True, text=True, check=True).stdout
    return f"#define {macro} " in out


def measure(seconds: float = 1.0) -> tuple[int, dict[str, dict[str, float] | None]]:
    """(CPUs used, GFLOP/s per kind for "1_thread" and "all_threads"; None for a kind the compiler's
    target lacks). Raises SystemExit where the target has neither AVX2 + FMA nor AVX-512."""
    cc = os.environ.get("CC", "cc")
    kinds = {"fp32_fma": 0 if has("__AVX512F__", cc) or (has("__AVX2__", cc) and has("__FMA__", cc)) else None,
             "bf16_dot": 1 if has("__AVX512BF16__", cc) else None,
             "int16_dot": 2 if has("__AVX512VNNI__", cc) else None}
    cpus = len(os.sched_getaffinity(0))  # the CPUs this process may use
    if all(kind is None for kind in kinds.values()):
        raise SystemExit("the compiler's target has neither AVX2 + FMA nor AVX-512: nothing to measure")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run([cc, "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True)
        result: dict[str, dict[str, float] | None] = {}
        for name, kind in kinds.items():
            if kind is None:
                result[name] = None
                continue
            # an iteration is 12 multiply-adds, about one a cycle at ~3 GHz: loops for the wanted time
            n = max(1, int(seconds * 3e9 / 12))
            row = {}
            for label, threads in (("1_thread", 1), ("all_threads", cpus)):
                env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "spread"}
                out = subprocess.run([str(exe), str(kind), str(n)], capture_output=True, text=True, check=True,
                                     env=env).stdout.split()
                row[label] = float(out[0])
            result[name] = row
    return cpus, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="roughly how long each measurement runs")
    args = ap.parse_args()
    if not 0.05 <= args.seconds <= 60:
        raise SystemExit(f"--seconds must be within 0.05 .. 60, got {args.seconds}")
    cpus, result = measure(args.seconds)
    print(json.dumps({"machine": machine(), "command": command(), "threads": {"1_thread": 1, "all_threads": cpus},
                      "gflops": result}))


if __name__ == "__main__":
    main()
