/* sm80/linear_logp.cu: fused LM-head log-probs on tensor cores (mma.sync, sm_80 and later);
 * contract: csrc/ops/linear_logp.h.
 *
 * Forward, per row n with s_v = (hidden[n] . weight[v] + bias[v]) * inv_temperature:
 *   lse = log sum_v exp(s_v),  logp = s_target - lse,  entropy = lse - sum_v p_v s_v,
 * computed without ever writing the [N, V] logits to memory.
 *
 * Tile plan (partial kernel): a CTA of 256 threads (8 warps as 2 x 4, warp tile 64 x 64) computes
 * logits tiles of 128 rows x 256 vocabulary columns with mma.sync m16n8k16 (bf16/fp16 in, fp32
 * accumulate); operands stream through a 3-stage cp.async pipeline of 64-wide D slices stored with
 * a 16-byte XOR swizzle and read with ldmatrix. Every 32-long piece of D is a fresh 2-deep mma
 * chain added to the fp32 accumulators with FADD (the tensor-core accumulator truncates; see the
 * main loop). The grid is (row tiles) x (vocabulary splits); a split is 3 consecutive vocabulary
 * tiles (768 columns), walked in increasing order as one flat pipeline over (tile, D slice).
 * When a tile's D loop ends, the epilogue folds the 128 x 256 logits into online-softmax states
 * (running max m, sum l of 2^(x-m), sum S of 2^(x-m) (x-m), all in log2 units x = s * log2(e)):
 * each quad of lanes sharing a row reduces its 64 columns, then lane 0 merges them into the state
 * of (row, warp column) kept in shared memory. The lane holding the target column records the
 * target's logit. At the end of the split the 4 warp-column states of a row are merged and written
 * as one float4 {m, l, S, x_target} to workspace[split][row].
 * The merge kernel folds the splits of each row in increasing split order and writes logp,
 * entropy, lse (ignored rows -> 0; out-of-range targets -> NaN and *bad_target = 1).
 *
 * Batch invariance: every logit is one fixed sequence of mma.sync chains and FADDs over 32-wide D
 * pieces (zero padding past D), a function of D only. The split boundaries depend on V only,
 * each split walks its tiles in increasing order, every reduction (quad shuffles, warp-column
 * merge, split merge) runs in a fixed order, no atomics. Nothing depends on N, on the row's
 * position in the batch, or on pointer alignment (the aligned cp.async loader and the scalar
 * loader fill shared memory with identical bytes).
 *
 * fp32 inputs (no tensor cores, never TF32): logits chunks from the fp32 FFMA GEMM into the workspace,
 * folded per split by partials_from_logits_kernel into the same partials and merged the same way.
 *
 * linear_logp_dz (backward): elementwise, z = logits + bias, d_z = inv_T * (g_logp * (1[v == t] - p)
 * - g_ent * p * (s - lse + H)), 4 columns per thread (vector accesses when the logits / dz rows allow
 * them), scalar tail otherwise.
 *
 * Build: nvcc -O3 -std=c++17 -lineinfo -Xptxas -v -c -Xcompiler -fPIC -Icsrc
 *          -gencode arch=compute_80,code=sm_80 -gencode arch=compute_80,code=compute_80
 *          -gencode arch=compute_90,code=sm_90 csrc/cuda/sm80/linear_logp.cu (links with sm80/gemm.cu)
 * Test (GPU): python3 setup.py build_ext --inplace && pytest tests/test_gpu_linear_logp.py -m gpu
 *   (or scripts/gpu_check.sh: tests, compute-sanitizer, benchmarks/bench_linear_logp.py).
 */
#include <math.h>
#include <string.h>

#include "../../ops/gemm.h"
#include "../../ops/linear_logp.h"
#include "../common.cuh"
#include "../linear_logp.cuh"

extern "C" int rlk_gemm_sm80(const rlk_gemm_args *args, rlk_context *ctx); /* sm80/gemm.cu */

