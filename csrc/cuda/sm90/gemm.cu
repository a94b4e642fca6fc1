/* gemm_sm90.cu: Hopper (sm_90a) batch-invariant GEMM, out = alpha * A @ B + beta * C, and on the same main
 * loop the fused linear_logp forward and the backward's fused dlogits (see rl_kernels.h for the contracts).
 *
 * Tile plan. A persistent grid (one CTA per SM) walks output tiles of BM x BN in a grouped order that
 * keeps a band of A rows and B columns hot in L2. Inside a CTA, warpgroup 0 is the producer: one thread
 * issues TMA loads (cp.async.bulk.tensor, 128-byte swizzle, zero fill out of bounds) of BK = 64 wide
 * k-slices of A and B into a ring of STAGES shared-memory buffers that complete on mbarriers. Each
 * consumer warpgroup owns 64 rows of the tile and multiplies them with wgmma.m64nBNk16 (fp32
 * accumulators in registers, both operands read from shared memory through descriptors; the
 * descriptors' transpose bits cover K-major and MN-major A and B), then applies alpha * acc + beta * C
 * in fp32 from registers and stores with row/column predicates, or, in the 2-consumer configs when out
 * is 16-byte aligned with a 16-byte multiple row stride, writes the tile into two small shared-memory
 * buffers per consumer that one thread hands to TMA stores (store_tile_tma), so the consumers return to
 * the next tile's wgmmas without waiting on global stores (+6% on the 4096^3 GEMM).
 *   large config: BM = 128 (2 consumer warpgroups, setmaxnreg 232/40), BN = 256, 4 stages + 32 KB of
 *     epilogue buffers, clusters of 2 CTAs on vertically adjacent tiles, each CTA loading half of the
 *     shared B tile multicast to both.
 *   medium config: the same with BN = 128, 6 stages.
 *   tall config: BM = 128 (2 consumers), BN = 64, 8 stages, clusters of 2 with K-major B (else none):
 *     twice the tiles of the medium config for shapes whose medium tiles leave SMs idle (M = N = 1024).
 *   small config: BM = 64 (1 consumer warpgroup), BN = 64, 12 stages, no cluster.
 *   narrow configs: BM = 64, BN = 96 / 48 / 32 / 16 (10 / 14 / 16 / 20 stages), K-major B only.
 *   M <= 64 (decode) takes the narrowest 64-row config whose tiles still fit in one wave (the one whose
 *   tiles come closest to filling it); larger M whichever of the first four a waves x cycles-per-tile
 *   estimate finds fastest.
 *
 * linear_logp (LOGP kernels): the product hidden [N, D] @ weight[V, D]^T on 128 x 192 tiles (2 consumers,
 * 5 stages, 2-CTA clusters with B multicast), each k-slice group of LOGP_CHAIN = 4 (256 of D) a fresh
 * wgmma chain added into the logits with an fp32 FADD (mma_tile: the tensor cores' accumulator adds
 * truncate, 3.2e-4 logp error over D = 4096 with one long chain, 2e-5 with these). A work item is
 * (128-row tile, vocabulary split of LOGP_SPLIT_COLS = 768 columns = 4 tiles walked in increasing order);
 * instead of storing a tile, each consumer folds it into per-row online-softmax states (max,
 * sum 2^(x - max), sum 2^(x - max) (x - max), target logit, log2 units) held in registers, written as one
 * float4 per (split, row) to the workspace at the end of the split. linear_logp_merge_kernel
 * (linear_logp_common.cuh) folds a row's splits in increasing order.
 *
 * linear_logp backward (MODE_DLOGITS): the GEMM z = hidden @ weight_chunk^T + bias on the large config
 * whose epilogue turns each z into d loss / d z (dlogit_value, per-row lse / entropy / gradients loaded
 * before the tile's k loop) and stores that in the input dtype instead of z: the fp32 logits of the chunk
 * are never written (198 vs 229 us per 4096 x 4096 x 4096 chunk for GEMM + elementwise kernel).
 *
 * Batch invariance. Every output element is produced by the same instruction sequence whatever the
 * config, M or the tile it lands in: its accumulator starts at 0 and receives the k16 steps
 * 0, 1, ..., ceil(K/64)*4 - 1 in order, one wgmma m64 x k16 step each (the k-slices past K are zero
 * filled by TMA, adding exact zeros), then one fused alpha/beta epilogue with explicit __fmaf_rn /
 * __fmul_rn. The wgmma N width (256 to 16) and the row offset inside the tile do not change an
 * element's arithmetic, nor does the epilogue path (register or shared memory + TMA store: same fp32
 * values, same rounding); tests/test_gpu_gemm.py checks this bitwise on the GPU (every M of the sweep
 * 1..4096 against M = 4096 on the Qwen3-8B shapes, which exercises all six configs; rows shifted
 * across tiles; outputs at aligned and unaligned addresses compared with torch.equal). linear_logp:
 * the chain boundaries depend on D, the tiles and splits on V, every fold and merge runs in a fixed
 * order, so a row's results do not depend on N or its position (tests/test_gpu_linear_logp.py:
 * torch.equal for rows of N = 1, 3, 17, 129, 1000 and shifted rows vs N = 4096). No split-K, no
 * atomics.
 *
 * Limits (-> RLK_UNSUPPORTED, the caller falls back to sm80): in/out dtypes other than bf16/fp16 in
 * and in-dtype/fp32 out; A or B base address not 16-byte aligned or row stride not a multiple of 16
 * bytes (TMA descriptor rules); N or K >= 2^31. C and out may have any alignment and stride.
 * linear_logp additionally needs D a multiple of 8.
 *
 * Build: nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo -Xptxas -v
 *        -shared -Xcompiler -fPIC gemm_sm90.cu -o libgemm_sm90.so
 * Test (GPU): python3 setup.py build_ext --inplace && pytest tests/test_gpu_gemm.py tests/test_gpu_linear_logp.py
 *   -m gpu (or scripts/gpu_check.sh, which also runs compute-sanitizer and the benchmarks; the
 *   version history and numbers are in docs/perf-notes.md).
 */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include "../rl_kernels.h"
#include "linear_logp_common.cuh"

#define BK 64                 /* k-slice per stage: 64 16-bit elements = one 128-byte swizzle row */
#define GROUP_M 16            /* tile order: bands of GROUP_M row tiles sweep all column tiles in turn */
#define SMEM_ALIGN 1024       /* 128-byte swizzle atoms repeat every 8 rows x 128 bytes */
#define LOGP_CHAIN 4            /* linear_logp: k-slices per fresh wgmma chain (see mma_tile) */

typedef struct gemm_sm90_params {
    int M, N, k_tiles;
    int m_tiles;
    int n_units;                              /* column work units: a column tile, or a LOGP split */
    int col_tiles;                            /* column tiles in all */
    uint32_t a_box_bytes;                     /* bytes one stage's A loads bring (box rows may be < BM) */
    const void *c;
    int64_t ldc;
    void *out;
    int64_t ldo;
    float alpha, beta;
    int c_pairs_aligned, out_pairs_aligned;  /* 2-element vector access allowed for C / out */
    int tma_store;                            /* store through shared memory + TMA (map_out is valid) */
} gemm_sm90_params;

