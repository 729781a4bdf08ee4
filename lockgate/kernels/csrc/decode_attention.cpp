// Decode and prefill attention over the slot-indexed KV pool (TokenAttention), read in place.
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
//   tokens) attends to keys 0 .. n_b - Q_b + i: causal.
//
// lockgate::set_attention_lookahead(on) -> bool: the process-wide switch of the AVX512-BF16 path's
// look-ahead (Ahead, below: a prefetch schedule, never a change in what is computed); returns the
// setting before (always false in a build without AVX-512). Start-up tuning sets it by measuring.
//
// The invariant both operators keep, and what lockgate's determinism rests on: **a token's result
// is a function of its own query and its own keys only**, bitwise: the same whether it is a
// decode row, one row of a prefill chunk (of any length, cut anywhere), a speculative guess row,
// alone or in a batch, on any thread count. Every token is computed with one fixed sequence of
// operations (per build: which sequence depends on the CPU and dtypes, below):
//
//   * its keys are cut into chunks of kChunkKeys (0..127, 128..255, ...);
//   * per chunk and query head: its scores (q . k * scale, summed in a fixed order), the chunk's
//     softmax statistics (max m, sum of exp(score - m) in a fixed lane order) and its weighted
//     value sum, accumulated in key order;
//   * the chunks' partials merged by their maxima, in chunk order.
//
// How the work is grouped does not enter that sequence. A work item is (a run of up to
// kTokenBlock tokens of one sequence, one key chunk), all kv heads (or, for a whole chunk that
// sequences hold with the same slots, tokens of several sequences: plan_items, after index_tokens has put
// sequences that start on the same slot next to each other): per kv head it reads each
// key's K and V row once from the pool, by slot (no gathered copy, no padding to the longest
// sequence), for every query row of the run (the run's tokens x the G query heads sharing the kv
// head). That is what makes prefill cheap: a key row is prepared once (widened or paired, and
// transposed: 16 keys to a vector, so a score needs no horizontal sum) for up to 16 tokens x G
// heads instead of once per token. Rows of one item that see fewer keys (the causal diagonal)
// leave the keys beyond theirs out exactly (masked FMAs, or probability 0 times a finite value).
// Threads take stripes of neighbouring items from a shared counter (stripes); the merge of a
// token's chunk partials goes over tokens in pieces an idle thread can take (lockgate::steal_for).
//
// Arithmetic by path:
//   * bf16 q and pool on a CPU with AVX512-BF16: VDPBF16PS (two exact bf16 products added to a
//     float32 lane): scores over dimension pairs in order, then * scale; probabilities rounded to
//     bf16 for P V (as torch's CPU flash attention does), float32 sums; see item_avx512_bf16.
//     3.1x faster than one token per item at 1,024 tokens (Zen 5 class CPU).
//   * otherwise on AVX-512: float32 math whatever the storage (bf16 widened by a shift); scores
//     summed over d in order (one FMA per d), probabilities float32; 2.1x at 256 and 1,024 tokens.
//   * AVX2 + FMA (no AVX-512): one token at a time, float32, lane partial sums; plain loops for
//     head sizes without a vector path.
// Vector paths exist for head sizes 32, 64, 96, 128 and 256 (AVX-512) and 32, 64, 128 and 256
// (AVX2). Paths differ in rounding (last-bit differences between CPU types), never within one build.
//
// An 8-bit pool (--kv-cache-dtype int8 / fp8: k_cache / v_cache [C, Hkv, D + 4] int8 or
// float8_e4m3fn, each row D codes then its float32 scale, kv_quant.h) is read in place too, one
// token at a time on every CPU (the per-token paths: AVX2 + FMA + F16C vectors for head sizes 32, 64,
// 128 and 256, else plain loops), with float32 or bf16 queries. Codes are widened to float32 in
// registers (int8: sign-extended and converted; e4m3fn: its bits moved into a float16's, an exact
// 2^-8 multiple, converted by F16C); a key's score is (q . codes) * its K scale, and a value row
// enters the sum as codes times (probability * its V scale). No de-quantized copy of the pool or of
// a sequence's keys is made. The chunking, statistics and merge are the ones above, so a token's
// result still depends on its own query and keys only.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kv_quant.h"
#include "ops.h"
#include "steal.h"
#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define LOCKGATE_ATTN_256 1
#include <immintrin.h>
#endif

namespace lockgate::decode_attention_impl {
namespace {

using lockgate::exp_nonpositive;
using lockgate::widen;
using lockgate::mul_add;
#if defined(__AVX512F__)
using lockgate::exp16_nonpositive;
using lockgate::load16;
using lockgate::store16;
#endif
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, c10::BFloat16* out) { *out = lockgate::to_bf16(x); }  // round to nearest even

// Keys per chunk: a fixed number, whatever the batch and the thread count, so that a token's
// result depends only on its own query and keys. 128 keys: a batch-1 decode step at a few hundred
// tokens of context still gives each of two threads several items, and a chunk's partial (H rows
// of D + 2 floats) costs far less to merge than its 128 K and V rows cost to read.
constexpr int64_t kChunkKeys = 128;
// Tokens per work item (prefill): up to this many of one sequence share each key row read.
constexpr int64_t kTokenBlock = 16;

// The step's tokens, in work order: the token at position p is row row[p] of q and out and attends
// to slots[base[p] .. base[p] + count[p]); tokens of one sequence are adjacent with count rising by
// one; part_row[p] is its first partial (one per chunk). Work order is the rows' order with whole
// sequences regrouped so that sequences starting on the same slot are adjacent (index_tokens).
struct Tokens {
  std::vector<int64_t> base, count, part_row, row;
  int64_t parts = 0;  // partials in all
};

struct Item {
  // Tokens t0 .. t1 - 1, all seeing key chunk `chunk` (keys chunk * kChunkKeys .. + kChunkKeys of
  // token t0's list), counts non-decreasing: either one sequence's, or (a chunk every one of them
  // sees whole, with the same slots) several sequences'. The item code takes the keys it reads from
  // its last token's count and its slots from its first token's list, which both rules make right.
  int64_t t0, t1;
  int64_t chunk;
  bool first = true;  // the first item of its sequence to read this chunk (later ones find its rows in cache)
};

inline int64_t chunks_of(int64_t n) { return (n + kChunkKeys - 1) / kChunkKeys; }
// Keys an item reads: those of its chunk its last token sees (slots from its first token's list).
inline int64_t keys_of(const Item& it, const Tokens& tk) {
  return std::min(kChunkKeys, tk.count[it.t1 - 1] - it.chunk * kChunkKeys);
}

// Sequences (runs of rows with the same key list start and one more key each) in the rows' order,
// stably regrouped by their first key slot: requests on one cached prompt prefix start on the same
// slots, and plan_items reads a whole chunk once for adjacent sequences that share it. The batch
// comes in the scheduler's order, where such requests are mixed with others (a shared-prefix
// workload's groups arrive interleaved): regrouped, a decode step of 32 rows on 4 prefixes of 1,024
// tokens reads each prefix once instead of once per row (0.65 -> 0.31 ms per layer, Zen 5 class).
// The order only decides which rows share reads, never a row's arithmetic.
Tokens index_tokens(const std::vector<int64_t>& base, const std::vector<int64_t>& count, const int64_t* slots) {
  const int64_t n = static_cast<int64_t>(count.size());
  std::vector<std::pair<int64_t, int64_t>> seqs;  // (first row, end row) in the rows' order
  for (int64_t s0 = 0; s0 < n;) {
    int64_t s1 = s0 + 1;
    while (s1 < n && base[s1] == base[s0] && count[s1] == count[s1 - 1] + 1) ++s1;
    seqs.emplace_back(s0, s1);
    s0 = s1;
  }
  std::stable_sort(seqs.begin(), seqs.end(), [&](const auto& a, const auto& b) {
    return slots[base[a.first]] < slots[base[b.first]];
  });
  Tokens tk;
  tk.base.reserve(static_cast<size_t>(n));
  tk.count.reserve(static_cast<size_t>(n));
  tk.row.reserve(static_cast<size_t>(n));
  tk.part_row.reserve(static_cast<size_t>(n));
  for (const auto& [s0, s1] : seqs) {
    for (int64_t t = s0; t < s1; ++t) {
      tk.base.push_back(base[t]);
      tk.count.push_back(count[t]);
      tk.row.push_back(t);
      tk.part_row.push_back(tk.parts);
      tk.parts += chunks_of(count[t]);
    }
  }
  return tk;
}

// Work items in work order (Tokens): per sequence (tokens with the same keys, one more each) and key chunk,
// runs of up to kTokenBlock tokens. A chunk that every token of a sequence sees whole and that holds
// the same slots as the previous sequence's (a shared prompt prefix: the prefix cache hands requests
// the same slots) joins that sequence's item for it while the item has room, so the chunk's key rows
// are read and prepared once for the tokens of several sequences. Whole chunks only: every row of
// such an item sees all kChunkKeys keys, so no row's keys are cut by another's.
std::vector<Item> plan_items(const Tokens& tk, const int64_t* slots) {
  std::vector<Item> items;
  std::vector<int64_t> whole_item;  // per chunk: the item that took the previous sequence's whole chunk, or -1
  const int64_t n = static_cast<int64_t>(tk.count.size());
  for (int64_t s0 = 0; s0 < n;) {
    int64_t s1 = s0 + 1;  // tokens s0 .. s1 - 1: one sequence (same keys, one more each)
    while (s1 < n && tk.base[s1] == tk.base[s0] && tk.count[s1] == tk.count[s1 - 1] + 1) ++s1;
    const int64_t chunks = chunks_of(tk.count[s1 - 1]);
    if (static_cast<int64_t>(whole_item.size()) < chunks) whole_item.resize(static_cast<size_t>(chunks), -1);
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t first = s0;  // the first token that sees chunk c
      while (tk.count[first] <= c * kChunkKeys) ++first;
      const bool whole = tk.count[s0] >= (c + 1) * kChunkKeys;  // every token of the sequence sees all of it
      int64_t t = first;
      if (whole && whole_item[c] >= 0) {
        Item& prev = items[static_cast<size_t>(whole_item[c])];
        if (prev.t1 == s0 && prev.t1 - prev.t0 < kTokenBlock &&
            std::memcmp(slots + tk.base[prev.t0] + c * kChunkKeys, slots + tk.base[s0] + c * kChunkKeys,
                        kChunkKeys * sizeof(int64_t)) == 0) {
          prev.t1 = std::min(s1, prev.t0 + kTokenBlock);
          t = prev.t1;
        }
      }
      int64_t last = whole && t == s1 ? whole_item[c] : -1;  // the item now ending at s1 with chunk c whole
      for (; t < s1; t += kTokenBlock) {
        items.push_back({t, std::min(t + kTokenBlock, s1), c, t == first});
        last = whole ? static_cast<int64_t>(items.size()) - 1 : -1;
      }
      whole_item[c] = last;
    }
    for (int64_t c = chunks; c < static_cast<int64_t>(whole_item.size()); ++c) whole_item[c] = -1;
    s0 = s1;
  }
  return items;
}

