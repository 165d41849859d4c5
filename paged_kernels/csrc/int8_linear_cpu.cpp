// A linear layer over a few token rows with int8 weights (one fp32 scale per 32 weights of an output channel, as
// llama.cpp's Q8_0), read at memory speed. A decode step at one to a few rows is bound by reading the weights:
// int8 halves bf16's bytes. oneDNN's and torch's int8 kernels do not reach that speed at so few rows (see
// engine/models/quantization.py), so this one widens each weight to fp32 in registers, scales it and multiplies
// the rows in fp32 (no activation quantization: the result is the fp32 product with the dequantized weight, up
// to summation order). AVX-512 and AVX2 by intrinsics (GCC did not vectorize the plain loops well: 12x slower
// than the AVX2 intrinsics); plain loops elsewhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <tuple>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// The weights are packed for one sequential read: blocks of kBlockOutputs output channels, each block's rows
// interleaved in chunks of kChunk features: [ceil(out / 4), ceil(in / 32) * 2, 4, 16], zero-padded; the scales
// of a block follow its groups: [ceil(out / 4), ceil(in / 32), 4] (int8_pack_weight). The rows are read
// zero-padded to whole groups too, so that no load needs a mask.
constexpr int64_t kBlockOutputs = 4;
constexpr int64_t kChunk = 16;
constexpr int64_t kGroup = 32;  // weights per scale
constexpr int64_t kChunksPerGroup = kGroup / kChunk;
constexpr int64_t kBlockBytes = kBlockOutputs * kGroup;  // one group of a block's 4 outputs
constexpr int64_t kBlockGrain = 16;  // output blocks per parallel task: a few KiB of weights at least

int64_t groups_of(int64_t in) { return (in + kGroup - 1) / kGroup; }
int64_t blocks_of(int64_t out) { return (out + kBlockOutputs - 1) / kBlockOutputs; }

#if defined(__AVX512F__)
// the rows one pass over a block multiplies (its accumulators fill the 32 vector registers); more rows take more
// passes over the block, from L1
constexpr int64_t kRowsPerPass = 4;

