/* cuda/attention.cuh: what the attention of every architecture (sm80/attention.cu on mma.sync,
 * sm90/attention.cu on wgmma) shares: the per-sequence ranges and their check (a sequence
 * that breaks the contract raises *bad_index and is skipped, or run with no keys when only its key
 * range is bad, so that its rows are still written), the contract's scaled(m), the row
 * state of a thread's two rows, its block update (mask_block, update_rows, rescale_rows), the
 * segment merge (merge_segment) and the normalization (finalize_row), the cp.async tile loads (in
 * each backend's swizzle), the rows' 16-byte stores from the accumulator layout (store_quad_row: out,
 * dq, dk, dv), the kernel parameters both directions read (CallParams) and the
 * forward's, the split-KV combine kernel, and the host side: the layout checks (supported), the
 * schedule choice, the split workspace, the forward launch (launch_fwd; each backend supplies its
 * tile plan and attention_fwd_kernel) and the forward's entry point (attention_fwd_entry); for the
 * backward, its parameters (BwdParams), the row-statistics kernel that runs first
 * (attention_bwd_prep_kernel), the gradient rows' store (store_acc_rows) and the entry point
 * (attention_bwd_entry) with its one launch of both kinds of CTA (launch_bwd; each backend supplies
 * attention_bwd_kernel, its dK/dV and dQ CTAs). The contract is
 * csrc/ops/attention.h.
 *
 * The merge and the normalization are the contract's "one shared function per backend": both
 * schedules of a backend (prefill kernel, split kernel + combine kernel) call them, every product
 * and sum in them an explicitly rounded intrinsic, exp2 / log2 ex2.approx.ftz / lg2.approx.ftz. Each
 * backend compiles its own copy; the bits of a row still differ between backends (their S and P V).
 *
 * Everything here has internal linkage (an unnamed namespace, as in the .cu files that include it):
 * each .cu file gets its own copy, compiled for its own architectures.
 */
#ifndef RLK_CUDA_ATTENTION_CUH_
#define RLK_CUDA_ATTENTION_CUH_

#include <cuda.h>
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "../ops/attention.h"
#include "common.cuh"

namespace {

constexpr int BLOCK_N = RLK_ATTENTION_BLOCK_N;
constexpr int SEGMENT = RLK_ATTENTION_SEGMENT;
constexpr int BLOCKS_PER_SEGMENT = SEGMENT / BLOCK_N;
static_assert(SEGMENT % BLOCK_N == 0, "a segment is whole blocks");

constexpr float RESCALE_THRESHOLD = RLK_ATTENTION_RESCALE_THRESHOLD;
constexpr float LN2 = 0.6931471805599453f;
constexpr int SPLIT_ROWS = 64; /* rows of a split-schedule CTA: (query, head in group) pairs */
constexpr int PERSISTENT_CTAS_MAX = 1024; /* a persistent prefill grid's CTAs at most (workspace slots) */
constexpr int64_t persistent_workspace_bytes() { return sizeof(int) * (1 + 2 * PERSISTENT_CTAS_MAX); }

/* ------------------------------------ shared arithmetic ------------------------------------- */

__device__ __forceinline__ float log2_approx(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* Keys 0 .. L-1 of its sequence that query i sees (bottom-right causal alignment). */
__device__ __forceinline__ int visible_keys(int i, int q_len, int k_len, int causal) {
    if (!causal) return k_len;
    return min(max(k_len - q_len + i + 1, 0), k_len);
}

/* The per-sequence ranges (device arrays; a null one means 0 for starts, max_q_len / max_k_len for
 * lengths) and the bounds the contract holds them to. */
struct Sequences {
    const int32_t *q_start, *q_len, *k_start, *k_len;
    int64_t max_q_len, max_k_len, q_rows, k_rows;
    int32_t *bad_index; /* host-mapped; may be null */
};

struct SequenceRange {
    int64_t q_start, k_start;
    int q_len, k_len;
};

/* Sequence b's ranges. Ranges that break the contract (negative, longer than max_q_len / max_k_len,
 * past the storage rows) raise the host-mapped flag for the caller, and the sequence is skipped
 * (false). The forward passes write_rows: a sequence whose query range holds but whose key range
 * does not then runs with no keys (k_len 0) instead, so that the kernel owning each of its rows
 * still writes it (out 0, lse -inf) and the caller may hand the forward uninitialized out / lse
 * (csrc/ops/attention.h). */
__device__ __forceinline__ bool load_sequence(const Sequences &s, int b, SequenceRange &r, bool write_rows = false) {
    r.q_start = s.q_start ? s.q_start[b] : 0;
    r.k_start = s.k_start ? s.k_start[b] : 0;
    r.q_len = s.q_len ? s.q_len[b] : (int)s.max_q_len;
    r.k_len = s.k_len ? s.k_len[b] : (int)s.max_k_len;
    const bool q_ok = r.q_len >= 0 && r.q_len <= s.max_q_len && r.q_start >= 0 && r.q_start + r.q_len <= s.q_rows;
    const bool k_ok = r.k_len >= 0 && r.k_len <= s.max_k_len && r.k_start >= 0 && r.k_start + r.k_len <= s.k_rows;
    if (!(q_ok && k_ok) && s.bad_index) *(volatile int32_t *)s.bad_index = 1;
    if (write_rows && q_ok && !k_ok) {
        r.k_len = 0;
        return true;
    }
    return q_ok && k_ok;
}

/* The contract's scaled(m) = round(m * c), 0 while m = -inf. States keep m only and recompute its
 * scaled value where it is needed (same bits, fewer live registers). */
__device__ __forceinline__ float scaled(float m, float c) {
    /* the product unconditionally: a predicated multiply reloaded c from the constant bank */
    const float product = __fmul_rn(m, c);
    return m == -INFINITY ? 0.0f : product;
}

/* The softmax state of a thread's two rows of an MMA accumulator tile, row h = 0, 1 eight rows apart
 * (sm80: rows lane / 4 and + 8 of a warp's m16 tile; sm90: rows 16 w + lane / 4 and + 8 of warp w of
 * a warpgroup's m64 tile): reference max m and running sum l. */
struct RowPair {
    float m[2], l[2];
};

__device__ __forceinline__ void set_empty(RowPair &st) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        st.m[h] = -INFINITY;
        st.l[h] = 0.0f;
    }
}

/* The contract's mask of one key block, before update_rows: a score whose key the row cannot see
 * becomes -inf. Both backends' fragments hold, of row h, the columns 8 j + 2 (lane % 4) + e of the
 * block (s(h, j, e) as in update_rows); key0: the absolute position of the block's first key;
 * row_len: the visible keys of the thread's two rows. KEYS (here and in update_rows): the block's
 * keys, BLOCK_N, or sm90's forward blocks of 128 (sm90/attention.cu, FWD_KEYS). */
template <int KEYS = BLOCK_N, class Scores>
__device__ __forceinline__ void mask_block(int lane, int key0, const int (&row_len)[2], Scores s) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int visible = row_len[h] - key0 - 2 * (lane & 3); /* columns 8 j + e below are keys < L */
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (j * 8 + e >= visible) s(h, j, e) = -INFINITY;
    }
}

