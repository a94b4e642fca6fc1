/* cuda/sm90/gemm_kernel.cuh: the Hopper (sm_90a) warp-specialized wgmma GEMM main loop, shared by the
 * GEMM (sm90/gemm.cu) and the fused linear_logp kernels (sm90/linear_logp.cu), which differ only in
 * what an Epilogue policy does with the fp32 tiles.
 *
 * Tile plan. A persistent grid (one CTA per SM) walks work units in a grouped order that keeps a band
 * of A rows and B columns hot in L2; a unit is Epilogue::TILES_PER_UNIT output tiles of BM x BN in a
 * row (1 for a GEMM). Warpgroup 0 is the producer: one thread issues TMA loads (cp.async.bulk.tensor,
 * 128-byte swizzle, zero fill past K; rows of A past M, and of the swapped operands' B past N, are not
 * loaded) of BK = 64 wide k-slices of A and B into a ring of STAGES
 * shared-memory stages of SLICES k-slices each, which complete on mbarriers (the narrow decode configs
 * take 2-16 slices a stage: a weight stream's pace is set by its stages more than by its bytes,
 * docs/perf-notes.md "Decode GEMMs: bytes per stage"). Each consumer warpgroup owns 64 rows of the tile
 * and multiplies them with wgmma.m64nBNk16 (fp32 accumulators in registers, both operands read from
 * shared memory through descriptors whose transpose bits cover K-major and MN-major A and B); with
 * CLUSTER = 2, two CTAs on vertically adjacent tiles each load half of the shared B tile, multicast to
 * both (an odd last row tile goes in horizontally adjacent pairs instead, each CTA loading its own B:
 * plan_work_items). After each tile's k loop the Epilogue takes the accumulators: store_tiles forms
 * value(acc, C) in fp32 and stores with row/column predicates or, in the 2-consumer configs when out is
 * 16-byte aligned with a 16-byte multiple row stride, through two small shared-memory buffers per
 * consumer handed to TMA stores (store_tile_tma), so the consumers return to the next tile's wgmmas
 * without waiting on global stores.
 *
 * Stream-K (GEMM only, when the caller gives scratch memory): when the work items leave the last wave
 * partly empty, the last G + r items (G clusters, 0 < r < G) are shared out as equal ranges of
 * k-slices instead of whole items (the rounds before them run as usual): cluster g owns slices
 * [g T / G, (g + 1) T / G) of their T = (G + r) x k_tiles, in work order the tail of one item, whole
 * items, and the head of another. The head's owner runs its slices from zero and stores the fp32
 * accumulators to a slot of the workspace; the next cluster loads them and continues the same chain
 * through the remaining slices, then runs the epilogue. In the shared items each cluster does its head
 * first and its tail last, so the wait for the previous cluster's head is short or none; cluster g waits only on cluster
 * g - 1 of a persistent grid of co-resident clusters. This is the cuBLAS answer to wave quantization
 * without its split-K sums: no element is summed in a different order. Units of several tiles (the
 * linear_logp forward's vocabulary splits) are shared out the same way by tiles instead of k-slices,
 * the Epilogue's per-row state handed over instead of the accumulators (its hand_over / take_over).
 *
 * K chains (the GEMM's kernels instantiated with store_tiles' CHAINS, which sm90/gemm.cu runs from
 * K = 65536 on: a choice by K alone): the k-slices are cut into chains of chain_tiles at fixed
 * multiples, each chain a wgmma chain from zero, and an element is d = ((c0 + c1) + c2) + ... with
 * round-to-nearest fp32 adds in chain order. Where
 * the chains run is a schedule choice: a whole item runs its chains in turn, the running sum going
 * through this consumer's slot of p.partials (an exact fp32 copy); the items from kc.split_first on
 * (the last, partly empty round) run as one piece per chain on different clusters, chain-major in
 * work order; each piece stores its chain to its own slot, counts itself in, and the piece
 * that counts last loads the tile's chains and adds them in chain order. Either way the same chains
 * and the same adds, so the split may depend on M (it fills the last wave: at M = 209 the head's
 * dX, K = 151936, is 32 tiles). The counter only picks which CTA adds; it orders nothing.
 *
 * fp32 operands as bf16 parts (Epilogue::PARTS: both fp32 linear_logp passes, sm90/linear_logp.cu). An fp32
 * x is hi + mid + lo exactly (each part bf16 of what the previous ones leave), and a product x y is the six
 * exact bf16 products parts_plane pairs up, smallest first, leaving out mid lo, lo mid and lo lo (below
 * 2^-24 |x y| together, under fp32's own rounding of x y). Each operand comes as three bf16 planes [3][outer]
 * [ld] (hi, mid, lo; plane stride outer x ld), read by 3-D tensor maps; the k loop runs PARTS_BLOCKS
 * blocks of ceil(K / 64) k-slices, block b pairing A's plane parts_plane(false, b) with B's parts_plane(true,
 * b), in chains of Epilogue::CHAIN k-slices added in fp32 (mma_tile: one chain over 6 K would truncate
 * like no fp32 sum does). Stream-K shares such items by whole chains.
 *
 * Batch invariance. Every output element is produced by the same instruction sequence whatever the
 * tile config, M or the tile it lands in: its accumulator starts at 0 and receives the k16 steps
 * 0, 1, ..., ceil(K/64)*4 - 1 in order, one wgmma m64 x k16 step each (the k-slices past K are zero
 * filled by TMA, adding exact zeros; with K chains, the steps of each chain from 0 and the chains'
 * sum as above), then the epilogue's explicitly rounded fp32 operations. The wgmma N width (256 to
 * 16), the row offset inside the tile, the cluster, the k-slices per stage, the A rows staged (8 at
 * M <= 8: the wgmma's other rows re-read them), the store path and a stream-K hand-over (an exact fp32
 * copy of the accumulator registers, which the next wgmma adds into as it would have in place) do not
 * change an element's arithmetic.
 * No split-K sums by M, no order-dependent atomics. The per-op proofs are the GPU tests named in
 * sm90/gemm.cu and sm90/linear_logp.cu.
 *
 * Build: part of csrc/cuda/sm90/gemm.cu and linear_logp.cu (see there).
 */
#ifndef RLK_CUDA_SM90_GEMM_KERNEL_CUH_
#define RLK_CUDA_SM90_GEMM_KERNEL_CUH_

#include <string.h>

#include <type_traits>

#include "../../ops/gemm.h"
#include "ptx.cuh"
#include "wgmma.cuh"

#define BK 64                 /* k-slice per stage: 64 16-bit elements = one 128-byte swizzle row */
#define GROUP_M 16            /* work order: bands of GROUP_M row tiles sweep all column units in turn */
#define SMEM_ALIGN 1024       /* 128-byte swizzle atoms repeat every 8 rows x 128 bytes */
#define EPI_BOX_BYTES (64 * 128)

typedef struct gemm_sm90_params {
    int M, N, k_tiles;
    int m_tiles;
    int n_units;                              /* column work units of Epilogue::TILES_PER_UNIT tiles */
    int m_groups;                             /* groups of CLUSTER row tiles sharing B (work_coords) */
    int work_items;                           /* work items, a paired tail's included */
    int tail_band_first, tail_band_start;     /* paired tail: its band's first group and first item */
    int col_tiles;                            /* column tiles in all */
    uint32_t a_box_bytes;                     /* bytes one stage's A loads bring for a full row tile */
    uint32_t a_tail_box_bytes;                /* ... for the last row tile when M % BM != 0 (map_a_tail) */
    int a_tail_rows;                          /* that tile's rows, rounded up to 8 (BM: no such tile) */
    const void *c;
    int64_t ldc;
    void *out;
    int64_t ldo;
    float alpha, beta;
    int c_pairs_aligned, out_pairs_aligned;  /* 2-element vector access allowed for C / out */
    int tma_store;                            /* store through shared memory + TMA (map_out is valid) */
    int stream_k;                             /* split the k-slices evenly across clusters (see above) */
    float *partials;                          /* a 64 x BN fp32 slot per consumer of each CTA: stream-K's
                                                 hand-over, or a whole chained item's running sum */
    int *partial_ready;                       /* stream_k: a flag per slot, zeroed before the launch */
} gemm_sm90_params;
/* 128 bytes: one more field (K chains' first try) changed the code ptxas made for every GEMM kernel
 * and cost 3-5% at M = 209-2661 on the H100; the K-chain fields are their kernels' Epilogue::Params. */
static_assert(sizeof(gemm_sm90_params) == 128, "see above");

/* The K-chain kernels' parameters (store_tiles<.., CHAINS = true>::Params; see "K chains" above). */
typedef struct k_chain_params {
    int chain_tiles;                          /* k-slices per K chain */
    int chains;                               /* ceil(k_tiles / chain_tiles) */
    int split;                                /* run the last, partly empty round's items by chains */
    int split_first;                          /* items from here on run as one piece per chain */
    float *partials;                          /* split items: a 64 x BN slot per (CTA tile, consumer, chain) */
    int *arrivals;                            /* split items: a counter per consumer tile, zeroed before */
} k_chain_params;

/* The bf16 parts of fp32 operands (Epilogue::PARTS, see the top of this file): block b of the k loop
 * multiplies A's plane {lo, hi, mid, mid, hi, hi}[b] by B's {hi, lo, mid, hi, mid, hi}[b] (plane 0 hi,
 * 1 mid, 2 lo): lo hi + hi lo + mid mid + mid hi + hi mid + hi hi, smallest first. */
#define PARTS_BLOCKS 6
__host__ __device__ constexpr int parts_plane(bool b_side, int block) {
    return b_side ? (block == 1 ? 2 : block == 2 || block == 4 ? 1 : 0) : (block == 0 ? 2 : block == 2 || block == 3 ? 1 : 0);
}

