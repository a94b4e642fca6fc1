/* sm90/attention.cu: prefill/decode-invariant attention, forward and backward, on the Hopper tensor
 * cores (wgmma, sm_90a). The contract is csrc/ops/attention.h.
 *
 * Forward. Per query row: keys cut into segments of 512 at absolute positions 0, 512, ..., each cut
 * into blocks of 128 (FWD_KEYS; sm80 and the CPU reference fold blocks of 64); a segment's softmax
 * state (m, l, acc) is built block by block from empty, and
 * the segments' states are merged in increasing order into the row state, which is normalized at the
 * end. Two schedules run that same arithmetic:
 *   attention_fwd_kernel (fwd_pipeline<SPLIT = false>: prefill, training, chunked prefill):
 *     persistent, one CTA per SM taking tiles of 128 query rows of one (sequence, head) one after the
 *     other (its blockIdx.x, then tickets from an atomic counter, in the order of the heaviest causal
 *     tiles first): two consumer warpgroups of 64 rows (one wgmma m64 tile each) and a producer warpgroup
 *     (setmaxnreg: 48 registers, consumers 224) that streams each tile's blocks of 128 keys into a
 *     4-stage ring completing on mbarriers (full: the producer's copies have landed and were fenced for
 *     the tensor cores; empty: every consumer warp is done with the stage): whole blocks by TMA (a 4-D
 *     map over K or V: column, row, kv head, sequence), a sequence's last, partial block by cp.async
 *     zero-filling the rows past k_len; one stream across the tiles, so the next tile's first blocks
 *     load while the consumers finish the current one. A block's K and its V are separate ring items
 *     (32 KB each at d = 128): K(t) is freed once S of block t has read it, so K(t + 1) loads while the
 *     consumers still hold V(t - 1). Each consumer warpgroup copies its own 64 Q rows into its own
 *     slab of the Q tile, the next tile's under the current one's epilogue.
 *     Every tile is stored in the wgmma 128-byte swizzle (boxes of rows x 64 elements, 16-byte chunk c
 *     of row r at chunk c ^ (r % 8)). Per block and warpgroup: S = Q K^T (wgmma m64n128k16 over
 *     head_dim; Q from its slab and K from its stage, both in shared memory, K-major), the
 *     online-softmax update in registers, then
 *     acc = alpha acc + P V (wgmma m64n{d}k16 with P rounded to the dtype as the register A operand
 *     and V as an MN-major B operand). A consumer issues S of block t and then P V of block t - 1 as
 *     two wgmma groups, then runs block t's softmax. The source orders that softmax before the wait
 *     for P V, but ptxas hoists the wait above it; forcing it back measured no faster (perf-notes).
 *     The two consumers are not synchronized with each other, so one's softmax runs under the other's
 *     wgmmas. At
 *     each segment end the warpgroup merges the segment state into the row state (its o kept in
 *     shared memory, touched only there) and restarts the segment from empty; after its last block it
 *     normalizes and writes out and lse. A warpgroup skips the blocks none of its rows can see (the
 *     causal diagonal) but still waits for and releases them; the heaviest causal tiles start first.
 *   attention_fwd_split_kernel (fwd_pipeline<SPLIT = true>) + attention_combine_kernel (split-KV
 *     decode): a CTA of one consumer warpgroup and the producer owns one (sequence, kv head, segment) and
 *     64 rows made of the group's G query heads of consecutive queries (row = query * G + head in group),
 *     so one K/V read serves the whole group; its producer copies every block by cp.async. Two variants,
 *     the same S per score (a wgmma's A operand from registers or from shared memory gives the same
 *     products; the GPU tests compare decode with the prefill bitwise): one CTA an SM with 4 stages and Q
 *     in registers, which the launcher takes when the grid fits one wave of them (B = 1 decode: the
 *     shortest chain per block), else two CTAs an SM with 3 stages and S reading Q from the slab (the
 *     registers of two CTAs leave none for Q's fragments: ptxas serialized the wgmmas). It writes the
 *     segment state of each row (m, l, acc[head_dim], fp32) to the workspace; the combine kernel
 *     (cuda/attention.cuh, as sm80's) merges each row's segments in increasing order and normalizes
 *     (head_dim / 4 threads per row, 4 columns each; a chunk's link factors one a lane, then the
 *     chain). It is launched as a programmatic dependent of the split kernel, which triggers it as it
 *     starts, so its launch overlaps the split kernel (griddepcontrol). When a call's keys are at most
 *     MERGE_CLUSTER_MAX segments (caches up to 4096 keys) and its grid is one wave, no combine kernel
 *     runs: the segments of one (row tile, kv head, sequence) are one thread-block cluster, and its rank
 *     0 merges the rows with the combine kernel's combine_row once every rank's records are written
 *     (merge_in_cluster). A grid without clusters runs kv heads first, (row tile x kv head, segment,
 *     sequence) (FwdTiles::HEADS_FIRST), so that a wave's CTAs read whole rows of the cache. Over a
 *     cache (sequences starting at storage row 0) the producer copies its first block before the
 *     sequence range has loaded (copy_first_block_early).
 *   The launcher takes the split schedule when max_q_len * G <= 64 (decode, speculative or short
 *   chunks), the prefill schedule otherwise; rlk_attention_fwd_sm90_forced takes either on request.
 *   When max_q_len * G <= 8 (decode with G <= 8) the split kernel's FEW_ROWS instantiation runs
 *   (few_rows_consumer): S^T = K Q^T and O^T = V^T P^T with the tile's rows as wgmma's N = 8, the
 *   same bits as the 64-row products at an eighth of their tensor work, the prefill's softmax
 *   arithmetic in that transposed layout.
 * Shared memory (d = 128 / 64): prefill Q tile (a 64-row slab per warpgroup) 32 / 16 KB + 4 stages of
 * K or V 128 / 64 KB + row states' o 64 / 32 KB, one CTA per SM; split Q 16 / 8 KB + 4 or 3 stages
 * 128 or 96 / 64 or 48 KB; + 1 KB in which the mbarriers sit and the tiles align to 1024 bytes.
 * Registers (ptxas, sm_90a, no spills): prefill 168 at entry (consumers then 224; producer 48), split
 * one an SM 240, two an SM 128 (consumer 208), combine 121 / 128.
 * Speed, what limits it and what was tried: docs/perf-notes.md ("Attention forward on wgmma");
 * tables in docs/benchmarks.md (benchmarks/bench_attention.py).
 *
 * Backward (deterministic: fixed loops, no atomics; the kernels' own comment, at "backward" below,
 * has the detail): the shared prep kernel (cuda/attention.cuh) writes each row's {lse log2(e), D =
 * sum dout out}; then attention_bwd_kernel, one grid of dK/dV CTAs (bwd_dkdv_cta: a CTA owns 128 keys
 * of one (sequence, kv head), K and V resident, the group's query heads and their 64-query blocks
 * streamed in increasing order: S^T, dP^T, dV += P^T dO, dK += dS^T Q) followed by dQ CTAs (bwd_dq_cta:
 * a CTA owns 128 query rows, Q and dO resident, the 64-key blocks streamed in increasing order: S, dP,
 * dQ += dS K), each with two consumer warpgroups and a cp.async producer warpgroup on the forward's
 * ring. The dQ CTAs read nothing the dK/dV CTAs write, so in one grid they fill the SMs that the
 * dK/dV CTAs' causal tail leaves idle. Shared memory (d = 128): dK/dV 64 KB resident + 3 x 32 KB ring
 * + 2 KB row stats, dQ 64 KB + 3 x 32 KB. Registers: producer 24, consumers 240 (dK/dV peaks at ~230
 * at d = 128; ptxas serializes the wgmmas below that), no spills.
 * Why the two schedules give the same bits for a row:
 *   - the block update (block_scores, block_operands, then issue_pv), the segment merge
 *     (merge_segment) and the normalization (finalize_row; all in cuda/attention.cuh, the sm80
 *     kernels' source too) are each one function, every product and sum in them an explicitly
 *     rounded intrinsic (no contraction choice left to the compiler), exp2 is ex2.approx.ftz;
 *   - a row's S and P V are wgmma m64 chains in one fixed order (S: the head_dim k16 steps from
 *     zero, N = 128; P V: the block's 8 key k16 steps onto the rescaled acc, N = head_dim) in both
 *     schedules; a wgmma row depends only on its own A row, so the rows packed beside it (other
 *     queries, other heads, padding, the other warpgroup) do not matter; the row max/sum combine only
 *     the row's own values (the thread's columns in a fixed order, then quad shuffles xor 1, xor 2);
 *   - block and segment boundaries are absolute key positions; which blocks a warpgroup visits depends
 *     on the other rows of its tile, but a block a row cannot see is an exact no-op for it (s = -inf,
 *     p = 0, alpha = 1 selected, l + 0, acc * 1 + 0 * v with V zero-filled past k_len: cp.async with
 *     0 source bytes, so stale NaN in a cache is never read) and a segment it cannot see is skipped by
 *     the merge (m = -inf).
 * The row's bits therefore depend only on its own q, the keys/values it sees, head_dim and dtype: not
 * on batch size, packing, padding, q_len (full vs chunked prefill vs decode) or schedule. They differ
 * from the sm80 kernels' bits (other MMA instructions).
 *
 * Layout requirements (else RLK_UNSUPPORTED, the sm80 fallback then runs): the sm80 kernels' exactly,
 * one supported() in cuda/attention.cuh (bf16/fp16, head_dim 64 or 128, heads_q a multiple of
 * heads_kv, 16-byte aligned data pointers and batch/row/head strides multiples of 8 elements, lse any
 * fp32 strides), so whether the fallback runs depends on dtype and head_dim only. Every kernel checks
 * its sequence's ranges (0 <= len <= max_len, 0 <= start, start + len <= rows; load_sequence) and
 * skips a sequence that breaks them, raising *bad_index (one whose key range alone breaks them runs
 * with no keys instead, its rows written as out 0, lse -inf); a null range array reads as
 * csrc/ops/attention.h says.
 *
 * Build (object, ptxas report; the wgmma header is generated):
 *   python3 csrc/cuda/sm90/wgmma_gen.py build/gen && nvcc -c csrc/cuda/sm90/attention.cu -o /tmp/a90.o \
 *     -O3 -std=c++17 -lineinfo -Xcompiler -fPIC --expt-relaxed-constexpr -Xptxas -v -Icsrc -Ibuild/gen \
 *     -gencode arch=compute_90a,code=sm_90a
 * Test (GPU): python3 -m pytest tests/test_gpu_attention.py -m gpu -k sm90 (accuracy of out and the
 *   gradients vs fp64, bitwise prefill == chunked prefill == decode, packing / padding for out and
 *   the gradients, stale NaN, deterministic backward); benchmarks/bench_attention.py.
 */
#include <math.h>
#include <stdint.h>

#include "../../ops/attention.h"
#include "../attention.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

