/* cpu/rms_norm.c: reference CPU RMSNorm over the last dimension, forward and backward
 * (contract: csrc/ops/rms_norm.h).
 *
 * Forward, per row (fp32 for fp32 / bf16 / fp16, fp64 for fp64):
 *   ss = sum_j x_j * x_j,  rstd = 1 / sqrt(ss / cols + eps)   (correctly rounded sqrt and divide)
 *   h_j = x_j * rstd;  y_j = round(h_j * w_j), or round(w_j * round(h_j)) with
 *   round_before_weight, or round(h_j) without a weight; rstd[r] = rstd (fp32) when rstd != NULL.
 * Backward, per row: g_j = dy_j * w_j (dy_j without a weight), dot = sum_j g_j * x_j,
 *   c = rstd * rstd * rstd * (dot / cols),  dx_j = rstd * g_j - x_j * c;
 *   dweight_j = sum over row blocks b = 0, 1, ... (increasing) of P[b][j], where P[b][j] sums
 *   dy_rj * h'_rj over the block's RMS_ROW_BLOCK rows in increasing r from +0, h' = round(h) with
 *   round_before_weight else h, h = x * rstd (the saved rstd, as in the forward).
 *   fp64: rstd is recomputed in fp64 from x (the fp32 rstd the forward saved would cost gradcheck
 *   its precision); the rstd argument is not read.
 *
 * Plan: forward: OpenMP threads split the rows; each row is converted into an fp32 buffer, the
 * squares formed in a second buffer and summed by rlk_row_sum16_f32 (16 interleaved partial sums,
 * fixed tree: the order depends on cols only). Backward: threads take blocks of RMS_ROW_BLOCK
 * rows (dx of each row as in the forward plan, the block's dweight partial P[b] accumulated row by
 * row); then threads split the columns and add the partials of each column in increasing b.
 * workspace: the partials P (ceil(rows / RMS_ROW_BLOCK) x cols fp32, fp64 for fp64) when dweight
 * is wanted; planned as ctx->workspace_bytes, taken from args->workspace, or allocated here when
 * that is NULL (same bits either way).
 *
 * Why batch-invariant: y, rstd and dx of a row use that row (and the weight) alone, in orders that
 * depend on cols only; threads only decide which rows they take. dweight is a sum over all rows;
 * its order depends on rows only (fixed blocks, increasing order), never on the thread count, so
 * it is bitwise equal run to run.
 *
 * Build: gcc -O3 -std=c11 -fopenmp -ffp-contract=off -fPIC -shared -I csrc csrc/cpu/rms_norm.c \
 *            csrc/cpu/softmax.c csrc/cpu/row_sum.c -o /tmp/librowops.so
 * Test:  python .scratch/rowops_cpu_harness.py
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/common.h"
#include "cpu/row_reduce.h"
#include "ops/rms_norm.h"

enum { RMS_ROW_BLOCK = 16 }; /* rows per dweight partial */

static int valid_dtype(rlk_dtype dtype)
{
    return dtype == RLK_F32 || dtype == RLK_BF16 || dtype == RLK_F16 || dtype == RLK_F64;
}

/* ---------------------------------------- forward ------------------------------------------- */

static void fwd_row_f32(const rlk_rms_norm_args *a, int64_t r, float *x, float *t, const float *w)
{
    const int64_t n = a->cols;
    rlk_load_row_f32(x, 1, a->x, a->dtype, r * a->ldx, n);
    for (int64_t j = 0; j < n; j++) t[j] = x[j] * x[j];
    const float ss = rlk_row_sum16_f32(t, n);
    const float rstd = 1.0f / sqrtf(ss / (float)n + (float)a->eps);
    if (a->rstd) a->rstd[r] = rstd;
    if (!w) {
        for (int64_t j = 0; j < n; j++) t[j] = x[j] * rstd;
    } else if (a->round_before_weight) {
        for (int64_t j = 0; j < n; j++) t[j] = w[j] * rlk_round_f32(a->dtype, x[j] * rstd);
    } else {
        for (int64_t j = 0; j < n; j++) t[j] = (x[j] * rstd) * w[j];
    }
    rlk_store_row_f32(a->y, a->dtype, r * a->ldy, t, n);
}

static double rstd_f64(const double *x, int64_t n, double eps, double *t)
{
    for (int64_t j = 0; j < n; j++) t[j] = x[j] * x[j];
    return 1.0 / sqrt(rlk_row_sum16_f64(t, n) / (double)n + eps);
}

