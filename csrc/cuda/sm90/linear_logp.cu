/* sm90/linear_logp.cu: the fused linear_logp kernels on Hopper (contract: csrc/ops/linear_logp.h), on the
 * wgmma main loop of gemm_kernel.cuh.
 *
 * Forward (linear_logp_fwd): the product hidden [N, D] @ weight[V, D]^T on 128 x 192 tiles (2 consumers,
 * 5 stages, 2-CTA clusters with B multicast), each k-slice group of LOGP_CHAIN = 8 (512 of D) a fresh
 * wgmma chain added into the logits with an fp32 FADD (mma_tile: the tensor cores' accumulator adds
 * truncate, 3.2e-4 logp error over D = 4096 with one long chain, 2e-5 with these). A work unit is
 * (128-row tile, vocabulary split of LOGP_SPLIT_COLS = 768 columns = 4 tiles walked in increasing
 * order); instead of storing a tile, each consumer folds it into per-row online-softmax states (max,
 * sum 2^(x - max), sum 2^(x - max) (x - max), target logit, log2 units) held in registers, written as one
 * float4 per (split, row) to the workspace at the end of the split (policy logp_fold). When the units
 * leave the last round of clusters partly empty, the last ones are shared out by tiles (stream-K,
 * gemm_kernel.cuh): a cluster stopping inside a split hands the rows' states to the next one.
 * linear_logp_merge_kernel (cuda/linear_logp.cuh) folds a row's splits in increasing order.
 *
 * Backward dz (linear_logp_dlogits): the GEMM z = hidden @ weight_chunk^T + bias on the large GEMM
 * config whose epilogue turns each z into d loss / d z (dlogits_value; per-row lse / entropy / gradients
 * loaded before the tile's k loop) and stores that in the input dtype instead of z: the fp32 logits of
 * the chunk are never written.
 *
 * Batch invariance: the chain boundaries depend on D, the tiles and splits on V, every fold and merge
 * runs in a fixed order (a split handed over between clusters continues the same fold from an exact copy
 * of its states), so a row's results do not depend on N or its position; z's elements in the backward are
 * bitwise those of the SM90 GEMM. Tested on the GPU by tests/test_gpu_linear_logp.py (torch.equal for rows
 * of N = 1, 3, 17, 129, 1000 and shifted rows vs N = 4096; at V = 32768, where N = 300 to 1024 share their
 * last units differently, N = 1 .. 1000 vs 1024; fused dz vs the SM90 GEMM followed by the elementwise dz).
 *
 * fp32 forward: hidden and weight as three bf16 planes each (fp32_parts; the bias one more column), and
 * the same fold over their PARTS product (gemm_kernel.cuh), which equals the fp32 product to below fp32's
 * rounding (see "fp32 inputs" below); per block of rows and vocabulary chunk, within FP32_PARTS_BYTES of
 * workspace.
 *
 * fp32 backward (linear_logp_bwd): the whole backward, each of its products (z for dz, dH, dW) a PARTS
 * product of bf16 planes (gemm_kernel.cuh; "fp32 backward" below), per block of rows and vocabulary chunk
 * of a width fixed by D; dH rows tested bitwise alone, among a few and across row blocks, the gradients
 * against fp64 (test_fp32_backward_on_bf16_parts).
 *
 * Limits (-> RLK_UNSUPPORTED, sm80 runs): the forward takes bf16 / fp16 with D a multiple of 8, or fp32;
 * dz takes bf16 / fp16, the whole backward fp32 (16-bit: the binding's chunk walk); 16-bit operands TMA
 * cannot describe.
 *
 * Build: as sm90/gemm.cu (python3 csrc/cuda/sm90/wgmma_gen.py build/gen; nvcc ... -Ibuild/gen
 *        csrc/cuda/sm90/linear_logp.cu). Test: pytest tests/test_gpu_linear_logp.py -m gpu.
 */
#include "../../ops/linear_logp.h"
#include "../linear_logp.cuh"
#include "gemm_kernel.cuh"

#define LOGP_CHAIN 8 /* forward: k-slices per fresh wgmma chain (see mma_tile) */

/* The linear_logp kernels' row data: the product is hidden [N, D] @ weight[V, D]^T (M = N rows, N = V
 * columns, K = D), or a vocabulary chunk of it starting at column v0 (the backward's dz). */
typedef struct logp_sm90_params {
    const void *bias;       /* forward: [V] in the input dtype, or NULL (backward: C of the GEMM) */
    const int64_t *target;  /* [N] */
    float4 *partials;       /* forward: [split][row] {m, l, S, x_target}, see fold_logits_tile */
    float scale_log2;       /* forward: inv_temperature * log2(e) */
    const float *lse, *entropy, *grad_logp, *grad_entropy;  /* backward: [N] each; the last 3 may be NULL */
    int64_t ignore_index, v0;
    float inv_temperature;
} logp_sm90_params;

/* The backward's value: d loss / d z (dlogit_value) of z = acc + bias (C is the bias row, ldc = 0) for
 * the thread's two rows; ignored rows (and rows past N) get 0. */
