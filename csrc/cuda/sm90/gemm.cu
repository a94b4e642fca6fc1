/* sm90/gemm.cu: Hopper (sm_90a) batch-invariant GEMM, out = alpha * A @ B + beta * C (contract:
 * csrc/ops/gemm.h), on the warp-specialized wgmma main loop of gemm_kernel.cuh (tile plan and the
 * invariance argument are there).
 *
 * Tile configs (all the same per-element k16 wgmma sequence; choose_plan picks by M, N and K):
 *   large:  BM = 128 (2 consumer warpgroups, setmaxnreg 232/40), BN = 256, 4 stages + 32 KB of epilogue
 *           buffers, clusters of 2 CTAs on vertically adjacent tiles sharing B by multicast;
 *   medium: the same with BN = 128, 6 stages;
 *   tall:   BM = 128 (2 consumers), BN = 64, 8 stages, clusters of 2 with K-major B (else none): twice
 *           the tiles of medium for shapes whose medium tiles leave SMs idle (M = N = 1024);
 *   wide:   BM = 128 (2 consumers), BN = 192, 4 stages, clusters of 2, K-major B only (half of 192
 *           MN-major columns is no 64-wide box): one wave where medium needs two and large fills
 *           two-thirds of the SMs at most (k / v, N = 1024, at M = 2049-2816);
 *   small:  BM = 64 (1 consumer warpgroup), BN = 64, 12 stages, no cluster;
 *   narrow: BM = 64, BN = 96 / 48 / 32 / 16 (stages x k-slices 5 x 2 / 3 x 4 / 4 x 4 / 5 x 4; 16 wide
 *           at M <= 8: 4 x 16 with 8-row A slots), K-major B only;
 *   narrow x2: BM = 128 (2 consumers), BN = 96 / 64 / 48 / 32 / 16 (8 / 8 / 10 / 11 / 12 stages), no
 *           cluster (at M <= 128 the second CTA of a cluster would own only rows past M), K-major B
 *           except BN = 64; 64 wide also at 129-256 rows in place of tall when its tiles fit one wave and
 *           K <= 8192.
 *   Every config but narrow stages one 64-wide k-slice at a time. Narrow tiles stream weights, and
 *   bigger stages stream them faster (docs/perf-notes.md "Decode GEMMs: bytes per stage"; narrow x2:
 *   measured no faster).
 *   swapped: out^T = W X^T in tiles of 128 weight rows (2 consumers) x 80-240 of M's rows, clusters of 2
 *           sharing X by multicast, at 65-1408 rows with at least 4 waves of weight tiles (the LM head),
 *           and at the other shapes from 257 rows where their estimate beats the normal plan's by 5%;
 *           with K chains (the head's dX = G W as dX^T = W^T G^T, W MN-major) 144-240 of M's rows, where
 *           the chain rounds cost less than the normal tiles'.
 * M <= 128 (decode) takes the narrowest narrow config whose tiles still fit in one wave (x2 above 64 rows,
 * unless two one-consumer row tiles of 16 or 32 columns fit), the weights streaming through as many SMs as
 * possible, and so does M <= 256 where a one-consumer narrow config's row tiles all fit in one wave (k / v);
 * other M whichever of the first five (wide: unchained, K-major B) a measured ns-per-step estimate finds
 * fastest, in waves of whole tiles or stream-K (gemm_kernel.cuh: every SM an equal share of the k-slices, a
 * tile split between two CTAs continuing one accumulator chain through L2; the workspace is planned,
 * ctx->workspace_bytes).
 * From K = 65536 on the kernels' K-chain variants run instead (4 chains summed in order;
 * gemm_kernel.cuh, "K chains").
 *
 * Invariance proof on the GPU: tests/test_gpu_gemm.py (every M of the sweep 1..4096 against M = 4096 on
 * the Qwen3-8B shapes, which exercises every config; rows shifted across tiles; outputs and operands at
 * aligned and unaligned addresses compared with torch.equal).
 *
 * Limits (-> RLK_UNSUPPORTED, the sm80 kernel runs): dtypes other than bf16/fp16 in, in-dtype/fp32 out;
 * A or B not TMA-describable (base 16-byte aligned, row stride a multiple of 16 bytes); N or K >= 2^31. C and out:
 * any alignment/stride.
 *
 * Build: python3 csrc/cuda/sm90/wgmma_gen.py build/gen && nvcc -c -gencode arch=compute_90a,code=sm_90a
 *        -O3 -std=c++17 -lineinfo -Xptxas -v -Xcompiler -fPIC -Icsrc -Ibuild/gen csrc/cuda/sm90/gemm.cu
 * Test (GPU): python3 setup.py build_ext --inplace && pytest tests/test_gpu_gemm.py -m gpu (or
 *   scripts/gpu_check.sh: GPU tests, compute-sanitizer, benchmarks; history in docs/perf-notes.md).
 */
