// Groupwise-quantized linear for many rows (prefill, large decode batches) on integer dot products:
// y = x W^T with W as GGUF blocks (Q4_1 or Q8_0) and x quantized to int16 per block of 32 columns.
//
// lockgate::int_linear(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, int bits, Tensor? bias=None) -> Tensor
//
//   x       [M, K] float32, bfloat16 or float16, contiguous; K % 32 == 0. A 16-bit x is widened to
//           float32 (exactly) as it is read
//   packed  the weight's codes in this kernel's layout (made by ``lockgate.layers.forms``):
//           bits 4: uint8 [N / 16, K / 4, 32]: byte i of chunk (nb, c) holds, for output row
//                   n = 16 nb + i / 2 and column k = 4 c + i % 2, code(n, k) in its low nibble and
//                   code(n, k + 2) in its high nibble (codes 0..15, W = code * scale + zero)
//           bits 8: int8 [N / 16, K / 2, 32]: byte i of chunk (nb, p) = code(16 nb + i / 2, 2 p + i % 2)
//                   (codes -127..127, W = code * scale, or code * scale + zero with zeros)
//   scales, zeros  float16 (both the same) [N / 16, K / 32, 16] (zeros required for bits
//           4, optional for bits 8): entry (nb, g, l) belongs to output row 16 nb + l and columns
//           [32 g, 32 g + 32). GGUF keeps its Q4_0 / Q4_1 / Q8_0 / Q5_0 block scales and offsets in
//           float16, so they are exact there; half the bytes of float32 matter when one row streams
//           the weights from memory (17% of a Q4_1 weight's bytes). A K-quant's scales are products
//           of a float16 and a 6-bit integer, not float16 values (Q4_K: 4-bit codes; Q5_K: 8-bit
//           codes 0..31 with zeros). Bits 8 may have a scale per 16 columns instead: scales
//           [N / 16, K / 16, 16] (GGUF Q6_K: codes q - 32 in -32..31, scale d * its int8 sub-block
//           scale); each 16 columns' int32 sum is then scaled on its own, in column order. Zeros
//           stay one per 32 columns, in a table of the scales' shape: entry (nb, 2 g, l) holds
//           group g's zero and (nb, 2 g + 1, l) is 0 (a Q4_K q over a Q6_K v, fused: 8-bit codes
//           with Q4_K's steps and mins, Q6_K's steps and zero mins)
//           Factored (uint8 tables, K % 256 == 0): a K-quant's scales as it stores them, an int8
//           factor per entry and a float16 super-scale per 256 columns (see the note after Job):
//           a byte per 32 weights instead of 4, multiplied out exactly as each group is scaled
//   bias    [N] float32, bfloat16 or float16, contiguous, or None: added (widened exactly) to the
//           float32 result
//   returns [M, N] in x's dtype: float32 as computed; for a 16-bit x the float32 result (plus
//           bias) rounded once to x's dtype, to nearest even, as ``y.to(x.dtype)`` rounds (a NaN
//           stays a NaN). So a 16-bit model's call takes no conversions of its own: at batch-1
//           decode the ~240 small conversions of a step (each an allocation and a dispatch) were
//           ~0.3-0.4 ms of a ~5.5 ms step on the Zen 4 class CPU
//
// Why: on a CPU without bf16 matrix units, float32 FMA is the fastest float arithmetic, and MKL's
// sgemm already runs near its peak. AVX512-VNNI's VPDPWSSD multiplies 32 int16 pairs per
// instruction at the FMA's rate, twice the FMA's 16 products. The weights' codes are small
// integers (exact in int16); the activations are rounded to int16 with one scale per row and
// block of 32 columns (relative error <= 2^-16 of the block's largest magnitude, 2^8 times finer
// than a bf16 cast). Products of one block are summed exactly in int32 (|code| * 32767 * 32 <
// 2^31) and then scaled in float32: y[m, n] = sum_g (d[n,g] s[m,g] sum_k q x16 + z[n,g] sum_k x).
// The offset term uses the block sums of the unrounded x.
//
// Work split: threads take tiles of 48 output rows (3 zmm of 16). x's rows go in chunks of 128
// (their int16 copy stays in L2 while a thread walks its tiles); for each chunk, tile and block
// of 256 columns the codes are widened to int16 into a 24 KB per-thread buffer (L1) and reused by
// every group of 4 x rows; the 4 x 3 int32 accumulators and their 4 x 3 float32 sums stay in
// registers. Weights are read in their packed size (4 or 8 bits per weight) once per chunk of
// 128 rows: once per call at decode sizes. Calls of 1-6 rows (batch-1 decode, a request and its
// speculative guesses: bound by reading the weights from memory) take run_gemv instead: each
// thread an even share of the 16-row blocks, codes widened in registers as they stream in,
// software prefetch ahead of each stream and, spread over each tile, of the next tile's codes,
// scales and offsets (prefetch.h: a tile's streams otherwise begin at memory latency; on the Zen 4
// class CPU a batch-1 decode step took 7-8% less time).
//
// Non-finite x: a block holding NaN or +-inf gets a NaN scale, so the rows it feeds come out NaN
// (as F.linear's would); a block whose largest magnitude is below 1e-30 is taken as zeros.
//
// Vector paths, picked at compile time (-march=native: the code is built on the CPU it runs on):
//   avx512-vnni  zmm, VPDPWSSD (one instruction per 32 int16 products)
//   avx512bw     zmm, VPMADDWD + VPADDD (AVX-512 CPUs without VNNI: Skylake-SP)
//   avx2-vnni    ymm, the VEX VPDPWSSD of AVX-VNNI (Alder Lake and later)
//   avx2         ymm, VPMADDWD + VPADDD (every x86-64 CPU since Haswell / Zen 1)
//   generic      plain C++ (no AVX2)
// The 256-bit paths split each 16-row block into two halves of 8 rows (one ymm of int32 each);
// with 16 ymm registers the tiles are 4 x rows by 2 halves, and the few-row path takes at most 3
// x rows per pass over a tile (a 4-6-row call passes twice, the second time from L1).
// ``int_linear_isa()`` names the path built. int32 sums of int16 products are exact whichever
// instruction makes them, and every path scales them in float32 in the same order, so all paths
// give bitwise the same result.
//
// Invariants: allocations are the output, x's int16 copy with its scales and sums, and one
// widening buffer per thread; the result depends only on the inputs (not on the thread count, on
// the other rows or on the vector path); the plain C++ path (``tile_generic``) does the same
// arithmetic (exact int32 sums, float32 scaling in the same order per block), and
// ``int_linear_reference`` runs it on any CPU so tests compare the two bitwise.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512BW__) && defined(__AVX512F__)
#define LOCKGATE_IG_512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOCKGATE_IG_256 1
#endif
#if defined(LOCKGATE_IG_512) || defined(LOCKGATE_IG_256)
#define LOCKGATE_IG_VECTOR 1
#include <immintrin.h>

#include "prefetch.h"
#endif

