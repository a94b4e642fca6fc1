/* cuda/sm90/wgmma.cuh: d[64 x N] (+)= A[64 x 16] * B[16 x N] on the Hopper tensor cores
 * (wgmma.mma_async, both operands read from shared memory through descriptors, fp32 accumulators,
 * bf16 or fp16 operands), one definition for every N width.
 *
 * wgmma_k16<N, BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate): accumulate = 0 overwrites d
 * (wgmma's scale-d). TRANS_A / TRANS_B: the operand is MN-major in shared memory.
 * wgmma_k16_rs<N, BF16, TRANS_B>(d, a, desc_b, accumulate): A from registers instead: thread t holds
 * rows 16w + l/4 (+8) and columns 2(l%4) (+1) (+8) of the 64 x 16 A tile, packed pairs (low = lower
 * column) a[0] = (row, col), a[1] = (row + 8, col), a[2] = (row, col + 8), a[3] = (row + 8, col + 8):
 * the accumulator layout of columns 16k .. 16k+15, so an fp32 result rounded pairwise becomes the A
 * operand of the next product (attention's P V). Accumulator layout:
 * thread t of the warpgroup (warp w = t / 32, lane l) holds rows 16w + l/4 (+8) and columns
 * 8j + 2(l%4) (+1) in d[4j .. 4j+3], j < N/8.
 * The asm statement of each width (every register named) comes from wgmma_gen.py, which the build
 * runs into its own directory.
 */
#ifndef RLK_CUDA_SM90_WGMMA_CUH_
#define RLK_CUDA_SM90_WGMMA_CUH_

#include <stdint.h>

template <int N>
struct wgmma_m64k16;

#include "wgmma_shapes.cuh"

template <int N, bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_k16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    wgmma_m64k16<N>::template run<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
}

template <int N, bool BF16, int TRANS_B>
__device__ __forceinline__ void wgmma_k16_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b,
                                             int accumulate) {
    wgmma_m64k16<N>::template run_rs<BF16, TRANS_B>(d, a, desc_b, accumulate);
}

#endif /* RLK_CUDA_SM90_WGMMA_CUH_ */