// Threads take work in stripes: runs of consecutive items, from a shared counter (`stripes` gives
// their item boundaries, one more than the stripes). Consecutive items read neighbouring memory (a
// sequence's chunks in order, a prefill chunk's token runs over the same keys), so a thread walking
// a stripe streams through memory the hardware prefetchers follow, and a prefill chunk's keys are
// read into one core's cache instead of both; one item at a time from the counter sent neighbours
// to alternating threads. Stripes shrink as the work left does (each about the work left over
// 2 x threads, by cost: token rows x keys read, plus a fixed share per item for its preparation;
// at least one item), so the first are long and the last short enough to end the threads together.
// Zen 5 class, kernel alone: decode b = 128 at 321 keys 1.21-1.25x against one item at a time.
constexpr int64_t kItemOverheadKeys = 32;

std::vector<int64_t> stripes(const std::vector<Item>& items, const Tokens& tk, int64_t workers) {
  const int64_t ni = static_cast<int64_t>(items.size());
  std::vector<int64_t> cost(static_cast<size_t>(ni));
  int64_t left = 0;
  for (int64_t i = 0; i < ni; ++i) {
    const Item& it = items[static_cast<size_t>(i)];
    const int64_t keys = keys_of(it, tk);
    cost[static_cast<size_t>(i)] = (it.t1 - it.t0) * keys + kItemOverheadKeys;
    left += cost[static_cast<size_t>(i)];
  }
  std::vector<int64_t> bounds{0};
  int64_t acc = 0, share = left / (2 * workers);
  for (int64_t i = 0; i < ni; ++i) {
    acc += cost[static_cast<size_t>(i)];
    if (acc >= share || i == ni - 1) {
      bounds.push_back(i + 1);
      left -= acc;
      acc = 0;
      share = left / (2 * workers);
    }
  }
  return bounds;
}

// Softmax statistics of a chunk's partial: part = [max, sum, acc[D]].
inline float* part_of(float* parts, const Tokens& tk, int64_t t, int64_t chunk, int64_t h, int64_t head,
                      int64_t d) {
  return parts + ((tk.part_row[t] + chunk) * h + head) * (d + 2);
}

// ------------------------------------------------------------------------------------------------
// Per-token paths (AVX2 and plain loops): one token's G query heads over n keys, one kv head.
// ------------------------------------------------------------------------------------------------

// Softmax statistics of rows [0, rows) of sc [rows, n] in place (scores -> exp(score - max));
// writes max and sum into part rows.
inline void softmax_rows(float* sc, int64_t rows, int64_t n, float* part, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    float* p = sc + r * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) m = std::max(m, p[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      p[j] = exp_nonpositive(p[j] - m);
      sum += p[j];
    }
    part[r * (d + 2)] = m;
    part[r * (d + 2) + 1] = sum;
  }
}

#if defined(LOCKGATE_ATTN_256)
// 256-bit registers (AVX2 + FMA CPUs without AVX-512). 16 ymm registers cannot hold the queries,
// so they are read from L1 as FMA operands while a key row (up to 8 ymm) is held; values go in
// passes of 16 columns (2 ymm = one cache line of float32) for all R rows at once.
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

// ---- 8-bit pools (kv_quant.h): one token's G query heads over n keys, one kv head ----
using lockgate::QFp8;
using lockgate::QInt8;
using lockgate::kQuantized;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOCKGATE_ATTN_Q8 1
// 8 codes -> 8 float lanes: int8 exactly; e4m3fn as its value times 2^-8 (kCodeUnit undoes it).
inline __m256 load8_codes(const QInt8* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8_codes(const QFp8* p) {
  // s eeee mmm -> float16 s 0eeee mmm0000000: the same exponent field with bias 15 instead of 7
  // (subnormals too), so the float16's value is the e4m3fn value times 2^-8 exactly
  const __m128i t = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(t, _mm_set1_epi16(0x80)), 8);
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(t, _mm_set1_epi16(0x7F)), 7);
  return _mm256_cvtph_ps(_mm_or_si128(sign, mag));
}
#endif
template <typename Code>
constexpr float kCodeUnit = std::is_same_v<Code, QFp8> ? 256.f : 1.f;