/* What the kernel computes from the product (template parameter MODE). */
enum {
    MODE_GEMM,     /* out = alpha * A @ B + beta * C */
    MODE_LOGP,     /* linear_logp forward: hidden [N, D] @ weight[V, D]^T folded into softmax partials */
    MODE_DLOGITS,  /* linear_logp backward: out = d loss / d z of z = hidden @ weight_chunk^T + C (bias) */
};

/* The linear_logp modes' row data: the product is hidden [N, D] @ weight[V, D]^T (M = N rows, N = V
 * columns, K = D), or a vocabulary chunk of it starting at column v0 (MODE_DLOGITS). */
typedef struct logp_sm90_params {
    const void *bias;       /* MODE_LOGP: [V] in the input dtype, or NULL (MODE_DLOGITS: C) */
    const int64_t *target;  /* [N] */
    float4 *partials;       /* MODE_LOGP: [split][row] {m, l, S, x_target}, see fold_logits_tile */
    float scale_log2;       /* MODE_LOGP: inv_temperature * log2(e) */
    const float *lse, *entropy, *grad_logp, *grad_entropy;  /* MODE_DLOGITS: [N] each; the last 3 may be NULL */
    int64_t ignore_index, v0;
    float inv_temperature;
} logp_sm90_params;

/* ------------------------------------ PTX wrappers ------------------------------------------ */

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

/* Spin until the phase with the given parity has completed. */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

/* Same box, written at the same shared-memory offset of every CTA in cta_mask (and counted on each CTA's
 * mbarrier at the same offset). */
__device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap *map, int inner, int outer,
                                                      uint32_t bar, uint16_t cta_mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;"
                 ::"r"(dst), "l"((uint64_t)map), "r"(inner), "r"(outer), "r"(bar), "h"(cta_mask) : "memory");
}

/* Arrive on the mbarrier at the same shared-memory offset in CTA cta_rank of this cluster. Default
 * (CTA-scope) semantics: the reads being released were wgmma's, already complete at wgmma.wait_group;
 * a .release.cluster arrive compiles to MEMBAR.ALL.GPU and halved the throughput (perf-notes v2). */
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta_rank) {
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n"
                 ::"r"(bar), "r"(cta_rank) : "memory");
}

__device__ __forceinline__ uint32_t cluster_ctarank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

/* 2-D TMA load of one box into shared memory; completion is counted on the mbarrier in bytes. */
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int inner, int outer,
                                            uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"((uint64_t)map), "r"(inner), "r"(outer), "r"(bar) : "memory");
}

/* 2-D TMA store of one shared-memory box to global memory (out-of-bounds parts are skipped), tracked
 * in this thread's bulk async-group. */
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, uint32_t src, int inner, int outer) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"((uint64_t)map), "r"(inner), "r"(outer), "r"(src) : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

/* Wait until at most N of this thread's bulk groups still read their shared-memory source. */
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

/* Makes this thread's ordinary shared-memory writes visible to the TMA unit (async proxy). */
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* Barrier among the 128 threads of one warpgroup (ids 1, 2: one per consumer; 0 is __syncthreads). */
__device__ __forceinline__ void warpgroup_sync(uint32_t id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

__device__ __forceinline__ void st_shared_pair(uint32_t addr, float2 v, float *) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}
__device__ __forceinline__ void st_shared_pair(uint32_t addr, float2 v, __nv_bfloat16 *) {
    const __nv_bfloat162 h = __float22bfloat162_rn(v);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(*(const uint32_t *)&h) : "memory");
}
__device__ __forceinline__ void st_shared_pair(uint32_t addr, float2 v, __half *) {
    const __half2 h = __float22half2_rn(v);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(*(const uint32_t *)&h) : "memory");
}

/* wgmma shared-memory matrix descriptor for a 128-byte swizzled tile (start address 1024-aligned up to
 * the k16 offset). lbo/sbo in bytes: K-major tiles use sbo = 1024 (next 8 rows), lbo unused;
 * MN-major tiles use lbo = distance between 64-element MN blocks, sbo = 1024 (next 8 k rows). */
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving accumulator reads/writes across wgmma fences and waits. */
template <int R>
__device__ __forceinline__ void fence_accumulators(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/* One wrapper per wgmma N width: inline PTX needs every accumulator register spelled out. Inside
 * each, WGMMA_ASM is the one asm statement, instantiated for bf16 and fp16 operands. */
// d[64 x 256] (+)= A[64 x 16] * B[16 x 256], both operands from shared memory (descriptors);
// accumulate = 0 overwrites d (wgmma scale-d).
template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#define WGMMA_ASM(TYPE) asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {" \
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
                     "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
                     "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
                     "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
                     "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127" \
                     "}, %128, %129, p, 1, 1, %131, %132;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                       "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                       "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                       "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                       "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                       "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
                       "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
                       "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
                       "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
                       "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
                       "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
                       "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
                       "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
                       "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B))
    if constexpr (BF16) WGMMA_ASM("bf16");
    else WGMMA_ASM("f16");
#undef WGMMA_ASM
}

// d[64 x 192] (+)= A[64 x 16] * B[16 x 192], both operands from shared memory (descriptors);
// accumulate = 0 overwrites d (wgmma scale-d).
template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n192k16(float (&d)[96], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#define WGMMA_ASM(TYPE) asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n192k16.f32." TYPE "." TYPE " {" \
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
                     "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
                     "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95" \
                     "}, %96, %97, p, 1, 1, %99, %100;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                       "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                       "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                       "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                       "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                       "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
                       "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
                       "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
                       "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
                       "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]) \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B))
    if constexpr (BF16) WGMMA_ASM("bf16");
    else WGMMA_ASM("f16");
#undef WGMMA_ASM
}

// d[64 x 128] (+)= A[64 x 16] * B[16 x 128], both operands from shared memory (descriptors);
// accumulate = 0 overwrites d (wgmma scale-d).
template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#define WGMMA_ASM(TYPE) asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {" \
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
                     "}, %64, %65, p, 1, 1, %67, %68;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                       "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                       "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                       "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
                       "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
                       "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B))
    if constexpr (BF16) WGMMA_ASM("bf16");
    else WGMMA_ASM("f16");
#undef WGMMA_ASM
}

// d[64 x 96] (+)= A[64 x 16] * B[16 x 96], both operands from shared memory (descriptors);
// accumulate = 0 overwrites d (wgmma scale-d).
template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n96k16(float (&d)[48], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#define WGMMA_ASM(TYPE) asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n96k16.f32." TYPE "." TYPE " {" \
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
                     "}, %48, %49, p, 1, 1, %51, %52;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                       "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
                       "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
                       "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]) \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B))
    if constexpr (BF16) WGMMA_ASM("bf16");
    else WGMMA_ASM("f16");
#undef WGMMA_ASM
}

// d[64 x 64] (+)= A[64 x 16] * B[16 x 64], both operands from shared memory (descriptors);
// accumulate = 0 overwrites d (wgmma scale-d).
template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#define WGMMA_ASM(TYPE) asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {" \
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
                     "}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                       "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B))
    if constexpr (BF16) WGMMA_ASM("bf16");
    else WGMMA_ASM("f16");
#undef WGMMA_ASM
}


// d[64 x 48] (+)= A[64 x 16] * B[16 x 48], both operands from shared memory (descriptors);
// accumulate = 0 overwrites d (wgmma scale-d).
template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n48k16(float (&d)[24], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#define WGMMA_ASM(TYPE) asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n48k16.f32." TYPE "." TYPE " {" \
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                     "%16, %17, %18, %19, %20, %21, %22, %23" \
                     "}, %24, %25, p, 1, 1, %27, %28;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
                       "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]) \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B))
    if constexpr (BF16) WGMMA_ASM("bf16");
    else WGMMA_ASM("f16");
#undef WGMMA_ASM
}