namespace {

static_assert(BLOCK_N == 64, "the backward's key and query tiles are 64 rows (wgmma n64 for S, 4 k16 steps of P V)");
/* The forward's key block, the contract's fold unit on sm90: 128 keys (wgmma n128 for S, 8 k16 steps of
 * P V): half the per-key row work of 64-key blocks, and half the blocks in a decode segment's
 * sequential chain. sm80 and the CPU reference fold BLOCK_N = 64 keys; each backend's bits are its own. */
constexpr int FWD_KEYS = 2 * BLOCK_N;
static_assert(SEGMENT % FWD_KEYS == 0, "a segment is whole forward blocks");

constexpr int TILE_ALIGN = 1024; /* 128-byte swizzle atoms: 8 rows x 128 bytes */
/* split schedule: up to this many segments (caches up to 4k keys) merge in the split kernel's
 * clusters, one per (row tile, kv head, sequence) (merge_in_cluster); 8 is the portable cluster size */
constexpr int MERGE_CLUSTER_MAX = 8;

/* ------------------------------------ shared-memory tiles ----------------------------------- */

/* A ROWS x D tile of 16-bit elements is D / 64 boxes of ROWS rows x 128 bytes, one after the other
 * (box j holds columns 64 j .. 64 j + 63), in the wgmma 128-byte swizzle: 16-byte chunk c of a row
 * (c < D / 8) sits in box c / 8 at chunk (c % 8) ^ (row % 8). Tiles start 1024-aligned. */
template <int ROWS>
struct BoxSwizzle {
    static __device__ __forceinline__ uint32_t at(int row, int chunk) {
        return (uint32_t)((chunk >> 3) * (ROWS * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
    }
};

/* Every kernel's shared memory: its mbarriers at the start, its tiles from the next TILE_ALIGN boundary. */
__device__ __forceinline__ uint32_t first_tile(uint32_t barriers, int barrier_bytes) {
    return (barriers + barrier_bytes + TILE_ALIGN - 1) & ~(uint32_t)(TILE_ALIGN - 1);
}

/* wgmma descriptors into these tiles, as SmemDesc bases that each wgmma advances by a byte offset.
 * K-major operand (Q as A, K as B of S = Q K^T): a 64-row slab of a tile whose boxes are BOX bytes
 * apart; k16 step kk of head_dim at box kk / 4, 32 bytes per k16 inside the 128-byte row; 8-row
 * groups 1024 bytes apart.
 * MN-major operand (V as B of P V: k = keys, n = head_dim): k16 step t = tile rows 16 t .. 16 t + 15,
 * 64-column boxes ROWS * 128 bytes apart (ROWS: the tile's keys), 8-key groups 1024 bytes apart. */
__device__ __forceinline__ SmemDesc k_major_desc(uint32_t rows) { return SmemDesc(rows, 16, 1024); }
template <int ROWS = BLOCK_N>
__device__ __forceinline__ SmemDesc mn_major_desc(uint32_t tile) { return SmemDesc(tile, ROWS * 128, 1024); }

template <uint32_t BOX>
__device__ __forceinline__ uint32_t k_major_step(int kk) {
    return (kk >> 2) * BOX + (kk & 3) * 32;
}

/* ------------------------------------ the K/V ring ----------------------------------------- */

/* A ring of STAGES shared-memory stages between a producer warpgroup (cp.async) and consumer warps,
 * on two mbarriers per stage: full (the producer's copies have landed and were fenced for the tensor
 * cores: its 128 threads arrive) and empty (every consumer warp is done with the stage: lane 0 of
 * each arrives). Item j of a stream uses stage j % STAGES, on barrier phase (j / STAGES) & 1 (items
 * are unsigned: j % STAGES is then one instruction, not a signed remainder's several). */
template <int STAGES>
struct Ring {
    uint32_t full_bar, empty_bar; /* STAGES barriers each, 8 bytes apart */

    __device__ __forceinline__ void init(int consumer_warps) const {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + 8 * s, 128);
            mbar_init(empty_bar + 8 * s, consumer_warps);
        }
    }
    /* producer warpgroup: for the items first + j, j < count, waits until the item's stage is free,
     * issues load(j, stage) (this thread's cp.async copies), and once item j - 1's copies have landed
     * (cp.async.wait_group, then fence.proxy.async so the tensor cores see them) marks that item full;
     * on return every item is marked full. Item j - 1 is marked before the wait for a stage that is not
     * free yet, so a consumer waiting for it is not held until another consumer frees a stage, and one
     * that holds all but one stage while it waits for it (a consumer running S a block ahead would)
     * cannot deadlock. The first `issued` items were copied before the call (copy_first_block_early),
     * one commit group each, into stages known free: produce only marks them. */
    template <class Load>
    __device__ __forceinline__ void produce(uint32_t first, int count, Load load, int issued = 0) const {
        auto mark_full = [&](uint32_t item) {
            fence_proxy_async_smem();
            mbar_arrive(full_bar + 8 * (item % STAGES));
        };
        for (int j = 0; j < count; ++j) {
            const int s = (first + j) % STAGES;
            const uint32_t free_parity = (((first + j) / STAGES) & 1) ^ 1;
            const bool mark_first = j >= issued && j > 0 && !mbar_ready(empty_bar + 8 * s, free_parity);
            if (mark_first) {
                cp_async_wait<0>();
                mark_full(first + j - 1);
            }
            if (j >= issued) {
                mbar_wait(empty_bar + 8 * s, free_parity);
                load(j, s);
                cp_async_commit();
            }
            if (j > 0 && !mark_first) {
                cp_async_wait<1>();
                mark_full(first + j - 1);
            }
        }
        if (count > 0) {
            cp_async_wait<0>();
            mark_full(first + count - 1);
        }
    }
    __device__ __forceinline__ void wait_full(uint32_t j) const {
        mbar_wait(full_bar + 8 * (j % STAGES), (j / STAGES) & 1);
    }
    __device__ __forceinline__ void release(uint32_t j, int lane) const {
        if (lane == 0) mbar_arrive(empty_bar + 8 * (j % STAGES));
    }
};

/* Rows row .. row + ROWS - 1 of (head, sequence) of a tensor by TMA from `map` into the tile at dst: D / 64
 * boxes of ROWS rows x 128 bytes, as BoxSwizzle<ROWS> lays them out, their bytes counted on mbarrier bar
 * (the caller raises its expected bytes: the ring's full barriers then complete once the producer
 * warpgroup's 128 threads have arrived and the bytes have landed, Ring::produce). One thread issues it. */
template <int D, int ROWS>
__device__ __forceinline__ void tma_load_rows(uint32_t dst, const CUtensorMap *map, int row, int head, int batch,
                                              uint32_t bar) {
#pragma unroll
    for (int box = 0; box < D / 64; ++box) tma_load_4d(dst + box * ROWS * 128, map, 64 * box, row, head, batch, bar);
}

/* ------------------------------------ forward ----------------------------------------------- */

/* The wgmmas of one block, issued into the current commit group (the caller fences and commits).
 * S = Q K^T: one chain per score over the head_dim k16 steps in increasing order, from zero; q: the
 * warpgroup's 64 Q rows in a tile whose boxes are Q_BOX bytes apart; k: the block's K tile
 * (stage_bytes past the ring's). */
template <bool BF16, int D, uint32_t Q_BOX, int KEYS = BLOCK_N>
__device__ __forceinline__ void issue_scores(float (&s)[KEYS / 2], const SmemDesc &q, const SmemDesc &k,
                                             uint32_t stage_bytes) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        wgmma_k16<KEYS, BF16, 0, 0>(s, q.at(k_major_step<Q_BOX>(kk)),
                                    k.at(stage_bytes + k_major_step<KEYS * 128>(kk)), kk > 0);
}

/* The same S = Q K^T with Q as the register A operand (the forward): qa[kk], this thread's fragments of
 * the warpgroup's 64 Q rows for k16 step kk (load_q_fragments), so each wgmma reads only K from shared
 * memory and takes one descriptor. */
template <bool BF16, int D, int KEYS>
__device__ __forceinline__ void issue_scores_qreg(float (&s)[KEYS / 2], const uint32_t (&qa)[D / 16][4],
                                                  const SmemDesc &k, uint32_t stage_bytes) {
    const SmemDesc stage = k.plus(stage_bytes);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        wgmma_k16_rs<KEYS, BF16, 0>(s, qa[kk], stage.at(k_major_step<KEYS * 128>(kk)), kk > 0);
}

/* This thread's A fragments of a warp's 16 rows (row0 ..) of a warpgroup's 64 x D Q slab in the box
 * swizzle, by ldmatrix: lane l addresses row row0 + l % 8 (+ 8 for l % 16 >= 8) at 16-byte chunk 2 kk
 * (+ 1 for l >= 16), so matrix i of k16 step kk lands in qa[kk][i] as wgmma_k16_rs wants it. */
template <int D>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qa)[D / 16][4], uint32_t q_slab, int row0, int lane) {
    const int row = row0 + (lane & 15);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4<false>(qa[kk], q_slab + BoxSwizzle<64>::at(row, 2 * kk + (lane >> 4)));
}

/* acc += round(P) V over the block's 4 key k16 steps in order (pa: P's A fragments; v: the block's V
 * tile, stage_bytes past the ring's); fresh: the block starts a segment, whose acc starts from P V
 * (the first step's scale-d 0) instead of from zeroed registers. */
template <bool BF16, int D, int KEYS = BLOCK_N>
__device__ __forceinline__ void issue_pv(float (&acc)[D / 2], const uint32_t (&pa)[KEYS / 16][4], const SmemDesc &v,
                                         uint32_t stage_bytes, bool fresh = false) {
    const SmemDesc stage = v.plus(stage_bytes);
#pragma unroll
    for (int t = 0; t < KEYS / 16; ++t)
        wgmma_k16_rs<D, BF16, 1>(acc, pa[t], stage.at(t * 16 * 128), t > 0 || !fresh);
}

/* x (a 64 x 64 accumulator tile) rounded to the dtype as the A fragments of a product over its 64
 * columns: k16 step t is the accumulator columns 16 t .. 16 t + 15, the register A fragment layout */
template <bool BF16, int KEYS = BLOCK_N>
__device__ __forceinline__ void to_a_fragments(const float (&x)[KEYS / 2], uint32_t (&a)[KEYS / 16][4]) {
#pragma unroll
    for (int t = 0; t < KEYS / 16; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) a[t][i] = pack_half2<BF16>(x[8 * t + 2 * i], x[8 * t + 2 * i + 1]);
}

/* The contract's block update between S and P V, for one warpgroup's 64 rows, in two parts, the
 * first ordered before the wait for the previous block's P V (ptxas may hoist that wait):
 * block_scores: masks s, updates the state (m, l) and turns s into p (alpha: the rows' rescale);
 * block_operands (once that P V has landed): acc = alpha acc (not for a segment's first block,
 * fresh: its P V starts acc, issue_pv), and round(P) as the A fragments of the next P V. key0: the
 * absolute position of the block's first key; row_len: the visible keys of the thread's two rows;
 * masked: some row of the warpgroup cannot see the whole block. Accumulator layout (wgmma): this
 * thread holds of row h (0: 16 w + lane / 4, 1: + 8) the columns 8 j + 2 (lane % 4) + e in
 * x[4 j + 2 h + e]. */
__device__ __forceinline__ void block_scores(float (&s)[FWD_KEYS / 2], int lane, int key0, const int (&row_len)[2],
                                             bool masked, float c, RowPair &st, float (&alpha)[2]) {
    auto scores = [&](int h, int j, int e) -> float & { return s[4 * j + 2 * h + e]; };
    if (masked) mask_block<FWD_KEYS>(lane, key0, row_len, scores);
    update_rows<FWD_KEYS>(st, c, scores, alpha);
}

template <bool BF16, int D>
__device__ __forceinline__ void block_operands(const float (&s)[FWD_KEYS / 2], const float (&alpha)[2],
                                               float (&acc)[D / 2], uint32_t (&pa)[FWD_KEYS / 16][4], bool fresh) {
    if (!fresh) rescale_rows<D>(alpha, [&](int h, int j, int e) -> float & { return acc[4 * j + 2 * h + e]; });
    to_a_fragments<BF16, FWD_KEYS>(s, pa);
}

/* cp.async of a warpgroup's 64 Q rows, tile rows row0 .. row0 + 63 (row r: query cta.query_of(r),
 * head cta.head_of(r); zeros past rows_in), into its slab by its 128 threads (wg_tid). The prefill's
 * rows are consecutive queries of one head: a thread's rows are one pointer stepped by a stride, where
 * the general form divides by rows_per_query for each row (the prefill kernel 4,896 -> 4,440 SASS
 * instructions; 4% of the forward at T = 1k, docs/perf-notes.md) */
template <int D, bool SPLIT>
__device__ __forceinline__ void load_q_slab_async(uint32_t q_slab, const FwdParams &p, const FwdCta &cta, int row0,
                                                  int wg_tid) {
    /* this thread's 16-byte chunk c of the slab rows r0, r0 + ROW_STEP, ... (load_rows_async's map) */
    constexpr int CHUNKS_PER_ROW = D / 8, ROW_STEP = 128 / CHUNKS_PER_ROW;
    const int r0 = wg_tid / CHUNKS_PER_ROW, c = wg_tid % CHUNKS_PER_ROW;
    if constexpr (!SPLIT) {
        const uint16_t *src = row_address(p.q, cta.b, cta.range.q_start + cta.row0 + row0 + r0, cta.head0) + 8 * c;
        load_thread_rows_async<D, 64, 128, BoxSwizzle<64>>(q_slab, src, p.q.row_stride, cta.rows_in - row0, p.q.data,
                                                           wg_tid);
        return;
    }
    /* split: row x = query * rows_per_query + head; a thread's rows are ROW_STEP apart, so its
     * (query, head) steps by (ROW_STEP / rows_per_query, ROW_STEP % rows_per_query) with one carry,
     * from one division */
    const int g = cta.rows_per_query, x0 = cta.row0 + row0 + r0;
    int query = x0 / g, head = x0 - query * g;
    const int step_q = ROW_STEP / g, step_h = ROW_STEP - step_q * g;
#pragma unroll
    for (int i = 0; i < 64 / ROW_STEP; ++i) {
        const int r = r0 + i * ROW_STEP;
        const bool live = row0 + r < cta.rows_in;
        const uint16_t *src = row_address(p.q, cta.b, cta.range.q_start + query, cta.head0 + head) + 8 * c;
        cp_async_16(q_slab + BoxSwizzle<64>::at(r, c), live ? (const void *)src : p.q.data, live ? 16 : 0);
        query += step_q;
        head += step_h;
        if (head >= g) head -= g, ++query;
    }
}

