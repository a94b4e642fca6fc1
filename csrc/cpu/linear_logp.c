/* linear_logp.c: reference CPU fused LM-head log-probs (forward) and the backward's elementwise dz
 * (contract: csrc/ops/linear_logp.h).
 *
 * Forward, per row n: z_v = hidden[n] . weight[v] + bias[v], s_v = z_v * inv_temperature,
 *   lse = log sum_v exp(s_v),  logp = s_target - lse,  entropy = lse - sum_v p_v s_v.
 * Backward (linear_logp_dz): d_z of a vocabulary chunk from its logits and the saved lse / entropy,
 * elementwise (the row blocks and chunks are walked by csrc/bind/linear_logp.c).
 *
 * Tile plan: OpenMP threads take blocks of up to ROW_BLOCK rows. A row block walks the vocabulary
 * in blocks of VOCAB_BLOCK entries in increasing order; the logits of a rows x vocab block come from
 * a single-threaded rlk_gemm_cpu call (B = weight^T), which reuses every packed weight panel for all
 * rows of the block from cache. Each row then folds the block into its running softmax state
 * (max, sum exp(s - max) - 1, sum exp(s - max) * (max - s)), all in fp32. Both sums have
 * non-negative terms, so entropy = log1p(rest) + gap_sum / (1 + rest) has no cancellation and
 * stays accurate (relative) for confident rows with tiny entropy.
 *
 * Why batch-invariant: z_v follows the GEMM's rule (fma over d = 0..D-1 from 0), which does not
 * depend on the block a row lands in; the vocabulary blocks have a fixed size and are folded in
 * increasing order, each in v order, so the reduction order depends on V only; rows never interact
 * and threads only split rows. The logits also match a GEMM of the same operands with a fp32 bias
 * bit for bit, so a backward that recomputes them sees exactly the forward's values.
 *
 * Build: gcc -O3 -std=c11 -fopenmp -ffp-contract=off -fPIC -shared -I csrc csrc/cpu/gemm.c \
 *            csrc/cpu/linear_logp.c
 * Test:  pip install --no-build-isolation -e . && pytest tests/test_linear_logp.py
 */
#include <math.h>
#include <stdlib.h>

#include "../ops/gemm.h"
#include "../ops/linear_logp.h"
#include "common.h"

int rlk_gemm_cpu(const rlk_gemm_args *args, rlk_context *ctx); /* cpu/gemm.c */

enum {
    ROW_BLOCK = 96,     /* the GEMM's macro tile height: one weight pass per 96 rows */
    VOCAB_BLOCK = 1024, /* fixed, so the softmax folding order depends on V only */
};

/* Running softmax of one row, relative to its max (first arg max a): sum_exp_rest = sum_{v != a}
 * exp(s_v - max), so sum_exp = 1 + sum_exp_rest keeps full precision when one entry dominates
 * (entropy then needs log1p of a tiny value); sum_exp_gap = sum_v exp(s_v - max) * (max - s_v).
 * Entries with s = -inf have p = 0 and are skipped (their gap term would be 0 * inf). */
typedef struct softmax_state {
    float max, sum_exp_rest, sum_exp_gap, s_target;
    int saw_nan;
} softmax_state;

/* Folds s[0..n) into the state: the block is reduced in v order, then the side with the smaller
 * max is rescaled onto the larger one (moving the reference down by shift multiplies its terms by
 * exp(-shift) and adds shift to each gap) and added; every sum has non-negative terms only. */
