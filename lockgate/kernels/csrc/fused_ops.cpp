// Fused element-wise steps of a Llama layer: one operator call instead of three to six.
//
// At decode batch 1 a layer's element-wise work is a few thousand numbers; what it costs is the
// number of operator calls (each a few microseconds of Python and dispatch), not the arithmetic.
// These fuse the runs of calls between the matmuls. Each rounds exactly where the torch ops it
// replaces round (tested against them), so bf16 results are the same numbers:
//
//   lockgate::add_rms_norm_(Tensor(a!) residual, Tensor? x, Tensor weight, float eps) -> Tensor
//       residual [T, N] += x (if given, rounded to residual's dtype), then
//       returns weight * round(rms_norm(residual))          (Hugging Face LlamaRMSNorm)
//   lockgate::silu_mul(Tensor gate_up) -> Tensor
//       gate_up [T, 2F] -> round(silu(gate)) * up  [T, F]
//   lockgate::rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads,
//                           Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> Tensor
//       qkv [T, (H + 2 Hkv) D]; cos / signed sin [T, D] (rotate-half form, as lockgate.layers.rope);
//       writes rotated k and v into the pool [C, Hkv, D] at slots [T] (distinct, as the scheduler
//       hands them out: rows are written in parallel); returns rotated q [T, H, D]. An 8-bit pool
//       ([C, Hkv, D + 4] int8 or float8_e4m3fn, kv_quant.h) gets each (token, kv head) row of k (as
//       rotated and rounded to the run dtype: the values an exact pool would hold) and of v
//       quantized with its own scale
//
// Supported dtypes: float32 and bfloat16 (all tensors of one call in the same dtype, float32 math;
// rope_write_kv's pool may be 8-bit instead).
// Rows are split over threads only when there are enough of them to pay for waking the threads,
// in pieces an idle thread can take from a descheduled one (lockgate::steal_for, steal.h). On
// AVX-512 silu_mul (both dtypes) and, for bf16, add_rms_norm_ and rope_write_kv run 16 lanes at a
// time with the same roundings (to_bf16x16: one instruction where the CPU has AVX512-BF16); the
// plain loops serve other CPUs, other widths and row tails.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "steal.h"

#include "kv_quant.h"
#include "ops.h"
#include "vec_math.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace lockgate::fused_ops_impl {
namespace {

constexpr int64_t kMaxVectorHeadDim = 256;  // rope_write_kv's vector path keeps cos / sin of a row in registers
constexpr int64_t kGrainElements = 1 << 15;  // a thread gets at least this many elements of work

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

using lockgate::narrow;
using lockgate::round_to;
using lockgate::widen;

#if defined(__AVX512F__)
using lockgate::load16;
using lockgate::round16;
using lockgate::store16;
#endif

template <typename T>
void add_rms_norm_impl(at::Tensor& residual, const std::optional<at::Tensor>& x, const at::Tensor& weight,
                       double eps, at::Tensor& out) {
  const int64_t t = residual.size(0), n = residual.size(1);
  T* r = residual.data_ptr<T>();
  const T* xp = x ? x->data_ptr<T>() : nullptr;
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  lockgate::steal_for(0, t, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* ri = r + i * n;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (n % 16 == 0) {
          // The same roundings on 16 lanes. The squares are summed per lane, then across the lanes
          // (_mm512_reduce_add_ps): an order of its own, so the inverse norm can differ from the
          // loop below (and from builds before it) in the last bit; fixed for every row and call.
          const T* xi = xp ? xp + i * n : nullptr;
          __m512 acc = _mm512_setzero_ps();
          for (int64_t j = 0; j < n; j += 16) {
            __m512 v = load16(ri + j);
            if (xi) {
              v = round16<T>(_mm512_add_ps(v, load16(xi + j)));
              store16(ri + j, v);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
          }
          const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + static_cast<float>(eps));
          const __m512 iv = _mm512_set1_ps(inv);
          T* oi = o + i * n;
          for (int64_t j = 0; j < n; j += 16)
            store16(oi + j, _mm512_mul_ps(load16(w + j), round16<T>(_mm512_mul_ps(load16(ri + j), iv))));
          continue;
        }
      }
#endif
      if (xp) {
        const T* xi = xp + i * n;
        for (int64_t j = 0; j < n; ++j) ri[j] = narrow<T>(widen(ri[j]) + widen(xi[j]));
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < n; ++j) ss += widen(ri[j]) * widen(ri[j]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      T* oi = o + i * n;
      for (int64_t j = 0; j < n; ++j) oi[j] = narrow<T>(widen(w[j]) * round_to<T>(widen(ri[j]) * inv));
    }
  });
}

}  // namespace
}  // namespace lockgate::fused_ops_impl