// d[64 x 32] (+)= A[64 x 16] * B[16 x 32], both operands from shared memory (descriptors);
// accumulate = 0 overwrites d (wgmma scale-d).
template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#define WGMMA_ASM(TYPE) asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " {" \
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
                     "}, %16, %17, p, 1, 1, %19, %20;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
                       "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B))
    if constexpr (BF16) WGMMA_ASM("bf16");
    else WGMMA_ASM("f16");
#undef WGMMA_ASM
}

// d[64 x 16] (+)= A[64 x 16] * B[16 x 16], both operands from shared memory (descriptors);
// accumulate = 0 overwrites d (wgmma scale-d).
template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n16k16(float (&d)[8], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#define WGMMA_ASM(TYPE) asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n" \
                     "wgmma.mma_async.sync.aligned.m64n16k16.f32." TYPE "." TYPE " {" \
                     "%0, %1, %2, %3, %4, %5, %6, %7" \
                     "}, %8, %9, p, 1, 1, %11, %12;\n}\n" \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B))
    if constexpr (BF16) WGMMA_ASM("bf16");
    else WGMMA_ASM("f16");
#undef WGMMA_ASM
}


template <int BN, bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_k16(float (&d)[BN / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    if constexpr (BN == 256) wgmma_m64n256k16<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
    else if constexpr (BN == 192) wgmma_m64n192k16<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
    else if constexpr (BN == 128) wgmma_m64n128k16<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
    else if constexpr (BN == 96) wgmma_m64n96k16<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
    else if constexpr (BN == 64) wgmma_m64n64k16<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
    else if constexpr (BN == 48) wgmma_m64n48k16<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
    else if constexpr (BN == 32) wgmma_m64n32k16<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
    else wgmma_m64n16k16<BF16, TRANS_A, TRANS_B>(d, desc_a, desc_b, accumulate);
}

/* ------------------------------------ epilogue ---------------------------------------------- */

__device__ __forceinline__ float load_c(const float *c) { return *c; }
__device__ __forceinline__ float load_c(const __nv_bfloat16 *c) { return __bfloat162float(*c); }
__device__ __forceinline__ float load_c(const __half *c) { return __half2float(*c); }
__device__ __forceinline__ float2 load_c2(const float *c) { return *(const float2 *)c; }
__device__ __forceinline__ float2 load_c2(const __nv_bfloat16 *c) { return __bfloat1622float2(*(const __nv_bfloat162 *)c); }
__device__ __forceinline__ float2 load_c2(const __half *c) { return __half22float2(*(const __half2 *)c); }
__device__ __forceinline__ void store_out(float *o, float v) { *o = v; }
__device__ __forceinline__ void store_out(__nv_bfloat16 *o, float v) { *o = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_out(__half *o, float v) { *o = __float2half_rn(v); }
__device__ __forceinline__ void store_out2(float *o, float2 v) { *(float2 *)o = v; }
__device__ __forceinline__ void store_out2(__nv_bfloat16 *o, float2 v) { *(__nv_bfloat162 *)o = __float22bfloat162_rn(v); }
__device__ __forceinline__ void store_out2(__half *o, float2 v) { *(__half2 *)o = __float22half2_rn(v); }

/* The value stored for an accumulator element, as a function object called with (acc, c, has_c, h, col):
 * h picks the thread's row (0: 16w + l/4, 1: + 8), col is the output column. */

/* MODE_GEMM: alpha * acc + beta * c, formed the same way (explicit rounding ops, no contraction choices)
 * for every element and config. */
struct gemm_epilogue {
    float alpha, beta;
    __device__ __forceinline__ float operator()(float acc, float c, bool has_c, int, int) const {
        return has_c ? __fmaf_rn(alpha, acc, __fmul_rn(beta, c)) : __fmul_rn(alpha, acc);
    }
};

/* MODE_DLOGITS: d loss / d z (dlogit_value) of z = acc + bias (C is the bias row, ldc = 0) for the
 * thread's two rows; ignored rows (and rows past N) get 0. */
struct dlogits_epilogue {
    float inv_temperature;
    float lse[2], entropy[2], grad_logp[2], grad_entropy[2];
    int target_col[2];  /* the target's column in this chunk, or -1 */
    bool active[2];
    __device__ __forceinline__ float operator()(float acc, float c, bool has_c, int h, int col) const {
        const float z = has_c ? __fadd_rn(acc, c) : acc;
        /* computed for every row and then selected: a branch per element kept the exps from overlapping */
        const float dz =
            dlogit_value(z, inv_temperature, lse[h], entropy[h], grad_logp[h], grad_entropy[h], col == target_col[h]);
        return active[h] ? dz : 0.f;
    }
};

template <int MODE>
__device__ __forceinline__ auto tile_epilogue(int row0, const gemm_sm90_params &p, const logp_sm90_params &lp) {
    if constexpr (MODE == MODE_DLOGITS) {
        dlogits_epilogue e;
        e.inv_temperature = lp.inv_temperature;
        const int t = threadIdx.x % 128;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 16 * (t / 32) + (t % 32) / 4 + 8 * h;
            const int64_t target = row < p.M ? lp.target[row] : lp.ignore_index;
            e.active[h] = target != lp.ignore_index;
            e.target_col[h] = (target >= lp.v0 && target < lp.v0 + p.N) ? (int)(target - lp.v0) : -1;
            e.lse[h] = e.active[h] ? lp.lse[row] : 0.f;
            e.entropy[h] = e.active[h] && lp.entropy ? lp.entropy[row] : 0.f;
            e.grad_logp[h] = e.active[h] && lp.grad_logp ? lp.grad_logp[row] : 0.f;
            e.grad_entropy[h] = e.active[h] && lp.grad_entropy ? lp.grad_entropy[row] : 0.f;
        }
        return e;
    } else {
        return gemm_epilogue{p.alpha, p.beta};
    }
}

/* Forms the values to store, in place: d = epi(acc, C) over the consumer warpgroup's 64 x BN block.
 * wgmma's fp32 accumulator layout: thread t (warp w = t / 32, lane l) holds, for j < BN/8, rows
 * 16w + l/4 (+8) and columns 8j + 2(l%4) (+1) in d[4j .. 4j+3].
 * C loads: a block inside M x N with pair-aligned C takes a branch-free path that issues them in batches
 * of 2 x C_BATCH pairs before using any; per-element predicates put each load in its own branch, and the
 * one L2 round trip per load that this cost made an fp32 beta = 1 GEMM take 1.5x the time of beta = 0. */
#define C_BATCH 16
template <int BN, typename OutT, typename Epilogue>
__device__ __forceinline__ void apply_epilogue(float (&d)[BN / 2], int row0, int col0, const gemm_sm90_params &p,
                                               const Epilogue &epi) {
    const int t = threadIdx.x % 128;
    const int row_base = row0 + 16 * (t / 32) + (t % 32) / 4;
    const int col_base = col0 + 2 * (t % 4);
    const OutT *c = (const OutT *)p.c;
    const bool has_c = c != nullptr;
    if (has_c && p.c_pairs_aligned && row0 + 64 <= p.M && col0 + BN <= p.N) {
        constexpr int BATCH = BN / 8 < C_BATCH ? BN / 8 : C_BATCH;
        const OutT *c_rows[2] = {c + (int64_t)row_base * p.ldc + col_base, c + (int64_t)(row_base + 8) * p.ldc + col_base};
#pragma unroll
        for (int j0 = 0; j0 < BN / 8; j0 += BATCH) {
            float2 cv[2][BATCH];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int jj = 0; jj < BATCH; ++jj) cv[h][jj] = load_c2(c_rows[h] + 8 * (j0 + jj));
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int jj = 0; jj < BATCH; ++jj) {
                    const int j = j0 + jj, col = col_base + 8 * j;
                    d[4 * j + 2 * h] = epi(d[4 * j + 2 * h], cv[h][jj].x, true, h, col);
                    d[4 * j + 2 * h + 1] = epi(d[4 * j + 2 * h + 1], cv[h][jj].y, true, h, col + 1);
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
                    cv = load_c2(c_row + col);
                } else {
                    if (col < p.N) cv.x = load_c(c_row + col);
                    if (col + 1 < p.N) cv.y = load_c(c_row + col + 1);
                }
            }
            d[4 * j + 2 * h] = epi(d[4 * j + 2 * h], cv.x, has_c, h, col);
            d[4 * j + 2 * h + 1] = epi(d[4 * j + 2 * h + 1], cv.y, has_c, h, col + 1);
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
                store_out2(out_row + col, make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
            } else {
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (col + e < p.N) store_out(out_row + col + e, d[4 * j + 2 * h + e]);
            }
        }
    }
}