namespace lockgate::int_gemm_impl {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kLanes = 16;             // output rows per zmm
constexpr int kTileN = 3;                  // zmm of output rows per tile (48 rows)
constexpr int kTileM = 4;                  // x rows per register block
constexpr int kTileM256 = 4;               // the same on the 256-bit paths (6 x 2 int32 sums in 16 ymm)
constexpr int64_t kBlockK = 256;           // columns widened at a time (48 rows * 256 * 2 B = 24 KB)
constexpr int64_t kPairsPerGroup = kGroup / 2;
constexpr int64_t kChunkM = 128;           // x rows per pass over a thread's tiles
constexpr int64_t kGemvMaxRows = 6;        // at most this many x rows: run_gemv (no widening buffer)
// Output-row blocks of 16 per gemv tile: 4 (64 rows) for up to 3 x rows; 2 beyond, so that the
// MR x NR int32 sums, their float32 totals and the broadcast x pairs still fit the 32 zmm registers.
template <int MR>
constexpr int gemv_tile_n() { return MR <= 3 ? 4 : 2; }
constexpr int64_t kGemvGrain = 8;          // fewest 16-row blocks worth a thread of their own
// Software prefetch in run_gemv, which streams the weights from memory: each code stream this many
// bytes ahead, scales and zeros this many groups ahead. Measured on the default model's shapes
// (one row, 120 MB of distinct weights per pass, 2 threads, settings interleaved in one
// process): 4-bit 12-14 -> 13-17 GB/s with 512 bytes / 2 groups, 8-bit 18 -> 19 GB/s; 256-1,536
// bytes were within the noise of each other.
constexpr int64_t kGemvPrefetchBytes = 512;
constexpr int64_t kGemvPrefetchGroups = 2;

struct Job {
  const int16_t* xq;   // [M, K] int16 (with int8 activations: their values, -127..127)
  const int8_t* x8;    // [M, K] the same values as int8 (int8 activations), else nullptr
  const float* xs;     // [M, G] scale per row and group
  const float* xsum;   // [M, G] sum of x per row and group (bits 4), else nullptr
  int64_t m, k, g, nb; // rows, columns, groups, 16-row blocks of the output
  const uint8_t* packed;
  const void* scales;     // the scale table (see Tables), zeros: the offsets' (or nullptr)
  const void* zeros;
  int bits;
  float* out;          // [M, N]
  bool generic;        // the plain C++ path even where VNNI is there (int_linear_reference)
  bool factored;       // the tables are factored (else float16)
  int sub;             // scales per 32 columns: 1, or 2 (one per 16: bits 8, GGUF Q6_K)
  int64_t factors;     // factored: bytes of a 16-row block's int8 factors (its supers follow them)
  int64_t block_bytes; // bytes of a table per 16-row block
};

// How the scale and zero tables hold their values:
//   float16   [NB, G * sub, 16]
//   factored  uint8 [NB, G * sub * 16 + K / 256 * 32]: per 16-row block, int8 factors [G * sub, 16]
//             then float16 supers [K / 256, 16]; the value of (nb, g, s, lane) is super(nb, g / 8,
//             lane) * factor(nb, g, s, lane), a zero's its negation: a GGUF K-quant's d * sc and
//             -(dmin * m), exact in float32 (11 x 8 significant bits)

// Index of entry (nb, g, s, lane 0) of a float16 table, or of the factors of a factored one.
inline int64_t scale_index(const Job& job, int64_t nb, int64_t g, int s) { return ((nb * job.g + g) * job.sub + s) * kLanes; }

// The factored table's int8 factors and float16 supers of entry (nb, g, s, lane 0).
inline const int8_t* factor_ptr(const Job& job, const void* t, int64_t nb, int64_t g, int s) {
  return static_cast<const int8_t*>(t) + nb * job.block_bytes + (g * job.sub + s) * kLanes;
}
inline const at::Half* super_ptr(const Job& job, const void* t, int64_t nb, int64_t g) {
  return reinterpret_cast<const at::Half*>(static_cast<const char*>(t) + nb * job.block_bytes + job.factors) +
         (g / 8) * kLanes;
}

// Entry (nb, g, s, lane) of the scales (zero false) or zeros (zero true), as float32.
inline float table_at(const Job& job, bool zero, int64_t nb, int64_t g, int s, int lane) {
  const void* t = zero ? job.zeros : job.scales;
  if (job.factored) {
    const float v = static_cast<float>(super_ptr(job, t, nb, g)[lane]) * static_cast<float>(factor_ptr(job, t, nb, g, s)[lane]);
    return zero ? -v : v;
  }
  const int64_t at = scale_index(job, nb, g, s) + lane;
  return static_cast<float>(static_cast<const at::Half*>(t)[at]);
}

// The address of entry (nb, g, s, lane 0) (for prefetching).
inline const char* table_ptr(const Job& job, bool zero, int64_t nb, int64_t g, int s) {
  const void* t = zero ? job.zeros : job.scales;
  if (job.factored) return reinterpret_cast<const char*>(factor_ptr(job, t, nb, g, s));
  return static_cast<const char*>(t) + scale_index(job, nb, g, s) * 2;
}

// Quantize x [M, K] to integers of at most qmax per row and group of 32: scale = absmax / qmax
// (qmax 32767: int16; 127: int8 activations, also written to x8 when given). T: float, or a
// 16-bit float widened exactly to float32 first.
template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, bool sums, float qmax, int16_t* xq, int8_t* x8, float* xs,
                   float* xsum) {
  const int64_t groups = k / kGroup;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        float src[kGroup];
        for (int64_t j = 0; j < kGroup; ++j) src[j] = static_cast<float>(x[r * k + g * kGroup + j]);
        float amax = 0.f, sum = 0.f;
        bool finite = true;
        for (int64_t j = 0; j < kGroup; ++j) {
          const float a = std::fabs(src[j]);
          finite &= a <= std::numeric_limits<float>::max();  // false for NaN and +-inf
          amax = std::max(amax, a);
          sum += src[j];
        }
        const bool used = finite && amax >= 1e-30f;  // qmax / amax stays finite
        const float inv = used ? qmax / amax : 0.f;
        int16_t* dst = xq + r * k + g * kGroup;
        for (int64_t j = 0; j < kGroup; ++j) {
          // |src * inv| <= qmax up to rounding: clamped so the conversion is always defined
          const float v = std::min(std::max(src[j] * inv, -qmax), qmax);
          dst[j] = static_cast<int16_t>(std::nearbyint(v));
          if (x8) x8[r * k + g * kGroup + j] = static_cast<int8_t>(dst[j]);
        }
        xs[r * groups + g] = finite ? (used ? amax / qmax : 0.f) : std::numeric_limits<float>::quiet_NaN();
        if (sums) xsum[r * groups + g] = sum;
      }
    }
  });
}

// Widen the codes of output-row blocks [nb0, nb0 + nt) and columns [k0, k0 + kb) into
// buf[t][p][32] int16 (pair p of columns k0 + 2p, k0 + 2p + 1; lane l of the zmm = row 16 nb + l).
void widen_block(const Job& job, int64_t nb0, int nt, int64_t k0, int64_t kb, int16_t* buf) {
  const int64_t pairs = kb / 2;
  for (int t = 0; t < nt; ++t) {
    int16_t* dst = buf + t * pairs * 32;
    if (job.bits == 4) {
      // chunk c covers columns 4c .. 4c + 3: low nibbles = pair 2c, high nibbles = pair 2c + 1
      const uint8_t* src = job.packed + ((nb0 + t) * (job.k / 4) + k0 / 4) * 32;
      for (int64_t c = 0; c < kb / 4; ++c) {
#if defined(LOCKGATE_IG_512)
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c * 32)));
        _mm512_storeu_si512(dst + (2 * c) * 32, _mm512_and_si512(w, _mm512_set1_epi16(0xF)));
        _mm512_storeu_si512(dst + (2 * c + 1) * 32, _mm512_srli_epi16(w, 4));
#elif defined(LOCKGATE_IG_256)
        for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c * 32 + 16 * h)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (2 * c) * 32 + 16 * h),
                              _mm256_and_si256(w, _mm256_set1_epi16(0xF)));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (2 * c + 1) * 32 + 16 * h), _mm256_srli_epi16(w, 4));
        }
#else
        for (int i = 0; i < 32; ++i) {
          dst[(2 * c) * 32 + i] = src[c * 32 + i] & 0xF;
          dst[(2 * c + 1) * 32 + i] = src[c * 32 + i] >> 4;
        }
