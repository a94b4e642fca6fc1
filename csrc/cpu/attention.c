/* cpu/attention.c: reference CPU attention, forward and backward, exactly as csrc/ops/attention.h
 * states it (segments, blocks, the softmax state update, the merge and the normalization).
 *
 * Forward: out = softmax(q k^T * scale) v per query row and head, and lse (natural log) per row,
 * with GQA and bottom-right causal masking or none; fp32 / bf16 / fp16 computed in fp32, fp64 in
 * double (lse is fp64 too then). Backward: dq, dk, dv from q, k, v, out, lse, dout with
 * D_i = dout_i . out_i, P = exp2(s * c - lse * log2(e)), dS = P (dP - D), dq = scale dS K,
 * dk = scale dS^T Q, dv = P^T dO; P and dS stay fp32 (no round_dtype), every sum is accumulated in
 * fp32 (fp64) and rounded once to the dtype.
 *
 * Loop plan (fp32 / bf16 / fp16). OpenMP threads take work items in any order:
 *   forward: (sequence, query head, ROW_BLOCK query rows). The item walks the keys its last row sees
 *     in blocks of RLK_ATTENTION_BLOCK_N at absolute positions 0, 64, ...; each block of K
 *     (transposed, d x 64) and V (64 x d) is converted to fp32 once for all rows of the item. Each
 *     row that sees keys of the block then forms its 64 scores (one fma chain per key over d in
 *     increasing order, vectorized across keys), p_j, and sum_j round(p_j) v_j (one fma chain per
 *     element over the block's keys, vectorized across d), and updates its segment state; after every
 *     RLK_ATTENTION_SEGMENT keys the segment state is merged into the row state.
 *   backward: items (sequence, kv head, key block) for dk / dv, which walk the group's query heads
 *     in increasing order and, per head, the query rows that see the block in increasing order,
 *     accumulating dS^T Q and P^T dO; and items (sequence, query head, ROW_BLOCK rows) for dq, which
 *     accumulate dS K over the keys in increasing order. Both recompute s, P, dP and dS with the same
 *     functions, so they see the same bits. No atomics: every item writes its own outputs.
 * fp64 (gradcheck sizes) follows the same plan a row at a time, in double, without conversion.
 * The fp32 work items are compiled twice, portable and (x86) AVX2 + FMA, chosen at run time: fmaf is
 * exactly rounded and every other operation is the same IEEE operation in the same order, so both
 * builds give the same bits (exp2f / log2f are the same libm functions in both). Every multiply-add
 * is an explicit fmaf and no other expression has one to contract, so -ffp-contract does not
 * change the bits either.
 *
 * Why batch- and decode-invariant: a row's result is a function of its own q, the keys and values
 * it sees, head_dim and the scale, nothing else. Blocks and segments are cut at absolute key
 * positions; a row whose visible keys end inside a block uses only the keys it sees (the contract's
 * masked terms are exact zeros); its sums run in orders that depend on key positions and head_dim
 * only; and nothing in its arithmetic depends on the other rows of its item, on which item or
 * thread computes it, or on the layout (strides, starts, packing, padding). So a full prefill, a
 * chunked prefill and a token-by-token decode of one sequence give the same bits, in any batch.
 * dq sums over the row's keys in key order; dk / dv over (head, row) in increasing order.
 *
 * Build: gcc -O3 -std=c11 -fopenmp -ffp-contract=off -fPIC -shared -I csrc csrc/cpu/attention.c
 *        (-DRLK_CPU_PORTABLE_ONLY drops the AVX2 build; results are identical)
 * Test:  no binding yet: a ctypes harness compares with fp64 torch attention (forward, lse, dq, dk,
 *        dv; causal or not; GQA; d 40 / 64 / 128; all dtypes) and checks bitwise prefill / chunked
 *        prefill / decode, packing, padding, thread-count and run-to-run invariance.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../ops/attention.h"
#include "common.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(RLK_CPU_PORTABLE_ONLY)
#define RLK_HAVE_AVX2_KERNELS 1
#endif

/* The helpers of a work item are inlined into it, so its AVX2 + FMA build compiles them with FMA
 * (inline fma instructions and vectorized loops rather than calls to libm's fmaf). */
#ifdef __GNUC__
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define ALWAYS_INLINE static inline
#endif

enum {
    BLOCK_N = RLK_ATTENTION_BLOCK_N,
    SEGMENT = RLK_ATTENTION_SEGMENT,
    ROW_BLOCK = 32,     /* query rows per forward / dq item: a converted K / V block serves 32 rows */
    SCRATCH_ALIGN = 64, /* bytes; every scratch array starts on a cache line */
};

static const float RESCALE_THRESHOLD = RLK_ATTENTION_RESCALE_THRESHOLD;
static const float LOG2E_F = 0x1.715476p+0f; /* log2(e) rounded to fp32 */
static const float LN2_F = 0x1.62e430p-1f;   /* ln(2) rounded to fp32 */
static const double LOG2E = 0x1.71547652b82fep+0;
static const double LN2 = 0x1.62e42fefa39efp-1;

/* softmax_scale as the fp32 computations take it, rounded to float (the fp64 ones use the double) */
static float fp32_scale(const rlk_attention_args *a) { return (float)a->softmax_scale; }

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* ---- geometry shared by both precisions ---------------------------------------------------- */

