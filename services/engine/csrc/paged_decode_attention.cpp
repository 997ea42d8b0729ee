// Decode attention that reads the paged KV cache in place, on the CPU.
//
// The reference path gathers every request's blocks into a dense copy and runs SDPA over
// it: at long contexts the copy costs as much as the attention (40% of a 7,500-token decode
// step, the same again for SDPA). Here each query reads K and V straight from its blocks,
// once. Work is cut into (request, split of kSplitTokens keys) items: enough items to keep
// every thread busy at one stream, and a split's size never depends on the batch, so a
// request's result is the same whatever else is decoding beside it.
//
// An item reads each token's K (then V) row whole, every KV head side by side, so its reads
// run sequentially through a block. Items per (request, KV head) that read only their head's
// slice of each row were 3-4x slower (1 x 7,500 keys, fp32: 6.3 ms against 1.4): memory
// stalls, not arithmetic.
//
// The hot loops are AVX2 where the build targets it (a scalar fallback elsewhere): a score's
// dot product on two accumulators and the softmax's exponentials eight at a time made the
// kernel 1.4-1.5x faster (one stream at 1,000-7,500 keys and 16 x 1,000, fp32 and bf16, two
// threads of a Xeon), over what the compiler made of the plain loops.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kSplitTokens = 256;

#if defined(__AVX2__) && defined(__FMA__)
// e^x for x <= 0 (a score minus its split's maximum), 8 at a time: the compiler leaves a loop
// of std::exp scalar. 2^n times a degree-6 polynomial of the remainder (|r| <= ln2 / 2):
// relative error about 2e-7, expf's order. Inputs below -87 give 2^-126 rather than 0,
// nothing beside a sum that holds e^0 = 1.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

inline float horizontal_sum(__m256 v) {
  __m128 low = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  low = _mm_add_ps(low, _mm_movehl_ps(low, low));
  low = _mm_add_ss(low, _mm_movehdup_ps(low));
  return _mm_cvtss_f32(low);
}

// Eight elements of a K or V row as fp32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift.
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// One query head's score against one key row. Two accumulators: a single one makes every
// multiply-add wait on the one before it.
template <typename T>
inline float dot(const float* query, const T* key, int64_t head_dim) {
  int64_t d = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  for (; d + 16 <= head_dim; d += 16) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(query + d), load8(key + d), even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(query + d + 8), load8(key + d + 8), odd);
  }
  total = horizontal_sum(_mm256_add_ps(even, odd));
#endif
  // The whole row on a build without AVX2 (vectorised as the compiler can, as before).
#pragma omp simd reduction(+ : total)
  for (int64_t e = d; e < head_dim; ++e) total += query[e] * static_cast<float>(key[e]);
  return total;
}

struct WorkItem {
  int64_t request;
  int64_t begin;
  int64_t end;
};

// One split of one request: every query head's scores against keys [begin, end), softmax
// within the split (max and sum kept for the merge), and the unnormalised weighted sum of
// values. A token's K (and V) row holds every KV head side by side: reading it whole keeps
// the reads sequential through each block.
template <typename T>
void attend_split(const WorkItem& item, const float* queries, const T* k_cache, const T* v_cache,
                  const int64_t* blocks, int64_t block_size, int64_t num_kv_heads, int64_t group,
                  int64_t head_dim, float* scores, float* acc, float* maxes, float* sums) {
  const int64_t length = item.end - item.begin;
  const int64_t num_heads = num_kv_heads * group;
  const int64_t token_stride = num_kv_heads * head_dim;
  for (int64_t position = item.begin; position < item.end;) {
    const int64_t offset = position % block_size;
    const int64_t run = std::min(block_size - offset, item.end - position);
    const T* key = k_cache + (blocks[position / block_size] * block_size + offset) * token_stride;
    for (int64_t t = position - item.begin; t < position - item.begin + run; ++t, key += token_stride) {
      for (int64_t h = 0; h < num_heads; ++h) {
        scores[h * length + t] = dot(queries + h * head_dim, key + (h / group) * head_dim, head_dim);
      }
    }
    position += run;
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    float* row = scores + h * length;
    float max_score = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max_score)
    for (int64_t t = 0; t < length; ++t) max_score = std::max(max_score, row[t]);
    float sum = 0.f;
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 max_vector = _mm256_set1_ps(max_score);
    __m256 sum_vector = _mm256_setzero_ps();
    for (; t + 8 <= length; t += 8) {
      const __m256 weights = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + t), max_vector));
      _mm256_storeu_ps(row + t, weights);
      sum_vector = _mm256_add_ps(sum_vector, weights);
    }
    sum = horizontal_sum(sum_vector);