static void fold_block(softmax_state *st, const float *s, int64_t n)
{
    float block_max = -INFINITY;
    int64_t arg_max = -1;
    for (int64_t j = 0; j < n; j++) {
        if (s[j] > block_max) block_max = s[j], arg_max = j;
        else if (s[j] != s[j]) st->saw_nan = 1;
    }
    if (arg_max < 0) return;
    float rest = 0.0f, gap_sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        if (j == arg_max || s[j] == -INFINITY) continue;
        const float gap = block_max - s[j];
        const float e = expf(-gap);
        rest += e;
        gap_sum += e * gap;
    }
    if (st->max == -INFINITY) {
        st->max = block_max, st->sum_exp_rest = rest, st->sum_exp_gap = gap_sum;
    } else if (block_max > st->max) {
        const float shift = block_max - st->max, scale = expf(-shift);
        st->sum_exp_gap = gap_sum + scale * (st->sum_exp_gap + shift * (1.0f + st->sum_exp_rest));
        st->sum_exp_rest = rest + scale * (1.0f + st->sum_exp_rest);
        st->max = block_max;
    } else {
        const float shift = st->max - block_max, scale = expf(-shift);
        st->sum_exp_gap = st->sum_exp_gap + scale * (gap_sum + shift * (1.0f + rest));
        st->sum_exp_rest = st->sum_exp_rest + scale * (1.0f + rest);
    }
}

/* Rows [row0, row0 + rows) of the forward. work: logits (ROW_BLOCK * VOCAB_BLOCK) then bias
 * (VOCAB_BLOCK) floats. Returns 1 if a row had an out-of-range target, RLK_CPU_OUT_OF_MEMORY if the
 * GEMM's workspace could not be allocated, else 0. */
static int forward_row_block(const rlk_linear_logp_args *args, int64_t row0, int64_t rows, float *work)
{
    float *logits = work, *bias = logits + ROW_BLOCK * VOCAB_BLOCK;
    const size_t elem = rlk_dtype_size(args->dtype);
    softmax_state state[ROW_BLOCK];
    for (int64_t r = 0; r < rows; r++)
        state[r] = (softmax_state){-INFINITY, 0.0f, 0.0f, NAN, 0};

    for (int64_t v0 = 0; v0 < args->V; v0 += VOCAB_BLOCK) {
        const int64_t vb = rlk_min64(VOCAB_BLOCK, args->V - v0);
        const rlk_gemm_args gemm = {
            .M = rows, .N = vb, .K = args->D, .in_dtype = args->dtype, .out_dtype = RLK_F32,
            .a = (const char *)args->hidden + (size_t)(row0 * args->ldh) * elem, .lda = args->ldh,
            .a_trans = 0,
            .b = (const char *)args->weight + (size_t)(v0 * args->ldw) * elem, .ldb = args->ldw,
            .b_trans = 1,
            .c = NULL, .ldc = 0, .out = logits, .ldo = vb, .alpha = 1.0f, .beta = 0.0f,
        };
        rlk_context one_thread = {.num_threads = 1};
        const int status = rlk_gemm_cpu(&gemm, &one_thread);
        if (status != RLK_OK) return status;
        for (int64_t j = 0; j < vb; j++)
            bias[j] = args->bias ? rlk_load_f32(args->bias, args->dtype, v0 + j) : 0.0f;

        for (int64_t r = 0; r < rows; r++) {
            float *s = logits + r * vb;
            for (int64_t j = 0; j < vb; j++) s[j] = (s[j] + bias[j]) * args->inv_temperature;
            fold_block(&state[r], s, vb);
            const int64_t t = args->target[row0 + r] - v0;
            if (t >= 0 && t < vb) state[r].s_target = s[t];
        }
    }

    int bad_target = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = row0 + r, t = args->target[n];
        float logp, entropy, lse;
        if (t == args->ignore_index) {
            logp = entropy = lse = 0.0f;
        } else if (t < 0 || t >= args->V) {
            logp = entropy = lse = NAN;
            bad_target = 1;
        } else if (state[r].saw_nan) {
            logp = entropy = lse = NAN;
        } else if (isinf(state[r].max)) {
            /* every logit -inf (lse -inf), or one +inf (lse +inf): torch's log_softmax and entropy are NaN */
            logp = entropy = NAN;
            lse = state[r].max;
        } else {
            const softmax_state *st = &state[r];
            const float log_sum_exp = log1pf(st->sum_exp_rest);
            lse = st->max + log_sum_exp;
            logp = st->s_target - lse;
            entropy = log_sum_exp + st->sum_exp_gap / (1.0f + st->sum_exp_rest);
        }
        args->logp[n] = logp;
        args->lse[n] = lse;
        if (args->entropy) args->entropy[n] = entropy;
    }
    return bad_target;
}

