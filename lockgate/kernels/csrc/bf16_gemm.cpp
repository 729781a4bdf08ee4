// A bf16 weight times bf16 rows on AVX512-BF16 dot products (VDPBF16PS), for every row count.
//
// lockgate::bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor
//
//   x       [M, K] bfloat16, contiguous; K even
//   packed  bfloat16 [N / 16, K / 2, 32], the weight W [N, K] in this kernel's layout (made by
//           ``lockgate.layers.forms.Bf16GemmWeight``): element (nb, p, 2 i + j) = W[16 nb + i, 2 p + j],
//           so one 64-byte row of it is the column pair (2p, 2p + 1) of 16 output rows, what one
//           VDPBF16PS multiplies against a broadcast pair of x
//   bias    [N] (any float dtype) or None: added in float32 before the result is rounded
//   returns [M, N] bfloat16: x W^T (+ bias), float32 sums rounded to nearest even once
//
// Why: on a CPU with AVX512-BF16 and no AMX, oneDNN's bf16 matmul (what the dense form runs)
// reached 420-600 GFLOP/s on the default model's projections at 32 rows and 510-750 at 64, on a
// Zen 5 class part whose VDPBF16PS peak is ~960 on 2 cores; this kernel runs the same products at
// 730-850 and 800-920 (docs/performance.md, round 18). A decode step's matmuls are small (tens of
// rows against a 0.3-3.5 MB weight): what decides them is keeping the dot-product units busy from
// the first row block on, not cache blocking for large M.
//
// Work split: each thread starts on a contiguous run of 16-row output blocks (as at::parallel_for
// would split them), walked in tiles; a thread that runs out takes whole tiles from the back of the
// other's run (lockgate::StealRanges, steal.h), so a thread the OS deschedules for a while (another
// process of the server, a neighbour on the host) does not hold the step up with its whole share;
// the split never enters the arithmetic. A tile is up to 4 blocks (64 outputs: 4 zmm of float32
// sums per x row); for each tile every x row goes in register blocks of at most 6
// rows (4 x 6 = 24 accumulators + 4 weight vectors of the 32 zmm; the row blocks of one call are
// as even as possible, so 32 rows go 6 6 5 5 5 5 rather than 6 6 6 6 6 2). The first row block
// streams the tile's weights from memory, the others find them in L2; while a tile is multiplied,
// the thread's next own tile's weights are prefetched into L2, spread over all of the tile's column pair steps
// (4 lines a step with one row block, 1 from 4 row blocks on), so the next tile's first row block
// does not wait on memory.
//
// Arithmetic: every output is sum over column pairs p, in order, of VDPBF16PS(x pair, w pair),
// accumulated in one float32 lane from zero; then + bias (float32); then one rounding to bf16
// (VCVTNEPS2BF16, nearest even). The products are exact; as in oneDNN's bf16 kernels, these
// instructions take subnormal inputs as zero and flush subnormal results, whatever MXCSR says. Invariants: an output depends only on its x row, its weight row
// and its bias (not on M, on the other rows, on the tile or row block it fell in, or on the thread
// count: the same instruction sequence in the same order either way), so the form is row-invariant
// by construction; no allocation but the output (and a float32 copy of a non-float32 bias).
//
// Only built with AVX512-BF16 (-march=native on such a CPU): elsewhere ``bf16_linear_available()``
// is false and the operator raises; lockgate.layers.forms then makes no such form.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "ops.h"
#include "steal.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LOCKGATE_BF16_GEMM 1
#include <immintrin.h>
#endif

namespace {

#if defined(LOCKGATE_BF16_GEMM)

constexpr int64_t kLanes = 16;   // output rows per zmm (one 16-row block)
constexpr int kTileBlocks = 4;   // 16-row blocks per tile
constexpr int kMaxRowBlock = 6;  // x rows per register block
constexpr int64_t kLine = 64;    // bytes per prefetched cache line

// Prefetch cursor over the next tile's weights, `lines` cache lines per column pair step of the
// current tile: as many as spread the next tile over every step the current one takes.
struct Prefetch {
  const char* at;
  const char* end;
  int64_t lines = 1;
  inline void step() {
    for (int64_t i = 0; i < lines && at < end; ++i, at += kLine) _mm_prefetch(at, _MM_HINT_T1);
  }
};

// out[MR rows][NV * 16] = x[MR rows] . w[NV blocks]^T (+ bias), rows of x k apart, of out ldo apart.
template <int MR, int NV>
inline void row_block(const uint16_t* x, int64_t k, const uint16_t* w, int64_t pairs, const float* bias,
                      uint16_t* out, int64_t ldo, Prefetch& pf) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const int64_t block = pairs * 2 * kLanes;  // elements per 16-row block of packed
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * block + p * 2 * kLanes);
    pf.step();
    for (int m = 0; m < MR; ++m) {
      int32_t pair;  // x's columns 2p, 2p + 1 as one 32-bit lane (memcpy: no aliasing or alignment assumed)
      std::memcpy(&pair, x + m * k + 2 * p, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, wv[v]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) {
      __m512 a = acc[m][v];
      if (bias != nullptr) a = _mm512_add_ps(a, _mm512_loadu_ps(bias + v * kLanes));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo + v * kLanes), (__m256i)_mm512_cvtneps_pbh(a));
    }
  }
}

