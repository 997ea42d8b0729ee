// Attention that reads the paged KV cache in place, on the CPU: decodes, and in batch-invariant
// steps every prompt token as a query of its own.
//
// The reference path gathers every request's blocks into a dense copy and runs SDPA over it: at
// long contexts the copy costs as much as the attention (40% of a 7,500-token decode step, the
// same again for SDPA). Here each query reads K and V straight from its blocks.
//
// Every query's result is one fixed sum, whatever else is computed beside it: its keys are cut
// into splits of kSplitTokens from position 0 (the last one ends at its own length), a score is
// a dot product in one fixed order, a split's softmax and weighted sum of values run over its
// keys in position order, and the splits merge in order. So a token's attention has the same
// bits as a decode, as a prompt token in a chunk of any size, and beside any other requests:
// what reproducible greedy decoding needs (attention.py, every_token_in_place).
//
// Work is cut into (tile, split) items: a tile is up to kTileRows consecutive rows of one
// request (a prompt's tokens, each a query that sees the keys up to its position), so a key's
// row is read and widened to fp32 once for every query of the tile; decodes are tiles of one
// row. Scores come kGroup keys at a time: one sum per key over the head dimension, added across
// lanes by one transposing reduction that gives every key the same order of additions. The
// weighted sum of values keeps a query head's totals in registers across a group's keys.
//
// Where the build has AVX2 and FMA, a tile of several rows (a prompt chunk's, up to
// kPromptTileRows) takes register tiles instead, an item per (tile, split, KV head): a block of
// keys copied out transposed serves every row of the tile, in sums of score_group's and
// accumulate's orders (attend_tiled). Two threads of an AVX2-only Zen 3 EPYC, fp32, 9 heads on
// 3 KV heads of 64, a 512-token chunk after 0 / 1,024 / 3,000 / 7,000 cached tokens: 7.1 / 28.0 /
// 60.6 / 182.8 -> 5.7 / 21.6 / 55.3 / 144.2 ms (the fp32 prompt kernel, whose sums follow the
// chunk's shape: 3.9 / 19.4 / 53.9 / 127.1). The default model's cold TTFT at 1,800 tokens in
// batch-invariant steps went from 1.30x that of steps that are not to 1.01-1.07x
// (bench/batch_invariance_bench.py). Built with AVX-512, the tiles are 16 keys wide (one
// register) and twice as tall: two threads of a Zen 5 EPYC, same shapes, 1.92 / 9.08 / 21.94 /
// 59.55 -> 1.49 / 6.61 / 17.17 / 50.02 ms (the AVX-512 prompt kernel: 1.03 / 4.49 / 11.35 /
// 25.50), cold TTFT 1.25x -> 1.13x that of steps that are not. (Gathering a block's keys
// transposed, a dim at a time, was no faster than copying them key by key.)
//
// Against the kernel before (one query per item, a score as a dot product with its own
// horizontal sum, the weighted sum through memory), one thread of this 2-core AMD EPYC, bf16,
// 9 heads on 3 KV heads of 64: a 512-token chunk over 1,800 keys 100 -> 46 ms (SDPA with a
// causal mask: 32 ms), a decode over 7,500 keys 0.93 -> 0.60 ms, 16 decodes over 1,000 keys
// 2.04 -> 1.38 ms.
//
// Where the build targets AVX512-BF16, a bf16 cache takes a path of dot products instead (below,
// attend_bf16_dot_impl): one thread of a 2-core AMD EPYC (Zen 4), 9 heads on 3 KV heads of 64,
// against the AVX2 path: a 512-token chunk over 1,800 keys 28 -> 7.1 ms (2 threads; SDPA over a
// dense copy with a causal mask, copy not counted: 15.9 ms), a cold 512-token prompt 5.7 -> 1.5 ms,
// a decode over 7,500 keys 0.36 -> 0.22 ms, 16 decodes over 1,000 keys 0.77 -> 0.42 ms. So the
// engine sends prompt tokens through it in every step there, not only in batch-invariant ones.
// A decode (up to 4 queries per KV head) scores its keys and weighs its values from registers
// rather than through the stored layouts a tile's many queries share (same sums, same order):
// the default model's decode steps on a Zen 4, one thread, 4 requests over 100-1,800 keys 28.3
// -> 26.8 ms; two threads, 16 over 1,000 keys 52.1 -> 48.8 ms.
//
// A token's K (and V) row holds every KV head side by side: reading it whole keeps the reads
// sequential through each block (items per KV head reading their slice of each row were 3-4x
// slower: memory stalls, not arithmetic). The hot loops are AVX2 where the build targets it,
// scalar elsewhere (the same fixed orders either way, so a build is invariant by itself).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include "avx2_exp.h"
#include "row_count.h"
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kSplitTokens = 256;
// Keys scored together: one AVX2 register of results. Splits start at multiples of kSplitTokens,
// so a key always takes the same slot of its group, and with it the same order of additions.
constexpr int64_t kGroup = 8;
constexpr int64_t kTileRows = 16;
// Prompt tiles of at least kMinTiledRows rows take register tiles (attend_tiled), up to
// kPromptTileRows rows a tile (each item reads its split's keys once for them all); fewer are
// read as decodes are, a key block's copy not being worth it.
constexpr int64_t kMinTiledRows = 4;
constexpr int64_t kPromptTileRows = 64;

#if defined(__AVX2__) && defined(__FMA__)
inline float horizontal_sum(__m256 v) {
  __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  low = _mm_add_ps(low, _mm_movehl_ps(low, low));
  low = _mm_add_ss(low, _mm_movehdup_ps(low));
  return _mm_cvtss_f32(low);
}

// Lane j of the result is the sum of aj's lanes, every j in the same order:
// ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
inline __m256 transpose_sum(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                            __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// One K or V row (every KV head side by side) as fp32.
inline void widen(const float* from, float* to, int64_t n) { std::memcpy(to, from, n * sizeof(float)); }
inline void widen(const at::BFloat16* from, float* to, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    // bf16 is the top half of an fp32: widen and shift.
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i));
    _mm256_storeu_ps(to + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
#endif
  for (; i < n; ++i) to[i] = static_cast<float>(from[i]);
}
inline void widen(const at::Half* from, float* to, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i))));
  }
#endif
  for (; i < n; ++i) to[i] = static_cast<float>(from[i]);
}

// Whether an fp32 (or widened) cache of this head_dim takes register tiles for prompt tiles in
// this build.
bool register_tiles_fit(int64_t head_dim) {
#if defined(__AVX2__) && defined(__FMA__)
  return head_dim % 32 == 0;
#else
  (void)head_dim;
  return false;
#endif
}

// Scores of one query head against kGroup key rows (each `stride` floats apart, the head's slice
// at `key`): out[j] = sum over d of query[d] * key_j[d], in the same order for every j.
// kStride: the stride where it is known when compiled (0: `stride`); the keys' offsets are then
// constants, where at run time GCC kept half of them on the stack.
template <int64_t kStride = 0>
inline void score_group(const float* query, const float* key, int64_t stride, int64_t head_dim, float* out) {
  if constexpr (kStride > 0) stride = kStride, head_dim = kStride;
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // Named sums, not an array: GCC kept an array of them in memory.
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
  for (; d + 8 <= head_dim; d += 8) {
    const __m256 q = _mm256_loadu_ps(query + d);
    const float* k = key + d;
    s0 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k), s0);
    s1 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + stride), s1);
    s2 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 2 * stride), s2);
    s3 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 3 * stride), s3);
    s4 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 4 * stride), s4);
    s5 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 5 * stride), s5);
    s6 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 6 * stride), s6);
    s7 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 7 * stride), s7);
  }
  _mm256_storeu_ps(out, transpose_sum(s0, s1, s2, s3, s4, s5, s6, s7));
#else
  for (int64_t j = 0; j < kGroup; ++j) out[j] = 0.f;
#endif
  if (d == head_dim) return;  // every head_dim a model has: no tail
  for (int64_t j = 0; j < kGroup; ++j) {
    float tail = 0.f;
    for (int64_t e = d; e < head_dim; ++e) tail += query[e] * key[j * stride + e];
    out[j] += tail;
  }
}

// One query head's running weighted sum of values over `count` consecutive keys (their rows
// `stride` floats apart): acc[d] = fma(weight_j, value_j[d], acc[d]) for j in order. The totals
// stay in registers across the keys: through memory each multiply-add waited on the store of
// the one before (the kernel's weighted sum was 2.5x slower so).
inline void accumulate(float* acc, const float* weights, const float* values, int64_t stride, int64_t count,
                       int64_t head_dim) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // 64 at a time: eight independent sums keep both multiply-add units busy.
  for (; d + 64 <= head_dim; d += 64) {
    __m256 a[8];
    for (int k = 0; k < 8; ++k) a[k] = _mm256_loadu_ps(acc + d + 8 * k);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 w = _mm256_set1_ps(weights[j]);
      const float* v = values + j * stride + d;
      for (int k = 0; k < 8; ++k) a[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * k), a[k]);
    }
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(acc + d + 8 * k, a[k]);
  }
  for (; d + 32 <= head_dim; d += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
    __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 w = _mm256_set1_ps(weights[j]);
      const float* v = values + j * stride + d;
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d + 8 <= head_dim; d += 8) {
    __m256 a = _mm256_loadu_ps(acc + d);
    for (int64_t j = 0; j < count; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(weights[j]), _mm256_loadu_ps(values + j * stride + d), a);
    _mm256_storeu_ps(acc + d, a);
  }
