/* sm80/convert.cu: elementwise dtype conversion of a matrix on CUDA (contract: csrc/ops/convert.h).
 *
 * Plan: grid.x covers 4 columns per thread, grid.y strides over rows; each element goes through fp32
 * (exact for every supported input dtype) and is rounded once (from_f32, round to nearest even).
 * Elementwise: no order to choose.
 * Build: part of the extension (setup.py; flags from the sm80 row of csrc/kernels.def).
 * Test (GPU): pytest tests/test_gpu_linear_logp.py -m gpu (the backward stores its dH through it).
 */
#include "../../ops/convert.h"
#include "../common.cuh"

template <typename In, typename Out>
__global__ void convert_kernel(rlk_convert_args a) {
    const int64_t c0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (c0 >= a.cols) return;
    const int n = (int)min((int64_t)4, a.cols - c0);
    for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
        const In *in = (const In *)a.in + r * a.ld_in + c0;
        Out *out = (Out *)a.out + r * a.ld_out + c0;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (j < n) from_f32(out + j, to_f32(in[j]));
    }
}

template <typename In>
static int launch_convert(const rlk_convert_args *a, cudaStream_t stream) {
    const int threads = 256;
    const dim3 grid((unsigned)((a->cols + threads * 4 - 1) / (threads * 4)), (unsigned)(a->rows < 65535 ? a->rows : 65535));
    switch (a->out_dtype) {
    case RLK_F32: convert_kernel<In, float><<<grid, threads, 0, stream>>>(*a); break;
    case RLK_BF16: convert_kernel<In, __nv_bfloat16><<<grid, threads, 0, stream>>>(*a); break;
    default: convert_kernel<In, __half><<<grid, threads, 0, stream>>>(*a); break;
    }
    return (int)cudaGetLastError();
}

extern "C" int rlk_convert_sm80(const rlk_convert_args *args, rlk_context *ctx) {
    const auto supported = [](rlk_dtype d) { return d == RLK_F32 || d == RLK_BF16 || d == RLK_F16; };
    if (!supported(args->in_dtype) || !supported(args->out_dtype)) return RLK_UNSUPPORTED;
    ctx->kernel = "convert_sm80";
    if (ctx->plan_only || args->rows == 0 || args->cols == 0) return RLK_OK;
    const cudaStream_t s = (cudaStream_t)ctx->stream;
    if (args->in_dtype == RLK_F32) return launch_convert<float>(args, s);
    return args->in_dtype == RLK_BF16 ? launch_convert<__nv_bfloat16>(args, s) : launch_convert<__half>(args, s);
}