#endif
      }
    } else {
      const int8_t* src = reinterpret_cast<const int8_t*>(job.packed) + ((nb0 + t) * (job.k / 2) + k0 / 2) * 32;
      for (int64_t p = 0; p < pairs; ++p) {
#if defined(LOCKGATE_IG_512)
        _mm512_storeu_si512(dst + p * 32,
                            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + p * 32))));
#elif defined(LOCKGATE_IG_256)
        for (int h = 0; h < 2; ++h) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + p * 32 + 16 * h),
                              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + p * 32 + 16 * h))));
        }
#else
        for (int i = 0; i < 32; ++i) dst[p * 32 + i] = src[p * 32 + i];
#endif
      }
    }
  }
}

#if defined(LOCKGATE_IG_512)
// 16 float16 scales or offsets as float32 (exact).
inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Entries (nb, g, s, lanes 0..15) of the scales or zeros as float32.
inline __m512 load_table16(const Job& job, bool zero, int64_t nb, int64_t g, int s) {
  const void* t = zero ? job.zeros : job.scales;
  if (job.factored) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
        factor_ptr(job, t, nb, g, s)))));
    const __m512 v = _mm512_mul_ps(load_half16(super_ptr(job, t, nb, g)), f);
    return zero ? _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))) : v;
  }
  return load_half16(static_cast<const at::Half*>(t) + scale_index(job, nb, g, s));
}

// acc + the sums of adjacent int16 products of x and w, per int32 lane (exact)
inline __m512i dot512(__m512i acc, __m512i x, __m512i w) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, x, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}

// out[m0 .. m0 + MR, 16 nb0 .. 16 (nb0 + NR)] += the products of columns [k0, k0 + kb).
template <int MR, int NR, int SUB>
void tile_vnni_sub(const Job& job, int64_t m0, int64_t nb0, int64_t k0, int64_t kb, const int16_t* buf, bool first) {
  constexpr int64_t kPairs = kPairsPerGroup / SUB;  // column pairs per scale
  const int64_t pairs = kb / 2, n = job.nb * kLanes;
  __m512 f[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      f[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(job.out + (m0 + i) * n + (nb0 + j) * kLanes);
  for (int64_t gi = 0; gi < kb / kGroup; ++gi)
   for (int s = 0; s < SUB; ++s) {
    const int64_t g = k0 / kGroup + gi;
    __m512i a[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) a[i][j] = _mm512_setzero_si512();
    const int16_t* w = buf + (gi * kPairsPerGroup + s * kPairs) * 32;
#pragma GCC unroll 16
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512i wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512(w + (j * pairs + p) * 32);
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, job.xq + (m0 + i) * job.k + g * kGroup + 2 * (s * kPairs + p), sizeof pair);
        const __m512i xv = _mm512_set1_epi32(pair);
        for (int j = 0; j < NR; ++j) a[i][j] = dot512(a[i][j], xv, wv[j]);
      }
    }
    __m512 d[NR], z[NR];
    for (int j = 0; j < NR; ++j) {
      d[j] = load_table16(job, false, nb0 + j, g, s);
      if (job.zeros) z[j] = load_table16(job, true, nb0 + j, g, s);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 s = _mm512_set1_ps(job.xs[(m0 + i) * job.g + g]);
      for (int j = 0; j < NR; ++j) f[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i][j]), _mm512_mul_ps(d[j], s), f[i][j]);
      if (job.zeros) {
        const __m512 xsum = _mm512_set1_ps(job.xsum[(m0 + i) * job.g + g]);
        for (int j = 0; j < NR; ++j) f[i][j] = _mm512_fmadd_ps(z[j], xsum, f[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(job.out + (m0 + i) * n + (nb0 + j) * kLanes, f[i][j]);
}

template <int MR, int NR>
void tile_vnni(const Job& job, int64_t m0, int64_t nb0, int64_t k0, int64_t kb, const int16_t* buf, bool first) {
  if (job.sub == 2) return tile_vnni_sub<MR, NR, 2>(job, m0, nb0, k0, kb, buf, first);
  tile_vnni_sub<MR, NR, 1>(job, m0, nb0, k0, kb, buf, first);
}
#endif

#if defined(LOCKGATE_IG_VECTOR)
// The few-row path's prefetch of output-row blocks [n0, n1) (the next tile; none when n0 == n1):
// their codes, scales and offsets, spread over the steps of a tile (one per 4 columns of 4-bit
// codes, per column pair of 8-bit ones, as gemv_tile and gemv_tile_avx2 call next.step()).
lockgate::TilePrefetch next_tile(const Job& job, int64_t n0, int64_t n1) {
  const int64_t code_bytes = job.k * (job.bits == 4 ? 8 : 16), scale_bytes = job.block_bytes;
  lockgate::TilePrefetch next;
  next.add(job.packed + n0 * code_bytes, (n1 - n0) * code_bytes);
  next.add(reinterpret_cast<const char*>(job.scales) + n0 * scale_bytes, (n1 - n0) * scale_bytes);
  if (job.zeros) next.add(reinterpret_cast<const char*>(job.zeros) + n0 * scale_bytes, (n1 - n0) * scale_bytes);
  next.spread(job.g * (job.bits == 4 ? kGroup / 4 : kPairsPerGroup));
  return next;
}
#endif

#if defined(LOCKGATE_IG_512)
// Few rows (decode): out[0 .. MR, 16 nb0 .. 16 (nb0 + NR)] over all of K, the codes widened in
// registers straight from their packed bytes (no buffer: each byte is used by MR <= 6 rows only,
// so the step is bound by reading the weights and the widening's stores and reloads would cost
// more than they save). Same arithmetic, in the same order, as tile_vnni.
template <int MR, int NR, int SUB>
void gemv_tile_sub(const Job& job, int64_t nb0, lockgate::TilePrefetch& next) {
  constexpr int64_t kPairs = kPairsPerGroup / SUB;  // column pairs per scale (8-bit codes)
  const int64_t n = job.nb * kLanes;
  __m512 f[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) f[i][j] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(0xF);
  for (int64_t g = 0; g < job.g; ++g)
   for (int s = 0; s < SUB; ++s) {
    __m512i a[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) a[i][j] = _mm512_setzero_si512();
    if (SUB == 1 && job.bits == 4) {
      // the group's 8 chunks: chunk c holds columns 4c, 4c + 1 (low nibbles) and 4c + 2, 4c + 3 (high)
#pragma GCC unroll 8
      for (int64_t cg = 0; cg < kGroup / 4; ++cg) {
        const int64_t c = g * kGroup / 4 + cg;
        next.step();
        __m512i lo[MR], hi[MR];
        for (int i = 0; i < MR; ++i) {
          int32_t pair[2];
          std::memcpy(pair, job.xq + i * job.k + 4 * c, sizeof pair);
          lo[i] = _mm512_set1_epi32(pair[0]);
          hi[i] = _mm512_set1_epi32(pair[1]);
        }
        for (int j = 0; j < NR; ++j) {
          const uint8_t* src = job.packed + ((nb0 + j) * (job.k / 4) + c) * 32;
          _mm_prefetch(reinterpret_cast<const char*>(src + kGemvPrefetchBytes), _MM_HINT_T0);
          const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
          const __m512i wl = _mm512_and_si512(w, nibble), wh = _mm512_srli_epi16(w, 4);
          for (int i = 0; i < MR; ++i) {
            a[i][j] = dot512(a[i][j], lo[i], wl);
            a[i][j] = dot512(a[i][j], hi[i], wh);
          }
        }
      }
    } else {
      const int8_t* codes = reinterpret_cast<const int8_t*>(job.packed);
#pragma GCC unroll 16
      for (int64_t pg = 0; pg < kPairs; ++pg) {
        const int64_t p = g * kPairsPerGroup + s * kPairs + pg;
        next.step();
        __m512i xv[MR];
        for (int i = 0; i < MR; ++i) {
          int32_t pair;
          std::memcpy(&pair, job.xq + i * job.k + 2 * p, sizeof pair);
          xv[i] = _mm512_set1_epi32(pair);
        }
        for (int j = 0; j < NR; ++j) {
          const int8_t* src = codes + ((nb0 + j) * (job.k / 2) + p) * 32;
          _mm_prefetch(reinterpret_cast<const char*>(src + kGemvPrefetchBytes), _MM_HINT_T0);
          const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
          for (int i = 0; i < MR; ++i) a[i][j] = dot512(a[i][j], xv[i], w);
        }
      }
    }
    for (int j = 0; j < NR; ++j) {
      _mm_prefetch(table_ptr(job, false, nb0 + j, g + kGemvPrefetchGroups, s), _MM_HINT_T0);
      if (job.zeros) _mm_prefetch(table_ptr(job, true, nb0 + j, g + kGemvPrefetchGroups, s), _MM_HINT_T0);
      const __m512 d = load_table16(job, false, nb0 + j, g, s);
      for (int i = 0; i < MR; ++i) {
        const __m512 s = _mm512_set1_ps(job.xs[i * job.g + g]);
        f[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i][j]), _mm512_mul_ps(d, s), f[i][j]);
      }
      if (job.zeros) {
        const __m512 z = load_table16(job, true, nb0 + j, g, s);
        for (int i = 0; i < MR; ++i) f[i][j] = _mm512_fmadd_ps(z, _mm512_set1_ps(job.xsum[i * job.g + g]), f[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) _mm512_storeu_ps(job.out + i * n + (nb0 + j) * kLanes, f[i][j]);
}

template <int MR, int NR>
void gemv_tile(const Job& job, int64_t nb0, lockgate::TilePrefetch& next) {
  if (job.sub == 2) return gemv_tile_sub<MR, NR, 2>(job, nb0, next);
  gemv_tile_sub<MR, NR, 1>(job, nb0, next);
}

// Output-row blocks [b0, b1) for all MR rows, in tiles of gemv_tile_n<MR>() blocks; while a
// tile is multiplied, the next one's codes, scales and offsets are prefetched (TilePrefetch).
template <int MR>
void gemv_blocks(const Job& job, int64_t b0, int64_t b1) {
  constexpr int tn = gemv_tile_n<MR>();
  for (int64_t b = b0; b < b1;) {
    const int64_t nt = std::min<int64_t>(tn, b1 - b);
    lockgate::TilePrefetch next = next_tile(job, b + nt, std::min<int64_t>(b + nt + tn, b1));
    switch (nt) {  // a share's last blocks may be fewer than a tile
      case 1: gemv_tile<MR, 1>(job, b, next); break;
      case 2: gemv_tile<MR, 2>(job, b, next); break;
      case 3: if constexpr (tn >= 3) gemv_tile<MR, 3>(job, b, next); break;
      default: gemv_tile<MR, tn>(job, b, next); break;
    }
    b += nt;
  }
}

void run_gemv(const Job& job) {
  // contiguous, even shares of the output's 16-row blocks (ATen splits the range evenly)
  at::parallel_for(0, job.nb, kGemvGrain, [&](int64_t b0, int64_t b1) {
    switch (job.m) {
      case 1: gemv_blocks<1>(job, b0, b1); break;
      case 2: gemv_blocks<2>(job, b0, b1); break;
      case 3: gemv_blocks<3>(job, b0, b1); break;
      case 4: gemv_blocks<4>(job, b0, b1); break;
      case 5: gemv_blocks<5>(job, b0, b1); break;
      default: gemv_blocks<6>(job, b0, b1); break;
    }
  });
}
#endif

#if defined(LOCKGATE_IG_256)
// ---- 256-bit paths (AVX2, AVX-VNNI). A "half" is 8 of a 16-row block's output rows: half h of
// block nb is rows 16 nb + 8 h .. + 8, one ymm of int32 (or float32) lanes; in the packed codes and
// the widening buffer it is bytes / int16 [16 h, 16 h + 16) of every 32-wide chunk. ----

// 8 float16 scales or offsets as float32 (exact).
inline __m256 load_half8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Entries (nb, g, s, lanes lane0 .. lane0 + 7) of the scales or zeros as float32.
inline __m256 load_table8(const Job& job, bool zero, int64_t nb, int64_t g, int s, int lane0) {
  const void* t = zero ? job.zeros : job.scales;
  if (job.factored) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
        factor_ptr(job, t, nb, g, s) + lane0))));
    const __m256 v = _mm256_mul_ps(load_half8(super_ptr(job, t, nb, g) + lane0), f);
    return zero ? _mm256_xor_ps(v, _mm256_set1_ps(-0.f)) : v;
  }
  return load_half8(static_cast<const at::Half*>(t) + scale_index(job, nb, g, s) + lane0);
}