namespace lockgate {

at::Tensor add_rms_norm_(at::Tensor& residual, const std::optional<at::Tensor>& x, const at::Tensor& weight,
                         double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be contiguous [T, N]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == residual.size(1) && weight.is_contiguous(),
              "weight must be [N]");
  TORCH_CHECK(weight.scalar_type() == residual.scalar_type(), "weight and residual dtypes differ");
  if (x) {
    TORCH_CHECK(x->sizes() == residual.sizes() && x->is_contiguous() && x->scalar_type() == residual.scalar_type(),
                "x must be contiguous and match residual");
  }
  at::Tensor out = at::empty_like(residual);
  if (residual.scalar_type() == at::kFloat) {
    fused_ops_impl::add_rms_norm_impl<float>(residual, x, weight, eps, out);
  } else if (residual.scalar_type() == at::kBFloat16) {
    fused_ops_impl::add_rms_norm_impl<c10::BFloat16>(residual, x, weight, eps, out);
  } else {
    TORCH_CHECK(false, "add_rms_norm_: unsupported dtype ", residual.scalar_type());
  }
  return out;
}

template <typename T>
void silu_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t t = gu.size(0), f = out.size(1);
  const T* in = gu.data_ptr<T>();
  T* o = out.data_ptr<T>();
  lockgate::steal_for(0, t, fused_ops_impl::grain_rows(2 * f), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = in + i * 2 * f;
      const T* u = g + f;
      T* oi = o + i * f;
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + 16 <= f; j += 16) {
        const __m512 s = lockgate::silu16(load16(g + j));
        store16(oi + j, _mm512_mul_ps(round16<T>(s), load16(u + j)));
      }
#endif
      for (; j < f; ++j) {
        oi[j] = narrow<T>(round_to<T>(lockgate::silu(widen(g[j]))) * widen(u[j]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous(),
              "gate_up must be contiguous [T, 2F]");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(gate_up, out);
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_impl<c10::BFloat16>(gate_up, out);
  } else {
    TORCH_CHECK(false, "silu_mul: unsupported dtype ", gate_up.scalar_type());
  }
  return out;
}

// Rotate-half rope of one head row x [D] into dst: round(round(x * cos) + roll(x, D/2) * ssin).
template <typename T>
inline void rope_row(const T* x, const T* cos, const T* ssin, int64_t d, T* dst) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    dst[j] = narrow<T>(round_to<T>(widen(x[j]) * widen(cos[j])) + widen(x[j + half]) * widen(ssin[j]));
  }
#pragma omp simd
  for (int64_t j = half; j < d; ++j) {
    dst[j] = narrow<T>(round_to<T>(widen(x[j]) * widen(cos[j])) + widen(x[j - half]) * widen(ssin[j]));
  }
}

// The 8-bit pool's rows of token i (Code: QInt8 / QFp8): k rotated into a run-dtype row, then each
// kv head's k and v rows quantized (kv_quant.h).
template <typename Code, typename T>
void rope_write_kv_quantized(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t h,
                             int64_t hkv, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                             at::Tensor& q_out) {
  const int64_t t = qkv.size(0), d = lockgate::pool_head_dim(k_cache), width = qkv.size(1);
  const int64_t row_bytes = d + lockgate::kScaleBytes;
  const T* in = qkv.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t* sl = slots.data_ptr<int64_t>();
  T* q = q_out.data_ptr<T>();
  lockgate::steal_for(0, t, fused_ops_impl::grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<T> krow(static_cast<size_t>(d));
    for (int64_t i = begin; i < end; ++i) {
      const T* row = in + i * width;
      const T* ci = c + i * d;
      const T* si = s + i * d;
      for (int64_t hh = 0; hh < h; ++hh) rope_row(row + hh * d, ci, si, d, q + (i * h + hh) * d);
      for (int64_t hh = 0; hh < hkv; ++hh) {
        rope_row(row + (h + hh) * d, ci, si, d, krow.data());
        lockgate::quantize_row<Code>(krow.data(), d, kc + (sl[i] * hkv + hh) * row_bytes);
        lockgate::quantize_row<Code>(row + (h + hkv + hh) * d, d, vc + (sl[i] * hkv + hh) * row_bytes);
      }
    }
  });
}

