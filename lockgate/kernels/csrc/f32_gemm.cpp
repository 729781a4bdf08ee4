// A float32 weight times float32 rows, each output one dot product in a fixed order: row-invariant
// by construction, for every row count.
//
// lockgate::f32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor
//
//   x       [M, K] float32, contiguous
//   weight  [N, K] float32, contiguous: the dense weight as the checkpoint holds it (no packed copy;
//           ``lockgate.layers.forms.F32DotWeight`` shares its storage)
//   bias    [N] float32 or None
//   returns [M, N] float32: x W^T (+ bias)
//
// Why: MKL's sgemm gives a row other bits at 1, 2, 3, 5, 7 or 9 rows than in a larger call, so a
// float32 run that keeps results independent of the batch (``--exact-prefill``, the default) pads
// every small call to 16 rows (lockgate.runner.row_invariance): a one-row decode step then costs
// sixteen rows of arithmetic. Here a one-row call streams the weight once. On the AMD EPYC Zen 3
// class CPU (AVX2, 2 threads), against the 16-row padded sgemm call at the default model's shapes
// (K 576 / 1,536, N 576-49,152; benchmarks/f32_dot.py): 5.2-7.7x less time at 1 row, 3.0-4.2x at
// 4, 1.1-2.3x at 16, 0.86-1.6x at 64; at 512 rows sgemm is faster (0.70-0.94x), so the tuning
// table keeps sgemm for large calls.
//
// Arithmetic: output (m, n) is one vector accumulator of L lanes (8 with AVX2, 16 with AVX-512)
// started at zero, fed x[m, k..k+L) * W[n, k..k+L) by FMA for k = 0, L, 2L, ... in order (the
// last step's missing columns loaded as zeros), then summed across lanes in a fixed tree, then
// + bias. Invariants: an output depends only on its x row, its weight row and its bias (not on M,
// the tile it fell in, the thread count or the split: the same instruction sequence either way);
// no allocation but the output.
//
// Work split: at::parallel_for over tiles of NT weight rows; a thread walks its tiles for each
// block of MB x rows (kept in L2), each tile's rows (in L1) against register blocks of MT x rows
// (MT x NT accumulators: 3 x 4 of the 16 ymm, 4 x 6 of the 32 zmm).
//
// Built with AVX2 + FMA (or AVX-512): elsewhere ``f32_linear_available()`` is false and the
// operator raises; lockgate.layers.forms then makes no such form.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>

namespace lockgate {
namespace f32_gemm_impl {
namespace {

#if defined(__AVX512F__)
#define LOCKGATE_F32_GEMM 1
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int MT = 4, NT = 6;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vhead(const float* p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
inline float hsum(Vec v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define LOCKGATE_F32_GEMM 1
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int MT = 3, NT = 4;
alignas(32) constexpr int32_t kMask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vhead(const float* p, int n) {
  return _mm256_maskload_ps(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMask + 8 - n)));
}
inline float hsum(Vec v) {
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
#endif

#ifdef LOCKGATE_F32_GEMM
constexpr int64_t MB = 64;  // x rows a thread's tiles pass over while they stay in L2

// y[i, j] = x[i] . w[j] (+ bias[j]) for i < MR, j < NR: one accumulator per output (module comment)
template <int MR, int NR>
inline void tile(const float* x, const float* w, int64_t K, float* y, int64_t ldy, const float* bias) {
  Vec acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = vload(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const Vec xv = vload(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {  // the last columns, the missing ones as zeros
    const int n = static_cast<int>(K - k);
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = vhead(w + j * K + k, n);
    for (int i = 0; i < MR; ++i) {
      const Vec xv = vhead(x + i * K + k, n);
      for (int j = 0; j < NR; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum(acc[i][j]) + (bias != nullptr ? bias[j] : 0.0f);
}

// rows [0, M) of x against NR weight rows, in register blocks of MT rows and one of the rest
template <int NR>
inline void rows(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t ldy, const float* bias) {
  int64_t m = 0;
  for (; m + MT <= M; m += MT) tile<MT, NR>(x + m * K, w, K, y + m * ldy, ldy, bias);
  const float* xr = x + m * K;
  float* yr = y + m * ldy;
  switch (M - m) {
    case 1: tile<1, NR>(xr, w, K, yr, ldy, bias); break;
    case 2: tile<2, NR>(xr, w, K, yr, ldy, bias); break;
    case 3: tile<3, NR>(xr, w, K, yr, ldy, bias); break;  // (MT 4 only)
    default: break;
  }
}

void run(const float* xp, const float* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = (N + NT - 1) / NT;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = std::min(MB, M - m0);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * NT;
        const float* xb = xp + m0 * K;
        float* yb = yp + m0 * N + n0;
        if (n0 + NT <= N) {
          rows<NT>(xb, mb, K, wp + n0 * K, yb, N, bp != nullptr ? bp + n0 : nullptr);
        } else {
          for (int64_t n = n0; n < N; ++n)
            rows<1>(xb, mb, K, wp + n * K, yp + m0 * N + n, N, bp != nullptr ? bp + n : nullptr);
        }
      }
    }
  });
}
#endif

}  // namespace
}  // namespace f32_gemm_impl

bool f32_linear_available() {
#ifdef LOCKGATE_F32_GEMM
  return true;
#else
  return false;
#endif
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(f32_linear_available(), "lockgate::f32_linear: built without AVX2 + FMA");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "lockgate::f32_linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "lockgate::f32_linear: float32 x and weight expected");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "lockgate::f32_linear: contiguous x and weight expected");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "lockgate::f32_linear: a contiguous float32 bias [N] expected");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef LOCKGATE_F32_GEMM
  if (M > 0 && N > 0) f32_gemm_impl::run(x.data_ptr<float>(), weight.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N);
#endif
  return y;
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("f32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("f32_linear_available() -> bool", &lockgate::f32_linear_available);
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) { m.impl("f32_linear", &lockgate::f32_linear); }

// This file's macros end with it (a unity build compiles several sources as one unit).
#undef LOCKGATE_F32_GEMM
