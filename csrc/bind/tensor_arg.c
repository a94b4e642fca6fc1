/* tensor_arg.c: DLPack intake and argument validation for the binding layer (see tensor_arg.h). */
#include "tensor_arg.h"

#include <string.h>

static const char *const CAPSULE_VERSIONED = "dltensor_versioned";
static const char *const CAPSULE_LEGACY = "dltensor";
static const char *const CAPSULE_USED_VERSIONED = "used_dltensor_versioned";
static const char *const CAPSULE_USED_LEGACY = "used_dltensor";

const char *rlk_dtype_name(rlk_dtype dtype) {
    switch (dtype) {
    case RLK_F32: return "float32";
    case RLK_BF16: return "bfloat16";
    case RLK_F16: return "float16";
    case RLK_F64: return "float64";
    case RLK_I32: return "int32";
    case RLK_I64: return "int64";
    }
    return "unknown";
}

/* A small cache of exchange tables by type: calls see torch.Tensor and nn.Parameter mostly. */
#define EXCHANGE_CACHE_SIZE 4
static PyTypeObject *exchange_types[EXCHANGE_CACHE_SIZE];
static const DLPackExchangeAPI *exchange_apis[EXCHANGE_CACHE_SIZE];
static int exchange_next;

static const DLPackExchangeAPI *exchange_api_for(PyObject *obj) {
    PyTypeObject *type = Py_TYPE(obj);
    for (int i = 0; i < EXCHANGE_CACHE_SIZE; i++)
        if (exchange_types[i] == type) return exchange_apis[i];
    PyObject *capsule = PyObject_GetAttrString((PyObject *)type, "__dlpack_c_exchange_api__");
    if (capsule == NULL) {
        PyErr_Clear();
        return NULL;
    }
    const DLPackExchangeAPI *api = NULL;
    if (PyCapsule_IsValid(capsule, "dlpack_exchange_api")) {
        api = (const DLPackExchangeAPI *)PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
        /* The table must stay alive for the process (the spec says so); we only read it. */
        if (api != NULL && (api->header.version.major != DLPACK_MAJOR_VERSION ||
                            api->dltensor_from_py_object_no_sync == NULL))
            api = NULL;
    }
    Py_DECREF(capsule);
    if (api != NULL) { /* types are immortal enough here: a cached type is only compared */
        exchange_types[exchange_next] = type;
        exchange_apis[exchange_next] = api;
        exchange_next = (exchange_next + 1) % EXCHANGE_CACHE_SIZE;
    }
    return api;
}

static int fill_from_dltensor(tensor_arg *t, const DLTensor *dl) {
    if (dl->ndim < 0 || dl->ndim > RLK_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "%s: expected at most %d dimensions, got %d", t->name,
                     RLK_MAX_NDIM, (int)dl->ndim);
        return -1;
    }
    if (dl->dtype.lanes != 1) {
        PyErr_Format(PyExc_TypeError, "%s: vector dtypes (lanes=%d) are not supported", t->name,
                     (int)dl->dtype.lanes);
        return -1;
    }
    const int code = dl->dtype.code, bits = dl->dtype.bits;
    if (code == kDLFloat && bits == 32) t->dtype = RLK_F32;
    else if (code == kDLBfloat && bits == 16) t->dtype = RLK_BF16;
    else if (code == kDLFloat && bits == 16) t->dtype = RLK_F16;
    else if (code == kDLFloat && bits == 64) t->dtype = RLK_F64;
    else if (code == kDLInt && bits == 32) t->dtype = RLK_I32;
    else if (code == kDLInt && bits == 64) t->dtype = RLK_I64;
    else {
        static const char *const kinds[] = {"int", "uint", "float", "opaque handle", "bfloat",
                                            "complex", "bool"};
        const char *kind = code >= 0 && code < (int)(sizeof kinds / sizeof kinds[0]) ? kinds[code]
                                                                                    : "unknown";
        PyErr_Format(PyExc_TypeError,
                     "%s: unsupported dtype %s%d; expected float32, bfloat16, float16, float64, "
                     "int32 or int64", t->name, kind, bits);
        return -1;
    }
    t->elem_size = bits / 8;
    if (dl->device.device_type != kDLCPU && dl->device.device_type != kDLCUDA &&
        dl->device.device_type != kDLCUDAHost) {
        PyErr_Format(PyExc_ValueError, "%s: unsupported device type %d (CPU or CUDA tensors only)",
                     t->name, (int)dl->device.device_type);
        return -1;
    }
    t->device = dl->device;
    if (t->device.device_type == kDLCUDAHost) t->device.device_type = kDLCPU;
    t->ndim = dl->ndim;
    int64_t compact = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        t->shape[d] = dl->shape[d];
        if (t->shape[d] < 0) {
            PyErr_Format(PyExc_ValueError, "%s: negative size in dimension %d", t->name, d);
            return -1;
        }
        t->strides[d] = dl->strides ? dl->strides[d] : compact;
        compact *= t->shape[d];
    }
    t->data = (char *)dl->data + dl->byte_offset;
    return 0;
}