typedef struct sequence {
    int64_t b, q_start, q_len, k_start, k_len;
} sequence;

/* Sequence b's ranges; a null array stands for 0 (starts) or max_q_len / max_k_len (lengths). */
static sequence sequence_at(const rlk_attention_args *a, int64_t b)
{
    return (sequence){b, a->q_start ? a->q_start[b] : 0, a->q_len ? a->q_len[b] : a->max_q_len,
                      a->k_start ? a->k_start[b] : 0, a->k_len ? a->k_len[b] : a->max_k_len};
}

static int64_t kv_head(const rlk_attention_args *a, int64_t h) { return h / (a->heads_q / a->heads_kv); }

/* L of query row i: it sees keys 0 .. L-1 (its own position and before when causal). */
static int64_t visible_keys(const rlk_attention_args *a, const sequence *s, int64_t i)
{
    return a->causal ? max64(s->k_len - s->q_len + i + 1, 0) : s->k_len;
}

/* How many keys of the block at j0 a row with `visible` keys sees (0 .. BLOCK_N). */
static int64_t keys_in_block(int64_t visible, int64_t j0)
{
    return rlk_min64(max64(visible - j0, 0), BLOCK_N);
}

/* The first query row that sees key j (rows see nested ranges of keys). */
static int64_t first_row_seeing(const rlk_attention_args *a, const sequence *s, int64_t j)
{
    return a->causal ? max64(j - (s->k_len - s->q_len), 0) : 0;
}

/* Element index of row `row` (q / out / lse / dout / dq: q_start + i; k / v / dk / dv: k_start + j)
 * of head `head` of sequence b. */
static int64_t element(const rlk_attention_tensor *t, int64_t b, int64_t row, int64_t head)
{
    return b * t->batch_stride + row * t->row_stride + head * t->head_stride;
}

/* Work items: forward and dq (sequence, query head, row block); dk / dv (sequence, kv head, key
 * block). Items past a sequence's rows or keys are empty. */
static int64_t row_blocks(const rlk_attention_args *a) { return (a->max_q_len + ROW_BLOCK - 1) / ROW_BLOCK; }
static int64_t key_blocks(const rlk_attention_args *a) { return (a->max_k_len + BLOCK_N - 1) / BLOCK_N; }

typedef struct work_item {
    sequence s;
    int64_t head, first; /* first: the item's first query row (forward, dq) or key (dk / dv) */
} work_item;

static work_item row_item(const rlk_attention_args *a, int64_t item)
{
    const int64_t blocks = row_blocks(a);
    const int64_t bh = item / blocks;
    return (work_item){sequence_at(a, bh / a->heads_q), bh % a->heads_q, item % blocks * ROW_BLOCK};
}

static work_item key_item(const rlk_attention_args *a, int64_t item)
{
    const int64_t blocks = key_blocks(a);
    const int64_t bg = item / blocks;
    return (work_item){sequence_at(a, bg / a->heads_kv), bg % a->heads_kv, item % blocks * BLOCK_N};
}

/* ---- fp32 / bf16 / fp16, computed in fp32 ---------------------------------------------------- */

/* (m, ms, l) of the contract's softmax state; acc lives beside it in scratch. */
typedef struct softmax_state {
    float m, ms, l;
} softmax_state;

static const softmax_state EMPTY_STATE = {-INFINITY, 0.0f, 0.0f};

ALWAYS_INLINE float scaled_max(float m, float c) { return m == -INFINITY ? 0.0f : m * c; }

/* The factor that moves sums kept relative to ms_old onto ms_new: 0 for an empty state, and exactly
 * 1 when the max did not move, selected as the contract requires rather than left to exp2f(0). */
ALWAYS_INLINE float rescale_factor(float m_old, float ms_old, float m_new, float ms_new)
{
    if (m_old == -INFINITY) return 0.0f;
    return m_old == m_new ? 1.0f : exp2f(ms_old - ms_new);
}

/* sum_e x[e] * y[e]: one fma chain in increasing e from 0. */
ALWAYS_INLINE float dot(const float *restrict x, const float *restrict y, int64_t d)
{
    float acc = 0.0f;
    for (int64_t e = 0; e < d; e++) acc = fmaf(x[e], y[e], acc);
    return acc;
}

/* s[j] = x . column j of the d x BLOCK_N block keys_t, for all BLOCK_N columns: per column one fma
 * chain in increasing e from 0, exactly as dot() (the loop runs across columns so it vectorizes). */
ALWAYS_INLINE void block_dots(float *restrict s, const float *restrict x, const float *restrict keys_t, int64_t d)
{
    for (int j = 0; j < BLOCK_N; j++) s[j] = 0.0f;
    for (int64_t e = 0; e < d; e++) {
        const float xe = x[e];
        const float *restrict column_e = keys_t + e * BLOCK_N;
        for (int j = 0; j < BLOCK_N; j++) s[j] = fmaf(xe, column_e[j], s[j]);
    }
}

/* acc[e] = fma(w[j], rows[j * d + e], acc[e]) for j = 0 .. n-1 in increasing order. */
ALWAYS_INLINE void add_weighted_rows(float *restrict acc, const float *restrict w, const float *restrict rows,
                                     int64_t n, int64_t d)
{
    for (int64_t j = 0; j < n; j++) {
        const float wj = w[j];
        const float *restrict row = rows + j * d;
        for (int64_t e = 0; e < d; e++) acc[e] = fmaf(wj, row[e], acc[e]);
    }
}

