/* cuda/sm80/rms_norm.cu: batch-invariant RMSNorm over the last dimension, forward and backward, for
 * sm_80+ (runs on H100 through sm_90 SASS). Contract: csrc/ops/rms_norm.h.
 *
 *   forward:  rstd = 1 / sqrt(sum_j x_j^2 / cols + eps) (IEEE sqrt and divide), h_j = x_j * rstd,
 *             y_j = round(h_j * w_j) | round(w_j * round(h_j)) (round_before_weight) | round(h_j)
 *   backward: g_j = dy_j * w_j, c = rstd^3 * (sum_j g_j x_j) / cols, dx_j = rstd * g_j - x_j * c,
 *             dweight_j = sum_r dy_rj * h'_rj (h' = round(h) with round_before_weight, else h)
 * fp32 arithmetic, bf16 / fp16 / fp32 storage; fp64: RLK_UNSUPPORTED.
 *
 * Plan (rowops.cuh: chunks of V = 16 bytes of x, the row plan chosen by cols):
 *   forward, register plan (cols <= 16384 16-bit / 8192 fp32): x's chunks (and the weight's, same
 *     columns) are loaded once into registers, up to 4 x 16 bytes per thread all in flight; sum of
 *     squares -> row reduction -> rstd -> y: one read, one write. A warp per row (4 rows per CTA)
 *     up to 128 chunks, else a CTA of 64..512 threads per row.
 *   forward, loop plan (longer rows): 1024 threads per row; pass 1 sums the squares and caches the
 *     row's first chunks in shared memory, pass 2 re-reads (cache, then L2/HBM) and writes y.
 *   backward: a CTA owns RMS_ROW_BLOCK = 16 consecutive rows (one row when dweight is not wanted)
 *     and walks them in order; rows of up to 256 threads (register plan) load the next row's x and
 *     dy while they reduce the current one (the loop plan reads each row twice). The weight is
 *     re-read per row (L1). Per row: dot -> row reduction -> dx. The
 *     dweight partial of the block, P[b][j] = sum over its rows in increasing r of dy * h', lives
 *     in shared memory (register plan; [V][chunks] so that the owning threads' accesses are
 *     conflict-free) or directly in the workspace row (loop plan); each column is owned by one
 *     thread throughout, so no barrier and no atomic is involved. P goes to the workspace
 *     (ceil(rows / 16) x cols fp32; ctx->workspace_bytes). A second kernel then forms
 *     dweight_j = sum_b P[b][j]: 16 warps per 32 columns, warp w summing its contiguous range of
 *     blocks in increasing b, then the 16 range sums added in increasing w, rounded once.
 * Load path: 16-byte vector accesses when every base pointer and row stride is 16-byte aligned,
 * element accesses otherwise; both give the same bits.
 *
 * Batch invariance: y, rstd and dx of a row are computed by one warp / CTA in an order fixed by cols
 * (plan, chunk ownership, per-thread order, shuffle butterfly, increasing-warp combine); the row
 * count and the row's block only change which CTA computes it. dweight sums over all rows in a
 * fixed order (fixed blocks, fixed ranges): bitwise equal run to run. No atomics.
 *
 * Build (compile check): nvcc -c csrc/cuda/sm80/rms_norm.cu -O3 -std=c++17 -lineinfo -Xcompiler -fPIC \
 *   --expt-relaxed-constexpr -Xptxas -v -Icsrc -gencode arch=compute_80,code=sm_80 \
 *   -gencode arch=compute_90,code=sm_90
 * Test (GPU): python3 scripts/rowops_sm80_probe.py
 */
#include <cuda_runtime.h>

#include "cuda/sm80/rowops.cuh"
#include "ops/rms_norm.h"

using namespace rowops;

constexpr int RMS_ROW_BLOCK = 16;   /* rows per dweight partial */
constexpr int FINAL_WARPS = 16;     /* dweight finalize: warps (block ranges) per 32 columns */

/* y of one chunk from x (fp32), the weight chunk and rstd. */
template <typename T, int V, typename I>
__device__ __forceinline__ void rms_out(float (&o)[V], const float (&xv)[V], bool has_w, const Chunk<T, V> &wc,
                                        float rstd, I j0, I cols, int round_before_weight) {
    float wv[V];
    unpack(wc, wv, j0, cols, 0.0f);
#pragma unroll
    for (int e = 0; e < V; e++) {
        const float h = xv[e] * rstd;
        o[e] = !has_w ? h : round_before_weight ? wv[e] * round_to<T>(h) : h * wv[e];
    }
}

