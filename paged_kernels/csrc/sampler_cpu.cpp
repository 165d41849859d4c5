// The sampler's draw for rows that only scale their logits by a temperature (engine/sampler.py's plain rows), in one
// pass or three over each row instead of about twenty torch ops over the whole vocabulary: 1 ms of a SmolLM2 step
// at one sequence on a 2-vCPU Zen 3, a tenth of the step. The same choice as the torch path's, token for token:
// the first maximum of the finite logits for greedy and degenerate rows, else the first token whose cumulative
// weight e^((logit - max) / T) passes the row's uniform draw times the total, searched over blocks of kScanBlock
// entries, then inside the block found. Sums run in another order than torch's, so a draw within rounding of a
// boundary between two tokens may take the other one.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kScanBlock = 256;  // engine/sampler.py's SCAN_BLOCK
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// the largest of `count` values, NaN and +inf counted as -inf; `masked`: whether one of them was a NaN or +inf.
// Lane by lane (GCC vectorizes selects, not a float max reduction, which it must keep in order)
inline float block_max(const float* x, int64_t count, bool& masked) {
  constexpr int64_t kLanes = 16;
  float tops[kLanes];
  int broken[kLanes];
  std::fill_n(tops, kLanes, kNegInf);
  std::fill_n(broken, kLanes, 0);
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
#pragma omp simd
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const float value = x[i + lane];
      const bool is_masked = !(value < std::numeric_limits<float>::infinity());
      broken[lane] |= is_masked;
      tops[lane] = !is_masked && value > tops[lane] ? value : tops[lane];
    }
  }
  for (; i < count; ++i) {
    const bool is_masked = !(x[i] < std::numeric_limits<float>::infinity());
    broken[0] |= is_masked;
    tops[0] = !is_masked && x[i] > tops[0] ? x[i] : tops[0];
  }
  float top = kNegInf;
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    top = std::max(top, tops[lane]);
    masked = masked || broken[lane] != 0;
  }
  return top;
}

// a row's first maximum over its finite logits (NaN and +inf count as -inf: token 0 where nothing is finite), and
// whether it holds a NaN or +inf; block by block, so that only the first block holding the maximum is searched
struct RowMax {
  float top;
  int64_t index;
  bool broken;
};

RowMax row_max(const float* x, int64_t vocab, std::vector<float>& block_tops) {
  const int64_t blocks = (vocab + kScanBlock - 1) / kScanBlock;
  block_tops.resize(blocks);
  bool broken = false;
  float top = kNegInf;
  for (int64_t b = 0; b < blocks; ++b) {
    block_tops[b] = block_max(x + b * kScanBlock, std::min(kScanBlock, vocab - b * kScanBlock), broken);
    top = std::max(top, block_tops[b]);
  }
  int64_t index = 0;
  if (top > kNegInf) {
    int64_t block = 0;
    while (block_tops[block] != top) ++block;
    index = block * kScanBlock;
    while (x[index] != top) ++index;
  }
  return {top, index, broken};
}

// the token drawn by inverse CDF at `uniform` (in [0, 1)) over the weights e^((x - top) * inverse_temperature)
// (`weights`: room for them), or -1 where they have no mass to draw from
int64_t draw(const float* x, int64_t vocab, float top, float inverse_temperature, float uniform,
             std::vector<float>& weights, std::vector<float>& block_sums) {
  weights.resize(vocab);
  float* w = weights.data();
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) w[i] = exp_nonpositive((x[i] - top) * inverse_temperature);
  const int64_t blocks = (vocab + kScanBlock - 1) / kScanBlock;
  block_sums.resize(blocks);
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = std::min(vocab, (b + 1) * kScanBlock);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = b * kScanBlock; i < end; ++i) sum += w[i];
    block_sums[b] = sum;
    total += sum;
  }
  if (!(total > 0.f) || !std::isfinite(total)) return -1;
  // strictly below the total, so the block found has weight; strictly below that block's own total, so the token
  // found has weight too (cumulative sums that never fall, as they add weights >= 0)
  const float target = std::min(uniform * total, std::nextafter(total, 0.f));
  int64_t block = 0;
  float before = 0.f;
  while (block < blocks - 1 && before + block_sums[block] <= target) before += block_sums[block++];
  const int64_t first = block * kScanBlock, end = std::min(vocab, first + kScanBlock);
  float inside_total = 0.f;
  for (int64_t i = first; i < end; ++i) inside_total += w[i];
  const float local = std::min(std::max(target - before, 0.f), std::nextafter(inside_total, 0.f));
  float cumulative = 0.f;
  for (int64_t i = first; i < end; ++i) {
    cumulative += w[i];
    if (cumulative > local) return i;
  }
  return end - 1;
}

}  // namespace

// logits [R, V] (fp32, contiguous), inverse_temperatures [R] and uniforms [R] (fp32; a negative uniform: the row is
// greedy) -> tokens [R] int64 in [0, V)
torch::Tensor sample_tokens(torch::Tensor logits, torch::Tensor inverse_temperatures, torch::Tensor uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous() && logits.size(1) > 0,
              "sample_tokens: logits must be a contiguous 2-D fp32 CPU tensor of a non-empty vocabulary");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  for (const auto& [tensor, name] : {std::pair{&inverse_temperatures, "inverse_temperatures"},
                                     std::pair{&uniforms, "uniforms"}}) {
    TORCH_CHECK(tensor->device().is_cpu() && tensor->dim() == 1 && tensor->size(0) == rows &&
                    tensor->scalar_type() == at::kFloat && tensor->is_contiguous(),
                "sample_tokens: ", name, " must hold one fp32 value per row of logits");
  }
  auto tokens = torch::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* inverse_t = inverse_temperatures.data_ptr<float>();
  const float* u = uniforms.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights, block_sums;
    for (int64_t row = begin; row < end; ++row) {
      const float* logits_row = x + row * vocab;
      const RowMax max = row_max(logits_row, vocab, block_sums);
      int64_t token = -1;
      // a temperature too small to divide by (an infinite inverse) would give 0 * inf at the maximum
      if (u[row] >= 0.f && !max.broken && max.top > kNegInf && std::isfinite(inverse_t[row])) {
        token = draw(logits_row, vocab, max.top, inverse_t[row], u[row], weights, block_sums);
      }
      out[row] = token < 0 ? max.index : token;
    }
  });
  return tokens;
}
