/* sm90/gemm.cu: Hopper (sm_90a) batch-invariant GEMM, out = alpha * A @ B + beta * C (contract:
 * csrc/ops/gemm.h), on the warp-specialized wgmma main loop of gemm_kernel.cuh (tile plan and the
 * invariance argument are there).
 *
 * Tile configs (all the same per-element k16 wgmma sequence; choose_config picks by M and N):
 *   large:  BM = 128 (2 consumer warpgroups, setmaxnreg 232/40), BN = 256, 4 stages + 32 KB of epilogue
 *           buffers, clusters of 2 CTAs on vertically adjacent tiles sharing B by multicast;
 *   medium: the same with BN = 128, 6 stages;
 *   tall:   BM = 128 (2 consumers), BN = 64, 8 stages, clusters of 2 with K-major B (else none): twice
 *           the tiles of medium for shapes whose medium tiles leave SMs idle (M = N = 1024);
 *   small:  BM = 64 (1 consumer warpgroup), BN = 64, 12 stages, no cluster;
 *   narrow: BM = 64, BN = 96 / 48 / 32 / 16 (10 / 14 / 16 / 20 stages), K-major B only.
 * M <= 64 (decode) takes the narrowest 64-row config whose tiles still fit in one wave; larger M whichever
 * of the first four a waves x cycles-per-tile estimate finds fastest.
 *
 * Invariance proof on the GPU: tests/test_gpu_gemm.py (every M of the sweep 1..4096 against M = 4096 on
 * the Qwen3-8B shapes, which exercises every config; rows shifted across tiles; outputs and operands at
 * aligned and unaligned addresses compared with torch.equal).
 *
 * Limits (-> RLK_UNSUPPORTED, the sm80 kernel runs): dtypes other than bf16/fp16 in, in-dtype/fp32 out;
 * A or B row stride not a multiple of 16 bytes (TMA); N or K >= 2^31. C and out: any alignment/stride.
 *
 * Build: python3 csrc/cuda/sm90/wgmma_gen.py build/gen && nvcc -c -gencode arch=compute_90a,code=sm_90a
 *        -O3 -std=c++17 -lineinfo -Xptxas -v -Xcompiler -fPIC -Icsrc -Ibuild/gen csrc/cuda/sm90/gemm.cu
 * Test (GPU): python3 setup.py build_ext --inplace && pytest tests/test_gpu_gemm.py -m gpu (or
 *   scripts/gpu_check.sh: GPU tests, compute-sanitizer, benchmarks; history in docs/perf-notes.md).
 */
#include "gemm_kernel.cuh"

template <typename OutT>
using GemmTiles = store_tiles<OutT, gemm_value>;

/* The tile configs. All of them compute every output element with the same k16 wgmma sequence, so the
 * choice among them is a performance choice only (bitwise-equal rows are tested across them). */
enum { CONFIG_LARGE, CONFIG_MEDIUM, CONFIG_SMALL, CONFIG_TALL, CONFIG_NARROW96, CONFIG_NARROW48, CONFIG_NARROW32,
       CONFIG_NARROW16 };
static const int config_bm[CONFIG_TALL + 1] = {128, 128, 64, 128};
static const int config_bn[CONFIG_TALL + 1] = {256, 128, 64, 64};
/* Estimated SM cycles per k16 step of one tile (measured order of magnitude on H100): two m64n256 wgmmas
 * at ~80% of peak, two m64n128, one latency-bound m64n64 chain. The tall value is a weight, not a cycle
 * count: one-wave tall grids measured 160-190 cycles per step, yet beat the medium config's one-wave grids
 * (half the SMs; M = N = 1024: 24.5 vs 28.3 us, M = 256, N = 4096: 23.4 vs 30.0), while the medium
 * config is chosen wherever tall would need more waves. */
static const int config_cycles[CONFIG_TALL + 1] = {320, 170, 100, 120};

/* Up to 64 rows (decode): 64-row tiles (128-row tiles would mostly multiply zero-filled rows). Each tile is
 * one latency-bound chain of K/16 wgmmas, and the weights stream through the SMs that own tiles, so the
 * width whose tiles come closest to filling one wave wins: 16, 32, 48, 64 or 96 columns (all but 64
 * need K-major B: an MN-major B box is 64 columns wide); with more columns than 96 x SMs, 64 (several
 * waves). Otherwise the fewest estimated cycles among the first four: waves of tiles x cycles per tile. */