/* ------------------------------------ forward ----------------------------------------------- */

template <typename T>
__global__ void __launch_bounds__(kRegMaxThreads)
rms_fwd_reg_kernel(const T *__restrict__ x, int64_t ldx, const T *__restrict__ w, T *__restrict__ y, int64_t ldy,
                   float *__restrict__ rstd_out, int64_t rows, int64_t cols64, float eps, int round_before_weight,
                   int tpr, int vec) {
    constexpr int V = chunk_elems<T>(), K = kRegChunks;
    __shared__ float red[32];
    const int t = threadIdx.x % tpr;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr;
    if (row >= rows) return; /* only in warp-per-row CTAs */
    const T *xr = x + row * ldx;
    T *yr = y + row * ldy;
    const int cols = (int)cols64, nch = (cols + V - 1) / V; /* register plan: <= 2048 chunks */

    Chunk<T, V> xc[K], wc[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = t + k * tpr;
        if (c < nch) {
            load_chunk(xc[k], xr, c * V, cols, vec);
            if (w) load_chunk(wc[k], w, c * V, cols, vec);
        }
    }
    float xv[K][V];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = t + k * tpr;
        if (c < nch) {
            unpack(xc[k], xv[k], c * V, cols, 0.0f);
#pragma unroll
            for (int e = 0; e < V; e++) ss = fmaf(xv[k][e], xv[k][e], ss);
        }
    }
    ss = row_allreduce(ss, red, tpr, SumOp());
    const float rstd = 1.0f / sqrtf(ss / (float)cols + eps);
    if (t == 0 && rstd_out) rstd_out[row] = rstd;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = t + k * tpr;
        if (c < nch) {
            float o[V];
            rms_out<T, V>(o, xv[k], w != nullptr, wc[k], rstd, c * V, cols, round_before_weight);
            store_chunk<T, V>(yr, c * V, cols, o, vec);
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(kLoopThreads, 1)
rms_fwd_loop_kernel(const T *__restrict__ x, int64_t ldx, const T *__restrict__ w, T *__restrict__ y, int64_t ldy,
                    float *__restrict__ rstd_out, int64_t cols, float eps, int round_before_weight, int64_t cap,
                    int vec) {
    constexpr int V = chunk_elems<T>(), U = kLoopUnroll;
    extern __shared__ uint4 dyn_smem[];
    uint32_t *cache = reinterpret_cast<uint32_t *>(dyn_smem);
    __shared__ float red[32];
    const int t = threadIdx.x, T_ = blockDim.x;
    const int64_t row = blockIdx.x;
    const T *xr = x + row * ldx;
    T *yr = y + row * ldy;
    const int64_t nch = (cols + V - 1) / V;

    float ss = 0.0f;
    for (int64_t c0 = t; c0 < nch; c0 += (int64_t)T_ * U) {
        Chunk<T, V> xc[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * T_;
            if (c < nch) load_chunk(xc[u], xr, c * V, cols, vec);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * T_;
            if (c < nch) {
                if (c < cap) cache_put(cache, c, xc[u]);
                float xv[V];
                unpack(xc[u], xv, c * V, cols, 0.0f);
#pragma unroll
                for (int e = 0; e < V; e++) ss = fmaf(xv[e], xv[e], ss);
            }
        }
    }
    ss = row_allreduce(ss, red, T_, SumOp());
    const float rstd = 1.0f / sqrtf(ss / (float)cols + eps);
    if (t == 0 && rstd_out) rstd_out[row] = rstd;
    constexpr int U2 = 2; /* pass 2 holds x and w: 2 chunks each */
    for (int64_t c0 = t; c0 < nch; c0 += (int64_t)T_ * U2) {
        Chunk<T, V> xc[U2], wc[U2];
#pragma unroll
        for (int u = 0; u < U2; u++) {
            const int64_t c = c0 + (int64_t)u * T_;
            if (c < cap) cache_get(xc[u], cache, c);
            else if (c < nch) load_chunk(xc[u], xr, c * V, cols, vec);
            if (w && c < nch) load_chunk(wc[u], w, c * V, cols, vec);
        }
#pragma unroll
        for (int u = 0; u < U2; u++) {
            const int64_t c = c0 + (int64_t)u * T_;
            if (c < nch) {
                float xv[V], o[V];
                unpack(xc[u], xv, c * V, cols, 0.0f);
                rms_out<T, V>(o, xv, w != nullptr, wc[u], rstd, c * V, cols, round_before_weight);
                store_chunk<T, V>(yr, c * V, cols, o, vec);
            }
        }
    }
}

/* ------------------------------------ backward ---------------------------------------------- */

/* g = dy * w (dy without a weight) and the dot product terms g * x of one chunk, added to dot. */
template <typename T, int V, typename I>
__device__ __forceinline__ float bwd_dot(float dot, float (&g)[V], const float (&xv)[V], const float (&dv)[V],
                                         bool has_w, const Chunk<T, V> &wc, I j0, I cols) {
    float wv[V];
    unpack(wc, wv, j0, cols, 0.0f);
#pragma unroll
    for (int e = 0; e < V; e++) {
        g[e] = has_w ? dv[e] * wv[e] : dv[e];
        dot = fmaf(g[e], xv[e], dot);
    }
    return dot;
}

/* Register plan. partial: the workspace (NULL: no dweight); acc: V x nch floats of dynamic shared
 * memory, acc[e * nch + c] for column c * V + e. rb: rows per CTA. blockDim.x == tpr.
 * PREFETCH (rows of up to 256 threads, up to 255 registers): the next row's x and dy are loaded
 * before this row's reduction; 512-thread rows load each row after the previous one (128
 * registers). The arithmetic is the same. */
template <typename T, bool PREFETCH>
__global__ void __launch_bounds__(PREFETCH ? kRegMaxThreads / 2 : kRegMaxThreads)
rms_bwd_reg_kernel(const T *__restrict__ x, int64_t ldx, const T *__restrict__ dy, int64_t lddy,
                   const T *__restrict__ w, const float *__restrict__ rstd_in, T *__restrict__ dx, int64_t lddx,
                   float *__restrict__ partial, int64_t rows, int64_t cols64, int rb, int round_before_weight, int vec) {
    constexpr int V = chunk_elems<T>(), K = kRegChunks;
    extern __shared__ uint4 dyn_smem[];
    float *acc = reinterpret_cast<float *>(dyn_smem);
    __shared__ float red[32];
    const int t = threadIdx.x, tpr = blockDim.x;
    const int cols = (int)cols64, nch = (cols + V - 1) / V; /* register plan: <= 2048 chunks */
    const int64_t r0 = (int64_t)blockIdx.x * rb, r1 = min(rows, r0 + rb);

    if (partial) {
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = t + k * tpr;
            if (c < nch) {
#pragma unroll
                for (int e = 0; e < V; e++) acc[e * nch + c] = 0.0f;
            }
        }
    }
    Chunk<T, V> xc[K], dc[K];
    float rstd = 0.0f;
    {
        const T *xr = x + r0 * ldx, *dyr = dy + r0 * lddy;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = t + k * tpr;
            if (c < nch) load_chunk(xc[k], xr, c * V, cols, vec), load_chunk(dc[k], dyr, c * V, cols, vec);
        }
        rstd = rstd_in[r0];
    }
    for (int64_t r = r0; r < r1; r++) {
        /* the next row's loads go out before this row's reduction */
        Chunk<T, V> xn[K], dn[K];
        float rstd_next = 0.0f;
        if (PREFETCH && r + 1 < r1) {
            const T *xr = x + (r + 1) * ldx, *dyr = dy + (r + 1) * lddy;
#pragma unroll
            for (int k = 0; k < K; k++) {
                const int c = t + k * tpr;
                if (c < nch) load_chunk(xn[k], xr, c * V, cols, vec), load_chunk(dn[k], dyr, c * V, cols, vec);
            }
            rstd_next = rstd_in[r + 1];
        }
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = t + k * tpr;
            if (c < nch) {
                Chunk<T, V> wc; /* the weight is re-read from L1 per row: registers go to the prefetch */
                if (w) load_chunk(wc, w, c * V, cols, vec);
                float xv[V], dv[V], g[V];
                unpack(xc[k], xv, c * V, cols, 0.0f);
                unpack(dc[k], dv, c * V, cols, 0.0f);
                dot = bwd_dot<T, V>(dot, g, xv, dv, w != nullptr, wc, c * V, cols);
            }
        }
        dot = row_allreduce(dot, red, tpr, SumOp());
        const float coef = rstd * rstd * rstd * (dot / (float)cols);
        T *dxr = dx + r * lddx;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = t + k * tpr;
            if (c < nch) {
                Chunk<T, V> wc;
                if (w) load_chunk(wc, w, c * V, cols, vec);
                launder(xc[k]), launder(dc[k]), launder(wc);
                float xv[V], dv[V], g[V], o[V];
                unpack(xc[k], xv, c * V, cols, 0.0f);
                unpack(dc[k], dv, c * V, cols, 0.0f);
                bwd_dot<T, V>(0.0f, g, xv, dv, w != nullptr, wc, c * V, cols);
#pragma unroll
                for (int e = 0; e < V; e++) o[e] = rstd * g[e] - xv[e] * coef;
                store_chunk<T, V>(dxr, c * V, cols, o, vec);
                if (partial) {
#pragma unroll
                    for (int e = 0; e < V; e++) {
                        float h = xv[e] * rstd;
                        if (round_before_weight) h = round_to<T>(h);
                        acc[e * nch + c] = fmaf(dv[e], h, acc[e * nch + c]);
                    }
                }
            }
        }
        if (PREFETCH) {
#pragma unroll
            for (int k = 0; k < K; k++) xc[k] = xn[k], dc[k] = dn[k];
            rstd = rstd_next;
        } else if (r + 1 < r1) {
            const T *xr = x + (r + 1) * ldx, *dyr = dy + (r + 1) * lddy;
#pragma unroll
            for (int k = 0; k < K; k++) {
                const int c = t + k * tpr;
                if (c < nch) load_chunk(xc[k], xr, c * V, cols, vec), load_chunk(dc[k], dyr, c * V, cols, vec);
            }
            rstd = rstd_in[r + 1];
        }
    }
    if (partial) {
        float *prow = partial + (int64_t)blockIdx.x * cols;
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = t + k * tpr;
            if (c < nch) {
#pragma unroll
                for (int e = 0; e < V; e++)
                    if (c * V + e < cols) prow[c * V + e] = acc[e * nch + c];
            }
        }
    }
}

