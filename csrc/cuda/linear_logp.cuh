/* cuda/linear_logp.cuh: what the linear_logp kernels of every architecture (sm80/linear_logp.cu on
 * mma.sync, sm90/linear_logp.cu on wgmma) share: the vocabulary split, the online-softmax state, the
 * kernel that merges a row's split partials, and the backward's d loss / d z of one logit.
 *
 * Partial state of (split, row), in log2 units x = s * log2(e): float4 {m, l, S, x_target} with
 * m the running max, l = sum 2^(x - m), S = sum 2^(x - m) (x - m), x_target the target's logit when
 * the target falls in the split. workspace[split * N + row]; splits = ceil(V / LOGP_SPLIT_COLS),
 * a function of V only, merged per row in increasing order: the result does not depend on N.
 *
 * Everything here has internal linkage: each .cu file that includes it gets its own copy.
 */
#ifndef RLK_CUDA_LINEAR_LOGP_CUH_
#define RLK_CUDA_LINEAR_LOGP_CUH_

#include "../ops/linear_logp.h"
#include "common.cuh"

#define LOGP_SPLIT_COLS 768     /* vocabulary columns per split: one partial state per row */
#define LOGP_EMPTY_MAX (-1e30f) /* max of an empty state: finite so that (m - m') * 0 stays 0 */

static const float LOG2E = 1.4426950408889634f;
static const float LN2 = 0.6931471805599453f;

static inline int64_t logp_splits(int64_t V) { return (V + LOGP_SPLIT_COLS - 1) / LOGP_SPLIT_COLS; }

/* Folds (m2, l2, S2) into (m, l, S). Empty states have m = LOGP_EMPTY_MAX, l = S = 0. */
static __device__ __forceinline__ void softmax_state_merge(float &m, float &l, float &S, float m2,
                                                           float l2, float S2) {
    const float m_new = fmaxf(m, m2);
    const float a = exp2f(m - m_new), b = exp2f(m2 - m_new);
    S = a * fmaf(m - m_new, l, S) + b * fmaf(m2 - m_new, l2, S2);
    l = fmaf(a, l, b * l2);
    m = m_new;
}

/* d loss / d z of the logits z of one row (ops/linear_logp.h, backward): with s = z / T, p = exp(s - lse),
 *   (g_logp (1[target] - p) - g_ent p (s - lse + entropy)) / T  =  a 1[target] - p (k + b x2),
 * x2 = (s - lse) log2(e) = z c2 - lse2 and p = 2^x2, from the row's constants (dlogit_row): c2 = log2(e) / T,
 * lse2 = lse log2(e), a = g_logp / T, b = g_ent ln(2) / T, k = a + g_ent entropy / T. Four operations a
 * logit (the direct form with expf took ~20; the fused SM90 epilogue runs them while the tensor cores
 * wait). Explicitly rounded operations, so the fused SM90 epilogue and the elementwise kernel give the
 * same bits. */
typedef struct dlogit_row {
    float c2, lse2, a, b, k;
} dlogit_row;

static __device__ __forceinline__ dlogit_row make_dlogit_row(float inv_temperature, float lse, float entropy,
                                                             float grad_logp, float grad_entropy) {
    const float g_ent = __fmul_rn(grad_entropy, inv_temperature);
    dlogit_row r;
    r.c2 = __fmul_rn(inv_temperature, LOG2E);
    r.lse2 = __fmul_rn(lse, LOG2E);
    r.a = __fmul_rn(grad_logp, inv_temperature);
    r.b = __fmul_rn(g_ent, LN2);
    r.k = __fmaf_rn(g_ent, entropy, r.a);
    return r;
}

static __device__ __forceinline__ float dlogit_value(const dlogit_row &r, float z, bool is_target) {
    const float x2 = __fmaf_rn(z, r.c2, -r.lse2);
    const float p = exp2_approx(x2);
    return __fmaf_rn(-p, __fmaf_rn(r.b, x2, r.k), is_target ? r.a : 0.0f);
}

/* One row of a logits tile as the mma.sync / wgmma accumulator layouts spread it: a quad of lanes,
 * NC column pairs x[j][0..1] per lane (log2 units, -inf past V). Gives the tile's state: the max
 * over the quad, then l = sum 2^(x - max) and S = sum 2^(x - max) (x - max) in column order per
 * lane, reduced with xor shuffles (a + b == b + a, so all four lanes hold the same bits). A -inf
 * entry has p = 0; clamping its x - max keeps S finite. */