/* ------------------------------------ storing epilogues ------------------------------------- */

/* The value stored for an accumulator element, as a function object called with (acc, c, has_c, h, col):
 * h picks the thread's row (0: 16w + l/4, 1: + 8), col is the output column; make() builds it for the
 * consumer's 64 rows at row0 before the tile's k loop. */

/* The GEMM's value: alpha * acc + beta * c, formed the same way (explicit rounding ops, no contraction
 * choices) for every element and config. */
struct gemm_value {
    struct Params {};
    static constexpr bool PAIR_TAIL = true, STREAM_K = true;
    float alpha, beta;
    static __device__ __forceinline__ gemm_value make(int, const gemm_sm90_params &p, const Params &) {
        return gemm_value{p.alpha, p.beta};
    }
    __device__ __forceinline__ float operator()(float acc, float c, bool has_c, int, int) const {
        return has_c ? __fmaf_rn(alpha, acc, __fmul_rn(beta, c)) : __fmul_rn(alpha, acc);
    }
};

/* Forms the values to store, in place: d = value(acc, C) over the consumer warpgroup's 64 x BN block.
 * wgmma's fp32 accumulator layout: thread t (warp w = t / 32, lane l) holds, for j < BN/8, rows
 * 16w + l/4 (+8) and columns 8j + 2(l%4) (+1) in d[4j .. 4j+3].
 * C loads: a block inside M x N with pair-aligned C takes a branch-free path that issues them in batches
 * of 2 x C_BATCH pairs before using any; per-element predicates put each load in its own branch, and the
 * one L2 round trip per load that this cost made an fp32 beta = 1 GEMM take 1.5x the time of beta = 0. */
#define C_BATCH 16
template <int N, int MAX>
__host__ __device__ constexpr int largest_divisor_upto() {
    int d = MAX;
    while (N % d != 0) --d;
    return d;
}

template <int BN, typename OutT, class Value>
__device__ __forceinline__ void apply_epilogue(float (&d)[BN / 2], int row0, int col0, const gemm_sm90_params &p,
                                               const Value &value) {
    const int t = threadIdx.x % 128;
    const int row_base = row0 + 16 * (t / 32) + (t % 32) / 4;
    const int col_base = col0 + 2 * (t % 4);
    const OutT *c = (const OutT *)p.c;
    const bool has_c = c != nullptr;
    if (has_c && p.c_pairs_aligned && row0 + 64 <= p.M && col0 + BN <= p.N) {
        /* a divisor of BN / 8 (192 wide: 12), so that no batch reaches past the block */
        constexpr int BATCH = largest_divisor_upto<BN / 8, C_BATCH>();
        const OutT *c_rows[2] = {c + (int64_t)row_base * p.ldc + col_base, c + (int64_t)(row_base + 8) * p.ldc + col_base};
#pragma unroll
        for (int j0 = 0; j0 < BN / 8; j0 += BATCH) {
            float2 cv[2][BATCH];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int jj = 0; jj < BATCH; ++jj) cv[h][jj] = load2_f32(c_rows[h] + 8 * (j0 + jj));
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int jj = 0; jj < BATCH; ++jj) {
                    const int j = j0 + jj, col = col_base + 8 * j;
                    d[4 * j + 2 * h] = value(d[4 * j + 2 * h], cv[h][jj].x, true, h, col);
                    d[4 * j + 2 * h + 1] = value(d[4 * j + 2 * h + 1], cv[h][jj].y, true, h, col + 1);
                }
        }
        return;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_base + 8 * h;
        const OutT *c_row = (has_c && row < p.M) ? c + (int64_t)row * p.ldc : nullptr;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = col_base + 8 * j;
            float2 cv = make_float2(0.f, 0.f);
            if (c_row != nullptr) {
                if (p.c_pairs_aligned && col + 1 < p.N) {
                    cv = load2_f32(c_row + col);
                } else {
                    if (col < p.N) cv.x = to_f32(c_row[col]);
                    if (col + 1 < p.N) cv.y = to_f32(c_row[col + 1]);
                }
            }
            d[4 * j + 2 * h] = value(d[4 * j + 2 * h], cv.x, has_c, h, col);
            d[4 * j + 2 * h + 1] = value(d[4 * j + 2 * h + 1], cv.y, has_c, h, col + 1);
        }
    }
}

/* Stores the block formed by apply_epilogue from registers, with row/column predicates. */
template <int BN, typename OutT>
__device__ __forceinline__ void store_tile(const float (&d)[BN / 2], int row0, int col0, const gemm_sm90_params &p) {
    const int t = threadIdx.x % 128;
    const int row_base = row0 + 16 * (t / 32) + (t % 32) / 4;
    const int col_base = col0 + 2 * (t % 4);
    OutT *out = (OutT *)p.out;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row_base + 8 * h;
        if (row >= p.M) continue;
        OutT *out_row = out + (int64_t)row * p.ldo;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = col_base + 8 * j;
            if (col + 1 < p.N && p.out_pairs_aligned) {
                store2_f32(out_row + col, make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
            } else {
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (col + e < p.N) from_f32(out_row + col + e, d[4 * j + 2 * h + e]);
            }
        }
    }
}

/* Epilogue through shared memory (2-consumer GEMM configs, out 16-byte aligned with a 16-byte multiple
 * row stride): the block formed by apply_epilogue goes out in ROUNDS rounds. Each round the threads write
 * their values into one of two 8 KB buffers (fill(r, buf)), and one thread issues the round's TMA stores
 * (store(r, buf)), which clip the M/N tails. The consumers then return to the next tile's wgmmas while the
 * copy engine writes global memory; a buffer is rewritten only after the store issued two rounds earlier
 * has finished reading it (every tile starts at buffer 0: after an even number of rounds the previous
 * tile's last store read buffer 1; after an odd number, buffer 0, so the first round waits for every
 * store). */
template <int ROUNDS, class Fill, class Store>
__device__ __forceinline__ void store_rounds(int t, uint32_t epi_smem, uint32_t barrier_id, const Fill &fill,
                                             const Store &store) {
    const bool issuer = t == 0;  /* t: the thread's index in the warpgroup */
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const uint32_t buf = epi_smem + (r % 2) * EPI_BOX_BYTES;
        if (issuer) {  /* stores that may still read the other buffer */
            if (r == 0 && ROUNDS % 2 == 1) bulk_wait_read<0>();
            else bulk_wait_read<1>();
        }
        warpgroup_sync(barrier_id);
        fill(r, buf);
        fence_proxy_async_smem();
        warpgroup_sync(barrier_id);
        if (issuer) {
            store(r, buf);
            bulk_commit();
        }
    }
}

/* store_rounds of 64 rows x 128 bytes of columns, in the TMA's 128-byte swizzle (16-byte chunk q of row r
 * at chunk q ^ (r % 8): a warp's 8 rows x 16 bytes hit all 32 banks once), one box a round. Same rounding
 * as store_tile. */
template <int BN, typename OutT>
__device__ __forceinline__ void store_tile_tma(const float (&d)[BN / 2], int row0, int col0,
                                               const CUtensorMap *map_out, uint32_t epi_smem, uint32_t barrier_id) {
    constexpr int ROUND_COLS = 128 / (int)sizeof(OutT);
    const int t = threadIdx.x % 128, lane = t % 32;
    const int tile_row = 16 * (t / 32) + lane / 4;  /* + 8h; tile_row % 8 == lane / 4 */
    auto fill = [&](int r, uint32_t buf) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int jj = 0; jj < ROUND_COLS / 8; ++jj) {
                const int j = r * (ROUND_COLS / 8) + jj;
                const int byte = (8 * jj + 2 * (lane % 4)) * (int)sizeof(OutT);
                const uint32_t addr = buf + (tile_row + 8 * h) * 128 + (((byte / 16) ^ (lane / 4)) * 16) + byte % 16;
                st_shared_pair(addr, make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]), (OutT *)nullptr);
            }
        }
    };
    auto store = [&](int r, uint32_t buf) { tma_store_2d(map_out, buf, col0 + r * ROUND_COLS, row0); };
    store_rounds<BN / ROUND_COLS>(t, epi_smem, barrier_id, fill, store);
}

/* store_tile_tma for a tile of swapped operands (out^T = B^T A^T, the transposed-out Epilogue policies:
 * the tile's rows are out's columns, its columns out's rows; 16-bit out). The same two 8 KB buffers, here
 * each holding 64 of out's rows (64 of the tile's columns a round) x its 64 columns (the consumer's 64
 * rows: 128 bytes), swizzled alike (chunk q of buffer row r at q ^ (r % 8)); a round goes out as boxes of
 * 16 rows, those inside the tile (BN is a multiple of 16: nothing lands in the next tile's rows). A
 * thread's values go in as 2-byte stores: a warp's 32 land in 4 buffer rows at 4 distinct chunks, no bank
 * conflict. */
template <int BN, typename OutT>
__device__ __forceinline__ void store_tile_tma_transposed(const float (&d)[BN / 2], int row0, int col0,
                                                          const CUtensorMap *map_out, uint32_t epi_smem,
                                                          uint32_t barrier_id) {
    static_assert(sizeof(OutT) == 2, "the consumer's 64 rows of 16-bit out are one 128-byte buffer row");
    static_assert(BN % 16 == 0, "boxes of 16 of out's rows");
    const int t = threadIdx.x % 128, lane = t % 32;
    const int tile_row = 16 * (t / 32) + lane / 4;  /* + 8h: out's column in the buffer row */
    auto fill = [&](int r, uint32_t buf) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            const int j = 8 * r + jj;
            if (j >= BN / 8) break;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int buf_row = 8 * jj + 2 * (lane % 4) + e;  /* the tile's column - 64r: out's row */
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int byte = (tile_row + 8 * h) * 2;
                    const uint32_t addr = buf + buf_row * 128 + (((byte / 16) ^ (buf_row % 8)) * 16) + byte % 16;
                    st_shared_16(addr, d[4 * j + 2 * h + e], (OutT *)nullptr);
                }
            }
        }
    };
    auto store = [&](int r, uint32_t buf) {
#pragma unroll
        for (int q = 0; q < 4; ++q)
            if (64 * r + 16 * q < BN) tma_store_2d(map_out, buf + q * 16 * 128, row0, col0 + 64 * r + 16 * q);
    };
    store_rounds<(BN + 63) / 64>(t, epi_smem, barrier_id, fill, store);
}