/* Consumer warpgroups of 64 rows (prefill 2, one CTA per SM: the two accumulator sets take ~200
 * registers a thread; split 1, two CTAs per SM) and one producer warpgroup that streams the K and V
 * blocks into a ring of STAGES stages. setmaxnreg moves registers from the producer (PRODUCER_REGS)
 * to the consumers (CONSUMER_REGS) from the even share the launch bounds give (ENTRY_REGS).
 * Shared memory: the mbarriers and tile slots, then from the next TILE_ALIGN boundary the Q tile,
 * the ring ((K, V) per stage) and (prefill) the row states' o; the barriers live in the
 * alignment slack (the dynamic shared memory starts 1024-aligned in practice; the kernel traps if it
 * ever did not leave them room). */
template <int D, bool SPLIT, int SPLIT_CTAS = 2>
struct FwdTiles {
    static constexpr int WARPGROUPS = SPLIT ? 1 : 2;
    static constexpr int ROWS = 64 * WARPGROUPS;
    static constexpr int CONSUMER_THREADS = 128 * WARPGROUPS;
    static constexpr int THREADS = CONSUMER_THREADS + 128;
    /* ring items: K of a block, then its V. A split CTA alone on its SM takes 4 stages and Q in registers
     * (the shortest chain per block: B = 1); two an SM take 3 stages. Those and the prefill read Q from
     * its slab: its 32 registers a consumer thread are worth more to the prefill's loop (1-2% faster)
     * than the shorter S chain, and two split CTAs an SM have no registers left for it */
    static constexpr int STAGES = SPLIT && SPLIT_CTAS == 2 ? 3 : 4;
    static constexpr bool Q_IN_SMEM = !SPLIT || SPLIT_CTAS == 2;
    static constexpr int KV_BYTES = FWD_KEYS * D * 2; /* one K or V block */
    static constexpr int Q_SLAB_BYTES = 64 * D * 2; /* a consumer warpgroup's 64 Q rows */
    static constexpr int Q_BYTES = WARPGROUPS * Q_SLAB_BYTES;
    static constexpr int RING_BYTES = STAGES * KV_BYTES;
    /* prefill: the row states' o (fp32, D / 2 per consumer thread, float4s [row][column quad][thread]),
     * touched only at segment ends, so they do not take registers from the pipeline */
    static constexpr int O_BYTES = SPLIT ? 0 : CONSUMER_THREADS * (D / 2) * 4;
    /* the ring's 2 STAGES mbarriers, tile_free, tile_ready[2], split: merge (merge_in_cluster) */
    static constexpr int BARRIER_BYTES = 2 * STAGES * 8 + (SPLIT ? 4 : 3) * 8;
    static constexpr int SMEM_BYTES = TILE_ALIGN + Q_BYTES + RING_BYTES + O_BYTES;
    static constexpr int MIN_CTAS = SPLIT ? SPLIT_CTAS : 1;
    /* prefill: one CTA per SM takes tile after tile (launch_fwd); split: a CTA per tile */
    static constexpr bool PERSISTENT = !SPLIT;
    /* a split grid without clusters runs kv heads first: the CTAs of a wave then read whole rows of
     * the cache's [row][kv head][d] storage, not every 8th 256-byte piece of them (perf-notes, "kv
     * heads first") */
    static constexpr bool HEADS_FIRST = true;
    static constexpr int ENTRY_REGS = (65536 / (THREADS * MIN_CTAS)) & ~7;
    static constexpr int PRODUCER_REGS = 48;
    static constexpr int CONSUMER_REGS = std::min(240, (ENTRY_REGS + (ENTRY_REGS - PRODUCER_REGS) / WARPGROUPS) & ~7);
};

/* The prefill kernel's parameters: FwdParams and TMA maps over K and V (fwd_kv_maps fills them and sets
 * kv_tma; else every key block is copied by cp.async), boxes of a key block's rows x 64 columns of one
 * kv head at coordinates (column, row, kv head, sequence x kv_map_batch: 0 where the sequences share one
 * storage) */
struct PrefillParams : FwdParams {
    CUtensorMap k_map, v_map;
    int kv_tma, kv_map_batch;
};

/* Split schedule in clusters (FwdParams::cluster_merge): the grid's segments of one (row tile, kv head,
 * sequence) are the CTAs of one cluster, rank = segment. Each consumer thread, its records written
 * (or none: a CTA without work), arrives on rank 0's merge barrier with release semantics; rank 0's
 * consumer warpgroup waits for all of them and merges the tile's rows with the combine kernel's
 * combine_row, which reads the records back from global memory (L2). A rank other than 0 may exit
 * at once: only its own shared memory would make it wait, and nobody reads that. range, range_ok: the
 * tile's sequence range as fwd_cta loaded it. */
template <bool BF16, int D>
__device__ __forceinline__ void merge_in_cluster(const FwdParams &p, const SequenceRange &range, bool range_ok,
                                                 uint32_t merge_bar, int tid) {
    cluster_wait(); /* the barrier's init */
    mbar_arrive_release_cluster(merge_bar, 0);
    if (cluster_ctarank() != 0) return;
    mbar_wait<true>(merge_bar, 0);
    if (!range_ok) return;
    constexpr int LANES = D / 4;
    const int kv_head = blockIdx.y % p.heads_kv, row0 = (blockIdx.y / p.heads_kv) * SPLIT_ROWS;
    for (int r = tid / LANES; r < SPLIT_ROWS; r += 128 / LANES) {
        const int i = (row0 + r) / p.group;
        if (i >= p.seq.max_q_len) break;
        combine_row<BF16, D>(p, range, blockIdx.z, i, kv_head * p.group + (row0 + r) % p.group, tid % LANES);
    }
}

/* A split CTA's tile number as fwd_cta numbers them: block_tile(), or, in a grid without clusters
 * (kv heads first, HEADS_FIRST), block_tile's with x and y swapped. */
__device__ __forceinline__ int split_tile(const FwdParams &p) {
    return p.cluster_merge ? block_tile() : (int)(blockIdx.y + gridDim.y * (blockIdx.x + gridDim.x * blockIdx.z));
}

/* Split over sequences that start at storage row 0 (k_start null: a KV cache or a padded batch): K and
 * V of the tile's first block (its segment's block 0, keys SEGMENT x .. + FWD_KEYS - 1) copied by this
 * producer thread into the ring's stages 0 and 1, one commit group each, before the sequence range has
 * loaded: at decode that load (load_sequence) is ~1,400 cycles of a CTA's ~20,000, and the block's
 * copies waited behind it. Only when those rows lie inside the storage (k_rows), whatever the range
 * turns out to be. Returns the ring items issued (2, or 0). The copies are the bytes Ring::produce
 * would copy for a whole block; the caller waits for them and copies again when the range makes the
 * block partial (rows past k_len must be zeros). */
template <int D, int KV_BYTES>
__device__ __forceinline__ int copy_first_block_early(const FwdParams &p, uint32_t kv_ring, int ptid) {
    if (p.seq.k_start) return 0;
    FwdCta cta;
    tile_rows<SPLIT_ROWS, true>(p, split_tile(p), cta);
    const int64_t row0 = (int64_t)cta.segment * SEGMENT;
    if (row0 + FWD_KEYS > p.seq.k_rows) return 0;
    /* the range's entries asked for first: its load then does not queue behind these copies */
    auto prefetch = [&](const int32_t *entries) {
        if (entries) prefetch_l1(entries + cta.b);
    };
    prefetch(p.seq.q_start);
    prefetch(p.seq.q_len);
    prefetch(p.seq.k_len);
    const int64_t thread_row = row0 + ptid / (D / 8);
    const int thread_col = 8 * (ptid % (D / 8));
    using KvRows = BoxSwizzle<FWD_KEYS>;
    load_thread_rows_async<D, FWD_KEYS, 128, KvRows>(kv_ring, row_address(p.k, cta.b, thread_row, cta.kv_head) + thread_col,
                                                     p.k.row_stride, FWD_KEYS, p.k.data, ptid);
    cp_async_commit();
    load_thread_rows_async<D, FWD_KEYS, 128, KvRows>(kv_ring + KV_BYTES,
                                                     row_address(p.v, cta.b, thread_row, cta.kv_head) + thread_col,
                                                     p.v.row_stride, FWD_KEYS, p.v.data, ptid);
    cp_async_commit();
    return 2;
}

/* The split kernel for tiles of at most 8 rows (FEW_ROWS: max_q_len * G <= 8, decode with G <= 8).
 * wgmma's M is 64 rows, so S = Q K^T over such a tile would spend 64-row products (1,024 tensor
 * cycles a block of 128 keys at d = 128) on 8 rows or fewer. Here both products run transposed,
 * the tile's rows as wgmma's N = 8:
 *   S^T = K Q^T: two m64n8 chains a block (keys 0-63, 64-127 as M; K from its stage, Q's 8 rows from
 *     shared memory, both K-major), each score one chain over the head_dim k16 steps from zero;
 *   O^T = alpha O^T + V^T P^T: D / 64 m64n8 chains (head_dim as M: V's stage read MN-major, the
 *     prefill's B operand transposed; round(P) from shared memory, K-major), the block's 8 key k16
 *     steps in order onto the rescaled O^T (a segment's first block from scale-d 0).
 * A wgmma output element is a function of its own A row and B column (the GEMM's swapped tiles rely
 * on the same: out^T = W X^T gives out's bits), so S and O are the prefill's to the bit. The softmax
 * keeps the prefill's arithmetic (update_max, score_p, quad_part_sum; cuda/attention.cuh) in this
 * layout: thread (warp w, lane l) holds the scores of keys 64 T + 16 w + l / 4 + 8 h of rows 2 (l % 4)
 * + e. Per block: the masked scores' maxima over the thread's 4 keys, the warp's lanes (xor 4, 8, 16)
 * and the 4 warps (shared memory, a warpgroup barrier), which is exact in any order; each thread's
 * update_max for its two rows; p into shared memory, rounded (P's tile) and fp32 (a barrier); O^T
 * rescaled and V^T P^T issued; then, while it runs, the rows' sums of p in the prefill's order: lane l
 * of warp w adds chain w of quad_part_sum for row l / 4 as the prefill's quad lane l % 4 would (its
 * keys 8 j + 2 (l % 4) + e, j of one parity, e one element), and warp 0, a barrier later (the next
 * block's turn, or after the last), adds the four chains as quad_part_sum does, the quad's parts over
 * xor 1, xor 2, l = alpha l + sum, the row's m and alpha from the same maxima by the same update_max.
 * Shared memory: the Q tile region of the split tiles holds this kernel's (FewRows). */
template <int D>
struct FewRows {
    static constexpr int ROWS = 8;
    static constexpr int Q_BYTES = ROWS * D * 2; /* Q's 8 rows, BoxSwizzle<8> */
    /* round(P), 8 rows x FWD_KEYS keys as BoxSwizzle<8>'s columns */
    static constexpr int P_OFFSET = Q_BYTES;
    /* fp32 p, [row][key], rows P32_PITCH floats apart (4 more than the keys: one store of the quads'
     * rows 2 q + e hits 32 banks) */
    static constexpr int P32_OFFSET = P_OFFSET + ROWS * FWD_KEYS * 2;
    static constexpr int P32_PITCH = FWD_KEYS + 4;
    static constexpr int MAX_OFFSET = P32_OFFSET + ROWS * P32_PITCH * 4; /* block maxima [warp][row] */
    static constexpr int CHAIN_OFFSET = MAX_OFFSET + 4 * ROWS * 4; /* the row sums' chains [warp][lane] */
    static constexpr int BYTES = CHAIN_OFFSET + 4 * 32 * 4;
    static_assert(P_OFFSET % TILE_ALIGN == 0, "P's tile is whole swizzle atoms");
};

/* The tile's rows 0-7 of Q (row r: query cta.query_of(r), head cta.head_of(r); zeros from rows_in
 * on) into q_rows as BoxSwizzle<8>, one 16-byte chunk a thread. */
template <int D>
__device__ __forceinline__ void load_few_q_rows(uint32_t q_rows, const FwdParams &p, const FwdCta &cta, int tid) {
    constexpr int CHUNKS_PER_ROW = D / 8;
    const int r = tid / CHUNKS_PER_ROW, c = tid % CHUNKS_PER_ROW;
    if (r >= FewRows<D>::ROWS) return;
    const bool live = r < cta.rows_in;
    const uint16_t *src = row_address(p.q, cta.b, cta.range.q_start + cta.query_of(r), cta.head_of(r)) + 8 * c;
    cp_async_16(q_rows + BoxSwizzle<FewRows<D>::ROWS>::at(r, c), live ? (const void *)src : p.q.data, live ? 16 : 0);
}

/* The consumer warpgroup of the FEW_ROWS split kernel (above): its tile, whose segment's blocks the
 * producer streams as K(t) = item 2 t, V(t) = item 2 t + 1, and the tile's records. area (area_ptr
 * its generic address): FewRows' shared memory. range, range_ok: the tile's sequence range as
 * fwd_cta loaded it (the cluster merge's). */
