/* sm80/gemm.cu: batch-invariant GEMM for sm_80+ (also runs on H100 through sm_90 SASS): bf16/fp16
 * on tensor cores, fp32 on FFMA (never TF32).
 *
 *   out[i, j] = alpha * sum_k A[i, k] * B[k, j] + beta * C[i, j]   (contract: csrc/ops/gemm.h)
 *
 * Tensor-core tile plan (bf16/fp16 in): CTA tile BM x BN x BK = 128 x 256 x 64, 8 warps as 2 (M) x 4 (N), warp tile
 * 64 x 64 = 4 x 8 mma.sync.m16n8k16 (bf16/fp16 in, fp32 accumulate), one CTA per SM; when those
 * tiles would leave half the SMs idle (small M or N), 128 x 128 with 4 x 2 warps of 32 x 64.
 * Operands go global -> shared with 16-byte cp.async in a 3-stage pipeline (162 KB for the large
 * tile, fits the 164 KB of an A100 as well); each operand is kept in shared memory in its
 * global orientation (the contiguous global dimension is contiguous in shared memory), rows
 * padded by 16 bytes so ldmatrix (.trans for the M- or N-contiguous layouts) is free of bank
 * conflicts. Fragments of the next k16 step are loaded while the current step's mma issue.
 * Operands whose base or row stride is not 16-byte aligned take a predicated element-wise load
 * path (template flag VEC_LOADS = 0) inside the same kernel: only the loads differ, the
 * shared-memory image and the mma sequence are identical, so results are bitwise equal.
 * The epilogue stages the fp32 tile through shared memory and writes 8 consecutive outputs per
 * thread (16-byte stores where aligned), forming alpha * acc + beta * c in fp32, rounded once.
 * The grid is 1-D over output tiles, rastered in groups of 8 M-tiles so that neighbouring CTAs
 * share B and A tiles in L2 (no 65535 grid.y limit; N = 151936 is 594 N-tiles).
 *
 * fp32 plan (FFMA): CTA tile 128 x 128 x 16 (64 x 64 when the large tiles would not give every SM
 * one), 256 threads as 16 x 16, each thread an 8 x 8 (4 x 4) register block of two 4-wide strips per
 * dimension, two CTAs per SM. A 3-stage ring of k-major k-tiles is filled by 4-byte cp.async whose
 * addresses walk each operand's contiguous dimension across neighbouring threads (coalesced for every
 * layout): a tile inside M x N copies its whole k-tiles without bounds, the others zero-fill past the
 * edges; grouped raster like the tensor-core kernel.
 *
 * Batch invariance: no split-K; the tile size (chosen by M and N) only moves an element between
 * tiles, CTAs and warps, never changes its arithmetic. Every output element
 * is accumulated over k-tiles 0, 1, ..., ceil(K / BK) - 1 and, inside a k-tile, over its k16
 * mma steps in order, with zero fill past K (which depends on K only). The mma sequence is the same
 * for every row, every position inside the tile and every CTA, so a row's bits do not depend on M,
 * on its position in the batch or on the alignment of the operands. The fp32 kernel updates one
 * accumulator per element by fmaf for k = 0, 1, ..., K - 1 in order (zero fill adds exact zeros).
 *
 * Build (shared library for tests):
 *   nvcc -shared -Xcompiler -fPIC -O3 -std=c++17 -lineinfo -Xptxas -v -Icsrc \
 *     -gencode arch=compute_80,code=sm_80 -gencode arch=compute_80,code=compute_80 \
 *     -gencode arch=compute_90,code=sm_90 csrc/cuda/sm80/gemm.cu -o libgemm_sm80.so
 * Test (GPU): python3 setup.py build_ext --inplace && pytest tests/test_gpu_gemm.py -m gpu
 *   (or scripts/gpu_check.sh: tests, compute-sanitizer, benchmarks/bench_gemm.py).
 */
#include "../../ops/gemm.h"
#include "../common.cuh"

#define GEMM_SM80_GROUP_M 8 /* M-tiles per raster group (L2 reuse of the B tiles) */

/* ----------------------------------------------------------------------------------------------
 * 8 consecutive output elements <-> 8 floats
 * -------------------------------------------------------------------------------------------- */
