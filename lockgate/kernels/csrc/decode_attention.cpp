// Decode attention over the slot-indexed KV pool (TokenAttention), read in place.
//
// lockgate::decode_attention(q, k_cache, v_cache, slots, offsets, scale) -> (out, lse)
//
//   q        [B, H, D]      float32 or bfloat16; last dim contiguous, other strides free
//   k_cache  [C, Hkv, D]    float32 or bfloat16 (one layer of the pool), contiguous
//   v_cache  [C, Hkv, D]    same dtype as k_cache, contiguous
//   slots    [N]   int64    keys of sequence b are slots[offsets[b] : offsets[b + 1]]
//   offsets  [B+1] int64    (CSR); every sequence has at least one key
//   out      [B, H, D]      q's dtype: softmax(scale * q k^T) v over the sequence's keys
//   lse      [B, H]         float32: log-sum-exp of the scaled scores (to merge partial results)
//
// lockgate::prefill_attention(q, k_cache, v_cache, slots, offsets, q_offsets, scale) -> (out, lse)
//
//   q          [T, H, D]    every new token of the step; sequence b's are rows q_offsets[b] .. q_offsets[b+1]
//   q_offsets  [B+1] int64  (CSR over q); Q_b = q_offsets[b+1] - q_offsets[b] >= 1, Q_b <= the keys of b
//   out [T, H, D], lse [T, H]: token i of sequence b (the last Q_b of its n_b keys are the new
//   tokens) attends to keys 0 .. n_b - Q_b + i: causal, each token one row of the computation below
//   over its own keys, so a token's result is bitwise what decode_attention gives it as a sequence
//   of its own with those keys (the same chunks, the same merge), whatever else is in the step.
//
// One query token per sequence, every key visible (decode). Query heads h = kv * G + g share
// kv head kv (GQA, G = H / Hkv). A work item is (sequence, kv head, key chunk): it reads each
// key's K and V row once, straight from the pool by slot (no gathered copy, no padding to the
// longest sequence), scores its G query heads against it, and keeps a partial softmax
// (max, sum, weighted V sum) in float32. Every sequence is split into chunks of kChunkKeys keys,
// whose partials are then merged by their maxima in key order: the result does not depend on the
// batch or the thread count. Math is float32 whatever the storage dtype; bf16 is
// widened by a shift, so no AVX512-BF16 instruction is needed. Vector paths for head sizes 32, 64,
// 96, 128 and 256 on AVX-512 (zmm) and, on CPUs without it, for 32, 64, 128 and 256 on AVX2 + FMA
// (ymm); other head sizes and CPUs take plain loops. Paths differ in summation order (last-bit differences
// between CPU types), never within one build.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define LOCKGATE_ATTN_256 1
#include <immintrin.h>
#endif

namespace {

using lockgate::exp_nonpositive;
using lockgate::widen;
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, c10::BFloat16* out) { *out = lockgate::to_bf16(x); }  // round to nearest even

struct Item {
  int64_t seq, kv, base, begin, end;  // query row seq; keys slots[base + begin .. base + end)
};

// Keys per work item: a fixed number, whatever the batch and the thread count, so that a
// sequence's result depends only on its own query and keys (the chunks and their merge order
// are the same in a batch of one as in a batch of 64). That is what lets a sequence verify
// speculative guesses in rows of their own and still get bitwise the logits it would have got
// one token at a time. 128 keys: a batch-1 step at a few hundred tokens of context still gives
// each of two threads several items, and a chunk's partial (G rows of D + 2 floats) costs far
// less to merge than its 128 K and V rows cost to read.
constexpr int64_t kChunkKeys = 128;

// Query row r's keys are slots[base[r] .. base[r] + count[r]).
std::vector<Item> plan_items(const std::vector<int64_t>& base, const std::vector<int64_t>& count, int64_t hkv) {
  std::vector<Item> items;
  for (int64_t s = 0; s < static_cast<int64_t>(base.size()); ++s) {
    const int64_t n = count[s];
    for (int64_t kv = 0; kv < hkv; ++kv) {
      for (int64_t j = 0; j < n; j += kChunkKeys) items.push_back({s, kv, base[s], j, std::min(j + kChunkKeys, n)});
    }
  }
  return items;
}