int rlk_linear_logp_fwd_cpu(const rlk_linear_logp_args *args, rlk_context *ctx)
{
    if (args->dtype == RLK_F64) return RLK_UNSUPPORTED;
    ctx->kernel = "linear_logp_fwd_cpu";
    if (ctx->plan_only) return RLK_OK;
    const int threads = ctx->num_threads > 0 ? ctx->num_threads : 1;
    /* The row block size only balances the threads; a row's result does not depend on it. */
    const int64_t rows_per_thread = (args->N + threads - 1) / threads;
    const int64_t row_block = rlk_min64(ROW_BLOCK, rows_per_thread);
    const int64_t blocks = (args->N + row_block - 1) / row_block;
    const size_t work_bytes = sizeof(float) * (ROW_BLOCK * VOCAB_BLOCK + VOCAB_BLOCK);
    int bad_target = 0, out_of_memory = 0;

#pragma omp parallel num_threads((int)rlk_min64(threads, blocks)) reduction(| : bad_target, out_of_memory)
    {
        float *work = malloc(work_bytes);
        if (!work) out_of_memory = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < blocks; b++) {
            if (!work) continue;
            const int64_t row0 = b * row_block;
            const int status = forward_row_block(args, row0, rlk_min64(row_block, args->N - row0), work);
            if (status == RLK_CPU_OUT_OF_MEMORY) out_of_memory = 1;
            else bad_target |= status;
        }
        free(work);
    }
    if (out_of_memory) return RLK_CPU_OUT_OF_MEMORY;
    return bad_target ? RLK_BAD_INDEX : RLK_OK;
}

int rlk_linear_logp_dz_cpu(const rlk_linear_logp_dlogits_args *args, rlk_context *ctx)
{
    if (args->dtype == RLK_F64 || args->logits == NULL) return RLK_UNSUPPORTED;
    ctx->kernel = "linear_logp_dz_cpu";
    if (ctx->plan_only) return RLK_OK;
    const float inv_t = args->inv_temperature;
#pragma omp parallel for num_threads(ctx->num_threads > 0 ? ctx->num_threads : 1) schedule(static)
    for (int64_t r = 0; r < args->rows; r++) {
        const float *logits = args->logits + r * args->ld_logits;
        const int64_t out_row = r * args->ld_dlogits;
        if (args->target[r] == args->ignore_index) {
            for (int64_t c = 0; c < args->cols; c++) rlk_store_f32(args->dlogits, args->dtype, out_row + c, 0.0f);
            continue;
        }
        const int64_t target_col = args->target[r] - args->v0;
        const float g_logp = args->grad_logp ? args->grad_logp[r] : 0.0f;
        const float g_ent = args->grad_entropy ? args->grad_entropy[r] : 0.0f;
        const float entropy = args->grad_entropy ? args->entropy[r] : 0.0f;
        const float lse = args->lse[r];
        for (int64_t c = 0; c < args->cols; c++) {
            /* z = logits + bias in one rounding, as a GEMM epilogue with C = bias forms it */
            const float z = args->bias ? logits[c] + rlk_load_f32(args->bias, args->dtype, c) : logits[c];
            const float s = z * inv_t;
            const float p = expf(s - lse);
            const float one_hot = c == target_col ? 1.0f : 0.0f;
            const float d_s = g_logp * (one_hot - p) - g_ent * p * (s - lse + entropy);
            rlk_store_f32(args->dlogits, args->dtype, out_row + c, d_s * inv_t);
        }
    }
    return RLK_OK;
}
