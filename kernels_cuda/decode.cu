// Paged decode attention: one query token per request over its paged K/V.
//
// Layout (executor_svc/pages.py): K and V of one layer are views [num_pages, block_size, kv_heads, D] of the
// page pool, contiguous inside a page but NOT across pages; element (page, slot, head, d) is at
//   base + page * page_stride + slot * slot_stride + head * head_stride + d.
//
// Grid (num_kv_heads * num_chunks, batch, num_partitions), kThreads threads. One CTA takes one KV head of one
// request and up to G of the query heads that share it (the "query group"; a group larger than G is split
// into num_chunks CTAs). Every K/V row is loaded once per CTA, into registers, and used for all G heads.
//
// Inside the CTA a "thread group" of TPT = D / VEC threads owns one token row (16-byte vector loads, VEC
// elements a thread, coalesced along head_dim); the CTA has NTG = kThreads / TPT thread groups, and each
// runs its own online softmax (fp32, base 2) over the tokens i = tg, tg + NTG, ... of its partition, with
// kUnroll tokens in flight per step. At the end the thread groups are merged through shared memory.
//
// Split-K: the visible positions of a request (see Visible) are cut into partitions of partition_tokens;
// with max_parts > 1 each CTA writes its partition's (max, sum, unnormalised output) and
// paged_decode_reduce merges them; with max_parts == 1 the CTA writes the normalised output itself.
#include "common.cuh"

namespace pkv {

constexpr int kThreads = 128;
constexpr float kNegBig = -1.0e30f;   // running max before any token: finite, so no inf - inf

// Resident CTAs a multiprocessor should hold (caps registers at 65536 / (kThreads * n)): 4 for the small
// tiles (<= 128 registers), 2 for the 8-head tile (<= 255).
template <int G> struct MinCtas { static constexpr int value = G >= 8 ? 2 : 4; };

// Both decode kernels below are paged_decode_body with a different K/V policy: the policy binds to the CTA's KV
// head, loads one token row (load), and turns it into floats (key, value) and scale factors (score, weight);
// the tiling, split-K partitioning, online softmax and the merge/store epilogue are shared.
template <typename T, int G, int VEC, typename KV>
__device__ __forceinline__ void paged_decode_body(
    const KV& pages, T* __restrict__ out, long long out_tok_stride, long long out_head_stride,
    const T* __restrict__ q, long long q_tok_stride, long long q_head_stride,
    const long long* __restrict__ token_idx, long long page_stride,
    const long long* __restrict__ page_tables, long long table_stride,
    const long long* __restrict__ ctx_lens,
    const long long* __restrict__ sinks, const long long* __restrict__ windows,
    int model_window, int group, int num_chunks, int block_shift, float scale_log2,
    int partition_tokens, int max_parts,
    float* __restrict__ part_acc, float* __restrict__ part_ml) {
    constexpr int D = KV::kHeadDim;
    constexpr int TPT = D / VEC;
    constexpr int NTG = kThreads / TPT;
    // Tokens in flight per thread group and step (fewer for the largest tile, which would spill otherwise).
    constexpr int kUnroll = G >= 8 ? 2 : 4;
    static_assert(D % VEC == 0 && TPT <= 32 && 32 % TPT == 0, "a token row must fit one warp");

    const int kv_head = blockIdx.x / num_chunks;
    const int chunk = blockIdx.x - kv_head * num_chunks;
    const int num_kv_heads = gridDim.x / num_chunks;
    const int b = blockIdx.y;
    const int part = blockIdx.z;
    const int num_heads = num_kv_heads * group;
    const int head0 = kv_head * group + chunk * G;
    const int heads_here = min(G, group - chunk * G);

    const int ctx = (int)ctx_lens[b];
    const int sink = sinks != nullptr ? (int)sinks[b] : 0;
    const int window = windows != nullptr ? (int)windows[b] : 0;
    const Visible vis = visible_positions(ctx, model_window, sink, window);
    const int v0 = part * partition_tokens;
    const int v1 = min(vis.count(), v0 + partition_tokens);
    if (v0 >= v1) return;  // the whole CTA: this partition is past the request's visible positions

    const int tid = threadIdx.x;
    const int tg = tid / TPT;
    const int lane = tid - tg * TPT;

    // The policy bound to this thread's slice of the KV head. Where (before or after the queries) changes only
    // the instruction order; each policy's choice keeps ptxas at the registers of its former stand-alone kernel
    // (the 8-head tiles are sensitive to it).
    KV kv = pages;
    if (KV::kBindFirst) kv = pages.bind(kv_head, num_kv_heads, lane * VEC);

    // The group's queries, this thread's slice, pre-multiplied by scale * log2(e).
    float qv[G][VEC];
    const long long row = token_idx[b];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g < heads_here) {
            const T* qp = q + row * q_tok_stride + (head0 + g) * q_head_stride + lane * VEC;
            constexpr int QV = Elem<T>::kVec;  // elements per 16-byte load: one load, or two for 8-bit pages
#pragma unroll
            for (int c = 0; c < VEC; c += QV) Elem<T>::unpack(*reinterpret_cast<const uint4*>(qp + c), qv[g] + c);
#pragma unroll
            for (int e = 0; e < VEC; ++e) qv[g][e] *= scale_log2;
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) qv[g][e] = 0.f;
        }
    }

    float m[G], l[G], acc[G][VEC];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = kNegBig;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][e] = 0.f;
    }

    if (!KV::kBindFirst) kv = pages.bind(kv_head, num_kv_heads, lane * VEC);
    const long long* table = page_tables + b * table_stride;
    const int slot_mask = (1 << block_shift) - 1;

    for (int i0 = v0; i0 < v1; i0 += NTG * kUnroll) {  // the same trip count for every thread of the CTA
        typename KV::Row r[kUnroll];
        bool ok[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = i0 + u * NTG + tg;
            ok[u] = i < v1;
            // Past the end a lane re-reads the last visible row (cached; its score is masked to -inf below)
            // instead of branching: the table loads of all kUnroll rows issue together, not one after another.
            const int p = vis.position(min(i, v1 - 1));
            r[u] = kv.load(table[p >> block_shift] * page_stride, p & slot_mask);
        }
        float s[G][kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            float kf[VEC];
            kv.key(r[u], kf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int e = 0; e < VEC; ++e) dot = fmaf(qv[g][e], kf[e], dot);
                s[g][u] = kv.score(dot, r[u]);
            }
        }
