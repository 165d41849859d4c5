// A bf16 linear layer for CPUs with AVX512-BF16 (its `vdpbf16ps` multiplies pairs of bf16 and sums them into fp32),
// over a weight packed once so that every call reads it in one sequential pass. At a few rows a decode step is bound
// by reading the weights: oneDNN's packed bf16 read SmolLM2's at 16-23 GB/s inside a step, this kernel at 45-48 on the
// same 2-vCPU Zen 4 (its ratios to oneDNN per row count are in engine/models/cpu_packing.py). The same
// layout serves many rows (prefill, large batches): each block of weights stays in L2 while all the rows pass over it,
// so the model holds one copy of its weights. Where the CPU also has AMX tiles, rows are multiplied in them at any
// row count, reading the same layout (AMX's B tiles take pairs of features as vdpbf16ps does).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define BF16_LINEAR_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
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
// A pass takes one block and up to 12 rows (12 x 2 vectors of accumulators, 2 of weights: 26 of the 32 registers);
// more rows take more passes, which read the block from L2
constexpr int64_t kBlockPassRows = 12;

// A pass of at least kReadAheadRows rows reads the weights this far ahead of the pair it multiplies into L2
// (prefetcht1). From about 6 rows a pass multiplies more per byte of weights than memory delivers (12 vdpbf16ps per
// 128 bytes), and the hardware prefetchers alone left it waiting on memory: the layer took about the time of reading
// its weights plus that of multiplying by all but its first pass's rows. SmolLM2's linear layers, weights from
// memory, paired in one process on a 2-vCPU Zen 4: 0.80-0.85x the time at 12-16 rows, 0.96-0.97x at 8; 1 and 2 KiB
// ahead were slower at 12 rows (1.6x, 1.2x of 4 KiB's time), 8 KiB 1.05x. With fewer rows a pass is bound by memory
// and reading ahead was 1.06-1.16x slower at 3-5 rows. With it, passes of 12 rows over one block beat the passes of
// 6 rows over two blocks side by side that took more than 12 rows before (fewer row pairs loaded per product):
// 0.89-0.92x the time at 25-48 rows, 0.95-0.98x at 64-2,048.
constexpr int64_t kReadAheadRows = 6;
constexpr int64_t kReadAheadBytes = 4096;

// For R rows (each `pairs` bf16 pairs, row r at x + 2 * r * stride) and one block of weights: sums[r][v] = the
// products for the block's outputs 16 v to 16 v + 15, as fp32 vectors. Each pair of a row is broadcast to all lanes
// and multiplied into both vectors of the block's pair.
template <int64_t R>
void block_pass(const at::BFloat16* x, int64_t stride, const uint16_t* weights, int64_t pairs,
                __m512 (&sums)[R][kVectors]) {
#pragma GCC unroll 12
  for (int64_t r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int64_t v = 0; v < kVectors; ++v) sums[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[kVectors];
#pragma GCC unroll 2
    for (int64_t v = 0; v < kVectors; ++v) {
      const uint16_t* vector = weights + (p * kBlockOutputs + v * 16) * 2;
      if constexpr (R >= kReadAheadRows) {  // a prefetch never faults, past the weights' end too (an address as an
        // integer: a pointer past the end of the weights would be undefined in C++)
        __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(vector) + kReadAheadBytes), 0, 2);
      }
      w[v] = (__m512bh)_mm512_loadu_si512(vector);
    }
#pragma GCC unroll 12
    for (int64_t r = 0; r < R; ++r) {
      const __m512bh row = (__m512bh)_mm512_set1_epi32(pair_bits(x + 2 * (r * stride + p)));
#pragma GCC unroll 2
      for (int64_t v = 0; v < kVectors; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], row, w[v]);
    }
  }
}

// The lanes of the 16 outputs from `output` on that hold one of the `outputs` valid ones (none past the last)
__mmask16 output_lanes(int64_t output, int64_t outputs) {
  return static_cast<__mmask16>((1u << std::clamp<int64_t>(outputs - output, 0, 16)) - 1);
}

// the bias of the lanes' outputs from `first` on (zeros without a bias)
__m512 bias_lanes(const float* bias, int64_t first, __mmask16 lanes) {
  return bias != nullptr ? _mm512_maskz_loadu_ps(lanes, bias + first) : _mm512_setzero_ps();
}

