/* The router's hot paths in C, built at install (setup.py, optional), each with the same function in Python
 * used when this is not built:
 *   add: router.indexer's `_add`, the ingest hot path (a batch of blocks into the index's dict of worker
 *        bitmasks); tests/router/test_indexer.py runs both;
 *   block_hashes, local_hashes: router.hashing's scheme over a list of token ids, hashed by the xxh3 of the
 *        xxhash package itself (its extension exports XXH3_64bits_withSeed; found here with dlsym), so the
 *        values are the ones the Python path and every worker compute; tests/router/test_hashing.py runs both.
 *        Where that symbol is not found the module has no hashing functions and router.hashing stays Python. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#define HASH_SEED 1337
typedef uint64_t (*xxh3_fn)(const void *data, size_t len, uint64_t seed);
static xxh3_fn xxh3 = NULL;

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

/* An int of at most one digit read off its object (a token id nearly always): the conversion's cost, where
 * PyLong_AsLongLong's general path was most of the hashing's time. 0 (and `v` untouched) for any other. */
static inline int small_int(PyObject *o, long long *v) {
    if (!PyLong_CheckExact(o))
        return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o))
        return 0;
    *v = PyUnstable_Long_CompactValue((PyLongObject *)o);
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size != 0 && size != 1)
        return 0;
    *v = size ? (long long)((PyLongObject *)o)->ob_digit[0] : 0;
#endif
    return 1;
}

/* The token ids of a list or tuple as little-endian u32 (a new buffer, PyMem_Free it), or NULL with the error
 * router.hashing.token_bytes raises: every id must fit, the trailing partial block's too. */
static uint32_t *token_words(PyObject *tokens, Py_ssize_t *count) {
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens)) {
        PyErr_SetString(PyExc_TypeError, "token ids must be a list or a tuple");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    uint32_t *words = PyMem_Malloc(n ? n * sizeof(uint32_t) : 1);
    if (words == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v;
        if (!small_int(items[i], &v) && (v = PyLong_AsLongLong(items[i])) == -1 && PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "token id %S does not fit an unsigned 32-bit integer", items[i]);
            }
            PyMem_Free(words);
            return NULL;
        }
        if (v < 0 || v > 0xFFFFFFFFLL) {
            PyErr_Format(PyExc_ValueError, "token id %lld does not fit an unsigned 32-bit integer", v);
            PyMem_Free(words);
            return NULL;
        }
        uint32_t w = (uint32_t)v;
#if PY_BIG_ENDIAN
        w = __builtin_bswap32(w);
#endif
        words[i] = w;
    }
    *count = n;
    return words;
}

static uint64_t le64(uint64_t v) {
#if PY_BIG_ENDIAN
    return __builtin_bswap64(v);
#else
    return v;
#endif
}

/* block_hashes(tokens, block_size, parent) / local_hashes(tokens, block_size) -> list[int] */
static PyObject *hash_blocks(PyObject *const *args, Py_ssize_t nargs, int chained) {
    if (nargs != (chained ? 3 : 2) || !PyLong_Check(args[1]) || (chained && args[2] != Py_None
                                                                  && !PyLong_Check(args[2]))) {
        PyErr_SetString(PyExc_TypeError, chained ? "block_hashes(tokens, block_size: int, parent: int | None)"
                                                 : "local_hashes(tokens, block_size: int)");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[1]);
    if (block_size == -1 && PyErr_Occurred())
        return NULL;
    if (block_size <= 0) {
        PyErr_Format(PyExc_ValueError, "block_size must be positive, got %zd", block_size);
        return NULL;
    }
    int has_parent = chained && args[2] != Py_None;
    uint64_t parent = 0;
    if (has_parent) {
        parent = PyLong_AsUnsignedLongLong(args[2]);
        if (parent == (uint64_t)-1 && PyErr_Occurred())
            return NULL;
    }
    Py_ssize_t n;
    uint32_t *words = token_words(args[0], &n);
    if (words == NULL)
        return NULL;
    Py_ssize_t blocks = n / block_size;
    PyObject *out = PyList_New(blocks);
    if (out == NULL) {
        PyMem_Free(words);
        return NULL;
    }
    for (Py_ssize_t b = 0; b < blocks; b++) {
        uint64_t h = xxh3(words + b * block_size, (size_t)block_size * 4, HASH_SEED);
        if (chained) {
            if (has_parent) {
                uint64_t pair[2] = {le64(parent), le64(h)};
                h = xxh3(pair, sizeof pair, HASH_SEED);
            }
            parent = h;
            has_parent = 1;
        }
        PyObject *v = PyLong_FromUnsignedLongLong(h);
        if (v == NULL) {
            Py_DECREF(out);
            PyMem_Free(words);
            return NULL;
        }
        PyList_SET_ITEM(out, b, v);
    }
    PyMem_Free(words);
    return out;
}

static PyObject *block_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return hash_blocks(args, nargs, 1);
}

static PyObject *local_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return hash_blocks(args, nargs, 0);
}

static PyMethodDef methods[] = {
    {"add", (PyCFunction)(void (*)(void))add, METH_FASTCALL,
     "add(nodes, batch, bit) -> int: set bit in each block's mask; how many lacked it"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef hash_methods[] = {
    {"block_hashes", (PyCFunction)(void (*)(void))block_hashes, METH_FASTCALL,
     "block_hashes(tokens, block_size, parent) -> list[int]: sequence hashes of the full blocks, chained from "
     "parent (None: the first block's local hash starts the chain)"},
    {"local_hashes", (PyCFunction)(void (*)(void))local_hashes, METH_FASTCALL,
     "local_hashes(tokens, block_size) -> list[int]: local hashes of the full blocks"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "router._index", NULL, -1, methods};

/* XXH3_64bits_withSeed from the xxhash package's extension, loaded already by importing it */
static xxh3_fn find_xxh3(void) {
    PyObject *ext = PyImport_ImportModule("xxhash._xxhash");
    if (ext == NULL)
        return NULL;
    PyObject *file = PyObject_GetAttrString(ext, "__file__");
    Py_DECREF(ext);
    if (file == NULL)
        return NULL;
    const char *path = PyUnicode_AsUTF8(file);
    void *handle = path == NULL ? NULL : dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(file);
    return handle == NULL ? NULL : (xxh3_fn)dlsym(handle, "XXH3_64bits_withSeed");
}

PyMODINIT_FUNC PyInit__index(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    xxh3 = find_xxh3();
    PyErr_Clear(); /* without it the module still serves `add` */
    if (xxh3 != NULL && PyModule_AddFunctions(m, hash_methods) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