#include "gemm_kernel.cuh"

/* The tile configs. All of them compute every output element with the same k16 wgmma sequence, so the
 * choice among them is a performance choice only (bitwise-equal rows are tested across them). */
enum { CONFIG_LARGE, CONFIG_MEDIUM, CONFIG_SMALL, CONFIG_TALL, CONFIG_WIDE, CONFIG_NARROW96, CONFIG_NARROW48,
       CONFIG_NARROW32, CONFIG_NARROW16, CONFIG_NARROW96_X2, CONFIG_NARROW64_X2, CONFIG_NARROW48_X2,
       CONFIG_NARROW32_X2, CONFIG_NARROW16_X2 };
static const int config_bn[CONFIG_NARROW16_X2 + 1] = {256, 128, 64, 64, 192, 96, 48, 32, 16, 96, 64, 48, 32, 16};
static const int config_consumers[CONFIG_NARROW16_X2 + 1] = {2, 2, 1, 2, 2, 1, 1, 1, 1, 2, 2, 2, 2, 2};
/* clusters of 2 share B by multicast: large, medium, wide, and tall with K-major B (launch_config) */
static int config_cluster(int config, bool b_mn) {
    return config == CONFIG_LARGE || config == CONFIG_MEDIUM || config == CONFIG_WIDE ||
                   (config == CONFIG_TALL && !b_mn)
               ? 2
               : 1;
}
/* ns per k16 step of a wave of tiles, measured on the H100 (bench_gemm_layer, median over the Qwen3-8B
 * layer shapes; docs/perf-notes.md "Layer GEMMs at ragged token counts"). wide measured 135-160 but is
 * charged 177: at the measured figure it displaced large + stream-K at K = 12288 (M = 1334, 1362),
 * where it ran 4% slower, because stream-K's charge (fitted at K = 4096) is too high at long K; 177
 * keeps every pick of the layer's shapes on the measured winner (perf-notes: "A 192-wide tile"). */
static const int config_step_ns[CONFIG_WIDE + 1] = {197, 126, 74, 106, 177};
/* Stream-K's cost beyond its share of the k-slices, in waves of whole tiles: fitted to the H100
 * (docs/perf-notes.md, "Stream-K"): with G + r items shared out it measured ~0.2-0.5 of a wave above
 * (tiles / SMs) waves (partials through L2, the clusters no longer in step through k, waits), plus
 * the flag memset. So it pays where the last wave of whole tiles is less than about half full. */
#define STREAM_K_EXTRA_WAVES 0.45
#define STREAM_K_FIXED_NS 2000.0
/* The tall tiles at 129-256 rows run without their cluster up to this K (choose_plan: measured at K = 4096
 * faster, at 12288 slower on the H100) */
#define NO_CLUSTER_MAX_K 8192

/* K chains (gemm_kernel.cuh): from K = 65536 on, the k-slices are cut into K_CHAIN_COUNT chains of equal
 * length (the last one shorter) summed in order, at every M of the shape: a function of K alone. The
 * LM head's dX (K = 151936) has 32 tiles at M = 209, and its chains spread a tile over 4 CTAs; at any
 * M they fill the last wave with quarters of tiles instead of whole ones. Shorter chains also lose
 * less to the tensor cores' truncating accumulator adds (perf-notes: linear_logp's chains). Why 4: each
 * chain boundary of a whole tile costs time (8 chains made the head's dX 4-16% slower at M = 16384, 16
 * chains 35%; 4 chains none measurable), and 4 quarters still fill the wave at M = 209 (perf-notes). */
#define CHAIN_MIN_K 65536
#define K_CHAIN_COUNT 4
/* the split pieces' cost beyond their share: the arrival counters' memset and the last piece of each
 * tile loading every chain's slot */
#define CHAIN_SPLIT_FIXED_NS 5000.0

static int k_chains(int64_t K) { return K >= CHAIN_MIN_K ? K_CHAIN_COUNT : 1; }

/* k-slices per chain (all of them for an unchained K) */
static int chain_tiles(int64_t K) { return (int)(((K + 63) / 64 + k_chains(K) - 1) / k_chains(K)); }