struct dlogits_value {
    using Params = logp_sm90_params;
    /* no tail pairing: its work_coords branch made this 256-wide consumer spill (20-176 bytes). The
     * stream-K path is compiled as the GEMM's but never taken (p.stream_k stays 0): without it ptxas
     * spilled 20 bytes in the fp16 kernel. */
    static constexpr bool PAIR_TAIL = false, STREAM_K = true;
    dlogit_row row[2];
    int target_col[2];  /* the target's column in this chunk, or -1 */
    bool active[2];
    __device__ __forceinline__ float operator()(float acc, float c, bool has_c, int h, int col) const {
        const float z = has_c ? __fadd_rn(acc, c) : acc;
        /* computed for every row and then selected: a branch per element kept the exps from overlapping */
        const float dz = dlogit_value(row[h], z, col == target_col[h]);
        return active[h] ? dz : 0.f;
    }
    static __device__ __forceinline__ dlogits_value make(int row0, const gemm_sm90_params &p,
                                                         const logp_sm90_params &lp) {
        dlogits_value e;
        const int t = threadIdx.x % 128;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 16 * (t / 32) + (t % 32) / 4 + 8 * h;
            const int64_t target = row < p.M ? lp.target[row] : lp.ignore_index;
            e.active[h] = target != lp.ignore_index;
            e.target_col[h] = (target >= lp.v0 && target < lp.v0 + p.N) ? (int)(target - lp.v0) : -1;
            e.row[h] = make_dlogit_row(lp.inv_temperature, e.active[h] ? lp.lse[row] : 0.f,
                                       e.active[h] && lp.entropy ? lp.entropy[row] : 0.f,
                                       e.active[h] && lp.grad_logp ? lp.grad_logp[row] : 0.f,
                                       e.active[h] && lp.grad_entropy ? lp.grad_entropy[row] : 0.f);
        }
        return e;
    }
};

/* Per-thread softmax states of the two rows a consumer thread holds in the wgmma accumulator layout
 * (rows 16w + l/4 and + 8 of its warpgroup's 64; the quad of lanes sharing a row keeps identical copies). */
typedef struct logp_row_states {
    float m[2], l[2], S[2];
    float x_target[2];  /* target logit in log2 units (0 in the lanes and splits that do not hold it) */
    int target_col[2];  /* -1: ignored, out of range or a row past N */
} logp_row_states;

__device__ __forceinline__ void logp_states_init(logp_row_states &st, int row0, const gemm_sm90_params &p,
                                                 const logp_sm90_params &lp) {
    const int t = threadIdx.x % 128;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + 16 * (t / 32) + (t % 32) / 4 + 8 * h;
        const int64_t target = row < p.M ? lp.target[row] : -1;
        st.target_col[h] = (target >= lp.v0 && target < lp.v0 + p.N) ? (int)(target - lp.v0) : -1;
        st.m[h] = LOGP_EMPTY_MAX;
        st.l[h] = st.S[h] = st.x_target[h] = 0.f;
    }
}

/* bias * scale_log2 for the thread's columns of the tile at col0 (-inf past V). Loaded after the tile's k
 * loop: during it the 192-wide tile's two accumulator sets take the registers. */
template <int BN, bool BF16>
__device__ __forceinline__ void load_bias_log2(float (&bias_log2)[BN / 8][2], int col0, const gemm_sm90_params &p,
                                               const logp_sm90_params &lp) {
    const int col_lane = col0 + 2 * (threadIdx.x % 4);  /* column of d[0] */
    const uint16_t *bias = (const uint16_t *)lp.bias;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = col_lane + 8 * j + e;
            const float b = (bias != nullptr && col < p.N) ? half_bits_to_float<BF16>(__ldg(bias + col)) : 0.f;
            bias_log2[j][e] = col < p.N ? b * lp.scale_log2 : -INFINITY;
        }
}

/* Folds one consumer warpgroup's 64 x BN logits tile d (columns col0 ..) into the row states: each
 * thread scales its BN/4 values of a row (x = acc * scale_log2 + bias_log2(j, e): the bias in log2 units,
 * -inf past V), the quad forms the tile's state (quad_tile_state), and it is merged into the running
 * one. Only a thread whose row's target is one of its columns here looks for it (a branch taken in few
 * tiles: a compare and select per value in every tile cost ~200 instructions a tile). */
template <int BN, class BiasLog2>
__device__ __forceinline__ void fold_logits_tile(const float (&d)[BN / 2], const BiasLog2 &bias_log2, int col0,
                                                 logp_row_states &st, const logp_sm90_params &lp) {
    const int col_lane = col0 + 2 * (threadIdx.x % 4);  /* column of d[0] */
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float x[BN / 8][2];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) x[j][e] = fmaf(d[4 * j + 2 * h + e], lp.scale_log2, bias_log2(j, e));
        float tile_max, l, S;
        quad_tile_state(x, tile_max, l, S);
        softmax_state_merge(st.m[h], st.l[h], st.S[h], tile_max, l, S);
        const int target_offset = st.target_col[h] - col_lane;  /* the lane's columns: 8 j + e, e < 2 */
        if (target_offset >= 0 && target_offset < BN && (target_offset & 6) == 0) {
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (target_offset == 8 * j + e) st.x_target[h] = x[j][e];
        }
    }
}

/* Lane 0 of each quad writes the split's {m, l, S, x_target} of its two rows (x_target: the one lane
 * holding it plus exact zeros). */
__device__ __forceinline__ void store_partials(logp_row_states &st, int row0, int split, const gemm_sm90_params &p,
                                               const logp_sm90_params &lp) {
    const int t = threadIdx.x % 128;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float x = st.x_target[h];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        const int row = row0 + 16 * (t / 32) + (t % 32) / 4 + 8 * h;
        if (t % 4 == 0 && row < p.M)
            lp.partials[(int64_t)split * p.M + row] = make_float4(st.m[h], st.l[h], st.S[h], x);
    }
}

