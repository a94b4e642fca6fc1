/* cuda/sm80/softmax.cu: batch-invariant softmax / log_softmax over the last dimension, forward and
 * backward, for sm_80+ (runs on H100 through sm_90 SASS). Contract: csrc/ops/softmax.h.
 *
 *   forward:  m = max_j x_j, z = sum_j exp(x_j - m),
 *             softmax y_j = exp(x_j - m) / z,  log_softmax y_j = (x_j - m) - log(z)
 *   backward: softmax dx_j = y_j (dy_j - sum_k dy_k y_k),  log_softmax dx_j = dy_j - exp(y_j) sum_k dy_k
 * in fp32 (expf / logf / IEEE division: no fast-math approximations), bf16 / fp16 / fp32 storage,
 * out_dtype = in_dtype or fp32 for 16-bit inputs; fp64: RLK_UNSUPPORTED.
 *
 * Plan (rowops.cuh: chunks of V = 16 bytes of input, the row plan chosen by cols):
 *   register plan (cols <= 16384 16-bit / 8192 fp32): the row's chunks are loaded once into
 *     registers (up to 4 x 16 bytes per thread, all loads in flight), then max -> row reduction ->
 *     exp and sum -> row reduction -> write: one read and one write of the row. A warp per row
 *     (4 rows per CTA) for rows of up to 128 chunks, else a CTA of 64..512 threads per row.
 *   loop plan (longer rows, e.g. a 151936-entry vocabulary): a CTA of 1024 threads per row; pass 1
 *     folds the thread's chunks, in increasing order, into an online (max, sum) state (rescaled
 *     only when the max moves) and copies the first `cap` chunks of the row into dynamic shared
 *     memory (as much as the SM offers, one CTA per SM); the states merge across the row; pass 2
 *     re-reads the row (cached chunks from shared memory, the rest from L2/HBM) and writes y.
 *   backward: the same two plans over (y, dy): the row sum (sum dy y, or sum dy for log_softmax),
 *     then dx. log_softmax's sum needs dy only, so y is read once, after (register plan: its loads
 *     are in flight during the reduction), and the loop plan caches dy alone.
 * Load path: 16-byte vector accesses when every base pointer and row stride is 16-byte aligned,
 * element accesses otherwise; both give the same bits.
 *
 * Batch invariance: each row is computed by its own warp or CTA, in an order fixed by cols (the
 * plan, the chunk ownership t + k * tpr, the per-thread fold order, the shuffle butterfly and the
 * increasing-warp combine); the number of rows only changes the grid. No atomics, no
 * cross-row state. The cache size (device dependent) only moves where a chunk is re-read from.
 *
 * Build (compile check): nvcc -c csrc/cuda/sm80/softmax.cu -O3 -std=c++17 -lineinfo -Xcompiler -fPIC \
 *   --expt-relaxed-constexpr -Xptxas -v -Icsrc -gencode arch=compute_80,code=sm_80 \
 *   -gencode arch=compute_90,code=sm_90
 * Test (GPU): python3 scripts/rowops_sm80_probe.py (accuracy vs fp64, torch semantics, bitwise
 *   invariance over row counts / positions / layouts / streams, timing against torch).
 */
#include <cuda_runtime.h>

#include "cuda/sm80/rowops.cuh"
#include "ops/softmax.h"

using namespace rowops;

/* ------------------------------------ forward ----------------------------------------------- */

