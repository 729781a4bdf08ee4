// Small numeric helpers shared by lockgate's CPU kernels: widening/narrowing of bf16 (one value, or
// 16 lanes on AVX-512: load16 / store16 / round16), an exp that the compiler can vectorise (libm's
// expf is a scalar call in a loop) and its 16-lane form, silu on one value or 16 lanes, and a
// multiply-add whose rounding the code fixes rather than the compiler (mul_add).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace lockgate {

// a * b + c, rounded once where the target has FMA and twice where it has not, in every caller and
// template instance alike. Plain `c += a * b` leaves contraction to the compiler, expression by
// expression: on an AVX2 build it fused the sums of one LoRA tile size and not of another, so a
// row's result depended on how many rows shared its tile.
// (Built for x86-64: a target with FMA defines __FMA__; an ARM one __ARM_FEATURE_FMA.)
inline float mul_add(float a, float b, float c) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  return std::fma(a, b, c);
#else
  return a * b + c;  // no FMA instruction to contract into
#endif
}

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
// With AVX512-BF16, VCVTNEPS2BF16 gives the same bits for zeros, normal numbers and infinities
// in one instruction (silu_mul 1.4x faster on the Zen 5 class CPU); it would flush denormals to zero and keep NaN
// payloads, so a vector holding either takes the integer path.
inline __m256i to_bf16x16(__m512 x) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
  // lanes that are NaN (quiet 0x01, signalling 0x80) or denormal (0x20)
  if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0xA1) == 0, 1)) return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#endif
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

#if defined(__AVX512F__)
// 16 values of float or bf16 widened to float lanes, and 16 float lanes stored as float or as bf16
// (rounded by to_bf16x16); round16<T> is round_to<T> on 16 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(x));
}
template <typename T> inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(x)), 16));
  }
}

// exp(x) for x <= 0 on 16 lanes (exp_nonpositive's method: 2^n e^r, degree-7 Taylor); 0 below -87.
inline __m512 exp16_nonpositive(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  const __m512 nf = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(nf), _mm512_set1_epi32(127)), 23);
  const __m512 v = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), v);
}

// silu on 16 lanes: silu's arithmetic, lane by lane (the same selects, the same division).
inline __m512 silu16(__m512 x) {
  const __m512 neg_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
  const __m512 e = exp16_nonpositive(neg_abs);
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
  return _mm512_mul_ps(x, _mm512_div_ps(num, _mm512_add_ps(one, e)));
}
#endif

}  // namespace lockgate