/* The forward's epilogue policy: a work unit is a vocabulary split of LOGP_SPLIT_COLS / BN tiles walked
 * in increasing order; each tile, from fresh LOGP_CHAIN-slice wgmma chains, is folded into per-row
 * softmax states instead of being stored, and the split's state is written once at the end. Stream-K
 * shares the last units' tiles between clusters (gemm_kernel.cuh): a piece that stops inside a unit
 * hands its states (m, l, S, x_target of the thread's two rows: STATE_BN / 2 = 8 floats) to the next
 * cluster's piece, which folds the following tiles onto them, the same folds in the same order. */
template <int BN, bool PARTS_IN = false>
struct logp_fold {
    using OutT = float; /* nothing is stored through the out map */
    using Params = logp_sm90_params;
    static constexpr int TILES_PER_UNIT = LOGP_SPLIT_COLS / BN, CHAIN = LOGP_CHAIN, STATE_BN = 16;
    static constexpr bool STORES_TILES = false, PAIR_TAIL = false, STREAM_K = true, K_CHAINS = false;
    static constexpr bool TRANSPOSED = false, PARTS = PARTS_IN; /* PARTS: the fp32 forward's planes */
    static_assert(LOGP_SPLIT_COLS % BN == 0, "a split is whole tiles");
    static __device__ __forceinline__ logp_row_states begin(int row0, const gemm_sm90_params &p,
                                                            const logp_sm90_params &lp) {
        logp_row_states st;
        logp_states_init(st, row0, p, lp);
        return st;
    }
    template <int TILE_BN, bool BF16, bool TMA_STORE>
    static __device__ __forceinline__ void tile(float (&d)[TILE_BN / 2], logp_row_states &st, int, int col0,
                                                const gemm_sm90_params &p, const logp_sm90_params &lp, const tile_store &) {
        /* no bias and no column past V (every tile but a vocabulary's last, when the head has no bias):
         * the addend is the +0 that the general path computes there, without its loads and column tests */
        if (lp.bias == nullptr && col0 + TILE_BN <= p.N) {
            fold_logits_tile<TILE_BN>(d, [](int, int) { return 0.f; }, col0, st, lp);
        } else {
            float bias_log2[TILE_BN / 8][2];
            load_bias_log2<TILE_BN, BF16>(bias_log2, col0, p, lp);
            fold_logits_tile<TILE_BN>(d, [&](int j, int e) { return bias_log2[j][e]; }, col0, st, lp);
        }
    }
    static __device__ __forceinline__ void end(logp_row_states &st, int row0, int split, const gemm_sm90_params &p,
                                               const logp_sm90_params &lp) {
        store_partials(st, row0, split, p, lp);
    }
    static __device__ __forceinline__ void hand_over(const logp_row_states &st, float *slot, int *ready,
                                                     uint32_t barrier_id) {
        const float v[STATE_BN / 2] = {st.m[0], st.m[1], st.l[0],          st.l[1],
                                       st.S[0], st.S[1], st.x_target[0], st.x_target[1]};
        store_partial<STATE_BN>(v, slot, ready, barrier_id);
    }
    static __device__ __forceinline__ void take_over(logp_row_states &st, const float *slot, const int *ready,
                                                     uint32_t barrier_id) {
        float v[STATE_BN / 2];
        load_partial<STATE_BN>(v, slot, ready, barrier_id);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            st.m[h] = v[h], st.l[h] = v[2 + h], st.S[h] = v[4 + h], st.x_target[h] = v[6 + h];
        }
    }
};

/* ------------------------------------ launchers --------------------------------------------- */

/* The product hidden [rows, D] @ weight[cols, D]^T as GEMM arguments (A = hidden, K-major; B = weight^T,
 * b_trans = 1); the caller adds the epilogue fields its kernel uses. */
static rlk_gemm_args product_args(const void *hidden, int64_t ldh, const void *weight, int64_t ldw, int64_t rows,
                                  int64_t cols, int64_t D, rlk_dtype in_dtype, rlk_dtype out_dtype) {
    rlk_gemm_args g;
    memset(&g, 0, sizeof(g));
    g.M = rows;
    g.N = cols;
    g.K = D;
    g.in_dtype = in_dtype;
    g.out_dtype = out_dtype;
    g.a = hidden;
    g.lda = ldh;
    g.b = weight;
    g.ldb = ldw;
    g.b_trans = 1;
    return g;
}

/* The fold of hidden [rows, K] @ weight[cols, K]^T (16-bit, bias [cols] or NULL; PARTS: the bf16 planes of
 * fp32 operands, below) into the partial states of its ceil(cols / LOGP_SPLIT_COLS) splits,
 * partials[split * rows + row]; the targets count from vocabulary column v0 (a multiple of LOGP_SPLIT_COLS,
 * so the splits are the whole vocabulary's). 128 x 192 tiles, 2-CTA clusters, 5 stages: the fresh k-slice
 * chains need a second set of accumulator registers, which the 128 x 256 config cannot afford; at 192 both
 * sets (2 x 96) fit under the consumers' setmaxnreg 232, and a wider tile needs less shared-memory bandwidth
 * per FLOP than 128 x 128 (docs/perf-notes.md, "linear_logp forward on SM90"). ptxas spills ~40 values
 * around the fold with a bias or columns past V, after the k loop; the fold without them
 * (fold_logits_tile's common case) spills none. 4 tiles per vocabulary split. slots:
 * stream_k_workspace_bytes(logp_fold<192>::STATE_BN, 2, num_sms). */