#define LOGP_BM 128             /* rows per CTA tile */
#define LOGP_BN 256             /* vocabulary columns per CTA tile */
#define LOGP_BK 64              /* D slice per pipeline stage (128-byte smem rows) */
#define LOGP_STAGES 3
#define LOGP_CHAIN_K 32         /* D length of one mma accumulation chain before an fp32 add */
#define LOGP_THREADS 256
#define LOGP_TILES_PER_SPLIT 3
#define LOGP_ROW_SLOTS 8        /* rows per thread in the mma fragments: 4 m16 tiles x 2 halves */

#define LOGP_A_STAGE_BYTES (LOGP_BM * LOGP_BK * 2)
#define LOGP_B_STAGE_BYTES (LOGP_BN * LOGP_BK * 2)
#define LOGP_STAGE_BYTES (LOGP_A_STAGE_BYTES + LOGP_B_STAGE_BYTES)
#define LOGP_STATE_COUNT (LOGP_ROW_SLOTS * (LOGP_THREADS / 32) * 8) /* (slot, warp, lane group) */
#define LOGP_SMEM_BYTES (LOGP_STAGES * LOGP_STAGE_BYTES + LOGP_STATE_COUNT * 16 + LOGP_BM * 8)

static_assert(LOGP_BN * LOGP_TILES_PER_SPLIT == LOGP_SPLIT_COLS, "a split is whole tiles");

/* ---------------------------------------------------------------------------------------------
 * Partial kernel: one (128-row tile, 768-column split) per CTA.
 * ------------------------------------------------------------------------------------------- */

/* Fills the ROWS x 64 operand slice (rows [row_begin, row_begin + ROWS), columns [k0, k0 + 64))
 * of a [row_end, D] matrix into swizzled shared memory; out-of-range elements become zero.
 * Thread t fills 16-byte chunk (t & 7) of slice rows (t >> 3) + 32 i. Addresses are recomputed
 * per call rather than kept in registers (the accumulators need them). ALIGNED: cp.async (row
 * starts 16-byte aligned; a partial last chunk copies 2 * (D - k) bytes, zero-filling the rest).
 * Otherwise scalar loads assemble the same bytes. */
template <int ROWS, bool ALIGNED>
__device__ __forceinline__ void load_operand_slice(uint32_t smem_tile, const uint16_t *matrix, int64_t ld,
                                                   int64_t row_begin, int64_t row_end, int k0, int D, int tid) {
    const int chunk = tid & 7;
    const int k = k0 + chunk * 8;
    const int k_left = D - k;
    const int64_t first_row = row_begin + (tid >> 3);
    const int rows_left = (int)min(row_end - first_row, (int64_t)ROWS); /* >= -31 */
    const uint16_t *first = matrix + first_row * ld + k;                 /* dereferenced only if live */
    const int64_t stride = 32 * ld;                                      /* between this thread's rows */
    if (ALIGNED) {
        const int bytes = min(max(2 * k_left, 0), 16);
        const uint16_t *src = first;
#pragma unroll 1 /* rolled: unrolled, the hoisted addresses compete with the accumulators */
        for (int i = 0; i < ROWS / 32; ++i) {
            const int r = (tid >> 3) + 32 * i;
            const bool live = 32 * i < rows_left && bytes > 0;
            cp_async_16(smem_tile + r * 128 + ((chunk ^ (r & 7)) << 4), live ? src : matrix, live ? bytes : 0);
            src += stride;
        }
    } else {
        /* one chunk at a time: the scalar loads of all chunks in flight would not fit in registers */
#pragma unroll 1
        for (int i = 0; i < ROWS / 32; ++i) {
            const int r = (tid >> 3) + 32 * i;
            const bool live = 32 * i < rows_left;
            const uint16_t *src = first + i * stride;
            uint32_t packed[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint32_t lo = (live && 2 * j < k_left) ? __ldg(src + 2 * j) : 0u;
                const uint32_t hi = (live && 2 * j + 1 < k_left) ? __ldg(src + 2 * j + 1) : 0u;
                packed[j] = lo | (hi << 16);
            }
            st_shared_v4(smem_tile + r * 128 + ((chunk ^ (r & 7)) << 4), packed[0], packed[1], packed[2], packed[3]);
        }
    }
}