#endif
    for (; t < length; ++t) {
      row[t] = std::exp(row[t] - max_score);
      sum += row[t];
    }
    maxes[h] = max_score;
    sums[h] = sum;
  }
  std::fill(acc, acc + num_heads * head_dim, 0.f);
  for (int64_t position = item.begin; position < item.end;) {
    const int64_t offset = position % block_size;
    const int64_t run = std::min(block_size - offset, item.end - position);
    const T* value = v_cache + (blocks[position / block_size] * block_size + offset) * token_stride;
    for (int64_t t = position - item.begin; t < position - item.begin + run; ++t, value += token_stride) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const float weight = scores[h * length + t];
        const T* value_head = value + (h / group) * head_dim;
        float* out = acc + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) out[d] += weight * static_cast<float>(value_head[d]);
      }
    }
    position += run;
  }
}

template <typename T>
void paged_decode(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                  const at::Tensor& v_cache, const at::Tensor& block_table,
                  const at::Tensor& seq_lens, double scale) {
  const int64_t batch = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_stride = block_table.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();

  // Queries in fp32, pre-scaled, so the inner loops are one multiply-add per element.
  const at::Tensor scaled = (q.to(at::kFloat) * scale).contiguous();
  const float* queries = scaled.data_ptr<float>();

  std::vector<WorkItem> items;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t begin = 0; begin < lens[b]; begin += kSplitTokens) {
      items.push_back({b, begin, std::min(begin + kSplitTokens, lens[b])});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::vector<float> acc(num_items * num_heads * head_dim);
  std::vector<float> maxes(num_items * num_heads);
  std::vector<float> sums(num_items * num_heads);
  const T* k_data = k_cache.data_ptr<T>();
  const T* v_data = v_cache.data_ptr<T>();

  at::parallel_for(0, num_items, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(num_heads * kSplitTokens);
    for (int64_t i = first; i < last; ++i) {
      const WorkItem& item = items[i];
      attend_split<T>(item, queries + item.request * num_heads * head_dim, k_data, v_data,
                      table + item.request * table_stride, block_size, num_kv_heads, group, head_dim,
                      scores.data(), acc.data() + i * num_heads * head_dim,
                      maxes.data() + i * num_heads, sums.data() + i * num_heads);
    }
  });

  // Merge each request's splits in order: its items are consecutive.
  std::vector<int64_t> request_start;
  for (int64_t i = 0; i < num_items; ++i) {
    if (i == 0 || items[i].request != items[i - 1].request) {
      request_start.push_back(i);
    }
  }
  request_start.push_back(num_items);
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(request_start.size()) - 1, 1, [&](int64_t first, int64_t last) {
    std::vector<float> merged(head_dim);
    for (int64_t p = first; p < last; ++p) {
      const int64_t request = items[request_start[p]].request;
      for (int64_t h = 0; h < num_heads; ++h) {
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t i = request_start[p]; i < request_start[p + 1]; ++i) {
          max_score = std::max(max_score, maxes[i * num_heads + h]);
        }
        std::fill(merged.begin(), merged.end(), 0.f);
        float total = 0.f;
        for (int64_t i = request_start[p]; i < request_start[p + 1]; ++i) {
          const float weight = std::exp(maxes[i * num_heads + h] - max_score);
          total += weight * sums[i * num_heads + h];
          const float* part = acc.data() + (i * num_heads + h) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * part[d];
        }
        T* row = out_data + (request * num_heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<T>(merged[d] / total);
      }
    }
  });
}

}  // namespace

// q: [batch, heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim],
// same dtype as q; block_table: [batch, max_blocks] int64; seq_lens: [batch] int64 keys per
// request (its cached tokens and this step's). Returns [batch, heads, head_dim].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, double scale) {
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
      paged_decode<float>(out, queries, k_cache, v_cache, table, lens, scale);
      break;
    case at::kBFloat16:
      paged_decode<at::BFloat16>(out, queries, k_cache, v_cache, table, lens, scale);
      break;
    case at::kHalf:
      paged_decode<at::Half>(out, queries, k_cache, v_cache, table, lens, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a paged KV cache, read in place");
}
