/* The router's hot paths in C, built at install (setup.py, optional), each with the same function in Python
 * used when this is not built:
 *   add: router.indexer's `_add`, the ingest hot path (a batch of blocks into the index's dict of worker
 *        bitmasks); tests/router/test_indexer.py runs both;
 *   match: router.indexer's `_match`, the walk of find_matches (every route asks it); the same tests run both;
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

/* Appends (mask, depth) to levels; 0 on success. Steals nothing. */
static int level(PyObject *levels, PyObject *mask, Py_ssize_t depth) {
    PyObject *t = Py_BuildValue("(On)", mask, depth);
    if (t == NULL)
        return -1;
    int rc = PyList_Append(levels, t);
    Py_DECREF(t);
    return rc;
}

/* match(nodes: dict[int, int], hashes: list | tuple) -> list[tuple[int, int]]
 * Walks the prompt's sequence hashes: the workers holding the first block, and at each block where some of
 * them stop holding, (the workers that stopped, the blocks they held in a row); the workers holding all at the
 * end with the whole length. While the first block's holders fit 64 bits (workers in slots below 64: nearly
 * always) the walk runs on a machine word: only the low 64 bits of each later mask matter. */
static PyObject *match(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_CheckExact(args[0]) || (!PyList_CheckExact(args[1]) && !PyTuple_CheckExact(args[1]))) {
        PyErr_SetString(PyExc_TypeError, "match(nodes: dict, hashes: list | tuple)");
        return NULL;
    }
    PyObject *nodes = args[0], **hashes = PySequence_Fast_ITEMS(args[1]);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(args[1]), depth = 1;
    PyObject *levels = PyList_New(0);
    if (levels == NULL || n == 0)
        return levels;
    PyObject *first = PyDict_GetItemWithError(nodes, hashes[0]); /* borrowed */
    if (first == NULL)
        return PyErr_Occurred() ? (Py_DECREF(levels), NULL) : levels;
    uint64_t alive = PyLong_AsUnsignedLongLong(first);
    if (!(alive == (uint64_t)-1 && PyErr_Occurred())) {
        for (Py_ssize_t i = 1; i < n && alive; i++, depth++) {
            PyObject *m = PyDict_GetItemWithError(nodes, hashes[i]);
            if (m == NULL && PyErr_Occurred())
                goto fail;
            uint64_t still = m == NULL ? 0 : alive & PyLong_AsUnsignedLongLongMask(m);
            if (still != alive) {
                PyObject *gone = PyLong_FromUnsignedLongLong(alive ^ still);
                int rc = gone == NULL ? -1 : level(levels, gone, depth);
                Py_XDECREF(gone);
                if (rc < 0)
                    goto fail;
                alive = still;
            }
        }
        if (alive) {
            PyObject *held = PyLong_FromUnsignedLongLong(alive);
            int rc = held == NULL ? -1 : level(levels, held, n);
            Py_XDECREF(held);
            if (rc < 0)
                goto fail;
        }
        return levels;
    }
    if (!PyErr_ExceptionMatches(PyExc_OverflowError))
        goto fail;
    PyErr_Clear();
    /* wider masks: the same walk on Python ints */
    PyObject *zero = PyLong_FromLong(0), *wide = first;
    if (zero == NULL)
        goto fail;
    Py_INCREF(wide);
    for (Py_ssize_t i = 1; i < n; i++, depth++) {
        PyObject *m = PyDict_GetItemWithError(nodes, hashes[i]);
        if (m == NULL && PyErr_Occurred())
            goto wide_fail;
        PyObject *still = PyNumber_And(wide, m == NULL ? zero : m);
        if (still == NULL)
            goto wide_fail;
        int same = PyObject_RichCompareBool(still, wide, Py_EQ);
        if (same < 0) {
            Py_DECREF(still);
            goto wide_fail;
        }
        if (same) {
            Py_DECREF(still);
            continue;
        }
        PyObject *gone = PyNumber_Xor(wide, still);
        int rc = gone == NULL ? -1 : level(levels, gone, depth);
        Py_XDECREF(gone);
        Py_DECREF(wide);
        wide = still;
        if (rc < 0)
            goto wide_fail;
        int any = PyObject_IsTrue(wide);
        if (any < 0)
            goto wide_fail;
        if (!any) {
            Py_DECREF(wide);
            Py_DECREF(zero);
            return levels;
        }
    }
    if (level(levels, wide, n) < 0)
        goto wide_fail;
    Py_DECREF(wide);
    Py_DECREF(zero);
    return levels;
wide_fail:
    Py_DECREF(wide);
    Py_DECREF(zero);
fail:
    Py_DECREF(levels);
    return NULL;
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
    {"match", (PyCFunction)(void (*)(void))match, METH_FASTCALL,
     "match(nodes, hashes) -> list[tuple[int, int]]: (workers mask, blocks held in a row) levels of a prompt"},
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
