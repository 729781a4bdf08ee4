// A whole step's decoder layers in one operator call.
//
// lockgate::decode_layers_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache,
//                          Tensor out_slots, Tensor slots, Tensor offsets, Tensor? q_offsets,
//                          Tensor[] weights, int[] kinds, int heads, int kv_heads, float eps,
//                          float scale) -> Tensor
//
//   x          [T, hidden] the step's embeddings (run dtype: float32 or bf16); used as the residual
//              stream, returned after the last layer (every MLP output added)
//   cos, sin   [T, D] rope (cos, signed sin) in the run dtype
//   k_cache, v_cache  [L, C, Hkv, D] the pool; the step's K/V are written at out_slots [T]
//   slots, offsets    each sequence's keys (CSR, as lockgate::decode_attention)
//   q_offsets  None: one token per sequence (lockgate::decode_attention); else each sequence's new
//              tokens (CSR over x's rows, as lockgate::prefill_attention: prompt chunks, decode
//              rows with their speculative guesses, or both)
//   weights    per layer: attn_norm, mlp_norm, then for qkv, o, gate_up, down four tensors
//              (a, b, c, bias); an empty tensor (numel 0) stands for "none"
//   kinds      per layer and projection: 0 = torch's int4 (a: packed codes, b: scales_and_zeros,
//              groups of 32, bf16 activations), 4 / 8 = lockgate::quant_linear with that many bits
//              (a: codes, b: scales, c: zeros), 104 / 108 = lockgate::int_linear with 4 / 8 bits
//              (a: packed codes, b: scales, c: zeros; a bf16 x widened for it), 200 = the dense weight packed for
//              oneDNN (a: what mkldnn::_reorder_linear_weight made; run by mkldnn::_linear_pointwise with
//              the bias fused, as lockgate.layers.forms.DenseWeight), 201 = the dense weight (a) by
//              at::linear (F.linear), 202 = the bf16 weight packed for lockgate::bf16_linear (a, as
//              lockgate.layers.forms.Bf16GemmWeight)
//
// It does exactly what lockgate.models.decoder.DecoderModel._layers does on KernelOps for such a step
// (the same functions, in the same order, rounding in the same places), without returning to Python
// between the ~12 calls of each layer: at decode batch 1 those returns, not the arithmetic, were a
// quarter of the step, at batch 32 on dense bf16 forms still 1-1.5 ms of ~30, and a 256-token prompt
// paid ~3 ms of them. The Python side (KernelOps.whole_step) only takes this path when every
// projection's form for the step (its prompt form where the step has prompt rows) has a kind here
// (all but the float32 copy of a 16-bit run) and needs no padding, and the step's attention is one
// kernel call (one group read by slot, no cascade over shared prefixes).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu_cpu_dispatch.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kTensorsPerLayer = 2 + 4 * 4;
constexpr int64_t kInt4Group = 32;
constexpr int64_t kIntGemmKind = 100;  // kinds 104 / 108: int_linear with kind - 100 bits
constexpr int64_t kOneDnnKind = 200;   // the oneDNN-packed dense weight
constexpr int64_t kDenseKind = 201;    // the dense weight, at::linear
constexpr int64_t kBf16GemmKind = 202; // the bf16 weight packed for lockgate::bf16_linear

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
  if (kind >= kIntGemmKind) {
    // float32 in and out (as IntGemmWeight: a 16-bit x widened exactly, the biased result rounded once)
    const bool narrow = x.scalar_type() != at::kFloat;
    at::Tensor y = lockgate::int_linear(narrow ? x.to(at::kFloat) : x, p[0], p[1], opt(p[2]), kind - kIntGemmKind);
    if (p[3].numel()) y.add_(p[3]);
    return narrow ? y.to(x.scalar_type()) : y;
  }
  return lockgate::quant_linear(x, p[0], p[1], opt(p[2]), opt(p[3]), kind);
}

}  // namespace

namespace lockgate {

at::Tensor decode_layers_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                          at::Tensor& v_cache, const at::Tensor& out_slots, const at::Tensor& slots,
                          const at::Tensor& offsets, const std::optional<at::Tensor>& q_offsets,
                          at::TensorList weights, at::IntArrayRef kinds, int64_t heads,
                          int64_t kv_heads, double eps, double scale) {
  const int64_t layers = k_cache.size(0), t = x.size(0), d = k_cache.size(3);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [T, hidden]");
  TORCH_CHECK(heads > 0 && kv_heads > 0, "heads and kv_heads must be positive");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "k_cache/v_cache must be [L, C, Hkv, D]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kTensorsPerLayer,
              "weights: expected ", layers * kTensorsPerLayer, " tensors (", kTensorsPerLayer, " per layer), got ",
              weights.size());
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == layers * 4, "kinds: expected 4 per layer");
  for (int64_t kind : kinds) {
    TORCH_CHECK(kind == 0 || kind == 4 || kind == 8 || kind == 104 || kind == 108 || kind == kOneDnnKind ||
                    kind == kDenseKind || kind == kBf16GemmKind,
                "kinds must be 0, 4, 8, 104, 108, 200, 201 or 202");
  }
  std::optional<at::Tensor> pending;  // the previous layer's MLP output, not yet added to x
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kTensorsPerLayer;
    const int64_t* kind = kinds.data() + l * 4;
    at::Tensor kc = k_cache.select(0, l), vc = v_cache.select(0, l);
    at::Tensor y = add_rms_norm_(x, pending, w[0], eps);
    at::Tensor q = rope_write_kv(project(y, w + 2, kind[0]), cos, sin, heads, kv_heads, kc, vc, out_slots);
    at::Tensor o = std::get<0>(q_offsets ? prefill_attention(q, kc, vc, slots, offsets, *q_offsets, scale)
                                         : decode_attention(q, kc, vc, slots, offsets, scale));
    y = add_rms_norm_(x, project(o.view({t, heads * d}), w + 6, kind[1]), w[1], eps);
    pending = project(silu_mul(project(y, w + 10, kind[2])), w + 14, kind[3]);
  }
  if (pending) {
    TORCH_CHECK(pending->sizes() == x.sizes(), "decode_layers_: the last projection's output ", pending->sizes(),
                " does not match x ", x.sizes());
    x.add_(*pending);
  }
  return x;
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("decode_layers_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor out_slots, Tensor slots, Tensor offsets, Tensor? q_offsets, Tensor[] weights, int[] kinds, "
        "int heads, int kv_heads, float eps, float scale) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) { m.impl("decode_layers_", &lockgate::decode_layers_); }
// oneDNN-packed weights (kind 200) are MkldnnCPU tensors: a call holding one dispatches there
TORCH_LIBRARY_IMPL(lockgate, MkldnnCPU, m) { m.impl("decode_layers_", &lockgate::decode_layers_); }