/* Issues the cp.async loads of the next (vocabulary tile, 64-wide D slice) of the flat pipeline into
 * stage load_stage, then advances the slice, the tile when D is done, and the stage ring. */
template <bool ALIGNED>
__device__ __forceinline__ void load_next_slice(uint32_t smem_base, const uint16_t *hidden, int64_t ldh,
                                                int64_t row0, int64_t N, const uint16_t *weight, int64_t ldw,
                                                int V, int D, int tid, int &load_tile, int &load_k0,
                                                int &load_stage) {
    const uint32_t a_dst = smem_base + load_stage * LOGP_STAGE_BYTES;
    load_operand_slice<LOGP_BM, ALIGNED>(a_dst, hidden, ldh, row0, N, load_k0, D, tid);
    load_operand_slice<LOGP_BN, ALIGNED>(a_dst + LOGP_A_STAGE_BYTES, weight, ldw,
                                         (int64_t)load_tile * LOGP_BN, V, load_k0, D, tid);
    /* compare with D, not a slice count: keeps a register free */
    if ((load_k0 += LOGP_BK) >= D) { load_k0 = 0; ++load_tile; }
    load_stage = load_stage + 1 == LOGP_STAGES ? 0 : load_stage + 1;
}

/* The accumulators of a thread's 4 x 8 mma tiles back to 0 (at the start and after each folded tile). */
__device__ __forceinline__ void zero_tile(float (&acc)[4][8][4]) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
}