template <bool PARTS>
static int launch_logp_fold(const void *hidden, int64_t ldh, const void *weight, int64_t ldw, int64_t rows,
                            int64_t cols, int64_t K, bool bf16, const void *bias, const int64_t *target, int64_t v0,
                            float inv_temperature, float4 *partials, float *slots, int device, int num_sms,
                            cudaStream_t s) {
    const rlk_gemm_args g = product_args(hidden, ldh, weight, ldw, rows, cols, K, bf16 ? RLK_BF16 : RLK_F16, RLK_F32);
    gemm_sm90_params p = gemm_params(&g);
    p.stream_k = 1; /* when the last round of units is partly empty (launch_gemm_sm90) */
    p.partials = slots;
    logp_sm90_params lp;
    memset(&lp, 0, sizeof(lp));
    lp.bias = bias;
    lp.target = target;
    lp.v0 = v0;
    lp.partials = partials;
    lp.scale_log2 = inv_temperature * LOG2E;
    /* launch_gemm_sm90<BN, CONSUMERS, A_ROWS, STAGES, SLICES, CLUSTER, A_MN, B_MN, BF16, Epilogue> */
    if constexpr (PARTS)
        return launch_gemm_sm90<192, 2, 64, 5, 1, 2, false, false, true, logp_fold<192, true>>(&g, p, lp, device,
                                                                                             num_sms, s);
    return bf16 ? launch_gemm_sm90<192, 2, 64, 5, 1, 2, false, false, true, logp_fold<192>>(&g, p, lp, device, num_sms, s)
                : launch_gemm_sm90<192, 2, 64, 5, 1, 2, false, false, false, logp_fold<192>>(&g, p, lp, device, num_sms,
                                                                                             s);
}

/* ------------------------------ fp32 inputs: three bf16 parts each ------------------------------ */
/* An fp32 x is hi + mid + lo exactly (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid), round to
 * nearest; the subtractions are exact, and three 8-bit parts cover fp32's 24), and the product of two fp32
 * matrices is the PARTS product of their bf16 planes (gemm_kernel.cuh: six exact bf16 products, smallest
 * first, in fp32 chains of 512; never TF32). Both passes take hidden and weight as planes [3][rows][ld] of
 * K = D + 1 columns with a bias, D without: the column past D holds 1 in hidden's planes (hi 1, mid and lo
 * 0) and bias[v] in weight's, so that hidden . weight[v] + bias[v] is one product, the bias's parts inside
 * the chains. The forward folds it as the bf16 forward does; the backward's dz kernel forms the same z
 * (the same k sequence and chains), and its dH and dW read the planes' first D columns.
 * docs/operators/linear_logp.md gives the error against fp64 beside the fp32 FFMA path's. */
#define FP32_PARTS_BYTES (256ll << 20) /* forward: hidden's planes of a row block (half at most) + weight's of a chunk */

__device__ __forceinline__ void fp32_parts(float x, __nv_bfloat16 (&part)[3]) {
    part[0] = __float2bfloat16_rn(x);
    const float r = __fsub_rn(x, __bfloat162float(part[0]));
    part[1] = __float2bfloat16_rn(r);
    part[2] = __float2bfloat16_rn(__fsub_rn(r, __bfloat162float(part[1])));
}

/* x [rows, cols] fp32 (row stride ld) -> planes[q][row][col], q = 0 hi, 1 mid, 2 lo (fp32_parts), row stride
 * ld_planes, plane stride rows x ld_planes: a PARTS operand. With tail, column `cols` too, holding
 * tail_values[row] (NULL: 1). One block per row. */
__global__ void fp32_planes_kernel(const float *__restrict__ x, int64_t ld, int64_t cols, bool tail,
                                   const float *__restrict__ tail_values, int64_t ld_planes, int64_t plane_stride,
                                   __nv_bfloat16 *__restrict__ planes) {
    const int64_t row = blockIdx.x;
    const float *xr = x + row * ld;
    __nv_bfloat16 *out = planes + row * ld_planes;
    for (int64_t c = threadIdx.x; c < cols + tail; c += blockDim.x) {
        __nv_bfloat16 part[3];
        fp32_parts(c < cols ? xr[c] : tail_values != nullptr ? tail_values[row] : 1.f, part);
#pragma unroll
        for (int q = 0; q < 3; ++q) out[q * plane_stride + c] = part[q];
    }
}

static int launch_fp32_planes(const float *x, int64_t ld, int64_t rows, int64_t cols, bool tail,
                              const float *tail_values, int64_t ld_planes, __nv_bfloat16 *planes, cudaStream_t s) {
    fp32_planes_kernel<<<(unsigned)rows, 256, 0, s>>>(x, ld, cols, tail, tail_values, ld_planes, rows * ld_planes,
                                                      planes);
    return (int)cudaGetLastError();
}

/* The forward's logits and the backward's z are one product bit for bit only when both build their planes
 * alike, so both build them here. Hidden's rows r0.. with the bias's 1 column; weight's rows v0.. with the
 * bias's values there (no bias: neither has the column). */