#if defined(LOCKGATE_ATTN_Q8)
inline float hsum8q(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R (<= 4) query rows x keys sl[0..n) of an 8-bit pool: scores, softmax, probabilities x values
// -> part. D = 8 * NV, NV even. Rows are D codes + a float32 scale (rb bytes).
template <int NV, int R, typename Code>
void attend_rows_q8(const float* qf, const char* kc, const char* vc, const int64_t* sl, int64_t n, int64_t hkv,
                    int64_t kv, float* sc, float* vs, float* part) {
  constexpr int64_t d = 8 * NV, rb = d + lockgate::kScaleBytes;
  constexpr int kHeld = NV < 8 ? NV : 8;  // key vectors held at a time
  constexpr int kAhead = 8;               // rows ahead (slots are scattered)
  for (int64_t j = 0; j < n; ++j) {
    const char* kr = kc + (sl[j] * hkv + kv) * rb;
    if (j + kAhead < n) {  // this key's row ahead, and its value row for the second pass
      const int64_t row = (sl[j + kAhead] * hkv + kv) * rb;
      for (int64_t o = 0; o < rb; o += 64) {
        _mm_prefetch(kc + row + o, _MM_HINT_T0);
        _mm_prefetch(vc + row + o, _MM_HINT_T1);
      }
      _mm_prefetch(kc + row + rb - 1, _MM_HINT_T0);
      _mm_prefetch(vc + row + rb - 1, _MM_HINT_T1);
    }
    const Code* codes = reinterpret_cast<const Code*>(kr);
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int v0 = 0; v0 < NV; v0 += kHeld) {
      __m256 k[kHeld];
      for (int v = 0; v < kHeld; ++v) k[v] = load8_codes(codes + 8 * (v0 + v));
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kHeld; ++v)
          acc[r][v & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * d + 8 * (v0 + v)), k[v], acc[r][v & 1]);
    }
    const float ks = lockgate::row_scale(kr, d) * kCodeUnit<Code>;
    for (int r = 0; r < R; ++r) sc[r * n + j] = hsum8q(_mm256_add_ps(acc[r][0], acc[r][1])) * ks;
  }
  softmax_rows(sc, R, n, part, d);
  for (int64_t j = 0; j < n; ++j) vs[j] = lockgate::row_scale(vc + (sl[j] * hkv + kv) * rb, d) * kCodeUnit<Code>;
  for (int v0 = 0; v0 < NV; v0 += 2) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {  // (the scores pass prefetched every value row)
      const Code* vr = reinterpret_cast<const Code*>(vc + (sl[j] * hkv + kv) * rb) + 8 * v0;
      const __m256 v_lo = load8_codes(vr), v_hi = load8_codes(vr + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_set1_ps(sc[r * n + j] * vs[j]);
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

template <int NV, typename Code>
void attend_q8(const float* qf, const char* kc, const char* vc, const int64_t* sl, int64_t n, int64_t hkv, int64_t kv,
               int64_t g, float* sc, float* vs, float* part) {
  constexpr int64_t d = 8 * NV;
  for (int64_t r0 = 0; r0 < g; r0 += 4) {
    const float* q = qf + r0 * d;
    float* pr = part + r0 * (d + 2);
    switch (std::min<int64_t>(4, g - r0)) {
      case 1: attend_rows_q8<NV, 1, Code>(q, kc, vc, sl, n, hkv, kv, sc, vs, pr); break;
      case 2: attend_rows_q8<NV, 2, Code>(q, kc, vc, sl, n, hkv, kv, sc, vs, pr); break;
      case 3: attend_rows_q8<NV, 3, Code>(q, kc, vc, sl, n, hkv, kv, sc, vs, pr); break;
      default: attend_rows_q8<NV, 4, Code>(q, kc, vc, sl, n, hkv, kv, sc, vs, pr); break;
    }
  }
}
#endif

// Any head size, any CPU, an 8-bit pool: plain loops (the arithmetic of attend_rows_q8, in scalar order).
template <typename Code>
void attend_generic_q8(const float* qf, const char* kc, const char* vc, const int64_t* sl, int64_t n, int64_t hkv,
                       int64_t kv, int64_t g, int64_t d, float* sc, float* row, float* part) {
  const int64_t rb = d + lockgate::kScaleBytes;
  for (int64_t j = 0; j < n; ++j) {
    const char* kr = kc + (sl[j] * hkv + kv) * rb;
    const Code* codes = reinterpret_cast<const Code*>(kr);
    for (int64_t i = 0; i < d; ++i) row[i] = lockgate::code_value(codes[i]);
    const float ks = lockgate::row_scale(kr, d);
    for (int64_t r = 0; r < g; ++r) {
      float acc = 0.f;
      for (int64_t i = 0; i < d; ++i) acc = mul_add(qf[r * d + i], row[i], acc);
      sc[r * n + j] = acc * ks;
    }
  }
  softmax_rows(sc, g, n, part, d);
  for (int64_t r = 0; r < g; ++r) std::fill(part + r * (d + 2) + 2, part + r * (d + 2) + 2 + d, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const char* vr = vc + (sl[j] * hkv + kv) * rb;
    const Code* codes = reinterpret_cast<const Code*>(vr);
    for (int64_t i = 0; i < d; ++i) row[i] = lockgate::code_value(codes[i]);
    const float vs = lockgate::row_scale(vr, d);
    for (int64_t r = 0; r < g; ++r) {
      float* acc = part + r * (d + 2) + 2;
      const float w = sc[r * n + j] * vs;
      for (int64_t i = 0; i < d; ++i) acc[i] = mul_add(w, row[i], acc[i]);
    }
  }
}

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

// ------------------------------------------------------------------------------------------------
// AVX-512: a whole item at once.
// ------------------------------------------------------------------------------------------------
#if defined(__AVX512F__)

// 16 x 16 32-bit transpose in registers: r[i] lane j -> r[j] lane i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 16; i += 4) {
    r[i] = lo(t[i], t[i + 2]);
    r[i + 1] = hi(t[i], t[i + 2]);
    r[i + 2] = lo(t[i + 1], t[i + 3]);
    r[i + 3] = hi(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + 4 + k], 0x88);
      t[i + 4 + k] = _mm512_shuffle_f32x4(r[i + k], r[i + 4 + k], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd);
  }
}

// 16 keys' rows (nullptr: a padding key, zeros) -> kt [D][16] float32: dimension-major, one key per lane.
template <int NV>
inline void transpose_keys(const float* const* rows, float* kt) {
  for (int v = 0; v < NV; ++v) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = rows[i] ? _mm512_loadu_ps(rows[i] + 16 * v) : _mm512_setzero_ps();
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (16 * v + i) * 16, r[i]);
  }
}
// bf16 rows: dimensions 2p and 2p + 1 travel as one 32-bit pair through the transpose, then split.
template <int NV>
inline void transpose_keys(const c10::BFloat16* const* rows, float* kt) {
  for (int half = 0; half < NV / 2; ++half) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = rows[i] ? _mm512_loadu_ps(reinterpret_cast<const float*>(rows[i] + 32 * half)) : _mm512_setzero_ps();
    transpose16(r);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int p = 0; p < 16; ++p) {
      const __m512i pair = _mm512_castps_si512(r[p]);
      _mm512_storeu_ps(kt + (32 * half + 2 * p) * 16, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
      _mm512_storeu_ps(kt + (32 * half + 2 * p + 1) * 16, _mm512_castsi512_ps(_mm512_and_si512(pair, high)));
    }
  }
}


// Scores of R rows x KB blocks of 16 keys: sc[r][16 b + lane] = sum_d qf[r][d] k[d], in d order.
template <int NV, int R, int KB>
inline void score_block(const float* qf, const float* kt, float* sc, int64_t sc_stride) {
  constexpr int64_t d = 16 * NV;
  __m512 acc[R][KB];
  for (int b = 0; b < KB; ++b) {
    const __m512 k0 = _mm512_loadu_ps(kt + b * d * 16);
    for (int r = 0; r < R; ++r) acc[r][b] = _mm512_mul_ps(_mm512_set1_ps(qf[r * d]), k0);
  }
#pragma GCC unroll 4
  for (int64_t i = 1; i < d; ++i) {
    __m512 k[KB];
    for (int b = 0; b < KB; ++b) k[b] = _mm512_loadu_ps(kt + (b * d + i) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 qi = _mm512_set1_ps(qf[r * d + i]);
      for (int b = 0; b < KB; ++b) acc[r][b] = _mm512_fmadd_ps(qi, k[b], acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < KB; ++b) _mm512_storeu_ps(sc + r * sc_stride + 16 * b, acc[r][b]);
}

template <int NV, int R>
inline void score_rows(const float* qf, const float* kt, int64_t blocks, float* sc, int64_t sc_stride) {
  constexpr int64_t d = 16 * NV;
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) score_block<NV, R, 4>(qf, kt + b * d * 16, sc + 16 * b, sc_stride);
  for (; b + 2 <= blocks; b += 2) score_block<NV, R, 2>(qf, kt + b * d * 16, sc + 16 * b, sc_stride);
  if (b < blocks) score_block<NV, R, 1>(qf, kt + b * d * 16, sc + 16 * b, sc_stride);
}

// A row's softmax statistics over its n keys, in place (scores -> exp(score - max), zeros up to
// the next multiple of 16); returns {max, sum}.
inline std::pair<float, float> softmax_row(float* p, int64_t n) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(p + j));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1u);
  if (j < n) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail, p + j));
  const float m = _mm512_reduce_max_ps(mv);
  const __m512 mb = _mm512_set1_ps(m);
  __m512 sv = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(p + j), mb));
    _mm512_storeu_ps(p + j, e);
    sv = _mm512_add_ps(sv, e);
  }
  if (j < n) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(p + j), mb)));
    _mm512_storeu_ps(p + j, e);
    sv = _mm512_add_ps(sv, e);
  }
  return {m, _mm512_reduce_add_ps(sv)};
}

