/* module.c: rl_kernels._C, the CPython binding layer (one PyMethodDef table, no C++).
 *
 * Each entry takes tensors as DLPack capsules or DLPack-exporting objects (tensor_arg.h), plain
 * scalars and, for CUDA tensors, the stream handle as an integer. Everything is validated before a
 * kernel runs; errors are TypeError / ValueError naming the argument. CPU kernels run with the GIL
 * released; CUDA launchers are asynchronous on the given stream.
 *
 * Build: pip install --no-build-isolation -e .   (setup.py compiles the .c files of csrc and
 * csrc/cpu and, when nvcc is found, the .cu files of csrc/cuda; each compiled .cu file defines
 * RLK_HAVE_<FILE STEM>).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <omp.h>

#include "rl_kernels.h"
#include "tensor_arg.h"

#ifdef RLK_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

/* Backend codes shared with rl_kernels/kernel_registry.py. */
enum { BACKEND_CPU = 1, BACKEND_SM80 = 2, BACKEND_SM90 = 3 };

static int cpu_num_threads = 0; /* 0: OpenMP's default */

static int num_threads(void) { return cpu_num_threads > 0 ? cpu_num_threads : omp_get_max_threads(); }

/* ------------------------------------------------------------------------------------------- */
/* Helpers                                                                                      */
/* ------------------------------------------------------------------------------------------- */

static void release_all(tensor_arg *args, int n) {
    for (int i = 0; i < n; i++) tensor_arg_release(&args[i]);
}

static int check_backend_matches_device(int backend, const tensor_arg *t) {
    const int on_cuda = t->device.device_type == kDLCUDA;
    if (backend != BACKEND_CPU && backend != BACKEND_SM80 && backend != BACKEND_SM90) {
        PyErr_Format(PyExc_ValueError, "backend: unknown backend code %d", backend);
        return -1;
    }
    if (on_cuda == (backend != BACKEND_CPU)) return 0;
    PyErr_Format(PyExc_ValueError, "backend: %s backend cannot run on %s tensors (%s)",
                 backend == BACKEND_CPU ? "the cpu" : "a CUDA", on_cuda ? "CUDA" : "CPU", t->name);
    return -1;
}

