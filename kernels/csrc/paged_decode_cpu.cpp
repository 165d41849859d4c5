// Paged decode attention on the CPU: each sequence reads its context's K/V rows in place through its
// block table (no gather copy; a block's rows are contiguous, every KV head of a token side by side),
// scores every query head against its KV head's rows, then softmax and a weighted sum of the V rows.
// Math in fp32 whatever the cache's dtype.
//
// Scores are made kLanes positions at a time: one vector of partial sums per position (no horizontal sum
// per dot product), then one transpose-and-add of those kLanes vectors gives the kLanes scores side by
// side. Written with GCC's vector extensions, so that one code path compiles to AVX2 or AVX-512 (8 lanes
// are one AVX2 register, half of an AVX-512 one; Zen 4 runs 512-bit ops as two 256-bit halves anyway).
// The softmax's exponential is simd_math_cpu.cpp's polynomial, which the compiler vectorizes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Mask __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float* from, int64_t count = kLanes) {
  Vec v = {};
  std::memcpy(&v, from, count * sizeof(float));
  return v;
}

// lane i of the result is the sum of the lanes of v[i]: pairs interleaved and added three times over
// (unpack floats, unpack float pairs, swap 128-bit halves); the masks are constants, so that each shuffle is
// one instruction
inline Vec transpose_sum(const Vec (&v)[kLanes]) {
  Vec w[4], x[2];
  for (int i = 0; i < 4; ++i) {
    w[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], (Mask){0, 8, 1, 9, 4, 12, 5, 13}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], (Mask){2, 10, 3, 11, 6, 14, 7, 15});
  }
  for (int i = 0; i < 2; ++i) {
    x[i] = __builtin_shuffle(w[2 * i], w[2 * i + 1], (Mask){0, 1, 8, 9, 4, 5, 12, 13}) +
           __builtin_shuffle(w[2 * i], w[2 * i + 1], (Mask){2, 3, 10, 11, 6, 7, 14, 15});
  }
  return __builtin_shuffle(x[0], x[1], (Mask){0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(x[0], x[1], (Mask){4, 5, 6, 7, 12, 13, 14, 15});
}

// the scores q . k of the kLanes rows, side by side: one vector of partial sums per row (held in registers),
// then one transpose_sum
inline Vec scores_of_rows(const float* qh, const float* const (&rows)[kLanes], int64_t offset, int64_t full_chunks,
                          int64_t tail) {
  Vec partial[kLanes] = {};
  for (int64_t c = 0; c < full_chunks; ++c) {
    const Vec qc = load(qh + c * kLanes);
    for (int64_t i = 0; i < kLanes; ++i) partial[i] += qc * load(rows[i] + offset + c * kLanes);
  }
  if (tail) {
    const Vec qc = load(qh + full_chunks * kLanes, tail);
    for (int64_t i = 0; i < kLanes; ++i) partial[i] += qc * load(rows[i] + offset + full_chunks * kLanes, tail);
  }
  return transpose_sum(partial);
}

inline void store(float* to, const Vec& v) { std::memcpy(to, &v, sizeof v); }

// out[0, kLanes * nvec) += sum over the ``count`` rows of weights[i] * rows[i][0, kLanes * nvec), the sums held in
// registers across the rows
template <int nvec>
inline void accumulate_rows(float* out, const float* weights, const float* const* rows, int64_t count) {
  Vec sums[nvec];
  for (int v = 0; v < nvec; ++v) sums[v] = load(out + v * kLanes);
  for (int64_t i = 0; i < count; ++i) {
    for (int v = 0; v < nvec; ++v) sums[v] += weights[i] * load(rows[i] + v * kLanes);
  }
  for (int v = 0; v < nvec; ++v) store(out + v * kLanes, sums[v]);
}

// accumulate_rows over a head of ``head_dim`` values: eight vectors at a time, then the rest
void accumulate_head(float* out, const float* weights, const float* const (&rows)[kLanes], int64_t count,
                     int64_t head_dim) {
  const float* shifted[kLanes];
  int64_t d = 0;
  auto shift = [&] { for (int64_t i = 0; i < count; ++i) shifted[i] = rows[i] + d; };
  for (; d + 8 * kLanes <= head_dim; d += 8 * kLanes) {
    shift();
    accumulate_rows<8>(out + d, weights, shifted, count);
  }
  shift();
  switch ((head_dim - d) / kLanes) {
    case 7: accumulate_rows<7>(out + d, weights, shifted, count); break;
    case 6: accumulate_rows<6>(out + d, weights, shifted, count); break;
    case 5: accumulate_rows<5>(out + d, weights, shifted, count); break;
    case 4: accumulate_rows<4>(out + d, weights, shifted, count); break;
    case 3: accumulate_rows<3>(out + d, weights, shifted, count); break;
    case 2: accumulate_rows<2>(out + d, weights, shifted, count); break;
    case 1: accumulate_rows<1>(out + d, weights, shifted, count); break;
    default: break;
  }
  for (d += (head_dim - d) / kLanes * kLanes; d < head_dim; ++d) {  // a head_dim that is no multiple of kLanes
    for (int64_t i = 0; i < count; ++i) out[d] += weights[i] * rows[i][d];
  }
}

// the K or V rows of ``count`` consecutive positions from ``first`` as fp32: pointers into the cache for an
// fp32 cache, else rows converted into ``scratch`` [kLanes, row]. Past ``count`` (the context's last chunk),
// rows repeat the first one, so that every chunk is scored as a whole and only ``count`` scores are kept.
template <typename scalar_t>
void rows_as_float(const scalar_t* cache, const int32_t* table, int64_t first, int64_t count, int64_t block_size,
                   int64_t block_stride, int64_t row, float* scratch, const float* (&rows)[kLanes]) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pos = first + i;
    const scalar_t* src = cache + table[pos / block_size] * block_stride + (pos % block_size) * row;
    if constexpr (std::is_same_v<scalar_t, float>) {
      rows[i] = src;
    } else {
      float* dst = scratch + i * row;
#pragma omp simd
      for (int64_t j = 0; j < row; ++j) dst[j] = to_float(src[j]);
      rows[i] = dst;
    }
  }
  std::fill(rows + count, rows + kLanes, rows[0]);
}

