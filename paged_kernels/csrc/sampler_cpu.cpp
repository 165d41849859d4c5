// The sampler's draw on the CPU (engine/sampler.py, after its logit edits) in a few passes over each row instead of
// about twenty torch ops over the whole vocabulary and, with top-k or top-p, a sort of it: on a 2-vCPU Zen 3, one
// SmolLM2 row took the torch ops 0.57 ms with a temperature alone and 5.3 ms with top-p, this kernel 0.13 and 0.29
// ms (benchmarks.sampler). The same choice as the torch path's: the first maximum of the finite logits for greedy
// and degenerate rows, else the first token whose cumulative weight e^((logit - max) / T), over the tokens min-p,
// top-k and top-p keep, passes the row's uniform draw times their total, searched over blocks of kScanBlock entries,
// then inside the block found. Sums run in another
// order than torch's, so a draw or a nucleus within rounding of a boundary between two tokens may end on the other.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
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

// a row's sampling parameters as the kernel takes them
struct RowParams {
  float inverse_temperature;
  float uniform;  // in [0, 1); negative: the row is greedy
  int64_t top_k;  // 0: every token
  float top_p;    // 1: every token
  float min_p;    // 0: every token
};

// the weights' total over blocks of kScanBlock entries (block_sums: each block's)
float block_totals(const float* w, int64_t vocab, std::vector<float>& block_sums) {
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
  return total;
}

// the weights w (in [0, 1], the maximum's 1; `total`: their sum) zeroed outside the row's top-k, then outside the
// top-p nucleus of what top-k kept: the largest weights in descending order (ties by index) while fewer than top_k
// come before and the mass before stays below top_p times the top_k largest weights' mass (the first always kept),
// as engine/sampler.py's sort does (and vLLM). Only the largest weights are sorted: those of the powers of two that
// hold the first top_k tokens or, without top-k, top_p of the mass
void keep_nucleus(float* w, int64_t vocab, float total, int64_t top_k, float top_p, std::vector<int32_t>& order,
                  std::vector<float>& kept) {
  constexpr int kBuckets = 128;  // bucket e: weights in [2^-e, 2^(1-e)), by their exponent bits (0: exactly 1)
  float mass[kBuckets] = {};
  int64_t count[kBuckets] = {};
  auto bucket = [](float weight) {
    return static_cast<int>(127 - std::min<uint32_t>(__builtin_bit_cast(uint32_t, weight) >> 23, 127));
  };
  for (int64_t i = 0; i < vocab; ++i) {
    if (w[i] > 0.f) {
      mass[bucket(w[i])] += w[i];
      ++count[bucket(w[i])];
    }
  }
  float needed = top_p < 1.f ? top_p * total : std::numeric_limits<float>::infinity();
  int last = 0;  // the last bucket whose weights can be kept
  float cumulative_mass = mass[0];
  int64_t cumulative_count = count[0];
  while (last < kBuckets - 1 && (top_k > 0 ? cumulative_count < top_k : cumulative_mass < needed)) {
    ++last;
    cumulative_mass += mass[last];
    cumulative_count += count[last];
  }
  order.clear();
  for (int64_t i = 0; i < vocab; ++i) {
    if (w[i] > 0.f && bucket(w[i]) <= last) order.push_back(static_cast<int32_t>(i));
  }
  std::sort(order.begin(), order.end(), [w](int32_t a, int32_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); });
  if (top_k > 0 && top_p < 1.f) {  // the nucleus of the top_k largest: top_p of their mass
    float top_k_mass = 0.f;
    for (int64_t rank = 0; rank < std::min<int64_t>(top_k, order.size()); ++rank) top_k_mass += w[order[rank]];
    needed = top_p * top_k_mass;
  }
  kept.clear();
  float before = 0.f;
  for (const int32_t i : order) {
    if ((top_k > 0 && static_cast<int64_t>(kept.size()) >= top_k) || (!kept.empty() && before >= needed)) break;
    kept.push_back(w[i]);
    before += w[i];
  }
  std::fill_n(w, vocab, 0.f);
  for (size_t rank = 0; rank < kept.size(); ++rank) w[order[rank]] = kept[rank];
}

