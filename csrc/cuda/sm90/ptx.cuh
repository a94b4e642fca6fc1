/* cuda/sm90/ptx.cuh: the Hopper (sm_90a) primitives the wgmma kernels use: mbarriers, TMA loads and
 * stores (cp.async.bulk.tensor), clusters, proxy fences, wgmma descriptors and synchronization.
 * One thin inline wrapper per PTX instruction; the wgmma instructions themselves are in wgmma.cuh.
 * Host side: the driver's tensor-map encoder, which the TMA loads' maps are built with.
 */
#ifndef RLK_CUDA_SM90_PTX_CUH_
#define RLK_CUDA_SM90_PTX_CUH_

#include <cuda.h>
#include <cudaTypedefs.h>

#include "../common.cuh"

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

/* raises the current phase's expected transaction bytes without arriving (a TMA's bytes on a barrier that
 * other threads arrive on) */
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

/* Spin until the phase with the given parity has completed; ACQUIRE_CLUSTER: acquiring at cluster
 * scope what the arrivals released (mbar_arrive_release_cluster), not only at the CTA's. */
template <bool ACQUIRE_CLUSTER = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        if constexpr (ACQUIRE_CLUSTER)
            asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                         "selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        else
            asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                         "selp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

/* Whether the phase of the given parity has completed, without waiting. */
__device__ __forceinline__ bool mbar_ready(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile("{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
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

/* The cluster's barrier in two halves: arrive (relaxed: orders nothing but fence_mbarrier_init's
 * inits) and wait (acquire). */
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }

/* This thread's mbarrier inits visible to the cluster (before a cluster barrier). */
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/* Arrive on the mbarrier at the same offset in CTA cta_rank of this cluster, releasing this thread's
 * earlier global and shared stores to the cluster (mbar_wait<true> on the other side). */
__device__ __forceinline__ void mbar_arrive_release_cluster(uint32_t bar, uint32_t cta_rank) {
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n"
                 ::"r"(bar), "r"(cta_rank) : "memory");
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

/* 3-D TMA load of one box (coordinates innermost first: the planes of gemm_kernel.cuh's PARTS operands
 * are the third); completion is counted on the mbarrier in bytes. */
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                            uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

/* tma_load_3d written into every CTA in cta_mask, as tma_load_2d_multicast. */
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                                      uint32_t bar, uint16_t cta_mask) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3, %4}], [%5], %6;"
                 ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(cta_mask) : "memory");
}

/* 4-D TMA load of one box into shared memory (coordinates innermost first); completion is counted on the
 * mbarrier in bytes. */
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 ::"r"(dst), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}

/* fetches a TMA map into the descriptor cache ahead of its first load */
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap *map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)map) : "memory");
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

/* Barrier among the 128 threads of one warpgroup that also returns whether any of them passed true. */
__device__ __forceinline__ bool warpgroup_any(uint32_t id, bool value) {
    uint32_t any;
    asm volatile(
        "{\n\t.reg .pred p, q;\n\tsetp.ne.u32 p, %1, 0;\n\tbar.red.or.pred q, %2, 128, p;\n\tselp.u32 %0, 1, 0, q;\n\t}"
        : "=r"(any)
        : "r"((uint32_t)value), "r"(id)
        : "memory");
    return any != 0;
}

/* A flag in global memory handing data from one CTA to another: the writer's threads store the data,
 * meet at a barrier, and one of them publishes with flag_release (the fence orders the whole group's
 * stores, seen through the barrier, before the flag); the reader's one thread spins in flag_acquire,
 * then its group meets at a barrier before loading. */
__device__ __forceinline__ void flag_release(int *flag) {
    asm volatile("fence.acq_rel.gpu;\n\tst.relaxed.gpu.global.b32 [%0], 1;" ::"l"(flag) : "memory");
}
__device__ __forceinline__ void flag_acquire(const int *flag) {
    int ready;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(ready) : "l"(flag) : "memory");
    } while (ready == 0);
}

/* A counter of arrivals, as flag_release / flag_acquire in one: the group's stores, seen through a
 * barrier, are ordered before the count by the first fence, and the second orders the counting thread's
 * later loads (and its group's, after a barrier) after every earlier arrival. Returns the count before. */
__device__ __forceinline__ int count_arrival(int *counter) {
    int before;
    asm volatile("fence.acq_rel.gpu;\n\tatom.relaxed.gpu.global.add.s32 %0, [%1], 1;\n\tfence.acq_rel.gpu;"
                 : "=r"(before)
                 : "l"(counter)
                 : "memory");
    return before;
}

__device__ __forceinline__ void st_shared_pair(uint32_t addr, float2 v, float *) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}
/* one value rounded to nearest 16-bit T (as pack_half2 rounds each of a pair) */
template <typename T>
__device__ __forceinline__ void st_shared_16(uint32_t addr, float v, T *) {
    const uint16_t bits = std::is_same<T, __nv_bfloat16>::value ? __bfloat16_as_ushort(__float2bfloat16_rn(v))
                                                                 : __half_as_ushort(__float2half_rn(v));
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(bits) : "memory");
}
template <typename T>
__device__ __forceinline__ void st_shared_pair(uint32_t addr, float2 v, T *) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(pack_half2<std::is_same<T, __nv_bfloat16>::value>(v.x, v.y))
                 : "memory");
}

/* wgmma shared-memory matrix descriptor for a 128-byte swizzled tile (start address 1024-aligned up to
 * the k16 offset). lbo/sbo in bytes: K-major tiles use sbo = 1024 (next 8 rows), lbo unused;
 * MN-major tiles use lbo = distance between 64-element MN blocks, sbo = 1024 (next 8 k rows). */
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62);
}

/* A descriptor kept as its two 32-bit halves, advanced by byte offsets: the start address is bits
 * 0-13 (address / 16) and shared addresses stay below 256 KB, so adding offset / 16 to the low half
 * never carries into the next field; a wgmma then costs one add, not a rebuilt descriptor. */
struct SmemDesc {
    uint32_t lo, hi;
    __device__ __forceinline__ SmemDesc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
        const uint64_t d = smem_desc(addr, lbo, sbo);
        lo = (uint32_t)d;
        hi = (uint32_t)(d >> 32);
    }
    __device__ __forceinline__ uint64_t at(uint32_t offset) const {
        return ((uint64_t)hi << 32) | (uint32_t)(lo + (offset >> 4));
    }
    /* the descriptor offset bytes further: a loop's per-stage base, so that each wgmma of the stage
     * adds only its constant step to it */
    __device__ __forceinline__ SmemDesc plus(uint32_t offset) const {
        SmemDesc d = *this;
        d.lo += offset >> 4;
        return d;
    }
};

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

/* The same for 32-bit operand registers (wgmma A fragments held in registers). */
template <int R>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

/* ------------------------------------ host side --------------------------------------------- */

/* cuTensorMapEncodeTiled through the runtime's driver entry point, so nothing links libcuda (null when
 * the driver has none: the callers then take their non-TMA path or answer RLK_UNSUPPORTED). */
static inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(void) {
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

#endif /* RLK_CUDA_SM90_PTX_CUH_ */
