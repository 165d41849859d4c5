// A linear layer over a few token rows with int8 weights (one fp32 scale per 32 weights of an output channel, as
// llama.cpp's Q8_0), read at memory speed. A decode step at one to a few rows is bound by reading the weights:
// int8 halves bf16's bytes. oneDNN's and torch's int8 kernels do not reach that speed at so few rows (see
// engine/models/quantization.py), so this one widens each weight to fp32 in registers, scales it and multiplies
// the rows in fp32 (no activation quantization: the result is the fp32 product with the dequantized weight, up
// to summation order). AVX-512 by intrinsics; elsewhere plain loops that GCC vectorizes for the machine.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <tuple>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;  // the rows one pass over the weights multiplies; more rows take more passes
// The weights are packed for one sequential read: blocks of kBlockOutputs output channels, each block's rows
// interleaved in chunks of kChunk features: [ceil(out / 4), ceil(in / 32) * 2, 4, 16], zero-padded; the scales
// of a block follow its groups: [ceil(out / 4), ceil(in / 32), 4] (int8_pack_weight).
constexpr int64_t kBlockOutputs = 4;
constexpr int64_t kChunk = 16;
constexpr int64_t kGroup = 32;  // weights per scale
constexpr int64_t kChunksPerGroup = kGroup / kChunk;
constexpr int64_t kBlockGrain = 16;  // output blocks per parallel task: a few KiB of weights at least

int64_t groups_of(int64_t in) { return (in + kGroup - 1) / kGroup; }
int64_t blocks_of(int64_t out) { return (out + kBlockOutputs - 1) / kBlockOutputs; }

#ifdef __AVX512F__
// Up to 2 rows a group's products are summed unscaled and scaled once per group (one multiply per 32 weights, not
// per 16: at 1 row the widening and scaling are the time); more rows scale each 16 weights once for all rows, as
// partial sums for 4 outputs x 3-4 rows would not fit in the 32 vector registers beside the accumulators.
template <int64_t R>
constexpr bool kPartialSums = R <= 2;

// out[r, n] = dot(x[r], w[n] * scale[n]) + bias[n] for R rows and the output blocks [begin, end): each 16 weights
// are widened to fp32 (vpmovsxbd, vcvtdq2ps) once, then multiplied into all R rows; masked loads take the rows'
// last features (the packed weights are zero past them)
template <int64_t R, typename scalar_t>
void linear_rows(const float* x, int64_t in, const int8_t* w, const float* scales, const float* bias,
                 scalar_t* out, int64_t out_features, int64_t begin, int64_t end) {
  const int64_t groups = groups_of(in);
  for (int64_t block = begin; block < end; ++block) {
    const int8_t* weights = w + block * groups * kChunksPerGroup * kBlockOutputs * kChunk;
    const float* block_scales = scales + block * groups * kBlockOutputs;
    __m512 acc[kBlockOutputs * R];
    __m512 partial[kBlockOutputs * R];  // one group's unscaled sums (kPartialSums)
#pragma GCC unroll 16
    for (int64_t i = 0; i < kBlockOutputs * R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 scale[kBlockOutputs];
#pragma GCC unroll 4
      for (int64_t j = 0; j < kBlockOutputs; ++j) scale[j] = _mm512_set1_ps(block_scales[g * kBlockOutputs + j]);
#pragma GCC unroll 16
      for (int64_t i = 0; i < kBlockOutputs * R; ++i) partial[i] = _mm512_setzero_ps();
#pragma GCC unroll 2
      for (int64_t h = 0; h < kChunksPerGroup; ++h, weights += kBlockOutputs * kChunk) {
        const int64_t k = g * kGroup + h * kChunk;
        const int64_t left = std::max<int64_t>(0, std::min(kChunk, in - k));
        const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1);
        __m512 rows[R];
#pragma GCC unroll 4
        for (int64_t r = 0; r < R; ++r) rows[r] = _mm512_maskz_loadu_ps(mask, x + r * in + k);
#pragma GCC unroll 4
        for (int64_t j = 0; j < kBlockOutputs; ++j) {
          const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(weights + j * kChunk));
          const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(packed));
          if constexpr (kPartialSums<R>) {
#pragma GCC unroll 4
            for (int64_t r = 0; r < R; ++r) partial[j * R + r] = _mm512_fmadd_ps(wf, rows[r], partial[j * R + r]);
          } else {
            const __m512 scaled = _mm512_mul_ps(wf, scale[j]);
#pragma GCC unroll 4
            for (int64_t r = 0; r < R; ++r) acc[j * R + r] = _mm512_fmadd_ps(scaled, rows[r], acc[j * R + r]);
          }
        }
      }
      if constexpr (kPartialSums<R>) {
#pragma GCC unroll 4
        for (int64_t j = 0; j < kBlockOutputs; ++j) {
#pragma GCC unroll 4
          for (int64_t r = 0; r < R; ++r) {
            acc[j * R + r] = _mm512_fmadd_ps(partial[j * R + r], scale[j], acc[j * R + r]);
          }
        }
      }
    }
    float sums[kBlockOutputs * R];  // all reduced, so that the accumulators are never indexed at run time
