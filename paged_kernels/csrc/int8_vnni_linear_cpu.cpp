// int8_linear's job (int8 weights, one fp32 scale per 32 weights of an output channel) for CPUs with AVX512-VNNI, by
// integer arithmetic: each row is quantized to int16 in groups of 32 features (one fp32 scale per group: the error is
// at most 2^-16 of the group's largest value, far below bf16's own rounding), the weights are widened to int16 and
// `vpdpwssd` sums pairs of int16 products into int32, which each group converts and scales once. That is about 3
// instructions per 32 weights where widening each weight to fp32 takes 8, so a row reads the int8 weights near the
// memory's speed (SmolLM2's linear layers at 1 row: 3.7 ms against 4.7 for int8_linear and 6.7 for bf16_linear on a
// Zen 4). The products are exact in int32 (|x| <= 32767, |w| <= 127: 32 products stay below 2^31).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

// One translation unit with the other kernels (cpu_extension.py): this file's names live in their own namespace.
namespace int8_vnni_kernel {

// [ceil(out / 64), ceil(in / 32) * 16, 64, 2]: blocks of 64 output channels, each block's weights feature pair by
// feature pair (the 64 outputs' two weights of a pair side by side, as vpdpwssd takes them after widening); scales
// [ceil(out / 64), ceil(in / 32), 64]; zero-padded
constexpr int64_t kBlockOutputs = 64;
constexpr int64_t kVectors = kBlockOutputs / 16;
// kGroup (32 weights per scale, here also 32 features per activation scale), groups_of, pack_int8_blocks and
// check_int8_linear_args are int8_linear_cpu.cpp's, earlier in the translation unit
constexpr int64_t kPairsPerGroup = kGroup / 2;
constexpr int64_t kRowsPerPass = 2;  // 2 rows x 4 vectors of int32 and of fp32 sums, 4 of weights: 20 registers
constexpr float kInt16Max = 32767.f;

int64_t blocks_of(int64_t out) { return (out + kBlockOutputs - 1) / kBlockOutputs; }

// a row's `in` values as int16 in groups of 32 (zero-padded to whole groups) and each group's scale (its largest
// magnitude / 32767; 0 for an all-zero group)
template <typename scalar_t>
void quantize_row(const scalar_t* row, int64_t in, int16_t* quantized, float* scales) {
  for (int64_t g = 0; g < groups_of(in); ++g) {
    const int64_t first = g * kGroup, count = std::min(kGroup, in - first);
    float largest = 0.f;
    for (int64_t k = 0; k < count; ++k) largest = std::max(largest, std::fabs(to_float(row[first + k])));
    const float inverse = largest > 0.f ? kInt16Max / largest : 0.f;
    scales[g] = largest / kInt16Max;
    for (int64_t k = 0; k < count; ++k) {
      quantized[first + k] = static_cast<int16_t>(std::nearbyint(to_float(row[first + k]) * inverse));
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// sums[r * 64 + o] = the block's output o for R rows (quantized row r at x + 2 * r * stride, its scales at x_scales +
// r * groups)
template <int64_t R>
void block_pass(const int16_t* x, int64_t stride, const float* x_scales, const int8_t* weights, const float* scales,
                int64_t groups, float* sums) {
  __m512 total[R][kVectors];
#pragma GCC unroll 2
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < kVectors; ++v) total[r][v] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i group[R][kVectors];
#pragma GCC unroll 2
    for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int64_t v = 0; v < kVectors; ++v) group[r][v] = _mm512_setzero_si512();
    }
    const int8_t* pairs = weights + g * kPairsPerGroup * kBlockOutputs * 2;
#pragma GCC unroll 4
    for (int64_t p = 0; p < kPairsPerGroup; ++p) {
      __m512i w[kVectors];
#pragma GCC unroll 4
      for (int64_t v = 0; v < kVectors; ++v) {
        const auto* chunk = reinterpret_cast<const __m256i*>(pairs + (p * kBlockOutputs + v * 16) * 2);
        w[v] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(chunk));
      }
#pragma GCC unroll 2
      for (int64_t r = 0; r < R; ++r) {
        const __m512i pair = _mm512_set1_epi32(pair_bits(x + 2 * (r * stride + g * kPairsPerGroup + p)));
#pragma GCC unroll 4
        for (int64_t v = 0; v < kVectors; ++v) group[r][v] = _mm512_dpwssd_epi32(group[r][v], w[v], pair);
      }
    }
#pragma GCC unroll 4
    for (int64_t v = 0; v < kVectors; ++v) {
      const __m512 weight_scale = _mm512_loadu_ps(scales + g * kBlockOutputs + v * 16);
#pragma GCC unroll 2
      for (int64_t r = 0; r < R; ++r) {
        const __m512 scale = _mm512_mul_ps(weight_scale, _mm512_set1_ps(x_scales[r * groups + g]));
        total[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(group[r][v]), scale, total[r][v]);
      }
    }
  }