#endif
  for (; d < head_dim; ++d) {
    float a = acc[d];
    for (int64_t j = 0; j < count; ++j) a = std::fma(weights[j], values[j * stride + d], a);
    acc[d] = a;
  }
}

// Softmax numerators of one split's scores in place; returns the sum, sets the maximum.
inline float exponentiate(float* row, int64_t length, float* max_out) {
  float max_score = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // A maximum is exact in any order: eight lanes, then across them (the scalar loop was 7% of a
  // prompt chunk's time).
  __m256 lanes = _mm256_set1_ps(max_score);
  for (; t + 8 <= length; t += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(row + t));
  alignas(32) float lane_max[8];
  _mm256_store_ps(lane_max, lanes);
  for (float v : lane_max) max_score = std::max(max_score, v);
#endif
  for (; t < length; ++t) max_score = std::max(max_score, row[t]);
  float sum = 0.f;
  t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 max_vector = _mm256_set1_ps(max_score);
  __m256 sum_vector = _mm256_setzero_ps();
  for (; t + 8 <= length; t += 8) {
    const __m256 weights = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), max_vector));
    _mm256_storeu_ps(row + t, weights);
    sum_vector = _mm256_add_ps(sum_vector, weights);
  }
  sum = horizontal_sum(sum_vector);
#endif
  for (; t < length; ++t) {
    row[t] = std::exp(row[t] - max_score);
    sum += row[t];
  }
  *max_out = max_score;
  return sum;
}

// Asks for the cache lines of `bytes` bytes from `start` into L2. Rows of a split sit in blocks
// scattered over the pool, which the hardware's prefetchers do not follow. Into L2, not L1: a
// group's rows are ~100 lines in flight, more than L1's miss buffers hold, and prefetches into
// L1 waited on them (or were dropped) where L2's deeper queue takes them all. One thread of a
// Zen 4 EPYC, the default model's 30 layers with a step's weights read between them, 4 decodes
// over 150 / 150 / 150 / 1,850 keys: 6.3 -> 5.6 ms a step on a fresh pool's consecutive blocks,
// 12.9 -> 8.3 ms on blocks taken one by one from a used pool's free list (fp32: 12.9 -> 9.6,
// 16.7 -> 12.1 ms); two threads, 16 over 1,000 keys on scattered blocks: 42.4 -> 28.0 ms.
inline void prefetch_lines(const void* start, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(static_cast<const char*>(start) + offset, 0, 1);
}

struct Tile {
  int64_t first_row;
  int64_t num_rows;
};

struct WorkItem {
  int64_t tile;
  int64_t split;
  int64_t kv_head;  // attend_tiled's items are one KV head's; -1: every head at once
  int64_t cost;     // query rows x keys, to take the heaviest first
};

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, table_stride, num_splits;
  // A sliding-window layer's: a row sees its last `window` keys (0: all of them).
  int64_t window;
  int64_t token_stride() const { return num_kv_heads * head_dim; }
  int64_t first_key(int64_t length) const { return window > 0 ? std::max<int64_t>(0, length - window) : 0; }
};

