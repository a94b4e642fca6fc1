/* bind/gemm.c: _C.gemm (contract: csrc/ops/gemm.h).
 *
 * gemm(a, b, c, out, alpha, beta, backend, stream, out_dtype=-1)
 *   out[..., i, j] = alpha * (a @ b)[..., i, j] + beta * c[..., i, j]
 * a: [M, K] or [B, M, K]; b: [K, N] or [B, K, N] (batch stride 0 allowed), row-major or a transposed
 * view; c: None, [N], [M, N] or [B|1, M|1, N] broadcast, unit column stride; out: like a with N
 * columns, rows contiguous, or None to allocate it (dtype code out_dtype, -1: a's) through a's
 * framework and return it. BLAS semantics: alpha == 0 does not read a and b, beta == 0 does not
 * read c. One launch per batch entry, in order.
 */
#include "common.h"

#include "../ops/gemm.h"

RLK_DEFINE_CALLER(gemm, rlk_gemm_args)

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
} gemm_call;

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
    if (out->dtype != a->dtype && out->dtype != RLK_F32) {
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
    return tensor_arg_new_like(a, "out: None", a->ndim, shape,
                               out_dtype < 0 ? a->dtype : (rlk_dtype)out_dtype);
}

/* Runs the batch entries in order, each with the scratch memory its kernel plans (sm90 stream-K);
 * stops at the first error. */
static int run_gemm_batches(const gemm_call *call, int backend, const tensor_arg *ref, rlk_context *ctx) {
    rlk_gemm_args args = call->args;
    const size_t in_size = rlk_dtype_size(args.in_dtype), out_size = rlk_dtype_size(args.out_dtype);
    for (int64_t batch = 0; batch < call->batch; batch++) {
        args.a = (const char *)call->args.a + batch * call->a_batch_stride * in_size;
        args.b = (const char *)call->args.b + batch * call->b_batch_stride * in_size;
        args.c = call->args.c ? (const char *)call->args.c + batch * call->c_batch_stride * out_size
                              : NULL;
        args.out = (char *)call->args.out + batch * call->out_batch_stride * out_size;
        const int status = rlk_run_planned("gemm", backend, ref, call_gemm, &args, &args.workspace, ctx);
        if (status != RLK_OK) return status;
    }
    return RLK_OK;
}

PyObject *py_gemm(PyObject *self, PyObject *args) {
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
             tensor_arg_parse(beta == 0.0 || (float)beta == 0.0f ? Py_None : c_obj, "c", 1, &t[2]) == 0;
    if (ok && out_obj == Py_None) {
        new_out = new_gemm_out(&t[0], &t[1], out_dtype);
        ok = new_out != NULL;
        out_obj = new_out;
    }
    ok = ok && tensor_arg_parse(out_obj, "out", 0, &t[3]) == 0 &&
         prepare_gemm(&t[0], &t[1], &t[2], &t[3], &call) == 0 && rlk_check_backend(backend, &t[0]) == 0;
    PyObject *a_copy = NULL, *b_copy = NULL;
    if (ok && call.batch > 0 && call.args.M > 0 && call.args.N > 0) {
        rlk_gemm_args *g = &call.args;
        g->alpha = alpha;
        g->beta = beta;
        /* BLAS: A @ B is not read when alpha is 0 as the kernel applies it (fp32 unless fp64) */
        if ((g->in_dtype == RLK_F64 ? alpha : (double)(float)alpha) == 0.0) g->K = 0;
        rlk_context ctx = rlk_context_for(backend, stream);
        if (call.batch == 1 && g->K > 0)
            ok = rlk_align_cuda_matrix(&t[0], &g->a, g->a_trans ? g->K : g->M, g->a_trans ? g->M : g->K, &g->lda, &ctx,
                                       &a_copy) == 0 &&
                 rlk_align_cuda_matrix(&t[1], &g->b, g->b_trans ? g->N : g->K, g->b_trans ? g->K : g->N, &g->ldb, &ctx,
                                       &b_copy) == 0;
        ok = ok && rlk_raise_for_status(run_gemm_batches(&call, backend, &t[0], &ctx), "gemm") == 0;
    }
    Py_XDECREF(a_copy);
    Py_XDECREF(b_copy);
    rlk_release_all(t, 4);
    if (!ok) {
        Py_XDECREF(new_out);
        return NULL;
    }
    if (new_out != NULL) return new_out;
    Py_RETURN_NONE;
}
