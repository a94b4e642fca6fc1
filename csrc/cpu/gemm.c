/* gemm.c: reference CPU GEMM (contract: csrc/ops/gemm.h), out[i, j] = alpha * sum_k A[i, k] * B[k, j] + beta * C[i, j],
 * for fp32 / bf16 / fp16 inputs (fp32 accumulation) and fp64 inputs (fp64 accumulation, gradcheck).
 *
 * Tile plan (fp32 / bf16 / fp16, GotoBLAS style): the output is cut into MC x NC macro tiles that
 * OpenMP threads take in any order. A macro tile walks K in KC blocks, in increasing order; per
 * block it packs B (KC x NC) into NR-column micro-panels and A (MC x KC) into MR-row micro-panels,
 * converted to fp32 and zero padded to whole micro-panels, then runs an MR x NR register
 * micro-kernel (AVX2 + FMA when the CPU has it, portable C otherwise) over them, with the B
 * micro-panel outer so it stays in L1. Each output's fp32 accumulator lives in a per-thread
 * MC x NC buffer between K blocks. The epilogue forms fmaf(beta, c, alpha * acc) in fp32 and
 * rounds that once to out_dtype (fp64: the same in fp64).
 * fp64 is a plain blocked loop nest (gradcheck sizes), same reduction rule.
 *
 * Why batch-invariant: every output element is acc = fma(A[i, k], B[k, j], acc) for k = 0..K-1,
 * starting from 0, whatever its tile, row position, M or thread: tails are zero padded and run the
 * same micro-kernel, and fma is exactly rounded, so the AVX2 and portable micro-kernels (and libm's
 * fmaf) agree bit for bit. Threads split output tiles only, never K.
 *
 * Build: gcc -O3 -std=c11 -fopenmp -ffp-contract=off -fPIC -shared -I csrc csrc/cpu/gemm.c
 *        (-DRLK_CPU_PORTABLE_ONLY drops the AVX2 micro-kernel; results are identical)
 * Test:  pip install --no-build-isolation -e . && pytest tests/test_gemm.py tests/test_invariance.py
 *        tests/test_binding.py (fp64 references, bitwise row invariance, 1 vs 2 threads).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../ops/gemm.h"
#include "common.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(RLK_CPU_PORTABLE_ONLY)
#define RLK_HAVE_AVX2_KERNEL 1
#include <immintrin.h>
#endif

enum {
    MR = 6,    /* micro-tile rows: 6 x 2 ymm accumulators + 2 B loads + 1 broadcast = 15 of 16 regs */
    NR = 16,   /* micro-tile columns: two 8-float vectors */
    KC = 256,  /* K block: a 16 KB B micro-panel stays in L1 */
    MC = 96,   /* macro tile rows (multiple of MR): the 96 KB A block stays in L2 */
    NC = 256,  /* macro tile columns (multiple of NR) */
    MC64 = 32, /* fp64 macro tile */
    NC64 = 64,
};

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Packs rows [i0, i0 + mc) x K [k0, k0 + kc) of A as MR-row micro-panels: panel p holds
 * apack[p * MR * kc + k * MR + r]; rows past M are zero. */
static void pack_a(float *apack, const rlk_gemm_args *g, int64_t i0, int64_t mc, int64_t k0, int64_t kc)
{
    const int64_t row_stride = g->a_trans ? 1 : g->lda, k_stride = g->a_trans ? g->lda : 1;
    for (int64_t p = 0; p < mc; p += MR) {
        float *panel = apack + p * kc;
        const int64_t rows = rlk_min64(MR, mc - p);
        const int64_t first = (i0 + p) * row_stride + k0 * k_stride;
        if (g->a_trans) {
            for (int64_t k = 0; k < kc; k++)
                rlk_load_row_f32(panel + k * MR, 1, g->a, g->in_dtype, first + k * k_stride, rows);
        } else {
            for (int64_t r = 0; r < rows; r++)
                rlk_load_row_f32(panel + r, MR, g->a, g->in_dtype, first + r * row_stride, kc);
        }
        for (int64_t r = rows; r < MR; r++)
            for (int64_t k = 0; k < kc; k++) panel[k * MR + r] = 0.0f;
    }
}