/* Epilogue through shared memory (2-consumer GEMM configs, out 16-byte aligned with a 16-byte multiple
 * row stride): the block formed by apply_epilogue goes out in rounds of 64 rows x 128 bytes. Each round the
 * threads write their values into one of two 8 KB buffers in the TMA's 128-byte swizzle (16-byte chunk q
 * of row r at chunk q ^ (r % 8): a warp's 8 rows x 16 bytes hit all 32 banks once), and one thread issues
 * a TMA store of the box, which clips the M/N tails. The consumers then return to the next tile's wgmmas
 * while the copy engine writes global memory; a buffer is rewritten only after the store issued two rounds
 * earlier has finished reading it (tiles with an even number of rounds start at buffer 0; with one round,
 * every tile uses buffer 0 after the previous tile's store). Same rounding as store_tile. */
#define EPI_BOX_BYTES (64 * 128)
template <int BN, typename OutT>
__device__ __forceinline__ void store_tile_tma(const float (&d)[BN / 2], int row0, int col0,
                                               const CUtensorMap *map_out, uint32_t epi_smem, uint32_t barrier_id) {
    constexpr int ROUND_COLS = 128 / (int)sizeof(OutT);
    constexpr int ROUNDS = BN / ROUND_COLS;
    constexpr int PENDING = ROUNDS % 2 == 0 ? 1 : 0;  /* stores that may still read the other buffer */
    static_assert(ROUNDS % 2 == 0 || ROUNDS == 1, "buffer parity must restart with each tile");
    const int t = threadIdx.x % 128, lane = t % 32;
    const int tile_row = 16 * (t / 32) + lane / 4;  /* + 8h; tile_row % 8 == lane / 4 */
#pragma unroll
    for (int r = 0; r < ROUNDS; ++r) {
        const uint32_t buf = epi_smem + (r % 2) * EPI_BOX_BYTES;
        if (t == 0) bulk_wait_read<PENDING>();
        warpgroup_sync(barrier_id);
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
        fence_proxy_async_smem();
        warpgroup_sync(barrier_id);
        if (t == 0) {
            tma_store_2d(map_out, buf, col0 + r * ROUND_COLS, row0);
            bulk_commit();
        }
    }
}

/* ------------------------------------ linear_logp epilogue ---------------------------------- */

template <bool BF16>
__device__ __forceinline__ float half_bits_to_float(uint16_t bits) {
    if constexpr (BF16) return __uint_as_float((uint32_t)bits << 16);
    else return __half2float(__ushort_as_half(bits));
}

/* Per-thread softmax states of the two rows a consumer thread holds in the wgmma accumulator layout
 * (rows 16w + l/4 and + 8 of its warpgroup's 64; the quad of lanes sharing a row keeps identical copies). */
typedef struct logp_row_states {
    float m[2], l[2], S[2];
    float x_target[2];  /* target logit in log2 units (0 in the lanes and splits that do not hold it) */
    int target_col[2];  /* -1: ignored, out of range or a row past N */
} logp_row_states;

__device__ __forceinline__ void logp_states_init(logp_row_states &st, int row0, const gemm_sm90_params &p,
                                                 const logp_sm90_params &lp) {
    const int t = threadIdx.x % 128;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + 16 * (t / 32) + (t % 32) / 4 + 8 * h;
        const int64_t target = row < p.M ? lp.target[row] : -1;
        st.target_col[h] = (target >= 0 && target < p.N) ? (int)target : -1;
        st.m[h] = LOGP_EMPTY_MAX;
        st.l[h] = st.S[h] = st.x_target[h] = 0.f;
    }
}

/* bias * scale_log2 for the thread's columns of the tile at col0 (-inf past V). Loaded after the tile's k
 * loop: during it the 192-wide tile's two accumulator sets take the registers. */
template <int BN, bool BF16>
__device__ __forceinline__ void load_bias_log2(float (&bias_log2)[BN / 8][2], int col0, const gemm_sm90_params &p,
                                               const logp_sm90_params &lp) {
    const int col_lane = col0 + 2 * (threadIdx.x % 4);  /* column of d[0] */
    const uint16_t *bias = (const uint16_t *)lp.bias;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = col_lane + 8 * j + e;
            const float b = (bias != nullptr && col < p.N) ? half_bits_to_float<BF16>(__ldg(bias + col)) : 0.f;
            bias_log2[j][e] = col < p.N ? b * lp.scale_log2 : -INFINITY;
        }
}

/* Folds one consumer warpgroup's 64 x BN logits tile d (columns col0 ..) into the row states: each
 * thread scales its BN/4 values of a row (x = acc * scale_log2 + bias * scale_log2, -inf past V), the
 * quad forms the tile's state (quad_tile_state), and it is merged into the running one. */
template <int BN>
__device__ __forceinline__ void fold_logits_tile(const float (&d)[BN / 2], const float (&bias_log2)[BN / 8][2],
                                                 int col0, logp_row_states &st, const logp_sm90_params &lp) {
    const int col_lane = col0 + 2 * (threadIdx.x % 4);  /* column of d[0] */
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float x[BN / 8][2];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) x[j][e] = fmaf(d[4 * j + 2 * h + e], lp.scale_log2, bias_log2[j][e]);
        float tile_max, l, S;
        quad_tile_state(x, tile_max, l, S);
        softmax_state_merge(st.m[h], st.l[h], st.S[h], tile_max, l, S);
        const int target_offset = st.target_col[h] - col_lane;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (target_offset == 8 * j + e) st.x_target[h] = x[j][e];
    }
}

/* Lane 0 of each quad writes the split's {m, l, S, x_target} of its two rows (x_target: the one lane
 * holding it plus exact zeros). */