/* 8 consecutive elements <-> 8 floats with 16-byte accesses; p must be 16-byte aligned */
__device__ __forceinline__ void load8_vec(const float *p, float v[8]) {
    float4 x = *(const float4 *)p, y = *(const float4 *)(p + 4);
    v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w; v[4] = y.x; v[5] = y.y; v[6] = y.z; v[7] = y.w;
}
template <typename T>
__device__ __forceinline__ void load8_vec(const T *p, float v[8]) {
    uint4 x = *(const uint4 *)p;
    const T *e = (const T *)&x;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = to_f32(e[i]);
}
__device__ __forceinline__ void store8_vec(float *p, const float v[8]) {
    *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
    *(float4 *)(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}
template <typename T>
__device__ __forceinline__ void store8_vec(T *p, const float v[8]) {
    uint4 x;
    T *e = (T *)&x;
#pragma unroll
    for (int i = 0; i < 8; i++) from_f32(&e[i], v[i]);
    *(uint4 *)p = x;
}

/* ----------------------------------------------------------------------------------------------
 * Global -> shared tile copy. The tile is ROWS x COLS elements of a row-major global matrix
 * (COLS along the contiguous dimension) starting at g; rows_in x cols_in of them are in range,
 * the rest is zero-filled. Shared rows have stride COLS + 8 elements (16-byte pad).
 * VEC_LOADS: 16-byte cp.async (base 16-byte aligned, ld % 8 == 0); otherwise element-wise
 * predicated loads that build the same 16-byte chunks and store them to shared memory.
 * -------------------------------------------------------------------------------------------- */
template <typename T, int ROWS, int COLS, int THREADS, int VEC_LOADS>
__device__ __forceinline__ void load_tile(T *smem_tile, const T *g, int64_t ld, int rows_in,
                                          int cols_in, int tid) {
    constexpr int CHUNKS_PER_ROW = COLS / 8;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    static_assert(CHUNKS % THREADS == 0, "tile chunks must divide evenly over the threads");
    if (VEC_LOADS) {
        /* chunk i of this thread: row r0 + i * ROWS_PER_PASS, column c; the global address
         * advances by one 64-bit step per chunk rather than keeping one offset per chunk live
         * across the main loop (which spills next to the 128 accumulators) */
        constexpr int ROWS_PER_PASS = THREADS / CHUNKS_PER_ROW;
        static_assert(THREADS % CHUNKS_PER_ROW == 0, "a thread keeps one column of chunks");
        const int r0 = tid / CHUNKS_PER_ROW, c = (tid % CHUNKS_PER_ROW) * 8;
        const int64_t step = ROWS_PER_PASS * ld;
        const T *src = g + r0 * ld + c;
        const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem_tile + r0 * (COLS + 8) + c);
#pragma unroll
        for (int i = 0; i < CHUNKS / THREADS; i++, src += step) {
            const int valid = r0 + i * ROWS_PER_PASS < rows_in ? cols_in - c : 0;
            const int bytes = valid <= 0 ? 0 : (valid >= 8 ? 16 : valid * 2);
            cp_async_16(dst + 2 * i * ROWS_PER_PASS * (COLS + 8), bytes ? src : g, bytes);
        }
    } else {
        /* one chunk at a time: unrolled, the 8 element loads per chunk would spill */
#pragma unroll 1
        for (int i = 0; i < CHUNKS / THREADS; i++) {
            const int chunk = tid + i * THREADS;
            const int r = chunk / CHUNKS_PER_ROW, c = (chunk % CHUNKS_PER_ROW) * 8;
            const int valid = r < rows_in ? cols_in - c : 0;
            const unsigned short *src = (const unsigned short *)(g + r * ld + c);
            uint32_t w[4];
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                const uint32_t lo = e < valid ? __ldg(src + e) : 0;
                const uint32_t hi = e + 1 < valid ? __ldg(src + e + 1) : 0;
                w[e / 2] = lo | (hi << 16);
            }
            *(uint4 *)(smem_tile + r * (COLS + 8) + c) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

/* ----------------------------------------------------------------------------------------------
 * The kernel. T: bf16 or fp16 inputs; OutT: out/c type; A_TRANS/B_TRANS: operand layouts.
 * A tile in shared memory: [BM][BK] (A_TRANS = 0) or [BK][BM] (A_TRANS = 1);
 * B tile: [BN][BK] (B_TRANS = 1) or [BK][BN] (B_TRANS = 0); each row padded by 8 elements.
 * -------------------------------------------------------------------------------------------- */
template <int BM, int BK, int A_TRANS>
__host__ __device__ constexpr int a_stage_elems(void) {
    return A_TRANS ? BK * (BM + 8) : BM * (BK + 8);
}
template <int BN, int BK, int B_TRANS>
__host__ __device__ constexpr int b_stage_elems(void) {
    return B_TRANS ? BN * (BK + 8) : BK * (BN + 8);
}

template <typename T, typename OutT, int A_TRANS, int B_TRANS, int VEC_LOADS, int BM, int BN, int BK,
          int WARPS_M, int WARPS_N, int STAGES>
/* One CTA per SM is assumed for register allocation (a 64 x 64 warp tile needs ~240 registers; the
 * 32 x 64 one of the 128 x 128 plan ~140, which a two-CTA bound of 128 would spill). */
__global__ void __launch_bounds__(WARPS_M *WARPS_N * 32, 1)
    gemm_sm80_kernel(int64_t M, int64_t N, int64_t K, const T *__restrict__ a, int64_t lda,
                     const T *__restrict__ b, int64_t ldb, const OutT *__restrict__ c, int64_t ldc,
                     OutT *__restrict__ out, int64_t ldo, float alpha, float beta) {
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N; /* warp tile */
    constexpr int MI = WM / 16, NI = WN / 8;             /* mma tiles per warp */
    static_assert(WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0 && BK >= 32, "bad tile plan");
    constexpr int A_STAGE = a_stage_elems<BM, BK, A_TRANS>();
    constexpr int B_STAGE = b_stage_elems<BN, BK, B_TRANS>();
    constexpr int A_LD = A_TRANS ? BM + 8 : BK + 8; /* shared row strides in elements */
    constexpr int B_LD = B_TRANS ? BK + 8 : BN + 8;
    constexpr int C_LD = BN + 4; /* fp32 epilogue staging stride */

    extern __shared__ uint4 smem_raw[];
    T *As = (T *)smem_raw;
    T *Bs = As + STAGES * A_STAGE;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;

    /* grouped raster: GROUP_M consecutive M-tiles walk the N-tiles together */
    const int64_t num_m_tiles = (M + BM - 1) / BM, num_n_tiles = (N + BN - 1) / BN;
    const int64_t pid = blockIdx.x;
    const int64_t tiles_per_group = (int64_t)GEMM_SM80_GROUP_M * num_n_tiles;
    const int64_t first_m = (pid / tiles_per_group) * GEMM_SM80_GROUP_M;
    const int64_t group_rows = min((int64_t)GEMM_SM80_GROUP_M, num_m_tiles - first_m);
    const int64_t tile_m = first_m + (pid % tiles_per_group) % group_rows;
    const int64_t tile_n = (pid % tiles_per_group) / group_rows;
    const int64_t m0 = tile_m * BM, n0 = tile_n * BN;

    /* k-tiles are loaded in order; k_next is the k offset of the next one */
    const int m_in = (int)min((int64_t)BM, M - m0), n_in = (int)min((int64_t)BN, N - n0);
    const T *a_tile = a + (A_TRANS ? m0 : m0 * lda); /* tile origins at k = 0 */
    const T *b_tile = b + (B_TRANS ? n0 * ldb : n0);
    int64_t k_next = 0;
    auto load_next_a = [&](int stage) {
        const int k_in = (int)min((int64_t)BK, K - k_next);
        if (A_TRANS)
            load_tile<T, BK, BM, THREADS, VEC_LOADS>(As + stage * A_STAGE, a_tile + k_next * lda, lda, k_in, m_in, tid);
        else
            load_tile<T, BM, BK, THREADS, VEC_LOADS>(As + stage * A_STAGE, a_tile + k_next, lda, m_in, k_in, tid);
    };
    auto load_next_b = [&](int stage) { /* after load_next_a: moves on to the next k-tile */
        const int k_in = (int)min((int64_t)BK, K - k_next);
        if (B_TRANS)
            load_tile<T, BN, BK, THREADS, VEC_LOADS>(Bs + stage * B_STAGE, b_tile + k_next, ldb, n_in, k_in, tid);
        else
            load_tile<T, BK, BN, THREADS, VEC_LOADS>(Bs + stage * B_STAGE, b_tile + k_next * ldb, ldb, k_in, n_in, tid);
        k_next += BK;
    };

    /* per-lane ldmatrix offsets (elements, within a stage, for k16 step 0 and mma tile 0).
     * x4 matrix j = lane / 8 supplies row lane % 8. A fragment order: (m0-7,k0-7), (m8-15,k0-7),
     * (m0-7,k8-15), (m8-15,k8-15); B fragment pair order: (n0-7,k0-7), (n0-7,k8-15), (n8-15,k0-7),
     * (n8-15,k8-15). */
    const int j = lane / 8, r8 = lane % 8;
    const int wm0 = warp_m * WM, wn0 = warp_n * WN;
    const int a_lane_off = A_TRANS ? (r8 + (j / 2) * 8) * A_LD + wm0 + (j % 2) * 8
                                   : (wm0 + r8 + (j % 2) * 8) * A_LD + (j / 2) * 8;
    const int b_lane_off = B_TRANS ? (wn0 + r8 + (j / 2) * 8) * B_LD + (j % 2) * 8
                                   : (r8 + (j % 2) * 8) * B_LD + wn0 + (j / 2) * 8;
    /* element steps between mma tiles and between k16 steps */
    constexpr int A_MI_STEP = A_TRANS ? 16 : 16 * A_LD, A_K_STEP = A_TRANS ? 16 * A_LD : 16;
    constexpr int B_NJ_STEP = B_TRANS ? 16 * B_LD : 16, B_K_STEP = B_TRANS ? 16 : 16 * B_LD;
    const uint32_t as_base = (uint32_t)__cvta_generic_to_shared(As) + 2 * a_lane_off; /* bytes */
    const uint32_t bs_base = (uint32_t)__cvta_generic_to_shared(Bs) + 2 * b_lane_off;

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mi][ni][e] = 0.0f;

    /* fragments of k16 step ks of pipeline stage `stage`; B x4 loads cover two n8 mma tiles */
    auto load_fragments = [&](uint32_t (&af)[MI][4], uint32_t (&bf)[NI][2], int stage, int ks) {
        const uint32_t as_stage = as_base + 2 * (stage * A_STAGE + ks * A_K_STEP);
        const uint32_t bs_stage = bs_base + 2 * (stage * B_STAGE + ks * B_K_STEP);
#pragma unroll
        for (int mi = 0; mi < MI; mi++) ldmatrix_x4<A_TRANS != 0>(af[mi], as_stage + 2 * mi * A_MI_STEP);
#pragma unroll
        for (int nj = 0; nj < NI / 2; nj++) {
            uint32_t r[4];
            ldmatrix_x4<B_TRANS == 0>(r, bs_stage + 2 * nj * B_NJ_STEP);
            bf[2 * nj][0] = r[0]; bf[2 * nj][1] = r[1];
            bf[2 * nj + 1][0] = r[2]; bf[2 * nj + 1][1] = r[3];
        }
    };

    const int num_k_tiles = (int)((K + BK - 1) / BK);
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < num_k_tiles) {
            load_next_a(s);
            load_next_b(s);
        }
        cp_async_commit();
    }

    /* Software pipeline: fragments for the next k16 step are read from shared memory while the
     * current step's mma run; the barrier sits before the last k16 step of a k-tile so that the
     * first fragments of the next k-tile are already in flight when that step's mma issue. The
     * mma order is k-tile 0, 1, ... and k16 steps 0 .. BK/16 - 1 within each. */
    constexpr int KSTEPS = BK / 16;
    constexpr int B_LOAD_STEP = KSTEPS > 2 ? 1 : 0;
    uint32_t af[2][MI][4], bf[2][NI][2];
    int read_stage = 0, write_stage = STAGES - 1;
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    load_fragments(af[0], bf[0], 0, 0);
    for (int kt = 0; kt < num_k_tiles; kt++) {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            if (ks == KSTEPS - 1) {
                /* k-tile kt + 1 has landed, and every warp is past its reads of the stage that
                 * the next k-tile's ks == 0 step refills */
                cp_async_wait<STAGES - 2>();
                __syncthreads();
                read_stage = (read_stage + 1) % STAGES;
            }
            load_fragments(af[(ks + 1) % 2], bf[(ks + 1) % 2], read_stage, (ks + 1) % KSTEPS);
            /* refill the free stage, A and B in different k16 steps to spread the issue; the
             * commit stays before the last step's wait (hence B_LOAD_STEP < KSTEPS - 1) */
            const bool refill = kt + STAGES - 1 < num_k_tiles;
            if (ks == 0 && refill) load_next_a(write_stage);
            if (ks == B_LOAD_STEP) {
                if (refill) load_next_b(write_stage);
                cp_async_commit();
                write_stage = (write_stage + 1) % STAGES;
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++)
                    mma_16816<std::is_same<T, __nv_bfloat16>::value>(acc[mi][ni], af[ks % 2][mi], bf[ks % 2][ni]);
        }
    }

    /* epilogue: stage the fp32 tile in shared memory, then 8 consecutive outputs per thread */
    cp_async_wait<0>();
    __syncthreads();
    float *Cs = (float *)smem_raw;
    const int g = lane / 4, t4 = lane % 4;
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            const int row = wm0 + mi * 16 + g, col = wn0 + ni * 8 + 2 * t4;
            *(float2 *)&Cs[row * C_LD + col] = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
            *(float2 *)&Cs[(row + 8) * C_LD + col] = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
        }
    __syncthreads();

    constexpr int GROUPS_PER_ROW = BN / 8;