/* The pieces of a row's update by one key block (update_rows runs them for the accumulator layout;
 * sm90's decode kernel for its transposed one):
 * update_max: the row's new m from its block max mx (the old m unless the max grew past it by more
 * than RESCALE_THRESHOLD in scaled units), ms_new = scaled(new m) and the returned rescale factor
 * alpha (exactly 1 while m stays, 0 for a row that was empty). Selects, not branches (a
 * short-circuit || here compiled to branches that reload c from the constant bank): both scaled
 * values and the exp2 run whether or not m moved. */
__device__ __forceinline__ float update_max(float &m, float mx, float c, float &ms_new) {
    const bool empty = m == -INFINITY;
    const float ms_old = scaled(m, c);
    const float m_max = fmaxf(m, mx);
    const float ms_max = scaled(m_max, c);
    const bool moves = empty | (ms_max > __fadd_rn(ms_old, RESCALE_THRESHOLD));
    m = moves ? m_max : m;
    ms_new = moves ? ms_max : ms_old;
    const float rescale = exp2_approx(__fsub_rn(ms_old, ms_new));
    return empty ? 0.0f : (moves ? rescale : 1.0f);
}

/* p of a masked score s: exp2(s c - ms_new) */
__device__ __forceinline__ float score_p(float s, float c, float ms_new) { return exp2_approx(__fmaf_rn(s, c, -ms_new)); }

/* Chain `chain` (2 (j & 1) + e) of quad_part_sum (below): its p(j, e) in increasing j; and the four
 * chains added as quad_part_sum adds them. The sm90 few-row split kernel runs the four chains on four
 * warps. */
template <int KEYS, class P>
__device__ __forceinline__ float quad_part_chain(int chain, P p) {
    const int e = chain & 1, j0 = chain >> 1;
    float link = p(j0, e);
#pragma unroll
    for (int i = 1; i < KEYS / 16; ++i) link = __fadd_rn(link, p(j0 + 2 * i, e));
    return link;
}
__device__ __forceinline__ float quad_chains_sum(const float (&chain)[4]) {
    return __fadd_rn(__fadd_rn(chain[0], chain[1]), __fadd_rn(chain[2], chain[3]));
}
/* One quad lane's part of a row's sum of p over a block: its KEYS / 4 values p(j, e) (column 8 j + 2
 * (lane % 4) + e) in four chains (column pair parity x element, so that the adds do not wait on each
 * other the whole block long), added pairwise. The row's sum adds the quad's parts, over the lanes
 * xor 1 and then xor 2, and l = alpha l + sum. */
template <int KEYS, class P>
__device__ __forceinline__ float quad_part_sum(P p) {
    float chain[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) chain[c] = quad_part_chain<KEYS>(c, p);
    return quad_chains_sum(chain);
}

/* The contract's update of a RowPair by one key block, after masking, the two rows side by side (their
 * shuffles and sum chains overlap; each row's arithmetic is its own): per row h the block's max (this
 * thread's KEYS / 4 scores by a balanced tree, exact in any order, then over the quad), update_max,
 * the scores turned into p in place (score_p), their quad_part_sum then over the quad, l = alpha l +
 * sum. The accumulators are scaled by alpha afterwards (rescale_rows), before P V adds onto them.
 * s(h, j, e): row h's score at this thread's column pair j, element e; the backends' fragment
 * layouts differ, the arithmetic is this one. */
template <int KEYS = BLOCK_N, class Scores>
__device__ __forceinline__ void update_rows(RowPair &st, float c, Scores s, float (&alpha)[2]) {
    float mx[2], ms_new[2], sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mt[KEYS / 8];
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) mt[j] = fmaxf(s(h, j, 0), s(h, j, 1));
#pragma unroll
        for (int w = 1; w < KEYS / 8; w *= 2)
#pragma unroll
            for (int i = 0; i < KEYS / 8; i += 2 * w) mt[i] = fmaxf(mt[i], mt[i + w]);
        mx[h] = mt[0];
    }
#pragma unroll
    for (int x = 1; x <= 2; x *= 2)
#pragma unroll
        for (int h = 0; h < 2; ++h) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], x));
#pragma unroll
    for (int h = 0; h < 2; ++h) alpha[h] = update_max(st.m[h], mx[h], c, ms_new[h]);
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) s(h, j, e) = score_p(s(h, j, e), c, ms_new[h]);
#pragma unroll
    for (int h = 0; h < 2; ++h) sum[h] = quad_part_sum<KEYS>([&](int j, int e) { return s(h, j, e); });
#pragma unroll
    for (int x = 1; x <= 2; x *= 2)
#pragma unroll
        for (int h = 0; h < 2; ++h) sum[h] = __fadd_rn(sum[h], __shfl_xor_sync(0xffffffffu, sum[h], x));
#pragma unroll
    for (int h = 0; h < 2; ++h) st.l[h] = __fmaf_rn(alpha[h], st.l[h], sum[h]);
}

/* The rows' D / 4 accumulators each scaled by its row's alpha (the contract's acc = alpha acc before
 * P V). Skipped when alpha is 1 in every row of the warp: x * 1 == x, so the bits are the same, and
 * after a segment's first block a row's m moves only when a score beats it by RESCALE_THRESHOLD.
 * o(h, j, e): row h's accumulator at column pair j, element e. The whole warp calls it. */
template <int D, class Accs>
__device__ __forceinline__ void rescale_rows(const float (&alpha)[2], Accs o) {
    if (!__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) return;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            o(h, j, 0) = __fmul_rn(o(h, j, 0), alpha[h]);
            o(h, j, 1) = __fmul_rn(o(h, j, 1), alpha[h]);
        }
}

/* One link of the segment merge: a segment with maximum m_g joins a row whose running maximum is m.
 * The row's state becomes x = a x + b y for its l and each accumulator (y the segment's), m_new its
 * maximum. A segment the row cannot see (m_g = -inf) leaves the row untouched: its link is a = 1 and
 * the term fma(1, x, -0) = x, exact for every x. Both exp2s are computed and then selected, so the
 * link has no branch. The factors depend on the maxima alone: the combine kernel computes a row's
 * links in parallel, one a lane, then runs only the chain of terms. */
struct MergeLink {
    float m_new, a, b;
    bool seen;
};

__device__ __forceinline__ MergeLink merge_link(float m, float m_g, float c) {
    MergeLink k;
    k.seen = m_g != -INFINITY;
    k.m_new = fmaxf(m, m_g);
    const float ms_new = scaled(k.m_new, c);
    const float exp_a = exp2_approx(__fsub_rn(scaled(m, c), ms_new));
    const float exp_b = exp2_approx(__fsub_rn(scaled(m_g, c), ms_new));
    const float a = m == -INFINITY ? 0.0f : (k.m_new == m ? 1.0f : exp_a);
    k.a = k.seen ? a : 1.0f;
    k.b = m_g == k.m_new ? 1.0f : exp_b;
    return k;
}

__device__ __forceinline__ float merge_term(float a, float b, bool seen, float x, float y) {
    return __fmaf_rn(a, x, seen ? __fmul_rn(b, y) : -0.0f);
}