template <bool BF16, int D, class Tiles>
__device__ __forceinline__ void few_rows_consumer(const FwdParams &p, const Ring<Tiles::STAGES> &ring, uint32_t kv_ring,
                                                  uint32_t area, unsigned char *area_ptr, int tid,
                                                  SequenceRange &range, bool &range_ok) {
    using L = FewRows<D>;
    using Half = typename std::conditional<BF16, __nv_bfloat16, __half>::type;
    constexpr int STAGES = Tiles::STAGES, KV_BYTES = Tiles::KV_BYTES, D_TILES = D / 64;
    static_assert(L::BYTES <= Tiles::Q_BYTES, "FewRows lives in the split tiles' Q region");
    const int lane = tid & 31, warp = tid >> 5, quad = lane & 3;
    float *const p32 = (float *)(area_ptr + L::P32_OFFSET);
    float *const block_max = (float *)(area_ptr + L::MAX_OFFSET);
    float *const chains = (float *)(area_ptr + L::CHAIN_OFFSET);
    const float c = p.scale_log2;

    /* Q's rows after the range, not with the producer's early first block: copied before it, they
     * waited behind a full wave's first blocks (B = 1 over 8k +3%, docs/perf-notes.md) */
    FwdCta cta;
    const bool has_tile = fwd_cta<SPLIT_ROWS, true, FWD_KEYS>(p, split_tile(p), cta);
    range = cta.range;
    range_ok = cta.range_ok;
    if (!has_tile) return;
    load_few_q_rows<D>(area, p, cta, tid);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async_smem(); /* S^T reads Q from shared memory */
    warpgroup_sync(1);

    const int blocks = __shfl_sync(0xffffffffu, cta.block_end - cta.block_begin, 0);
    int row_len[2]; /* of this thread's rows 2 quad + e */
#pragma unroll
    for (int e = 0; e < 2; ++e) row_len[e] = 2 * quad + e < cta.rows_in ? cta.len_of(2 * quad + e) : 0;
    float m[2] = {-INFINITY, -INFINITY};
    /* warp 0: the state of row lane / 4, whose sum this lane's quad adds */
    const int sum_row = lane >> 2;
    float sum_row_m = -INFINITY, sum_row_l = 0.0f, sum_row_alpha = 0.0f;
    /* warp 0: the sum of the block whose chains the four warps stored last (a barrier since), l = alpha
     * l + sum with that block's alpha */
    auto finish_sum = [&](float block_alpha) {
        const float chain[4] = {chains[lane], chains[32 + lane], chains[64 + lane], chains[96 + lane]};
        float sum = quad_chains_sum(chain);
#pragma unroll
        for (int x = 1; x <= 2; x *= 2) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, x));
        sum_row_l = __fmaf_rn(block_alpha, sum_row_l, sum);
    };

    const SmemDesc k_desc = k_major_desc(kv_ring), v_desc = mn_major_desc<FWD_KEYS>(kv_ring);
    const SmemDesc q_desc = k_major_desc(area), p_desc = k_major_desc(area + L::P_OFFSET);
    auto stage_bytes = [&](uint32_t item) { return (uint32_t)((item % STAGES) * KV_BYTES); };
    float st[2][4], acc[D_TILES][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        st[0][i] = st[1][i] = 0.0f;
#pragma unroll
        for (int d = 0; d < D_TILES; ++d) acc[d][i] = 0.0f;
    }
    auto fence_registers = [&]() {
        fence_accumulators(st[0]);
        fence_accumulators(st[1]);
#pragma unroll
        for (int d = 0; d < D_TILES; ++d) fence_accumulators(acc[d]);
    };

    for (int t = 0; t < blocks; ++t) {
        const uint32_t k_item = 2 * t, v_item = 2 * t + 1;
        ring.wait_full(k_item);
        fence_registers();
        wgmma_fence();
#pragma unroll
        for (int tile = 0; tile < 2; ++tile)
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                wgmma_k16<L::ROWS, BF16, 0, 0>(
                    st[tile], k_desc.at(stage_bytes(k_item) + tile * 64 * 128 + k_major_step<FWD_KEYS * 128>(kk)),
                    q_desc.at(k_major_step<L::ROWS * 128>(kk)), kk > 0);
        wgmma_commit();
        wgmma_wait<0>(); /* S^T of block t, and V^T P^T of block t - 1 */
        fence_registers();
        ring.release(k_item, lane);
        if (t > 0) ring.release(v_item - 2, lane);

        /* the rows' block maxima of the masked scores */
        const int thread_key = (cta.block_begin + t) * FWD_KEYS + 16 * warp + (lane >> 2); /* + 64 tile + 8 h */
        float mx[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            mx[e] = -INFINITY;
#pragma unroll
            for (int tile = 0; tile < 2; ++tile)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float &x = st[tile][2 * h + e];
                    if (thread_key + 64 * tile + 8 * h >= row_len[e]) x = -INFINITY;
                    mx[e] = fmaxf(mx[e], x);
                }
#pragma unroll
            for (int x = 4; x <= 16; x *= 2) mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], x));
        }
        if (lane < 4) *(float2 *)&block_max[warp * L::ROWS + 2 * quad] = make_float2(mx[0], mx[1]);
        warpgroup_sync(1);
        /* row r's maximum over the 4 warps' */
        auto row_max = [&](int r) {
            return fmaxf(fmaxf(block_max[r], block_max[L::ROWS + r]),
                         fmaxf(block_max[2 * L::ROWS + r], block_max[3 * L::ROWS + r]));
        };
        float ms_new[2], alpha[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) alpha[e] = update_max(m[e], row_max(2 * quad + e), c, ms_new[e]);
        if (warp == 0) {
            if (t > 0) finish_sum(sum_row_alpha);
            float unused;
            sum_row_alpha = update_max(sum_row_m, row_max(sum_row), c, unused);
        }
        /* p: rounded into P's tile (V^T P^T's B operand) and fp32 for the sums */
#pragma unroll
        for (int tile = 0; tile < 2; ++tile)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int r = 2 * quad + e, key = 64 * tile + 16 * warp + (lane >> 2) + 8 * h;
                    const float pv = score_p(st[tile][2 * h + e], c, ms_new[e]);
                    st_shared_16(area + L::P_OFFSET + BoxSwizzle<L::ROWS>::at(r, key / 8) + 2 * (key % 8), pv,
                                 (Half *)nullptr);
                    p32[r * L::P32_PITCH + key] = pv;
                }
        fence_proxy_async_smem(); /* V^T P^T reads P's tile */
        warpgroup_sync(1);

        /* O^T = alpha O^T by rescale_rows (its row h: this thread's row 2 quad + h; its column pair j,
         * element e: acc[j][2 e + h]), then + V^T P^T */
        if (t > 0) rescale_rows<8 * D_TILES>(alpha, [&](int h, int j, int e) -> float & { return acc[j][2 * e + h]; });
        ring.wait_full(v_item);
        fence_registers();
        wgmma_fence();
#pragma unroll
        for (int d = 0; d < D_TILES; ++d)
#pragma unroll
            for (int kt = 0; kt < FWD_KEYS / 16; ++kt)
                wgmma_k16<L::ROWS, BF16, 1, 0>(acc[d], v_desc.at(stage_bytes(v_item) + d * FWD_KEYS * 128 + kt * 16 * 128),
                                               p_desc.at(k_major_step<L::ROWS * 128>(kt)), kt > 0 || t > 0);
        wgmma_commit();
        /* while V^T P^T runs: chain `warp` of block t's row sums (lane: row lane / 4 as quad lane
         * lane % 4), which warp 0 adds after the next barrier */
        const float *const row_p = p32 + sum_row * L::P32_PITCH + 2 * quad;
        chains[warp * 32 + lane] = quad_part_chain<FWD_KEYS>(warp, [&](int j, int e) { return row_p[8 * j + e]; });
    }
    wgmma_wait<0>();
    fence_registers();
    ring.release(2 * blocks - 1, lane);
    warpgroup_sync(1); /* the last block's chains */
    if (warp == 0) finish_sum(sum_row_alpha);

    /* the records of the tile's rows */
    auto record = [&](int r) { return segment_record<D>(p, cta, cta.query_of(r), cta.head_of(r)); };
    if (warp == 0 && quad == 0 && sum_row < cta.rows_in) *(float2 *)record(sum_row) = make_float2(sum_row_m, sum_row_l);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int r = 2 * quad + e;
        if (r >= cta.rows_in) continue;
        float *const rec = record(r) + 4 + 16 * warp + (lane >> 2);
#pragma unroll
        for (int d = 0; d < D_TILES; ++d)
#pragma unroll
            for (int h = 0; h < 2; ++h) rec[64 * d + 8 * h] = acc[d][2 * h + e];
    }
}

/* Pipeline, per CTA. The CTA takes tiles (rows of one (sequence, head) or, split, of one (sequence,
 * kv head, segment)) one after the other: a split CTA its blockIdx only; a prefill CTA tile blockIdx.x,
 * then tickets from p.tile_counter, so the grid is one CTA per SM and a CTA's next tile needs no
 * launch. Its blocks' K and V are the items of one ring stream across the tiles (tile n's relative
 * block t: K is item first + 2 t, V item first + 2 t + 1). A prefill CTA's tile n is published by the
 * producer's thread 0: once tile n - 1 is free (tile_free: every warp has read its number) it writes
 * the number (-1: no more tiles) to the CTA's global slot n % 2 in the workspace and arrives on
 * tile_ready[n % 2], on which every thread waits before it reads.
 * (A global slot because compute-sanitizer racecheck does not follow the mbarriers' ordering for
 * shared-memory loads and stores; the mbarriers order the global slot the same way.)
 *   producer warpgroup: for each item j of the tile (K, then V, of each block), waits until stage
 *     j % STAGES is free (empty barrier: every consumer warp has released the item that used it
 *     before), copies the item into it with cp.async (rows past k_len zero-filled, not read), and once
 *     they have landed (cp.async.wait_group, then fence.proxy.async so the tensor cores see them)
 *     arrives on the stage's full barrier. So the next tile's first blocks load while the consumers
 *     finish and store the current one.
 *   consumer warpgroup, per tile: its Q rows (in flight since the previous tile's epilogue; the
 *     first tile's since its start) waited for, left in the slab, which S reads (split alone on its SM:
 *     read into registers as fragments and the slab freed), both behind a warpgroup barrier
 *     (racecheck follows those; it does not follow mbarriers), then turns t = 0 .. nb; turn t waits
 *     for K(t) and V(t - 1), then issues two commit groups: S of block t, then P V of block t - 1.
 *     Once S has landed it frees K(t) and runs the scores part of block t's update (max, alpha, p,
 *     l: block_scores), in the source before it waits for that P V; once P V has landed it frees
 *     V(t - 1), merges a finished segment into the row
 *     state, and rescales acc by block t's alpha (unless block t starts a segment: its P V then
 *     starts acc) and rounds P (block_operands), as the contract's order acc = alpha acc + P V
 *     wants. A warpgroup whose rows cannot see block t (nb <= t) issues nothing for it but still
 *     waits for and frees its K and V, so the barriers' phases stay in step. The two consumer
 *     warpgroups run unsynchronized; their wgmmas and softmaxes interleave on their own (forced
 *     turn-taking with named barriers measured 1-6% slower). */
