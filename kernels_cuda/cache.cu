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

}  // namespace pkv