/* rows[j * d + e] = fma(w[j], x[e], rows[j * d + e]) for j < n: one more term of each row's chain. */
ALWAYS_INLINE void add_outer(float *restrict rows, const float *restrict w, const float *restrict x, int64_t n,
                             int64_t d)
{
    for (int64_t j = 0; j < n; j++) {
        const float wj = w[j];
        float *restrict row = rows + j * d;
        for (int64_t e = 0; e < d; e++) row[e] = fmaf(wj, x[e], row[e]);
    }
}

/* round_dtype(p) of the contract: the PV product sees p as the dtype would hold it. */
ALWAYS_INLINE void round_to_dtype(float *p, int64_t n, rlk_dtype dtype)
{
    if (dtype == RLK_BF16)
        for (int64_t j = 0; j < n; j++) p[j] = rlk_bf16_to_f32(rlk_f32_to_bf16(p[j]));
    else if (dtype == RLK_F16)
        for (int64_t j = 0; j < n; j++) p[j] = rlk_f16_to_f32(rlk_f32_to_f16(p[j]));
}

/* The contract's block update of one row's segment state (st, acc) with the n keys it sees of a
 * block: s their scores, values the block's values (n x d). p (BLOCK_N) and pv (d) are scratch.
 * st->m moves only when the block's max beats it by RESCALE_THRESHOLD (scaled units); else alpha = 1. */
ALWAYS_INLINE void softmax_block_update(softmax_state *st, float *restrict acc, const float *restrict s, int64_t n,
                                        const float *restrict values, int64_t d, float c, rlk_dtype dtype,
                                        float *restrict p, float *restrict pv)
{
    float block_max = -INFINITY;
    for (int64_t j = 0; j < n; j++) block_max = s[j] > block_max ? s[j] : block_max;
    const float m_max = block_max > st->m ? block_max : st->m;
    const int moves = st->m == -INFINITY || scaled_max(m_max, c) > st->ms + RESCALE_THRESHOLD;
    const float m_new = moves ? m_max : st->m;
    const float ms_new = scaled_max(m_new, c);
    const float alpha = rescale_factor(st->m, st->ms, m_new, ms_new);
    float p_sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        p[j] = exp2f(fmaf(s[j], c, -ms_new));
        p_sum += p[j];
    }
    round_to_dtype(p, n, dtype);
    for (int64_t e = 0; e < d; e++) pv[e] = 0.0f;
    add_weighted_rows(pv, p, values, n, d);
    for (int64_t e = 0; e < d; e++) acc[e] = fmaf(alpha, acc[e], pv[e]);
    st->l = fmaf(alpha, st->l, p_sum);
    st->m = m_new;
    st->ms = ms_new;
}

/* Merges a segment's state into the row state (the same update, per the contract). */
ALWAYS_INLINE void merge_state(softmax_state *row, float *restrict o, const softmax_state *seg,
                               const float *restrict acc, int64_t d, float c)
{
    const float m_new = seg->m > row->m ? seg->m : row->m;
    const float ms_new = scaled_max(m_new, c);
    const float a = rescale_factor(row->m, row->ms, m_new, ms_new);
    const float b = rescale_factor(seg->m, seg->ms, m_new, ms_new);
    for (int64_t e = 0; e < d; e++) o[e] = fmaf(a, o[e], b * acc[e]);
    row->l = fmaf(a, row->l, b * seg->l);
    row->m = m_new;
    row->ms = ms_new;
}

/* keys_t[e * BLOCK_N + j] = element e of row j0 + j of t (kv head g) in fp32, for j < nk; columns
 * nk .. BLOCK_N-1 are zero, so the scores block_dots forms for them are finite (and unused). */
static void load_block_transposed(float *keys_t, const rlk_attention_args *a, const rlk_attention_tensor *t,
                                  const sequence *s, int64_t g, int64_t j0, int64_t nk)
{
    const int64_t d = a->head_dim;
    for (int64_t j = 0; j < nk; j++)
        rlk_load_row_f32(keys_t + j, BLOCK_N, t->data, a->dtype, element(t, s->b, s->k_start + j0 + j, g), d);
    if (nk < BLOCK_N)
        for (int64_t e = 0; e < d; e++) memset(keys_t + e * BLOCK_N + nk, 0, sizeof(float) * (BLOCK_N - nk));
}

/* rows[j * d + e] = element e of row j0 + j of t (kv head g) in fp32, for j < nk. */
static void load_block_rows(float *rows, const rlk_attention_args *a, const rlk_attention_tensor *t,
                            const sequence *s, int64_t g, int64_t j0, int64_t nk)
{
    const int64_t d = a->head_dim;
    for (int64_t j = 0; j < nk; j++)
        rlk_load_row_f32(rows + j * d, 1, t->data, a->dtype, element(t, s->b, s->k_start + j0 + j, g), d);
}

/* dst = row i (head h) of a tensor addressed like q (q, out, dout) in fp32. */
static void load_query_row(float *dst, const rlk_attention_args *a, const rlk_attention_tensor *t,
                           const sequence *s, int64_t i, int64_t h)
{
    rlk_load_row_f32(dst, 1, t->data, a->dtype, element(t, s->b, s->q_start + i, h), a->head_dim);
}

