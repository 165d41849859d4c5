// The decoder layer's small element-wise steps fused on the CPU, where each torch op over a decode step's
// few rows costs more in dispatch than in arithmetic: rotary embedding of query and key in place, and the
// residual add fused with the RMS norm after it. fp32 models only; one token row per task.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

// a token's heads [H, D] at ``x`` rotated by its cos/sin rows [D]: x * cos + rotate_half(x) * sin, where
// rotate_half pairs each head's first half of dimensions with its second
void rotate_heads(float* x, int64_t num_heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h, x += head_dim) {
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      const float first = x[d], second = x[d + half];
      x[d] = first * cos[d] - second * sin[d];
      x[d + half] = second * cos[d + half] + first * sin[d + half];
    }
  }
}

}  // namespace

// query [T, H, D] and key [T, KV, D] (views of the qkv rows: heads contiguous, rows at any stride) rotated
// in place by cos/sin [T, D]
void rotary_(torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin) {
  const int64_t head_dim = query.size(2);
  float* q = query.data_ptr<float>();
  float* k = key.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, query.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_heads(q + t * query.stride(0), query.size(1), head_dim, c + t * head_dim, s + t * head_dim);
      rotate_heads(k + t * key.stride(0), key.size(1), head_dim, c + t * head_dim, s + t * head_dim);
    }
  });
}

// residual [T, hidden] += delta in place (delta may be empty: nothing to add); returns
// weight * residual / sqrt(mean(residual^2) + eps), row by row
torch::Tensor add_rms_norm_(torch::Tensor delta, torch::Tensor residual, torch::Tensor weight, double eps) {
  auto out = torch::empty_like(residual);
  const int64_t hidden = residual.size(1);
  const float* add = delta.numel() ? delta.data_ptr<float>() : nullptr;
  float* rows = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, residual.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = rows + t * hidden;
      if (add != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) row[i] += add[t * hidden + i];
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) squares += row[i] * row[i];
      const float inverse = 1.f / std::sqrt(squares / static_cast<float>(hidden) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) dst[t * hidden + i] = w[i] * (row[i] * inverse);
    }
  });
  return out;
}
