/* cpu/row_sum.c: reference CPU sum / mean over the last dimension (contract: csrc/ops/row_sum.h).
 *
 * Per row: s = sum_j x_j in fp32 (fp64 for fp64 inputs), y = round_out(s / divisor) with divisor 1
 * (sum) or cols (mean, a division as the contract says). cols == 0: s = +0, so a sum is 0 and a
 * mean 0 / 0 = NaN.
 *
 * Plan: OpenMP threads (ctx->num_threads) split the rows (schedule static); a row is converted to
 * an fp32 buffer and summed by rlk_row_sum16_f32 (16 interleaved partial sums over j, then a fixed
 * tree), whose order depends on cols only.
 *
 * Why batch-invariant: a row's sum uses that row alone in an order fixed by cols; threads only
 * decide which rows they take.
 *
 * Build: gcc -O3 -std=c11 -fopenmp -ffp-contract=off -fPIC -shared -I csrc csrc/cpu/rms_norm.c \
 *            csrc/cpu/softmax.c csrc/cpu/row_sum.c -o /tmp/librowops.so
 * Test:  python .scratch/rowops_cpu_harness.py
 */
#include <math.h>
#include <stdlib.h>

#include "cpu/common.h"
#include "cpu/row_reduce.h"
#include "ops/row_sum.h"

static void sum_row(const void *op, int64_t r, void *const *buffers)
{
    const rlk_row_sum_args *a = op;
    if (a->in_dtype == RLK_F64) {
        const double s = rlk_row_sum16_f64((const double *)a->x + r * a->ldx, a->cols);
        ((double *)a->y)[r] = a->mean ? s / (double)a->cols : s;
    } else {
        float *x = buffers[0];
        rlk_load_row_f32(x, 1, a->x, a->in_dtype, r * a->ldx, a->cols);
        const float s = rlk_row_sum16_f32(x, a->cols);
        rlk_store_f32(a->y, a->out_dtype, r, a->mean ? s / (float)a->cols : s);
    }
}

int rlk_row_sum_cpu(const rlk_row_sum_args *args, rlk_context *ctx)
{
    const rlk_dtype in = args->in_dtype, out = args->out_dtype;
    if (!(out == in || (out == RLK_F32 && in != RLK_F64))) return RLK_UNSUPPORTED;
    ctx->kernel = "row_sum_cpu";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only || args->rows <= 0) return RLK_OK;
    /* fp64 rows are summed in place; the others are converted into a buffer first */
    return rlk_parallel_items(ctx->num_threads, args->rows, in == RLK_F64 ? 0 : 1, args->cols, sizeof(float),
                              sum_row, args);
}