/* Scratch is carved into arrays of whole cache lines; *_scratch_floats below add up the same sizes. */
static float *carve(float **cursor, int64_t n)
{
    float *start = *cursor;
    *cursor += round_up(n, SCRATCH_ALIGN / sizeof(float));
    return start;
}

static int64_t padded(int64_t n) { return round_up(n, SCRATCH_ALIGN / sizeof(float)); }

static int64_t forward_scratch_floats(int64_t d)
{
    return 3 * padded(ROW_BLOCK * d) + 2 * padded(BLOCK_N * d) + padded(d);
}

static int64_t backward_scratch_floats(int64_t d)
{
    const int64_t dq = 3 * padded(ROW_BLOCK * d) + 3 * padded(BLOCK_N * d) + padded(d);
    const int64_t dkdv = 4 * padded(BLOCK_N * d) + 3 * padded(d);
    return max64(dq, dkdv);
}

/* Forward of one item: rows i0 .. i0 + rows - 1 of query head h. */
ALWAYS_INLINE void forward_row_block(const rlk_attention_args *a, int64_t item, float *scratch)
{
    const work_item w = row_item(a, item);
    const sequence *s = &w.s;
    const int64_t d = a->head_dim, h = w.head, g = kv_head(a, h), i0 = w.first;
    if (i0 >= s->q_len) return;
    const int64_t rows = rlk_min64(ROW_BLOCK, s->q_len - i0);
    const float c = fp32_scale(a) * LOG2E_F;
    float *cursor = scratch;
    float *q_rows = carve(&cursor, ROW_BLOCK * d), *seg_acc = carve(&cursor, ROW_BLOCK * d);
    float *row_o = carve(&cursor, ROW_BLOCK * d);
    float *keys_t = carve(&cursor, BLOCK_N * d), *values = carve(&cursor, BLOCK_N * d);
    float *pv = carve(&cursor, d);
    float scores[BLOCK_N], p[BLOCK_N];
    softmax_state seg_state[ROW_BLOCK], row_state[ROW_BLOCK];
    int64_t visible[ROW_BLOCK];

    for (int64_t r = 0; r < rows; r++) {
        load_query_row(q_rows + r * d, a, &a->q, s, i0 + r, h);
        visible[r] = visible_keys(a, s, i0 + r);
        row_state[r] = EMPTY_STATE;
    }
    memset(row_o, 0, sizeof(float) * rows * d);
    /* rows see nested key ranges; the last sees the most. Computed, not read from visible[rows - 1]:
     * under -fwrapv gcc cannot prove rows >= 1 (i0 < q_len does not imply q_len - i0 > 0 when
     * wrapping is defined), and warned that the read may be of an unset element. Same value. */
    const int64_t keys_seen = visible_keys(a, s, i0 + rows - 1);
    for (int64_t seg0 = 0; seg0 < keys_seen; seg0 += SEGMENT) {
        const int64_t seg_end = rlk_min64(seg0 + SEGMENT, keys_seen);
        for (int64_t r = 0; r < rows; r++) seg_state[r] = EMPTY_STATE;
        memset(seg_acc, 0, sizeof(float) * rows * d);
        for (int64_t j0 = seg0; j0 < seg_end; j0 += BLOCK_N) {
            const int64_t nk = rlk_min64(BLOCK_N, keys_seen - j0);
            load_block_transposed(keys_t, a, &a->k, s, g, j0, nk);
            load_block_rows(values, a, &a->v, s, g, j0, nk);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t n = keys_in_block(visible[r], j0);
                if (n == 0) continue;
                block_dots(scores, q_rows + r * d, keys_t, d);
                softmax_block_update(&seg_state[r], seg_acc + r * d, scores, n, values, d, c, a->dtype, p, pv);
            }
        }
        for (int64_t r = 0; r < rows; r++)
            if (visible[r] > seg0) merge_state(&row_state[r], row_o + r * d, &seg_state[r], seg_acc + r * d, d, c);
    }

    for (int64_t r = 0; r < rows; r++) {
        const softmax_state *st = &row_state[r];
        float *o = row_o + r * d, lse = -INFINITY;
        if (visible[r] > 0) { /* else o stayed 0 */
            const float inv_l = 1.0f / st->l;
            for (int64_t e = 0; e < d; e++) o[e] *= inv_l;
            lse = (st->ms + log2f(st->l)) * LN2_F;
        }
        rlk_store_row_f32(a->out.data, a->dtype, element(&a->out, s->b, s->q_start + i0 + r, h), o, d);
        ((float *)a->lse.data)[element(&a->lse, s->b, s->q_start + i0 + r, h)] = lse;
    }
}

/* D = dout . out and lse * log2(e) of query row i, head h: what P and dS need besides the scores. */
ALWAYS_INLINE void row_statistics(const rlk_attention_args *a, const sequence *s, int64_t i, int64_t h,
                                  const float *dout, float *out_scratch, float *delta, float *lse_log2)
{
    load_query_row(out_scratch, a, &a->out, s, i, h);
    *delta = dot(dout, out_scratch, a->head_dim);
    *lse_log2 = ((const float *)a->lse.data)[element(&a->lse, s->b, s->q_start + i, h)] * LOG2E_F;
}