template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kRegMaxThreads)
softmax_fwd_reg_kernel(const Tin *__restrict__ x, int64_t ldx, Tout *__restrict__ y, int64_t ldy, int64_t rows,
                       int64_t cols64, int tpr, int log_out, int vec) {
    constexpr int V = chunk_elems<Tin>(), K = kRegChunks;
    __shared__ float red[32];
    const int t = threadIdx.x % tpr;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr;
    if (row >= rows) return; /* only in warp-per-row CTAs, whose warps never wait for each other */
    const Tin *xr = x + row * ldx;
    Tout *yr = y + row * ldy;
    const int cols = (int)cols64, nch = (cols + V - 1) / V; /* register plan: <= 2048 chunks */

    Chunk<Tin, V> ch[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = t + k * tpr;
        if (c < nch) load_chunk(ch[k], xr, c * V, cols, vec);
    }
    float v[K][V];
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = t + k * tpr;
        if (c < nch) {
            unpack(ch[k], v[k], c * V, cols, -INFINITY);
#pragma unroll
            for (int e = 0; e < V; e++) m = fmaxf(m, v[k][e]);
        }
    }
    m = row_allreduce(m, red, tpr, MaxOp());
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = t + k * tpr;
        if (c < nch) {
#pragma unroll
            for (int e = 0; e < V; e++) {
                const float d = v[k][e] - m, p = expf(d);
                s = __fadd_rn(s, p);
                v[k][e] = log_out ? d : p;
            }
        }
    }
    const float z = row_allreduce(s, red, tpr, SumOp()), log_z = logf(z);
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = t + k * tpr;
        if (c < nch) {
            float o[V];
#pragma unroll
            for (int e = 0; e < V; e++) o[e] = log_out ? v[k][e] - log_z : v[k][e] / z;
            store_chunk<Tout, V>(yr, c * V, cols, o, vec);
        }
    }
}

template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kLoopThreads, 1)
softmax_fwd_loop_kernel(const Tin *__restrict__ x, int64_t ldx, Tout *__restrict__ y, int64_t ldy, int64_t cols,
                        int64_t cap, int log_out, int vec) {
    constexpr int V = chunk_elems<Tin>(), U = kLoopUnroll;
    extern __shared__ uint4 dyn_smem[];
    uint32_t *cache = reinterpret_cast<uint32_t *>(dyn_smem);
    __shared__ float red_m[32], red_s[32];
    const int t = threadIdx.x, T = blockDim.x;
    const int64_t row = blockIdx.x;
    const Tin *xr = x + row * ldx;
    Tout *yr = y + row * ldy;
    const int64_t nch = (cols + V - 1) / V;

    MaxSum st = {-INFINITY, 0.0f};
    for (int64_t c0 = t; c0 < nch; c0 += (int64_t)T * U) {
        Chunk<Tin, V> ch[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * T;
            if (c < nch) load_chunk(ch[u], xr, c * V, cols, vec);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * T;
            if (c < nch) {
                if (c < cap) cache_put(cache, c, ch[u]);
                float v[V];
                unpack(ch[u], v, c * V, cols, -INFINITY);
                online_update(st, v);
            }
        }
    }
    st = row_allreduce(st, red_m, red_s, T);
    const float m = st.m, z = st.s, log_z = logf(z);
    /* pass 2: each thread re-reads the chunks it cached itself, so no barrier is needed */
    for (int64_t c0 = t; c0 < nch; c0 += (int64_t)T * U) {
        Chunk<Tin, V> ch[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * T;
            if (c < cap) cache_get(ch[u], cache, c);
            else if (c < nch) load_chunk(ch[u], xr, c * V, cols, vec);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * T;
            if (c < nch) {
                float v[V];
                unpack(ch[u], v, c * V, cols, 0.0f);
#pragma unroll
                for (int e = 0; e < V; e++) v[e] = log_out ? (v[e] - m) - log_z : expf(v[e] - m) / z;
                store_chunk<Tout, V>(yr, c * V, cols, v, vec);
            }
        }
    }
}

/* ------------------------------------ backward ---------------------------------------------- */

/* Row sum of the backward: log ? sum_k dy_k : sum_k dy_k y_k, over a chunk pair (filled with 0). */
template <int V>
__device__ __forceinline__ float bwd_terms(float s, const float (&yv)[V], const float (&dv)[V], int log_out) {
#pragma unroll
    for (int e = 0; e < V; e++) s = log_out ? __fadd_rn(s, dv[e]) : __fadd_rn(s, __fmul_rn(dv[e], yv[e]));
    return s;
}

