/* float32 -> bfloat16 on CPUs with AVX512-BF16: one pass, without the GIL.
 *
 * A trainer casts every element of its share of each version. That cast reads the float32
 * master weights from memory and is bound by it; the VCVTNE2PS2BF16 instruction does the
 * rounding (to nearest even) in one step, which keeps the loop at the memory's pace, where
 * torch's portable cast takes 30% longer. The bytes are torch's: denormals are rounded (the
 * instruction would flush them), and NaN becomes 0xFFFF as torch's vectorised cast makes it.
 * Elsewhere (other CPUs, other dtypes) weightsync casts with torch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* One element, rounded to nearest even: what torch computes. */
static inline uint16_t round_one(const float *x) {
    uint32_t u;
    memcpy(&u, x, sizeof u);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFF : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1

/* Lanes holding a denormal (exponent 0, mantissa not 0): |u| - 1 < 0x7FFFFF, unsigned. */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline __mmask16 denormal(__m512 x) {
    __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
    return _mm512_cmplt_epu32_mask(_mm512_sub_epi32(magnitude, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFFFF));
}

__attribute__((target("avx512f,avx512bw,avx512bf16")))
static void cast_avx512bf16(const float *src, uint16_t *dst, size_t n) {
    const __m512i nan = _mm512_set1_epi16((short)0xFFFF);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 lo = _mm512_loadu_ps(src + i);
        __m512 hi = _mm512_loadu_ps(src + i + 16);
        if (__builtin_expect((denormal(lo) | denormal(hi)) != 0, 0)) {
            /* the instruction flushes denormals to zero; torch rounds them */
            for (size_t k = i; k < i + 32; k++)
                dst[k] = round_one(src + k);
            continue;
        }
        __m512i out = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        __mmask32 unordered = (__mmask32)_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q)
                            | ((__mmask32)_mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q) << 16);
        _mm512_storeu_si512((void *)(dst + i), _mm512_mask_blend_epi16(unordered, out, nan));
    }
    for (; i < n; i++)
        dst[i] = round_one(src + i);
}
#endif

static int supported(void) {
#ifdef HAVE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

static PyObject *py_supported(PyObject *self, PyObject *args) {
    return PyBool_FromLong(supported());
}

static PyObject *py_float32_to_bfloat16(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*:float32_to_bfloat16", &src, &dst))
        return NULL;
    PyObject *result = NULL;
    if (!supported()) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no AVX512-BF16");
    } else if (src.len % 4 != 0 || dst.len * 2 != src.len) {
        PyErr_Format(PyExc_ValueError, "float32_to_bfloat16: %zd source bytes do not fill %zd destination bytes",
                     src.len, dst.len);
    } else {
#ifdef HAVE_X86
        Py_BEGIN_ALLOW_THREADS
        cast_avx512bf16((const float *)src.buf, (uint16_t *)dst.buf, (size_t)src.len / 4);
        Py_END_ALLOW_THREADS
#endif
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"supported", py_supported, METH_NOARGS, "True when this CPU can run float32_to_bfloat16."},
    {"float32_to_bfloat16", py_float32_to_bfloat16, METH_VARARGS,
     "float32_to_bfloat16(src, dst): cast the float32 values in the buffer src into the buffer dst, "
     "half its size, rounding to nearest even."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "weightsync._cast", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cast(void) { return PyModule_Create(&module); }
