/* rl_kernels.h: the contract between the binding layer (csrc/module.c) and the kernels.
 *
 * The binding validates every argument (dtypes, shapes, strides, devices, aliasing) before it
 * calls a launcher, so launchers may assume well-formed arguments: sizes > 0 unless stated,
 * pointers valid for the described extents, outputs not aliasing inputs.
 *
 * Launchers are plain C functions (`extern "C"` in .cu files). They return RLK_OK, RLK_UNSUPPORTED
 * when this backend cannot take the problem (the caller then tries the next backend in the fixed
 * chain sm90 -> sm80 -> fp32 SIMT, a choice that depends on dtypes, layouts and N, K only, never on
 * M or on pointer values), or a positive cudaError_t value.
 *
 * GPU launchers run on the caller's stream, never allocate, never synchronize, so they can be
 * captured in a CUDA graph.
 */
#ifndef RL_KERNELS_H_
#define RL_KERNELS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RLK_OK 0
#define RLK_UNSUPPORTED (-1)
/* CPU launchers: a per-thread workspace allocation failed (outputs incomplete). */
#define RLK_CPU_OUT_OF_MEMORY (-2)

typedef enum rlk_dtype {
    RLK_F32 = 0,
    RLK_BF16 = 1,
    RLK_F16 = 2,
    RLK_F64 = 3, /* CPU reference backend only (gradcheck) */
} rlk_dtype;

/* ---------------------------------------------------------------------------------------------
 * GEMM:  out[i, j] = alpha * sum_k A[i, k] * B[k, j]  +  beta * C[i, j]
 *
 * Element addressing (strides in elements, 64-bit):
 *   A[i, k] = a_trans ? a[k * lda + i] : a[i * lda + k]      A is M x K
 *   B[k, j] = b_trans ? b[j * ldb + k] : b[k * ldb + j]      B is K x N
 *   C[i, j] = c[i * ldc + j]   (c == NULL: no C term; ldc == 0: one row broadcast, i.e. a bias)
 *   out[i, j] = out[i * ldo + j]
 * a_trans = 1 is a transposed view, e.g. B = W^T of an nn.Linear weight W [N, K] has b_trans = 1.
 * Pointers carry no alignment promise beyond the element size; lda/ldb/ldc/ldo may be odd.
 *
 * Types: a and b have in_dtype; c and out have out_dtype. Products and sums in fp32 (fp64 for
 * RLK_F64 on the CPU); alpha * acc + beta * c is formed in fp32 and rounded once to out_dtype.
 *
 * Batch invariance: for every output element the K reduction runs in one order that depends on
 * K (and N, dtypes, layouts) only. Never split K by M, never use atomics.
 * Sizes: M, N >= 1; K >= 0 (K == 0 gives alpha * 0 + beta * C).
 * ------------------------------------------------------------------------------------------- */
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
    float alpha, beta;
} rlk_gemm_args;

/* csrc/cpu/gemm_cpu.c: all dtypes; OpenMP over output tiles with num_threads threads. */
int rlk_gemm_cpu(const rlk_gemm_args *args, int num_threads);

/* csrc/cuda/gemm_sm90.cu: bf16/fp16 in (wgmma + TMA). RLK_UNSUPPORTED for layouts/strides the
 * TMA descriptors cannot express (row strides not a multiple of 16 bytes, base not 16-byte aligned
 * is handled by the Python layer making the operand contiguous first). */
int rlk_gemm_sm90(const rlk_gemm_args *args, void *stream);

/* csrc/cuda/gemm_sm80.cu: bf16/fp16 in (mma.sync m16n8k16); any M, N, K, layout, stride, alignment. */
int rlk_gemm_sm80(const rlk_gemm_args *args, void *stream);

/* csrc/cuda/gemm_fp32_sm80.cu: fp32 in, fp32 FFMA (never TF32); any layout and stride. */
int rlk_gemm_fp32_simt(const rlk_gemm_args *args, void *stream);

/* ---------------------------------------------------------------------------------------------
 * linear_logp forward, per row n (s_v = (hidden[n] . weight[v] + bias[v]) * inv_temperature):
 *   lse[n] = log sum_v exp(s_v);  logp[n] = s_target - lse[n];  entropy[n] = lse[n] - sum_v p_v s_v
 * Rows whose target == ignore_index: logp = 0, entropy = 0, lse = 0 (no gradient flows there).
 * Targets outside [0, V) (other than ignore_index) give logp = entropy = lse = NaN for that row and
 * are reported: the CPU launcher returns RLK_BAD_TARGET; the GPU launcher stores 1 to *bad_target.
 * hidden [N, D] row stride ldh (contiguous in D), weight [V, D] row stride ldw, bias [V] or NULL,
 * all in `dtype`; target int64 [N]; logp, entropy (may be NULL), lse: fp32 [N].
 * The V reduction order depends on V only (fixed V split, partials merged in a fixed order).
 * ------------------------------------------------------------------------------------------- */
