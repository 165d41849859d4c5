// The decoder layer's small element-wise steps fused on the CPU, where each torch op over a decode step's
// few rows costs more in dispatch than in arithmetic: rotary embedding of query and key in place, the
// residual add fused with the RMS norm after it, and the MLP's SiLU(gate) * up. fp32, bf16 or fp16 rows, math
// in fp32; one token row per task. A reduced-precision row is rounded once per result (the plain layers round
// after every op).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

// a token's heads [H, D] at ``x`` rotated by its fp32 cos/sin rows [D]: x * cos + rotate_half(x) * sin, where
// rotate_half pairs each head's first half of dimensions with its second
template <typename scalar_t>
void rotate_heads(scalar_t* x, int64_t num_heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h, x += head_dim) {
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
      const float first = to_float(x[d]), second = to_float(x[d + half]);
      x[d] = from_float<scalar_t>(first * cos[d] - second * sin[d]);
      x[d + half] = from_float<scalar_t>(second * cos[d + half] + first * sin[d + half]);
    }
  }
}

template <typename scalar_t>
void add_rms_norm_rows(const scalar_t* add, scalar_t* rows, const scalar_t* w, scalar_t* dst, int64_t num_rows,
                       int64_t hidden, float eps) {
  at::parallel_for(0, num_rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* row = rows + t * hidden;
      if (add != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) {
          row[i] = from_float<scalar_t>(to_float(row[i]) + to_float(add[t * hidden + i]));
        }
      }
      float squares = 0.f;  // of the stored (rounded) sum, as the plain norm reads it
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) squares += to_float(row[i]) * to_float(row[i]);
      const float inverse = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        dst[t * hidden + i] = from_float<scalar_t>(to_float(w[i]) * (to_float(row[i]) * inverse));
      }
    }
  });
}

// a token's SiLU(gate) * up: sigmoid(g) from e^-|g| (never overflows), 1 / (1 + e) for g >= 0, e / (1 + e) below
// (0 below -87, so that a huge negative gate gives -0 and -inf gives NaN, as torch's SiLU does)
template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* dst, int64_t size) {
#pragma omp simd
  for (int64_t i = 0; i < size; ++i) {
    const float g = to_float(gate[i]);
    const float e = exp_nonpositive(-std::fabs(g));
    dst[i] = from_float<scalar_t>(g * ((g >= 0.f ? 1.f : e) / (1.f + e)) * to_float(up[i]));
  }
}

}  // namespace

// query [T, H, D] and key [T, KV, D] (views of the qkv rows: heads contiguous, rows at any stride, one dtype)
// rotated in place by fp32 cos/sin [T, D]
void rotary_(torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rotary_: cos/sin must be fp32");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "rotary_: query and key must share a dtype");
  const int64_t head_dim = query.size(2);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_", [&] {
    scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* k = key.data_ptr<scalar_t>();
    at::parallel_for(0, query.size(0), 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate_heads(q + t * query.stride(0), query.size(1), head_dim, c + t * head_dim, s + t * head_dim);
        rotate_heads(k + t * key.stride(0), key.size(1), head_dim, c + t * head_dim, s + t * head_dim);
      }
    });
  });
}

// residual [T, hidden] += delta in place (delta may be empty: nothing to add); returns
// weight * residual / sqrt(mean(residual^2) + eps), row by row; all three in one dtype
torch::Tensor add_rms_norm_(torch::Tensor delta, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(delta.scalar_type() == residual.scalar_type() && weight.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: delta, residual and weight must share a dtype");
  auto out = torch::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm_", [&] {
    add_rms_norm_rows<scalar_t>(delta.numel() ? delta.data_ptr<scalar_t>() : nullptr, residual.data_ptr<scalar_t>(),
                                weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), residual.size(0),
                                residual.size(1), static_cast<float>(eps));
  });
  return out;
}

// gate_up [T, 2 * I] (each row the gate's I columns then the up's; rows at any stride) -> SiLU(gate) * up [T, I]
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_and_mul: gate_up must be on the CPU");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "silu_and_mul: gate_up must be [tokens, 2 * intermediate] with contiguous rows");
  const int64_t size = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), size}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = gate_up.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, gate_up.size(0), 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        silu_mul_row(src + t * stride, src + t * stride + size, dst + t * size, size);
      }
    });
  });
  return out;
}
