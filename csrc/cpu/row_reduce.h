/* cpu/row_reduce.h: the one fixed summation order of the CPU row ops (rms_norm.c, softmax.c,
 * row_sum.c), and per-thread row buffers.
 *
 * rlk_row_sum16_f32(v, n) / rlk_row_sum16_f64(v, n): 16 interleaved partial sums, lane l taking
 * v[j] for j = l, l + 16, l + 32, ... in increasing j, each lane starting from +0; then a fixed tree:
 * lane l += lane l + 8 (l < 8), then l += l + 4, l += l + 2, l += l + 1; the result is lane 0. The
 * order depends on n only. The lanes are independent, so the compiler may vectorize the main loop
 * (4 SSE / 2 AVX registers) without reassociating anything; -ffp-contract=off keeps every product
 * that feeds a sum a separately rounded multiply (the callers form the terms in a buffer first).
 * Starting from +0 means an exact cancellation gives +0 and a sum of no terms is +0 (torch's sum).
 */
#ifndef RLK_CPU_ROW_REDUCE_H_
#define RLK_CPU_ROW_REDUCE_H_

#include <stdint.h>
#include <stdlib.h>

#include "common.h"

enum { RLK_ROW_LANES = 16 };

/* rlk_row_sum16_f32 and rlk_row_sum16_f64: one definition, two element types. */
#define RLK_DEFINE_ROW_SUM16(name, T)                                         \
    static inline T name(const T *restrict v, int64_t n)                      \
    {                                                                         \
        T lane[RLK_ROW_LANES];                                                \
        for (int l = 0; l < RLK_ROW_LANES; l++) lane[l] = 0;                  \
        int64_t j = 0;                                                        \
        for (; j + RLK_ROW_LANES <= n; j += RLK_ROW_LANES)                    \
            for (int l = 0; l < RLK_ROW_LANES; l++) lane[l] += v[j + l];      \
        for (int l = 0; j + l < n; l++) lane[l] += v[j + l];                  \
        for (int width = RLK_ROW_LANES / 2; width >= 1; width /= 2)           \
            for (int l = 0; l < width; l++) lane[l] += lane[l + width];       \
        return lane[0];                                                       \
    }
RLK_DEFINE_ROW_SUM16(rlk_row_sum16_f32, float)
RLK_DEFINE_ROW_SUM16(rlk_row_sum16_f64, double)
#undef RLK_DEFINE_ROW_SUM16

/* value rounded to dtype (fp32, bf16 or fp16) and back to fp32: round_dtype(v) in the contracts. */
static inline float rlk_round_f32(rlk_dtype dtype, float v)
{
    if (dtype == RLK_BF16) return rlk_bf16_to_f32(rlk_f32_to_bf16(v));
    if (dtype == RLK_F16) return rlk_f16_to_f32(rlk_f32_to_f16(v));
    return v;
}

/* One 64-byte aligned buffer of `count` elements of `size` bytes (at least one element, so a
 * cols == 0 row still gets a valid pointer); NULL when out of memory. Free with free(). */
static inline void *rlk_row_buffer(int64_t count, size_t size)
{
    size_t bytes = (size_t)(count > 0 ? count : 1) * size;
    bytes = (bytes + 63) / 64 * 64;
    return aligned_alloc(64, bytes);
}

/* OpenMP team size for `items` independent work items: at least 1, at most num_threads. */
static inline int rlk_row_threads(int num_threads, int64_t items)
{
    const int64_t t = rlk_min64(num_threads > 0 ? num_threads : 1, items);
    return t > 0 ? (int)t : 1;
}

enum { RLK_MAX_ROW_BUFFERS = 4 };

/* work(op, i, buffers) for one work item i (a row, a block of rows), given the calling thread's
 * row buffers. */
typedef void (*rlk_item_fn)(const void *op, int64_t i, void *const *buffers);

/* Runs work(op, i, buffers) for i = 0 .. items - 1 on OpenMP threads (static shares; which thread
 * takes an item never changes its result), each thread with its own `count` buffers of `cols`
 * elements of `elem` bytes. RLK_CPU_OUT_OF_MEMORY when a thread could not get its buffers (its
 * items are then not run). */
static inline int rlk_parallel_items(int num_threads, int64_t items, int count, int64_t cols, size_t elem,
                                     rlk_item_fn work, const void *op)
{
    if (items <= 0) return RLK_OK;
    int out_of_memory = 0;
#pragma omp parallel num_threads(rlk_row_threads(num_threads, items))
    {
        void *buffers[RLK_MAX_ROW_BUFFERS] = {NULL};
        int ok = 1;
        for (int b = 0; b < count; b++) ok = (buffers[b] = rlk_row_buffer(cols, elem)) != NULL && ok;
        if (!ok) {
#pragma omp atomic write
            out_of_memory = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++)
            if (ok) work(op, i, buffers);
        for (int b = 0; b < count; b++) free(buffers[b]);
    }
    return out_of_memory ? RLK_CPU_OUT_OF_MEMORY : RLK_OK;
}

#endif /* RLK_CPU_ROW_REDUCE_H_ */
