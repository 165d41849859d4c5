// Paged decode attention on the CPU: each sequence reads its context's K/V rows in place through its
// block table (no gather copy; a block's rows are contiguous, every KV head of a token side by side),
// scores the query heads of each KV head against that head's rows, then softmax and a weighted sum of the V
// rows. Math in fp32 whatever the cache's dtype.
//
// The query heads that share a KV head (GQA) are worked together, up to kMaxHeads of them: each K or V vector
// is loaded and widened to fp32 once, in registers, and multiplied into every head of the group (no fp32 copy
// of the rows, which cost a third of the kernel's time in stores and reloads). Scores are made kLanes positions
// at a time: one vector of partial sums per position and head (no horizontal sum per dot product), then one
// transpose-and-add of those kLanes vectors gives a head's kLanes scores side by side. The weighted sum keeps
// the group's sums for a tile of up to kTile vectors of dimensions in registers across kValueChunk positions.
// A decode step reads the cache from memory (the weights pass through the caches in between), one block
// wherever the table put it: the rows are prefetched ahead of use, K a few chunks ahead and V during the scores.
// Every sum is taken in the order of one head at a time: the same results bit for bit, but for the values past a
// head_dim's last whole vector in fp32, which may round one ulp apart.
// Written with GCC's vector extensions, so that one code path compiles to AVX2 or AVX-512 (8 lanes are one
// AVX2 register, half of an AVX-512 one; Zen 4 runs 512-bit ops as two 256-bit halves anyway).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;
constexpr int kTile = 8;  // vectors of dimensions per weighted-sum pass: a head_dim of 64 in one pass
// heads per group pass: kMaxHeads * kLanes score sums (or kMaxHeads * kTile value sums) stay in registers,
// which takes AVX-512's 32 vector registers; AVX2's 16 hold the sums of one head
#ifdef __AVX512F__
constexpr int kMaxHeads = 3;
#else
constexpr int kMaxHeads = 1;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Mask __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline Vec load(const float* from, int64_t count = kLanes) {
  Vec v = {};
  std::memcpy(&v, from, count * sizeof(float));
  return v;
}

// ``count`` values from ``from`` as fp32 lanes (the rest 0): a whole vector of bf16 or fp16 widens in registers
// (bf16 by its bits, fp16 by the F16C conversion), anything else value by value. GCC's generic widening of the
// bf16 bits went through two 128-bit halves and its fp16 conversion one value at a time, hence the intrinsics.
template <typename scalar_t>
inline Vec load_as_float(const scalar_t* from, int64_t count = kLanes) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return load(from, count);
  }
#if defined(__AVX2__) && defined(__F16C__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> || std::is_same_v<scalar_t, c10::Half>) {
    if (count == kLanes) {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        return __builtin_bit_cast(Vec, _mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
      } else {
        return __builtin_bit_cast(Vec, _mm256_cvtph_ps(bits));
      }
    }
  }
#endif
  Vec v = {};
  for (int64_t i = 0; i < count; ++i) v[i] = to_float(from[i]);
  return v;
}

inline void store(float* to, const Vec& v) { std::memcpy(to, &v, sizeof v); }

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

// f(std::integral_constant<int, n>) for a runtime n in [1, Max]
template <int Max, typename F>
inline void with_constant(int n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_constant<Max - 1>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int, Max>{});
}

// the scores of NH query heads (fp32 rows of head_dim, scaled) against their KV head's K values, at ``offset``
// in the rows of kLanes positions: scores[h * stride + i] (a row past the context repeats a real one: its lane
// is ignored)
template <int NH, typename scalar_t>
inline void score_positions(const float* q, int64_t head_dim, const scalar_t* const* rows, int64_t offset,
                            float* scores, int64_t stride) {
  Vec partial[NH][kLanes] = {};
  auto accumulate = [&](int64_t d, int64_t width) {
    Vec qd[NH];
    for (int h = 0; h < NH; ++h) qd[h] = load(q + h * head_dim + d, width);
    for (int64_t i = 0; i < kLanes; ++i) {
      const Vec k = load_as_float(rows[i] + offset + d, width);
      for (int h = 0; h < NH; ++h) partial[h][i] += qd[h] * k;
    }
  };
  int64_t d = 0;
  for (; d + kLanes <= head_dim; d += kLanes) accumulate(d, kLanes);
  if (d < head_dim) accumulate(d, head_dim - d);
  for (int h = 0; h < NH; ++h) store(scores + h * stride, transpose_sum(partial[h]));
}