template <int V>
__device__ __forceinline__ void bwd_dx(float (&o)[V], const float (&yv)[V], const float (&dv)[V], float s, int log_out) {
#pragma unroll
    for (int e = 0; e < V; e++) o[e] = log_out ? dv[e] - expf(yv[e]) * s : yv[e] * (dv[e] - s);
}

/* Tin: dx's dtype (and the chunk size); Tout: y's and dy's. */
template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kRegMaxThreads)
softmax_bwd_reg_kernel(const Tout *__restrict__ y, int64_t ldy, const Tout *__restrict__ dy, int64_t lddy,
                       Tin *__restrict__ dx, int64_t lddx, int64_t rows, int64_t cols64, int tpr, int log_out,
                       int vec) {
    constexpr int V = chunk_elems<Tin>(), K = kRegChunks;
    __shared__ float red[32];
    const int t = threadIdx.x % tpr;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr;
    if (row >= rows) return;
    const Tout *yr = y + row * ldy, *dyr = dy + row * lddy;
    Tin *dxr = dx + row * lddx;
    const int cols = (int)cols64, nch = (cols + V - 1) / V; /* register plan: <= 2048 chunks */

    Chunk<Tout, V> yc[K], dc[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = t + k * tpr;
        if (c < nch) {
            if (!log_out) load_chunk(yc[k], yr, c * V, cols, vec);
            load_chunk(dc[k], dyr, c * V, cols, vec);
        }
    }
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = t + k * tpr;
        if (c < nch) {
            float yv[V], dv[V];
            if (!log_out) unpack(yc[k], yv, c * V, cols, 0.0f);
            unpack(dc[k], dv, c * V, cols, 0.0f);
            s = bwd_terms(s, yv, dv, log_out);
        }
    }
    if (log_out) {
#pragma unroll
        for (int k = 0; k < K; k++) {
            const int c = t + k * tpr;
            if (c < nch) load_chunk(yc[k], yr, c * V, cols, vec); /* in flight during the reduction */
        }
    }
    s = row_allreduce(s, red, tpr, SumOp());
#pragma unroll
    for (int k = 0; k < K; k++) {
        const int c = t + k * tpr;
        if (c < nch) {
            float yv[V], dv[V], o[V];
            unpack(yc[k], yv, c * V, cols, 0.0f);
            unpack(dc[k], dv, c * V, cols, 0.0f);
            bwd_dx(o, yv, dv, s, log_out);
            store_chunk<Tin, V>(dxr, c * V, cols, o, vec);
        }
    }
}

