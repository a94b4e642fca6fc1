/* bind/common.h: what every binding file (csrc/bind/<op>.c) shares: the backends and kernels of
 * csrc/kernels.def, running a kernel entry down its backend's fallback chain, argument checks, and
 * turning launcher status codes into Python exceptions.
 *
 * A binding function parses its Python arguments into tensor_args (tensor_arg.h), validates them
 * with the checks below, fills the op's argument struct (csrc/ops/<op>.h) and calls rlk_run (or
 * rlk_run_planned when the launch needs scratch memory). It never picks a kernel itself: the
 * launchers decide what they can take (csrc/rlk.h) and rlk_run follows the fallbacks that
 * kernels.def declares, recording which kernel ran (_C.last_kernel()).
 */
#ifndef RLK_BIND_COMMON_H_
#define RLK_BIND_COMMON_H_

#include "tensor_arg.h"

/* Backend codes: the BACKEND rows of kernels.def in order (what _C.backends() lists). */
enum {
#define BACKEND(name, device, min_cc, max_cc, fallback, nvcc_gencode) RLK_BACKEND_##name,
#include "../kernels.def"
    RLK_NUM_BACKENDS,
    RLK_BACKEND_none = -1,
};

/* A status of the binding's own: a Python exception is already set. */
#define RLK_PYTHON_ERROR (-100)

/* Any launcher, as stored in the kernel table; a caller casts it back to its entry's type. */
typedef void (*rlk_launcher)(void);
/* Calls one launcher of an entry with that entry's argument struct. */
typedef int (*rlk_caller)(rlk_launcher launcher, const void *args, rlk_context *ctx);

/* Defines the caller of entry ENTRY (rlk_<ENTRY>_fn taking ARGS_TYPE). */
#define RLK_DEFINE_CALLER(ENTRY, ARGS_TYPE)                                                        \
    static int call_##ENTRY(rlk_launcher launcher, const void *args, rlk_context *ctx) {           \
        return ((rlk_##ENTRY##_fn *)launcher)((const ARGS_TYPE *)args, ctx);                       \
    }

/* bind/kernels.c: the launcher of entry on backend, NULL when this build has none. */
rlk_launcher rlk_kernel_launcher(const char *entry, int backend);
/* Python tuples describing kernels.def: _C.backends(), _C.kernels() (compiled launchers only). */
PyObject *rlk_backends_tuple(void);
PyObject *rlk_kernels_tuple(void);
int rlk_backend_fallback(int backend);
int rlk_backend_is_cuda(int backend);

/* A context for a launch on backend: the CUDA stream handle, or the CPU thread count. */
rlk_context rlk_context_for(int backend, unsigned long long stream);
int rlk_num_threads(void);
void rlk_set_num_threads(int n);
const char *rlk_last_kernel(void);

/* Runs entry on backend, then on its fallbacks while a launcher answers RLK_UNSUPPORTED (or the
 * backend has no kernel for the entry). ref: a tensor of the call, whose CUDA device is made current
 * for the launch. CPU launches run with the GIL released. Honors ctx->plan_only. Returns the status
 * of the launcher that took the call (RLK_UNSUPPORTED if none did); *ran_backend (may be NULL) gets
 * its backend. */
int rlk_run(const char *entry, int backend, const tensor_arg *ref, rlk_caller call, const void *args,
            rlk_context *ctx, int *ran_backend);
/* Plans entry (rlk_run with plan_only), allocates the workspace the chosen launcher asked for
 * through ref's framework (*workspace receives its address; the args struct's workspace field),
 * and runs it. The workspace lives until the launch is queued: stream-ordered allocators reuse it
 * only after. */
int rlk_run_planned(const char *entry, int backend, const tensor_arg *ref, rlk_caller call,
                    const void *args, void **workspace, rlk_context *ctx);
/* Scratch memory of at least `bytes` from ref's framework, on ref's device (fp32 elements): *owner
 * keeps it alive (the caller releases it after the launches), *data is its address. 0, or -1 with a
 * Python exception. */
int rlk_new_workspace(const tensor_arg *ref, int64_t bytes, PyObject **owner, void **data);

/* CUDA operands are presented with 16-byte aligned rows: a matrix whose base or row stride is not a
 * multiple of 16 bytes (a view starting mid-row, an odd leading dimension) is copied, values
 * unchanged, to fresh memory from t's framework with rows padded to 16 bytes, on the launch's
 * stream, so neither where a slice starts nor how its rows are spaced decides which kernel runs. The
 * matrix is outer x inner elements, inner contiguous, *ld elements between outer rows; *data and *ld
 * then describe the copy, and *owner (NULL when nothing was copied) keeps it alive until the caller
 * has launched. CPU tensors: no-op. 0, or -1 with a Python exception. */
int rlk_align_cuda_matrix(const tensor_arg *t, const void **data, int64_t outer, int64_t inner, int64_t *ld,
                          const rlk_context *ctx, PyObject **owner);

/* 0, or -1 with a Python exception for a failed launch (what: the op's name). */
int rlk_raise_for_status(int status, const char *what);

/* Argument checks: 0, or -1 with an exception naming the argument. */
int rlk_check_backend(int backend, const tensor_arg *t);            /* known, and runs on t's device */
int rlk_check_vector(const tensor_arg *t, int64_t n);              /* 1-D of n, unit stride */
int rlk_check_rows_contiguous(const tensor_arg *t, int64_t rows, int64_t cols);
int64_t rlk_row_stride(const tensor_arg *t);                       /* of a 2-D tensor */

void rlk_release_all(tensor_arg *args, int n);

#endif /* RLK_BIND_COMMON_H_ */
