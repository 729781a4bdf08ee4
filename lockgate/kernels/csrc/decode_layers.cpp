// A whole step's decoder layers in one operator call.
//
// lockgate::decode_layers_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache,
//                          Tensor out_slots, Tensor slots, Tensor offsets, Tensor? q_offsets,
//                          Tensor[] weights, int[] kinds, int heads, int kv_heads, float eps,
//                          float scale, int parts=1, Tensor? out_rows=None) -> Tensor(a!)
//
//   x          [T, hidden] the step's embeddings (run dtype: float32 or bf16); used as the residual
//              stream, returned after the last layer (every MLP output added)
//   cos, sin   [T, D] rope (cos, signed sin) in the run dtype
//   k_cache, v_cache  [L, C, Hkv, D] the pool (or an 8-bit pool [L, C, Hkv, D + 4]: kv_quant.h); the
//              step's K/V are written at out_slots [T]
//   slots, offsets    each sequence's keys (CSR, as lockgate::decode_attention)
//   q_offsets  None: one token per sequence (lockgate::decode_attention); else each sequence's new
//              tokens (CSR over x's rows, as lockgate::prefill_attention: prompt chunks, decode
//              rows with their speculative guesses, or both)
//   weights    per layer: attn_norm, mlp_norm, then for qkv, o, gate_up, down four tensors
//              (a, b, c, bias); an empty tensor (numel 0) stands for "none"
//   kinds      per layer and projection: 0 = torch's int4 (a: packed codes, b: scales_and_zeros,
//              groups of 32, bf16 activations), 4 / 8 = lockgate::quant_linear with that many bits
//              (a: codes, b: scales, c: zeros), 104 / 108 = lockgate::int_linear with 4 / 8 bits (114 / 118:
//              with int8 activations, act_bits 8)
//              (a: packed codes, b: scales, c: zeros; it widens a bf16 x and rounds its result itself), 200 = the dense weight packed for
//              oneDNN (a: what mkldnn::_reorder_linear_weight made; run by mkldnn::_linear_pointwise with
//              the bias fused, as lockgate.layers.forms.DenseWeight), 201 = the dense weight (a) by
//              at::linear (F.linear), 202 = the bf16 weight packed for lockgate::bf16_linear (a, as
//              lockgate.layers.forms.Bf16GemmWeight), 203 = the float32 dense weight (a) by
//              lockgate::f32_linear (lockgate.layers.forms.F32DotWeight)
//   parts      1: the layers run over all rows, each operator split over the threads; 2 (decode
//              steps only: no q_offsets): the sequences split in two halves, each half's whole
//              layer stack run by one thread (see "Two halves" below); a call with fewer than 2
//              sequences, on fewer than 2 threads or inside a parallel region runs as one part
//   out_rows   None: every row of x is wanted after the call; else int64 [K], strictly ascending: the
//              only rows the caller reads after it (the rows it samples). With q_offsets, where each
//              sequence's wanted rows are the last rows of its own (none, its last token, or more),
//              the last layer runs its attention, o projection and MLP on those K rows only (see
//              "The last layer" below); the other rows of x then hold no meaning. Otherwise ignored.
//
// It does exactly what lockgate.models.decoder.DecoderModel._layers does on KernelOps for such a step
// (the same functions, in the same order, rounding in the same places; on lockgate's bf16 kernel,
// when the MLP's width is a multiple of 16, the gate/up projection and silu_mul are one call,
// bf16_linear_silu, with the same bits), without
// returning to Python between the ~12 calls of each layer: at decode batch 1 those returns, not the arithmetic, were a
// quarter of the step, at batch 32 on dense bf16 forms still 1-1.5 ms of ~30, and a 256-token prompt
// paid ~3 ms of them. The Python side (KernelOps.whole_step) only takes this path when every
// projection's form for the step (its prompt form where the step has prompt rows) has a kind here
// (all but the float32 copy of a 16-bit run) and needs no padding, and the step's attention is one
// kernel call (one group read by slot, no cascade over shared prefixes).
//
// Two halves (parts = 2): with every operator split over both threads, a layer is ~12 parallel
// regions, each ending at a barrier, and each thread does every phase at the same time as the other
// (both read K/V in attention together, then both multiply). With the batch split in two and each
// thread carrying its half through all the layers, there is one barrier per step, and the halves
// drift apart so that one thread's memory-bound attention runs beside the other's compute-bound
// matmuls. Each half reads the layer's weights, the second mostly from the shared L3. On the Zen 5
// class CPU decode steps at c = 32 and c = 128 took 2.5-7% less time (docs/performance.md, round
// 21). A
// row's arithmetic is the same either way only where every projection's kernel gives a row the same
// bits whatever the call's row count and thread: the caller asks for two parts only then
// (lockgate.layers.ops.KernelOps.whole_step); the attention and fused kernels already work per row
// or per sequence.
//
// The last layer (out_rows): only the rows the caller samples go on past the last layer, but every
// row's K and V must reach the pool. So the last layer projects q/k/v and writes K/V for every
// row, then attends, projects and runs the MLP for the wanted rows alone: a prompt chunk of n
// tokens whose last is sampled does 1 row of that work instead of n, a middle chunk none. That is
// ~3% of a prompt's matmul work at 30 layers (the o projection and the MLP are ~93% of a layer's
// weights). A wanted row gets the same bits as in the full layer: attention gives a token a
// result that depends only on its query and keys, the norms and silu work per row, and the caller
// passes out_rows only where each projection's form gives a row the same bits whatever the rows
// in the call (lockgate.layers.ops.KernelOps.whole_step).