// Rows [first, first + n) of one request, split `split`: each row's scores against its keys of
// the split, their softmax (max and sum kept for the merge), and the unnormalised weighted sum of
// values, into acc/maxes/sums at [row][split].
template <typename T>
void attend(const Tile& tile, int64_t split, const Shape& s, const float* queries, const T* k_cache,
            const T* v_cache, const int64_t* table, const int64_t* lens, float* acc, float* maxes,
            float* sums, std::vector<float>& scores, std::vector<float>& rows) {
  const int64_t begin = split * kSplitTokens;
  int64_t end = begin;
  for (int64_t r = 0; r < tile.num_rows; ++r) end = std::max(end, std::min(begin + kSplitTokens, lens[tile.first_row + r]));
  const int64_t* blocks = table + tile.first_row * s.table_stride;
  const int64_t stride = s.token_stride();
  const int64_t heads_dim = s.num_heads * s.head_dim;
  auto row_of = [&](const T* cache, int64_t position) {
    return cache + (blocks[position / s.block_size] * s.block_size + position % s.block_size) * stride;
  };
  // One group's K (then V) rows as fp32 in `rows`, by KV head: [kv_head][key][head_dim], so a
  // head's keys sit head_dim apart and the score and value loops address them from one pointer
  // (with rows a whole token apart, GCC spilled the eight keys' addresses to the stack); slots
  // past `end` are zeros.
  const int64_t head_rows = kGroup * s.head_dim;
  auto load_group = [&](const T* cache, int64_t position) {
    for (int64_t j = 0; j < kGroup; ++j) {
      for (int64_t g = 0; g < s.num_kv_heads; ++g) {
        float* to = rows.data() + g * head_rows + j * s.head_dim;
        if (position + j < end) {
          widen(row_of(cache, position + j) + g * s.head_dim, to, s.head_dim);
        } else {
          std::fill(to, to + s.head_dim, 0.f);
        }
      }
    }
  };
  // The next group's rows are asked for while this one's are scored (and weighed, below): 16
  // decodes over 224 / 600 keys of an fp32 cache, 30 layers' KV cycled as in a step, 390 -> 354 /
  // 992 -> 885 us a layer (two groups ahead, or the first two up front: slower).
  for (int64_t position = begin; position < end; position += kGroup) {
    for (int64_t j = position + kGroup; j < std::min(end, position + 2 * kGroup); ++j)
      prefetch_lines(row_of(k_cache, j), stride * static_cast<int64_t>(sizeof(T)));
    load_group(k_cache, position);
    for (int64_t r = 0; r < tile.num_rows; ++r) {
      const int64_t row = tile.first_row + r;
      if (position >= lens[row]) continue;
      for (int64_t h = 0; h < s.num_heads; ++h) {
        const float* query = queries + row * heads_dim + h * s.head_dim;
        const float* keys = rows.data() + (h / s.group) * head_rows;
        float* out = scores.data() + (r * s.num_heads + h) * kSplitTokens + (position - begin);
        if (s.head_dim == 64) {
          score_group<64>(query, keys, 64, 64, out);
        } else if (s.head_dim == 128) {
          score_group<128>(query, keys, 128, 128, out);
        } else {
          score_group(query, keys, s.head_dim, s.head_dim, out);
        }
      }
    }
  }
  for (int64_t r = 0; r < tile.num_rows; ++r) {
    const int64_t row = tile.first_row + r;
    const int64_t length = std::min(begin + kSplitTokens, lens[row]) - begin;
    // Keys before the row's window weigh nothing.
    const int64_t skip = std::max<int64_t>(0, s.first_key(lens[row]) - begin);
    if (length <= skip) continue;
    const int64_t slot = row * s.num_splits + split;
    for (int64_t h = 0; h < s.num_heads; ++h) {
      float* row_scores = scores.data() + (r * s.num_heads + h) * kSplitTokens;
      sums[slot * s.num_heads + h] = exponentiate(row_scores + skip, length - skip, &maxes[slot * s.num_heads + h]);
      std::fill(row_scores, row_scores + skip, 0.f);
    }
    std::fill(acc + slot * heads_dim, acc + (slot + 1) * heads_dim, 0.f);
  }
  // The split's V rows, by KV head as the keys were ([kv_head][key][head_dim], all of them now),
  // then each row's weighted sum over its keys in one pass: its head_dim totals stay in
  // registers across the split, where a pass per group of keys loaded and stored them each time.
  const int64_t head_values = kSplitTokens * s.head_dim;
  for (int64_t position = begin; position < end; position += kGroup) {
    for (int64_t j = position + kGroup; j < std::min(end, position + 2 * kGroup); ++j)
      prefetch_lines(row_of(v_cache, j), stride * static_cast<int64_t>(sizeof(T)));
    for (int64_t j = position; j < std::min(end, position + kGroup); ++j) {
      for (int64_t g = 0; g < s.num_kv_heads; ++g) {
        widen(row_of(v_cache, j) + g * s.head_dim, rows.data() + g * head_values + (j - begin) * s.head_dim, s.head_dim);
      }
    }
  }
  for (int64_t r = 0; r < tile.num_rows; ++r) {
    const int64_t row = tile.first_row + r;
    const int64_t stop = std::min(begin + kSplitTokens, lens[row]);
    // From the group that holds the row's first key (a window's), as the weights before it are 0.
    const int64_t first = s.first_key(lens[row]);
    const int64_t start = first > begin ? begin + (first - begin) / kGroup * kGroup : begin;
    if (start >= stop) continue;
    float* row_acc = acc + (row * s.num_splits + split) * heads_dim;
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const float* weights = scores.data() + (r * s.num_heads + h) * kSplitTokens + (start - begin);
      accumulate(row_acc + h * s.head_dim, weights, rows.data() + (h / s.group) * head_values + (start - begin) * s.head_dim,
                 s.head_dim, stop - start, s.head_dim);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Prompt tiles (several rows of one request) take register tiles instead: a block of kKeyBlock
// keys of one KV head is copied out transposed ([head_dim][kKeyBlock]), and the scores of up to
// kScoreRows query rows against it are sums in registers, each key read once per tile rather
// than once per query. The sums keep score_group's order exactly: the dims d with
// d % 8 == l make one chain of multiply-adds in d's order (score_group's lane l), and the eight
// chains are added as transpose_sum adds its lanes. The weighted sum of values is a tile of
// kValueRows rows x 32 dims, each dim's total one chain over the keys in order, as accumulate's;
// keys past a row's length weigh 0, which leaves a total's bits as they were. So a row gets the
// same bits through either path, and the path a tile takes is free to follow its size.
constexpr int64_t kKeyBlock = 16;
#if defined(__AVX512F__)
// A block's 16 keys are one register, and 32 registers hold twice the AVX2 tile's rows. Lanes
// are independent, so each score and each total is the same chain in the same order, whatever
// the width: the same bits as the AVX2 tiles and the decode path.
constexpr int kScoreRows = 12;
constexpr int kValueRows = 6;
#else
constexpr int kScoreRows = 6;
constexpr int kValueRows = 3;
#endif

// One thread's buffers for attend_tiled, for tiles of up to kPromptTileRows rows. A pair is one
// (tile row, query head) of the item's KV head.
struct TiledScratch {
  TiledScratch(int64_t group, int64_t head_dim)
      : scores(kPromptTileRows * group * kSplitTokens), keys(kKeyBlock * head_dim), widened(kSplitTokens * head_dim),
        queries(kPromptTileRows * group), weights(kPromptTileRows * group), totals(kPromptTileRows * group),
        values(kSplitTokens) {}
  std::vector<float> scores, keys, widened;
  std::vector<const float*> queries;  // per pair: its query
  std::vector<float*> weights;        // per pair: its scores over the split, then their softmax numerators
  std::vector<float*> totals;         // per pair: its weighted sum of values (in acc)
  std::vector<const float*> values;   // per key of the split: its V row (one KV head's)
};

// out[r][column:column + kKeyBlock] = score_group's scores of query r against the block's keys,
// r < Rows.
template <int Rows>
inline void score_tile(const float* const* queries, const float* keys, int64_t head_dim, float* const* out,
                       int64_t column) {
#if defined(__AVX512F__)
  alignas(64) float partial[8][Rows][kKeyBlock];
  for (int l = 0; l < 8; ++l) {
    __m512 sums[Rows];
#pragma GCC unroll 12
    for (int r = 0; r < Rows; ++r) sums[r] = _mm512_setzero_ps();
    for (int64_t d = l; d < head_dim; d += 8) {
      const __m512 k = _mm512_loadu_ps(keys + d * kKeyBlock);
#pragma GCC unroll 12
      for (int r = 0; r < Rows; ++r) sums[r] = _mm512_fmadd_ps(_mm512_set1_ps(queries[r][d]), k, sums[r]);
    }
#pragma GCC unroll 12
    for (int r = 0; r < Rows; ++r) _mm512_store_ps(partial[l][r], sums[r]);
  }
#pragma GCC unroll 12
  for (int r = 0; r < Rows; ++r) {
    auto lane = [&](int l) { return _mm512_load_ps(partial[l][r]); };
    const __m512 first = _mm512_add_ps(_mm512_add_ps(lane(0), lane(1)), _mm512_add_ps(lane(2), lane(3)));
    const __m512 second = _mm512_add_ps(_mm512_add_ps(lane(4), lane(5)), _mm512_add_ps(lane(6), lane(7)));
    _mm512_storeu_ps(out[r] + column, _mm512_add_ps(first, second));
  }
#else
  alignas(32) float partial[8][Rows][kKeyBlock];
  for (int l = 0; l < 8; ++l) {
    __m256 low[Rows], high[Rows];
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) low[r] = high[r] = _mm256_setzero_ps();
    for (int64_t d = l; d < head_dim; d += 8) {
      const __m256 k0 = _mm256_loadu_ps(keys + d * kKeyBlock);
      const __m256 k1 = _mm256_loadu_ps(keys + d * kKeyBlock + 8);
#pragma GCC unroll 6
      for (int r = 0; r < Rows; ++r) {
        const __m256 q = _mm256_broadcast_ss(queries[r] + d);
        low[r] = _mm256_fmadd_ps(q, k0, low[r]);
        high[r] = _mm256_fmadd_ps(q, k1, high[r]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) {
      _mm256_store_ps(partial[l][r], low[r]);
      _mm256_store_ps(partial[l][r] + 8, high[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < Rows; ++r) {
    for (int half = 0; half < kKeyBlock; half += 8) {
      auto lane = [&](int l) { return _mm256_load_ps(partial[l][r] + half); };
      const __m256 first = _mm256_add_ps(_mm256_add_ps(lane(0), lane(1)), _mm256_add_ps(lane(2), lane(3)));
      const __m256 second = _mm256_add_ps(_mm256_add_ps(lane(4), lane(5)), _mm256_add_ps(lane(6), lane(7)));
      _mm256_storeu_ps(out[r] + column + half, _mm256_add_ps(first, second));
    }
  }
#endif
}

// acc[r][d] = fma(weights[r][j], values[j][d], acc[r][d]) for keys j < count in order, r < Rows.
template <int Rows>
inline void value_tile(const float* const* weights, const float* const* values, int64_t count, int64_t head_dim,
                       float* const* acc) {
#if defined(__AVX512F__)
  for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
    __m512 a[Rows][2];
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) {
      a[r][0] = _mm512_loadu_ps(acc[r] + d0);
      a[r][1] = _mm512_loadu_ps(acc[r] + d0 + 16);
    }
    for (int64_t j = 0; j < count; ++j) {
      const __m512 low = _mm512_loadu_ps(values[j] + d0), high = _mm512_loadu_ps(values[j] + d0 + 16);
#pragma GCC unroll 6
      for (int r = 0; r < Rows; ++r) {
        const __m512 weight = _mm512_set1_ps(weights[r][j]);
        a[r][0] = _mm512_fmadd_ps(weight, low, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(weight, high, a[r][1]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) {
      _mm512_storeu_ps(acc[r] + d0, a[r][0]);
      _mm512_storeu_ps(acc[r] + d0 + 16, a[r][1]);
    }
  }
#else
  for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
    __m256 a[Rows][4];
#pragma GCC unroll 3
    for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
      for (int w = 0; w < 4; ++w) a[r][w] = _mm256_loadu_ps(acc[r] + d0 + 8 * w);
    for (int64_t j = 0; j < count; ++j) {
      const float* v = values[j] + d0;
      __m256 weight[Rows];
#pragma GCC unroll 3
      for (int r = 0; r < Rows; ++r) weight[r] = _mm256_broadcast_ss(weights[r] + j);
#pragma GCC unroll 4
      for (int w = 0; w < 4; ++w) {
        const __m256 value = _mm256_loadu_ps(v + 8 * w);
#pragma GCC unroll 3
        for (int r = 0; r < Rows; ++r) a[r][w] = _mm256_fmadd_ps(weight[r], value, a[r][w]);
      }
    }
#pragma GCC unroll 3
    for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 4
      for (int w = 0; w < 4; ++w) _mm256_storeu_ps(acc[r] + d0 + 8 * w, a[r][w]);
  }
#endif
}

// attend's work for one KV head `g` of a prompt tile, through the register tiles above: the
// same bits per row. The tile's (row, query head) pairs of that KV head are its rows here,
// pair p = r * group + (h - g * group), with its scores at p * kSplitTokens.
template <typename T>
void attend_tiled(const Tile& tile, int64_t split, int64_t g, const Shape& s, const float* queries,
                  const T* k_cache, const T* v_cache, const int64_t* table, const int64_t* lens, float* acc,
                  float* maxes, float* sums, TiledScratch& scratch) {
  const int64_t begin = split * kSplitTokens;
  int64_t end = begin;
  for (int64_t r = 0; r < tile.num_rows; ++r) end = std::max(end, std::min(begin + kSplitTokens, lens[tile.first_row + r]));
  const int64_t* blocks = table + tile.first_row * s.table_stride;
  const int64_t heads_dim = s.num_heads * s.head_dim;
  auto row_of = [&](const T* cache, int64_t position) {
    return cache + (blocks[position / s.block_size] * s.block_size + position % s.block_size) * s.token_stride() +
           g * s.head_dim;
  };
  const int64_t pairs = tile.num_rows * s.group;
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t row = tile.first_row + p / s.group, h = g * s.group + p % s.group;
    scratch.queries[p] = queries + row * heads_dim + h * s.head_dim;
    scratch.weights[p] = scratch.scores.data() + p * kSplitTokens;
    scratch.totals[p] = acc + (row * s.num_splits + split) * heads_dim + h * s.head_dim;
  }
  float* keys = scratch.keys.data();
  for (int64_t position = begin; position < end; position += kKeyBlock) {
    // The next block's rows are asked for while this one's are scored: blocks sit scattered over
    // the pool, where the hardware's prefetchers do not follow.
    for (int64_t j = position + kKeyBlock; j < std::min(end, position + 2 * kKeyBlock); ++j)
      prefetch_lines(row_of(k_cache, j), s.head_dim * static_cast<int64_t>(sizeof(T)));
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      if (position + j < end) {
        const T* key = row_of(k_cache, position + j);
        for (int64_t d = 0; d < s.head_dim; ++d) keys[d * kKeyBlock + j] = static_cast<float>(key[d]);
      } else {
        for (int64_t d = 0; d < s.head_dim; ++d) keys[d * kKeyBlock + j] = 0.f;
      }
    }
    // A tile's rows are consecutive positions: those that see none of this block come first.
    int64_t first_r = 0;
    while (lens[tile.first_row + first_r] <= position) ++first_r;
    for (int64_t p = first_r * s.group; p < pairs; p += kScoreRows) {
      for_row_count<kScoreRows>(std::min<int64_t>(kScoreRows, pairs - p), [&]<int Rows>() {
        score_tile<Rows>(scratch.queries.data() + p, keys, s.head_dim, scratch.weights.data() + p, position - begin);
      });
    }
  }
  // The softmax as attend's; then weights past a row's keys are zeroed, as the value tiles read
  // every key of the split for each row.
  int64_t weighed_first = tile.num_rows, weighed_last = 0;
  for (int64_t r = 0; r < tile.num_rows; ++r) {
    const int64_t row = tile.first_row + r;
    const int64_t length = std::min(begin + kSplitTokens, lens[row]) - begin;
    const int64_t skip = std::max<int64_t>(0, s.first_key(lens[row]) - begin);
    if (length <= skip) continue;
    weighed_first = std::min(weighed_first, r);
    weighed_last = r + 1;
    const int64_t slot = row * s.num_splits + split;
    for (int64_t i = 0; i < s.group; ++i) {
      const int64_t h = g * s.group + i;
      float* row_scores = scratch.weights[r * s.group + i];
      sums[slot * s.num_heads + h] = exponentiate(row_scores + skip, length - skip, &maxes[slot * s.num_heads + h]);
      std::fill(row_scores, row_scores + skip, 0.f);
      std::fill(row_scores + length, row_scores + (end - begin), 0.f);
    }
    std::fill(scratch.totals[r * s.group], scratch.totals[r * s.group] + s.group * s.head_dim, 0.f);
  }
  // The split's V rows of this KV head, copied (widened) side by side: read in place, rows a
  // token apart in the cache (4 KB for 4 KV heads of 256) fall in the same few L1 sets, and
  // the value tiles read each row once per 32 dims (8 heads on 4 KV heads of 256, a 512-token
  // chunk after 3,000 cached tokens: 1.27x of gather + SDPA's time read in place).
  for (int64_t j = begin; j < end; ++j) {
    float* to = scratch.widened.data() + (j - begin) * s.head_dim;
    widen(row_of(v_cache, j), to, s.head_dim);
    scratch.values[j - begin] = to;
  }
  // Rows whose window has not reached this split, or that end before it, weigh nothing here:
  // they sit at the tile's two ends.
  for (int64_t p = weighed_first * s.group; p < weighed_last * s.group; p += kValueRows) {
    for_row_count<kValueRows>(std::min<int64_t>(kValueRows, weighed_last * s.group - p), [&]<int Rows>() {
      value_tile<Rows>(scratch.weights.data() + p, scratch.values.data(), end - begin, s.head_dim,
                       scratch.totals.data() + p);
    });
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "avx512_exp.h"

// The bf16 path where the host has AVX512-BF16: `vdpbf16ps` multiplies pairs of bf16 and adds
// both products into one fp32 lane, 32 products an instruction where the fp32 path widens every
// element and does 8. Its fixed orders differ from the fp32 path's, and a bf16 cache always takes
// this path in this build, so a token still gets the same bits whatever it is computed beside.
//
// Scores: a kv head's 16 keys of a group are laid out pair-major (lane j of row i: key j's head
// dims 2i and 2i+1), and each query broadcasts its pair i against row i: lane j gathers key j's
// score, with no sum across lanes. Every score is two chains (pairs of the first half of the head,
// then the second) added at the end. Probabilities are rounded to bf16 for the weighted sum of
// values, as flash attention does on GPUs (their sum stays fp32); values are laid out by pairs of
// keys (lane d: key t's and key t+1's dim d), so a query's head_dim totals stay in registers.
constexpr int64_t kKeyLanes = 16;

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// One split's softmax numerators for a query, rounded to bf16 into `weights` (zeros from
// `length` to the next multiple of 16); returns their fp32 sum and sets the maximum.
inline float exponentiate_to_bf16(const float* row, int64_t length, uint16_t* weights, float* max_out) {
  __m512 maximum = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < length; t += 16) {
    const __mmask16 valid = length - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (length - t)) - 1);
    maximum = _mm512_mask_max_ps(maximum, valid, maximum, _mm512_maskz_loadu_ps(valid, row + t));
  }
  const float max_score = _mm512_reduce_max_ps(maximum);
  const __m512 max_vector = _mm512_set1_ps(max_score);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < length; t += 16) {
    const __mmask16 valid = length - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (length - t)) - 1);
    const __m512 numerators =
        _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, row + t), max_vector)));
    sum = _mm512_add_ps(sum, numerators);
    const __m256bh rounded = _mm512_cvtneps_pbh(numerators);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + t), (__m256i)rounded);
  }
  *max_out = max_score;
  return _mm512_reduce_add_ps(sum);
}