static int choose_config(int64_t M, int64_t N, bool b_mn, int num_sms) {
    if (M <= 64) {
        static const int widths[] = {16, 32, 48, 64, 96};
        static const int configs[] = {CONFIG_NARROW16, CONFIG_NARROW32, CONFIG_NARROW48, CONFIG_SMALL,
                                      CONFIG_NARROW96};
        for (int i = 0; i < 5; ++i)
            if ((!b_mn || widths[i] == 64) && (N + widths[i] - 1) / widths[i] <= num_sms) return configs[i];
        return CONFIG_SMALL;
    }
    int best = CONFIG_LARGE;
    int64_t best_cost = INT64_MAX;
    for (int c = 0; c <= CONFIG_TALL; ++c) {
        const int64_t tiles = ((M + config_bm[c] - 1) / config_bm[c]) * ((N + config_bn[c] - 1) / config_bn[c]);
        const int64_t cost = (tiles + num_sms - 1) / num_sms * config_cycles[c];
        if (cost < best_cost) {
            best_cost = cost;
            best = c;
        }
    }
    return best;
}

template <bool A_MN, bool B_MN, bool BF16, typename OutT>
static int launch_config(int config, const rlk_gemm_args *args, const gemm_sm90_params &p, int device, int num_sms,
                         cudaStream_t stream) {
    if (config == CONFIG_LARGE)
        return launch_gemm_sm90<256, 2, 4, 2, A_MN, B_MN, BF16, GemmTiles<OutT>>(args, p, {}, device, num_sms, stream);
    if (config == CONFIG_MEDIUM)
        return launch_gemm_sm90<128, 2, 6, 2, A_MN, B_MN, BF16, GemmTiles<OutT>>(args, p, {}, device, num_sms, stream);
    if (config == CONFIG_TALL)  /* B multicast needs K-major B: half of a 64-wide MN-major box is no box */
        return launch_gemm_sm90<64, 2, 8, B_MN ? 1 : 2, A_MN, B_MN, BF16, GemmTiles<OutT>>(args, p, {}, device, num_sms,
                                                                                        stream);
    if constexpr (!B_MN) {
        if (config == CONFIG_NARROW96)
            return launch_gemm_sm90<96, 1, 10, 1, A_MN, B_MN, BF16, GemmTiles<OutT>>(args, p, {}, device, num_sms, stream);
        if (config == CONFIG_NARROW48)
            return launch_gemm_sm90<48, 1, 14, 1, A_MN, B_MN, BF16, GemmTiles<OutT>>(args, p, {}, device, num_sms, stream);
        if (config == CONFIG_NARROW32)
            return launch_gemm_sm90<32, 1, 16, 1, A_MN, B_MN, BF16, GemmTiles<OutT>>(args, p, {}, device, num_sms, stream);
        if (config == CONFIG_NARROW16)
            return launch_gemm_sm90<16, 1, 20, 1, A_MN, B_MN, BF16, GemmTiles<OutT>>(args, p, {}, device, num_sms, stream);
    }
    return launch_gemm_sm90<64, 1, 12, 1, A_MN, B_MN, BF16, GemmTiles<OutT>>(args, p, {}, device, num_sms, stream);
}

template <bool BF16, typename OutT>
static int launch_layout(int config, const rlk_gemm_args *args, const gemm_sm90_params &p, int device, int num_sms,
                         cudaStream_t stream) {
    const bool b_mn = !args->b_trans;
    if (args->a_trans)
        return b_mn ? launch_config<true, true, BF16, OutT>(config, args, p, device, num_sms, stream)
                    : launch_config<true, false, BF16, OutT>(config, args, p, device, num_sms, stream);
    return b_mn ? launch_config<false, true, BF16, OutT>(config, args, p, device, num_sms, stream)
                : launch_config<false, false, BF16, OutT>(config, args, p, device, num_sms, stream);
}

extern "C" int rlk_gemm_sm90(const rlk_gemm_args *args, rlk_context *ctx) {
    const bool in_ok = args->in_dtype == RLK_BF16 || args->in_dtype == RLK_F16;
    const bool out_ok = args->out_dtype == args->in_dtype || args->out_dtype == RLK_F32;
    if (!in_ok || !out_ok) return RLK_UNSUPPORTED;
    if (args->N >= INT32_MAX || args->K >= INT32_MAX) return RLK_UNSUPPORTED;
    if (args->K > 0 && (!tma_row_stride_ok(args->lda) || !tma_row_stride_ok(args->ldb))) return RLK_UNSUPPORTED;
    ctx->kernel = "gemm_sm90";
    if (ctx->plan_only) return RLK_OK;

    int device, num_sms;
    const cudaError_t err = current_device(&device, &num_sms);
    if (err != cudaSuccess) return (int)err;

    const gemm_sm90_params p = gemm_params(args);
    const int config = choose_config(args->M, args->N, !args->b_trans, num_sms);

    const cudaStream_t s = (cudaStream_t)ctx->stream;
    if (args->in_dtype == RLK_BF16)
        return args->out_dtype == RLK_F32 ? launch_layout<true, float>(config, args, p, device, num_sms, s)
                                          : launch_layout<true, __nv_bfloat16>(config, args, p, device, num_sms, s);
    return args->out_dtype == RLK_F32 ? launch_layout<false, float>(config, args, p, device, num_sms, s)
                                      : launch_layout<false, __half>(config, args, p, device, num_sms, s);
}
