// Math shared by the CPU kernel library's sources (paged_attention_cpu.cpp, ../model/cpu_ops.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace pagedkv_cpu {

// e^x, x clamped to [-87, 88] (beyond, 0 and inf are as good): Cephes' expf (range reduction by ln 2, degree-6
// polynomial, ~1 ulp). Plain float arithmetic with no call, so that a `#pragma omp simd` loop over it vectorizes
// on whatever -march=native has (AVX2: 8 lanes, AVX-512: 16; with -fno-trapping-math, see cpu_kernel.py), where
// glibc's expf would run one lane at a time.
__attribute__((always_inline)) inline float exp_clamped(float x) {
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

// For a scope, this thread's float arithmetic flushes denormal results to zero and reads denormal inputs as zero
// (MXCSR's FTZ and DAZ bits; the thread's own setting restored after). Every parallel region of the CPU kernels
// opens one: on Intel cores an operation that makes or reads a denormal takes a microcode assist of ~100+ cycles,
// and GCC's if-converted clamp in exp_clamped computes g / (1 + e^88) for every lane of silu_mul, a denormal for
// |g| < 2 (silu_mul over [512, 3,072]: 4.9 ms on one thread without, 0.4 ms with; bench/NOTES.md "Denormals").
// AMD's cores take no such assist. Values below 1.2e-38 become 0, far under any tolerance of ours.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

}  // namespace pagedkv_cpu
