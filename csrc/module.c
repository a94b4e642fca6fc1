/* module.c: rl_kernels._C, the CPython extension: its method table and module init, nothing else.
 *
 * Each method py_<name> lives in csrc/bind/<op>.c: it takes tensors as DLPack capsules or
 * DLPack-exporting objects (bind/tensor_arg.h), plain scalars, a backend code (an index into
 * _C.backends()) and, for CUDA tensors, the stream handle as an integer; it validates everything
 * (errors are TypeError / ValueError naming the argument) and runs the op's kernels through the
 * table generated from csrc/kernels.def (bind/common.h).
 *
 * Build: pip install --no-build-isolation -e .   (setup.py compiles csrc/module.c, the csrc/bind files and
 * the sources that kernels.def lists, the .cu ones when nvcc is found).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bind/common.h"

/* The method table, one row per method: X(name, docstring). */
#define RLK_METHODS(X)                                                                             \
    X(gemm, "gemm(a, b, c, out, alpha, beta, backend, stream, out_dtype=-1): out = alpha * a @ b + " \
            "beta * c; out=None allocates it (dtype code out_dtype, -1: a's) and returns it")        \
    X(linear_logp_fwd, "linear_logp_fwd(hidden, weight, bias, target, logp, entropy, lse, "          \
                       "bad_target_addr, inv_temperature, ignore_index, backend, stream)")            \
    X(linear_logp_bwd, "linear_logp_bwd(hidden, weight, bias, target, lse, entropy, grad_logp, "     \
                       "grad_entropy, grad_hidden, grad_weight, grad_bias, ones, inv_temperature, "   \
                       "ignore_index, vocab_chunk, max_workspace_bytes, backend, stream)")            \
    X(linear_logp_dz, "linear_logp_dz(logits, bias, target, lse, entropy, grad_logp, grad_entropy, " \
                      "dlogits, v0, inv_temperature, ignore_index, backend, stream)")                \
    X(linear_logp_dlogits, "linear_logp_dlogits(hidden, weight, bias, target, lse, entropy, "        \
                           "grad_logp, grad_entropy, dlogits, v0, inv_temperature, ignore_index, "    \
                           "backend, stream)")                                                 \
    X(attention_fwd, "attention_fwd(q, k, v, out, lse, q_start, q_len, k_start, k_len, max_q_len, "  \
                     "max_k_len, causal, softmax_scale, bad_index_addr, backend, stream)")            \
    X(attention_bwd, "attention_bwd(q, k, v, out, lse, dout, dq, dk, dv, q_start, q_len, k_start, "  \
                     "k_len, max_q_len, max_k_len, causal, softmax_scale, bad_index_addr, backend, "  \
                     "stream)")

#define RLK_DECLARE_METHOD(name, doc) PyObject *py_##name(PyObject *self, PyObject *args);
RLK_METHODS(RLK_DECLARE_METHOD)

static PyObject *py_backends(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return rlk_backends_tuple();
}

static PyObject *py_kernels(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return rlk_kernels_tuple();
}

static PyObject *py_last_kernel(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(rlk_last_kernel());
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *args) {
    (void)self;
    int n;
    if (!PyArg_ParseTuple(args, "i:set_num_threads", &n)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "num_threads: must be >= 0 (0 = OpenMP default)");
        return NULL;
    }
    rlk_set_num_threads(n);
    Py_RETURN_NONE;
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(rlk_num_threads());
}

#define RLK_METHOD_ROW(name, doc) {#name, py_##name, METH_VARARGS, doc},
static PyMethodDef methods[] = {
    RLK_METHODS(RLK_METHOD_ROW)
    {"backends", py_backends, METH_NOARGS,
     "the BACKEND rows of kernels.def: (name, device, min_cc, max_cc, fallback); a backend's code "
     "is its index"},
    {"kernels", py_kernels, METH_NOARGS,
     "the KERNEL rows of kernels.def compiled into this build: (entry, backend, source)"},
    {"last_kernel", py_last_kernel, METH_NOARGS,
     "the kernel that ran the last launch of this thread, e.g. 'gemm_sm90'"},
    {"set_num_threads", py_set_num_threads, METH_VARARGS, "threads for CPU kernels (0 = OpenMP default)"},
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
    if (PyModule_AddIntConstant(m, "DTYPE_F32", RLK_F32) || PyModule_AddIntConstant(m, "DTYPE_BF16", RLK_BF16) ||
        PyModule_AddIntConstant(m, "DTYPE_F16", RLK_F16) || PyModule_AddIntConstant(m, "DTYPE_F64", RLK_F64) ||
        PyModule_AddIntConstant(m, "DTYPE_I32", RLK_I32) || PyModule_AddIntConstant(m, "DTYPE_I64", RLK_I64)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
