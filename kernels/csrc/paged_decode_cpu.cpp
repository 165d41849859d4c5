// Paged decode attention on the CPU: each sequence reads its context's K/V rows in place through its
// block table (no gather copy; a block's rows are contiguous, every KV head of a token side by side),
// scores every query head against its KV head's row, then softmax and a weighted sum of the V rows.
// Math in fp32 whatever the cache's dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename scalar_t>
void decode_rows(const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
                 const int32_t* block_tables, const int32_t* context_lens, scalar_t* out,
                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, int64_t table_width, float scale) {
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t block_stride = block_size * token_stride;
  // one sequence per task: its blocks are read whole, every KV head of a token row at once
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(num_heads * head_dim), acc(num_heads * head_dim), scores;
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t length = context_lens[seq];
      const int32_t* table = block_tables + seq * table_width;
      const scalar_t* seq_query = query + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = static_cast<float>(seq_query[i]) * scale;
      scores.resize(num_heads * length);
      for (int64_t pos = 0; pos < length; ++pos) {
        const scalar_t* key = key_cache + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* qh = q.data() + h * head_dim;
          const scalar_t* kh = key + (h / group) * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * static_cast<float>(kh[d]);
          scores[h * length + pos] = dot;
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* row = scores.data() + h * length;
        const float top = *std::max_element(row, row + length);
        float total = 0.f;
        for (int64_t pos = 0; pos < length; ++pos) {
          row[pos] = std::exp(row[pos] - top);
          total += row[pos];
        }
        const float inverse = 1.f / total;
        for (int64_t pos = 0; pos < length; ++pos) row[pos] *= inverse;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t pos = 0; pos < length; ++pos) {
        const scalar_t* value = value_cache + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
        for (int64_t h = 0; h < num_heads; ++h) {
          const float weight = scores[h * length + pos];
          const scalar_t* vh = value + (h / group) * head_dim;
          float* ah = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += weight * static_cast<float>(vh[d]);
        }
      }
      scalar_t* seq_out = out + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) seq_out[i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

}  // namespace

// query [S, H, D], caches [num_blocks, block_size, KV, D] (contiguous, query's dtype),
// block_tables [S, W] int32, context_lens [S] int32 -> [S, H, D]. The caller has checked the values.
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    decode_rows<scalar_t>(query.data_ptr<scalar_t>(), key_cache.data_ptr<scalar_t>(),
                          value_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
                          context_lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), query.size(0),
                          query.size(1), key_cache.size(2), query.size(2), key_cache.size(1),
                          block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}
