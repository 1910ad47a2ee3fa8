/* The inner loops of delta versions (delta.py defines the patch format), without the GIL.
 *
 * diff() compares a chunk of new bytes with the kept ones in one pass, 64 bytes at a time with
 * AVX-512BW, else 8: a block that did not change is only read; a block that did is written into
 * the kept bytes, and each of its changed elements becomes an entry (the u16 gap from the one before, the XOR of its values),
 * with a filler entry (value 0) wherever a gap would exceed 65535. patch() copies a chunk of the
 * base and XORs the entries into it. numpy needs a dozen passes and temporary arrays for either;
 * this is one pass over memory that is in cache.
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

static inline __attribute__((always_inline)) void put_value(unsigned char *values, Py_ssize_t at, uint64_t v, Py_ssize_t itemsize) {
    memcpy(values + at * itemsize, &v, (size_t)itemsize); /* little-endian: the low bytes */
}

typedef struct {
    uint16_t *gaps;
    unsigned char *values;
    Py_ssize_t cap, entries, changed, last; /* last: index of the last entry, -1 before the first */
} Entries;

/* An entry for element `i`, whose value is `v`; fillers first where the gap is too long. Past
 * `cap` entries only the count goes on. Inlined where itemsize is a constant: each entry is then
 * two stores. */
static inline __attribute__((always_inline)) void entry(Entries *e, Py_ssize_t i, uint64_t v, Py_ssize_t itemsize) {
    while (i - e->last > MAX_GAP) {
        e->last += MAX_GAP;
        if (e->entries < e->cap) {
            e->gaps[e->entries] = MAX_GAP;
            put_value(e->values, e->entries, 0, itemsize);
        }
        e->entries++;
    }
    if (e->entries < e->cap) {
        e->gaps[e->entries] = (uint16_t)(i - e->last);
        put_value(e->values, e->entries, v, itemsize);
    }
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

static int has_avx512bw(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
#endif

static void diff_any(unsigned char *kept, const unsigned char *new, Py_ssize_t n, Py_ssize_t itemsize, Entries *e) {
    Py_ssize_t done = 0;
#ifdef HAVE_X86
    static int avx512 = -1;
    if (avx512 < 0)
        avx512 = has_avx512bw();
    if (avx512)
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
        e.gaps = (uint16_t *)scratch.buf;
        e.values = (unsigned char *)scratch.buf + 2 * e.cap;
        e.last = -1;
        Py_BEGIN_ALLOW_THREADS
        diff_any((unsigned char *)kept.buf, (const unsigned char *)new.buf, new.len, itemsize, &e);
        if (e.entries <= e.cap) /* the values right behind the gaps: the record's layout */
            memmove((unsigned char *)scratch.buf + 2 * e.entries, e.values, (size_t)(e.entries * itemsize));
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("nn", e.entries <= e.cap ? e.entries : (Py_ssize_t)-1, e.changed);
    }
    PyBuffer_Release(&kept);
    PyBuffer_Release(&new);
    PyBuffer_Release(&scratch);
    return result;
}

#define XOR_INTO(type, dst, src) do { type d_, s_; memcpy(&d_, dst, sizeof d_); memcpy(&s_, src, sizeof s_); \
                                        d_ ^= s_; memcpy(dst, &d_, sizeof d_); } while (0)

/* out = base, then element (sum of the first i+1 gaps) - 1 XOR value i; -1 when an entry names an
 * element beyond the end (out is then partly written). */
static Py_ssize_t patch_loop(const unsigned char *base, unsigned char *out, Py_ssize_t n, const unsigned char *raw,
                             Py_ssize_t entries, Py_ssize_t itemsize) {
    memcpy(out, base, (size_t)n);
    const unsigned char *values = raw + 2 * entries;
    Py_ssize_t elements = n / itemsize, at = -1;
    for (Py_ssize_t i = 0; i < entries; i++) {
        uint16_t gap;
        memcpy(&gap, raw + 2 * i, 2);
        at += gap;
        if (at >= elements || at < 0)
            return -1;
        unsigned char *e = out + at * itemsize;
        const unsigned char *v = values + i * itemsize;
        switch (itemsize) { /* fixed sizes: each a load, an XOR and a store */
        case 1: XOR_INTO(uint8_t, e, v); break;
        case 2: XOR_INTO(uint16_t, e, v); break;
        case 4: XOR_INTO(uint32_t, e, v); break;
        default: XOR_INTO(uint64_t, e, v); break;
        }
    }
    return 0;
}

static PyObject *py_patch(PyObject *self, PyObject *args) {
    Py_buffer base, out, raw;
    Py_ssize_t entries, itemsize;
    if (!PyArg_ParseTuple(args, "y*w*y*nn:patch", &base, &out, &raw, &entries, &itemsize))
        return NULL;
    PyObject *result = NULL;
    if (!valid_itemsize(itemsize)) {
    } else if (base.len != out.len || out.len % itemsize || entries < 0 || raw.len != entries * (2 + itemsize)) {
        PyErr_Format(PyExc_ValueError, "patch: %zd entries in %zd bytes, %zd base bytes into %zd", entries, raw.len,
                     base.len, out.len);
    } else {
        Py_ssize_t got;
        Py_BEGIN_ALLOW_THREADS
        got = patch_loop((const unsigned char *)base.buf, (unsigned char *)out.buf, out.len,
                         (const unsigned char *)raw.buf, entries, itemsize);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(got == 0);
    }
    PyBuffer_Release(&base);
    PyBuffer_Release(&out);
    PyBuffer_Release(&raw);
    return result;
}

static PyMethodDef methods[] = {
    {"diff", py_diff, METH_VARARGS,
     "diff(kept, new, itemsize, scratch) -> (entries, changed): the entries that make `new` of `kept` into scratch "
     "(u16 gaps, then the XOR values), `kept` made equal to `new`; entries is -1 when they do not fit scratch."},
    {"patch", py_patch, METH_VARARGS,
     "patch(base, out, raw, entries, itemsize) -> bool: out = base with the entries in raw applied; False when an "
     "entry names an element beyond the end."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "weightsync._delta", NULL, -1, methods};

PyMODINIT_FUNC PyInit__delta(void) { return PyModule_Create(&module); }