#include <ATen/core/Tensor.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu_cpu_dispatch.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "kv_quant.h"
#include "ops.h"

namespace lockgate::decode_layers_impl {
namespace {

constexpr int64_t kTensorsPerLayer = 2 + 4 * 4;
constexpr int64_t kInt4Group = 32;
constexpr int64_t kIntGemmKind = 100;  // kinds 104 / 108: int_linear with kind - 100 bits
constexpr int64_t kInt8ActKind = 10;   // kinds 114 / 118: the same with int8 activations (act_bits 8)
constexpr int64_t kOneDnnKind = 200;   // the oneDNN-packed dense weight
constexpr int64_t kDenseKind = 201;    // the dense weight, at::linear
constexpr int64_t kBf16GemmKind = 202; // the bf16 weight packed for lockgate::bf16_linear
constexpr int64_t kF32DotKind = 203;   // the float32 dense weight, lockgate::f32_linear

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(t);
}

// mkldnn::_linear_pointwise(x, packed, bias, "none", [], "") through the dispatcher (the operator
// torch registers for oneDNN-packed weights; boxed, so its C++ signature is not restated here).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::optional<std::string>(std::string())};
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

// y = x W^T + bias through the projection's form.
at::Tensor project(const at::Tensor& x, const at::Tensor* p, int64_t kind) {
  if (kind == kOneDnnKind) return onednn_linear(x, p[0], opt(p[3]));
  if (kind == kDenseKind) return at::linear(x, p[0], opt(p[3]));
  if (kind == kBf16GemmKind) return lockgate::bf16_linear(x, p[0], opt(p[3]));
  if (kind == kF32DotKind) return lockgate::f32_linear(x.contiguous(), p[0], opt(p[3]));
  if (kind == 0) {
    // torch's kernel checks the codes' shape but not the scales' first dimension: check both here
    const int64_t k = x.size(1), n = p[0].size(0);
    TORCH_CHECK(p[0].dim() == 2 && p[0].scalar_type() == at::kByte && p[0].size(1) == k / 2 && k % kInt4Group == 0,
                "decode_layers_: int4 codes must be uint8 [N, K / 2] for K = ", k);
    TORCH_CHECK(p[1].dim() == 3 && p[1].size(0) == k / kInt4Group && p[1].size(1) == n && p[1].size(2) == 2 &&
                    p[1].scalar_type() == at::kBFloat16,
                "decode_layers_: int4 scales_and_zeros must be bf16 [K / 32, N, 2] for K = ", k, ", N = ", n);
    at::Tensor y = at::cpu::_weight_int4pack_mm_for_cpu(x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16),
                                                        p[0], kInt4Group, p[1]);
    if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
    return p[3].numel() ? y.add_(p[3]) : y;
  }
  if (kind >= kIntGemmKind) {  // x's dtype in and out (a 16-bit x widened exactly, the biased result rounded once)
    const int64_t bits = (kind - kIntGemmKind) % kInt8ActKind;
    return lockgate::int_linear(x, p[0], p[1], opt(p[2]), bits, opt(p[3]), kind - kIntGemmKind >= kInt8ActKind ? 8 : 16);
  }
  return lockgate::quant_linear(x, p[0], p[1], opt(p[2]), opt(p[3]), kind);
}