// rows[j] lane i -> rows[i] lane j, for 16 rows of 16 32-bit lanes (4x4 blocks within each 128-bit
// lane, then the lanes moved across).
inline void transpose_16x16(__m512i* rows) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(rows[2 * k], rows[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(rows[2 * k], rows[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  // u[4k + m], 128-bit lane L: rows 4k..4k+3 of column 4L + m.
  for (int m = 0; m < 4; ++m) {
    const __m512i low_a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), high_a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    const __m512i low_b = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44), high_b = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    rows[m] = _mm512_shuffle_i32x4(low_a, low_b, 0x88);
    rows[4 + m] = _mm512_shuffle_i32x4(low_a, low_b, 0xDD);
    rows[8 + m] = _mm512_shuffle_i32x4(high_a, high_b, 0x88);
    rows[12 + m] = _mm512_shuffle_i32x4(high_a, high_b, 0xDD);
  }
}

// The pair sources below and the loops over them, forced inline: left to GCC 12, a decode's
// attention over the default model's shapes took 1.05-1.1x the time.
#define CACHET_ALWAYS_INLINE __attribute__((always_inline))

// Where a decode's score pass reads its keys as pairs of dims, 16 keys a register (lane k: key
// k's dims 2i and 2i + 1): pair i of a chunk of 16 (begin(c), then pair(i) for pairs c .. c +
// 15). A decode's few queries use a group's keys once, so each chunk is transposed in registers
// from the 16 key rows (null past the split's end) and used at once; a tile's many queries read
// them stored pair-major once (score_keys).
struct KeyRows {
  const at::BFloat16* const* rows;
  __m512i chunk[kKeyLanes];
  CACHET_ALWAYS_INLINE void begin(int64_t c) {
    for (int64_t j = 0; j < kKeyLanes; ++j)
      chunk[j] = rows[j] != nullptr ? _mm512_loadu_si512(rows[j] + 2 * c) : _mm512_setzero_si512();
    transpose_16x16(chunk);
  }
  CACHET_ALWAYS_INLINE __m512i pair(int64_t i) const { return chunk[i]; }
};

// A score is its two chains' sum, scaled: what both score loops store, so a token's score has the
// same bits from either.
template <int NQ>
CACHET_ALWAYS_INLINE inline void store_scores(const __m512 (&first)[NQ], const __m512 (&second)[NQ], float scale,
                                              float* const* out) {
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int q = 0; q < NQ; ++q) _mm512_storeu_ps(out[q], _mm512_mul_ps(_mm512_add_ps(first[q], second[q]), scaled));
}