/* Where a consumer's stores go: the out tensor map and this consumer's shared-memory buffers. */
struct tile_store {
    const CUtensorMap *map_out;
    uint32_t epi_smem, barrier_id;
};

/* ------------------------------------ Epilogue policies ------------------------------------- */
/* An Epilogue policy says what the consumers do with the fp32 accumulators of each work unit:
 *   TILES_PER_UNIT  tiles per work unit, walked in increasing column order
 *   CHAIN           k-slices per fresh wgmma chain (0: one chain over K; see mma_tile)
 *   STORES_TILES    the tiles are stored to `out` of type OutT (gives the kernel TMA-store buffers)
 *   PAIR_TAIL       clusters of 2 take an unpartnered last row tile in pairs of units (plan_work_items;
 *                   units must be single tiles)
 *   STREAM_K        stream-K may share the last items between CTAs: a tile's k-slices (units of one
 *                   tile), or a unit's tiles (units of several: the row states handed over instead of
 *                   the accumulators, STATE_BN, hand_over / take_over below)
 *   K_CHAINS        the k-slices run as K chains (Params is k_chain_params; units of one tile)
 *   TRANSPOSED      the tiles are of out^T (swapped operands: store_tile_tma_transposed)
 *   PARTS           A and B are fp32 matrices as three bf16 planes each (see the top of this file)
 *   Params          its own kernel parameters
 *   begin(row0, p, ep) -> unit state, before the unit's first k loop
 *   tile<BN, BF16, TMA_STORE>(d, unit, row0, col0, p, ep, store), after each tile's k loop
 *   end(unit, row0, n_unit, p, ep), after the unit's last tile.
 * With STREAM_K and units of several tiles, also: STATE_BN, the unit state's width in a stream-K slot
 * (64 x STATE_BN floats per consumer: STATE_BN / 2 a thread), hand_over(unit, slot, ready, barrier) after a
 * piece that ends before the unit does, take_over(unit, slot, ready, barrier) after begin for a piece
 * that starts inside a unit. */

/* Tiles of value(acc, C) stored to out (OutT): the GEMM (Value = gemm_value; CHAINS: its kernels for
 * K chains; TRANSPOSED_OUT: its swapped operands, whose tiles are of out^T, stored through shared memory
 * only and without C) and the linear_logp backward's fused dz (Value = dlogits_value, sm90/linear_logp.cu). */
template <typename OutType, class Value, bool CHAINS = false, bool TRANSPOSED_OUT = false>
struct store_tiles {
    using OutT = OutType;
    static_assert(!CHAINS || std::is_empty<typename Value::Params>::value, "the chained kernels' Params are their own");
    using Params = std::conditional_t<CHAINS, k_chain_params, typename Value::Params>;
    static constexpr int TILES_PER_UNIT = 1, CHAIN = 0;
    static constexpr bool STORES_TILES = true, PAIR_TAIL = Value::PAIR_TAIL;
    static constexpr bool STREAM_K = Value::STREAM_K && !CHAINS && !TRANSPOSED_OUT, K_CHAINS = CHAINS;
    static constexpr bool TRANSPOSED = TRANSPOSED_OUT, PARTS = false;
    static __device__ __forceinline__ Value begin(int row0, const gemm_sm90_params &p, const Params &ep) {
        if constexpr (CHAINS) return Value::make(row0, p, typename Value::Params{});
        else return Value::make(row0, p, ep);
    }
    template <int BN, bool BF16, bool TMA_STORE>
    static __device__ __forceinline__ void tile(float (&d)[BN / 2], const Value &value, int row0, int col0,
                                                const gemm_sm90_params &p, const Params &, const tile_store &store) {
        apply_epilogue<BN, OutT>(d, row0, col0, p, value);
        if constexpr (TRANSPOSED) {
            static_assert(TMA_STORE, "out^T is stored through shared memory only");
            store_tile_tma_transposed<BN, OutT>(d, row0, col0, store.map_out, store.epi_smem, store.barrier_id);
            return;
        }
        if constexpr (TMA_STORE) {
            if (p.tma_store) {
                store_tile_tma<BN, OutT>(d, row0, col0, store.map_out, store.epi_smem, store.barrier_id);
                return;
            }
        }
        store_tile<BN, OutT>(d, row0, col0, p);
    }
    static __device__ __forceinline__ void end(const Value &, int, int, const gemm_sm90_params &, const Params &) {}
};

/* store_tiles of a product of fp32 operands given as bf16 planes (PARTS): chains of 8 k-slices, as
 * linear_logp's forward folds them (mma_tile); no tail pairing. */
template <typename OutType, class Value>
struct store_parts_tiles : store_tiles<OutType, Value> {
    static constexpr int CHAIN = 8;
    static constexpr bool PAIR_TAIL = false, PARTS = true;
};

/* ------------------------------------ main loop --------------------------------------------- */

/* The width of a stream-K slot (64 x SLOT_BN fp32 per consumer): a tile's accumulators when a unit is
 * one tile, the Epilogue's unit state when a unit is several tiles (stream-K then shares tiles). */
template <int BN, class Epilogue>
constexpr int stream_k_slot_bn() {
    if constexpr (Epilogue::TILES_PER_UNIT > 1) return Epilogue::STATE_BN;
    else return BN;
}

/* A piece of work (plan.piece: a range [k_begin, k_end) of an item) as the tiles of its unit and the
 * k-slices of each: with units of one tile the range is of k-slices; with units of several tiles the
 * range is of the unit's tiles (stream-K shares tiles; every tile runs all k_tiles slices). */
template <int TILES_PER_UNIT>
__device__ __forceinline__ void unit_piece(int &k_begin, int &k_end, int &tile_begin, int &tile_end, int k_tiles) {
    if constexpr (TILES_PER_UNIT > 1) {
        tile_begin = k_begin, tile_end = k_end;
        k_begin = 0, k_end = k_tiles;
    } else {
        tile_begin = 0, tile_end = 1;
    }
}

/* A PARTS kernel's piece in k-slices: stream-K shares its one-tile items in whole chains (item_length
 * counts chains), since a piece that ended inside a chain would hand over d without that chain's sum
 * (units of several tiles are shared by tiles, each tile's chains whole). */
template <class Epilogue>
__device__ __forceinline__ void chain_aligned_piece(int &k_begin, int &k_end, int k_tiles) {
    if constexpr (Epilogue::PARTS && Epilogue::TILES_PER_UNIT == 1) {
        k_begin *= Epilogue::CHAIN;
        k_end = min(k_end * Epilogue::CHAIN, k_tiles);
    }
}

/* One box of an operand by TMA: 2-D, or with PARTS from plane `plane` of its 3-D map. */
template <bool PARTS>
__device__ __forceinline__ void load_box(uint32_t dst, const CUtensorMap *map, int inner, int outer, int plane,
                                         uint32_t bar) {
    if constexpr (PARTS) tma_load_3d(dst, map, inner, outer, plane, bar);
    else tma_load_2d(dst, map, inner, outer, bar);
}

template <bool PARTS>
__device__ __forceinline__ void load_box_multicast(uint32_t dst, const CUtensorMap *map, int inner, int outer,
                                                   int plane, uint32_t bar) {
    if constexpr (PARTS) tma_load_3d_multicast(dst, map, inner, outer, plane, bar, 0x3);
    else tma_load_2d_multicast(dst, map, inner, outer, bar, 0x3);
}

/* The work items of a grid: groups of CLUSTER vertically adjacent row tiles (one per CTA of a cluster,
 * sharing the B tiles) times the column units; when the last row tile has no partner (clusters of 2, an
 * odd number of row tiles) and Epilogue::PAIR_TAIL, that row tile instead goes in horizontally adjacent
 * pairs of units, one per CTA, each CTA loading its own B. Unpaired, the second CTA of that group
 * computes a phantom row tile past M (at M = 1334, 11 row tiles, 1/12 of the grid's time).
 * Fills p's m_tiles, col_tiles, n_units, m_groups, work_items and tail_band_* for tiles of bm x bn in
 * units of tiles_per_unit (the kernel reads them from there; the workspace plan counts items with it). */
static inline void plan_work_items(gemm_sm90_params *p, int64_t M, int64_t N, int bm, int bn, int tiles_per_unit,
                                   int cluster, bool pair_tail_allowed) {
    p->m_tiles = (int)((M + bm - 1) / bm);
    p->col_tiles = (int)((N + bn - 1) / bn);
    p->n_units = (p->col_tiles + tiles_per_unit - 1) / tiles_per_unit;
    const bool pair_tail = cluster == 2 && pair_tail_allowed && p->m_tiles % 2 == 1;
    p->m_groups = pair_tail ? p->m_tiles / 2 : (p->m_tiles + cluster - 1) / cluster;
    p->work_items = p->m_groups * p->n_units + (pair_tail ? (p->n_units + 1) / 2 : 0);
    const int band = GROUP_M / cluster;
    p->tail_band_first = p->m_groups > 0 ? (p->m_groups - 1) / band * band : 0;
    p->tail_band_start = pair_tail ? p->tail_band_first * p->n_units : INT32_MAX;
}