// One item: partial softmax of G query heads over keys [begin, end). part = G rows of
// [max, sum, acc[D]] (float32). Query rows are taken R (<= 4) at a time so that their queries and
// accumulators stay in registers; a pass reads the item's K rows once, then its V rows once.
template <typename TQ>
void load_queries(const Item& it, const TQ* q, int64_t q_s0, int64_t q_s1, int64_t g, int64_t d, float scale,
                  float* qf) {
  for (int64_t r = 0; r < g; ++r) {
    const TQ* src = q + it.seq * q_s0 + (it.kv * g + r) * q_s1;
    for (int64_t i = 0; i < d; ++i) qf[r * d + i] = widen(src[i]) * scale;
  }
}

// Softmax statistics of rows [0, rows) of sc [rows, n] in place (scores -> exp(score - max));
// writes max and sum into part rows.
inline void softmax_rows(float* sc, int64_t rows, int64_t n, float* part, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    float* p = sc + r * n;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < n; ++j) m = std::max(m, p[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      p[j] = exp_nonpositive(p[j] - m);
      sum += p[j];
    }
    part[r * (d + 2)] = m;
    part[r * (d + 2) + 1] = sum;
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
constexpr int kPrefetch = 8;  // rows ahead: slots are scattered, hardware prefetch cannot guess them

template <typename TKV>
inline void prefetch_row(const TKV* row, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + o, _MM_HINT_T0);
}