#pragma unroll 2
    for (int idx = tid; idx < BM * GROUPS_PER_ROW; idx += THREADS) {
        const int r = idx / GROUPS_PER_ROW, col = (idx % GROUPS_PER_ROW) * 8;
        const int64_t gi = m0 + r, gj = n0 + col;
        if (gi >= M || gj >= N) continue;
        const int64_t valid = N - gj; /* columns of this group in range */
        float v[8];
        load8_vec(&Cs[r * C_LD + col], v);
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] *= alpha;
        if (c) {
            const OutT *crow = c + gi * ldc + gj; /* ldc == 0: bias row broadcast */
            float cv[8];
            if (valid >= 8 && ((uintptr_t)crow % 16) == 0) {
                load8_vec(crow, cv);
            } else {
#pragma unroll
                for (int e = 0; e < 8; e++) cv[e] = e < valid ? to_f32(crow[e]) : 0.0f;
            }
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = fmaf(beta, cv[e], v[e]);
        }
        OutT *orow = out + gi * ldo + gj;
        if (valid >= 8 && ((uintptr_t)orow % 16) == 0) {
            store8_vec(orow, v);
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (e < valid) from_f32(&orow[e], v[e]);
        }
    }
}

/* ----------------------------------------------------------------------------------------------
 * The fp32 kernel (FFMA, fixed k order; see the file header). BM x BN x 16 CTA tiles (128 x 128 or
 * 64 x 64), 256 threads as a 16 x 16 grid. Thread (tx, ty) owns rows s * 64 + 4 ty + r and columns
 * t * 64 + 4 tx + c (r, c < 4): four-wide strips 64 apart, so a warp's float4 reads of one k row of
 * the shared tiles are broadcasts (A) or one contiguous 256-byte run (B). A ring of FP32_STAGES
 * k-tiles is filled by 4-byte cp.async (zero-filling past M, N and K), two k-tiles ahead.
 * -------------------------------------------------------------------------------------------- */