typedef struct gemm_plan {
    int config;
    bool stream_k;     /* an equal share of the k-slices per cluster (unchained shapes) */
    bool chain_split;  /* the last, partly empty round of items by chains (chained shapes) */
    int swapped_bn;    /* > 0: swapped operands, M in tiles of this many columns (launch_swapped) */
} gemm_plan;

/* Swapped operands: out^T = W X^T, for out = X W^T with many weight rows (the LM head: N = 151,936) at
 * 65-1408 rows. wgmma's M is 64 rows a consumer, its N any multiple of 8, so the normal tiles compute M
 * rounded up to 128 (129 rows as 256, 304 as 384), the swapped ones M cut into the fewest tiles of at most
 * SWAP_MAX_BN columns of equal width rounded up to 16 (304 as 2 x 160): W as A in 128-row tiles of 2
 * consumers, the rows of X as B tiles that each cluster of 2 shares by multicast, out^T stored through
 * shared memory (store_tile_tma_transposed). Every element is the same k16 sequence of the same
 * products, so the same bits (tests/test_gpu_gemm.py; probed on an H200 with inputs of wide exponent
 * range in every config: 0 of 560 differ). Taken where it computes fewer rows than the normal tiles by
 * more than 1/32 (or M fits one tile: 65-240 rows), as measured on the H100 at the head (perf-notes,
 * "Swapped operands"): 65-240 rows 2-6% faster, 257-479 3-12%, 791-1334 2-9%; not taken at 256 (0.5%
 * slower) or 1091 (2.8% fewer rows: 1% slower). Also: unchained, K-major X and W, no C, 16-bit out that
 * TMA can store, and at least SWAP_MIN_WAVES waves of weight tiles (fewer leave SMs idle in the last
 * wave: the 12,288-wide gate projection at M = 200 ran 15% slower swapped). Up to 64 rows the
 * one-consumer 64 x 64 tiles read the weights at the copy rate. */
#define SWAP_MIN_M 65
#define SWAP_MAX_M 1408
#define SWAP_MIN_WAVES 4
#define SWAP_MAX_BN 240
/* Swapped operands at the other shapes (fewer weight tiles than the head's) from SWAP_ANY_MIN_M rows: M in
 * t tiles of equal width (SWAP_MIN_BN to SWAP_MAX_BN, rounded up to 16) for the t whose waves of 128 x width
 * tiles cost the least, taken where that is below the normal plan's estimate by more than SWAP_ANY_MARGIN.
 * The swapped tiles' width is a finer menu than the normal tiles' 64 / 128 / 192 / 256: they fill waves and
 * pad M less (791 rows: 4 x 208 in one wave of q's 128 tiles, against 7 x 128 = 896 rows on 112 large
 * tiles). Measured on the H200 over the layer's forward shapes at 209-5482 rows, each width paired with
 * cuBLAS (perf-notes, "Swapped operands at the layer's shapes"): 5-17% faster at k / v 1025-2710,
 * q / o 304-446 and 791, gate / up 791, down 304-446, 791 and 2661, the rest within 3%; at 209-256 rows
 * every width was slower than the normal tiles (k / v: 8 weight tiles) */
#define SWAP_ANY_MIN_M 257
#define SWAP_ANY_MARGIN 0.05
#define SWAP_MIN_BN 80
/* A swapped tile's ns per k16 step: medium's (128 wide) to large's (256) by width, and no less than at
 * SWAP_STEP_FLOOR_BN: on the H200 one wave of 80-112-wide tiles took 93-107 ns a step, 128-wide 110,
 * 208-wide 162 (below 112 the time stopped shrinking with the width) */
#define SWAP_STEP_FLOOR_BN 96
/* K chains (the head's dX = G W, K = 151,936, N = 4096) swap from 129 to SWAP_CHAINED_MAX_M rows: out^T =
 * W^T G^T in tiles of 128 of W's columns x 144-240 of G's rows, where the chain rounds cost less than the
 * normal tiles' (chained_ns) by more than 1/32; the normal tiles compute M rounded up to 128 (256 for a
 * cluster's pair) and read W a second time for an odd row tile. A swapped tile's ns per k16 step is
 * interpolated between medium's (128 wide) and large's (256) by width, times SWAP_CHAINED_STEP_SCALE: on
 * the H100 the swapped tiles ran at 0.90-0.94 of the unscaled figure, the large tiles at 0.93-0.96 of theirs
 * (perf-notes, "Swapped operands for the head's dX") */
#define SWAP_CHAINED_MIN_BN 144
#define SWAP_CHAINED_MAX_M 4096
#define SWAP_CHAINED_STEP_SCALE 0.97