// R query rows (qf, scaled) x keys sl[0..n) -> scores sc [R, n]; then, after the softmax, the
// probabilities x values -> part accumulators. D = 16 * NV.
template <int NV, int R, typename TKV>
void attend_rows_avx512(const float* qf, const TKV* kc, const TKV* vc, const int64_t* sl, int64_t n,
                        int64_t hkv, int64_t kv, float* sc, float* part) {
  constexpr int64_t d = 16 * NV;
  __m512 qv[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) qv[r][v] = _mm512_loadu_ps(qf + r * d + 16 * v);
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetch < n) prefetch_row(kc + (sl[j + kPrefetch] * hkv + kv) * d, d * sizeof(TKV));
    const TKV* kr = kc + (sl[j] * hkv + kv) * d;
    __m512 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = load16(kr + 16 * v);
    for (int r = 0; r < R; ++r) {
      __m512 acc = _mm512_mul_ps(qv[r][0], k[0]);
      for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(qv[r][v], k[v], acc);
      sc[r * n + j] = _mm512_reduce_add_ps(acc);
    }
  }
  softmax_rows(sc, R, n, part, d);
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (j + kPrefetch < n) prefetch_row(vc + (sl[j + kPrefetch] * hkv + kv) * d, d * sizeof(TKV));
    const TKV* vr = vc + (sl[j] * hkv + kv) * d;
    __m512 val[NV];
    for (int v = 0; v < NV; ++v) val[v] = load16(vr + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(sc[r * n + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(w, val[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(part + r * (d + 2) + 2 + 16 * v, acc[r][v]);
}

template <int NV, typename TKV>
void attend_avx512(const float* qf, const TKV* kc, const TKV* vc, const int64_t* sl, int64_t n, int64_t hkv,
                   int64_t kv, int64_t g, float* sc, float* part) {
  constexpr int64_t d = 16 * NV;
  for (int64_t r0 = 0; r0 < g; r0 += 4) {
    const float* q = qf + r0 * d;
    float* pr = part + r0 * (d + 2);
    switch (std::min<int64_t>(4, g - r0)) {
      case 1: attend_rows_avx512<NV, 1>(q, kc, vc, sl, n, hkv, kv, sc, pr); break;
      case 2: attend_rows_avx512<NV, 2>(q, kc, vc, sl, n, hkv, kv, sc, pr); break;
      case 3: attend_rows_avx512<NV, 3>(q, kc, vc, sl, n, hkv, kv, sc, pr); break;
      default: attend_rows_avx512<NV, 4>(q, kc, vc, sl, n, hkv, kv, sc, pr); break;
    }
  }
}
#endif

#if defined(LOCKGATE_ATTN_256)
// The same on 256-bit registers (AVX2 + FMA CPUs without AVX-512). 16 ymm registers cannot hold
// the queries, so they are read from L1 as FMA operands while a key row (up to 8 ymm) is held;
// values go in passes of 16 columns (2 ymm = one cache line of float32) for all R rows at once.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int kPrefetch256 = 8;  // rows ahead (slots are scattered)

// R (<= 4) query rows x keys sl[0..n): scores, softmax, probabilities x values -> part. D = 8 * NV, NV even.
template <int NV, int R, typename TKV>
void attend_rows_avx2(const float* qf, const TKV* kc, const TKV* vc, const int64_t* sl, int64_t n, int64_t hkv,
                      int64_t kv, float* sc, float* part) {
  constexpr int64_t d = 8 * NV;
  constexpr int kHeld = NV < 8 ? NV : 8;  // key vectors held at a time
  for (int64_t j = 0; j < n; ++j) {
    const TKV* kr = kc + (sl[j] * hkv + kv) * d;
    if (j + kPrefetch256 < n) {  // this key's row ahead, and its value row for the second pass
      const int64_t row = (sl[j + kPrefetch256] * hkv + kv) * d;
      const char* ka = reinterpret_cast<const char*>(kc + row);
      const char* va = reinterpret_cast<const char*>(vc + row);
      for (int64_t o = 0; o < d * static_cast<int64_t>(sizeof(TKV)); o += 64) {
        _mm_prefetch(ka + o, _MM_HINT_T0);
        _mm_prefetch(va + o, _MM_HINT_T1);
      }
    }
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int v0 = 0; v0 < NV; v0 += kHeld) {
      __m256 k[kHeld];
      for (int v = 0; v < kHeld; ++v) k[v] = load8(kr + 8 * (v0 + v));
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kHeld; ++v)
          acc[r][v & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * d + 8 * (v0 + v)), k[v], acc[r][v & 1]);
    }
    for (int r = 0; r < R; ++r) sc[r * n + j] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
  }
  softmax_rows(sc, R, n, part, d);
  for (int v0 = 0; v0 < NV; v0 += 2) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {  // (the scores pass prefetched every value row)
      const TKV* vr = vc + (sl[j] * hkv + kv) * d + 8 * v0;
      const __m256 v_lo = load8(vr), v_hi = load8(vr + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(sc + r * n + j);
        acc[r][0] = _mm256_fmadd_ps(w, v_lo, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w, v_hi, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(part + r * (d + 2) + 2 + 8 * v0, acc[r][0]);
      _mm256_storeu_ps(part + r * (d + 2) + 2 + 8 * v0 + 8, acc[r][1]);
    }
  }
}

template <int NV, typename TKV>
void attend_avx2(const float* qf, const TKV* kc, const TKV* vc, const int64_t* sl, int64_t n, int64_t hkv,
                 int64_t kv, int64_t g, float* sc, float* part) {
  constexpr int64_t d = 8 * NV;
  for (int64_t r0 = 0; r0 < g; r0 += 4) {
    const float* q = qf + r0 * d;
    float* pr = part + r0 * (d + 2);
    switch (std::min<int64_t>(4, g - r0)) {
      case 1: attend_rows_avx2<NV, 1>(q, kc, vc, sl, n, hkv, kv, sc, pr); break;
      case 2: attend_rows_avx2<NV, 2>(q, kc, vc, sl, n, hkv, kv, sc, pr); break;
      case 3: attend_rows_avx2<NV, 3>(q, kc, vc, sl, n, hkv, kv, sc, pr); break;
      default: attend_rows_avx2<NV, 4>(q, kc, vc, sl, n, hkv, kv, sc, pr); break;
    }
  }
}
#endif

// Any head size, any CPU: plain loops (auto-vectorised where the compiler can).
template <typename TKV>
void attend_generic(const float* qf, const TKV* kc, const TKV* vc, const int64_t* sl, int64_t n, int64_t hkv,
                    int64_t kv, int64_t g, int64_t d, float* sc, float* row, float* part) {
  for (int64_t j = 0; j < n; ++j) {
    const TKV* kr = kc + (sl[j] * hkv + kv) * d;
    for (int64_t i = 0; i < d; ++i) row[i] = widen(kr[i]);
    for (int64_t r = 0; r < g; ++r) {
      float acc = 0.f;
      for (int64_t i = 0; i < d; ++i) acc += qf[r * d + i] * row[i];
      sc[r * n + j] = acc;
    }
  }
  softmax_rows(sc, g, n, part, d);
  for (int64_t r = 0; r < g; ++r) std::fill(part + r * (d + 2) + 2, part + r * (d + 2) + 2 + d, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const TKV* vr = vc + (sl[j] * hkv + kv) * d;
    for (int64_t i = 0; i < d; ++i) row[i] = widen(vr[i]);
    for (int64_t r = 0; r < g; ++r) {
      float* acc = part + r * (d + 2) + 2;
      const float w = sc[r * n + j];
      for (int64_t i = 0; i < d; ++i) acc[i] += w * row[i];
    }
  }
}

template <typename TQ, typename TKV>
void attend_item(const Item& it, const TQ* q, int64_t q_s0, int64_t q_s1, const TKV* kc, const TKV* vc,
                 const int64_t* slots, int64_t hkv, int64_t g, int64_t d, float scale,
                 float* part, std::vector<float>& scratch) {
  const int64_t n = it.end - it.begin;
  scratch.resize(static_cast<size_t>(g * d + d + g * n));
  float* qf = scratch.data();  // [G, D] scaled queries
  float* row = qf + g * d;     // [D] one key or value row, widened (generic path)
  float* sc = row + d;         // [G, n] scores, then probabilities
  load_queries(it, q, q_s0, q_s1, g, d, scale, qf);
  const int64_t* sl = slots + it.base + it.begin;
#if defined(__AVX512F__)
  if (d == 64) return attend_avx512<4>(qf, kc, vc, sl, n, hkv, it.kv, g, sc, part);
  if (d == 128) return attend_avx512<8>(qf, kc, vc, sl, n, hkv, it.kv, g, sc, part);
  if (d == 256) return attend_avx512<16>(qf, kc, vc, sl, n, hkv, it.kv, g, sc, part);  // Gemma
  if (d == 96) return attend_avx512<6>(qf, kc, vc, sl, n, hkv, it.kv, g, sc, part);    // Phi-3
  if (d == 32) return attend_avx512<2>(qf, kc, vc, sl, n, hkv, it.kv, g, sc, part);
#elif defined(LOCKGATE_ATTN_256)
  if (d == 64) return attend_avx2<8>(qf, kc, vc, sl, n, hkv, it.kv, g, sc, part);
  if (d == 128) return attend_avx2<16>(qf, kc, vc, sl, n, hkv, it.kv, g, sc, part);
  if (d == 256) return attend_avx2<32>(qf, kc, vc, sl, n, hkv, it.kv, g, sc, part);
  if (d == 32) return attend_avx2<4>(qf, kc, vc, sl, n, hkv, it.kv, g, sc, part);
#endif
  attend_generic(qf, kc, vc, sl, n, hkv, it.kv, g, d, sc, row, part);
}

template <typename TQ, typename TKV>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
         const std::vector<int64_t>& base, const std::vector<int64_t>& count, double scale, at::Tensor& out,
         at::Tensor& lse) {
  const int64_t h = q.size(1), d = q.size(2), hkv = k_cache.size(1), g = h / hkv;
  const std::vector<Item> items = plan_items(base, count, hkv);
  const int64_t ni = static_cast<int64_t>(items.size());
  std::vector<float> parts(static_cast<size_t>(ni * g * (d + 2)));
  const TQ* qp = q.data_ptr<TQ>();
  const TKV* kc = k_cache.data_ptr<TKV>();
  const TKV* vc = v_cache.data_ptr<TKV>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  at::parallel_for(0, ni, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      attend_item<TQ, TKV>(items[i], qp, q.stride(0), q.stride(1), kc, vc, sl, hkv, g, d,
                           static_cast<float>(scale), parts.data() + i * g * (d + 2), scratch);
    }
  });
  // Merge the chunks of each (sequence, kv head): items of one pair are adjacent, in key order.
  std::vector<int64_t> first;  // index of the first item of each pair, plus ni
  for (int64_t i = 0; i < ni; ++i) {
    if (i == 0 || items[i].seq != items[i - 1].seq || items[i].kv != items[i - 1].kv) first.push_back(i);
  }
  first.push_back(ni);
  TQ* op = out.data_ptr<TQ>();
  float* lp = lse.data_ptr<float>();
  const int64_t pairs = static_cast<int64_t>(first.size()) - 1;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(d));
    for (int64_t p = begin; p < end; ++p) {
      const Item& it = items[first[p]];
      for (int64_t r = 0; r < g; ++r) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = first[p]; i < first[p + 1]; ++i) m = std::max(m, parts[(i * g + r) * (d + 2)]);
        float sum = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t i = first[p]; i < first[p + 1]; ++i) {
          const float* pr = parts.data() + (i * g + r) * (d + 2);
          const float w = std::exp(pr[0] - m);
          sum += w * pr[1];
          for (int64_t k = 0; k < d; ++k) acc[k] += w * pr[2 + k];
        }
        const int64_t head = it.kv * g + r;
        TQ* dst = op + (it.seq * h + head) * d;
        const float inv = 1.f / sum;
        for (int64_t k = 0; k < d; ++k) narrow(acc[k] * inv, dst + k);
        lp[it.seq * h + head] = m + std::log(sum);
      }
    }
  });
}

}  // namespace

