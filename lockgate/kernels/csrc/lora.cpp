// lockgate::lora_add_: add each row's low-rank adapter update to a projection's output, rows of
// different adapters (and rows of none) in one call: the SGMV idea (Punica, S-LoRA) on a CPU.
//
//   lora_add_(Tensor(a!) y [T, N], Tensor x [T, K], Tensor rows [M] int64, Tensor group_offsets [G + 1]
//             int64, Tensor group_slots [G] int64, Tensor[] a, Tensor[] b, Tensor[] spans) -> Tensor (y)
//
// Slot s (0 <= s < len(a)) holds one adapter's update for this projection: a[s] [K, R_s] (the
// LoRA A matrices of the projection's parts side by side, transposed: column r is rank row r),
// b[s] [R_s, N] (the B matrices, scaling folded in, zero outside each rank row's span) and
// spans[s] [R_s, 2] int32 (rank row r touches output columns spans[s][r][0] .. spans[s][r][1]).
// R_s is a multiple of kLanes (16; zero-padded rank rows with empty spans). An empty a[s] (numel
// 0) is a slot whose adapter leaves this projection alone (or a free slot): its rows are skipped. ``rows[group_offsets[g] .. group_offsets[g + 1]]`` are the rows of group g,
// all under slot group_slots[g]; each such row t gets
//
//   y[t, n] += sum_r (sum_k x[t, k] * a[s][k, r]) * b[s][r, n]
//
// and rows in no group are not touched. x, y, a and b share one dtype (float32 or bfloat16); sums
// run in float32 and y is rounded once per element.
//
// How: a group's rows go in tiles of up to kRows; a tile's first product keeps kRows x kLanes
// running sums in registers per block of rank rows (each A element read once per tile), its
// second product kRows x kCols sums per block of output columns (each B element read once per
// tile, blocks outside every rank row's span skipped). Parallel over tiles.
//
// Invariants: a row's result depends only on that row and its slot's weights, never on the other
// rows or their number: every sum runs in the same order, with the same roundings (mul_add),
// whatever the tile (batch-invariant, as the deterministic mode needs).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "vec_math.h"

