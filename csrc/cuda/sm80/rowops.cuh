/* cuda/sm80/rowops.cuh: what the sm80 row-op kernels (rms_norm.cu, softmax.cu, row_sum.cu) share:
 * the row plan, chunked row loads / stores, and the fixed-order reductions.
 *
 * Chunks. A row of `cols` elements of the input dtype is cut into chunks of V consecutive elements,
 * V = 8 for 16-bit inputs and 4 for fp32 (one 16-byte load of the input); chunk c holds elements
 * [c V, c V + V). Other arrays of the op (an fp32 output of a 16-bit input, the weight, dy, ...)
 * use the same V, so a thread owns the same columns in every array. A chunk is kept raw in
 * registers (Chunk: 4 or 8 32-bit words) and unpacked to fp32 where it is used; positions past
 * cols unpack to a fill value (0 for sums, -inf for maxima), which leaves every sum and maximum
 * exactly as if they were skipped (sums start from +0, and x + (+0) == x for every x != -0, which a
 * sum started from +0 never is).
 *
 * Row plan (a function of cols and the dtype only, never of rows): nch = ceil(cols / V) chunks;
 *   register plan (nch <= 512 * 4): tpr = the smallest power of two >= max(32, nch / 4) threads per
 *     row, thread t of the row owning chunks t + k tpr, k = 0..3 (at most 4 chunks, held in
 *     registers between the passes); tpr == 32: a warp per row, 4 rows per 128-thread CTA;
 *     otherwise one row per CTA of tpr threads;
 *   loop plan (longer rows): 1024 threads per row, thread t owning chunks t, t + 1024, t + 2048, ...
 *     walked in increasing order (4 loads in flight), the row read twice (the second read from a
 *     shared-memory cache of the row's first chunks, the rest from L2/HBM).
 * Load path: 16-byte vector loads / stores when every array's base and row stride are 16-byte
 * aligned (Chunk loads of a full chunk), element loads otherwise (and for the last, partial chunk).
 * Both paths fill the same registers with the same bits, so the choice (by pointers and strides)
 * never changes a result.
 *
 * Reductions, fixed: each thread accumulates its chunks in increasing k (chunk index), each chunk's
 * elements in increasing j, from +0; a warp combines its lanes with a shuffle-xor butterfly
 * (offsets 16, 8, 4, 2, 1; every combine is commutative, so all lanes hold the same bits); the
 * warps of a row write their values to shared memory and every thread combines them in increasing
 * warp order. All of it depends on cols (through tpr, V and nch) only.
 */
#ifndef RLK_CUDA_SM80_ROWOPS_CUH_
#define RLK_CUDA_SM80_ROWOPS_CUH_

#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "cuda/common.cuh"
#include "rlk.h"