// Scores of NQ queries (their head slices as bf16 pairs) against one group's 16 keys, over
// `pairs` pairs of dims: two chains a query (the first half of the dims, then the second).
template <int NQ>
CACHET_ALWAYS_INLINE inline void score_pairs(const uint32_t* const* queries, KeyRows keys, int64_t pairs,
                                             float scale, float* const* out) {
  __m512 first[NQ], second[NQ];
  for (int q = 0; q < NQ; ++q) first[q] = second[q] = _mm512_setzero_ps();
  // Each half's loop names its own chains: one pointer picking between them kept them in memory.
  auto run = [&](__m512(&chains)[NQ], int64_t from, int64_t to) CACHET_ALWAYS_INLINE {
    for (int64_t c = from; c < to; c += 16) {
      keys.begin(c);
      for (int64_t i = 0; i < 16; ++i) {
        const __m512i k = keys.pair(i);
        for (int q = 0; q < NQ; ++q)
          chains[q] = _mm512_dpbf16_ps(chains[q], as_bh(_mm512_set1_epi32(static_cast<int>(queries[q][c + i]))), as_bh(k));
      }
    }
  };
  const int64_t half = pairs / 2;  // a multiple of 16 for every head_dim built
  run(first, 0, half);
  run(second, half, pairs);
  store_scores<NQ>(first, second, scale, out);
}

// A tile's queries against a group's keys stored pair-major (pair p at keys + 16 p): the same two
// chains a query as score_pairs, each chain's additions in the same order, so the same bits; but
// both halves advance in one loop, 2 x NQ chains in flight where NQ waited on each other's
// latency.
template <int NQ>
inline void score_keys(const uint32_t* const* queries, const uint32_t* keys, int64_t pairs, float scale,
                       float* const* out) {
  __m512 first[NQ], second[NQ];
  for (int q = 0; q < NQ; ++q) first[q] = second[q] = _mm512_setzero_ps();
  const int64_t half = pairs / 2;
  for (int64_t i = 0; i < half; ++i) {
    const __m512i k0 = _mm512_loadu_si512(keys + i * kKeyLanes);
    const __m512i k1 = _mm512_loadu_si512(keys + (half + i) * kKeyLanes);
    for (int q = 0; q < NQ; ++q) {
      first[q] = _mm512_dpbf16_ps(first[q], as_bh(_mm512_set1_epi32(static_cast<int>(queries[q][i]))), as_bh(k0));
      second[q] =
          _mm512_dpbf16_ps(second[q], as_bh(_mm512_set1_epi32(static_cast<int>(queries[q][half + i]))), as_bh(k1));
    }
  }
  store_scores<NQ>(first, second, scale, out);
}

template <int NQ>
inline void score_rows(const uint32_t* const* queries, const at::BFloat16* const* key_rows, int64_t pairs,
                       float scale, float* const* out) {
  score_pairs<NQ>(queries, KeyRows{key_rows}, pairs, scale, out);
}

// 32 dims of two keys' values as pairs: lane d of `low` holds a's and b's dim d, of `high` their
// dim 16 + d.
inline void interleave_values(__m512i a, __m512i b, __m512i* low, __m512i* high) {
  const __m512i first_half = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                              38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  *low = _mm512_permutex2var_epi16(a, first_half, b);
  *high = _mm512_permutex2var_epi16(a, _mm512_add_epi16(first_half, _mm512_set1_epi16(16)), b);
}

// Where a weighing pass reads its values: pair t of keys as NV registers, lane d of register v
// holding key 2t's and key 2t + 1's dim 16v + d. StoredValues: a split's values interleaved once
// for a tile's many queries. ValueRows: a decode's few queries interleave them in registers from
// the split's value rows (`rows[j]`: key j's slice, `keys` of them) as they use them, asking for
// `prefetch_bytes` of each row two groups of keys ahead when that is > 0.
template <int NV>
struct StoredValues {
  const uint32_t* values;
  int64_t head_dim;
  CACHET_ALWAYS_INLINE void pairs(int64_t t, __m512i* out) const {
    for (int v = 0; v < NV; ++v) out[v] = _mm512_loadu_si512(values + t * head_dim + 16 * v);
  }
};

template <int NV>
struct ValueRows {
  const at::BFloat16* const* rows;
  int64_t keys;
  int64_t prefetch_bytes;
  CACHET_ALWAYS_INLINE void pairs(int64_t t, __m512i* out) const {
    if (prefetch_bytes > 0) {
      for (int64_t j = t == 0 ? 0 : 2 * t + 2 * kKeyLanes; j < std::min(keys, 2 * t + 2 * kKeyLanes + 2); ++j)
        prefetch_lines(rows[j], prefetch_bytes);
    }
    const at::BFloat16* v0 = rows[2 * t];
    const at::BFloat16* v1 = 2 * t + 1 < keys ? rows[2 * t + 1] : nullptr;
    for (int v = 0; v < NV; v += 2) {
      const __m512i b = v1 != nullptr ? _mm512_loadu_si512(v1 + 16 * v) : _mm512_setzero_si512();
      interleave_values(_mm512_loadu_si512(v0 + 16 * v), b, &out[v], &out[v + 1]);
    }
  }
};

// acc (NV registers of 16 dims per query) += the weighted sum of values over `key_pairs` pairs of
// keys, for NQ queries: their bf16 probabilities as pairs.
template <int NQ, int NV, typename Values>
CACHET_ALWAYS_INLINE inline void weigh_pairs(const uint32_t* const* weights, const Values& values,
                                             int64_t key_pairs, float* const* acc) {
  __m512 sums[NQ][NV];
  for (int q = 0; q < NQ; ++q)
    for (int v = 0; v < NV; ++v) sums[q][v] = _mm512_loadu_ps(acc[q] + 16 * v);
  for (int64_t t = 0; t < key_pairs; ++t) {
    __m512i v_pairs[NV];
    values.pairs(t, v_pairs);
    for (int q = 0; q < NQ; ++q) {
      const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(weights[q][t])));
      for (int v = 0; v < NV; ++v) sums[q][v] = _mm512_dpbf16_ps(sums[q][v], w, as_bh(v_pairs[v]));
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc[q] + 16 * v, sums[q][v]);
}

template <int NQ, int NV>
inline void weigh_values(const uint32_t* const* weights, const uint32_t* values, int64_t key_pairs,
                         int64_t head_dim, float* const* acc) {
  weigh_pairs<NQ, NV>(weights, StoredValues<NV>{values, head_dim}, key_pairs, acc);
}

template <int NQ, int NV>
inline void weigh_value_rows(const uint32_t* const* weights, const at::BFloat16* const* rows, int64_t keys,
                             int64_t key_pairs, int64_t prefetch_bytes, float* const* acc) {
  weigh_pairs<NQ, NV>(weights, ValueRows<NV>{rows, keys, prefetch_bytes}, key_pairs, acc);
}