// Probabilities x values for R rows: acc[r] = sum over keys j < n[r] of p[r][j] v[j], in key
// order. Keys below n_min are every row's; above it, a row's FMA is masked off once j >= n[r].
template <int NV, int R, typename Rows>
inline void value_rows(const float* sc, int64_t sc_stride, const Rows& vrow, const int64_t* n, float* const* out) {
  constexpr int64_t d = 16 * NV;
  int64_t n_min = n[0], n_max = n[0];
  for (int r = 1; r < R; ++r) n_min = std::min(n_min, n[r]), n_max = std::max(n_max, n[r]);
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < n_min; ++j) {
    __m512 val[NV];
    for (int v = 0; v < NV; ++v) val[v] = load16(vrow(j) + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(sc[r * sc_stride + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(w, val[v], acc[r][v]);
    }
  }
  for (; j < n_max; ++j) {
    __m512 val[NV];
    for (int v = 0; v < NV; ++v) val[v] = load16(vrow(j) + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __mmask16 live = j < n[r] ? 0xFFFF : 0;
      const __m512 w = _mm512_set1_ps(sc[r * sc_stride + j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_mask3_fmadd_ps(w, val[v], acc[r][v], live);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[r] + 2 + 16 * v, acc[r][v]);
}

// Rows of the value pass held in registers at once: R * NV accumulators.
template <int NV>
constexpr int kValueRows = NV >= 16 ? 1 : NV >= 8 ? 3 : NV >= 6 ? 4 : 6;

template <int NV, typename Rows>
void value_pass(const float* sc, int64_t sc_stride, const Rows& vf, const int64_t* n, float* const* out,
                int64_t rows) {
  constexpr int RV = kValueRows<NV>;
  for (int64_t r0 = 0; r0 < rows; r0 += RV) {
    const float* s = sc + r0 * sc_stride;
    switch (std::min<int64_t>(RV, rows - r0)) {
      case 1: value_rows<NV, 1, Rows>(s, sc_stride, vf, n + r0, out + r0); break;
      case 2: if constexpr (RV >= 2) value_rows<NV, 2, Rows>(s, sc_stride, vf, n + r0, out + r0); break;
      case 3: if constexpr (RV >= 3) value_rows<NV, 3, Rows>(s, sc_stride, vf, n + r0, out + r0); break;
      case 4: if constexpr (RV >= 4) value_rows<NV, 4, Rows>(s, sc_stride, vf, n + r0, out + r0); break;
      case 5: if constexpr (RV >= 5) value_rows<NV, 5, Rows>(s, sc_stride, vf, n + r0, out + r0); break;
      default: if constexpr (RV >= 6) value_rows<NV, RV, Rows>(s, sc_stride, vf, n + r0, out + r0); break;
    }
  }
}

// Runs of at most this many tokens (a decode row, or one with its speculative guesses) pair their
// value rows in registers for each group of rows instead of staging them once for the item: at a
// few rows the staging's write and read cost more than pairing again (guess rows of 32 requests x
// 3 at 321 keys, Zen 5 class: 0.425 -> 0.391 ms per layer; bitwise the same results).
constexpr int64_t kInPlaceTokens = 3;
constexpr int kPrefetch = 8;  // keys ahead: slots are scattered, hardware prefetch cannot guess them

// Look-ahead (lockgate::set_attention_lookahead, off until start-up tuning measures it faster):
// the next item's K and V rows, asked for a few cache lines at a time while the current item
// computes. touch_rows reads an item's rows before its arithmetic, so on one thread memory idles
// while the item computes and the core idles while it reads; a short run (decode, guess rows) that
// prefetches the next item's rows while it works (step: once per key of its key pass and once
// per key pair of its value pass for each group of rows, for each kv head, a few lines each)
// lets the next item skip touch_rows, its rows arriving while this one works. On the AMD EPYC Zen 4 class CPU (2 threads,
// pool on huge pages) decode at 321 keys took 9% less time at b = 32 and 12% at b = 128; on the
// Zen 5 class, three other forms of it (one thread) were slower: hence measured, per CPU
// (docs/performance.md, "Tried and did not work"). Spread over both passes, not the value pass alone:
// with step() as cheap as it is, asking for the lines in the value pass alone came in bursts that made
// a memory-bound item slower (Zen 4 class). Which cache level a row comes from is
// all it changes: never what is computed. An item's start() with no next item leaves it inactive, so the
// first item of a stripe (its thread's previous item ended another stripe) reads its own rows.
std::atomic<bool> g_lookahead{false};

struct Ahead {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* sl = nullptr;
  int64_t lines = 0;  // cache lines per K (and per V) row
  int64_t keys = 0;   // the keys whose rows are asked for (0: inactive)
  int64_t key = 0, line = 0;  // the next line to ask for: line `line` of key `key`'s K row, then its V row
  int64_t quota = 0;  // lines of K (each with its V line) per step

  // The K and V rows (row_bytes each) of keys slots[0 .. n), to be asked for (pace, step).
  void start(const void* kc, const void* vc, const int64_t* slots, int64_t n, int64_t row_bytes) {
    k = static_cast<const char*>(kc);
    v = static_cast<const char*>(vc);
    sl = slots;
    lines = row_bytes / 64;
    keys = n;
    key = line = quota = 0;
  }
  // Spread them over the `steps` calls of step the current item will make (it knows its loops).
  void pace(int64_t steps) { quota = (keys * lines + steps - 1) / std::max<int64_t>(1, steps); }
  bool active() const { return keys > 0; }
  void finish() {
    quota = keys * lines;
    step();
  }
  // Counters in locals: the loop stores nothing, so they stay in registers (a member counter is
  // stored on every line, the compiler unable to tell it from the slots it reads; that and a
  // division per line were ~20% of a decode item's samples on the Zen 4 class CPU).
  void step() {
    int64_t kk = key, ll = line;
    for (int64_t n = quota; n > 0 && kk < keys; --n) {
      const int64_t at = (sl[kk] * lines + ll) * 64;
      _mm_prefetch(k + at, _MM_HINT_T1);
      _mm_prefetch(v + at, _MM_HINT_T1);
      if (++ll == lines) {
        ll = 0;
        ++kk;
      }
    }
    key = kk;
    line = ll;
  }
};

struct Scratch {
  std::vector<float> kt, vf, qf, sc;
  std::vector<int64_t> n;
  std::vector<float*> out;
  std::vector<uint32_t> kp, vp, qp, pb;  // the AVX512-BF16 path's bf16 pairs
  Ahead ahead;           // the next item's rows, asked for during this one (Ahead)
  bool fetched = false;  // this item's rows were asked for during the previous one
};

// Reads every kv head's K and V rows of an item's keys once, before the passes over its kv heads.
// A pass interleaves its loads with transposes and arithmetic, so few of its cache misses are in
// flight at a time and memory and arithmetic take turns (a pass's own prefetches, a few keys
// ahead, help but do not close the gap); a loop of nothing but loads keeps the memory system busy
// (the hardware prefetchers follow the runs of slots the allocator hands out) and leaves the rows
// in L2 for the passes. Decode, b = 128 at 321 keys (Zen 5 class): 1.27 -> 1.13 ms per layer, a
// plain read of the same rows being 0.73 ms; prefill runs unchanged.
inline void touch_rows(const void* kc, const void* vc, const int64_t* sl, int64_t n, int64_t row_bytes) {
  const char* k = static_cast<const char*>(kc);
  const char* v = static_cast<const char*>(vc);
  __m512i acc = _mm512_setzero_si512();
  for (int64_t j = 0; j < n; ++j) {
    const char* kr = k + sl[j] * row_bytes;
    const char* vr = v + sl[j] * row_bytes;
    for (int64_t o = 0; o < row_bytes; o += 64) {
      acc = _mm512_or_si512(acc, _mm512_loadu_si512(kr + o));
      acc = _mm512_or_si512(acc, _mm512_loadu_si512(vr + o));
    }
  }
  volatile int sink = _mm512_reduce_or_epi32(acc);  // the loads are kept: their result is used
  (void)sink;
}

// One item on AVX-512: every kv head, every row (token x query head of the kv group). A single
// token (decode) reads its values in place; a run of tokens shares one widened copy.
template <int NV, typename TQ, typename TKV>
void item_avx512(const Item& it, const Tokens& tk, const TQ* q, int64_t q_s0, int64_t q_s1, const TKV* kc,
                 const TKV* vc, const int64_t* slots, int64_t h, int64_t hkv, float scale, float* parts,
                 Scratch& s) {
  constexpr int64_t d = 16 * NV;
  const int64_t g = h / hkv, nt = it.t1 - it.t0, rows = nt * g, begin = it.chunk * kChunkKeys;
  const int64_t nk = std::min(kChunkKeys, tk.count[it.t1 - 1] - begin);  // keys the item reads
  const int64_t blocks = (nk + 15) / 16;
  const int64_t* sl = slots + tk.base[it.t0] + begin;
  s.kt.resize(static_cast<size_t>(blocks * 16 * d));
  const bool staged = it.t1 - it.t0 > 1;  // values widened once for all rows (one token: read in place)
  if (staged) s.vf.resize(static_cast<size_t>(nk * d));
  s.qf.resize(static_cast<size_t>(rows * d));
  const int64_t sc_stride = blocks * 16;
  s.sc.resize(static_cast<size_t>(rows * sc_stride));
  s.n.resize(static_cast<size_t>(rows));
  s.out.resize(static_cast<size_t>(rows));
  if (it.first) touch_rows(kc, vc, sl, nk, hkv * d * static_cast<int64_t>(sizeof(TKV)));
  for (int64_t kv = 0; kv < hkv; ++kv) {
    // K transposed into kt (16 keys a block); with several tokens, V widened into vf once for all rows.
    for (int64_t b = 0; b < blocks; ++b) {
      const TKV* krows[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t j = b * 16 + i;
        if (j >= nk) {
          krows[i] = nullptr;
          continue;
        }
        if (j + kPrefetch < nk) {  // this kv head's K and V rows ahead
          const char* ka = reinterpret_cast<const char*>(kc + (sl[j + kPrefetch] * hkv + kv) * d);
          const char* va = reinterpret_cast<const char*>(vc + (sl[j + kPrefetch] * hkv + kv) * d);
          for (int64_t o = 0; o < d * static_cast<int64_t>(sizeof(TKV)); o += 64) {
            _mm_prefetch(ka + o, _MM_HINT_T0);
            _mm_prefetch(va + o, _MM_HINT_T0);
          }
        }
        krows[i] = kc + (sl[j] * hkv + kv) * d;
        if (staged) {
          const TKV* vr = vc + (sl[j] * hkv + kv) * d;
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(s.vf.data() + j * d + 16 * v, load16(vr + 16 * v));
        }
      }
      transpose_keys<NV>(krows, s.kt.data() + b * 16 * d);
    }
    for (int64_t t = it.t0; t < it.t1; ++t) {
      const int64_t n = std::min(kChunkKeys, tk.count[t] - begin);
      for (int64_t gg = 0; gg < g; ++gg) {
        const int64_t r = (t - it.t0) * g + gg, head = kv * g + gg;
        const TQ* src = q + tk.row[t] * q_s0 + head * q_s1;
        for (int64_t i = 0; i < d; ++i) s.qf[r * d + i] = widen(src[i]) * scale;
        s.n[r] = n;
        s.out[r] = part_of(parts, tk, t, it.chunk, h, head, d);
      }
    }
    // Scores, 4 rows at a time over the key blocks the rows see.
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t rr = std::min<int64_t>(4, rows - r0);
      const int64_t rb = (s.n[r0 + rr - 1] + 15) / 16;
      const float* qr = s.qf.data() + r0 * d;
      float* sr = s.sc.data() + r0 * sc_stride;
      switch (rr) {
        case 1: score_rows<NV, 1>(qr, s.kt.data(), rb, sr, sc_stride); break;
        case 2: score_rows<NV, 2>(qr, s.kt.data(), rb, sr, sc_stride); break;
        case 3: score_rows<NV, 3>(qr, s.kt.data(), rb, sr, sc_stride); break;
        default: score_rows<NV, 4>(qr, s.kt.data(), rb, sr, sc_stride); break;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const auto [m, sum] = softmax_row(s.sc.data() + r * sc_stride, s.n[r]);
      s.out[r][0] = m;
      s.out[r][1] = sum;
    }
    if (staged) {
      const float* vf = s.vf.data();
      value_pass<NV>(s.sc.data(), sc_stride, [vf](int64_t j) { return vf + j * d; }, s.n.data(), s.out.data(), rows);
    } else {
      const TKV* vbase = vc + kv * d;
      value_pass<NV>(s.sc.data(), sc_stride, [vbase, sl, hkv](int64_t j) { return vbase + sl[j] * hkv * d; },
                     s.n.data(), s.out.data(), rows);
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 queries on a bf16 pool, on a CPU with AVX512-BF16: VDPBF16PS adds two bf16 products to a
// float32 lane per instruction (the products are exact in float32), twice the work of an FMA, and
// needs no widening. The order of operations per token, fixed as on the float32 path:
//   * score_j = (sum over dimension pairs p = 0 .. D/2 - 1, in order, of q_2p k_2p + q_2p+1 k_2p+1,
//     one VDPBF16PS each, from 0) * scale;
//   * softmax statistics as softmax_row (float32), then each exp(score - max) rounded to bf16 (round
//     to nearest even, what torch's CPU flash attention does to its probabilities before P V);
//   * acc = sum over key pairs (2i, 2i + 1), in order, of p_2i v_2i + p_2i+1 v_2i+1, one VDPBF16PS
//     each, from 0; the sum of the float32 probabilities normalises it, as on the float32 path.
// A row with fewer keys than its run (the causal diagonal) has probability 0 beyond its keys, so
// those products add exact zeros (the value rows there are the sequence's own, finite).
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }
// 16 floats rounded to bf16 (nearest even), stored as 8 pairs.
inline void store_bf16x16(uint32_t* dst, __m512 x) {
  __m256bh b = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i&>(b));
}

// 16 keys' bf16 rows (nullptr: padding, zeros) -> kp [D/2][16] u32: dimension pairs, one key per lane.
template <int NV>
inline void transpose_key_pairs(const c10::BFloat16* const* rows, uint32_t* kp) {
  for (int half = 0; half < NV / 2; ++half) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i)
      r[i] = rows[i] ? _mm512_loadu_ps(reinterpret_cast<const float*>(rows[i] + 32 * half)) : _mm512_setzero_ps();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_ps(reinterpret_cast<float*>(kp + (16 * half + p) * 16), r[p]);
  }
}

// Two keys' value rows (b may be nullptr: zeros) -> vp [D/16][16] u32: lane i of vector v holds
// dimension 16 v + i of key a (low half) and of key b (high half).
template <int NV>
inline void interleave_values(const c10::BFloat16* a, const c10::BFloat16* b, uint32_t* vp) {
  for (int v = 0; v < NV; ++v) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * v)));
    const __m512i hi = b ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * v)))
                         : _mm512_setzero_si512();
    _mm512_storeu_si512(vp + 16 * v, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

// Scores of R rows x KB blocks of 16 keys (qp: each row's D/2 bf16 pairs as u32).
template <int NV, int R, int KB>
inline void score_block_bf16(const uint32_t* qp, const uint32_t* kp, float scale, float* sc, int64_t sc_stride) {
  constexpr int64_t pairs = 8 * NV;
  __m512 acc[R][KB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < KB; ++b) acc[r][b] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t i = 0; i < pairs; ++i) {
    __m512i k[KB];
    for (int b = 0; b < KB; ++b) k[b] = _mm512_loadu_si512(kp + (b * pairs + i) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh qi = as_bh(_mm512_set1_epi32(static_cast<int>(qp[r * pairs + i])));
      for (int b = 0; b < KB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], as_bh(k[b]), qi);
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < KB; ++b) _mm512_storeu_ps(sc + r * sc_stride + 16 * b, _mm512_mul_ps(acc[r][b], sv));
}

