/* ops/linear_logp.h: the contract of the fused LM-head log-probs (docs/operators/linear_logp.md).
 *
 * Forward (entry linear_logp_fwd), per row n with s_v = (hidden[n] . weight[v] + bias[v]) * inv_temperature:
 *   lse[n] = log sum_v exp(s_v);  logp[n] = s_target - lse[n];  entropy[n] = lse[n] - sum_v p_v s_v
 * Rows whose target == ignore_index: logp = 0, entropy = 0, lse = 0 (no gradient flows there).
 * Targets outside [0, V) (other than ignore_index) give logp = entropy = lse = NaN for that row and
 * are reported: the CPU launcher returns RLK_BAD_INDEX after finishing the other rows; GPU launchers
 * store 1 to *bad_target (host-mapped pinned memory, so no host sync is needed).
 * hidden [N, D] row stride ldh (contiguous in D), weight [V, D] row stride ldw, bias [V] or NULL,
 * all in `dtype`; target int64 [N]; logp, entropy (may be NULL), lse: fp32 [N].
 * The V reduction order depends on V only (fixed V split, partials merged in a fixed order).
 * workspace: ctx->workspace_bytes of device memory as planned (the split partials; sm90 also its
 * stream-K hand-over slots).
 *
 * Backward, one chunk of rows x vocabulary columns [v0, v0 + cols) at a time (csrc/bind/linear_logp.c
 * walks the chunks in a fixed order and feeds d_z to the GEMM kernels). With z the chunk's logits
 * (bias included), s = z / T, p = exp(s - lse), t the row's target:
 *   d_s[r, c] = g_logp[r] * (1[v0 + c == t] - p) - g_ent[r] * p * (s - lse[r] + entropy[r])
 *   d_z = d_s * inv_temperature           (rows with target == ignore_index: d_z = 0)
 * entry linear_logp_dz: d_z from logits = hidden @ weight_chunk^T (fp32, no bias) given in memory,
 *   z = logits + bias in fp32 (one rounding, as the GEMM's epilogue with C = bias would do);
 * entry linear_logp_dlogits: the same d_z with the product formed inside the kernel (z never leaves
 *   registers), bitwise equal to a GEMM of this backend followed by linear_logp_dz.
 * target, lse, entropy, grad_logp, grad_entropy point at the chunk's first row ([rows] each);
 * grad_logp or grad_entropy may be NULL (zero); entropy may be NULL when grad_entropy is.
 * dlogits has the inputs' dtype, row stride ld_dlogits.
 *
 * entry linear_logp_bwd: the whole backward in one call, for a backend that runs it its own way (sm90's
 * fp32 inputs: every product on bf16 parts); csrc/bind/linear_logp.c asks it first and walks the chunks
 * itself where it answers RLK_UNSUPPORTED. The same gradients as the chunk walk: grad_hidden [N, D] and
 * grad_weight [V, D] (row strides ld_grad_hidden, ld_grad_weight, inputs' dtype) written, grad_bias fp32
 * [V] (zeros on entry) accumulated into, or NULL without a bias. dH rows depend on their own row only;
 * its vocabulary chunks are a function of D and V. Scratch memory at most max_workspace_bytes (plan_only
 * reports it; RLK_UNSUPPORTED when no plan fits).
 */
#ifndef RLK_OPS_LINEAR_LOGP_H_
#define RLK_OPS_LINEAR_LOGP_H_

#include "../rlk.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rlk_linear_logp_args {
    int64_t N, D, V;
    rlk_dtype dtype;
    const void *hidden;
    int64_t ldh;
    const void *weight;
    int64_t ldw;
    const void *bias;
    const int64_t *target;
    int64_t ignore_index;
    float inv_temperature;
    float *logp, *entropy, *lse;
    int32_t *bad_target;
    void *workspace;
} rlk_linear_logp_args;

typedef struct rlk_linear_logp_dlogits_args {
    int64_t rows, cols, D, v0;
    rlk_dtype dtype;
    const void *hidden, *weight, *bias; /* the chunk's rows, weight rows [cols, D] and bias [cols] */
    int64_t ldh, ldw;
    const float *logits;                /* linear_logp_dz: [rows, cols] fp32, row stride ld_logits */
    int64_t ld_logits;
    const int64_t *target;
    int64_t ignore_index;
    const float *lse, *entropy, *grad_logp, *grad_entropy;
    float inv_temperature;
    void *dlogits;
    int64_t ld_dlogits;
} rlk_linear_logp_dlogits_args;

typedef struct rlk_linear_logp_bwd_args {
    int64_t N, D, V;
    rlk_dtype dtype;
    const void *hidden, *weight, *bias;
    int64_t ldh, ldw;
    const int64_t *target;
    int64_t ignore_index;
    float inv_temperature;
    const float *lse, *entropy, *grad_logp, *grad_entropy; /* [N]; as rlk_linear_logp_dlogits_args */
    void *grad_hidden, *grad_weight;
    int64_t ld_grad_hidden, ld_grad_weight;
    float *grad_bias;
    int64_t max_workspace_bytes;
    void *workspace;
} rlk_linear_logp_bwd_args;

typedef int rlk_linear_logp_fwd_fn(const rlk_linear_logp_args *args, rlk_context *ctx);
typedef int rlk_linear_logp_dz_fn(const rlk_linear_logp_dlogits_args *args, rlk_context *ctx);
typedef int rlk_linear_logp_dlogits_fn(const rlk_linear_logp_dlogits_args *args, rlk_context *ctx);
typedef int rlk_linear_logp_bwd_fn(const rlk_linear_logp_bwd_args *args, rlk_context *ctx);

#ifdef __cplusplus
}
#endif
#endif /* RLK_OPS_LINEAR_LOGP_H_ */