// head_dims this path is built for (registers per query's totals: head_dim / 16; 256: Gemma 3).
inline bool bf16_dot_path_fits(int64_t head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

template <int NV>
void attend_bf16_dot_impl(const Tile& tile, int64_t split, const Shape& s, const at::BFloat16* queries, float scale,
                          const at::BFloat16* k_cache, const at::BFloat16* v_cache, const int64_t* table,
                          const int64_t* lens, float* acc, float* maxes, float* sums, std::vector<float>& scores,
                          std::vector<uint32_t>& pairs) {
  // Queries of one kv head scored together (two chains each, 16 in flight for 8 queries), and
  // weighing values together: their head_dim sums must fit the 32 registers. Both halves' chains
  // advancing together, 8 queries a pass where 6 ran one half at a time: a cold 1,800-token
  // prompt's attention 0.87-0.90x the time (30 layers, two threads of a Zen 5, same bits).
  constexpr int kScorePass = 8;
  constexpr int kWeighPass = NV == 4 ? 6 : NV == 8 ? 3 : 1;
  const int64_t begin = split * kSplitTokens;
  int64_t end = begin;
  for (int64_t r = 0; r < tile.num_rows; ++r) end = std::max(end, std::min(begin + kSplitTokens, lens[tile.first_row + r]));
  const int64_t* blocks = table + tile.first_row * s.table_stride;
  const int64_t stride = s.token_stride();
  // A key's whole K (or V) row, every KV head's slice: what the first KV head's passes ask for.
  const int64_t row_bytes = stride * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t heads_dim = s.num_heads * s.head_dim;
  const int64_t dim_pairs = s.head_dim / 2;
  // Each key's row offset in the caches, found once: every pass reads each key's rows (each KV
  // head's K and V, and the prefetches), and a division by the block size at each read cost a
  // bf16 prompt's attention 4-7% (a cold 1,800-token prompt's 30 layers, two threads of a Zen 5).
  int64_t offsets[kSplitTokens];
  for (int64_t position = begin; position < end; ++position)
    offsets[position - begin] = (blocks[position / s.block_size] * s.block_size + position % s.block_size) * stride;
  auto row_of = [&](const at::BFloat16* cache, int64_t position) { return cache + offsets[position - begin]; };
  // A pass reads one KV head's slice of each key's row (128 of the default model's 384 bytes),
  // through blocks scattered over the pool: the hardware's prefetchers do not follow that, and
  // each group of keys waited on memory (16 decodes' attention read DRAM at 9 GB/s of the 40 this
  // Zen 5 gives). So the first KV head's passes ask for whole rows two groups of keys ahead, their
  // first three groups up front (a loop at each pass: through a lambda, GCC 12 dropped the
  // prefetches), and the other heads' passes find their slices in L2. 16 decodes over 224 / 600
  // keys, 30 layers' KV cycled as in a step, each pass asking for its own slices: 315 -> 182 /
  // 815 -> 486 us a layer. Asking once, for whole rows (a decode's three passes per KV head each
  // began with a wait on memory), one thread of a Zen 4 EPYC, the default model's decode steps:
  // 4 requests over 100-1,800 keys 31.4 -> 27.8 ms; two threads, 16 over 1,000 keys 68.6 -> 53.7
  // ms. Whole rows at every pass, or further ahead, were slower (too many lines in flight).
  //
  // The tile's queries of kv head g: (row, head) in order.
  std::vector<std::pair<int64_t, int64_t>> members;
  members.reserve(tile.num_rows * s.group);
  // pairs: keys pair-major for one group, then values pair-interleaved for the split, then
  // the probabilities as bf16.
  uint32_t* key_pairs = pairs.data();
  uint32_t* value_pairs = key_pairs + dim_pairs * kKeyLanes;
  uint16_t* probabilities = reinterpret_cast<uint16_t*>(value_pairs + (kSplitTokens / 2) * s.head_dim);
  // bf16 per query, and room for the zeros a window's row writes past its split's end.
  const int64_t probability_stride = kSplitTokens + 16;
  const __m512i zero = _mm512_setzero_si512();
  // A decode's few queries of a KV head (up to 4) score a group's keys from registers, every KV
  // head's slice of the group in turn, so each key row is read from memory once, at a steady
  // pace: a pass per KV head asked for the rows in the first pass's bursts and left memory idle
  // through the others' (which found them in L2). One thread of a Zen 4 EPYC, the default
  // model's 30 layers with a step's weights read between them, 4 decodes over 150 / 150 / 150 /
  // 1,850 keys: 5.6 -> 5.3 ms a step on consecutive blocks, 8.6 -> 7.5 on scattered ones; one
  // decode over 7,500 keys on scattered blocks 23.3 -> 20.3 ms; two threads, 16 over 1,000 keys
  // 22.4 -> 19.1 / 27.1 -> 24.7 ms. Asking for the V rows in this pass too was slower.
  const int64_t row_queries = tile.num_rows * s.group;
  const bool scores_from_rows = row_queries <= 4;
  // Where a KV head's queries weigh values from registers (their sums and a pair's values must
  // fit the 32 registers), they do so for every KV head in one pass too (below the loop), so
  // each KV head's probabilities keep slots of their own.
  const bool values_from_rows = row_queries * NV <= 16;
  if (scores_from_rows) {
    for (int64_t position = begin; position < end; position += kKeyLanes) {
      for (int64_t j = position == begin ? begin : position + 2 * kKeyLanes; j < std::min(end, position + 3 * kKeyLanes); ++j)
        prefetch_lines(row_of(k_cache, j), row_bytes);
      const at::BFloat16* group_rows[kKeyLanes];
      for (int64_t j = 0; j < kKeyLanes; ++j) group_rows[j] = position + j < end ? row_of(k_cache, position + j) : nullptr;
      for (int64_t g = 0; g < s.num_kv_heads; ++g) {
        const at::BFloat16* key_rows[kKeyLanes];
        for (int64_t j = 0; j < kKeyLanes; ++j) key_rows[j] = group_rows[j] != nullptr ? group_rows[j] + g * s.head_dim : nullptr;
        // The KV head's queries in the order of its members below: (row, head) in order.
        const uint32_t* qs[4];
        float* outs[4];
        int64_t q = 0;
        for (int64_t r = 0; r < tile.num_rows; ++r) {
          for (int64_t h = g * s.group; h < (g + 1) * s.group; ++h, ++q) {
            qs[q] = reinterpret_cast<const uint32_t*>(queries + (tile.first_row + r) * heads_dim + h * s.head_dim);
            outs[q] = scores.data() + (r * s.num_heads + h) * kSplitTokens + (position - begin);
          }
        }
        switch (row_queries) {
          case 1: score_rows<1>(qs, key_rows, dim_pairs, scale, outs); break;
          case 2: score_rows<2>(qs, key_rows, dim_pairs, scale, outs); break;
          case 3: score_rows<3>(qs, key_rows, dim_pairs, scale, outs); break;
          default: score_rows<4>(qs, key_rows, dim_pairs, scale, outs); break;
        }
      }
    }
  }
  for (int64_t g = 0; g < s.num_kv_heads; ++g) {
    members.clear();
    for (int64_t r = 0; r < tile.num_rows; ++r)
      for (int64_t h = g * s.group; h < (g + 1) * s.group; ++h) members.emplace_back(r, h);
    const int64_t count = static_cast<int64_t>(members.size());
    const int64_t member_base = values_from_rows ? g * count : 0;
    // Member m's query (its head's dims as bf16 pairs) and its scores of this split.
    auto query_pairs = [&](int64_t m) {
      const auto [r, h] = members[m];
      return reinterpret_cast<const uint32_t*>(queries + (tile.first_row + r) * heads_dim + h * s.head_dim);
    };
    auto score_row = [&](int64_t m) {
      const auto [r, h] = members[m];
      return scores.data() + (r * s.num_heads + h) * kSplitTokens;
    };
    // Members first .. first + n - 1's probabilities (as bf16 pairs) and accumulators; returns
    // the most pairs of keys any of them has in this split.
    auto weighing = [&](int64_t first, int64_t n, const uint32_t** ws, float** outs) {
      int64_t longest_pairs = 0;
      for (int64_t q = 0; q < n; ++q) {
        const auto [r, h] = members[first + q];
        const int64_t row = tile.first_row + r;
        const int64_t length = std::max<int64_t>(0, std::min(begin + kSplitTokens, lens[row]) - begin);
        longest_pairs = std::max(longest_pairs, (length + 1) / 2);
        ws[q] = reinterpret_cast<const uint32_t*>(probabilities + (member_base + first + q) * probability_stride);
        outs[q] = acc + (row * s.num_splits + split) * heads_dim + h * s.head_dim;
      }
      return longest_pairs;
    };
    // A tile's scores: its dozens of queries of this KV head share a group's keys stored
    // pair-major once (a decode's are in already).
    for (int64_t position = begin; position < end && !scores_from_rows; position += kKeyLanes) {
      if (g == 0) {
        for (int64_t j = position == begin ? begin : position + 2 * kKeyLanes; j < std::min(end, position + 3 * kKeyLanes); ++j)
          prefetch_lines(row_of(k_cache, j), row_bytes);
      }
      for (int64_t c = 0; c < dim_pairs; c += 16) {
        __m512i rows[16];
        for (int64_t j = 0; j < kKeyLanes; ++j) {
          rows[j] = position + j < end ? _mm512_loadu_si512(row_of(k_cache, position + j) + g * s.head_dim + 2 * c) : zero;
        }
        transpose_16x16(rows);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(key_pairs + (c + i) * kKeyLanes, rows[i]);
      }
      for (int64_t m = 0; m < count; m += kScorePass) {
        const int n = static_cast<int>(std::min<int64_t>(kScorePass, count - m));
        const uint32_t* qs[kScorePass];
        float* outs[kScorePass];
        for (int q = 0; q < n; ++q) {
          qs[q] = query_pairs(m + q);
          outs[q] = score_row(m + q) + (position - begin);
        }
        switch (n) {
          case 1: score_keys<1>(qs, key_pairs, dim_pairs, scale, outs); break;
          case 2: score_keys<2>(qs, key_pairs, dim_pairs, scale, outs); break;
          case 3: score_keys<3>(qs, key_pairs, dim_pairs, scale, outs); break;
          case 4: score_keys<4>(qs, key_pairs, dim_pairs, scale, outs); break;
          case 5: score_keys<5>(qs, key_pairs, dim_pairs, scale, outs); break;
          case 6: score_keys<6>(qs, key_pairs, dim_pairs, scale, outs); break;
          case 7: score_keys<7>(qs, key_pairs, dim_pairs, scale, outs); break;
          default: score_keys<8>(qs, key_pairs, dim_pairs, scale, outs); break;
        }
      }
    }
    // Softmax numerators, rounded to bf16 (zero past each row's last key, to the pair's end).
    const int64_t span_pairs = (end - begin + 1) / 2;
    for (int64_t m = 0; m < count; ++m) {
      const auto [r, h] = members[m];
      const int64_t row = tile.first_row + r;
      const int64_t length = std::min(begin + kSplitTokens, lens[row]) - begin;
      const int64_t skip = std::max<int64_t>(0, s.first_key(lens[row]) - begin);
      uint16_t* weights = probabilities + (member_base + m) * probability_stride;
      std::fill(weights, weights + 2 * span_pairs, static_cast<uint16_t>(0));
      if (length <= skip) continue;
      const float* row_scores = scores.data() + (r * s.num_heads + h) * kSplitTokens;
      const int64_t slot = row * s.num_splits + split;
      // From the row's first key: a window's start need not be a split's.
      sums[slot * s.num_heads + h] =
          exponentiate_to_bf16(row_scores + skip, length - skip, weights + skip, &maxes[slot * s.num_heads + h]);
      std::fill(acc + slot * heads_dim + h * s.head_dim, acc + slot * heads_dim + (h + 1) * s.head_dim, 0.f);
    }
    // Values, two keys interleaved by dim: lane d of pair t holds key 2t's and key 2t+1's dim d.
    // A tile's queries store them once for all their passes (a decode's weigh them below).
    if (values_from_rows) continue;
    for (int64_t t = 0; t < span_pairs; ++t) {
      const int64_t p0 = begin + 2 * t;
      if (g == 0) {
        for (int64_t j = t == 0 ? begin : p0 + 2 * kKeyLanes; j < std::min(end, p0 + 2 * kKeyLanes + 2); ++j)
          prefetch_lines(row_of(v_cache, j), row_bytes);
      }
      const at::BFloat16* v0 = row_of(v_cache, p0) + g * s.head_dim;
      const at::BFloat16* v1 = p0 + 1 < end ? row_of(v_cache, p0 + 1) + g * s.head_dim : nullptr;
      uint32_t* out = value_pairs + t * s.head_dim;
      for (int64_t d = 0; d < s.head_dim; d += 32) {
        __m512i low, high;
        interleave_values(_mm512_loadu_si512(v0 + d), v1 != nullptr ? _mm512_loadu_si512(v1 + d) : zero, &low, &high);
        _mm512_storeu_si512(out + d, low);
        _mm512_storeu_si512(out + d + 16, high);
      }
    }
    for (int64_t m = 0; m < count; m += kWeighPass) {
      const int n = static_cast<int>(std::min<int64_t>(kWeighPass, count - m));
      const uint32_t* ws[kWeighPass];
      float* outs[kWeighPass];
      const int64_t longest_pairs = weighing(m, n, ws, outs);
      // Only the counts a pass can hold are built: weigh_values<6, 16> would not fit.
      if constexpr (kWeighPass == 1) {
        weigh_values<1, NV>(ws, value_pairs, longest_pairs, s.head_dim, outs);
      } else if constexpr (kWeighPass == 3) {
        switch (n) {
          case 1: weigh_values<1, NV>(ws, value_pairs, longest_pairs, s.head_dim, outs); break;
          case 2: weigh_values<2, NV>(ws, value_pairs, longest_pairs, s.head_dim, outs); break;
          default: weigh_values<3, NV>(ws, value_pairs, longest_pairs, s.head_dim, outs); break;
        }
      } else {
        switch (n) {
          case 1: weigh_values<1, NV>(ws, value_pairs, longest_pairs, s.head_dim, outs); break;
          case 2: weigh_values<2, NV>(ws, value_pairs, longest_pairs, s.head_dim, outs); break;
          case 3: weigh_values<3, NV>(ws, value_pairs, longest_pairs, s.head_dim, outs); break;
          case 4: weigh_values<4, NV>(ws, value_pairs, longest_pairs, s.head_dim, outs); break;
          case 5: weigh_values<5, NV>(ws, value_pairs, longest_pairs, s.head_dim, outs); break;
          default: weigh_values<6, NV>(ws, value_pairs, longest_pairs, s.head_dim, outs); break;
        }
      }
    }
  }
  if (!values_from_rows) return;
  // A decode's queries weigh the split's values from registers as they are interleaved, a chunk
  // of keys at a time for every KV head in turn (their sums stored between chunks, the same
  // chains), so the value rows stream from memory at a steady pace while the next chunk's are
  // asked for. One thread of a Zen 4 EPYC, the default model's 30 layers with a step's weights
  // read between them, 4 decodes over 150 / 150 / 150 / 1,850 keys: 5.4 -> 5.3 ms a step on
  // consecutive blocks, 7.4 -> 7.1 on scattered ones (chunks of 8 or 32 pairs: 5.0 / 5.4 and 7.4
  // / 7.5).
  constexpr int64_t kChunkPairs = 16;
  const int64_t keys = end - begin;
  const at::BFloat16* v_rows[kSplitTokens];
  for (int64_t j = 0; j < keys; ++j) v_rows[j] = row_of(v_cache, begin + j);
  int64_t longest_pairs = 0;
  for (int64_t r = 0; r < tile.num_rows; ++r) {
    const int64_t length = std::max<int64_t>(0, std::min(begin + kSplitTokens, lens[tile.first_row + r]) - begin);
    longest_pairs = std::max(longest_pairs, (length + 1) / 2);
  }
  for (int64_t j = 0; j < std::min(keys, 2 * kChunkPairs); ++j) prefetch_lines(v_rows[j], row_bytes);
  for (int64_t t0 = 0; t0 < longest_pairs; t0 += kChunkPairs) {
    for (int64_t j = 2 * (t0 + kChunkPairs); j < std::min(keys, 2 * (t0 + 2 * kChunkPairs)); ++j) prefetch_lines(v_rows[j], row_bytes);
    const int64_t chunk_pairs = std::min(kChunkPairs, longest_pairs - t0);
    const int64_t chunk_keys = std::min(2 * kChunkPairs, keys - 2 * t0);
    for (int64_t g = 0; g < s.num_kv_heads; ++g) {
      const at::BFloat16* chunk_rows[2 * kChunkPairs];
      for (int64_t j = 0; j < chunk_keys; ++j) chunk_rows[j] = v_rows[2 * t0 + j] + g * s.head_dim;
      const uint32_t* ws[4];
      float* outs[4];
      int64_t q = 0;
      for (int64_t r = 0; r < tile.num_rows; ++r) {
        for (int64_t h = g * s.group; h < (g + 1) * s.group; ++h, ++q) {
          ws[q] = reinterpret_cast<const uint32_t*>(probabilities + (g * row_queries + q) * probability_stride) + t0;
          outs[q] = acc + ((tile.first_row + r) * s.num_splits + split) * heads_dim + h * s.head_dim;
        }
      }
      if constexpr (NV <= 4) {
        switch (row_queries) {
          case 1: weigh_value_rows<1, NV>(ws, chunk_rows, chunk_keys, chunk_pairs, 0, outs); break;
          case 2: weigh_value_rows<2, NV>(ws, chunk_rows, chunk_keys, chunk_pairs, 0, outs); break;
          case 3: weigh_value_rows<3, NV>(ws, chunk_rows, chunk_keys, chunk_pairs, 0, outs); break;
          default: weigh_value_rows<4, NV>(ws, chunk_rows, chunk_keys, chunk_pairs, 0, outs); break;
        }
      } else if constexpr (NV <= 8) {
        if (row_queries == 1) weigh_value_rows<1, NV>(ws, chunk_rows, chunk_keys, chunk_pairs, 0, outs);
        else weigh_value_rows<2, NV>(ws, chunk_rows, chunk_keys, chunk_pairs, 0, outs);
      } else {
        weigh_value_rows<1, NV>(ws, chunk_rows, chunk_keys, chunk_pairs, 0, outs);
      }
    }
  }
}
#endif

// Row `row` is the next prompt token of the request whose tile starts at `first`: one position
// past the row before it, and the tile's first row names every block it reads.
bool continues(const int64_t* table, int64_t table_stride, const int64_t* lens, int64_t block_size, int64_t first,
               int64_t row) {
  if (lens[row] != lens[row - 1] + 1) return false;
  const int64_t needed = (lens[row] + block_size - 1) / block_size;
  return std::equal(table + first * table_stride, table + first * table_stride + needed, table + row * table_stride);
}

// Room for every row's partial results per split (merged at the end of a call), kept between a
// thread's calls up to kKeptPartialFloats. Past glibc's largest mmap threshold (32 MB: a 512-token
// chunk after about 7,000 cached tokens) a fresh allocation is mapped anew at each call and each
// of its pages faults in at first touch: one layer of a bf16 chunk after 7,000 cached tokens took
// 38 ms that way against 24 ms on kept room (two threads of a Zen 5, same bits). Past the cap
// (chunks after ~55,000 tokens) a call allocates its own, so one very long context does not pin
// its room for the life of the process.
constexpr int64_t kKeptPartialFloats = int64_t{64} << 20;  // 256 MB

float* split_partials(int64_t floats, std::unique_ptr<float[]>& fresh) {
  if (floats > kKeptPartialFloats) {
    fresh.reset(new float[floats]);
    return fresh.get();
  }
  thread_local std::vector<float> kept;
  if (static_cast<int64_t>(kept.size()) < floats) kept.resize(floats);
  return kept.data();
}

template <typename T>
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                     double scale, int64_t window) {
  const int64_t batch = q.size(0);
  Shape s{};
  s.num_heads = q.size(1);
  s.head_dim = q.size(2);
  s.block_size = k_cache.size(1);
  s.num_kv_heads = k_cache.size(2);
  s.group = s.num_heads / s.num_kv_heads;
  s.table_stride = block_table.size(1);
  s.window = window;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) max_len = std::max(max_len, lens[b]);
  s.num_splits = (max_len + kSplitTokens - 1) / kSplitTokens;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  const bool dot_products = kBf16 && bf16_dot_path_fits(s.head_dim);
