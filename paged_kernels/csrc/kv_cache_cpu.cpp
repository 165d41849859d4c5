// The step's new key and value rows written into their cache slots on the CPU: one copy of a token's row per
// cache. torch's index_copy_ took two dispatches per layer and a strided walk for the K and V views of the fused
// projection, several times the copying itself for a decode step's few rows.
#include <torch/extension.h>

#include <cstring>

namespace {

template <typename index_t>
void copy_rows(const char* key, const char* value, int64_t key_stride, int64_t value_stride, char* key_cache,
               char* value_cache, const index_t* slots, int64_t num_tokens, int64_t row_bytes) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding: no slot
    std::memcpy(key_cache + slot * row_bytes, key + t * key_stride, row_bytes);
    std::memcpy(value_cache + slot * row_bytes, value + t * value_stride, row_bytes);
  }
}

void check_rows(const torch::Tensor& rows, const torch::Tensor& cache, const char* name) {
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == cache.size(2) && rows.size(2) == cache.size(3),
              "write_kv_cache_: ", name, " must be [tokens, kv_heads, head_dim] of the cache's heads");
  TORCH_CHECK(rows.stride(2) == 1 && rows.stride(1) == rows.size(2),
              "write_kv_cache_: ", name, "'s heads must be contiguous (rows may be at any stride)");
  TORCH_CHECK(rows.scalar_type() == cache.scalar_type(), "write_kv_cache_: ", name, " must have the cache's dtype");
}

}  // namespace

// key/value [T, KV, D] in the caches' dtype, caches [num_blocks, block_size, KV, D] contiguous, slot_mapping [T]
// int32 or int64: a slot of -1 skips its token; the caller has checked that the others lie inside the cache
void write_kv_cache_(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                     torch::Tensor slot_mapping) {
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
                  value_cache.sizes() == key_cache.sizes(),
              "write_kv_cache_: the caches must be contiguous, [num_blocks, block_size, kv_heads, head_dim] alike");
  check_rows(key, key_cache, "key");
  check_rows(value, value_cache, "value");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "write_kv_cache_: slot_mapping must hold one slot per token");
  slot_mapping = slot_mapping.contiguous();
  const int64_t element = key.element_size();
  const int64_t row_bytes = key.size(1) * key.size(2) * element;
  auto* key_rows = static_cast<const char*>(key.data_ptr());
  auto* value_rows = static_cast<const char*>(value.data_ptr());
  auto* keys = static_cast<char*>(key_cache.data_ptr());
  auto* values = static_cast<char*>(value_cache.data_ptr());
  if (slot_mapping.scalar_type() == at::kInt) {
    copy_rows(key_rows, value_rows, key.stride(0) * element, value.stride(0) * element, keys, values,
              slot_mapping.data_ptr<int32_t>(), key.size(0), row_bytes);
  } else {
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "write_kv_cache_: slot_mapping must be int32 or int64");
    copy_rows(key_rows, value_rows, key.stride(0) * element, value.stride(0) * element, keys, values,
              slot_mapping.data_ptr<int64_t>(), key.size(0), row_bytes);
  }
}