#pragma unroll
        for (int offset = TPT / 2; offset > 0; offset /= 2) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) s[g][u] += __shfl_xor_sync(0xffffffffu, s[g][u], offset);
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                if (!ok[u]) s[g][u] = -__int_as_float(0x7f800000);  // -inf: weight 0
                mx = fmaxf(mx, s[g][u]);
            }
            const float corr = exp2_approx(m[g] - mx);
            m[g] = mx;
            l[g] *= corr;
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][e] *= corr;
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                s[g][u] = exp2_approx(s[g][u] - mx);
                l[g] += s[g][u];
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            float vf[VEC];
            kv.value(r[u], vf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float w = kv.weight(s[g][u], r[u]);
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][e] = fmaf(w, vf[e], acc[g][e]);
            }
        }
    }

    // Merge the NTG thread groups: a common max per head, then sums of the rescaled l and acc.
    __shared__ float sm_m[NTG][G];
    __shared__ float sm_l[NTG][G];
    __shared__ __align__(16) float sm_acc[NTG][G][D];
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) sm_m[tg][g] = m[g];
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        float mx = kNegBig;
#pragma unroll
        for (int t = 0; t < NTG; ++t) mx = fmaxf(mx, sm_m[t][g]);
        const float f = exp2_approx(m[g] - mx);
        if (lane == 0) sm_l[tg][g] = l[g] * f;
#pragma unroll
        for (int e = 0; e < VEC; e += 4) {
            *reinterpret_cast<float4*>(&sm_acc[tg][g][lane * VEC + e]) =
                make_float4(acc[g][e] * f, acc[g][e + 1] * f, acc[g][e + 2] * f, acc[g][e + 3] * f);
        }
    }
    __syncthreads();
    for (int o = tid; o < heads_here * D; o += kThreads) {
        const int g = o / D;
        const int d = o - g * D;
        float mx = kNegBig, sum = 0.f, a = 0.f;
#pragma unroll
        for (int t = 0; t < NTG; ++t) {
            mx = fmaxf(mx, sm_m[t][g]);
            sum += sm_l[t][g];
            a += sm_acc[t][g][d];
        }
        const int h = head0 + g;
        if (max_parts == 1) {
            store1(out + row * out_tok_stride + h * out_head_stride + d, a / sum);
        } else {
            const long long slot = ((long long)b * num_heads + h) * max_parts + part;
            part_acc[slot * D + d] = a;
            if (d == 0) {
                part_ml[slot * 2] = mx;
                part_ml[slot * 2 + 1] = sum;
            }
        }
    }
}