#else
  const bool dot_products = false;
#endif
  // Queries in fp32, pre-scaled, so the inner loops are one multiply-add per element (the bf16
  // dot-product path reads them as they are).
  const at::Tensor scaled = dot_products ? q : (q.to(at::kFloat) * scale).contiguous();
  const float* queries = dot_products ? nullptr : scaled.data_ptr<float>();

  const bool register_tiles = !dot_products && register_tiles_fit(s.head_dim);
  const int64_t tile_rows = register_tiles ? kPromptTileRows : kTileRows;
  std::vector<Tile> tiles;
  for (int64_t row = 0; row < batch;) {
    int64_t n = 1;
    while (n < tile_rows && row + n < batch && continues(table, s.table_stride, lens, s.block_size, row, row + n)) ++n;
    tiles.push_back({row, n});
    row += n;
  }
  std::vector<WorkItem> items;
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t) {
    const int64_t longest = lens[tiles[t].first_row + tiles[t].num_rows - 1];
    const int64_t first_split = s.first_key(lens[tiles[t].first_row]) / kSplitTokens;
    const bool by_kv_head = register_tiles && tiles[t].num_rows >= kMinTiledRows;
    for (int64_t split = first_split; split * kSplitTokens < longest; ++split) {
      const int64_t keys = std::min(kSplitTokens, longest - split * kSplitTokens);
      if (!by_kv_head) {
        items.push_back({t, split, -1, tiles[t].num_rows * s.num_heads * keys});
        continue;
      }
      for (int64_t g = 0; g < s.num_kv_heads; ++g) items.push_back({t, split, g, tiles[t].num_rows * s.group * keys});
    }
  }
  // Heaviest first, each thread taking the next from a shared counter: a prompt chunk's later
  // tiles see more keys, and a contiguous split of the items left one of two threads 1.2-1.4x the
  // other's work (a 512-token chunk with nothing cached). Each item writes slots of its own, so
  // the order changes no result.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next_item{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t heads_dim = s.num_heads * s.head_dim;
  // Left uninitialised: each item writes the slots it owns before anything reads them (a
  // 512-token chunk's would be ~10 MB to clear per layer).
  const int64_t acc_floats = batch * s.num_splits * heads_dim, stat_floats = batch * s.num_splits * s.num_heads;
  std::unique_ptr<float[]> fresh;
  float* const acc = split_partials(acc_floats + 2 * stat_floats, fresh);
  float* const maxes = acc + acc_floats;
  float* const sums = maxes + stat_floats;
  const T* k_data = k_cache.data_ptr<T>();
  const T* v_data = v_cache.data_ptr<T>();

  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores(kTileRows * s.num_heads * kSplitTokens);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (kBf16) {
      if (dot_products) {
        // Probabilities for a tile's queries of one KV head, or a decode's of every KV head.
        const int64_t weighed_queries = std::max(kTileRows * s.group, s.num_kv_heads * 4);
        std::vector<uint32_t> pairs(s.head_dim / 2 * kKeyLanes + kSplitTokens / 2 * s.head_dim +
                                    weighed_queries * (kSplitTokens + 16) / 2);
        const at::BFloat16* bf16_queries = scaled.data_ptr<at::BFloat16>();
        for (int64_t i = next_item.fetch_add(1); i < num_items; i = next_item.fetch_add(1)) {
          const Tile& tile = tiles[items[i].tile];
          if (s.head_dim == 64) {
            attend_bf16_dot_impl<4>(tile, items[i].split, s, bf16_queries, static_cast<float>(scale), k_data, v_data,
                                    table, lens, acc, maxes, sums, scores, pairs);
          } else if (s.head_dim == 128) {
            attend_bf16_dot_impl<8>(tile, items[i].split, s, bf16_queries, static_cast<float>(scale), k_data, v_data,
                                    table, lens, acc, maxes, sums, scores, pairs);
          } else {
            attend_bf16_dot_impl<16>(tile, items[i].split, s, bf16_queries, static_cast<float>(scale), k_data, v_data,
                                     table, lens, acc, maxes, sums, scores, pairs);
          }
        }
        return;
      }
    }