template <bool IS_BF16, bool ALIGNED>
__global__ void __launch_bounds__(LOGP_THREADS, 1)
linear_logp_partial_kernel(const uint16_t *__restrict__ hidden, int64_t ldh, const uint16_t *__restrict__ weight,
                           int64_t ldw, const uint16_t *__restrict__ bias, const int64_t *__restrict__ target,
                           int64_t N, int D, int V, float scale_log2, float4 *__restrict__ partials) {
    extern __shared__ __align__(128) unsigned char smem[];
    float4 *states = (float4 *)(smem + LOGP_STAGES * LOGP_STAGE_BYTES); /* [slot][warp][lane >> 2] */
    float *target_logit = (float *)(states + LOGP_STATE_COUNT);           /* [BM] */
    int *target_col = (int *)(target_logit + LOGP_BM);                     /* [BM], -1: none */
    const uint32_t smem_base = (uint32_t)__cvta_generic_to_shared(smem);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp >> 2, warp_n = warp & 3;
    const int64_t row0 = (int64_t)blockIdx.x * LOGP_BM;
    const int split = blockIdx.y;
    const int tiles_total = (V + LOGP_BN - 1) / LOGP_BN;
    const int tile_begin = split * LOGP_TILES_PER_SPLIT;
    const int tile_end = min(tile_begin + LOGP_TILES_PER_SPLIT, tiles_total);
    const int k_iters = max(1, (D + LOGP_BK - 1) / LOGP_BK); /* D == 0: one all-zero slice */
    const int total_iters = (tile_end - tile_begin) * k_iters;

    if (tid < LOGP_BM) {
        const int64_t row = row0 + tid;
        const int64_t t = row < N ? target[row] : -1;
        target_col[tid] = (t >= 0 && t < V) ? (int)t : -1;
        target_logit[tid] = 0.0f;
    }
    if ((lane & 3) == 0) {
        for (int slot = 0; slot < LOGP_ROW_SLOTS; ++slot)
            states[(slot * 8 + warp) * 8 + (lane >> 2)] = make_float4(LOGP_EMPTY_MAX, 0.0f, 0.0f, 0.0f);
    }

    /* loader position in the flat (tile, D slice) sequence of this split */
    int load_tile = tile_begin, load_k0 = 0, load_stage = 0;
#pragma unroll
    for (int s = 0; s < LOGP_STAGES - 1; ++s) {
        if (s < total_iters) {
            load_next_slice<ALIGNED>(smem_base, hidden, ldh, row0, N, weight, ldw, V, D, tid, load_tile,
                                     load_k0, load_stage);
        }
        cp_async_commit();
    }

    /* per-lane ldmatrix offsets; the swizzle term (row & 7) is (lane & 7) for every fragment */
    const uint32_t a_lane_row = (uint32_t)(warp_m * 64 + (lane & 15)) * 128;
    const uint32_t b_lane_row = (uint32_t)(warp_n * 64 + (lane & 7) + ((lane >> 4) << 3)) * 128;
    const int a_lane_chunk = lane >> 4, b_lane_chunk = (lane >> 3) & 1, swizzle = lane & 7;

    float acc[4][8][4];
    zero_tile(acc);

    int tile = tile_begin, read_k0 = 0, read_stage = 0;
    for (int it = 0; it < total_iters; ++it) {
        cp_async_wait<LOGP_STAGES - 2>();
        __syncthreads(); /* slice `it` visible; stage of slice it - 1 free for refill */
        if (it + LOGP_STAGES - 1 < total_iters) {
            load_next_slice<ALIGNED>(smem_base, hidden, ldh, row0, N, weight, ldw, V, D, tid, load_tile,
                                     load_k0, load_stage);
        }
        cp_async_commit();

        const uint32_t a_smem = smem_base + read_stage * LOGP_STAGE_BYTES;
        const uint32_t b_smem = a_smem + LOGP_A_STAGE_BYTES;
        /* Each LOGP_CHAIN_K-long piece of the D sum starts a fresh mma chain from zero and is added
         * to acc with an fp32 FADD: the tensor cores add into their accumulator with truncation,
         * which over a 4096-long chain biases a logit of size 30 by ~1e-4; short chains plus
         * round-to-nearest adds keep it near 1e-6. The order is still fixed by D alone. */
#pragma unroll 1 /* rolled: unrolled, the next chains' fragments push the accumulators into spills */
        for (int kc = 0; kc < LOGP_BK / LOGP_CHAIN_K; ++kc) {
            uint32_t b_frag[LOGP_CHAIN_K / 16][8][2];
#pragma unroll
            for (int q = 0; q < LOGP_CHAIN_K / 16; ++q) {
                const int kk = kc * (LOGP_CHAIN_K / 16) + q;
                const uint32_t b_col = (uint32_t)(((2 * kk + b_lane_chunk) ^ swizzle) << 4);
#pragma unroll
                for (int nj = 0; nj < 4; ++nj) {
                    uint32_t r[4];
                    ldmatrix_x4<false>(r, b_smem + b_lane_row + nj * 16 * 128 + b_col);
                    b_frag[q][2 * nj][0] = r[0];
                    b_frag[q][2 * nj][1] = r[1];
                    b_frag[q][2 * nj + 1][0] = r[2];
                    b_frag[q][2 * nj + 1][1] = r[3];
                }
            }
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                uint32_t a_frag[LOGP_CHAIN_K / 16][4];
#pragma unroll
                for (int q = 0; q < LOGP_CHAIN_K / 16; ++q) {
                    const int kk = kc * (LOGP_CHAIN_K / 16) + q;
                    const uint32_t a_col = (uint32_t)(((2 * kk + a_lane_chunk) ^ swizzle) << 4);
                    ldmatrix_x4<false>(a_frag[q], a_smem + a_lane_row + mi * 16 * 128 + a_col);
                }
#pragma unroll
                for (int ni = 0; ni < 8; ++ni) {
                    float chain[4];
                    mma_16816_zero_acc<IS_BF16>(chain, a_frag[0], b_frag[0][ni]);
#pragma unroll
                    for (int q = 1; q < LOGP_CHAIN_K / 16; ++q) mma_16816<IS_BF16>(chain, a_frag[q], b_frag[q][ni]);
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mi][ni][e] += chain[e];
                }
            }
        }
        read_stage = read_stage + 1 == LOGP_STAGES ? 0 : read_stage + 1;

        if ((read_k0 += LOGP_BK) < D) continue;

        /* ---- epilogue of vocabulary tile `tile`: fold its logits into the row states ---- */
        const int col_lane0 = tile * LOGP_BN + warp_n * 64 + 2 * (lane & 3); /* column of acc[.][0][0] */
        float bias_log2[8][2]; /* (bias * scale_log2), -inf for columns >= V */
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = col_lane0 + ni * 8 + e;
                float b = 0.0f;
                if (bias != nullptr && col < V) b = half_bits_to_float<IS_BF16>(__ldg(bias + col));
                bias_log2[ni][e] = col < V ? b * scale_log2 : -INFINITY;
            }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int slot = mi * 2 + h;
                const int row_local = warp_m * 64 + mi * 16 + h * 8 + (lane >> 2);
                float x[8][2];
