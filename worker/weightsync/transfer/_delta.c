/* The inner loops of delta versions (delta.py defines the patch format), without the GIL.
 *
 * diff() compares a chunk of new bytes with the kept ones in one pass, 64 bytes at a time with
 * AVX-512BW, else 8: a block that did not change is only read; a block that did is written into
 * the kept bytes, and each of its changed elements becomes an entry (the u16 gap from the one
 * before, the XOR of its values), with a filler entry (value 0) wherever a gap would exceed 65535.
 * The entries are written as byte planes (byte 0 of every gap, byte 1 of every gap, then each byte
 * of every value), the layout that zstd compresses best and fastest. 2-byte elements (bfloat16,
 * float16) with AVX512-VBMI2 pack a block's entries at once. Which loop runs is decided at run
 * time: the extension is built for any x86-64 (and any other CPU, where the portable loop runs).
 * patch() copies a chunk of the base and XORs the entries into it; with no base it XORs them into
 * the chunk in place (a receiver whose staging buffer holds the version before the base: delta.py).
 * numpy needs a dozen passes and temporary arrays for either; this is one pass over memory that is
 * in cache.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_GAP 0xFFFF

static inline uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Element `k` of the word `x` of `itemsize`-byte little-endian elements, as an unsigned value. */
static inline uint64_t lane(uint64_t x, Py_ssize_t itemsize, Py_ssize_t k) {
    return itemsize == 8 ? x : (x >> (8 * itemsize * k)) & ((UINT64_C(1) << (8 * itemsize)) - 1);
}

typedef struct {
    unsigned char *planes; /* byte plane p of entry i at planes[p * cap + i]: gap bytes, then value bytes */
    Py_ssize_t cap, entries, changed, last; /* last: index of the last entry, -1 before the first */
} Entries;

/* Entry `at`: its gap and value, one byte into each plane (little-endian: byte 0 first). */
static inline __attribute__((always_inline)) void put_entry(Entries *e, Py_ssize_t at, Py_ssize_t gap, uint64_t v,
                                                            Py_ssize_t itemsize) {
    unsigned char *p = e->planes + at;
    Py_ssize_t cap = e->cap;
    p[0] = (unsigned char)gap;
    p[cap] = (unsigned char)(gap >> 8);
    for (Py_ssize_t k = 0; k < itemsize; k++)
        p[(2 + k) * cap] = (unsigned char)(v >> (8 * k));
}

/* An entry for element `i`, whose value is `v`; fillers first where the gap is too long. Past
 * `cap` entries only the count goes on. Inlined where itemsize is a constant: each entry is then
 * a store into each plane. */
static inline __attribute__((always_inline)) void entry(Entries *e, Py_ssize_t i, uint64_t v, Py_ssize_t itemsize) {
    while (i - e->last > MAX_GAP) {
        e->last += MAX_GAP;
        if (e->entries < e->cap)
            put_entry(e, e->entries, MAX_GAP, 0, itemsize);
        e->entries++;
    }
    if (e->entries < e->cap)
        put_entry(e, e->entries, i - e->last, v, itemsize);
    e->entries++;
    e->changed++;
    e->last = i;
}