static void fwd_row_f64(const rlk_rms_norm_args *a, int64_t r, double *t)
{
    const int64_t n = a->cols;
    const double *x = (const double *)a->x + r * a->ldx, *w = (const double *)a->weight;
    double *y = (double *)a->y + r * a->ldy;
    const double rstd = rstd_f64(x, n, a->eps, t);
    if (a->rstd) a->rstd[r] = (float)rstd;
    for (int64_t j = 0; j < n; j++) {
        const double h = x[j] * rstd;
        y[j] = !w ? h : a->round_before_weight ? w[j] * h : h * w[j];
    }
}

/* What every thread reads: the arguments, the weight in fp32 (NULL: none, or fp64), and the
 * backward's dweight partials (NULL: not wanted). */
typedef struct rms_op {
    const rlk_rms_norm_args *a;
    const float *w;
    void *partials;
} rms_op;

static void fwd_row(const void *op, int64_t r, void *const *buffers)
{
    const rms_op *o = op;
    if (o->a->dtype == RLK_F64) fwd_row_f64(o->a, r, buffers[1]);
    else fwd_row_f32(o->a, r, buffers[0], buffers[1], o->w);
}

int rlk_rms_norm_fwd_cpu(const rlk_rms_norm_args *args, rlk_context *ctx)
{
    if (!valid_dtype(args->dtype)) return RLK_UNSUPPORTED;
    ctx->kernel = "rms_norm_fwd_cpu";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only || args->rows <= 0) return RLK_OK;
    const int is_f64 = args->dtype == RLK_F64;
    const size_t elem = is_f64 ? sizeof(double) : sizeof(float);
    float *w = NULL; /* the weight in fp32, shared by all threads */
    if (args->weight && !is_f64) {
        w = rlk_row_buffer(args->cols, sizeof(float));
        if (!w) return RLK_CPU_OUT_OF_MEMORY;
        rlk_load_row_f32(w, 1, args->weight, args->dtype, 0, args->cols);
    }
    const rms_op op = {args, w, NULL};
    const int status = rlk_parallel_items(ctx->num_threads, args->rows, 2, args->cols, elem, fwd_row, &op);
    free(w);
    return status;
}

/* ---------------------------------------- backward ------------------------------------------ */

typedef struct bwd_buffers {
    void *x, *dy, *g, *t;
} bwd_buffers;  /* a thread's buffers[0..3] */

/* dx of row r; adds dy * h' of the row to part (cols values) when part != NULL. */
static void bwd_row_f32(const rlk_rms_norm_args *a, int64_t r, const bwd_buffers *b, const float *w,
                        float *part)
{
    const int64_t n = a->cols;
    float *x = b->x, *dy = b->dy, *g = b->g, *t = b->t;
    rlk_load_row_f32(x, 1, a->x, a->dtype, r * a->ldx, n);
    rlk_load_row_f32(dy, 1, a->dy, a->dtype, r * a->lddy, n);
    const float rstd = a->rstd[r];
    if (w) {
        for (int64_t j = 0; j < n; j++) g[j] = dy[j] * w[j];
    } else {
        memcpy(g, dy, (size_t)n * sizeof(float));
    }
    for (int64_t j = 0; j < n; j++) t[j] = g[j] * x[j];
    const float dot = rlk_row_sum16_f32(t, n);
    const float c = rstd * rstd * rstd * (dot / (float)n);
    for (int64_t j = 0; j < n; j++) t[j] = rstd * g[j] - x[j] * c;
    rlk_store_row_f32(a->dx, a->dtype, r * a->lddx, t, n);
    if (part) {
        if (a->round_before_weight) {
            for (int64_t j = 0; j < n; j++) part[j] += dy[j] * rlk_round_f32(a->dtype, x[j] * rstd);
        } else {
            for (int64_t j = 0; j < n; j++) part[j] += dy[j] * (x[j] * rstd);
        }
    }
}

static void bwd_row_f64(const rlk_rms_norm_args *a, int64_t r, const bwd_buffers *b, double *part)
{
    const int64_t n = a->cols;
    const double *x = (const double *)a->x + r * a->ldx, *dy = (const double *)a->dy + r * a->lddy;
    const double *w = (const double *)a->weight;
    double *dx = (double *)a->dx + r * a->lddx, *g = b->g, *t = b->t;
    const double rstd = rstd_f64(x, n, a->eps, t);
    for (int64_t j = 0; j < n; j++) g[j] = w ? dy[j] * w[j] : dy[j];
    for (int64_t j = 0; j < n; j++) t[j] = g[j] * x[j];
    const double dot = rlk_row_sum16_f64(t, n);
    const double c = rstd * rstd * rstd * (dot / (double)n);
    for (int64_t j = 0; j < n; j++) dx[j] = rstd * g[j] - x[j] * c;
    if (part)
        for (int64_t j = 0; j < n; j++) part[j] += dy[j] * (x[j] * rstd);
}