namespace rowops {

constexpr int kRegChunks = 4;        /* chunks per thread in the register plan */
constexpr int kRegMaxThreads = 512;  /* register plan: rows of up to 512 * 4 chunks */
constexpr int kLoopThreads = 1024;   /* loop plan: threads per row */
constexpr int kLoopUnroll = 4;       /* loop plan: chunk loads in flight per thread */
constexpr int kMultiRowThreads = 128; /* warp-per-row CTAs: 4 rows */

/* ------------------------------------ plan (host) ------------------------------------------- */

struct RowPlan {
    int tpr;          /* threads per row */
    int rows_per_cta; /* 4 for a warp per row, else 1 */
    bool loop;        /* loop plan (long rows) */
    int64_t nch;      /* chunks per row */
};

/* v: chunk elements (8 for a 16-bit input dtype, 4 for fp32). Depends on cols and v only. */
static inline RowPlan plan_row(int64_t cols, int v) {
    const int64_t nch = (cols + v - 1) / v;
    if (nch > (int64_t)kRegMaxThreads * kRegChunks) return {kLoopThreads, 1, true, nch};
    const int64_t need = (nch + kRegChunks - 1) / kRegChunks;
    int tpr = 32;
    while (tpr < need) tpr *= 2;
    return {tpr, tpr == 32 ? kMultiRowThreads / 32 : 1, false, nch};
}

/* p (with row stride ld elements of `elem` bytes) allows 16-byte accesses to every chunk. */
static inline bool vec_ok(const void *p, int64_t ld, size_t elem) {
    return p == nullptr || ((uintptr_t)p % 16 == 0 && ((uint64_t)ld * elem) % 16 == 0);
}

/* Shared memory one CTA may use (opt-in maximum), or a negative cudaError_t. */
static inline int smem_optin_bytes() {
    int device = 0, bytes = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    return err == cudaSuccess ? bytes : -(int)err;
}

/* Grid size for `rows` rows, or 0 when it does not fit gridDim.x. */
static inline unsigned grid_for(int64_t rows, int rows_per_cta) {
    const int64_t ctas = (rows + rows_per_cta - 1) / rows_per_cta;
    return ctas > 0x7fffffff ? 0u : (unsigned)ctas;
}

/* ------------------------------------ chunks (device) --------------------------------------- */

template <typename T>
constexpr int chunk_elems() { return sizeof(T) == 2 ? 8 : 4; }

template <typename T>
constexpr bool is_bf16() { return std::is_same<T, __nv_bfloat16>::value; }

/* V elements of T, raw. */
template <typename T, int V>
struct Chunk {
    static_assert((V * sizeof(T)) % 16 == 0, "a chunk is whole 16-byte words");
    static constexpr int W = V * (int)sizeof(T) / 4;
    uint32_t w[W];
};

/* Elements [j0, j0 + V) of row (positions >= cols: zero bits). I: the index type, int in the
 * register plans (rows of at most 2048 chunks: 32-bit index arithmetic), int64_t in the loop plans. */
template <typename T, int V, typename I>
__device__ __forceinline__ void load_chunk(Chunk<T, V> &ch, const T *row, I j0, I cols, bool vec) {
    constexpr int W = Chunk<T, V>::W;
    if (vec && j0 + V <= cols) {
        const uint4 *p = reinterpret_cast<const uint4 *>(row + j0);
#pragma unroll
        for (int i = 0; i < W / 4; i++) {
            const uint4 q = __ldg(p + i);
            ch.w[4 * i] = q.x, ch.w[4 * i + 1] = q.y, ch.w[4 * i + 2] = q.z, ch.w[4 * i + 3] = q.w;
        }
    } else if constexpr (sizeof(T) == 2) {
        const unsigned short *p = reinterpret_cast<const unsigned short *>(row) + j0;
#pragma unroll
        for (int i = 0; i < W; i++) {
            const uint32_t lo = j0 + 2 * i < cols ? __ldg(p + 2 * i) : 0u;
            const uint32_t hi = j0 + 2 * i + 1 < cols ? __ldg(p + 2 * i + 1) : 0u;
            ch.w[i] = lo | (hi << 16);
        }
    } else {
        const unsigned int *p = reinterpret_cast<const unsigned int *>(row) + j0;
#pragma unroll
        for (int i = 0; i < W; i++) ch.w[i] = j0 + i < cols ? __ldg(p + i) : 0u;
    }
}

/* The chunk as fp32; positions j0 + e >= cols get `fill`. */
template <typename T, int V, typename I>
__device__ __forceinline__ void unpack(const Chunk<T, V> &ch, float (&v)[V], I j0, I cols, float fill) {
    if constexpr (sizeof(T) == 2) {
#pragma unroll
        for (int i = 0; i < V / 2; i++) {
            v[2 * i] = half_bits_to_float<is_bf16<T>()>((uint16_t)(ch.w[i] & 0xffffu));
            v[2 * i + 1] = half_bits_to_float<is_bf16<T>()>((uint16_t)(ch.w[i] >> 16));
        }
    } else {
#pragma unroll
        for (int i = 0; i < V; i++) v[i] = __uint_as_float(ch.w[i]);
    }
    if (j0 + V > cols) {
#pragma unroll
        for (int e = 0; e < V; e++)
            if (j0 + e >= cols) v[e] = fill;
    }
}

/* row[j0 + e] = v[e] rounded to T, for j0 + e < cols. */
template <typename T, int V, typename I>
__device__ __forceinline__ void store_chunk(T *row, I j0, I cols, const float (&v)[V], bool vec) {
    static_assert((V * sizeof(T)) % 16 == 0, "a chunk is whole 16-byte words");
    if (vec && j0 + V <= cols) {
        if constexpr (sizeof(T) == 2) {
#pragma unroll
            for (int i = 0; i < V / 8; i++) {
                uint4 q;
                q.x = pack_half2<is_bf16<T>()>(v[8 * i], v[8 * i + 1]);
                q.y = pack_half2<is_bf16<T>()>(v[8 * i + 2], v[8 * i + 3]);
                q.z = pack_half2<is_bf16<T>()>(v[8 * i + 4], v[8 * i + 5]);
                q.w = pack_half2<is_bf16<T>()>(v[8 * i + 6], v[8 * i + 7]);
                *reinterpret_cast<uint4 *>(row + j0 + 8 * i) = q;
            }
        } else {
#pragma unroll
            for (int i = 0; i < V / 4; i++)
                *reinterpret_cast<float4 *>(row + j0 + 4 * i) =
                    make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
        }
    } else {
#pragma unroll
        for (int e = 0; e < V; e++)
            if (j0 + e < cols) from_f32(row + j0 + e, v[e]);
    }
}

/* Shared-memory cache of raw chunks: chunk c at words [c W, c W + W) of `cache` (16-byte aligned). */
template <typename T, int V>
__device__ __forceinline__ void cache_put(uint32_t *cache, int64_t c, const Chunk<T, V> &ch) {
    constexpr int W = Chunk<T, V>::W;
    uint4 *p = reinterpret_cast<uint4 *>(cache + c * W);
#pragma unroll
    for (int i = 0; i < W / 4; i++) p[i] = make_uint4(ch.w[4 * i], ch.w[4 * i + 1], ch.w[4 * i + 2], ch.w[4 * i + 3]);
}

template <typename T, int V>
__device__ __forceinline__ void cache_get(Chunk<T, V> &ch, const uint32_t *cache, int64_t c) {
    constexpr int W = Chunk<T, V>::W;
    const uint4 *p = reinterpret_cast<const uint4 *>(cache + c * W);
#pragma unroll
    for (int i = 0; i < W / 4; i++) {
        const uint4 q = p[i];
        ch.w[4 * i] = q.x, ch.w[4 * i + 1] = q.y, ch.w[4 * i + 2] = q.z, ch.w[4 * i + 3] = q.w;
    }
}

/* Makes the compiler treat the chunk's words as new values (no instruction is emitted), so that
 * fp32 values unpacked from them before a row reduction are unpacked again after it instead of
 * being kept live in registers across it (the raw words take half the registers of 16-bit data). */
template <typename T, int V>
__device__ __forceinline__ void launder(Chunk<T, V> &ch) {
#pragma unroll
    for (int i = 0; i < Chunk<T, V>::W; i++) asm volatile("" : "+r"(ch.w[i]));
}

/* v rounded to T and back (round_dtype in the contracts). */
template <typename T>
__device__ __forceinline__ float round_to(float v) {
    if constexpr (std::is_same<T, float>::value) {
        return v;
    } else {
        T h;
        from_f32(&h, v);
        return to_f32(h);
    }
}

/* ------------------------------------ reductions -------------------------------------------- */

struct SumOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

/* v combined over the tpr threads of a row, the same bits in all of them. tpr == 32: the row is a
 * warp (several rows per CTA, no CTA barrier); otherwise the row is the whole CTA (tpr ==
 * blockDim.x) and every thread of the CTA must call. red: __shared__ float[32]. */
template <class Op>
__device__ __forceinline__ float row_allreduce(float v, float *red, int tpr, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (tpr == 32) return __shfl_sync(0xffffffffu, v, 0);
    __syncthreads(); /* red's previous readers are done */
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < (tpr >> 5); w++) r = op(r, red[w]);
    return r;
}