template <bool BF16, int D, bool SPLIT, bool FEW_ROWS = false, int SPLIT_CTAS = 2, class Params>
__device__ __forceinline__ void fwd_pipeline(const Params &p) {
    using Tiles = FwdTiles<D, SPLIT, SPLIT_CTAS>;
    static_assert(!FEW_ROWS || SPLIT, "few_rows_consumer: a split tile of at most 8 rows (Forward::run)");
    constexpr int ROWS = Tiles::ROWS, STAGES = Tiles::STAGES, KV_BYTES = Tiles::KV_BYTES;
    constexpr int WARPGROUPS = Tiles::WARPGROUPS;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t full_bar = smem_u32(smem_raw);
    const Ring<STAGES> ring{full_bar, full_bar + 8 * STAGES};
    const uint32_t tile_free_bar = full_bar + 16 * STAGES, tile_ready_bar = tile_free_bar + 8; /* + 8 (n % 2) */
    const uint32_t merge_bar = tile_ready_bar + 16;
    const uint32_t q_tile = first_tile(full_bar, Tiles::BARRIER_BYTES);
    const uint32_t kv_ring = q_tile + Tiles::Q_BYTES; /* stage j: K at + 2 j KV_BYTES, V after it */
    if (kv_ring + Tiles::RING_BYTES + Tiles::O_BYTES > full_bar + Tiles::SMEM_BYTES) __trap();

    /* wg, tile, blocks and nb are broadcast from lane 0 (__shfl_sync), so that a warp's lanes agree on
     * them by construction (the result is still a vector register to the compiler: see first_u) */
    const int tid = threadIdx.x, lane = tid & 31, wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int warp_in_wg = (tid >> 5) & 3;
    /* the combine kernel may launch now; it waits for this grid's end before it reads (launch_fwd) */
    if constexpr (SPLIT) asm volatile("griddepcontrol.launch_dependents;");
    if (tid == 0) {
        if constexpr (!SPLIT)
            if (p.kv_tma) {
                prefetch_tensor_map(&p.k_map);
                prefetch_tensor_map(&p.v_map);
            }
        ring.init(4 * WARPGROUPS);
        mbar_init(tile_free_bar, 4 * WARPGROUPS + 4);
        mbar_init(tile_ready_bar, 1);
        mbar_init(tile_ready_bar + 8, 1);
        if constexpr (SPLIT)
            if (p.cluster_merge) {
                mbar_init(merge_bar, 128 * gridDim.x); /* every consumer thread of the cluster's CTAs */
                fence_mbarrier_init();
            }
    }
    __syncthreads(); /* the initialized barriers */
    /* split in clusters: the merge barrier's init ordered before any CTA's arrival on it (cluster_wait,
     * long after this, right before the arrival) */
    if constexpr (SPLIT)
        if (p.cluster_merge) cluster_arrive_relaxed();

    /* prefill: the tile numbers in ticket order (the CTA's first, then one per call), and the first
     * of them from `from` on whose tile has work (-1: none left) */
    auto ticket = [&]() { return (int)gridDim.x + atomicAdd(p.tile_counter, 1); };
    auto first_with_work = [&](int from) {
        FwdCta probe;
        while (from < p.tiles && !fwd_cta<ROWS, SPLIT, FWD_KEYS>(p, from, probe)) from = ticket();
        return from < p.tiles ? from : -1;
    };
    volatile int *tile_slot = Tiles::PERSISTENT ? p.tile_counter + 1 + 2 * blockIdx.x : nullptr; /* + n % 2 */
    /* tile n of this CTA (-1: none): a split CTA's is its blockIdx (n = 0 only; cta filled here, so
     * that a decode's threads decode it once); a prefill CTA's as published (cta filled by the caller) */
    auto tile_of = [&](int n, FwdCta &cta) {
        if constexpr (!Tiles::PERSISTENT) {
            /* without clusters the grid is (row tile x kv head, segment, sequence) (HEADS_FIRST): the
             * same tile number, block_tile's with x and y swapped */
            const int tile = split_tile(p);
            return n == 0 && fwd_cta<ROWS, SPLIT, FWD_KEYS>(p, tile, cta) ? tile : -1;
        }
        mbar_wait(tile_ready_bar + 8 * (n & 1), (n >> 1) & 1);
        return __shfl_sync(0xffffffffu, tile_slot[n & 1], 0);
    };
    /* this warp has read tile n's number */
    auto free_tile = [&]() {
        if (lane == 0) mbar_arrive(tile_free_bar);
    };

    if (wg == WARPGROUPS) {
        /* producer warpgroup. K and V of the tile's relative block j into stage (first + j) % STAGES.
         * Prefill: a whole block (all its keys below k_len) by TMA where the launcher built the maps
         * (kv_tma), its D / 64 boxes issued by thread 0 onto the stage's full barrier, whose phase then
         * also waits for their bytes. The rest, and every block of the split kernel (TMA measured no
         * faster there: perf-notes), by cp.async: this thread's source rows are two running pointers,
         * rows past k_len zeros (p = 0 there, and 0 * (stale NaN) would poison acc). Either way the
         * stage holds the same bytes in the same swizzle (TMA's 128-byte swizzle is BoxSwizzle's) */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Tiles::PRODUCER_REGS));
        const int ptid = tid - Tiles::CONSUMER_THREADS;
        int issued = 0; /* split: the tile's ring items copied before its range (copy_first_block_early) */
        if constexpr (SPLIT) issued = copy_first_block_early<D, KV_BYTES>(p, kv_ring, ptid);
        uint32_t first = 0; /* the tile's first ring item */
        int next = blockIdx.x;
        for (int n = 0;; ++n) {
            if (Tiles::PERSISTENT && ptid == 0) {
                const int published = first_with_work(next);
                if (n > 0) mbar_wait(tile_free_bar, (n - 1) & 1);
                tile_slot[n & 1] = published;
                mbar_arrive(tile_ready_bar + 8 * (n & 1));
                /* the next ticket's atomic is in flight while this tile's blocks are issued */
                if (published >= 0) next = ticket();
            }
            FwdCta cta;
            const int tile = tile_of(n, cta);
            free_tile();
            /* early copies land before the CTA ends or copies again over them */
            if (tile < 0 || (issued > 0 && cta.range.k_len - cta.block_begin * FWD_KEYS < FWD_KEYS)) {
                cp_async_wait<0>();
                issued = 0;
            }
            if (tile < 0) break;
            if constexpr (Tiles::PERSISTENT) fwd_cta<ROWS, SPLIT, FWD_KEYS>(p, tile, cta);
            const int blocks = __shfl_sync(0xffffffffu, cta.block_end - cta.block_begin, 0);
            const int64_t thread_row = cta.range.k_start + cta.block_begin * FWD_KEYS + ptid / (D / 8);
            const int64_t thread_col = 8 * (ptid % (D / 8));
            const uint16_t *k_src = row_address(p.k, cta.b, thread_row, cta.kv_head) + thread_col;
            const uint16_t *v_src = row_address(p.v, cta.b, thread_row, cta.kv_head) + thread_col;
            /* past the items copied early (items 0, 1: the first block's K, V) */
            if (issued > 0) k_src += FWD_KEYS * p.k.row_stride;
            if (issued > 1) v_src += FWD_KEYS * p.v.row_stride;
            /* item 2 j: K of block j, item 2 j + 1: its V */
            ring.produce(first, 2 * blocks, [&](int j, int s) {
                const uint32_t dst = kv_ring + s * KV_BYTES;
                const int keys_in = cta.range.k_len - (cta.block_begin + j / 2) * FWD_KEYS;
                if constexpr (!SPLIT) {
                    if (p.kv_tma && keys_in >= FWD_KEYS) {
                        if (ptid == 0) {
                            const uint32_t bar = ring.full_bar + 8 * s;
                            mbar_expect_tx(bar, KV_BYTES);
                            tma_load_rows<D, FWD_KEYS>(dst, j % 2 == 0 ? &p.k_map : &p.v_map,
                                                       (int)cta.range.k_start + (cta.block_begin + j / 2) * FWD_KEYS,
                                                       cta.kv_head, cta.b * p.kv_map_batch, bar);
                        }
                        if (j % 2 == 0) k_src += FWD_KEYS * p.k.row_stride;
                        else v_src += FWD_KEYS * p.v.row_stride;
                        return;
                    }
                }
                using KvRows = BoxSwizzle<FWD_KEYS>;
                if (j % 2 == 0) {
                    load_thread_rows_async<D, FWD_KEYS, 128, KvRows>(dst, k_src, p.k.row_stride, keys_in, p.k.data, ptid);
                    k_src += FWD_KEYS * p.k.row_stride;
                } else {
                    load_thread_rows_async<D, FWD_KEYS, 128, KvRows>(dst, v_src, p.v.row_stride, keys_in, p.v.data, ptid);
                    v_src += FWD_KEYS * p.v.row_stride;
                }
            }, issued);
            first += 2 * blocks;
        }
    } else if constexpr (FEW_ROWS) {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Tiles::CONSUMER_REGS));
        SequenceRange range;
        bool range_ok;
        few_rows_consumer<BF16, D, Tiles>(p, ring, kv_ring, q_tile, smem_raw + (q_tile - full_bar), tid, range, range_ok);
        if (p.cluster_merge) merge_in_cluster<BF16, D>(p, range, range_ok, merge_bar, tid);
    } else {
        /* consumer warpgroup wg: rows wg_row0 .. wg_row0 + 63 of each tile */
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Tiles::CONSUMER_REGS));
        const int wg_row0 = wg * 64;
        const int thread_row0 = wg_row0 + 16 * warp_in_wg + (lane >> 2); /* + 8 h */
        /* prefill: the row state's o, [row h][column quad][consumer thread] float4s: o of row h's column
         * pair j, element e at o_at(h, j, e), so that a row's columns load and store 16 bytes at a time */
        float4 *const o_state = (float4 *)(smem_raw + (kv_ring + Tiles::RING_BYTES - full_bar)) + tid;
        auto o_at = [&](int h, int j, int e) -> float & {
            return ((float *)&o_state[(h * (D / 16) + j / 2) * Tiles::CONSUMER_THREADS])[2 * (j % 2) + e];
        };
        const SmemDesc k_desc = k_major_desc(kv_ring), v_desc = mn_major_desc<FWD_KEYS>(kv_ring);
        float s[FWD_KEYS / 2], alpha[2], acc[D / 2];
        uint32_t pa[FWD_KEYS / 16][4], qa[D / 16][4];
#pragma unroll
        for (int i = 0; i < FWD_KEYS / 2; ++i) s[i] = 0.0f;
