// Weight-only quantized linear for few rows (decode): y = x W^T (+ bias), W in groups of 32 columns.
//
// lockgate::quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int bits) -> Tensor
//
//   x        [M, K]      float32 or bfloat16, contiguous; K % 32 == 0
//   bits 8:  qweight int8  [N, K];      W[n, k] = q * scales[n, k / 32]               (GGUF Q8_0)
//   bits 4:  qweight uint8 [N, K / 2];  W[n, k] = q * scales[n, k / 32] + zeros[n, k / 32], q in 0..15
//            (GGUF Q4_1); in each group of 32 columns, byte j holds column j (low nibble) and
//            column j + 16 (high nibble), llama.cpp's own order
//   scales, zeros  float32 [N, K / 32];  bias [N] in x's dtype or None
//   returns  [M, N] in x's dtype
//
// At decode a projection reads every weight once per step and does little arithmetic with it, so
// its cost is the bytes read: int4 is a quarter of bf16, int8 a half. Each thread takes a
// contiguous range of output rows and streams its weights once; for every group it widens the 32
// codes to float once and uses them for all M rows of x (float32 FMAs, exact products: the
// codes are small integers). The affine offset is folded in through per-group sums of x:
// sum_k (q s + z) x = s sum_k q x + z sum_k x. Math is float32; the result is rounded to x's
// dtype once.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"
#include "vec_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lockgate::quant_linear_impl {
namespace {

using lockgate::narrow;
using lockgate::widen;

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRowsPerPass = 4;  // rows of x whose accumulators stay in registers

// Codes of one group as floats: w[0..32).
template <int Bits>
inline void widen_group(const uint8_t* q, float* w) {
  if constexpr (Bits == 8) {
    const int8_t* s = reinterpret_cast<const int8_t*>(q);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(s[j]);
  } else {
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<float>(q[j] & 0xF);
      w[j + 16] = static_cast<float>(q[j] >> 4);
    }
  }
}

// Everything one call needs, shared by the threads; each thread writes out[:, n0:n1].
template <typename T>
struct Job {
  const float* x;      // [M, K] float32
  const float* xsum;   // [M, K / 32] per-group sums of x (bits 4), else nullptr
  int64_t m, k, n, groups, q_row_bytes;
  const uint8_t* q;    // codes, q_row_bytes per output row
  const float* scales; // [N, K / 32]
  const float* zeros;  // [N, K / 32] (bits 4) or nullptr
  const T* bias;       // [N] or nullptr
  T* out;              // [M, N]
};

// The finished value of out[r, n] from its accumulated s * sum_k q x.
template <typename T>
inline void store(const Job<T>& job, int64_t r, int64_t n, float acc) {
  if (job.zeros) {
    const float* z = job.zeros + n * job.groups;
    const float* xs = job.xsum + r * job.groups;
    float zs = 0.f;
#pragma omp simd reduction(+ : zs)
    for (int64_t g = 0; g < job.groups; ++g) zs += z[g] * xs[g];
    acc += zs;
  }
  if (job.bias) acc += widen(job.bias[n]);
  job.out[r * job.n + n] = narrow<T>(acc);
}

#if defined(__AVX512F__)
template <int Bits>
inline void widen_group_avx512(const uint8_t* q, __m512& w0, __m512& w1) {
  if constexpr (Bits == 8) {
    w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  } else {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    w0 = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
    w1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
}

// Output rows [n0, n1) for x rows [m0, m0 + R), NB output rows at a time: NB * R independent
// accumulators in registers (one accumulator would make every group wait on the previous FMA).
template <int Bits, int R, int NB, typename T>
void rows_avx512(const Job<T>& job, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int64_t group_bytes = kGroup * Bits / 8;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    __m512 acc[NB][R];
    for (int b = 0; b < NB; ++b)
      for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < job.groups; ++g) {
      __m512 x0[R], x1[R];
      for (int r = 0; r < R; ++r) {
        const float* xr = job.x + (m0 + r) * job.k + g * kGroup;
        x0[r] = _mm512_loadu_ps(xr);
        x1[r] = _mm512_loadu_ps(xr + 16);
      }
      for (int b = 0; b < NB; ++b) {
        const uint8_t* qg = job.q + (n + b) * job.q_row_bytes + g * group_bytes;
        _mm_prefetch(reinterpret_cast<const char*>(qg + 8 * group_bytes), _MM_HINT_T0);  // a hint: may pass the end
        __m512 w0, w1;
        widen_group_avx512<Bits>(qg, w0, w1);
        const __m512 s = _mm512_set1_ps(job.scales[(n + b) * job.groups + g]);
        for (int r = 0; r < R; ++r) {
          acc[b][r] = _mm512_fmadd_ps(_mm512_fmadd_ps(w1, x1[r], _mm512_mul_ps(w0, x0[r])), s, acc[b][r]);
        }
      }
    }
    for (int b = 0; b < NB; ++b)
      for (int r = 0; r < R; ++r) store(job, m0 + r, n + b, _mm512_reduce_add_ps(acc[b][r]));
  }
  if (n < n1) rows_avx512<Bits, R, 1>(job, m0, n, n1);  // the last < NB output rows
}
#endif