// K/V policy of paged_decode: T pages, a 16-byte vector (Elem<T>::kVec elements) a thread per row.
template <typename T, int D>
struct PlainKV {
    static constexpr int kHeadDim = D;
    static constexpr bool kBindFirst = true;
    struct Row { uint4 k, v; };
    const T* k;
    const T* v;
    long long head_stride, slot_stride;

    __device__ __forceinline__ PlainKV bind(int kv_head, int /*num_kv_heads*/, int elem) const {
        return {k + kv_head * head_stride + elem, v + kv_head * head_stride + elem, head_stride, slot_stride};
    }
    __device__ __forceinline__ Row load(long long page, int slot) const {
        const long long off = page + slot * slot_stride;
        Row r;
        r.k = load_stream(k + off);
        r.v = load_stream(v + off);
        return r;
    }
    __device__ __forceinline__ void key(const Row& r, float* kf) const { Elem<T>::unpack(r.k, kf); }
    __device__ __forceinline__ float score(float dot, const Row&) const { return dot; }
    __device__ __forceinline__ void value(const Row& r, float* vf) const { Elem<T>::unpack(r.v, vf); }
    __device__ __forceinline__ float weight(float p, const Row&) const { return p; }
};

template <typename T, int D, int G>
__global__ void __launch_bounds__(kThreads, MinCtas<G>::value) paged_decode(
    T* __restrict__ out, long long out_tok_stride, long long out_head_stride,
    const T* __restrict__ q, long long q_tok_stride, long long q_head_stride,
    const long long* __restrict__ token_idx,
    const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    long long page_stride, long long slot_stride, long long head_stride,
    const long long* __restrict__ page_tables, long long table_stride,
    const long long* __restrict__ ctx_lens,
    const long long* __restrict__ sinks, const long long* __restrict__ windows,
    int model_window, int group, int num_chunks, int block_shift, float scale_log2,
    int partition_tokens, int max_parts,
    float* __restrict__ part_acc, float* __restrict__ part_ml) {
    const PlainKV<T, D> pages{k_cache, v_cache, head_stride, slot_stride};
    paged_decode_body<T, G, Elem<T>::kVec>(
        pages, out, out_tok_stride, out_head_stride, q, q_tok_stride, q_head_stride, token_idx, page_stride,
        page_tables, table_stride, ctx_lens, sinks, windows, model_window, group, num_chunks, block_shift,
        scale_log2, partition_tokens, max_parts, part_acc, part_ml);
}

// K/V policy of paged_decode_q8 (executor_svc/kv_quant.py): 8 bytes a thread per row, dequantized in registers,
// never into a copy of the pool. Byte layout of a page's layer: K data [block, kv_heads, D] then K scales, V data
// then V scales (V and FP8 K: bf16 per (slot, head); INT8 K: an exponent byte per (head, channel), the page's
// power-of-two scale). A token-scaled K folds its scale into the score (s = scale * q.k), V's into the softmax
// weight (acc += p * scale * v).
template <typename Q, int D>
struct Q8KV {
    static constexpr int kHeadDim = D;
    static constexpr float kUnit = Q8<Q>::kUnit;
    static constexpr bool kBindFirst = false;
    struct Row { uint2 k, v, kx; float ks, vs; };
    const unsigned char* k;
    const unsigned char* ks;
    const unsigned char* v;
    const unsigned char* vs;
    long long head_stride, slot_stride, scale_slot;  // scale_slot: bytes between two slots' bf16 scales

