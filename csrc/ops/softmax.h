/* ops/softmax.h: the contract of the batch-invariant softmax / log_softmax over the last dimension.
 *
 * Per row of `cols` elements x (in_dtype, computed in fp32; fp64 on the CPU for fp64):
 *   m = max_j x_j,  z = sum_j exp(x_j - m)      (the sum in a fixed order that depends on cols only)
 *   softmax:      y_j = round_out(exp(x_j - m) / z)
 *   log_softmax:  y_j = round_out(x_j - m - log(z))
 * A row of all -inf gives NaN (as torch). out_dtype is in_dtype, or fp32 for 16-bit inputs
 * (torch's half_to_float).
 * Backward (entry softmax_bwd) from the forward's output y (out_dtype) and dy (out_dtype), writing
 * dx in in_dtype, row sums as above:
 *   softmax:      dx_j = y_j * (dy_j - sum_k dy_k y_k)
 *   log_softmax:  dx_j = dy_j - exp(y_j) * sum_k dy_k
 * Row strides in elements; the last dimension is contiguous.
 *
 * Details fixed by the implementations (cpu/softmax.c, cuda/sm80/softmax.cu):
 *   - dtypes: fp32 -> fp32; bf16 / fp16 -> the same or fp32; fp64 -> fp64 (CPU only); anything else
 *     is RLK_UNSUPPORTED. exp / log are expf / logf (exp / log for fp64), the division an IEEE
 *     division (no fast-math approximations).
 *   - the max skips NaN entries (fmaxf / comparisons), but a NaN entry makes z, hence the whole row,
 *     NaN; a +inf entry gives inf - inf = NaN for the row; a row of all -inf gives NaN: all as torch.
 *   - the sm80 loop plan (rows longer than 2048 16-byte chunks) computes (m, z) online: per thread
 *     z is kept relative to its running max and rescaled by exp(old - new) when the max grows, the
 *     threads' (m, z) then merged in a fixed order. Its z may differ in the last bits from a
 *     max-then-sum over the same row, but it is what every row of that length gets.
 *   - the backward's sum: softmax sum_k round(dy_k * y_k) (product rounded, then added);
 *     log_softmax sum_k dy_k.
 *   - fixed orders depend on cols and the dtypes (the sm80 chunk is 16 bytes of the input).
 */
#ifndef RLK_OPS_SOFTMAX_H_
#define RLK_OPS_SOFTMAX_H_

#include "../rlk.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rlk_softmax_args {
    int64_t rows, cols;
    rlk_dtype in_dtype, out_dtype;
    int log; /* 0: softmax, 1: log_softmax */
    const void *x; /* forward input */
    int64_t ldx;
    void *y; /* forward output, backward input */
    int64_t ldy;
    const void *dy; /* backward input (out_dtype) */
    int64_t lddy;
    void *dx; /* backward output (in_dtype) */
    int64_t lddx;
} rlk_softmax_args;

typedef int rlk_softmax_fwd_fn(const rlk_softmax_args *args, rlk_context *ctx);
typedef int rlk_softmax_bwd_fn(const rlk_softmax_args *args, rlk_context *ctx);

#ifdef __cplusplus
}
#endif
#endif /* RLK_OPS_SOFTMAX_H_ */