#pragma unroll
        for (int t = 0; t < FWD_KEYS / 16; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) pa[t][i] = 0u;
        /* keeps the registers of in-flight wgmmas (pa too: P V reads it) live and in place */
        auto fence_registers = [&]() {
            fence_accumulators(acc);
            fence_accumulators(s);
#pragma unroll
            for (int i = 0; i < FWD_KEYS / 16; ++i) fence_operands(pa[i]);
            if constexpr (!Tiles::Q_IN_SMEM)
#pragma unroll
                for (int i = 0; i < D / 16; ++i) fence_operands(qa[i]);
        };

        /* the warpgroup's own Q slab: it copies its rows in and reads them out itself, ordered by its
         * named barrier (compute-sanitizer racecheck follows those, not the ring's mbarriers) */
        const uint32_t q_slab = q_tile + wg * Tiles::Q_SLAB_BYTES;
        /* tile n of this CTA (-1: none), its cta filled and its Q rows in flight into the slab */
        auto start_tile = [&](int n, FwdCta &cta) {
            const int tile = tile_of(n, cta);
            if (tile >= 0) {
                if constexpr (Tiles::PERSISTENT) fwd_cta<ROWS, SPLIT, FWD_KEYS>(p, tile, cta);
                load_q_slab_async<D, SPLIT>(q_slab, p, cta, wg_row0, tid & 127);
                cp_async_commit();
            }
            return tile;
        };

        uint32_t first = 0; /* the tile's first ring item */
        FwdCta cta;
        int tile = start_tile(0, cta);
        const SequenceRange first_range = cta.range; /* split: the cluster merge's rows */
        const bool first_range_ok = cta.range_ok;
        for (int n = 0; tile >= 0; ++n) {
            /* every thread's Q rows landed (barrier), and the tile's number read: free_tile. Q in
             * registers: the fragments read, then the slab free again (second barrier); Q in the slab:
             * S reads it there, and the tile's last wgmma_wait frees it */
            cp_async_wait<0>();
            if constexpr (Tiles::Q_IN_SMEM) fence_proxy_async_smem(); /* S reads Q from the slab */
            warpgroup_sync(1 + wg);
            if constexpr (!Tiles::Q_IN_SMEM) {
                load_q_fragments<D>(qa, q_slab, 16 * warp_in_wg, lane);
                warpgroup_sync(1 + wg);
            }
            free_tile();
            const int blocks = __shfl_sync(0xffffffffu, cta.block_end - cta.block_begin, 0);
            const bool wg_has_rows = wg_row0 < cta.rows_in;
            const int wg_max_len = wg_has_rows ? cta.len_of(min(wg_row0 + 63, cta.rows_in - 1)) : 0;
            const int wg_min_len = wg_has_rows ? cta.len_of(wg_row0) : 0;
            /* the blocks it attends: those with a key its last row sees, a prefix of the tile's blocks */
            const int nb = __shfl_sync(0xffffffffu,
                                       min(blocks, max(0, (wg_max_len + FWD_KEYS - 1) / FWD_KEYS - cta.block_begin)), 0);
            int row_len[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = thread_row0 + 8 * h;
                row_len[h] = r < cta.rows_in ? cta.len_of(r) : 0;
            }

            RowPair seg, row; /* prefill: row is the row state the segments merge into; its o at o_at */
            set_empty(seg);
            set_empty(row);
            if constexpr (!SPLIT) {
#pragma unroll
                for (int i = 0; i < D / 8; ++i) o_state[i * Tiles::CONSUMER_THREADS] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }

            /* S of block t: Q from its slab, or as registers (split alone on its SM); the same wgmma
             * per score either way */
            auto issue_s = [&](uint32_t k_stage) {
                if constexpr (Tiles::Q_IN_SMEM)
                    issue_scores<BF16, D, 64 * 128, FWD_KEYS>(s, k_major_desc(q_slab), k_desc, k_stage);
                else
                    issue_scores_qreg<BF16, D, FWD_KEYS>(s, qa, k_desc, k_stage);
            };
            /* ring items of block t: its K, then its V. `first` is the same in every lane, but carried
             * across tiles it sits in a vector register, and every stage offset and wgmma descriptor
             * derived from it went to its HGMMA through R2UR (106 in the prefill kernel at d = 128);
             * REDUX writes a uniform register, so derived from first_u they are built in uniform
             * registers (35 R2UR left, none in the turn loop) */
            const uint32_t first_u = __reduce_max_sync(0xffffffffu, first);
            auto k_item = [&](int t) { return first_u + 2 * t; };
            auto v_item = [&](int t) { return first_u + 2 * t + 1; };
            auto stage_bytes = [&](uint32_t item) { return (uint32_t)((item % STAGES) * KV_BYTES); };
            auto scores = [&](int t) {
                const int key0 = (cta.block_begin + t) * FWD_KEYS;
                block_scores(s, lane, key0, row_len, key0 + FWD_KEYS > wg_min_len, p.scale_log2, seg,
                                          alpha);
            };
            /* prefill: block t starts a segment, so the one before it ended one */
            auto starts_segment = [&](int t) { return !SPLIT && (cta.block_begin + t) % (SEGMENT / FWD_KEYS) == 0; };
            /* prefill: merges an ended segment (its m and l in `ended`, its acc) into the row state;
             * the next segment's first P V overwrites acc (issue_pv's fresh) */
            auto merge_ended = [&](const RowPair &ended) {
                if constexpr (!SPLIT)
                    merge_segment_rows<D>(
                        row, ended,
                        o_at,
                        [&](int h, int j, int e) -> float & { return acc[4 * j + 2 * h + e]; }, p.scale_log2);
            };

            int t = 0;
            if (nb > 0) {
                /* turn 0: S of block 0 */
                ring.wait_full(k_item(0));
                fence_registers();
                wgmma_fence();
                issue_s(stage_bytes(k_item(0)));
                wgmma_commit();
                wgmma_wait<0>();
                fence_registers();
                ring.release(k_item(0), lane);
                scores(0);
                block_operands<BF16, D>(s, alpha, acc, pa, true);
                bool fresh = true; /* the last scored block starts a segment: its P V starts acc */
                /* turn t: S of block t, then P V of block t - 1 in a second group, then block t's
                 * softmax */
                for (t = 1; t < nb; ++t) {
                    ring.wait_full(k_item(t));
                    ring.wait_full(v_item(t - 1));
                    fence_registers();
                    wgmma_fence();
                    issue_s(stage_bytes(k_item(t)));
                    wgmma_commit();
                    issue_pv<BF16, D, FWD_KEYS>(acc, pa, v_desc, stage_bytes(v_item(t - 1)), fresh);
                    wgmma_commit();
                    wgmma_wait<1>();
                    fence_accumulators(s);
                    ring.release(k_item(t), lane);
                    const RowPair ended = seg;
                    const bool new_segment = starts_segment(t);
                    if (new_segment) set_empty(seg);
                    scores(t);
                    wgmma_wait<0>();
                    fence_registers();
                    ring.release(v_item(t - 1), lane);
                    if (new_segment) merge_ended(ended);
                    block_operands<BF16, D>(s, alpha, acc, pa, new_segment);
                    fresh = new_segment;
                }
                /* turn nb: P V of the last block */
                ring.wait_full(v_item(nb - 1));
                fence_registers();
                wgmma_fence();
                issue_pv<BF16, D, FWD_KEYS>(acc, pa, v_desc, stage_bytes(v_item(nb - 1)), fresh);
                wgmma_commit();
                wgmma_wait<0>();
                fence_registers();
                ring.release(v_item(nb - 1), lane);
                t = nb; /* prefill: the last segment merges in the epilogue, below */
            } else if constexpr (SPLIT) {
#pragma unroll
                for (int i = 0; i < D / 2; ++i) acc[i] = 0.0f; /* the record of a segment it cannot see */
            }
            /* the blocks its rows cannot see: keep the barriers' phases in step */
            for (; t < blocks; ++t) {
                ring.wait_full(k_item(t));
                ring.release(k_item(t), lane);
                ring.wait_full(v_item(t));
                ring.release(v_item(t), lane);
            }
            first += 2 * blocks;
            /* the next tile's Q rows load under this one's epilogue */
            FwdCta next_cta;
            const int next = start_tile(n + 1, next_cta);

            const int col = 2 * (lane & 3);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = thread_row0 + 8 * h;
                if (r >= cta.rows_in) continue;
                const int i = cta.query_of(r), head = cta.head_of(r);
                if constexpr (SPLIT) {
                    float *rec = segment_record<D>(p, cta, i, head);
                    if ((lane & 3) == 0) *(float2 *)rec = make_float2(seg.m[h], seg.l[h]);
#pragma unroll
                    for (int j = 0; j < D / 8; ++j)
                        *(float2 *)(rec + 4 + j * 8 + col) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                } else {
                    /* the last segment merged as merge_ended would, but into registers that go straight
                     * to the normalization: no store of o_state and no second load */
                    float o_row[D / 4], acc_row[D / 4], y[D / 4], lse;
#pragma unroll
                    for (int j = 0; j < D / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            o_row[2 * j + e] = o_at(h, j, e);
                            acc_row[2 * j + e] = acc[4 * j + 2 * h + e];
                        }
                    if (nb > 0) merge_segment<D / 4>(row.m[h], row.l[h], o_row, seg.m[h], seg.l[h], acc_row, p.scale_log2);
                    finalize_row<D / 4>(row.m[h], row.l[h], o_row, y, lse, p.scale_log2);
                    const int64_t q_row = cta.range.q_start + i;
                    store_quad_row<BF16, D>((uint16_t *)row_address(p.out, cta.b, q_row, head), y, lane);
                    if ((lane & 3) == 0 && p.lse.data)
                        ((float *)p.lse.data)[cta.b * p.lse.batch_stride + q_row * p.lse.row_stride +
                                              head * p.lse.head_stride] = lse;
                }
            }
            cta = next_cta;
            tile = next;
        }
        if constexpr (SPLIT)
            if (p.cluster_merge) merge_in_cluster<BF16, D>(p, first_range, first_range_ok, merge_bar, tid);
    }
}

/* The forward's kernels: fwd_pipeline's two schedules. The prefill kernel takes the TMA maps too
 * (PrefillParams), __grid_constant__ so that its loads read them in place; the split kernel, which
 * copies by cp.async, takes FwdParams alone (with the maps in its parameters B = 1 decode over 8k keys
 * ran 3-4% slower, perf-notes). */
template <bool BF16, int D>
__global__ void __launch_bounds__(FwdTiles<D, false>::THREADS, FwdTiles<D, false>::MIN_CTAS)
    attention_fwd_kernel(const __grid_constant__ PrefillParams p) {
    fwd_pipeline<BF16, D, false>(p);
}

template <bool BF16, int D, bool FEW_ROWS, int SPLIT_CTAS>
__global__ void __launch_bounds__(FwdTiles<D, true, SPLIT_CTAS>::THREADS, FwdTiles<D, true, SPLIT_CTAS>::MIN_CTAS)
    attention_fwd_split_kernel(const FwdParams p) {
    fwd_pipeline<BF16, D, true, FEW_ROWS, SPLIT_CTAS>(p);
}

/* ------------------------------------ backward ---------------------------------------------- */

/* Both kinds of backward CTA (one grid, attention_bwd_kernel): two consumer warpgroups and a producer
 * warpgroup (setmaxnreg as the forward's), one CTA per SM. Per block and warpgroup the same wgmma
 * shapes as the forward: two m64n64 products over head_dim (issue_scores: S and dP, or S^T and dP^T),
 * each its own commit group, the elementwise
 * P = exp2(S c - lse2) (0 where the query cannot see the key; formed while dP is still running) and
 * dS = P (dP - D) in registers, then one or two m64n{d} products over the block's 64 rows with P or dS
 * rounded to the dtype as the register A operand (issue_pv).
 *   bwd_dkdv_cta: a CTA owns 128 keys of one (sequence, kv head), 64 per warpgroup, K and V
 *     resident; the producer streams (Q, dO) of the 64-query blocks that can see them, for each query
 *     head of the group in increasing order and each block in increasing order. Per block: S^T = K Q^T,
 *     dP^T = V dO^T; dV += P^T dO, dK += dS^T Q. Each warpgroup copies the block's row stats (lse2, D)
 *     from global memory into its own two alternating shared buffers behind a named barrier (not
 *     through the ring: compute-sanitizer racecheck does not follow the mbarriers' ordering for plain
 *     loads, and reported ring-carried stats as races).
 *   bwd_dq_cta: a CTA owns 128 query rows of one (sequence, head), 64 per warpgroup, Q and
 *     dO resident; the producer streams the K and V blocks its rows see (as the forward's). Per block:
 *     S = Q K^T, dP = dO V^T; dQ += dS K.
 * Each accumulator row is one chain in a fixed order (dK, dV: the group's heads, then the query blocks
 * and their 4 k16 steps, in increasing order; dQ: the key blocks and their k16 steps in increasing
 * order) from zero, so the backward is bitwise deterministic; query blocks are aligned at the sequence's
 * first query and key blocks at its first key, so a sequence's gradients do not depend on the other
 * sequences of the batch. A block a row cannot see adds exact zeros (P = 0 selected). */
template <int D>
struct BwdTiles {
    static constexpr int WARPGROUPS = 2, THREADS = 128 * (WARPGROUPS + 1);
    static constexpr int ROWS = 64 * WARPGROUPS; /* keys (dK/dV) or query rows (dQ) a CTA owns */
    static constexpr int TILE_BYTES = BLOCK_N * D * 2; /* a 64-row tile */
    static constexpr int RESIDENT_BYTES = 2 * WARPGROUPS * TILE_BYTES; /* K, V or Q, dO of the CTA's rows */
    /* dK/dV stage: Q, dO; dQ stage: K, V */
    static constexpr int DKDV_STAGE_BYTES = 2 * TILE_BYTES;
    static constexpr int DQ_STAGE_BYTES = 2 * TILE_BYTES;
    static constexpr int STAGES = 3;
    static constexpr int BARRIER_BYTES = 2 * STAGES * 8;
    static constexpr int STATS_BYTES = WARPGROUPS * 2 * BLOCK_N * 8; /* dK/dV: {lse2, D}, 2 buffers per warpgroup */
    static constexpr int DKDV_SMEM_BYTES = TILE_ALIGN + RESIDENT_BYTES + STAGES * DKDV_STAGE_BYTES + STATS_BYTES;
    static constexpr int DQ_SMEM_BYTES = TILE_ALIGN + RESIDENT_BYTES + STAGES * DQ_STAGE_BYTES;
    static constexpr int ENTRY_REGS = (65536 / THREADS) & ~7;
    /* a dK/dV consumer at head_dim 128 holds dK, dV (128 registers), S^T, dP^T (64) and the P^T, dS^T
     * fragments (32): it peaks at ~230 registers, and ptxas serializes the wgmmas when short of them */
    static constexpr int PRODUCER_REGS = 24;
    static constexpr int CONSUMER_REGS = (ENTRY_REGS + (ENTRY_REGS - PRODUCER_REGS) / WARPGROUPS) & ~7;
};

/* f(h, j, e, i) for each element of a thread's 64 x 64 accumulator fragment, i = 4 j + 2 h + e */
template <class F>
__device__ __forceinline__ void for_each_element(F f) {
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) f(h, j, e, 4 * j + 2 * h + e);
}

/* The backward's elementwise part of one block, in two steps so that each runs while a product is on
 * the tensor cores (accumulator layout; element (h, j, e) at x[4 j + 2 h + e]):
 * block_probabilities: s -> P in place, p = exp2(fma(s, c, -lse2)); then, in a block some element of
 * which its query cannot see (a warp-uniform test, so unmasked blocks pay nothing), mask_probabilities:
 * p = 0 where !visible(h, j, e) (a select: whatever exp2 gave there is dropped);
 * block_score_grads: dp -> dS in place, ds = p (dp - D). stat(h, j, e): the {lse2, D} of the element's
 * query. */
template <class Stat>
__device__ __forceinline__ void block_probabilities(float (&s)[BLOCK_N / 2], float c, Stat stat) {
    for_each_element([&](int h, int j, int e, int i) { s[i] = exp2_approx(__fmaf_rn(s[i], c, -stat(h, j, e).x)); });
}

template <class Visible>
__device__ __forceinline__ void mask_probabilities(float (&s)[BLOCK_N / 2], Visible visible) {
    for_each_element([&](int h, int j, int e, int i) { s[i] = visible(h, j, e) ? s[i] : 0.0f; });
}