template <int NV, int R>
inline void score_rows_bf16(const uint32_t* qp, const uint32_t* kp, int64_t blocks, float scale, float* sc,
                            int64_t sc_stride) {
  constexpr int64_t pairs = 8 * NV;
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) score_block_bf16<NV, R, 4>(qp, kp + b * pairs * 16, scale, sc + 16 * b, sc_stride);
  for (; b + 2 <= blocks; b += 2) score_block_bf16<NV, R, 2>(qp, kp + b * pairs * 16, scale, sc + 16 * b, sc_stride);
  if (b < blocks) score_block_bf16<NV, R, 1>(qp, kp + b * pairs * 16, scale, sc + 16 * b, sc_stride);
}

// Probabilities (pb: each row's bf16 key pairs as u32, zeros beyond its keys) x values for R rows
// over key pairs [0, pairs).
template <int NV, int R>
inline void value_rows_bf16(const uint32_t* pb, int64_t pb_stride, const uint32_t* vp, int64_t pairs,
                            float* const* out) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i val[NV];
    for (int v = 0; v < NV; ++v) val[v] = _mm512_loadu_si512(vp + (j * NV + v) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(pb[r * pb_stride + j])));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], as_bh(val[v]), w);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[r] + 2 + 16 * v, acc[r][v]);
}