/* Loop plan: 1024 threads, each row read twice, the dweight partial accumulated in place in the
 * workspace row of the block (each column owned by one thread). */
template <typename T>
__global__ void __launch_bounds__(kLoopThreads, 1)
rms_bwd_loop_kernel(const T *__restrict__ x, int64_t ldx, const T *__restrict__ dy, int64_t lddy,
                    const T *__restrict__ w, const float *__restrict__ rstd_in, T *__restrict__ dx, int64_t lddx,
                    float *__restrict__ partial, int64_t rows, int64_t cols, int rb, int round_before_weight,
                    int vec) {
    constexpr int V = chunk_elems<T>(), U = 1; /* x, dy, w of one chunk in flight: no spills at 64 registers */
    __shared__ float red[32];
    const int t = threadIdx.x, T_ = blockDim.x;
    const int64_t nch = (cols + V - 1) / V;
    const int64_t r0 = (int64_t)blockIdx.x * rb, r1 = min(rows, r0 + rb);
    float *prow = partial ? partial + (int64_t)blockIdx.x * cols : nullptr;
    if (prow)
        for (int64_t j = (int64_t)t * V; j < cols; j += (int64_t)T_ * V)
            for (int e = 0; e < V && j + e < cols; e++) prow[j + e] = 0.0f;

    for (int64_t r = r0; r < r1; r++) {
        const T *xr = x + r * ldx, *dyr = dy + r * lddy;
        const float rstd = rstd_in[r];
        float dot = 0.0f;
        for (int64_t c0 = t; c0 < nch; c0 += (int64_t)T_ * U) {
            Chunk<T, V> xc[U], dc[U], wc[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t c = c0 + (int64_t)u * T_;
                if (c < nch) {
                    load_chunk(xc[u], xr, c * V, cols, vec), load_chunk(dc[u], dyr, c * V, cols, vec);
                    if (w) load_chunk(wc[u], w, c * V, cols, vec);
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t c = c0 + (int64_t)u * T_;
                if (c < nch) {
                    float xv[V], dv[V], g[V];
                    unpack(xc[u], xv, c * V, cols, 0.0f);
                    unpack(dc[u], dv, c * V, cols, 0.0f);
                    dot = bwd_dot<T, V>(dot, g, xv, dv, w != nullptr, wc[u], c * V, cols);
                }
            }
        }
        dot = row_allreduce(dot, red, T_, SumOp());
        const float coef = rstd * rstd * rstd * (dot / (float)cols);
        T *dxr = dx + r * lddx;
        for (int64_t c0 = t; c0 < nch; c0 += (int64_t)T_ * U) {
            Chunk<T, V> xc[U], dc[U], wc[U];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t c = c0 + (int64_t)u * T_;
                if (c < nch) {
                    load_chunk(xc[u], xr, c * V, cols, vec), load_chunk(dc[u], dyr, c * V, cols, vec);
                    if (w) load_chunk(wc[u], w, c * V, cols, vec);
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t c = c0 + (int64_t)u * T_;
                if (c < nch) {
                    float xv[V], dv[V], g[V], o[V];
                    unpack(xc[u], xv, c * V, cols, 0.0f);
                    unpack(dc[u], dv, c * V, cols, 0.0f);
                    bwd_dot<T, V>(0.0f, g, xv, dv, w != nullptr, wc[u], c * V, cols);
#pragma unroll
                    for (int e = 0; e < V; e++) o[e] = rstd * g[e] - xv[e] * coef;
                    store_chunk<T, V>(dxr, c * V, cols, o, vec);
                    if (prow) {
#pragma unroll
                        for (int e = 0; e < V; e++) {
                            if (c * V + e < cols) {
                                float h = xv[e] * rstd;
                                if (round_before_weight) h = round_to<T>(h);
                                prow[c * V + e] = fmaf(dv[e], h, prow[c * V + e]);
                            }
                        }
                    }
                }
            }
        }
    }
}

/* dweight_j = sum over blocks b (nb of them) of partial[b][j]: CTA of 32 x FINAL_WARPS threads per
 * 32 columns; warp w sums blocks [w * per, (w + 1) * per) in increasing b, per = ceil(nb / 16);
 * the range sums are added in increasing w. The order depends on nb only. */
template <typename T>
__global__ void __launch_bounds__(32 * FINAL_WARPS)
rms_dweight_kernel(const float *__restrict__ partial, int64_t nb, int64_t cols, T *__restrict__ dweight) {
    __shared__ float sums[FINAL_WARPS][33];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t j = (int64_t)blockIdx.x * 32 + lane;
    const int64_t per = (nb + FINAL_WARPS - 1) / FINAL_WARPS;
    const int64_t b0 = warp * per, b1 = min(nb, b0 + per);
    float s = 0.0f;
    if (j < cols) {
#pragma unroll 8
        for (int64_t b = b0; b < b1; b++) s = __fadd_rn(s, __ldg(partial + b * cols + j));
    }
    sums[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && j < cols) {
        float total = sums[0][lane];
        for (int v = 1; v < FINAL_WARPS; v++) total = __fadd_rn(total, sums[v][lane]);
        from_f32(dweight + j, total);
    }
}

/* ------------------------------------ host -------------------------------------------------- */

static int64_t bwd_row_blocks(const rlk_rms_norm_args *a) {
    return a->rows > 0 ? (a->rows + RMS_ROW_BLOCK - 1) / RMS_ROW_BLOCK : 0;
}

template <typename T>
static int launch_fwd(const rlk_rms_norm_args *a, cudaStream_t stream) {
    constexpr int V = chunk_elems<T>();
    const RowPlan plan = plan_row(a->cols, V);
    const unsigned grid = grid_for(a->rows, plan.rows_per_cta);
    if (grid == 0) return (int)cudaErrorInvalidConfiguration;
    const int vec = vec_ok(a->x, a->ldx, sizeof(T)) && vec_ok(a->y, a->ldy, sizeof(T)) && vec_ok(a->weight, 0, sizeof(T));
    if (!plan.loop) {
        rms_fwd_reg_kernel<T><<<grid, plan.tpr * plan.rows_per_cta, 0, stream>>>(
            (const T *)a->x, a->ldx, (const T *)a->weight, (T *)a->y, a->ldy, a->rstd, a->rows, a->cols, (float)a->eps,
            a->round_before_weight, plan.tpr, vec);
    } else {
        const int optin = smem_optin_bytes();
        if (optin < 0) return -optin;
        int64_t cap = (optin - 1024) / (V * (int64_t)sizeof(T));
        if (cap > plan.nch) cap = plan.nch;
        if (cap < 0) cap = 0;
        const size_t smem = (size_t)(cap * V * (int64_t)sizeof(T));
        auto kernel = rms_fwd_loop_kernel<T>;
        const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess) return (int)err;
        kernel<<<grid, plan.tpr, smem, stream>>>((const T *)a->x, a->ldx, (const T *)a->weight, (T *)a->y, a->ldy,
                                                 a->rstd, a->cols, (float)a->eps, a->round_before_weight, cap, vec);
    }
    return (int)cudaGetLastError();
}

