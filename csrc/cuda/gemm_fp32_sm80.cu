/* gemm_fp32_sm80.cu: batch-invariant fp32 GEMM with plain FFMA (never TF32), any layout/stride.
 *
 *   out[i, j] = alpha * sum_k A[i, k] * B[k, j] + beta * C[i, j]   (see rl_kernels.h for addressing)
 *
 * Tile plan (one plan for every problem): CTA tile 128 x 64 x 16, 256 threads as 16 x 16, each
 * thread owns an 8 x 4 register block (8 consecutive rows, 4 consecutive columns). Each k-tile is
 * copied global -> shared with element-wise, bounds-checked loads that walk the operand's
 * contiguous dimension across neighbouring threads (coalesced for every layout), stored k-major
 * ([k][m] and [k][n]) so the inner loop reads float4s from shared memory; zero fill past the edges.
 * The grid is 1-D over output tiles, rastered in groups of 8 M-tiles for L2 reuse.
 *
 * Batch invariance: the tile plan never depends on M and there is no split-K. Every output element
 * is one fp32 accumulator updated by fmaf for k = 0, 1, ..., K - 1 in order (zero fill past K adds
 * exact zeros), so its bits depend on its own row and column of the inputs only, never on M, on
 * the row's position in the batch, or on which CTA computed it. The epilogue forms
 * alpha * acc + beta * c in fp32 (fmaf(beta, c, alpha * acc)), like the sm80 tensor-core kernel.
 *
 * Build (shared library for tests):
 *   nvcc -shared -Xcompiler -fPIC -O3 -std=c++17 -lineinfo -Xptxas -v \
 *     -gencode arch=compute_80,code=sm_80 -gencode arch=compute_80,code=compute_80 \
 *     -gencode arch=compute_90,code=sm_90 csrc/cuda/gemm_fp32_sm80.cu -o libgemm_fp32.so
 * Test (GPU): python3 setup.py build_ext --inplace && pytest tests/test_gpu_gemm.py -m gpu
 *   (or scripts/gpu_check.sh, which also runs compute-sanitizer and the benchmarks).
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "../rl_kernels.h"

#define FP32_BM 128
#define FP32_BN 64
#define FP32_BK 16
#define FP32_THREADS 256
#define FP32_TM 8 /* rows per thread */
#define FP32_TN 4 /* columns per thread */
#define FP32_GROUP_M 8

