// Shared helpers of the pagedkv kernels. No CUDA headers are included: NVRTC (through CuPy) and nvcc
// see exactly the same text, and no include path to the toolkit is needed at run time.
//
// Element types are tag structs over their bits; conversions are single PTX instructions (sm_80+).
// With PKV_HOST_EMULATION (only tests/support/cuda_emulator builds it) the few PTX helpers are plain C++ instead, so the
// kernels' logic runs on a CPU under the emulator.
#pragma once

namespace pkv {

struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };

// Elements per 16-byte vector, and how to turn one 32-bit word (two 16-bit elements) into floats.
template <typename T> struct Elem;

template <> struct Elem<float> {
    static constexpr int kVec = 4;
    __device__ static __forceinline__ void unpack(const uint4& u, float* f) {
        f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
        f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
    }
    __device__ static __forceinline__ uint4 pack(const float* f) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                          __float_as_uint(f[3]));
    }
};

__device__ __forceinline__ void bf16x2_to_float2(unsigned int w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
}

#ifndef PKV_HOST_EMULATION
__device__ __forceinline__ void f16x2_to_float2(unsigned int w, float& lo, float& hi) {
    asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi) : "r"(w));
}

__device__ __forceinline__ unsigned int float2_to_f16x2(float lo, float hi) {
    unsigned int w;
    // cvt.rn.f16x2.f32 d, a, b puts a in the upper half and b in the lower half.
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
}

__device__ __forceinline__ unsigned int float2_to_bf16x2(float lo, float hi) {
    unsigned int w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
}

#else  // the CPU emulator of the tests (tests/support/cuda_emulator/): the same functions in C++
__device__ __forceinline__ void f16x2_to_float2(unsigned int w, float& lo, float& hi) {
    lo = host_half_to_float((unsigned short)(w & 0xffffu));
    hi = host_half_to_float((unsigned short)(w >> 16));
}

__device__ __forceinline__ unsigned int float2_to_f16x2(float lo, float hi) {
    return (unsigned int)host_float_to_half(lo) | ((unsigned int)host_float_to_half(hi) << 16);
}

__device__ __forceinline__ unsigned int float2_to_bf16x2(float lo, float hi) {
    return (unsigned int)host_float_to_bf16(lo) | ((unsigned int)host_float_to_bf16(hi) << 16);
}

#endif

template <> struct Elem<f16> {
    static constexpr int kVec = 8;
    __device__ static __forceinline__ void unpack(const uint4& u, float* f) {
        f16x2_to_float2(u.x, f[0], f[1]); f16x2_to_float2(u.y, f[2], f[3]);
        f16x2_to_float2(u.z, f[4], f[5]); f16x2_to_float2(u.w, f[6], f[7]);
    }
    __device__ static __forceinline__ uint4 pack(const float* f) {
        return make_uint4(float2_to_f16x2(f[0], f[1]), float2_to_f16x2(f[2], f[3]),
                          float2_to_f16x2(f[4], f[5]), float2_to_f16x2(f[6], f[7]));
    }
};

template <> struct Elem<bf16> {
    static constexpr int kVec = 8;
    __device__ static __forceinline__ void unpack(const uint4& u, float* f) {
        bf16x2_to_float2(u.x, f[0], f[1]); bf16x2_to_float2(u.y, f[2], f[3]);
        bf16x2_to_float2(u.z, f[4], f[5]); bf16x2_to_float2(u.w, f[6], f[7]);
    }
    __device__ static __forceinline__ uint4 pack(const float* f) {
        return make_uint4(float2_to_bf16x2(f[0], f[1]), float2_to_bf16x2(f[2], f[3]),
                          float2_to_bf16x2(f[4], f[5]), float2_to_bf16x2(f[6], f[7]));
    }
};

// 8-bit KV elements (executor_svc/kv_quant.py). Eight of them per 8-byte load; ``unpack8`` gives floats that
// still need the scales: FP8 E4M3 bytes become exact f16 values 2^-8 times theirs (sign, exponent and mantissa
// bits moved into an f16, subnormals included; kUnit = 256 restores the factor, folded into the scales), INT8
// bytes their integers (kUnit = 1).
struct fp8e4m3 { unsigned char bits; };
struct i8 { signed char value; };

template <typename Q> struct Q8;

__device__ __forceinline__ unsigned int fp8x2_to_f16x2(unsigned int two_bytes_apart) {
    // bytes at bits 0-7 and 16-23 -> f16 halves: sign to bit 15, exponent and mantissa to bits 7-14
    return ((two_bytes_apart & 0x00800080u) << 8) | ((two_bytes_apart & 0x007f007fu) << 7);
}

template <> struct Q8<fp8e4m3> {
    static constexpr float kUnit = 256.f;
    static constexpr bool kChannelK = false;  // K: one scale per (token, head)
    __device__ static __forceinline__ void unpack4(unsigned int w, float* f) {
        f16x2_to_float2(fp8x2_to_f16x2((w & 0xffu) | ((w & 0xff00u) << 8)), f[0], f[1]);
        f16x2_to_float2(fp8x2_to_f16x2(((w >> 16) & 0xffu) | ((w >> 8) & 0xff0000u)), f[2], f[3]);
    }
};

