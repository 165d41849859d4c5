// An fp32 linear layer over fp16 weights (F16C widens them in registers), for fp32 models on CPUs without fast
// bf16, over a weight packed once so that every call reads it in one sequential pass. At a few rows a decode step is
// bound by reading the weights, and fp16 halves fp32's bytes; fbgemm's fp16 GEMM, which did this before, reads them
// more slowly (ratios per row count in engine/models/cpu_packing.py). The same layout serves many rows (prefill,
// large batches): each block of weights stays in L2 while all the rows pass over it, so the model holds one copy of
// its weights. AVX2 (8 lanes, 16 registers) or AVX-512 (16 lanes, 32 registers), by intrinsics.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_FP16_LINEAR 1
#endif

// One translation unit with the other kernels (cpu_extension.py): this file's names live in their own namespace.
namespace fp16_kernel {

// the vector width's intrinsics: SIMD(fmadd_ps) is _mm512_fmadd_ps or _mm256_fmadd_ps
#if defined(PAGEDSERVE_FP16_LINEAR) && defined(__AVX512F__)
#define SIMD(name) _mm512_##name
using Vec = __m512;
using HalfBits = __m256i;  // the fp16 bits of one vector
constexpr int64_t kLanes = 16;
constexpr int64_t kManyRows = 12;  // rows per pass over one block: 24 accumulators, 2 weight vectors, a broadcast
constexpr int64_t kFewRows = 6;    // up to these rows a pass takes two blocks: 24 accumulators, 4 weight vectors
#elif defined(PAGEDSERVE_FP16_LINEAR)
#define SIMD(name) _mm256_##name
using Vec = __m256;
using HalfBits = __m128i;
constexpr int64_t kLanes = 8;
constexpr int64_t kManyRows = 6;  // 12 accumulators, 2 weight vectors, a broadcast: 15 of the 16 registers
constexpr int64_t kFewRows = 2;   // 8 accumulators, 4 weight vectors, a broadcast
#else
constexpr int64_t kLanes = 8;  // the layout's width where the kernel is absent (fp16_pack_weight still packs)
#endif

#if defined(PAGEDSERVE_FP16_LINEAR)
inline Vec widen(const uint16_t* from) {
  HalfBits bits;
  std::memcpy(&bits, from, sizeof bits);  // an unaligned load (the compiler folds it into vcvtph2ps)
  return SIMD(cvtph_ps)(bits);
}
inline Vec broadcast(float value) { return SIMD(set1_ps)(value); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return SIMD(fmadd_ps)(a, b, c); }
inline Vec zero() { return SIMD(setzero_ps)(); }
inline Vec load(const float* from) { return SIMD(loadu_ps)(from); }
inline Vec add(Vec a, Vec b) { return SIMD(add_ps)(a, b); }
inline void store(float* to, Vec v) { SIMD(storeu_ps)(to, v); }
#endif

// [ceil(out / kBlockOutputs), in, kBlockOutputs]: blocks of output channels, each block's weights feature by feature
// (the block's outputs side by side, two vectors of them), zero-padded
constexpr int64_t kBlockOutputs = 2 * kLanes;

int64_t blocks_of(int64_t out) { return (out + kBlockOutputs - 1) / kBlockOutputs; }

#if defined(PAGEDSERVE_FP16_LINEAR)
// For R rows (row r at x + r * in, `in` features) and B adjacent blocks: y[r][first + o] = the products for the
// pass's outputs (plus bias), `outputs` of them valid. Each feature of a row is broadcast to all lanes and multiplied
// into the blocks' weight vectors of that feature.
template <int64_t R, int64_t B>
void block_pass(const float* x, const uint16_t* weights, int64_t in, const float* bias,
                int64_t first, int64_t outputs, float* y, int64_t out_features) {
  constexpr int64_t V = 2 * B;
  Vec sums[R][V];
#pragma GCC unroll 12
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < V; ++v) sums[r][v] = zero();
  }
  const int64_t block_elements = in * kBlockOutputs;
  for (int64_t k = 0; k < in; ++k) {
    Vec w[V];
#pragma GCC unroll 4
    for (int64_t v = 0; v < V; ++v) {
      w[v] = widen(weights + (v / 2) * block_elements + k * kBlockOutputs + (v % 2) * kLanes);
    }
#pragma GCC unroll 12
    for (int64_t r = 0; r < R; ++r) {
      const Vec row = broadcast(x[r * in + k]);
#pragma GCC unroll 4
      for (int64_t v = 0; v < V; ++v) sums[r][v] = fmadd(row, w[v], sums[r][v]);
    }
  }
  for (int64_t v = 0; v < V; ++v) {
    const int64_t lanes = std::clamp<int64_t>(outputs - v * kLanes, 0, kLanes);
    if (lanes == 0) break;
    float b[kLanes] = {};
    if (bias != nullptr) std::memcpy(b, bias + first + v * kLanes, lanes * sizeof(float));
    for (int64_t r = 0; r < R; ++r) {
      float* to = y + r * out_features + first + v * kLanes;
      if (lanes == kLanes) {
        store(to, add(sums[r][v], load(b)));
      } else {
        float tail[kLanes];
        store(tail, add(sums[r][v], load(b)));
        std::memcpy(to, tail, lanes * sizeof(float));
      }
    }
  }
}