template <int NC>
static __device__ __forceinline__ void quad_tile_state(const float (&x)[NC][2], float &tile_max,
                                                       float &l, float &S) {
    tile_max = LOGP_EMPTY_MAX;
#pragma unroll
    for (int j = 0; j < NC; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) tile_max = fmaxf(tile_max, x[j][e]);
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    l = 0.0f;
    S = 0.0f;
#pragma unroll
    for (int j = 0; j < NC; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float diff = x[j][e] - tile_max;
            const float p = exp2_approx(diff);
            l += p;
            S = fmaf(p, fmaxf(diff, LOGP_EMPTY_MAX), S);
        }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    S += __shfl_xor_sync(0xffffffffu, S, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    S += __shfl_xor_sync(0xffffffffu, S, 2);
}

#define LOGP_MERGE_BATCH 8 /* partial states a thread has in flight: the loads of a batch overlap */

/* One thread per row: fold the splits in increasing order, then finish logp / entropy / lse.
 * Ignored rows give 0, 0, 0; an out-of-range target gives NaN and stores 1 to *bad_target.
 * A batch's partials are all loaded before any of them is folded (the fold's order is unchanged), so a
 * row's L2 round trips are ceil(splits / LOGP_MERGE_BATCH), not one per split. On sm90 the kernel is
 * launched as a programmatic dependent of the fold (launch_linear_logp_merge): it starts while the fold's
 * last CTAs run and waits (griddepcontrol.wait) for its end before reading the partials. */
static __global__ void linear_logp_merge_kernel(const float4 *__restrict__ partials, int64_t N,
                                                int64_t V, int splits,
                                                const int64_t *__restrict__ target,
                                                int64_t ignore_index, float *__restrict__ logp,
                                                float *__restrict__ entropy,
                                                float *__restrict__ lse, int32_t *bad_target) {
    const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t t = n < N ? target[n] : ignore_index; /* an input: read before the fold ends */
    wait_for_dependency();
    if (n >= N) return;
    float out_logp, out_entropy, out_lse;
    if (t == ignore_index) {
        out_logp = out_entropy = out_lse = 0.0f;
    } else if (t < 0 || t >= V) {
        out_logp = out_entropy = out_lse = __int_as_float(0x7fc00000);
        if (bad_target != nullptr) *bad_target = 1;
    } else {
        float m = LOGP_EMPTY_MAX, l = 0.0f, S = 0.0f;
        for (int s0 = 0; s0 < splits; s0 += LOGP_MERGE_BATCH) {
            float4 p[LOGP_MERGE_BATCH];
#pragma unroll
            for (int i = 0; i < LOGP_MERGE_BATCH; ++i)
                if (s0 + i < splits) p[i] = partials[(int64_t)(s0 + i) * N + n];
#pragma unroll
            for (int i = 0; i < LOGP_MERGE_BATCH; ++i)
                if (s0 + i < splits) softmax_state_merge(m, l, S, p[i].x, p[i].y, p[i].z);
        }
        const float x_target = partials[(t / LOGP_SPLIT_COLS) * N + n].w;
        const float log2_l = log2f(l);
        out_logp = ((x_target - m) - log2_l) * LN2;
        out_entropy = (log2_l - S / l) * LN2;
        out_lse = (m + log2_l) * LN2;
    }
    logp[n] = out_logp;
    lse[n] = out_lse;
    if (entropy != nullptr) entropy[n] = out_entropy;
}

/* Launches the merge of the partials in workspace into args' logp / entropy / lse; with dependent (sm90),
 * as a programmatic dependent of the kernel before it on the stream, which must be the fold that wrote
 * the partials (its launch and start-up then overlap the fold's last round). */
static inline int launch_linear_logp_merge(const rlk_linear_logp_args *args, const float4 *partials,
                                           bool dependent, cudaStream_t stream) {
    const int threads = 256;
    cudaLaunchAttribute programmatic;
    const cudaLaunchConfig_t config = launch_config_dependent(dim3((unsigned)((args->N + threads - 1) / threads)),
                                                              dim3(threads), stream, dependent, &programmatic);
    return (int)cudaLaunchKernelEx(&config, linear_logp_merge_kernel, partials, args->N, args->V,
                                   (int)logp_splits(args->V), args->target, args->ignore_index, args->logp,
                                   args->entropy, args->lse, args->bad_target);
}

#endif /* RLK_CUDA_LINEAR_LOGP_CUH_ */
