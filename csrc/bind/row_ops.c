/* bind/row_ops.c: the row ops over the last dimension: _C.rms_norm_fwd / _bwd, _C.softmax_fwd / _bwd
 * (log_softmax with log=True) and _C.row_sum (contracts: csrc/ops/rms_norm.h, softmax.h, row_sum.h).
 * Every matrix is 2-D [rows, cols] with contiguous rows (unit column stride); the Python layer
 * flattens the leading dimensions.
 *
 * rms_norm_fwd(x, weight, y, rstd, eps, round_before_weight, backend, stream)
 * rms_norm_bwd(x, weight, rstd, dy, dx, dweight, eps, round_before_weight, backend, stream)
 * softmax_fwd(x, y, log, backend, stream)           softmax_bwd(y, dy, dx, log, backend, stream)
 * row_sum(x, y, mean, backend, stream)              y: [rows]
 */
#include "common.h"

#include "../ops/rms_norm.h"
#include "../ops/row_sum.h"
#include "../ops/softmax.h"

RLK_DEFINE_CALLER(rms_norm_fwd, rlk_rms_norm_args)
RLK_DEFINE_CALLER(rms_norm_bwd, rlk_rms_norm_args)
RLK_DEFINE_CALLER(softmax_fwd, rlk_softmax_args)
RLK_DEFINE_CALLER(softmax_bwd, rlk_softmax_args)
RLK_DEFINE_CALLER(row_sum, rlk_row_sum_args)

/* t is [rows, cols] on ref's device with contiguous rows, of dtype (or any float dtype when dtype < 0);
 * *ld gets its row stride. */
static int check_matrix(const tensor_arg *t, const tensor_arg *ref, int64_t rows, int64_t cols, int dtype,
                        int64_t *ld) {
    if (tensor_arg_check_same_device(t, ref) || tensor_arg_check_float(t) ||
        (dtype >= 0 && tensor_arg_check_dtype(t, (rlk_dtype)dtype)) || rlk_check_rows_contiguous(t, rows, cols))
        return -1;
    *ld = rlk_row_stride(t);
    return 0;
}

/* Parses n arguments, then x's shape: 0, or -1 with an exception. */
static int parse_all(PyObject **obj, const char *const *names, const int *optional, int n, tensor_arg *t) {
    for (int i = 0; i < n; i++)
        if (tensor_arg_parse(obj[i], names[i], optional[i], &t[i]) != 0) return -1;
    return tensor_arg_check_ndim(&t[0], 2, 2);
}

static int check_outputs(tensor_arg *t, int n, int first_out) {
    for (int i = first_out; i < n; i++) {
        if (!t[i].present) continue;
        if (tensor_arg_check_writable(&t[i])) return -1;
        for (int j = 0; j < n; j++)
            if (j != i && tensor_arg_check_no_overlap(&t[i], &t[j])) return -1;
    }
    return 0;
}