    __device__ __forceinline__ Q8KV bind(int kv_head, int num_kv_heads, int elem) const {
        return {k + kv_head * head_stride + elem, ks + (Q8<Q>::kChannelK ? kv_head * D + elem : 2 * kv_head),
                v + kv_head * head_stride + elem, vs + 2 * kv_head, head_stride, slot_stride,
                2LL * num_kv_heads};
    }
    __device__ __forceinline__ Row load(long long page, int slot) const {
        Row r;
        r.k = load_stream8(k + page + slot * slot_stride);
        r.v = load_stream8(v + page + slot * slot_stride);
        r.vs = kUnit * bf16_bits_to_float(*reinterpret_cast<const unsigned short*>(vs + page + slot * scale_slot));
        if (Q8<Q>::kChannelK) {
            r.kx = load_stream8(ks + page);
            r.ks = kUnit;
        } else {
            r.kx = make_uint2(0u, 0u);
            r.ks = kUnit * bf16_bits_to_float(*reinterpret_cast<const unsigned short*>(ks + page +
                                                                                      slot * scale_slot));
        }
        return r;
    }
    __device__ __forceinline__ void key(const Row& r, float* kf) const {
        Q8<Q>::unpack4(r.k.x, kf);
        Q8<Q>::unpack4(r.k.y, kf + 4);
        if (Q8<Q>::kChannelK) {
            float cs[8];
            exp_bytes_to_scales(r.kx.x, cs);
            exp_bytes_to_scales(r.kx.y, cs + 4);
#pragma unroll
            for (int e = 0; e < 8; ++e) kf[e] *= cs[e];
        }
    }
    __device__ __forceinline__ float score(float dot, const Row& r) const { return dot * r.ks; }
    __device__ __forceinline__ void value(const Row& r, float* vf) const {
        Q8<Q>::unpack4(r.v.x, vf);
        Q8<Q>::unpack4(r.v.y, vf + 4);
    }
    __device__ __forceinline__ float weight(float p, const Row& r) const { return p * r.vs; }
};

// paged_decode over 8-bit pages: the same tiling, online softmax and split-K (see Q8KV).
template <typename T, typename Q, int D, int G>
__global__ void __launch_bounds__(kThreads, MinCtas<G>::value) paged_decode_q8(
    T* __restrict__ out, long long out_tok_stride, long long out_head_stride,
    const T* __restrict__ q, long long q_tok_stride, long long q_head_stride,
    const long long* __restrict__ token_idx,
    const unsigned char* __restrict__ k_data, const unsigned char* __restrict__ k_scale,
    const unsigned char* __restrict__ v_data, const unsigned char* __restrict__ v_scale,
    long long page_stride, long long slot_stride, long long head_stride,
    const long long* __restrict__ page_tables, long long table_stride,
    const long long* __restrict__ ctx_lens,
    const long long* __restrict__ sinks, const long long* __restrict__ windows,
    int model_window, int group, int num_chunks, int block_shift, float scale_log2,
    int partition_tokens, int max_parts,
    float* __restrict__ part_acc, float* __restrict__ part_ml) {
    const Q8KV<Q, D> pages{k_data, k_scale, v_data, v_scale, head_stride, slot_stride, 0};
    paged_decode_body<T, G, 8>(
        pages, out, out_tok_stride, out_head_stride, q, q_tok_stride, q_head_stride, token_idx, page_stride,
        page_tables, table_stride, ctx_lens, sinks, windows, model_window, group, num_chunks, block_shift,
        scale_log2, partition_tokens, max_parts, part_acc, part_ml);
}

// Merges the partitions of paged_decode. Grid (num_heads, batch), D threads: one output element a thread.
template <typename T, int D>
__global__ void __launch_bounds__(D) paged_decode_reduce(
    T* __restrict__ out, long long out_tok_stride, long long out_head_stride,
    const long long* __restrict__ token_idx, const long long* __restrict__ ctx_lens,
    const long long* __restrict__ sinks, const long long* __restrict__ windows,
    int model_window, int partition_tokens, int max_parts,
    const float* __restrict__ part_acc, const float* __restrict__ part_ml) {
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int d = threadIdx.x;
    const int ctx = (int)ctx_lens[b];
    const int sink = sinks != nullptr ? (int)sinks[b] : 0;
    const int window = windows != nullptr ? (int)windows[b] : 0;
    const Visible vis = visible_positions(ctx, model_window, sink, window);
    const int num_parts = min(max_parts, (vis.count() + partition_tokens - 1) / partition_tokens);
    const long long base = ((long long)b * gridDim.x + h) * max_parts;
    float mx = kNegBig;
    for (int p = 0; p < num_parts; ++p) mx = fmaxf(mx, part_ml[(base + p) * 2]);
    float sum = 0.f, a = 0.f;
    for (int p = 0; p < num_parts; ++p) {
        const float f = exp2_approx(part_ml[(base + p) * 2] - mx);
        sum = fmaf(part_ml[(base + p) * 2 + 1], f, sum);
        a = fmaf(part_acc[(base + p) * D + d], f, a);
    }
    store1(out + token_idx[b] * out_tok_stride + h * out_head_stride + d, a / sum);
}

}  // namespace pkv