#define FP32_BK 16
#define FP32_STAGES 3
#define FP32_THREADS 256
#define FP32_GROUP_M 8

template <int BM, int BN>
struct Fp32Stage { /* one k-tile, k-major; +4 floats per row: float4-aligned rows, spread banks */
    float a[FP32_BK][BM + 4];
    float b[FP32_BK][BN + 4];
};

/* One thread's share of an operand's k-tiles as 4-byte copies, consecutive lanes on consecutive
 * elements of the operand's contiguous global dimension. K_CONTIGUOUS (row-major [rows, K]): k tid % 16
 * of rows tid / 16 + 16 i (a half-warp reads a row's 64 bytes); else ([K, rows]): rows tid % 32 + 32 e
 * (a warp reads 128 contiguous bytes; the e steps are immediate offsets) of k tid / 32 + 8 i. */
template <int ROWS, bool K_CONTIGUOUS>
struct Fp32TileLoader {
    static constexpr int E = K_CONTIGUOUS ? 1 : ROWS / 32;  /* copies at immediate offsets from a run's */
    static constexpr int RUNS = ROWS * FP32_BK / FP32_THREADS / E;
    static constexpr int ROW_STEP = K_CONTIGUOUS ? FP32_THREADS / FP32_BK : 32, K_STEP = FP32_THREADS / 32;
    const float *src;   /* this thread's first element of the next k-tile */
    const float *base;  /* the operand tile's origin: any valid address for the zero-filled copies */
    int64_t run_step, k_tile_step;  /* elements between runs, between k-tiles */
    int row, k;