// sums[j * R + r] = dot(x[r], w[j] * scale[j]) for a block's 4 outputs and R rows of padded length `stride`: each
// 16 weights are widened to fp32 (vpmovsxbd, vcvtdq2ps) once, then multiplied into all R rows. Up to 2 rows a
// group's products are summed unscaled and scaled once per group (at 1 row the widening and scaling are the time:
// 7% faster); more rows scale each 16 weights once for all rows, as partial sums for 4 outputs x 3-4 rows would
// not fit in the registers beside the accumulators.
template <int64_t R>
void block_sums(const float* x, int64_t stride, const int8_t* weights, const float* scales, int64_t groups,
                float* sums) {
  constexpr bool kPartialSums = R <= 2;
  __m512 acc[kBlockOutputs * R];
  __m512 partial[kBlockOutputs * R];
#pragma GCC unroll 16
  for (int64_t i = 0; i < kBlockOutputs * R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 scale[kBlockOutputs];
#pragma GCC unroll 4
    for (int64_t j = 0; j < kBlockOutputs; ++j) scale[j] = _mm512_set1_ps(scales[g * kBlockOutputs + j]);
#pragma GCC unroll 16
    for (int64_t i = 0; i < kBlockOutputs * R; ++i) partial[i] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t h = 0; h < kChunksPerGroup; ++h) {
      const int8_t* chunk = weights + g * kBlockBytes + h * kBlockOutputs * kChunk;
      __m512 rows[R];
#pragma GCC unroll 4
      for (int64_t r = 0; r < R; ++r) rows[r] = _mm512_loadu_ps(x + r * stride + g * kGroup + h * kChunk);
#pragma GCC unroll 4
      for (int64_t j = 0; j < kBlockOutputs; ++j) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + j * kChunk));
        const __m512 wf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(packed));
        if constexpr (kPartialSums) {
#pragma GCC unroll 4
          for (int64_t r = 0; r < R; ++r) partial[j * R + r] = _mm512_fmadd_ps(wf, rows[r], partial[j * R + r]);
        } else {
          const __m512 scaled = _mm512_mul_ps(wf, scale[j]);
#pragma GCC unroll 4
          for (int64_t r = 0; r < R; ++r) acc[j * R + r] = _mm512_fmadd_ps(scaled, rows[r], acc[j * R + r]);
        }
      }
    }
    if constexpr (kPartialSums) {
#pragma GCC unroll 4
      for (int64_t j = 0; j < kBlockOutputs; ++j) {
#pragma GCC unroll 4
        for (int64_t r = 0; r < R; ++r) acc[j * R + r] = _mm512_fmadd_ps(partial[j * R + r], scale[j], acc[j * R + r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int64_t i = 0; i < kBlockOutputs * R; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kRowsPerPass = 2;  // 16 vector registers: 4 outputs x 2 rows of accumulators, 4 scales, rows

// the horizontal sum of 8 floats
inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// the AVX-512 path's sums, 8 weights at a time, each widened and scaled once for all R rows
template <int64_t R>
void block_sums(const float* x, int64_t stride, const int8_t* weights, const float* scales, int64_t groups,
                float* sums) {
  __m256 acc[kBlockOutputs * R];
#pragma GCC unroll 8
  for (int64_t i = 0; i < kBlockOutputs * R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 scale[kBlockOutputs];
#pragma GCC unroll 4
    for (int64_t j = 0; j < kBlockOutputs; ++j) scale[j] = _mm256_set1_ps(scales[g * kBlockOutputs + j]);
#pragma GCC unroll 4
    for (int64_t q = 0; q < kGroup / 8; ++q) {  // the group's 4 runs of 8 features: 2 chunks, 2 halves each
      const int8_t* run = weights + g * kBlockBytes + (q / 2) * kBlockOutputs * kChunk + (q % 2) * 8;
      __m256 rows[R];
#pragma GCC unroll 2
      for (int64_t r = 0; r < R; ++r) rows[r] = _mm256_loadu_ps(x + r * stride + g * kGroup + q * 8);
#pragma GCC unroll 4
      for (int64_t j = 0; j < kBlockOutputs; ++j) {
        const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(run + j * kChunk));
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(packed)), scale[j]);
#pragma GCC unroll 2
        for (int64_t r = 0; r < R; ++r) acc[j * R + r] = _mm256_fmadd_ps(scaled, rows[r], acc[j * R + r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int64_t i = 0; i < kBlockOutputs * R; ++i) sums[i] = sum_lanes(acc[i]);
}
#else
constexpr int64_t kRowsPerPass = 1;

// the same sums in plain loops, for CPUs without AVX2
template <int64_t R>
void block_sums(const float* x, int64_t stride, const int8_t* weights, const float* scales, int64_t groups,
                float* sums) {
  for (int64_t j = 0; j < kBlockOutputs; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      float sum = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float part = 0.f;
        for (int64_t h = 0; h < kChunksPerGroup; ++h) {
          const int8_t* w = weights + g * kBlockBytes + h * kBlockOutputs * kChunk + j * kChunk;
          const float* row = x + r * stride + g * kGroup + h * kChunk;
#pragma omp simd reduction(+ : part)
          for (int64_t i = 0; i < kChunk; ++i) part += static_cast<float>(w[i]) * row[i];
        }
        sum += part * scales[g * kBlockOutputs + j];
      }
      sums[j * R + r] = sum;
    }
  }
}
#endif

// block_sums for `rows` rows, 1 to R (kRowsPerPass): only those are instantiated
template <int64_t R = kRowsPerPass>
void block_sums_for(int64_t rows, const float* x, int64_t stride, const int8_t* weights, const float* scales,
                    int64_t groups, float* sums) {
  if constexpr (R > 1) {
    if (rows < R) return block_sums_for<R - 1>(rows, x, stride, weights, scales, groups, sums);
  }
  block_sums<R>(x, stride, weights, scales, groups, sums);
}

}  // namespace

// An int8 weight [out, in] and its fp32 scales [out, ceil(in / 32)] zero-padded to `block_outputs` rows and whole
// groups of 32 and packed by blocks: (weights [blocks, ceil(in / width), block_outputs, width], each block's rows
// interleaved by runs of `width` features; scales [blocks, ceil(in / 32), block_outputs]). int8_pack_weight's and
// int8_vnni_pack_weight's layouts; `name` is the caller's, for its errors.
std::tuple<torch::Tensor, torch::Tensor> pack_int8_blocks(const char* name, const torch::Tensor& weight,
                                                          const torch::Tensor& scale, int64_t block_outputs,
                                                          int64_t width) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, name, ": weight must be 2-D int8");
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t blocks = (out + block_outputs - 1) / block_outputs, groups = groups_of(in);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.size(0) == out &&
                  scale.size(1) == groups,
              name, ": scale must be fp32 [", out, ", ", groups, "] (one per 32 weights of a row)");
  auto padded = torch::zeros({blocks * block_outputs, groups * kGroup}, weight.options());
  padded.narrow(0, 0, out).narrow(1, 0, in).copy_(weight);
  auto padded_scale = torch::zeros({blocks * block_outputs, groups}, scale.options());
  padded_scale.narrow(0, 0, out).copy_(scale);
  return {padded.view({blocks, block_outputs, groups * kGroup / width, width}).permute({0, 2, 1, 3}).contiguous(),
          padded_scale.view({blocks, block_outputs, groups}).permute({0, 2, 1}).contiguous()};
}