/* P and dS of one row over n keys: p = exp2(s c - lse log2 e), ds = p (dp - D). */
ALWAYS_INLINE void probabilities_and_score_grads(float *restrict p, float *restrict ds, const float *restrict s,
                                                 const float *restrict dp, int64_t n, float c, float lse_log2,
                                                 float delta)
{
    for (int64_t j = 0; j < n; j++) {
        p[j] = exp2f(fmaf(s[j], c, -lse_log2));
        ds[j] = p[j] * (dp[j] - delta);
    }
}

/* dq of one item: rows i0 .. i0 + rows - 1 of query head h, summed over their keys in key order. */
ALWAYS_INLINE void dq_row_block(const rlk_attention_args *a, int64_t item, float *scratch)
{
    const work_item w = row_item(a, item);
    const sequence *s = &w.s;
    const int64_t d = a->head_dim, h = w.head, g = kv_head(a, h), i0 = w.first;
    if (i0 >= s->q_len) return;
    const int64_t rows = rlk_min64(ROW_BLOCK, s->q_len - i0);
    const float c = fp32_scale(a) * LOG2E_F;
    float *cursor = scratch;
    float *q_rows = carve(&cursor, ROW_BLOCK * d), *dout_rows = carve(&cursor, ROW_BLOCK * d);
    float *dq_acc = carve(&cursor, ROW_BLOCK * d), *keys_t = carve(&cursor, BLOCK_N * d);
    float *values_t = carve(&cursor, BLOCK_N * d), *keys = carve(&cursor, BLOCK_N * d);
    float *out_row = carve(&cursor, d);
    float scores[BLOCK_N], dp[BLOCK_N], p[BLOCK_N], ds[BLOCK_N], delta[ROW_BLOCK], lse_log2[ROW_BLOCK];
    int64_t visible[ROW_BLOCK];

    for (int64_t r = 0; r < rows; r++) {
        load_query_row(q_rows + r * d, a, &a->q, s, i0 + r, h);
        load_query_row(dout_rows + r * d, a, &a->dout, s, i0 + r, h);
        row_statistics(a, s, i0 + r, h, dout_rows + r * d, out_row, &delta[r], &lse_log2[r]);
        visible[r] = visible_keys(a, s, i0 + r);
    }
    memset(dq_acc, 0, sizeof(float) * rows * d);
    const int64_t keys_seen = visible_keys(a, s, i0 + rows - 1); /* the most (as in forward_row_block) */
    for (int64_t j0 = 0; j0 < keys_seen; j0 += BLOCK_N) {
        const int64_t nk = rlk_min64(BLOCK_N, keys_seen - j0);
        load_block_transposed(keys_t, a, &a->k, s, g, j0, nk);
        load_block_transposed(values_t, a, &a->v, s, g, j0, nk);
        load_block_rows(keys, a, &a->k, s, g, j0, nk);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t n = keys_in_block(visible[r], j0);
            if (n == 0) continue;
            block_dots(scores, q_rows + r * d, keys_t, d);
            block_dots(dp, dout_rows + r * d, values_t, d);
            probabilities_and_score_grads(p, ds, scores, dp, n, c, lse_log2[r], delta[r]);
            add_weighted_rows(dq_acc + r * d, ds, keys, n, d);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dq = dq_acc + r * d;
        for (int64_t e = 0; e < d; e++) dq[e] *= fp32_scale(a);
        rlk_store_row_f32(a->dq.data, a->dtype, element(&a->dq, s->b, s->q_start + i0 + r, h), dq, d);
    }
}

/* dk, dv of one item: keys j0 .. j0 + nk - 1 of kv head g, summed over the group's query heads in
 * increasing order and, per head, over the rows that see them in increasing order. */
ALWAYS_INLINE void dkdv_key_block(const rlk_attention_args *a, int64_t item, float *scratch)
{
    const work_item w = key_item(a, item);
    const sequence *s = &w.s;
    const int64_t d = a->head_dim, g = w.head, j0 = w.first;
    if (j0 >= s->k_len) return;
    const int64_t nk = rlk_min64(BLOCK_N, s->k_len - j0), group = a->heads_q / a->heads_kv;
    const float c = fp32_scale(a) * LOG2E_F;
    float *cursor = scratch;
    float *keys_t = carve(&cursor, BLOCK_N * d), *values_t = carve(&cursor, BLOCK_N * d);
    float *dk_acc = carve(&cursor, BLOCK_N * d), *dv_acc = carve(&cursor, BLOCK_N * d);
    float *q_row = carve(&cursor, d), *dout_row = carve(&cursor, d), *out_row = carve(&cursor, d);
    float scores[BLOCK_N], dp[BLOCK_N], p[BLOCK_N], ds[BLOCK_N];

    load_block_transposed(keys_t, a, &a->k, s, g, j0, nk);
    load_block_transposed(values_t, a, &a->v, s, g, j0, nk);
    memset(dk_acc, 0, sizeof(float) * nk * d);
    memset(dv_acc, 0, sizeof(float) * nk * d);
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
        for (int64_t i = first_row_seeing(a, s, j0); i < s->q_len; i++) {
            const int64_t n = keys_in_block(visible_keys(a, s, i), j0);
            float delta, lse_log2;
            load_query_row(q_row, a, &a->q, s, i, h);
            load_query_row(dout_row, a, &a->dout, s, i, h);
            row_statistics(a, s, i, h, dout_row, out_row, &delta, &lse_log2);
            block_dots(scores, q_row, keys_t, d);
            block_dots(dp, dout_row, values_t, d);
            probabilities_and_score_grads(p, ds, scores, dp, n, c, lse_log2, delta);
            add_outer(dv_acc, p, dout_row, n, d);
            add_outer(dk_acc, ds, q_row, n, d);
        }
    }
    for (int64_t j = 0; j < nk; j++) {
        float *dk = dk_acc + j * d;
        for (int64_t e = 0; e < d; e++) dk[e] *= fp32_scale(a);
        rlk_store_row_f32(a->dk.data, a->dtype, element(&a->dk, s->b, s->k_start + j0 + j, g), dk, d);
        rlk_store_row_f32(a->dv.data, a->dtype, element(&a->dv, s->b, s->k_start + j0 + j, g), dv_acc + j * d, d);
    }
}

