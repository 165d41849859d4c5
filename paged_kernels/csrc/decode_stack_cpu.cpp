// A decode step through every decoder layer of a Llama-family model in one call on the CPU: the same compiled
// kernels, in the same order and on the same tensors, as the model's Python layers call them one by one, so the
// results are bit-identical; what goes is the Python between them (about 12 module calls and torch dispatches per
// layer, 2-3 ms a step for SmolLM2's 30 layers on a 2-vCPU Zen 3, as much as its attention and norms together).
// Comes after every file whose kernels it calls.
#include <torch/extension.h>

#include <vector>

namespace {

// the linear kernels a layer may be packed for, as the Python side (engine/models/cpu_decode_stack.py) codes them
enum LinearKind : int64_t { kFp16 = 0, kBf16 = 1, kInt8 = 2, kInt8Vnni = 3 };
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down
constexpr int64_t kTensorsPerLinear = 3;  // packed weight, packed scale (empty for fp16/bf16), fp32 bias
constexpr int64_t kShapesPerLinear = 3;  // kind, in_features, out_features

struct Linears {
  const std::vector<torch::Tensor>& tensors;
  const std::vector<int64_t>& shapes;

  torch::Tensor operator()(int64_t index, const torch::Tensor& input) const {
    const torch::Tensor& packed = tensors[index * kTensorsPerLinear];
    const torch::Tensor& scale = tensors[index * kTensorsPerLinear + 1];
    const torch::Tensor& bias = tensors[index * kTensorsPerLinear + 2];
    const int64_t kind = shapes[index * kShapesPerLinear], in = shapes[index * kShapesPerLinear + 1],
                  out = shapes[index * kShapesPerLinear + 2];
    switch (kind) {
      case kFp16: return fp16_linear(input, packed, bias, in, out);
      case kBf16: return bf16_linear(input, packed, bias, in, out);
      case kInt8: return int8_linear(input, packed, scale, bias, in, out);
      case kInt8Vnni: return int8_vnni_linear(input, packed, scale, bias, in, out);
      default: TORCH_CHECK(false, "decode_layers: linear ", index, " has unknown kind ", kind);
    }
  }
};

}  // namespace

// hidden [T, hidden] (the embedded tokens of T decode rows, one per sequence; summed into in place as the residual
// stream), cos/sin [T, head_dim] fp32, per layer its key and value caches (contiguous, alike, in the model's dtype
// or 16-bit under an fp32 model),
// slot_mapping [T], block_tables [T, W] and context_lens [T] (checked by the caller from host copies, as the
// Python layers' first call checks them), per layer its input and post-attention norm weights then the final
// norm's, per layer its qkv, o, gate_up and down projections as kTensorsPerLinear tensors and kShapesPerLinear
// integers each -> the final norm of the last layer's residual stream [T, hidden]
torch::Tensor decode_layers(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
                            std::vector<torch::Tensor> key_caches, std::vector<torch::Tensor> value_caches,
                            torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens,
                            std::vector<torch::Tensor> norm_weights, std::vector<torch::Tensor> linear_tensors,
                            std::vector<int64_t> linear_shapes, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, double eps, double scale) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(value_caches.size()) == layers,
              "decode_layers: key_caches and value_caches must hold one cache per layer, alike in number");
  TORCH_CHECK(static_cast<int64_t>(norm_weights.size()) == 2 * layers + 1,
              "decode_layers: norm_weights must hold 2 per layer and the final norm's, ", 2 * layers + 1, " in all");
  TORCH_CHECK(static_cast<int64_t>(linear_tensors.size()) == layers * kLinearsPerLayer * kTensorsPerLinear &&
                  static_cast<int64_t>(linear_shapes.size()) == layers * kLinearsPerLayer * kShapesPerLinear,
              "decode_layers: linear_tensors and linear_shapes must describe ", kLinearsPerLayer, " linears per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layers: hidden must be contiguous [tokens, hidden]");
  TORCH_CHECK(pairs_with_cache(hidden.scalar_type(), key_caches[0].scalar_type()),
              "decode_layers: the caches must be in the model's dtype, or 16-bit under an fp32 model");
  // the caller checked the first layer's caches against the step's tables; the others must be shaped as it is
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (const torch::Tensor* cache : {&key_caches[layer], &value_caches[layer]}) {
      TORCH_CHECK(cache->sizes() == key_caches[0].sizes() && cache->scalar_type() == key_caches[0].scalar_type() &&
                      cache->is_contiguous() && cache->device().is_cpu(),
                  "decode_layers: layer ", layer, "'s caches must be contiguous CPU tensors shaped as layer 0's, in "
                  "its dtype");
    }
  }
  // the whole step without the GIL (the kernels it calls find it released)
  ReleasedGil released_gil;
  const int64_t tokens = hidden.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const Linears linear{linear_tensors, linear_shapes};
  torch::Tensor residual = hidden;
  torch::Tensor delta = hidden.narrow(0, 0, 0);  // the first layer adds nothing to the embedded tokens
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t first = layer * kLinearsPerLayer;
    const torch::Tensor normed = add_rms_norm_(delta, residual, norm_weights[2 * layer], eps);
    const torch::Tensor qkv = linear(first, normed);
    const torch::Tensor query = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    const torch::Tensor key = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const torch::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    rotary_(query, key, cos, sin);
    write_kv_cache_(key, value, key_caches[layer], value_caches[layer], slot_mapping);
    const torch::Tensor attention =
        paged_decode(query, key_caches[layer], value_caches[layer], block_tables, context_lens, scale);
    const torch::Tensor projected = linear(first + 1, attention.view({tokens, q_size}));
    const torch::Tensor mlp_input = add_rms_norm_(projected, residual, norm_weights[2 * layer + 1], eps);
    delta = linear(first + 3, silu_and_mul(linear(first + 2, mlp_input)));
  }
  return add_rms_norm_(delta, residual, norm_weights[2 * layers], eps);
}