// the token drawn by inverse CDF at params.uniform over the weights e^((x - top) * inverse_temperature) kept by
// top-k, top-p and min-p (`weights`: room for them), or -1 where they have no mass to draw from
int64_t draw(const float* x, int64_t vocab, float top, const RowParams& params, std::vector<float>& weights,
             std::vector<float>& block_sums, std::vector<int32_t>& order, std::vector<float>& kept) {
  weights.resize(vocab);
  float* w = weights.data();
  const float inverse_temperature = params.inverse_temperature;
#pragma omp simd
  for (int64_t i = 0; i < vocab; ++i) w[i] = exp_nonpositive((x[i] - top) * inverse_temperature);
  // vLLM's order: min-p, then top-k, then top-p over what those two kept
  if (params.min_p > 0.f) {  // a probability below min_p times the largest's: a weight below min_p (the largest is 1)
    const float min_p = params.min_p;
#pragma omp simd
    for (int64_t i = 0; i < vocab; ++i) w[i] = w[i] < min_p ? 0.f : w[i];
  }
  float total = block_totals(w, vocab, block_sums);
  if (!(total > 0.f) || !std::isfinite(total)) return -1;
  const bool limit_k = params.top_k > 0 && params.top_k < vocab;
  if (limit_k || params.top_p < 1.f) {  // keeps the largest weight at least: the total stays positive and finite
    keep_nucleus(w, vocab, total, limit_k ? params.top_k : 0, params.top_p, order, kept);
    total = block_totals(w, vocab, block_sums);
  }
  // strictly below the total, so the block found has weight; strictly below that block's own total, so the token
  // found has weight too (cumulative sums that never fall, as they add weights >= 0)
  const float target = std::min(params.uniform * total, std::nextafter(total, 0.f));
  const int64_t blocks = static_cast<int64_t>(block_sums.size());
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

// logits [R, V] (fp32, contiguous) and per row (one value each, contiguous): inverse_temperatures, uniforms (fp32; a
// negative uniform: the row is greedy), top_k (int64; 0: off), top_p and min_p (fp32; 1 and 0: off) -> tokens [R]
// int64 in [0, V): for greedy rows, rows holding a NaN or +inf and rows with nothing left to draw from, the first
// maximum of the finite logits
torch::Tensor sample_tokens(torch::Tensor logits, torch::Tensor inverse_temperatures, torch::Tensor uniforms,
                            torch::Tensor top_k, torch::Tensor top_p, torch::Tensor min_p) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                  logits.is_contiguous() && logits.size(1) > 0,
              "sample_tokens: logits must be a contiguous 2-D fp32 CPU tensor of a non-empty vocabulary");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  for (const auto& [tensor, name, dtype] :
       {std::tuple{&inverse_temperatures, "inverse_temperatures", at::kFloat}, std::tuple{&uniforms, "uniforms", at::kFloat},
        std::tuple{&top_k, "top_k", at::kLong}, std::tuple{&top_p, "top_p", at::kFloat},
        std::tuple{&min_p, "min_p", at::kFloat}}) {
    TORCH_CHECK(tensor->device().is_cpu() && tensor->dim() == 1 && tensor->size(0) == rows &&
                    tensor->scalar_type() == dtype && tensor->is_contiguous(),
                "sample_tokens: ", name, " must hold one ", c10::toString(dtype), " value per row of logits");
  }
  ReleasedGil released_gil;
  auto tokens = torch::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights, block_sums, kept;
    std::vector<int32_t> order;
    for (int64_t row = begin; row < end; ++row) {
      const float* logits_row = x + row * vocab;
      const RowMax max = row_max(logits_row, vocab, block_sums);
      const RowParams params{inverse_temperatures.data_ptr<float>()[row], uniforms.data_ptr<float>()[row],
                             top_k.data_ptr<int64_t>()[row], top_p.data_ptr<float>()[row],
                             min_p.data_ptr<float>()[row]};
      int64_t token = -1;
      // a temperature too small to divide by (an infinite inverse) would give 0 * inf at the maximum
      if (params.uniform >= 0.f && !max.broken && max.top > kNegInf && std::isfinite(params.inverse_temperature)) {
        token = draw(logits_row, vocab, max.top, params, weights, block_sums, order, kept);
      }
      out[row] = token < 0 ? max.index : token;
    }
  });
  return tokens;
}