/* Merges a segment state (m_g, l_g, acc_g) into a row state (m, l, o), N columns of the row: the
 * prefill kernel calls this at a segment's end, and the combine kernel runs the same links (combine_row),
 * so the merge is the same rounded sequence in both schedules. */
template <int N>
__device__ __forceinline__ void merge_segment(float &m, float &l, float (&o)[N], float m_g, float l_g,
                                              const float (&acc_g)[N], float c) {
    const MergeLink k = merge_link(m, m_g, c);
    l = merge_term(k.a, k.b, k.seen, l, l_g);
#pragma unroll
    for (int e = 0; e < N; ++e) o[e] = merge_term(k.a, k.b, k.seen, o[e], acc_g[e]);
    m = k.m_new;
}

/* The prefill kernels' segment end for a thread's two rows: each row's ended segment (ended.m, ended.l
 * and its D / 4 accumulators acc(h, j, e)) merged into its row state (row.m, row.l, o(h, j, e)) by
 * merge_segment. o and acc: the backend's places of row h's column pair j, element e (sm80:
 * registers; sm90: o in shared memory). The caller restarts acc for the next segment (sm80 zeroes it;
 * sm90's next P V overwrites it). */
template <int D, class O, class Acc>
__device__ __forceinline__ void merge_segment_rows(RowPair &row, const RowPair &ended, O o, Acc acc, float c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float o_row[D / 4], acc_row[D / 4];
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                o_row[2 * j + e] = o(h, j, e);
                acc_row[2 * j + e] = acc(h, j, e);
            }
        merge_segment<D / 4>(row.m[h], row.l[h], o_row, ended.m[h], ended.l[h], acc_row, c);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) o(h, j, e) = o_row[2 * j + e];
    }
}

/* out = o * (1 / l) and lse = (scaled(m) + log2 l) ln 2; a row that saw no key: out = 0, lse = -inf.
 * Both schedules normalize with this. */
template <int N>
__device__ __forceinline__ void finalize_row(float m, float l, const float (&o)[N], float (&y)[N], float &lse, float c) {
    const bool empty = l == 0.0f;
    const float inv = empty ? 0.0f : __frcp_rn(l);
#pragma unroll
    for (int k = 0; k < N; ++k) y[k] = __fmul_rn(o[k], inv);
    lse = empty ? -INFINITY : __fmul_rn(__fadd_rn(scaled(m, c), log2_approx(l)), LN2);
}

/* ------------------------------------ shared-memory tile loads ------------------------------ */

/* cp.async of ROWS x D tiles of 16-bit elements, 16 bytes per thread and step, into a swizzled tile
 * whose layout is the backend's: Swizzle::at(row, chunk) is the byte offset of 16-byte chunk `chunk`
 * of row `row` (sm80: rows of D elements, chunks XOR row % 8; sm90: the wgmma 128-byte boxes). */

/* Row r from row_ptr(r), or zeros where row_ptr(r) is null (that memory is not read: cp.async with
 * 0 source bytes; `fallback` is any valid address). */
template <int D, int ROWS, int THREADS, class Swizzle, class RowPtr>
__device__ __forceinline__ void load_rows_async(uint32_t smem, RowPtr row_ptr, const void *fallback, int tid) {
    constexpr int CHUNKS_PER_ROW = D / 8;
    static_assert(THREADS % CHUNKS_PER_ROW == 0 && (ROWS * CHUNKS_PER_ROW) % THREADS == 0, "uneven tile load");
    constexpr int ROW_STEP = THREADS / CHUNKS_PER_ROW;
    const int r0 = tid / CHUNKS_PER_ROW, c = tid % CHUNKS_PER_ROW;
#pragma unroll
    for (int i = 0; i < ROWS / ROW_STEP; ++i) {
        const int r = r0 + i * ROW_STEP;
        const uint16_t *src = row_ptr(r);
        cp_async_16(smem + Swizzle::at(r, c), src ? (const void *)(src + 8 * c) : fallback, src ? 16 : 0);
    }
}

/* The rows of a tile this thread copies (r0 + i ROW_STEP, 16-byte chunk c) from a stream of tiles:
 * src points at this thread's chunk of the tile's row r0; rows >= rows_in are zero-filled and not
 * read (`fallback`: any valid address). ROW_STEP is a multiple of 8, so the thread's rows share one
 * swizzle phase (row % 8) and their shared-memory offsets are its first one plus constants. */
template <int D, int ROWS, int THREADS, class Swizzle>
__device__ __forceinline__ void load_thread_rows_async(uint32_t smem, const uint16_t *src, int64_t row_stride,
                                                       int rows_in, const void *fallback, int tid) {
    constexpr int CHUNKS_PER_ROW = D / 8;
    static_assert(THREADS % CHUNKS_PER_ROW == 0 && (ROWS * CHUNKS_PER_ROW) % THREADS == 0, "uneven tile load");
    constexpr int ROW_STEP = THREADS / CHUNKS_PER_ROW;
    static_assert(ROW_STEP % 8 == 0, "a thread's rows share their swizzle phase");
    const int r0 = tid / CHUNKS_PER_ROW, c = tid % CHUNKS_PER_ROW;
    const uint32_t dst = smem + Swizzle::at(r0, c);
    const int live_rows = rows_in - r0;
    /* a whole tile (every block but a sequence's last) copies without a test per row */
    auto copy = [&](auto whole_tile) {
#pragma unroll
        for (int i = 0; i < ROWS / ROW_STEP; ++i) {
            const bool live = whole_tile || i * ROW_STEP < live_rows;
            cp_async_16(dst + Swizzle::at(i * ROW_STEP, 0), live ? (const void *)src : fallback, live ? 16 : 0);
            src += ROW_STEP * row_stride;
        }
    };
    if (rows_in >= ROWS) copy(std::true_type{});
    else copy(std::false_type{});
}

/* ------------------------------------ kernel parameters ------------------------------------- */

/* What the forward and the backward kernels both read of a call (call_params, below, fills it). */
struct CallParams {
    rlk_attention_tensor q, k, v, out, lse;
    Sequences seq;
    int heads_q, heads_kv, group, causal;
    float scale_log2; /* c = softmax_scale * log2(e) */
};

/* ------------------------------------ forward ----------------------------------------------- */

struct FwdParams : CallParams {
    float *partials; /* split: [batch][max_q_len][heads_q][num_segments] records {m, l, 0, 0, acc[D]} */
    int num_segments;
    int64_t rows_total; /* combine: batch * max_q_len * heads_q */
    /* the forward's tiles, numbered x + grid_x (y + grid_y z) over (x, y, z) as fwd_cta reads them */
    int grid_x, grid_y, tiles;
    /* persistent prefill: [0] tickets for the tiles after each CTA's first (zeroed at launch), then
     * two slots per CTA through which its producer publishes its tiles */
    int *tile_counter;
    /* split (sm90): the grid's CTAs of one (row tile, kv head, sequence), its num_segments segments,
     * run as one cluster whose rank 0 merges the rows (combine_row); no combine kernel */
    int cluster_merge;
};