namespace lockgate {

namespace {

void check_pool(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                const char* name) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, name, ": q must be [T, H, D] with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              name, ": k_cache/v_cache must be contiguous [C, Hkv, D] of the same shape");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), name, ": k_cache and v_cache dtypes differ");
  TORCH_CHECK(q.size(2) == k_cache.size(2), name, ": head dim of q and the pool differ");
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0,
              name, ": query heads must be a positive multiple of kv heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              name, ": slots must be contiguous int64 [N]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), name, " is a CPU kernel");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t n = slots.size(0), capacity = k_cache.size(0);
  bool in_pool = true;
  for (int64_t i = 0; i < n; ++i) in_pool &= sl[i] >= 0 && sl[i] < capacity;  // O(N), vectorised
  TORCH_CHECK(in_pool, name, ": a slot is outside the pool of ", capacity, " slots");
}

const int64_t* checked_offsets(const at::Tensor& offsets, int64_t rows, int64_t limit, const char* what,
                               const char* array) {
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.is_contiguous() && offsets.dim() == 1 &&
                  offsets.size(0) == rows + 1,
              "the offsets of ", what, " must be contiguous int64 [B + 1]");
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(rows == 0 || (off[0] >= 0 && off[rows] <= limit), "the offsets leave ", array);
  for (int64_t s = 0; s < rows; ++s) TORCH_CHECK(off[s + 1] > off[s], "sequence ", s, " has no ", what);
  return off;
}

