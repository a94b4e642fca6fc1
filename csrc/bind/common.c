/* bind/common.c: kernel dispatch, launch contexts, status codes and argument checks shared by the
 * binding files (see common.h). */
#include "common.h"

#include <omp.h>

#ifdef RLK_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

static int cpu_num_threads = 0; /* 0: OpenMP's default */
static _Thread_local const char *last_kernel = "";

int rlk_num_threads(void) { return cpu_num_threads > 0 ? cpu_num_threads : omp_get_max_threads(); }
void rlk_set_num_threads(int n) { cpu_num_threads = n; }
const char *rlk_last_kernel(void) { return last_kernel; }

rlk_context rlk_context_for(int backend, unsigned long long stream) {
    rlk_context ctx = {0};
    if (rlk_backend_is_cuda(backend)) ctx.stream = (void *)(uintptr_t)stream;
    else ctx.num_threads = rlk_num_threads();
    return ctx;
}

#ifdef RLK_WITH_CUDA
/* Makes the tensors' device current for the launch; *previous receives the old device. */
static int enter_device(int device, int *previous) {
    cudaError_t err = cudaGetDevice(previous);
    if (err == cudaSuccess && *previous != device) err = cudaSetDevice(device);
    if (err != cudaSuccess) {
        PyErr_Format(PyExc_RuntimeError, "CUDA error selecting device %d: %s", device,
                     cudaGetErrorString(err));
        return -1;
    }
    return 0;
}

static void leave_device(int device, int previous) {
    if (previous != device) cudaSetDevice(previous);
}
#endif

/* One launcher call; RLK_PYTHON_ERROR when the device could not be selected. */
static int call_launcher(int backend, const tensor_arg *ref, rlk_caller call, rlk_launcher launcher,
                         const void *args, rlk_context *ctx) {
    int status;
    if (!rlk_backend_is_cuda(backend)) {
        if (ctx->plan_only) return call(launcher, args, ctx);
        Py_BEGIN_ALLOW_THREADS
        status = call(launcher, args, ctx);
        Py_END_ALLOW_THREADS
        return status;
    }
#ifdef RLK_WITH_CUDA
    int previous;
    if (enter_device(ref->device.device_id, &previous) != 0) return RLK_PYTHON_ERROR;
    status = call(launcher, args, ctx);
    leave_device(ref->device.device_id, previous);
    return status;
#else
    (void)ref;
    return RLK_UNSUPPORTED;
#endif
}

int rlk_run(const char *entry, int backend, const tensor_arg *ref, rlk_caller call, const void *args,
            rlk_context *ctx, int *ran_backend) {
    for (int b = backend; b != RLK_BACKEND_none; b = rlk_backend_fallback(b)) {
        const rlk_launcher launcher = rlk_kernel_launcher(entry, b);
        if (launcher == NULL) continue;
        const int status = call_launcher(b, ref, call, launcher, args, ctx);
        if (status == RLK_UNSUPPORTED) continue;
        if (status == RLK_PYTHON_ERROR) return status;
        if (ran_backend != NULL) *ran_backend = b;
        last_kernel = ctx->kernel != NULL ? ctx->kernel : entry;
        return status;
    }
    return RLK_UNSUPPORTED;
}

int rlk_run_planned(const char *entry, int backend, const tensor_arg *ref, rlk_caller call,
                    const void *args, void **workspace, rlk_context *ctx) {
    int planned_backend;
    ctx->plan_only = 1;
    ctx->workspace_bytes = 0;
    int status = rlk_run(entry, backend, ref, call, args, ctx, &planned_backend);
    ctx->plan_only = 0;
    if (status != RLK_OK) return status;
    PyObject *owner = NULL;
    *workspace = NULL;
    if (ctx->workspace_bytes > 0 && rlk_new_workspace(ref, ctx->workspace_bytes, &owner, workspace) != 0)
        return RLK_PYTHON_ERROR;
    status = rlk_run(entry, planned_backend, ref, call, args, ctx, NULL);
    Py_XDECREF(owner);
    return status;
}

int rlk_new_workspace(const tensor_arg *ref, int64_t bytes, PyObject **owner, void **data) {
    const int64_t floats = (bytes + 3) / 4;
    *data = NULL;
    *owner = tensor_arg_new_like(ref, "workspace", 1, &floats, RLK_F32);
    if (*owner == NULL) return -1;
    tensor_arg view;
    if (tensor_arg_parse(*owner, "workspace", 0, &view) != 0) {
        Py_CLEAR(*owner);
        return -1;
    }
    *data = view.data;
    tensor_arg_release(&view);
    return 0;
}