// silu_mul(project(x, p, kind)): on lockgate's bf16 kernel in one pass (bf16_linear_silu: the gate
// and up outputs meet in registers, the same bits without writing and reading them back).
at::Tensor gate_up_silu(const at::Tensor& x, const at::Tensor* p, int64_t kind) {
  if (kind == kBf16GemmKind && p[0].size(0) % 2 == 0) {  // F % 16 == 0: gate and up blocks pair up
    return lockgate::bf16_linear_silu(x, p[0], opt(p[3]));
  }
  return lockgate::silu_mul(project(x, p, kind));
}

// The wanted rows of a step with q_offsets (out_rows), as a smaller prefill_attention problem:
// their rows of x, and the keys (slots, offsets) and new tokens (q_offsets) of the sequences that
// have any. Only where every sequence's wanted rows are the last ones of its own.
struct Wanted {
  at::Tensor rows, slots, offsets, q_offsets;
};

std::optional<Wanted> wanted_rows(const at::Tensor& out_rows, const at::Tensor& slots, const at::Tensor& offsets,
                                  const at::Tensor& q_offsets, int64_t t) {
  TORCH_CHECK(out_rows.dim() == 1 && out_rows.scalar_type() == at::kLong && out_rows.is_contiguous(),
              "decode_layers_: out_rows must be contiguous int64 [K]");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "decode_layers_: slots must be contiguous int64 [N]");
  const int64_t k = out_rows.size(0), seqs = offsets.size(0) - 1;
  const int64_t* rows = out_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < t && (i == 0 || rows[i] > rows[i - 1]),
                "decode_layers_: out_rows must be strictly ascending rows of x (", t, " rows)");
  }
  const int64_t* qo = q_offsets.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  TORCH_CHECK(qo[0] == 0 && qo[seqs] == t, "decode_layers_: q_offsets must cover the ", t, " rows");
  for (int64_t s = 0; s < seqs; ++s) TORCH_CHECK(qo[s + 1] >= qo[s], "decode_layers_: q_offsets must not fall");
  std::vector<int64_t> new_off{0}, new_qo{0}, new_slots;
  int64_t j = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t first = j;
    while (j < k && rows[j] < qo[s + 1]) ++j;
    const int64_t n = j - first;
    if (n == 0) continue;
    if (rows[first] != qo[s + 1] - n) return std::nullopt;  // not the sequence's last rows
    TORCH_CHECK(off[s] >= 0 && off[s] <= off[s + 1] && off[s + 1] <= slots.size(0),
                "decode_layers_: the offsets of sequence ", s, " leave slots");
    new_slots.insert(new_slots.end(), sl + off[s], sl + off[s + 1]);
    new_off.push_back(static_cast<int64_t>(new_slots.size()));
    new_qo.push_back(new_qo.back() + n);
  }
  TORCH_CHECK(j == k, "decode_layers_: out_rows lie outside the sequences' rows");
  auto tensor = [](const std::vector<int64_t>& v) {
    return at::tensor(at::ArrayRef<int64_t>(v), at::TensorOptions().dtype(at::kLong));
  };
  return Wanted{out_rows, tensor(new_slots), tensor(new_off), tensor(new_qo)};
}

