// Prompt chunks' attention over the paged KV cache in fp32, on AVX-512 or AVX2, and in bf16 on AMX
// (below, `CACHET_PROMPT_AMX`): the prefill groups of steps that are not batch-invariant
// (attention.py), which otherwise gather their keys into a dense copy and run SDPA with a mask.
//
// Flash attention's shape. A work item is one request's KV head and up to kPositions of its
// prompt positions, with every query head that reads that KV head (rows = positions x group
// size, so each key read serves them all). It walks the keys its last position may see in
// chunks of kKeyChunk, keeping a running maximum, sum and weighted sum of values per row (the
// online softmax). A chunk's keys are first copied out of their blocks transposed (eight keys at
// a time, through registers), 32 keys x head_dim a block, so scores come from register tiles of
// 12 rows x 32 keys: two loads and 12 broadcasts feed 24 fused multiply-adds (AVX2: 6 rows x 16
// keys, 12 sums in its 16 registers). The weighted sum of values reads V rows in place, a tile of
// 6 rows x 64 dims held in registers across the chunk's keys (AVX2: 3 rows x 32). Causality costs
// only the chunk on the diagonal, whose keys past a row's position are given no weight.
//
// Items are taken heaviest first from a shared counter: a causal prompt's later positions see
// more keys, and a contiguous split of the items can leave one of two threads with far more.
//
// Against the layer's reference path (gather, then SDPA with the causal mask or `is_causal`),
// SmolLM2-135M's 9 query heads on 3 KV heads of 64, a 512-token chunk, 2 threads of a Zen 4
// EPYC (`python -m bench --only prompt_kernel`): 1.9 against 4.6 ms with nothing cached, 8.7 /
// 21.9 / 49.9 against 13.9 / 32.9 / 72.6 ms after 1,024 / 3,000 / 7,000 cached tokens (about 75%
// of the cores' fp32 peak at 3,000). The default model's cold TTFT in fp32, non-invariant steps:
// 2.66 / 7.53 / 21.40 s against 3.12 / 9.76 / 27.43 at 1,800 / 3,800 / 7,500 tokens. The AVX2
// build on the same CPU (16 positions an item then): 0.45 / 0.72 / 0.78 / 0.86x of the
// reference's time for the four chunks.
//
// A sum here is ordered by the chunk's shape, as SDPA's is: batch-invariant steps keep the paged
// decode kernel, whose sums are fixed per token. Built without AVX2 (and FMA), `supported` says
// no and the engine keeps SDPA.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define CACHET_PROMPT_TILES 1
#include <immintrin.h>

#include "row_count.h"
#endif
#if defined(__AVX512F__)
#include "avx512_exp.h"
#elif defined(CACHET_PROMPT_TILES)
#include "avx2_exp.h"
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define CACHET_PROMPT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#endif

namespace {

// Prompt positions per work item. Each item copies its keys out transposed, so more rows share
// that copy: 32 took 0.91-0.94x the time of 16 (a 512-token chunk after 0-7,000 cached tokens, 2
// threads of a Zen 4), 64 another 0.96-0.99x, at half the items to share between threads.
constexpr int64_t kPositions = 32;
constexpr int64_t kKeyChunk = 512;  // keys per online-softmax update
constexpr int64_t kMaxGroup = 16;   // query heads per KV head

#if defined(__AVX512F__)
// One register of fp32 lanes, and the few operations the tiles need of it.
struct Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* from) { return _mm512_loadu_ps(from); }
  static void store(float* to, V v) { _mm512_storeu_ps(to, v); }
  static V broadcast(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V exp(V x) { return exp16(x); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  // v's first n lanes (all of them for n >= kWidth), `fill` in the others.
  static V first(V v, int64_t n, V fill) {
    const auto kept = n >= kWidth ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1);
    return _mm512_mask_mov_ps(fill, kept, v);
  }
};
// Score tiles of 12 rows x 32 keys (24 sums); value tiles of 6 rows x 64 dims (24 sums).
constexpr int kScoreRows = 12;
constexpr int kValueRows = 6;
#elif defined(CACHET_PROMPT_TILES)
struct Lanes {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* from) { return _mm256_loadu_ps(from); }
  static void store(float* to, V v) { _mm256_storeu_ps(to, v); }
  static V broadcast(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V x) { return exp8(x); }
  static float reduce_max(V v) {
    __m128 low = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    low = _mm_max_ps(low, _mm_movehl_ps(low, low));
    return _mm_cvtss_f32(_mm_max_ss(low, _mm_movehdup_ps(low)));
  }
  static float reduce_add(V v) {
    __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    low = _mm_add_ps(low, _mm_movehl_ps(low, low));
    return _mm_cvtss_f32(_mm_add_ss(low, _mm_movehdup_ps(low)));
  }
  static V first(V v, int64_t n, V fill) {
    const V lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_blendv_ps(fill, v, _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ));
  }
};
// Score tiles of 6 rows x 16 keys (12 sums of 16 registers); value tiles of 3 rows x 32 dims.
constexpr int kScoreRows = 6;
constexpr int kValueRows = 3;
#endif