    __device__ __forceinline__ Fp32TileLoader(const float *tile_origin, int64_t ld, int tid) {
        row = K_CONTIGUOUS ? tid / FP32_BK : tid % 32;
        k = K_CONTIGUOUS ? tid % FP32_BK : tid / 32;
        base = tile_origin;
        src = K_CONTIGUOUS ? tile_origin + row * ld + k : tile_origin + k * ld + row;
        run_step = (K_CONTIGUOUS ? ROW_STEP : K_STEP) * ld;
        k_tile_step = K_CONTIGUOUS ? FP32_BK : FP32_BK * ld;
    }

    /* Copies the next k-tile into tile and moves on. FULL: the whole k-tile lies inside the operand
     * (every tile but the last row or column tile, every k-tile but a partial last one), so the copies
     * need no bounds; otherwise the elements with row >= rows_in or k >= k_in are written as zeros.
     * Both place the same values. */
    template <bool FULL>
    __device__ __forceinline__ void load(float (*tile)[ROWS + 4], int rows_in, int k_in) {
#pragma unroll
        for (int i = 0; i < RUNS; i++) {
            const float *run = src + i * run_step;
#pragma unroll
            for (int e = 0; e < E; e++) {
                /* runs step across the contiguous dimension, copies inside a run along it (MN only) */
                const int r = row + (K_CONTIGUOUS ? i : e) * ROW_STEP, kk = K_CONTIGUOUS ? k : k + i * K_STEP;
                const float *elem = run + e * ROW_STEP;
                const uint32_t dst = smem_u32(&tile[kk][r]);
                if (FULL) {
                    cp_async_4(dst, elem, 4);
                } else {
                    const bool valid = kk < k_in && r < rows_in;
                    cp_async_4(dst, valid ? elem : base, valid ? 4 : 0);
                }
            }
        }
        src += k_tile_step;
    }
};