// y[lane] = bf16(sum[lane] + bias[lane]) for the set lanes
void store_rounded(__m512 sum, __m512 bias, __mmask16 lanes, at::BFloat16* y) {
  _mm256_mask_storeu_epi16(y, lanes, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum, bias)));
}

// y[r][first + o] = bf16(sums[r][o / 16] + bias) for the pass's `outputs` valid outputs
template <int64_t R>
void store_sums(const __m512 (&sums)[R][kVectors], const float* bias, int64_t first, int64_t outputs, at::BFloat16* y,
                int64_t out_features) {
  for (int64_t v = 0; v < kVectors; ++v) {
    const __mmask16 lanes = output_lanes(v * 16, outputs);
    if (lanes == 0) break;
    const __m512 b = bias_lanes(bias, first + v * 16, lanes);
    for (int64_t r = 0; r < R; ++r) store_rounded(sums[r][v], b, lanes, y + r * out_features + first + v * 16);
  }
}

// block_pass and store_sums for `rows` rows, 1 to R: only those are instantiated
template <int64_t R>
void rows_through_block(int64_t rows, const at::BFloat16* x, int64_t stride, const uint16_t* weights, int64_t pairs,
                        const float* bias, int64_t first, int64_t outputs, at::BFloat16* y, int64_t out_features) {
  if constexpr (R > 1) {
    if (rows < R) {
      return rows_through_block<R - 1>(rows, x, stride, weights, pairs, bias, first, outputs, y, out_features);
    }
  }
  __m512 sums[R][kVectors];
  block_pass<R>(x, stride, weights, pairs, sums);
  store_sums<R>(sums, bias, first, outputs, y, out_features);
}

// every row through the block `block`, kBlockPassRows rows a pass
void all_rows_through_block(int64_t block, int64_t rows, const at::BFloat16* x, int64_t pairs, const uint16_t* w,
                            const float* bias, at::BFloat16* y, int64_t out_features) {
  const uint16_t* weights = w + block * pairs * kBlockOutputs * 2;
  const int64_t first = block * kBlockOutputs, outputs = std::min(kBlockOutputs, out_features - first);
  for (int64_t r0 = 0; r0 < rows; r0 += kBlockPassRows) {  // the block's later passes read it from L2
    rows_through_block<kBlockPassRows>(std::min(kBlockPassRows, rows - r0), x + 2 * r0 * pairs, pairs, weights,
                                       pairs, bias, first, outputs, y + r0 * out_features, out_features);
  }
}
#endif

#if defined(BF16_LINEAR_AMX)
// AMX: tiles of 16 rows by 64 bytes. A tile of sums holds 16 rows x 16 outputs (fp32); a tile of rows, 16 rows x 32
// features; a tile of weights, 16 pairs x 16 outputs, which is half a block's row of pairs (128 bytes), so a block
// is two such tiles side by side, read at a stride of one block row. Each step multiplies 32 features.
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileFeatures = 32;
constexpr int64_t kBlockRowBytes = kBlockOutputs * 2 * 2;

// Linux gives a process AMX's tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); the
// permission holds for every thread of the process. torch's oneDNN asks too: asking again is harmless.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// LDTILECFG's 64 bytes: palette 1, and every tile used here (0-7) 64 bytes a row, 16 rows but in the sums and the
// features of the last row tile of a pass of `row_tiles` (1 or 2), which hold its `last_rows` (1-16): rows are read
// and written as they are, never padded
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};

  TileConfig(int64_t row_tiles, int64_t last_rows) {
    const auto last = static_cast<uint8_t>(last_rows);
    const int sums = 2 * (static_cast<int>(row_tiles) - 1), features = 4 + static_cast<int>(row_tiles) - 1;
    rows[sums] = rows[sums + 1] = rows[features] = last;
  }
};

