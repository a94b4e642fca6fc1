/* ops/convert.h: the contract of an elementwise dtype conversion of a matrix.
 *
 *   out[r, c] = round_out(in[r, c])      r < rows, c < cols; row strides ld_in / ld_out (elements)
 *
 * in_dtype and out_dtype are fp32, bf16 or fp16; rounding to nearest even, NaN kept. Used where a
 * kernel sequence accumulates in fp32 and stores the result in the inputs' dtype (the linear_logp
 * backward's dH). Elementwise, so trivially batch-invariant.
 */
#ifndef RLK_OPS_CONVERT_H_
#define RLK_OPS_CONVERT_H_

#include "../rlk.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rlk_convert_args {
    int64_t rows, cols;
    rlk_dtype in_dtype, out_dtype;
    const void *in;
    int64_t ld_in;
    void *out;
    int64_t ld_out;
} rlk_convert_args;

typedef int rlk_convert_fn(const rlk_convert_args *args, rlk_context *ctx);

#ifdef __cplusplus
}
#endif
#endif /* RLK_OPS_CONVERT_H_ */
