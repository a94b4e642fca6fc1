/* bind/kernels.c: the backend and launcher tables, generated from csrc/kernels.def.
 *
 * Every launcher is declared weak here. A build without nvcc links no CUDA object, so the CUDA
 * launchers resolve to NULL: "compiled" is whether the symbol was linked, and nothing else in the
 * binding needs to know what the build contains. (The declarations are unprototyped on purpose:
 * this file only stores the addresses; callers cast them back to their entry's type.)
 */
#include "common.h"

#include <string.h>

#define KERNEL(entry, backend, source) \
    extern void rlk_##entry##_##backend(void) __attribute__((weak, visibility("hidden")));
#include "../kernels.def"

typedef struct backend_row {
    const char *name, *device;
    int min_cc, max_cc, fallback;
} backend_row;

static const backend_row backend_rows[RLK_NUM_BACKENDS] = {
#define BACKEND(name, device, min_cc, max_cc, fallback, nvcc_gencode) \
    {#name, #device, min_cc, max_cc, RLK_BACKEND_##fallback},
#include "../kernels.def"
};

typedef struct kernel_row {
    const char *entry, *source;
    int backend;
    rlk_launcher launcher;
} kernel_row;

static const kernel_row kernel_rows[] = {
#define KERNEL(entry, backend, source) \
    {#entry, source, RLK_BACKEND_##backend, rlk_##entry##_##backend},
#include "../kernels.def"
};

#define KERNEL_ROWS ((int)(sizeof kernel_rows / sizeof kernel_rows[0]))

int rlk_backend_fallback(int backend) { return backend_rows[backend].fallback; }

int rlk_backend_is_cuda(int backend) { return strcmp(backend_rows[backend].device, "cuda") == 0; }

rlk_launcher rlk_kernel_launcher(const char *entry, int backend) {
    for (int i = 0; i < KERNEL_ROWS; i++)
        if (kernel_rows[i].backend == backend && strcmp(kernel_rows[i].entry, entry) == 0)
            return kernel_rows[i].launcher;
    return NULL;
}

PyObject *rlk_backends_tuple(void) {
    PyObject *rows = PyTuple_New(RLK_NUM_BACKENDS);
    for (int b = 0; rows != NULL && b < RLK_NUM_BACKENDS; b++) {
        const backend_row *r = &backend_rows[b];
        PyObject *row = Py_BuildValue("(ssiiz)", r->name, r->device, r->min_cc, r->max_cc,
                                      r->fallback == RLK_BACKEND_none ? NULL
                                                                      : backend_rows[r->fallback].name);
        if (row == NULL) {
            Py_CLEAR(rows);
            break;
        }
        PyTuple_SET_ITEM(rows, b, row);
    }
    return rows;
}

PyObject *rlk_kernels_tuple(void) {
    PyObject *rows = PyList_New(0);
    for (int i = 0; rows != NULL && i < KERNEL_ROWS; i++) {
        const kernel_row *k = &kernel_rows[i];
        if (k->launcher == NULL) continue;
        PyObject *row = Py_BuildValue("(sss)", k->entry, backend_rows[k->backend].name, k->source);
        if (row == NULL || PyList_Append(rows, row) != 0) {
            Py_XDECREF(row);
            Py_CLEAR(rows);
            break;
        }
        Py_DECREF(row);
    }
    if (rows == NULL) return NULL;
    PyObject *tuple = PyList_AsTuple(rows);
    Py_DECREF(rows);
    return tuple;
}