// Any CPU: plain loops.
template <int Bits, typename T>
void rows_generic(const Job<T>& job, int64_t m0, int64_t rows, int64_t n0, int64_t n1) {
  constexpr int64_t group_bytes = kGroup * Bits / 8;
  float w[kGroup];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < job.groups; ++g) {
        widen_group<Bits>(job.q + n * job.q_row_bytes + g * group_bytes, w);
        const float* xr = job.x + (m0 + r) * job.k + g * kGroup;
        float d = 0.f;
        for (int j = 0; j < kGroup; ++j) d += w[j] * xr[j];
        acc += d * job.scales[n * job.groups + g];
      }
      store(job, m0 + r, n, acc);
    }
  }
}

template <int Bits, typename T>
void run_rows(const Job<T>& job, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < job.m; m0 += kMaxRowsPerPass) {
    const int64_t rows = std::min(kMaxRowsPerPass, job.m - m0);
#if defined(__AVX512F__)
    switch (rows) {
      case 1: rows_avx512<Bits, 1, 4>(job, m0, n0, n1); continue;
      case 2: rows_avx512<Bits, 2, 4>(job, m0, n0, n1); continue;
      case 3: rows_avx512<Bits, 3, 2>(job, m0, n0, n1); continue;
      default: rows_avx512<Bits, 4, 2>(job, m0, n0, n1); continue;
    }
#endif
    rows_generic<Bits>(job, m0, rows, n0, n1);
  }
}

template <typename T>
void run(const at::Tensor& xf, const at::Tensor& qweight, const at::Tensor& scales,
         const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias, int64_t bits, at::Tensor& out) {
  const int64_t m = xf.size(0), k = xf.size(1), groups = k / kGroup;
  const float* xp = xf.data_ptr<float>();
  std::vector<float> xsum;
  if (zeros) {
    xsum.resize(static_cast<size_t>(m * groups));
    for (int64_t i = 0; i < m * groups; ++i) {
      float s = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) s += xp[i * kGroup + j];
      xsum[i] = s;
    }
  }
  const Job<T> job{xp, zeros ? xsum.data() : nullptr, m, k, qweight.size(0), groups, k * bits / 8,
                   reinterpret_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                   zeros ? zeros->data_ptr<float>() : nullptr, bias ? bias->data_ptr<T>() : nullptr,
                   out.data_ptr<T>()};
  at::parallel_for(0, job.n, 16, [&](int64_t n0, int64_t n1) {
    if (bits == 8) {
      run_rows<8>(job, n0, n1);
    } else {
      run_rows<4>(job, n0, n1);
    }
  });
}

}  // namespace
}  // namespace lockgate::quant_linear_impl

namespace lockgate {

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "x must be contiguous [M, K] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t group = quant_linear_impl::kGroup;
  const int64_t k = x.size(1), n = qweight.size(0), groups = k / group;
  TORCH_CHECK(k % group == 0, "K = ", k, " is not a multiple of the group size ", group);
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.size(1) == k * bits / 8 &&
                  qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "qweight must be contiguous ", bits == 8 ? "int8 [N, K]" : "uint8 [N, K / 2]");
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({n, groups}) && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat,
              "scales must be contiguous float32 [N, K / 32]");
  TORCH_CHECK((bits == 4) == zeros.has_value(), "zeros are required for bits 4 and not allowed for bits 8");
  if (zeros) {
    TORCH_CHECK(zeros->sizes() == scales.sizes() && zeros->is_contiguous() && zeros->scalar_type() == at::kFloat,
                "zeros must be contiguous float32 [N, K / 32]");
  }
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "bias must be contiguous [N] in x's dtype");
  }
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);  // [M, K]
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.scalar_type() == at::kFloat) {
    quant_linear_impl::run<float>(xf, qweight, scales, zeros, bias, bits, out);
  } else {
    quant_linear_impl::run<c10::BFloat16>(xf, qweight, scales, zeros, bias, bits, out);
  }
  return out;
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) { m.impl("quant_linear", &lockgate::quant_linear); }