template <int A_TRANS, int B_TRANS>
__global__ void __launch_bounds__(FP32_THREADS)
    gemm_fp32_simt_kernel(int64_t M, int64_t N, int64_t K, const float *__restrict__ a, int64_t lda,
                          const float *__restrict__ b, int64_t ldb, const float *__restrict__ c,
                          int64_t ldc, float *__restrict__ out, int64_t ldo, float alpha, float beta) {
    /* +4 floats per row keeps float4 alignment and spreads the transposing stores over banks */
    __shared__ __align__(16) float As[FP32_BK][FP32_BM + 4];
    __shared__ __align__(16) float Bs[FP32_BK][FP32_BN + 4];

    const int64_t num_m_tiles = (M + FP32_BM - 1) / FP32_BM, num_n_tiles = (N + FP32_BN - 1) / FP32_BN;
    const int64_t pid = blockIdx.x;
    const int64_t tiles_per_group = (int64_t)FP32_GROUP_M * num_n_tiles;
    const int64_t first_m = (pid / tiles_per_group) * FP32_GROUP_M;
    const int64_t group_rows = min((int64_t)FP32_GROUP_M, num_m_tiles - first_m);
    const int64_t m0 = (first_m + (pid % tiles_per_group) % group_rows) * FP32_BM;
    const int64_t n0 = ((pid % tiles_per_group) / group_rows) * FP32_BN;

    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int m_in = (int)min((int64_t)FP32_BM, M - m0), n_in = (int)min((int64_t)FP32_BN, N - n0);
    const float *a_tile = a + (A_TRANS ? m0 : m0 * lda); /* tile origins at k = 0 */
    const float *b_tile = b + (B_TRANS ? n0 * ldb : n0);

    float acc[FP32_TM][FP32_TN];
#pragma unroll
    for (int i = 0; i < FP32_TM; i++)
#pragma unroll
        for (int j = 0; j < FP32_TN; j++) acc[i][j] = 0.0f;

    for (int64_t k0 = 0; k0 < K; k0 += FP32_BK) {
        const int k_in = (int)min((int64_t)FP32_BK, K - k0);
        /* consecutive threads walk the contiguous global dimension */
#pragma unroll
        for (int i = 0; i < FP32_BM * FP32_BK / FP32_THREADS; i++) {
            const int e = tid + i * FP32_THREADS;
            const int k = A_TRANS ? e / FP32_BM : e % FP32_BK;
            const int m = A_TRANS ? e % FP32_BM : e / FP32_BK;
            As[k][m] = (k < k_in && m < m_in)
                           ? (A_TRANS ? a_tile[(k0 + k) * lda + m] : a_tile[m * lda + k0 + k])
                           : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < FP32_BN * FP32_BK / FP32_THREADS; i++) {
            const int e = tid + i * FP32_THREADS;
            const int k = B_TRANS ? e % FP32_BK : e / FP32_BN;
            const int n = B_TRANS ? e / FP32_BK : e % FP32_BN;
            Bs[k][n] = (k < k_in && n < n_in)
                           ? (B_TRANS ? b_tile[n * ldb + k0 + k] : b_tile[(k0 + k) * ldb + n])
                           : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < FP32_BK; k++) {
            const float4 a_lo = *(const float4 *)&As[k][ty * FP32_TM];
            const float4 a_hi = *(const float4 *)&As[k][ty * FP32_TM + 4];
            const float4 bv = *(const float4 *)&Bs[k][tx * FP32_TN];
            const float av[FP32_TM] = {a_lo.x, a_lo.y, a_lo.z, a_lo.w, a_hi.x, a_hi.y, a_hi.z, a_hi.w};
            const float bw[FP32_TN] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
            for (int i = 0; i < FP32_TM; i++)
#pragma unroll
                for (int j = 0; j < FP32_TN; j++) acc[i][j] = fmaf(av[i], bw[j], acc[i][j]);
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < FP32_TM; i++) {
        const int64_t gi = m0 + ty * FP32_TM + i;
        if (gi >= M) break;
#pragma unroll
        for (int j = 0; j < FP32_TN; j++) {
            const int64_t gj = n0 + tx * FP32_TN + j;
            if (gj >= N) break;
            float v = alpha * acc[i][j];
            if (c) v = fmaf(beta, c[gi * ldc + gj], v); /* ldc == 0: bias row broadcast */
            out[gi * ldo + gj] = v;
        }
    }
}

extern "C" int rlk_gemm_fp32_simt(const rlk_gemm_args *p, void *stream) {
    if (p->in_dtype != RLK_F32 || p->out_dtype != RLK_F32) return RLK_UNSUPPORTED;
    const int64_t tiles = ((p->M + FP32_BM - 1) / FP32_BM) * ((p->N + FP32_BN - 1) / FP32_BN);
    if (tiles > 0x7fffffff) return (int)cudaErrorInvalidConfiguration;
    void (*kernel)(int64_t, int64_t, int64_t, const float *, int64_t, const float *, int64_t,
                   const float *, int64_t, float *, int64_t, float, float);
    if (p->a_trans)
        kernel = p->b_trans ? gemm_fp32_simt_kernel<1, 1> : gemm_fp32_simt_kernel<1, 0>;
    else
        kernel = p->b_trans ? gemm_fp32_simt_kernel<0, 1> : gemm_fp32_simt_kernel<0, 0>;
    kernel<<<(unsigned)tiles, FP32_THREADS, 0, (cudaStream_t)stream>>>(
        p->M, p->N, p->K, (const float *)p->a, p->lda, (const float *)p->b, p->ldb,
        (const float *)p->c, p->ldc, (float *)p->out, p->ldo, p->alpha, p->beta);
    return (int)cudaGetLastError();
}