#pragma unroll
                for (int ni = 0; ni < 8; ++ni)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        x[ni][e] = fmaf(acc[mi][ni][2 * h + e], scale_log2, bias_log2[ni][e]);
                float tile_max, l, S;
                quad_tile_state(x, tile_max, l, S);
                if ((lane & 3) == 0) {
                    float4 *st = &states[(slot * 8 + warp) * 8 + (lane >> 2)];
                    float4 s = *st;
                    softmax_state_merge(s.x, s.y, s.z, tile_max, l, S);
                    *st = s;
                }
                const int target_offset = target_col[row_local] - col_lane0;
#pragma unroll
                for (int ni = 0; ni < 8; ++ni)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (target_offset == ni * 8 + e) target_logit[row_local] = x[ni][e];
            }
        zero_tile(acc);
        read_k0 = 0;
        ++tile;
    }
    cp_async_wait<0>();
    __syncthreads();

    /* merge the 4 warp-column states of each row in fixed order and publish the split's partial */
    if (tid < LOGP_BM) {
        const int r = tid;
        const int wm = r >> 6, slot = ((r >> 4) & 3) * 2 + ((r >> 3) & 1), group = r & 7;
        float m = LOGP_EMPTY_MAX, l = 0.0f, S = 0.0f;
        for (int wn = 0; wn < 4; ++wn) {
            const float4 s = states[(slot * 8 + wm * 4 + wn) * 8 + group];
            softmax_state_merge(m, l, S, s.x, s.y, s.z);
        }
        if (row0 + r < N) partials[(int64_t)split * N + row0 + r] = make_float4(m, l, S, target_logit[r]);
    }
}

/* ---------------------------------------------------------------------------------------------
 * fp32 inputs: no tensor-core path (never TF32). The logits of chunks of at most
 * LOGP_FP32_CHUNK_ROWS rows x whole splits (as many as LOGP_FP32_CHUNK_FLOATS hold) come from the
 * fp32 FFMA GEMM (rlk_gemm_sm80 with fp32 operands: fixed k order, bias added in its epilogue) into
 * the workspace; partials_from_logits_kernel then folds each LOGP_SPLIT_COLS-column split of a row
 * into the same partial state as the fused kernels (lane j takes columns j, j + 32, ... in order, the
 * lanes merge in a fixed shuffle tree), and the common merge kernel finishes. Slower (logits pass
 * through memory, O(chunk) extra), same contract. The chunk shape (by N) moves no bits: a logit is
 * the same fma sequence in any GEMM tile, and a split's partial folds its own columns.
 * ------------------------------------------------------------------------------------------- */
#define LOGP_FP32_CHUNK_ROWS 4096
#define LOGP_FP32_CHUNK_FLOATS (LOGP_FP32_CHUNK_ROWS * 4 * LOGP_SPLIT_COLS) /* 48 MB of logits */