/* Work index -> (row tile, column work unit); returns whether the cluster shares the item's B tiles.
 * Bands of GROUP_M row tiles sweep all column units in turn. In the last band of a paired tail, each
 * two units' group items are followed by the tail's pair of them, while their B tiles are still in L2:
 * the pairs placed after all group items read B from memory a second time, 0.9x at M = 304 on the LM
 * head (N = 151936), where B's bytes bound the time. With an odd number of units the last pair's second
 * CTA gets a phantom tile past M, as a cluster's second CTA does in an unpaired tail: it loads no A and
 * stores nothing, but runs the k loop, keeping the CTAs of the cluster in step through the stages.
 * Selects, not branches: a branch here moved the producer's loop state off the uniform datapath. */
template <int CLUSTER, bool PAIR_TAIL>
__device__ __forceinline__ bool work_coords(int work, const gemm_sm90_params &p, int cta_rank, int *m_blk,
                                            int *n_unit) {
    constexpr int band = GROUP_M / CLUSTER;
    const bool tail_band = CLUSTER == 2 && PAIR_TAIL && work >= p.tail_band_start;
    /* an ordinary band */
    const int w = tail_band ? 0 : work;
    const int band_size = band * p.n_units;
    const int first = (w / band_size) * band;
    const int rows = min(p.m_groups - first, band);
    const int local = w % band_size;
    /* the tail's band: blocks of two units, each rows_t x 2 group items and then a pair */
    const int rows_t = max(p.m_groups - p.tail_band_first, 1);  /* 0 groups: blocks of the pair alone */
    const int block_size = tail_band ? 2 * (p.m_groups - p.tail_band_first) + 1 : 1;
    const int l = tail_band ? work - p.tail_band_start : 0;
    const int block = l / block_size, r = l % block_size;
    const bool pair = r >= block_size - 1 - (2 * block + 1 == p.n_units ? p.m_groups - p.tail_band_first : 0);
    const int pair_unit = 2 * block + cta_rank;
    const bool phantom = pair_unit == p.n_units;  /* a tile past M */
    *m_blk = !tail_band ? (first + local % rows) * CLUSTER + cta_rank
             : pair     ? p.m_tiles - 1 + phantom
                        : (p.tail_band_first + r % rows_t) * CLUSTER + cta_rank;
    *n_unit = !tail_band ? local / rows : pair ? pair_unit - phantom : 2 * block + r / rows_t;
    return CLUSTER == 2 && !(tail_band && pair);
}

/* The work of one cluster, in the order it runs: whole items first + i * stride (i < count), a head
 * piece (k-slices [0, head_end) of head_work; none when head_end = 0), whole items sk_first + i (i <
 * sk_count), a tail piece (k-slices [tail_begin, k_tiles) of tail_work; none when tail_begin = 0).
 * Without stream-K only whole items, strided over the clusters: a round of G items at a time, all
 * clusters in step through k, so tiles that share A rows or B columns read them from L2 at about the
 * same time. With stream-K the same rounds come first but one; the last G + r items (0 < r < G) are
 * shared out as equal ranges of k-slices, contiguous in work order, so no item spans more than two
 * clusters. Measured on the H100: stream-K over all items made M >= 8942 1.7x slower (ranges far
 * apart in work order share nothing in L2), and heads before the whole rounds 1.2-1.4x slower at
 * K = 12288 (the heads' lengths put the clusters out of step for every round). */
struct work_plan {
    int head_work, head_end;
    int first, count, stride;
    int sk_first, sk_count;
    int tail_work, tail_begin;

    __device__ __forceinline__ int pieces() const { return count + (head_end > 0) + sk_count + (tail_begin > 0); }
    __device__ __forceinline__ void piece(int i, int k_tiles, int *work, int *k_begin, int *k_end) const {
        *k_begin = 0, *k_end = k_tiles;
        if (i < count) {
            *work = first + i * stride;
            return;
        }
        i -= count;
        if (head_end > 0) {
            if (i == 0) {
                *work = head_work, *k_end = head_end;
                return;
            }
            --i;
        }
        if (i < sk_count) *work = sk_first + i;
        else *work = tail_work, *k_begin = tail_begin;
    }
};

__device__ __forceinline__ work_plan plan_work(bool stream_k, int num_work, int k_tiles, int cluster, int clusters) {
    work_plan w = {0, 0, cluster, 0, clusters, 0, 0, 0, 0};
    if (!stream_k) {
        w.count = cluster < num_work ? (num_work - cluster + clusters - 1) / clusters : 0;
        return w;
    }
    w.count = num_work / clusters - 1;  /* whole rounds before the shared ones */
    const int shared_first = w.count * clusters;
    const int64_t total = (int64_t)(num_work - shared_first) * k_tiles;
    const int64_t begin = total * cluster / clusters, end = total * (cluster + 1) / clusters;
    w.sk_first = shared_first + (int)(begin / k_tiles);
    if (begin % k_tiles) {
        w.tail_work = w.sk_first++;
        w.tail_begin = (int)(begin % k_tiles);
    }
    const int last = shared_first + (int)(end / k_tiles);
    w.head_work = last;
    w.head_end = (int)(end % k_tiles);
    w.sk_count = last - w.sk_first;
    return w;
}

/* K chains: a strided work index of a chained kernel -> a whole item (k-slices [0, k_tiles)) before
 * kc.split_first, or one chain of a later item, chain-major (chain j of every split item, then chain
 * j + 1: a round's clusters read the same k-range of the A rows or B columns they share). */
__device__ __forceinline__ void chain_piece(int index, const gemm_sm90_params &p, const k_chain_params &kc,
                                            int *work, int *k_begin, int *k_end) {
    *work = index, *k_begin = 0, *k_end = p.k_tiles;
    if (index < kc.split_first) return;
    const int split_items = p.work_items - kc.split_first;
    const int chain = (index - kc.split_first) / split_items;
    *work = index - chain * split_items;
    *k_begin = chain * kc.chain_tiles;
    *k_end = min(p.k_tiles, *k_begin + kc.chain_tiles);
}

/* One consumer warpgroup's 64 x BN accumulators to a slot of 64 x BN floats, through L2: thread t's
 * d[4i .. 4i+3] go to float4 i * 128 + t (each warp access 512 contiguous bytes). The slots of
 * stream-K's hand-over and of the K chains all have this layout. */
template <int BN>
__device__ __forceinline__ void store_slot(const float (&d)[BN / 2], float *slot) {
    float4 *dst = (float4 *)slot + threadIdx.x % 128;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) __stcg(dst + 128 * i, make_float4(d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]));
}

/* Stream-K hand-over of the accumulators through a slot (store_slot's layout) and its flag. */
template <int BN>
__device__ __forceinline__ void store_partial(const float (&d)[BN / 2], float *slot, int *ready, uint32_t barrier_id) {
    store_slot<BN>(d, slot);
    warpgroup_sync(barrier_id);
    if (threadIdx.x % 128 == 0) flag_release(ready);
}

template <int BN>
__device__ __forceinline__ void load_partial(float (&d)[BN / 2], const float *slot, const int *ready,
                                             uint32_t barrier_id) {
    const int t = threadIdx.x % 128;
    if (t == 0) flag_acquire(ready);
    warpgroup_sync(barrier_id);
    const float4 *src = (const float4 *)slot + t;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
        const float4 v = __ldcg(src + 128 * i);
        d[4 * i] = v.x, d[4 * i + 1] = v.y, d[4 * i + 2] = v.z, d[4 * i + 3] = v.w;
    }
}

/* K chains (see the top of this file). A whole item's running sum: d = slot + d after every chain but
 * the first, stored back after every chain but the last. Each thread reads only what it wrote. */
template <int BN>
__device__ __forceinline__ void fold_chain(float (&d)[BN / 2], float *slot, bool first, bool last) {
    float4 *sum = (float4 *)slot + threadIdx.x % 128;
    if (!first) {
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
            const float4 v = __ldcg(sum + 128 * i);
            d[4 * i] = __fadd_rn(v.x, d[4 * i]), d[4 * i + 1] = __fadd_rn(v.y, d[4 * i + 1]);
            d[4 * i + 2] = __fadd_rn(v.z, d[4 * i + 2]), d[4 * i + 3] = __fadd_rn(v.w, d[4 * i + 3]);
        }
    }
    if (!last) store_slot<BN>(d, slot);
}

/* A split item's piece: stores chain `chain` of this consumer's 64 x BN block to its slot of
 * kc.partials and counts itself in; returns false unless it counted last, in which case
 * d = ((c0 + c1) + c2) + ... loaded from the slots (its own chain too: the order is fixed, whoever
 * adds). The whole warpgroup decides together: the epilogue after it meets at named barriers. */
template <int BN, int CLUSTER, int CONSUMERS>
__device__ __forceinline__ bool gather_chains(float (&d)[BN / 2], const k_chain_params &kc, int work, int cta_rank,
                                              int chain, int c) {
    const int t = threadIdx.x % 128;
    const int64_t block = ((int64_t)(work - kc.split_first) * CLUSTER + cta_rank) * CONSUMERS + c;
    float *chain_slots = kc.partials + block * kc.chains * 64 * BN;
    store_slot<BN>(d, chain_slots + (int64_t)chain * 64 * BN);
    const float4 *slots = (const float4 *)chain_slots + t;
    warpgroup_sync(1u + c);
    const bool counted_last = t == 0 && count_arrival(kc.arrivals + block) == kc.chains - 1;
    if (!warpgroup_any(1u + c, counted_last)) return false;
    /* in blocks of up to 8 float4 per thread (a divisor of BN / 8: the swapped operands' widths are
     * multiples of 16), so that the loads in flight fit beside d */
    constexpr int F4 = BN / 8, BLOCK = largest_divisor_upto<F4, 8>();
#pragma unroll
    for (int i0 = 0; i0 < F4; i0 += BLOCK) {
        float4 sum[BLOCK];
#pragma unroll
        for (int i = 0; i < BLOCK; ++i) sum[i] = __ldcg(slots + (i0 + i) * 128);
        for (int j = 1; j < kc.chains; ++j) {
            float4 v[BLOCK];
#pragma unroll
            for (int i = 0; i < BLOCK; ++i) v[i] = __ldcg(slots + (j * F4 + i0 + i) * 128);
#pragma unroll
            for (int i = 0; i < BLOCK; ++i) {
                sum[i].x = __fadd_rn(sum[i].x, v[i].x), sum[i].y = __fadd_rn(sum[i].y, v[i].y);
                sum[i].z = __fadd_rn(sum[i].z, v[i].z), sum[i].w = __fadd_rn(sum[i].w, v[i].w);
            }
        }
#pragma unroll
        for (int i = 0; i < BLOCK; ++i) {
            const int e = 4 * (i0 + i);
            d[e] = sum[i].x, d[e + 1] = sum[i].y, d[e + 2] = sum[i].z, d[e + 3] = sum[i].w;
        }
    }
    return true;
}