static PyObject *finish(int ok, int status, const char *what, tensor_arg *t, int n) {
    if (ok && rlk_raise_for_status(status, what) != 0) ok = 0;
    rlk_release_all(t, n);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static int check_weight(const tensor_arg *w, const tensor_arg *x, int64_t cols) {
    if (!w->present) return 0;
    return tensor_arg_check_dtype(w, x->dtype) || tensor_arg_check_same_device(w, x) || rlk_check_vector(w, cols);
}

static int check_rstd(const tensor_arg *r, const tensor_arg *x, int64_t rows) {
    return tensor_arg_check_dtype(r, RLK_F32) || tensor_arg_check_same_device(r, x) || rlk_check_vector(r, rows);
}

PyObject *py_rms_norm_fwd(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[4];
    double eps;
    int round_before_weight, backend;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "OOOOdpiK:rms_norm_fwd", &obj[0], &obj[1], &obj[2], &obj[3], &eps,
                          &round_before_weight, &backend, &stream))
        return NULL;
    static const char *const names[4] = {"x", "weight", "y", "rstd"};
    static const int optional[4] = {0, 1, 0, 0};
    tensor_arg t[4] = {{0}};
    rlk_rms_norm_args a = {0};
    int ok = parse_all(obj, names, optional, 4, t) == 0;
    if (ok) a.rows = t[0].shape[0], a.cols = t[0].shape[1];
    ok = ok && check_matrix(&t[0], &t[0], a.rows, a.cols, -1, &a.ldx) == 0 && check_weight(&t[1], &t[0], a.cols) == 0 &&
         check_matrix(&t[2], &t[0], a.rows, a.cols, t[0].dtype, &a.ldy) == 0 && check_rstd(&t[3], &t[0], a.rows) == 0 &&
         rlk_check_backend(backend, &t[0]) == 0 && check_outputs(t, 4, 2) == 0;
    int status = RLK_OK;
    if (ok && a.rows > 0) {
        a.dtype = t[0].dtype, a.eps = eps, a.round_before_weight = round_before_weight;
        a.x = t[0].data, a.weight = t[1].present ? t[1].data : NULL, a.y = t[2].data, a.rstd = (float *)t[3].data;
        rlk_context ctx = rlk_context_for(backend, stream);
        status = rlk_run_planned("rms_norm_fwd", backend, &t[0], call_rms_norm_fwd, &a, &a.workspace, &ctx);
    }
    return finish(ok, status, "rms_norm", t, 4);
}

PyObject *py_rms_norm_bwd(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[6];
    double eps;
    int round_before_weight, backend;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "OOOOOOdpiK:rms_norm_bwd", &obj[0], &obj[1], &obj[2], &obj[3], &obj[4], &obj[5],
                          &eps, &round_before_weight, &backend, &stream))
        return NULL;
    static const char *const names[6] = {"x", "weight", "rstd", "dy", "dx", "dweight"};
    static const int optional[6] = {0, 1, 0, 0, 0, 1};
    tensor_arg t[6] = {{0}};
    rlk_rms_norm_args a = {0};
    int ok = parse_all(obj, names, optional, 6, t) == 0;
    if (ok) a.rows = t[0].shape[0], a.cols = t[0].shape[1];
    ok = ok && check_matrix(&t[0], &t[0], a.rows, a.cols, -1, &a.ldx) == 0 && check_weight(&t[1], &t[0], a.cols) == 0 &&
         check_rstd(&t[2], &t[0], a.rows) == 0 && check_matrix(&t[3], &t[0], a.rows, a.cols, t[0].dtype, &a.lddy) == 0 &&
         check_matrix(&t[4], &t[0], a.rows, a.cols, t[0].dtype, &a.lddx) == 0 &&
         (!t[5].present || tensor_arg_check_dtype(&t[5], t[0].dtype) == 0) &&
         (!t[5].present || (tensor_arg_check_same_device(&t[5], &t[0]) == 0 && rlk_check_vector(&t[5], a.cols) == 0)) &&
         rlk_check_backend(backend, &t[0]) == 0 && check_outputs(t, 6, 4) == 0;
    int status = RLK_OK;
    if (ok && (a.rows > 0 || t[5].present)) {
        a.dtype = t[0].dtype, a.eps = eps, a.round_before_weight = round_before_weight;
        a.x = t[0].data, a.weight = t[1].present ? t[1].data : NULL, a.rstd = (float *)t[2].data;
        a.dy = t[3].data, a.dx = t[4].data, a.dweight = t[5].present ? t[5].data : NULL;
        rlk_context ctx = rlk_context_for(backend, stream);
        status = rlk_run_planned("rms_norm_bwd", backend, &t[0], call_rms_norm_bwd, &a, &a.workspace, &ctx);
    }
    return finish(ok, status, "rms_norm backward", t, 6);
}