// out[h * head_dim + (0, NV * kLanes)] += sum over ``count`` positions of weights[h * stride + pos] *
// rows[pos][offset, offset + NV * kLanes) for NH heads, the sums in registers across the positions
template <int NH, int NV, typename scalar_t>
inline void weigh_values(float* out, int64_t head_dim, const float* weights, int64_t stride, int64_t count,
                         const scalar_t* const* rows, int64_t offset) {
  Vec sums[NH][NV];
  for (int h = 0; h < NH; ++h) {
    for (int v = 0; v < NV; ++v) sums[h][v] = load(out + h * head_dim + v * kLanes);
  }
  for (int64_t pos = 0; pos < count; ++pos) {
    float w[NH];
    for (int h = 0; h < NH; ++h) w[h] = weights[h * stride + pos];
    const scalar_t* row = rows[pos] + offset;
    for (int v = 0; v < NV; ++v) {
      const Vec x = load_as_float(row + v * kLanes);
      for (int h = 0; h < NH; ++h) sums[h][v] += w[h] * x;
    }
  }
  for (int h = 0; h < NH; ++h) {
    for (int v = 0; v < NV; ++v) store(out + h * head_dim + v * kLanes, sums[h][v]);
  }
}

// the context's length rounded up to whole vectors: a head's row of scores
inline int64_t padded(int64_t length) { return (length + kLanes - 1) / kLanes * kLanes; }

// every cache line of ``count`` rows of ``bytes`` each, asked for ahead of their use: a block's rows sit wherever
// the block table put it, out of reach of the hardware prefetchers, and decode reads the cache from memory.
// Into L2 only (prefetcht1, locality 2): a prefetch into L1 (prefetcht0) holds one of the core's few L1 miss
// buffers until its line arrives, which capped the reads at 10-12 GB/s over two Zen 4 cores; into L2 the same
// calls took 0.51-0.55x their time at 8-32 rows x 256-4,096 positions (prefetchnta: no change; a Zen 3: 0.96-1.03x)
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* const* rows, int64_t count, int64_t bytes) {
  for (int64_t i = 0; i < count; ++i) {
    const char* row = reinterpret_cast<const char*>(rows[i]);
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(row + line, 0, 2);
  }
}

constexpr int64_t kValueChunk = 32;  // positions per pass of the weighted sum: their V rows stay in L1
constexpr int64_t kPrefetchAhead = 4 * kLanes;  // how far ahead of the scores the K rows are asked for

// one head's scores over ``length`` positions turned into e^(score - max), in place; returns that max and the
// sum of the exponentials
struct Softmax {
  float top, total;
};
inline Softmax exponentiate(float* scores, int64_t length) {
  float top = scores[0];
#pragma omp simd reduction(max : top)
  for (int64_t pos = 0; pos < length; ++pos) top = std::max(top, scores[pos]);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t pos = 0; pos < length; ++pos) {
    scores[pos] = exp_nonpositive(scores[pos] - top);
    total += scores[pos];
  }
  return {top, total};
}

// sums[h][0, head_dim) += the NH heads' weights (rows of ``stride``) times the V values at ``offset`` of ``count``
// positions' rows: whole tiles of kTile vectors, then the vectors left, then the values past the last vector
template <int NH, typename scalar_t>
void weigh_head_values(float* sums, int64_t head_dim, const float* weights, int64_t stride, int64_t count,
                       const scalar_t* const* rows, int64_t offset) {
  int64_t d = 0;
  for (; d + kTile * kLanes <= head_dim; d += kTile * kLanes) {
    weigh_values<NH, kTile>(sums + d, head_dim, weights, stride, count, rows, offset + d);
  }
  if (const int vectors = static_cast<int>((head_dim - d) / kLanes); vectors > 0) {
    with_constant<kTile>(vectors, [&](auto nv) {
      weigh_values<NH, decltype(nv)::value>(sums + d, head_dim, weights, stride, count, rows, offset + d);
    });
    d += vectors * kLanes;
  }
  for (; d < head_dim; ++d) {  // a head_dim that is no multiple of kLanes
    for (int h = 0; h < NH; ++h) {
      for (int64_t pos = 0; pos < count; ++pos) {
        sums[h * head_dim + d] += weights[h * stride + pos] * to_float(rows[pos][offset + d]);
      }
    }
  }
}

// for every KV head, its query heads kMaxHeads at a time: f(std::integral_constant<int, NH>, first query head,
// KV head)
template <typename F>
inline void for_head_groups(int64_t num_kv_heads, int64_t group, F&& f) {
  for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
    for (int64_t h = 0; h < group; h += kMaxHeads) {
      with_constant<kMaxHeads>(static_cast<int>(std::min<int64_t>(kMaxHeads, group - h)),
                               [&](auto nh) { f(nh, kv_head * group + h, kv_head); });
    }
  }
}