// A pass's sums (32 rows x the block's 32 outputs, fp32) on their way to y as bf16: with more than a tile of rows,
// rounded and written a few rows at a time between the next pass's products, so that the vector unit rounds while the
// tiles multiply (oneDNN's AMX kernels interleave their tile stores likewise): 2-18% less time per layer at 32-2,048
// rows of SmolLM2's layers than writing each pass out after it (paired, 2-vCPU Emerald Rapids).
struct PassSums {
  alignas(64) float sums[2 * kTileRows][kBlockOutputs];
  at::BFloat16* y = nullptr;  // the pass's first row, at its block's first output
  int64_t out_features = 0, rows = 0, written = 0;
  __mmask16 low = 0, high = 0;
  __m512 bias_low = _mm512_setzero_ps(), bias_high = _mm512_setzero_ps();

  // round and write up to `count` more rows
  void write(int64_t count) {
    for (const int64_t end = std::min(rows, written + count); written < end; ++written) {
      at::BFloat16* row = y + written * out_features;
      store_rounded(_mm512_load_ps(&sums[written][0]), bias_low, low, row);
      if (high != 0) store_rounded(_mm512_load_ps(&sums[written][kTileRows]), bias_high, high, row + kTileRows);
    }
  }
};

// Tiles 0-3 sum (row tile g, half h) at 2g + h; tiles 4-5 hold row tiles 0-1's features, 6-7 the halves' weights.
// For G row tiles (rows at x, `x_stride` bf16 apart) through one block of weights (`pairs` pairs, a multiple of 16):
// into.sums[16 g + r][o] for the block's 32 outputs o (the rows the loaded shapes give each tile), while `earlier`
// (the pass before) is written out.
template <int G>
void amx_block_pass(const at::BFloat16* x, int64_t x_stride, const uint16_t* weights, int64_t pairs,
                    PassSums& earlier, PassSums& into) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (G == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_bytes = x_stride * 2, steps = pairs / (kTileFeatures / 2);
  const int64_t rows_per_step = (earlier.rows - earlier.written + steps - 1) / steps;
  for (int64_t pair = 0; pair < pairs; pair += kTileFeatures / 2) {
    const uint16_t* w = weights + pair * kBlockOutputs * 2;
    _tile_loadd(6, w, kBlockRowBytes);
    _tile_loadd(7, w + kTileRows * 2, kBlockRowBytes);
    _tile_loadd(4, x + 2 * pair, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (G == 2) {
      _tile_loadd(5, x + kTileRows * x_stride + 2 * pair, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (rows_per_step > 0) earlier.write(rows_per_step);
  }
  constexpr int64_t sums_bytes = kBlockOutputs * sizeof(float);
  _tile_stored(0, &into.sums[0][0], sums_bytes);
  _tile_stored(1, &into.sums[0][kTileRows], sums_bytes);
  if constexpr (G == 2) {
    _tile_stored(2, &into.sums[kTileRows][0], sums_bytes);
    _tile_stored(3, &into.sums[kTileRows][kTileRows], sums_bytes);
  }
}

// Rows a thread takes over its blocks at a time: as many whole passes as fit in kChunkBytes, so that the chunk stays
// in L2 while every block of the thread passes over it (and each block's weights stay in L1 over the chunk's passes).
// Without chunks, 2,048 rows (a prefill) were read again from L3 for every block: 1.6-1.9x oneDNN's time at 2,048
// rows, against 1.1-1.6x with chunks of 256 KiB to 1 MiB (SmolLM2's layers on a 2-vCPU Emerald Rapids).
constexpr int64_t kChunkBytes = 512 * 1024;
constexpr int64_t kPassRows = 2 * kTileRows;

// y = bf16(x W^T + bias) for `rows` rows at x, features a multiple of 32; each thread takes a run of blocks, and
// passes a chunk of rows at a time over them, 32 rows a pass (the last pass the rest, in tiles of its own shapes)
void amx_linear(const at::BFloat16* x, int64_t rows, int64_t in_features, const uint16_t* w, const float* bias,
                at::BFloat16* y, int64_t out_features) {
  const int64_t pairs = in_features / 2, passes = (rows + kPassRows - 1) / kPassRows, rest = rows % kPassRows;
  const int64_t chunk_passes = std::max<int64_t>(1, kChunkBytes / (in_features * 2 * kPassRows));
  // one tile of rows (a decode step's few) is written right after each pass: interleaved, 1-16 rows took 3-12% longer
  const bool interleave = rows > kTileRows;
  at::parallel_for(0, blocks_of(out_features), 1, [&](int64_t begin, int64_t end) {
    // the tiles' shapes are the thread's state: loaded when they change, released below
    const TileConfig whole(2, kTileRows), last(rest > kTileRows ? 2 : 1, rest > kTileRows ? rest - kTileRows : rest);
    const TileConfig* loaded = nullptr;
    PassSums sums[2];  // the pass in the tiles fills sums[done % 2] while sums[(done + 1) % 2] is written out
    sums[0].out_features = sums[1].out_features = out_features;
    int64_t done = 0;
    for (int64_t chunk = 0; chunk < passes; chunk += chunk_passes) {
      for (int64_t block = begin; block < end; ++block) {
        const uint16_t* weights = w + block * pairs * kBlockOutputs * 2;
        const int64_t first = block * kBlockOutputs, outputs = std::min(kBlockOutputs, out_features - first);
        const __mmask16 low = output_lanes(0, outputs), high = output_lanes(kTileRows, outputs);
        const __m512 bias_low = bias_lanes(bias, first, low), bias_high = bias_lanes(bias, first + kTileRows, high);
        for (int64_t pass = chunk; pass < std::min(passes, chunk + chunk_passes); ++pass, ++done) {
          const int64_t r0 = pass * kPassRows, pass_rows = std::min(kPassRows, rows - r0);
          const TileConfig& shapes = pass_rows == kPassRows ? whole : last;
          if (loaded != &shapes) _tile_loadconfig(loaded = &shapes);
          PassSums &into = sums[done % 2], &earlier = sums[(done + 1) % 2];
          if (pass_rows > kTileRows) {
            amx_block_pass<2>(x + r0 * in_features, in_features, weights, pairs, earlier, into);
          } else {
            amx_block_pass<1>(x + r0 * in_features, in_features, weights, pairs, earlier, into);
          }
          into.y = y + r0 * out_features + first;
          into.rows = pass_rows;
          into.written = 0;
          into.low = low;
          into.high = high;
          into.bias_low = bias_low;
          into.bias_high = bias_high;
          if (!interleave) into.write(kPassRows);
        }
      }
    }
    sums[(done + 1) % 2].write(kPassRows);  // the thread's last pass
    if (loaded != nullptr) _tile_release();
  });
}
#endif

// whether this build multiplies in AMX tiles (the CPU has AMX-BF16 and Linux lets the process use them)
bool has_amx_bf16_linear() {
#if defined(BF16_LINEAR_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

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
  ReleasedGil released_gil;
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
#if defined(BF16_LINEAR_AMX)
  // in AMX tiles, at any row count (even one row in a tile of its own is read from memory faster than by
  // vdpbf16ps: 0.81-0.85x oneDNN's time at 1-4 rows against 0.94-1.37x, benchmarks.linear_layers on a 2-vCPU
  // Emerald Rapids); whole steps of features
  if (rows > 0 && in_features > 0 && in_features % kTileFeatures == 0 && amx_permitted()) {
    const auto x = input.contiguous();
    auto out = torch::empty({rows, out_features}, input.options());
    amx_linear(x.data_ptr<at::BFloat16>(), rows, in_features, w, b, out.data_ptr<at::BFloat16>(), out_features);
    return out;
  }
#endif
  // rows read as bf16 pairs: an odd width gets a zero column (its weights' padding is zero too)
  const auto x = in_features % 2 == 0 ? input.contiguous() : torch::constant_pad_nd(input, {0, 1});
  auto out = torch::empty({rows, out_features}, input.options());
  const at::BFloat16* xs = x.data_ptr<at::BFloat16>();
  at::BFloat16* y = out.data_ptr<at::BFloat16>();
  // each thread takes a run of blocks: a block stays in L2 while every row passes over it
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      all_rows_through_block(block, rows, xs, pairs, w, b, y, out_features);
    }
  });
  return out;
#else
  TORCH_CHECK(false, "bf16_linear: this build has no AVX512-BF16 (the CPU lacks it): use oneDNN's bf16 linear");
#endif
}

}  // namespace bf16_kernel

using bf16_kernel::bf16_linear;
using bf16_kernel::bf16_pack_weight;
using bf16_kernel::has_amx_bf16_linear;
using bf16_kernel::has_bf16_linear;