static int launch_hidden_planes(const float *hidden, int64_t ldh, int64_t r0, int64_t rows, int64_t D,
                                const float *bias, int64_t ld_planes, __nv_bfloat16 *planes, cudaStream_t s) {
    return launch_fp32_planes(hidden + r0 * ldh, ldh, rows, D, bias != nullptr, nullptr, ld_planes, planes, s);
}
static int launch_weight_planes(const float *weight, int64_t ldw, int64_t v0, int64_t cols, int64_t D,
                                const float *bias, int64_t ld_planes, __nv_bfloat16 *planes, cudaStream_t s) {
    return launch_fp32_planes(weight + v0 * ldw, ldw, cols, D, bias != nullptr, bias != nullptr ? bias + v0 : nullptr,
                              ld_planes, planes, s);
}

/* The planes' columns (D, + 1 for the bias) and row stride (whole 16 bytes, as TMA needs). */
static int64_t fp32_planes_k(const void *bias, int64_t D) { return D + (bias != nullptr); }
static int64_t fp32_planes_ld(const void *bias, int64_t D) { return round_up(fp32_planes_k(bias, D), 8); }

/* The fp32 forward's plan: equal blocks of rows, as few as keep hidden's planes within half of
 * FP32_PARTS_BYTES, and chunks of as many whole splits as weight's planes fit in the rest (wide chunks:
 * each is one launch, whose last round of units is partly empty). */
typedef struct fp32_plan {
    int64_t K, ld, block_rows, chunk_cols;
    int64_t partial_bytes, slot_bytes, hidden_bytes, weight_bytes;
} fp32_plan;

static fp32_plan plan_fp32(const rlk_linear_logp_args *args, int num_sms) {
    fp32_plan f;
    f.K = fp32_planes_k(args->bias, args->D);
    f.ld = fp32_planes_ld(args->bias, args->D);
    const int64_t row_bytes = 6 * f.ld;
    const int64_t max_rows = FP32_PARTS_BYTES / 2 / row_bytes < 128 ? 128 : FP32_PARTS_BYTES / 2 / row_bytes;
    const int64_t blocks = (args->N + max_rows - 1) / max_rows;
    f.block_rows = (args->N + blocks - 1) / blocks;
    const int64_t splits = (FP32_PARTS_BYTES - f.block_rows * row_bytes) / row_bytes / LOGP_SPLIT_COLS;
    f.chunk_cols = (splits < 1 ? 1 : splits) * LOGP_SPLIT_COLS;
    if (f.chunk_cols > args->V) f.chunk_cols = args->V;
    f.partial_bytes = round_up(logp_splits(args->V) * f.block_rows * (int64_t)sizeof(float4), 256);
    f.slot_bytes = round_up(stream_k_workspace_bytes(logp_fold<192>::STATE_BN, 2, num_sms), 256);
    f.hidden_bytes = round_up(f.block_rows * row_bytes, 256);
    f.weight_bytes = f.chunk_cols * row_bytes;
    return f;
}

static int linear_logp_fwd_fp32(const rlk_linear_logp_args *args, rlk_context *ctx, int device, int num_sms) {
    const fp32_plan f = plan_fp32(args, num_sms);
    if (ctx->plan_only) {
        ctx->workspace_bytes = f.partial_bytes + f.slot_bytes + f.hidden_bytes + f.weight_bytes;
        return RLK_OK;
    }
    char *ws = (char *)args->workspace;
    float4 *partials = (float4 *)ws;
    float *slots = (float *)(ws + f.partial_bytes);
    __nv_bfloat16 *hidden_planes = (__nv_bfloat16 *)(ws + f.partial_bytes + f.slot_bytes);
    __nv_bfloat16 *weight_planes = (__nv_bfloat16 *)(ws + f.partial_bytes + f.slot_bytes + f.hidden_bytes);
    const float *hidden = (const float *)args->hidden, *weight = (const float *)args->weight;
    const float *bias = (const float *)args->bias;
    const cudaStream_t s = (cudaStream_t)ctx->stream;
    for (int64_t r0 = 0; r0 < args->N; r0 += f.block_rows) {
        const int64_t rows = args->N - r0 < f.block_rows ? args->N - r0 : f.block_rows;
        int rc = launch_hidden_planes(hidden, args->ldh, r0, rows, args->D, bias, f.ld, hidden_planes, s);
        for (int64_t v0 = 0; rc == RLK_OK && v0 < args->V; v0 += f.chunk_cols) {
            const int64_t cols = args->V - v0 < f.chunk_cols ? args->V - v0 : f.chunk_cols;
            rc = launch_weight_planes(weight, args->ldw, v0, cols, args->D, bias, f.ld, weight_planes, s);
            if (rc == RLK_OK)
                rc = launch_logp_fold<true>(hidden_planes, f.ld, weight_planes, f.ld, rows, cols, f.K, true, nullptr,
                                            args->target + r0, v0, args->inv_temperature,
                                            partials + v0 / LOGP_SPLIT_COLS * rows, slots, device, num_sms, s);
        }
        if (rc != RLK_OK) return rc;
        rlk_linear_logp_args block = *args;
        block.N = rows;
        block.target = args->target + r0;
        block.logp = args->logp + r0;
        block.entropy = args->entropy != nullptr ? args->entropy + r0 : nullptr;
        block.lse = args->lse + r0;
        rc = launch_linear_logp_merge(&block, partials, true, s);
        if (rc != RLK_OK) return rc;
    }
    return RLK_OK;
}