static int consume_capsule(tensor_arg *t, PyObject *capsule) {
    if (PyCapsule_IsValid(capsule, CAPSULE_VERSIONED)) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, CAPSULE_VERSIONED);
        if (m == NULL) return -1;
        if (PyCapsule_SetName(capsule, CAPSULE_USED_VERSIONED) != 0) return -1;
        t->managed_versioned = m; /* ours now: the deleter runs in tensor_arg_release */
        if (m->version.major != DLPACK_MAJOR_VERSION) {
            PyErr_Format(PyExc_ValueError, "%s: DLPack major version %u is not supported (need %d)",
                         t->name, m->version.major, DLPACK_MAJOR_VERSION);
            return -1;
        }
        t->read_only = (m->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
        return fill_from_dltensor(t, &m->dl_tensor);
    }
    if (PyCapsule_IsValid(capsule, CAPSULE_LEGACY)) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, CAPSULE_LEGACY);
        if (m == NULL) return -1;
        if (PyCapsule_SetName(capsule, CAPSULE_USED_LEGACY) != 0) return -1;
        t->managed_legacy = m;
        return fill_from_dltensor(t, &m->dl_tensor);
    }
    if (PyCapsule_IsValid(capsule, CAPSULE_USED_VERSIONED) ||
        PyCapsule_IsValid(capsule, CAPSULE_USED_LEGACY)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: this DLPack capsule was already consumed; export the tensor again",
                     t->name);
        return -1;
    }
    const char *capsule_name = PyCapsule_GetName(capsule);
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: capsule named '%s' is not a DLPack tensor", t->name,
                 capsule_name ? capsule_name : "(null)");
    return -1;
}

static PyObject *call_dunder_dlpack(PyObject *obj) {
    PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
    if (method == NULL) return NULL;
    PyObject *kwargs = Py_BuildValue("{s:(ii)}", "max_version", DLPACK_MAJOR_VERSION, 0);
    PyObject *empty = PyTuple_New(0);
    PyObject *capsule = NULL;
    if (kwargs != NULL && empty != NULL) {
        capsule = PyObject_Call(method, empty, kwargs);
        if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear(); /* a producer older than DLPack 1.0 has no max_version */
            capsule = PyObject_Call(method, empty, NULL);
        }
    }
    Py_XDECREF(kwargs);
    Py_XDECREF(empty);
    Py_DECREF(method);
    return capsule;
}

/* Replaces the pending exception with a TypeError "<name>: <what>: <original message>". */
static void reraise_with_name(const char *name, const char *what) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *msg = value ? PyObject_Str(value) : NULL;
    const char *text = msg ? PyUnicode_AsUTF8(msg) : NULL;
    if (text == NULL) text = "unknown error";
    /* torch's C++ errors append the C++ frames after this line: the message alone */
    const char *frames = strstr(text, "\nException raised from");
    PyObject *first = PyUnicode_FromStringAndSize(text, frames ? frames - text : (Py_ssize_t)strlen(text));
    if (first != NULL) PyErr_Format(PyExc_TypeError, "%s: %s: %U", name, what, first);
    Py_XDECREF(first);
    Py_XDECREF(msg);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
}