// block_pass for `rows` rows, 1 to R: only those are instantiated
template <int64_t B, int64_t R>
void rows_pass(int64_t rows, const float* x, int64_t in, const uint16_t* weights, const float* bias, int64_t first,
               int64_t outputs, float* y, int64_t out_features) {
  if constexpr (R > 1) {
    if (rows < R) return rows_pass<B, R - 1>(rows, x, in, weights, bias, first, outputs, y, out_features);
  }
  block_pass<R, B>(x, weights, in, bias, first, outputs, y, out_features);
}

// every row through B adjacent blocks starting at `block`, R rows a pass: the blocks' later passes read them from L2
template <int64_t B, int64_t R>
void rows_through_blocks(int64_t block, int64_t rows, const float* x, int64_t in, const uint16_t* w,
                         const float* bias, float* y, int64_t out_features) {
  const uint16_t* weights = w + block * in * kBlockOutputs;
  const int64_t first = block * kBlockOutputs, outputs = std::min(B * kBlockOutputs, out_features - first);
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    rows_pass<B, R>(std::min(R, rows - r0), x + r0 * in, in, weights, bias, first, outputs, y + r0 * out_features,
                    out_features);
  }
}
#endif

// whether this build has fp16_linear: the CPU (and the compiler) have AVX2, F16C and FMA
bool has_fp16_linear() {
#if defined(PAGEDSERVE_FP16_LINEAR)
  return true;
#else
  return false;
#endif
}

// An fp16 weight [out, in] in the layout fp16_linear reads: [ceil(out / kBlockOutputs), in, kBlockOutputs],
// zero-padded
torch::Tensor fp16_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.scalar_type() == at::kHalf && weight.dim() == 2, "fp16_pack_weight: weight must be 2-D fp16");
  const int64_t out = weight.size(0), in = weight.size(1), blocks = blocks_of(out);
  auto padded = torch::zeros({blocks * kBlockOutputs, in}, weight.options().device(at::kCPU));
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({blocks, kBlockOutputs, in}).permute({0, 2, 1}).contiguous();
}

// input [T, in_features] (fp32) times the [out_features, in_features] weight packed by fp16_pack_weight, plus fp32
// bias [out_features] (an empty tensor: none) -> [T, out_features] fp32, summed in fp32 feature by feature
torch::Tensor fp16_linear(torch::Tensor input, torch::Tensor packed, torch::Tensor bias, int64_t in_features,
                          int64_t out_features) {
  TORCH_CHECK(input.device().is_cpu() && input.dim() == 2 && input.scalar_type() == at::kFloat,
              "fp16_linear: input must be a 2-D fp32 CPU tensor, got ", input.dim(), "-D ", input.scalar_type());
  TORCH_CHECK(input.size(1) == in_features, "fp16_linear: input has ", input.size(1), " features, the weight takes ",
              in_features);
  const int64_t rows = input.size(0), blocks = blocks_of(out_features);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kHalf && packed.is_contiguous() &&
                  packed.dim() == 3 && packed.size(0) == blocks && packed.size(1) == in_features &&
                  packed.size(2) == kBlockOutputs,
              "fp16_linear: packed must be fp16_pack_weight's layout of a [", out_features, ", ", in_features,
              "] weight");
  TORCH_CHECK(bias.device().is_cpu() && (bias.numel() == 0 || (bias.scalar_type() == at::kFloat &&
                                                               bias.numel() == out_features && bias.is_contiguous())),
              "fp16_linear: bias must be empty or ", out_features, " contiguous fp32 CPU values");
#if defined(PAGEDSERVE_FP16_LINEAR)
  ReleasedGil released_gil;
  const auto x = input.contiguous();
  auto out = torch::empty({rows, out_features}, input.options());
  const float* xs = x.data_ptr<float>();
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>());
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  // each thread takes a run of blocks (pairs of them for few rows): a run stays in L2 while every row passes over it
  if (rows <= kFewRows) {
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = 2 * begin; block < std::min(2 * end, blocks); block += 2) {
        if (block + 1 < blocks) {
          rows_through_blocks<2, kFewRows>(block, rows, xs, in_features, w, b, y, out_features);
        } else {
          rows_through_blocks<1, kFewRows>(block, rows, xs, in_features, w, b, y, out_features);
        }
      }
    });
  } else {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t block = begin; block < end; ++block) {
        rows_through_blocks<1, kManyRows>(block, rows, xs, in_features, w, b, y, out_features);
      }
    });
  }
  return out;
#else
  TORCH_CHECK(false, "fp16_linear: this build has no AVX2 with F16C and FMA (the CPU lacks them)");
#endif
}

}  // namespace fp16_kernel
#undef SIMD

using fp16_kernel::fp16_linear;
using fp16_kernel::fp16_pack_weight;
using fp16_kernel::has_fp16_linear;