/* Packs K [k0, k0 + kc) x columns [j0, j0 + nc) of B as NR-column micro-panels: panel q holds
 * bpack[q * NR * kc + k * NR + c]; columns past N are zero. */
static void pack_b(float *bpack, const rlk_gemm_args *g, int64_t k0, int64_t kc, int64_t j0, int64_t nc)
{
    const int64_t k_stride = g->b_trans ? 1 : g->ldb, col_stride = g->b_trans ? g->ldb : 1;
    for (int64_t q = 0; q < nc; q += NR) {
        float *panel = bpack + q * kc;
        const int64_t cols = rlk_min64(NR, nc - q);
        const int64_t first = k0 * k_stride + (j0 + q) * col_stride;
        if (g->b_trans) {
            for (int64_t c = 0; c < cols; c++)
                rlk_load_row_f32(panel + c, NR, g->b, g->in_dtype, first + c * col_stride, kc);
        } else {
            for (int64_t k = 0; k < kc; k++)
                rlk_load_row_f32(panel + k * NR, 1, g->b, g->in_dtype, first + k * k_stride, cols);
        }
        for (int64_t k = 0; k < kc; k++)
            for (int64_t c = cols; c < NR; c++) panel[k * NR + c] = 0.0f;
    }
}

/* acc[r * ldacc + c] (+)= sum_k ap[k * MR + r] * bp[k * NR + c] for an MR x NR micro-tile, one fma
 * per k in increasing k; accumulate = 0 starts the accumulators from 0. */
typedef void (*micro_kernel_fn)(int64_t kc, const float *ap, const float *bp, float *acc,
                                int64_t ldacc, int accumulate);