/* Elements [first, first + n / itemsize) of the chunk, at kept and new. */
static void diff_loop(unsigned char *kept, const unsigned char *new, Py_ssize_t n, Py_ssize_t itemsize, Entries *e,
                      Py_ssize_t first) {
    Py_ssize_t per_word = 8 / itemsize, words = n / 8, pos = 0;
    for (Py_ssize_t w = 0; w < words; w++, pos += 8) {
        uint64_t a = load64(kept + pos), b = load64(new + pos), x = a ^ b;
        if (!x)
            continue;
        for (Py_ssize_t k = 0; k < per_word; k++) {
            uint64_t v = lane(x, itemsize, k);
            if (v)
                entry(e, first + pos / itemsize + k, v, itemsize);
        }
        memcpy(kept + pos, &b, 8);
    }
    for (; pos < n; pos += itemsize) { /* the tail: whole elements, fewer than a word's worth */
        uint64_t a = 0, b = 0;
        memcpy(&a, kept + pos, (size_t)itemsize);
        memcpy(&b, new + pos, (size_t)itemsize);
        if (a != b) {
            entry(e, first + pos / itemsize, a ^ b, itemsize);
            memcpy(kept + pos, new + pos, (size_t)itemsize);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1

/* The same with AVX-512BW, 64 bytes at a time: one compare gives the mask of the changed
 * elements, and only those are visited. Returns where it stopped (a tail shorter than 64). */
__attribute__((target("avx512f,avx512bw"))) static inline __attribute__((always_inline))
Py_ssize_t diff_avx512_of(unsigned char *kept, const unsigned char *new, Py_ssize_t n, const Py_ssize_t itemsize,
                          Entries *out) {
    Entries local = *out, *e = &local; /* in registers: the stores of entries cannot alias it */
    Py_ssize_t pos = 0;
    uint64_t x[8];
    for (; pos + 64 <= n; pos += 64) {
        __m512i a = _mm512_loadu_si512((const void *)(kept + pos)), b = _mm512_loadu_si512((const void *)(new + pos));
        uint64_t mask = itemsize == 1 ? (uint64_t)_mm512_cmpneq_epi8_mask(a, b)
                      : itemsize == 2 ? (uint64_t)_mm512_cmpneq_epi16_mask(a, b)
                      : itemsize == 4 ? (uint64_t)_mm512_cmpneq_epi32_mask(a, b)
                                      : (uint64_t)_mm512_cmpneq_epi64_mask(a, b);
        if (!mask)
            continue;
        _mm512_storeu_si512((void *)x, _mm512_xor_si512(a, b));
        _mm512_storeu_si512((void *)(kept + pos), b);
        Py_ssize_t first = pos / itemsize;
        while (mask) {
            int k = __builtin_ctzll(mask);
            uint64_t v = 0;
            memcpy(&v, (const unsigned char *)x + k * itemsize, (size_t)itemsize);
            entry(e, first + k, v, itemsize);
            mask &= mask - 1;
        }
    }
    *out = local;
    return pos;
}

__attribute__((target("avx512f,avx512bw")))
static Py_ssize_t diff_avx512(unsigned char *kept, const unsigned char *new, Py_ssize_t n, Py_ssize_t itemsize,
                              Entries *e) {
    switch (itemsize) { /* a loop for each element size, with its constant */
    case 1: return diff_avx512_of(kept, new, n, 1, e);
    case 2: return diff_avx512_of(kept, new, n, 2, e);
    case 4: return diff_avx512_of(kept, new, n, 4, e);
    default: return diff_avx512_of(kept, new, n, 8, e);
    }
}

/* 2-byte elements (bfloat16, float16: the versions whose deltas are sparse) with AVX512-VBMI2 as
 * well: a block's changed elements are packed with one compress each for their positions and
 * their XOR values, and their gaps and values go into the four planes as four masked stores,
 * instead of an entry at a time. A block whose first change is more than MAX_GAP after the last
 * entry (fillers), or whose entries would not fit, takes the loop above. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2")))
static Py_ssize_t diff_u16_vbmi2(unsigned char *kept, const unsigned char *new, Py_ssize_t n, Entries *out) {
    Entries local = *out, *e = &local;
    const __m512i iota = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                                          12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i before = _mm512_set_epi16(30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                                            12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0); /* lane i: lane i - 1 */
    Py_ssize_t pos = 0;
    uint16_t x[32];
    for (; pos + 64 <= n; pos += 64) {
        __m512i a = _mm512_loadu_si512((const void *)(kept + pos)), b = _mm512_loadu_si512((const void *)(new + pos));
        __mmask32 mask = _mm512_cmpneq_epi16_mask(a, b);
        if (!mask)
            continue;
        _mm512_storeu_si512((void *)(kept + pos), b);
        __m512i v = _mm512_xor_si512(a, b);
        Py_ssize_t first = pos / 2, lo = first + __builtin_ctz(mask);
        int count = __builtin_popcount(mask);
        if (lo - e->last > MAX_GAP || e->entries + count > e->cap) {
            _mm512_storeu_si512((void *)x, v);
            for (uint32_t m = mask; m; m &= m - 1) {
                int k = __builtin_ctz(m);
                entry(e, first + k, x[k], 2);
            }
            continue;
        }
        __m512i at = _mm512_maskz_compress_epi16(mask, iota);
        __m512i gaps = _mm512_sub_epi16(at, _mm512_permutexvar_epi16(before, at));
        gaps = _mm512_mask_mov_epi16(gaps, 1, _mm512_set1_epi16((short)(lo - e->last)));
        __m512i values = _mm512_maskz_compress_epi16(mask, v);
        __mmask32 some = count == 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << count) - 1);
        unsigned char *p = e->planes + e->entries;
        Py_ssize_t cap = e->cap;
        _mm256_mask_storeu_epi8((void *)p, some, _mm512_cvtepi16_epi8(gaps));
        _mm256_mask_storeu_epi8((void *)(p + cap), some, _mm512_cvtepi16_epi8(_mm512_srli_epi16(gaps, 8)));
        _mm256_mask_storeu_epi8((void *)(p + 2 * cap), some, _mm512_cvtepi16_epi8(values));
        _mm256_mask_storeu_epi8((void *)(p + 3 * cap), some, _mm512_cvtepi16_epi8(_mm512_srli_epi16(values, 8)));
        e->entries += count;
        e->changed += count;
        e->last = first + 31 - __builtin_clz(mask);
    }
    *out = local;
    return pos;
}