template <class Stat>
__device__ __forceinline__ void block_score_grads(const float (&p)[BLOCK_N / 2], float (&dp)[BLOCK_N / 2], Stat stat) {
    for_each_element([&](int h, int j, int e, int i) { dp[i] = __fmul_rn(p[i], __fsub_rn(dp[i], stat(h, j, e).y)); });
}

/* A backward CTA's two resident tiles: rows first_row .. first_row + ROWS - 1 of x and y (head `head` of
 * sequence b; rows >= rows_in zero-filled), copied by the consumer warpgroups' THREADS threads and
 * fenced for the tensor cores. */
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void load_resident_tiles(uint32_t x_tile, const rlk_attention_tensor &x, uint32_t y_tile,
                                                    const rlk_attention_tensor &y, int b, int64_t first_row, int head,
                                                    int rows_in, int tid) {
    auto load = [&](uint32_t tile, const rlk_attention_tensor &t) {
        load_rows_async<D, ROWS, THREADS, BoxSwizzle<ROWS>>(
            tile, [&](int r) -> const uint16_t * { return r < rows_in ? row_address(t, b, first_row + r, head) : nullptr; },
            t.data, tid);
    };
    load(x_tile, x);
    load(y_tile, y);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async_smem();
}

template <bool BF16, int D>
__device__ __forceinline__ void bwd_dkdv_cta(const BwdParams &p, int cta) {
    using Tiles = BwdTiles<D>;
    constexpr int STAGES = Tiles::STAGES, ROWS = Tiles::ROWS, TILE_BYTES = Tiles::TILE_BYTES;
    constexpr int STAGE_BYTES = Tiles::DKDV_STAGE_BYTES;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t bar = smem_u32(smem_raw);
    const uint32_t k_tile = first_tile(bar, Tiles::BARRIER_BYTES);
    const uint32_t v_tile = k_tile + ROWS * D * 2, ring_tiles = v_tile + ROWS * D * 2;
    const uint32_t stats_area = ring_tiles + STAGES * STAGE_BYTES;
    if (stats_area + Tiles::STATS_BYTES > bar + Tiles::DKDV_SMEM_BYTES) __trap();

    const int tid = threadIdx.x, lane = tid & 31, wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int warp_in_wg = (tid >> 5) & 3;
    KeyTile tile;
    if (!key_tile<ROWS>(p, cta, tile)) return;
    const int b = tile.b, kv_head = tile.kv_head, key0 = tile.key0, keys_in = tile.keys_in;
    const int q_len = tile.range.q_len, k_len = tile.range.k_len;
    const int qb_begin = tile.qb_begin, qb_count = __shfl_sync(0xffffffffu, tile.qb_count, 0);
    const int iters = p.group * qb_count;
    const int64_t q_row0 = tile.range.q_start, k_row0 = tile.range.k_start + key0;

    const Ring<STAGES> ring{bar, bar + 8 * STAGES};
    if (tid == 0) ring.init(4 * Tiles::WARPGROUPS);
    if (tid < 128 * Tiles::WARPGROUPS)
        load_resident_tiles<D, ROWS, 128 * Tiles::WARPGROUPS>(k_tile, p.k, v_tile, p.v, b, k_row0, kv_head, keys_in, tid);
    __syncthreads();

    auto query_block = [&](int it, int &head, int &q0, int &rows_in) {
        head = kv_head * p.group + it / qb_count;
        q0 = (qb_begin + it % qb_count) * BLOCK_N;
        rows_in = min(BLOCK_N, q_len - q0);
    };
    if (wg == Tiles::WARPGROUPS) {
        /* producer: Q and dO of each query block; rows past the sequence zero-filled */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Tiles::PRODUCER_REGS));
        const int ptid = tid - 128 * Tiles::WARPGROUPS;
        const int thread_row = ptid / (D / 8), thread_col = 8 * (ptid % (D / 8));
        int head = kv_head * p.group, q0 = qb_begin * BLOCK_N; /* query_block(it), counted along */
        ring.produce(0, iters, [&](int, int s) {
            const int rows_in = min(BLOCK_N, q_len - q0);
            const uint32_t dst = ring_tiles + s * STAGE_BYTES;
            if (p.tma && rows_in == BLOCK_N) {
                if (ptid == 0) {
                    const uint32_t bar = ring.full_bar + 8 * s;
                    mbar_expect_tx(bar, STAGE_BYTES);
                    tma_load_rows<D, BLOCK_N>(dst, &p.q_map, (int)q_row0 + q0, head, b * p.q_map_batch, bar);
                    tma_load_rows<D, BLOCK_N>(dst + TILE_BYTES, &p.do_map, (int)q_row0 + q0, head,
                                              b * p.q_map_batch, bar);
                }
            } else {
                const int64_t row = q_row0 + q0 + thread_row;
                load_thread_rows_async<D, BLOCK_N, 128, BoxSwizzle<BLOCK_N>>(
                    dst, row_address(p.q, b, row, head) + thread_col, p.q.row_stride, rows_in, p.q.data, ptid);
                load_thread_rows_async<D, BLOCK_N, 128, BoxSwizzle<BLOCK_N>>(
                    dst + TILE_BYTES, row_address(p.dout, b, row, head) + thread_col, p.dout.row_stride, rows_in,
                    p.dout.data, ptid);
            }
            q0 += BLOCK_N;
            if (q0 >= q_len) {
                q0 = qb_begin * BLOCK_N;
                ++head;
            }
        });
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Tiles::CONSUMER_REGS));
        const int wg_key0 = key0 + 64 * wg; /* this warpgroup's keys, relative to the sequence */
        const int thread_key = wg_key0 + 16 * warp_in_wg + (lane >> 2); /* + 8 h */
        const SmemDesc k_desc = k_major_desc(k_tile + wg * 64 * 128), v_desc = k_major_desc(v_tile + wg * 64 * 128);
        const SmemDesc q_desc = k_major_desc(ring_tiles), do_desc = k_major_desc(ring_tiles + TILE_BYTES);
        const SmemDesc q_mn_desc = mn_major_desc(ring_tiles), do_mn_desc = mn_major_desc(ring_tiles + TILE_BYTES);
        const float c = p.scale_log2;
        float dk[D / 2], dv[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;

        /* Per block, four commit groups: S^T, dP^T, then dV once P^T is formed (under dP^T), then dK once
         * dS^T is formed (under dV). The block's products end before the next block's start: keeping dK
         * in flight past it needs more than the 240 registers (ptxas then serializes every wgmma). */
        float st[BLOCK_N / 2], dpt[BLOCK_N / 2];
        uint32_t pa[BLOCK_N / 16][4], dsa[BLOCK_N / 16][4];
        /* the row stats of the blocks it works on, buffer (worked & 1); thread wg_tid < 64 copies row wg_tid */
        float2 *const wg_stats = (float2 *)(smem_raw + (stats_area - bar)) + wg * 2 * BLOCK_N;
        const int wg_tid = tid & 127;
        int worked = 0;
        for (int it = 0; it < iters; ++it) {
            int head, q0, rows_in;
            query_block(it, head, q0, rows_in);
            /* the block's last query sees the most keys: skip it when none sees this warpgroup's keys */
            if (wg_key0 >= visible_keys(q0 + rows_in - 1, q_len, k_len, p.causal)) {
                ring.wait_full(it);
                ring.release(it, lane);
                continue;
            }
            const float2 row_stat = wg_tid < rows_in
                                        ? p.stats[((int64_t)b * p.heads_q + head) * p.stats_pitch + q0 + wg_tid]
                                        : make_float2(0.0f, 0.0f);
            /* (the buffer's previous readers, two blocks back, passed the barrier of the block between) */
            float2 *const stats = wg_stats + (worked++ & 1) * BLOCK_N;
            if (wg_tid < BLOCK_N) stats[wg_tid] = row_stat;
            warpgroup_sync(1 + wg);
            ring.wait_full(it);
            const uint32_t stage_bytes = (uint32_t)((it % STAGES) * STAGE_BYTES);
            wgmma_fence();
            issue_scores<BF16, D, ROWS * 128>(st, k_desc, q_desc, stage_bytes);
            wgmma_commit();
            issue_scores<BF16, D, ROWS * 128>(dpt, v_desc, do_desc, stage_bytes);
            wgmma_commit();
            wgmma_wait<1>(); /* S^T */
            fence_accumulators(st);
            /* element (h, j, e): key thread_key + 8 h, query q0 + 8 j + 2 (lane % 4) + e */
            auto query = [&](int j, int e) { return 8 * j + 2 * (lane & 3) + e; };
            auto stat = [&](int, int j, int e) { return stats[query(j, e)]; };
            const bool masked = rows_in < BLOCK_N || wg_key0 + 64 > visible_keys(q0, q_len, k_len, p.causal);
            block_probabilities(st, c, stat);
            if (masked)
                mask_probabilities(st, [&](int h, int j, int e) {
                    const int i = query(j, e);
                    return i < rows_in && thread_key + 8 * h < visible_keys(q0 + i, q_len, k_len, p.causal);
                });
            to_a_fragments<BF16>(st, pa);
            wgmma_fence();
            issue_pv<BF16, D>(dv, pa, do_mn_desc, stage_bytes);
            wgmma_commit();
            wgmma_wait<1>(); /* dP^T */
            fence_accumulators(dpt);
            block_score_grads(st, dpt, stat);
            to_a_fragments<BF16>(dpt, dsa);
            wgmma_fence();
            issue_pv<BF16, D>(dk, dsa, q_mn_desc, stage_bytes);
            wgmma_commit();
            wgmma_wait<0>();
            fence_accumulators(dk);
            fence_accumulators(dv);
#pragma unroll
            for (int t = 0; t < BLOCK_N / 16; ++t) {
                fence_operands(pa[t]);
                fence_operands(dsa[t]);
            }
            ring.release(it, lane);
        }
        const int thread_row = 64 * wg + 16 * warp_in_wg + (lane >> 2);
        store_acc_rows<BF16, D>(p.dv, b, k_row0, kv_head, keys_in, thread_row, lane, 1.0f,
                                [&](int h, int j, int e) { return dv[4 * j + 2 * h + e]; });
        store_acc_rows<BF16, D>(p.dk, b, k_row0, kv_head, keys_in, thread_row, lane, p.scale,
                                [&](int h, int j, int e) { return dk[4 * j + 2 * h + e]; });
    }
}

