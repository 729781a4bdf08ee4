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
// lockgate::bf16_linear_silu(Tensor x, Tensor packed, Tensor? bias) -> Tensor
//
//   the same x, packed and bias for a gate/up weight (rows 0 .. N/2 - 1 the gate's, the rest the
//   up projection's; N / 16 even); returns [M, N / 2] bfloat16: lockgate::silu_mul of
//   bf16_linear's result, bit for bit (each gate and up output rounded to bf16, then silu_mul's
//   lane arithmetic), without writing the [M, N] product and reading it back: a unit of work is up
//   to two gate blocks together with their up blocks, so a row's gate and up sums meet in
//   registers. At the default model's gate/up (N = 3072, K = 576) on the Zen 5 class CPU:
//   3-7% less time than the two calls at 1-166 rows, 2-3% at 256-1,046.
//
// Why: on a CPU with AVX512-BF16 and no AMX, oneDNN's bf16 matmul (what the dense form runs)
// reached 420-600 GFLOP/s on the default model's projections at 32 rows and 510-750 at 64, on a
// Zen 5 class part whose VDPBF16PS peak is ~960 on 2 cores; this kernel runs the same products at
// 730-850 and 800-920. A decode step's matmuls are small (tens of
// rows against a 0.3-3.5 MB weight): what decides them is keeping the dot-product units busy from
// the first row block on, not cache blocking for large M.
//
// Work split: each thread starts on a contiguous run of 16-row output blocks (as at::parallel_for
// would split them), walked in tiles; a thread that runs out takes whole tiles from the back of the
// other's run (lockgate::StealRanges, steal.h), so a thread the OS deschedules for a while (another
// process of the server, a neighbour on the host) does not hold the step up with its whole share;
// the split never enters the arithmetic. A tile is up to 4 blocks (64 outputs: 4 zmm of float32
// sums per x row; for bf16_linear_silu the split walks the gate's blocks, and a tile is up to 2
// of them with their 2 up blocks, 32 outputs); for each tile every x row goes in register blocks of at most 6
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
// instructions take subnormal inputs as zero and flush subnormal results, whatever MXCSR says.
// bf16_linear_silu's epilogue then does silu_mul's ordinary float32 arithmetic (exp, division,
// products), which follows the thread's MXCSR as silu_mul's does (lockgate never changes it).
// Invariants: an output depends only on its x row, its weight row and its bias (not on M, on the other rows, on the tile or row block it fell in, or on the thread
// count: the same instruction sequence in the same order either way), so the form is row-invariant
// by construction; no allocation but the output (and a float32 copy of a non-float32 bias).
//
// Only built with AVX512-BF16 (-march=native on such a CPU): elsewhere ``bf16_linear_available()``
// is false and the operator raises; lockgate.layers.forms then makes no such form.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "ops.h"
#include "prefetch.h"
#include "steal.h"
#include "vec_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define LOCKGATE_BF16_GEMM 1
#include <immintrin.h>
#endif

namespace lockgate::bf16_gemm_impl {
namespace {

#if defined(LOCKGATE_BF16_GEMM)

constexpr int64_t kLanes = 16;   // output rows per zmm (one 16-row block)
constexpr int kTileBlocks = 4;   // 16-row blocks per tile
constexpr int kMaxRowBlock = 6;  // x rows per register block

// 16 bf16 values (bits in a 256-bit vector) widened to float32, exactly.
inline __m512 widen16(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

// Where a register block's weight blocks are: NV blocks `block` elements apart from w; FUSED
// (silu_mul in the epilogue): the first NV / 2 are gate blocks and the last NV / 2 the matching up
// blocks, `up` elements after them.
template <int NV, bool FUSED>
inline void block_pointers(const uint16_t* w, int64_t block, int64_t up, const uint16_t* (&wp)[NV]) {
  for (int v = 0; v < NV; ++v)
    wp[v] = !FUSED || v < NV / 2 ? w + v * block : w + up + (v - NV / 2) * block;
}

// The bf16 output of one accumulator: + bias (float32), rounded once (VCVTNEPS2BF16).
inline __m256i finish(__m512 a, const float* bias) {
  if (bias != nullptr) a = _mm512_add_ps(a, _mm512_loadu_ps(bias));
  return (__m256i)_mm512_cvtneps_pbh(a);
}

// out[MR rows][NV * 16] = x[MR rows] . w[NV blocks]^T (+ bias), rows of x k apart, of out ldo apart.
// FUSED (block_pointers; NV even): out[MR rows][NV / 2 * 16] = silu_mul of the gate and up
// outputs, each rounded to bf16 first (what lockgate::silu_mul does to bf16_linear's output, bit
// for bit); the bias's up entries are `up_bias` floats after the gate's.
template <int MR, int NV, bool FUSED>
inline void row_block(const uint16_t* x, int64_t k, const uint16_t* w, int64_t pairs, const float* bias,
                      uint16_t* out, int64_t ldo, lockgate::TilePrefetch& pf, int64_t up, int64_t up_bias) {
  static_assert(!FUSED || NV % 2 == 0, "a fused register block pairs each gate block with its up block");
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const int64_t block = pairs * 2 * kLanes;  // elements per 16-row block of packed
  const uint16_t* wp[NV];
  block_pointers<NV, FUSED>(w, block, up, wp);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(wp[v] + p * 2 * kLanes);
    pf.step();
    for (int m = 0; m < MR; ++m) {
      int32_t pair;  // x's columns 2p, 2p + 1 as one 32-bit lane (memcpy: no aliasing or alignment assumed)
      std::memcpy(&pair, x + m * k + 2 * p, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, wv[v]);
    }
  }
  if constexpr (!FUSED) {
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < NV; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * ldo + v * kLanes),
                            finish(acc[m][v], bias == nullptr ? nullptr : bias + v * kLanes));
  } else {
    constexpr int H = NV / 2;
    for (int m = 0; m < MR; ++m) {
      for (int v = 0; v < H; ++v) {
        const __m512 g = widen16(finish(acc[m][v], bias == nullptr ? nullptr : bias + v * kLanes));
        const __m512 u = widen16(finish(acc[m][v + H], bias == nullptr ? nullptr : bias + up_bias + v * kLanes));
        lockgate::store16(reinterpret_cast<c10::BFloat16*>(out + m * ldo + v * kLanes),
                          _mm512_mul_ps(lockgate::round16<c10::BFloat16>(lockgate::silu16(g)), u));
      }
    }
  }
}