/* Online softmax state: max m and s = sum exp(x - ref(m)), ref(m) = (m == -inf) ? 0 : m (so rows
 * or threads that have seen only -inf keep s = 0 rather than NaN). */
struct MaxSum {
    float m, s;
};

__device__ __forceinline__ float max_ref(float m) { return m == -INFINITY ? 0.0f : m; }

/* Commutative (explicitly rounded products and sum), so the butterfly leaves equal bits in all lanes. */
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
    const float m = fmaxf(a.m, b.m), ref = max_ref(m);
    return {m, __fadd_rn(__fmul_rn(a.s, expf(a.m - ref)), __fmul_rn(b.s, expf(b.m - ref)))};
}

/* Folds V values (positions past cols filled with -inf) into the state, in increasing e. */
template <int V>
__device__ __forceinline__ void online_update(MaxSum &st, const float (&v)[V]) {
    float cm = v[0];
#pragma unroll
    for (int e = 1; e < V; e++) cm = fmaxf(cm, v[e]);
    const float m = fmaxf(st.m, cm);
    if (m != st.m) {
        st.s = __fmul_rn(st.s, expf(st.m - max_ref(m)));
        st.m = m;
    }
    const float ref = max_ref(st.m);
#pragma unroll
    for (int e = 0; e < V; e++) st.s = __fadd_rn(st.s, expf(v[e] - ref));
}

__device__ __forceinline__ MaxSum row_allreduce(MaxSum a, float *red_m, float *red_s, int tpr) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        a = merge(a, {__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)});
    if (tpr == 32) return {__shfl_sync(0xffffffffu, a.m, 0), __shfl_sync(0xffffffffu, a.s, 0)};
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red_m[threadIdx.x >> 5] = a.m, red_s[threadIdx.x >> 5] = a.s;
    __syncthreads();
    MaxSum r = {red_m[0], red_s[0]};
    for (int w = 1; w < (tpr >> 5); w++) r = merge(r, {red_m[w], red_s[w]});
    return r;
}

}  // namespace rowops

#endif /* RLK_CUDA_SM80_ROWOPS_CUH_ */