// The layers over rows [r0, r1) of the step, which are sequences [s0, s1); `wanted`: the last
// layer's attention, o projection and MLP for those rows only (one part, with q_offsets).
void run_layers(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& slots, const at::Tensor& offsets,
                const std::optional<at::Tensor>& q_offsets, at::TensorList weights, at::IntArrayRef kinds,
                int64_t heads, int64_t kv_heads, double eps, double scale, int64_t s0, int64_t s1, int64_t r0,
                int64_t r1, const std::optional<Wanted>& wanted) {
  using lockgate::add_rms_norm_, lockgate::decode_attention, lockgate::prefill_attention, lockgate::rope_write_kv;
  const int64_t layers = k_cache.size(0), t = r1 - r0, d = lockgate::pool_head_dim(k_cache);
  at::Tensor xp = x.narrow(0, r0, t);
  const at::Tensor cp = cos.narrow(0, r0, t), sp = sin.narrow(0, r0, t), osp = out_slots.narrow(0, r0, t);
  const at::Tensor offp = offsets.narrow(0, s0, s1 - s0 + 1);  // the kernels read slots[off[s] .. off[s + 1])
  std::optional<at::Tensor> pending;  // the previous layer's MLP output, not yet added to x
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kTensorsPerLayer;
    const int64_t* kind = kinds.data() + l * 4;
    at::Tensor kc = k_cache.select(0, l), vc = v_cache.select(0, l);
    at::Tensor y = add_rms_norm_(xp, pending, w[0], eps);
    at::Tensor q = rope_write_kv(project(y, w + 2, kind[0]), cp, sp, heads, kv_heads, kc, vc, osp);
    if (wanted && l == layers - 1) {  // every row's K/V is in the pool; the rest for the wanted rows only
      const int64_t k = wanted->rows.size(0);
      if (k > 0) {
        at::Tensor xk = xp.index_select(0, wanted->rows);
        const at::Tensor o = std::get<0>(prefill_attention(q.index_select(0, wanted->rows), kc, vc, wanted->slots,
                                                           wanted->offsets, wanted->q_offsets, scale));
        y = add_rms_norm_(xk, project(o.view({k, heads * d}), w + 6, kind[1]), w[1], eps);
        const at::Tensor m = project(gate_up_silu(y, w + 10, kind[2]), w + 14, kind[3]);
        TORCH_CHECK(m.sizes() == xk.sizes(), "decode_layers_: the last projection's output ", m.sizes(),
                    " does not match x's wanted rows ", xk.sizes());
        xk.add_(m);
        xp.index_copy_(0, wanted->rows, xk);
      }
      return;
    }
    // (with q_offsets the call is one part: they count rows from the step's first)
    at::Tensor o = std::get<0>(q_offsets ? prefill_attention(q, kc, vc, slots, offp, *q_offsets, scale)
                                         : decode_attention(q, kc, vc, slots, offp, scale));
    y = add_rms_norm_(xp, project(o.view({t, heads * d}), w + 6, kind[1]), w[1], eps);
    pending = project(gate_up_silu(y, w + 10, kind[2]), w + 14, kind[3]);
  }
  if (pending) {
    TORCH_CHECK(pending->sizes() == xp.sizes(), "decode_layers_: the last projection's output ", pending->sizes(),
                " does not match x ", xp.sizes());
    xp.add_(*pending);
  }
}

}  // namespace
}  // namespace lockgate::decode_layers_impl