static void micro_kernel_portable(int64_t kc, const float *restrict ap, const float *restrict bp,
                                  float *restrict acc, int64_t ldacc, int accumulate)
{
    float c[MR][NR];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++) c[r][j] = accumulate ? acc[r * ldacc + j] : 0.0f;
    for (int64_t k = 0; k < kc; k++) {
        for (int r = 0; r < MR; r++) {
            const float a = ap[k * MR + r];
            for (int j = 0; j < NR; j++) c[r][j] = fmaf(a, bp[k * NR + j], c[r][j]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++) acc[r * ldacc + j] = c[r][j];
}

#ifdef RLK_HAVE_AVX2_KERNEL
/* Named accumulators rather than an array: GCC keeps all 12 in ymm registers only this way. */
__attribute__((target("avx2,fma")))
static void micro_kernel_avx2(int64_t kc, const float *restrict ap, const float *restrict bp,
                              float *restrict acc, int64_t ldacc, int accumulate)
{
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    if (accumulate) {
        c00 = _mm256_loadu_ps(acc + 0 * ldacc), c01 = _mm256_loadu_ps(acc + 0 * ldacc + 8);
        c10 = _mm256_loadu_ps(acc + 1 * ldacc), c11 = _mm256_loadu_ps(acc + 1 * ldacc + 8);
        c20 = _mm256_loadu_ps(acc + 2 * ldacc), c21 = _mm256_loadu_ps(acc + 2 * ldacc + 8);
        c30 = _mm256_loadu_ps(acc + 3 * ldacc), c31 = _mm256_loadu_ps(acc + 3 * ldacc + 8);
        c40 = _mm256_loadu_ps(acc + 4 * ldacc), c41 = _mm256_loadu_ps(acc + 4 * ldacc + 8);
        c50 = _mm256_loadu_ps(acc + 5 * ldacc), c51 = _mm256_loadu_ps(acc + 5 * ldacc + 8);
    }
    for (int64_t k = 0; k < kc; k++, ap += MR, bp += NR) {
        const __m256 b0 = _mm256_loadu_ps(bp), b1 = _mm256_loadu_ps(bp + 8);
        __m256 a = _mm256_broadcast_ss(ap + 0);
        c00 = _mm256_fmadd_ps(a, b0, c00), c01 = _mm256_fmadd_ps(a, b1, c01);
        a = _mm256_broadcast_ss(ap + 1);
        c10 = _mm256_fmadd_ps(a, b0, c10), c11 = _mm256_fmadd_ps(a, b1, c11);
        a = _mm256_broadcast_ss(ap + 2);
        c20 = _mm256_fmadd_ps(a, b0, c20), c21 = _mm256_fmadd_ps(a, b1, c21);
        a = _mm256_broadcast_ss(ap + 3);
        c30 = _mm256_fmadd_ps(a, b0, c30), c31 = _mm256_fmadd_ps(a, b1, c31);
        a = _mm256_broadcast_ss(ap + 4);
        c40 = _mm256_fmadd_ps(a, b0, c40), c41 = _mm256_fmadd_ps(a, b1, c41);
        a = _mm256_broadcast_ss(ap + 5);
        c50 = _mm256_fmadd_ps(a, b0, c50), c51 = _mm256_fmadd_ps(a, b1, c51);
    }
    _mm256_storeu_ps(acc + 0 * ldacc, c00), _mm256_storeu_ps(acc + 0 * ldacc + 8, c01);
    _mm256_storeu_ps(acc + 1 * ldacc, c10), _mm256_storeu_ps(acc + 1 * ldacc + 8, c11);
    _mm256_storeu_ps(acc + 2 * ldacc, c20), _mm256_storeu_ps(acc + 2 * ldacc + 8, c21);
    _mm256_storeu_ps(acc + 3 * ldacc, c30), _mm256_storeu_ps(acc + 3 * ldacc + 8, c31);
    _mm256_storeu_ps(acc + 4 * ldacc, c40), _mm256_storeu_ps(acc + 4 * ldacc + 8, c41);
    _mm256_storeu_ps(acc + 5 * ldacc, c50), _mm256_storeu_ps(acc + 5 * ldacc + 8, c51);
}
#endif

/* The choice only affects speed: both kernels perform the same exactly rounded fmas. */
static micro_kernel_fn select_micro_kernel(void)
{
#ifdef RLK_HAVE_AVX2_KERNEL
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return micro_kernel_avx2;
#endif
    return micro_kernel_portable;
}

/* One MC x NC macro tile at (i0, j0). work: apack (MC * KC), bpack (KC * NC), acc (MC * NC),
 * c_row (NC) floats. */
static void gemm_tile_f32(const rlk_gemm_args *g, micro_kernel_fn micro_kernel, int64_t i0,
                          int64_t j0, float *work)
{
    float *apack = work, *bpack = apack + MC * KC, *acc = bpack + KC * NC, *c_row = acc + MC * NC;
    const int64_t mc = rlk_min64(MC, g->M - i0), nc = rlk_min64(NC, g->N - j0);
    const int64_t mc_padded = round_up(mc, MR), nc_padded = round_up(nc, NR);
    const float alpha = (float)g->alpha, beta = (float)g->beta;
    if (g->K == 0) memset(acc, 0, sizeof(float) * MC * NC);
    for (int64_t k0 = 0; k0 < g->K; k0 += KC) {
        const int64_t kc = rlk_min64(KC, g->K - k0);
        pack_b(bpack, g, k0, kc, j0, nc);
        pack_a(apack, g, i0, mc, k0, kc);
        for (int64_t jr = 0; jr < nc_padded; jr += NR)
            for (int64_t ir = 0; ir < mc_padded; ir += MR)
                micro_kernel(kc, apack + ir * kc, bpack + jr * kc, acc + ir * NC + jr, NC, k0 > 0);
    }
    for (int64_t i = 0; i < mc; i++) {
        float *acc_row = acc + i * NC;
        if (g->c) {
            rlk_load_row_f32(c_row, 1, g->c, g->out_dtype, (i0 + i) * g->ldc + j0, nc);
            for (int64_t j = 0; j < nc; j++) acc_row[j] = fmaf(beta, c_row[j], alpha * acc_row[j]);
        } else {
            for (int64_t j = 0; j < nc; j++) acc_row[j] = alpha * acc_row[j];
        }
        rlk_store_row_f32(g->out, g->out_dtype, (i0 + i) * g->ldo + j0, acc_row, nc);
    }
}

/* One MC64 x NC64 fp64 macro tile at (i0, j0). work: bpack (KC * NC64), acc (MC64 * NC64) doubles. */
static void gemm_tile_f64(const rlk_gemm_args *g, int64_t i0, int64_t j0, double *work)
{
    double *bpack = work, *acc = bpack + KC * NC64;
    const double *a = (const double *)g->a, *b = (const double *)g->b;
    const int64_t mc = rlk_min64(MC64, g->M - i0), nc = rlk_min64(NC64, g->N - j0);
    const int64_t a_row_stride = g->a_trans ? 1 : g->lda, a_k_stride = g->a_trans ? g->lda : 1;
    const int64_t b_k_stride = g->b_trans ? 1 : g->ldb, b_col_stride = g->b_trans ? g->ldb : 1;
    memset(acc, 0, sizeof(double) * MC64 * NC64);
    for (int64_t k0 = 0; k0 < g->K; k0 += KC) {
        const int64_t kc = rlk_min64(KC, g->K - k0);
        for (int64_t k = 0; k < kc; k++)
            for (int64_t j = 0; j < nc; j++)
                bpack[k * NC64 + j] = b[(k0 + k) * b_k_stride + (j0 + j) * b_col_stride];
        for (int64_t i = 0; i < mc; i++) {
            double *acc_row = acc + i * NC64;
            for (int64_t k = 0; k < kc; k++) {
                const double a_ik = a[(i0 + i) * a_row_stride + (k0 + k) * a_k_stride];
                for (int64_t j = 0; j < nc; j++) acc_row[j] = fma(a_ik, bpack[k * NC64 + j], acc_row[j]);
            }
        }
    }
    for (int64_t i = 0; i < mc; i++) {
        for (int64_t j = 0; j < nc; j++) {
            double r = g->alpha * acc[i * NC64 + j];
            const int64_t c_index = (i0 + i) * g->ldc + j0 + j, out_index = (i0 + i) * g->ldo + j0 + j;
            if (g->c) {
                const double c = g->out_dtype == RLK_F64 ? ((const double *)g->c)[c_index]
                                                         : (double)((const float *)g->c)[c_index];
                r = fma(g->beta, c, r);
            }
            if (g->out_dtype == RLK_F64) ((double *)g->out)[out_index] = r;
            else ((float *)g->out)[out_index] = (float)r;
        }
    }
}

int rlk_gemm_cpu(const rlk_gemm_args *args, rlk_context *ctx)
{
    if (args->in_dtype == RLK_I32 || args->in_dtype == RLK_I64) return RLK_UNSUPPORTED;
    ctx->kernel = "gemm_cpu";
    if (ctx->plan_only) return RLK_OK;
    const int is_f64 = args->in_dtype == RLK_F64;
    const int64_t tile_m = is_f64 ? MC64 : MC, tile_n = is_f64 ? NC64 : NC;
    const int64_t tiles_n = (args->N + tile_n - 1) / tile_n;
    const int64_t tiles = (args->M + tile_m - 1) / tile_m * tiles_n;
    const size_t work_bytes = is_f64 ? sizeof(double) * (KC * NC64 + MC64 * NC64)
                                     : sizeof(float) * ((size_t)MC * KC + KC * NC + MC * NC + NC);
    const micro_kernel_fn micro_kernel = select_micro_kernel();
    const int threads = (int)rlk_min64(ctx->num_threads > 0 ? ctx->num_threads : 1, tiles);
    int out_of_memory = 0;

#pragma omp parallel num_threads(threads)
    {
        void *work = aligned_alloc(64, (size_t)round_up((int64_t)work_bytes, 64));
        if (!work) {
#pragma omp atomic write
            out_of_memory = 1;
        }
        /* Any tile-to-thread mapping gives the same bits; dynamic just balances edge tiles. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tiles; t++) {
            if (!work) continue;
            const int64_t i0 = t / tiles_n * tile_m, j0 = t % tiles_n * tile_n;
            if (is_f64) gemm_tile_f64(args, i0, j0, work);
            else gemm_tile_f32(args, micro_kernel, i0, j0, work);
        }
        free(work);
    }
    return out_of_memory ? RLK_CPU_OUT_OF_MEMORY : RLK_OK;
}
