/* The native engine's CPU kernels, float32 and bfloat16 (the arithmetic in float32), where a step spent its time
outside the matmuls: attention over the paged KV cache read in place, the new tokens' K and V written into
it, the residual add fused with RMS norm, rotary embedding in place, and a grammar's token bitmask applied to
the logits. kernels.py calls them, and runs the same
arithmetic in torch where they are not built (or not on a CPU). Built with -ffp-contract=off, so each product
rounds as torch's does (the rotation is bit-identical to transformers'), and -fno-trapping-math, so the exp's
clamps vectorize.

Attention: each query row (a decode's one token, or one of a prefill chunk's) attends over its sequence's cached
keys and values up to its own position, found through the sequence's block table, its new K and V stored first.
The torch path gathers every decode's blocks into a dense copy first (index_select), which moves the batch's whole
KV three times a layer, and calls SDPA once per prefill chunk (~150 us each for prompts of tens of tokens); this
reads the cache once, the decodes' rows and short chunks' in one call (attention.py leaves chunks with long
contexts to SDPA, which blocks its arithmetic as a matmul does). Rows are split over OpenMP threads: built
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
    const float *q;
    const void *k, *v; /* float32 or bfloat16 (kv_bf16) */
    const int64_t *tables, *row_seqs, *lens;
    float *out;
    int64_t q_stride, block_stride, width;
    int kv_heads, group, dim, block_size, kv_bf16;
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

/* 16 floats: one AVX-512 register, two AVX2 or four SSE ones in the clones below. Loaded and stored through
   memcpy: rows are 4-byte aligned only. */