/* Rows and columns of the fp32 logits chunks for N rows: fewer rows, wider chunks (more GEMM tiles). */
static int64_t fp32_chunk_rows(int64_t N) { return N < 1 ? 1 : N < LOGP_FP32_CHUNK_ROWS ? N : LOGP_FP32_CHUNK_ROWS; }
static int64_t fp32_chunk_cols(int64_t N, int64_t V) {
    const int64_t cols = LOGP_FP32_CHUNK_FLOATS / (fp32_chunk_rows(N) * LOGP_SPLIT_COLS) * LOGP_SPLIT_COLS;
    return cols < V ? cols : V;
}

__global__ void partials_from_logits_kernel(const float *__restrict__ logits, int64_t rows,
                                            int64_t cols, int64_t row0, int64_t v0, int64_t N,
                                            const int64_t *__restrict__ target, float scale_log2,
                                            float4 *__restrict__ partials) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * 4 + warp; /* one warp per row */
    if (r >= rows) return;
    const int64_t c0 = (int64_t)blockIdx.y * LOGP_SPLIT_COLS;
    const int64_t c1 = c0 + LOGP_SPLIT_COLS < cols ? c0 + LOGP_SPLIT_COLS : cols;
    const float *z = logits + r * cols;
    const int64_t t = target[row0 + r];
    float m = LOGP_EMPTY_MAX, l = 0.0f, S = 0.0f, x_target = 0.0f;
    for (int64_t c = c0 + lane; c < c1; c += 32) {
        const float x = z[c] * scale_log2;
        if (v0 + c == t) x_target = x;
        if (x != -INFINITY) softmax_state_merge(m, l, S, x, 1.0f, 0.0f); /* p = 0: no term */
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_down_sync(0xffffffffu, m, offset);
        const float l2 = __shfl_down_sync(0xffffffffu, l, offset);
        const float S2 = __shfl_down_sync(0xffffffffu, S, offset);
        if (lane < offset) softmax_state_merge(m, l, S, m2, l2, S2);
    }
    const bool target_here = t >= v0 + c0 && t < v0 + c1;
    x_target = __shfl_sync(0xffffffffu, x_target, target_here ? (int)((t - v0 - c0) & 31) : 0);
    if (lane == 0)
        partials[((v0 + c0) / LOGP_SPLIT_COLS) * N + row0 + r] = make_float4(m, l, S, x_target);
}

static int linear_logp_fwd_fp32(const rlk_linear_logp_args *args, float4 *partials, float *logits,
                                rlk_context *ctx) {
    const cudaStream_t s = (cudaStream_t)ctx->stream;
    rlk_context gemm_ctx = *ctx;
    const float scale_log2 = args->inv_temperature * LOG2E;
    const int64_t chunk_rows = fp32_chunk_rows(args->N), chunk_cols = fp32_chunk_cols(args->N, args->V);
    for (int64_t v0 = 0; v0 < args->V; v0 += chunk_cols) {
        const int64_t cols = args->V - v0 < chunk_cols ? args->V - v0 : chunk_cols;
        for (int64_t row0 = 0; row0 < args->N; row0 += chunk_rows) {
            const int64_t rows = args->N - row0 < chunk_rows ? args->N - row0 : chunk_rows;
            rlk_gemm_args g;
            memset(&g, 0, sizeof(g));
            g.M = rows;
            g.N = cols;
            g.K = args->D;
            g.in_dtype = g.out_dtype = RLK_F32;
            g.a = (const float *)args->hidden + row0 * args->ldh;
            g.lda = args->ldh;
            g.b = (const float *)args->weight + v0 * args->ldw; /* B = weight^T */
            g.ldb = args->ldw;
            g.b_trans = 1;
            g.c = args->bias ? (const float *)args->bias + v0 : NULL; /* ldc = 0: one row */
            g.out = logits;
            g.ldo = cols;
            g.alpha = g.beta = 1.0;
            const int rc = rlk_gemm_sm80(&g, &gemm_ctx);
            if (rc != RLK_OK) return rc;
            const dim3 grid((unsigned)((rows + 3) / 4), (unsigned)((cols + LOGP_SPLIT_COLS - 1) / LOGP_SPLIT_COLS));
            partials_from_logits_kernel<<<grid, 128, 0, s>>>(logits, rows, cols, row0, v0, args->N, args->target,
                                                             scale_log2, partials);
            const cudaError_t err = cudaGetLastError();
            if (err != cudaSuccess) return (int)err;
        }
    }
    return launch_linear_logp_merge(args, partials, false, s);
}