// The checks int8_linear and int8_vnni_linear share (`name`: the caller's; `pack_name`: the function that packed the
// weight it takes): a 2-D fp32/bf16/fp16 CPU input of in_features, pack_int8_blocks' layout of an [out_features,
// in_features] weight in blocks of `block_outputs` and runs of `width`, and an empty or fp32 bias.
void check_int8_linear_args(const char* name, const char* pack_name, const torch::Tensor& input,
                            const torch::Tensor& packed, const torch::Tensor& packed_scale, const torch::Tensor& bias,
                            int64_t in_features, int64_t out_features, int64_t block_outputs, int64_t width) {
  TORCH_CHECK(input.device().is_cpu() && input.dim() == 2, name, ": input must be a 2-D CPU tensor");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16 ||
                  input.scalar_type() == at::kHalf,
              name, ": input must be fp32, bf16 or fp16, got ", input.scalar_type());
  TORCH_CHECK(input.size(1) == in_features, name, ": input has ", input.size(1), " features, the weight takes ",
              in_features);
  TORCH_CHECK(packed.device().is_cpu() && packed_scale.device().is_cpu() && bias.device().is_cpu(), name,
              ": packed, packed_scale and bias must be CPU tensors");
  const int64_t blocks = (out_features + block_outputs - 1) / block_outputs, groups = groups_of(in_features);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == blocks && packed.size(1) == groups * kGroup / width &&
                  packed.size(2) == block_outputs && packed.size(3) == width,
              name, ": packed must be ", pack_name, "'s layout of a [", out_features, ", ", in_features, "] weight");
  TORCH_CHECK(packed_scale.scalar_type() == at::kFloat && packed_scale.is_contiguous() &&
                  packed_scale.numel() == blocks * groups * block_outputs,
              name, ": packed_scale must be ", pack_name, "'s scales of a [", out_features, ", ", in_features,
              "] weight");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == out_features &&
                                    bias.is_contiguous()),
              name, ": bias must be empty or ", out_features, " contiguous fp32 values");
}

// An int8 weight [out, in] and its fp32 scales [out, ceil(in / 32)] (one per 32 weights of a row) in the blocked
// layout int8_linear reads: (weights [ceil(out / 4), ceil(in / 32) * 2, 4, 16], scales [ceil(out / 4),
// ceil(in / 32), 4]), zero-padded
std::tuple<torch::Tensor, torch::Tensor> int8_pack_weight(torch::Tensor weight, torch::Tensor scale) {
  return pack_int8_blocks("int8_pack_weight", weight, scale, kBlockOutputs, kChunk);
}

// input [T, in_features] (fp32, bf16 or fp16) times the [out_features, in_features] int8 weight packed by
// int8_pack_weight, plus fp32 bias [out_features] (an empty tensor: none) -> [T, out_features] in the input's dtype
torch::Tensor int8_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor packed_scale, torch::Tensor bias,
                          int64_t in_features, int64_t out_features) {
  check_int8_linear_args("int8_linear", "int8_pack_weight", input, packed, packed_scale, bias, in_features,
                         out_features, kBlockOutputs, kChunk);
  const int64_t in = in_features, rows = input.size(0), blocks = blocks_of(out_features), groups = groups_of(in);
  const int64_t stride = groups * kGroup;  // the rows in fp32, zero-padded to whole groups; read from cache
  ReleasedGil released_gil;
  const auto x = stride == in ? input.to(at::kFloat).contiguous()
                              : torch::constant_pad_nd(input.to(at::kFloat), {0, stride - in});
  auto out = torch::empty({rows, out_features}, input.options());
  const float* xs = x.data_ptr<float>();
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* s = packed_scale.data_ptr<float>();
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  // fp64 was refused above; its instantiation is the dispatch macro's
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "int8_linear", [&] {
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, kBlockGrain, [&](int64_t begin, int64_t end) {
      float sums[kBlockOutputs * kRowsPerPass];
      for (int64_t block = begin; block < end; ++block) {
        const int8_t* weights = w + block * groups * kBlockBytes;
        const float* scales = s + block * groups * kBlockOutputs;
        const int64_t first = block * kBlockOutputs, outputs = std::min(kBlockOutputs, out_features - first);
        for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {  // a block's later passes read it from L1
          const int64_t pass = std::min(kRowsPerPass, rows - r0);
          block_sums_for(pass, xs + r0 * stride, stride, weights, scales, groups, sums);
          for (int64_t j = 0; j < outputs; ++j) {
            const float bj = b != nullptr ? b[first + j] : 0.f;
            for (int64_t r = 0; r < pass; ++r) {
              y[(r0 + r) * out_features + first + j] = from_float<scalar_t>(sums[j * pass + r] + bj);
            }
          }
        }
      }
    });
  });
  return out;
}
