// Small numeric helpers shared by lockgate's CPU kernels: widening/narrowing of bf16 (one value, or
// 16 lanes on AVX-512) and an exp that the compiler can vectorise (libm's expf is a scalar call in a
// loop).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lockgate {

inline float widen(float x) { return x; }
// (by reference, reading the bits: copying the struct by value keeps gcc from vectorising the loop)
inline float widen(const c10::BFloat16& x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16); }
// float -> bf16, round to nearest even (NaN stays NaN), written branch-free so loops vectorise
inline c10::BFloat16 to_bf16(float x) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  return out;
}
#if defined(__AVX512F__)
// to_bf16 on 16 lanes, the same rounding and NaN rule (the bf16 bits in a 256-bit vector).
inline __m256i to_bf16x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}
#endif
template <typename T> inline T narrow(float x);
template <> inline float narrow<float>(float x) { return x; }
template <> inline c10::BFloat16 narrow<c10::BFloat16>(float x) { return to_bf16(x); }
// round a float to T and back: what storing an intermediate result in T does
template <typename T> inline float round_to(float x) { return widen(narrow<T>(x)); }

// exp(x) for x <= 0: 2^n * e^r with n = round(x / ln 2) and r = x - n ln 2 in [-ln2/2, ln2/2]
// (ln 2 split in a high and a low part, so r keeps its precision), e^r by its degree-7 Taylor
// polynomial; relative error ~2e-7 over [-87, 0] (tested); 0 below -87.
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.0f);
  const float t = xc * 1.44269504088896341f + 0.5f;
  int32_t n = static_cast<int32_t>(t);                  // truncation toward zero ...
  n -= static_cast<int32_t>(t < static_cast<float>(n));  // ... made floor: n = round(x / ln 2)
  const float nf = static_cast<float>(n);
  float r = xc - nf * 0.693145751953125f;  // ln 2, high part (exact in float with n)
  r = r - nf * 1.428606765330187e-06f;     // ln 2, low part
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float v = p * __builtin_bit_cast(float, static_cast<uint32_t>(n + 127) << 23);
  // below -87: 0 (v is finite there, xc being clamped). A multiply, not a select: gcc treats
  // `cond ? 0 : v` here as control flow and then vectorises no loop that calls this.
  return v * static_cast<float>(x >= -87.0f);
}

// x * sigmoid(x) through exp of a non-positive argument (no overflow; selects, no branches).
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|) in (0, 1]
  return x * ((x >= 0.f ? 1.f : e) / (1.f + e));  // sigmoid(x) = 1 / (1 + e) or e / (1 + e)
}

}  // namespace lockgate
