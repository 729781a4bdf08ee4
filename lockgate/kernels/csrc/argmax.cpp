// Greedy sampling's argmax over each row of the logits, in the logits' own dtype.
//
// lockgate::argmax_rows(Tensor x) -> Tensor
//
//   x        [S, V] float32 or bfloat16, rows contiguous (stride(1) == 1, any row stride), V >= 1
//   returns  int64 [S]: per row the index of its largest value, the first one where several are
//            equal, the first NaN where the row has one: torch.argmax's rules, so the same tokens
//
// Why: a step of greedy rows needs one token per row, nothing else of its [S, 49k] logits. torch's
// argmax took 2.5 ms on [175, 49152] float32 (a c = 128 decode step with its guess rows, Zen 5
// class CPU) after a 0.4 ms widening copy, and 9.9 ms on the bf16 rows themselves; this reads the
// bf16 rows once, at memory speed (0.55 ms on the same rows). A bf16 value widens to float32
// exactly, so the index is the one the float32 logits give.
//
// Per row: 16 lanes each keep their largest value and its first index (a strictly greater value
// replaces it), NaNs are only flagged; then the lanes' largest value and, among lanes holding it,
// the smallest index. A row with a NaN is scanned again for its first NaN. Rows are split over
// threads (lockgate::steal_for); a row's result depends on nothing else. The vector scan needs AVX-512
// (``argmax_rows_vectorized``); elsewhere the operator is a plain loop that callers do not use.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "steal.h"
#include "vec_math.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lockgate::argmax_impl {
namespace {

inline float value_at(const float* row, int64_t i) { return row[i]; }
inline float value_at(const c10::BFloat16* row, int64_t i) { return static_cast<float>(row[i]); }

// The reference rule, one element at a time (the tail of a vector row, CPUs without AVX-512).
template <typename T>
int64_t argmax_scalar(const T* row, int64_t begin, int64_t end, float& best, int64_t& at, bool& nan) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = value_at(row, i);
    if (std::isnan(v)) {
      nan = true;
      return i;
    }
    if (v > best || at < 0) {
      best = v;
      at = i;
    }
  }
  return -1;
}

#if defined(__AVX512F__)
using lockgate::load16;
#endif

template <typename T>
int64_t argmax_row(const T* row, int64_t v) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = -1;
  bool nan = false;
  int64_t done = 0;
#if defined(__AVX512F__)
  if (v >= 16) {
    __m512 lane_best = load16(row);
    __m512i lane_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 unordered = _mm512_cmp_ps_mask(lane_best, lane_best, _CMP_UNORD_Q);
    __m512i idx = _mm512_add_epi32(lane_at, _mm512_set1_epi32(16));
    const __m512i step = _mm512_set1_epi32(16);
    // indices fit int32: V < 2^31 is checked by the caller
    for (done = 16; done + 16 <= v; done += 16) {
      const __m512 x = load16(row + done);
      const __mmask16 greater = _mm512_cmp_ps_mask(x, lane_best, _CMP_GT_OQ);
      unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      lane_best = _mm512_mask_mov_ps(lane_best, greater, x);
      lane_at = _mm512_mask_mov_epi32(lane_at, greater, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    if (unordered) {
      nan = true;
    } else {
      alignas(64) float vals[16];
      alignas(64) int32_t ids[16];
      _mm512_store_ps(vals, lane_best);
      _mm512_store_si512(ids, lane_at);
      for (int l = 0; l < 16; ++l) {
        if (vals[l] > best || (vals[l] == best && ids[l] < at) || at < 0) {
          best = vals[l];
          at = ids[l];
        }
      }
    }
  }
#endif
  if (!nan) {
    const int64_t first_nan = argmax_scalar(row, done, v, best, at, nan);
    if (nan) return first_nan;
    return at;
  }
  // a NaN somewhere in the vector part: the first one is the answer
  for (int64_t i = 0; i < v; ++i)
    if (std::isnan(value_at(row, i))) return i;
  return at;  // unreachable
}

template <typename T>
void run(const at::Tensor& x, at::Tensor& out) {
  const int64_t s = x.size(0), v = x.size(1), ld = x.stride(0);
  const T* base = x.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  lockgate::steal_for(0, s, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(base + r * ld, v);
  });
}

}  // namespace
}  // namespace lockgate::argmax_impl

namespace lockgate {

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1 && (x.size(1) == 1 || x.stride(1) == 1),
              "argmax_rows: x must be [S, V] with V >= 1 and contiguous rows, got ", x.sizes(), " strides ",
              x.strides());
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "argmax_rows: rows of at most 2^31 - 1 values, got ", x.size(1));
  TORCH_CHECK(x.device().is_cpu(), "argmax_rows is a CPU kernel");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    argmax_impl::run<float>(x, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    argmax_impl::run<c10::BFloat16>(x, out);
  } else {
    TORCH_CHECK(false, "argmax_rows: float32 or bfloat16 logits, got ", x.scalar_type());
  }
  return out;
}

// Whether rows are scanned 16 lanes at a time (AVX-512). Without it the scan is one element at a
// time, slower than torch's vectorised argmax: callers then keep torch's.
bool argmax_rows_vectorized() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("argmax_rows_vectorized() -> bool", &lockgate::argmax_rows_vectorized);
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) { m.impl("argmax_rows", &lockgate::argmax_rows); }