PyObject *py_softmax_fwd(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[2];
    int log, backend;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "OOpiK:softmax_fwd", &obj[0], &obj[1], &log, &backend, &stream)) return NULL;
    static const char *const names[2] = {"x", "y"};
    static const int optional[2] = {0, 0};
    tensor_arg t[2] = {{0}};
    rlk_softmax_args a = {0};
    int ok = parse_all(obj, names, optional, 2, t) == 0;
    if (ok) a.rows = t[0].shape[0], a.cols = t[0].shape[1];
    ok = ok && check_matrix(&t[0], &t[0], a.rows, a.cols, -1, &a.ldx) == 0 &&
         check_matrix(&t[1], &t[0], a.rows, a.cols, -1, &a.ldy) == 0 && rlk_check_backend(backend, &t[0]) == 0 &&
         check_outputs(t, 2, 1) == 0;
    int status = RLK_OK;
    if (ok && a.rows > 0) {
        a.in_dtype = t[0].dtype, a.out_dtype = t[1].dtype, a.log = log, a.x = t[0].data, a.y = t[1].data;
        rlk_context ctx = rlk_context_for(backend, stream);
        status = rlk_run("softmax_fwd", backend, &t[0], call_softmax_fwd, &a, &ctx, NULL);
    }
    return finish(ok, status, log ? "log_softmax" : "softmax", t, 2);
}

PyObject *py_softmax_bwd(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[3];
    int log, backend;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "OOOpiK:softmax_bwd", &obj[0], &obj[1], &obj[2], &log, &backend, &stream)) return NULL;
    static const char *const names[3] = {"y", "dy", "dx"};
    static const int optional[3] = {0, 0, 0};
    tensor_arg t[3] = {{0}};
    rlk_softmax_args a = {0};
    int ok = parse_all(obj, names, optional, 3, t) == 0;
    if (ok) a.rows = t[0].shape[0], a.cols = t[0].shape[1];
    ok = ok && check_matrix(&t[0], &t[0], a.rows, a.cols, -1, &a.ldy) == 0 &&
         check_matrix(&t[1], &t[0], a.rows, a.cols, t[0].dtype, &a.lddy) == 0 &&
         check_matrix(&t[2], &t[0], a.rows, a.cols, -1, &a.lddx) == 0 && rlk_check_backend(backend, &t[0]) == 0 &&
         check_outputs(t, 3, 2) == 0;
    int status = RLK_OK;
    if (ok && a.rows > 0) {
        a.in_dtype = t[2].dtype, a.out_dtype = t[0].dtype, a.log = log;
        a.y = t[0].data, a.dy = t[1].data, a.dx = t[2].data;
        rlk_context ctx = rlk_context_for(backend, stream);
        status = rlk_run("softmax_bwd", backend, &t[0], call_softmax_bwd, &a, &ctx, NULL);
    }
    return finish(ok, status, log ? "log_softmax backward" : "softmax backward", t, 3);
}

PyObject *py_row_sum(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[2];
    int mean, backend;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "OOpiK:row_sum", &obj[0], &obj[1], &mean, &backend, &stream)) return NULL;
    static const char *const names[2] = {"x", "y"};
    static const int optional[2] = {0, 0};
    tensor_arg t[2] = {{0}};
    rlk_row_sum_args a = {0};
    int ok = parse_all(obj, names, optional, 2, t) == 0;
    if (ok) a.rows = t[0].shape[0], a.cols = t[0].shape[1];
    ok = ok && check_matrix(&t[0], &t[0], a.rows, a.cols, -1, &a.ldx) == 0 &&
         tensor_arg_check_float(&t[1]) == 0 && tensor_arg_check_same_device(&t[1], &t[0]) == 0 &&
         rlk_check_vector(&t[1], a.rows) == 0 && rlk_check_backend(backend, &t[0]) == 0 && check_outputs(t, 2, 1) == 0;
    int status = RLK_OK;
    if (ok && a.rows > 0) {
        a.in_dtype = t[0].dtype, a.out_dtype = t[1].dtype, a.mean = mean, a.x = t[0].data, a.y = t[1].data;
        rlk_context ctx = rlk_context_for(backend, stream);
        status = rlk_run("row_sum", backend, &t[0], call_row_sum, &a, &ctx, NULL);
    }
    return finish(ok, status, mean ? "mean" : "sum", t, 2);
}
