// Element-wise math written so that GCC vectorizes the loops that call it (glibc's expf is a scalar call, and
// c10's bf16 conversions copy through a struct), for the kernels that follow this file in the one translation
// unit paged_kernels/cpu_extension.py builds: the exponential for the decode softmax and the SiLU, the conversions for
// every bf16 row the kernels read or write; and which row and cache dtypes the kernels pair.
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// Held by a kernel from its argument checks to its return: the process's other Python threads (a service's token
// publishing, its HTTP handlers) run meanwhile, where they would wait out the call. No kernel touches a Python object.
// Releases only a GIL the thread holds, so that kernels calling kernels (decode_layers) nest.
class ReleasedGil {
 public:
  ReleasedGil() : state_(PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~ReleasedGil() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;

 private:
  PyThreadState* state_;
};

// e^x for x <= 0 (a score minus its row's maximum; -|x| in a sigmoid) within a few ulp: 2^n * p(r),
// x = n ln2 + r (Cephes' expf); exactly 0 below -87, where 2^n would leave the normal floats (e^-87 is 1.6e-38).
// n is rounded by nearbyint: GCC did not vectorize the loops with Cephes' rounding, int(x * log2(e) - 0.5).
#pragma omp declare simd notinbranch
inline float exp_nonpositive(float x) {
  const bool underflows = x < -87.f;
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  return underflows ? 0.f : y * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

// a value as fp32: bf16 by its bits (the upper half of an fp32)
template <typename scalar_t>
inline float to_float(scalar_t x) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16);
  } else {
    return static_cast<float>(x);
  }
}

// the 4 bytes at `first` (two adjacent bf16 or int16 values: the pair one vdpbf16ps / vpdpwssd lane takes) as one
// int32, to broadcast; by memcpy, since the values' own type is not int32 (the compiler folds it into the load)
inline int32_t pair_bits(const void* first) {
  int32_t bits;
  std::memcpy(&bits, first, sizeof bits);
  return bits;
}

// fp32 rounded to scalar_t: bf16 to nearest, ties to even, a NaN kept a NaN (c10's rounding, by bits)
template <typename scalar_t>
inline scalar_t from_float(float f) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint32_t u = __builtin_bit_cast(uint32_t, f);
    const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return c10::BFloat16(std::isnan(f) ? uint16_t{0x7FC0} : rounded, c10::BFloat16::from_bits());
  } else {
    return static_cast<scalar_t>(f);
  }
}

// whether rows of `rows` (queries, new K/V rows) pair with a `cache` KV cache in the kernels: the same dtype, or a
// 16-bit cache under fp32 rows (an fp32 model's fp16 cache: EngineConfig.kv_cache_dtype)
inline bool pairs_with_cache(c10::ScalarType rows, c10::ScalarType cache) {
  return rows == cache || (rows == c10::kFloat && (cache == c10::kHalf || cache == c10::kBFloat16));
}

}  // namespace
