// lockgate::lora_add_: add each row's low-rank adapter update to a projection's output, rows of
// different adapters (and rows of none) in one call: the SGMV / BGMV idea (Punica, S-LoRA) on a CPU.
//
//   lora_add_(Tensor(a!) y [T, N], Tensor x [T, K], Tensor row_slot [T] int64,
//             Tensor[] a, Tensor[] b, Tensor[] spans) -> Tensor (y)
//
// Slot s (0 <= s < len(a)) holds one adapter's update for this projection: a[s] [K, R_s] (the
// LoRA A matrices of the projection's parts side by side, transposed: column r is rank row r),
// b[s] [R_s, N] (the B matrices, scaling folded in, zero outside each rank row's span) and
// spans[s] [R_s, 2] int32 (rank row r touches output columns spans[s][r][0] .. spans[s][r][1]).
// An empty a[s] (numel 0) is an empty slot. Row t with row_slot[t] = s >= 0 gets
//
//   y[t, n] += sum_r (sum_k x[t, k] * a[s][k, r]) * b[s][r, n]       for n in span(r)
//
// and a row with row_slot[t] < 0 (the base model) is not touched. x, y, a and b share one dtype
// (float32 or bfloat16); sums run in float32 and y is rounded once per element.
//
// Invariants: a row's result depends only on that row (x, its slot's weights), never on the
// other rows or their number: the sums run in the same order for every row (batch-invariant, as
// the deterministic mode needs). Parallel over rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <vector>

namespace lockgate {
namespace {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
void lora_rows(at::Tensor& y, const at::Tensor& x, const int64_t* slot, const std::vector<at::Tensor>& a,
               const std::vector<at::Tensor>& b, const std::vector<at::Tensor>& spans) {
  const int64_t rows = x.size(0), k = x.size(1), n = y.size(1);
  const int64_t ns = static_cast<int64_t>(a.size());
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t ys = y.stride(0), xs = x.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> xrow(k), acc(n), tmp;
    for (int64_t t = r0; t < r1; ++t) {
      const int64_t s = slot[t];
      if (s < 0 || s >= ns || a[s].numel() == 0) continue;
      const int64_t rank = a[s].size(1);
      const T* ap = a[s].data_ptr<T>();
      const T* bp = b[s].data_ptr<T>();
      const int32_t* sp = spans[s].data_ptr<int32_t>();
      const T* xt = xp + t * xs;
      for (int64_t i = 0; i < k; ++i) xrow[i] = widen(xt[i]);
      tmp.assign(rank, 0.f);
      float* tp = tmp.data();
      for (int64_t i = 0; i < k; ++i) {  // tmp = x[t] @ a[s]: an axpy per input column
        const float xi = xrow[i];
        const T* arow = ap + i * rank;
        for (int64_t r = 0; r < rank; ++r) tp[r] += xi * widen(arow[r]);
      }
      int64_t lo = n, hi = 0;
      for (int64_t r = 0; r < rank; ++r) {
        lo = std::min<int64_t>(lo, sp[2 * r]);
        hi = std::max<int64_t>(hi, sp[2 * r + 1]);
      }
      if (lo >= hi) continue;
      std::fill(acc.begin() + lo, acc.begin() + hi, 0.f);
      float* cp = acc.data();
      for (int64_t r = 0; r < rank; ++r) {  // acc = tmp @ b[s] over each rank row's span
        const float tr = tp[r];
        const T* brow = bp + r * n;
        for (int64_t j = sp[2 * r]; j < sp[2 * r + 1]; ++j) cp[j] += tr * widen(brow[j]);
      }
      T* yt = yp + t * ys;
      for (int64_t j = lo; j < hi; ++j) yt[j] = static_cast<T>(widen(yt[j]) + cp[j]);
    }
  });
}

}  // namespace

at::Tensor lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& row_slot, at::TensorList a,
                     at::TensorList b, at::TensorList spans) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add_: x [T, K] and y [T, N] expected");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora_add_: x and y must share a dtype");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_add_: rows of x and y must be contiguous");
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_slot.is_contiguous() && row_slot.numel() == x.size(0),
              "lora_add_: row_slot must be int64 [T]");
  TORCH_CHECK(a.size() == b.size() && a.size() == spans.size(), "lora_add_: a, b and spans must have one entry per slot");
  const int64_t k = x.size(1), n = y.size(1);
  std::vector<at::Tensor> av, bv, sv;
  for (size_t s = 0; s < a.size(); ++s) {
    if (a[s].numel() == 0) {
      av.push_back(a[s]), bv.push_back(b[s]), sv.push_back(spans[s]);
      continue;
    }
    const int64_t rank = a[s].size(1);
    TORCH_CHECK(a[s].dim() == 2 && a[s].size(0) == k && a[s].is_contiguous(), "lora_add_: a[", s, "] must be [K, R]");
    TORCH_CHECK(b[s].dim() == 2 && b[s].size(0) == rank && b[s].size(1) == n && b[s].is_contiguous(),
                "lora_add_: b[", s, "] must be [R, N]");
    TORCH_CHECK(a[s].scalar_type() == x.scalar_type() && b[s].scalar_type() == x.scalar_type(),
                "lora_add_: adapter weights must have x's dtype");
    TORCH_CHECK(spans[s].scalar_type() == at::kInt && spans[s].is_contiguous() && spans[s].numel() == 2 * rank,
                "lora_add_: spans[", s, "] must be int32 [R, 2]");
    const int32_t* sp = spans[s].data_ptr<int32_t>();
    for (int64_t r = 0; r < rank; ++r)
      TORCH_CHECK(0 <= sp[2 * r] && sp[2 * r] <= sp[2 * r + 1] && sp[2 * r + 1] <= n, "lora_add_: span out of range");
    av.push_back(a[s]), bv.push_back(b[s]), sv.push_back(spans[s]);
  }
  const int64_t* slot = row_slot.data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat) {
    lora_rows<float>(y, x, slot, av, bv, sv);
  } else if (x.scalar_type() == at::kBFloat16) {
    lora_rows<c10::BFloat16>(y, x, slot, av, bv, sv);
  } else {
    TORCH_CHECK(false, "lora_add_: float32 or bfloat16 only, got ", x.scalar_type());
  }
  return y;
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor row_slot, Tensor[] a, Tensor[] b, Tensor[] spans) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) { m.impl("lora_add_", &lockgate::lora_add_); }
