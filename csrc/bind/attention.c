/* bind/attention.c: _C.attention_fwd and _C.attention_bwd (contract: csrc/ops/attention.h).
 *
 * attention_fwd(q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q_len, max_k_len, causal,
 *               softmax_scale, bad_index_addr, backend, stream)
 * attention_bwd(q, k, v, out, lse, dout, dq, dk, dv, q_start, q_len, k_start, k_len, max_q_len,
 *               max_k_len, causal, softmax_scale, bad_index_addr, backend, stream)
 * q, out, dout, dq: [B, T, Hq, d] (a batch of B sequences) or [T, Hq, d] (packed: batch stride 0);
 * k, v, dk, dv: the same with Hkv heads; lse: fp32 [B, Hq, T] or [Hq, T] (fp64 for fp64 inputs);
 * q_start, q_len, k_start, k_len: int32 [number of sequences] on the tensors' device (B of them for
 * 4-D tensors), or None: every sequence starts at row 0 (starts) or spans max_q_len / max_k_len rows
 * (lengths), as csrc/ops/attention.h's null arrays. The number of sequences is the length of the
 * ones given, else B (4-D) or 1 (packed). Head dims contiguous; other strides free. bad_index_addr:
 * on CUDA, a host-mapped int32 flag the kernels set when a sequence's range is out of bounds (they
 * cannot be checked here without reading device memory).
 */
#include <float.h>

#include "common.h"

#include "../ops/attention.h"

RLK_DEFINE_CALLER(attention_fwd, rlk_attention_args)
RLK_DEFINE_CALLER(attention_bwd, rlk_attention_args)

/* The view of a [B, T, H, d] or packed [T, H, d] tensor; *rows / *heads / *dim receive its sizes. */
static int attention_tensor(const tensor_arg *t, int ndim, rlk_attention_tensor *view, int64_t *rows,
                            int64_t *heads, int64_t *dim) {
    if (tensor_arg_check_ndim(t, ndim, ndim)) return -1;
    const int o = ndim == 4 ? 1 : 0;
    if (t->shape[o + 2] > 1 && t->strides[o + 2] != 1) {
        PyErr_Format(PyExc_ValueError, "%s: the head dimension must be contiguous (stride 1), got stride %lld",
                     t->name, (long long)t->strides[o + 2]);
        return -1;
    }
    view->data = t->data;
    view->batch_stride = ndim == 4 ? t->strides[0] : 0;
    view->row_stride = t->strides[o];
    view->head_stride = t->strides[o + 1];
    *rows = t->shape[o];
    *heads = t->shape[o + 1];
    *dim = t->shape[o + 2];
    return 0;
}

static int check_like(const tensor_arg *t, const tensor_arg *ref) {
    if (tensor_arg_check_dtype(t, ref->dtype) || tensor_arg_check_same_device(t, ref)) return -1;
    for (int d = 0; d < ref->ndim; d++)
        if (t->ndim != ref->ndim || t->shape[d] != ref->shape[d]) {
            PyErr_Format(PyExc_ValueError, "%s: must have the shape of %s", t->name, ref->name);
            return -1;
        }
    return 0;
}

/* q, k, v, the index arrays (each may be absent: None) and lse; fills everything in *a but the
 * outputs' data. */