/* A 1-D vector of n elements with unit stride (or n <= 1). */
static int check_vector(const tensor_arg *t, int64_t n) {
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

/* Rows of a 2-D tensor must be contiguous: unit column stride and non-overlapping rows. */
static int check_rows_contiguous(const tensor_arg *t, int64_t rows, int64_t cols) {
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

static int64_t row_stride(const tensor_arg *t) {
    return t->shape[0] > 1 ? t->strides[0] : t->shape[1];
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

/* Turns a launcher's return code into a Python exception. */
static int raise_for_status(int status, const char *what) {
    if (status == RLK_OK) return 0;
    if (status == RLK_UNSUPPORTED) {
        PyErr_Format(PyExc_RuntimeError, "%s: no compiled kernel supports these arguments", what);
        return -1;
    }
    if (status == RLK_CPU_OUT_OF_MEMORY) {
        PyErr_Format(PyExc_MemoryError, "%s: the CPU kernel could not allocate its workspace", what);
        return -1;
    }
#ifdef RLK_WITH_CUDA
    PyErr_Format(PyExc_RuntimeError, "%s: CUDA error: %s", what,
                 cudaGetErrorString((cudaError_t)status));
#else
    PyErr_Format(PyExc_RuntimeError, "%s: kernel error %d", what, status);
#endif
    return -1;
}

/* ------------------------------------------------------------------------------------------- */
/* gemm(a, b, c, out, alpha, beta, backend, stream)                                              */
/*   out[..., i, j] = alpha * (a @ b)[..., i, j] + beta * c[..., i, j]                            */
/* a: [M, K] or [B, M, K]; b: [K, N] or [B, K, N] (batch stride 0 allowed); c: None, [N], [M, N]  */
/* or [B|1, M|1, N] broadcast; out: like a with N columns, rows contiguous.                       */
/* ------------------------------------------------------------------------------------------- */

/* Strides of c seen as [batch, M, N] with zero strides for broadcast dims. */
static int c_strides(const tensor_arg *c, int64_t batch, int64_t M, int64_t N, int64_t *batch_stride,
                     int64_t *ldc) {
    const int nd = c->ndim;
    if (nd < 1 || nd > 3 || c->shape[nd - 1] != N || (N > 1 && c->strides[nd - 1] != 1)) {
        PyErr_Format(PyExc_ValueError,
                     "c: expected [N], [M, N] or [B, M, N] with N = %lld and unit column stride",
                     (long long)N);
        return -1;
    }
    *ldc = 0;
    *batch_stride = 0;
    if (nd >= 2) {
        const int64_t rows = c->shape[nd - 2];
        if (rows != M && rows != 1) {
            PyErr_Format(PyExc_ValueError, "c: has %lld rows, expected %lld or 1", (long long)rows,
                         (long long)M);
            return -1;
        }
        *ldc = rows == 1 ? 0 : c->strides[nd - 2];
        if (*ldc < 0) {
            PyErr_SetString(PyExc_ValueError, "c: negative row stride");
            return -1;
        }
    }
    if (nd == 3) {
        if (c->shape[0] != batch && c->shape[0] != 1) {
            PyErr_Format(PyExc_ValueError, "c: batch size %lld, expected %lld or 1",
                         (long long)c->shape[0], (long long)batch);
            return -1;
        }
        *batch_stride = c->shape[0] == 1 ? 0 : c->strides[0];
    }
    return 0;
}

typedef struct gemm_call {
    rlk_gemm_args args;
    int64_t batch, a_batch_stride, b_batch_stride, c_batch_stride, out_batch_stride;
    int backend;
    void *stream;
} gemm_call;

/* One launch per batch entry, in order; stops at the first error. */
static int run_gemm_batches(const gemm_call *call,
                            int (*launch)(const rlk_gemm_args *args, const gemm_call *call)) {
    rlk_gemm_args args = call->args;
    const size_t in_size = rlk_dtype_size(args.in_dtype), out_size = rlk_dtype_size(args.out_dtype);
    for (int64_t batch = 0; batch < call->batch; batch++) {
        args.a = (const char *)call->args.a + batch * call->a_batch_stride * in_size;
        args.b = (const char *)call->args.b + batch * call->b_batch_stride * in_size;
        args.c = call->args.c ? (const char *)call->args.c + batch * call->c_batch_stride * out_size
                              : NULL;
        args.out = (char *)call->args.out + batch * call->out_batch_stride * out_size;
        const int status = launch(&args, call);
        if (status != RLK_OK) return status;
    }
    return RLK_OK;
}

static int launch_gemm_cpu(const rlk_gemm_args *args, const gemm_call *call) {
    (void)call;
    return rlk_gemm_cpu(args, num_threads());
}

#ifdef RLK_WITH_CUDA
/* The fixed chain sm90 -> sm80 -> fp32 SIMT, starting at the requested backend. The first
 * launcher that does not answer RLK_UNSUPPORTED runs; the answer depends on dtypes, layouts and
 * strides only, so every M takes the same kernel. */
static int launch_gemm_cuda(const rlk_gemm_args *args, const gemm_call *call) {
    int status = RLK_UNSUPPORTED;
#ifdef RLK_HAVE_GEMM_SM90
    if (call->backend == BACKEND_SM90) status = rlk_gemm_sm90(args, call->stream);
#endif
#ifdef RLK_HAVE_GEMM_SM80
    if (status == RLK_UNSUPPORTED) status = rlk_gemm_sm80(args, call->stream);
#endif
#ifdef RLK_HAVE_GEMM_FP32_SM80
    if (status == RLK_UNSUPPORTED) status = rlk_gemm_fp32_simt(args, call->stream);
#endif
    return status;
}
#endif

static int prepare_gemm(tensor_arg *a, tensor_arg *b, tensor_arg *c, tensor_arg *out, gemm_call *call) {
    rlk_gemm_args *g = &call->args;
    if (tensor_arg_check_ndim(a, 2, 3) || tensor_arg_check_ndim(b, 2, 3) ||
        tensor_arg_check_float(a) || tensor_arg_check_dtype(b, a->dtype) ||
        tensor_arg_check_float(out))
        return -1;
    if (out->ndim != a->ndim) {
        PyErr_Format(PyExc_ValueError, "out: expected %d-D like a, got %d-D", a->ndim, out->ndim);
        return -1;
    }
    if (b->ndim == 3 && a->ndim != 3) {
        PyErr_SetString(PyExc_ValueError, "b: a batched b needs a batched a");
        return -1;
    }
    if (tensor_arg_check_same_device(b, a) || tensor_arg_check_same_device(out, a)) return -1;
    if (c->present && (tensor_arg_check_same_device(c, a) || tensor_arg_check_float(c)))
        return -1;

    const int nd = a->ndim;
    g->M = a->shape[nd - 2];
    g->K = a->shape[nd - 1];
    g->N = b->shape[b->ndim - 1];
    call->batch = nd == 3 ? a->shape[0] : 1;
    if (b->shape[b->ndim - 2] != g->K) {
        PyErr_Format(PyExc_ValueError, "b: has %lld rows but a has %lld columns (K)",
                     (long long)b->shape[b->ndim - 2], (long long)g->K);
        return -1;
    }
    if (b->ndim == 3 && b->shape[0] != call->batch) {
        PyErr_Format(PyExc_ValueError, "b: batch size %lld differs from a's %lld",
                     (long long)b->shape[0], (long long)call->batch);
        return -1;
    }
    if (out->shape[nd - 2] != g->M || out->shape[nd - 1] != g->N ||
        (nd == 3 && out->shape[0] != call->batch)) {
        PyErr_Format(PyExc_ValueError, "out: shape does not match the product (M=%lld, N=%lld)",
                     (long long)g->M, (long long)g->N);
        return -1;
    }

    /* dtypes: out is the input dtype or fp32; c has out's dtype */
    g->in_dtype = a->dtype;
    g->out_dtype = out->dtype;
    if (out->dtype != a->dtype && !(out->dtype == RLK_F32 && a->dtype != RLK_F64)) {
        PyErr_Format(PyExc_TypeError, "out: dtype %s, expected %s or float32",
                     rlk_dtype_name(out->dtype), rlk_dtype_name(a->dtype));
        return -1;
    }
    if (c->present && tensor_arg_check_dtype(c, out->dtype)) return -1;

    /* layouts */
    if (tensor_arg_matrix_layout(a, &g->lda, &g->a_trans) ||
        tensor_arg_matrix_layout(b, &g->ldb, &g->b_trans))
        return -1;
    const int64_t out_rows = out->shape[nd - 2], out_cols = out->shape[nd - 1];
    g->ldo = out_rows > 1 ? out->strides[nd - 2] : out_cols;
    if ((out_cols > 1 && out->strides[nd - 1] != 1) || (out_rows > 1 && g->ldo < out_cols)) {
        PyErr_SetString(PyExc_ValueError, "out: rows must be contiguous (unit column stride)");
        return -1;
    }
    call->a_batch_stride = nd == 3 ? a->strides[0] : 0;
    call->b_batch_stride = b->ndim == 3 ? b->strides[0] : 0;
    call->out_batch_stride = nd == 3 ? out->strides[0] : 0;
    if (nd == 3 && call->batch > 1 && g->M > 0 && call->out_batch_stride < g->M * g->ldo) {
        PyErr_SetString(PyExc_ValueError, "out: batches overlap (batch stride too small)");
        return -1;
    }
    if (call->a_batch_stride < 0 || call->b_batch_stride < 0) {
        PyErr_SetString(PyExc_ValueError, "a/b: negative batch stride");
        return -1;
    }
    g->c = NULL;
    g->ldc = 0;
    call->c_batch_stride = 0;
    if (c->present) {
        if (c_strides(c, call->batch, g->M, g->N, &call->c_batch_stride, &g->ldc)) return -1;
        g->c = c->data;
    }

    /* memory: out is written, so it may not overlap any input; c == out exactly is the BLAS
     * in-place update and is allowed (each element is read before it is written) */
    if (tensor_arg_check_writable(out) || tensor_arg_check_no_overlap(out, a) ||
        tensor_arg_check_no_overlap(out, b))
        return -1;
    const int c_is_out = c->present && c->data == out->data && c->ndim == out->ndim &&
                         (g->M == 1 || g->ldc == g->ldo) &&
                         (call->batch == 1 || call->c_batch_stride == call->out_batch_stride);
    if (!c_is_out && tensor_arg_check_no_overlap(out, c)) return -1;
    uintptr_t lo, hi;
    if (tensor_arg_span(a, &lo, &hi) || tensor_arg_span(b, &lo, &hi) ||
        tensor_arg_span(out, &lo, &hi) || (c->present && tensor_arg_span(c, &lo, &hi)))
        return -1;

    g->a = a->data;
    g->b = b->data;
    g->out = out->data;
    if (g->lda < 1) g->lda = 1; /* K == 0 or M == 0: never read */
    if (g->ldb < 1) g->ldb = 1;
    return 0;
}

/* The output of a @ b, [M, N] or [B, M, N], in out_dtype (-1: a's dtype), from a's framework. */
static PyObject *new_gemm_out(const tensor_arg *a, const tensor_arg *b, int out_dtype) {
    if (tensor_arg_check_ndim(a, 2, 3) || tensor_arg_check_ndim(b, 2, 3) ||
        tensor_arg_check_float(a))
        return NULL;
    if (out_dtype < -1 || out_dtype > RLK_F64) {
        PyErr_Format(PyExc_ValueError, "out_dtype: unknown dtype code %d", out_dtype);
        return NULL;
    }
    int64_t shape[3];
    for (int d = 0; d < a->ndim - 1; d++) shape[d] = a->shape[d];
    shape[a->ndim - 1] = b->shape[b->ndim - 1];
    return tensor_arg_new_like(a, a->ndim, shape, out_dtype < 0 ? a->dtype : (rlk_dtype)out_dtype);
}

static PyObject *py_gemm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a_obj, *b_obj, *c_obj, *out_obj;
    double alpha, beta;
    int backend, out_dtype = -1;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "OOOOddiK|i:gemm", &a_obj, &b_obj, &c_obj, &out_obj, &alpha,
                          &beta, &backend, &stream, &out_dtype))
        return NULL;
    tensor_arg t[4] = {0}; /* a, b, c, out; zeroed so release is safe after a failed parse */
    gemm_call call;
    PyObject *new_out = NULL; /* out = None: allocated here, returned */
    int ok = tensor_arg_parse(a_obj, "a", 0, &t[0]) == 0 &&
             tensor_arg_parse(b_obj, "b", 0, &t[1]) == 0 &&
             tensor_arg_parse(c_obj, "c", 1, &t[2]) == 0;
    if (ok && out_obj == Py_None) {
        new_out = new_gemm_out(&t[0], &t[1], out_dtype);
        ok = new_out != NULL;
        out_obj = new_out;
    }
    ok = ok && tensor_arg_parse(out_obj, "out", 0, &t[3]) == 0 &&
         prepare_gemm(&t[0], &t[1], &t[2], &t[3], &call) == 0 &&
         check_backend_matches_device(backend, &t[0]) == 0;
    if (ok && call.batch > 0 && call.args.M > 0 && call.args.N > 0) {
        call.args.alpha = (float)alpha;
        call.args.beta = (float)beta;
        call.backend = backend;
        call.stream = (void *)(uintptr_t)stream;
        int status;
        if (backend == BACKEND_CPU) {
            Py_BEGIN_ALLOW_THREADS
            status = run_gemm_batches(&call, launch_gemm_cpu);
            Py_END_ALLOW_THREADS
        } else {
#ifdef RLK_WITH_CUDA
            int previous;
            status = RLK_OK;
            if (enter_device(t[0].device.device_id, &previous) != 0) {
                ok = 0;
            } else {
                status = run_gemm_batches(&call, launch_gemm_cuda);
                leave_device(t[0].device.device_id, previous);
            }
#else
            status = RLK_UNSUPPORTED;
#endif
        }
        if (ok && raise_for_status(status, "gemm") != 0) ok = 0;
    }
    release_all(t, 4);
    if (!ok) {
        Py_XDECREF(new_out);
        return NULL;
    }
    if (new_out != NULL) return new_out;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------- */
/* linear_logp_fwd(hidden, weight, bias, target, logp, entropy, lse, workspace, bad_target_addr,  */
/*                 inv_temperature, ignore_index, backend, stream)                                */
/* ------------------------------------------------------------------------------------------- */

static int prepare_linear_logp(tensor_arg *hidden, tensor_arg *weight, tensor_arg *bias,
                               tensor_arg *target, rlk_linear_logp_args *p) {
    if (tensor_arg_check_ndim(hidden, 2, 2) || tensor_arg_check_ndim(weight, 2, 2) ||
        tensor_arg_check_float(hidden) || tensor_arg_check_dtype(weight, hidden->dtype) ||
        tensor_arg_check_same_device(weight, hidden) ||
        tensor_arg_check_same_device(target, hidden))
        return -1;
    if (hidden->dtype == RLK_F64) {
        PyErr_SetString(PyExc_TypeError, "hidden: float64 is not supported by linear_logp");
        return -1;
    }
    if (!target->is_index) {
        PyErr_SetString(PyExc_TypeError, "target: expected an int64 tensor");
        return -1;
    }
    p->N = hidden->shape[0];
    p->D = hidden->shape[1];
    p->V = weight->shape[0];
    if (weight->shape[1] != p->D) {
        PyErr_Format(PyExc_ValueError, "weight: has %lld columns but hidden has %lld (D)",
                     (long long)weight->shape[1], (long long)p->D);
        return -1;
    }
    if (check_rows_contiguous(hidden, p->N, p->D) || check_rows_contiguous(weight, p->V, p->D) ||
        check_vector(target, p->N))
        return -1;
    if (bias->present && (tensor_arg_check_same_device(bias, hidden) ||
                          tensor_arg_check_dtype(bias, hidden->dtype) || check_vector(bias, p->V)))
        return -1;
    p->dtype = hidden->dtype;
    p->hidden = hidden->data;
    p->ldh = row_stride(hidden);
    p->weight = weight->data;
    p->ldw = row_stride(weight);
    p->bias = bias->present ? bias->data : NULL;
    p->target = (const int64_t *)target->data;
    return 0;
}

static int check_f32_vector_out(tensor_arg *t, const tensor_arg *hidden, int64_t n) {
    if (!t->present) return 0;
    return tensor_arg_check_dtype(t, RLK_F32) || tensor_arg_check_same_device(t, hidden) ||
           check_vector(t, n) || tensor_arg_check_writable(t);
}

static PyObject *py_linear_logp_fwd(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[8];
    unsigned long long bad_target_addr, stream;
    double inv_temperature;
    long long ignore_index;
    int backend;
    if (!PyArg_ParseTuple(args, "OOOOOOOOKdLiK:linear_logp_fwd", &obj[0], &obj[1], &obj[2],
                          &obj[3], &obj[4], &obj[5], &obj[6], &obj[7], &bad_target_addr,
                          &inv_temperature, &ignore_index, &backend, &stream))
        return NULL;
    static const char *names[8] = {"hidden", "weight", "bias", "target",
                                   "logp", "entropy", "lse", "workspace"};
    static const int optional[8] = {0, 0, 1, 0, 0, 1, 0, 1};
    tensor_arg t[8] = {0};
    int parsed = 0, ok = 1;
    for (; parsed < 8 && ok; parsed++)
        ok = tensor_arg_parse(obj[parsed], names[parsed], optional[parsed], &t[parsed]) == 0;
    rlk_linear_logp_args p = {0};
    ok = ok && prepare_linear_logp(&t[0], &t[1], &t[2], &t[3], &p) == 0 &&
         check_f32_vector_out(&t[4], &t[0], p.N) == 0 &&
         check_f32_vector_out(&t[5], &t[0], p.N) == 0 &&
         check_f32_vector_out(&t[6], &t[0], p.N) == 0 &&
         check_backend_matches_device(backend, &t[0]) == 0;
    for (int i = 4; ok && i < 7; i++)
        for (int j = 0; ok && j < 4; j++) ok = tensor_arg_check_no_overlap(&t[i], &t[j]) == 0;
    ok = ok && tensor_arg_check_no_overlap(&t[4], &t[6]) == 0 &&
         tensor_arg_check_no_overlap(&t[5], &t[6]) == 0 &&
         tensor_arg_check_no_overlap(&t[4], &t[5]) == 0;
    if (ok && p.N > 0) {
        p.ignore_index = ignore_index;
        p.inv_temperature = (float)inv_temperature;
        p.logp = (float *)t[4].data;
        p.entropy = t[5].present ? (float *)t[5].data : NULL;
        p.lse = (float *)t[6].data;
        int status;
        if (backend == BACKEND_CPU) {
            Py_BEGIN_ALLOW_THREADS
            status = rlk_linear_logp_fwd_cpu(&p, num_threads());
            Py_END_ALLOW_THREADS
            if (status == RLK_BAD_TARGET) {
                PyErr_Format(PyExc_ValueError,
                             "target: a value is outside [0, %lld) and is not ignore_index (%lld)",
                             (long long)p.V, ignore_index);
                ok = 0;
            }
        } else {
            status = RLK_UNSUPPORTED;
#if defined(RLK_WITH_CUDA) && defined(RLK_HAVE_LINEAR_LOGP_SM80)
            const int64_t need = rlk_linear_logp_fwd_workspace_bytes(p.N, p.V, p.dtype);
            uintptr_t lo = 0, hi = 0;
            if (t[7].present && tensor_arg_span(&t[7], &lo, &hi) != 0) ok = 0;
            if (ok && (!t[7].present || (int64_t)(hi - lo) < need ||
                       t[7].device.device_type != kDLCUDA)) {
                PyErr_Format(PyExc_ValueError, "workspace: needs %lld bytes of device memory",
                             (long long)need);
                ok = 0;
            }
            if (ok && bad_target_addr == 0) {
                PyErr_SetString(PyExc_ValueError, "bad_target_addr: a mapped host flag is required");
                ok = 0;
            }
            int previous;
            if (ok && enter_device(t[0].device.device_id, &previous) == 0) {
                p.bad_target = (int32_t *)(uintptr_t)bad_target_addr;
                void *cuda_stream = (void *)(uintptr_t)stream;
                /* sm90 -> sm80, as for the GEMM: the choice depends on dtype, D and strides only */
#ifdef RLK_HAVE_GEMM_SM90
                if (backend == BACKEND_SM90)
                    status = rlk_linear_logp_fwd_sm90(&p, t[7].data, cuda_stream);
#endif
                if (status == RLK_UNSUPPORTED)
                    status = rlk_linear_logp_fwd_sm80(&p, t[7].data, cuda_stream);
                leave_device(t[0].device.device_id, previous);
            } else {
                ok = 0;
            }
#endif
        }
        if (ok && status != RLK_BAD_TARGET && raise_for_status(status, "linear_logp") != 0) ok = 0;
    }
    release_all(t, parsed);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------- */
/* linear_logp_dlogits(logits, target, lse, entropy, grad_logp, grad_entropy, dlogits, v0,         */
/*                     inv_temperature, ignore_index, stream, hidden=None, weight=None, bias=None) */
/* -> True, or False when the fused form was asked for and no kernel takes these operands.        */
/* logits None asks for the fused form: z = hidden @ weight^T + bias of the chunk is formed in    */
/* registers (SM90 build, CUDA, dlogits in hidden's dtype); the caller then falls back to a GEMM  */
/* into fp32 logits and the plain form.                                                           */
/* ------------------------------------------------------------------------------------------- */

static PyObject *py_linear_logp_dlogits(PyObject *self, PyObject *args) {
    (void)self;
    enum { N_TENSORS = 10 };
    PyObject *obj[N_TENSORS];
    obj[7] = obj[8] = obj[9] = Py_None;
    long long v0, ignore_index;
    double inv_temperature;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "OOOOOOOLdLK|OOO:linear_logp_dlogits", &obj[0], &obj[1], &obj[2],
                          &obj[3], &obj[4], &obj[5], &obj[6], &v0, &inv_temperature,
                          &ignore_index, &stream, &obj[7], &obj[8], &obj[9]))
        return NULL;
    static const char *names[N_TENSORS] = {"logits", "target", "lse", "entropy", "grad_logp",
                                           "grad_entropy", "dlogits", "hidden", "weight", "bias"};
    static const int optional[N_TENSORS] = {1, 0, 0, 1, 1, 1, 0, 1, 1, 1};
    tensor_arg t[N_TENSORS] = {0};
    int parsed = 0, ok = 1, done = 1;
    for (; parsed < N_TENSORS && ok; parsed++)
        ok = tensor_arg_parse(obj[parsed], names[parsed], optional[parsed], &t[parsed]) == 0;
    tensor_arg *logits = &t[0], *target = &t[1], *dlogits = &t[6], *hidden = &t[7];
    const int fused = ok && !logits->present;
    const tensor_arg *ref = fused ? hidden : logits;  /* the tensor that sets rows, cols, device */
    rlk_linear_logp_dlogits_args d = {0};
    if (ok && fused) {
        /* the chunk's product is the forward's with the chunk's weight rows as the vocabulary */
        rlk_linear_logp_args product = {0};
        if (!hidden->present || !t[8].present) {
            PyErr_SetString(PyExc_ValueError, "hidden, weight: required when logits is None");
            ok = 0;
        }
        ok = ok && prepare_linear_logp(hidden, &t[8], &t[9], target, &product) == 0 &&
             tensor_arg_check_dtype(dlogits, hidden->dtype) == 0;
        if (ok) {
            d.rows = product.N;
            d.cols = product.V;
            d.D = product.D;
            d.hidden = product.hidden;
            d.ldh = product.ldh;
            d.weight = product.weight;
            d.ldw = product.ldw;
            d.bias = product.bias;
        }
    } else if (ok) {
        ok = tensor_arg_check_ndim(logits, 2, 2) == 0 &&
             tensor_arg_check_dtype(logits, RLK_F32) == 0 &&
             check_rows_contiguous(logits, logits->shape[0], logits->shape[1]) == 0;
        if (ok) {
            d.rows = logits->shape[0];
            d.cols = logits->shape[1];
        }
    }
    if (ok) {
        ok = tensor_arg_check_float(dlogits) == 0 &&
             check_rows_contiguous(dlogits, d.rows, d.cols) == 0 &&
             tensor_arg_check_writable(dlogits) == 0 &&
             tensor_arg_check_same_device(dlogits, ref) == 0 &&
             tensor_arg_check_same_device(target, ref) == 0 && check_vector(target, d.rows) == 0;
        if (ok && !target->is_index) {
            PyErr_SetString(PyExc_TypeError, "target: expected an int64 tensor");
            ok = 0;
        }
        if (ok && dlogits->dtype == RLK_F64) {
            PyErr_SetString(PyExc_TypeError, "dlogits: float64 is not supported");
            ok = 0;
        }
        for (int i = 2; ok && i < 6; i++)
            if (t[i].present)
                ok = tensor_arg_check_dtype(&t[i], RLK_F32) == 0 &&
                     tensor_arg_check_same_device(&t[i], ref) == 0 &&
                     check_vector(&t[i], d.rows) == 0;
        if (ok && t[5].present && !t[3].present) {
            PyErr_SetString(PyExc_ValueError, "entropy: required when grad_entropy is given");
            ok = 0;
        }
        /* dlogits may be the logits buffer itself (fp32, same rows); nothing else may overlap */
        const int in_place = ok && !fused && dlogits->data == logits->data &&
                             dlogits->dtype == RLK_F32 && row_stride(dlogits) == row_stride(logits);
        for (int i = in_place ? 1 : 0; ok && i < N_TENSORS; i++)
            if (i != 6 && t[i].present) ok = tensor_arg_check_no_overlap(dlogits, &t[i]) == 0;
        if (ok) {
            d.v0 = v0;
            d.logits = fused ? NULL : (const float *)logits->data;
            d.ld_logits = fused ? 0 : row_stride(logits);
            d.target = (const int64_t *)target->data;
            d.ignore_index = ignore_index;
            d.lse = (const float *)t[2].data;
            d.entropy = t[3].present ? (const float *)t[3].data : NULL;
            d.grad_logp = t[4].present ? (const float *)t[4].data : NULL;
            d.grad_entropy = t[5].present ? (const float *)t[5].data : NULL;
            d.inv_temperature = (float)inv_temperature;
            d.out_dtype = dlogits->dtype;
            d.dlogits = dlogits->data;
            d.ld_dlogits = row_stride(dlogits);
        }
    }
    if (ok && d.rows > 0 && d.cols > 0) {
        int status = RLK_UNSUPPORTED;
        if (ref->device.device_type == kDLCPU) {
            if (!fused) {
                Py_BEGIN_ALLOW_THREADS
                status = rlk_linear_logp_dlogits_cpu(&d, num_threads());
                Py_END_ALLOW_THREADS
            }
        } else {
#ifdef RLK_WITH_CUDA
            int previous;
            if (enter_device(ref->device.device_id, &previous) == 0) {
#ifdef RLK_HAVE_GEMM_SM90
                if (fused) status = rlk_linear_logp_dlogits_sm90(&d, (void *)(uintptr_t)stream);
#endif
#ifdef RLK_HAVE_LINEAR_LOGP_SM80
                if (!fused) status = rlk_linear_logp_dlogits_cuda(&d, (void *)(uintptr_t)stream);
#endif
                leave_device(ref->device.device_id, previous);
            } else {
                ok = 0;
            }
#endif
        }
        if (fused && status == RLK_UNSUPPORTED)
            done = 0;
        else if (ok && raise_for_status(status, "linear_logp_dlogits") != 0)
            ok = 0;
    }
    release_all(t, parsed);
    if (!ok) return NULL;
    return PyBool_FromLong(done);
}