// Every x row against one tile of NV blocks, in row blocks as even as possible.
template <int NV>
void tile(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t pairs, const float* bias,
          uint16_t* out, int64_t ldo, Prefetch pf) {
  const int64_t blocks = (m + kMaxRowBlock - 1) / kMaxRowBlock, size = m / blocks, bigger = m % blocks;
  const int64_t steps = blocks * pairs, lines = (pf.end - pf.at + kLine - 1) / kLine;
  pf.lines = std::max<int64_t>(1, (lines + steps - 1) / steps);
  for (int64_t i = 0, r = 0; i < blocks; ++i) {
    const int64_t mr = size + (i < bigger ? 1 : 0);
    const uint16_t* xr = x + r * k;
    uint16_t* o = out + r * ldo;
    switch (mr) {
      case 1: row_block<1, NV>(xr, k, w, pairs, bias, o, ldo, pf); break;
      case 2: row_block<2, NV>(xr, k, w, pairs, bias, o, ldo, pf); break;
      case 3: row_block<3, NV>(xr, k, w, pairs, bias, o, ldo, pf); break;
      case 4: row_block<4, NV>(xr, k, w, pairs, bias, o, ldo, pf); break;
      case 5: row_block<5, NV>(xr, k, w, pairs, bias, o, ldo, pf); break;
      default: row_block<kMaxRowBlock, NV>(xr, k, w, pairs, bias, o, ldo, pf); break;
    }
    r += mr;
  }
}

void run(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t nb, const float* bias, uint16_t* out) {
  const int64_t pairs = k / 2, n = nb * kLanes, block = pairs * 2 * kLanes;
  // Each worker's run of blocks (as at::parallel_for would split them), cut into tiles; idle
  // workers steal whole tiles from the back of the others' runs (lockgate::StealRanges). Inside
  // another parallel region the call runs on this thread alone: one worker, in order.
  const int64_t workers =
      at::in_parallel_region() ? 1 : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nb));
  const lockgate::StealSplit tiles(nb, workers, kTileBlocks);  // tile u: blocks start[u] .. start[u + 1] - 1
  const std::vector<int64_t>& first = tiles.start;
  lockgate::StealRanges ranges(tiles.bounds.data(), workers);
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t wk = w0; wk < w1; ++wk) {
      bool own = false;
      for (int64_t u = ranges.next(wk, &own); u >= 0; u = ranges.next(wk, &own)) {
        const int64_t b = first[u], nv = first[u + 1] - b;
        // the worker's next own tile's weights, prefetched while this one is multiplied
        const int64_t nx = own ? ranges.peek(wk) : -1;
        const char* start = nx < 0 ? nullptr : reinterpret_cast<const char*>(w + first[nx] * block);
        const int64_t bytes = nx < 0 ? 0 : (first[nx + 1] - first[nx]) * block * static_cast<int64_t>(sizeof(uint16_t));
        Prefetch pf{start, start + bytes};
        const uint16_t* wt = w + b * block;
        const float* bt = bias == nullptr ? nullptr : bias + b * kLanes;
        uint16_t* ot = out + b * kLanes;
        switch (nv) {
          case 1: tile<1>(x, m, k, wt, pairs, bt, ot, n, pf); break;
          case 2: tile<2>(x, m, k, wt, pairs, bt, ot, n, pf); break;
          case 3: tile<3>(x, m, k, wt, pairs, bt, ot, n, pf); break;
          default: tile<kTileBlocks>(x, m, k, wt, pairs, bt, ot, n, pf); break;
        }
      }
    }
  });
}

#endif  // LOCKGATE_BF16_GEMM

}  // namespace

namespace lockgate {

bool bf16_linear_available() {
#if defined(LOCKGATE_BF16_GEMM)
  return true;
#else
  return false;
#endif
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_linear_available(), "bf16_linear: this build has no AVX512-BF16 path (the CPU lacks it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_linear: x must be contiguous bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 2 == 0 && k > 0, "bf16_linear: K must be even and positive, got ", k);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) == k / 2 && packed.size(2) == 32,
              "bf16_linear: packed must be contiguous bfloat16 [N / 16, K / 2, 32] for K = ", k, ", got ",
              packed.scalar_type(), " ", packed.sizes());
  const int64_t nb = packed.size(0), n = nb * 16;
  at::Tensor b32;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bf16_linear: bias must be [N] = [", n, "], got ",
                bias->sizes());
    b32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
#if defined(LOCKGATE_BF16_GEMM)
  run(reinterpret_cast<const uint16_t*>(x.data_ptr()), m, k, reinterpret_cast<const uint16_t*>(packed.data_ptr()),
      nb, bias ? b32.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()));
#endif
  return out;
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("bf16_linear_available() -> bool", &lockgate::bf16_linear_available);
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) { m.impl("bf16_linear", &lockgate::bf16_linear); }
