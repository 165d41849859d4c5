// A bf16 linear layer for CPUs with AVX512-BF16 (its `vdpbf16ps` multiplies pairs of bf16 and sums them into fp32),
// over a weight packed once so that every call reads it in one sequential pass. At a few rows a decode step is bound
// by reading the weights: oneDNN's packed bf16 read SmolLM2's at 16-23 GB/s inside a step, this kernel at 45-48 on the
// same 2-vCPU Zen 4 (its ratios to oneDNN per row count are in engine/models/cpu_packing.py). The same
// layout serves many rows (prefill, large batches): each block of weights stays in L2 while all the rows pass over it,
// so the model holds one copy of its weights.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

// One translation unit with the other kernels (cpu_extension.py): this file's names live in their own namespace.
namespace bf16_kernel {

// [ceil(out / 32), ceil(in / 2), 32, 2]: blocks of kBlockOutputs output channels, each block's weights feature pair
// by feature pair (the 32 outputs' two weights of a pair side by side, as vdpbf16ps takes them), zero-padded
constexpr int64_t kBlockOutputs = 32;
constexpr int64_t kVectors = kBlockOutputs / 16;  // fp32 vectors per row of a block

int64_t blocks_of(int64_t out) { return (out + kBlockOutputs - 1) / kBlockOutputs; }
int64_t pairs_of(int64_t in) { return (in + 1) / 2; }

#if defined(__AVX512BF16__)
// Up to a few rows one pass takes one block and up to 12 rows (12 x 2 vectors of accumulators, 2 of weights: 26 of
// the 32 registers); with more rows, two blocks side by side and 6 rows, which loads fewer rows' pairs per product
// (3-4% faster at 256-512 rows on a Zen 4)
constexpr int64_t kFewRows = 12;
constexpr int64_t kManyRows = 6;

// For R rows (each `pairs` bf16 pairs, row r at x + 2 * r * stride) and B adjacent blocks of weights: sums[r][v] =
// the products for the passes's outputs 16 v to 16 v + 15, as fp32 vectors. Each pair of a row is broadcast to all
// lanes and multiplied into every vector of the blocks' pair.
template <int64_t R, int64_t B>
void block_pass(const at::BFloat16* x, int64_t stride, const uint16_t* weights, int64_t pairs,
                __m512 (&sums)[R][B * kVectors]) {
  constexpr int64_t V = B * kVectors;
#pragma GCC unroll 12
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < V; ++v) sums[r][v] = _mm512_setzero_ps();
  }
  const int64_t block_elements = pairs * kBlockOutputs * 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[V];
#pragma GCC unroll 4
    for (int64_t v = 0; v < V; ++v) {
      const int64_t block = v / kVectors, lane0 = (v % kVectors) * 16;
      w[v] = (__m512bh)_mm512_loadu_si512(weights + block * block_elements + (p * kBlockOutputs + lane0) * 2);
    }
#pragma GCC unroll 12
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh row = (__m512bh)_mm512_set1_epi32(pair_bits(x + 2 * (r * stride + p)));
#pragma GCC unroll 4
      for (int64_t v = 0; v < V; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], row, w[v]);
    }
  }
}

// y[r][first + o] = bf16(sums[r][o / 16] + bias) for the pass's `outputs` valid outputs
template <int64_t R, int64_t V>
void store_sums(const __m512 (&sums)[R][V], const float* bias, int64_t first, int64_t outputs, at::BFloat16* y,
                int64_t out_features) {
  for (int64_t v = 0; v < V; ++v) {
    const int64_t lanes = std::clamp<int64_t>(outputs - v * 16, 0, 16);
    if (lanes == 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + first + v * 16) : _mm512_setzero_ps();
    for (int64_t r = 0; r < R; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(sums[r][v], b));
      _mm256_mask_storeu_epi16(y + r * out_features + first + v * 16, mask, (__m256i)rounded);
    }
  }
}

// block_pass and store_sums for `rows` rows, 1 to R: only those are instantiated
template <int64_t B, int64_t R>
void rows_through_blocks(int64_t rows, const at::BFloat16* x, int64_t stride, const uint16_t* weights, int64_t pairs,
                         const float* bias, int64_t first, int64_t outputs, at::BFloat16* y, int64_t out_features) {
  if constexpr (R > 1) {
    if (rows < R) {
      return rows_through_blocks<B, R - 1>(rows, x, stride, weights, pairs, bias, first, outputs, y, out_features);
    }
  }
  __m512 sums[R][B * kVectors];
  block_pass<R, B>(x, stride, weights, pairs, sums);
  store_sums<R, B * kVectors>(sums, bias, first, outputs, y, out_features);
}