// Every x row against one tile of NV blocks, in row blocks as even as possible.
template <int NV, bool FUSED>
void tile(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t pairs, const float* bias,
          uint16_t* out, int64_t ldo, lockgate::TilePrefetch pf, int64_t up, int64_t up_bias) {
  const int64_t blocks = (m + kMaxRowBlock - 1) / kMaxRowBlock, size = m / blocks, bigger = m % blocks;
  pf.spread(blocks * pairs);
  for (int64_t i = 0, r = 0; i < blocks; ++i) {
    const int64_t mr = size + (i < bigger ? 1 : 0);
    const uint16_t* xr = x + r * k;
    uint16_t* o = out + r * ldo;
    switch (mr) {
      case 1: row_block<1, NV, FUSED>(xr, k, w, pairs, bias, o, ldo, pf, up, up_bias); break;
      case 2: row_block<2, NV, FUSED>(xr, k, w, pairs, bias, o, ldo, pf, up, up_bias); break;
      case 3: row_block<3, NV, FUSED>(xr, k, w, pairs, bias, o, ldo, pf, up, up_bias); break;
      case 4: row_block<4, NV, FUSED>(xr, k, w, pairs, bias, o, ldo, pf, up, up_bias); break;
      case 5: row_block<5, NV, FUSED>(xr, k, w, pairs, bias, o, ldo, pf, up, up_bias); break;
      default: row_block<kMaxRowBlock, NV, FUSED>(xr, k, w, pairs, bias, o, ldo, pf, up, up_bias); break;
    }
    r += mr;
  }
}

