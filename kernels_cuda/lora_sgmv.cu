// Multi-LoRA deltas in the punica / S-LoRA SGMV style: every flat row of a step adds its own adapter's delta to a
// fused linear's output, rows of several adapters and of the base model in one launch (executor_svc/lora/
// cuda_sgmv.py; the torch path it replaces on a GPU is executor_svc/lora/batch.py's LoraBatch.delta).
//
// Stacked weights (executor_svc/lora/stack.py), stack row n = slot n, each row's inner block contiguous:
//   A    [N, in, M * R]   element (n, k, j) at a + n * a_stride + k * cols + j        (cols = M * R)
//   B_m  [N, R, width]    element (n, r, c) at b + n * b_stride + r * width + c
// and per row t its stack row row_adapter[t] (-1: the base model; such a row is neither read nor written).
//
//   lora_shrink:  part[z, t, j]  = sum over k of split z of  x[t, k] * A[n_t, k, j]                  (fp32)
//   lora_expand:  y[t, c]       += scale[n_t] * sum_r (sum_z part[z, t, col0 + r]) * B_m[n_t, r, c]
//                 (y: module m's slice of the fused output, col0 = m * R; one launch per module)
//
// | kernel | grid                                   | a CTA                                  | a thread            |
// |--------|----------------------------------------|----------------------------------------|---------------------|
// | shrink | (row tiles, ceil(cols / 32), splits)   | kTileRows rows x 32 columns of s       | 1 column, k-group   |
// | expand | (row tiles, ceil(width / 256), 1)      | kTileRows rows x 256 columns of y      | 1 column            |
//
// A CTA takes kTileRows consecutive rows. A request's tokens are consecutive rows of one adapter, so a tile is
// mostly one *run* of rows sharing an adapter: each weight element is loaded once per run and used for all of its
// rows (one fp32 accumulator per tile row, in registers). Split-K over `in` (grid z) gives a decode step with few
// rows enough CTAs; the expand kernel sums the splits' partials while it stages s in shared memory: no atomics, and
// the result does not depend on the order CTAs run in. All arithmetic is fp32; y is rounded once, at the end.
#include "common.cuh"

namespace pkv {

constexpr int kLoraThreads = 256;
constexpr int kTileRows = 8;                                  // rows of a CTA (a tile)
constexpr int kShrinkCols = 32;                               // columns of s a shrink CTA computes: one warp's
constexpr int kShrinkGroups = kLoraThreads / kShrinkCols;     // k-groups: the warps split each chunk of k
constexpr int kShrinkChunk = 128;                             // x elements per row staged in shared memory a step
constexpr int kExpandCols = kLoraThreads;                     // columns of y an expand CTA writes: one a thread
constexpr int kRankChunk = 64;                                // ranks of s staged in shared memory a step

// The adapter runs of one row tile: runs [lo[u], hi[u]) of rows using stack row adapter[u]; rows of the base
// model (and rows past the batch) are in none. row[r]: row r's stack row (-1: none).
struct TileRuns {
    int count;
    int lo[kTileRows];
    int hi[kTileRows];
    long long adapter[kTileRows];
    long long row[kTileRows];
};

// Fills ``runs`` (thread 0) for rows [t0, t0 + rows); every thread returns after a barrier, so all see them.
__device__ __forceinline__ void find_runs(TileRuns& runs, const long long* __restrict__ row_adapter, int t0,
                                          int rows) {
    if (threadIdx.x == 0) {
        int n = 0;
        for (int r = 0; r < kTileRows; ++r) {
            const long long a = r < rows ? row_adapter[t0 + r] : -1;
            runs.row[r] = a;
            if (a < 0) continue;
            if (n > 0 && runs.adapter[n - 1] == a && runs.hi[n - 1] == r) {
                runs.hi[n - 1] = r + 1;
            } else {
                runs.lo[n] = r;
                runs.hi[n] = r + 1;
                runs.adapter[n] = a;
                ++n;
            }
        }
        runs.count = n;
    }
    __syncthreads();
}

// x [T, in] (row stride x_stride) -> part [splits, T, cols] fp32, the rows with an adapter only. split_k: elements
// of k per split (a multiple of kShrinkChunk; every split non-empty). 256 threads.
template <typename T>
__global__ void __launch_bounds__(kLoraThreads) lora_shrink(
    float* __restrict__ part, const T* __restrict__ x, long long x_stride,
    const T* __restrict__ a, long long a_stride, const long long* __restrict__ row_adapter,
    int num_rows, int in_features, int cols, int split_k) {
    __shared__ TileRuns runs;
    __shared__ float xs[kTileRows][kShrinkChunk];
    __shared__ float sums[kShrinkGroups][kTileRows][kShrinkCols];
    const int t0 = blockIdx.x * kTileRows;
    find_runs(runs, row_adapter, t0, min(kTileRows, num_rows - t0));
    if (runs.count == 0) return;  // the whole CTA: rows of the base model only

    const int lane = threadIdx.x % kShrinkCols;
    const int group = threadIdx.x / kShrinkCols;  // the same for a whole warp: xs reads are broadcasts
    const int j = blockIdx.y * kShrinkCols + lane;
    const bool col_ok = j < cols;
    const int k_begin = blockIdx.z * split_k;
    const int k_end = min(in_features, k_begin + split_k);

    float acc[kTileRows];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) acc[r] = 0.f;