#pragma GCC unroll 16
    for (int64_t i = 0; i < kBlockOutputs * R; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
    const int64_t first = block * kBlockOutputs, outputs = std::min(kBlockOutputs, out_features - first);
    for (int64_t j = 0; j < outputs; ++j) {
      const float b = bias != nullptr ? bias[first + j] : 0.f;
      for (int64_t r = 0; r < R; ++r) out[r * out_features + first + j] = from_float<scalar_t>(sums[j * R + r] + b);
    }
  }
}
#else
// the same, one block at a time: each output's 16 partial sums per row held in arrays GCC keeps in vectors
template <int64_t R, typename scalar_t>
void linear_rows(const float* x, int64_t in, const int8_t* w, const float* scales, const float* bias,
                 scalar_t* out, int64_t out_features, int64_t begin, int64_t end) {
  const int64_t groups = groups_of(in);
  for (int64_t block = begin; block < end; ++block) {
    const int8_t* weights = w + block * groups * kChunksPerGroup * kBlockOutputs * kChunk;
    const float* block_scales = scales + block * groups * kBlockOutputs;
    float acc[kBlockOutputs][R][kChunk] = {};
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t h = 0; h < kChunksPerGroup; ++h, weights += kBlockOutputs * kChunk) {
        const int64_t k = g * kGroup + h * kChunk;
        if (k >= in) continue;  // the padding of the last group
        float rows[R][kChunk] = {};
        for (int64_t r = 0; r < R; ++r) {
          for (int64_t i = 0; i < std::min(kChunk, in - k); ++i) rows[r][i] = x[r * in + k + i];
        }
        for (int64_t j = 0; j < kBlockOutputs; ++j) {
          const float s = block_scales[g * kBlockOutputs + j];
          float wf[kChunk];
#pragma omp simd
          for (int64_t i = 0; i < kChunk; ++i) wf[i] = static_cast<float>(weights[j * kChunk + i]) * s;
          for (int64_t r = 0; r < R; ++r) {
#pragma omp simd
            for (int64_t i = 0; i < kChunk; ++i) acc[j][r][i] += wf[i] * rows[r][i];
          }
        }
      }
    }
    const int64_t first = block * kBlockOutputs, outputs = std::min(kBlockOutputs, out_features - first);
    for (int64_t j = 0; j < outputs; ++j) {
      const float b = bias != nullptr ? bias[first + j] : 0.f;
      for (int64_t r = 0; r < R; ++r) {
        float sum = 0.f;
        for (int64_t i = 0; i < kChunk; ++i) sum += acc[j][r][i];
        out[r * out_features + first + j] = from_float<scalar_t>(sum + b);
      }
    }
  }
}
#endif

template <typename scalar_t>
void linear_chunk(const float* x, int64_t rows, int64_t in, const int8_t* w, const float* scales, const float* bias,
                  scalar_t* out, int64_t out_features, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: return linear_rows<1>(x, in, w, scales, bias, out, out_features, begin, end);
    case 2: return linear_rows<2>(x, in, w, scales, bias, out, out_features, begin, end);
    case 3: return linear_rows<3>(x, in, w, scales, bias, out, out_features, begin, end);
    default: return linear_rows<4>(x, in, w, scales, bias, out, out_features, begin, end);
  }
}

}  // namespace

// An int8 weight [out, in] and its fp32 scales [out, ceil(in / 32)] (one per 32 weights of a row) in the blocked
// layout int8_linear reads: (weights [ceil(out / 4), ceil(in / 32) * 2, 4, 16], scales [ceil(out / 4),
// ceil(in / 32), 4]), zero-padded
std::tuple<torch::Tensor, torch::Tensor> int8_pack_weight(torch::Tensor weight, torch::Tensor scale) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "int8_pack_weight: weight must be 2-D int8");
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t blocks = blocks_of(out), groups = groups_of(in);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.size(0) == out &&
                  scale.size(1) == groups,
              "int8_pack_weight: scale must be fp32 [", out, ", ", groups, "] (one per 32 weights of a row)");
  auto padded = torch::zeros({blocks * kBlockOutputs, groups * kGroup}, weight.options());
  padded.narrow(0, 0, out).narrow(1, 0, in).copy_(weight);
  auto padded_scale = torch::zeros({blocks * kBlockOutputs, groups}, scale.options());
  padded_scale.narrow(0, 0, out).copy_(scale);
  return {padded.view({blocks, kBlockOutputs, groups * kChunksPerGroup, kChunk}).permute({0, 2, 1, 3}).contiguous(),
          padded_scale.view({blocks, kBlockOutputs, groups}).permute({0, 2, 1}).contiguous()};
}

// input [T, in] (fp32, bf16 or fp16) times the [out_features, in] int8 weight packed by int8_pack_weight, plus fp32
// bias [out_features] (an empty tensor: none) -> [T, out_features] in the input's dtype
torch::Tensor int8_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor packed_scale, torch::Tensor bias,
                          int64_t out_features) {
  TORCH_CHECK(input.device().is_cpu() && input.dim() == 2, "int8_linear: input must be a 2-D CPU tensor");
  const int64_t in = input.size(1), rows = input.size(0), blocks = blocks_of(out_features), groups = groups_of(in);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == blocks && packed.size(1) == groups * kChunksPerGroup &&
                  packed.size(2) == kBlockOutputs && packed.size(3) == kChunk,
              "int8_linear: packed must be int8_pack_weight's layout of a [", out_features, ", ", in, "] weight");
  TORCH_CHECK(packed_scale.scalar_type() == at::kFloat && packed_scale.is_contiguous() &&
                  packed_scale.numel() == blocks * groups * kBlockOutputs,
              "int8_linear: packed_scale must be int8_pack_weight's scales of a [", out_features, ", ", in,
              "] weight");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == out_features &&
                                    bias.is_contiguous()),
              "int8_linear: bias must be empty or ", out_features, " contiguous fp32 values");
  const auto x = input.to(at::kFloat).contiguous();  // read once per pass, from cache
  auto out = torch::empty({rows, out_features}, input.options());
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* s = packed_scale.data_ptr<float>();
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "int8_linear", [&] {
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, kBlockGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        linear_chunk(x.data_ptr<float>() + r * in, std::min(kMaxRows, rows - r), in, w, s, b,
                     y + r * out_features, out_features, begin, end);
      }
    });
  });
  return out;
}