template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kLoopThreads, 1)
softmax_bwd_loop_kernel(const Tout *__restrict__ y, int64_t ldy, const Tout *__restrict__ dy, int64_t lddy,
                        Tin *__restrict__ dx, int64_t lddx, int64_t cols, int64_t cap, int log_out, int vec) {
    constexpr int V = chunk_elems<Tin>(), W = Chunk<Tout, V>::W;
    constexpr int U = 8 / W; /* 2 chunks of 16 bytes (1 of 32) per array in flight: no spills */
    extern __shared__ uint4 dyn_smem[];
    /* log_softmax's first pass needs dy only: y is read once, in the second pass, and dy gets the
     * whole cache */
    uint32_t *cache_y = reinterpret_cast<uint32_t *>(dyn_smem), *cache_d = cache_y + (log_out ? 0 : cap * W);
    __shared__ float red[32];
    const int t = threadIdx.x, T = blockDim.x;
    const int64_t row = blockIdx.x;
    const Tout *yr = y + row * ldy, *dyr = dy + row * lddy;
    Tin *dxr = dx + row * lddx;
    const int64_t nch = (cols + V - 1) / V;

    float s = 0.0f;
    for (int64_t c0 = t; c0 < nch; c0 += (int64_t)T * U) {
        Chunk<Tout, V> yc[U], dc[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * T;
            if (c < nch) {
                if (!log_out) load_chunk(yc[u], yr, c * V, cols, vec);
                load_chunk(dc[u], dyr, c * V, cols, vec);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * T;
            if (c < nch) {
                if (c < cap) {
                    if (!log_out) cache_put(cache_y, c, yc[u]);
                    cache_put(cache_d, c, dc[u]);
                }
                float yv[V], dv[V];
                if (!log_out) unpack(yc[u], yv, c * V, cols, 0.0f);
                unpack(dc[u], dv, c * V, cols, 0.0f);
                s = bwd_terms(s, yv, dv, log_out);
            }
        }
    }
    s = row_allreduce(s, red, T, SumOp());
    for (int64_t c0 = t; c0 < nch; c0 += (int64_t)T * U) {
        Chunk<Tout, V> yc[U], dc[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * T;
            if (c < nch) {
                if (c < cap && !log_out) cache_get(yc[u], cache_y, c);
                else load_chunk(yc[u], yr, c * V, cols, vec);
                if (c < cap) cache_get(dc[u], cache_d, c);
                else load_chunk(dc[u], dyr, c * V, cols, vec);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * T;
            if (c < nch) {
                float yv[V], dv[V], o[V];
                unpack(yc[u], yv, c * V, cols, 0.0f);
                unpack(dc[u], dv, c * V, cols, 0.0f);
                bwd_dx(o, yv, dv, s, log_out);
                store_chunk<Tin, V>(dxr, c * V, cols, o, vec);
            }
        }
    }
}

/* ------------------------------------ host -------------------------------------------------- */

/* Chunks of `chunk_bytes` (per array, `arrays` arrays) the loop plan caches in shared memory, and
 * the dynamic shared memory that takes; a negative cap is a negated cudaError_t. */
static int64_t loop_cache_chunks(int64_t nch, int64_t chunk_bytes, int arrays, size_t *smem_bytes) {
    const int optin = smem_optin_bytes();
    if (optin < 0) return optin;
    const int64_t budget = optin - 1024; /* the static reduction scratch and some slack */
    int64_t cap = budget > 0 ? budget / (chunk_bytes * arrays) : 0;
    if (cap > nch) cap = nch;
    *smem_bytes = (size_t)(cap * chunk_bytes * arrays);
    return cap;
}

template <typename Tin, typename Tout>
static int launch_fwd(const rlk_softmax_args *a, cudaStream_t stream) {
    constexpr int V = chunk_elems<Tin>();
    const RowPlan plan = plan_row(a->cols, V);
    const unsigned grid = grid_for(a->rows, plan.rows_per_cta);
    if (grid == 0) return (int)cudaErrorInvalidConfiguration;
    const int vec = vec_ok(a->x, a->ldx, sizeof(Tin)) && vec_ok(a->y, a->ldy, sizeof(Tout));
    if (!plan.loop) {
        softmax_fwd_reg_kernel<Tin, Tout><<<grid, plan.tpr * plan.rows_per_cta, 0, stream>>>(
            (const Tin *)a->x, a->ldx, (Tout *)a->y, a->ldy, a->rows, a->cols, plan.tpr, a->log, vec);
    } else {
        size_t smem = 0;
        const int64_t cap = loop_cache_chunks(plan.nch, V * (int64_t)sizeof(Tin), 1, &smem);
        if (cap < 0) return (int)(-cap);
        auto kernel = softmax_fwd_loop_kernel<Tin, Tout>;
        const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess) return (int)err;
        kernel<<<grid, plan.tpr, smem, stream>>>((const Tin *)a->x, a->ldx, (Tout *)a->y, a->ldy, a->cols, cap,
                                                 a->log, vec);
    }
    return (int)cudaGetLastError();
}

template <typename Tin, typename Tout>
static int launch_bwd(const rlk_softmax_args *a, cudaStream_t stream) {
    constexpr int V = chunk_elems<Tin>();
    const RowPlan plan = plan_row(a->cols, V);
    const unsigned grid = grid_for(a->rows, plan.rows_per_cta);
    if (grid == 0) return (int)cudaErrorInvalidConfiguration;
    const int vec = vec_ok(a->y, a->ldy, sizeof(Tout)) && vec_ok(a->dy, a->lddy, sizeof(Tout)) &&
                    vec_ok(a->dx, a->lddx, sizeof(Tin));
    if (!plan.loop) {
        softmax_bwd_reg_kernel<Tin, Tout><<<grid, plan.tpr * plan.rows_per_cta, 0, stream>>>(
            (const Tout *)a->y, a->ldy, (const Tout *)a->dy, a->lddy, (Tin *)a->dx, a->lddx, a->rows, a->cols,
            plan.tpr, a->log, vec);
    } else {
        size_t smem = 0;
        const int64_t cap = loop_cache_chunks(plan.nch, V * (int64_t)sizeof(Tout), a->log ? 1 : 2, &smem);
        if (cap < 0) return (int)(-cap);
        auto kernel = softmax_bwd_loop_kernel<Tin, Tout>;
        const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess) return (int)err;
        kernel<<<grid, plan.tpr, smem, stream>>>((const Tout *)a->y, a->ldy, (const Tout *)a->dy, a->lddy,
                                                 (Tin *)a->dx, a->lddx, a->cols, cap, a->log, vec);
    }
    return (int)cudaGetLastError();
}