template <typename T>
static int launch_bwd(const rlk_rms_norm_args *a, cudaStream_t stream) {
    constexpr int V = chunk_elems<T>();
    const RowPlan plan = plan_row(a->cols, V);
    float *partial = a->dweight ? (float *)a->workspace : nullptr;
    if (a->dweight && a->rows > 0 && a->cols > 0 && !partial) return (int)cudaErrorInvalidValue;
    const int vec = vec_ok(a->x, a->ldx, sizeof(T)) && vec_ok(a->dy, a->lddy, sizeof(T)) &&
                    vec_ok(a->dx, a->lddx, sizeof(T)) && vec_ok(a->weight, 0, sizeof(T));
    if (a->rows > 0 && a->cols > 0) {
        const int rb = partial ? RMS_ROW_BLOCK : 1;
        const unsigned grid = grid_for(a->rows, rb);
        if (grid == 0) return (int)cudaErrorInvalidConfiguration;
        if (!plan.loop) {
            const size_t smem = partial ? (size_t)(plan.nch * V * (int64_t)sizeof(float)) : 0;
            auto kernel = plan.tpr <= kRegMaxThreads / 2 ? rms_bwd_reg_kernel<T, true> : rms_bwd_reg_kernel<T, false>;
            if (smem > 0) {
                const cudaError_t err =
                    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
                if (err != cudaSuccess) return (int)err;
            }
            kernel<<<grid, plan.tpr, smem, stream>>>((const T *)a->x, a->ldx, (const T *)a->dy, a->lddy,
                                                     (const T *)a->weight, a->rstd, (T *)a->dx, a->lddx, partial,
                                                     a->rows, a->cols, rb, a->round_before_weight, vec);
        } else {
            rms_bwd_loop_kernel<T><<<grid, plan.tpr, 0, stream>>>(
                (const T *)a->x, a->ldx, (const T *)a->dy, a->lddy, (const T *)a->weight, a->rstd, (T *)a->dx,
                a->lddx, partial, a->rows, a->cols, rb, a->round_before_weight, vec);
        }
    }
    if (a->dweight && a->cols > 0) {
        const int64_t ctas = (a->cols + 31) / 32;
        if (ctas > 0x7fffffff) return (int)cudaErrorInvalidConfiguration;
        rms_dweight_kernel<T><<<(unsigned)ctas, 32 * FINAL_WARPS, 0, stream>>>(partial, bwd_row_blocks(a), a->cols,
                                                                            (T *)a->dweight);
    }
    return (int)cudaGetLastError();
}

