/* rlk.h: what every kernel launcher and the binding layer share: dtypes, status codes, and the
 * launch context.
 *
 * A launcher is a plain C function (`extern "C"` in .cu files) named rlk_<entry>_<backend>, listed
 * in csrc/kernels.def, whose type rlk_<entry>_fn is declared by the op's contract header
 * csrc/ops/<op>.h:
 *
 *     int rlk_<entry>_<backend>(const rlk_<entry>_args *args, rlk_context *ctx);
 *
 * The binding validates every argument (dtypes, shapes, strides, devices, aliasing) before it calls
 * a launcher, so launchers may assume well-formed arguments. A launcher first decides whether it can
 * take the arguments; its answer depends on dtypes, layouts (strides) and the problem dimensions
 * other than the row count -- never on the number of rows and never on pointer values -- so every
 * row of a problem is always computed by the same kernel. Then:
 *   - RLK_UNSUPPORTED: this backend cannot take these arguments; the binding tries the backend's
 *     fallback (kernels.def), e.g. sm90 -> sm80 for a row stride TMA cannot describe;
 *   - with ctx->plan_only set: sets ctx->kernel (and ctx->workspace_bytes when it needs scratch
 *     memory) and returns RLK_OK without running anything;
 *   - otherwise runs, sets ctx->kernel, and returns RLK_OK or an error: a positive cudaError_t, or
 *     a negative RLK_* code below.
 * GPU launchers run on ctx->stream, never allocate, never synchronize (CUDA-graph capturable); the
 * binding allocates the workspace they asked for. CPU launchers use ctx->num_threads OpenMP threads
 * and give the same bits for any count.
 */
#ifndef RLK_H_
#define RLK_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RLK_OK 0
#define RLK_UNSUPPORTED (-1)
#define RLK_CPU_OUT_OF_MEMORY (-2) /* a CPU launcher's per-thread buffer could not be allocated */
#define RLK_BAD_INDEX (-3)         /* an index argument (a target, a length) was out of range */

typedef enum rlk_dtype {
    RLK_F32 = 0,
    RLK_BF16 = 1,
    RLK_F16 = 2,
    RLK_F64 = 3, /* CPU reference backend only (gradcheck) */
    RLK_I32 = 4, /* index tensors: sequence lengths and offsets */
    RLK_I64 = 5, /* index tensors: targets */
} rlk_dtype;

static inline size_t rlk_dtype_size(rlk_dtype dtype) {
    return (dtype == RLK_F64 || dtype == RLK_I64) ? 8 : (dtype == RLK_F32 || dtype == RLK_I32) ? 4 : 2;
}

typedef struct rlk_context {
    void *stream;            /* CUDA backends: the cudaStream_t to launch on */
    int num_threads;         /* CPU backend: OpenMP threads (>= 1) */
    int plan_only;           /* decide, report kernel / workspace_bytes, run nothing */
    const char *kernel;      /* out: the kernel that runs (or would run), e.g. "gemm_sm90" */
    int64_t workspace_bytes; /* out (plan_only): scratch memory the launch needs, 0 if none */
} rlk_context;

#ifdef __cplusplus
}
#endif
#endif /* RLK_H_ */