namespace lockgate {

at::Tensor decode_layers_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                          at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& slots,
                          const at::Tensor& offsets, const std::optional<at::Tensor>& q_offsets,
                          at::TensorList weights, at::IntArrayRef kinds, int64_t heads,
                          int64_t kv_heads, double eps, double scale, int64_t parts,
                          const std::optional<at::Tensor>& out_rows) {
  const int64_t layers = k_cache.size(0), t = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, hidden]");
  TORCH_CHECK(heads > 0 && kv_heads > 0, "heads and kv_heads must be positive");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "k_cache/v_cache must be [L, C, Hkv, D]");
  const int64_t per_layer = decode_layers_impl::kTensorsPerLayer;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * per_layer, "weights: expected ", layers * per_layer,
              " tensors (", per_layer, " per layer), got ", weights.size());
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == layers * 4, "kinds: expected 4 per layer");
  for (int64_t kind : kinds) {
    TORCH_CHECK(kind == 0 || kind == 4 || kind == 8 || kind == 104 || kind == 108 || kind == 114 || kind == 118 ||
                    kind == decode_layers_impl::kOneDnnKind || kind == decode_layers_impl::kDenseKind ||
                    kind == decode_layers_impl::kBf16GemmKind || kind == decode_layers_impl::kF32DotKind,
                "kinds must be 0, 4, 8, 104, 108, 114, 118, 200, 201, 202 or 203");
  }
  TORCH_CHECK(parts == 1 || parts == 2, "decode_layers_: parts must be 1 or 2, got ", parts);
  TORCH_CHECK(parts == 1 || !q_offsets, "decode_layers_: parts = 2 takes decode steps only (one row per sequence, no "
              "q_offsets)");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) >= 1 && offsets.scalar_type() == at::kLong &&
                  offsets.is_contiguous(),
              "offsets must be contiguous int64 [B + 1]");
  const int64_t seqs = offsets.size(0) - 1;
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == t && sin.sizes() == cos.sizes(), "cos and sin must be [T, D] for ",
              t, " rows");
  TORCH_CHECK(out_slots.dim() == 1 && out_slots.size(0) == t, "out_slots must have one slot per row (", t, ")");
  TORCH_CHECK(q_offsets || seqs == t, "decode_layers_: without q_offsets each sequence has one row (", seqs,
              " sequences, ", t, " rows)");
  if (q_offsets) {
    TORCH_CHECK(q_offsets->dim() == 1 && q_offsets->size(0) == seqs + 1 && q_offsets->scalar_type() == at::kLong &&
                    q_offsets->is_contiguous(),
                "q_offsets must be contiguous int64 [B + 1]");
  }
  auto layers_over = [&](int64_t s0, int64_t s1, int64_t r0, int64_t r1,
                         const std::optional<decode_layers_impl::Wanted>& wanted) {
    run_layers(x, cos, sin, k_cache, v_cache, out_slots, slots, offsets, q_offsets, weights, kinds, heads, kv_heads,
               eps, scale, s0, s1, r0, r1, wanted);
  };
  if (parts == 1 || seqs < 2 || at::get_num_threads() < 2 || at::in_parallel_region()) {
    const bool trim = out_rows && q_offsets && layers > 0;
    layers_over(0, seqs, 0, t,
                trim ? decode_layers_impl::wanted_rows(*out_rows, slots, offsets, *q_offsets, t) : std::nullopt);
    return x;
  }
  // one row per sequence here: part p is sequences, and rows, bounds[p] .. bounds[p + 1]
  const int64_t bounds[3] = {0, seqs / 2, seqs};
  const at::ThreadLocalState caller;  // inference mode and the rest: the workers take the caller's
  at::parallel_for(0, 2, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(caller);
    for (int64_t p = begin; p < end; ++p) layers_over(bounds[p], bounds[p + 1], bounds[p], bounds[p + 1], std::nullopt);
  });
  return x;
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("decode_layers_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor out_slots, Tensor slots, Tensor offsets, Tensor? q_offsets, Tensor[] weights, int[] kinds, "
        "int heads, int kv_heads, float eps, float scale, int parts=1, Tensor? out_rows=None) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) { m.impl("decode_layers_", &lockgate::decode_layers_); }
// oneDNN-packed weights (kind 200) are MkldnnCPU tensors: a call holding one dispatches there
TORCH_LIBRARY_IMPL(lockgate, MkldnnCPU, m) { m.impl("decode_layers_", &lockgate::decode_layers_); }
