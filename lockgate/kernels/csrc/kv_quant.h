// The 8-bit KV pool (--kv-cache-dtype int8 / fp8; lockgate.kvcache.kv_dtype owns the format):
// its row layout, how a row is quantized when written (fused_ops.cpp rope_write_kv) and how codes
// are read back (decode_attention.cpp).
//
// A pool tensor [C, Hkv, D + 4] (one layer) or [L, C, Hkv, D + 4] of dtype int8 (kChar) or
// float8_e4m3fn holds, per (slot, kv head), D one-byte codes and then that row's float32 scale
// (kScaleBytes, unaligned: read with memcpy). The value of code c is c * scale (int8) or
// e4m3fn(c) * scale (fp8). A row is quantized from its own D values only:
//   int8: amax = max |x|, scale = amax / 127, code = round-half-even(x * (127 / amax)) (|code| <= 127);
//   fp8:  scale = amax / 448, code = e4m3fn(x * (448 / amax)) (c10's rounding: nearest even, saturating);
//   amax = 0: scale 0, codes 0.
// No FMA contraction enters (products and quotients only), so the torch reference
// (lockgate.layers.kv_quant.quantize) gives the same bytes.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace lockgate {

constexpr int64_t kScaleBytes = 4;  // each row's float32 scale, after its D codes
constexpr float kInt8Max = 127.f;
constexpr float kFp8Max = 448.f;

// The codes of an 8-bit pool, as the kernels' pool element types (one byte each).
struct QInt8 {
  int8_t x;
};
struct QFp8 {
  uint8_t x;
};
template <typename T>
constexpr bool kQuantized = std::is_same_v<T, QInt8> || std::is_same_v<T, QFp8>;

inline bool is_quantized_pool(const at::Tensor& pool) {
  return pool.scalar_type() == at::kChar || pool.scalar_type() == at::kFloat8_e4m3fn;
}
// The head size of a pool tensor's rows (its last dimension less the scale, for an 8-bit pool).
inline int64_t pool_head_dim(const at::Tensor& pool) {
  return pool.size(-1) - (is_quantized_pool(pool) ? kScaleBytes : 0);
}

inline float row_scale(const void* row, int64_t d) {
  float s;
  std::memcpy(&s, static_cast<const char*>(row) + d, sizeof(float));
  return s;
}

inline float code_value(QInt8 c) { return static_cast<float>(c.x); }
inline float code_value(QFp8 c) { return c10::detail::fp8e4m3fn_to_fp32_value(c.x); }

inline float widen_value(float x) { return x; }
inline float widen_value(const c10::BFloat16& x) { return static_cast<float>(x); }

// One row of D values (float32 or bf16) -> D codes and the scale, at dst (D + 4 bytes).
template <typename Code, typename T>
inline void quantize_row(const T* x, int64_t d, void* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(widen_value(x[i])));
  Code* codes = static_cast<Code*>(dst);
  const float top = std::is_same_v<Code, QInt8> ? kInt8Max : kFp8Max;
  const float scale = amax / top;
  const float inv = amax > 0.f ? top / amax : 0.f;
  for (int64_t i = 0; i < d; ++i) {
    const float v = widen_value(x[i]) * inv;
    if constexpr (std::is_same_v<Code, QInt8>) {
      const float r = std::nearbyint(v);  // the default rounding mode: half to even
      codes[i].x = static_cast<int8_t>(std::min(kInt8Max, std::max(-kInt8Max, r)));
    } else {
      codes[i].x = c10::detail::fp8e4m3fn_from_fp32_value(v);
    }
  }
  std::memcpy(static_cast<char*>(dst) + d, &scale, sizeof(float));
}

}  // namespace lockgate
