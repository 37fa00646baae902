/* router.indexer's `_add` in C: the ingest hot path (a batch of blocks into the index's dict of worker
 * bitmasks), built at install (setup.py, optional). router/indexer.py has the same
 * function in Python, used when this is not built; tests/router/test_indexer.py runs both. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* add(nodes: dict[int, int], batch: tuple[int, ...], bit: int) -> int
 * Sets `bit` in the mask of each block of `batch` (a new block gets `bit` alone); returns how many
 * blocks did not have it before. */
static PyObject *add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "add(nodes: dict, batch: tuple, bit: int)");
        return NULL;
    }
    PyObject *nodes = args[0], *batch = args[1], *bit = args[2];
    Py_ssize_t n = PyTuple_GET_SIZE(batch), added = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyTuple_GET_ITEM(batch, i);
        PyObject *mask = PyDict_GetItemWithError(nodes, h); /* borrowed */
        if (mask == NULL) {
            if (PyErr_Occurred() || PyDict_SetItem(nodes, h, bit) < 0)
                return NULL;
            added++;
            continue;
        }
        PyObject *both = PyNumber_And(mask, bit);
        if (both == NULL)
            return NULL;
        int held = PyObject_IsTrue(both);
        Py_DECREF(both);
        if (held < 0)
            return NULL;
        if (held)
            continue;
        PyObject *merged = PyNumber_Or(mask, bit);
        if (merged == NULL)
            return NULL;
        int rc = PyDict_SetItem(nodes, h, merged);
        Py_DECREF(merged);
        if (rc < 0)
            return NULL;
        added++;
    }
    return PyLong_FromSsize_t(added);
}

static PyMethodDef methods[] = {
    {"add", (PyCFunction)(void (*)(void))add, METH_FASTCALL,
     "add(nodes, batch, bit) -> int: set bit in each block's mask; how many lacked it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "router._index", NULL, -1, methods};

PyMODINIT_FUNC PyInit__index(void) { return PyModule_Create(&module); }
