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

int rlk_row_sum_cpu(const rlk_row_sum_args *args, rlk_context *ctx)
{
    const rlk_dtype in = args->in_dtype, out = args->out_dtype;
    if (!(out == in || (out == RLK_F32 && in != RLK_F64))) return RLK_UNSUPPORTED;
    ctx->kernel = "row_sum_cpu";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only || args->rows <= 0) return RLK_OK;
    const int is_f64 = in == RLK_F64;
    int out_of_memory = 0;

#pragma omp parallel num_threads(rlk_row_threads(ctx->num_threads, args->rows))
    {
        float *x = is_f64 ? NULL : rlk_row_buffer(args->cols, sizeof(float));
        if (!is_f64 && !x) {
#pragma omp atomic write
            out_of_memory = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < args->rows; r++) {
            if (is_f64) {
                const double s = rlk_row_sum16_f64((const double *)args->x + r * args->ldx, args->cols);
                ((double *)args->y)[r] = args->mean ? s / (double)args->cols : s;
            } else if (x) {
                rlk_load_row_f32(x, 1, args->x, in, r * args->ldx, args->cols);
                const float s = rlk_row_sum16_f32(x, args->cols);
                rlk_store_f32(args->y, out, r, args->mean ? s / (float)args->cols : s);
            }
        }
        free(x);
    }
    return out_of_memory ? RLK_CPU_OUT_OF_MEMORY : RLK_OK;
}
