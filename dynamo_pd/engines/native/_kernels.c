/* The native engine's CPU float32 kernels, where a step spent its time outside the matmuls: decode attention
over the paged KV cache read in place, the new tokens' K and V written into it, the residual add fused with RMS
norm, and rotary embedding in place. kernels.py calls them, and runs the same arithmetic in torch where they are
not built (or not on a CPU in float32). Built with -ffp-contract=off, so each product rounds as torch's does
(the rotation is bit-identical to transformers'), and -fno-trapping-math, so the exp's clamps vectorize.

Decode attention: each sequence's one query token attends over its cached keys and values, found through its
block table. The torch path gathers every sequence's blocks into a dense copy first (index_select), which moves
the batch's whole KV three times a layer; this reads it once. Sequences are split over OpenMP threads: built
with -fopenmp, the extension binds to the libgomp torch has loaded (one soname), so it runs on torch's own
thread pool rather than beside it (pthreads of its own competed with that pool's spinning threads and made a
step slower). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Vector clones picked at load time: the install's compiler defaults to baseline x86-64 (SSE2). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

typedef struct {
    const float *q, *k, *v;
    const int64_t *tables, *lens;
    float *out;
    int64_t q_stride, block_stride, width;
    int kv_heads, group, dim, block_size;
    float scale;
} Job;

/* Reads `count` int arguments into `out`, then `extra` floats; 0 and a Python error if one is not a number. */
static int parse(PyObject *const *args, Py_ssize_t nargs, int count, int64_t *out, int extra, double *floats) {
    if (nargs != count + extra) {
        PyErr_Format(PyExc_TypeError, "expected %d arguments, got %zd", count + extra, nargs);
        return 0;
    }
    for (int i = 0; i < count; i++)
        if ((out[i] = PyLong_AsLongLong(args[i])) == -1 && PyErr_Occurred()) return 0;
    for (int i = 0; i < extra; i++)
        if ((floats[i] = PyFloat_AsDouble(args[count + i])) == -1 && PyErr_Occurred()) return 0;
    return 1;
}

/* Sums 16 lanes pairwise (a chain of 4 adds, not 16). */
static inline float fold(float *acc) {
    for (int w = 8; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

static inline float dot(const float *a, const float *b, int n) {
    float acc[16] = {0}; /* 16 independent lanes: vectorizes without reassociating a sum */
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[0] += a[i] * b[i];
    return fold(acc);
}

static inline void axpy(float *restrict acc, float p, const float *restrict x, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) /* a fixed trip count: no alignment peeling for 64-float rows */
        for (int j = 0; j < 16; j++) acc[i + j] += p * x[i + j];
    for (; i < n; i++) acc[i] += p * x[i];
}

static inline float sum(const float *x, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += x[i + j];
    for (; i < n; i++) acc[0] += x[i];
    return fold(acc);
}

/* e^x for x <= 0, within 1.3 ulp (checked on 2e7 points of [-87, 0]), branch-free so a loop over it
   vectorizes (libm's expf does not, and was a third of the kernel's time): x = n ln2 + r, |r| <= ln2 / 2, e^r
   by its Taylor series to r^7, 2^n put in the exponent bits. Below -87 it returns about e^-87 (1e-38), nothing
   beside a softmax's largest term of 1. */
static inline float exp_nonpositive(float x) {
    /* k = x / ln 2 rounded (truncating a value <= 0). Both clamps come after the conversion: GCC does not
       vectorize a conversion of a clamped float. x below -1.5e9 (a broken model) converts to INT_MIN on x86. */
    int32_t k = (int32_t)(x * 1.44269504f - 0.5f);
    k = k < -126 ? -126 : k;
    x = x < -87.0f ? -87.0f : x;
    const float n = (float)k;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln 2 in two parts: exact n * hi */
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One sequence, all its heads: a cached token's K (or V) rows for every KV head are one dense run, read in
   order (a task per KV head read a third of each run at a time: 23 to 28 against 13 to 16 ms over a batch-32
   step's 30 layers). */
CLONES static void attend(const Job *j, int64_t seq, float *scores, float *acc) {
    const int64_t len = j->lens[seq];
    const int kv_heads = j->kv_heads, group = j->group, dim = j->dim, bs = j->block_size, heads = kv_heads * group;
    const int64_t *table = j->tables + seq * j->width;
    const int64_t token_stride = (int64_t)kv_heads * dim;
    const float *q = j->q + seq * j->q_stride;

    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const float *key = j->k + table[t0 / bs] * j->block_stride;
        for (int64_t t = t0; t < t0 + bs && t < len; t++, key += token_stride)
            for (int h = 0; h < heads; h++)
                scores[h * len + t] = dot(q + h * dim, key + h / group * dim, dim) * j->scale;
    }
    float inv_sum[heads];
    for (int h = 0; h < heads; h++) {
        float *s = scores + h * len, top = s[0];
        for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
        for (int64_t t = 0; t < len; t++) s[t] = exp_nonpositive(s[t] - top);
        inv_sum[h] = 1.0f / sum(s, len);
    }
    memset(acc, 0, sizeof(float) * heads * dim);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const float *value = j->v + table[t0 / bs] * j->block_stride;
        for (int64_t t = t0; t < t0 + bs && t < len; t++, value += token_stride)
            for (int h = 0; h < heads; h++) axpy(acc + h * dim, scores[h * len + t], value + h / group * dim, dim);
    }
    float *out = j->out + seq * heads * dim;
    for (int h = 0; h < heads; h++)
        for (int d = 0; d < dim; d++) out[h * dim + d] = acc[h * dim + d] * inv_sum[h];
}

/* decode(q, q_stride, k, v, block_stride, tables, width, lens, out, n, kv_heads, group, dim, block_size,
          threads, scale): pointers as ints; q rows [n][kv_heads * group * dim] q_stride apart, k and v
   [blocks][block_size][kv_heads][dim] with blocks block_stride apart, tables [n][width], lens [n] (int64),
   out [n][kv_heads * group * dim]. Strides in elements. */
static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[15];
    double scale;
    if (!parse(args, nargs, 15, a, 1, &scale)) return NULL;
    const int threads = (int)a[14];
    const int64_t n = a[9], kv_heads = a[10], group = a[11], dim = a[12];
    if (n < 0 || kv_heads < 1 || group < 1 || dim < 1 || a[13] < 1)
        return PyErr_Format(PyExc_ValueError, "decode: bad shape");
    const int64_t *lens = (const int64_t *)(intptr_t)a[7];
    int64_t max_len = 1;
    for (int64_t s = 0; s < n; s++) max_len = lens[s] > max_len ? lens[s] : max_len;

    const Job job = {
        .q = (const float *)(intptr_t)a[0], .q_stride = a[1], .k = (const float *)(intptr_t)a[2],
        .v = (const float *)(intptr_t)a[3], .block_stride = a[4], .tables = (const int64_t *)(intptr_t)a[5],
        .width = a[6], .lens = lens, .out = (float *)(intptr_t)a[8], .kv_heads = (int)kv_heads,
        .group = (int)group, .dim = (int)dim, .block_size = (int)a[13], .scale = (float)scale,
    };
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) reduction(| : failed)
    {
        /* per thread: softmax scores and output accumulators */
        float *scratch = malloc(sizeof(float) * kv_heads * group * (max_len + dim));
        failed = scratch == NULL;
#pragma omp for schedule(static)
        for (int64_t seq = 0; seq < n; seq++)
            if (scratch) attend(&job, seq, scratch, scratch + kv_heads * group * max_len);
        free(scratch);
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

CLONES static void add_norm_row(float *hidden, const float *delta, const float *weight, float *out, int64_t dim,
                                float eps) {
    if (delta)
        for (int64_t d = 0; d < dim; d++) hidden[d] += delta[d];
    const float r = 1.0f / sqrtf(dot(hidden, hidden, (int)dim) / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++) out[d] = weight[d] * (hidden[d] * r); /* transformers' order */
}

/* add_rms_norm(hidden, delta, weight, out, rows, dim, threads, eps): hidden += delta (delta 0: none), in place;
   out = RMS-normalized hidden times weight. All [rows][dim] dense, weight [dim]. */
static PyObject *add_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[7];
    double eps;
    if (!parse(args, nargs, 7, a, 1, &eps)) return NULL;
    float *hidden = (float *)(intptr_t)a[0], *out = (float *)(intptr_t)a[3];
    const float *delta = (const float *)(intptr_t)a[1], *weight = (const float *)(intptr_t)a[2];
    const int64_t rows = a[4], dim = a[5];
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(a[6] < 1 ? 1 : a[6]) if (rows * dim > 65536)
    for (int64_t r = 0; r < rows; r++)
        add_norm_row(hidden + r * dim, delta ? delta + r * dim : NULL, weight, out + r * dim, dim, (float)eps);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

CLONES static void rope_row(float *x, int64_t heads, int64_t dim, const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++, x += dim)
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * cos[i] - x2 * sin[i];
            x[i + half] = x2 * cos[i] + x1 * sin[i];
        }
}