// every row through B adjacent blocks starting at `block`, R rows a pass
template <int64_t B, int64_t R>
void all_rows_through_blocks(int64_t block, int64_t rows, const at::BFloat16* x, int64_t pairs, const uint16_t* w,
                             const float* bias, at::BFloat16* y, int64_t out_features) {
  const uint16_t* weights = w + block * pairs * kBlockOutputs * 2;
  const int64_t first = block * kBlockOutputs, outputs = std::min(B * kBlockOutputs, out_features - first);
  for (int64_t r0 = 0; r0 < rows; r0 += R) {  // the blocks' later passes read them from L2
    rows_through_blocks<B, R>(std::min(R, rows - r0), x + 2 * r0 * pairs, pairs, weights, pairs, bias, first, outputs,
                              y + r0 * out_features, out_features);
  }
}
#endif

// whether this build has bf16_linear: the CPU (and the compiler) have AVX512-BF16
bool has_bf16_linear() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// A bf16 weight [out, in] in the layout bf16_linear reads: [ceil(out / 32), ceil(in / 2), 32, 2], zero-padded
torch::Tensor bf16_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "bf16_pack_weight: weight must be 2-D bf16");
  const int64_t out = weight.size(0), in = weight.size(1), blocks = blocks_of(out), pairs = pairs_of(in);
  auto padded = torch::zeros({blocks * kBlockOutputs, pairs * 2}, weight.options().device(at::kCPU));
  padded.narrow(0, 0, out).narrow(1, 0, in).copy_(weight);
  return padded.view({blocks, kBlockOutputs, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

// input [T, in_features] (bf16) times the [out_features, in_features] bf16 weight packed by bf16_pack_weight, plus
// fp32 bias [out_features] (an empty tensor: none) -> [T, out_features] bf16, summed in fp32 and rounded once
torch::Tensor bf16_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor bias, int64_t in_features,
                          int64_t out_features) {
  TORCH_CHECK(input.device().is_cpu() && input.dim() == 2 && input.scalar_type() == at::kBFloat16,
              "bf16_linear: input must be a 2-D bf16 CPU tensor, got ", input.dim(), "-D ", input.scalar_type());
  TORCH_CHECK(input.size(1) == in_features, "bf16_linear: input has ", input.size(1), " features, the weight takes ",
              in_features);
  const int64_t rows = input.size(0), blocks = blocks_of(out_features), pairs = pairs_of(in_features);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.dim() == 4 && packed.size(0) == blocks && packed.size(1) == pairs &&
                  packed.size(2) == kBlockOutputs && packed.size(3) == 2,
              "bf16_linear: packed must be bf16_pack_weight's layout of a [", out_features, ", ", in_features,
              "] weight");
  TORCH_CHECK(bias.device().is_cpu() && (bias.numel() == 0 || (bias.scalar_type() == at::kFloat &&
                                                               bias.numel() == out_features && bias.is_contiguous())),
              "bf16_linear: bias must be empty or ", out_features, " contiguous fp32 CPU values");
#if defined(__AVX512BF16__)
  // rows read as bf16 pairs: an odd width gets a zero column (its weights' padding is zero too)
  ReleasedGil released_gil;
  const auto x = in_features % 2 == 0 ? input.contiguous() : torch::constant_pad_nd(input, {0, 1});
  auto out = torch::empty({rows, out_features}, input.options());
  const at::BFloat16* xs = x.data_ptr<at::BFloat16>();
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  // each thread takes a run of blocks (pairs of them for many rows): a run stays in L2 while every row passes over it
  if (rows <= kFewRows) {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) {
        all_rows_through_blocks<1, kFewRows>(block, rows, xs, pairs, w, b, y, out_features);
      }
    });
  } else {
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = 2 * begin; block < std::min(2 * end, blocks); block += 2) {
        if (block + 1 < blocks) {
          all_rows_through_blocks<2, kManyRows>(block, rows, xs, pairs, w, b, y, out_features);
        } else {
          all_rows_through_blocks<1, kManyRows>(block, rows, xs, pairs, w, b, y, out_features);
        }
      }
    });
  }
  return out;
#else
  TORCH_CHECK(false, "bf16_linear: this build has no AVX512-BF16 (the CPU lacks it): use oneDNN's bf16 linear");
#endif
}

}  // namespace bf16_kernel

using bf16_kernel::bf16_linear;
using bf16_kernel::bf16_pack_weight;
using bf16_kernel::has_bf16_linear;