// x [m, k] times the packed weight's nb blocks into out. Plain: out [m, 16 nb]. swiglu (nb even):
// the first nb / 2 blocks are the gate's, the rest the up projection's, and out [m, 8 nb] gets
// silu_mul of them: a unit is up to two gate blocks together with their up blocks (a 4-block tile
// as in the plain case), so the gate and up outputs of a row meet in registers.
void run(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t nb, const float* bias, uint16_t* out,
         bool swiglu) {
  const int64_t pairs = k / 2, block = pairs * 2 * kLanes;
  const int64_t units_of = swiglu ? nb / 2 : nb;  // blocks the split walks (gate blocks when fused)
  const int64_t up = swiglu ? units_of * block : -1, up_bias = swiglu ? units_of * kLanes : 0;
  const int64_t ldo = units_of * kLanes;  // output columns: 16 per walked block
  // Each worker's run of blocks (as at::parallel_for would split them), cut into tiles; idle
  // workers steal whole tiles from the back of the others' runs (lockgate::StealRanges). Inside
  // another parallel region the call runs on this thread alone: one worker, in order.
  const int64_t workers =
      at::in_parallel_region() ? 1 : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units_of));
  // tile u: walked blocks start[u] .. start[u + 1] - 1 (with swiglu each brings its up block along)
  const lockgate::StealSplit tiles(units_of, workers, swiglu ? kTileBlocks / 2 : kTileBlocks);
  const std::vector<int64_t>& first = tiles.start;
  lockgate::StealRanges ranges(tiles.bounds.data(), workers);
  constexpr int64_t kBytes = static_cast<int64_t>(sizeof(uint16_t));
  at::parallel_for(0, workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t wk = w0; wk < w1; ++wk) {
      bool own = false;
      for (int64_t u = ranges.next(wk, &own); u >= 0; u = ranges.next(wk, &own)) {
        const int64_t b = first[u], nv = first[u + 1] - b;
        // the worker's next own tile's weights (and its up blocks), prefetched while this one is multiplied
        const int64_t nx = own ? ranges.peek(wk) : -1;
        lockgate::TilePrefetch pf;
        if (nx >= 0) {
          const uint16_t* start = w + first[nx] * block;
          const int64_t bytes = (first[nx + 1] - first[nx]) * block * kBytes;
          pf.add(start, bytes);
          if (swiglu) pf.add(start + up, bytes);  // its up blocks, after the gate's
        }
        const uint16_t* wt = w + b * block;
        const float* bt = bias == nullptr ? nullptr : bias + b * kLanes;
        uint16_t* ot = out + b * kLanes;
        if (swiglu) {  // a unit of one or two gate blocks (StealSplit's piece), each with its up block
          if (nv == 1) {
            tile<2, true>(x, m, k, wt, pairs, bt, ot, ldo, pf, up, up_bias);
          } else {
            tile<kTileBlocks, true>(x, m, k, wt, pairs, bt, ot, ldo, pf, up, up_bias);
          }
          continue;
        }
        switch (nv) {
          case 1: tile<1, false>(x, m, k, wt, pairs, bt, ot, ldo, pf, up, up_bias); break;
          case 2: tile<2, false>(x, m, k, wt, pairs, bt, ot, ldo, pf, up, up_bias); break;
          case 3: tile<3, false>(x, m, k, wt, pairs, bt, ot, ldo, pf, up, up_bias); break;
          default: tile<kTileBlocks, false>(x, m, k, wt, pairs, bt, ot, ldo, pf, up, up_bias); break;
        }
      }
    }
  });
}

#endif  // LOCKGATE_BF16_GEMM

}  // namespace
}  // namespace lockgate::bf16_gemm_impl

namespace lockgate {

bool bf16_linear_available() {
#if defined(LOCKGATE_BF16_GEMM)
  return true;
#else
  return false;
#endif
}

}  // namespace lockgate

namespace lockgate::bf16_gemm_impl {
namespace {

// x, packed and bias checked as bf16_linear takes them (`name` in the messages); the float32 bias.
at::Tensor checked(const char* name, const at::Tensor& x, const at::Tensor& packed,
                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(lockgate::bf16_linear_available(), name, ": this build has no AVX512-BF16 path (the CPU lacks it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              name, ": x must be contiguous bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 2 == 0 && k > 0, name, ": K must be even and positive, got ", k);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) == k / 2 && packed.size(2) == 32,
              name, ": packed must be contiguous bfloat16 [N / 16, K / 2, 32] for K = ", k, ", got ",
              packed.scalar_type(), " ", packed.sizes());
  const int64_t n = packed.size(0) * 16;
  if (!bias) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, name, ": bias must be [N] = [", n, "], got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

at::Tensor linear(const char* name, const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias, bool swiglu) {
  const at::Tensor b32 = checked(name, x, packed, bias);
  const int64_t m = x.size(0), k = x.size(1), nb = packed.size(0);
  TORCH_CHECK(!swiglu || nb % 2 == 0, name, ": the gate and up halves need an even number of 16-row blocks, got ",
              nb);
  at::Tensor out = at::empty({m, swiglu ? nb * 8 : nb * 16}, x.options());
  if (m == 0 || nb == 0) return out;
#if defined(LOCKGATE_BF16_GEMM)
  run(reinterpret_cast<const uint16_t*>(x.data_ptr()), m, k, reinterpret_cast<const uint16_t*>(packed.data_ptr()),
      nb, b32.defined() ? b32.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()), swiglu);
#else
  (void)k;
#endif
  return out;
}

}  // namespace
}  // namespace lockgate::bf16_gemm_impl

namespace lockgate {

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return bf16_gemm_impl::linear("bf16_linear", x, packed, bias, false);
}

at::Tensor bf16_linear_silu(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  return bf16_gemm_impl::linear("bf16_linear_silu", x, packed, bias, true);
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("bf16_linear_silu(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("bf16_linear_available() -> bool", &lockgate::bf16_linear_available);
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) {
  m.impl("bf16_linear", &lockgate::bf16_linear);
  m.impl("bf16_linear_silu", &lockgate::bf16_linear_silu);
}

// This file's macros end with it (a unity build compiles several sources as one unit).
#undef LOCKGATE_BF16_GEMM