/* two epilogue buffers per consumer for the 2-consumer kernels that store their tiles (store_tile_tma,
 * which stores rounds of 128 bytes of columns: BN a multiple of 64; store_tile_tma_transposed, rounds of
 * 64 columns in boxes of 16: BN a multiple of 16) */
template <int BN, int CONSUMERS, class Epilogue>
__host__ __device__ constexpr int epi_buffers() {
    return CONSUMERS == 2 && Epilogue::STORES_TILES && (BN % 64 == 0 || Epilogue::TRANSPOSED) ? 2 * CONSUMERS : 0;
}

template <int BN, int CONSUMERS, int A_ROWS, int STAGES, int SLICES, class Epilogue>
constexpr int gemm_sm90_smem_bytes() {
    return STAGES * SLICES * (A_ROWS * CONSUMERS + BN) * BK * 2 +
           epi_buffers<BN, CONSUMERS, Epilogue>() * EPI_BOX_BYTES + SMEM_ALIGN + 2 * STAGES * 8;
}

/* Frees a stage for the producers of this CTA and, with clusters, of the peer CTA (whose producer wrote
 * half of this stage's B tile). */
template <int CLUSTER>
__device__ __forceinline__ void release_stage(uint32_t bar, int cta_rank) {
    mbar_arrive(bar);
    if constexpr (CLUSTER == 2) mbar_arrive_cluster(bar, cta_rank ^ 1);
}

/* Issues the 4 NS k16 wgmmas of the NS k-slices in shared-memory slots slot, slot + 1, ... into d
 * (accumulate = 0: the first one starts d from zero) as one commit group. A_ROWS = 8: a consumer's A
 * slot holds 8 rows and the descriptor's 8-row stride is 0, so the wgmma's rows 8-63 read rows 0-7
 * again (rows past M <= 8, never stored; each row's arithmetic is its own). */
template <int BN, int CONSUMERS, int A_ROWS, bool A_MN, bool B_MN, bool BF16, int NS>
__device__ __forceinline__ void issue_k_slices(float (&d)[BN / 2], int slot, uint32_t a_rows, uint32_t b_smem,
                                               int accumulate) {
    static_assert(A_ROWS == 64 || (A_ROWS == 8 && !A_MN && CONSUMERS == 1), "8-row A slots: K-major, one consumer");
    constexpr uint32_t A_SLICE = A_ROWS * CONSUMERS * BK * 2, B_SLICE = BN * BK * 2;
    constexpr uint32_t A_SBO = A_ROWS == 8 ? 0 : 1024;
    constexpr uint32_t MN_BOX = 64 * BK * 2;  /* one 64 (MN) x 64 (K) box of an MN-major operand */
    constexpr uint32_t A_K16 = A_MN ? 16 * 128 : 32;  /* byte step per k16 inside a stage */
    constexpr uint32_t B_K16 = B_MN ? 16 * 128 : 32;
    constexpr uint32_t A_LBO = A_MN ? MN_BOX : 16, B_LBO = B_MN ? MN_BOX : 16;
    wgmma_fence();
    fence_accumulators(d);
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const uint64_t da = smem_desc(a_rows + (slot + j) * A_SLICE + kk * A_K16, A_LBO, A_SBO);
            const uint64_t db = smem_desc(b_smem + (slot + j) * B_SLICE + kk * B_K16, B_LBO, 1024);
            wgmma_k16<BN, BF16, A_MN, B_MN>(d, da, db, j > 0 || kk > 0 || accumulate);
        }
    wgmma_commit();
    fence_accumulators(d);
}

/* The k-slices in the stage that starts at slice kt of a range ending at k_end: SLICES, or one each
 * for the range's last k_end - kt < SLICES slices (producer and consumers cut a range alike). */
template <int SLICES>
__host__ __device__ __forceinline__ int stage_slices(int kt, int k_end) {
    return kt + SLICES <= k_end ? SLICES : 1;
}

/* One consumer warpgroup's k loop over k-slices [k_begin, k_end) of one tile: d = its 64 rows (A at a_rows)
 * times the BN columns, from zero when k_begin = 0, else continuing the chain d holds (stream-K).
 * it counts stages through the ring across tiles; a stage holds SLICES k-slices, or one at the end of
 * the range (the producer cuts the range the same way: stage_slices). Each stage is freed once the
 * wgmmas reading it are done, keeping one stage of wgmmas in flight while waiting for the previous one.
 * CHAIN = 0 (GEMM): every k16 step accumulates into d.
 * CHAIN = c > 0 (linear_logp, one slice a stage): every c consecutive 64-wide k-slices form a fresh
 * wgmma chain from zero, added into d with a round-to-nearest fp32 FADD. The tensor cores' accumulator
 * adds truncate, which over one 4096-long chain gave 3.2e-4 logp error at logits up to ~50
 * (docs/perf-notes.md); chains of 1, 2 or 4 slices gave ~2e-5, 8 (linear_logp's) 3.1e-5 and 2-3% less
 * time than 4 (a chain per slice cost 25%). Every order here depends on K alone. */
template <int BN, int CONSUMERS, int A_ROWS, int STAGES, int SLICES, int CLUSTER, bool A_MN, bool B_MN, bool BF16,
          int CHAIN>
__device__ __forceinline__ void mma_tile(float (&d)[BN / 2], int k_begin, int k_end, int &it, uint32_t a_rows,
                                         uint32_t b_smem, uint32_t full_bar, uint32_t empty_bar, int cta_rank) {
    static_assert(CHAIN == 0 || SLICES == 1, "chains are counted in stages of one slice");
    const bool warp_leader = threadIdx.x % 32 == 0;
    float chain[CHAIN > 0 ? BN / 2 : 1];
    if (k_begin == 0) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    }
    bool prev_busy = false;  /* the previous stage still awaits release */
    /* the stage of k-slices kt .. kt + NS - 1 */
    auto run_stage = [&](auto ns, int kt) {
        constexpr int NS = decltype(ns)::value;
        const int s = it % STAGES;
        mbar_wait(full_bar + 8 * s, (it / STAGES) & 1);
        if constexpr (CHAIN > 0)
            issue_k_slices<BN, CONSUMERS, A_ROWS, A_MN, B_MN, BF16, NS>(chain, s * SLICES, a_rows, b_smem,
                                                                        kt % CHAIN != 0);
        else issue_k_slices<BN, CONSUMERS, A_ROWS, A_MN, B_MN, BF16, NS>(d, s * SLICES, a_rows, b_smem, 1);
        /* keep this stage's wgmmas in flight; the previous one's are done -> free its stage */
        wgmma_wait<1>();
        if (prev_busy && warp_leader) release_stage<CLUSTER>(empty_bar + 8 * ((it - 1) % STAGES), cta_rank);
        prev_busy = true;
        if constexpr (CHAIN > 0) {
            if (kt % CHAIN == CHAIN - 1 || kt == k_end - 1) {
                wgmma_wait<0>();
                fence_accumulators(chain);
                if (warp_leader) release_stage<CLUSTER>(empty_bar + 8 * s, cta_rank);
                prev_busy = false;
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) d[i] = __fadd_rn(d[i], chain[i]);
            }
        }
    };
    int kt = k_begin;
    for (; kt + SLICES <= k_end; kt += SLICES, ++it) run_stage(std::integral_constant<int, SLICES>{}, kt);
    if constexpr (SLICES > 1)
        for (; kt < k_end; ++kt, ++it) run_stage(std::integral_constant<int, 1>{}, kt);
    /* unconditional: a wgmma wait inside a branch made ptxas serialize every wgmma (C7518) */
    wgmma_wait<0>();
    fence_accumulators(d);
    if (prev_busy && warp_leader) release_stage<CLUSTER>(empty_bar + 8 * ((it - 1) % STAGES), cta_rank);
}

/* A_MN: A is MN-major in memory (a_trans = 1); B_MN: B is MN-major (b_trans = 0). CLUSTER = 2: the two
 * CTAs of a cluster compute vertically adjacent tiles and each loads half of the shared B tile,
 * multicast into both, which halves B's L2 -> SM traffic. A_ROWS: the A rows a consumer stages per
 * k-slice, 64, or 8 when M <= 8 (issue_k_slices). SLICES: k-slices per stage (mma_tile). Epilogue: what
 * the consumers do with each unit's tiles (see "Epilogue policies" above). */
template <int BN, int CONSUMERS, int A_ROWS, int STAGES, int SLICES, int CLUSTER, bool A_MN, bool B_MN, bool BF16,
          class Epilogue>