extern "C" int rlk_linear_logp_fwd_sm90(const rlk_linear_logp_args *args, rlk_context *ctx) {
    const bool bf16 = args->dtype == RLK_BF16, fp32 = args->dtype == RLK_F32;
    if (!bf16 && !fp32 && args->dtype != RLK_F16) return RLK_UNSUPPORTED;
    if (args->D <= 0 || (!fp32 && args->D % 8 != 0) || args->D >= INT32_MAX / (fp32 ? 8 : 1) ||
        args->N >= INT32_MAX || args->V >= INT32_MAX - LOGP_SPLIT_COLS)
        return RLK_UNSUPPORTED;
    if (!fp32 && (!tma_operand_ok(args->hidden, args->ldh) || !tma_operand_ok(args->weight, args->ldw)))
        return RLK_UNSUPPORTED;
    ctx->kernel = fp32 ? "linear_logp_fwd_fp32_sm90" : "linear_logp_fwd_sm90";
    int device, num_sms;
    const cudaError_t err = current_device(&device, &num_sms);
    if (err != cudaSuccess) return (int)err;
    if (fp32) return linear_logp_fwd_fp32(args, ctx, device, num_sms);
    /* workspace: the splits' partial states, then stream-K's hand-over slots (logp_fold) */
    const int64_t partial_bytes = logp_splits(args->V) * args->N * (int64_t)sizeof(float4);
    if (ctx->plan_only) {
        ctx->workspace_bytes = partial_bytes + stream_k_workspace_bytes(logp_fold<192>::STATE_BN, 2, num_sms);
        return RLK_OK;
    }
    float4 *partials = (float4 *)args->workspace;
    const cudaStream_t s = (cudaStream_t)ctx->stream;
    const int rc = launch_logp_fold<false>(args->hidden, args->ldh, args->weight, args->ldw, args->N, args->V, args->D, bf16,
                                    args->bias, args->target, 0, args->inv_temperature, partials,
                                    (float *)((char *)args->workspace + partial_bytes), device, num_sms, s);
    if (rc != RLK_OK) return rc;
    return launch_linear_logp_merge(args, partials, true, s);
}

/* The large tile config's main loop (the GEMM's z, bitwise) with the dlogits epilogue: z of the chunk never
 * leaves registers; dz goes out through the same store paths as a GEMM tile. */
extern "C" int rlk_linear_logp_dlogits_sm90(const rlk_linear_logp_dlogits_args *args, rlk_context *ctx) {
    const bool bf16 = args->dtype == RLK_BF16;
    if (!bf16 && args->dtype != RLK_F16) return RLK_UNSUPPORTED;
    if (args->D <= 0 || args->D >= INT32_MAX || args->rows >= INT32_MAX || args->cols >= INT32_MAX)
        return RLK_UNSUPPORTED;
    if (!tma_operand_ok(args->hidden, args->ldh) || !tma_operand_ok(args->weight, args->ldw)) return RLK_UNSUPPORTED;
    ctx->kernel = "linear_logp_dlogits_sm90";
    if (ctx->plan_only) return RLK_OK;

    int device, num_sms;
    const cudaError_t err = current_device(&device, &num_sms);
    if (err != cudaSuccess) return (int)err;

    /* z = hidden @ weight_chunk^T + 1 * bias, C = the bias row broadcast over the rows (ldc = 0) */
    rlk_gemm_args g = product_args(args->hidden, args->ldh, args->weight, args->ldw, args->rows, args->cols, args->D,
                                   args->dtype, args->dtype);
    g.c = args->bias;
    g.ldc = 0;
    g.out = args->dlogits;
    g.ldo = args->ld_dlogits;
    g.alpha = g.beta = 1.0;
    const gemm_sm90_params p = gemm_params(&g);
    logp_sm90_params lp;
    memset(&lp, 0, sizeof(lp));
    lp.target = args->target;
    lp.lse = args->lse;
    lp.entropy = args->entropy;
    lp.grad_logp = args->grad_logp;
    lp.grad_entropy = args->grad_entropy;
    lp.ignore_index = args->ignore_index;
    lp.v0 = args->v0;
    lp.inv_temperature = args->inv_temperature;

    const cudaStream_t s = (cudaStream_t)ctx->stream;
    return bf16 ? launch_gemm_sm90<256, 2, 64, 4, 1, 2, false, false, true, store_tiles<__nv_bfloat16, dlogits_value>>(
                      &g, p, lp, device, num_sms, s)
                : launch_gemm_sm90<256, 2, 64, 4, 1, 2, false, false, false, store_tiles<__half, dlogits_value>>(
                      &g, p, lp, device, num_sms, s);
}

/* ------------------------- fp32 backward: every product on bf16 parts ------------------------- */
/* With fp32 inputs the backward's three products run as PARTS products on the planes above, per block of
 * rows and vocabulary chunk:
 *   planes(H_block); then for each chunk c of fp32_bwd_chunk(bias, D, V) columns, in increasing order:
 *     planes(W_c); dz = dlogits(z) in fp32, z the forward's logits (192-wide tiles, the bias in the
 *     planes); planes(dz); db_c += column sums of dz (rows in order); dH_block (+)= dz W_c into
 *     grad_hidden; dW_c (+)= dz^T H_block into grad_weight (accumulated over the blocks).
 * A row's dH is the same sum of the same chunks whatever the blocks (the GEMMs' rows are batch-invariant,
 * the chunks depend on D and V); dW and db add the blocks in order. */