/* dx of the rows of block blk, and the block's dweight partial when wanted. */
static void bwd_block(const void *op, int64_t blk, void *const *buffers)
{
    const rms_op *o = op;
    const rlk_rms_norm_args *a = o->a;
    const size_t elem = a->dtype == RLK_F64 ? sizeof(double) : sizeof(float);
    const bwd_buffers b = {buffers[0], buffers[1], buffers[2], buffers[3]};
    void *part = o->partials ? (char *)o->partials + blk * a->cols * (int64_t)elem : NULL;
    if (part) memset(part, 0, (size_t)a->cols * elem); /* +0: the sums start from +0 */
    const int64_t r1 = rlk_min64(a->rows, (blk + 1) * RMS_ROW_BLOCK);
    for (int64_t r = blk * RMS_ROW_BLOCK; r < r1; r++) {
        if (a->dtype == RLK_F64) bwd_row_f64(a, r, &b, part);
        else bwd_row_f32(a, r, &b, o->w, part);
    }
}

static int64_t row_blocks(int64_t rows) { return rows > 0 ? (rows + RMS_ROW_BLOCK - 1) / RMS_ROW_BLOCK : 0; }

int rlk_rms_norm_bwd_cpu(const rlk_rms_norm_args *args, rlk_context *ctx)
{
    if (!valid_dtype(args->dtype)) return RLK_UNSUPPORTED;
    const int is_f64 = args->dtype == RLK_F64;
    const size_t elem = is_f64 ? sizeof(double) : sizeof(float);
    const int64_t cols = args->cols, blocks = row_blocks(args->rows);
    ctx->kernel = "rms_norm_bwd_cpu";
    ctx->workspace_bytes = args->dweight ? blocks * cols * (int64_t)elem : 0;
    if (ctx->plan_only) return RLK_OK;

    void *partials = NULL, *owned = NULL;
    if (args->dweight && blocks > 0 && cols > 0) {
        partials = args->workspace;
        if (!partials) partials = owned = rlk_row_buffer(blocks * cols, elem);
        if (!partials) return RLK_CPU_OUT_OF_MEMORY;
    }
    float *w = NULL;
    if (args->weight && !is_f64 && blocks > 0) {
        w = rlk_row_buffer(cols, sizeof(float));
        if (!w) {
            free(owned);
            return RLK_CPU_OUT_OF_MEMORY;
        }
        rlk_load_row_f32(w, 1, args->weight, args->dtype, 0, cols);
    }
    const rms_op op = {args, w, partials};
    const int status = rlk_parallel_items(ctx->num_threads, blocks, 4, cols, elem, bwd_block, &op);

    if (args->dweight && status == RLK_OK && cols > 0) {
        /* dweight_j = sum_b P[b][j], b increasing, from +0 (rows == 0: 0); threads take blocks of
         * FINAL_COLS columns and walk the partials row by row (cache friendly, same order). */
        enum { FINAL_COLS = 256 };
        const int64_t col_blocks = (cols + FINAL_COLS - 1) / FINAL_COLS;
#pragma omp parallel for num_threads(rlk_row_threads(ctx->num_threads, col_blocks)) schedule(static)
        for (int64_t cb = 0; cb < col_blocks; cb++) {
            const int64_t j0 = cb * FINAL_COLS, nj = rlk_min64(FINAL_COLS, cols - j0);
            if (is_f64) {
                double s[FINAL_COLS] = {0};
                for (int64_t blk = 0; blk < blocks; blk++) {
                    const double *p = (const double *)partials + blk * cols + j0;
                    for (int64_t j = 0; j < nj; j++) s[j] += p[j];
                }
                memcpy((double *)args->dweight + j0, s, (size_t)nj * sizeof(double));
            } else {
                float s[FINAL_COLS] = {0};
                for (int64_t blk = 0; blk < blocks; blk++) {
                    const float *p = (const float *)partials + blk * cols + j0;
                    for (int64_t j = 0; j < nj; j++) s[j] += p[j];
                }
                rlk_store_row_f32(args->dweight, args->dtype, j0, s, nj);
            }
        }
    }
    free(w);
    free(owned);
    return status;
}