template <int BM, int BN, int A_TRANS, int B_TRANS>
__global__ void __launch_bounds__(FP32_THREADS, 2)
    gemm_fp32_simt_kernel(int64_t M, int64_t N, int64_t K, const float *__restrict__ a, int64_t lda,
                          const float *__restrict__ b, int64_t ldb, const float *__restrict__ c,
                          int64_t ldc, float *__restrict__ out, int64_t ldo, float alpha, float beta) {
    constexpr int TM = BM / 16, TN = BN / 16; /* outputs per thread */
    static_assert(TM % 4 == 0 && TN % 4 == 0 && TM <= 8 && TN <= 8, "strips of 4, at most two");
    extern __shared__ __align__(16) uint4 fp32_smem[];
    Fp32Stage<BM, BN> *ring = (Fp32Stage<BM, BN> *)fp32_smem;

    const int64_t num_m_tiles = (M + BM - 1) / BM, num_n_tiles = (N + BN - 1) / BN;
    const int64_t pid = blockIdx.x;
    const int64_t tiles_per_group = (int64_t)FP32_GROUP_M * num_n_tiles;
    const int64_t first_m = (pid / tiles_per_group) * FP32_GROUP_M;
    const int64_t group_rows = min((int64_t)FP32_GROUP_M, num_m_tiles - first_m);
    const int64_t m0 = (first_m + (pid % tiles_per_group) % group_rows) * BM;
    const int64_t n0 = ((pid % tiles_per_group) / group_rows) * BN;

    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int m_in = (int)min((int64_t)BM, M - m0), n_in = (int)min((int64_t)BN, N - n0);
    const float *a_tile = a + (A_TRANS ? m0 : m0 * lda); /* tile origins at k = 0 */
    const float *b_tile = b + (B_TRANS ? n0 * ldb : n0);
    const int k_tiles = (int)((K + FP32_BK - 1) / FP32_BK); /* the launcher checks that K fits */
    /* full tiles take the copies without bounds up to the last whole k-tile */
    const int full_k_tiles = m_in == BM && n_in == BN ? (int)(K / FP32_BK) : 0;
    Fp32TileLoader<BM, !A_TRANS> a_loader(a_tile, lda, tid);
    Fp32TileLoader<BN, (bool)B_TRANS> b_loader(b_tile, ldb, tid);
    int load_kt = 0, load_stage = 0;
    auto load_k_tile = [&]() { /* the next k-tile; one commit group per call, empty past the last */
        if (load_kt < k_tiles) {
            Fp32Stage<BM, BN> &st = ring[load_stage];
            if (load_kt < full_k_tiles) {
                a_loader.template load<true>(st.a, m_in, FP32_BK);
                b_loader.template load<true>(st.b, n_in, FP32_BK);
            } else {
                const int k_in = (int)min((int64_t)FP32_BK, K - (int64_t)load_kt * FP32_BK);
                a_loader.template load<false>(st.a, m_in, k_in);
                b_loader.template load<false>(st.b, n_in, k_in);
            }
        }
        cp_async_commit();
        ++load_kt;
        load_stage = load_stage == FP32_STAGES - 1 ? 0 : load_stage + 1;
    };

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = 0.0f;

#pragma unroll
    for (int s = 0; s < FP32_STAGES - 1; s++) load_k_tile();
    int stage = 0;
    for (int kt = 0; kt < k_tiles; kt++) {
        cp_async_wait<FP32_STAGES - 2>();
        /* k-tile kt has landed for every thread, and every thread is done reading kt - 1's slot,
         * which the next load refills */
        __syncthreads();
        load_k_tile();
        const Fp32Stage<BM, BN> &st = ring[stage];
        stage = stage == FP32_STAGES - 1 ? 0 : stage + 1;
#pragma unroll
        for (int k = 0; k < FP32_BK; k++) {
            float av[TM], bw[TN];
#pragma unroll
            for (int s = 0; s < TM / 4; s++) {
                const float4 x = *(const float4 *)&st.a[k][s * 64 + ty * 4];
                av[4 * s] = x.x, av[4 * s + 1] = x.y, av[4 * s + 2] = x.z, av[4 * s + 3] = x.w;
            }
#pragma unroll
            for (int t = 0; t < TN / 4; t++) {
                const float4 y = *(const float4 *)&st.b[k][t * 64 + tx * 4];
                bw[4 * t] = y.x, bw[4 * t + 1] = y.y, bw[4 * t + 2] = y.z, bw[4 * t + 3] = y.w;
            }
#pragma unroll
            for (int i = 0; i < TM; i++)
#pragma unroll
                for (int j = 0; j < TN; j++) acc[i][j] = fmaf(av[i], bw[j], acc[i][j]);
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < TM; i++) {
        const int64_t gi = m0 + (i / 4) * 64 + ty * 4 + i % 4;
        if (gi >= M) continue;
#pragma unroll
        for (int j = 0; j < TN; j++) {
            const int64_t gj = n0 + (j / 4) * 64 + tx * 4 + j % 4;
            if (gj >= N) continue;
            float v = alpha * acc[i][j];
            if (c) v = fmaf(beta, c[gi * ldc + gj], v); /* ldc == 0: bias row broadcast */
            out[gi * ldo + gj] = v;
        }
    }
}

/* ----------------------------------------------------------------------------------------------
 * Host side: dispatch on dtypes, layouts and load path (pointer/stride alignment: the results are
 * identical on both paths, so this choice cannot break invariance).
 * -------------------------------------------------------------------------------------------- */
template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, typename T, typename OutT,
          int A_TRANS, int B_TRANS, int VEC_LOADS>
static int launch_gemm_sm80_kernel(const rlk_gemm_args *p, cudaStream_t stream) {
    constexpr int pipe_bytes =
        STAGES * 2 * (a_stage_elems<BM, BK, A_TRANS>() + b_stage_elems<BN, BK, B_TRANS>());
    constexpr int epi_bytes = BM * (BN + 4) * 4;
    constexpr int smem_bytes = pipe_bytes > epi_bytes ? pipe_bytes : epi_bytes;
    auto kernel = gemm_sm80_kernel<T, OutT, A_TRANS, B_TRANS, VEC_LOADS, BM, BN, BK, WARPS_M, WARPS_N,
                                   STAGES>;
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return (int)err;
    const int64_t tiles = ((p->M + BM - 1) / BM) * ((p->N + BN - 1) / BN);
    if (tiles > 0x7fffffff) return (int)cudaErrorInvalidConfiguration;
    kernel<<<(unsigned)tiles, WARPS_M * WARPS_N * 32, smem_bytes, stream>>>(
        p->M, p->N, p->K, (const T *)p->a, p->lda, (const T *)p->b, p->ldb, (const OutT *)p->c,
        p->ldc, (OutT *)p->out, p->ldo, (float)p->alpha, (float)p->beta);
    return (int)cudaGetLastError();
}

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, typename T, typename OutT>
static int launch_gemm_sm80_layout(const rlk_gemm_args *p, cudaStream_t stream) {
    const int vec = ((uintptr_t)p->a % 16 == 0) && (p->lda % 8 == 0) &&
                    ((uintptr_t)p->b % 16 == 0) && (p->ldb % 8 == 0);
    const int sel = (p->a_trans ? 4 : 0) + (p->b_trans ? 2 : 0) + vec;
#define GEMM_SM80_CASE(AT, BT, V) \
    case AT * 4 + BT * 2 + V:     \
        return launch_gemm_sm80_kernel<BM, BN, BK, WARPS_M, WARPS_N, STAGES, T, OutT, AT, BT, V>(p, stream);
    switch (sel) {
        GEMM_SM80_CASE(0, 0, 0) GEMM_SM80_CASE(0, 0, 1) GEMM_SM80_CASE(0, 1, 0) GEMM_SM80_CASE(0, 1, 1)
        GEMM_SM80_CASE(1, 0, 0) GEMM_SM80_CASE(1, 0, 1) GEMM_SM80_CASE(1, 1, 0) GEMM_SM80_CASE(1, 1, 1)
    }
#undef GEMM_SM80_CASE
    return RLK_UNSUPPORTED;
}

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES>
static int launch_gemm_sm80(const rlk_gemm_args *p, cudaStream_t stream) {
    if (p->in_dtype == RLK_BF16) {
        if (p->out_dtype == RLK_BF16)
            return launch_gemm_sm80_layout<BM, BN, BK, WARPS_M, WARPS_N, STAGES, __nv_bfloat16, __nv_bfloat16>(p, stream);
        if (p->out_dtype == RLK_F32)
            return launch_gemm_sm80_layout<BM, BN, BK, WARPS_M, WARPS_N, STAGES, __nv_bfloat16, float>(p, stream);
    } else if (p->in_dtype == RLK_F16) {
        if (p->out_dtype == RLK_F16)
            return launch_gemm_sm80_layout<BM, BN, BK, WARPS_M, WARPS_N, STAGES, __half, __half>(p, stream);
        if (p->out_dtype == RLK_F32)
            return launch_gemm_sm80_layout<BM, BN, BK, WARPS_M, WARPS_N, STAGES, __half, float>(p, stream);
    }
    return RLK_UNSUPPORTED;
}

template <int BM, int BN>
static int launch_gemm_fp32(const rlk_gemm_args *p, cudaStream_t stream) {
    const int64_t tiles = ((p->M + BM - 1) / BM) * ((p->N + BN - 1) / BN);
    if (tiles > 0x7fffffff || p->K >= (int64_t)INT32_MAX * FP32_BK) return (int)cudaErrorInvalidConfiguration;
    void (*kernel)(int64_t, int64_t, int64_t, const float *, int64_t, const float *, int64_t,
                   const float *, int64_t, float *, int64_t, float, float);
    if (p->a_trans)
        kernel = p->b_trans ? gemm_fp32_simt_kernel<BM, BN, 1, 1> : gemm_fp32_simt_kernel<BM, BN, 1, 0>;
    else
        kernel = p->b_trans ? gemm_fp32_simt_kernel<BM, BN, 0, 1> : gemm_fp32_simt_kernel<BM, BN, 0, 0>;
    constexpr int smem_bytes = FP32_STAGES * sizeof(Fp32Stage<BM, BN>);
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return (int)err;
    kernel<<<(unsigned)tiles, FP32_THREADS, smem_bytes, stream>>>(
        p->M, p->N, p->K, (const float *)p->a, p->lda, (const float *)p->b, p->ldb,
        (const float *)p->c, p->ldc, (float *)p->out, p->ldo, (float)p->alpha, (float)p->beta);
    return (int)cudaGetLastError();
}

/* bf16/fp16: 128 x 256 tiles; 128 x 128 (8 warps of 32 x 64) when even twice as many tiles fit in one
 * wave, so twice as many SMs work (a full wave of large tiles beats two of small ones). Both run the
 * same mma sequence for every output element, so the choice (by M and N) cannot change a row's bits;
 * the GPU tests compare every M of the sweep bitwise. fp32: the FFMA kernel on 128 x 128 tiles when
 * there are at least as many as SMs, else 64 x 64; both run one fma per k in order for every element
 * (tested bitwise against the CPU reference). */
extern "C" int rlk_gemm_sm80(const rlk_gemm_args *args, rlk_context *ctx) {
    const bool fp32 = args->in_dtype == RLK_F32 && args->out_dtype == RLK_F32;
    const bool half = (args->in_dtype == RLK_BF16 || args->in_dtype == RLK_F16) &&
                      (args->out_dtype == args->in_dtype || args->out_dtype == RLK_F32);
    if (!fp32 && !half) return RLK_UNSUPPORTED;
    ctx->kernel = fp32 ? "gemm_fp32_sm80" : "gemm_sm80";
    if (ctx->plan_only) return RLK_OK;
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    int device, num_sms;
    const cudaError_t err = current_device(&device, &num_sms);
    if (err != cudaSuccess) return (int)err;
    if (fp32) {
        const int64_t large_fp32_tiles = ((args->M + 127) / 128) * ((args->N + 127) / 128);
        return large_fp32_tiles >= num_sms ? launch_gemm_fp32<128, 128>(args, stream)
                                           : launch_gemm_fp32<64, 64>(args, stream);
    }
    const int64_t large_tiles = ((args->M + 127) / 128) * ((args->N + 255) / 256);
    if (2 * large_tiles <= num_sms) return launch_gemm_sm80<128, 128, 64, 4, 2, 3>(args, stream);
    return launch_gemm_sm80<128, 256, 64, 2, 4, 3>(args, stream);
}