namespace lockgate {
namespace lora_impl {
namespace {

constexpr int64_t kLanes = 16;  // rank rows per block of the first product
constexpr int64_t kRows = 4;    // rows per tile
constexpr int64_t kCols = 64;   // output columns per block of the second product

struct Slot {
  const void* a = nullptr;
  const void* b = nullptr;
  const int32_t* spans = nullptr;
  int64_t rank = 0;
};

// One tile of ``m`` (1..kRows) rows under one slot. ``xr`` holds the rows widened to float [m, k].
template <typename T, int M>
void tile(T* yp, int64_t ys, const float* xr, const int64_t* rows, const Slot& s, int64_t k, int64_t n,
          float* tmp /* [M, rank] */) {
  const T* ap = static_cast<const T*>(s.a);
  const T* bp = static_cast<const T*>(s.b);
  const int64_t rank = s.rank;
  for (int64_t rb = 0; rb < rank; rb += kLanes) {  // tmp = x @ a, kLanes rank rows at a time
    float acc[M][kLanes] = {};
    for (int64_t i = 0; i < k; ++i) {
      const T* arow = ap + i * rank + rb;
      float av[kLanes];
      for (int64_t l = 0; l < kLanes; ++l) av[l] = widen(arow[l]);
      for (int m = 0; m < M; ++m) {
        const float xi = xr[m * k + i];
        for (int64_t l = 0; l < kLanes; ++l) acc[m][l] = mul_add(xi, av[l], acc[m][l]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int64_t l = 0; l < kLanes; ++l) tmp[m * rank + rb + l] = acc[m][l];
  }
  const int32_t* sp = s.spans;
  for (int64_t j0 = 0; j0 < n; j0 += kCols) {  // y += tmp @ b, kCols output columns at a time
    const int64_t w = std::min(kCols, n - j0);
    float acc[M][kCols] = {};
    bool any = false;
    for (int64_t r = 0; r < rank; ++r) {
      if (sp[2 * r] >= j0 + w || sp[2 * r + 1] <= j0) continue;  // b is zero here
      any = true;
      const T* brow = bp + r * n + j0;
      if (w == kCols) {
        float bv[kCols];
        for (int64_t l = 0; l < kCols; ++l) bv[l] = widen(brow[l]);
        for (int m = 0; m < M; ++m) {
          const float t = tmp[m * rank + r];
          for (int64_t l = 0; l < kCols; ++l) acc[m][l] = mul_add(t, bv[l], acc[m][l]);
        }
      } else {
        for (int m = 0; m < M; ++m) {
          const float t = tmp[m * rank + r];
          for (int64_t l = 0; l < w; ++l) acc[m][l] = mul_add(t, widen(brow[l]), acc[m][l]);
        }
      }
    }
    if (!any) continue;
    for (int m = 0; m < M; ++m) {
      T* yt = yp + rows[m] * ys + j0;
      for (int64_t l = 0; l < w; ++l) yt[l] = narrow<T>(widen(yt[l]) + acc[m][l]);
    }
  }
}

template <typename T>
void lora_groups(at::Tensor& y, const at::Tensor& x, const int64_t* rows, const int64_t* offsets,
                 const int64_t* group_slot, int64_t groups, const std::vector<Slot>& slots) {
  const int64_t k = x.size(1), n = y.size(1);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t ys = y.stride(0), xs = x.stride(0);
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (group, first row index into rows)
  for (int64_t g = 0; g < groups; ++g)
    if (slots[group_slot[g]].rank > 0)
      for (int64_t i = offsets[g]; i < offsets[g + 1]; i += kRows) tiles.emplace_back(g, i);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> xr(kRows * k), tmp;
    for (int64_t t = t0; t < t1; ++t) {
      const auto [g, first] = tiles[t];
      const Slot& s = slots[group_slot[g]];
      const int64_t m = std::min(kRows, offsets[g + 1] - first);
      for (int64_t i = 0; i < m; ++i) {
        const T* xt = xp + rows[first + i] * xs;
        float* dst = xr.data() + i * k;
        for (int64_t c = 0; c < k; ++c) dst[c] = widen(xt[c]);
      }
      tmp.resize(kRows * s.rank);
      switch (m) {
        case 1: tile<T, 1>(yp, ys, xr.data(), rows + first, s, k, n, tmp.data()); break;
        case 2: tile<T, 2>(yp, ys, xr.data(), rows + first, s, k, n, tmp.data()); break;
        case 3: tile<T, 3>(yp, ys, xr.data(), rows + first, s, k, n, tmp.data()); break;
        default: tile<T, 4>(yp, ys, xr.data(), rows + first, s, k, n, tmp.data()); break;
      }
    }
  });
}

}  // namespace
}  // namespace lora_impl

at::Tensor lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& group_offsets,
                     const at::Tensor& group_slots, at::TensorList a, at::TensorList b, at::TensorList spans) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add_: x [T, K] and y [T, N] expected");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "lora_add_: x and y must share a dtype");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_add_: rows of x and y must be contiguous");
  TORCH_CHECK(a.size() == b.size() && a.size() == spans.size(), "lora_add_: a, b and spans must have one entry per slot");
  for (const auto* t : {&rows, &group_offsets, &group_slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "lora_add_: rows, group_offsets and group_slots must be contiguous int64 vectors");
  const int64_t groups = group_slots.numel(), t_rows = x.size(0);
  TORCH_CHECK(group_offsets.numel() == groups + 1, "lora_add_: group_offsets must be [G + 1]");
  const int64_t* off = group_offsets.data_ptr<int64_t>();
  const int64_t* gs = group_slots.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[groups] == rows.numel(), "lora_add_: group_offsets must cover rows");
  for (int64_t g = 0; g < groups; ++g)
    TORCH_CHECK(off[g] <= off[g + 1] && 0 <= gs[g] && gs[g] < static_cast<int64_t>(a.size()),
                "lora_add_: group ", g, " names a missing slot or has negative length");
  for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(0 <= rp[i] && rp[i] < t_rows, "lora_add_: row out of range");
  const int64_t k = x.size(1), n = y.size(1);
  std::vector<lora_impl::Slot> slots(a.size());
  for (size_t s = 0; s < a.size(); ++s) {
    if (a[s].numel() == 0) continue;
    const int64_t rank = a[s].size(1);
    TORCH_CHECK(a[s].dim() == 2 && a[s].size(0) == k && a[s].is_contiguous(), "lora_add_: a[", s, "] must be [K, R]");
    TORCH_CHECK(rank % lora_impl::kLanes == 0, "lora_add_: the rank of a[", s, "] must be a multiple of ",
                lora_impl::kLanes, " (zero-padded)");
    TORCH_CHECK(b[s].dim() == 2 && b[s].size(0) == rank && b[s].size(1) == n && b[s].is_contiguous(),
                "lora_add_: b[", s, "] must be [R, N]");
    TORCH_CHECK(a[s].scalar_type() == x.scalar_type() && b[s].scalar_type() == x.scalar_type(),
                "lora_add_: adapter weights must have x's dtype");
    TORCH_CHECK(spans[s].scalar_type() == at::kInt && spans[s].is_contiguous() && spans[s].numel() == 2 * rank,
                "lora_add_: spans[", s, "] must be int32 [R, 2]");
    slots[s] = lora_impl::Slot{a[s].data_ptr(), b[s].data_ptr(), spans[s].data_ptr<int32_t>(), rank};
  }
  if (x.scalar_type() == at::kFloat) {
    lora_impl::lora_groups<float>(y, x, rp, off, gs, groups, slots);
  } else if (x.scalar_type() == at::kBFloat16) {
    lora_impl::lora_groups<c10::BFloat16>(y, x, rp, off, gs, groups, slots);
  } else {
    TORCH_CHECK(false, "lora_add_: float32 or bfloat16 only, got ", x.scalar_type());
  }
  return y;
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor rows, Tensor group_offsets, Tensor group_slots, Tensor[] a, "
        "Tensor[] b, Tensor[] spans) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) { m.impl("lora_add_", &lockgate::lora_add_); }