// The same for the rows of a short run (decode, guess rows: kInPlaceTokens), values read in place:
// key pair (2j, 2j + 1)'s rows (the second zeros past the keys) paired in registers (unpack: lane k
// of the low half of 128-bit lane L holds dimension 8 L + k of both keys, of the high half
// 8 L + 4 + k) instead of staged in vp: each accumulator lane does exactly the VDPBF16PS sequence
// its dimension has on the staged path, and the lanes are put back in dimension order before the
// store. A short run's rows use each pair once or twice, so staging it costs a write and a read
// per key for little.
template <int NV, int R>
inline void value_rows_bf16_in_place(const uint32_t* pb, int64_t pb_stride, const c10::BFloat16* vk,
                                     const int64_t* sl, int64_t row_stride, int64_t nk, int64_t pairs,
                                     float* const* out, Ahead& ahead) {
  static_assert(NV % 2 == 0, "a 512-bit register holds 32 bf16 dimensions");
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {  // the key pairs the rows see (nk: the item's keys)
    ahead.step();
    const c10::BFloat16* a = vk + sl[2 * j] * row_stride;
    const bool has_b = 2 * j + 1 < nk;
    const c10::BFloat16* b = has_b ? vk + sl[2 * j + 1] * row_stride : a;
    __m512i val[NV];
    for (int hv = 0; hv < NV / 2; ++hv) {
      const __m512i ra = _mm512_loadu_si512(a + 32 * hv);
      const __m512i rb = has_b ? _mm512_loadu_si512(b + 32 * hv) : _mm512_setzero_si512();
      val[2 * hv] = _mm512_unpacklo_epi16(ra, rb);
      val[2 * hv + 1] = _mm512_unpackhi_epi16(ra, rb);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(pb[r * pb_stride + j])));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], as_bh(val[v]), w);
    }
  }
  // dimensions 32 hv + m: m < 16 from lanes of (lo, hi) = (acc[2 hv], acc[2 hv + 1]), in order
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < R; ++r)
    for (int hv = 0; hv < NV / 2; ++hv) {
      _mm512_storeu_ps(out[r] + 2 + 32 * hv, _mm512_permutex2var_ps(acc[r][2 * hv], first, acc[r][2 * hv + 1]));
      _mm512_storeu_ps(out[r] + 2 + 32 * hv + 16,
                       _mm512_permutex2var_ps(acc[r][2 * hv], second, acc[r][2 * hv + 1]));
    }
}