// acc + the sums of adjacent int16 products of x and w, per int32 lane (exact)
inline __m256i dot256(__m256i acc, __m256i x, __m256i w) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, x, w);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w));
#endif
}

inline __m256i broadcast_pair(const int16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return _mm256_set1_epi32(pair);
}

// Scale one group's int32 sums into the float32 total f, as every path does: f + a (d s), then + z sum(x).
inline __m256 scale_group(__m256 f, __m256i a, __m256 d, float s, const __m256* z, float xsum) {
  f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(d, _mm256_set1_ps(s)), f);
  return z ? _mm256_fmadd_ps(*z, _mm256_set1_ps(xsum), f) : f;
}

// out[m0 .. m0 + MR, the rows of halves h0 .. h0 + NH of the tile at block nb0] += the products of
// columns [k0, k0 + kb), from the widened codes in buf. The float32 totals live in out between groups
// (16 ymm registers hold the MR x NH int32 sums, the NH code vectors and one broadcast x pair).
template <int MR, int NH, int SUB>
void tile_avx2_sub(const Job& job, int64_t m0, int64_t nb0, int h0, int64_t k0, int64_t kb, const int16_t* buf,
                   bool first) {
  constexpr int64_t kPairs = kPairsPerGroup / SUB;  // column pairs per scale
  const int64_t pairs = kb / 2, n = job.nb * kLanes;
  for (int64_t gi = 0; gi < kb / kGroup; ++gi)
   for (int s = 0; s < SUB; ++s) {
    const int64_t g = k0 / kGroup + gi;
    __m256i a[MR][NH];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NH; ++j) a[i][j] = _mm256_setzero_si256();
    // row and code pointers once per group (a runtime index inside the unrolled loop makes gcc
    // precompute and spill an address per pair)
    const int16_t* wp[NH];
    for (int j = 0; j < NH; ++j) {
      const int h = h0 + j;
      wp[j] = buf + ((h / 2) * pairs + gi * kPairsPerGroup + s * kPairs) * 32 + 16 * (h % 2);
    }
    const int16_t* xr[MR];
    for (int i = 0; i < MR; ++i) xr[i] = job.xq + (m0 + i) * job.k + g * kGroup + 2 * s * kPairs;
#pragma GCC unroll 4
    for (int64_t p = 0; p < kPairs; ++p) {
      __m256i wv[NH];
      for (int j = 0; j < NH; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp[j] + p * 32));
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = broadcast_pair(xr[i] + 2 * p);
        for (int j = 0; j < NH; ++j) a[i][j] = dot256(a[i][j], xv, wv[j]);
      }
    }
    for (int j = 0; j < NH; ++j) {
      const int h = h0 + j;
      const __m256 d = load_table8(job, false, nb0 + h / 2, g, s, 8 * (h % 2));
      __m256 z;
      if (job.zeros) z = load_table8(job, true, nb0 + h / 2, g, s, 8 * (h % 2));
      for (int i = 0; i < MR; ++i) {
        float* o = job.out + (m0 + i) * n + (nb0 + h / 2) * kLanes + 8 * (h % 2);
        const __m256 f = first && gi == 0 && s == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o);
        const int64_t xg = (m0 + i) * job.g + g;
        _mm256_storeu_ps(o, scale_group(f, a[i][j], d, job.xs[xg], job.zeros ? &z : nullptr,
                                        job.zeros ? job.xsum[xg] : 0.f));
      }
    }
  }
}

