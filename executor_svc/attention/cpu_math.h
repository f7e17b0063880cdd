// Math shared by the CPU kernel library's sources (paged_attention_cpu.cpp, ../model/cpu_ops.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace pagedkv_cpu {

// e^x, x clamped to [-87, 88] (beyond, 0 and inf are as good): Cephes' expf (range reduction by ln 2, degree-6
// polynomial, ~1 ulp). Plain float arithmetic with no call, so that a `#pragma omp simd` loop over it vectorizes
// on whatever -march=native has (AVX2: 8 lanes, AVX-512: 16; with -fno-trapping-math, see cpu_kernel.py), where
// glibc's expf would run one lane at a time.
inline float exp_clamped(float x) {
  x = x < -87.f ? -87.f : x;
  x = x > 88.f ? 88.f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

}  // namespace pagedkv_cpu