#define FP32_BWD_WEIGHT_BYTES (96ll << 20) /* weight's planes of one chunk, at most */

/* Vocabulary columns per chunk: as few chunks as keep weight's planes within FP32_BWD_WEIGHT_BYTES, of equal
 * width rounded up to a multiple of 384 (whole 192-wide dz tiles and 128-row dW tiles; the last chunk
 * takes what is left), at most V. */
static int64_t fp32_bwd_chunk(const void *bias, int64_t D, int64_t V) {
    int64_t max_chunk = FP32_BWD_WEIGHT_BYTES / (6 * fp32_planes_ld(bias, D)) / 384 * 384;
    max_chunk = max_chunk < 384 ? 384 : max_chunk;
    const int64_t chunks = (V + max_chunk - 1) / max_chunk, chunk = round_up((V + chunks - 1) / chunks, 384);
    return chunk < V ? chunk : V;
}

/* db[c] += sum over rows r (in order) of dz[r][c]: one thread per column. */
__global__ void column_sums_kernel(const float *__restrict__ dz, int64_t ld, int64_t rows, int64_t cols,
                                   float *__restrict__ db) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float sum = 0.f;
    for (int64_t r = 0; r < rows; ++r) sum = __fadd_rn(sum, dz[r * ld + c]);
    db[c] = __fadd_rn(db[c], sum);
}

/* The fp32 backward's plan: the chunk, rows per block (as few equal blocks as fit, whole 128-row tiles
 * where that still fits) and the sizes of the workspace's buffers. */
typedef struct fp32_bwd_plan {
    int64_t chunk, block, K, ld, ld_chunk;
    int64_t slot_bytes, weight_bytes, hidden_bytes, dz_bytes, dz_planes_bytes, total_bytes;
} fp32_bwd_plan;

static bool plan_fp32_bwd(const rlk_linear_logp_bwd_args *args, int num_sms, fp32_bwd_plan *f) {
    f->chunk = fp32_bwd_chunk(args->bias, args->D, args->V);
    f->K = fp32_planes_k(args->bias, args->D);
    f->ld = fp32_planes_ld(args->bias, args->D);
    f->ld_chunk = round_up(f->chunk, 8);
    f->slot_bytes = round_up(stream_k_workspace_bytes(192, 2, num_sms), 256); /* the widest tiles' */
    f->weight_bytes = round_up(6 * f->chunk * f->ld, 256);
    const int64_t row_bytes = 6 * f->ld + 10 * f->ld_chunk + 3 * 256; /* H's planes, dz, dz's planes */
    const int64_t max_block = (args->max_workspace_bytes - f->slot_bytes - f->weight_bytes) / row_bytes;
    if (max_block < 1) return false;
    const int64_t blocks = (args->N + max_block - 1) / max_block;
    int64_t block = (args->N + blocks - 1) / blocks;
    block = round_up(block, 128) <= max_block ? round_up(block, 128) : block;
    f->block = block > args->N ? args->N : block;
    f->hidden_bytes = round_up(6 * f->block * f->ld, 256);
    f->dz_bytes = round_up(4 * f->block * f->ld_chunk, 256);
    f->dz_planes_bytes = round_up(6 * f->block * f->ld_chunk, 256);
    f->total_bytes = f->slot_bytes + f->weight_bytes + f->hidden_bytes + f->dz_bytes + f->dz_planes_bytes;
    return true;
}

/* out (+)= A @ B as a PARTS product on 128 x 128 tiles, clusters of 2, 6 stages: dH = dz W_c (A K-major,
 * B MN-major) and dW_c = dz^T H (both MN-major); fp32 out, accumulated into itself when accumulate. */
template <bool A_MN>
static int launch_parts_gemm(int64_t M, int64_t N, int64_t K, const __nv_bfloat16 *a, int64_t lda,
                             const __nv_bfloat16 *b, int64_t ldb, float *out, int64_t ldo, bool accumulate,
                             float *slots, int device, int num_sms, cudaStream_t s) {
    rlk_gemm_args g;
    memset(&g, 0, sizeof(g));
    g.M = M, g.N = N, g.K = K;
    g.in_dtype = RLK_BF16, g.out_dtype = RLK_F32;
    g.a = a, g.lda = lda, g.a_trans = A_MN;
    g.b = b, g.ldb = ldb;
    g.c = accumulate ? out : nullptr, g.ldc = accumulate ? ldo : 0;
    g.out = out, g.ldo = ldo;
    g.alpha = 1.0, g.beta = accumulate ? 1.0 : 0.0;
    gemm_sm90_params p = gemm_params(&g);
    p.stream_k = 1;
    p.partials = slots;
    return launch_gemm_sm90<128, 2, 64, 6, 1, 2, A_MN, true, true, store_parts_tiles<float, gemm_value>>(
        &g, p, gemm_value::Params{}, device, num_sms, s);
}

/* The dz kernel's z is the forward's logits bit for bit only with the same k sequence: the same chains. */
static_assert(store_parts_tiles<float, dlogits_value>::CHAIN == logp_fold<192, true>::CHAIN,
              "the fp32 backward's chains must be the forward's");

/* dz of the block's rows and the chunk at v0, fp32: the PARTS product of H's and W_c's planes (z, the bias
 * inside) with the dlogits epilogue, on 128 x 192 tiles, clusters of 2, 4 stages. */