    for (int k0 = k_begin; k0 < k_end; k0 += kShrinkChunk) {  // the same trip count for every thread of the CTA
        const int kn = min(kShrinkChunk, k_end - k0);
        __syncthreads();  // the previous chunk's xs is read
        for (int i = threadIdx.x; i < kTileRows * kShrinkChunk; i += kLoraThreads) {
            const int r = i / kShrinkChunk;
            const int kk = i - r * kShrinkChunk;
            xs[r][kk] = runs.row[r] >= 0 && kk < kn ? to_float(x[(t0 + r) * x_stride + k0 + kk]) : 0.f;
        }
        __syncthreads();
        for (int u = 0; u < runs.count; ++u) {
            const int lo = runs.lo[u], hi = runs.hi[u];
            const T* ak = a + runs.adapter[u] * a_stride + (long long)k0 * cols + j;
#pragma unroll 4
            for (int kk = group; kk < kn; kk += kShrinkGroups) {
                const float w = col_ok ? to_float(ak[(long long)kk * cols]) : 0.f;
#pragma unroll
                for (int r = 0; r < kTileRows; ++r) {
                    if (r >= lo && r < hi) acc[r] += xs[r][kk] * w;
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < kTileRows; ++r) sums[group][r][lane] = acc[r];
    __syncthreads();
    for (int i = threadIdx.x; i < kTileRows * kShrinkCols; i += kLoraThreads) {
        const int r = i / kShrinkCols;
        const int c = i - r * kShrinkCols;
        const int jc = blockIdx.y * kShrinkCols + c;
        if (runs.row[r] < 0 || jc >= cols) continue;
        float s = 0.f;
#pragma unroll
        for (int g = 0; g < kShrinkGroups; ++g) s += sums[g][r][c];
        part[((long long)blockIdx.z * num_rows + t0 + r) * cols + jc] = s;
    }
}

// y [T, width] (row stride y_stride: one module's slice of the fused output) += scale * s_m @ B_m, in place, for
// the rows with an adapter; s_m = columns [col0, col0 + rank) of part summed over its splits. 256 threads.
template <typename T>
__global__ void __launch_bounds__(kLoraThreads) lora_expand(
    T* __restrict__ y, long long y_stride, const float* __restrict__ part, int splits, int cols, int col0,
    const T* __restrict__ b, long long b_stride, const long long* __restrict__ row_adapter,
    const float* __restrict__ scales, int num_rows, int rank, int width) {
    __shared__ TileRuns runs;
    __shared__ float ss[kTileRows][kRankChunk];
    const int t0 = blockIdx.x * kTileRows;
    find_runs(runs, row_adapter, t0, min(kTileRows, num_rows - t0));
    if (runs.count == 0) return;  // the whole CTA: rows of the base model only

    const int c = blockIdx.y * kExpandCols + threadIdx.x;
    const bool col_ok = c < width;
    const long long split_stride = (long long)num_rows * cols;

    float acc[kTileRows];
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) acc[r] = 0.f;

    for (int r0 = 0; r0 < rank; r0 += kRankChunk) {  // the same trip count for every thread of the CTA
        const int rn = min(kRankChunk, rank - r0);
        __syncthreads();  // the previous chunk's ss is read
        for (int i = threadIdx.x; i < kTileRows * kRankChunk; i += kLoraThreads) {
            const int r = i / kRankChunk;
            const int q = i - r * kRankChunk;
            float v = 0.f;
            if (runs.row[r] >= 0 && q < rn) {
                const float* p = part + (long long)(t0 + r) * cols + col0 + r0 + q;
                for (int z = 0; z < splits; ++z) v += p[z * split_stride];
            }
            ss[r][q] = v;
        }
        __syncthreads();
        for (int u = 0; u < runs.count; ++u) {
            const int lo = runs.lo[u], hi = runs.hi[u];
            const T* bq = b + runs.adapter[u] * b_stride + (long long)r0 * width + c;
#pragma unroll 4
            for (int q = 0; q < rn; ++q) {
                const float w = col_ok ? to_float(bq[(long long)q * width]) : 0.f;
#pragma unroll
                for (int r = 0; r < kTileRows; ++r) {
                    if (r >= lo && r < hi) acc[r] += ss[r][q] * w;
                }
            }
        }
    }

    if (!col_ok) return;
#pragma unroll
    for (int r = 0; r < kTileRows; ++r) {
        const long long n = runs.row[r];
        if (n < 0) continue;
        T* out = y + (t0 + r) * y_stride + c;
        store1(out, to_float(*out) + scales[n] * acc[r]);
    }
}

}  // namespace pkv
