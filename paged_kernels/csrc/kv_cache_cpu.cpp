// The step's new key and value rows written into their cache slots on the CPU: one copy of a token's row per
// cache, rounded to the cache's dtype where it is narrower than the rows' (an fp32 model's fp16 cache).
// torch's index_copy_ took two dispatches per layer and a strided walk for the K and V views of the fused
// projection, several times the copying itself for a decode step's few rows.
#include <torch/extension.h>

#include <cstring>
#include <type_traits>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// `count` values from `from` into `to`, converted to cache_t (a plain copy when the dtypes agree)
template <typename row_t, typename cache_t>
inline void copy_row(cache_t* to, const row_t* from, int64_t count) {
  if constexpr (std::is_same_v<row_t, cache_t>) {
    std::memcpy(to, from, count * sizeof(cache_t));
  } else {
    int64_t i = 0;
#if defined(__F16C__)
    if constexpr (std::is_same_v<row_t, float> && std::is_same_v<cache_t, c10::Half>) {  // 8 at a time, to nearest
      for (; i + 8 <= count; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i), _mm256_cvtps_ph(_mm256_loadu_ps(from + i), 0));
      }
    }
#endif
    for (; i < count; ++i) to[i] = from_float<cache_t>(to_float(from[i]));
  }
}

// rows at `key_stride` / `value_stride` elements apart, `row` elements each, into their slots' rows
template <typename row_t, typename cache_t, typename index_t>
void copy_rows(const row_t* key, const row_t* value, int64_t key_stride, int64_t value_stride, cache_t* key_cache,
               cache_t* value_cache, const index_t* slots, int64_t num_tokens, int64_t row) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding: no slot
    copy_row(key_cache + slot * row, key + t * key_stride, row);
    copy_row(value_cache + slot * row, value + t * value_stride, row);
  }
}

void check_rows(const torch::Tensor& rows, const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == cache.size(2) && rows.size(2) == cache.size(3),
              "write_kv_cache_: ", name, " must be [tokens, kv_heads, head_dim] of the cache's heads");
  TORCH_CHECK(rows.stride(2) == 1 && rows.stride(1) == rows.size(2),
              "write_kv_cache_: ", name, "'s heads must be contiguous (rows may be at any stride)");
  TORCH_CHECK(pairs_with_cache(rows.scalar_type(), cache.scalar_type()),
              "write_kv_cache_: ", name, " must have the cache's dtype, or be fp32 for a 16-bit cache");
}

template <typename row_t, typename cache_t>
void write_rows(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
                torch::Tensor& value_cache, const torch::Tensor& slot_mapping) {
  const int64_t row = key.size(1) * key.size(2);
  auto write = [&](const auto* slots) {
    copy_rows(key.data_ptr<row_t>(), value.data_ptr<row_t>(), key.stride(0), value.stride(0),
              key_cache.data_ptr<cache_t>(), value_cache.data_ptr<cache_t>(), slots, key.size(0), row);
  };
  if (slot_mapping.scalar_type() == at::kInt) {
    write(slot_mapping.data_ptr<int32_t>());
  } else {
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "write_kv_cache_: slot_mapping must be int32 or int64");
    write(slot_mapping.data_ptr<int64_t>());
  }
}

}  // namespace

// key/value [T, KV, D] in the caches' dtype (or fp32 for 16-bit caches), caches [num_blocks, block_size, KV, D]
// contiguous, slot_mapping [T] int32 or int64: a slot of -1 skips its token; the caller has checked that the others
// lie inside the cache
void write_kv_cache_(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                     torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.scalar_type() == key_cache.scalar_type(),
              "write_kv_cache_: the caches must be contiguous, [num_blocks, block_size, kv_heads, head_dim] alike");
  check_rows(key, key_cache, "key");
  check_rows(value, value_cache, "value");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "write_kv_cache_: key and value must have one dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "write_kv_cache_: slot_mapping must hold one slot per token");
  slot_mapping = slot_mapping.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "write_kv_cache_", [&] {
    if (key.scalar_type() == key_cache.scalar_type()) {
      write_rows<scalar_t, scalar_t>(key, value, key_cache, value_cache, slot_mapping);
    } else if constexpr (!std::is_same_v<scalar_t, float> && !std::is_same_v<scalar_t, double>) {
      write_rows<float, scalar_t>(key, value, key_cache, value_cache, slot_mapping);  // check_rows: fp32 rows
    } else {
      TORCH_CHECK(false, "write_kv_cache_: rows of ", key.scalar_type(), " cannot go into a ",
                  key_cache.scalar_type(), " cache");
    }
  });
}