typedef void item_fn(const rlk_attention_args *a, int64_t item, void *scratch);

static void forward_item_portable(const rlk_attention_args *a, int64_t item, void *scratch)
{
    forward_row_block(a, item, scratch);
}
static void dq_item_portable(const rlk_attention_args *a, int64_t item, void *scratch)
{
    dq_row_block(a, item, scratch);
}
static void dkdv_item_portable(const rlk_attention_args *a, int64_t item, void *scratch)
{
    dkdv_key_block(a, item, scratch);
}

#ifdef RLK_HAVE_AVX2_KERNELS
__attribute__((target("avx2,fma"))) static void forward_item_avx2(const rlk_attention_args *a, int64_t item,
                                                                  void *scratch)
{
    forward_row_block(a, item, scratch);
}
__attribute__((target("avx2,fma"))) static void dq_item_avx2(const rlk_attention_args *a, int64_t item,
                                                             void *scratch)
{
    dq_row_block(a, item, scratch);
}
__attribute__((target("avx2,fma"))) static void dkdv_item_avx2(const rlk_attention_args *a, int64_t item,
                                                               void *scratch)
{
    dkdv_key_block(a, item, scratch);
}
#endif

/* ---- fp64, computed in double (gradcheck) ---------------------------------------------------- */

typedef struct softmax_state_f64 {
    double m, ms, l;
} softmax_state_f64;

static const softmax_state_f64 EMPTY_STATE_F64 = {-INFINITY, 0.0, 0.0};

static double scaled_max_f64(double m, double c) { return m == -INFINITY ? 0.0 : m * c; }

static double rescale_factor_f64(double m_old, double ms_old, double m_new, double ms_new)
{
    if (m_old == -INFINITY) return 0.0;
    return m_old == m_new ? 1.0 : exp2(ms_old - ms_new);
}

static double dot_f64(const double *x, const double *y, int64_t d)
{
    double acc = 0.0;
    for (int64_t e = 0; e < d; e++) acc = fma(x[e], y[e], acc);
    return acc;
}

static const double *row_f64(const rlk_attention_tensor *t, int64_t b, int64_t row, int64_t head)
{
    return (const double *)t->data + element(t, b, row, head);
}

static double *mutable_row_f64(const rlk_attention_tensor *t, int64_t b, int64_t row, int64_t head)
{
    return (double *)t->data + element(t, b, row, head);
}

static int64_t forward_scratch_doubles(int64_t d) { return 3 * d; }
static int64_t backward_scratch_doubles(int64_t d) { return 2 * BLOCK_N * d; }

/* Forward of query row i, head h: the fp32 path's arithmetic, in double. scratch: 3 d doubles. */
static void forward_row_f64(const rlk_attention_args *a, const sequence *s, int64_t h, int64_t i, double *scratch)
{
    const int64_t d = a->head_dim, g = kv_head(a, h), visible = visible_keys(a, s, i);
    const double c = a->softmax_scale * LOG2E;
    const double *q = row_f64(&a->q, s->b, s->q_start + i, h);
    double *acc = scratch, *o = acc + d, *pv = o + d;
    double scores[BLOCK_N];
    softmax_state_f64 row = EMPTY_STATE_F64;

    memset(o, 0, sizeof(double) * d);
    for (int64_t seg0 = 0; seg0 < visible; seg0 += SEGMENT) {
        softmax_state_f64 seg = EMPTY_STATE_F64;
        memset(acc, 0, sizeof(double) * d);
        for (int64_t j0 = seg0; j0 < rlk_min64(seg0 + SEGMENT, visible); j0 += BLOCK_N) {
            const int64_t n = rlk_min64(BLOCK_N, visible - j0);
            double block_max = -INFINITY, p_sum = 0.0;
            for (int64_t j = 0; j < n; j++) {
                scores[j] = dot_f64(q, row_f64(&a->k, s->b, s->k_start + j0 + j, g), d);
                block_max = scores[j] > block_max ? scores[j] : block_max;
            }
            const double m_max = block_max > seg.m ? block_max : seg.m;
            const int moves = seg.m == -INFINITY || scaled_max_f64(m_max, c) > seg.ms + RESCALE_THRESHOLD;
            const double m_new = moves ? m_max : seg.m;
            const double ms_new = scaled_max_f64(m_new, c);
            const double alpha = rescale_factor_f64(seg.m, seg.ms, m_new, ms_new);
            memset(pv, 0, sizeof(double) * d);
            for (int64_t j = 0; j < n; j++) {
                const double p = exp2(fma(scores[j], c, -ms_new));
                const double *v = row_f64(&a->v, s->b, s->k_start + j0 + j, g);
                p_sum += p;
                for (int64_t e = 0; e < d; e++) pv[e] = fma(p, v[e], pv[e]);
            }
            for (int64_t e = 0; e < d; e++) acc[e] = fma(alpha, acc[e], pv[e]);
            seg = (softmax_state_f64){m_new, ms_new, fma(alpha, seg.l, p_sum)};
        }
        const double m_new = seg.m > row.m ? seg.m : row.m;
        const double ms_new = scaled_max_f64(m_new, c);
        const double ra = rescale_factor_f64(row.m, row.ms, m_new, ms_new);
        const double rb = rescale_factor_f64(seg.m, seg.ms, m_new, ms_new);
        for (int64_t e = 0; e < d; e++) o[e] = fma(ra, o[e], rb * acc[e]);
        row = (softmax_state_f64){m_new, ms_new, fma(ra, row.l, rb * seg.l)};
    }

    double *out = mutable_row_f64(&a->out, s->b, s->q_start + i, h);
    double *lse = mutable_row_f64(&a->lse, s->b, s->q_start + i, h);
    if (visible == 0) {
        memset(out, 0, sizeof(double) * d);
        *lse = -INFINITY;
    } else {
        const double inv_l = 1.0 / row.l;
        for (int64_t e = 0; e < d; e++) out[e] = o[e] * inv_l;
        *lse = (row.ms + log2(row.l)) * LN2;
    }
}