template <int MR, int NH>
void tile_avx2(const Job& job, int64_t m0, int64_t nb0, int h0, int64_t k0, int64_t kb, const int16_t* buf, bool first) {
  if (job.sub == 2) return tile_avx2_sub<MR, NH, 2>(job, m0, nb0, h0, k0, kb, buf, first);
  tile_avx2_sub<MR, NH, 1>(job, m0, nb0, h0, k0, kb, buf, first);
}

// Few rows: out[m0 .. m0 + MR, blocks nb0 .. nb0 + NB] over all of K, codes widened in registers
// as they stream in (as gemv_tile), float32 totals in registers.
template <int MR, int NB, int SUB>
void gemv_tile_avx2_sub(const Job& job, int64_t m0, int64_t nb0, lockgate::TilePrefetch& next) {
  constexpr int NH = 2 * NB;
  constexpr int64_t kPairs = kPairsPerGroup / SUB;  // column pairs per scale (8-bit codes)
  const int64_t n = job.nb * kLanes;
  __m256 f[MR][NH];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NH; ++j) f[i][j] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi16(0xF);
  for (int64_t g = 0; g < job.g; ++g)
   for (int s = 0; s < SUB; ++s) {
    __m256i a[MR][NH];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NH; ++j) a[i][j] = _mm256_setzero_si256();
    if (SUB == 1 && job.bits == 4) {
#pragma GCC unroll 8
      for (int64_t cg = 0; cg < kGroup / 4; ++cg) {
        const int64_t c = g * kGroup / 4 + cg;
        next.step();
        __m256i lo[MR], hi[MR];
        for (int i = 0; i < MR; ++i) {
          lo[i] = broadcast_pair(job.xq + (m0 + i) * job.k + 4 * c);
          hi[i] = broadcast_pair(job.xq + (m0 + i) * job.k + 4 * c + 2);
        }
        for (int b = 0; b < NB; ++b) {
          const uint8_t* src = job.packed + ((nb0 + b) * (job.k / 4) + c) * 32;
          _mm_prefetch(reinterpret_cast<const char*>(src + kGemvPrefetchBytes), _MM_HINT_T0);
          for (int h = 0; h < 2; ++h) {
            const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * h)));
            const __m256i wl = _mm256_and_si256(w, nibble), wh = _mm256_srli_epi16(w, 4);
            for (int i = 0; i < MR; ++i) {
              a[i][2 * b + h] = dot256(a[i][2 * b + h], lo[i], wl);
              a[i][2 * b + h] = dot256(a[i][2 * b + h], hi[i], wh);
            }
          }
        }
      }
    } else {
      const int8_t* codes = reinterpret_cast<const int8_t*>(job.packed);
#pragma GCC unroll 16
      for (int64_t pg = 0; pg < kPairs; ++pg) {
        const int64_t p = g * kPairsPerGroup + s * kPairs + pg;
        next.step();
        __m256i xv[MR];
        for (int i = 0; i < MR; ++i) xv[i] = broadcast_pair(job.xq + (m0 + i) * job.k + 2 * p);
        for (int b = 0; b < NB; ++b) {
          const int8_t* src = codes + ((nb0 + b) * (job.k / 2) + p) * 32;
          _mm_prefetch(reinterpret_cast<const char*>(src + kGemvPrefetchBytes), _MM_HINT_T0);
          for (int h = 0; h < 2; ++h) {
            const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * h)));
            for (int i = 0; i < MR; ++i) a[i][2 * b + h] = dot256(a[i][2 * b + h], xv[i], w);
          }
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(table_ptr(job, false, nb0 + b, g + kGemvPrefetchGroups, s), _MM_HINT_T0);
      if (job.zeros) _mm_prefetch(table_ptr(job, true, nb0 + b, g + kGemvPrefetchGroups, s), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        const __m256 d = load_table8(job, false, nb0 + b, g, s, 8 * h);
        __m256 z;
        if (job.zeros) z = load_table8(job, true, nb0 + b, g, s, 8 * h);
        for (int i = 0; i < MR; ++i) {
          const int64_t xg = (m0 + i) * job.g + g;
          f[i][2 * b + h] = scale_group(f[i][2 * b + h], a[i][2 * b + h], d, job.xs[xg], job.zeros ? &z : nullptr,
                                        job.zeros ? job.xsum[xg] : 0.f);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NH; ++j) _mm256_storeu_ps(job.out + (m0 + i) * n + nb0 * kLanes + 8 * j, f[i][j]);
}

template <int MR, int NB>
void gemv_tile_avx2(const Job& job, int64_t m0, int64_t nb0, lockgate::TilePrefetch& next) {
  if (job.sub == 2) return gemv_tile_avx2_sub<MR, NB, 2>(job, m0, nb0, next);
  gemv_tile_avx2_sub<MR, NB, 1>(job, m0, nb0, next);
}

// ---- int8 activations on 4-bit codes (AVX2's VPMADDUBSW: 32 unsigned-by-signed byte products,
// adjacent pairs summed to int16, per instruction; twice VPMADDWD's 16). The int32 sums are the same
// exact integers the int16 paths form from the same int8-valued x, so the result is bitwise theirs.
// Bounds: a product is at most 15 * 127, an int16 lane sums at most 8 pairs of them (30,480 <
// 32,767) before it is widened to int32, so nothing saturates. ----

// Few rows: as gemv_tile_avx2 for 4-bit codes, on x8. A chunk's 32 bytes hold 16 rows x 4 columns;
// its low nibbles are each row's first column pair (adjacent bytes), so one VPMADDUBSW against the
// pair broadcast gives 16 rows' int16 sums; 4 chunks' sums stay in int16, then widen to int32.
template <int MR, int NB>
void gemv_tile_avx2_a8(const Job& job, int64_t m0, int64_t nb0, lockgate::TilePrefetch& next) {
  constexpr int NH = 2 * NB;
  const int64_t n = job.nb * kLanes;
  __m256 f[MR][NH];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NH; ++j) f[i][j] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0xF);
  for (int64_t g = 0; g < job.g; ++g) {
    __m256i a[MR][NH];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NH; ++j) a[i][j] = _mm256_setzero_si256();
    for (int q = 0; q < 2; ++q) {  // the group's two runs of 4 chunks (16 columns)
      __m256i s16[MR][NB];
      for (int i = 0; i < MR; ++i)
        for (int b = 0; b < NB; ++b) s16[i][b] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int64_t cq = 0; cq < 4; ++cq) {
        const int64_t c = g * kGroup / 4 + q * 4 + cq;
        next.step();
        __m256i lo[MR], hi[MR];
        for (int i = 0; i < MR; ++i) {
          int16_t pair[2];
          std::memcpy(pair, job.x8 + (m0 + i) * job.k + 4 * c, sizeof pair);
          lo[i] = _mm256_set1_epi16(pair[0]);
          hi[i] = _mm256_set1_epi16(pair[1]);
        }
        for (int b = 0; b < NB; ++b) {
          const uint8_t* src = job.packed + ((nb0 + b) * (job.k / 4) + c) * 32;
          _mm_prefetch(reinterpret_cast<const char*>(src + kGemvPrefetchBytes), _MM_HINT_T0);
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
          const __m256i wl = _mm256_and_si256(w, nibble), wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
          for (int i = 0; i < MR; ++i) {
            s16[i][b] = _mm256_add_epi16(s16[i][b], _mm256_maddubs_epi16(wl, lo[i]));
            s16[i][b] = _mm256_add_epi16(s16[i][b], _mm256_maddubs_epi16(wh, hi[i]));
          }
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int b = 0; b < NB; ++b) {  // int16 lane l = row l of the block: halves are its 128-bit lanes
          a[i][2 * b] = _mm256_add_epi32(a[i][2 * b], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16[i][b])));
          a[i][2 * b + 1] = _mm256_add_epi32(a[i][2 * b + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16[i][b], 1)));
        }
    }
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(table_ptr(job, false, nb0 + b, g + kGemvPrefetchGroups, 0), _MM_HINT_T0);
      _mm_prefetch(table_ptr(job, true, nb0 + b, g + kGemvPrefetchGroups, 0), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        const __m256 d = load_table8(job, false, nb0 + b, g, 0, 8 * h);
        const __m256 z = load_table8(job, true, nb0 + b, g, 0, 8 * h);
        for (int i = 0; i < MR; ++i) {
          const int64_t xg = (m0 + i) * job.g + g;
          f[i][2 * b + h] = scale_group(f[i][2 * b + h], a[i][2 * b + h], d, job.xs[xg], &z, job.xsum[xg]);
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NH; ++j) _mm256_storeu_ps(job.out + (m0 + i) * n + nb0 * kLanes + 8 * j, f[i][j]);
}