/* The rows and key blocks of a forward tile, decoded from its number (FwdParams: x + grid_x (y +
 * grid_y z)) in the layout launch_fwd gives it (below): prefill (head, row tile counted from the last:
 * the causal tiles with the most keys come first, sequence); split (segment, row tile x kv head,
 * sequence). A non-persistent kernel's tile is its CTA's blockIdx. Tile row r is query (row0 + r) /
 * rows_per_query of head head0 + (row0 + r) % rows_per_query; key blocks [block_begin, block_end). */
struct FwdCta {
    SequenceRange range;
    bool range_ok; /* load_sequence's answer for range (with write_rows) */
    int b, segment, kv_head, head0, row0, rows_per_query, rows_in, block_begin, block_end, causal;

    __device__ __forceinline__ int query_of(int r) const { return (row0 + r) / rows_per_query; }
    __device__ __forceinline__ int head_of(int r) const { return head0 + (row0 + r) % rows_per_query; }
    __device__ __forceinline__ int len_of(int r) const {
        return visible_keys(query_of(r), range.q_len, range.k_len, causal);
    }
};

__device__ __forceinline__ int block_tile() { return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); }

/* The part of fwd_cta that the tile number alone decides (no sequence range): b, segment, kv_head,
 * head0, row0, rows_per_query. The sm90 split kernel starts its first copies from it before the range
 * has loaded. */
template <int ROWS, bool SPLIT>
__device__ __forceinline__ void tile_rows(const FwdParams &p, int tile, FwdCta &cta) {
    const int x = tile % p.grid_x, yz = tile / p.grid_x, y = yz % p.grid_y;
    cta.b = yz / p.grid_y;
    cta.segment = 0;
    if (SPLIT) {
        cta.segment = x;
        cta.kv_head = y % p.heads_kv;
        cta.row0 = (y / p.heads_kv) * ROWS;
        cta.rows_per_query = p.group;
        cta.head0 = cta.kv_head * p.group;
    } else {
        cta.head0 = x;
        cta.kv_head = cta.head0 / p.group;
        cta.row0 = (p.grid_y - 1 - y) * ROWS;
        cta.rows_per_query = 1;
    }
}

/* Fills cta for tile `tile` of the ROWS-row tiles; false when it has nothing to do (its sequence's
 * query range is out of bounds, its tile past the sequence's rows, or its segment past the keys its
 * rows see: a prefill tile whose rows see no key still writes them). */
template <int ROWS, bool SPLIT, int KEYS = BLOCK_N>
__device__ __forceinline__ bool fwd_cta(const FwdParams &p, int tile, FwdCta &cta) {
    tile_rows<ROWS, SPLIT>(p, tile, cta);
    cta.range_ok = load_sequence(p.seq, cta.b, cta.range, true);
    if (!cta.range_ok) return false;
    cta.causal = p.causal;
    cta.rows_in = min(ROWS, cta.range.q_len * cta.rows_per_query - cta.row0);
    if (cta.rows_in <= 0) return false;
    /* rows are in increasing query order, so the last row sees the most keys */
    cta.block_begin = 0;
    cta.block_end = (cta.len_of(cta.rows_in - 1) + KEYS - 1) / KEYS;
    if (SPLIT) {
        cta.block_begin = cta.segment * (SEGMENT / KEYS);
        if (cta.block_begin >= cta.block_end) return false;
        cta.block_end = min(cta.block_end, cta.block_begin + SEGMENT / KEYS);
    }
    return true;
}

__device__ __forceinline__ const uint16_t *row_address(const rlk_attention_tensor &t, int b, int64_t row, int head) {
    return (const uint16_t *)t.data + b * t.batch_stride + row * t.row_stride + head * t.head_stride;
}

/* Split schedule: the workspace's records of row (b, i, head), segment s's {m, l, 0, 0, acc[D]} at
 * + s (D + 4) floats (row_records), and the one a tile's segment writes (segment_record: its query i and
 * head, the caller passes the two it has) */
template <int D>
__device__ __forceinline__ float *row_records(const FwdParams &p, int b, int i, int head) {
    return p.partials + (((int64_t)b * p.seq.max_q_len + i) * p.heads_q + head) * p.num_segments * (D + 4);
}
template <int D>
__device__ __forceinline__ float *segment_record(const FwdParams &p, const FwdCta &cta, int i, int head) {
    return row_records<D>(p, cta.b, i, head) + (int64_t)cta.segment * (D + 4);
}

/* Split schedule, the merge of row (b, i, head): its segment records 0 .. ceil(L / 512) - 1 merged in
 * order and normalized, with the prefill kernel's merge_segment and finalize_row; lane j of D / 4
 * threads holds columns 4 j .. 4 j + 3. range: sequence b's, as load_sequence (write_rows) gave it to
 * the caller. The combine kernel calls it, and so does (sm90) the split kernel's rank 0 when the
 * segments ran as one cluster, with the range its tile loaded (a second load of it sat in that
 * merge's dependent chain). */
template <bool BF16, int D>
__device__ __forceinline__ void combine_row(const FwdParams &p, const SequenceRange &range, int b, int i, int head,
                                            int j) {
    if (i >= range.q_len) return;
    constexpr int LANES = D / 4, RECORD = D + 4, CHUNK = 16;
    static_assert(LANES >= CHUNK && LANES <= 32, "a chunk's links are lanes of the row's group");
    const int segments = (visible_keys(i, range.q_len, range.k_len, p.causal) + SEGMENT - 1) / SEGMENT;
    const float *const records = row_records<D>(p, b, i, head);
    /* the row's LANES lanes of its warp (D = 64: two rows a warp) */
    const int first_lane = (threadIdx.x & 31) & ~(LANES - 1);
    const unsigned group = LANES == 32 ? 0xffffffffu : ((1u << LANES) - 1) << first_lane;

    /* The merge is a serial chain; a load per link made it latency-bound (43 us for the 64 segments
     * of a 32k cache). CHUNK segments at a time, the next chunk's records asked into L1 meanwhile
     * (each lane a 32-byte sector in turn; the whole row at once measured slower at B = 16 over 32k):
     * the loads of a chunk together (unconditional, the last segment's again past it, so that no
     * branch sinks a load to its use); lane k computes link s0 + k's factors from the running
     * maximum before it (an inclusive scan of the chunk's maxima: max is exact, so any order gives
     * the serial chain's values; only a zero's sign could differ, and neither a factor nor the lse
     * depends on it); then every lane runs the chain of terms for its 4 columns, the links in
     * order, their factors shuffled. */
    const auto prefetch_chunk = [&](int s0) { /* segments s0 .. s0 + CHUNK - 1 of the row's, into L1 */
        const char *const bytes = (const char *)records;
        const int64_t end = (int64_t)min(s0 + CHUNK, segments) * RECORD * 4;
        for (int64_t x = (int64_t)s0 * RECORD * 4 + 32 * j; x < end; x += 32 * LANES) prefetch_l1(bytes + x);
    };
    prefetch_chunk(0);
    const float c = p.scale_log2;
    float m = -INFINITY, l = 0.0f, o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s0 = 0; s0 < segments; s0 += CHUNK) {
        const float *const rec = records + (int64_t)s0 * RECORD;
        prefetch_chunk(s0 + CHUNK);
        const int last = segments - 1 - s0;
        float4 acc[CHUNK];
#pragma unroll
        for (int k = 0; k < CHUNK; ++k) acc[k] = *(const float4 *)(rec + min(k, last) * RECORD + 4 + 4 * j);
        const float2 st = *(const float2 *)(rec + min(j, last) * RECORD);
        /* past the chunk or the row's last segment: a segment the row cannot see */
        const float m_g = j < CHUNK && j <= last ? st.x : -INFINITY;
        float incl = m_g;
#pragma unroll
        for (int d = 1; d < CHUNK; d *= 2) {
            const float t = __shfl_up_sync(group, incl, d, LANES);
            if (j >= d) incl = fmaxf(incl, t);
        }
        const float before = __shfl_up_sync(group, incl, 1, LANES);
        const MergeLink link = merge_link(j == 0 ? m : fmaxf(m, before), m_g, c);
        const unsigned seen = __ballot_sync(group, link.seen) >> first_lane;
#pragma unroll
        for (int k = 0; k < CHUNK; ++k) {
            const float a = __shfl_sync(group, link.a, k, LANES), b = __shfl_sync(group, link.b, k, LANES);
            const float l_g = __shfl_sync(group, st.y, k, LANES);
            const bool seen_k = (seen >> k) & 1u;
            l = merge_term(a, b, seen_k, l, l_g);
            o[0] = merge_term(a, b, seen_k, o[0], acc[k].x);
            o[1] = merge_term(a, b, seen_k, o[1], acc[k].y);
            o[2] = merge_term(a, b, seen_k, o[2], acc[k].z);
            o[3] = merge_term(a, b, seen_k, o[3], acc[k].w);
        }
        m = fmaxf(m, __shfl_sync(group, incl, CHUNK - 1, LANES));
    }
    float y[4], lse;
    finalize_row<4>(m, l, o, y, lse, p.scale_log2);
    uint16_t *dst = (uint16_t *)row_address(p.out, b, range.q_start + i, head) + 4 * j;
    *(uint2 *)dst = make_uint2(pack_half2<BF16>(y[0], y[1]), pack_half2<BF16>(y[2], y[3]));
    if (j == 0 && p.lse.data)
        ((float *)p.lse.data)[b * p.lse.batch_stride + (range.q_start + i) * p.lse.row_stride +
                              head * p.lse.head_stride] = lse;
}

