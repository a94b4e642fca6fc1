/* ops/gemm.h: the GEMM contract.
 *
 *   out[i, j] = alpha * sum_k A[i, k] * B[k, j]  +  beta * C[i, j]
 *
 * Element addressing (strides in elements, 64-bit):
 *   A[i, k] = a_trans ? a[k * lda + i] : a[i * lda + k]      A is M x K
 *   B[k, j] = b_trans ? b[j * ldb + k] : b[k * ldb + j]      B is K x N
 *   C[i, j] = c[i * ldc + j]   (c == NULL: no C term; ldc == 0: one row broadcast, i.e. a bias)
 *   out[i, j] = out[i * ldo + j]
 * a_trans = 1 is a transposed view, e.g. B = W^T of an nn.Linear weight W [N, K] has b_trans = 1.
 * Pointers carry no alignment promise beyond the element size; lda/ldb/ldc/ldo may be odd.
 *
 * Types: a and b have in_dtype; c and out have out_dtype (in_dtype or fp32). Products and sums in
 * fp32 (fp64 for RLK_F64 on the CPU); alpha * acc + beta * c is formed in fp32 with alpha and beta
 * rounded to fp32 (in fp64 with them as given for RLK_F64) and rounded once to out_dtype. BLAS semantics are the binding's: alpha == 0 reaches a launcher as K == 0 (A and B
 * are not read), beta == 0 as c == NULL (C is not read).
 *
 * Batch invariance: for every output element the K reduction runs in one order that depends on
 * K (and N, dtypes, layouts) only. Never split K by M, no order-dependent atomics (sm90's K chains
 * count arrivals only to pick which CTA forms their fixed-order sum).
 * Sizes: M, N >= 1; K >= 0 (K == 0 gives beta * C, or 0).
 *
 * Kernels (csrc/kernels.def): cpu (all dtypes), sm80 (bf16/fp16 on mma.sync; fp32 on FFMA, never
 * TF32; any layout, stride and alignment), sm90 (bf16/fp16 on wgmma + TMA; row strides that are
 * a multiple of 16 bytes, else RLK_UNSUPPORTED and the sm80 kernel runs).
 */
#ifndef RLK_OPS_GEMM_H_
#define RLK_OPS_GEMM_H_

#include "../rlk.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rlk_gemm_args {
    int64_t M, N, K;
    rlk_dtype in_dtype, out_dtype;
    const void *a;
    int64_t lda;
    int a_trans;
    const void *b;
    int64_t ldb;
    int b_trans;
    const void *c;
    int64_t ldc;
    void *out;
    int64_t ldo;
    double alpha, beta; /* as given; the fp32 kernels round them to fp32 */
    void *workspace;    /* ctx->workspace_bytes as planned, or NULL: a kernel that plans scratch memory
                           runs without it when given none (sm90: stream-K tiling, same results), except
                           sm90 at K >= 65536 (K chains: their running sums), which fails */
} rlk_gemm_args;

typedef int rlk_gemm_fn(const rlk_gemm_args *args, rlk_context *ctx);

#ifdef __cplusplus
}
#endif
#endif /* RLK_OPS_GEMM_H_ */