// Many rows: the 4-bit codes of blocks [nb0, nb0 + nt), columns [k0, k0 + kb), as bytes in
// buf8[t][h][kb / 4][32]: per half h of block t and column quad q, 8 rows x 4 columns (byte 4 r + e
// = code(row 16 (nb0 + t) + 8 h + r, column k0 + 4 q + e)), so one VPMADDUBSW against a row's 4
// bytes of x broadcast gives 8 rows' sums in int16 pairs, and VPMADDWD by ones then adds each pair.
void widen_block_a8(const Job& job, int64_t nb0, int nt, int64_t k0, int64_t kb, uint8_t* buf) {
  const int64_t quads = kb / 4;
  const __m128i nibble = _mm_set1_epi8(0xF);
  for (int t = 0; t < nt; ++t) {
    const uint8_t* src = job.packed + ((nb0 + t) * (job.k / 4) + k0 / 4) * 32;
    for (int64_t q = 0; q < quads; ++q)
      for (int h = 0; h < 2; ++h) {
        // bytes 2 r, 2 r + 1 of the half: row r's columns 0, 1 (low nibbles) and 2, 3 (high)
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + q * 32 + 16 * h));
        const __m128i lo = _mm_and_si128(v, nibble), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
        uint8_t* dst = buf + ((t * 2 + h) * quads + q) * 32;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_unpacklo_epi16(lo, hi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm_unpackhi_epi16(lo, hi));
      }
  }
}

// out[m0 .. m0 + MR, halves h0 .. h0 + NH of the tile at nb0] += the products of columns [k0, k0 + kb),
// from buf8 (widen_block_a8); float32 totals in out between groups, as tile_avx2_sub.
template <int MR, int NH>
void tile_avx2_a8(const Job& job, int64_t m0, int64_t nb0, int h0, int64_t k0, int64_t kb, const uint8_t* buf,
                  bool first) {
  const int64_t quads = kb / 4, n = job.nb * kLanes;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t gi = 0; gi < kb / kGroup; ++gi) {
    const int64_t g = k0 / kGroup + gi;
    __m256i a[MR][NH];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NH; ++j) a[i][j] = _mm256_setzero_si256();
    const uint8_t* wp[NH];
    for (int j = 0; j < NH; ++j) wp[j] = buf + ((h0 + j) * quads + gi * (kGroup / 4)) * 32;
    const int8_t* xr[MR];
    for (int i = 0; i < MR; ++i) xr[i] = job.x8 + (m0 + i) * job.k + g * kGroup;
#pragma GCC unroll 8
    for (int64_t q = 0; q < kGroup / 4; ++q) {
      __m256i wv[NH];
      for (int j = 0; j < NH; ++j) wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp[j] + q * 32));
      for (int i = 0; i < MR; ++i) {
        int32_t quad;
        std::memcpy(&quad, xr[i] + 4 * q, sizeof quad);
        const __m256i xv = _mm256_set1_epi32(quad);
        for (int j = 0; j < NH; ++j) a[i][j] = _mm256_add_epi16(a[i][j], _mm256_maddubs_epi16(wv[j], xv));
      }
    }
    for (int j = 0; j < NH; ++j) {
      const int h = h0 + j;
      const __m256 d = load_table8(job, false, nb0 + h / 2, g, 0, 8 * (h % 2));
      const __m256 z = load_table8(job, true, nb0 + h / 2, g, 0, 8 * (h % 2));
      for (int i = 0; i < MR; ++i) {
        float* o = job.out + (m0 + i) * n + (nb0 + h / 2) * kLanes + 8 * (h % 2);
        const __m256 f = first && gi == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o);
        const int64_t xg = (m0 + i) * job.g + g;
        _mm256_storeu_ps(o, scale_group(f, _mm256_madd_epi16(a[i][j], ones), d, job.xs[xg], &z, job.xsum[xg]));
      }
    }
  }
}

// Output-row blocks [b0, b1) for x rows [m0, m0 + MR): tiles of 2 blocks for one row, with the
// next tile's codes, scales and offsets prefetched during each (as gemv_blocks), else tiles of
// 1 block, where each stream's own prefetch already runs into the next block (measured under
// LOCKGATE_KERNEL_MARCH=haswell on the Zen 4 class CPU: the next-tile prefetch took ~10% off
// one row's calls and added ~10% to three rows' LM head).
template <int MR>
void gemv_rows_avx2(const Job& job, int64_t m0, int64_t b0, int64_t b1) {
  constexpr int64_t tn = MR == 1 ? 2 : 1;
  for (int64_t b = b0; b < b1;) {
    const int64_t nt = std::min<int64_t>(tn, b1 - b);
    lockgate::TilePrefetch next = MR == 1 ? next_tile(job, b + nt, std::min<int64_t>(b + nt + tn, b1))
                                          : lockgate::TilePrefetch{};
    const bool a8 = job.x8 && job.bits == 4;
    if (nt == 2) {
      if constexpr (MR == 1) a8 ? gemv_tile_avx2_a8<1, 2>(job, m0, b, next) : gemv_tile_avx2<1, 2>(job, m0, b, next);
    } else {
      a8 ? gemv_tile_avx2_a8<MR, 1>(job, m0, b, next) : gemv_tile_avx2<MR, 1>(job, m0, b, next);
    }
    b += nt;
  }
}

void run_gemv(const Job& job) {
  at::parallel_for(0, job.nb, kGemvGrain, [&](int64_t b0, int64_t b1) {
    // passes of at most 3 x rows over the share: 4 = 2 + 2, 5 = 3 + 2, 6 = 3 + 3. A later pass
    // re-reads a tile's codes from cache, block by block (a block of 16 rows x K is <= 12 KB at
    // K = 1,536 and 4 bits), so the weights still stream from memory once per call.
    for (int64_t blk = b0; blk < b1; blk += kGemvGrain) {
      const int64_t blk1 = std::min(b1, blk + kGemvGrain);
      for (int64_t m0 = 0; m0 < job.m;) {
        const int64_t left = job.m - m0, mr = left == 4 ? 2 : std::min<int64_t>(3, left);
        switch (mr) {
          case 1: gemv_rows_avx2<1>(job, m0, blk, blk1); break;
          case 2: gemv_rows_avx2<2>(job, m0, blk, blk1); break;
          default: gemv_rows_avx2<3>(job, m0, blk, blk1); break;
        }
        m0 += mr;
      }
    }
  });
}
#endif

