// Page-pool kernels besides attention: the step's cache write, copy-on-write page copies, and the gather of
// one prefill segment's context into contiguous K/V (for torch's SDPA). Layout as in decode.cu.
#include "common.cuh"

namespace pkv {

// New K/V of the step ([T, kv_heads, D], any token/head strides) into their slots. Grid (T), 128 threads;
// one 16-byte vector a thread and step.
template <typename T>
__global__ void __launch_bounds__(128) write_kv_cache(
    T* __restrict__ k_cache, T* __restrict__ v_cache,
    long long page_stride, long long slot_stride, long long head_stride,
    const T* __restrict__ k, long long k_tok_stride, long long k_head_stride,
    const T* __restrict__ v, long long v_tok_stride, long long v_head_stride,
    const long long* __restrict__ slot_pages, const long long* __restrict__ slot_offsets,
    int num_kv_heads, int head_dim) {
    constexpr int VEC = Elem<T>::kVec;
    const int t = blockIdx.x;
    const int vecs_per_head = head_dim / VEC;
    const long long dst = slot_pages[t] * page_stride + slot_offsets[t] * slot_stride;
    for (int i = threadIdx.x; i < num_kv_heads * vecs_per_head; i += blockDim.x) {
        const int h = i / vecs_per_head;
        const int c = (i - h * vecs_per_head) * VEC;
        const long long to = dst + h * head_stride + c;
        *reinterpret_cast<uint4*>(k_cache + to) =
            *reinterpret_cast<const uint4*>(k + t * k_tok_stride + h * k_head_stride + c);
        *reinterpret_cast<uint4*>(v_cache + to) =
            *reinterpret_cast<const uint4*>(v + t * v_tok_stride + h * v_head_stride + c);
    }
}

// 8-bit pages (executor_svc/kv_quant.py; the same arithmetic as its torch code, so the same bytes). Per (token,
// KV head) scales, for FP8 K and V and INT8 V: one warp a (token, head) vector: absmax over the warp, scale =
// bf16(absmax / qmax) (1 if 0), data = round(x / scale) (INT8: to nearest even, clamped to +-127; FP8: saturating,
// to nearest even). data: [pages, block, heads, D] bytes with page_stride / slot_stride bytes; scale: bf16 at
// scale + page * page_stride + (slot * heads + head) * 2. Grid (T), 128 threads.
template <typename T, typename Q>
__global__ void __launch_bounds__(128) write_kv_q8_token(
    unsigned char* __restrict__ data, unsigned char* __restrict__ scale,
    long long page_stride, long long slot_stride,
    const T* __restrict__ x, long long x_tok_stride, long long x_head_stride,
    const long long* __restrict__ slot_pages, const long long* __restrict__ slot_offsets,
    int num_kv_heads, int head_dim) {
    constexpr float kMax = Q8<Q>::kUnit == 1.f ? 127.f : 448.f;
    const int t = blockIdx.x;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const long long page = slot_pages[t] * page_stride;
    const int slot = (int)slot_offsets[t];
    for (int h = warp; h < num_kv_heads; h += blockDim.x / 32) {  // the same trip count for a whole warp
        const T* row = x + t * x_tok_stride + h * x_head_stride;
        float amax = 0.f;
        for (int c = lane; c < head_dim; c += 32) amax = fmaxf(amax, fabsf(to_float(row[c])));
        for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        bf16 sb;
        store1(&sb, amax / kMax);
        float s = bf16_bits_to_float(sb.bits);
        if (!(s > 0.f)) {
            s = 1.f;
            sb.bits = 0x3f80;  // 1.0
        }
        unsigned char* dst = data + page + slot * slot_stride + h * head_dim;
        for (int c = lane; c < head_dim; c += 32) dst[c] = quantize_q8<Q>(to_float(row[c]) / s);
        if (lane == 0) *reinterpret_cast<unsigned short*>(scale + page + (slot * num_kv_heads + h) * 2) = sb.bits;
    }
}

// INT8 K with one power-of-two scale per (page, head, channel) (exponent bytes at exps + page * page_stride +
// head * D + c). Grid (T, heads), head_dim threads: thread c owns channel c. The tokens a step writes into one page
// are consecutive in the flat batch (a request's tokens are, and two requests never write one page), so the CTA
// of a page's first token handles the page's whole run in order: the run's absmax per channel raises the exponent
// (a run starting at offset 0 starts the page afresh), the page's earlier tokens are requantized to it (an exact
// power-of-two division, rounded to nearest even), then the run's tokens are written.
template <typename T>
__global__ void __launch_bounds__(128) write_k_i8_channel(
    unsigned char* __restrict__ data, unsigned char* __restrict__ exps,
    long long page_stride, long long slot_stride,
    const T* __restrict__ x, long long x_tok_stride, long long x_head_stride,
    const long long* __restrict__ slot_pages, const long long* __restrict__ slot_offsets,
    int num_tokens, int num_kv_heads, int head_dim) {
    const int t0 = blockIdx.x;
    const int h = blockIdx.y;
    const int c = threadIdx.x;
    const long long pid = slot_pages[t0];
    if (t0 > 0 && slot_pages[t0 - 1] == pid) return;  // not the first token of its page's run
    int t1 = t0 + 1;
    while (t1 < num_tokens && slot_pages[t1] == pid) ++t1;
    if (c >= head_dim) return;
    const long long page = pid * page_stride;
    float amax = 0.f;
    for (int t = t0; t < t1; ++t) amax = fmaxf(amax, fabsf(to_float(x[t * x_tok_stride + h * x_head_stride + c])));
    unsigned char* e_at = exps + page + h * head_dim + c;
    const int first = (int)slot_offsets[t0];
    const int old = first == 0 ? 0 : (int)*e_at;
    int need = 0;
    if (amax > 0.f) {
        int e;
        const float m = frexpf(amax / 127.f, &e);  // amax / 127 = m * 2^e, m in [0.5, 1): ceil(log2) = e or e - 1
        need = m == 0.f ? 1 : min(max((m == 0.5f ? e - 1 : e) + 127, 1), 254);  // 0: flushed to zero (tiny)
    }
    const int now = max(old, need);
    unsigned char* col = data + page + h * head_dim + c;
    if (now > old && old > 0) {
        const float shift = __uint_as_float((unsigned int)(old - now + 127) << 23);  // 2^(old - now)
        for (int s = 0; s < first; ++s) {
            signed char* q = reinterpret_cast<signed char*>(col + s * slot_stride);
            *q = (signed char)quantize_q8<i8>((float)*q * shift);
        }
    }
    *e_at = (unsigned char)now;
    const float scale = __uint_as_float((unsigned int)now << 23);  // 2^(now - 127)
    for (int t = t0; t < t1; ++t) {
        const float y = to_float(x[t * x_tok_stride + h * x_head_stride + c]) / scale;
        col[(long long)slot_offsets[t] * slot_stride] = quantize_q8<i8>(y);
    }
}

// Whole pages (every layer, K and V: page_vecs 16-byte vectors each) from src[i] to dst[i]. The caller
// guarantees no page is both a source and a destination and no destination repeats (copies are then
// independent). Grid (chunks, pairs), 256 threads.
__global__ void __launch_bounds__(256) copy_pages(
    uint4* __restrict__ pool, const long long* __restrict__ src, const long long* __restrict__ dst,
    long long page_vecs) {
    const long long from = src[blockIdx.y] * page_vecs;
    const long long to = dst[blockIdx.y] * page_vecs;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < page_vecs; i += stride) {
        pool[to + i] = load_stream(pool + from + i);
    }
}