/* Split schedule, second kernel: combine_row for every row (b, i, head), D / 4 threads per row. */
template <bool BF16, int D>
__global__ void __launch_bounds__(128) attention_combine_kernel(const FwdParams p) {
    constexpr int LANES = D / 4, ROWS_PER_CTA = 128 / LANES;
    const int64_t row = (int64_t)blockIdx.x * ROWS_PER_CTA + threadIdx.x / LANES;
    if (row >= p.rows_total) return;
    const int64_t bi = row / p.heads_q;
    const int b = (int)(bi / p.seq.max_q_len);
    SequenceRange range;
    const bool range_ok = load_sequence(p.seq, b, range, true);
    /* launched as a programmatic dependent of the split kernel (launch_fwd): its CTAs may start before
     * the split kernel ends; this waits until it has ended and its records are visible. The sequence
     * range is the call's input, written before the split kernel started, so it is loaded before. */
    wait_for_dependency();
    if (!range_ok) return;
    combine_row<BF16, D>(p, range, b, (int)(bi % p.seq.max_q_len), (int)(row % p.heads_q), threadIdx.x % LANES);
}

/* ------------------------------------ backward ---------------------------------------------- */

constexpr float LOG2E = 1.4426950408889634f;

struct BwdParams : CallParams {
    rlk_attention_tensor dout, dq, dk, dv;
    float scale;
    float2 *stats;   /* [batch][heads_q][stats_pitch] {lse * log2(e), sum_d dout * out} */
    int stats_pitch; /* max_q_len rounded up to even: two rows are one 16-byte chunk */
    /* the backward's one grid (launch_bwd): CTAs 0 .. dkdv_ctas - 1 are dK/dV key tiles (key_tile), the
     * others dQ row tiles (query_tile); key_tiles / row_tiles per (sequence, head) */
    int key_tiles, row_tiles, dkdv_ctas;
    /* sm90: TMA maps in boxes of a backward block's rows (the backend's Backward fills them and sets
     * tma; else every block is copied by cp.async): Q and dO (coordinates: column, row, query head,
     * sequence x q_map_batch), K and V (column, row, kv head, sequence x k_map_batch) */
    CUtensorMap q_map, do_map, k_map, v_map;
    int tma, q_map_batch, k_map_batch;
};

/* The backward's first kernel, shared by the backends: 8 threads per (b, h, i) row: D = sum_d
 * dout * out (each thread its 16-byte chunks j, j + 8, ... in order, then an xor tree of which
 * thread 0's result is kept) and lse in log2 units. */
template <bool BF16, int D>
__global__ void __launch_bounds__(256) attention_bwd_prep_kernel(const BwdParams p, int64_t rows_total) {
    const int64_t row = (int64_t)blockIdx.x * 32 + threadIdx.x / 8;
    const int j = threadIdx.x % 8;
    const int i = (int)(row % p.stats_pitch);
    const int64_t bh = row / p.stats_pitch;
    const int head = (int)(bh % p.heads_q), b = (int)(bh / p.heads_q);
    SequenceRange range;
    bool live = row < rows_total; /* every lane stays for the shuffles */
    if (live) live = load_sequence(p.seq, b, range) && i < range.q_len;
    const int64_t q_row = live ? range.q_start + i : 0;
    float d = 0.0f;
    if (live) {
        const uint16_t *o = row_address(p.out, b, q_row, head), *g = row_address(p.dout, b, q_row, head);
#pragma unroll
        for (int c = j; c < D / 8; c += 8) {
            const uint4 ov = *(const uint4 *)(o + 8 * c), gv = *(const uint4 *)(g + 8 * c);
            const uint16_t *oh = (const uint16_t *)&ov, *gh = (const uint16_t *)&gv;
#pragma unroll
            for (int e = 0; e < 8; ++e)
                d = __fmaf_rn(half_bits_to_float<BF16>(gh[e]), half_bits_to_float<BF16>(oh[e]), d);
        }
    }
    d = __fadd_rn(d, __shfl_xor_sync(0xffffffffu, d, 4));
    d = __fadd_rn(d, __shfl_xor_sync(0xffffffffu, d, 2));
    d = __fadd_rn(d, __shfl_xor_sync(0xffffffffu, d, 1));
    if (live && j == 0) {
        const float lse = ((const float *)p.lse.data)[b * p.lse.batch_stride + q_row * p.lse.row_stride +
                                                      head * p.lse.head_stride];
        p.stats[row] = make_float2(__fmul_rn(lse, LOG2E), d);
    }
}

/* The grid launch_bwd lays out, decoded. dK/dV CTA number cta = x + key_tiles (kv_head + heads_kv b)
 * owns keys key0 = x ROWS .. key0 + keys_in - 1 of (sequence b, kv head) and walks, for each query head
 * of the group in increasing order, the 64-query blocks qb_begin .. qb_begin + qb_count - 1 (counted
 * from the sequence's first query) that can see key0. dQ CTA number cta = head + heads_q (y +
 * row_tiles b) owns query rows q0 .. q0 + rows_in - 1, row tile y counted from the last (the causal
 * tiles with the most keys start first). Both false when the CTA has nothing to do. */