int tensor_arg_parse(PyObject *obj, const char *name, int optional, tensor_arg *t) {
    memset(t, 0, sizeof(*t));
    t->name = name;
    if (obj == Py_None) {
        if (optional) return 0;
        PyErr_Format(PyExc_TypeError, "%s: expected a tensor, got None", name);
        return -1;
    }
    t->present = 1;
    if (PyCapsule_CheckExact(obj)) return consume_capsule(t, obj);

    const DLPackExchangeAPI *api = exchange_api_for(obj);
    if (api != NULL) {
        DLTensor view;
        if (api->dltensor_from_py_object_no_sync(obj, &view) != 0) {
            reraise_with_name(name, "cannot be exported through DLPack");
            return -1;
        }
        t->api = api;
        return fill_from_dltensor(t, &view); /* borrowed: obj is alive for the whole call */
    }
    if (!PyObject_HasAttrString(obj, "__dlpack__")) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected a DLPack capsule or an object with __dlpack__, got %s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *capsule = call_dunder_dlpack(obj);
    if (capsule == NULL) {
        reraise_with_name(name, "cannot be exported through DLPack");
        return -1;
    }
    t->owned_capsule = capsule;
    if (!PyCapsule_CheckExact(capsule)) {
        PyErr_Format(PyExc_TypeError, "%s: __dlpack__ did not return a capsule", name);
        return -1;
    }
    return consume_capsule(t, capsule);
}

static void set_allocation_error(void *context, const char *kind, const char *message) {
    PyErr_Format(PyExc_RuntimeError, "%s: allocation failed (%s): %s", (const char *)context, kind,
                 message);
}

PyObject *tensor_arg_new_like(const tensor_arg *ref, const char *what, int ndim,
                              const int64_t *shape, rlk_dtype dtype) {
    if (ref->api == NULL || ref->api->managed_tensor_allocator == NULL ||
        ref->api->managed_tensor_to_py_object_no_sync == NULL) {
        PyErr_Format(PyExc_TypeError,
                     "%s needs %s to come from a framework with a DLPack exchange table "
                     "(torch >= 2.10)", what, ref->name);
        return NULL;
    }
    static const DLDataType codes[] = {
        [RLK_F32] = {kDLFloat, 32, 1}, [RLK_BF16] = {kDLBfloat, 16, 1},
        [RLK_F16] = {kDLFloat, 16, 1}, [RLK_F64] = {kDLFloat, 64, 1},
        [RLK_I32] = {kDLInt, 32, 1},   [RLK_I64] = {kDLInt, 64, 1}};
    DLTensor prototype;
    memset(&prototype, 0, sizeof(prototype));
    prototype.device = ref->device;
    prototype.ndim = ndim;
    prototype.dtype = codes[dtype];
    prototype.shape = (int64_t *)shape;
    DLManagedTensorVersioned *managed = NULL;
    if (ref->api->managed_tensor_allocator(&prototype, &managed, (void *)what, set_allocation_error) != 0)
        return NULL;
    void *object = NULL;
    if (ref->api->managed_tensor_to_py_object_no_sync(managed, &object) != 0) return NULL;
    return (PyObject *)object;
}

void tensor_arg_release(tensor_arg *t) {
    if (t->managed_versioned != NULL && t->managed_versioned->deleter != NULL)
        t->managed_versioned->deleter(t->managed_versioned);
    if (t->managed_legacy != NULL && t->managed_legacy->deleter != NULL)
        t->managed_legacy->deleter(t->managed_legacy);
    Py_XDECREF(t->owned_capsule);
    t->managed_versioned = NULL;
    t->managed_legacy = NULL;
    t->owned_capsule = NULL;
}

int tensor_arg_check_ndim(const tensor_arg *t, int min_ndim, int max_ndim) {
    if (t->ndim >= min_ndim && t->ndim <= max_ndim) return 0;
    if (min_ndim == max_ndim)
        PyErr_Format(PyExc_ValueError, "%s: expected a %d-D tensor, got %d-D", t->name, min_ndim,
                     t->ndim);
    else
        PyErr_Format(PyExc_ValueError, "%s: expected a %d-D to %d-D tensor, got %d-D", t->name,
                     min_ndim, max_ndim, t->ndim);
    return -1;
}

int tensor_arg_check_float(const tensor_arg *t) {
    if (t->dtype != RLK_I32 && t->dtype != RLK_I64) return 0;
    PyErr_Format(PyExc_TypeError, "%s: expected a floating point tensor, got %s", t->name,
                 rlk_dtype_name(t->dtype));
    return -1;
}