/* The width of M's rows cut into `tiles` swapped tiles of equal width, rounded up to 16 */
static int64_t swapped_width(int64_t M, int64_t tiles) { return round_up((M + tiles - 1) / tiles, 16); }

static double swapped_step_ns(int64_t bn) {
    const int64_t width = bn > SWAP_STEP_FLOOR_BN ? bn : SWAP_STEP_FLOOR_BN;
    return config_step_ns[CONFIG_MEDIUM] +
           (double)(width - 128) / 128 * (config_step_ns[CONFIG_LARGE] - config_step_ns[CONFIG_MEDIUM]);
}

/* ns of a chained plan: tiles in waves, or whole rounds and then the last round's tiles as one piece per
 * chain (split: there is such a round and the pieces pay), at step_ns per k16 step of a tile */
static double chained_ns(int64_t tiles, double steps, int chains, double step_ns, int num_sms, bool *split) {
    const int64_t rest = tiles % num_sms;  /* tiles past the whole rounds */
    const double waves_ns = (double)((tiles + num_sms - 1) / num_sms) * steps * step_ns;
    const double split_ns = (double)(tiles / num_sms) * steps * step_ns +
                            (double)((rest * chains + num_sms - 1) / num_sms) * ceil(steps / chains) * step_ns +
                            CHAIN_SPLIT_FIXED_NS;
    *split = rest > 0 && split_ns < waves_ns;
    return *split ? split_ns : waves_ns;
}

/* Up to 128 rows (decode): one row of tiles, 64 rows (128 above 64: two consumers, or two row tiles of one
 * consumer, 16 or 32 columns wide, where they fit in one wave). A tile's k loop takes about the same time at
 * any width (perf-notes), so the more SMs own tiles the better: the width whose tiles come closest to filling
 * one wave wins: 16, 32, 48, 64 or 96 columns (all but 64 need K-major B: an MN-major B box is 64 columns
 * wide); with more columns than 96 x SMs, 64 (several waves). Otherwise the fewest estimated ns among the first
 * five (wide for unchained shapes with K-major B), each either in waves of whole tiles (the last wave partly
 * empty) or, with scratch memory and at least a wave of tiles, stream-K (an equal share of the k-slices per SM,
 * plus its overhead). A chained shape (K chains, below) takes the 64-wide configs up to 128 rows, and in place
 * of stream-K may run its last, partly empty round by chains. */