struct KeyTile {
    SequenceRange range;
    int b, kv_head, key0, keys_in, qb_begin, qb_count;
};

template <int ROWS>
__device__ __forceinline__ bool key_tile(const BwdParams &p, int cta, KeyTile &t) {
    t.b = cta / (p.key_tiles * p.heads_kv);
    if (!load_sequence(p.seq, t.b, t.range)) return false;
    const int q_len = t.range.q_len, k_len = t.range.k_len;
    t.kv_head = cta / p.key_tiles % p.heads_kv;
    t.key0 = cta % p.key_tiles * ROWS;
    if (t.key0 >= k_len) return false;
    t.keys_in = min(ROWS, k_len - t.key0);
    const int first_query = p.causal ? max(0, t.key0 - (k_len - q_len)) : 0;
    t.qb_begin = first_query / BLOCK_N;
    t.qb_count = first_query < q_len ? (q_len + BLOCK_N - 1) / BLOCK_N - t.qb_begin : 0;
    return true;
}

struct QueryTile {
    SequenceRange range;
    int b, head, q0, rows_in, causal;
    /* the keys tile row r sees */
    __device__ __forceinline__ int len_of(int r) const { return visible_keys(q0 + r, range.q_len, range.k_len, causal); }
};

template <int ROWS>
__device__ __forceinline__ bool query_tile(const BwdParams &p, int cta, QueryTile &t) {
    t.b = cta / (p.heads_q * p.row_tiles);
    if (!load_sequence(p.seq, t.b, t.range)) return false;
    t.head = cta % p.heads_q;
    t.q0 = (p.row_tiles - 1 - cta / p.heads_q % p.row_tiles) * ROWS;
    t.causal = p.causal;
    t.rows_in = min(ROWS, t.range.q_len - t.q0);
    return t.rows_in > 0;
}

/* Stores one row of D values, rounded to the dtype, that the 4 lanes of a quad hold in the MMA
 * accumulator layout of both backends (lane q: column 8 j + 2 q + e in y[2 j + e]); all 4 lanes call
 * it. Each 4 x 4 block of packed column pairs (j = 4 m .. 4 m + 3) is transposed across the quad by two
 * xor shuffles, so that lane q stores the 16 bytes of columns 8 (4 m + q) .. + 7 with one store: 16-byte
 * stores of whole 32-byte sectors instead of 4-byte stores of half sectors (the prefill forward's
 * epilogue 5% faster at T = 1k, docs/perf-notes.md). row: the row's first element, 16-byte aligned. */
template <bool BF16, int D>
__device__ __forceinline__ void store_quad_row(uint16_t *row, const float (&y)[D / 4], int lane) {
    const int q = lane & 3;
    const unsigned quad = 0xfu << (lane & ~3);
#pragma unroll
    for (int m = 0; m < D / 32; ++m) {
        uint32_t a[4]; /* a[k]: this lane's columns of j = 4 m + k; after the transpose, lane k's of j = 4 m + q */
#pragma unroll
        for (int k = 0; k < 4; ++k) a[k] = pack_half2<BF16>(y[2 * (4 * m + k)], y[2 * (4 * m + k) + 1]);
#pragma unroll
        for (int bit = 1; bit <= 2; bit <<= 1)
#pragma unroll
            for (int k0 = 0; k0 < 4; ++k0) {
                if (k0 & bit) continue;
                const int k1 = k0 | bit;
                const bool upper = q & bit; /* keeps a[k1], gives a[k0] to lane q ^ bit */
                const uint32_t received = __shfl_xor_sync(quad, upper ? a[k0] : a[k1], bit);
                if (upper) a[k0] = received;
                else a[k1] = received;
            }
        *(uint4 *)(row + 8 * (4 * m + q)) = make_uint4(a[0], a[1], a[2], a[3]);
    }
}

/* Stores a thread's two rows of an MMA accumulator tile (row h: first_row + thread_row + 8 h, when
 * thread_row + 8 h < rows_in) times scale, rounded to the dtype. c(h, j, e): row h's accumulator at
 * column 8 j + 2 (lane % 4) + e, the layout of both backends' fragments. */
template <bool BF16, int D, class Accs>
__device__ __forceinline__ void store_acc_rows(const rlk_attention_tensor &t, int b, int64_t first_row, int head,
                                               int rows_in, int thread_row, int lane, float scale, Accs c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (thread_row + 8 * h >= rows_in) continue;
        float y[D / 4];
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) y[2 * j + e] = __fmul_rn(c(h, j, e), scale);
        store_quad_row<BF16, D>((uint16_t *)row_address(t, b, first_row + thread_row + 8 * h, head), y, lane);
    }
}

/* ------------------------------------ host -------------------------------------------------- */

enum FwdSchedule { SCHEDULE_AUTO = 0, SCHEDULE_PREFILL = 1, SCHEDULE_SPLIT = 2 };

bool layout_ok(const rlk_attention_tensor &t) {
    return (uintptr_t)t.data % 16 == 0 && t.batch_stride % 8 == 0 && t.row_stride % 8 == 0 && t.head_stride % 8 == 0;
}

/* What the kernels take: dtype, head_dim, head grouping, 16-byte rows, grid limits; backward:
 * also dout, dq, dk, dv and an lse. Every backend's forward checks exactly this, so which backend
 * runs a call never depends on its row counts. */
bool supported(const rlk_attention_args *a, bool backward) {
    if (a->dtype != RLK_BF16 && a->dtype != RLK_F16) return false;
    if (a->head_dim != 64 && a->head_dim != 128) return false;
    if (a->batch < 0 || a->batch > 65535 || a->heads_kv < 1 || a->heads_q % a->heads_kv != 0 || a->heads_q > 65535)
        return false;
    if (a->max_q_len < 0 || a->max_k_len < 0 || a->max_q_len > (1 << 22) || a->max_k_len > (1 << 30)) return false;
    if (!layout_ok(a->q) || !layout_ok(a->k) || !layout_ok(a->v) || !layout_ok(a->out)) return false;
    /* (a call without query rows has an empty lse: no storage) */
    if (backward && (!layout_ok(a->dout) || !layout_ok(a->dq) || !layout_ok(a->dk) || !layout_ok(a->dv) ||
                     (!a->lse.data && a->max_q_len > 0)))
        return false;
    return true;
}

FwdSchedule pick_schedule(const rlk_attention_args *a, int forced) {
    if (forced == SCHEDULE_PREFILL || forced == SCHEDULE_SPLIT) return (FwdSchedule)forced;
    /* a scheduling choice only: both give the same bits */
    return a->max_q_len * (a->heads_q / a->heads_kv) <= SPLIT_ROWS ? SCHEDULE_SPLIT : SCHEDULE_PREFILL;
}

int64_t split_segments(const rlk_attention_args *a) { return (a->max_k_len + SEGMENT - 1) / SEGMENT; }