/* ------------------------------------------------------------------------------------------- */
/* Build facts and settings                                                                     */
/* ------------------------------------------------------------------------------------------- */

static PyObject *py_linear_logp_fwd_workspace_bytes(PyObject *self, PyObject *args) {
    (void)self;
    long long N, V;
    int dtype;
    if (!PyArg_ParseTuple(args, "LLi:linear_logp_fwd_workspace_bytes", &N, &V, &dtype)) return NULL;
    if (dtype < RLK_F32 || dtype > RLK_F64) {
        PyErr_Format(PyExc_ValueError, "dtype: unknown dtype code %d", dtype);
        return NULL;
    }
#if defined(RLK_WITH_CUDA) && defined(RLK_HAVE_LINEAR_LOGP_SM80)
    return PyLong_FromLongLong(rlk_linear_logp_fwd_workspace_bytes(N, V, (rlk_dtype)dtype));
#else
    return PyLong_FromLong(0);
#endif
}

static PyObject *py_compiled_kernels(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("(s"
#ifdef RLK_HAVE_GEMM_SM80
                         "s"
#endif
#ifdef RLK_HAVE_GEMM_FP32_SM80
                         "s"
#endif
#ifdef RLK_HAVE_GEMM_SM90
                         "s"
#endif
#ifdef RLK_HAVE_LINEAR_LOGP_SM80
                         "s"
#endif
                         ")",
                         "cpu"
#ifdef RLK_HAVE_GEMM_SM80
                         , "gemm_sm80"
#endif
#ifdef RLK_HAVE_GEMM_FP32_SM80
                         , "gemm_fp32_sm80"
#endif
#ifdef RLK_HAVE_GEMM_SM90
                         , "gemm_sm90"
#endif
#ifdef RLK_HAVE_LINEAR_LOGP_SM80
                         , "linear_logp_sm80"
#endif
    );
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *args) {
    (void)self;
    int n;
    if (!PyArg_ParseTuple(args, "i:set_num_threads", &n)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "num_threads: must be >= 0 (0 = OpenMP default)");
        return NULL;
    }
    cpu_num_threads = n;
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(num_threads());
}

