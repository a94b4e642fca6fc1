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
 *
 * Details fixed by the implementations (cpu/rms_norm.c, cuda/sm80/rms_norm.cu):
 *   - rstd = 1 / sqrt(ss / cols + eps) with a correctly rounded sqrt and division (no rsqrt), ss
 *     the fp32 sum of x_j * x_j; cols == 0 gives rstd = NaN (0 / 0), as torch's mean of nothing.
 *   - forward: rstd may be NULL (not written). backward: rstd is required and read (the forward's
 *     bits, so h is the forward's h); except fp64 on the CPU, which recomputes rstd in fp64 from x
 *     and does not read it (the saved fp32 value would cost gradcheck its precision).
 *   - dweight without a weight: computed all the same (sum_r dy * h', the gradient of a unit
 *     weight); NULL dweight: nothing of it is computed and no workspace is planned.
 *   - dweight order: blocks of 16 rows (both backends), each block's partial summed in increasing
 *     r from +0; CPU: the partials added in increasing block order; sm80: the blocks cut into 16
 *     contiguous ranges, each summed in increasing order, the 16 range sums added in increasing
 *     order. rows == 0 gives dweight = 0. The order depends on rows (it must), never on threads,
 *     streams or timing.
 *   - workspace: planned as ceil(rows / 16) * cols * 4 bytes (8 for fp64) when dweight != NULL,
 *     else 0. sm80 needs it (cudaErrorInvalidValue without it); the CPU uses it when given and
 *     allocates the partials itself when args->workspace is NULL (same bits).
 *   - fixed orders depend on cols and the dtype (the sm80 chunk is 16 bytes: 8 or 4 elements).
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
    double eps;  /* added in fp32 (so rounded to fp32, as torch does) for fp32 / bf16 / fp16, in fp64 for fp64 */
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