static int has_avx512bw(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

static int has_vbmi2(void) {
    __builtin_cpu_init();
    return has_avx512bw() && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2");
}

/* What this CPU runs, asked once: 2 AVX512-VBMI2, 1 AVX512BW, 0 neither (one store: threads may race to it). */
static int simd(void) {
    static int level = -1;
    if (level < 0)
        level = has_vbmi2() ? 2 : has_avx512bw() ? 1 : 0;
    return level;
}
#endif

static void diff_any(unsigned char *kept, const unsigned char *new, Py_ssize_t n, Py_ssize_t itemsize, Entries *e) {
    Py_ssize_t done = 0;
#ifdef HAVE_X86
    int level = simd();
    if (level == 2 && itemsize == 2)
        done = diff_u16_vbmi2(kept, new, n, e);
    else if (level >= 1)
        done = diff_avx512(kept, new, n, itemsize, e);
#endif
    diff_loop(kept + done, new + done, n - done, itemsize, e, done / itemsize);
}

static int valid_itemsize(Py_ssize_t itemsize) {
    if (itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8)
        return 1;
    PyErr_Format(PyExc_ValueError, "no delta encoding for %zd-byte elements", itemsize);
    return 0;
}

static PyObject *py_diff(PyObject *self, PyObject *args) {
    Py_buffer kept, new, scratch;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "w*y*nw*:diff", &kept, &new, &itemsize, &scratch))
        return NULL;
    PyObject *result = NULL;
    if (!valid_itemsize(itemsize)) {
    } else if (kept.len != new.len || new.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "diff: %zd kept bytes against %zd new ones of %zd-byte elements",
                     kept.len, new.len, itemsize);
    } else {
        Entries e = {0};
        e.cap = scratch.len / (2 + itemsize);
        e.planes = (unsigned char *)scratch.buf;
        e.last = -1;
        Py_BEGIN_ALLOW_THREADS
        diff_any((unsigned char *)kept.buf, (const unsigned char *)new.buf, new.len, itemsize, &e);
        if (e.entries <= e.cap) /* each plane right behind the one before: the record's layout */
            for (Py_ssize_t p = 1; p < 2 + itemsize; p++)
                memmove(e.planes + p * e.entries, e.planes + p * e.cap, (size_t)e.entries);
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("nn", e.entries <= e.cap ? e.entries : (Py_ssize_t)-1, e.changed);
    }
    PyBuffer_Release(&kept);
    PyBuffer_Release(&new);
    PyBuffer_Release(&scratch);
    return result;
}