static PyMethodDef methods[] = {
    {"gemm", py_gemm, METH_VARARGS,
     "gemm(a, b, c, out, alpha, beta, backend, stream, out_dtype=-1): out = alpha * a @ b + beta * c;"
     " out=None allocates it (dtype code out_dtype, -1: a's) through a's framework and returns it"},
    {"linear_logp_fwd", py_linear_logp_fwd, METH_VARARGS,
     "linear_logp_fwd(hidden, weight, bias, target, logp, entropy, lse, workspace, "
     "bad_target_addr, inv_temperature, ignore_index, backend, stream)"},
    {"linear_logp_dlogits", py_linear_logp_dlogits, METH_VARARGS,
     "linear_logp_dlogits(logits, target, lse, entropy, grad_logp, grad_entropy, dlogits, v0, "
     "inv_temperature, ignore_index, stream, hidden=None, weight=None, bias=None) -> bool; "
     "logits=None: the fused form from hidden @ weight^T + bias (False: no kernel takes it)"},
    {"linear_logp_fwd_workspace_bytes", py_linear_logp_fwd_workspace_bytes, METH_VARARGS,
     "bytes of device workspace the GPU linear_logp forward needs for (N, V, dtype code)"},
    {"compiled_kernels", py_compiled_kernels, METH_NOARGS,
     "names of the kernel files compiled into this build"},
    {"set_num_threads", py_set_num_threads, METH_VARARGS,
     "threads for CPU kernels (0 = OpenMP default)"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "threads CPU kernels use"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "rl_kernels._C", "rl_kernels C extension (DLPack in, kernels out)", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "BACKEND_CPU", BACKEND_CPU) ||
        PyModule_AddIntConstant(m, "BACKEND_SM80", BACKEND_SM80) ||
        PyModule_AddIntConstant(m, "BACKEND_SM90", BACKEND_SM90) ||
        PyModule_AddIntConstant(m, "DTYPE_F32", RLK_F32) ||
        PyModule_AddIntConstant(m, "DTYPE_BF16", RLK_BF16) ||
        PyModule_AddIntConstant(m, "DTYPE_F16", RLK_F16) ||
        PyModule_AddIntConstant(m, "DTYPE_F64", RLK_F64) ||
        PyModule_AddIntConstant(m, "WITH_CUDA",
#ifdef RLK_WITH_CUDA
                                1
#else
                                0
#endif
                                )) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