// positions of one sequence's context per task at the least, when contexts are split to spread the work evenly over
// the threads: one sequence of 128 positions in two parts of 64 took 1.31x its time whole; in parts of at least
// 128, one of 256 took 0.66x, of 1,024 0.58x, of 4,096 0.50x (benchmarks.kernel_revisions on a Zen 4, two threads)
constexpr int64_t kMinPartPositions = 128;
constexpr int64_t kMaxParts = 4;

// parts per sequence (1 to kMaxParts) that spread num_seqs sequences of equal work most evenly over the threads: the
// fewest with the least work on the busiest thread, ceil(num_seqs * parts / threads) / parts, if that is under 0.9 of
// the whole sequences' (3 sequences on 2 threads: 2 parts each, 3 tasks a thread, against 2 sequences on one thread;
// 17 sequences on 2 threads stay whole: a thread with 9 against 8.5 is not worth the merges)
int64_t even_parts(int64_t num_seqs, int64_t threads) {
  auto busiest = [&](int64_t parts) { return (num_seqs * parts + threads - 1) / threads; };
  int64_t best = 1;
  for (int64_t parts = 2; parts <= kMaxParts; ++parts) {
    if (busiest(parts) * best < busiest(best) * parts) best = parts;  // busiest(parts) / parts < busiest(best) / best
  }
  return busiest(best) * 10 < busiest(1) * 9 * best ? best : 1;
}

// a part of a sequence's context, attended by one task: every head's e^(score - top) weighted sum of the V rows
// and the softmax terms that merge it with the sequence's other parts
struct PartResult {
  std::vector<float> sums;  // [H, D], not divided by the total
  std::vector<Softmax> softmax;  // [H]
};

// query_t: the query's and the output's dtype; cache_t: the caches' (the same, or 16-bit under an fp32 query)
template <typename query_t, typename cache_t>
void decode_rows(const query_t* query, int64_t query_stride, const cache_t* key_cache, const cache_t* value_cache,
                 const int32_t* block_tables, const int32_t* context_lens, query_t* out,
                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t block_size, int64_t table_width, float scale) {
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t row = num_kv_heads * head_dim;      // one token's K (or V) row: every KV head side by side
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(cache_t));
  const int64_t block_stride = block_size * row;
  // tasks: each sequence's context in parts (one part where the sequences alone spread evenly), in order
  const int64_t wanted_parts = even_parts(num_seqs, at::get_num_threads());
  std::vector<int64_t> first_task(num_seqs + 1, 0);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t parts = std::clamp<int64_t>(context_lens[seq] / kMinPartPositions, 1, wanted_parts);
    first_task[seq + 1] = first_task[seq] + parts;
  }
  std::vector<PartResult> split_results(num_seqs == first_task[num_seqs] ? 0 : first_task[num_seqs]);
  at::parallel_for(0, first_task[num_seqs], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(num_heads * head_dim), scores, sums(num_heads * head_dim);
    std::vector<Softmax> softmax(num_heads);
    std::vector<const cache_t*> key_rows, value_rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const int64_t parts = first_task[seq + 1] - first_task[seq], part = task - first_task[seq];
      const int64_t first_pos = context_lens[seq] * part / parts;
      const int64_t length = context_lens[seq] * (part + 1) / parts - first_pos, stride = padded(length);
      const int32_t* table = block_tables + seq * table_width;
      // each position's rows, padded with the first one to whole chunks of scores
      value_rows.resize(length);
      for (int64_t i = 0; i < length; ++i) {
        const int64_t pos = first_pos + i;
        value_rows[i] = value_cache + table[pos / block_size] * block_stride + (pos % block_size) * row;
      }
      key_rows.assign(stride, nullptr);
      for (int64_t i = 0; i < stride; ++i) key_rows[i] = key_cache + (value_rows[i < length ? i : 0] - value_cache);
      prefetch_rows(key_rows.data(), std::min(kPrefetchAhead, length), row_bytes);
      const query_t* seq_query = query + seq * query_stride;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = to_float(seq_query[i]) * scale;
      scores.resize(num_heads * stride);
      for (int64_t first = 0; first < length; first += kLanes) {
        if (first + kPrefetchAhead < length) {
          prefetch_rows(key_rows.data() + first + kPrefetchAhead, std::min(kLanes, length - first - kPrefetchAhead),
                        row_bytes);
        }
        prefetch_rows(value_rows.data() + first, std::min(kLanes, length - first), row_bytes);  // for the sums
        for_head_groups(num_kv_heads, group, [&](auto nh, int64_t head, int64_t kv_head) {
          score_positions<decltype(nh)::value>(q.data() + head * head_dim, head_dim, key_rows.data() + first,
                                               kv_head * head_dim, scores.data() + head * stride + first, stride);
        });
      }
      for (int64_t h = 0; h < num_heads; ++h) softmax[h] = exponentiate(scores.data() + h * stride, length);
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t first = 0; first < length; first += kValueChunk) {
        const int64_t count = std::min(kValueChunk, length - first);
        // again for the next chunk: in a long context the scores' pass has pushed its first rows out of L2
        prefetch_rows(value_rows.data() + first + count, std::min(kValueChunk, length - first - count), row_bytes);
        for_head_groups(num_kv_heads, group, [&](auto nh, int64_t head, int64_t kv_head) {
          weigh_head_values<decltype(nh)::value>(sums.data() + head * head_dim, head_dim,
                                                 scores.data() + head * stride + first, stride, count,
                                                 value_rows.data() + first, kv_head * head_dim);
        });
      }
      if (parts > 1) {  // merged below, once every part is done
        split_results[task] = {sums, softmax};
        continue;
      }
      query_t* seq_out = out + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inverse_total = 1.f / softmax[h].total;
        for (int64_t d = 0; d < head_dim; ++d) {
          seq_out[h * head_dim + d] = from_float<query_t>(sums[h * head_dim + d] * inverse_total);
        }
      }
    }
  });
  // a split sequence's parts, each scaled by e^(its top - the sequence's top)
  for (int64_t seq = 0; seq < num_seqs && !split_results.empty(); ++seq) {
    if (first_task[seq + 1] - first_task[seq] == 1) continue;
    for (int64_t h = 0; h < num_heads; ++h) {
      float top = split_results[first_task[seq]].softmax[h].top, total = 0.f;
      for (int64_t task = first_task[seq]; task < first_task[seq + 1]; ++task) {
        top = std::max(top, split_results[task].softmax[h].top);
      }
      std::vector<float> merged(head_dim, 0.f);
      for (int64_t task = first_task[seq]; task < first_task[seq + 1]; ++task) {
        const PartResult& result = split_results[task];
        const float weight = exp_nonpositive(result.softmax[h].top - top);
        total += weight * result.softmax[h].total;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * result.sums[h * head_dim + d];
      }
      query_t* head_out = out + (seq * num_heads + h) * head_dim;
      const float inverse_total = 1.f / total;
      for (int64_t d = 0; d < head_dim; ++d) head_out[d] = from_float<query_t>(merged[d] * inverse_total);
    }
  }
}

}  // namespace