template <int NV>
void item_avx512_bf16(const Item& it, const Tokens& tk, const c10::BFloat16* q, int64_t q_s0, int64_t q_s1,
                      const c10::BFloat16* kc, const c10::BFloat16* vc, const int64_t* slots, int64_t h,
                      int64_t hkv, float scale, float* parts, Scratch& s) {
  constexpr int64_t d = 16 * NV, pairs = 8 * NV;
  const int64_t g = h / hkv, nt = it.t1 - it.t0, rows = nt * g, begin = it.chunk * kChunkKeys;
  const int64_t nk = std::min(kChunkKeys, tk.count[it.t1 - 1] - begin);
  const int64_t blocks = (nk + 15) / 16, sc_stride = blocks * 16, key_pairs = (nk + 1) / 2;
  const int64_t pb_stride = sc_stride / 2;
  const int64_t* sl = slots + tk.base[it.t0] + begin;
  const bool single = nt <= kInPlaceTokens;  // decode (and guess) rows: values paired in registers, not staged
  s.kp.resize(static_cast<size_t>(blocks * 16 * pairs));
  if (!single) s.vp.resize(static_cast<size_t>(key_pairs * d));
  s.qp.resize(static_cast<size_t>(rows * pairs));
  s.sc.resize(static_cast<size_t>(rows * sc_stride));
  s.pb.resize(static_cast<size_t>(rows * pb_stride));
  s.n.resize(static_cast<size_t>(rows));
  s.out.resize(static_cast<size_t>(rows));
  if (it.first && !s.fetched) touch_rows(kc, vc, sl, nk, hkv * d * 2);
  // the look-ahead's steps below, per kv head: one per key, one per key pair for each group of value rows
  constexpr int64_t rv = kValueRows<NV>;
  if (single) s.ahead.pace(hkv * (nk + (rows + rv - 1) / rv * key_pairs));
  for (int64_t kv = 0; kv < hkv; ++kv) {
    for (int64_t b = 0; b < blocks; ++b) {
      const c10::BFloat16* krows[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t j = b * 16 + i;
        if (j >= nk) {
          krows[i] = nullptr;
          continue;
        }
        if (j + kPrefetch < nk) {  // this kv head's K and V rows ahead
          const char* ka = reinterpret_cast<const char*>(kc + (sl[j + kPrefetch] * hkv + kv) * d);
          const char* va = reinterpret_cast<const char*>(vc + (sl[j + kPrefetch] * hkv + kv) * d);
          for (int64_t o = 0; o < d * 2; o += 64) {
            _mm_prefetch(ka + o, _MM_HINT_T0);
            _mm_prefetch(va + o, _MM_HINT_T0);
          }
        }
        krows[i] = kc + (sl[j] * hkv + kv) * d;
        if (single) s.ahead.step();  // (the look-ahead: the next item's rows, a few lines)
        if (!single && j % 2 == 0)
          interleave_values<NV>(vc + (sl[j] * hkv + kv) * d, j + 1 < nk ? vc + (sl[j + 1] * hkv + kv) * d : nullptr,
                                s.vp.data() + (j / 2) * d);
      }
      transpose_key_pairs<NV>(krows, s.kp.data() + b * 16 * pairs);
    }
    for (int64_t t = it.t0; t < it.t1; ++t) {
      const int64_t n = std::min(kChunkKeys, tk.count[t] - begin);
      for (int64_t gg = 0; gg < g; ++gg) {
        const int64_t r = (t - it.t0) * g + gg, head = kv * g + gg;
        std::memcpy(s.qp.data() + r * pairs, q + tk.row[t] * q_s0 + head * q_s1, d * sizeof(c10::BFloat16));
        s.n[r] = n;
        s.out[r] = part_of(parts, tk, t, it.chunk, h, head, d);
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t rr = std::min<int64_t>(4, rows - r0);
      const int64_t rb = (s.n[r0 + rr - 1] + 15) / 16;
      const uint32_t* qr = s.qp.data() + r0 * pairs;
      float* sr = s.sc.data() + r0 * sc_stride;
      switch (rr) {
        case 1: score_rows_bf16<NV, 1>(qr, s.kp.data(), rb, scale, sr, sc_stride); break;
        case 2: score_rows_bf16<NV, 2>(qr, s.kp.data(), rb, scale, sr, sc_stride); break;
        case 3: score_rows_bf16<NV, 3>(qr, s.kp.data(), rb, scale, sr, sc_stride); break;
        default: score_rows_bf16<NV, 4>(qr, s.kp.data(), rb, scale, sr, sc_stride); break;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* p = s.sc.data() + r * sc_stride;
      const auto [m, sum] = softmax_row(p, s.n[r]);  // zeros up to the next multiple of 16
      s.out[r][0] = m;
      s.out[r][1] = sum;
      uint32_t* pr = s.pb.data() + r * pb_stride;
      const int64_t filled = (s.n[r] + 15) / 16;
      for (int64_t b = 0; b < filled; ++b)
        store_bf16x16(pr + 8 * b, _mm512_loadu_ps(p + 16 * b));
      std::fill(pr + 8 * filled, pr + pb_stride, 0u);  // probability 0 beyond the row's keys
    }
    constexpr int RV = kValueRows<NV>;
    if (single) {
      const c10::BFloat16* vk = vc + kv * d;
      for (int64_t r0 = 0; r0 < rows; r0 += RV) {
        const int64_t rr = std::min<int64_t>(RV, rows - r0);
        const int64_t kp_rows = (s.n[r0 + rr - 1] + 1) / 2;  // key pairs the rows see, as staged
        const uint32_t* pr = s.pb.data() + r0 * pb_stride;
        float* const* o = s.out.data() + r0;
        switch (rr) {
          case 1: value_rows_bf16_in_place<NV, 1>(pr, pb_stride, vk, sl, hkv * d, nk, kp_rows, o, s.ahead); break;
          case 2: if constexpr (RV >= 2) value_rows_bf16_in_place<NV, 2>(pr, pb_stride, vk, sl, hkv * d, nk, kp_rows, o, s.ahead); break;
          case 3: if constexpr (RV >= 3) value_rows_bf16_in_place<NV, 3>(pr, pb_stride, vk, sl, hkv * d, nk, kp_rows, o, s.ahead); break;
          case 4: if constexpr (RV >= 4) value_rows_bf16_in_place<NV, 4>(pr, pb_stride, vk, sl, hkv * d, nk, kp_rows, o, s.ahead); break;
          case 5: if constexpr (RV >= 5) value_rows_bf16_in_place<NV, 5>(pr, pb_stride, vk, sl, hkv * d, nk, kp_rows, o, s.ahead); break;
          default: if constexpr (RV >= 6) value_rows_bf16_in_place<NV, RV>(pr, pb_stride, vk, sl, hkv * d, nk, kp_rows, o, s.ahead); break;
        }
      }
      continue;  // next kv head
    }
    for (int64_t r0 = 0; r0 < rows; r0 += RV) {
      const int64_t rr = std::min<int64_t>(RV, rows - r0);
      const int64_t kp_rows = (s.n[r0 + rr - 1] + 1) / 2;  // key pairs the rows see
      const uint32_t* pr = s.pb.data() + r0 * pb_stride;
      float* const* o = s.out.data() + r0;
      switch (rr) {
        case 1: value_rows_bf16<NV, 1>(pr, pb_stride, s.vp.data(), kp_rows, o); break;
        case 2: if constexpr (RV >= 2) value_rows_bf16<NV, 2>(pr, pb_stride, s.vp.data(), kp_rows, o); break;
        case 3: if constexpr (RV >= 3) value_rows_bf16<NV, 3>(pr, pb_stride, s.vp.data(), kp_rows, o); break;
        case 4: if constexpr (RV >= 4) value_rows_bf16<NV, 4>(pr, pb_stride, s.vp.data(), kp_rows, o); break;
        case 5: if constexpr (RV >= 5) value_rows_bf16<NV, 5>(pr, pb_stride, s.vp.data(), kp_rows, o); break;
        default: if constexpr (RV >= 6) value_rows_bf16<NV, RV>(pr, pb_stride, s.vp.data(), kp_rows, o); break;
      }
    }
  }
  s.ahead.finish();  // whatever its steps left (none when the passes ran them all)
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__

// One item on the per-token paths: each token of the run by itself, per kv head.
template <typename TQ, typename TKV>
void item_per_token(const Item& it, const Tokens& tk, const TQ* q, int64_t q_s0, int64_t q_s1, const TKV* kc,
                    const TKV* vc, const int64_t* slots, int64_t h, int64_t hkv, int64_t d, float scale,
                    float* parts, std::vector<float>& scratch) {
  const int64_t g = h / hkv, begin = it.chunk * kChunkKeys;
  scratch.resize(static_cast<size_t>(g * d + d + g * kChunkKeys + kChunkKeys));
  float* qf = scratch.data();  // [G, D] scaled queries
  float* row = qf + g * d;     // [D] one key or value row, widened (generic path)
  float* sc = row + d;         // [G, n] scores, then probabilities
  float* vs = sc + g * kChunkKeys;  // [n] the value rows' scales (8-bit pools)
  for (int64_t t = it.t0; t < it.t1; ++t) {
    const int64_t n = std::min(kChunkKeys, tk.count[t] - begin);
    const int64_t* sl = slots + tk.base[t] + begin;
    for (int64_t kv = 0; kv < hkv; ++kv) {
      for (int64_t r = 0; r < g; ++r) {
        const TQ* src = q + tk.row[t] * q_s0 + (kv * g + r) * q_s1;
        for (int64_t i = 0; i < d; ++i) qf[r * d + i] = widen(src[i]) * scale;
      }
      float* part = part_of(parts, tk, t, it.chunk, h, kv * g, d);
      if constexpr (kQuantized<TKV>) {
        const char* kq = reinterpret_cast<const char*>(kc);
        const char* vq = reinterpret_cast<const char*>(vc);
#if defined(LOCKGATE_ATTN_Q8)
        if (d == 64) { attend_q8<8, TKV>(qf, kq, vq, sl, n, hkv, kv, g, sc, vs, part); continue; }
        if (d == 128) { attend_q8<16, TKV>(qf, kq, vq, sl, n, hkv, kv, g, sc, vs, part); continue; }
        if (d == 256) { attend_q8<32, TKV>(qf, kq, vq, sl, n, hkv, kv, g, sc, vs, part); continue; }
        if (d == 32) { attend_q8<4, TKV>(qf, kq, vq, sl, n, hkv, kv, g, sc, vs, part); continue; }
#endif
        attend_generic_q8<TKV>(qf, kq, vq, sl, n, hkv, kv, g, d, sc, row, part);
        continue;
      } else {
#if defined(LOCKGATE_ATTN_256)
      if (d == 64) { attend_avx2<8>(qf, kc, vc, sl, n, hkv, kv, g, sc, part); continue; }
      if (d == 128) { attend_avx2<16>(qf, kc, vc, sl, n, hkv, kv, g, sc, part); continue; }
      if (d == 256) { attend_avx2<32>(qf, kc, vc, sl, n, hkv, kv, g, sc, part); continue; }
      if (d == 32) { attend_avx2<4>(qf, kc, vc, sl, n, hkv, kv, g, sc, part); continue; }
#endif
      attend_generic(qf, kc, vc, sl, n, hkv, kv, g, d, sc, row, part);
      }
    }
  }
}

// One (token, head)'s chunk partials (part = [max, sum, acc[D]], `stride` floats apart, in key
// order) merged into its output row and log-sum-exp: m = the largest max; per chunk, in order,
// w = exp(max - m), sum += w * sum_c and acc += w * acc_c (from zero; fused multiply-adds where the
// CPU has them, written out, as the scalar loop this replaced compiled to: gcc contracts a * b + c
// in C++, and left to itself it fuses only some lanes of a loop it vectorises over chunks); out =
// acc * (1 / sum) rounded once to the output dtype; lse = m + log(sum). A single chunk has w = 1
// exactly, so its result is its own acc * (1 / sum): taken directly, bitwise the same.
template <typename TQ>
inline void merge_partials(const float* part, int64_t stride, int64_t chunks, int64_t d, TQ* dst, float* lse) {
  if (chunks == 1) {
    const float inv = 1.f / part[1];
    int64_t k = 0;
#if defined(__AVX512F__)
    const __m512 iv = _mm512_set1_ps(inv);
    for (; k + 16 <= d; k += 16) store16(dst + k, _mm512_mul_ps(_mm512_loadu_ps(part + 2 + k), iv));
#endif
    for (; k < d; ++k) narrow(part[2 + k] * inv, dst + k);
    *lse = part[0] + std::log(part[1]);
    return;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part[c * stride]);
  float w_small[64];
  std::vector<float> w_large;
  float* w = chunks <= 64 ? w_small : (w_large.resize(static_cast<size_t>(chunks)), w_large.data());
  float sum = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    w[c] = std::exp(part[c * stride] - m);
    sum = mul_add(w[c], part[c * stride + 1], sum);
  }
  const float inv = 1.f / sum;
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 iv = _mm512_set1_ps(inv);
  for (; k + 16 <= d; k += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c)
      acc = _mm512_fmadd_ps(_mm512_set1_ps(w[c]), _mm512_loadu_ps(part + c * stride + 2 + k), acc);
    store16(dst + k, _mm512_mul_ps(acc, iv));
  }
#endif
  for (; k < d; ++k) {
    float acc = 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      acc = mul_add(w[c], part[c * stride + 2 + k], acc);
    }
    narrow(acc * inv, dst + k);
  }
  *lse = m + std::log(sum);
}

template <typename TQ, typename TKV>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
         const Tokens& tk, double scale, at::Tensor& out, at::Tensor& lse) {
  const int64_t nt = q.size(0), h = q.size(1), d = q.size(2), hkv = k_cache.size(1);
  const std::vector<Item> items = plan_items(tk, slots.data_ptr<int64_t>());
  const int64_t ni = static_cast<int64_t>(items.size());
  // every partial is written by the item that owns it before the merge reads it: no zeroing
  const std::unique_ptr<float[]> parts(new float[static_cast<size_t>(tk.parts * h * (d + 2))]);
  const TQ* qp = q.data_ptr<TQ>();
  const TKV* kc = static_cast<const TKV*>(k_cache.data_ptr());  // (an 8-bit pool: its bytes, rows of D + 4)
  const TKV* vc = static_cast<const TKV*>(v_cache.data_ptr());
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  // Stripes of items are taken from a shared counter; which thread runs an item changes nothing in
  // its result.
#if defined(__AVX512BF16__)
  const bool lookahead = g_lookahead.load(std::memory_order_relaxed);  // once per call: Ahead
#endif
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(ni, at::get_num_threads()));
  const std::vector<int64_t> stripe = stripes(items, tk, workers);
  const int64_t ns = static_cast<int64_t>(stripe.size()) - 1;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
#if defined(__AVX512F__)
    Scratch scratch;