/* P and dS of query row i, head h, against key j (kv head g): the fp32 path's arithmetic in double. */
static void score_grad_f64(const rlk_attention_args *a, const sequence *s, int64_t h, int64_t i, int64_t g,
                           int64_t j, double delta, double lse_log2, double *p, double *ds)
{
    const int64_t d = a->head_dim;
    const double c = a->softmax_scale * LOG2E;
    const double score = dot_f64(row_f64(&a->q, s->b, s->q_start + i, h), row_f64(&a->k, s->b, s->k_start + j, g), d);
    const double dp = dot_f64(row_f64(&a->dout, s->b, s->q_start + i, h), row_f64(&a->v, s->b, s->k_start + j, g), d);
    *p = exp2(fma(score, c, -lse_log2));
    *ds = *p * (dp - delta);
}

static void row_statistics_f64(const rlk_attention_args *a, const sequence *s, int64_t i, int64_t h,
                               double *delta, double *lse_log2)
{
    const int64_t row = s->q_start + i;
    *delta = dot_f64(row_f64(&a->dout, s->b, row, h), row_f64(&a->out, s->b, row, h), a->head_dim);
    *lse_log2 = *row_f64(&a->lse, s->b, row, h) * LOG2E;
}

static void forward_item_f64(const rlk_attention_args *a, int64_t item, void *scratch)
{
    const work_item w = row_item(a, item);
    for (int64_t i = w.first; i < rlk_min64(w.first + ROW_BLOCK, w.s.q_len); i++)
        forward_row_f64(a, &w.s, w.head, i, scratch);
}

static void dq_item_f64(const rlk_attention_args *a, int64_t item, void *scratch)
{
    const work_item w = row_item(a, item);
    const sequence *s = &w.s;
    const int64_t d = a->head_dim, h = w.head, g = kv_head(a, h);
    for (int64_t i = w.first; i < rlk_min64(w.first + ROW_BLOCK, s->q_len); i++) {
        double *dq = mutable_row_f64(&a->dq, s->b, s->q_start + i, h);
        double *acc = scratch;
        double delta, lse_log2, p, ds;
        row_statistics_f64(a, s, i, h, &delta, &lse_log2);
        memset(acc, 0, sizeof(double) * d);
        for (int64_t j = 0; j < visible_keys(a, s, i); j++) {
            const double *k = row_f64(&a->k, s->b, s->k_start + j, g);
            score_grad_f64(a, s, h, i, g, j, delta, lse_log2, &p, &ds);
            for (int64_t e = 0; e < d; e++) acc[e] = fma(ds, k[e], acc[e]);
        }
        for (int64_t e = 0; e < d; e++) dq[e] = acc[e] * a->softmax_scale;
    }
}

static void dkdv_item_f64(const rlk_attention_args *a, int64_t item, void *scratch)
{
    const work_item w = key_item(a, item);
    const sequence *s = &w.s;
    const int64_t d = a->head_dim, g = w.head, j0 = w.first, group = a->heads_q / a->heads_kv;
    if (j0 >= s->k_len) return;
    const int64_t nk = rlk_min64(BLOCK_N, s->k_len - j0);
    double *dk_acc = scratch, *dv_acc = dk_acc + BLOCK_N * d;

    memset(scratch, 0, sizeof(double) * 2 * BLOCK_N * d);
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
        for (int64_t i = first_row_seeing(a, s, j0); i < s->q_len; i++) {
            const int64_t n = keys_in_block(visible_keys(a, s, i), j0);
            const double *q = row_f64(&a->q, s->b, s->q_start + i, h);
            const double *dout = row_f64(&a->dout, s->b, s->q_start + i, h);
            double delta, lse_log2, p, ds;
            row_statistics_f64(a, s, i, h, &delta, &lse_log2);
            for (int64_t j = 0; j < n; j++) {
                score_grad_f64(a, s, h, i, g, j0 + j, delta, lse_log2, &p, &ds);
                for (int64_t e = 0; e < d; e++) {
                    dv_acc[j * d + e] = fma(p, dout[e], dv_acc[j * d + e]);
                    dk_acc[j * d + e] = fma(ds, q[e], dk_acc[j * d + e]);
                }
            }
        }
    }
    for (int64_t j = 0; j < nk; j++) {
        double *dk = mutable_row_f64(&a->dk, s->b, s->k_start + j0 + j, g);
        double *dv = mutable_row_f64(&a->dv, s->b, s->k_start + j0 + j, g);
        for (int64_t e = 0; e < d; e++) {
            dk[e] = dk_acc[j * d + e] * a->softmax_scale;
            dv[e] = dv_acc[j * d + e];
        }
    }
}