__global__ void __launch_bounds__((CONSUMERS + 1) * 128, 1)
gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_a_tail,
                 const __grid_constant__ CUtensorMap map_b, const __grid_constant__ CUtensorMap map_b_tail,
                 const __grid_constant__ CUtensorMap map_out, const gemm_sm90_params p,
                 const typename Epilogue::Params ep) {
    constexpr int BM = 64 * CONSUMERS;
    constexpr int TILES_PER_UNIT = Epilogue::TILES_PER_UNIT;
    constexpr bool TMA_EPILOGUE = epi_buffers<BN, CONSUMERS, Epilogue>() > 0;
    constexpr uint32_t A_SLICE = A_ROWS * CONSUMERS * BK * 2, B_SLICE = BN * BK * 2;  /* a k-slice's slot */
    constexpr uint32_t MN_BOX = 64 * BK * 2;  /* one 64 (MN) x 64 (K) box of an MN-major operand */
    /* a K-major B tile's rows in boxes of BN / CLUSTER (map_b's box: a cluster's CTAs load one each) */
    constexpr int B_BOX_ROWS = BN / CLUSTER;
    /* B rows past N stay unloaded in the swapped operands' tiles (TRANSPOSED: B is X, and the last of the
     * equal-width tiles of its rows is partly empty): stale rows reach accumulator columns past N only,
     * which the transposed store never stores. The other kernels keep TMA's zero fill: a fold over a row
     * (linear_logp's) would read those columns, and the extra producer instructions made the 64-wide
     * tiles 4-6% slower (perf-notes, "Swapped operands at the layer's shapes") */
    constexpr bool B_TAIL_UNLOADED = !B_MN && Epilogue::TRANSPOSED;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t smem = (smem_u32(smem_raw) + SMEM_ALIGN - 1) & ~(uint32_t)(SMEM_ALIGN - 1);
    const uint32_t a_smem = smem, b_smem = smem + STAGES * SLICES * A_SLICE;
    const uint32_t epi_smem = b_smem + STAGES * SLICES * B_SLICE;  /* 1024-aligned: slots are multiples of 1 KB */
    const uint32_t full_bar = epi_smem + epi_buffers<BN, CONSUMERS, Epilogue>() * EPI_BOX_BYTES;
    const uint32_t empty_bar = full_bar + STAGES * 8;
    const int cta_rank = CLUSTER == 1 ? 0 : (int)cluster_ctarank();

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + 8 * s, 1);
            /* lane 0 of every consumer warp of every CTA reading the stage's B tile */
            mbar_init(empty_bar + 8 * s, 4 * CONSUMERS * CLUSTER);
        }
        fence_mbarrier_init();
    }
    if constexpr (CLUSTER == 1) __syncthreads();
    else cluster_sync();

    const int warpgroup = threadIdx.x / 128;
    constexpr bool STREAM_K = Epilogue::STREAM_K, K_CHAINS = Epilogue::K_CHAINS, PARTS = Epilogue::PARTS;
    static_assert(!PARTS || (BF16 && SLICES == 1 && Epilogue::CHAIN > 0 && !K_CHAINS && !Epilogue::TRANSPOSED),
                  "bf16 parts: chains of one-slice stages");
    /* a chained kernel strides over its pieces (chain_piece), the others over their items */
    int num_work = p.work_items;
    if constexpr (K_CHAINS) num_work = ep.split_first + (p.work_items - ep.split_first) * ep.chains;
    /* what stream-K shares out: k-slices of one-tile units (PARTS: whole chains of them), or tiles of a unit */
    const int item_length = TILES_PER_UNIT > 1 ? TILES_PER_UNIT
                            : PARTS            ? (p.k_tiles + Epilogue::CHAIN - 1) / Epilogue::CHAIN
                                               : p.k_tiles;
    const work_plan plan = plan_work(STREAM_K && p.stream_k, num_work, item_length, blockIdx.x / CLUSTER,
                                     gridDim.x / CLUSTER);

    if (warpgroup == 0) {
        /* producer: one thread keeps the ring full across tiles */
        if constexpr (CONSUMERS == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            int it = 0;
            for (int i = 0; i < plan.pieces(); ++i) {
                int work, k_begin, k_end, m_blk, n_unit, tile_begin, tile_end;
                plan.piece(i, item_length, &work, &k_begin, &k_end);
                if constexpr (K_CHAINS) chain_piece(work, p, ep, &work, &k_begin, &k_end);
                unit_piece<TILES_PER_UNIT>(k_begin, k_end, tile_begin, tile_end, p.k_tiles);
                chain_aligned_piece<Epilogue>(k_begin, k_end, p.k_tiles);
                const bool b_shared = work_coords<CLUSTER, Epilogue::PAIR_TAIL>(work, p, cta_rank, &m_blk, &n_unit);
                /* the k loop, instantiated for a B tile shared by the cluster or not: a branch on b_shared
                 * inside it moved the loop's state off the uniform datapath */
                auto load_tiles = [&](auto shared_b) {
                    constexpr bool SHARED_B = decltype(shared_b)::value;
                    const int n_end = min(n_unit * TILES_PER_UNIT + tile_end, p.col_tiles);
                    for (int n_blk = n_unit * TILES_PER_UNIT + tile_begin; n_blk < n_end; ++n_blk) {
                        /* K-major B in boxes of B_BOX_ROWS: the last column tile loads its boxes inside N in
                         * full, the one N cuts through by map_b_tail (its rows rounded up to 8) and none past
                         * N, like A's tail (B_TAIL_UNLOADED) */
                        int b_full_boxes = BN / B_BOX_ROWS, b_tail_rows = 0;
                        if constexpr (B_TAIL_UNLOADED) {
                            const int rows = min(BN, p.N - n_blk * BN);
                            b_full_boxes = rows / B_BOX_ROWS;
                            b_tail_rows = (rows % B_BOX_ROWS + 7) / 8 * 8;
                        }
                        const uint32_t b_bytes = (b_full_boxes * B_BOX_ROWS + b_tail_rows) * BK * 2;
                        auto load_b_box = [&](uint32_t dst, int box, int k, int plane, uint32_t bar) {
                            const CUtensorMap *map = &map_b;
                            if constexpr (B_TAIL_UNLOADED) {
                                if (box > b_full_boxes || (box == b_full_boxes && b_tail_rows == 0)) return;
                                if (box == b_full_boxes) map = &map_b_tail;
                            }
                            const int row = n_blk * BN + box * B_BOX_ROWS;
                            if constexpr (SHARED_B) load_box_multicast<PARTS>(dst, map, k, row, plane, bar);
                            else load_box<PARTS>(dst, map, k, row, plane, bar);
                        };
                        for (int kt = k_begin; kt < k_end; ++it) {
                            const int s = it % STAGES;
                            const int slices = stage_slices<SLICES>(kt, k_end);
                            mbar_wait(empty_bar + 8 * s, ((it / STAGES) & 1) ^ 1);
                            const uint32_t bar = full_bar + 8 * s;
                            /* A rows past M are not loaded (the TMA's zero fill of absent rows is slow): the
                             * last row tile loads its rows rounded up to 8, a phantom tile past M none; the
                             * stale shared memory only reaches accumulator rows that are never stored */
                            const int a_rows = m_blk < p.m_tiles - 1 ? BM : m_blk == p.m_tiles - 1 ? p.a_tail_rows : 0;
                            const uint32_t a_bytes = a_rows == BM ? p.a_box_bytes : a_rows > 0 ? p.a_tail_box_bytes : 0;
                            mbar_arrive_expect_tx(bar, slices * (a_bytes + b_bytes));
#pragma unroll
                            for (int j = 0; j < SLICES; ++j) {
                                if (j > 0 && j >= slices) break;
                                const int slot = s * SLICES + j;
                                /* PARTS: k-slice kt + j is slice k / BK of block `block`, whose planes pair up */
                                int k = (kt + j) * BK, plane_a = 0, plane_b = 0;
                                if constexpr (PARTS) {
                                    const int block_tiles = p.k_tiles / PARTS_BLOCKS, block = (kt + j) / block_tiles;
                                    k = (kt + j - block * block_tiles) * BK;
                                    plane_a = parts_plane(false, block), plane_b = parts_plane(true, block);
                                }
                                if constexpr (A_MN) {
#pragma unroll
                                    for (int jj = 0; jj < BM / 64; ++jj)
                                        if (64 * jj < a_rows)
                                            load_box<PARTS>(a_smem + slot * A_SLICE + jj * MN_BOX, &map_a,
                                                            m_blk * BM + 64 * jj, k, plane_a, bar);
                                } else if (a_rows > 0) {
                                    load_box<PARTS>(a_smem + slot * A_SLICE, a_rows == BM ? &map_a : &map_a_tail, k,
                                                    m_blk * BM, plane_a, bar);
                                }
                                const uint32_t b_dst = b_smem + slot * B_SLICE;
                                if constexpr (SHARED_B) {
                                    /* this CTA's half of the B tile, into both CTAs */
                                    constexpr int HALF = BN / 2;
                                    if constexpr (B_MN) {
#pragma unroll
                                        for (int jj = 0; jj < HALF / 64; ++jj) {
                                            const int jb = cta_rank * (HALF / 64) + jj;
                                            load_box_multicast<PARTS>(b_dst + jb * MN_BOX, &map_b, n_blk * BN + 64 * jb,
                                                                      k, plane_b, bar);
                                        }
                                    } else {
                                        load_b_box(b_dst + cta_rank * HALF * BK * 2, cta_rank, k, plane_b, bar);
                                    }
                                } else {
                                    /* the whole B tile into this CTA: MN-major in 64-column boxes, K-major in the
                                     * map's boxes of BN / CLUSTER rows */
                                    constexpr int B_BOX = B_MN ? 64 : B_BOX_ROWS;
#pragma unroll
                                    for (int jb = 0; jb < BN / B_BOX; ++jb) {
                                        const uint32_t dst = b_dst + jb * B_BOX * BK * 2;
                                        if constexpr (B_MN) load_box<PARTS>(dst, &map_b, n_blk * BN + B_BOX * jb, k, plane_b, bar);
                                        else load_b_box(dst, jb, k, plane_b, bar);
                                    }
                                }
                            }
                            kt += slices;
                        }
                    }
                };
                if constexpr (CLUSTER == 2) {
                    if (b_shared) load_tiles(std::true_type{});
                    else load_tiles(std::false_type{});
                } else {
                    load_tiles(std::false_type{});
                }
            }
        }
    } else {
        /* consumer warpgroup c: rows 64c .. 64c+63 of each tile */
        if constexpr (CONSUMERS == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int c = warpgroup - 1;
        /* K-major: A_ROWS rows of 128 bytes; MN-major: one 64 x BK box. Both are 8 KB per 64 rows. */
        const uint32_t a_rows = a_smem + c * A_ROWS * BK * 2;
        float d[BN / 2];
        int it = 0;
        for (int i = 0; i < plan.pieces(); ++i) {
            int work, k_begin, k_end, m_blk, n_unit, tile_begin, tile_end;
            plan.piece(i, item_length, &work, &k_begin, &k_end);
            if constexpr (K_CHAINS) chain_piece(work, p, ep, &work, &k_begin, &k_end);
            unit_piece<TILES_PER_UNIT>(k_begin, k_end, tile_begin, tile_end, p.k_tiles);
            chain_aligned_piece<Epilogue>(k_begin, k_end, p.k_tiles);
            work_coords<CLUSTER, Epilogue::PAIR_TAIL>(work, p, cta_rank, &m_blk, &n_unit);
            const int row0 = m_blk * BM + 64 * c;
            const tile_store store{&map_out, epi_smem + c * 2 * EPI_BOX_BYTES, 1u + c};
            auto unit = Epilogue::begin(row0, p, ep);  /* per-row data, loaded before the k loop */
            if constexpr (TILES_PER_UNIT == 1) {
                const int slot = (int)blockIdx.x * CONSUMERS + c;
                if constexpr (K_CHAINS) {
                    /* a whole item: its chains in turn, summed through the slot; else one chain */
                    const bool whole = k_begin == 0 && k_end == p.k_tiles;
                    for (int kb = k_begin; kb < k_end;) {
                        const int ke = min(k_end, kb + ep.chain_tiles);
                        if (kb > 0) {  /* a fresh chain, as mma_tile starts one at k = 0 */
#pragma unroll
                            for (int e = 0; e < BN / 2; ++e) d[e] = 0.f;
                        }
                        mma_tile<BN, CONSUMERS, A_ROWS, STAGES, SLICES, CLUSTER, A_MN, B_MN, BF16, Epilogue::CHAIN>(
                            d, kb, ke, it, a_rows, b_smem, full_bar, empty_bar, cta_rank);
                        if (whole) fold_chain<BN>(d, p.partials + (int64_t)slot * 64 * BN, kb == 0, ke == k_end);
                        kb = ke;
                    }
                    if (!whole && !gather_chains<BN, CLUSTER, CONSUMERS>(d, ep, work, cta_rank, k_begin / ep.chain_tiles, c))
                        continue;
                } else {
                    /* stream-K slots: this CTA's tail piece continues from slot (cta, c), written by the
                     * same rank of the previous cluster; its head piece goes to the next cluster's slot */
                    if (STREAM_K && k_begin > 0)
                        load_partial<BN>(d, p.partials + (int64_t)slot * 64 * BN, p.partial_ready + slot, 1u + c);
                    /* no loop state: with it the 256-wide dz kernel spilled */
                    mma_tile<BN, CONSUMERS, A_ROWS, STAGES, SLICES, CLUSTER, A_MN, B_MN, BF16, Epilogue::CHAIN>(
                        d, k_begin, k_end, it, a_rows, b_smem, full_bar, empty_bar, cta_rank);
                    if (STREAM_K && k_end < p.k_tiles) {
                        const int next = slot + CLUSTER * CONSUMERS;
                        store_partial<BN>(d, p.partials + (int64_t)next * 64 * BN, p.partial_ready + next, 1u + c);
                        continue;
                    }
                }
                Epilogue::template tile<BN, BF16, TMA_EPILOGUE>(d, unit, row0, n_unit * BN, p, ep, store);
            } else {
                /* stream-K slots as above, holding the unit's state: a piece that starts inside the unit
                 * continues the state the previous cluster's piece handed over, taken over after its first
                 * tile's k loop (waiting before it ran the pieces of a unit one after another), or at once
                 * when the piece holds only tiles past the vocabulary's last; one that ends before the
                 * unit does hands its state to the next cluster */
                constexpr int SLOT_FLOATS = 64 * stream_k_slot_bn<BN, Epilogue>();
                const int slot = (int)blockIdx.x * CONSUMERS + c;
                bool to_take_over = STREAM_K && tile_begin > 0;
                const int n_end = min(n_unit * TILES_PER_UNIT + tile_end, p.col_tiles);
                for (int n_blk = n_unit * TILES_PER_UNIT + tile_begin; n_blk < n_end; ++n_blk) {
                    mma_tile<BN, CONSUMERS, A_ROWS, STAGES, SLICES, CLUSTER, A_MN, B_MN, BF16, Epilogue::CHAIN>(
                        d, 0, p.k_tiles, it, a_rows, b_smem, full_bar, empty_bar, cta_rank);
                    if (to_take_over)
                        Epilogue::take_over(unit, p.partials + (int64_t)slot * SLOT_FLOATS, p.partial_ready + slot, 1u + c);
                    to_take_over = false;
                    Epilogue::template tile<BN, BF16, TMA_EPILOGUE>(d, unit, row0, n_blk * BN, p, ep, store);
                }
                if (to_take_over)
                    Epilogue::take_over(unit, p.partials + (int64_t)slot * SLOT_FLOATS, p.partial_ready + slot, 1u + c);
                if constexpr (STREAM_K) {
                    if (tile_end < TILES_PER_UNIT) {
                        const int next = slot + CLUSTER * CONSUMERS;
                        Epilogue::hand_over(unit, p.partials + (int64_t)next * SLOT_FLOATS, p.partial_ready + next,
                                            1u + c);
                        continue;
                    }
                }
            }
            Epilogue::end(unit, row0, n_unit, p, ep);
        }
        /* the last stores must finish reading shared memory before the CTA exits */
        if (TMA_EPILOGUE && p.tma_store && threadIdx.x % 128 == 0) bulk_wait_all();
    }
    /* the peer CTA may still arrive on this CTA's barriers: leave together */
    if constexpr (CLUSTER == 2) {
        __syncwarp();
        cluster_sync();
    }
}