// Positions [0, ctx) of one request, through its page ids, into contiguous out_k/out_v [kv_heads, ctx, D]
// (one 16-byte vector a thread; writes coalesced). Grid (ceil(kv_heads * ctx * D / VEC / 256)), 256 threads.
template <typename T>
__global__ void __launch_bounds__(256) gather_kv(
    T* __restrict__ out_k, T* __restrict__ out_v,
    const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    long long page_stride, long long slot_stride, long long head_stride,
    const long long* __restrict__ page_ids, int ctx, int num_kv_heads, int head_dim, int block_shift) {
    constexpr int VEC = Elem<T>::kVec;
    const int vecs_per_row = head_dim / VEC;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)num_kv_heads * ctx * vecs_per_row) return;
    const int c = (int)(i % vecs_per_row) * VEC;
    const long long row = i / vecs_per_row;  // = h * ctx + p
    const int p = (int)(row % ctx);
    const int h = (int)(row / ctx);
    const long long from = page_ids[p >> block_shift] * page_stride + (p & ((1 << block_shift) - 1)) * slot_stride +
                           h * head_stride + c;
    *reinterpret_cast<uint4*>(out_k + row * head_dim + c) = load_stream(k_cache + from);
    *reinterpret_cast<uint4*>(out_v + row * head_dim + c) = load_stream(v_cache + from);
}