static gemm_plan choose_plan(int64_t M, int64_t N, int64_t K, bool b_mn, bool swappable, bool has_workspace,
                             int num_sms) {
    const int chains = k_chains(K);
    /* swapped operands (above): M in the fewest tiles of at most SWAP_MAX_BN columns, equal widths rounded up
     * to 16, where that is one tile or computes fewer rows than the normal 128-row tiles by more than 1/32 */
    const bool head_like = (N + 127) / 128 >= SWAP_MIN_WAVES * num_sms;
    if (swappable && chains == 1 && head_like && M >= SWAP_MIN_M && M <= SWAP_MAX_M) {
        const int64_t tiles = (M + SWAP_MAX_BN - 1) / SWAP_MAX_BN, bn = swapped_width(M, tiles);
        const int64_t normal_rows = round_up(M, 128);
        if (tiles == 1 || tiles * bn * 32 <= normal_rows * 31) return {CONFIG_LARGE, false, false, (int)bn};
    }
    const double steps = (double)((K + 63) / 64 * 4);
    if (M <= 128 && chains > 1) {
        /* K chains: 64 columns, one or two consumers; a row of tiles that leaves SMs idle is split */
        const int64_t tiles = (N + 63) / 64, rest = tiles % num_sms;
        const double waves_ns = (double)((tiles + num_sms - 1) / num_sms) * steps;
        const double split_ns = (double)(tiles / num_sms) * steps +
                                (double)((rest * chains + num_sms - 1) / num_sms) * ceil(steps / chains) +
                                CHAIN_SPLIT_FIXED_NS / config_step_ns[CONFIG_SMALL];
        return {M > 64 ? CONFIG_NARROW64_X2 : CONFIG_SMALL, false, has_workspace && rest > 0 && split_ns < waves_ns, 0};
    }
    static const int widths[] = {16, 32, 48, 64, 96};
    static const int configs[2][5] = {
        {CONFIG_NARROW16, CONFIG_NARROW32, CONFIG_NARROW48, CONFIG_SMALL, CONFIG_NARROW96},
        {CONFIG_NARROW16_X2, CONFIG_NARROW32_X2, CONFIG_NARROW48_X2, CONFIG_NARROW64_X2, CONFIG_NARROW96_X2}};
    /* 65 to 256 rows: one-consumer row tiles of 16 or 32 columns (48 too above 128 rows) where all of
     * them fit in one wave (k / v up to 256 rows: 16 or 32 columns x 2-4 row tiles; q / o of a 2048-wide
     * model up to 128 rows). Twice the SMs of a two-consumer tile stream the weights (the other row
     * tiles read them from L2), in stages of 4 k-slices: N = 2048 at 65-128 rows 14.4 against 17.3 us.
     * At 65-128 rows, 48 columns (3 stages) and 64 measured slower than two consumers (perf-notes) */
    if (M > 64 && M <= 256 && chains == 1 && !b_mn) {
        for (int i = 0; i < (M <= 128 ? 2 : 3); ++i)
            if ((M + 63) / 64 * ((N + widths[i] - 1) / widths[i]) <= num_sms) return {configs[0][i], false, false, 0};
    }
    if (M <= 128) {
        const int x2 = M > 64;
        for (int i = 0; i < 5; ++i)
            if ((!b_mn || widths[i] == 64) && (N + widths[i] - 1) / widths[i] <= num_sms)
                return {configs[x2][i], false, false, 0};
        return {configs[x2][3], false, false, 0};
    }
    gemm_plan best = {CONFIG_LARGE, false, false, 0};
    double best_ns = INFINITY;
    int64_t best_tiles = 0;
    for (int c = 0; c <= CONFIG_WIDE; ++c) {
        if (c == CONFIG_WIDE && (b_mn || chains > 1)) continue;  /* K-major B, unchained (launch_config) */
        const int bm = 64 * config_consumers[c];
        const int64_t tiles = ((M + bm - 1) / bm) * ((N + config_bn[c] - 1) / config_bn[c]);
        const double waves_ns = (double)((tiles + num_sms - 1) / num_sms) * steps * config_step_ns[c];
        const double stream_k_ns =
            ((double)tiles / num_sms + STREAM_K_EXTRA_WAVES) * steps * config_step_ns[c] + STREAM_K_FIXED_NS;
        bool chain_split = false;
        const double chain_ns = chained_ns(tiles, steps, chains, config_step_ns[c], num_sms, &chain_split);
        chain_split = chain_split && chains > 1 && has_workspace;
        const bool stream_k = has_workspace && chains == 1 && tiles > num_sms && stream_k_ns < waves_ns;
        const double ns = stream_k ? stream_k_ns : chain_split ? chain_ns : waves_ns;
        if (ns < best_ns) {
            best_ns = ns;
            best = {c, stream_k, chain_split, 0};
            best_tiles = tiles;
        }
    }
    /* 129 to 256 rows whose tall tiles fit in one wave and K is at most NO_CLUSTER_MAX_K (q / o at decode
     * batches 200 and 256): the same tiles without the cluster, whose B multicast measured slower there than
     * each CTA reading B from L2: q / o at 200 rows 22.5 -> 20.9 us on the H200 (perf-notes "Decode GEMMs: a
     * forced-plan sweep on the H200"), 23.4 -> 21.5 on the H100. At K = 12288 (down) the devices disagree:
     * without the cluster the H200 ran 5-12% faster, the H100 8-13% slower at 200-256 rows (53 -> 57-60 us,
     * perf-notes "Session 37"); issue 12's targets are the H100's, so long K keeps the cluster. */
    if (best.config == CONFIG_TALL && !best.stream_k && M <= 256 && K <= NO_CLUSTER_MAX_K && chains == 1 &&
        best_tiles <= num_sms)
        best.config = CONFIG_NARROW64_X2;
    /* swapped operands at the other shapes (SWAP_ANY_MIN_M above) */
    if (swappable && chains == 1 && !head_like && M >= SWAP_ANY_MIN_M) {
        const int64_t weight_tiles = (N + 127) / 128;
        double swap_ns = INFINITY;
        int swap_bn = 0;
        for (int64_t t = (M + SWAP_MAX_BN - 1) / SWAP_MAX_BN;; ++t) {
            const int64_t bn = swapped_width(M, t);
            if (bn < SWAP_MIN_BN) break;
            const double ns = (double)((weight_tiles * t + num_sms - 1) / num_sms) * steps * swapped_step_ns(bn);
            if (ns < swap_ns) swap_ns = ns, swap_bn = (int)bn;
        }
        if (swap_ns < best_ns * (1 - SWAP_ANY_MARGIN)) return {CONFIG_LARGE, false, false, swap_bn};
    }
    /* K chains on swapped operands (SWAP_CHAINED_MIN_BN above): the fewest tiles of at most SWAP_MAX_BN of M's
     * rows, equal widths rounded up to 16, taken where they cost less than the normal tiles by more than 1/32 */
    if (swappable && chains > 1 && has_workspace && M > 128 && M <= SWAP_CHAINED_MAX_M) {
        const int64_t m_tiles = (M + SWAP_MAX_BN - 1) / SWAP_MAX_BN;
        const int64_t even = swapped_width(M, m_tiles);
        const int64_t bn = even > SWAP_CHAINED_MIN_BN ? even : SWAP_CHAINED_MIN_BN;
        const double step_ns = SWAP_CHAINED_STEP_SCALE * swapped_step_ns(bn);
        bool split = false;
        const double ns = chained_ns((N + 127) / 128 * m_tiles, steps, chains, step_ns, num_sms, &split);
        if (ns * 32 < best_ns * 31) return {CONFIG_LARGE, false, split, (int)bn};
    }
    return best;
}