int rlk_align_cuda_matrix(const tensor_arg *t, const void **data, int64_t outer, int64_t inner, int64_t *ld,
                          const rlk_context *ctx, PyObject **owner) {
    *owner = NULL;
    const int64_t elem = (int64_t)rlk_dtype_size(t->dtype);
    const int aligned = (uintptr_t)*data % 16 == 0 && (outer <= 1 || (*ld * elem) % 16 == 0);
    if (t->device.device_type != kDLCUDA || aligned || outer == 0 || inner == 0) return 0;
#ifdef RLK_WITH_CUDA
    const int64_t pitch = (inner * elem + 15) / 16 * 16 / elem; /* rows of the copy: 16-byte multiples */
    const int64_t shape[2] = {outer, pitch};
    PyObject *copy = tensor_arg_new_like(t, "aligned copy", 2, shape, t->dtype);
    if (copy == NULL) return -1;
    tensor_arg view;
    if (tensor_arg_parse(copy, t->name, 0, &view) != 0) {
        Py_DECREF(copy);
        return -1;
    }
    int previous;
    cudaError_t err = enter_device(t->device.device_id, &previous) == 0 ? cudaSuccess : cudaErrorInvalidDevice;
    if (err == cudaSuccess) {
        err = cudaMemcpy2DAsync(view.data, (size_t)(pitch * elem), *data, (size_t)(*ld * elem), (size_t)(inner * elem),
                                (size_t)outer, cudaMemcpyDeviceToDevice, (cudaStream_t)ctx->stream);
        leave_device(t->device.device_id, previous);
    }
    *data = view.data;
    *ld = pitch;
    tensor_arg_release(&view);
    if (err != cudaSuccess) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "%s: aligned copy failed: %s", t->name, cudaGetErrorString(err));
        Py_DECREF(copy);
        return -1;
    }
    *owner = copy;
    return 0;
#else
    (void)ctx, (void)ld;
    return 0;
#endif
}

int rlk_raise_for_status(int status, const char *what) {
    if (status == RLK_OK) return 0;
    if (status == RLK_PYTHON_ERROR) return -1;
    if (status == RLK_UNSUPPORTED) {
        PyErr_Format(PyExc_RuntimeError, "%s: no compiled kernel supports these arguments", what);
        return -1;
    }
    if (status == RLK_CPU_OUT_OF_MEMORY) {
        PyErr_Format(PyExc_MemoryError, "%s: the CPU kernel could not allocate its workspace", what);
        return -1;
    }
#ifdef RLK_WITH_CUDA
    if (status > 0) {
        PyErr_Format(PyExc_RuntimeError, "%s: CUDA error: %s", what,
                     cudaGetErrorString((cudaError_t)status));
        return -1;
    }
#endif
    PyErr_Format(PyExc_RuntimeError, "%s: kernel error %d", what, status);
    return -1;
}

int rlk_check_backend(int backend, const tensor_arg *t) {
    if (backend < 0 || backend >= RLK_NUM_BACKENDS) {
        PyErr_Format(PyExc_ValueError, "backend: unknown backend code %d", backend);
        return -1;
    }
    const int on_cuda = t->device.device_type == kDLCUDA;
    if (on_cuda == rlk_backend_is_cuda(backend)) return 0;
    PyErr_Format(PyExc_ValueError, "backend: %s backend cannot run on %s tensors (%s)",
                 rlk_backend_is_cuda(backend) ? "a CUDA" : "the cpu", on_cuda ? "CUDA" : "CPU",
                 t->name);
    return -1;
}

int rlk_check_vector(const tensor_arg *t, int64_t n) {
    if (t->ndim != 1 || t->shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected shape (%lld,), got a %d-D tensor%s", t->name,
                     (long long)n, t->ndim, t->ndim == 1 ? " of another length" : "");
        return -1;
    }
    if (n > 1 && t->strides[0] != 1) {
        PyErr_Format(PyExc_ValueError, "%s: must be contiguous (stride 1), got stride %lld",
                     t->name, (long long)t->strides[0]);
        return -1;
    }
    return 0;
}

int rlk_check_rows_contiguous(const tensor_arg *t, int64_t rows, int64_t cols) {
    if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
        PyErr_Format(PyExc_ValueError, "%s: expected shape (%lld, %lld)", t->name,
                     (long long)rows, (long long)cols);
        return -1;
    }
    if ((cols > 1 && t->strides[1] != 1) || (rows > 1 && t->strides[0] < cols)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: rows must be contiguous (strides (>=%lld, 1)), got (%lld, %lld)",
                     t->name, (long long)cols, (long long)t->strides[0], (long long)t->strides[1]);
        return -1;
    }
    return 0;
}

int64_t rlk_row_stride(const tensor_arg *t) { return t->shape[0] > 1 ? t->strides[0] : t->shape[1]; }

void rlk_release_all(tensor_arg *args, int n) {
    for (int i = 0; i < n; i++) tensor_arg_release(&args[i]);
}