/* rope(x, row_stride, cos, sin, tokens, heads, dim, threads): rotates x[t][h][0:dim] in place, Hugging Face's
   rotate-half pairs (i, i + dim / 2); rows row_stride apart, heads dense; cos and sin [tokens][dim / 2]. */
static PyObject *rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[8];
    if (!parse(args, nargs, 8, a, 0, NULL)) return NULL;
    float *x = (float *)(intptr_t)a[0];
    const float *cos = (const float *)(intptr_t)a[2], *sin = (const float *)(intptr_t)a[3];
    const int64_t stride = a[1], tokens = a[4], heads = a[5], dim = a[6], half = dim / 2;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(a[7] < 1 ? 1 : a[7]) if (tokens * heads * dim > 65536)
    for (int64_t t = 0; t < tokens; t++) rope_row(x + t * stride, heads, dim, cos + t * half, sin + t * half);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* store(k, v, k_stride, v_stride, k_cache, v_cache, block_stride, slot_blocks, slot_offsets, tokens, width):
   copies each token's K and V rows (width floats, rows k_stride and v_stride apart) into its cache slot (int64
   block, offset); the caches [blocks][block_size][width] with blocks block_stride apart. */
static PyObject *store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[11];
    if (!parse(args, nargs, 11, a, 0, NULL)) return NULL;
    const float *k = (const float *)(intptr_t)a[0], *v = (const float *)(intptr_t)a[1];
    float *k_cache = (float *)(intptr_t)a[4], *v_cache = (float *)(intptr_t)a[5];
    const int64_t *blocks = (const int64_t *)(intptr_t)a[7], *offsets = (const int64_t *)(intptr_t)a[8];
    const int64_t block_stride = a[6], tokens = a[9], width = a[10];
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = blocks[t] * block_stride + offsets[t] * width;
        memcpy(k_cache + slot, k + t * a[2], sizeof(float) * width);
        memcpy(v_cache + slot, v + t * a[3], sizeof(float) * width);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL, "Decode attention over a paged KV cache."},
    {"add_rms_norm", (PyCFunction)(void (*)(void))add_rms_norm, METH_FASTCALL, "Residual add and RMS norm."},
    {"rope", (PyCFunction)(void (*)(void))rope, METH_FASTCALL, "Rotary embedding in place."},
    {"store", (PyCFunction)(void (*)(void))store, METH_FASTCALL, "New K and V rows into their cache slots."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, 0, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
