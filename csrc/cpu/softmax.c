/* cpu/softmax.c: reference CPU softmax / log_softmax over the last dimension, forward and backward
 * (contract: csrc/ops/softmax.h).
 *
 * Forward, per row (fp32 for fp32 / bf16 / fp16 inputs, fp64 for fp64):
 *   m = max_j x_j (NaNs skipped by the comparison; they reach the result through the sum),
 *   e_j = exp(x_j - m) (libm expf / exp), z = sum_j e_j,
 *   softmax y_j = e_j / z, log_softmax y_j = (x_j - m) - log(z), rounded once to out_dtype.
 *   A row of all -inf has m = -inf, x_j - m = NaN, so y is NaN (as torch).
 * Backward, per row, from y and dy (out_dtype) to dx (in_dtype):
 *   softmax:     s = sum_k dy_k * y_k (each product rounded, then summed), dx_j = y_j * (dy_j - s)
 *   log_softmax: s = sum_k dy_k,  dx_j = dy_j - exp(y_j) * s
 *
 * Plan: OpenMP threads (ctx->num_threads) split the rows (schedule static); each thread converts a
 * row into fp32 buffers, forms the terms of a sum in a buffer, and sums them with
 * rlk_row_sum16_f32 (16 interleaved partial sums, a fixed tree: the order depends on cols only).
 *
 * Why batch-invariant: a row's arithmetic uses that row alone, in an order fixed by cols; threads
 * only decide which rows they take. -ffp-contract=off: no product is silently fused into an add.
 *
 * Build: gcc -O3 -std=c11 -fopenmp -ffp-contract=off -fPIC -shared -I csrc csrc/cpu/rms_norm.c \
 *            csrc/cpu/softmax.c csrc/cpu/row_sum.c -o /tmp/librowops.so
 * Test:  python .scratch/rowops_cpu_harness.py (accuracy against fp64 torch, torch's edge-case
 *        semantics, bitwise invariance over row counts, positions, 1 vs 2 threads, repeats).
 */
#include <math.h>
#include <stdlib.h>

#include "cpu/common.h"
#include "cpu/row_reduce.h"
#include "ops/softmax.h"

static int valid_dtypes(const rlk_softmax_args *a)
{
    if (a->in_dtype == RLK_F64) return a->out_dtype == RLK_F64;
    if (a->in_dtype == RLK_F32) return a->out_dtype == RLK_F32;
    if (a->in_dtype == RLK_BF16 || a->in_dtype == RLK_F16)
        return a->out_dtype == a->in_dtype || a->out_dtype == RLK_F32;
    return 0;
}

/* ---------------------------------------- forward ------------------------------------------- */

static void fwd_row_f32(const rlk_softmax_args *a, int64_t r, float *x, float *e)
{
    const int64_t n = a->cols;
    rlk_load_row_f32(x, 1, a->x, a->in_dtype, r * a->ldx, n);
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) m = x[j] > m ? x[j] : m;
    for (int64_t j = 0; j < n; j++) e[j] = expf(x[j] - m);
    const float z = rlk_row_sum16_f32(e, n);
    if (a->log) {
        const float log_z = logf(z);
        for (int64_t j = 0; j < n; j++) e[j] = (x[j] - m) - log_z;
    } else {
        for (int64_t j = 0; j < n; j++) e[j] = e[j] / z;
    }
    rlk_store_row_f32(a->y, a->out_dtype, r * a->ldy, e, n);
}

static void fwd_row_f64(const rlk_softmax_args *a, int64_t r, double *e)
{
    const int64_t n = a->cols;
    const double *x = (const double *)a->x + r * a->ldx;
    double *y = (double *)a->y + r * a->ldy;
    double m = -INFINITY;
    for (int64_t j = 0; j < n; j++) m = x[j] > m ? x[j] : m;
    for (int64_t j = 0; j < n; j++) e[j] = exp(x[j] - m);
    const double z = rlk_row_sum16_f64(e, n);
    if (a->log) {
        const double log_z = log(z);
        for (int64_t j = 0; j < n; j++) y[j] = (x[j] - m) - log_z;
    } else {
        for (int64_t j = 0; j < n; j++) y[j] = e[j] / z;
    }
}

static void fwd_row(const void *op, int64_t r, void *const *buffers)
{
    const rlk_softmax_args *a = op;
    if (a->in_dtype == RLK_F64) fwd_row_f64(a, r, buffers[1]);
    else fwd_row_f32(a, r, buffers[0], buffers[1]);
}

int rlk_softmax_fwd_cpu(const rlk_softmax_args *args, rlk_context *ctx)
{
    if (!valid_dtypes(args)) return RLK_UNSUPPORTED;
    ctx->kernel = "softmax_fwd_cpu";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only || args->rows <= 0 || args->cols <= 0) return RLK_OK;
    const size_t elem = args->in_dtype == RLK_F64 ? sizeof(double) : sizeof(float);
    return rlk_parallel_items(ctx->num_threads, args->rows, 2, args->cols, elem, fwd_row, args);
}

/* ---------------------------------------- backward ------------------------------------------ */

static void bwd_row_f32(const rlk_softmax_args *a, int64_t r, float *y, float *dy, float *t)
{
    const int64_t n = a->cols;
    rlk_load_row_f32(y, 1, a->y, a->out_dtype, r * a->ldy, n);
    rlk_load_row_f32(dy, 1, a->dy, a->out_dtype, r * a->lddy, n);
    if (a->log) {
        const float s = rlk_row_sum16_f32(dy, n);
        for (int64_t j = 0; j < n; j++) t[j] = dy[j] - expf(y[j]) * s;
    } else {
        for (int64_t j = 0; j < n; j++) t[j] = dy[j] * y[j];
        const float s = rlk_row_sum16_f32(t, n);
        for (int64_t j = 0; j < n; j++) t[j] = y[j] * (dy[j] - s);
    }
    rlk_store_row_f32(a->dx, a->in_dtype, r * a->lddx, t, n);
}

static void bwd_row_f64(const rlk_softmax_args *a, int64_t r, double *t)
{
    const int64_t n = a->cols;
    const double *y = (const double *)a->y + r * a->ldy, *dy = (const double *)a->dy + r * a->lddy;
    double *dx = (double *)a->dx + r * a->lddx;
    if (a->log) {
        const double s = rlk_row_sum16_f64(dy, n);
        for (int64_t j = 0; j < n; j++) dx[j] = dy[j] - exp(y[j]) * s;
    } else {
        for (int64_t j = 0; j < n; j++) t[j] = dy[j] * y[j];
        const double s = rlk_row_sum16_f64(t, n);
        for (int64_t j = 0; j < n; j++) dx[j] = y[j] * (dy[j] - s);
    }
}

static void bwd_row(const void *op, int64_t r, void *const *buffers)
{
    const rlk_softmax_args *a = op;
    if (a->in_dtype == RLK_F64) bwd_row_f64(a, r, buffers[2]);
    else bwd_row_f32(a, r, buffers[0], buffers[1], buffers[2]);
}

int rlk_softmax_bwd_cpu(const rlk_softmax_args *args, rlk_context *ctx)
{
    if (!valid_dtypes(args)) return RLK_UNSUPPORTED;
    ctx->kernel = "softmax_bwd_cpu";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only || args->rows <= 0 || args->cols <= 0) return RLK_OK;
    const size_t elem = args->in_dtype == RLK_F64 ? sizeof(double) : sizeof(float);
    return rlk_parallel_items(ctx->num_threads, args->rows, 3, args->cols, elem, bwd_row, args);
}