// query [S, H, D] (heads contiguous, rows at any stride: the query part of the fused projection), caches
// [num_blocks, block_size, KV, D] (contiguous, query's dtype, or 16-bit under an fp32 query), block_tables [S, W],
// context_lens [S] -> [S, H, D] in the query's dtype. The caller has checked the values.
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "paged_decode: the caches must have one dtype");
  TORCH_CHECK(pairs_with_cache(query.scalar_type(), key_cache.scalar_type()),
              "paged_decode: the caches must have the query's dtype, or be 16-bit under an fp32 query");
  const bool wider_query = query.scalar_type() != key_cache.scalar_type();
  if (query.stride(2) != 1 || query.stride(1) != query.size(2)) query = query.contiguous();
  block_tables = block_tables.to(at::kInt).contiguous();
  context_lens = context_lens.to(at::kInt).contiguous();
  ReleasedGil released_gil;
  auto out = torch::empty(query.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "paged_decode", [&] {
    auto run = [&](auto* typed_query) {
      using query_t = std::remove_pointer_t<decltype(typed_query)>;
      decode_rows<query_t, scalar_t>(typed_query, query.stride(0), key_cache.data_ptr<scalar_t>(),
                                     value_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(),
                                     context_lens.data_ptr<int32_t>(), out.data_ptr<query_t>(), query.size(0),
                                     query.size(1), key_cache.size(2), query.size(2), key_cache.size(1),
                                     block_tables.size(1), static_cast<float>(scale));
    };
    if (!wider_query) {
      run(query.data_ptr<scalar_t>());
    } else if constexpr (std::is_same_v<scalar_t, c10::Half> || std::is_same_v<scalar_t, c10::BFloat16>) {
      run(query.data_ptr<float>());
    } else {
      TORCH_CHECK(false, "paged_decode: a ", query.scalar_type(), " query cannot read a ", key_cache.scalar_type(),
                  " cache");  // unreachable: pairs_with_cache let only 16-bit caches differ
    }
  });
  return out;
}