/* Tiles: store_tiles<OutT, gemm_value, CHAINS>; the K-chained kernels exist for the general configs and
 * the 64-wide narrow ones only, the configs choose_plan picks for a chained shape. */
template <bool A_MN, bool B_MN, bool BF16, class Tiles>
static int launch_config(int config, const rlk_gemm_args *args, const gemm_sm90_params &p,
                         const typename Tiles::Params &ep, int device, int num_sms, cudaStream_t stream) {
    /* launch_gemm_sm90<BN, CONSUMERS, A_ROWS, STAGES, SLICES, CLUSTER, A_MN, B_MN, BF16, Tiles> */
    if (config == CONFIG_LARGE)
        return launch_gemm_sm90<256, 2, 64, 4, 1, 2, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
    if (config == CONFIG_MEDIUM)
        return launch_gemm_sm90<128, 2, 64, 6, 1, 2, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
    if (config == CONFIG_TALL)  /* B multicast needs K-major B: half of a 64-wide MN-major box is no box */
        return launch_gemm_sm90<64, 2, 64, 8, 1, B_MN ? 1 : 2, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms,
                                                                                        stream);
    if (config == CONFIG_NARROW64_X2)
        return launch_gemm_sm90<64, 2, 64, 8, 1, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
    if constexpr (!B_MN && !Tiles::K_CHAINS) {
        if (config == CONFIG_WIDE)
            return launch_gemm_sm90<192, 2, 64, 4, 1, 2, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
        /* up to 8 rows, 16 columns: 8-row A slots (issue_k_slices) make room for stages of 16 k-slices */
        if constexpr (!A_MN) {
            if (config == CONFIG_NARROW16 && args->M <= 8)
                return launch_gemm_sm90<16, 1, 8, 4, 16, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms,
                                                                                    stream);
        }
        if (config == CONFIG_NARROW96_X2)
            return launch_gemm_sm90<96, 2, 64, 8, 1, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
        if (config == CONFIG_NARROW48_X2)
            return launch_gemm_sm90<48, 2, 64, 10, 1, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
        if (config == CONFIG_NARROW32_X2)
            return launch_gemm_sm90<32, 2, 64, 11, 1, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
        if (config == CONFIG_NARROW16_X2)
            return launch_gemm_sm90<16, 2, 64, 12, 1, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
        if (config == CONFIG_NARROW96)
            return launch_gemm_sm90<96, 1, 64, 5, 2, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
        if (config == CONFIG_NARROW48)
            return launch_gemm_sm90<48, 1, 64, 3, 4, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
        if (config == CONFIG_NARROW32)
            return launch_gemm_sm90<32, 1, 64, 4, 4, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
        if (config == CONFIG_NARROW16)
            return launch_gemm_sm90<16, 1, 64, 5, 4, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
    }
    return launch_gemm_sm90<64, 1, 64, 12, 1, 1, A_MN, B_MN, BF16, Tiles>(args, p, ep, device, num_sms, stream);
}

template <bool BF16, class Tiles>
static int launch_layout(int config, const rlk_gemm_args *args, const gemm_sm90_params &p,
                         const typename Tiles::Params &ep, int device, int num_sms, cudaStream_t stream) {
    const bool b_mn = !args->b_trans;
    if (args->a_trans)
        return b_mn ? launch_config<true, true, BF16, Tiles>(config, args, p, ep, device, num_sms, stream)
                    : launch_config<true, false, BF16, Tiles>(config, args, p, ep, device, num_sms, stream);
    return b_mn ? launch_config<false, true, BF16, Tiles>(config, args, p, ep, device, num_sms, stream)
                : launch_config<false, false, BF16, Tiles>(config, args, p, ep, device, num_sms, stream);
}