/* 0: f32 -> f32, 1: bf16 -> bf16, 2: bf16 -> f32, 3: f16 -> f16, 4: f16 -> f32; -1: unsupported */
static int dtype_case(const rlk_softmax_args *a) {
    if (a->in_dtype == RLK_F32) return a->out_dtype == RLK_F32 ? 0 : -1;
    if (a->in_dtype == RLK_BF16) return a->out_dtype == RLK_BF16 ? 1 : a->out_dtype == RLK_F32 ? 2 : -1;
    if (a->in_dtype == RLK_F16) return a->out_dtype == RLK_F16 ? 3 : a->out_dtype == RLK_F32 ? 4 : -1;
    return -1;
}

extern "C" int rlk_softmax_fwd_sm80(const rlk_softmax_args *args, rlk_context *ctx) {
    const int dc = dtype_case(args);
    if (dc < 0) return RLK_UNSUPPORTED;
    ctx->kernel = "softmax_fwd_sm80";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only || args->rows <= 0 || args->cols <= 0) return RLK_OK;
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    switch (dc) {
    case 0: return launch_fwd<float, float>(args, stream);
    case 1: return launch_fwd<__nv_bfloat16, __nv_bfloat16>(args, stream);
    case 2: return launch_fwd<__nv_bfloat16, float>(args, stream);
    case 3: return launch_fwd<__half, __half>(args, stream);
    default: return launch_fwd<__half, float>(args, stream);
    }
}

extern "C" int rlk_softmax_bwd_sm80(const rlk_softmax_args *args, rlk_context *ctx) {
    const int dc = dtype_case(args);
    if (dc < 0) return RLK_UNSUPPORTED;
    ctx->kernel = "softmax_bwd_sm80";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only || args->rows <= 0 || args->cols <= 0) return RLK_OK;
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    switch (dc) {
    case 0: return launch_bwd<float, float>(args, stream);
    case 1: return launch_bwd<__nv_bfloat16, __nv_bfloat16>(args, stream);
    case 2: return launch_bwd<__nv_bfloat16, float>(args, stream);
    case 3: return launch_bwd<__half, __half>(args, stream);
    default: return launch_bwd<__half, float>(args, stream);
    }
}
