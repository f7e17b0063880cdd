// A CPU stand-in for the parts of CUDA the pagedkv kernels use, so that tests can run the kernels' own source on
// a machine without a GPU (tests/cuda_emulator.py builds it with g++). Each CTA's threads are fibers on one OS
// thread (ucontext); __syncthreads and warp shuffles are cooperative barriers. Not a model of timing, memory
// coherence or the PTX helpers (common.cuh swaps those for C++ under PKV_HOST_EMULATION): it checks indexing,
// control flow, the online softmax, the merges and the split-K reduction on real inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define PKV_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static  // one CTA runs at a time

struct uint4 { unsigned int x, y, z, w; } __attribute__((aligned(16)));
struct float4 { float x, y, z, w; } __attribute__((aligned(16)));
struct uint2 { unsigned int x, y; } __attribute__((aligned(8)));
struct dim3 { unsigned int x = 1, y = 1, z = 1; };

inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned int x, unsigned int y) { return {x, y}; }

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
using std::max;
using std::min;

inline float host_half_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
inline unsigned short host_float_to_half(float x) {
    _Float16 h = (_Float16)x;  // round to nearest even
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}
inline unsigned short host_float_to_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (unsigned short)(u >> 16);
}

// Built-ins; the emulator sets threadIdx each time it resumes a fiber (one OS thread runs them all).
extern dim3 threadIdx, blockIdx, blockDim, gridDim;

void __syncthreads();
float __shfl_xor_sync(unsigned int mask, float value, int lane_mask);