/* kc: the K-chain parameters (chain_tiles, split) with CHAINS, unused without */
template <bool CHAINS>
static int launch_dtypes(int config, const rlk_gemm_args *args, const gemm_sm90_params &p, const k_chain_params &kc,
                         int device, int num_sms, cudaStream_t s) {
    using Bf16Out = store_tiles<__nv_bfloat16, gemm_value, CHAINS>;
    using HalfOut = store_tiles<__half, gemm_value, CHAINS>;
    using F32Out = store_tiles<float, gemm_value, CHAINS>;
    typename F32Out::Params ep{};  /* the same type for every OutT */
    if constexpr (CHAINS) ep = kc;
    if (args->in_dtype == RLK_BF16)
        return args->out_dtype == RLK_F32 ? launch_layout<true, F32Out>(config, args, p, ep, device, num_sms, s)
                                          : launch_layout<true, Bf16Out>(config, args, p, ep, device, num_sms, s);
    return args->out_dtype == RLK_F32 ? launch_layout<false, F32Out>(config, args, p, ep, device, num_sms, s)
                                      : launch_layout<false, HalfOut>(config, args, p, ep, device, num_sms, s);
}

/* out = X W^T as out^T = W X^T (gemm_plan.swapped_bn): the kernel's A is W, its B is X (K-major: X^T), its
 * M and N are N and M. Stages: as many of 128 + BN rows x 64 k as fit beside the epilogue buffers, up to 8. */
template <int BN, bool BF16, typename OutT, bool CHAINS>
static int launch_swapped_width(const rlk_gemm_args *swapped, const gemm_sm90_params &p, const k_chain_params &kc,
                                int device, int num_sms, cudaStream_t stream) {
    using Tiles = store_tiles<OutT, gemm_value, CHAINS, true>;
    constexpr int STAGE_BYTES = (128 + BN) * BK * 2, FREE = 227 * 1024 - 4 * EPI_BOX_BYTES - SMEM_ALIGN - 16 * 8;
    constexpr int STAGES = FREE / STAGE_BYTES < 8 ? FREE / STAGE_BYTES : 8;
    typename Tiles::Params ep{};
    if constexpr (CHAINS) ep = kc;
    /* chained: the head's dX = G W, whose W (B, MN-major) is the swapped A; unchained: X W^T, W K-major */
    return launch_gemm_sm90<BN, 2, 64, STAGES, 1, 2, CHAINS, false, BF16, Tiles>(swapped, p, ep, device, num_sms,
                                                                                 stream);
}

/* the width bn of BN, BN + 16, ..., SWAP_MAX_BN (BN: the narrowest built, 80 unchained, SWAP_CHAINED_MIN_BN
 * chained): launch_swapped_width<bn> */
template <int BN, bool BF16, typename OutT, bool CHAINS>
static int launch_swapped(int bn, const rlk_gemm_args *swapped, const gemm_sm90_params &p, const k_chain_params &kc,
                          int device, int num_sms, cudaStream_t s) {
    if (bn == BN) return launch_swapped_width<BN, BF16, OutT, CHAINS>(swapped, p, kc, device, num_sms, s);
    if constexpr (BN < SWAP_MAX_BN) return launch_swapped<BN + 16, BF16, OutT, CHAINS>(bn, swapped, p, kc, device, num_sms, s);
    return RLK_UNSUPPORTED;
}

/* The swapped product's arguments: out^T = B^T A^T, A = B^T (K-major B: K-major A; MN-major B: MN-major A),
 * B = A^T (K-major: A is), M and N exchanged */
static rlk_gemm_args swapped_args(const rlk_gemm_args *args) {
    rlk_gemm_args t = *args;
    t.M = args->N, t.N = args->M;
    t.a = args->b, t.lda = args->ldb, t.a_trans = !args->b_trans;
    t.b = args->a, t.ldb = args->lda, t.b_trans = 1;
    return t;
}

/* Scratch memory of a K-chained product of M x N in bm x bn tiles on clusters of `cluster`: its items as
 * launch_gemm_sm90 plans them for the chained store_tiles, then chain_workspace_bytes. */