#define RLK_BAD_TARGET 2

typedef struct rlk_linear_logp_args {
    int64_t N, D, V;
    rlk_dtype dtype;
    const void *hidden;
    int64_t ldh;
    const void *weight;
    int64_t ldw;
    const void *bias;
    const int64_t *target;
    int64_t ignore_index;
    float inv_temperature;
    float *logp, *entropy, *lse;
    int32_t *bad_target;
} rlk_linear_logp_args;

/* linear_logp backward, one chunk of rows x vocabulary columns at a time (the Python layer walks
 * the chunks in a fixed order and feeds d_z to the GEMM launchers). With s = z / T, p = softmax(s)
 * (p_v = exp(s_v - lse)), t = target of the row:
 *   d_s[r, c] = g_logp[r] * (1[v0 + c == t] - p) - g_ent[r] * p * (s - lse[r] + entropy[r])
 *   d_z = d_s * inv_temperature
 * logits holds z (bias included, before temperature), fp32 [rows, cols] with row stride ld_logits;
 * target, lse, entropy, grad_logp, grad_entropy point at the chunk's first row ([rows] each);
 * grad_logp or grad_entropy may be NULL (zero), entropy may be NULL when grad_entropy is NULL.
 * Rows whose target == ignore_index get d_z = 0. dlogits (out_dtype, row stride ld_dlogits) may be
 * the logits buffer itself when out_dtype is fp32 (elementwise in place). */
typedef struct rlk_linear_logp_dlogits_args {
    int64_t rows, cols, v0;
    const float *logits;
    int64_t ld_logits;
    const int64_t *target;
    int64_t ignore_index;
    const float *lse, *entropy, *grad_logp, *grad_entropy;
    float inv_temperature;
    rlk_dtype out_dtype;
    void *dlogits;
    int64_t ld_dlogits;
    /* Fused form (rlk_linear_logp_dlogits_sm90, logits == NULL): z = hidden [rows, D] @ weight^T + bias
     * is formed in registers from the chunk's weight rows [cols, D] and bias [cols] (or NULL), all in
     * out_dtype (bf16/fp16), so the fp32 logits are never written. */
    const void *hidden, *weight, *bias;
    int64_t ldh, ldw, D;
} rlk_linear_logp_dlogits_args;

/* csrc/cpu/linear_logp_cpu.c: fp32/bf16/fp16 inputs, OpenMP over rows. Returns RLK_BAD_TARGET
 * (after finishing all other rows) if any target is out of range. */
int rlk_linear_logp_fwd_cpu(const rlk_linear_logp_args *args, int num_threads);
int rlk_linear_logp_dlogits_cpu(const rlk_linear_logp_dlogits_args *args, int num_threads);

/* csrc/cuda/linear_logp_sm80.cu: bf16/fp16 inputs on tensor cores, fp32 inputs through the fp32 SIMT
 * GEMM and a logits pass (slower, never TF32); any N, D, V. bad_target points at host-mapped pinned
 * memory; the kernel stores 1 there for an out-of-range target (no host sync).
 * workspace: rlk_linear_logp_fwd_workspace_bytes(N, V, dtype) bytes of device memory. */
int64_t rlk_linear_logp_fwd_workspace_bytes(int64_t N, int64_t V, rlk_dtype dtype);
int rlk_linear_logp_fwd_sm80(const rlk_linear_logp_args *args, void *workspace, void *stream);
int rlk_linear_logp_dlogits_cuda(const rlk_linear_logp_dlogits_args *args, void *stream);

/* csrc/cuda/gemm_sm90.cu: the same forward on wgmma; bf16/fp16, D*2 bytes a multiple of 16,
 * 16-byte aligned hidden/weight (else RLK_UNSUPPORTED); workspace as for the sm80 kernel. */
int rlk_linear_logp_fwd_sm90(const rlk_linear_logp_args *args, void *workspace, void *stream);
/* The fused dlogits (hidden, weight, bias given, logits NULL) on the GEMM's wgmma main loop; z's
 * elements are bitwise those of rlk_gemm_sm90 (out fp32, C = bias). RLK_UNSUPPORTED: use
 * rlk_gemm_sm90 + rlk_linear_logp_dlogits_cuda. */
int rlk_linear_logp_dlogits_sm90(const rlk_linear_logp_dlogits_args *args, void *stream);


#ifdef __cplusplus
}
#endif
#endif /* RL_KERNELS_H_ */