template <typename scalar_t>
void decode_rows(const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
                 const int32_t* block_tables, const int32_t* context_lens, scalar_t* out,
                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, int64_t table_width, float scale) {
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t row = num_kv_heads * head_dim;      // one token's K (or V) row: every KV head side by side
  const int64_t block_stride = block_size * row;
  const int64_t full_chunks = head_dim / kLanes, tail = head_dim % kLanes;
  // one sequence per task: its blocks are read whole, every KV head of a token row at once
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(num_heads * head_dim), acc(num_heads * head_dim), scores, scratch(kLanes * row),
        inverse_totals(num_heads);
    const float* rows[kLanes];
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t length = context_lens[seq];
      const int32_t* table = block_tables + seq * table_width;
      const scalar_t* seq_query = query + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = to_float(seq_query[i]) * scale;
      scores.resize(num_heads * length);
      for (int64_t first = 0; first < length; first += kLanes) {
        const int64_t count = std::min(kLanes, length - first);
        rows_as_float(key_cache, table, first, count, block_size, block_stride, row, scratch.data(), rows);
        for (int64_t h = 0; h < num_heads; ++h) {
          const Vec sums = scores_of_rows(q.data() + h * head_dim, rows, (h / group) * head_dim, full_chunks, tail);
          std::memcpy(scores.data() + h * length + first, &sums, count * sizeof(float));
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* head_scores = scores.data() + h * length;
        const float top = *std::max_element(head_scores, head_scores + length);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t pos = 0; pos < length; ++pos) {
          head_scores[pos] = exp_nonpositive(head_scores[pos] - top);
          total += head_scores[pos];
        }
        inverse_totals[h] = 1.f / total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t first = 0; first < length; first += kLanes) {
        const int64_t count = std::min(kLanes, length - first);
        rows_as_float(value_cache, table, first, count, block_size, block_stride, row, scratch.data(), rows);
        for (int64_t h = 0; h < num_heads; ++h) {
          const int64_t offset = (h / group) * head_dim;
          const float* head_rows[kLanes];
          for (int64_t i = 0; i < count; ++i) head_rows[i] = rows[i] + offset;
          accumulate_head(acc.data() + h * head_dim, scores.data() + h * length + first, head_rows, count, head_dim);
        }
      }
      scalar_t* seq_out = out + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) {
          seq_out[h * head_dim + d] = from_float<scalar_t>(acc[h * head_dim + d] * inverse_totals[h]);
        }
      }
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