#pragma GCC unroll 2
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < kVectors; ++v) _mm512_storeu_ps(sums + r * kBlockOutputs + v * 16, total[r][v]);
  }
}
#endif

// whether this build has int8_vnni_linear: the CPU (and the compiler) have AVX512-VNNI and AVX512-BW
bool has_int8_vnni_linear() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// An int8 weight [out, in] and its fp32 scales [out, ceil(in / 32)] in the layout int8_vnni_linear reads: (weights
// [ceil(out / 64), ceil(in / 32) * 16, 64, 2], scales [ceil(out / 64), ceil(in / 32), 64]), zero-padded
std::tuple<torch::Tensor, torch::Tensor> int8_vnni_pack_weight(torch::Tensor weight, torch::Tensor scale) {
  return pack_int8_blocks("int8_vnni_pack_weight", weight, scale, kBlockOutputs, 2);
}

// input [T, in_features] (fp32, bf16 or fp16) times the [out_features, in_features] int8 weight packed by
// int8_vnni_pack_weight, plus fp32 bias [out_features] (an empty tensor: none) -> [T, out_features] in the input's
// dtype
torch::Tensor int8_vnni_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor packed_scale,
                               torch::Tensor bias, int64_t in_features, int64_t out_features) {
  check_int8_linear_args("int8_vnni_linear", "int8_vnni_pack_weight", input, packed, packed_scale, bias,
                         in_features, out_features, kBlockOutputs, 2);
  const int64_t in = in_features, rows = input.size(0), blocks = blocks_of(out_features), groups = groups_of(in);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  ReleasedGil released_gil;
  const auto x = input.contiguous();
  auto out = torch::empty({rows, out_features}, input.options());
  const int64_t stride = groups * kPairsPerGroup;  // int16 pairs per quantized row
  std::vector<int16_t> quantized(rows * groups * kGroup, 0);
  std::vector<float> x_scales(rows * groups);
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* s = packed_scale.data_ptr<float>();
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  // fp64 was refused above; its instantiation is the dispatch macro's
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "int8_vnni_linear", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {
      quantize_row(xs + r * in, in, quantized.data() + r * groups * kGroup, x_scales.data() + r * groups);
    }
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      float sums[kRowsPerPass * kBlockOutputs];
      for (int64_t block = begin; block < end; ++block) {
        const int8_t* weights = w + block * groups * kGroup * kBlockOutputs;
        const float* scales = s + block * groups * kBlockOutputs;
        const int64_t first = block * kBlockOutputs, outputs = std::min(kBlockOutputs, out_features - first);
        for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {  // a block's later passes read it from L1 / L2
          const int64_t pass = std::min(kRowsPerPass, rows - r0);
          const int16_t* x_rows = quantized.data() + 2 * r0 * stride;
          const float* x_row_scales = x_scales.data() + r0 * groups;
          if (pass == 2) {
            block_pass<2>(x_rows, stride, x_row_scales, weights, scales, groups, sums);
          } else {
            block_pass<1>(x_rows, stride, x_row_scales, weights, scales, groups, sums);
          }
          for (int64_t r = 0; r < pass; ++r) {
            for (int64_t o = 0; o < outputs; ++o) {
              const float bo = b != nullptr ? b[first + o] : 0.f;
              y[(r0 + r) * out_features + first + o] = from_float<scalar_t>(sums[r * kBlockOutputs + o] + bo);
            }
          }
        }
      }
    });
  });
  return out;
#else
  TORCH_CHECK(false, "int8_vnni_linear: this build has no AVX512-VNNI (the CPU lacks it): use int8_linear");
#endif
}

}  // namespace int8_vnni_kernel

using int8_vnni_kernel::has_int8_vnni_linear;
using int8_vnni_kernel::int8_vnni_linear;
using int8_vnni_kernel::int8_vnni_pack_weight;
