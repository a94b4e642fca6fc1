/* bind/linear_logp.c: _C.linear_logp_fwd, _C.linear_logp_bwd and the backward's two dz forms
 * (contract: csrc/ops/linear_logp.h; math: docs/operators/linear_logp.md).
 *
 * The backward runs here, in C, unless the backend runs it whole (entry linear_logp_bwd: sm90 with fp32
 * inputs, every product on bf16 parts), as one call per row block: it walks the vocabulary in chunks of
 * vocab_chunk columns (a constant of the caller, so a row's dH sums the same chunks in the same
 * order for every N) and, per chunk, forms dz (the fused linear_logp_dlogits kernel where the
 * backend has one for these operands, else a GEMM into fp32 logits and linear_logp_dz), then
 * dH += dz @ W_chunk, dW_chunk (+)= dz^T @ H, db_chunk += 1^T dz on the GEMM kernels. Every kernel
 * is chosen by rlk_run from the backend and the operands' layouts only.
 */
#include "common.h"

#include "../ops/convert.h"
#include "../ops/gemm.h"
#include "../ops/linear_logp.h"

RLK_DEFINE_CALLER(gemm, rlk_gemm_args)
RLK_DEFINE_CALLER(convert, rlk_convert_args)
RLK_DEFINE_CALLER(linear_logp_fwd, rlk_linear_logp_args)
RLK_DEFINE_CALLER(linear_logp_dz, rlk_linear_logp_dlogits_args)
RLK_DEFINE_CALLER(linear_logp_dlogits, rlk_linear_logp_dlogits_args)
RLK_DEFINE_CALLER(linear_logp_bwd, rlk_linear_logp_bwd_args)