/* ---- launchers ----------------------------------------------------------------------------- */

typedef struct attention_items {
    item_fn *forward, *dq, *dkdv;
} attention_items;

/* Which build of the work items runs only affects speed (see the header). */
static attention_items select_items(rlk_dtype dtype)
{
    if (dtype == RLK_F64) return (attention_items){forward_item_f64, dq_item_f64, dkdv_item_f64};
#ifdef RLK_HAVE_AVX2_KERNELS
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return (attention_items){forward_item_avx2, dq_item_avx2, dkdv_item_avx2};
#endif
    return (attention_items){forward_item_portable, dq_item_portable, dkdv_item_portable};
}

static int supported_dtype(rlk_dtype dtype)
{
    return dtype == RLK_F32 || dtype == RLK_BF16 || dtype == RLK_F16 || dtype == RLK_F64;
}

/* The lengths and starts are data the binding cannot check without reading them; out-of-range
 * values would address memory outside the tensors, so nothing runs. */
static int check_lengths(const rlk_attention_args *a)
{
    for (int64_t b = 0; b < a->batch; b++) {
        const sequence s = sequence_at(a, b);
        if (s.q_len < 0 || s.q_len > a->max_q_len || s.k_len < 0 || s.k_len > a->max_k_len || s.q_start < 0 ||
            s.k_start < 0 || s.q_start + s.q_len > a->q_rows || s.k_start + s.k_len > a->k_rows)
            return RLK_BAD_INDEX;
    }
    return RLK_OK;
}

/* Runs items 0 .. items-1 on up to num_threads OpenMP threads, each with its own scratch. An item
 * below split runs first_fn, the others second_fn with item - split. Items write disjoint
 * outputs, so any item-to-thread mapping gives the same bits; dynamic only balances the load. */
static int run_items(const rlk_attention_args *a, item_fn *first_fn, int64_t split, item_fn *second_fn,
                     int64_t items, size_t scratch_bytes, int num_threads)
{
    const int threads = (int)rlk_min64(num_threads > 0 ? num_threads : 1, max64(items, 1));
    int out_of_memory = 0;
#pragma omp parallel num_threads(threads) reduction(| : out_of_memory)
    {
        void *scratch = aligned_alloc(SCRATCH_ALIGN, (size_t)round_up((int64_t)scratch_bytes, SCRATCH_ALIGN));
        if (!scratch) out_of_memory = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!scratch) continue;
            if (item < split) first_fn(a, item, scratch);
            else second_fn(a, item - split, scratch);
        }
        free(scratch);
    }
    return out_of_memory ? RLK_CPU_OUT_OF_MEMORY : RLK_OK;
}

int rlk_attention_fwd_cpu(const rlk_attention_args *args, rlk_context *ctx)
{
    if (!supported_dtype(args->dtype)) return RLK_UNSUPPORTED;
    ctx->kernel = "attention_fwd_cpu";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only) return RLK_OK;
    const int status = check_lengths(args);
    if (status != RLK_OK) return status;

    const attention_items fns = select_items(args->dtype);
    const int64_t items = args->batch * args->heads_q * row_blocks(args);
    const size_t scratch_bytes = args->dtype == RLK_F64
                                     ? sizeof(double) * (size_t)forward_scratch_doubles(args->head_dim)
                                     : sizeof(float) * (size_t)forward_scratch_floats(args->head_dim);
    return run_items(args, fns.forward, items, NULL, items, scratch_bytes, ctx->num_threads);
}

int rlk_attention_bwd_cpu(const rlk_attention_args *args, rlk_context *ctx)
{
    if (!supported_dtype(args->dtype)) return RLK_UNSUPPORTED;
    ctx->kernel = "attention_bwd_cpu";
    ctx->workspace_bytes = 0;
    if (ctx->plan_only) return RLK_OK;
    const int status = check_lengths(args);
    if (status != RLK_OK) return status;

    const attention_items fns = select_items(args->dtype);
    /* dk / dv items first: they are the larger ones, so the dq items fill in behind them. */
    const int64_t dkdv_items = args->batch * args->heads_kv * key_blocks(args);
    const int64_t dq_items = args->batch * args->heads_q * row_blocks(args);
    const size_t scratch_bytes = args->dtype == RLK_F64
                                     ? sizeof(double) * (size_t)backward_scratch_doubles(args->head_dim)
                                     : sizeof(float) * (size_t)backward_scratch_floats(args->head_dim);
    return run_items(args, fns.dkdv, dkdv_items, fns.dq, dkdv_items + dq_items, scratch_bytes, ctx->num_threads);
}