static int prepare_attention(tensor_arg *q, tensor_arg *k, tensor_arg *v, tensor_arg *lse, tensor_arg *index,
                             rlk_attention_args *a) {
    if (tensor_arg_check_float(q) || tensor_arg_check_dtype(k, q->dtype) || tensor_arg_check_dtype(v, q->dtype) ||
        tensor_arg_check_same_device(k, q) || tensor_arg_check_same_device(v, q) || check_like(v, k))
        return -1;
    if (q->ndim != 3 && q->ndim != 4) {
        PyErr_Format(PyExc_ValueError, "q: expected [B, T, H, d] or packed [T, H, d], got %d-D", q->ndim);
        return -1;
    }
    int64_t dk, dv;
    if (attention_tensor(q, q->ndim, &a->q, &a->q_rows, &a->heads_q, &a->head_dim) ||
        attention_tensor(k, q->ndim, &a->k, &a->k_rows, &a->heads_kv, &dk) ||
        attention_tensor(v, q->ndim, &a->v, &a->k_rows, &a->heads_kv, &dv))
        return -1;
    if (dk != a->head_dim) {
        PyErr_Format(PyExc_ValueError, "k: head dim %lld differs from q's %lld", (long long)dk,
                     (long long)a->head_dim);
        return -1;
    }
    if (a->heads_kv < 1 || a->heads_q % a->heads_kv != 0) {
        PyErr_Format(PyExc_ValueError, "k: %lld heads do not divide q's %lld heads (GQA needs Hq a multiple of Hkv)",
                     (long long)a->heads_kv, (long long)a->heads_q);
        return -1;
    }
    const tensor_arg *first = NULL; /* the first range array given: it sets the number of sequences */
    for (int i = 0; i < 4 && !first; i++)
        if (index[i].present) first = &index[i];
    if (first && tensor_arg_check_ndim(first, 1, 1)) return -1;
    a->batch = first ? first->shape[0] : q->ndim == 4 ? q->shape[0] : 1;
    for (int i = 0; i < 4; i++)
        if (index[i].present && (tensor_arg_check_dtype(&index[i], RLK_I32) ||
                                 tensor_arg_check_same_device(&index[i], q) || rlk_check_vector(&index[i], a->batch)))
            return -1;
    if (q->ndim == 4 && (a->batch != q->shape[0] || k->shape[0] != q->shape[0])) {
        PyErr_Format(PyExc_ValueError, "%s: %lld sequences for a batch of %lld (q) and %lld (k)",
                     first ? first->name : "q_len", (long long)a->batch, (long long)q->shape[0],
                     (long long)k->shape[0]);
        return -1;
    }
    a->dtype = q->dtype;
    /* lse: [B, Hq, T] or [Hq, T] */
    const rlk_dtype lse_dtype = q->dtype == RLK_F64 ? RLK_F64 : RLK_F32;
    if (tensor_arg_check_ndim(lse, q->ndim - 1, q->ndim - 1) || tensor_arg_check_dtype(lse, lse_dtype) ||
        tensor_arg_check_same_device(lse, q))
        return -1;
    const int o = q->ndim == 4 ? 1 : 0;
    if ((o && lse->shape[0] != q->shape[0]) || lse->shape[o] != a->heads_q || lse->shape[o + 1] != a->q_rows) {
        PyErr_SetString(PyExc_ValueError, "lse: expected shape [B, Hq, T] ([Hq, T] packed) matching q");
        return -1;
    }
    a->lse.data = lse->data;
    a->lse.batch_stride = o ? lse->strides[0] : 0;
    a->lse.head_stride = lse->strides[o];
    a->lse.row_stride = lse->strides[o + 1];
    a->q_start = index[0].present ? (const int32_t *)index[0].data : NULL;
    a->q_len = index[1].present ? (const int32_t *)index[1].data : NULL;
    a->k_start = index[2].present ? (const int32_t *)index[2].data : NULL;
    a->k_len = index[3].present ? (const int32_t *)index[3].data : NULL;
    return 0;
}

static int check_max_lengths(rlk_attention_args *a, long long max_q_len, long long max_k_len) {
    if (max_q_len < 0 || max_q_len > a->q_rows || max_k_len < 0 || max_k_len > a->k_rows) {
        PyErr_Format(PyExc_ValueError, "max_q_len, max_k_len: %lld and %lld must be within the %lld query and "
                     "%lld key rows", max_q_len, max_k_len, (long long)a->q_rows, (long long)a->k_rows);
        return -1;
    }
    a->max_q_len = max_q_len;
    a->max_k_len = max_k_len;
    return 0;
}

/* The contract's m follows the max of the raw scores, which is the max of the scaled ones only for
 * softmax_scale >= 0; a Python caller gets the same check from the wrapper first. */
static int check_softmax_scale(double softmax_scale) {
    if (!(softmax_scale >= 0.0 && softmax_scale <= FLT_MAX)) {
        PyErr_Format(PyExc_ValueError, "softmax_scale: must be finite and >= 0, got %g", softmax_scale);
        return -1;
    }
    return 0;
}

static int run_attention(const char *entry, rlk_caller call, int backend, unsigned long long stream,
                         unsigned long long bad_index_addr, const tensor_arg *q, rlk_attention_args *a) {
    if (rlk_backend_is_cuda(backend) && bad_index_addr == 0) {
        PyErr_SetString(PyExc_ValueError, "bad_index_addr: a mapped host flag is required on CUDA");
        return -1;
    }
    a->bad_index = (int32_t *)(uintptr_t)bad_index_addr;
    if (a->batch == 0 || a->heads_q == 0) return 0;
    rlk_context ctx = rlk_context_for(backend, stream);
    const int status = rlk_run_planned(entry, backend, q, call, a, &a->workspace, &ctx);
    if (status == RLK_BAD_INDEX) {
        PyErr_Format(PyExc_ValueError, "q_start, q_len, k_start, k_len: a sequence's range is negative, longer "
                     "than max_q_len / max_k_len, or past the %lld query / %lld key rows",
                     (long long)a->q_rows, (long long)a->k_rows);
        return -1;
    }
    return rlk_raise_for_status(status, "attention");
}