typedef float vec __attribute__((vector_size(64)));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_vec(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* 16 floats at element i of a float32 or bfloat16 array (a bfloat16 is a float32's upper half). */
static inline vec load_as_float(const void *base, int64_t i, const int bf16) {
    if (!bf16) return load((const float *)base + i);
    typedef uint16_t u16x16 __attribute__((vector_size(32)));
    typedef uint32_t u32x16 __attribute__((vector_size(64)));
    u16x16 half;
    memcpy(&half, (const uint16_t *)base + i, sizeof half);
    const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* Sums 16 lanes pairwise (a chain of 4 adds, not 16). */
static inline float hsum(vec v) {
    typedef float half __attribute__((vector_size(32)));
    typedef float quarter __attribute__((vector_size(16)));
    const half a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const quarter b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* 16 lanes accumulated in order (vectorizes without reassociating a sum), then hsum. */
static inline float dot(const float *a, const float *b, int n) {
    vec acc = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) acc += load(a + i) * load(b + i);
    float tail = 0;
    for (; i < n; i++) tail += a[i] * b[i];
    return hsum(acc) + tail;
}

static inline float sum(const float *x, int64_t n) {
    vec acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += load(x + i);
    float tail = 0;
    for (; i < n; i++) tail += x[i];
    return hsum(acc) + tail;
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

/* One query row, all its heads; dim a multiple of 16. Scores go token by token, each cached token's K rows for
   every KV head being one dense run (a task per KV head read a third of each run at a time: 23 to 28 against 13
   to 16 ms over a batch-32 step's 30 layers); the block after the current one is prefetched, and the current
   block's V rows, for the pass over values that follows (a block is block_size rows: the hardware prefetcher
   stops at each jump, 10 against 8.6 ms a step). Values go head by head, the head's accumulators in
   registers. Inlined where dim is a constant (attend below), so the 16-float chunks of a row unroll. */
static inline __attribute__((always_inline)) void attend_dim(const Job *j, int64_t row, float *scores,
                                                            const int dim, const int bf16) {
    const int64_t len = j->lens[row];
    const int kv_heads = j->kv_heads, group = j->group, bs = j->block_size, chunks = dim / 16;
    const int64_t *table = j->tables + j->row_seqs[row] * j->width;
    const int64_t token_stride = (int64_t)kv_heads * dim, size = bf16 ? 2 : 4, block_bytes = bs * token_stride * size;
    const float *q = j->q + row * j->q_stride;

    for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t block = table[t0 / bs] * j->block_stride;
        const char *next = t0 + bs < len ? (const char *)j->k + table[t0 / bs + 1] * j->block_stride * size : NULL;
        const char *values = (const char *)j->v + block * size;
        for (int64_t c = 0; c < block_bytes; c += 64) {
            if (next) __builtin_prefetch(next + c);
            __builtin_prefetch(values + c);
        }
        for (int64_t t = t0, key = block; t < t0 + bs && t < len; t++, key += token_stride)
            for (int g = 0, h = 0; g < kv_heads; g++)
                for (int i = 0; i < group; i++, h++) {
                    vec acc = load(q + h * dim) * load_as_float(j->k, key + g * dim, bf16);
                    for (int c = 1; c < chunks; c++)
                        acc += load(q + h * dim + c * 16) * load_as_float(j->k, key + g * dim + c * 16, bf16);
                    scores[h * len + t] = hsum(acc) * j->scale;
                }
    }
    float *out = j->out + row * kv_heads * group * dim;
    for (int g = 0, h = 0; g < kv_heads; g++)
        for (int i = 0; i < group; i++, h++) {
            float *s = scores + h * len, top = s[0];
            for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
            for (int64_t t = 0; t < len; t++) s[t] = exp_nonpositive(s[t] - top);
            const float inv_sum = 1.0f / sum(s, len);
            vec acc[chunks];
            for (int c = 0; c < chunks; c++) acc[c] = (vec){0};
            for (int64_t t0 = 0; t0 < len; t0 += bs) {
                int64_t value = table[t0 / bs] * j->block_stride + g * dim;
                for (int64_t t = t0; t < t0 + bs && t < len; t++, value += token_stride)
                    for (int c = 0; c < chunks; c++) acc[c] += s[t] * load_as_float(j->v, value + c * 16, bf16);
            }
            for (int c = 0; c < chunks; c++) store_vec(out + h * dim + c * 16, acc[c] * inv_sum);
        }
}

/* dim 64 and 128 (most models') as constants; bfloat16 or float32 K and V. */
CLONES static void attend(const Job *j, int64_t row, float *scores) {
    const int bf16 = j->kv_bf16;
    if (j->dim == 64)
        bf16 ? attend_dim(j, row, scores, 64, 1) : attend_dim(j, row, scores, 64, 0);
    else if (j->dim == 128)
        bf16 ? attend_dim(j, row, scores, 128, 1) : attend_dim(j, row, scores, 128, 0);
    else
        bf16 ? attend_dim(j, row, scores, j->dim, 1) : attend_dim(j, row, scores, j->dim, 0);
}

/* attention(q, q_stride, k, v, kv_bf16, block_stride, tables, width, row_seqs, lens, out, n, kv_heads, group,
             dim, block_size, threads, scale): pointers as ints; query row r ([kv_heads * group * dim] float32,
   rows q_stride apart) attends over the first lens[r] tokens of sequence row_seqs[r], whose blocks are
   tables[row_seqs[r]] ([width] int64); k and v [blocks][block_size][kv_heads][dim], float32 or (kv_bf16)
   bfloat16, blocks block_stride apart; out [n][kv_heads * group * dim] float32. Strides in elements; dim a
   multiple of 16. Rows go to threads 8 at a time as they free up: a prefill's rows grow longer one by one. */
static PyObject *attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[17];
    double scale;
    if (!parse(args, nargs, 17, a, 1, &scale)) return NULL;
    const int threads = (int)a[16];
    const int64_t n = a[11], kv_heads = a[12], group = a[13], dim = a[14];
    if (n < 0 || kv_heads < 1 || group < 1 || dim < 16 || dim % 16 || a[15] < 1)
        return PyErr_Format(PyExc_ValueError, "attention: bad shape");
    const int64_t *lens = (const int64_t *)(intptr_t)a[9];
    int64_t max_len = 1;
    for (int64_t r = 0; r < n; r++) max_len = lens[r] > max_len ? lens[r] : max_len;

    const Job job = {
        .q = (const float *)(intptr_t)a[0], .q_stride = a[1], .k = (const void *)(intptr_t)a[2],
        .v = (const void *)(intptr_t)a[3], .kv_bf16 = a[4] != 0, .block_stride = a[5],
        .tables = (const int64_t *)(intptr_t)a[6], .width = a[7], .row_seqs = (const int64_t *)(intptr_t)a[8],
        .lens = lens, .out = (float *)(intptr_t)a[10], .kv_heads = (int)kv_heads, .group = (int)group,
        .dim = (int)dim, .block_size = (int)a[15], .scale = (float)scale,
    };
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * kv_heads * group * max_len); /* per thread */
        failed = scores == NULL;
#pragma omp for schedule(dynamic, 8)
        for (int64_t row = 0; row < n; row++)
            if (scores) attend(&job, row, scores);
        free(scores);
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* A float32 or bfloat16 array's element i as a float, and a float stored into one (bfloat16: rounded to nearest
   even, NaN kept quiet, as torch rounds). */
static inline float get(const void *p, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)p)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline void put(void *p, int64_t i, float x, const int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* One row; tmp (dim floats) holds a bfloat16 row widened. */
static inline __attribute__((always_inline)) void add_norm_row_of(void *hidden, const void *delta, const void *weight,
                                                                 void *out, int64_t dim, float eps, float *tmp,
                                                                 const int bf16) {
    float *row = bf16 ? tmp : (float *)hidden;
    for (int64_t d = 0; d < dim; d++) {
        float h = get(hidden, d, bf16);
        if (delta) {
            h += get(delta, d, bf16);
            put(hidden, d, h, bf16);
            h = get(hidden, d, bf16); /* the sum as stored: rounded in bfloat16, as torch's add rounds it */
        }
        row[d] = h;
    }
    const float r = 1.0f / sqrtf(dot(row, row, (int)dim) / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++) put(out, d, get(weight, d, bf16) * (row[d] * r), bf16); /* torch's order */
}

CLONES static void add_norm_row(void *hidden, const void *delta, const void *weight, void *out, int64_t dim,
                                float eps, float *tmp, int bf16) {
    if (bf16)
        add_norm_row_of(hidden, delta, weight, out, dim, eps, tmp, 1);
    else
        add_norm_row_of(hidden, delta, weight, out, dim, eps, tmp, 0);
}

/* add_rms_norm(hidden, delta, weight, out, rows, dim, threads, bf16, eps): hidden += delta (delta 0: none), in
   place; out = RMS-normalized hidden times weight. All [rows][dim] dense, weight [dim]; float32 or (bf16)
   bfloat16, the arithmetic in float32. */
static PyObject *add_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[8];
    double eps;
    if (!parse(args, nargs, 8, a, 1, &eps)) return NULL;
    char *hidden = (char *)(intptr_t)a[0], *out = (char *)(intptr_t)a[3];
    const char *delta = (const char *)(intptr_t)a[1], *weight = (const char *)(intptr_t)a[2];
    const int64_t rows = a[4], dim = a[5], bf16 = a[7] != 0, row_bytes = dim * (bf16 ? 2 : 4);
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(a[6] < 1 ? 1 : a[6]) if (rows * dim > 65536) reduction(| : failed)
    {
        float *tmp = bf16 ? malloc(sizeof(float) * dim) : NULL;
        failed = bf16 && tmp == NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (!failed)
                add_norm_row(hidden + r * row_bytes, delta ? delta + r * row_bytes : NULL, weight,
                             out + r * row_bytes, dim, (float)eps, tmp, (int)bf16);
        free(tmp);
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static inline __attribute__((always_inline)) void rope_row_of(void *x, int64_t heads, int64_t dim, const float *cos,
                                                             const float *sin, const int bf16) {
    const int64_t half = dim / 2;
    for (int64_t head = 0; head < heads * dim; head += dim)
        for (int64_t i = 0; i < half; i++) {
            const float x1 = get(x, head + i, bf16), x2 = get(x, head + i + half, bf16);
            put(x, head + i, x1 * cos[i] - x2 * sin[i], bf16);
            put(x, head + i + half, x2 * cos[i] + x1 * sin[i], bf16);
        }
}

CLONES static void rope_row(void *x, int64_t heads, int64_t dim, const float *cos, const float *sin, int bf16) {
    if (bf16)
        rope_row_of(x, heads, dim, cos, sin, 1);
    else
        rope_row_of(x, heads, dim, cos, sin, 0);
}

/* rope(x, row_stride, cos, sin, tokens, heads, dim, threads, bf16): rotates x[t][h][0:dim] in place, Hugging
   Face's rotate-half pairs (i, i + dim / 2), in float32; x float32 or (bf16) bfloat16, rows row_stride elements
   apart, heads dense; cos and sin [tokens][dim / 2] float32. */
static PyObject *rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[9];
    if (!parse(args, nargs, 9, a, 0, NULL)) return NULL;
    char *x = (char *)(intptr_t)a[0];
    const float *cos = (const float *)(intptr_t)a[2], *sin = (const float *)(intptr_t)a[3];
    const int64_t stride = a[1] * (a[8] ? 2 : 4), tokens = a[4], heads = a[5], dim = a[6], half = dim / 2;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(a[7] < 1 ? 1 : a[7]) if (tokens * heads * dim > 65536)
    for (int64_t t = 0; t < tokens; t++)
        rope_row(x + t * stride, heads, dim, cos + t * half, sin + t * half, (int)a[8]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* store(k, v, k_stride, v_stride, k_cache, v_cache, block_stride, slot_blocks, slot_offsets, tokens, width,
         itemsize): copies each token's K and V rows (width elements of itemsize bytes, rows k_stride and v_stride
   apart) into its cache slot (int64 block, offset); the caches [blocks][block_size][width] with blocks
   block_stride apart. Strides in elements. */
static PyObject *store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[12];
    if (!parse(args, nargs, 12, a, 0, NULL)) return NULL;
    const char *k = (const char *)(intptr_t)a[0], *v = (const char *)(intptr_t)a[1];
    char *k_cache = (char *)(intptr_t)a[4], *v_cache = (char *)(intptr_t)a[5];
    const int64_t *blocks = (const int64_t *)(intptr_t)a[7], *offsets = (const int64_t *)(intptr_t)a[8];
    const int64_t block_stride = a[6], tokens = a[9], width = a[10], size = a[11];
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = (blocks[t] * block_stride + offsets[t] * width) * size;
        memcpy(k_cache + slot, k + t * a[2] * size, size * width);
        memcpy(v_cache + slot, v + t * a[3] * size, size * width);
    }
    Py_RETURN_NONE;
}

