// The operators of lockgate's CPU kernels as C++ functions, so that kernels can call each other
// without the dispatcher (decode_layers.cpp runs whole steps on them). Contracts: at the
// top of each implementing file.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace lockgate {

// decode_attention.cpp
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& slots,
                                                    const at::Tensor& offsets, double scale);
std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                     const at::Tensor& v_cache, const at::Tensor& slots,
                                                     const at::Tensor& offsets, const at::Tensor& q_offsets,
                                                     double scale);
// fused_ops.cpp
at::Tensor add_rms_norm_(at::Tensor& residual, const std::optional<at::Tensor>& x, const at::Tensor& weight,
                         double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                         int64_t kv_heads, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots);
// quant_linear.cpp
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias, int64_t bits);

// bf16_gemm.cpp
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor bf16_linear_silu(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
bool bf16_linear_available();

// f32_gemm.cpp
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
bool f32_linear_available();

// int_gemm.cpp
at::Tensor int_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zeros, int64_t bits, const std::optional<at::Tensor>& bias,
                      int64_t act_bits = 16);

}  // namespace lockgate