#if defined(CACHET_PROMPT_TILES)
constexpr int64_t kKeyBlock = 2 * Lanes::kWidth;  // keys per score tile: two registers
constexpr int kValueSlice = 4;                   // registers of dims per row of a value tile
#endif

bool supported_shape(int64_t head_dim, int64_t group) {
#if defined(CACHET_PROMPT_TILES)
  return (head_dim == 64 || head_dim == 128) && group >= 1 && group <= kMaxGroup;
#else
  (void)head_dim, (void)group;
  return false;
#endif
}

#if defined(CACHET_PROMPT_TILES)
using V = Lanes::V;

// s[r, 0:kKeyBlock] = q[r, :] . keys for r < Rows; `keys` is one block [head_dim][kKeyBlock].
template <int Rows>
inline void score_tile(const float* q, int64_t head_dim, const float* keys, float* s, int64_t s_stride) {
  V low[Rows], high[Rows];
#pragma GCC unroll 12
  for (int r = 0; r < Rows; ++r) low[r] = high[r] = Lanes::zero();
  for (int64_t d = 0; d < head_dim; ++d) {
    const V k0 = Lanes::load(keys + d * kKeyBlock);
    const V k1 = Lanes::load(keys + d * kKeyBlock + Lanes::kWidth);
#pragma GCC unroll 12
    for (int r = 0; r < Rows; ++r) {
      const V qb = Lanes::broadcast(q[r * head_dim + d]);
      low[r] = Lanes::fmadd(qb, k0, low[r]);
      high[r] = Lanes::fmadd(qb, k1, high[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < Rows; ++r) {
    Lanes::store(s + r * s_stride, low[r]);
    Lanes::store(s + r * s_stride + Lanes::kWidth, high[r]);
  }
}

// o[r, d0:d0 + slice] += sum over keys j of p[r, j] * values[j][d0:d0 + slice] for r < Rows, where
// a slice is kValueSlice registers and o's rows are head_dim apart.
template <int Rows>
inline void value_tile(const float* p, int64_t p_stride, const float* const* values, int64_t num_keys, float* o,
                       int64_t head_dim, int64_t d0) {
  V acc[Rows][kValueSlice];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int w = 0; w < kValueSlice; ++w) acc[r][w] = Lanes::load(o + r * head_dim + d0 + w * Lanes::kWidth);
  for (int64_t j = 0; j < num_keys; ++j) {
    V weight[Rows];
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) weight[r] = Lanes::broadcast(p[r * p_stride + j]);
    const float* value = values[j] + d0;
#pragma GCC unroll 8
    for (int w = 0; w < kValueSlice; ++w) {
      const V v = Lanes::load(value + w * Lanes::kWidth);
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) acc[r][w] = Lanes::fmadd(weight[r], v, acc[r][w]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int w = 0; w < kValueSlice; ++w) Lanes::store(o + r * head_dim + d0 + w * Lanes::kWidth, acc[r][w]);
}

// One row's scores of a chunk (its first `visible` keys count) become weights against the new
// running maximum; returns the factor its earlier sums are rescaled by. Weights past `visible`
// (up to `width`) are zero. The row's buffer holds whole registers past `width`.
inline float softmax_update(float* s, int64_t visible, int64_t width, float& running_max, float& running_sum) {
  const V minus_inf = Lanes::broadcast(-std::numeric_limits<float>::infinity());
  V maxima = minus_inf;
  // Only the register that holds the last visible key needs a mask, so whole registers run in a
  // loop of their own (a mask on every register was a third of the softmax's time; one loop
  // with a branch per register instead took 1.05-1.11x this one's time).
  const int64_t whole = visible / Lanes::kWidth * Lanes::kWidth;
  for (int64_t j = 0; j < whole; j += Lanes::kWidth) maxima = Lanes::max(maxima, Lanes::load(s + j));
  if (whole < visible) {
    maxima = Lanes::max(maxima, Lanes::first(Lanes::load(s + whole), visible - whole, minus_inf));
  }
  const float new_max = std::max(running_max, Lanes::reduce_max(maxima));
  const float rescale = running_max == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(running_max - new_max);
  const V shift = Lanes::broadcast(new_max);
  V sums = Lanes::zero();
  int64_t j = 0;
  for (; j < whole; j += Lanes::kWidth) {
    const V weights = Lanes::exp(Lanes::sub(Lanes::load(s + j), shift));
    Lanes::store(s + j, weights);
    sums = Lanes::add(sums, weights);
  }
  for (; j < width; j += Lanes::kWidth) {
    const V weights = Lanes::first(Lanes::exp(Lanes::sub(Lanes::load(s + j), shift)), visible - j, Lanes::zero());
    Lanes::store(s + j, weights);
    sums = Lanes::add(sums, weights);
  }
  running_sum = running_sum * rescale + Lanes::reduce_add(sums);
  running_max = new_max;
  return rescale;
}

// Eight keys' rows into a score block's transposed layout: to[d * kKeyBlock + i] = rows[i][d], eight
// dims at a time through registers (an 8 x 8 transpose of fp32 lanes), not one scalar at a time.
template <int HeadDim>
inline void transpose_keys(const float* const* rows, float* to) {
  for (int64_t d0 = 0; d0 < HeadDim; d0 += 8) {
    __m256 r[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + d0);
    // Interleave pairs, then quads, then swap 128-bit halves: lane i of t[d] is rows[i][d0 + d].
    const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
    const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
    const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
    const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
    const __m256 t[8] = {
        _mm256_permute2f128_ps(b0, b4, 0x20), _mm256_permute2f128_ps(b1, b5, 0x20),
        _mm256_permute2f128_ps(b2, b6, 0x20), _mm256_permute2f128_ps(b3, b7, 0x20),
        _mm256_permute2f128_ps(b0, b4, 0x31), _mm256_permute2f128_ps(b1, b5, 0x31),
        _mm256_permute2f128_ps(b2, b6, 0x31), _mm256_permute2f128_ps(b3, b7, 0x31),
    };
#pragma GCC unroll 8
    for (int d = 0; d < 8; ++d) _mm256_storeu_ps(to + (d0 + d) * kKeyBlock, t[d]);
  }
}

struct WorkItem {
  int64_t request, kv_head, first_position, positions;
  int64_t cost;  // keys seen x rows, to take the heaviest first
};

// What every item of one call reads.
struct PromptCall {
  const float* q;
  float* out;
  const float* k_cache;
  const float* v_cache;
  const int64_t* block_table;
  int64_t table_stride, block_size, num_heads, num_kv_heads;
  const int64_t* seq_lens;
  const int64_t* query_lens;
  const int64_t* token_bases;  // each request's first row of q
  float scale;
};

// One thread's buffers, sized for an item of up to `max_rows` rows.
template <int HeadDim>
struct Scratch {
  explicit Scratch(int64_t max_rows)
      : queries(max_rows * HeadDim), scores(max_rows * kKeyChunk), keys(kKeyChunk * HeadDim),
        sums(max_rows * HeadDim), running_max(max_rows), running_sum(max_rows), value_rows(kKeyChunk) {}
  std::vector<float> queries, scores, keys, sums, running_max, running_sum;
  std::vector<const float*> value_rows;
};

template <int HeadDim>
void attend_item(const WorkItem& item, const PromptCall& call, Scratch<HeadDim>& scratch) {
  const int64_t group = call.num_heads / call.num_kv_heads;
  const int64_t rows = item.positions * group;
  const int64_t token_stride = call.num_kv_heads * HeadDim;  // a token's K (or V) row in the cache
  const int64_t* table = call.block_table + item.request * call.table_stride;
  const int64_t first_token = call.token_bases[item.request] + item.first_position;
  float* queries = scratch.queries.data();
  float* scores = scratch.scores.data();
  float* keys = scratch.keys.data();
  float* sums = scratch.sums.data();
  float* running_max = scratch.running_max.data();
  float* running_sum = scratch.running_sum.data();
  // Row r is query head kv_head * group + r % group at prompt position first_position + r / group,
  // so a position's rows are one contiguous slice of q.
  const int64_t first_absolute = call.seq_lens[item.request] - call.query_lens[item.request] + item.first_position;
  for (int64_t p = 0; p < item.positions; ++p) {
    const float* from = call.q + ((first_token + p) * call.num_heads + item.kv_head * group) * HeadDim;
    for (int64_t i = 0; i < group * HeadDim; ++i) queries[p * group * HeadDim + i] = from[i] * call.scale;
  }
  std::fill(sums, sums + rows * HeadDim, 0.f);
  std::fill(running_max, running_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(running_sum, running_sum + rows, 0.f);
  const int64_t last_key = first_absolute + item.positions - 1;  // the last row sees keys 0..this
  for (int64_t chunk = 0; chunk <= last_key; chunk += kKeyChunk) {
    const int64_t chunk_len = std::min(kKeyChunk, last_key + 1 - chunk);
    const int64_t key_blocks = (chunk_len + kKeyBlock - 1) / kKeyBlock;
    const float* key_rows[kKeyChunk];
    for (int64_t j = 0; j < chunk_len; ++j) {
      const int64_t position = chunk + j;
      const int64_t slot = table[position / call.block_size] * call.block_size + position % call.block_size;
      key_rows[j] = call.k_cache + slot * token_stride + item.kv_head * HeadDim;
      scratch.value_rows[j] = call.v_cache + slot * token_stride + item.kv_head * HeadDim;
    }
    const int64_t whole_eights = chunk_len / 8 * 8;
    for (int64_t j = 0; j < whole_eights; j += 8) {
      transpose_keys<HeadDim>(key_rows + j, keys + (j / kKeyBlock) * HeadDim * kKeyBlock + j % kKeyBlock);
    }
    for (int64_t j = whole_eights; j < key_blocks * kKeyBlock; ++j) {
      float* to = keys + (j / kKeyBlock) * HeadDim * kKeyBlock + j % kKeyBlock;
      for (int64_t d = 0; d < HeadDim; ++d) to[d * kKeyBlock] = j < chunk_len ? key_rows[j][d] : 0.f;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
      for_row_count<kScoreRows>(std::min<int64_t>(kScoreRows, rows - r0), [&]<int Rows>() {
        for (int64_t b = 0; b < key_blocks; ++b) {
          score_tile<Rows>(queries + r0 * HeadDim, HeadDim, keys + b * HeadDim * kKeyBlock,
                           scores + r0 * kKeyChunk + b * kKeyBlock, kKeyChunk);
        }
      });
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::clamp<int64_t>(first_absolute + r / group + 1 - chunk, 0, chunk_len);
      float* row_scores = scores + r * kKeyChunk;
      if (visible == 0) {
        std::fill(row_scores, row_scores + chunk_len, 0.f);
        continue;
      }
      const float rescale = softmax_update(row_scores, visible, chunk_len, running_max[r], running_sum[r]);
      if (rescale != 1.f) {
        for (int64_t d = 0; d < HeadDim; ++d) sums[r * HeadDim + d] *= rescale;
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += kValueRows) {
      for_row_count<kValueRows>(std::min<int64_t>(kValueRows, rows - r0), [&]<int Rows>() {
        for (int64_t d0 = 0; d0 < HeadDim; d0 += kValueSlice * Lanes::kWidth) {
          value_tile<Rows>(scores + r0 * kKeyChunk, kKeyChunk, scratch.value_rows.data(), chunk_len,
                           sums + r0 * HeadDim, HeadDim, d0);
        }
      });
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.f / running_sum[r];
    float* to = call.out + ((first_token + r / group) * call.num_heads + item.kv_head * group + r % group) * HeadDim;
    for (int64_t d = 0; d < HeadDim; ++d) to[d] = sums[r * HeadDim + d] * inverse;
  }
}

template <int HeadDim>
void attend_all(const PromptCall& call, int64_t num_requests) {
  const int64_t group = call.num_heads / call.num_kv_heads;
  std::vector<WorkItem> items;
  for (int64_t request = 0; request < num_requests; ++request) {
    const int64_t queries = call.query_lens[request];
    for (int64_t first = 0; first < queries; first += kPositions) {
      const int64_t positions = std::min(kPositions, queries - first);
      const int64_t keys_seen = call.seq_lens[request] - queries + first + positions;
      for (int64_t head = 0; head < call.num_kv_heads; ++head) {
        items.push_back({request, head, first, positions, keys_seen * positions});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch<HeadDim> scratch(kPositions * group);
    for (int64_t index = next.fetch_add(1); index < static_cast<int64_t>(items.size()); index = next.fetch_add(1)) {
      attend_item<HeadDim>(items[index], call, scratch);
    }
  });
}

#endif  // CACHET_PROMPT_TILES

#if defined(CACHET_PROMPT_AMX)
// bf16 prompt chunks on AMX: the same items and online softmax as the fp32 tiles above, with both
// products on the tile unit. Every tile is 16 rows x 64 bytes: 16 rows of 32 bf16 (a product's
// left side), 16 pairs of rows of 16 bf16 interleaved (its right side, "VNNI"), or 16 rows of 16
// fp32 sums. Scores are 16 rows x 16 keys per tile, eight tiles for a chunk of kAmxKeys keys; the
// weighted sums of values accumulate onto the rows' fp32 sums, loaded as tiles of 16 rows x 16
// dims and stored back once per chunk. Keys and values are laid out for the right side once per
// call and request KV head (`pack_request`), not once per item: every item of a request reads
// its early chunks. Scores and weights stay fp32 (scaled and exponentiated with AVX-512); the
// weights are rounded to bf16 only as the second product's input, as flash attention does on GPUs.
// Against gather + SDPA, a 512-token chunk of the default model's heads after 0 / 1,024 / 3,000 /
// 7,000 cached tokens: 0.53 / 0.67 / 0.65 / 0.66x the time (a Sapphire Rapids-class Xeon, 2
// threads; `python -m bench --only prompt_kernel`); half of it is the softmax.

// Keys per online-softmax update: eight score tiles, in two groups of four (the tile registers
// hold four tiles of sums beside a query tile and two key tiles). A row's update costs a
// reduction and a rescale of its sums whatever its keys, so fewer, longer chunks: against 64
// keys a 512-token chunk after 0 / 1,288 / 3,000 cached tokens took 0.95 / 0.92 / 0.87x the time.
constexpr int64_t kAmxKeys = 128;
constexpr int64_t kAmxPositions = 32; // prompt positions per item (rows = positions x group)

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process the tile registers' state only when asked (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); oneDNN asks too, and asking twice is harmless.
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

// This thread's tiles, all 16 x 64 bytes. Set at the start of each thread's share of a call
// and released after it: oneDNN's products configure the same threads' tiles for their own shapes.
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

struct PackedKV {
  // Per request KV head, chunks of kAmxKeys keys; both in uint32 (a pair of bf16) units.
  // keys[chunk][tile n of 16 keys][dim pair i][key j]: tile (k-slice kk, n) is 16 dim pairs from 16 kk.
  // values[chunk][half kk of 32 keys][tile n of 16 dims][key pair i][dim j].
  std::vector<uint32_t> keys, values;
  std::vector<int64_t> offsets;  // request * kv_heads + head -> first uint32 of its chunks
};

// What every item of one bf16 call reads.
struct AmxCall {
  const uint16_t* q;
  uint16_t* out;
  const PackedKV* packed;
  int64_t num_heads, num_kv_heads;
  const int64_t* seq_lens;
  const int64_t* query_lens;
  const int64_t* token_bases;
  float scale;
};

inline int64_t amx_chunks(int64_t keys) { return (keys + kAmxKeys - 1) / kAmxKeys; }

// One request KV head's keys and values, read from their blocks, into the tiles' right-side layouts.
template <int HeadDim>
void pack_request(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table, int64_t block_size,
                  int64_t num_kv_heads, int64_t head, int64_t keys, uint32_t* packed_keys, uint32_t* packed_values) {
  constexpr int64_t kPairs = HeadDim / 2;
  const int64_t token_stride = num_kv_heads * HeadDim;
  // Keys past the last (to a whole chunk) stay as the buffers were made: zero.
  for (int64_t key = 0; key < keys; ++key) {
    const int64_t chunk = key / kAmxKeys, within = key % kAmxKeys;
    uint32_t* to_keys = packed_keys + chunk * kAmxKeys * kPairs + (within / 16) * kPairs * 16 + within % 16;
    const int64_t half = within / 32, pair = (within % 32) / 2, odd = within % 2;
    uint16_t* to_values = reinterpret_cast<uint16_t*>(packed_values + chunk * kAmxKeys * kPairs + half * 32 * kPairs) +
                          pair * 32 + odd;
    const int64_t slot = table[key / block_size] * block_size + key % block_size;
    const uint32_t* k_row = reinterpret_cast<const uint32_t*>(k_cache + slot * token_stride + head * HeadDim);
    const uint16_t* v_row = v_cache + slot * token_stride + head * HeadDim;
    for (int64_t i = 0; i < kPairs; ++i) to_keys[i * 16] = k_row[i];
    for (int64_t d = 0; d < HeadDim; ++d) to_values[(d / 16) * 16 * 32 + (d % 16) * 2] = v_row[d];
  }
}

// One thread's buffers for an item of up to `max_rows` rows (rounded up to whole tiles).
template <int HeadDim>
struct AmxScratch {
  explicit AmxScratch(int64_t max_rows)
      : queries(max_rows * HeadDim), scores(max_rows * kAmxKeys), weights(max_rows * kAmxKeys),
        sums(max_rows * HeadDim), running_max(max_rows), running_sum(max_rows) {}
  std::vector<uint16_t> queries, weights;
  std::vector<float> scores, sums, running_max, running_sum;
};

template <int HeadDim>
void amx_attend_item(const WorkItem& item, const AmxCall& call, AmxScratch<HeadDim>& scratch) {
  constexpr int64_t kPairs = HeadDim / 2;
  const int64_t group = call.num_heads / call.num_kv_heads;
  const int64_t rows = item.positions * group;
  const int64_t row_tiles = (rows + 15) / 16;
  const int64_t first_token = call.token_bases[item.request] + item.first_position;
  const int64_t first_absolute = call.seq_lens[item.request] - call.query_lens[item.request] + item.first_position;
  const int64_t offset = call.packed->offsets[item.request * call.num_kv_heads + item.kv_head];
  const uint32_t* keys = call.packed->keys.data() + offset;
  const uint32_t* values = call.packed->values.data() + offset;
  uint16_t* queries = scratch.queries.data();
  uint16_t* weights = scratch.weights.data();
  float* scores = scratch.scores.data();
  float* sums = scratch.sums.data();
  float* running_max = scratch.running_max.data();
  float* running_sum = scratch.running_sum.data();
  // Row r is query head kv_head * group + r % group at position first_position + r / group; rows
  // past the item's are zero queries whose results are dropped.
  for (int64_t p = 0; p < item.positions; ++p) {
    const uint16_t* from = call.q + ((first_token + p) * call.num_heads + item.kv_head * group) * HeadDim;
    std::memcpy(queries + p * group * HeadDim, from, group * HeadDim * sizeof(uint16_t));
  }
  std::fill(queries + rows * HeadDim, queries + row_tiles * 16 * HeadDim, uint16_t{0});
  std::fill(weights, weights + row_tiles * 16 * kAmxKeys, uint16_t{0});
  std::fill(sums, sums + row_tiles * 16 * HeadDim, 0.f);
  std::fill(running_max, running_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(running_sum, running_sum + rows, 0.f);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(call.scale);
  const int64_t last_key = first_absolute + item.positions - 1;
  for (int64_t chunk = 0; chunk * kAmxKeys <= last_key; ++chunk) {
    const uint32_t* chunk_keys = keys + chunk * kAmxKeys * kPairs;
    const uint32_t* chunk_values = values + chunk * kAmxKeys * kPairs;
    for (int64_t m = 0; m < row_tiles; ++m) {
      for (int64_t n0 = 0; n0 < kAmxKeys / 16; n0 += 4) {  // four tiles of 16 keys at a time
        const uint32_t* group_keys = chunk_keys + n0 * kPairs * 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kk = 0; kk < HeadDim / 32; ++kk) {
          _tile_loadd(4, queries + m * 16 * HeadDim + kk * 32, HeadDim * 2);
          _tile_loadd(5, group_keys + 0 * kPairs * 16 + kk * 256, 64);
          _tile_loadd(6, group_keys + 1 * kPairs * 16 + kk * 256, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, group_keys + 2 * kPairs * 16 + kk * 256, 64);
          _tile_loadd(6, group_keys + 3 * kPairs * 16 + kk * 256, 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_dpbf16ps(3, 4, 6);
        }
        float* tile_scores = scores + m * 16 * kAmxKeys + n0 * 16;
        _tile_stored(0, tile_scores, kAmxKeys * 4);
        _tile_stored(1, tile_scores + 16, kAmxKeys * 4);
        _tile_stored(2, tile_scores + 32, kAmxKeys * 4);
        _tile_stored(3, tile_scores + 48, kAmxKeys * 4);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::clamp<int64_t>(first_absolute + r / group + 1 - chunk * kAmxKeys, 0, kAmxKeys);
      uint16_t* row_weights = weights + r * kAmxKeys;
      if (visible == 0) {
        std::fill(row_weights, row_weights + kAmxKeys, uint16_t{0});
        continue;
      }
      const float* row_scores = scores + r * kAmxKeys;
      __m512 lanes[kAmxKeys / 16];
      __m512 maxima = minus_inf;
      for (int w = 0; w < kAmxKeys / 16; ++w) {
        const int64_t seen = std::clamp<int64_t>(visible - w * 16, 0, 16);
        const __mmask16 kept = static_cast<__mmask16>((1u << seen) - 1);
        lanes[w] = _mm512_mask_mul_ps(minus_inf, kept, _mm512_loadu_ps(row_scores + w * 16), scale);
        maxima = _mm512_max_ps(maxima, lanes[w]);
      }
      const float new_max = std::max(running_max[r], _mm512_reduce_max_ps(maxima));
      const float rescale = running_max[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(running_max[r] - new_max);
      const __m512 shift = _mm512_set1_ps(new_max);
      __m512 total = _mm512_setzero_ps();
      for (int w = 0; w < kAmxKeys / 16; ++w) {
        const int64_t seen = std::clamp<int64_t>(visible - w * 16, 0, 16);
        const __mmask16 kept = static_cast<__mmask16>((1u << seen) - 1);
        const __m512 weight = _mm512_maskz_mov_ps(kept, exp16(_mm512_sub_ps(lanes[w], shift)));
        total = _mm512_add_ps(total, weight);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_weights + w * 16), (__m256i)_mm512_cvtneps_pbh(weight));
      }
      running_sum[r] = running_sum[r] * rescale + _mm512_reduce_add_ps(total);
      running_max[r] = new_max;
      if (rescale != 1.f) {
        const __m512 factor = _mm512_set1_ps(rescale);
        for (int64_t d = 0; d < HeadDim; d += 16) {
          _mm512_storeu_ps(sums + r * HeadDim + d, _mm512_mul_ps(factor, _mm512_loadu_ps(sums + r * HeadDim + d)));
        }
      }
    }
    for (int64_t m = 0; m < row_tiles; ++m) {
      for (int64_t n0 = 0; n0 < HeadDim / 16; n0 += 4) {
        float* tile_sums = sums + m * 16 * HeadDim + n0 * 16;
        _tile_loadd(0, tile_sums, HeadDim * 4);
        _tile_loadd(1, tile_sums + 16, HeadDim * 4);
        _tile_loadd(2, tile_sums + 32, HeadDim * 4);
        _tile_loadd(3, tile_sums + 48, HeadDim * 4);
        for (int64_t kk = 0; kk < kAmxKeys / 32; ++kk) {
          const uint32_t* half_values = chunk_values + kk * 32 * kPairs + n0 * 256;
          _tile_loadd(4, weights + m * 16 * kAmxKeys + kk * 32, kAmxKeys * 2);
          _tile_loadd(5, half_values, 64);
          _tile_loadd(6, half_values + 256, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, half_values + 512, 64);
          _tile_loadd(6, half_values + 768, 64);
          _tile_dpbf16ps(2, 4, 5);
          _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, tile_sums, HeadDim * 4);
        _tile_stored(1, tile_sums + 16, HeadDim * 4);
        _tile_stored(2, tile_sums + 32, HeadDim * 4);
        _tile_stored(3, tile_sums + 48, HeadDim * 4);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.f / running_sum[r]);
    uint16_t* to = call.out + ((first_token + r / group) * call.num_heads + item.kv_head * group + r % group) * HeadDim;
    for (int64_t d = 0; d < HeadDim; d += 16) {
      const __m512 row = _mm512_mul_ps(_mm512_loadu_ps(sums + r * HeadDim + d), inverse);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + d), (__m256i)_mm512_cvtneps_pbh(row));
    }
  }
}

template <int HeadDim>
void amx_attend_all(const uint16_t* q, uint16_t* out, const uint16_t* k_cache, const uint16_t* v_cache,
                    const int64_t* block_table, int64_t table_stride, int64_t block_size, int64_t num_heads,
                    int64_t num_kv_heads, const std::vector<int64_t>& seq_lens, const std::vector<int64_t>& query_lens,
                    const std::vector<int64_t>& token_bases, float scale) {
  const int64_t requests = static_cast<int64_t>(seq_lens.size());
  const int64_t group = num_heads / num_kv_heads;
  PackedKV packed;
  packed.offsets.resize(requests * num_kv_heads);
  int64_t total = 0;
  for (int64_t request = 0; request < requests; ++request) {
    for (int64_t head = 0; head < num_kv_heads; ++head) {
      packed.offsets[request * num_kv_heads + head] = total;
      total += amx_chunks(seq_lens[request]) * kAmxKeys * HeadDim / 2;
    }
  }
  packed.keys.resize(total);  // zeros: a request's last chunk is padded with zero keys and values
  packed.values.resize(total);
  at::parallel_for(0, requests * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t request = unit / num_kv_heads, head = unit % num_kv_heads;
      const int64_t offset = packed.offsets[unit];
      pack_request<HeadDim>(k_cache, v_cache, block_table + request * table_stride, block_size, num_kv_heads, head,
                            seq_lens[request], packed.keys.data() + offset, packed.values.data() + offset);
    }
  });
  std::vector<WorkItem> items;
  for (int64_t request = 0; request < requests; ++request) {
    const int64_t queries = query_lens[request];
    for (int64_t first = 0; first < queries; first += kAmxPositions) {
      const int64_t positions = std::min(kAmxPositions, queries - first);
      const int64_t keys_seen = seq_lens[request] - queries + first + positions;
      for (int64_t head = 0; head < num_kv_heads; ++head) {
        items.push_back({request, head, first, positions, keys_seen * positions});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  const AmxCall call{q, out, &packed, num_heads, num_kv_heads, seq_lens.data(), query_lens.data(), token_bases.data(), scale};
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    AmxScratch<HeadDim> scratch((kAmxPositions * group + 15) / 16 * 16);
    configure_tiles();
    for (int64_t index = next.fetch_add(1); index < static_cast<int64_t>(items.size()); index = next.fetch_add(1)) {
      amx_attend_item<HeadDim>(items[index], call, scratch);
    }
    _tile_release();
  });
}
#endif  // CACHET_PROMPT_AMX

bool supported(int64_t head_dim, int64_t group) { return supported_shape(head_dim, group); }

// Whether this build attends bf16 prompt chunks of this shape: on AMX, where the process may use it.
bool supported_bf16(int64_t head_dim, int64_t group) {
#if defined(CACHET_PROMPT_AMX)
  return supported_shape(head_dim, group) && amx_permitted();
#else
  (void)head_dim, (void)group;
  return false;
#endif
}

// q: [tokens, heads, head_dim] fp32, the requests' prompt tokens in request order (query_lens[i]
// of request i, the last ones of its seq_lens[i] keys); caches: [blocks, block_size, kv_heads,
// head_dim] fp32; block_table: [requests, blocks] int64. Returns [tokens, heads, head_dim]: each
// token attends its request's keys up to its own position.
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                                const torch::Tensor& query_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && k_cache.scalar_type() == dtype &&
                  v_cache.scalar_type() == dtype, "fp32 or bf16 queries and caches, of one dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && block_table.is_contiguous(),
              "contiguous tensors only");
  TORCH_CHECK(block_table.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong &&
                  query_lens.scalar_type() == torch::kLong, "int64 block table and lengths");
  const int64_t head_dim = q.size(2), num_heads = q.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "heads do not match the cache");
  TORCH_CHECK(dtype == torch::kFloat ? supported_shape(head_dim, num_heads / num_kv_heads)
                                     : supported_bf16(head_dim, num_heads / num_kv_heads),
              "shape not supported by this build");
  const int64_t requests = seq_lens.size(0);
  TORCH_CHECK(query_lens.size(0) == requests && block_table.size(0) == requests, "one length and row per request");
  std::vector<int64_t> seqs(seq_lens.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>() + requests);
  std::vector<int64_t> queries(query_lens.data_ptr<int64_t>(), query_lens.data_ptr<int64_t>() + requests);
  std::vector<int64_t> bases(requests);
  int64_t tokens = 0;
  for (int64_t i = 0; i < requests; ++i) {
    TORCH_CHECK(queries[i] >= 1 && queries[i] <= seqs[i], "a request's queries are among its keys");
    TORCH_CHECK((seqs[i] + k_cache.size(1) - 1) / k_cache.size(1) <= block_table.size(1), "block table too short");
    bases[i] = tokens;
    tokens += queries[i];
  }
  TORCH_CHECK(tokens == q.size(0), "query_lens must sum to q's tokens");
  auto out = torch::empty_like(q);
#if defined(CACHET_PROMPT_AMX)
  if (dtype == torch::kBFloat16) {
    const auto* q_bits = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
    auto* out_bits = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    const auto* k_bits = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
    const auto* v_bits = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
    if (head_dim == 64) {
      amx_attend_all<64>(q_bits, out_bits, k_bits, v_bits, block_table.data_ptr<int64_t>(), block_table.size(1),
                         k_cache.size(1), num_heads, num_kv_heads, seqs, queries, bases, static_cast<float>(scale));
    } else {
      amx_attend_all<128>(q_bits, out_bits, k_bits, v_bits, block_table.data_ptr<int64_t>(), block_table.size(1),
                          k_cache.size(1), num_heads, num_kv_heads, seqs, queries, bases, static_cast<float>(scale));
    }
    return out;
  }
#endif
#if defined(CACHET_PROMPT_TILES)
  const PromptCall call{q.data_ptr<float>(), out.data_ptr<float>(), k_cache.data_ptr<float>(),
                        v_cache.data_ptr<float>(), block_table.data_ptr<int64_t>(), block_table.size(1),
                        k_cache.size(1), num_heads, num_kv_heads, seqs.data(), queries.data(), bases.data(),
                        static_cast<float>(scale)};
  if (head_dim == 64) {
    attend_all<64>(call, requests);
  } else {
    attend_all<128>(call, requests);
  }
#endif
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention, "Causal fp32 attention of prompt chunks over the paged KV cache");
  m.def("supported", &supported, "Whether this build attends fp32 chunks of this head_dim and query heads per KV head");
  m.def("supported_bf16", &supported_bf16, "Whether this build attends bf16 chunks of this shape (AMX)");
}