static int64_t partials_bytes(int64_t N, int64_t V) { return logp_splits(V) * N * (int64_t)sizeof(float4); }

template <bool IS_BF16, bool ALIGNED>
static cudaError_t launch_partial(const rlk_linear_logp_args *a, float4 *partials, dim3 grid, cudaStream_t stream) {
    void (*kernel)(const uint16_t *, int64_t, const uint16_t *, int64_t, const uint16_t *, const int64_t *, int64_t,
                   int, int, float, float4 *) = linear_logp_partial_kernel<IS_BF16, ALIGNED>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, LOGP_SMEM_BYTES);
    if (err != cudaSuccess) return err;
    kernel<<<grid, LOGP_THREADS, LOGP_SMEM_BYTES, stream>>>(
        (const uint16_t *)a->hidden, a->ldh, (const uint16_t *)a->weight, a->ldw, (const uint16_t *)a->bias, a->target,
        a->N, (int)a->D, (int)a->V, a->inv_temperature * LOG2E, partials);
    return cudaGetLastError();
}

/* Workspace: the split partials, plus for fp32 inputs one chunk of fp32 logits. */
extern "C" int rlk_linear_logp_fwd_sm80(const rlk_linear_logp_args *args, rlk_context *ctx) {
    const bool fp32 = args->dtype == RLK_F32;
    if (!fp32 && args->dtype != RLK_BF16 && args->dtype != RLK_F16) return RLK_UNSUPPORTED;
    const int64_t splits = logp_splits(args->V);
    if (args->D > INT32_MAX - LOGP_BK || args->V > INT32_MAX - LOGP_SPLIT_COLS || splits > 65535)
        return RLK_UNSUPPORTED;
    ctx->kernel = fp32 ? "linear_logp_fwd_fp32_sm80" : "linear_logp_fwd_sm80";
    if (ctx->plan_only) {
        ctx->workspace_bytes =
            partials_bytes(args->N, args->V) +
            (fp32 ? fp32_chunk_rows(args->N) * fp32_chunk_cols(args->N, args->V) * (int64_t)sizeof(float) : 0);
        return RLK_OK;
    }
    const cudaStream_t s = (cudaStream_t)ctx->stream;
    float4 *partials = (float4 *)args->workspace;
    if (fp32)
        return linear_logp_fwd_fp32(args, partials,
                                    (float *)((char *)args->workspace + partials_bytes(args->N, args->V)), ctx);
    /* loader choice by layout only; both loaders produce identical shared-memory bytes */
    const bool aligned = ((uintptr_t)args->hidden % 16 == 0) && ((uintptr_t)args->weight % 16 == 0) &&
                         (args->ldh % 8 == 0) && (args->ldw % 8 == 0);
    const dim3 grid((unsigned)((args->N + LOGP_BM - 1) / LOGP_BM), (unsigned)splits);
    cudaError_t err;
    if (args->dtype == RLK_BF16)
        err = aligned ? launch_partial<true, true>(args, partials, grid, s) : launch_partial<true, false>(args, partials, grid, s);
    else
        err = aligned ? launch_partial<false, true>(args, partials, grid, s) : launch_partial<false, false>(args, partials, grid, s);
    if (err != cudaSuccess) return (int)err;
    return launch_linear_logp_merge(args, partials, false, s);
}

/* ---------------------------------------------------------------------------------------------
 * linear_logp_dz: elementwise backward of one (rows x cols) chunk from its fp32 logits.
 * ------------------------------------------------------------------------------------------- */

