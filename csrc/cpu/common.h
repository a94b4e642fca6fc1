/* cpu/common.h: what the C reference kernels share: bf16 / fp16 <-> fp32 conversion in plain C, and
 * element loads / stores of the storage dtypes through fp32.
 *
 * Stores round to nearest even, overflow goes to +-inf, NaN stays NaN (made quiet, sign and top
 * payload bits kept), fp16 subnormals are exact in both directions. Pure integer / exact float
 * arithmetic, so the result never depends on the compiler, flags or CPU.
 * Tested by tests/test_gemm.py: 16-bit outputs equal torch's rounding of the fp32 result.
 */
#ifndef RLK_CPU_COMMON_H_
#define RLK_CPU_COMMON_H_

#include <stdint.h>
#include <string.h>

#include "../rlk.h"

static inline int64_t rlk_min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline uint32_t rlk_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float rlk_f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float rlk_bf16_to_f32(uint16_t h)
{
    return rlk_f32_from_bits((uint32_t)h << 16);
}

static inline uint16_t rlk_f32_to_bf16(float f)
{
    const uint32_t u = rlk_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    /* Adding 0x7fff plus the lowest kept bit rounds to nearest even; a carry out of the
     * mantissa bumps the exponent, which turns the largest finite values into inf as it should. */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float rlk_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return rlk_f32_from_bits(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        /* zero or subnormal: mantissa * 2^-24 is exact in fp32 */
        const float magnitude = (float)mantissa * 0x1p-24f;
        return rlk_f32_from_bits(sign | rlk_f32_bits(magnitude));
    }
    return rlk_f32_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static inline uint16_t rlk_f32_to_f16(float f)
{
    const uint32_t u = rlk_f32_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t magnitude = u & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu)); /* NaN */
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (magnitude >= 0x38800000u) {
        /* normal fp16: rebias the exponent (127 -> 15), then round the 13 dropped bits to
         * nearest even; a mantissa carry correctly moves into the exponent */
        const uint32_t rebiased = magnitude - 0x38000000u;
        return (uint16_t)(sign | ((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13));
    }
    /* subnormal fp16 (or zero): adding 0.5f aligns the value so that fp32's own round to
     * nearest even rounds it to a multiple of 2^-24, the fp16 subnormal step; the low bits of
     * the sum are then the fp16 encoding (a result of 0x400 is the smallest normal, correctly). */
    const float aligned = rlk_f32_from_bits(magnitude) + 0.5f;
    return (uint16_t)(sign | (rlk_f32_bits(aligned) - 0x3f000000u));
}

/* Element `index` of an fp32 / bf16 / fp16 array, as fp32. */
static inline float rlk_load_f32(const void *src, rlk_dtype dtype, int64_t index)
{
    if (dtype == RLK_F32) return ((const float *)src)[index];
    if (dtype == RLK_BF16) return rlk_bf16_to_f32(((const uint16_t *)src)[index]);
    return rlk_f16_to_f32(((const uint16_t *)src)[index]);
}

/* dst[index] = value rounded to dtype (fp32, bf16 or fp16). */
static inline void rlk_store_f32(void *dst, rlk_dtype dtype, int64_t index, float value)
{
    if (dtype == RLK_F32) ((float *)dst)[index] = value;
    else if (dtype == RLK_BF16) ((uint16_t *)dst)[index] = rlk_f32_to_bf16(value);
    else ((uint16_t *)dst)[index] = rlk_f32_to_f16(value);
}

/* dst[q * dst_stride] = src[index + q] as fp32, q = 0..n-1 (src of an fp32 / bf16 / fp16 dtype). */
static inline void rlk_load_row_f32(float *dst, int64_t dst_stride, const void *src, rlk_dtype dtype,
                                    int64_t index, int64_t n)
{
    if (dtype == RLK_F32) {
        const float *s = (const float *)src + index;
        for (int64_t q = 0; q < n; q++) dst[q * dst_stride] = s[q];
    } else if (dtype == RLK_BF16) {
        const uint16_t *s = (const uint16_t *)src + index;
        for (int64_t q = 0; q < n; q++) dst[q * dst_stride] = rlk_bf16_to_f32(s[q]);
    } else {
        const uint16_t *s = (const uint16_t *)src + index;
        for (int64_t q = 0; q < n; q++) dst[q * dst_stride] = rlk_f16_to_f32(s[q]);
    }
}

/* dst[index + q] = src[q] rounded to dtype (fp32, bf16 or fp16), q = 0..n-1. */
static inline void rlk_store_row_f32(void *dst, rlk_dtype dtype, int64_t index, const float *src, int64_t n)
{
    if (dtype == RLK_F32) {
        memcpy((float *)dst + index, src, (size_t)n * sizeof(float));
    } else if (dtype == RLK_BF16) {
        uint16_t *d = (uint16_t *)dst + index;
        for (int64_t q = 0; q < n; q++) d[q] = rlk_f32_to_bf16(src[q]);
    } else {
        uint16_t *d = (uint16_t *)dst + index;
        for (int64_t q = 0; q < n; q++) d[q] = rlk_f32_to_f16(src[q]);
    }
}

#endif /* RLK_CPU_COMMON_H_ */