template <> struct Q8<i8> {
    static constexpr float kUnit = 1.f;
    static constexpr bool kChannelK = true;  // K: one power-of-two scale per (page, head, channel)
    __device__ static __forceinline__ void unpack4(unsigned int w, float* f) {
        f[0] = (float)(int)(signed char)(w & 0xffu);
        f[1] = (float)(int)(signed char)((w >> 8) & 0xffu);
        f[2] = (float)(int)(signed char)((w >> 16) & 0xffu);
        f[3] = (float)(int)(signed char)(w >> 24);
    }
};

// 2^(e - 127) for each exponent byte of w (0 -> 0.0: no token written yet).
__device__ __forceinline__ void exp_bytes_to_scales(unsigned int w, float* f) {
    f[0] = __uint_as_float((w & 0xffu) << 23);
    f[1] = __uint_as_float(((w >> 8) & 0xffu) << 23);
    f[2] = __uint_as_float(((w >> 16) & 0xffu) << 23);
    f[3] = __uint_as_float((w >> 24) << 23);
}

__device__ __forceinline__ float bf16_bits_to_float(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }

// One element from a float, as the storage type's bits.
__device__ __forceinline__ void store1(float* p, float x) { *p = x; }

#ifndef PKV_HOST_EMULATION
// 2^x, ~2 ulp (MUFU.EX2); -inf -> 0.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// A 16-byte load that bypasses L1 allocation (K/V are streamed once per query group).
__device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// An 8-byte load, likewise streamed.
__device__ __forceinline__ uint2 load_stream8(const void* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// float -> FP8 E4M3 bits, saturating to +-448, round to nearest even (NaN stays NaN); sm_89+.
__device__ __forceinline__ unsigned char float_to_fp8(float x) {
    unsigned short two;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(0.f), "f"(x));
    return (unsigned char)(two & 0xffu);
}

__device__ __forceinline__ void store1(f16* p, float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    p->bits = h;
}
__device__ __forceinline__ void store1(bf16* p, float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    p->bits = h;
}
#else
__device__ __forceinline__ float exp2_approx(float x) { return exp2f(x); }
__device__ __forceinline__ uint4 load_stream(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint2 load_stream8(const void* p) { return *reinterpret_cast<const uint2*>(p); }
__device__ __forceinline__ unsigned char float_to_fp8(float x) {  // as cvt.rn.satfinite.e4m3x2.f32
    if (x != x) return 0x7f;
    const unsigned char sign = std::signbit(x) ? 0x80 : 0;
    float a = std::fabs(x);
    if (a >= 448.f) return sign | 0x7e;
    if (a < 0.015625f) return sign | (unsigned char)std::nearbyint(a * 512.f);  // subnormals: steps of 2^-9
    int e;
    const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    int mant = (int)std::nearbyint((m * 2.f - 1.f) * 8.f);  // round to nearest even (default rounding mode)
    int exp = e - 1 + 7;
    if (mant == 8) { mant = 0; ++exp; }
    if (exp > 15 || (exp == 15 && mant > 6)) return sign | 0x7e;
    return sign | (unsigned char)((exp << 3) | mant);
}
__device__ __forceinline__ void store1(f16* p, float x) { p->bits = host_float_to_half(x); }
__device__ __forceinline__ void store1(bf16* p, float x) { p->bits = host_float_to_bf16(x); }
#endif

// One element as a float, and a float (already divided by its scale) as an 8-bit element's byte.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16 x) {
    float lo, hi;
    f16x2_to_float2((unsigned int)x.bits, lo, hi);
    return lo;
}
__device__ __forceinline__ float to_float(bf16 x) { return bf16_bits_to_float(x.bits); }

template <typename Q> __device__ __forceinline__ unsigned char quantize_q8(float y);
template <> __device__ __forceinline__ unsigned char quantize_q8<fp8e4m3>(float y) { return float_to_fp8(y); }
template <> __device__ __forceinline__ unsigned char quantize_q8<i8>(float y) {
    return (unsigned char)(signed char)(int)fminf(fmaxf(rintf(y), -127.f), 127.f);
}

// The context positions a decode query sees, as two ordered, disjoint ranges [a0, a1) (the request's
// attention sink) and [b0, ctx) (its window). Position p is visible iff p < ctx and
//   (model_window == 0 or p > ctx - 1 - model_window) and (window == 0 or p < sink or p > ctx - 1 - window).
// Iterating over these ranges only is what skips dropped pages (and the table padding) without reading them.
struct Visible {
    int a0, a1, b0, ctx;
    __device__ __forceinline__ int count() const { return (a1 - a0) + (ctx - b0); }
    // The i-th visible position, 0 <= i < count().
    __device__ __forceinline__ int position(int i) const {
        const int na = a1 - a0;
        return i < na ? a0 + i : b0 + (i - na);
    }
};

__device__ __forceinline__ Visible visible_positions(int ctx, int model_window, int sink, int window) {
    const int lo = model_window > 0 ? max(0, ctx - model_window) : 0;
    Visible v;
    v.ctx = ctx;
    v.a0 = lo;
    if (window > 0) {
        v.b0 = max(lo, ctx - window);
        v.a1 = max(lo, min(sink, v.b0));
    } else {
        v.b0 = lo;
        v.a1 = lo;
    }
    return v;
}

}  // namespace pkv