static int64_t chained_scratch_bytes(int64_t M, int64_t N, int64_t K, int bm, int bn, int cluster, bool split,
                                     int num_sms) {
    using ChainedTiles = store_tiles<float, gemm_value, true>;
    gemm_sm90_params p;
    memset(&p, 0, sizeof(p));
    plan_work_items(&p, M, N, bm, bn, ChainedTiles::TILES_PER_UNIT, cluster, ChainedTiles::PAIR_TAIL);
    return chain_workspace_bytes(bn, bm / 64, cluster, p.work_items, k_chains(K), split, num_sms);
}

extern "C" int rlk_gemm_sm90(const rlk_gemm_args *args, rlk_context *ctx) {
    const bool in_ok = args->in_dtype == RLK_BF16 || args->in_dtype == RLK_F16;
    const bool out_ok = args->out_dtype == args->in_dtype || args->out_dtype == RLK_F32;
    if (!in_ok || !out_ok) return RLK_UNSUPPORTED;
    if (args->N >= INT32_MAX || args->K >= INT32_MAX) return RLK_UNSUPPORTED;
    if (args->K > 0 && (!tma_operand_ok(args->a, args->lda) || !tma_operand_ok(args->b, args->ldb)))
        return RLK_UNSUPPORTED;
    ctx->kernel = "gemm_sm90";

    int device, num_sms;
    const cudaError_t err = current_device(&device, &num_sms);
    if (err != cudaSuccess) return (int)err;

    /* swapped operands store out^T through TMA, from a K-major X (the tokens' rows), without C
     * (gemm_plan.swapped_bn); W K-major (the forward's X W^T) unchained, MN-major (the head's dX = G W)
     * with K chains: the kernels built */
    const bool chained = k_chains(args->K) > 1;
    const bool swappable = args->K > 0 && !args->a_trans && args->b_trans == !chained && args->c == nullptr &&
                           args->out_dtype == args->in_dtype && tma_operand_ok(args->out, args->ldo);
    gemm_plan plan = choose_plan(args->M, args->N, args->K, !args->b_trans, swappable, true, num_sms);
    const cudaStream_t s = (cudaStream_t)ctx->stream;
    k_chain_params kc = {};
    kc.chain_tiles = chain_tiles(args->K);
    kc.split = plan.chain_split;
    /* K chains need their scratch memory (a whole tile's running sum goes through it) */
    if (chained && !ctx->plan_only && !args->workspace) return (int)cudaErrorInvalidValue;
    if (plan.swapped_bn > 0) {
        const rlk_gemm_args t = swapped_args(args);
        const int bn = plan.swapped_bn;
        if (ctx->plan_only) {  /* unchained: no scratch memory */
            if (chained) ctx->workspace_bytes = chained_scratch_bytes(t.M, t.N, t.K, 128, bn, 2, plan.chain_split, num_sms);
            return RLK_OK;
        }
        gemm_sm90_params p = gemm_params(&t);
        if (chained) {
            p.partials = (float *)args->workspace;
            return args->in_dtype == RLK_BF16
                       ? launch_swapped<SWAP_CHAINED_MIN_BN, true, __nv_bfloat16, true>(bn, &t, p, kc, device, num_sms, s)
                       : launch_swapped<SWAP_CHAINED_MIN_BN, false, __half, true>(bn, &t, p, kc, device, num_sms, s);
        }
        return args->in_dtype == RLK_BF16 ? launch_swapped<80, true, __nv_bfloat16, false>(bn, &t, p, kc, device, num_sms, s)
                                          : launch_swapped<80, false, __half, false>(bn, &t, p, kc, device, num_sms, s);
    }
    if (ctx->plan_only) {
        const int bn = config_bn[plan.config], consumers = config_consumers[plan.config];
        if (chained)
            ctx->workspace_bytes = chained_scratch_bytes(args->M, args->N, args->K, 64 * consumers, bn,
                                                         config_cluster(plan.config, !args->b_trans), plan.chain_split,
                                                         num_sms);
        else if (plan.stream_k)
            ctx->workspace_bytes = stream_k_workspace_bytes(bn, consumers, num_sms);
        return RLK_OK;
    }
    /* stream-K is a choice of schedule only: a call given no scratch memory runs the best plan without
     * it, with the same bits */
    if (!args->workspace) plan = choose_plan(args->M, args->N, args->K, !args->b_trans, swappable, false, num_sms);
    gemm_sm90_params p = gemm_params(args);
    p.stream_k = plan.stream_k;
    p.partials = (float *)args->workspace;
    return chained ? launch_dtypes<true>(plan.config, args, p, kc, device, num_sms, s)
                   : launch_dtypes<false>(plan.config, args, p, kc, device, num_sms, s);
}