__device__ __forceinline__ void store_partials(logp_row_states &st, int row0, int split, const gemm_sm90_params &p,
                                               const logp_sm90_params &lp) {
    const int t = threadIdx.x % 128;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float x = st.x_target[h];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        const int row = row0 + 16 * (t / 32) + (t % 32) / 4 + 8 * h;
        if (t % 4 == 0 && row < p.M)
            lp.partials[(int64_t)split * p.M + row] = make_float4(st.m[h], st.l[h], st.S[h], x);
    }
}

/* ------------------------------------ kernel ------------------------------------------------ */

/* Work index -> (row tile, column work unit). A work item is CLUSTER vertically adjacent row tiles (one
 * per CTA of the cluster, sharing the B tiles); bands of GROUP_M row tiles sweep all column units in turn. */
template <int CLUSTER>
__device__ __forceinline__ void work_coords(int work, int m_groups, int n_units, int cta_rank, int *m_blk,
                                            int *n_unit) {
    constexpr int band = GROUP_M / CLUSTER;
    const int band_size = band * n_units;
    const int first = (work / band_size) * band;
    const int rows = min(m_groups - first, band);
    const int local = work % band_size;
    *m_blk = (first + local % rows) * CLUSTER + cta_rank;
    *n_unit = local / rows;
}

/* two epilogue buffers per consumer for the 2-consumer GEMM kernels (store_tile_tma) */
template <int CONSUMERS, int MODE>
__host__ __device__ constexpr int epi_buffers() {
    return CONSUMERS == 2 && MODE != MODE_LOGP ? 2 * CONSUMERS : 0;
}

template <int BN, int CONSUMERS, int STAGES, int MODE>
constexpr int gemm_sm90_smem_bytes() {
    return STAGES * (64 * CONSUMERS + BN) * BK * 2 + epi_buffers<CONSUMERS, MODE>() * EPI_BOX_BYTES + SMEM_ALIGN +
           2 * STAGES * 8;
}

/* Frees a stage for the producers of this CTA and, with clusters, of the peer CTA (whose producer wrote
 * half of this stage's B tile). */
template <int CLUSTER>
__device__ __forceinline__ void release_stage(uint32_t bar, int cta_rank) {
    mbar_arrive(bar);
    if constexpr (CLUSTER == 2) mbar_arrive_cluster(bar, cta_rank ^ 1);
}

/* Issues the four k16 wgmmas of the k-slice in stage s into d (accumulate = 0: the first one starts d
 * from zero) as one commit group. */
template <int BN, int CONSUMERS, bool A_MN, bool B_MN, bool BF16>
__device__ __forceinline__ void issue_k_slice(float (&d)[BN / 2], int s, uint32_t a_rows, uint32_t b_smem,
                                              int accumulate) {
    constexpr uint32_t A_STAGE = 64 * CONSUMERS * BK * 2, B_STAGE = BN * BK * 2;
    constexpr uint32_t MN_BOX = 64 * BK * 2;  /* one 64 (MN) x 64 (K) box of an MN-major operand */
    constexpr uint32_t A_K16 = A_MN ? 16 * 128 : 32;  /* byte step per k16 inside a stage */
    constexpr uint32_t B_K16 = B_MN ? 16 * 128 : 32;
    constexpr uint32_t A_LBO = A_MN ? MN_BOX : 16, B_LBO = B_MN ? MN_BOX : 16;
    wgmma_fence();
    fence_accumulators(d);
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        const uint64_t da = smem_desc(a_rows + s * A_STAGE + kk * A_K16, A_LBO, 1024);
        const uint64_t db = smem_desc(b_smem + s * B_STAGE + kk * B_K16, B_LBO, 1024);
        wgmma_k16<BN, BF16, A_MN, B_MN>(d, da, db, kk > 0 || accumulate);
    }
    wgmma_commit();
    fence_accumulators(d);
}

/* One consumer warpgroup's k loop over one tile: d = its 64 rows (A at a_rows) times the BN columns.
 * it counts k-slices through the stage ring across tiles; each stage is freed once the wgmmas reading it
 * are done, keeping one k-slice of wgmmas in flight while waiting for the previous one.
 * CHAIN = 0 (GEMM): every k16 step accumulates into d.
 * CHAIN = c > 0 (linear_logp): every c consecutive 64-wide k-slices form a fresh wgmma chain from zero,
 * added into d with a round-to-nearest fp32 FADD. The tensor cores' accumulator adds truncate, which over
 * one 4096-long chain gave 3.2e-4 logp error at logits up to ~50 (docs/perf-notes.md); chains
 * of 1, 2 or 4 slices gave ~2e-5, and 4 hides the FADDs (a chain per slice cost 25% of the time).
 * Every order here depends on K alone. */
template <int BN, int CONSUMERS, int STAGES, int CLUSTER, bool A_MN, bool B_MN, bool BF16, int CHAIN>
__device__ __forceinline__ void mma_tile(float (&d)[BN / 2], int k_tiles, int &it, uint32_t a_rows, uint32_t b_smem,
                                         uint32_t full_bar, uint32_t empty_bar, int cta_rank) {
    const bool warp_leader = threadIdx.x % 32 == 0;
    float chain[CHAIN > 0 ? BN / 2 : 1];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    bool prev_busy = false;  /* the previous k-slice's stage still awaits release */
    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % STAGES;
        mbar_wait(full_bar + 8 * s, (it / STAGES) & 1);
        if constexpr (CHAIN > 0) issue_k_slice<BN, CONSUMERS, A_MN, B_MN, BF16>(chain, s, a_rows, b_smem, kt % CHAIN != 0);
        else issue_k_slice<BN, CONSUMERS, A_MN, B_MN, BF16>(d, s, a_rows, b_smem, 1);
        /* keep this k-slice's wgmmas in flight; the previous one's are done -> free its stage */
        wgmma_wait<1>();
        if (prev_busy && warp_leader) release_stage<CLUSTER>(empty_bar + 8 * ((it - 1) % STAGES), cta_rank);
        prev_busy = true;
        if constexpr (CHAIN > 0) {
            if (kt % CHAIN == CHAIN - 1 || kt == k_tiles - 1) {
                wgmma_wait<0>();
                fence_accumulators(chain);
                if (warp_leader) release_stage<CLUSTER>(empty_bar + 8 * s, cta_rank);
                prev_busy = false;
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) d[i] = __fadd_rn(d[i], chain[i]);
            }
        }
    }
    /* unconditional: a wgmma wait inside a branch made ptxas serialize every wgmma (C7518) */
    wgmma_wait<0>();
    fence_accumulators(d);
    if (prev_busy && warp_leader) release_stage<CLUSTER>(empty_bar + 8 * ((it - 1) % STAGES), cta_rank);
}

/* A_MN: A is MN-major in memory (a_trans = 1); B_MN: B is MN-major (b_trans = 0). CLUSTER = 2: the two
 * CTAs of a cluster compute vertically adjacent tiles and each loads half of the shared B tile,
 * multicast into both, which halves B's L2 -> SM traffic. LOGP: the linear_logp forward; a column work
 * unit is a vocabulary split of LOGP_SPLIT_COLS / BN tiles walked in increasing order, each tile folded
 * into per-row softmax states instead of being stored (OutT unused). */