/* out = base (where base is not NULL; else out as it is), then element (sum of the first i+1 gaps)
 * - 1 XOR value i, the entries' bytes in planes; -1 when an entry names an element beyond the end
 * (out is then partly written). */
static inline __attribute__((always_inline)) Py_ssize_t patch_of(const unsigned char *base, unsigned char *out,
                                                                 Py_ssize_t n, const unsigned char *raw,
                                                                 Py_ssize_t entries, const Py_ssize_t itemsize) {
    if (base)
        memcpy(out, base, (size_t)n);
    const unsigned char *hi = raw + entries, *values = raw + 2 * entries;
    Py_ssize_t elements = n / itemsize, at = -1;
    for (Py_ssize_t i = 0; i < entries; i++) {
        at += raw[i] | (Py_ssize_t)hi[i] << 8;
        if (at >= elements || at < 0)
            return -1;
        uint64_t v = 0, d = 0;
        for (Py_ssize_t k = 0; k < itemsize; k++)
            v |= (uint64_t)values[k * entries + i] << (8 * k);
        memcpy(&d, out + at * itemsize, (size_t)itemsize);
        d ^= v;
        memcpy(out + at * itemsize, &d, (size_t)itemsize); /* little-endian: the low bytes */
    }
    return 0;
}

static Py_ssize_t patch_loop(const unsigned char *base, unsigned char *out, Py_ssize_t n, const unsigned char *raw,
                             Py_ssize_t entries, Py_ssize_t itemsize) {
    switch (itemsize) { /* a loop for each element size, with its constant */
    case 1: return patch_of(base, out, n, raw, entries, 1);
    case 2: return patch_of(base, out, n, raw, entries, 2);
    case 4: return patch_of(base, out, n, raw, entries, 4);
    default: return patch_of(base, out, n, raw, entries, 8);
    }
}

static PyObject *py_patch(PyObject *self, PyObject *args) {
    PyObject *base_arg;
    Py_buffer base = {0}, out, raw;
    Py_ssize_t entries, itemsize;
    if (!PyArg_ParseTuple(args, "Ow*y*nn:patch", &base_arg, &out, &raw, &entries, &itemsize))
        return NULL;
    PyObject *result = NULL;
    int in_place = base_arg == Py_None;
    if (!in_place && PyObject_GetBuffer(base_arg, &base, PyBUF_SIMPLE) < 0) {
    } else if (!valid_itemsize(itemsize)) {
    } else if ((!in_place && base.len != out.len) || out.len % itemsize || entries < 0 ||
               raw.len != entries * (2 + itemsize)) {
        PyErr_Format(PyExc_ValueError, "patch: %zd entries in %zd bytes, %zd base bytes into %zd", entries, raw.len,
                     in_place ? out.len : base.len, out.len);
    } else {
        Py_ssize_t got;
        Py_BEGIN_ALLOW_THREADS
        got = patch_loop(in_place ? NULL : (const unsigned char *)base.buf, (unsigned char *)out.buf, out.len,
                         (const unsigned char *)raw.buf, entries, itemsize);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(got == 0);
    }
    if (!in_place && base.obj != NULL)
        PyBuffer_Release(&base);
    PyBuffer_Release(&out);
    PyBuffer_Release(&raw);
    return result;
}

static PyMethodDef methods[] = {
    {"diff", py_diff, METH_VARARGS,
     "diff(kept, new, itemsize, scratch) -> (entries, changed): the entries that make `new` of `kept` into scratch "
     "(byte planes of the u16 gaps, then of the XOR values), `kept` made equal to `new`; entries is -1 when they do not "
     "fit scratch."},
    {"patch", py_patch, METH_VARARGS,
     "patch(base, out, raw, entries, itemsize) -> bool: out = base with the entries in raw applied (with base None, "
     "out with them applied in place); False when an entry names an element beyond the end."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "weightsync._delta", NULL, -1, methods};

PyMODINIT_FUNC PyInit__delta(void) { return PyModule_Create(&module); }
