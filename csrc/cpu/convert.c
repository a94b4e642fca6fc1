/* convert.c: elementwise dtype conversion of a matrix on the CPU (contract: csrc/ops/convert.h).
 *
 * Plan: OpenMP over rows; each row goes through fp32 (exact for every supported input dtype) and is
 * rounded once by the helpers of common.h. Elementwise: no order to choose.
 * Build/test: part of the extension (pip install --no-build-isolation -e .); exercised by the
 * linear_logp backward tests (tests/test_linear_logp.py).
 */
#include <stdlib.h>

#include "../ops/convert.h"
#include "common.h"

int rlk_convert_cpu(const rlk_convert_args *args, rlk_context *ctx)
{
    if (args->in_dtype == RLK_F64 || args->out_dtype == RLK_F64) return RLK_UNSUPPORTED;
    ctx->kernel = "convert_cpu";
    if (ctx->plan_only) return RLK_OK;
    int out_of_memory = 0;
#pragma omp parallel num_threads(ctx->num_threads) reduction(| : out_of_memory)
    {
        float *row = malloc(sizeof(float) * (size_t)(args->cols > 0 ? args->cols : 1));
        if (!row) out_of_memory = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < args->rows; r++) {
            if (!row) continue;
            rlk_load_row_f32(row, 1, args->in, args->in_dtype, r * args->ld_in, args->cols);
            rlk_store_row_f32(args->out, args->out_dtype, r * args->ld_out, row, args->cols);
        }
        free(row);
    }
    return out_of_memory ? RLK_CPU_OUT_OF_MEMORY : RLK_OK;
}