template <int BN, int CONSUMERS, int STAGES, int CLUSTER, bool A_MN, bool B_MN, bool BF16, typename OutT, int MODE>
__global__ void __launch_bounds__((CONSUMERS + 1) * 128, 1)
gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 const __grid_constant__ CUtensorMap map_out, const gemm_sm90_params p, const logp_sm90_params lp) {
    constexpr int BM = 64 * CONSUMERS;
    constexpr bool LOGP = MODE == MODE_LOGP;
    constexpr int TILES_PER_UNIT = LOGP ? LOGP_SPLIT_COLS / BN : 1;
    constexpr bool TMA_EPILOGUE = epi_buffers<CONSUMERS, MODE>() > 0;
    constexpr uint32_t A_STAGE = BM * BK * 2, B_STAGE = BN * BK * 2;
    constexpr uint32_t MN_BOX = 64 * BK * 2;  /* one 64 (MN) x 64 (K) box of an MN-major operand */
    static_assert(MODE == MODE_GEMM || (LOGP_SPLIT_COLS % BN == 0 && !A_MN && !B_MN), "linear_logp: K-major operands");
    extern __shared__ uint8_t smem_raw[];
    const uint32_t smem = (smem_u32(smem_raw) + SMEM_ALIGN - 1) & ~(uint32_t)(SMEM_ALIGN - 1);
    const uint32_t a_smem = smem, b_smem = smem + STAGES * A_STAGE;
    const uint32_t epi_smem = b_smem + STAGES * B_STAGE;  /* 1024-aligned: stage sizes are multiples of 1 KB */
    const uint32_t full_bar = epi_smem + epi_buffers<CONSUMERS, MODE>() * EPI_BOX_BYTES;
    const uint32_t empty_bar = full_bar + STAGES * 8;
    const int cta_rank = CLUSTER == 1 ? 0 : (int)cluster_ctarank();

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full_bar + 8 * s, 1);
            /* lane 0 of every consumer warp of every CTA reading the stage's B tile */
            mbar_init(empty_bar + 8 * s, 4 * CONSUMERS * CLUSTER);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if constexpr (CLUSTER == 1) __syncthreads();
    else cluster_sync();

    const int warpgroup = threadIdx.x / 128;
    const int m_groups = (p.m_tiles + CLUSTER - 1) / CLUSTER;
    const int num_work = m_groups * p.n_units;
    const int first_work = blockIdx.x / CLUSTER, work_stride = gridDim.x / CLUSTER;

    if (warpgroup == 0) {
        /* producer: one thread keeps the ring full across tiles */
        if constexpr (CONSUMERS == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            int it = 0;
            for (int work = first_work; work < num_work; work += work_stride) {
                int m_blk, n_unit;
                work_coords<CLUSTER>(work, m_groups, p.n_units, cta_rank, &m_blk, &n_unit);
                const int n_end = min((n_unit + 1) * TILES_PER_UNIT, p.col_tiles);
                for (int n_blk = n_unit * TILES_PER_UNIT; n_blk < n_end; ++n_blk) {
                    for (int kt = 0; kt < p.k_tiles; ++kt, ++it) {
                        const int s = it % STAGES;
                        mbar_wait(empty_bar + 8 * s, ((it / STAGES) & 1) ^ 1);
                        const uint32_t bar = full_bar + 8 * s;
                        mbar_arrive_expect_tx(bar, p.a_box_bytes + B_STAGE);
                        if constexpr (A_MN) {
                            for (int j = 0; j < BM / 64; ++j)
                                tma_load_2d(a_smem + s * A_STAGE + j * MN_BOX, &map_a, m_blk * BM + 64 * j, kt * BK,
                                            bar);
                        } else {
                            tma_load_2d(a_smem + s * A_STAGE, &map_a, kt * BK, m_blk * BM, bar);
                        }
                        const uint32_t b_dst = b_smem + s * B_STAGE;
                        if constexpr (CLUSTER == 1) {
                            if constexpr (B_MN) {
                                for (int j = 0; j < BN / 64; ++j)
                                    tma_load_2d(b_dst + j * MN_BOX, &map_b, n_blk * BN + 64 * j, kt * BK, bar);
                            } else {
                                tma_load_2d(b_dst, &map_b, kt * BK, n_blk * BN, bar);
                            }
                        } else {
                            /* this CTA's half of the B tile, into both CTAs */
                            constexpr int HALF = BN / 2;
                            if constexpr (B_MN) {
                                for (int j = cta_rank * HALF / 64; j < (cta_rank + 1) * HALF / 64; ++j)
                                    tma_load_2d_multicast(b_dst + j * MN_BOX, &map_b, n_blk * BN + 64 * j, kt * BK,
                                                          bar, 0x3);
                            } else {
                                tma_load_2d_multicast(b_dst + cta_rank * HALF * BK * 2, &map_b, kt * BK,
                                                      n_blk * BN + cta_rank * HALF, bar, 0x3);
                            }
                        }
                    }
                }
            }
        }
    } else {
        /* consumer warpgroup c: rows 64c .. 64c+63 of each tile */
        if constexpr (CONSUMERS == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int c = warpgroup - 1;
        /* K-major: 64 rows of 128 bytes; MN-major: one 64 x BK box. Both are 8 KB per 64 rows. */
        const uint32_t a_rows = a_smem + c * 64 * BK * 2;
        float d[BN / 2];
        int it = 0;
        for (int work = first_work; work < num_work; work += work_stride) {
            int m_blk, n_unit;
            work_coords<CLUSTER>(work, m_groups, p.n_units, cta_rank, &m_blk, &n_unit);
            const int row0 = m_blk * BM + 64 * c;
            if constexpr (LOGP) {
                logp_row_states st;
                logp_states_init(st, row0, p, lp);
                const int n_end = min((n_unit + 1) * TILES_PER_UNIT, p.col_tiles);
                for (int n_blk = n_unit * TILES_PER_UNIT; n_blk < n_end; ++n_blk) {
                    mma_tile<BN, CONSUMERS, STAGES, CLUSTER, A_MN, B_MN, BF16, LOGP_CHAIN>(d, p.k_tiles, it, a_rows, b_smem,
                                                                                            full_bar, empty_bar, cta_rank);
                    float bias_log2[BN / 8][2];
                    load_bias_log2<BN, BF16>(bias_log2, n_blk * BN, p, lp);
                    fold_logits_tile<BN>(d, bias_log2, n_blk * BN, st, lp);
                }
                store_partials(st, row0, n_unit, p, lp);
            } else {
                const int col0 = n_unit * BN;
                const auto epi = tile_epilogue<MODE>(row0, p, lp);
                mma_tile<BN, CONSUMERS, STAGES, CLUSTER, A_MN, B_MN, BF16, 0>(d, p.k_tiles, it, a_rows, b_smem,
                                                                              full_bar, empty_bar, cta_rank);
                apply_epilogue<BN, OutT>(d, row0, col0, p, epi);
                bool stored = false;
                if constexpr (TMA_EPILOGUE) {
                    if (p.tma_store) {
                        store_tile_tma<BN, OutT>(d, row0, col0, &map_out, epi_smem + c * 2 * EPI_BOX_BYTES, 1 + c);
                        stored = true;
                    }
                }
                if (!stored) store_tile<BN, OutT>(d, row0, col0, p);
            }
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

/* cuTensorMapEncodeTiled through the runtime's driver entry point, so nothing links libcuda. */
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
        void *fn = nullptr;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) ==
                cudaSuccess &&
            found == cudaDriverEntryPointSuccess)
            encode = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }
    return encode;
}