/* The split schedule's row tiles per (kv head, sequence): SPLIT_ROWS (query, head in group) rows each. */
int64_t split_row_tiles(const rlk_attention_args *a) {
    return (a->max_q_len * (a->heads_q / a->heads_kv) + SPLIT_ROWS - 1) / SPLIT_ROWS;
}

int64_t split_workspace_bytes(const rlk_attention_args *a) {
    return a->batch * a->max_q_len * a->heads_q * split_segments(a) * (a->head_dim + 4) * (int64_t)sizeof(float);
}

Sequences sequences(const rlk_attention_args *a) {
    Sequences s;
    s.q_start = a->q_start;
    s.q_len = a->q_len;
    s.k_start = a->k_start;
    s.k_len = a->k_len;
    s.max_q_len = a->max_q_len;
    s.max_k_len = a->max_k_len;
    s.q_rows = a->q_rows;
    s.k_rows = a->k_rows;
    s.bad_index = a->bad_index;
    return s;
}

CallParams call_params(const rlk_attention_args *a) {
    CallParams p;
    p.q = a->q;
    p.k = a->k;
    p.v = a->v;
    p.out = a->out;
    p.lse = a->lse;
    p.seq = sequences(a);
    p.heads_q = (int)a->heads_q;
    p.heads_kv = (int)a->heads_kv;
    p.group = (int)(a->heads_q / a->heads_kv);
    p.causal = a->causal != 0;
    p.scale_log2 = (float)((double)(float)a->softmax_scale * 1.4426950408889634);
    return p;
}

/* The forward of a backend on `stream`: the prefill kernel over the tiles (head, 64- or 128-row tile,
 * sequence), or the split kernel over (segment, row tile x kv head, sequence) and then the combine
 * kernel (none when the segments are at most merge_cluster_max and the grid is one wave: the split
 * kernel's clusters merge).
 * Tiles<D, SPLIT> is the backend's tile plan (ROWS, THREADS, SMEM_BYTES, MIN_CTAS,
 * PERSISTENT, HEADS_FIRST: a split grid without clusters launched (row tile x kv head, segment,
 * sequence), so that the CTAs running at once read the same key range of every kv head); prefill
 * and split are its prefill and split-KV kernels.
 * A PERSISTENT prefill plan gets MIN_CTAS CTAs per SM (fewer when there are fewer tiles; at most
 * PERSISTENT_CTAS_MAX), each taking tile blockIdx.x first and then tickets from a counter in the
 * workspace (persistent_workspace_bytes; the counter zeroed here). The prefill kernel's parameters are
 * PrefillParams, FwdParams or a backend's extension of it that prepare_prefill (null: none) fills
 * (sm90: the TMA maps). */
template <bool BF16, int D, template <int, bool> class Tiles, class PrefillParams = FwdParams>
int launch_fwd(const rlk_attention_args *a, FwdSchedule schedule, cudaStream_t stream,
               void (*prefill)(PrefillParams), void (*split)(FwdParams), bool dependent_combine, int merge_cluster_max,
               void (*prepare_prefill)(PrefillParams &, const rlk_attention_args *) = nullptr) {
    static_assert(Tiles<D, true>::ROWS == SPLIT_ROWS, "pick_schedule sizes the split schedule by its CTA rows");
    static_assert(!Tiles<D, true>::PERSISTENT, "the split schedule's grid is a CTA per tile");
    FwdParams p{call_params(a)};
    p.partials = (float *)a->workspace;
    p.num_segments = (int)split_segments(a);
    p.cluster_merge = 0;
    p.rows_total = a->batch * a->max_q_len * a->heads_q;
    p.tile_counter = nullptr;
    if (p.rows_total == 0) return RLK_OK;

    cudaError_t err;
    if (schedule == SCHEDULE_PREFILL) {
        using PrefillTiles = Tiles<D, false>;
        const int64_t row_tiles = (a->max_q_len + PrefillTiles::ROWS - 1) / PrefillTiles::ROWS;
        const int64_t tiles = row_tiles * a->heads_q * a->batch;
        if (row_tiles > 65535 || tiles > INT32_MAX) return RLK_UNSUPPORTED;
        p.grid_x = p.heads_q;
        p.grid_y = (int)row_tiles;
        p.tiles = (int)tiles;
        err = cudaFuncSetAttribute(prefill, cudaFuncAttributeMaxDynamicSharedMemorySize, PrefillTiles::SMEM_BYTES);
        if (err != cudaSuccess) return (int)err;
        dim3 grid((unsigned)a->heads_q, (unsigned)row_tiles, (unsigned)a->batch);
        if (PrefillTiles::PERSISTENT) {
            int device, sms;
            err = current_device(&device, &sms);
            p.tile_counter = (int *)a->workspace;
            if (err == cudaSuccess) err = cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream);
            if (err != cudaSuccess) return (int)err;
            const int ctas = std::min(sms * PrefillTiles::MIN_CTAS, PERSISTENT_CTAS_MAX);
            grid = dim3((unsigned)std::min<int64_t>(tiles, ctas));
        }
        PrefillParams prefill_params{p};
        if (prepare_prefill) prepare_prefill(prefill_params, a);
        prefill<<<grid, PrefillTiles::THREADS, PrefillTiles::SMEM_BYTES, stream>>>(prefill_params);
        return (int)cudaGetLastError();
    }
    using SplitTiles = Tiles<D, true>;
    const int64_t row_tiles = split_row_tiles(a);
    if (row_tiles * a->heads_kv > 65535) return RLK_UNSUPPORTED;
    p.grid_x = p.num_segments;
    p.grid_y = (int)(row_tiles * a->heads_kv);
    p.tiles = (int)(p.grid_x * row_tiles * a->heads_kv * a->batch);
    if (p.num_segments > 0) {
        err = cudaFuncSetAttribute(split, cudaFuncAttributeMaxDynamicSharedMemorySize, SplitTiles::SMEM_BYTES);
        if (err != cudaSuccess) return (int)err;
        /* merge_cluster_max (sm90): up to that many segments run as one cluster per (row tile, kv head,
         * sequence) and merge there, when the grid is one wave: the combine kernel's launch and its
         * wait for the split grid's end cost a one-wave decode more than the merge inside (H100, 1k
         * cache: B = 16 32.9 -> 32.3 us), while in a grid of several waves a rank 0 waiting for its
         * cluster holds a CTA slot (B = 64: 103 -> 107 us) */
        if (p.num_segments <= merge_cluster_max) {
            int device, sms;
            err = current_device(&device, &sms);
            if (err != cudaSuccess) return (int)err;
            p.cluster_merge = p.tiles <= sms * SplitTiles::MIN_CTAS;
        }
        cudaLaunchAttribute cluster;
        cluster.id = cudaLaunchAttributeClusterDimension;
        cluster.val.clusterDim.x = (unsigned)p.num_segments;
        cluster.val.clusterDim.y = 1;
        cluster.val.clusterDim.z = 1;
        cudaLaunchConfig_t config = {};
        config.gridDim = SplitTiles::HEADS_FIRST && !p.cluster_merge
                             ? dim3((unsigned)(row_tiles * a->heads_kv), (unsigned)p.num_segments, (unsigned)a->batch)
                             : dim3((unsigned)p.num_segments, (unsigned)(row_tiles * a->heads_kv), (unsigned)a->batch);
        config.blockDim = dim3(SplitTiles::THREADS);
        config.dynamicSmemBytes = SplitTiles::SMEM_BYTES;
        config.stream = stream;
        config.attrs = &cluster;
        config.numAttrs = p.cluster_merge ? 1 : 0;
        err = cudaLaunchKernelEx(&config, split, p);
        if (err != cudaSuccess || p.cluster_merge) return (int)err;
    }
    /* dependent_combine (a split kernel that triggers its dependents as it starts, sm90): the combine
     * kernel is launched as a programmatic dependent, so its launch and CTA start-up overlap the split
     * kernel and it waits (griddepcontrol.wait) only for that kernel's end; a B = 1 decode is a few
     * microseconds long, and this was one launch gap of it */
    constexpr int ROWS_PER_CTA = 128 / (D / 4);
    cudaLaunchAttribute programmatic;
    const cudaLaunchConfig_t config =
        launch_config_dependent(dim3((unsigned)((p.rows_total + ROWS_PER_CTA - 1) / ROWS_PER_CTA)), dim3(128), stream,
                                dependent_combine && p.num_segments > 0, &programmatic);
    return (int)cudaLaunchKernelEx(&config, attention_combine_kernel<BF16, D>, p);
}