/* mask(logits, vocab, bitmask, words, rows, n, threads): for each of the n rows listed in rows (int64), every
   token t < vocab whose bit (bit t % 32 of int32 word t / 32, xgrammar's token bitmask) is 0 gets -inf in its
   logits row (float32, rows vocab apart; bitmask rows words apart). A grammar allows few tokens in most states:
   a word of zeros is 32 stores, one of ones none. xgrammar's own CPU kernel tests bit by bit (7.5 ms a step at
   batch 32 over a 49k vocabulary). */
CLONES static void mask_row(float *logits, const int32_t *bits, int64_t vocab) {
    for (int64_t w = 0, base = 0; base < vocab; w++, base += 32) {
        const uint32_t word = (uint32_t)bits[w];
        if (word == 0xffffffffu) continue;
        const int64_t n = vocab - base < 32 ? vocab - base : 32;
        for (int64_t i = 0; i < n; i++)
            if (!((word >> i) & 1u)) logits[base + i] = -INFINITY;
    }
}

static PyObject *mask(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t a[7];
    if (!parse(args, nargs, 7, a, 0, NULL)) return NULL;
    float *logits = (float *)(intptr_t)a[0];
    const int32_t *bits = (const int32_t *)(intptr_t)a[2];
    const int64_t vocab = a[1], words = a[3], *rows = (const int64_t *)(intptr_t)a[4], n = a[5];
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(a[6] < 1 ? 1 : a[6]) if (n > 1)
    for (int64_t r = 0; r < n; r++) mask_row(logits + rows[r] * vocab, bits + rows[r] * words, vocab);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attention", (PyCFunction)(void (*)(void))attention, METH_FASTCALL, "Attention over a paged KV cache."},
    {"add_rms_norm", (PyCFunction)(void (*)(void))add_rms_norm, METH_FASTCALL, "Residual add and RMS norm."},
    {"rope", (PyCFunction)(void (*)(void))rope, METH_FASTCALL, "Rotary embedding in place."},
    {"store", (PyCFunction)(void (*)(void))store, METH_FASTCALL, "New K and V rows into their cache slots."},
    {"mask", (PyCFunction)(void (*)(void))mask, METH_FASTCALL, "A grammar's token bitmask applied to logits."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, 0, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