/* Map over a [outer, inner] matrix (inner contiguous, rows row_bytes apart), 128-byte swizzled boxes of
 * box_inner x box_outer elements; out-of-bounds elements read as zero (loads) or are skipped (stores). */
static bool make_tensor_map(CUtensorMap *map, CUtensorMapDataType dtype, const void *base, int64_t inner,
                            int64_t outer, int64_t row_bytes, int box_inner, int box_outer) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (!encode) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)inner, (cuuint64_t)outer};
    const cuuint64_t strides[1] = {(cuuint64_t)row_bytes};
    const cuuint32_t box[2] = {(cuuint32_t)box_inner, (cuuint32_t)box_outer};
    const cuuint32_t elem_strides[2] = {1, 1};
    return encode(map, dtype, 2, (void *)base, dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int BN, int CONSUMERS, int STAGES, int CLUSTER, bool A_MN, bool B_MN, bool BF16, typename OutT, int MODE>
static int launch_gemm_sm90(const rlk_gemm_args *args, gemm_sm90_params p, const logp_sm90_params &lp, int device,
                            int num_sms, cudaStream_t stream) {
    constexpr int BM = 64 * CONSUMERS;
    /* K-major A with a single 64-row tile: load only the rows that exist (rounded up to 8); the rows past
     * the box keep stale shared memory, which only reaches accumulator rows that are never stored. */
    const int a_rows = (!A_MN && BM == 64 && args->M < 64) ? (int)((args->M + 7) / 8 * 8) : BM;
    p.a_box_bytes = A_MN ? BM * BK * 2 : a_rows * BK * 2;
    const CUtensorMapDataType in_type = BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    CUtensorMap map_a, map_b, map_out;
    memset(&map_a, 0, sizeof(map_a));
    memset(&map_b, 0, sizeof(map_b));
    memset(&map_out, 0, sizeof(map_out));
    if (args->K > 0) {
        const bool ok_a = A_MN ? make_tensor_map(&map_a, in_type, args->a, args->M, args->K, args->lda * 2, 64, BK)
                               : make_tensor_map(&map_a, in_type, args->a, args->K, args->M, args->lda * 2, BK, a_rows);
        const bool ok_b = B_MN ? make_tensor_map(&map_b, in_type, args->b, args->N, args->K, args->ldb * 2, 64, BK)
                               : make_tensor_map(&map_b, in_type, args->b, args->K, args->N, args->ldb * 2, BK, BN / CLUSTER);
        if (!ok_a || !ok_b) return RLK_UNSUPPORTED;
    }
    /* out as [M rows, N columns] in boxes of 64 rows x 128 bytes (store_tile_tma); else the register path */
    p.tma_store = 0;
    if (epi_buffers<CONSUMERS, MODE>() > 0 && (uintptr_t)args->out % 16 == 0 &&
        (args->ldo * (int64_t)sizeof(OutT)) % 16 == 0 && args->ldo * (int64_t)sizeof(OutT) < (1ll << 40)) {
        const CUtensorMapDataType out_type = sizeof(OutT) == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : in_type;
        p.tma_store = make_tensor_map(&map_out, out_type, args->out, args->N, args->M, args->ldo * (int64_t)sizeof(OutT),
                                      128 / (int)sizeof(OutT), 64);
    }
    auto kernel = gemm_sm90_kernel<BN, CONSUMERS, STAGES, CLUSTER, A_MN, B_MN, BF16, OutT, MODE>;
    constexpr int smem_bytes = gemm_sm90_smem_bytes<BN, CONSUMERS, STAGES, MODE>();
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
    p.m_tiles = (int)((args->M + BM - 1) / BM);
    p.col_tiles = (int)((args->N + BN - 1) / BN);
    p.n_units = MODE == MODE_LOGP ? (int)((args->N + LOGP_SPLIT_COLS - 1) / LOGP_SPLIT_COLS) : p.col_tiles;
    const int work = (p.m_tiles + CLUSTER - 1) / CLUSTER * p.n_units;
    config.gridDim = dim3((work < max_clusters[device] ? work : max_clusters[device]) * CLUSTER);
    const cudaError_t err = cudaLaunchKernelEx(&config, kernel, map_a, map_b, map_out, p, lp);
    return err == cudaSuccess ? RLK_OK : (int)err;
}

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
        return launch_gemm_sm90<256, 2, 4, 2, A_MN, B_MN, BF16, OutT, MODE_GEMM>(args, p, {}, device, num_sms, stream);
    if (config == CONFIG_MEDIUM)
        return launch_gemm_sm90<128, 2, 6, 2, A_MN, B_MN, BF16, OutT, MODE_GEMM>(args, p, {}, device, num_sms, stream);
    if (config == CONFIG_TALL)  /* B multicast needs K-major B: half of a 64-wide MN-major box is no box */
        return launch_gemm_sm90<64, 2, 8, B_MN ? 1 : 2, A_MN, B_MN, BF16, OutT, MODE_GEMM>(args, p, {}, device, num_sms,
                                                                                        stream);
    if constexpr (!B_MN) {
        if (config == CONFIG_NARROW96)
            return launch_gemm_sm90<96, 1, 10, 1, A_MN, B_MN, BF16, OutT, MODE_GEMM>(args, p, {}, device, num_sms, stream);
        if (config == CONFIG_NARROW48)
            return launch_gemm_sm90<48, 1, 14, 1, A_MN, B_MN, BF16, OutT, MODE_GEMM>(args, p, {}, device, num_sms, stream);
        if (config == CONFIG_NARROW32)
            return launch_gemm_sm90<32, 1, 16, 1, A_MN, B_MN, BF16, OutT, MODE_GEMM>(args, p, {}, device, num_sms, stream);
        if (config == CONFIG_NARROW16)
            return launch_gemm_sm90<16, 1, 20, 1, A_MN, B_MN, BF16, OutT, MODE_GEMM>(args, p, {}, device, num_sms, stream);
    }
    return launch_gemm_sm90<64, 1, 12, 1, A_MN, B_MN, BF16, OutT, MODE_GEMM>(args, p, {}, device, num_sms, stream);
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

static bool tma_operand_ok(const void *base, int64_t ld) {
    return ((uintptr_t)base % 16 == 0) && ((ld * 2) % 16 == 0) && ld > 0 && ld * 2 < (1ll << 40);
}

static bool pairs_aligned(const void *ptr, int64_t ld, int elem_bytes) {
    return ((uintptr_t)ptr % (2 * elem_bytes) == 0) && (ld % 2 == 0);
}

/* The current device and its SM count (the persistent grids are sized by it). */
static cudaError_t current_device(int *device, int *num_sms) {
    cudaError_t err = cudaGetDevice(device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, *device);
    return err;
}

extern "C" int rlk_gemm_sm90(const rlk_gemm_args *args, void *stream) {
    const bool in_ok = args->in_dtype == RLK_BF16 || args->in_dtype == RLK_F16;
    const bool out_ok = args->out_dtype == args->in_dtype || args->out_dtype == RLK_F32;
    if (!in_ok || !out_ok) return RLK_UNSUPPORTED;
    if (args->N >= INT32_MAX || args->K >= INT32_MAX) return RLK_UNSUPPORTED;
    if (args->K > 0 && (!tma_operand_ok(args->a, args->lda) || !tma_operand_ok(args->b, args->ldb)))
        return RLK_UNSUPPORTED;

    int device, num_sms;
    const cudaError_t err = current_device(&device, &num_sms);
    if (err != cudaSuccess) return (int)err;

    const int out_bytes = args->out_dtype == RLK_F32 ? 4 : 2;
    gemm_sm90_params p;
    p.M = (int)args->M;
    p.N = (int)args->N;
    p.k_tiles = (int)((args->K + BK - 1) / BK);
    p.c = args->c;
    p.ldc = args->ldc;
    p.out = args->out;
    p.ldo = args->ldo;
    p.alpha = args->alpha;
    p.beta = args->beta;
    p.c_pairs_aligned = args->c != nullptr && pairs_aligned(args->c, args->ldc, out_bytes);
    p.out_pairs_aligned = pairs_aligned(args->out, args->ldo, out_bytes);

    const int config = choose_config(args->M, args->N, !args->b_trans, num_sms);

    cudaStream_t s = (cudaStream_t)stream;
    if (args->in_dtype == RLK_BF16)
        return args->out_dtype == RLK_F32 ? launch_layout<true, float>(config, args, p, device, num_sms, s)
                                          : launch_layout<true, __nv_bfloat16>(config, args, p, device, num_sms, s);
    return args->out_dtype == RLK_F32 ? launch_layout<false, float>(config, args, p, device, num_sms, s)
                                      : launch_layout<false, __half>(config, args, p, device, num_sms, s);
}


/* ------------------------------------ linear_logp ------------------------------------------- */

/* The product hidden [rows, D] @ weight[cols, D]^T as GEMM arguments (A = hidden, K-major; B = weight^T,
 * b_trans = 1) and kernel parameters; the caller adds what its mode needs. */
static void product_args(const void *hidden, int64_t ldh, const void *weight, int64_t ldw, int64_t rows,
                         int64_t cols, int64_t D, rlk_dtype in_dtype, rlk_dtype out_dtype, rlk_gemm_args *g,
                         gemm_sm90_params *p) {
    memset(g, 0, sizeof(*g));
    g->M = rows;
    g->N = cols;
    g->K = D;
    g->in_dtype = in_dtype;
    g->out_dtype = out_dtype;
    g->a = hidden;
    g->lda = ldh;
    g->b = weight;
    g->ldb = ldw;
    g->b_trans = 1;
    memset(p, 0, sizeof(*p));
    p->M = (int)rows;
    p->N = (int)cols;
    p->k_tiles = (int)((D + BK - 1) / BK);
}

/* forward */


/* 128 x 192 tiles, 2-CTA clusters, 5 stages: the fresh k-slice chains need a second set of accumulator
 * registers, which the 128 x 256 config cannot afford; at 192 both sets (2 x 96) fit under the consumers'
 * setmaxnreg 232, and a wider tile needs less shared-memory bandwidth per FLOP than 128 x 128
 * (docs/perf-notes.md, "linear_logp forward on SM90"). ptxas spills ~45 values around the fold, after the k loop.
 * 4 tiles per vocabulary split. */
extern "C" int rlk_linear_logp_fwd_sm90(const rlk_linear_logp_args *args, void *workspace, void *stream) {
    const bool bf16 = args->dtype == RLK_BF16;
    if (!bf16 && args->dtype != RLK_F16) return RLK_UNSUPPORTED;
    if (args->D <= 0 || args->D % 8 != 0 || args->D >= INT32_MAX || args->N >= INT32_MAX ||
        args->V >= INT32_MAX - LOGP_SPLIT_COLS)
        return RLK_UNSUPPORTED;
    if (!tma_operand_ok(args->hidden, args->ldh) || !tma_operand_ok(args->weight, args->ldw)) return RLK_UNSUPPORTED;

    int device, num_sms;
    const cudaError_t err = current_device(&device, &num_sms);
    if (err != cudaSuccess) return (int)err;

    rlk_gemm_args g;
    gemm_sm90_params p;
    product_args(args->hidden, args->ldh, args->weight, args->ldw, args->N, args->V, args->D, args->dtype, RLK_F32,
                 &g, &p);
    logp_sm90_params lp;
    memset(&lp, 0, sizeof(lp));
    lp.bias = args->bias;
    lp.target = args->target;
    lp.partials = (float4 *)workspace;
    lp.scale_log2 = args->inv_temperature * LOG2E;

    cudaStream_t s = (cudaStream_t)stream;
    const int rc = bf16 ? launch_gemm_sm90<192, 2, 5, 2, false, false, true, float, MODE_LOGP>(&g, p, lp, device, num_sms, s)
                        : launch_gemm_sm90<192, 2, 5, 2, false, false, false, float, MODE_LOGP>(&g, p, lp, device, num_sms, s);
    if (rc != RLK_OK) return rc;
    return launch_linear_logp_merge(args, lp.partials, s);
}

/* backward */

/* The large tile config's main loop (the GEMM's z, bitwise) with the dlogits epilogue: z of the chunk never
 * leaves registers; dz goes out through the same store paths as a GEMM tile. */
extern "C" int rlk_linear_logp_dlogits_sm90(const rlk_linear_logp_dlogits_args *args, void *stream) {
    const bool bf16 = args->out_dtype == RLK_BF16;
    if ((!bf16 && args->out_dtype != RLK_F16) || args->logits != nullptr || args->hidden == nullptr ||
        args->weight == nullptr)
        return RLK_UNSUPPORTED;
    if (args->D <= 0 || args->D >= INT32_MAX || args->rows >= INT32_MAX || args->cols >= INT32_MAX)
        return RLK_UNSUPPORTED;
    if (!tma_operand_ok(args->hidden, args->ldh) || !tma_operand_ok(args->weight, args->ldw)) return RLK_UNSUPPORTED;

    int device, num_sms;
    const cudaError_t err = current_device(&device, &num_sms);
    if (err != cudaSuccess) return (int)err;

    /* z = hidden @ weight_chunk^T + 1 * bias, C = the bias row broadcast over the rows (ldc = 0) */
    rlk_gemm_args g;
    gemm_sm90_params p;
    product_args(args->hidden, args->ldh, args->weight, args->ldw, args->rows, args->cols, args->D, args->out_dtype,
                 args->out_dtype, &g, &p);
    g.out = args->dlogits;
    g.ldo = args->ld_dlogits;
    p.c = args->bias;
    p.ldc = 0;
    p.out = args->dlogits;
    p.ldo = args->ld_dlogits;
    p.c_pairs_aligned = args->bias != nullptr && pairs_aligned(args->bias, 0, 2);
    p.out_pairs_aligned = pairs_aligned(args->dlogits, args->ld_dlogits, 2);
    logp_sm90_params lp;
    memset(&lp, 0, sizeof(lp));
    lp.target = args->target;
    lp.lse = args->lse;
    lp.entropy = args->entropy;
    lp.grad_logp = args->grad_logp;
    lp.grad_entropy = args->grad_entropy;
    lp.ignore_index = args->ignore_index;
    lp.v0 = args->v0;
    lp.inv_temperature = args->inv_temperature;

    cudaStream_t s = (cudaStream_t)stream;
    return bf16 ? launch_gemm_sm90<256, 2, 4, 2, false, false, true, __nv_bfloat16, MODE_DLOGITS>(&g, p, lp, device,
                                                                                                   num_sms, s)
                : launch_gemm_sm90<256, 2, 4, 2, false, false, false, __half, MODE_DLOGITS>(&g, p, lp, device, num_sms,
                                                                                           s);
}
