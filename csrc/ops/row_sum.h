/* ops/row_sum.h: the contract of the batch-invariant sum / mean over the last dimension.
 *
 * Per row of `cols` elements x (in_dtype): y = round_out(s / divisor) with s = sum_j x_j in fp32
 * (fp64 for fp64 inputs), in a fixed order that depends on cols only; divisor = 1 for sum, cols
 * for mean (torch divides the sum). out_dtype: in_dtype or fp32 (torch's dtype= argument).
 * cols == 0 gives 0 for sum, NaN for mean (0 / 0, as torch).
 * Row stride in elements; the last dimension is contiguous; y is [rows], stride 1.
 *
 * Details fixed by the implementations (cpu/row_sum.c, cuda/sm80/row_sum.cu):
 *   - mean: s / (float)cols, one IEEE division (torch's CUDA mean multiplies by 1 / cols, so the
 *     last bit may differ); fp64: s / (double)cols.
 *   - dtypes: fp32 -> fp32; bf16 / fp16 -> the same or fp32; fp64 -> fp64 only (CPU); anything else
 *     is RLK_UNSUPPORTED.
 *   - sums start from +0 (a row of -0 sums to +0, as torch); 16-bit outputs overflow to inf as
 *     rounding says (fp16 sum of 151936 ones is inf, as torch's).
 *   - the fixed order depends on cols and the dtype (the sm80 chunk is 16 bytes of the input).
 */
#ifndef RLK_OPS_ROW_SUM_H_
#define RLK_OPS_ROW_SUM_H_

#include "../rlk.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rlk_row_sum_args {
    int64_t rows, cols;
    rlk_dtype in_dtype, out_dtype;
    int mean;
    const void *x;
    int64_t ldx;
    void *y;
} rlk_row_sum_args;

typedef int rlk_row_sum_fn(const rlk_row_sum_args *args, rlk_context *ctx);

#ifdef __cplusplus
}
#endif
#endif /* RLK_OPS_ROW_SUM_H_ */