template <typename T>
void rope_write_kv_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t h, int64_t hkv,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, at::Tensor& q_out) {
  if (k_cache.scalar_type() == at::kChar) {
    rope_write_kv_quantized<lockgate::QInt8, T>(qkv, cos, sin, h, hkv, k_cache, v_cache, slots, q_out);
    return;
  }
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    rope_write_kv_quantized<lockgate::QFp8, T>(qkv, cos, sin, h, hkv, k_cache, v_cache, slots, q_out);
    return;
  }
  const int64_t t = qkv.size(0), d = k_cache.size(2), width = qkv.size(1);
  const T* in = qkv.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  T* q = q_out.data_ptr<T>();
  lockgate::steal_for(0, t, fused_ops_impl::grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = in + i * width;
      const T* ci = c + i * d;
      const T* si = s + i * d;
      T* kdst = kc + sl[i] * hkv * d;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        constexpr int64_t max_d = fused_ops_impl::kMaxVectorHeadDim;
        if (d % 32 == 0 && d <= max_d) {  // rope_row on 16 lanes (bf16 products are exact: no FMA question)
          const int64_t half = d / 2;
          __m512 cv[max_d / 16], sv[max_d / 16];
          for (int64_t j = 0; j < d / 16; ++j) cv[j] = load16(ci + 16 * j), sv[j] = load16(si + 16 * j);
          for (int64_t hh = 0; hh < h + hkv; ++hh) {
            const T* x = row + hh * d;
            T* dst = hh < h ? q + (i * h + hh) * d : kdst + (hh - h) * d;
            for (int64_t j = 0; j < d / 16; ++j) {
              const int64_t other = 16 * j < half ? 16 * j + half : 16 * j - half;
              const __m512 rot = _mm512_mul_ps(load16(x + other), sv[j]);
              store16(dst + 16 * j, _mm512_add_ps(round16<T>(_mm512_mul_ps(load16(x + 16 * j), cv[j])), rot));
            }
          }
          std::copy(row + (h + hkv) * d, row + (h + 2 * hkv) * d, vc + sl[i] * hkv * d);
          continue;
        }
      }
#endif
      for (int64_t hh = 0; hh < h; ++hh) rope_row(row + hh * d, ci, si, d, q + (i * h + hh) * d);
      for (int64_t hh = 0; hh < hkv; ++hh) rope_row(row + (h + hh) * d, ci, si, d, kdst + hh * d);
      std::copy(row + (h + hkv) * d, row + (h + 2 * hkv) * d, vc + sl[i] * hkv * d);
    }
  });
}

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                         int64_t kv_heads, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  TORCH_CHECK(heads > 0 && kv_heads > 0, "heads and kv_heads must be positive");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(1) == kv_heads,
              "k_cache/v_cache must be contiguous [C, Hkv, D] of the same shape");
  const int64_t d = lockgate::pool_head_dim(k_cache), t = qkv.size(0);
  TORCH_CHECK(d > 0 && d % 2 == 0, "head dim must be even");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "qkv must be [T, (H + 2 Hkv) D] with contiguous rows");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == t && cos.size(1) == d && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "cos and sin must be contiguous [T, D]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == t && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be contiguous int64 [T]");
  const auto dt = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dt && sin.scalar_type() == dt &&
                  (k_cache.scalar_type() == dt || lockgate::is_quantized_pool(k_cache)) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "qkv, cos, sin and the pool must share one dtype (or the pool be 8-bit: int8, float8_e4m3fn)");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < k_cache.size(0), "slot ", sl[i], " is outside the pool of ",
                k_cache.size(0), " slots");
  }
  at::Tensor q = at::empty({t, heads, d}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor contig = qkv.stride(0) == qkv.size(1) ? qkv : qkv.contiguous();
  if (dt == at::kFloat) {
    rope_write_kv_impl<float>(contig, cos, sin, heads, kv_heads, k_cache, v_cache, slots, q);
  } else if (dt == at::kBFloat16) {
    rope_write_kv_impl<c10::BFloat16>(contig, cos, sin, heads, kv_heads, k_cache, v_cache, slots, q);
  } else {
    TORCH_CHECK(false, "rope_write_kv: unsupported dtype ", dt);
  }
  return q;
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor? x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) {
  m.impl("add_rms_norm_", &lockgate::add_rms_norm_);
  m.impl("silu_mul", &lockgate::silu_mul);
  m.impl("rope_write_kv", &lockgate::rope_write_kv);
}