// The same arithmetic in plain C++ (any CPU; also the reference the vector path is tested against).
void tile_generic(const Job& job, int64_t m0, int mr, int64_t nb0, int nr, int64_t k0, int64_t kb, const int16_t* buf,
                  bool first) {
  const int64_t pairs = kb / 2, n = job.nb * kLanes;
  for (int i = 0; i < mr; ++i) {
    for (int j = 0; j < nr; ++j) {
      for (int64_t l = 0; l < kLanes; ++l) {
        float* o = job.out + (m0 + i) * n + (nb0 + j) * kLanes + l;
        float f = first ? 0.f : *o;
        const int64_t per = kPairsPerGroup / job.sub;  // column pairs per scale
        for (int64_t gi = 0; gi < kb / kGroup; ++gi) {
          const int64_t g = k0 / kGroup + gi;
          for (int s = 0; s < job.sub; ++s) {
            int32_t acc = 0;
            for (int64_t p = gi * kPairsPerGroup + s * per; p < gi * kPairsPerGroup + (s + 1) * per; ++p)
              for (int e = 0; e < 2; ++e)
                acc += static_cast<int32_t>(job.xq[(m0 + i) * job.k + k0 + 2 * p + e]) * buf[(j * pairs + p) * 32 + 2 * l + e];
            const int lane = static_cast<int>(l);
            f = std::fma(static_cast<float>(acc), table_at(job, false, nb0 + j, g, s, lane) * job.xs[(m0 + i) * job.g + g], f);
            if (job.zeros) f = std::fma(table_at(job, true, nb0 + j, g, s, lane), job.xsum[(m0 + i) * job.g + g], f);
          }
        }
        *o = f;
      }
    }
  }
}

#if defined(LOCKGATE_IG_256)
// rows_of_tile for int8 activations on 4-bit codes (buf: widen_block_a8's bytes).
template <int NR>
void rows_of_tile_a8(const Job& job, int64_t m0, int64_t m1, int64_t nb0, int64_t k0, int64_t kb, const uint8_t* buf,
                     bool first) {
  for (int h0 = 0; h0 < 2 * NR; h0 += 2) {
    int64_t r = m0;
    for (; r + kTileM256 <= m1; r += kTileM256) tile_avx2_a8<kTileM256, 2>(job, r, nb0, h0, k0, kb, buf, first);
    switch (m1 - r) {
      case 3: tile_avx2_a8<3, 2>(job, r, nb0, h0, k0, kb, buf, first); break;
      case 2: tile_avx2_a8<2, 2>(job, r, nb0, h0, k0, kb, buf, first); break;
      case 1: tile_avx2_a8<1, 2>(job, r, nb0, h0, k0, kb, buf, first); break;
      default: break;
    }
  }
}
#endif

template <int NR>
void rows_of_tile(const Job& job, int64_t m0, int64_t m1, int64_t nb0, int64_t k0, int64_t kb, const int16_t* buf,
                  bool first) {
#if defined(LOCKGATE_IG_512)
  if (!job.generic) {
    for (; m0 + kTileM <= m1; m0 += kTileM) tile_vnni<kTileM, NR>(job, m0, nb0, k0, kb, buf, first);
    switch (m1 - m0) {
      case 3: tile_vnni<3, NR>(job, m0, nb0, k0, kb, buf, first); break;
      case 2: tile_vnni<2, NR>(job, m0, nb0, k0, kb, buf, first); break;
      case 1: tile_vnni<1, NR>(job, m0, nb0, k0, kb, buf, first); break;
      default: break;
    }
    return;
  }
#elif defined(LOCKGATE_IG_256)
  if (!job.generic) {
    // the tile's 2 NR halves in pairs, x rows 4 at a time
    for (int h0 = 0; h0 < 2 * NR; h0 += 2) {
      int64_t r = m0;
      for (; r + kTileM256 <= m1; r += kTileM256) tile_avx2<kTileM256, 2>(job, r, nb0, h0, k0, kb, buf, first);
      switch (m1 - r) {
        case 5: tile_avx2<5, 2>(job, r, nb0, h0, k0, kb, buf, first); break;
        case 4: tile_avx2<4, 2>(job, r, nb0, h0, k0, kb, buf, first); break;
        case 3: tile_avx2<3, 2>(job, r, nb0, h0, k0, kb, buf, first); break;
        case 2: tile_avx2<2, 2>(job, r, nb0, h0, k0, kb, buf, first); break;
        case 1: tile_avx2<1, 2>(job, r, nb0, h0, k0, kb, buf, first); break;
        default: break;
      }
    }
    return;
  }
#endif
  for (; m0 < m1; m0 += kTileM)
    tile_generic(job, m0, static_cast<int>(std::min<int64_t>(kTileM, m1 - m0)), nb0, NR, k0, kb, buf, first);
}

void run(const Job& job) {
#if defined(LOCKGATE_IG_VECTOR)
  if (!job.generic && job.m <= kGemvMaxRows) return run_gemv(job);
#endif
  const int64_t tiles = (job.nb + kTileN - 1) / kTileN;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int16_t> buf(static_cast<size_t>(kTileN * kBlockK / 2 * 32));
    // rows in chunks whose int16 x stays in L2 while this thread's tiles pass over it
    for (int64_t m0 = 0; m0 < job.m; m0 += kChunkM) {
      const int64_t m1 = std::min(job.m, m0 + kChunkM);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t nb0 = t * kTileN;
        const int nt = static_cast<int>(std::min<int64_t>(kTileN, job.nb - nb0));
        for (int64_t k0 = 0; k0 < job.k; k0 += kBlockK) {
          const int64_t kb = std::min(kBlockK, job.k - k0);
          const bool first = k0 == 0;
#if defined(LOCKGATE_IG_256)
          if (!job.generic && job.x8 && job.bits == 4) {  // int8 activations: bytes, not int16
            uint8_t* buf8 = reinterpret_cast<uint8_t*>(buf.data());
            widen_block_a8(job, nb0, nt, k0, kb, buf8);
            switch (nt) {
              case 3: rows_of_tile_a8<3>(job, m0, m1, nb0, k0, kb, buf8, first); break;
              case 2: rows_of_tile_a8<2>(job, m0, m1, nb0, k0, kb, buf8, first); break;
              default: rows_of_tile_a8<1>(job, m0, m1, nb0, k0, kb, buf8, first); break;
            }
            continue;
          }
#endif
          widen_block(job, nb0, nt, k0, kb, buf.data());
          switch (nt) {
            case 3: rows_of_tile<3>(job, m0, m1, nb0, k0, kb, buf.data(), first); break;
            case 2: rows_of_tile<2>(job, m0, m1, nb0, k0, kb, buf.data(), first); break;
            default: rows_of_tile<1>(job, m0, m1, nb0, k0, kb, buf.data(), first); break;
          }
        }
      }
    }
  });
}

}  // namespace
}  // namespace lockgate::int_gemm_impl

namespace lockgate {

namespace int_gemm_impl {
namespace {

// out [M, N] = y [M, N] float32 + bias (B: its dtype, widened exactly; nullptr: none) in x's dtype
// T: float32 as summed (out may be y), a 16-bit T rounded to nearest even (c10's conversion: the
// bits ``Tensor.to`` gives a finite or infinite value; a NaN as a NaN).
template <typename T, typename B>
void finish_out(const float* y, const B* bias, int64_t m, int64_t n, T* out) {
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = y + r * n;
      T* dst = out + r * n;
      if (bias) {
        for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<T>(src[j] + static_cast<float>(bias[j]));
      } else {
        for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<T>(src[j]);
      }
    }
  });
}

