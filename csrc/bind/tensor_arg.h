/* tensor_arg.h: turning a Python argument into a validated, borrowed view of a DLPack tensor.
 *
 * An argument may be
 *   - a DLPack capsule, "dltensor_versioned" (DLPack >= 1.0) or legacy "dltensor": consumed as the
 *     spec says (renamed to "used_...", its deleter called when the call ends); an already
 *     consumed capsule is refused;
 *   - an object whose type exports __dlpack_c_exchange_api__ (torch >= 2.10): read through the
 *     C exchange table without building a capsule (the fast path for torch tensors);
 *   - any other object with __dlpack__ (numpy arrays, ...): its capsule is taken as above.
 * Every error is a Python exception (TypeError / ValueError) whose message names the argument.
 */
#ifndef RLK_TENSOR_ARG_H_
#define RLK_TENSOR_ARG_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <ATen/dlpack.h>

#include "../rlk.h"

#define RLK_MAX_NDIM 4

typedef struct tensor_arg {
    const char *name;     /* the argument name used in error messages */
    int present;          /* 0 for an optional argument given as None */
    char *data;           /* data pointer with byte_offset applied */
    int ndim;
    int64_t shape[RLK_MAX_NDIM];
    int64_t strides[RLK_MAX_NDIM]; /* in elements, filled in for compact tensors too */
    rlk_dtype dtype;
    int elem_size;
    DLDevice device;
    int read_only;
    const DLPackExchangeAPI *api; /* the producer's exchange table, when it has one */
    /* owners, released by tensor_arg_release */
    PyObject *owned_capsule;
    DLManagedTensorVersioned *managed_versioned;
    DLManagedTensor *managed_legacy;
} tensor_arg;

/* Fills *t from obj. optional: None gives t->present = 0. Returns 0, or -1 with an exception set. */
int tensor_arg_parse(PyObject *obj, const char *name, int optional, tensor_arg *t);
void tensor_arg_release(tensor_arg *t);

/* A new, uninitialized tensor of the framework that produced ref (through its exchange table's
 * allocator), on ref's device; `what` names it in errors. Returns a new reference, or NULL with an
 * exception set. */
PyObject *tensor_arg_new_like(const tensor_arg *ref, const char *what, int ndim,
                              const int64_t *shape, rlk_dtype dtype);

/* Checks on a parsed argument; each returns 0, or -1 with an exception naming the argument. */
int tensor_arg_check_ndim(const tensor_arg *t, int min_ndim, int max_ndim);
int tensor_arg_check_float(const tensor_arg *t);          /* fp32, bf16, fp16 or fp64 */
int tensor_arg_check_dtype(const tensor_arg *t, rlk_dtype dtype);
int tensor_arg_check_same_device(const tensor_arg *t, const tensor_arg *ref);
int tensor_arg_check_writable(const tensor_arg *t);
/* The span of bytes [lo, hi) the tensor touches; -1 with OverflowError if sizes overflow. */
int tensor_arg_span(const tensor_arg *t, uintptr_t *lo, uintptr_t *hi);
/* ValueError if the memory of out overlaps that of in. */
int tensor_arg_check_no_overlap(const tensor_arg *out, const tensor_arg *in);

/* The last two dims as a matrix for a GEMM operand: row-major (trans = 0, ld = row stride) or a
 * transposed view (trans = 1, ld = column stride). Anything else: ValueError asking for a
 * contiguous tensor. */
int tensor_arg_matrix_layout(const tensor_arg *t, int64_t *ld, int *trans);

const char *rlk_dtype_name(rlk_dtype dtype);

#endif /* RLK_TENSOR_ARG_H_ */