std::tuple<at::Tensor, at::Tensor> dispatch(const at::Tensor& q, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, const at::Tensor& slots,
                                            const std::vector<int64_t>& base, const std::vector<int64_t>& count,
                                            double scale, const char* name) {
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  const auto qt = q.scalar_type(), kt = k_cache.scalar_type();
  if (qt == at::kFloat && kt == at::kFloat) {
    run<float, float>(q, k_cache, v_cache, slots, base, count, scale, out, lse);
  } else if (qt == at::kBFloat16 && kt == at::kBFloat16) {
    run<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, slots, base, count, scale, out, lse);
  } else if (qt == at::kFloat && kt == at::kBFloat16) {
    run<float, c10::BFloat16>(q, k_cache, v_cache, slots, base, count, scale, out, lse);
  } else {
    TORCH_CHECK(false, name, ": unsupported dtypes q ", qt, " / pool ", kt);
  }
  return {out, lse};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& slots,
                                                    const at::Tensor& offsets, double scale) {
  check_pool(q, k_cache, v_cache, slots, "decode_attention");
  const int64_t b = q.size(0);
  const int64_t* off = checked_offsets(offsets, b, slots.size(0), "keys", "slots");
  std::vector<int64_t> base(off, off + b), count(static_cast<size_t>(b));
  for (int64_t s = 0; s < b; ++s) count[s] = off[s + 1] - off[s];
  return dispatch(q, k_cache, v_cache, slots, base, count, scale, "decode_attention");
}

std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                     const at::Tensor& v_cache, const at::Tensor& slots,
                                                     const at::Tensor& offsets, const at::Tensor& q_offsets,
                                                     double scale) {
  check_pool(q, k_cache, v_cache, slots, "prefill_attention");
  const int64_t b = offsets.size(0) - 1;
  TORCH_CHECK(b >= 0, "prefill_attention: offsets must have B + 1 entries");
  const int64_t* off = checked_offsets(offsets, b, slots.size(0), "keys", "slots");
  const int64_t* qo = checked_offsets(q_offsets, b, q.size(0), "query tokens", "q");
  TORCH_CHECK(b == 0 ? q.size(0) == 0 : (qo[0] == 0 && qo[b] == q.size(0)), "prefill_attention: q_offsets must cover q");
  std::vector<int64_t> base(static_cast<size_t>(q.size(0))), count(static_cast<size_t>(q.size(0)));
  for (int64_t s = 0; s < b; ++s) {
    const int64_t nq = qo[s + 1] - qo[s], nk = off[s + 1] - off[s];
    TORCH_CHECK(nq <= nk, "prefill_attention: sequence ", s, " has ", nq, " new tokens but ", nk, " keys");
    for (int64_t i = 0; i < nq; ++i) {
      base[qo[s] + i] = off[s];
      count[qo[s] + i] = nk - nq + 1 + i;
    }
  }
  return dispatch(q, k_cache, v_cache, slots, base, count, scale, "prefill_attention");
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor offsets, float scale)"
        " -> (Tensor, Tensor)");
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor offsets, "
        "Tensor q_offsets, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) {
  m.impl("decode_attention", &lockgate::decode_attention);
  m.impl("prefill_attention", &lockgate::prefill_attention);
}