/* ------------------------------------ host side --------------------------------------------- */

/* Map over a [outer, inner] matrix (inner contiguous, rows row_bytes apart), 128-byte swizzled boxes of
 * box_inner x box_outer elements; out-of-bounds elements read as zero (loads) or are skipped (stores).
 * planes = 3: over three such matrices one after another (a PARTS operand), a box from one plane. */
static bool make_tensor_map(CUtensorMap *map, CUtensorMapDataType dtype, const void *base, int64_t inner,
                            int64_t outer, int64_t row_bytes, int box_inner, int box_outer, int planes = 1) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (!encode) return false;
    const cuuint64_t dims[3] = {(cuuint64_t)inner, (cuuint64_t)outer, (cuuint64_t)planes};
    const cuuint64_t strides[2] = {(cuuint64_t)row_bytes, (cuuint64_t)(row_bytes * outer)};
    const cuuint32_t box[3] = {(cuuint32_t)box_inner, (cuuint32_t)box_outer, 1};
    const cuuint32_t elem_strides[3] = {1, 1, 1};
    return encode(map, dtype, planes > 1 ? 3 : 2, (void *)base, dims, strides, box, elem_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* Builds the tensor maps and launches gemm_sm90_kernel for the product args describes (A, B, out), with
 * p's epilogue fields (C, alpha, beta) filled by the caller. Epilogue::PARTS: args->a and b are the first
 * of three bf16 planes each (parts of fp32 matrices, in args' layout), args->K the fp32 product's K. */
template <int BN, int CONSUMERS, int A_ROWS, int STAGES, int SLICES, int CLUSTER, bool A_MN, bool B_MN, bool BF16,
          class Epilogue>
static int launch_gemm_sm90(const rlk_gemm_args *args, gemm_sm90_params p, const typename Epilogue::Params &ep,
                            int device, int num_sms, cudaStream_t stream) {
    using OutT = typename Epilogue::OutT;
    constexpr int BM = 64 * CONSUMERS;
    if (A_ROWS < 64 && args->M > A_ROWS) return RLK_UNSUPPORTED;  /* 8-row A slots hold M <= 8 only */
    /* the last row tile's A loads: its rows rounded up to 8 (K-major: a box of that many rows; MN-major:
     * the 64-row boxes that hold them) */
    const int tail = (int)(args->M % BM);
    p.a_tail_rows = tail == 0 ? BM : (int)round_up(tail, 8);
    p.a_box_bytes = BM * BK * 2;
    p.a_tail_box_bytes = (uint32_t)(A_MN ? round_up(p.a_tail_rows, 64) : p.a_tail_rows) * BK * 2;
    const CUtensorMapDataType in_type = BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    constexpr int PLANES = Epilogue::PARTS ? 3 : 1;
    if constexpr (Epilogue::PARTS) p.k_tiles *= PARTS_BLOCKS;
    CUtensorMap map_a, map_a_tail, map_b, map_b_tail, map_out;
    memset(&map_a, 0, sizeof(map_a));
    memset(&map_a_tail, 0, sizeof(map_a_tail));
    memset(&map_b, 0, sizeof(map_b));
    memset(&map_b_tail, 0, sizeof(map_b_tail));
    memset(&map_out, 0, sizeof(map_out));
    if (args->K > 0) {
        const bool ok_a =
            A_MN ? make_tensor_map(&map_a, in_type, args->a, args->M, args->K, args->lda * 2, 64, BK, PLANES)
                 : make_tensor_map(&map_a, in_type, args->a, args->K, args->M, args->lda * 2, BK, BM, PLANES) &&
                       (tail == 0 || make_tensor_map(&map_a_tail, in_type, args->a, args->K, args->M, args->lda * 2, BK,
                                                     p.a_tail_rows, PLANES));
        const bool ok_b =
            B_MN ? make_tensor_map(&map_b, in_type, args->b, args->N, args->K, args->ldb * 2, 64, BK, PLANES)
                 : make_tensor_map(&map_b, in_type, args->b, args->K, args->N, args->ldb * 2, BK, BN / CLUSTER, PLANES);
        /* the swapped kernels' box of the last column tile that N cuts through (B_TAIL_UNLOADED), rows
         * rounded up to 8 */
        const int b_tail_rows = (int)round_up((args->N - (args->N - 1) / BN * BN) % (BN / CLUSTER), 8);
        const bool ok_b_tail = !Epilogue::TRANSPOSED || B_MN || b_tail_rows == 0 ||
                               make_tensor_map(&map_b_tail, in_type, args->b, args->K, args->N, args->ldb * 2, BK, b_tail_rows);
        if (!ok_a || !ok_b || !ok_b_tail) return RLK_UNSUPPORTED;
    }
    /* out as [M rows, N columns] in boxes of 64 rows x 128 bytes (store_tile_tma); else the register path.
     * Transposed: out^T, i.e. out as [N rows, M columns] in boxes of 16 rows x 64 columns
     * (store_tile_tma_transposed), which the caller has checked TMA can describe */
    p.tma_store = 0;
    if constexpr (Epilogue::TRANSPOSED) {
        static_assert(sizeof(OutT) == 2 && !B_MN, "swapped operands: 16-bit out, K-major B (the tokens' rows)");
        if (!make_tensor_map(&map_out, in_type, args->out, args->M, args->N, args->ldo * 2, 64, 16))
            return RLK_UNSUPPORTED;
        p.tma_store = 1;
    } else if (epi_buffers<BN, CONSUMERS, Epilogue>() > 0 && (uintptr_t)args->out % 16 == 0 &&
        (args->ldo * (int64_t)sizeof(OutT)) % 16 == 0 && args->ldo * (int64_t)sizeof(OutT) < (1ll << 40)) {
        const CUtensorMapDataType out_type = sizeof(OutT) == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : in_type;
        p.tma_store = make_tensor_map(&map_out, out_type, args->out, args->N, args->M, args->ldo * (int64_t)sizeof(OutT),
                                      128 / (int)sizeof(OutT), 64);
    }
    auto kernel = gemm_sm90_kernel<BN, CONSUMERS, A_ROWS, STAGES, SLICES, CLUSTER, A_MN, B_MN, BF16, Epilogue>;
    constexpr int smem_bytes = gemm_sm90_smem_bytes<BN, CONSUMERS, A_ROWS, STAGES, SLICES, Epilogue>();
    static_assert(smem_bytes <= 227 * 1024, "shared memory");

    cudaLaunchConfig_t config;
    memset(&config, 0, sizeof(config));
    cudaLaunchAttribute cluster_attr;
    cluster_attr.id = cudaLaunchAttributeClusterDimension;
    cluster_attr.val.clusterDim.x = CLUSTER;
    cluster_attr.val.clusterDim.y = 1;
    cluster_attr.val.clusterDim.z = 1;
    config.blockDim = dim3((CONSUMERS + 1) * 128);
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    config.attrs = &cluster_attr;
    config.numAttrs = 1;

    /* once per device and instantiation: raise the shared-memory limit, count co-resident clusters */
    static uint64_t configured_devices = 0;
    static int max_clusters[64];
    if (device >= 64) return RLK_UNSUPPORTED;
    if (!(configured_devices & (1ull << device))) {
        cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
        if (err != cudaSuccess) return (int)err;
        int clusters = num_sms / CLUSTER;
        if (CLUSTER > 1) {
            config.gridDim = dim3(num_sms / CLUSTER * CLUSTER);
            if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess || clusters < 1)
                clusters = num_sms / CLUSTER;
            cudaGetLastError();
        }
        max_clusters[device] = clusters;
        configured_devices |= 1ull << device;
    }
    static_assert(!Epilogue::PAIR_TAIL || Epilogue::TILES_PER_UNIT == 1, "a phantom unit must run its partner's k loop");
    plan_work_items(&p, args->M, args->N, BM, BN, Epilogue::TILES_PER_UNIT, CLUSTER, Epilogue::PAIR_TAIL);
    const int work = p.work_items;
    /* K chains: with kc.split, the items past the last whole round run as one piece per chain */
    typename Epilogue::Params kernel_ep = ep;
    int pieces = work;
    if constexpr (Epilogue::K_CHAINS) {
        k_chain_params &kc = kernel_ep;
        kc.chains = (p.k_tiles + kc.chain_tiles - 1) / kc.chain_tiles;
        kc.split_first = kc.split ? work / max_clusters[device] * max_clusters[device] : work;
        pieces = kc.split_first + (work - kc.split_first) * kc.chains;
        /* chain_workspace_bytes' layout; a chained GEMM runs only with it (its running sums) */
        if (p.partials == nullptr) return (int)cudaErrorInvalidValue;
        const int64_t blocks = (int64_t)(work - kc.split_first) * CLUSTER * CONSUMERS;
        kc.partials = p.partials + (int64_t)num_sms * CONSUMERS * 64 * BN;
        kc.arrivals = (int *)(kc.partials + blocks * kc.chains * 64 * BN);
        if (blocks > 0) {
            const cudaError_t err = cudaMemsetAsync(kc.arrivals, 0, sizeof(int) * blocks, stream);
            if (err != cudaSuccess) return (int)err;
        }
    }
    const int clusters = pieces < max_clusters[device] ? pieces : max_clusters[device];
    config.gridDim = dim3(clusters * CLUSTER);
    /* stream-K (p.partials: stream_k_workspace_bytes of scratch) pays only where whole items would leave
     * the last wave partly empty, and needs no item to span three clusters */
    if (p.stream_k && (work < max_clusters[device] || work % clusters == 0)) p.stream_k = 0;
    if (p.stream_k) {
        p.partial_ready = (int *)(p.partials + (int64_t)num_sms * CONSUMERS * 64 * stream_k_slot_bn<BN, Epilogue>());
        const cudaError_t err = cudaMemsetAsync(p.partial_ready, 0, sizeof(int) * clusters * CLUSTER * CONSUMERS, stream);
        if (err != cudaSuccess) return (int)err;
    }
    const cudaError_t err = cudaLaunchKernelEx(&config, kernel, map_a, map_a_tail, map_b, map_b_tail, map_out, p, kernel_ep);
    return err == cudaSuccess ? RLK_OK : (int)err;
}


/* Scratch memory for stream-K (launch_gemm_sm90 with p.stream_k and p.partials): a 64 x bn fp32 slot
 * and a flag per consumer warpgroup of each of up to num_sms CTAs. */
static inline int64_t stream_k_workspace_bytes(int bn, int consumers, int num_sms) {
    return (int64_t)num_sms * consumers * (64 * bn + 1) * 4;
}

/* Scratch memory for a chained GEMM of `work` items on clusters of `cluster`: the running sums (a
 * 64 x bn slot per consumer of each of up to num_sms CTAs), then with `split` a slot per chain and a
 * counter for each consumer of the split items' CTA tiles; those are the items past the last whole
 * round, fewer than a round (at most num_sms / cluster). */
static inline int64_t chain_workspace_bytes(int bn, int consumers, int cluster, int work, int chains, bool split,
                                            int num_sms) {
    const int64_t split_items = split ? (work < num_sms / cluster ? work : num_sms / cluster) : 0;
    const int64_t blocks = split_items * cluster * consumers;
    return ((int64_t)num_sms * consumers * 64 * bn + blocks * (chains * 64 * bn + 1)) * 4;
}

/* A 16-bit operand TMA can describe: 16-byte aligned base, row stride a multiple of 16 bytes below 2^40.
 * (The binding presents CUDA operands 16-byte aligned, copying a misaligned view, so in practice only
 * the row stride decides.) */
static inline bool tma_operand_ok(const void *base, int64_t ld) {
    return (uintptr_t)base % 16 == 0 && ld > 0 && (ld * 2) % 16 == 0 && ld * 2 < (1ll << 40);
}

static inline bool pairs_aligned(const void *ptr, int64_t ld, int elem_bytes) {
    return ((uintptr_t)ptr % (2 * elem_bytes) == 0) && (ld % 2 == 0);
}

/* The kernel parameters of the product args describes, epilogue fields (C, out, alpha, beta) included;
 * launch_gemm_sm90 fills in the tiling. */
static inline gemm_sm90_params gemm_params(const rlk_gemm_args *args) {
    const int out_bytes = args->out_dtype == RLK_F32 ? 4 : 2;
    gemm_sm90_params p;
    memset(&p, 0, sizeof(p));
    p.M = (int)args->M;
    p.N = (int)args->N;
    p.k_tiles = (int)((args->K + BK - 1) / BK);
    p.c = args->c;
    p.ldc = args->ldc;
    p.out = args->out;
    p.ldo = args->ldo;
    p.alpha = (float)args->alpha;
    p.beta = (float)args->beta;
    p.c_pairs_aligned = args->c != nullptr && pairs_aligned(args->c, args->ldc, out_bytes);
    p.out_pairs_aligned = pairs_aligned(args->out, args->ldo, out_bytes);
    return p;
}

#endif /* RLK_CUDA_SM90_GEMM_KERNEL_CUH_ */