/* A backend's forward entry point (rlk_attention_fwd_<arch>_forced): the layout check, the schedule
 * (forced: 1 the prefill kernel, 2 the split-KV kernels, 0 as pick_schedule decides; the bits do not
 * depend on it), the kernel's name and, when planning, the workspace (split: the segment records;
 * prefill: Forward::prefill_workspace_bytes(), a persistent plan's tile queue); then the backend's
 * Forward<BF16, D>::run (launch_fwd with its tile plan and kernels) for the dtype and head dim. */
template <template <bool, int> class Forward>
int attention_fwd_entry(const rlk_attention_args *args, rlk_context *ctx, int forced, const char *prefill_kernel,
                        const char *split_kernel) {
    if (!supported(args, false)) return RLK_UNSUPPORTED;
    const FwdSchedule s = pick_schedule(args, forced);
    ctx->kernel = s == SCHEDULE_SPLIT ? split_kernel : prefill_kernel;
    if (ctx->plan_only) {
        ctx->workspace_bytes = s == SCHEDULE_SPLIT        ? split_workspace_bytes(args)
                               : args->head_dim == 64 ? Forward<true, 64>::prefill_workspace_bytes()
                                                      : Forward<true, 128>::prefill_workspace_bytes();
        return RLK_OK;
    }
    cudaStream_t stream = (cudaStream_t)ctx->stream;
    const bool bf16 = args->dtype == RLK_BF16;
    if (args->head_dim == 64)
        return bf16 ? Forward<true, 64>::run(args, s, stream) : Forward<false, 64>::run(args, s, stream);
    return bf16 ? Forward<true, 128>::run(args, s, stream) : Forward<false, 128>::run(args, s, stream);
}

/* The backward's parameters from the call's arguments (stats: the workspace). */
BwdParams bwd_params(const rlk_attention_args *a) {
    BwdParams p{call_params(a)};
    p.dout = a->dout;
    p.dq = a->dq;
    p.dk = a->dk;
    p.dv = a->dv;
    p.scale = (float)a->softmax_scale;
    p.stats = (float2 *)a->workspace;
    p.stats_pitch = (int)((a->max_q_len + 1) & ~(int64_t)1);
    return p;
}

/* The backward as one launch: the dK/dV CTAs first, then the dQ CTAs, which need nothing the dK/dV
 * CTAs write, so they take the SMs that dK/dV's causal tail (the last kv heads' long key tiles)
 * would leave idle. kernel(p) runs CTA blockIdx.x as key_tile / query_tile decode it. Tiles is the
 * backend's plan (ROWS keys or query rows per CTA, THREADS, DKDV_SMEM_BYTES, DQ_SMEM_BYTES). */
template <class Tiles>
int launch_bwd(BwdParams p, const rlk_attention_args *a, cudaStream_t stream, void (*kernel)(BwdParams)) {
    const int64_t key_tiles = (a->max_k_len + Tiles::ROWS - 1) / Tiles::ROWS;
    const int64_t row_tiles = (a->max_q_len + Tiles::ROWS - 1) / Tiles::ROWS;
    const int64_t dkdv_ctas = key_tiles * a->heads_kv * a->batch, dq_ctas = row_tiles * a->heads_q * a->batch;
    if (dkdv_ctas + dq_ctas > INT32_MAX) return RLK_UNSUPPORTED;
    if (dkdv_ctas + dq_ctas == 0) return RLK_OK;
    p.key_tiles = (int)key_tiles;
    p.row_tiles = (int)row_tiles;
    p.dkdv_ctas = (int)dkdv_ctas;
    const int smem = Tiles::DKDV_SMEM_BYTES > Tiles::DQ_SMEM_BYTES ? Tiles::DKDV_SMEM_BYTES : Tiles::DQ_SMEM_BYTES;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return (int)err;
    kernel<<<(unsigned)(dkdv_ctas + dq_ctas), Tiles::THREADS, smem, stream>>>(p);
    return (int)cudaGetLastError();
}

/* A backend's backward entry point (rlk_attention_bwd_<arch>): the layout check, the kernel's name
 * and, when planning, the row-statistics workspace; then the prep kernel (above) and the backend's
 * Backward<BF16, D>::run (launch_bwd of its attention_bwd_kernel) for the dtype and head dim. */
template <template <bool, int> class Backward>
int attention_bwd_entry(const rlk_attention_args *args, rlk_context *ctx, const char *kernel) {
    if (!supported(args, true)) return RLK_UNSUPPORTED;
    ctx->kernel = kernel;
    if (ctx->plan_only) {
        ctx->workspace_bytes = args->batch * args->heads_q * ((args->max_q_len + 1) & ~(int64_t)1) * (int64_t)sizeof(float2);
        return RLK_OK;
    }
    if (args->batch == 0) return RLK_OK;
    cudaStream_t stream = (cudaStream_t)ctx->stream;
    const bool bf16 = args->dtype == RLK_BF16;
    const BwdParams p = bwd_params(args);
    const int64_t stat_rows = args->batch * args->heads_q * p.stats_pitch;
    if (stat_rows > 0) {
        auto prep = args->head_dim == 64 ? (bf16 ? attention_bwd_prep_kernel<true, 64> : attention_bwd_prep_kernel<false, 64>)
                                         : (bf16 ? attention_bwd_prep_kernel<true, 128> : attention_bwd_prep_kernel<false, 128>);
        prep<<<(unsigned)((stat_rows + 31) / 32), 256, 0, stream>>>(p, stat_rows);
        const cudaError_t err = cudaGetLastError();
        if (err != cudaSuccess) return (int)err;
    }
    if (args->head_dim == 64) return bf16 ? Backward<true, 64>::run(p, args, stream) : Backward<false, 64>::run(p, args, stream);
    return bf16 ? Backward<true, 128>::run(p, args, stream) : Backward<false, 128>::run(p, args, stream);
}

}  // namespace

#endif /* RLK_CUDA_ATTENTION_CUH_ */