static int launch_parts_dlogits(const rlk_linear_logp_bwd_args *args, int64_t r0, int64_t rows, int64_t v0,
                                int64_t cols, const fp32_bwd_plan &f, const __nv_bfloat16 *hidden_planes,
                                const __nv_bfloat16 *weight_planes, float *dz, float *slots, int device,
                                int num_sms, cudaStream_t s) {
    rlk_gemm_args g = product_args(hidden_planes, f.ld, weight_planes, f.ld, rows, cols, f.K, RLK_BF16, RLK_F32);
    g.out = dz;
    g.ldo = f.ld_chunk;
    g.alpha = 1.0;
    gemm_sm90_params p = gemm_params(&g);
    p.stream_k = 1;
    p.partials = slots;
    logp_sm90_params lp;
    memset(&lp, 0, sizeof(lp));
    lp.target = args->target + r0;
    lp.lse = args->lse + r0;
    lp.entropy = args->entropy != nullptr ? args->entropy + r0 : nullptr;
    lp.grad_logp = args->grad_logp != nullptr ? args->grad_logp + r0 : nullptr;
    lp.grad_entropy = args->grad_entropy != nullptr ? args->grad_entropy + r0 : nullptr;
    lp.ignore_index = args->ignore_index;
    lp.v0 = v0;
    lp.inv_temperature = args->inv_temperature;
    return launch_gemm_sm90<192, 2, 64, 4, 1, 2, false, false, true, store_parts_tiles<float, dlogits_value>>(
        &g, p, lp, device, num_sms, s);
}

extern "C" int rlk_linear_logp_bwd_sm90(const rlk_linear_logp_bwd_args *args, rlk_context *ctx) {
    if (args->dtype != RLK_F32) return RLK_UNSUPPORTED; /* 16-bit inputs: the binding's chunk walk */
    if (args->D <= 0 || args->D >= INT32_MAX / 8 || args->N >= INT32_MAX || args->V >= INT32_MAX) return RLK_UNSUPPORTED;
    int device, num_sms;
    const cudaError_t err = current_device(&device, &num_sms);
    if (err != cudaSuccess) return (int)err;
    fp32_bwd_plan f;
    if (!plan_fp32_bwd(args, num_sms, &f)) return RLK_UNSUPPORTED;
    ctx->kernel = "linear_logp_bwd_fp32_sm90";
    if (ctx->plan_only) {
        ctx->workspace_bytes = f.total_bytes;
        return RLK_OK;
    }
    char *ws = (char *)args->workspace;
    float *slots = (float *)ws;
    __nv_bfloat16 *weight_planes = (__nv_bfloat16 *)(ws + f.slot_bytes);
    __nv_bfloat16 *hidden_planes = (__nv_bfloat16 *)(ws + f.slot_bytes + f.weight_bytes);
    float *dz = (float *)(ws + f.slot_bytes + f.weight_bytes + f.hidden_bytes);
    __nv_bfloat16 *dz_planes = (__nv_bfloat16 *)(ws + f.slot_bytes + f.weight_bytes + f.hidden_bytes + f.dz_bytes);
    const float *hidden = (const float *)args->hidden, *weight = (const float *)args->weight;
    const float *bias = (const float *)args->bias;
    float *grad_hidden = (float *)args->grad_hidden, *grad_weight = (float *)args->grad_weight;
    const cudaStream_t s = (cudaStream_t)ctx->stream;
    int rc = RLK_OK;
    for (int64_t r0 = 0; rc == RLK_OK && r0 < args->N; r0 += f.block) {
        const int64_t rows = args->N - r0 < f.block ? args->N - r0 : f.block;
        rc = launch_hidden_planes(hidden, args->ldh, r0, rows, args->D, bias, f.ld, hidden_planes, s);
        for (int64_t v0 = 0; rc == RLK_OK && v0 < args->V; v0 += f.chunk) {
            const int64_t cols = args->V - v0 < f.chunk ? args->V - v0 : f.chunk;
            rc = launch_weight_planes(weight, args->ldw, v0, cols, args->D, bias, f.ld, weight_planes, s);
            if (rc == RLK_OK)
                rc = launch_parts_dlogits(args, r0, rows, v0, cols, f, hidden_planes, weight_planes, dz, slots, device,
                                          num_sms, s);
            if (rc == RLK_OK) rc = launch_fp32_planes(dz, f.ld_chunk, rows, cols, false, nullptr, f.ld_chunk, dz_planes, s);
            if (rc == RLK_OK && args->grad_bias != nullptr) {
                column_sums_kernel<<<(unsigned)((cols + 255) / 256), 256, 0, s>>>(dz, f.ld_chunk, rows, cols,
                                                                               args->grad_bias + v0);
                rc = (int)cudaGetLastError();
            }
            if (rc == RLK_OK) /* dH (+)= dz W_c: W_c's planes as [cols, D] */
                rc = launch_parts_gemm<false>(rows, args->D, cols, dz_planes, f.ld_chunk, weight_planes, f.ld,
                                              grad_hidden + r0 * args->ld_grad_hidden, args->ld_grad_hidden, v0 > 0,
                                              slots, device, num_sms, s);
            if (rc == RLK_OK) /* dW_c (+)= dz^T H: H's planes as [rows, D] */
                rc = launch_parts_gemm<true>(cols, args->D, rows, dz_planes, f.ld_chunk, hidden_planes, f.ld,
                                             grad_weight + v0 * args->ld_grad_weight, args->ld_grad_weight, r0 > 0,
                                             slots, device, num_sms, s);
        }
    }
    return rc;
}