extern "C" int rlk_rms_norm_fwd_sm80(const rlk_rms_norm_args *args, rlk_context *ctx) {
    if (args->dtype != RLK_F32 && args->dtype != RLK_BF16 && args->dtype != RLK_F16) return RLK_UNSUPPORTED;
    ctx->kernel = "rms_norm_fwd_sm80";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only || args->rows <= 0) return RLK_OK;
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    if (args->dtype == RLK_F32) return launch_fwd<float>(args, stream);
    if (args->dtype == RLK_BF16) return launch_fwd<__nv_bfloat16>(args, stream);
    return launch_fwd<__half>(args, stream);
}

extern "C" int rlk_rms_norm_bwd_sm80(const rlk_rms_norm_args *args, rlk_context *ctx) {
    if (args->dtype != RLK_F32 && args->dtype != RLK_BF16 && args->dtype != RLK_F16) return RLK_UNSUPPORTED;
    ctx->kernel = "rms_norm_bwd_sm80";
    ctx->workspace_bytes = args->dweight ? bwd_row_blocks(args) * args->cols * (int64_t)sizeof(float) : 0;
    if (ctx->plan_only) return RLK_OK;
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    if (args->dtype == RLK_F32) return launch_bwd<float>(args, stream);
    if (args->dtype == RLK_BF16) return launch_bwd<__nv_bfloat16>(args, stream);
    return launch_bwd<__half>(args, stream);
}
