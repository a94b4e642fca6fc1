/* cuda/sm80/row_sum.cu: batch-invariant sum / mean over the last dimension for sm_80+ (runs on
 * H100 through sm_90 SASS). Contract: csrc/ops/row_sum.h.
 *
 *   y[r] = round_out(s / divisor),  s = sum_j x[r, j] in fp32,  divisor = 1 (sum) or cols (mean)
 * bf16 / fp16 / fp32 inputs, out_dtype = in_dtype or fp32; fp64: RLK_UNSUPPORTED. cols == 0 gives
 * s = +0: a sum of 0 and a mean of 0 / 0 = NaN (as torch).
 *
 * Plan (rowops.cuh; a function of cols and the dtype only): chunks of V = 16 bytes of input; tpr
 * threads per row, the smallest power of two >= max(32, chunks / 4) (1024 beyond 2048 chunks);
 * thread t sums chunks t, t + tpr, t + 2 tpr, ... in increasing order (4 loads in flight, so a
 * 4096-column bf16 row, 512 chunks, is one round of four 16-byte loads per thread on 128 threads),
 * each chunk's elements in increasing j, into one fp32 accumulator from +0; then the row's warps
 * reduce with a shuffle-xor butterfly and the warp sums are added in increasing warp order. A warp
 * per row (4 rows per CTA) for rows of up to 128 chunks, else a CTA per row. One pass, one read.
 * Load path: 16-byte vector loads when x and its row stride are 16-byte aligned, element loads
 * otherwise; the same bits either way.
 *
 * Batch invariance: a row is summed by its own warp or CTA in an order fixed by cols; the row count
 * only changes the grid. No atomics.
 *
 * Build (compile check): nvcc -c csrc/cuda/sm80/row_sum.cu -O3 -std=c++17 -lineinfo -Xcompiler -fPIC \
 *   --expt-relaxed-constexpr -Xptxas -v -Icsrc -gencode arch=compute_80,code=sm_80 \
 *   -gencode arch=compute_90,code=sm_90
 * Test (GPU): python3 scripts/rowops_sm80_probe.py
 */
#include <cuda_runtime.h>

#include "cuda/sm80/rowops.cuh"
#include "ops/row_sum.h"

using namespace rowops;

template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kLoopThreads)
row_sum_kernel(const Tin *__restrict__ x, int64_t ldx, Tout *__restrict__ y, int64_t rows, int64_t cols, int tpr,
               int mean, int vec) {
    constexpr int V = chunk_elems<Tin>(), U = kLoopUnroll;
    __shared__ float red[32];
    const int t = threadIdx.x % tpr;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr;
    if (row >= rows) return; /* only in warp-per-row CTAs */
    const Tin *xr = x + row * ldx;
    const int64_t nch = (cols + V - 1) / V;

    float s = 0.0f;
    for (int64_t c0 = t; c0 < nch; c0 += (int64_t)tpr * U) {
        Chunk<Tin, V> ch[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * tpr;
            if (c < nch) load_chunk(ch[u], xr, c * V, cols, vec);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t c = c0 + (int64_t)u * tpr;
            if (c < nch) {
                float v[V];
                unpack(ch[u], v, c * V, cols, 0.0f);
#pragma unroll
                for (int e = 0; e < V; e++) s = __fadd_rn(s, v[e]);
            }
        }
    }
    s = row_allreduce(s, red, tpr, SumOp());
    if (t == 0) from_f32(y + row, mean ? s / (float)cols : s);
}

template <typename Tin, typename Tout>
static int launch(const rlk_row_sum_args *a, cudaStream_t stream) {
    const RowPlan plan = plan_row(a->cols, chunk_elems<Tin>());
    const unsigned grid = grid_for(a->rows, plan.rows_per_cta);
    if (grid == 0) return (int)cudaErrorInvalidConfiguration;
    const int vec = vec_ok(a->x, a->ldx, sizeof(Tin));
    row_sum_kernel<Tin, Tout><<<grid, plan.tpr * plan.rows_per_cta, 0, stream>>>(
        (const Tin *)a->x, a->ldx, (Tout *)a->y, a->rows, a->cols, plan.tpr, a->mean, vec);
    return (int)cudaGetLastError();
}

extern "C" int rlk_row_sum_sm80(const rlk_row_sum_args *args, rlk_context *ctx) {
    const rlk_dtype in = args->in_dtype, out = args->out_dtype;
    int dc = -1; /* 0: f32 -> f32, 1: bf16 -> bf16, 2: bf16 -> f32, 3: f16 -> f16, 4: f16 -> f32 */
    if (in == RLK_F32 && out == RLK_F32) dc = 0;
    else if (in == RLK_BF16) dc = out == RLK_BF16 ? 1 : out == RLK_F32 ? 2 : -1;
    else if (in == RLK_F16) dc = out == RLK_F16 ? 3 : out == RLK_F32 ? 4 : -1;
    if (dc < 0) return RLK_UNSUPPORTED;
    ctx->kernel = "row_sum_sm80";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only || args->rows <= 0) return RLK_OK;
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    switch (dc) {
    case 0: return launch<float, float>(args, stream);
    case 1: return launch<__nv_bfloat16, __nv_bfloat16>(args, stream);
    case 2: return launch<__nv_bfloat16, float>(args, stream);
    case 3: return launch<__half, __half>(args, stream);
    default: return launch<__half, float>(args, stream);
    }
}