template <typename T>
void finish_out(const float* y, const std::optional<at::Tensor>& bias, int64_t m, int64_t n, T* out) {
  if (!bias) {
    if constexpr (!std::is_same_v<T, float>) finish_out(y, static_cast<const float*>(nullptr), m, n, out);
  } else if (bias->scalar_type() == at::kFloat) {
    finish_out(y, bias->data_ptr<float>(), m, n, out);
  } else if (bias->scalar_type() == at::kBFloat16) {
    finish_out(y, bias->data_ptr<at::BFloat16>(), m, n, out);
  } else {
    finish_out(y, bias->data_ptr<at::Half>(), m, n, out);
  }
}

at::Tensor int_linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const std::optional<at::Tensor>& zeros, int64_t bits, const std::optional<at::Tensor>& bias,
                           int64_t act_bits, bool generic) {
  TORCH_CHECK(bits == 4 || bits == 8, "int_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(act_bits == 16 || act_bits == 8, "int_linear: act_bits must be 16 or 8, got ", act_bits);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "int_linear: x must be contiguous float32, bfloat16 or float16 [M, K] on the CPU");
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  TORCH_CHECK(k > 0 && k % kGroup == 0, "int_linear: K = ", k, " is not a positive multiple of ", kGroup);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) == k * bits / 16 && packed.size(2) == 32 &&
                  packed.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "int_linear: packed must be contiguous ", bits == 8 ? "int8 [N / 16, K / 2, 32]" : "uint8 [N / 16, K / 4, 32]");
  const int64_t nb = packed.size(0);
  // the tables: float16 [NB, G * sub, 16], or factored uint8 [NB, G * sub * 16 + K / 256 * 32]
  const bool factored = scales.scalar_type() == at::kByte;
  const bool may_split = bits == 8;  // a scale per 16 columns: 8 bits
  int64_t sub = 1;
  if (factored) {
    TORCH_CHECK(k % 256 == 0, "int_linear: factored scales need K % 256 == 0, got K = ", k);
    const int64_t supers = k / 256 * kLanes * 2;
    if (may_split && scales.dim() == 2 && scales.size(1) == groups * 2 * kLanes + supers) sub = 2;
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == nb && scales.size(1) == groups * sub * kLanes + supers &&
                    scales.is_contiguous(),
                "int_linear: factored scales must be contiguous uint8 [N / 16, K / 32 * 16 + K / 256 * 32] (or "
                "[N / 16, K / 16 * 16 + K / 256 * 32] for bits 8)");
  } else {
    if (may_split && scales.dim() == 3 && scales.size(1) == 2 * groups) sub = 2;
    TORCH_CHECK(scales.sizes() == at::IntArrayRef({nb, groups * sub, kLanes}) && scales.is_contiguous() &&
                    scales.scalar_type() == at::kHalf,
                "int_linear: scales must be contiguous float16 [N / 16, K / 32, 16] (or [N / 16, K / 16, 16] for "
                "bits 8), or factored uint8");
  }
  TORCH_CHECK(bits == 8 || zeros.has_value(), "int_linear: zeros are required for bits 4");
  if (zeros) {
    TORCH_CHECK(zeros->sizes() == scales.sizes() && zeros->is_contiguous() && zeros->scalar_type() == scales.scalar_type(),
                "int_linear: zeros must be contiguous, of the scales' shape and dtype");
  }
  const int64_t n = nb * kLanes;
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() && bias->device().is_cpu() &&
                        (bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16 ||
                         bias->scalar_type() == at::kHalf)),
              "int_linear: bias must be contiguous float32, bfloat16 or float16 [N] = [", n, "] on the CPU");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  std::vector<int16_t> xq(static_cast<size_t>(m * k));
  std::vector<int8_t> x8(act_bits == 8 ? static_cast<size_t>(m * k) : 0);
  std::vector<float> xs(static_cast<size_t>(m * groups)), xsum(zeros ? static_cast<size_t>(m * groups) : 0);
  const bool sums = zeros.has_value();
  const float qmax = act_bits == 8 ? 127.f : 32767.f;
  int8_t* x8p = act_bits == 8 ? x8.data() : nullptr;
  if (dtype == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), m, k, sums, qmax, xq.data(), x8p, xs.data(), xsum.data());
  } else if (dtype == at::kBFloat16) {
    quantize_rows(x.data_ptr<at::BFloat16>(), m, k, sums, qmax, xq.data(), x8p, xs.data(), xsum.data());
  } else {
    quantize_rows(x.data_ptr<at::Half>(), m, k, sums, qmax, xq.data(), x8p, xs.data(), xsum.data());
  }
  // the float32 result: straight into out for a float32 x, else into a buffer rounded afterwards
  const at::Tensor wide = dtype == at::kFloat ? out : at::empty({m, n}, x.options().dtype(at::kFloat));
  float* y = wide.data_ptr<float>();
  const Job job{xq.data(), x8p, xs.data(), sums ? xsum.data() : nullptr, m, k, groups, nb,
                reinterpret_cast<const uint8_t*>(packed.data_ptr()), scales.data_ptr(),
                sums ? zeros->data_ptr() : nullptr, static_cast<int>(bits), y, generic, factored,
                static_cast<int>(sub), groups * sub * kLanes,
                factored ? groups * sub * kLanes + k / 256 * kLanes * 2 : groups * sub * kLanes * 2};
  run(job);
  if (dtype == at::kFloat) {
    finish_out(y, bias, m, n, y);  // the bias added in place (nothing to do without one)
  } else if (dtype == at::kBFloat16) {
    finish_out(y, bias, m, n, out.data_ptr<at::BFloat16>());
  } else {
    finish_out(y, bias, m, n, out.data_ptr<at::Half>());
  }
  return out;
}

}  // namespace
}  // namespace int_gemm_impl

at::Tensor int_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zeros, int64_t bits, const std::optional<at::Tensor>& bias,
                      int64_t act_bits) {
  return int_gemm_impl::int_linear_impl(x, packed, scales, zeros, bits, bias, act_bits, false);
}

// The plain C++ path on any CPU (what a CPU without VNNI runs): for tests of the vector path.
at::Tensor int_linear_reference(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                                const std::optional<at::Tensor>& zeros, int64_t bits,
                                const std::optional<at::Tensor>& bias, int64_t act_bits) {
  return int_gemm_impl::int_linear_impl(x, packed, scales, zeros, bits, bias, act_bits, true);
}

bool int_linear_vectorized() {
#if defined(LOCKGATE_IG_VECTOR)
  return true;
#else
  return false;
#endif
}

// The vector path this build runs (see the top of this file).
std::string int_linear_isa() {
#if defined(LOCKGATE_IG_512) && defined(__AVX512VNNI__)
  return "avx512-vnni";
#elif defined(LOCKGATE_IG_512)
  return "avx512bw";
#elif defined(LOCKGATE_IG_256) && defined(__AVXVNNI__)
  return "avx2-vnni";
#elif defined(LOCKGATE_IG_256)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("int_linear(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, int bits, Tensor? bias=None, "
        "int act_bits=16) -> Tensor");
  m.def("int_linear_reference(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, int bits, "
        "Tensor? bias=None, int act_bits=16) -> Tensor");
  m.def("int_linear_vectorized() -> bool", &lockgate::int_linear_vectorized);
  m.def("int_linear_isa() -> str", &lockgate::int_linear_isa);
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) {
  m.impl("int_linear", &lockgate::int_linear);
  m.impl("int_linear_reference", &lockgate::int_linear_reference);
}

// This file's macros end with it (a unity build compiles several sources as one unit).
#undef LOCKGATE_IG_512
#undef LOCKGATE_IG_256
#undef LOCKGATE_IG_VECTOR
