// Decode attention that reads the paged KV cache in place, on the CPU.
//
// The reference path gathers every request's blocks into a dense copy and runs SDPA over
// it: at long contexts the copy costs as much as the attention (40% of a 7,500-token decode
// step, the same again for SDPA). Here each query reads K and V straight from its blocks,
// once. Work is cut into (request, KV head, split of kSplitTokens keys) items: enough items
// to keep every thread busy at one stream, and a split's size never depends on the batch,
// so a request's result is the same whatever else is decoding beside it.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kSplitTokens = 256;

struct WorkItem {
  int64_t request;
  int64_t kv_head;
  int64_t begin;
  int64_t end;
};

// One split of one (request, KV head): its `group` query heads' scores against keys
// [begin, end), softmax within the split (max and sum kept for the merge), and the
// unnormalised weighted sum of values.
template <typename T>
void attend_split(const WorkItem& item, const float* queries, const T* k_cache, const T* v_cache,
                  const int64_t* blocks, int64_t block_size, int64_t token_stride, int64_t group,
                  int64_t head_dim, float* scores, float* acc, float* maxes, float* sums) {
  const int64_t length = item.end - item.begin;
  const int64_t head_offset = item.kv_head * head_dim;
  for (int64_t t = 0; t < length; ++t) {
    const int64_t position = item.begin + t;
    const int64_t slot = blocks[position / block_size] * block_size + position % block_size;
    const T* key = k_cache + slot * token_stride + head_offset;
    for (int64_t g = 0; g < group; ++g) {
      const float* query = queries + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) {
        dot += query[d] * static_cast<float>(key[d]);
      }
      scores[g * length + t] = dot;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * length;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < length; ++t) max_score = std::max(max_score, row[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < length; ++t) {
      row[t] = std::exp(row[t] - max_score);
      sum += row[t];
    }
    maxes[g] = max_score;
    sums[g] = sum;
  }
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t t = 0; t < length; ++t) {
    const int64_t position = item.begin + t;
    const int64_t slot = blocks[position / block_size] * block_size + position % block_size;
    const T* value = v_cache + slot * token_stride + head_offset;
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * length + t];
      float* out = acc + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) {
        out[d] += weight * static_cast<float>(value[d]);
      }
    }
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
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t table_stride = block_table.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();

  // Queries in fp32, pre-scaled, so the inner loops are one multiply-add per element.
  const at::Tensor scaled = (q.to(at::kFloat) * scale).contiguous();
  const float* queries = scaled.data_ptr<float>();

  std::vector<WorkItem> items;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t begin = 0; begin < lens[b]; begin += kSplitTokens) {
        items.push_back({b, h, begin, std::min(begin + kSplitTokens, lens[b])});
      }
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::vector<float> acc(num_items * group * head_dim);
  std::vector<float> maxes(num_items * group);
  std::vector<float> sums(num_items * group);
  const T* k_data = k_cache.data_ptr<T>();
  const T* v_data = v_cache.data_ptr<T>();

  at::parallel_for(0, num_items, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(group * kSplitTokens);
    for (int64_t i = first; i < last; ++i) {
      const WorkItem& item = items[i];
      attend_split<T>(item, queries + (item.request * num_heads + item.kv_head * group) * head_dim,
                      k_data, v_data, table + item.request * table_stride, block_size,
                      token_stride, group, head_dim, scores.data(), acc.data() + i * group * head_dim,
                      maxes.data() + i * group, sums.data() + i * group);
    }
  });

  // Merge each (request, KV head)'s splits in order: items of one pair are consecutive.
  std::vector<int64_t> pair_start;
  for (int64_t i = 0; i < num_items; ++i) {
    if (i == 0 || items[i].request != items[i - 1].request || items[i].kv_head != items[i - 1].kv_head) {
      pair_start.push_back(i);
    }
  }
  pair_start.push_back(num_items);
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(pair_start.size()) - 1, 1, [&](int64_t first, int64_t last) {
    std::vector<float> merged(head_dim);
    for (int64_t p = first; p < last; ++p) {
      const WorkItem& head = items[pair_start[p]];
      for (int64_t g = 0; g < group; ++g) {
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t i = pair_start[p]; i < pair_start[p + 1]; ++i) {
          max_score = std::max(max_score, maxes[i * group + g]);
        }
        std::fill(merged.begin(), merged.end(), 0.f);
        float total = 0.f;
        for (int64_t i = pair_start[p]; i < pair_start[p + 1]; ++i) {
          const float weight = std::exp(maxes[i * group + g] - max_score);
          total += weight * sums[i * group + g];
          const float* part = acc.data() + (i * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * part[d];
        }
        T* row = out_data + (head.request * num_heads + head.kv_head * group + g) * head_dim;
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
  TORCH_CHECK(lens.numel() == 0 || lens.min().item<int64_t>() >= 1, "every request attends at least one key");
  TORCH_CHECK(lens.numel() == 0 || lens.max().item<int64_t>() <= table.size(1) * k_cache.size(1),
              "a request's keys run past its block table");
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