// gather_kv over 8-bit pages: positions [0, ctx) of one request into contiguous out_k/out_v [kv_heads, ctx, D] of
// the model dtype, dequantized (data * scale in fp32, then rounded to T once: the torch reference's values).
// 8 elements a thread. Grid (ceil(kv_heads * ctx * D / 8 / 256)), 256 threads.
template <typename T, typename Q>
__global__ void __launch_bounds__(256) gather_kv_q8(
    T* __restrict__ out_k, T* __restrict__ out_v,
    const unsigned char* __restrict__ k_data, const unsigned char* __restrict__ k_scale,
    const unsigned char* __restrict__ v_data, const unsigned char* __restrict__ v_scale,
    long long page_stride, long long slot_stride,
    const long long* __restrict__ page_ids, int ctx, int num_kv_heads, int head_dim, int block_shift) {
    constexpr float kUnit = Q8<Q>::kUnit;
    const int groups = head_dim / 8;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)num_kv_heads * ctx * groups) return;
    const int c = (int)(i % groups) * 8;
    const long long row = i / groups;  // = h * ctx + p
    const int p = (int)(row % ctx);
    const int h = (int)(row / ctx);
    const long long page = page_ids[p >> block_shift] * page_stride;
    const int slot = p & ((1 << block_shift) - 1);
    const long long at = page + slot * slot_stride + h * head_dim + c;
    const long long scale_at = page + (slot * num_kv_heads + h) * 2;
    float kf[8], vf[8], ks[8];
    const uint2 kd = load_stream8(k_data + at), vd = load_stream8(v_data + at);
    Q8<Q>::unpack4(kd.x, kf);
    Q8<Q>::unpack4(kd.y, kf + 4);
    Q8<Q>::unpack4(vd.x, vf);
    Q8<Q>::unpack4(vd.y, vf + 4);
    if (Q8<Q>::kChannelK) {
        const uint2 ex = load_stream8(k_scale + page + h * head_dim + c);
        exp_bytes_to_scales(ex.x, ks);
        exp_bytes_to_scales(ex.y, ks + 4);
    } else {
        const float s = kUnit * bf16_bits_to_float(*reinterpret_cast<const unsigned short*>(k_scale + scale_at));
#pragma unroll
        for (int e = 0; e < 8; ++e) ks[e] = s;
    }
    const float vs = kUnit * bf16_bits_to_float(*reinterpret_cast<const unsigned short*>(v_scale + scale_at));
    T* ok = out_k + row * head_dim + c;
    T* ov = out_v + row * head_dim + c;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        store1(ok + e, kf[e] * ks[e]);
        store1(ov + e, vf[e] * vs);
    }
}

}  // namespace pkv