PyObject *py_attention_fwd(PyObject *self, PyObject *args) {
    (void)self;
    enum { Q, K, V, OUT, LSE, INDEX, COUNT = INDEX + 4 };
    PyObject *obj[COUNT];
    long long max_q_len, max_k_len;
    int causal, backend;
    double softmax_scale;
    unsigned long long bad_index_addr, stream;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOLLpdKiK:attention_fwd", &obj[Q], &obj[K], &obj[V], &obj[OUT], &obj[LSE],
                          &obj[INDEX], &obj[INDEX + 1], &obj[INDEX + 2], &obj[INDEX + 3], &max_q_len, &max_k_len,
                          &causal, &softmax_scale, &bad_index_addr, &backend, &stream))
        return NULL;
    static const char *const names[COUNT] = {"q", "k", "v", "out", "lse", "q_start", "q_len", "k_start", "k_len"};
    tensor_arg t[COUNT] = {0};
    int parsed = 0, ok = 1;
    for (; parsed < COUNT && ok; parsed++)
        ok = tensor_arg_parse(obj[parsed], names[parsed], parsed >= INDEX, &t[parsed]) == 0;
    rlk_attention_args a = {0};
    ok = ok && prepare_attention(&t[Q], &t[K], &t[V], &t[LSE], &t[INDEX], &a) == 0 &&
         check_max_lengths(&a, max_q_len, max_k_len) == 0 && check_like(&t[OUT], &t[Q]) == 0 &&
         rlk_check_backend(backend, &t[Q]) == 0 && tensor_arg_check_writable(&t[OUT]) == 0 &&
         tensor_arg_check_writable(&t[LSE]) == 0;
    int64_t rows, heads, dim;
    ok = ok && attention_tensor(&t[OUT], t[Q].ndim, &a.out, &rows, &heads, &dim) == 0;
    for (int i = 0; ok && i < COUNT; i++)
        if (i != OUT && i != LSE)
            ok = tensor_arg_check_no_overlap(&t[OUT], &t[i]) == 0 && tensor_arg_check_no_overlap(&t[LSE], &t[i]) == 0;
    ok = ok && tensor_arg_check_no_overlap(&t[OUT], &t[LSE]) == 0;
    ok = ok && check_softmax_scale(softmax_scale) == 0;
    if (ok) {
        a.causal = causal;
        a.softmax_scale = softmax_scale;
        ok = run_attention("attention_fwd", call_attention_fwd, backend, stream, bad_index_addr, &t[Q], &a) == 0;
    }
    rlk_release_all(t, parsed);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

PyObject *py_attention_bwd(PyObject *self, PyObject *args) {
    (void)self;
    enum { Q, K, V, OUT, LSE, DOUT, DQ, DK, DV, INDEX, COUNT = INDEX + 4 };
    PyObject *obj[COUNT];
    long long max_q_len, max_k_len;
    int causal, backend;
    double softmax_scale;
    unsigned long long bad_index_addr, stream;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOLLpdKiK:attention_bwd", &obj[Q], &obj[K], &obj[V], &obj[OUT],
                          &obj[LSE], &obj[DOUT], &obj[DQ], &obj[DK], &obj[DV], &obj[INDEX], &obj[INDEX + 1],
                          &obj[INDEX + 2], &obj[INDEX + 3], &max_q_len, &max_k_len, &causal, &softmax_scale,
                          &bad_index_addr, &backend, &stream))
        return NULL;
    static const char *const names[COUNT] = {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv",
                                             "q_start", "q_len", "k_start", "k_len"};
    tensor_arg t[COUNT] = {0};
    int parsed = 0, ok = 1;
    for (; parsed < COUNT && ok; parsed++)
        ok = tensor_arg_parse(obj[parsed], names[parsed], parsed >= INDEX, &t[parsed]) == 0;
    rlk_attention_args a = {0};
    ok = ok && prepare_attention(&t[Q], &t[K], &t[V], &t[LSE], &t[INDEX], &a) == 0 &&
         check_max_lengths(&a, max_q_len, max_k_len) == 0 && rlk_check_backend(backend, &t[Q]) == 0 &&
         check_like(&t[OUT], &t[Q]) == 0 && check_like(&t[DOUT], &t[Q]) == 0 && check_like(&t[DQ], &t[Q]) == 0 &&
         check_like(&t[DK], &t[K]) == 0 && check_like(&t[DV], &t[K]) == 0;
    int64_t rows, heads, dim;
    ok = ok && attention_tensor(&t[OUT], t[Q].ndim, &a.out, &rows, &heads, &dim) == 0 &&
         attention_tensor(&t[DOUT], t[Q].ndim, &a.dout, &rows, &heads, &dim) == 0 &&
         attention_tensor(&t[DQ], t[Q].ndim, &a.dq, &rows, &heads, &dim) == 0 &&
         attention_tensor(&t[DK], t[Q].ndim, &a.dk, &rows, &heads, &dim) == 0 &&
         attention_tensor(&t[DV], t[Q].ndim, &a.dv, &rows, &heads, &dim) == 0;
    for (int i = DQ; ok && i <= DV; i++) {
        ok = tensor_arg_check_writable(&t[i]) == 0;
        for (int j = 0; ok && j < COUNT; j++)
            if (j != i && (j < DQ || j > i)) ok = tensor_arg_check_no_overlap(&t[i], &t[j]) == 0;
    }
    ok = ok && check_softmax_scale(softmax_scale) == 0;
    if (ok) {
        a.causal = causal;
        a.softmax_scale = softmax_scale;
        ok = run_attention("attention_bwd", call_attention_bwd, backend, stream, bad_index_addr, &t[Q], &a) == 0;
    }
    rlk_release_all(t, parsed);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}