/* hidden [N, D], weight [V, D] (rows contiguous, one float dtype), bias [V] or None, target int64 [N]. */
static int prepare_linear_logp(tensor_arg *hidden, tensor_arg *weight, tensor_arg *bias,
                               tensor_arg *target, rlk_linear_logp_args *p) {
    if (tensor_arg_check_ndim(hidden, 2, 2) || tensor_arg_check_ndim(weight, 2, 2) ||
        tensor_arg_check_float(hidden) || tensor_arg_check_dtype(weight, hidden->dtype) ||
        tensor_arg_check_same_device(weight, hidden) ||
        tensor_arg_check_same_device(target, hidden) || tensor_arg_check_dtype(target, RLK_I64))
        return -1;
    if (hidden->dtype == RLK_F64) {
        PyErr_SetString(PyExc_TypeError, "hidden: float64 is not supported by linear_logp");
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
    if (rlk_check_rows_contiguous(hidden, p->N, p->D) ||
        rlk_check_rows_contiguous(weight, p->V, p->D) || rlk_check_vector(target, p->N))
        return -1;
    if (bias->present && (tensor_arg_check_same_device(bias, hidden) ||
                          tensor_arg_check_dtype(bias, hidden->dtype) ||
                          rlk_check_vector(bias, p->V)))
        return -1;
    p->dtype = hidden->dtype;
    p->hidden = hidden->data;
    p->ldh = rlk_row_stride(hidden);
    p->weight = weight->data;
    p->ldw = rlk_row_stride(weight);
    p->bias = bias->present ? bias->data : NULL;
    p->target = (const int64_t *)target->data;
    return 0;
}

/* hidden and weight presented 16-byte aligned on CUDA (rlk_align_cuda_matrix); owners[2] keep copies. */
static int align_operands(const tensor_arg *hidden, const tensor_arg *weight, rlk_linear_logp_args *p,
                          const rlk_context *ctx, PyObject **owners) {
    return rlk_align_cuda_matrix(hidden, &p->hidden, p->N, p->D, &p->ldh, ctx, &owners[0]) ||
           rlk_align_cuda_matrix(weight, &p->weight, p->V, p->D, &p->ldw, ctx, &owners[1]);
}

/* An fp32 vector of n on ref's device (optional ones may be absent); writable when `out`. */
static int check_f32_vector(const tensor_arg *t, const tensor_arg *ref, int64_t n, int out) {
    if (!t->present) return 0;
    return tensor_arg_check_dtype(t, RLK_F32) || tensor_arg_check_same_device(t, ref) ||
           rlk_check_vector(t, n) || (out && tensor_arg_check_writable(t));
}

static int check_no_overlaps(const tensor_arg *outs, int n_outs, const tensor_arg *ins, int n_ins) {
    for (int i = 0; i < n_outs; i++) {
        for (int j = 0; j < n_ins; j++)
            if (tensor_arg_check_no_overlap(&outs[i], &ins[j])) return -1;
        for (int j = i + 1; j < n_outs; j++)
            if (tensor_arg_check_no_overlap(&outs[i], &outs[j])) return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------- */
/* linear_logp_fwd(hidden, weight, bias, target, logp, entropy, lse, bad_target_addr,            */
/*                 inv_temperature, ignore_index, backend, stream)                                */
/* bad_target_addr: a host-mapped int32 flag a CUDA kernel sets for an out-of-range target.       */
/* ------------------------------------------------------------------------------------------- */

PyObject *py_linear_logp_fwd(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj[7];
    unsigned long long bad_target_addr, stream;
    double inv_temperature;
    long long ignore_index;
    int backend;
    if (!PyArg_ParseTuple(args, "OOOOOOOKdLiK:linear_logp_fwd", &obj[0], &obj[1], &obj[2], &obj[3],
                          &obj[4], &obj[5], &obj[6], &bad_target_addr, &inv_temperature,
                          &ignore_index, &backend, &stream))
        return NULL;
    static const char *names[7] = {"hidden", "weight", "bias", "target", "logp", "entropy", "lse"};
    static const int optional[7] = {0, 0, 1, 0, 0, 1, 0};
    tensor_arg t[7] = {0};
    int parsed = 0, ok = 1;
    for (; parsed < 7 && ok; parsed++)
        ok = tensor_arg_parse(obj[parsed], names[parsed], optional[parsed], &t[parsed]) == 0;
    rlk_linear_logp_args p = {0};
    ok = ok && prepare_linear_logp(&t[0], &t[1], &t[2], &t[3], &p) == 0 &&
         check_f32_vector(&t[4], &t[0], p.N, 1) == 0 && check_f32_vector(&t[5], &t[0], p.N, 1) == 0 &&
         check_f32_vector(&t[6], &t[0], p.N, 1) == 0 && rlk_check_backend(backend, &t[0]) == 0 &&
         check_no_overlaps(&t[4], 3, t, 4) == 0;
    if (ok && rlk_backend_is_cuda(backend) && bad_target_addr == 0) {
        PyErr_SetString(PyExc_ValueError, "bad_target_addr: a mapped host flag is required on CUDA");
        ok = 0;
    }
    if (ok && p.N > 0) {
        p.ignore_index = ignore_index;
        p.inv_temperature = (float)inv_temperature;
        p.logp = (float *)t[4].data;
        p.entropy = t[5].present ? (float *)t[5].data : NULL;
        p.lse = (float *)t[6].data;
        p.bad_target = (int32_t *)(uintptr_t)bad_target_addr;
        rlk_context ctx = rlk_context_for(backend, stream);
        PyObject *copies[2] = {NULL, NULL};
        const int status = align_operands(&t[0], &t[1], &p, &ctx, copies) != 0
                               ? RLK_PYTHON_ERROR
                               : rlk_run_planned("linear_logp_fwd", backend, &t[0], call_linear_logp_fwd, &p,
                                                 &p.workspace, &ctx);
        Py_XDECREF(copies[0]);
        Py_XDECREF(copies[1]);
        if (status == RLK_BAD_INDEX) {
            PyErr_Format(PyExc_ValueError,
                         "target: a value is outside [0, %lld) and is not ignore_index (%lld)",
                         (long long)p.V, ignore_index);
            ok = 0;
        } else {
            ok = rlk_raise_for_status(status, "linear_logp") == 0;
        }
    }
    rlk_release_all(t, parsed);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------- */
/* The row data of a dz computation: target, lse, entropy, grad_logp, grad_entropy ([rows] each)  */
/* and dlogits [rows, cols] in dtype.                                                              */
/* ------------------------------------------------------------------------------------------- */

enum { ROW_TARGET, ROW_LSE, ROW_ENTROPY, ROW_GRAD_LOGP, ROW_GRAD_ENTROPY, ROW_DATA };

static const char *const row_names[ROW_DATA] = {"target", "lse", "entropy", "grad_logp", "grad_entropy"};
static const int row_optional[ROW_DATA] = {0, 0, 1, 1, 1};

static int check_row_data(const tensor_arg *rows, const tensor_arg *ref, int64_t n) {
    if (tensor_arg_check_same_device(&rows[ROW_TARGET], ref) ||
        tensor_arg_check_dtype(&rows[ROW_TARGET], RLK_I64) || rlk_check_vector(&rows[ROW_TARGET], n))
        return -1;
    for (int i = ROW_LSE; i < ROW_DATA; i++)
        if (check_f32_vector(&rows[i], ref, n, 0)) return -1;
    if (rows[ROW_GRAD_ENTROPY].present && !rows[ROW_ENTROPY].present) {
        PyErr_SetString(PyExc_ValueError, "entropy: required when grad_entropy is given");
        return -1;
    }
    return 0;
}

static void fill_row_data(rlk_linear_logp_dlogits_args *d, const tensor_arg *rows) {
    d->target = (const int64_t *)rows[ROW_TARGET].data;
    d->lse = (const float *)rows[ROW_LSE].data;
    d->entropy = rows[ROW_ENTROPY].present ? (const float *)rows[ROW_ENTROPY].data : NULL;
    d->grad_logp = rows[ROW_GRAD_LOGP].present ? (const float *)rows[ROW_GRAD_LOGP].data : NULL;
    d->grad_entropy = rows[ROW_GRAD_ENTROPY].present ? (const float *)rows[ROW_GRAD_ENTROPY].data : NULL;
}

/* ------------------------------------------------------------------------------------------- */
/* linear_logp_dz(logits, bias, target, lse, entropy, grad_logp, grad_entropy, dlogits, v0,       */
/*                inv_temperature, ignore_index, backend, stream)                                */
/* linear_logp_dlogits(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy,       */
/*                     dlogits, v0, inv_temperature, ignore_index, backend, stream)               */
/* One chunk's dz, from fp32 logits (bias not included) or fused from hidden @ weight^T. The      */
/* backward does not come through here; these let tests compare the two forms bit for bit.       */
/* ------------------------------------------------------------------------------------------- */

static PyObject *run_dz_form(PyObject *args, int fused) {
    PyObject *operands[2], *obj[ROW_DATA + 2]; /* operands: logits (or hidden, weight); then bias */
    long long v0, ignore_index;
    double inv_temperature;
    int backend;
    unsigned long long stream;
    int parsed_ok = fused ? PyArg_ParseTuple(args, "OOOOOOOOOLdLiK:linear_logp_dlogits", &operands[0],
                                             &operands[1], &obj[0], &obj[1], &obj[2], &obj[3], &obj[4],
                                             &obj[5], &obj[6], &v0, &inv_temperature, &ignore_index,
                                             &backend, &stream)
                          : PyArg_ParseTuple(args, "OOOOOOOOLdLiK:linear_logp_dz", &operands[0], &obj[0],
                                             &obj[1], &obj[2], &obj[3], &obj[4], &obj[5], &obj[6], &v0,
                                             &inv_temperature, &ignore_index, &backend, &stream);
    if (!parsed_ok) return NULL;
    /* t: hidden / logits, weight (fused), bias, the row data, dlogits */
    enum { HIDDEN, WEIGHT, BIAS, ROWS, DLOGITS = ROWS + ROW_DATA, COUNT };
    tensor_arg t[COUNT] = {0};
    int ok = tensor_arg_parse(operands[0], fused ? "hidden" : "logits", 0, &t[HIDDEN]) == 0 &&
             (!fused || tensor_arg_parse(operands[1], "weight", 0, &t[WEIGHT]) == 0) &&
             tensor_arg_parse(obj[0], "bias", 1, &t[BIAS]) == 0;
    for (int i = 0; ok && i < ROW_DATA; i++)
        ok = tensor_arg_parse(obj[1 + i], row_names[i], row_optional[i], &t[ROWS + i]) == 0;
    ok = ok && tensor_arg_parse(obj[6], "dlogits", 0, &t[DLOGITS]) == 0;
    rlk_linear_logp_dlogits_args d = {0};
    PyObject *copies[2] = {NULL, NULL};
    rlk_context ctx = rlk_context_for(backend, stream);
    if (ok && fused) {
        rlk_linear_logp_args product = {0};
        ok = prepare_linear_logp(&t[HIDDEN], &t[WEIGHT], &t[BIAS], &t[ROWS + ROW_TARGET], &product) == 0 &&
             rlk_check_backend(backend, &t[HIDDEN]) == 0 &&
             align_operands(&t[HIDDEN], &t[WEIGHT], &product, &ctx, copies) == 0;
        d.rows = product.N, d.cols = product.V, d.D = product.D, d.dtype = product.dtype;
        d.hidden = product.hidden, d.ldh = product.ldh, d.weight = product.weight, d.ldw = product.ldw;
        d.bias = product.bias;
    } else if (ok) {
        tensor_arg *logits = &t[HIDDEN];
        ok = tensor_arg_check_ndim(logits, 2, 2) == 0 && tensor_arg_check_dtype(logits, RLK_F32) == 0 &&
             rlk_check_rows_contiguous(logits, logits->shape[0], logits->shape[1]) == 0;
        if (ok) {
            d.rows = logits->shape[0], d.cols = logits->shape[1];
            d.logits = (const float *)logits->data, d.ld_logits = rlk_row_stride(logits);
            d.dtype = t[DLOGITS].dtype;
            ok = (!t[BIAS].present ||
                  (tensor_arg_check_same_device(&t[BIAS], logits) == 0 &&
                   tensor_arg_check_dtype(&t[BIAS], d.dtype) == 0 && rlk_check_vector(&t[BIAS], d.cols) == 0));
            d.bias = t[BIAS].present ? t[BIAS].data : NULL;
        }
    }
    ok = ok && tensor_arg_check_float(&t[DLOGITS]) == 0 &&
         (!fused || tensor_arg_check_dtype(&t[DLOGITS], d.dtype) == 0) &&
         rlk_check_rows_contiguous(&t[DLOGITS], d.rows, d.cols) == 0 &&
         tensor_arg_check_writable(&t[DLOGITS]) == 0 &&
         tensor_arg_check_same_device(&t[DLOGITS], &t[HIDDEN]) == 0 &&
         check_row_data(&t[ROWS], &t[HIDDEN], d.rows) == 0 && rlk_check_backend(backend, &t[HIDDEN]) == 0 &&
         check_no_overlaps(&t[DLOGITS], 1, t, DLOGITS) == 0;
    if (ok && d.dtype == RLK_F64) {
        PyErr_SetString(PyExc_TypeError, "dlogits: float64 is not supported");
        ok = 0;
    }
    if (ok && d.rows > 0 && d.cols > 0) {
        fill_row_data(&d, &t[ROWS]);
        d.v0 = v0;
        d.ignore_index = ignore_index;
        d.inv_temperature = (float)inv_temperature;
        d.dlogits = t[DLOGITS].data;
        d.ld_dlogits = rlk_row_stride(&t[DLOGITS]);
        ok = rlk_raise_for_status(rlk_run(fused ? "linear_logp_dlogits" : "linear_logp_dz", backend, &t[HIDDEN],
                                          fused ? call_linear_logp_dlogits : call_linear_logp_dz, &d, &ctx, NULL),
                                  fused ? "linear_logp_dlogits" : "linear_logp_dz") == 0;
    }
    Py_XDECREF(copies[0]);
    Py_XDECREF(copies[1]);
    rlk_release_all(t, COUNT);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

PyObject *py_linear_logp_dz(PyObject *self, PyObject *args) {
    (void)self;
    return run_dz_form(args, 0);
}

PyObject *py_linear_logp_dlogits(PyObject *self, PyObject *args) {
    (void)self;
    return run_dz_form(args, 1);
}

/* ------------------------------------------------------------------------------------------- */
/* linear_logp_bwd(hidden, weight, bias, target, lse, entropy, grad_logp, grad_entropy,           */
/*                 grad_hidden, grad_weight, grad_bias, ones, inv_temperature, ignore_index,      */
/*                 vocab_chunk, max_workspace_bytes, backend, stream)                             */
/* grad_hidden [N, D] and grad_weight [V, D] are written; grad_bias fp32 [V] (zeros) accumulates, */
/* or None; ones [N] of 1 in hidden's dtype (with grad_bias). The rows are walked in blocks whose */
/* scratch memory (fp32 dH, dz, fp32 logits where dz is not fused) fits max_workspace_bytes.      */
/* ------------------------------------------------------------------------------------------- */

/* The GEMM out = A @ B (+ C) on the backend's GEMM kernels, with scratch memory `workspace` (NULL, or
 * at least what the plan asks for). With ctx->plan_only it runs nothing and raises
 * ctx->workspace_bytes to the scratch memory this GEMM needs, if that is more. */
static int run_gemm(int backend, const tensor_arg *ref, rlk_context *ctx, void *workspace, int64_t M, int64_t N,
                    int64_t K, rlk_dtype in_dtype, const void *a, int64_t lda, int a_trans, const void *b,
                    int64_t ldb, int b_trans, rlk_dtype out_dtype, void *out, int64_t ldo, const void *c) {
    const rlk_gemm_args g = {.M = M, .N = N, .K = K, .in_dtype = in_dtype, .out_dtype = out_dtype,
                             .a = a, .lda = lda, .a_trans = a_trans, .b = b, .ldb = ldb, .b_trans = b_trans,
                             .c = c, .ldc = c == out ? ldo : 0, .out = out, .ldo = ldo,
                             .alpha = 1.0, .beta = c != NULL ? 1.0 : 0.0, .workspace = workspace};
    const int64_t planned = ctx->workspace_bytes;
    const int status = rlk_run("gemm", backend, ref, call_gemm, &g, ctx, NULL);
    if (ctx->plan_only && ctx->workspace_bytes < planned) ctx->workspace_bytes = planned;
    return status;
}

/* One vocabulary chunk's GEMMs after its dz, for a block of rows: dH (+)= dz @ W_chunk (fp32, in the
 * workspace), dW_chunk (+)= dz^T @ H_rows, db_chunk += 1^T dz. */
typedef struct chunk_gemms {
    int64_t rows, cols, D;
    rlk_dtype dtype;
    const void *dz;                   /* [rows, cols] */
    const void *w_chunk, *h_rows;     /* weight [cols, D], hidden [rows, D] (row strides ldw, ldh) */
    int64_t ldw, ldh;
    float *dh;                        /* [rows, D] fp32; accumulated into after the first chunk */
    void *dw;                         /* grad_weight [cols, D] (row stride ld_dw); accumulated from the second block */
    int64_t ld_dw;
    float *db;                        /* grad_bias [cols] fp32, or NULL */
    const void *ones;                 /* [rows] of 1, with db */
    int first_chunk, first_block;
} chunk_gemms;

static int run_chunk_gemms(int backend, const tensor_arg *ref, rlk_context *ctx, void *workspace,
                           const chunk_gemms *c) {
    int status = run_gemm(backend, ref, ctx, workspace, c->rows, c->D, c->cols, c->dtype, c->dz, c->cols, 0,
                          c->w_chunk, c->ldw, 0, RLK_F32, c->dh, c->D, c->first_chunk ? NULL : c->dh);
    if (status == RLK_OK)
        status = run_gemm(backend, ref, ctx, workspace, c->cols, c->D, c->rows, c->dtype, c->dz, c->cols, 1,
                          c->h_rows, c->ldh, 0, c->dtype, c->dw, c->ld_dw, c->first_block ? NULL : c->dw);
    if (status == RLK_OK && c->db != NULL)
        status = run_gemm(backend, ref, ctx, workspace, 1, c->cols, c->rows, c->dtype, c->ones, c->rows, 0, c->dz,
                          c->cols, 0, RLK_F32, c->db, c->cols, c->db);
    return status;
}

/* The chunk's fp32 logits H_rows @ W_chunk^T, where dz is formed off the fused path. */
static int run_logits_gemm(int backend, const tensor_arg *ref, rlk_context *ctx, void *workspace,
                           const chunk_gemms *c, float *logits) {
    return run_gemm(backend, ref, ctx, workspace, c->rows, c->cols, c->D, c->dtype, c->h_rows, c->ldh, 0, c->w_chunk,
                    c->ldw, 1, RLK_F32, logits, c->cols, NULL);
}

/* The chunk GEMMs of the block of rows from r0 and the vocabulary chunk from v0. */
static chunk_gemms chunk_gemms_at(const rlk_linear_logp_args *p, int64_t block, int64_t chunk, int64_t r0,
                                  int64_t v0, const void *dz, float *dh, const tensor_arg *grad_weight,
                                  const tensor_arg *grad_bias, const tensor_arg *ones) {
    const int64_t elem = (int64_t)rlk_dtype_size(p->dtype), ld_dw = rlk_row_stride(grad_weight);
    const int64_t cols = p->V - v0 < chunk ? p->V - v0 : chunk;
    const chunk_gemms c = {.rows = p->N - r0 < block ? p->N - r0 : block, .cols = cols, .D = p->D,
                           .dtype = p->dtype, .dz = dz, .w_chunk = (const char *)p->weight + v0 * p->ldw * elem,
                           .h_rows = (const char *)p->hidden + r0 * p->ldh * elem, .ldw = p->ldw, .ldh = p->ldh,
                           .dh = dh, .dw = (char *)grad_weight->data + v0 * ld_dw * elem, .ld_dw = ld_dw,
                           .db = grad_bias->present ? (float *)grad_bias->data + v0 : NULL,
                           .ones = ones->present ? (const char *)ones->data + r0 * elem : NULL,
                           .first_chunk = v0 == 0, .first_block = r0 == 0};
    return c;
}

/* Bytes rounded up so that the next buffer carved from the workspace stays 256-byte aligned. */
static int64_t aligned_bytes(int64_t bytes) { return (bytes + 255) / 256 * 256; }

PyObject *py_linear_logp_bwd(PyObject *self, PyObject *args) {
    (void)self;
    enum { HIDDEN, WEIGHT, BIAS, ROWS, GRAD_HIDDEN = ROWS + ROW_DATA, GRAD_WEIGHT, GRAD_BIAS, ONES, COUNT };
    PyObject *obj[COUNT];
    int backend;
    double inv_temperature;
    long long ignore_index, vocab_chunk, max_workspace_bytes;
    unsigned long long stream;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOdLLLiK:linear_logp_bwd", &obj[HIDDEN], &obj[WEIGHT], &obj[BIAS],
                          &obj[ROWS], &obj[ROWS + 1], &obj[ROWS + 2], &obj[ROWS + 3], &obj[ROWS + 4],
                          &obj[GRAD_HIDDEN], &obj[GRAD_WEIGHT], &obj[GRAD_BIAS], &obj[ONES], &inv_temperature,
                          &ignore_index, &vocab_chunk, &max_workspace_bytes, &backend, &stream))
        return NULL;
    static const char *const names[COUNT] = {"hidden", "weight", "bias", "target", "lse", "entropy",
                                             "grad_logp", "grad_entropy", "grad_hidden", "grad_weight",
                                             "grad_bias", "ones"};
    static const int optional[COUNT] = {0, 0, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1};
    tensor_arg t[COUNT] = {0};
    int parsed = 0, ok = 1;
    for (; parsed < COUNT && ok; parsed++)
        ok = tensor_arg_parse(obj[parsed], names[parsed], optional[parsed], &t[parsed]) == 0;
    rlk_linear_logp_args p = {0};
    ok = ok && prepare_linear_logp(&t[HIDDEN], &t[WEIGHT], &t[BIAS], &t[ROWS + ROW_TARGET], &p) == 0 &&
         check_row_data(&t[ROWS], &t[HIDDEN], p.N) == 0 && rlk_check_backend(backend, &t[HIDDEN]) == 0;
    const rlk_dtype dtype = p.dtype;
    for (int i = GRAD_HIDDEN; ok && i <= GRAD_WEIGHT; i++)
        ok = tensor_arg_check_dtype(&t[i], dtype) == 0 && tensor_arg_check_same_device(&t[i], &t[HIDDEN]) == 0 &&
             rlk_check_rows_contiguous(&t[i], i == GRAD_HIDDEN ? p.N : p.V, p.D) == 0 &&
             tensor_arg_check_writable(&t[i]) == 0;
    ok = ok && check_f32_vector(&t[GRAD_BIAS], &t[HIDDEN], p.V, 1) == 0 &&
         check_no_overlaps(&t[GRAD_HIDDEN], 3, t, GRAD_HIDDEN) == 0;
    if (ok && (t[GRAD_BIAS].present != t[BIAS].present || t[ONES].present != t[BIAS].present)) {
        PyErr_SetString(PyExc_ValueError, "grad_bias, ones: required exactly when bias is given");
        ok = 0;
    }
    ok = ok && (!t[ONES].present || (tensor_arg_check_dtype(&t[ONES], dtype) == 0 &&
                                     tensor_arg_check_same_device(&t[ONES], &t[HIDDEN]) == 0 &&
                                     rlk_check_vector(&t[ONES], p.N) == 0));
    if (ok && (vocab_chunk < 1 || max_workspace_bytes < 1)) {
        PyErr_SetString(PyExc_ValueError, "vocab_chunk, max_workspace_bytes: must be >= 1");
        ok = 0;
    }
    PyObject *workspace = NULL, *gemm_workspace = NULL, *copies[2] = {NULL, NULL};
    rlk_context ctx = rlk_context_for(backend, stream);
    ok = ok && (p.N == 0 || align_operands(&t[HIDDEN], &t[WEIGHT], &p, &ctx, copies) == 0);
    int whole = 0; /* the backend ran the whole backward itself */
    if (ok && p.N > 0) {
        rlk_linear_logp_dlogits_args rows = {0};
        fill_row_data(&rows, &t[ROWS]);
        rlk_linear_logp_bwd_args b = {
            .N = p.N, .D = p.D, .V = p.V, .dtype = p.dtype, .hidden = p.hidden, .weight = p.weight, .bias = p.bias,
            .ldh = p.ldh, .ldw = p.ldw, .target = rows.target, .ignore_index = ignore_index,
            .inv_temperature = (float)inv_temperature, .lse = rows.lse, .entropy = rows.entropy,
            .grad_logp = rows.grad_logp, .grad_entropy = rows.grad_entropy,
            .grad_hidden = t[GRAD_HIDDEN].data, .grad_weight = t[GRAD_WEIGHT].data,
            .ld_grad_hidden = rlk_row_stride(&t[GRAD_HIDDEN]), .ld_grad_weight = rlk_row_stride(&t[GRAD_WEIGHT]),
            .grad_bias = t[GRAD_BIAS].present ? (float *)t[GRAD_BIAS].data : NULL,
            .max_workspace_bytes = max_workspace_bytes};
        const int status = rlk_run_planned("linear_logp_bwd", backend, &t[HIDDEN], call_linear_logp_bwd, &b,
                                           &b.workspace, &ctx);
        whole = status != RLK_UNSUPPORTED;
        if (whole) ok = rlk_raise_for_status(status, "linear_logp backward") == 0;
    }
    if (ok && p.N > 0 && !whole) {
        const int64_t N = p.N, D = p.D, V = p.V, chunk = V < vocab_chunk ? V : vocab_chunk;
        const int64_t elem = (int64_t)rlk_dtype_size(dtype);
        /* does the backend form dz in one kernel for these operands? (then no fp32 logits are needed) */
        rlk_linear_logp_dlogits_args d = {.rows = N, .cols = chunk, .D = D, .dtype = dtype, .hidden = p.hidden,
                                          .ldh = p.ldh, .weight = p.weight, .ldw = p.ldw, .bias = p.bias,
                                          .ignore_index = ignore_index, .inv_temperature = (float)inv_temperature};
        ctx.plan_only = 1;
        const int plan = rlk_run("linear_logp_dlogits", backend, &t[HIDDEN], call_linear_logp_dlogits, &d, &ctx, NULL);
        ctx.plan_only = 0;
        const int fused = plan == RLK_OK;
        ok = plan != RLK_PYTHON_ERROR;
        /* rows per block: each row needs its fp32 dH, its dz chunk and, unfused, its fp32 logits */
        const int64_t bytes_per_row = 4 * D + chunk * (elem + (fused ? 0 : 4));
        const int64_t max_block = max_workspace_bytes / bytes_per_row < 1 ? 1 : max_workspace_bytes / bytes_per_row;
        /* as few blocks as fit, of equal size rounded up to whole 128-row tiles where that still fits
         * (16384 rows at D = 4096: four blocks of 4096, not three of 5120 and one of 1024); dH rows
         * do not depend on the blocks, dW's one rounding per block does */
        const int64_t blocks = (N + max_block - 1) / max_block;
        int64_t block = (N + blocks - 1) / blocks;
        block = (block + 127) / 128 * 128 <= max_block ? (block + 127) / 128 * 128 : block;
        block = block > N ? N : block;
        const int64_t dh_bytes = aligned_bytes(4 * block * D), dz_bytes = aligned_bytes(elem * block * chunk);
        void *ws_data = NULL;
        ok = ok && rlk_new_workspace(&t[HIDDEN], dh_bytes + dz_bytes + (fused ? 0 : 4 * block * chunk), &workspace,
                                     &ws_data) == 0;
        char *ws = ws_data;
        float *dh = (float *)ws;
        void *dz = ws + dh_bytes;
        float *logits = fused ? NULL : (float *)(ws + dh_bytes + dz_bytes);
        /* the GEMMs' scratch memory (sm90: stream-K where whole tiles would leave a wave partly empty, and
         * the K chains' running sums from K = 65536 on), planned for the first and last block and chunk:
         * the plans depend on the GEMMs' shapes only, and every other block and chunk has the first's */
        int status = ok ? RLK_OK : RLK_PYTHON_ERROR;
        ctx.plan_only = 1;
        ctx.workspace_bytes = 0;
        const int64_t last_r0 = (N - 1) / block * block, last_v0 = (V - 1) / chunk * chunk;
        for (int i = 0; i < 4 && status == RLK_OK; i++) {
            const chunk_gemms c = chunk_gemms_at(&p, block, chunk, i % 2 ? last_r0 : 0, i / 2 ? last_v0 : 0, dz, dh,
                                                 &t[GRAD_WEIGHT], &t[GRAD_BIAS], &t[ONES]);
            status = run_chunk_gemms(backend, &t[HIDDEN], &ctx, NULL, &c);
            if (status == RLK_OK && !fused) status = run_logits_gemm(backend, &t[HIDDEN], &ctx, NULL, &c, logits);
        }
        ctx.plan_only = 0;
        void *gemm_ws = NULL;
        if (status == RLK_OK && ctx.workspace_bytes > 0 &&
            rlk_new_workspace(&t[HIDDEN], ctx.workspace_bytes, &gemm_workspace, &gemm_ws) != 0)
            status = RLK_PYTHON_ERROR;
        for (int64_t r0 = 0; status == RLK_OK && r0 < N; r0 += block) {
            const int64_t rows = N - r0 < block ? N - r0 : block;
            d.rows = rows;
            d.hidden = (const char *)p.hidden + r0 * p.ldh * elem;
            d.target = (const int64_t *)t[ROWS + ROW_TARGET].data + r0;
            d.lse = (const float *)t[ROWS + ROW_LSE].data + r0;
            d.entropy = t[ROWS + ROW_ENTROPY].present ? (const float *)t[ROWS + ROW_ENTROPY].data + r0 : NULL;
            d.grad_logp = t[ROWS + ROW_GRAD_LOGP].present ? (const float *)t[ROWS + ROW_GRAD_LOGP].data + r0 : NULL;
            d.grad_entropy =
                t[ROWS + ROW_GRAD_ENTROPY].present ? (const float *)t[ROWS + ROW_GRAD_ENTROPY].data + r0 : NULL;
            for (int64_t v0 = 0; status == RLK_OK && v0 < V; v0 += chunk) {
                const chunk_gemms c = chunk_gemms_at(&p, block, chunk, r0, v0, dz, dh, &t[GRAD_WEIGHT],
                                                     &t[GRAD_BIAS], &t[ONES]);
                d.cols = c.cols, d.v0 = v0, d.weight = c.w_chunk;
                d.bias = p.bias != NULL ? (const char *)p.bias + v0 * elem : NULL;
                d.dlogits = dz, d.ld_dlogits = c.cols;
                if (fused) {
                    status = rlk_run("linear_logp_dlogits", backend, &t[HIDDEN], call_linear_logp_dlogits, &d, &ctx,
                                     NULL);
                } else {
                    status = run_logits_gemm(backend, &t[HIDDEN], &ctx, gemm_ws, &c, logits);
                    d.logits = logits, d.ld_logits = c.cols;
                    if (status == RLK_OK)
                        status = rlk_run("linear_logp_dz", backend, &t[HIDDEN], call_linear_logp_dz, &d, &ctx, NULL);
                }
                if (status == RLK_OK) status = run_chunk_gemms(backend, &t[HIDDEN], &ctx, gemm_ws, &c);
            }
            if (status == RLK_OK) { /* the block's dH, accumulated in fp32, stored once in the dtype */
                const int64_t ld_grad_hidden = rlk_row_stride(&t[GRAD_HIDDEN]);
                const rlk_convert_args store = {.rows = rows, .cols = D, .in_dtype = RLK_F32, .out_dtype = dtype,
                                                .in = dh, .ld_in = D,
                                                .out = t[GRAD_HIDDEN].data + r0 * ld_grad_hidden * elem,
                                                .ld_out = ld_grad_hidden};
                status = rlk_run("convert", backend, &t[HIDDEN], call_convert, &store, &ctx, NULL);
            }
        }
        ok = rlk_raise_for_status(status, "linear_logp backward") == 0;
    }
    Py_XDECREF(workspace);
    Py_XDECREF(gemm_workspace);
    Py_XDECREF(copies[0]);
    Py_XDECREF(copies[1]);
    rlk_release_all(t, parsed);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}