template <bool BF16, int D>
__device__ __forceinline__ void bwd_dq_cta(const BwdParams &p, int cta) {
    using Tiles = BwdTiles<D>;
    constexpr int STAGES = Tiles::STAGES, ROWS = Tiles::ROWS, TILE_BYTES = Tiles::TILE_BYTES;
    constexpr int STAGE_BYTES = Tiles::DQ_STAGE_BYTES;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t bar = smem_u32(smem_raw);
    const uint32_t q_tile = first_tile(bar, Tiles::BARRIER_BYTES);
    const uint32_t do_tile = q_tile + ROWS * D * 2, ring_tiles = do_tile + ROWS * D * 2;
    if (ring_tiles + STAGES * STAGE_BYTES > bar + Tiles::DQ_SMEM_BYTES) __trap();

    const int tid = threadIdx.x, lane = tid & 31, wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    const int warp_in_wg = (tid >> 5) & 3;
    QueryTile tile;
    if (!query_tile<ROWS>(p, cta, tile)) return;
    const int b = tile.b, head = tile.head, kv_head = head / p.group, q0 = tile.q0, rows_in = tile.rows_in;
    const int k_len = tile.range.k_len;
    const int64_t q_row0 = tile.range.q_start + q0, k_row0 = tile.range.k_start;
    const int blocks = __shfl_sync(0xffffffffu, (tile.len_of(rows_in - 1) + BLOCK_N - 1) / BLOCK_N, 0);

    const Ring<STAGES> ring{bar, bar + 8 * STAGES};
    if (tid == 0) ring.init(4 * Tiles::WARPGROUPS);
    if (tid < 128 * Tiles::WARPGROUPS)
        load_resident_tiles<D, ROWS, 128 * Tiles::WARPGROUPS>(q_tile, p.q, do_tile, p.dout, b, q_row0, head, rows_in, tid);
    __syncthreads();

    if (wg == Tiles::WARPGROUPS) {
        /* producer: K and V of blocks 0 .. blocks - 1, rows past k_len zero-filled (as the forward's) */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Tiles::PRODUCER_REGS));
        const int ptid = tid - 128 * Tiles::WARPGROUPS;
        const int64_t thread_row = k_row0 + ptid / (D / 8);
        const int64_t thread_col = 8 * (ptid % (D / 8));
        const uint16_t *k_src = row_address(p.k, b, thread_row, kv_head) + thread_col;
        const uint16_t *v_src = row_address(p.v, b, thread_row, kv_head) + thread_col;
        ring.produce(0, blocks, [&](int j, int s) {
            const uint32_t dst = ring_tiles + s * STAGE_BYTES;
            const int keys_in = k_len - j * BLOCK_N;
            if (p.tma && keys_in >= BLOCK_N) {
                if (ptid == 0) {
                    const uint32_t bar = ring.full_bar + 8 * s;
                    const int row = (int)k_row0 + j * BLOCK_N;
                    mbar_expect_tx(bar, STAGE_BYTES);
                    tma_load_rows<D, BLOCK_N>(dst, &p.k_map, row, kv_head, b * p.k_map_batch, bar);
                    tma_load_rows<D, BLOCK_N>(dst + TILE_BYTES, &p.v_map, row, kv_head, b * p.k_map_batch, bar);
                }
            } else {
                load_thread_rows_async<D, BLOCK_N, 128, BoxSwizzle<BLOCK_N>>(dst, k_src, p.k.row_stride, keys_in,
                                                                           p.k.data, ptid);
                load_thread_rows_async<D, BLOCK_N, 128, BoxSwizzle<BLOCK_N>>(dst + TILE_BYTES, v_src, p.v.row_stride,
                                                                           keys_in, p.v.data, ptid);
            }
            k_src += BLOCK_N * p.k.row_stride;
            v_src += BLOCK_N * p.v.row_stride;
        });
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Tiles::CONSUMER_REGS));
        const int wg_row0 = 64 * wg;
        const bool wg_has_rows = wg_row0 < rows_in;
        const int wg_max_len = wg_has_rows ? tile.len_of(min(wg_row0 + 63, rows_in - 1)) : 0;
        const int wg_min_len = wg_has_rows ? tile.len_of(wg_row0) : 0;
        const int nb = __shfl_sync(0xffffffffu, (wg_max_len + BLOCK_N - 1) / BLOCK_N, 0); /* blocks it attends */
        const int thread_row = wg_row0 + 16 * warp_in_wg + (lane >> 2); /* + 8 h */
        int row_len[2];
        float2 row_stat[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = thread_row + 8 * h;
            row_len[h] = r < rows_in ? tile.len_of(r) : 0;
            row_stat[h] = r < rows_in ? p.stats[((int64_t)b * p.heads_q + head) * p.stats_pitch + q0 + r]
                                      : make_float2(0.0f, 0.0f);
        }
        const SmemDesc q_desc = k_major_desc(q_tile + wg_row0 * 128), do_desc = k_major_desc(do_tile + wg_row0 * 128);
        const SmemDesc k_desc = k_major_desc(ring_tiles), v_desc = k_major_desc(ring_tiles + TILE_BYTES);
        const SmemDesc k_mn_desc = mn_major_desc(ring_tiles);
        const float c = p.scale_log2;
        float dq[D / 2];
#pragma unroll
        for (int i = 0; i < D / 2; ++i) dq[i] = 0.0f;

        /* Per block, three commit groups: S, dP, then dQ once dS is formed; P is formed under dP, and dQ
         * of a block runs on under the next block's wait and S, so its stage is released one block later
         * (pending). */
        float sp[BLOCK_N / 2], dp[BLOCK_N / 2];
        uint32_t dsa[BLOCK_N / 16][4];
        auto fence_products = [&]() {
            fence_accumulators(dq);
#pragma unroll
            for (int t = 0; t < BLOCK_N / 16; ++t) fence_operands(dsa[t]);
        };
        auto stat = [&](int h, int, int) { return row_stat[h]; };
        int pending = -1;
        for (int t = 0; t < blocks; ++t) {
            ring.wait_full(t);
            if (t >= nb) { /* its rows see no key of block t */
                wgmma_wait<0>();
                fence_products();
                if (pending >= 0) ring.release(pending, lane);
                ring.release(t, lane);
                pending = -1;
                continue;
            }
            const uint32_t stage_bytes = (uint32_t)((t % STAGES) * STAGE_BYTES);
            wgmma_fence();
            issue_scores<BF16, D, ROWS * 128>(sp, q_desc, k_desc, stage_bytes);
            wgmma_commit();
            issue_scores<BF16, D, ROWS * 128>(dp, do_desc, v_desc, stage_bytes);
            wgmma_commit();
            wgmma_wait<2>(); /* the previous block's dQ */
            fence_products();
            if (pending >= 0) ring.release(pending, lane);
            wgmma_wait<1>(); /* S */
            fence_accumulators(sp);
            /* element (h, j, e): row thread_row + 8 h, key 64 t + 8 j + 2 (lane % 4) + e */
            const int key0 = t * BLOCK_N;
            const bool masked = key0 + BLOCK_N > wg_min_len;
            block_probabilities(sp, c, stat);
            if (masked)
                mask_probabilities(sp, [&](int h, int j, int e) { return key0 + 8 * j + 2 * (lane & 3) + e < row_len[h]; });
            wgmma_wait<0>(); /* dP */
            fence_accumulators(dp);
            block_score_grads(sp, dp, stat);
            to_a_fragments<BF16>(dp, dsa);
            wgmma_fence();
            issue_pv<BF16, D>(dq, dsa, k_mn_desc, stage_bytes);
            wgmma_commit();
            pending = t;
        }
        wgmma_wait<0>();
        fence_products();
        if (pending >= 0) ring.release(pending, lane);
        store_acc_rows<BF16, D>(p.dq, b, q_row0, head, rows_in, thread_row, lane, p.scale,
                                [&](int h, int j, int e) { return dq[4 * j + 2 * h + e]; });
    }
}

/* The backward's one grid (launch_bwd): dK/dV CTAs, then dQ CTAs. */
template <bool BF16, int D>
__global__ void __launch_bounds__(BwdTiles<D>::THREADS, 1) attention_bwd_kernel(const __grid_constant__ BwdParams p) {
    const int cta = (int)blockIdx.x;
    if (cta < p.dkdv_ctas) bwd_dkdv_cta<BF16, D>(p, cta);
    else bwd_dq_cta<BF16, D>(p, cta - p.dkdv_ctas);
}

/* ------------------------------------ host -------------------------------------------------- */

/* The tile plans launch_fwd takes: split CTAs two an SM, or one (a grid of at most one wave of them) */
template <int D, bool SPLIT>
using FwdTilesTwoPerSm = FwdTiles<D, SPLIT, 2>;
template <int D, bool SPLIT>
using FwdTilesOnePerSm = FwdTiles<D, SPLIT, 1>;

/* A TMA map over one of the call's tensors (q, k, v, dout) as [sequence][head][row][head_dim] in
 * 128-byte-swizzled boxes of box_rows rows x 64 columns, dimensions innermost first (column, row, head,
 * sequence): the boxes BoxSwizzle<box_rows> lays out. batches is 1 where the sequences share one
 * storage (the coordinate then 0). False (the kernels then copy every block by cp.async) when a stride
 * is not one TMA takes (positive, a multiple of 16 bytes, below 2^40), the rows pass 2^31, or the
 * driver has no encoder. A dimension of size 1 takes any stride: its coordinate is always 0. */
bool tensor_map(CUtensorMap *map, const rlk_attention_tensor &t, const rlk_attention_args *a, int64_t rows,
                int64_t heads, int64_t batches, int box_rows) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    auto stride_bytes = [](int64_t elements, int64_t extent) -> int64_t {
        return extent == 1 && elements <= 0 ? 16 : 2 * elements;
    };
    const int64_t strides_in[3] = {stride_bytes(t.row_stride, rows), stride_bytes(t.head_stride, heads),
                                   stride_bytes(t.batch_stride, batches)};
    if (!encode || rows < 1 || rows >= INT32_MAX) return false;
    for (int64_t st : strides_in)
        if (st <= 0 || st % 16 != 0 || st >= ((int64_t)1 << 40)) return false;
    const cuuint64_t dims[4] = {(cuuint64_t)a->head_dim, (cuuint64_t)rows, (cuuint64_t)heads, (cuuint64_t)batches};
    const cuuint64_t strides[3] = {(cuuint64_t)strides_in[0], (cuuint64_t)strides_in[1], (cuuint64_t)strides_in[2]};
    const cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    return encode(map, a->dtype == RLK_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                  t.data, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* TMA maps over two tensors of the same rows and heads (k and v, or q and dout) in boxes of box_rows
 * rows; *map_batch: 1 where the sequences have storage of their own (a sequence coordinate), 0 where
 * both batch strides are 0 (one storage). False as tensor_map. */
bool tensor_map_pair(CUtensorMap *x_map, CUtensorMap *y_map, const rlk_attention_tensor &x,
                     const rlk_attention_tensor &y, const rlk_attention_args *a, int64_t rows, int64_t heads,
                     int box_rows, int *map_batch) {
    const bool own = a->batch > 1 && (x.batch_stride != 0 || y.batch_stride != 0);
    const int64_t batches = own ? a->batch : 1;
    *map_batch = own ? 1 : 0;
    return tensor_map(x_map, x, a, rows, heads, batches, box_rows) &&
           tensor_map(y_map, y, a, rows, heads, batches, box_rows);
}

/* launch_fwd's prepare_prefill: K and V in boxes of a forward key block */
void fwd_kv_maps(PrefillParams &p, const rlk_attention_args *a) {
    p.kv_tma = tensor_map_pair(&p.k_map, &p.v_map, a->k, a->v, a, a->k_rows, a->heads_kv, FWD_KEYS, &p.kv_map_batch);
}

template <bool BF16, int D>
struct Forward {
    static constexpr int64_t prefill_workspace_bytes() {
        return FwdTiles<D, false>::PERSISTENT ? persistent_workspace_bytes() : 0;
    }
    static int run(const rlk_attention_args *a, FwdSchedule schedule, cudaStream_t stream) {
        /* a split tile's rows are (query, head in group) pairs: at most 8 of them run transposed, as
         * wgmma's N (few_rows_consumer) */
        const bool few_rows = a->max_q_len * (a->heads_q / a->heads_kv) <= FewRows<D>::ROWS;
        /* a split grid that fits one CTA an SM runs alone on each: the same S per score (Q in registers
         * or from shared memory, the tests compare them), its per-block chain shortest */
        bool one_per_sm = false;
        if (schedule == SCHEDULE_SPLIT) {
            int device, sms;
            const cudaError_t err = current_device(&device, &sms);
            if (err != cudaSuccess) return (int)err;
            one_per_sm = split_segments(a) * split_row_tiles(a) * a->heads_kv * a->batch <= sms;
        }
        if (one_per_sm)
            return launch_fwd<BF16, D, FwdTilesOnePerSm>(a, schedule, stream, attention_fwd_kernel<BF16, D>,
                                                     few_rows ? attention_fwd_split_kernel<BF16, D, true, 1>
                                                              : attention_fwd_split_kernel<BF16, D, false, 1>,
                                                     true, MERGE_CLUSTER_MAX, fwd_kv_maps);
        return launch_fwd<BF16, D, FwdTilesTwoPerSm>(a, schedule, stream, attention_fwd_kernel<BF16, D>,
                                            few_rows ? attention_fwd_split_kernel<BF16, D, true, 2>
                                                     : attention_fwd_split_kernel<BF16, D, false, 2>,
                                            true, MERGE_CLUSTER_MAX, fwd_kv_maps);
    }
};

template <bool BF16, int D>
struct Backward {
    static int run(const BwdParams &p, const rlk_attention_args *a, cudaStream_t stream) {
        BwdParams with_maps = p;
        with_maps.tma = tensor_map_pair(&with_maps.q_map, &with_maps.do_map, a->q, a->dout, a, a->q_rows, a->heads_q,
                                        BLOCK_N, &with_maps.q_map_batch) &&
                        tensor_map_pair(&with_maps.k_map, &with_maps.v_map, a->k, a->v, a, a->k_rows, a->heads_kv,
                                        BLOCK_N, &with_maps.k_map_batch);
        return launch_bwd<BwdTiles<D>>(with_maps, a, stream, attention_bwd_kernel<BF16, D>);
    }
};

}  // namespace

/* Test hook: schedule 1 forces the prefill kernel, 2 the split-KV kernels, 0 picks as the
 * launcher does. The bits do not depend on it. */
extern "C" int rlk_attention_fwd_sm90_forced(const rlk_attention_args *args, rlk_context *ctx, int schedule) {
    return attention_fwd_entry<Forward>(args, ctx, schedule, "attention_fwd_sm90", "attention_fwd_split_sm90");
}

extern "C" int rlk_attention_fwd_sm90(const rlk_attention_args *args, rlk_context *ctx) {
    return rlk_attention_fwd_sm90_forced(args, ctx, SCHEDULE_AUTO);
}

extern "C" int rlk_attention_bwd_sm90(const rlk_attention_args *args, rlk_context *ctx) {
    return attention_bwd_entry<Backward>(args, ctx, "attention_bwd_sm90");
}
