/* ops/rms_norm.h: the contract of the batch-invariant RMSNorm over the last dimension.
 *
 * Per row r of `cols` elements (x in dtype, computed in fp32):
 *   rstd_r = 1 / sqrt(sum_j x_j^2 / cols + eps)        (the sum in a fixed order that depends on
 *   h_j    = x_j * rstd_r                               cols only: batch-invariant)
 *   round_before_weight = 0 (torch.nn.functional.rms_norm):  y_j = round(h_j * w_j)
 *   round_before_weight = 1 (transformers' Llama / Qwen RMSNorm: weight * h.to(dtype)):
 *                                                         y_j = round(w_j * round(h_j))
 *   weight NULL: y_j = round(h_j). rstd (fp32 [rows]) is written for the backward.
 * Backward (entry rms_norm_bwd), with g_j = dy_j * w_j (dy_j without a weight), in fp32:
 *   dx_j = rstd_r * g_j - x_j * rstd_r^3 * (sum_k g_k x_k) / cols      (row sums as above)
 *   dweight_j = sum_r dy_rj * h'_rj, h' = round(h) when round_before_weight, else h: a reduction
 *   over rows in a fixed order (row blocks of a size fixed by the kernel, their partials added in
 *   increasing order): deterministic, bitwise equal run to run. dweight NULL: not computed.
 * dtype: bf16 / fp16 / fp32 (and fp64 on the CPU, computed in fp64); x, weight, y, dy, dx, dweight
 * share it. Row strides in elements; the last dimension is contiguous.
 * workspace: ctx->workspace_bytes as planned (the dweight partials).
 */
#ifndef RLK_OPS_RMS_NORM_H_
#define RLK_OPS_RMS_NORM_H_

#include "../rlk.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rlk_rms_norm_args {
    int64_t rows, cols;
    rlk_dtype dtype;
    float eps;
    int round_before_weight;
    const void *x;
    int64_t ldx;
    const void *weight; /* [cols] or NULL */
    void *y;            /* forward output */
    int64_t ldy;
    float *rstd;        /* [rows]: forward output, backward input */
    const void *dy;     /* backward input */
    int64_t lddy;
    void *dx;           /* backward output */
    int64_t lddx;
    void *dweight;      /* backward output [cols], or NULL */
    void *workspace;
} rlk_rms_norm_args;

typedef int rlk_rms_norm_fwd_fn(const rlk_rms_norm_args *args, rlk_context *ctx);
typedef int rlk_rms_norm_bwd_fn(const rlk_rms_norm_args *args, rlk_context *ctx);

#ifdef __cplusplus
}
#endif
#endif /* RLK_OPS_RMS_NORM_H_ */