#endif
    // A group's K rows, then a split's V rows.
    std::vector<float> rows(kSplitTokens * s.token_stride());
#if defined(__AVX2__) && defined(__FMA__)
    std::unique_ptr<TiledScratch> tiled;
#endif
    for (int64_t i = next_item.fetch_add(1); i < num_items; i = next_item.fetch_add(1)) {
      const Tile& tile = tiles[items[i].tile];
#if defined(__AVX2__) && defined(__FMA__)
      if (items[i].kv_head >= 0) {
        if (!tiled) tiled = std::make_unique<TiledScratch>(s.group, s.head_dim);
        attend_tiled<T>(tile, items[i].split, items[i].kv_head, s, queries, k_data, v_data, table, lens, acc, maxes,
                        sums, *tiled);
        continue;
      }
#endif
      attend<T>(tile, items[i].split, s, queries, k_data, v_data, table, lens, acc, maxes, sums,
                scores, rows);
    }
  });

  // Merge each row's splits in order.
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, batch, 1, [&](int64_t first, int64_t last) {
    std::vector<float> merged(s.head_dim);
    for (int64_t row = first; row < last; ++row) {
      const int64_t splits = (lens[row] + kSplitTokens - 1) / kSplitTokens;
      const int64_t first_split = s.first_key(lens[row]) / kSplitTokens;
      for (int64_t h = 0; h < s.num_heads; ++h) {
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t p = first_split; p < splits; ++p) {
          max_score = std::max(max_score, maxes[(row * s.num_splits + p) * s.num_heads + h]);
        }
        std::fill(merged.begin(), merged.end(), 0.f);
        float total = 0.f;
        for (int64_t p = first_split; p < splits; ++p) {
          const int64_t slot = row * s.num_splits + p;
          const float weight = std::exp(maxes[slot * s.num_heads + h] - max_score);
          total += weight * sums[slot * s.num_heads + h];
          const float* part = acc + slot * heads_dim + h * s.head_dim;
          for (int64_t d = 0; d < s.head_dim; ++d) merged[d] += weight * part[d];
        }
        T* destination = out_data + (row * s.num_heads + h) * s.head_dim;
        for (int64_t d = 0; d < s.head_dim; ++d) destination[d] = static_cast<T>(merged[d] / total);
      }
    }
  });
}

}  // namespace

// q: [batch, heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim],
// same dtype as q; block_table: [batch, max_blocks] int64; seq_lens: [batch] int64 keys per
// row (a request's cached tokens and this step's, up to the row's own position). Returns
// [batch, heads, head_dim]. window > 0: each row attends its last `window` keys only (a
// sliding-window layer's), in the same fixed order.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [batch, heads, dim], the cache [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the KV cache must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the KV cache differ in head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_table and seq_lens must be int64");
  TORCH_CHECK(block_table.size(0) == q.size(0) && seq_lens.size(0) == q.size(0), "one row per request");
  TORCH_CHECK(window >= 0, "window must be 0 (every key) or a number of keys");
  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  // Checked on the raw values: tensor reductions here would be a few operator calls per
  // layer, per step.
  const int64_t* len_data = lens.data_ptr<int64_t>();
  const int64_t capacity = table.size(1) * k_cache.size(1);
  for (int64_t b = 0; b < lens.numel(); ++b) {
    TORCH_CHECK(len_data[b] >= 1, "every request attends at least one key");
    TORCH_CHECK(len_data[b] <= capacity, "a request's keys run past its block table");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  const at::Tensor queries = q.contiguous();
  switch (q.scalar_type()) {
    case at::kFloat:
      paged_attention<float>(out, queries, k_cache, v_cache, table, lens, scale, window);
      break;
    case at::kBFloat16:
      paged_attention<at::BFloat16>(out, queries, k_cache, v_cache, table, lens, scale, window);
      break;
    case at::kHalf:
      paged_attention<at::Half>(out, queries, k_cache, v_cache, table, lens, scale, window);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
  return out;
}

// Whether a bf16 cache of this head_dim takes the AVX512-BF16 dot-product path in this build.
bool bf16_dot_products(int64_t head_dim) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return bf16_dot_path_fits(head_dim);
#else
  (void)head_dim;
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Attention over a paged KV cache, read in place: decodes, and prompt tokens one query each",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0);
  m.def("bf16_dot_products", &bf16_dot_products,
        "Whether a bf16 cache of this head_dim takes the AVX512-BF16 dot-product path in this build");
  m.def("fp32_prompt_tiles", &register_tiles_fit,
        "Whether an fp32 cache of this head_dim takes register tiles for prompt tiles in this build");
}