#endif
    std::vector<float> token_scratch;
    for (int64_t st = next++; st < ns; st = next++)
    for (int64_t i = stripe[st]; i < stripe[st + 1]; ++i) {
      const Item& it = items[i];
      if constexpr (!kQuantized<TKV>) {  // (an 8-bit pool: one token at a time, below)
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<TQ, c10::BFloat16> && std::is_same_v<TKV, c10::BFloat16>) {
        // a short run asks for the next item's rows (if it reads its chunk first) during its key and
        // value passes (item_avx512_bf16 paces them)
        scratch.fetched = scratch.ahead.active();  // the thread's previous item asked for this one's rows
        const Item* nx = lookahead && it.t1 - it.t0 <= kInPlaceTokens && i + 1 < stripe[st + 1] && items[i + 1].first
                             ? &items[i + 1] : nullptr;
        scratch.ahead.start(kc, vc, nx ? sl + tk.base[nx->t0] + nx->chunk * kChunkKeys : sl, nx ? keys_of(*nx, tk) : 0,
                            hkv * d * 2);
        switch (d) {
          case 64: item_avx512_bf16<4>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, sc, parts.get(), scratch); continue;
          case 128: item_avx512_bf16<8>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, sc, parts.get(), scratch); continue;
          case 256: item_avx512_bf16<16>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, sc, parts.get(), scratch); continue;
          case 96: item_avx512_bf16<6>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, sc, parts.get(), scratch); continue;
          case 32: item_avx512_bf16<2>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, sc, parts.get(), scratch); continue;
          default: break;
        }
      }
#endif
      switch (d) {
        case 64: item_avx512<4>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, sc, parts.get(), scratch); continue;
        case 128: item_avx512<8>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, sc, parts.get(), scratch); continue;
        case 256: item_avx512<16>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, sc, parts.get(), scratch); continue;  // Gemma
        case 96: item_avx512<6>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, sc, parts.get(), scratch); continue;  // Phi-3
        case 32: item_avx512<2>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, sc, parts.get(), scratch); continue;
        default: break;
      }
#endif
      }
      item_per_token<TQ, TKV>(it, tk, qp, q.stride(0), q.stride(1), kc, vc, sl, h, hkv, d, sc, parts.get(),
                              token_scratch);
    }
  });
  // Merge each (token, head)'s chunks in key order (merge_partials).
  TQ* op = out.data_ptr<TQ>();
  float* lp = lse.data_ptr<float>();
  lockgate::steal_for(0, nt, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t chunks = chunks_of(tk.count[t]), row = tk.row[t];
      for (int64_t head = 0; head < h; ++head)
        merge_partials(part_of(parts.get(), tk, t, 0, h, head, d), h * (d + 2), chunks, d,
                       op + (row * h + head) * d, lp + row * h + head);
    }
  });
}

}  // namespace
}  // namespace lockgate::decode_attention_impl

namespace lockgate {

namespace decode_attention_impl {
namespace {

void check_pool(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                const char* name) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, name, ": q must be [T, H, D] with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              name, ": k_cache/v_cache must be contiguous [C, Hkv, D] of the same shape");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), name, ": k_cache and v_cache dtypes differ");
  TORCH_CHECK(q.size(2) == pool_head_dim(k_cache), name, ": head dim of q and the pool differ",
              is_quantized_pool(k_cache) ? " (an 8-bit pool's rows are D codes + a 4-byte scale)" : "");
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

// Rows that are one sequence's newest token and its speculative guesses come as separate rows
// whose key lists are prefixes of each other (row j + 1: row j's keys and one more). Point each such
// row at its successor's list, so the rows form one run of plan_items and every key row is read
// once for all of them. Only where the lists' slots are equal, so what a token sees is unchanged;
// the check is one comparison per row unless the counts rise by exactly one.
void join_prefix_rows(std::vector<int64_t>& base, const std::vector<int64_t>& count, const int64_t* slots) {
  for (int64_t t = static_cast<int64_t>(base.size()) - 2; t >= 0; --t) {
    if (count[t + 1] != count[t] + 1 || base[t + 1] == base[t]) continue;
    if (std::memcmp(slots + base[t], slots + base[t + 1], static_cast<size_t>(count[t]) * sizeof(int64_t)) == 0) {
      base[t] = base[t + 1];
    }
  }
}

std::tuple<at::Tensor, at::Tensor> dispatch(const at::Tensor& q, const at::Tensor& k_cache,
                                            const at::Tensor& v_cache, const at::Tensor& slots,
                                            std::vector<int64_t> base, std::vector<int64_t> count,
                                            double scale, const char* name) {
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  join_prefix_rows(base, count, slots.data_ptr<int64_t>());
  const Tokens tk = index_tokens(base, count, slots.data_ptr<int64_t>());
  const auto qt = q.scalar_type(), kt = k_cache.scalar_type();
  if (qt == at::kFloat && kt == at::kFloat) {
    run<float, float>(q, k_cache, v_cache, slots, tk, scale, out, lse);
  } else if (qt == at::kBFloat16 && kt == at::kBFloat16) {
    run<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, slots, tk, scale, out, lse);
  } else if (qt == at::kFloat && kt == at::kBFloat16) {
    run<float, c10::BFloat16>(q, k_cache, v_cache, slots, tk, scale, out, lse);
  } else if (qt == at::kFloat && kt == at::kChar) {
    run<float, QInt8>(q, k_cache, v_cache, slots, tk, scale, out, lse);
  } else if (qt == at::kBFloat16 && kt == at::kChar) {
    run<c10::BFloat16, QInt8>(q, k_cache, v_cache, slots, tk, scale, out, lse);
  } else if (qt == at::kFloat && kt == at::kFloat8_e4m3fn) {
    run<float, QFp8>(q, k_cache, v_cache, slots, tk, scale, out, lse);
  } else if (qt == at::kBFloat16 && kt == at::kFloat8_e4m3fn) {
    run<c10::BFloat16, QFp8>(q, k_cache, v_cache, slots, tk, scale, out, lse);
  } else {
    TORCH_CHECK(false, name, ": unsupported dtypes q ", qt, " / pool ", kt);
  }
  return {out, lse};
}

}  // namespace
}  // namespace decode_attention_impl

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& slots,
                                                    const at::Tensor& offsets, double scale) {
  decode_attention_impl::check_pool(q, k_cache, v_cache, slots, "decode_attention");
  const int64_t b = q.size(0);
  const int64_t* off = decode_attention_impl::checked_offsets(offsets, b, slots.size(0), "keys", "slots");
  std::vector<int64_t> base(off, off + b), count(static_cast<size_t>(b));
  for (int64_t s = 0; s < b; ++s) count[s] = off[s + 1] - off[s];
  return decode_attention_impl::dispatch(q, k_cache, v_cache, slots, std::move(base), std::move(count), scale,
                                         "decode_attention");
}

std::tuple<at::Tensor, at::Tensor> prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                     const at::Tensor& v_cache, const at::Tensor& slots,
                                                     const at::Tensor& offsets, const at::Tensor& q_offsets,
                                                     double scale) {
  decode_attention_impl::check_pool(q, k_cache, v_cache, slots, "prefill_attention");
  const int64_t b = offsets.size(0) - 1;
  TORCH_CHECK(b >= 0, "prefill_attention: offsets must have B + 1 entries");
  const int64_t* off = decode_attention_impl::checked_offsets(offsets, b, slots.size(0), "keys", "slots");
  const int64_t* qo = decode_attention_impl::checked_offsets(q_offsets, b, q.size(0), "query tokens", "q");
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
  return decode_attention_impl::dispatch(q, k_cache, v_cache, slots, std::move(base), std::move(count), scale,
                                         "prefill_attention");
}

bool set_attention_lookahead(bool on) {
#if defined(__AVX512F__)
  return decode_attention_impl::g_lookahead.exchange(on);
#else
  (void)on;
  return false;
#endif
}

}  // namespace lockgate

TORCH_LIBRARY_FRAGMENT(lockgate, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor offsets, float scale)"
        " -> (Tensor, Tensor)");
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor offsets, "
        "Tensor q_offsets, float scale) -> (Tensor, Tensor)");
  m.def("set_attention_lookahead(bool on) -> bool", &lockgate::set_attention_lookahead);
}

TORCH_LIBRARY_IMPL(lockgate, CPU, m) {
  m.impl("decode_attention", &lockgate::decode_attention);
  m.impl("prefill_attention", &lockgate::prefill_attention);
}

// This file's macros end with it (a unity build compiles several sources as one unit).
#undef LOCKGATE_ATTN_256
#undef LOCKGATE_ATTN_Q8