/* Four consecutive elements <-> four floats in one 16-byte (fp32) / 8-byte (16-bit) access. */
__device__ __forceinline__ void load4_f32(const float *p, float (&v)[4]) {
    const float4 x = *(const float4 *)p;
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
}
__device__ __forceinline__ void store4_f32(float *p, const float (&v)[4]) { *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]); }
template <typename T>
__device__ __forceinline__ void store4_f32(T *p, const float (&v)[4]) {
    store2_f32(p, make_float2(v[0], v[1]));
    store2_f32(p + 2, make_float2(v[2], v[3]));
}

/* grid.x covers 4 columns per thread, grid.y strides over rows. VEC: rows of logits and dlogits
 * allow vector accesses at every multiple of 4 columns. z = logits + bias in one fp32 rounding (what
 * a GEMM epilogue with C = bias, or the fused SM90 kernel, forms), then dlogit_value. */
template <typename T, bool VEC>
__global__ void linear_logp_dz_kernel(rlk_linear_logp_dlogits_args a) {
    const int64_t c0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (c0 >= a.cols) return;
    const T *bias = (const T *)a.bias;
    const int n_cols = (int)min((int64_t)4, a.cols - c0);
    for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
        const float *logits = a.logits + r * a.ld_logits + c0;
        T *out = (T *)a.dlogits + r * a.ld_dlogits + c0;
        const int64_t t = a.target[r];
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (t != a.ignore_index) {
            const dlogit_row row = make_dlogit_row(a.inv_temperature, a.lse[r],
                                                   a.entropy != nullptr ? a.entropy[r] : 0.0f,
                                                   a.grad_logp != nullptr ? a.grad_logp[r] : 0.0f,
                                                   a.grad_entropy != nullptr ? a.grad_entropy[r] : 0.0f);
            const int64_t t_rel = t - a.v0 - c0;
            float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (VEC && n_cols == 4) {
                load4_f32(logits, z);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (j < n_cols) z[j] = logits[j];
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (bias != nullptr && j < n_cols) z[j] = __fadd_rn(z[j], to_f32(bias[c0 + j]));
                d[j] = dlogit_value(row, z[j], t_rel == j);
            }
        }
        if (VEC && n_cols == 4) {
            store4_f32(out, d);
        } else {
            for (int j = 0; j < n_cols; ++j) from_f32(out + j, d[j]);
        }
    }
}

template <typename T>
static int launch_dz(const rlk_linear_logp_dlogits_args *a, cudaStream_t stream) {
    const int threads = 256;
    const bool vec = ((uintptr_t)a->logits % 16 == 0) && (a->ld_logits % 4 == 0) &&
                     ((uintptr_t)a->dlogits % (4 * sizeof(T)) == 0) && (a->ld_dlogits % 4 == 0);
    const dim3 grid((unsigned)((a->cols + threads * 4 - 1) / (threads * 4)), (unsigned)(a->rows < 65535 ? a->rows : 65535));
    if (vec)
        linear_logp_dz_kernel<T, true><<<grid, threads, 0, stream>>>(*a);
    else
        linear_logp_dz_kernel<T, false><<<grid, threads, 0, stream>>>(*a);
    return (int)cudaGetLastError();
}

extern "C" int rlk_linear_logp_dz_sm80(const rlk_linear_logp_dlogits_args *args, rlk_context *ctx) {
    if (args->logits == nullptr || (args->dtype != RLK_F32 && args->dtype != RLK_BF16 && args->dtype != RLK_F16))
        return RLK_UNSUPPORTED;
    ctx->kernel = "linear_logp_dz_sm80";
    if (ctx->plan_only) return RLK_OK;
    const cudaStream_t s = (cudaStream_t)ctx->stream;
    if (args->dtype == RLK_F32) return launch_dz<float>(args, s);
    return args->dtype == RLK_BF16 ? launch_dz<__nv_bfloat16>(args, s) : launch_dz<__half>(args, s);
}
