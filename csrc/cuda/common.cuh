/* cuda/common.cuh: the device primitives every CUDA kernel file shares (sm_80 and later): cp.async,
 * ldmatrix, the m16n8k16 tensor-core step, and element conversions between the storage dtypes
 * (fp32, bf16, fp16) and fp32, the wait of a programmatic dependent launch; on the host, rounding up,
 * the current device and its SM count and the launch config of such a launch.
 *
 * Everything here is inline with internal linkage; a .cu file includes what it uses. Architecture-
 * specific primitives live beside their kernels (cuda/sm90/ptx.cuh for TMA, mbarriers, wgmma).
 */
#ifndef RLK_CUDA_COMMON_CUH_
#define RLK_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

/* ------------------------------------ cp.async ---------------------------------------------- */

/* Copies src_bytes (0..16) from global to shared memory and zero-fills the rest of the 16 bytes. */
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void *gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}

/* Copies one 4-byte element (src_bytes 4) or writes a zero (src_bytes 0), through L1. */
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void *gmem, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

/* Waits until at most N of this thread's committed cp.async groups are still in flight. */
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Asks the L1 for the 32-byte sector at p (no register, no wait); a later load of it hits. */
__device__ __forceinline__ void prefetch_l1(const void *p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d));
}

/* ------------------------------------ tensor cores ------------------------------------------ */

/* Four 8 x 8 16-bit matrices from shared memory; lane l supplies the address of row l % 8 of
 * matrix l / 8. TRANS: each matrix transposed on the way (for operands stored MN-contiguous). */
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(smem_addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(smem_addr));
}

/* c[16 x 8] += a[16 x 16] * b[16 x 8] on the tensor cores, bf16 (BF16) or fp16 operands, fp32
 * accumulators in the mma.sync fragment layouts. */
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#define RLK_MMA_16816(TYPE)                                                                      \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "                  \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"             \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
    if constexpr (BF16) RLK_MMA_16816("bf16");
    else RLK_MMA_16816("f16");
#undef RLK_MMA_16816
}

/* d = a * b from zero accumulators (the same bits as mma_16816 into zeros, without the zeroing). */
template <bool BF16>
__device__ __forceinline__ void mma_16816_zero_acc(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    const float zero = 0.0f;
#define RLK_MMA_16816_ZERO(TYPE)                                                                 \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "                  \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};\n"         \
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(zero))
    if constexpr (BF16) RLK_MMA_16816_ZERO("bf16");
    else RLK_MMA_16816_ZERO("f16");
#undef RLK_MMA_16816_ZERO
}

/* ------------------------------------ conversions ------------------------------------------- */

/* The 16-bit storage type of a kernel's bf16 (BF16) or fp16 operands. */
template <bool BF16>
using half_type = typename std::conditional<BF16, __nv_bfloat16, __half>::type;

template <bool BF16>
__device__ __forceinline__ float half_bits_to_float(uint16_t bits) {
    if constexpr (BF16) return __uint_as_float((uint32_t)bits << 16);
    else return __half2float(__ushort_as_half(bits));
}

/* Two fp32 values rounded to nearest even into one packed pair of 16-bit values (low = x). */
template <bool BF16>
__device__ __forceinline__ uint32_t pack_half2(float x, float y) {
    if constexpr (BF16) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
        return *(const uint32_t *)&h;
    } else {
        const __half2 h = __floats2half2_rn(x, y);
        return *(const uint32_t *)&h;
    }
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

/* *p = v rounded to nearest even in p's type. */
__device__ __forceinline__ void from_f32(float *p, float v) { *p = v; }
__device__ __forceinline__ void from_f32(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void from_f32(__half *p, float v) { *p = __float2half_rn(v); }

/* Two consecutive elements <-> float2 (p 2-element aligned). */
__device__ __forceinline__ float2 load2_f32(const float *p) { return *(const float2 *)p; }
__device__ __forceinline__ float2 load2_f32(const __nv_bfloat16 *p) { return __bfloat1622float2(*(const __nv_bfloat162 *)p); }
__device__ __forceinline__ float2 load2_f32(const __half *p) { return __half22float2(*(const __half2 *)p); }
__device__ __forceinline__ void store2_f32(float *p, float2 v) { *(float2 *)p = v; }
__device__ __forceinline__ void store2_f32(__nv_bfloat16 *p, float2 v) { *(__nv_bfloat162 *)p = __float22bfloat162_rn(v); }
__device__ __forceinline__ void store2_f32(__half *p, float2 v) { *(__half2 *)p = __float22half2_rn(v); }

/* ------------------------------------ math -------------------------------------------------- */

/* 2^x on the special-function unit (ex2.approx.ftz: 2 ulp, 2^0 = 1 exactly, 2^-inf = 0). */
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* x rounded up to a multiple of m (x >= 0, m > 0): sizes of tiles, boxes and scratch memory on the host. */
static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* The current device and its SM count (grids sized to the machine are sized by it). */
static inline cudaError_t current_device(int *device, int *num_sms) {
    cudaError_t err = cudaGetDevice(device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, *device);
    return err;
}

/* A launch of grid x block threads on stream; with dependent, as a programmatic dependent of the kernel
 * before it on the stream (sm90): its launch and start-up overlap that kernel's end, and it must
 * griddepcontrol.wait before it reads what that kernel writes. *programmatic holds the attribute, so it
 * must live until cudaLaunchKernelEx(&config, ...) is called. */
static inline cudaLaunchConfig_t launch_config_dependent(dim3 grid, dim3 block, cudaStream_t stream, bool dependent,
                                                         cudaLaunchAttribute *programmatic) {
    programmatic->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    programmatic->val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.stream = stream;
    config.attrs = programmatic;
    config.numAttrs = dependent ? 1 : 0;
    return config;
}

/* In a kernel launched by launch_config_dependent with dependent: waits until the kernel before it on the
 * stream has ended and its writes are visible (sm90; before sm90 the launch was an ordinary one and this
 * is nothing). What that kernel does not write, the call's inputs, may be read before. */
__device__ __forceinline__ void wait_for_dependency() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#endif /* RLK_CUDA_COMMON_CUH_ */