int tensor_arg_check_dtype(const tensor_arg *t, rlk_dtype dtype) {
    if (t->dtype == dtype) return 0;
    PyErr_Format(PyExc_TypeError, "%s: expected dtype %s, got %s", t->name, rlk_dtype_name(dtype),
                 rlk_dtype_name(t->dtype));
    return -1;
}

static const char *device_name(DLDevice d) { return d.device_type == kDLCUDA ? "cuda" : "cpu"; }

int tensor_arg_check_same_device(const tensor_arg *t, const tensor_arg *ref) {
    if (t->device.device_type == ref->device.device_type &&
        (t->device.device_type == kDLCPU || t->device.device_id == ref->device.device_id))
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: is on %s:%d but %s is on %s:%d", t->name,
                 device_name(t->device), (int)t->device.device_id, ref->name,
                 device_name(ref->device), (int)ref->device.device_id);
    return -1;
}

int tensor_arg_check_writable(const tensor_arg *t) {
    if (!t->read_only) return 0;
    PyErr_Format(PyExc_ValueError, "%s: is read-only and cannot be written", t->name);
    return -1;
}

int tensor_arg_span(const tensor_arg *t, uintptr_t *lo, uintptr_t *hi) {
    int64_t first = 0, last = 0; /* element offsets of the lowest and highest element */
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] == 0) {
            *lo = *hi = (uintptr_t)t->data;
            return 0;
        }
        int64_t reach;
        if (__builtin_mul_overflow(t->shape[d] - 1, t->strides[d], &reach)) goto overflow;
        if (reach < 0) {
            if (__builtin_add_overflow(first, reach, &first)) goto overflow;
        } else if (__builtin_add_overflow(last, reach, &last)) {
            goto overflow;
        }
    }
    int64_t lo_bytes, hi_bytes;
    if (__builtin_mul_overflow(first, (int64_t)t->elem_size, &lo_bytes) ||
        __builtin_mul_overflow(last + 1, (int64_t)t->elem_size, &hi_bytes))
        goto overflow;
    *lo = (uintptr_t)t->data + (intptr_t)lo_bytes;
    *hi = (uintptr_t)t->data + (intptr_t)hi_bytes;
    return 0;
overflow:
    PyErr_Format(PyExc_OverflowError, "%s: shape and strides overflow 64-bit byte offsets",
                 t->name);
    return -1;
}

int tensor_arg_check_no_overlap(const tensor_arg *out, const tensor_arg *in) {
    if (!out->present || !in->present) return 0;
    if (out->device.device_type != in->device.device_type) return 0;
    uintptr_t out_lo, out_hi, in_lo, in_hi;
    if (tensor_arg_span(out, &out_lo, &out_hi) != 0 || tensor_arg_span(in, &in_lo, &in_hi) != 0)
        return -1;
    if (out_lo < in_hi && in_lo < out_hi) {
        PyErr_Format(PyExc_ValueError, "%s: overlaps the memory of input %s", out->name,
                     in->name);
        return -1;
    }
    return 0;
}

int tensor_arg_matrix_layout(const tensor_arg *t, int64_t *ld, int *trans) {
    const int64_t rows = t->shape[t->ndim - 2], cols = t->shape[t->ndim - 1];
    const int64_t row_stride = t->strides[t->ndim - 2], col_stride = t->strides[t->ndim - 1];
    /* A single row (column) keeps its tensor's row (column) stride when that is a valid one, so the
     * slice x[i:i+1] has the layout of x and takes the same kernel as x for every row count. */
    if ((cols <= 1 || col_stride == 1) && (rows <= 1 || row_stride >= cols)) {
        *trans = 0;
        *ld = row_stride >= cols && row_stride > 0 ? row_stride : (cols > 1 ? cols : 1);
        return 0;
    }
    if ((rows <= 1 || row_stride == 1) && (cols <= 1 || col_stride >= rows)) {
        *trans = 1;
        *ld = col_stride >= rows && col_stride > 0 ? col_stride : (rows > 1 ? rows : 1);
        return 0;
    }
    PyErr_Format(PyExc_ValueError,
                 "%s: strides (%lld, %lld) for shape (%lld, %lld) are neither row-major nor a "
                 "transposed view; pass a contiguous tensor",
                 t->name, (long long)row_stride, (long long)col_stride, (long long)rows,
                 (long long)cols);
    return -1;
}
