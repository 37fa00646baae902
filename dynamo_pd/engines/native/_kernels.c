/* The native engine's CPU float32 kernels, where a step spent its time outside the matmuls: decode attention
over the paged KV cache read in place, the residual add fused with RMS norm, and rotary embedding in place.
kernels.py calls them and runs the same arithmetic in torch where they are not built (or not on a CPU in
float32). Built with -ffp-contract=off: each product rounds as torch's does, so the rotation is bit-identical
to transformers'.

Decode attention: each sequence's one query token attends over its cached keys and values, found through its
block table. The torch path gathers every sequence's blocks into a dense copy first (index_select), which
moves the batch's whole KV three times a layer; this reads it once. Work is split by (sequence, KV head) over OpenMP
threads: built with -fopenmp, the extension binds to the libgomp torch has loaded (one soname), so it runs on
torch's own thread pool rather than beside it (a pthread of its own competed with that pool's spinning threads
and made a step slower). */
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

#define MAX_GROUP_DIM 2048 /* query heads per KV head times head_dim */

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

static inline float dot(const float *a, const float *b, int n) {
    float acc[16] = {0}; /* 16 independent lanes: vectorizes without reassociating a sum */
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

static inline void axpy(float *restrict acc, float p, const float *restrict x, int n) {
    for (int i = 0; i < n; i++) acc[i] += p * x[i];
}

CLONES static void run_task(const Job *j, int64_t task, float *scores) {
    const int64_t seq = task / j->kv_heads, len = j->lens[seq];
    const int head = (int)(task % j->kv_heads), group = j->group, dim = j->dim, bs = j->block_size;
    const int64_t *table = j->tables + seq * j->width;
    const int64_t token_stride = (int64_t)j->kv_heads * dim, head_off = (int64_t)head * dim;
    const float *q = j->q + seq * j->q_stride + head_off * group;
    float acc[MAX_GROUP_DIM];

    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const float *key = j->k + table[t0 / bs] * j->block_stride + head_off;
        for (int64_t t = t0; t < t0 + bs && t < len; t++, key += token_stride)
            for (int g = 0; g < group; g++) scores[g * len + t] = dot(q + g * dim, key, dim) * j->scale;
    }
    float inv_sum[group];
    for (int g = 0; g < group; g++) {
        float *s = scores + g * len, top = s[0], sum = 0;
        for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
        for (int64_t t = 0; t < len; t++) sum += (s[t] = expf(s[t] - top));
        inv_sum[g] = 1.0f / sum;
    }
    memset(acc, 0, sizeof(float) * group * dim);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const float *value = j->v + table[t0 / bs] * j->block_stride + head_off;
        for (int64_t t = t0; t < t0 + bs && t < len; t++, value += token_stride)
            for (int g = 0; g < group; g++) axpy(acc + g * dim, scores[g * len + t], value, dim);
    }
    float *out = j->out + (seq * j->kv_heads + head) * group * dim;
    for (int g = 0; g < group; g++)
        for (int d = 0; d < dim; d++) out[g * dim + d] = acc[g * dim + d] * inv_sum[g];
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
    if (n < 0 || kv_heads < 1 || group < 1 || dim < 1 || a[13] < 1 || group * dim > MAX_GROUP_DIM)
        return PyErr_Format(PyExc_ValueError, "decode: unsupported shape (group %lld x head_dim %lld > %d?)",
                            (long long)group, (long long)dim, MAX_GROUP_DIM);
    const int64_t *lens = (const int64_t *)(intptr_t)a[7];
    int64_t max_len = 1;
    for (int64_t s = 0; s < n; s++) max_len = lens[s] > max_len ? lens[s] : max_len;

    const Job job = {
        .q = (const float *)(intptr_t)a[0], .q_stride = a[1], .k = (const float *)(intptr_t)a[2],
        .v = (const float *)(intptr_t)a[3], .block_stride = a[4], .tables = (const int64_t *)(intptr_t)a[5],
        .width = a[6], .lens = lens, .out = (float *)(intptr_t)a[8], .kv_heads = (int)kv_heads,
        .group = (int)group, .dim = (int)dim, .block_size = (int)a[13], .scale = (float)scale,
    };
    const int64_t tasks = n * kv_heads;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * max_len); /* softmax scratch, one per thread */
        failed = scores == NULL;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++)
            if (scores) run_task(&job, task, scores);
        free(scores);
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

CLONES static void add_norm_row(float *hidden, const float *delta, const float *weight, float *out, int64_t dim,
                                float eps) {
    float acc[16] = {0};
    int64_t i = 0;
    if (delta)
        for (int64_t d = 0; d < dim; d++) hidden[d] += delta[d];
    for (; i + 16 <= dim; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += hidden[i + j] * hidden[i + j];
    float sum = 0;
    for (; i < dim; i++) sum += hidden[i] * hidden[i];
    for (int j = 0; j < 16; j++) sum += acc[j];
    const float r = 1.0f / sqrtf(sum / (float)dim + eps);
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

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL, "Decode attention over a paged KV cache."},
    {"add_rms_norm", (PyCFunction)(void (*)(void))add_rms_norm, METH_FASTCALL, "Residual add and RMS norm."},
    {"rope", (PyCFunction)(void (*)(void))rope, METH_FASTCALL, "Rotary embedding in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, 0, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
