/* Element-wise reductions, float16/bfloat16 conversions and AVG finalisation.
 *
 * Semantics (the Python oracles in pccl/kernels.py implement exactly these):
 *
 *   Integers (int8..int64, uint8..uint64): SUM and PROD wrap modulo 2^bits like numpy's
 *   add/multiply.  The arithmetic is done in the unsigned type of the same width (at least
 *   `unsigned int`, so that small types are not promoted to a signed int that could overflow),
 *   which is defined behaviour in C; the conversion back to a signed type is modulo 2^bits on
 *   every compiler pccl supports (gcc, clang, MSVC document it).
 *
 *   Floats: SUM/PROD are one IEEE operation per element in the destination type, so
 *   float32 SUM equals numpy's float32 add bit for bit (in IEEE's default mode: on x86-64 every
 *   float kernel runs so whatever flush-to-zero / rounding mode the calling thread set, see
 *   PCCL_IEEE_CALL in kernels_internal.h).  MIN/MAX follow numpy.minimum /
 *   numpy.maximum: a NaN in either operand gives NaN, and when the operands compare equal
 *   (+0 and -0) the result is the src operand, as numpy returns its second argument.
 *
 *   float16/bfloat16 sources are widened exactly to float32 and combined with a float32
 *   destination by the float32 rules above.  Narrowing float32 -> float16/bfloat16 rounds to
 *   nearest, ties to even; overflow gives Inf and NaN stays NaN (see kernels_internal.h).
 *
 *   AVG accumulates as SUM.  pccl_avg_finalize divides by the count: floats by an IEEE
 *   division by (T)count (numpy's `a / T(count)`); integers by FLOOR division (numpy's
 *   `a // count`, rounding toward minus infinity: -7 // 2 == -4), computed in 64 bits so
 *   that counts larger than the element type can hold are fine.
 *
 * Every loop is a plain C99 loop over restrict pointers, written so that gcc/clang -O3
 * vectorise it on the x86-64 baseline (SSE2).  Selects use the `c ? a : b` form, which the
 * compiler turns into compare+blend, not branches.
 */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "kernels_internal.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

int pccl_kernels_abi_version(void) { return 6; }

/* ---- same-type reductions ------------------------------------------------------------ */

/* T: element type; W: the unsigned type the arithmetic wraps in. */
#define DEF_INT_REDUCE(SUF, T, W)                                                                  \
    PCCL_VEC static void sum_##SUF(T *restrict d, const T *restrict s, size_t n) {                 \
        for (size_t i = 0; i < n; i++) d[i] = (T)((W)d[i] + (W)s[i]);                              \
    }                                                                                              \
    PCCL_VEC static void prod_##SUF(T *restrict d, const T *restrict s, size_t n) {                \
        for (size_t i = 0; i < n; i++) d[i] = (T)((W)d[i] * (W)s[i]);                              \
    }                                                                                              \
    PCCL_VEC static void min_##SUF(T *restrict d, const T *restrict s, size_t n) {                 \
        for (size_t i = 0; i < n; i++) d[i] = s[i] < d[i] ? s[i] : d[i];                           \
    }                                                                                              \
    PCCL_VEC static void max_##SUF(T *restrict d, const T *restrict s, size_t n) {                 \
        for (size_t i = 0; i < n; i++) d[i] = s[i] > d[i] ? s[i] : d[i];                           \
    }

/* (W) of a negative value is defined (modulo 2^N); for 8/16-bit types W = unsigned int,
 * whose product of two values < 2^16 cannot overflow, and the final (T) keeps the low bits. */
DEF_INT_REDUCE(u8, uint8_t, unsigned int)
DEF_INT_REDUCE(i8, int8_t, unsigned int)
DEF_INT_REDUCE(u16, uint16_t, unsigned int)
DEF_INT_REDUCE(i16, int16_t, unsigned int)
DEF_INT_REDUCE(u32, uint32_t, uint32_t)
DEF_INT_REDUCE(i32, int32_t, uint32_t)
DEF_INT_REDUCE(u64, uint64_t, uint64_t)
DEF_INT_REDUCE(i64, int64_t, uint64_t)

/* numpy.minimum(d, s): d if d < s or d is NaN, else s (so s on ties and when s is NaN). */
#define FMIN(d, s) (((d) < (s) || (d) != (d)) ? (d) : (s))
#define FMAX(d, s) (((d) > (s) || (d) != (d)) ? (d) : (s))

#define DEF_FLOAT_REDUCE(SUF, T)                                                                   \
    PCCL_VEC static void sum_##SUF(T *restrict d, const T *restrict s, size_t n) {                 \
        for (size_t i = 0; i < n; i++) d[i] = d[i] + s[i];                                         \
    }                                                                                              \
    PCCL_VEC static void prod_##SUF(T *restrict d, const T *restrict s, size_t n) {                \
        for (size_t i = 0; i < n; i++) d[i] = d[i] * s[i];                                         \
    }                                                                                              \
    PCCL_VEC static void min_##SUF(T *restrict d, const T *restrict s, size_t n) {                 \
        for (size_t i = 0; i < n; i++) { T a = d[i], b = s[i]; d[i] = FMIN(a, b); }                \
    }                                                                                              \
    PCCL_VEC static void max_##SUF(T *restrict d, const T *restrict s, size_t n) {                 \
        for (size_t i = 0; i < n; i++) { T a = d[i], b = s[i]; d[i] = FMAX(a, b); }                \
    }

DEF_FLOAT_REDUCE(f32, float)
DEF_FLOAT_REDUCE(f64, double)

#define DISPATCH_OP(SUF, T)                                                                        \
    switch (op) {                                                                                  \
    case PCCL_SUM:                                                                                 \
    case PCCL_AVG: sum_##SUF((T *)dst, (const T *)src, n); return PCCL_OK;                         \
    case PCCL_PROD: prod_##SUF((T *)dst, (const T *)src, n); return PCCL_OK;                       \
    case PCCL_MIN: min_##SUF((T *)dst, (const T *)src, n); return PCCL_OK;                         \
    case PCCL_MAX: max_##SUF((T *)dst, (const T *)src, n); return PCCL_OK;                         \
    default: return PCCL_EOP;                                                                      \
    }

/* The dtypes of the same-type reductions, each dispatched by DISPATCH(suffix, C type). */
#define SWITCH_SAME_TYPE(DISPATCH)                                                                 \
    switch (dtype) {                                                                               \
    case PCCL_U8: DISPATCH(u8, uint8_t)                                                            \
    case PCCL_I8: DISPATCH(i8, int8_t)                                                             \
    case PCCL_U16: DISPATCH(u16, uint16_t)                                                         \
    case PCCL_I16: DISPATCH(i16, int16_t)                                                          \
    case PCCL_U32: DISPATCH(u32, uint32_t)                                                         \
    case PCCL_I32: DISPATCH(i32, int32_t)                                                          \
    case PCCL_U64: DISPATCH(u64, uint64_t)                                                         \
    case PCCL_I64: DISPATCH(i64, int64_t)                                                          \
    case PCCL_F32: DISPATCH(f32, float)                                                            \
    case PCCL_F64: DISPATCH(f64, double)                                                           \
    default: return PCCL_EDTYPE;                                                                   \
    }

PCCL_NOINLINE static int pccl_reduce_impl(int op, int dtype, void *dst, const void *src, size_t n) {
    SWITCH_SAME_TYPE(DISPATCH_OP)
}

int pccl_reduce(int op, int dtype, void *dst, const void *src, size_t n) {
    PCCL_IEEE_CALL(pccl_reduce_impl(op, dtype, dst, src, n));
}

/* ---- three-operand reductions ------------------------------------------------------- */

/* dst[i] = a[i] op b[i]: pccl_reduce's arithmetic with a in dst's role (so MIN/MAX give b on
 * ties, as numpy.minimum(a, b) does), i.e. memcpy(dst, a) followed by pccl_reduce(dst, b), in
 * one pass.  Bit for bit, except the payload of a float SUM/PROD of two NaNs: C lets the compiler
 * swap the operands of + and *, and the hardware keeps the first one's (pccl_reduce leaves that
 * unspecified too).  The out-of-place all-reduce's first reduction of a slice: its own input and
 * the partial sum it received, into the output. */
#define DEF_INT_REDUCE_TO(SUF, T, W)                                                               \
    PCCL_VEC static void sum3_##SUF(T *restrict d, const T *restrict a, const T *restrict b,       \
                                    size_t n) {                                                    \
        for (size_t i = 0; i < n; i++) d[i] = (T)((W)a[i] + (W)b[i]);                              \
    }                                                                                              \
    PCCL_VEC static void prod3_##SUF(T *restrict d, const T *restrict a, const T *restrict b,      \
                                     size_t n) {                                                   \
        for (size_t i = 0; i < n; i++) d[i] = (T)((W)a[i] * (W)b[i]);                              \
    }                                                                                              \
    PCCL_VEC static void min3_##SUF(T *restrict d, const T *restrict a, const T *restrict b,       \
                                    size_t n) {                                                    \
        for (size_t i = 0; i < n; i++) d[i] = b[i] < a[i] ? b[i] : a[i];                           \
    }                                                                                              \
    PCCL_VEC static void max3_##SUF(T *restrict d, const T *restrict a, const T *restrict b,       \
                                    size_t n) {                                                    \
        for (size_t i = 0; i < n; i++) d[i] = b[i] > a[i] ? b[i] : a[i];                           \
    }

DEF_INT_REDUCE_TO(u8, uint8_t, unsigned int)
DEF_INT_REDUCE_TO(i8, int8_t, unsigned int)
DEF_INT_REDUCE_TO(u16, uint16_t, unsigned int)
DEF_INT_REDUCE_TO(i16, int16_t, unsigned int)
DEF_INT_REDUCE_TO(u32, uint32_t, uint32_t)
DEF_INT_REDUCE_TO(i32, int32_t, uint32_t)
DEF_INT_REDUCE_TO(u64, uint64_t, uint64_t)
DEF_INT_REDUCE_TO(i64, int64_t, uint64_t)

#define DEF_FLOAT_REDUCE_TO(SUF, T)                                                                \
    PCCL_VEC static void sum3_##SUF(T *restrict d, const T *restrict a, const T *restrict b,       \
                                    size_t n) {                                                    \
        for (size_t i = 0; i < n; i++) d[i] = a[i] + b[i];                                         \
    }                                                                                              \
    PCCL_VEC static void prod3_##SUF(T *restrict d, const T *restrict a, const T *restrict b,      \
                                     size_t n) {                                                   \
        for (size_t i = 0; i < n; i++) d[i] = a[i] * b[i];                                         \
    }                                                                                              \
    PCCL_VEC static void min3_##SUF(T *restrict d, const T *restrict a, const T *restrict b,       \
                                    size_t n) {                                                    \
        for (size_t i = 0; i < n; i++) { T x = a[i], y = b[i]; d[i] = FMIN(x, y); }                \
    }                                                                                              \
    PCCL_VEC static void max3_##SUF(T *restrict d, const T *restrict a, const T *restrict b,       \
                                    size_t n) {                                                    \
        for (size_t i = 0; i < n; i++) { T x = a[i], y = b[i]; d[i] = FMAX(x, y); }                \
    }

DEF_FLOAT_REDUCE_TO(f32, float)
DEF_FLOAT_REDUCE_TO(f64, double)

#define DISPATCH_OP3(SUF, T)                                                                       \
    switch (op) {                                                                                  \
    case PCCL_SUM:                                                                                 \
    case PCCL_AVG: sum3_##SUF((T *)dst, (const T *)a, (const T *)b, n); return PCCL_OK;            \
    case PCCL_PROD: prod3_##SUF((T *)dst, (const T *)a, (const T *)b, n); return PCCL_OK;          \
    case PCCL_MIN: min3_##SUF((T *)dst, (const T *)a, (const T *)b, n); return PCCL_OK;            \
    case PCCL_MAX: max3_##SUF((T *)dst, (const T *)a, (const T *)b, n); return PCCL_OK;            \
    default: return PCCL_EOP;                                                                      \
    }

PCCL_NOINLINE static int pccl_reduce_to_impl(int op, int dtype, void *dst, const void *a,
                                             const void *b, size_t n) {
    SWITCH_SAME_TYPE(DISPATCH_OP3)
}

int pccl_reduce_to(int op, int dtype, void *dst, const void *a, const void *b, size_t n) {
    PCCL_IEEE_CALL(pccl_reduce_to_impl(op, dtype, dst, a, b, n));
}

/* ---- reductions that save the destination first ------------------------------------- */

/* backup[i] = dst[i]; dst[i] = dst[i] op src[i], for the in-place all-reduce, whose input must
 * stay restorable.  Done block by block: each block of dst is copied to the backup and then
 * reduced while it is still in L1, so dst is read from memory once instead of twice (copy pass,
 * then reduce pass).  On x86-64 the backup is written with non-temporal (streaming) stores: it
 * is only read again if the op aborts, so there is no point pulling its lines into the cache
 * (a normal store first reads the line: a third of the backup's memory traffic).  The closing
 * sfence orders those stores before the kernel returns, so any thread that later sees the
 * slice marked as saved (through a lock) also sees its bytes.  The arithmetic is pccl_reduce's
 * / pccl_dequantize_reduce's own, applied to each block: results are bit-identical. */
void pccl_save_block(void *restrict backup, const void *restrict dst, size_t nbytes) {
#if defined(__SSE2__)
    char *b = (char *)backup;
    const char *d = (const char *)dst;
    size_t i = 0;
    while (i < nbytes && ((uintptr_t)(b + i) & 15u) != 0) {
        b[i] = d[i];
        i++;
    }
    for (; i + 64 <= nbytes; i += 64) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(d + i));
        __m128i x1 = _mm_loadu_si128((const __m128i *)(d + i + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(d + i + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(d + i + 48));
        _mm_stream_si128((__m128i *)(b + i), x0);
        _mm_stream_si128((__m128i *)(b + i + 16), x1);
        _mm_stream_si128((__m128i *)(b + i + 32), x2);
        _mm_stream_si128((__m128i *)(b + i + 48), x3);
    }
    for (; i + 16 <= nbytes; i += 16)
        _mm_stream_si128((__m128i *)(b + i), _mm_loadu_si128((const __m128i *)(d + i)));
    for (; i < nbytes; i++) b[i] = d[i];
#else
    memcpy(backup, dst, nbytes);
#endif
}

void pccl_save_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

int pccl_save_copy(void *backup, const void *src, size_t nbytes) {
    pccl_save_block(backup, src, nbytes);
    pccl_save_fence();
    return PCCL_OK;
}

static size_t dtype_size(int dtype) {
    switch (dtype) {
    case PCCL_U8: case PCCL_I8: return 1;
    case PCCL_U16: case PCCL_I16: case PCCL_F16: case PCCL_BF16: return 2;
    case PCCL_U32: case PCCL_I32: case PCCL_F32: return 4;
    case PCCL_U64: case PCCL_I64: case PCCL_F64: return 8;
    default: return 0;
    }
}

int pccl_reduce_save(int op, int dtype, void *dst, const void *src, void *backup, size_t n) {
    /* validate op and dtype (f16/bf16 are refused) before touching memory: n == 0 checks only */
    int rc = pccl_reduce(op, dtype, dst, src, 0);
    if (rc != PCCL_OK) return rc;
    size_t size = dtype_size(dtype);
    size_t block = PCCL_SAVE_BLOCK / size;
    char *d = (char *)dst, *b = (char *)backup;
    const char *s = (const char *)src;
    for (size_t i = 0; i < n; i += block) {
        size_t len = n - i < block ? n - i : block;
        pccl_save_block(b + i * size, d + i * size, len * size);
        pccl_reduce(op, dtype, d + i * size, s + i * size, len);
    }
    pccl_save_fence();
    return PCCL_OK;
}

/* ---- float16 / bfloat16 into float32 ------------------------------------------------- */

#define DEF_WIDEN_REDUCE(SUF, CONV)                                                                \
    PCCL_VEC static void wsum_##SUF(float *restrict d, const uint16_t *restrict s, size_t n) {     \
        for (size_t i = 0; i < n; i++) d[i] = d[i] + CONV(s[i]);                                   \
    }                                                                                              \
    PCCL_VEC static void wprod_##SUF(float *restrict d, const uint16_t *restrict s, size_t n) {    \
        for (size_t i = 0; i < n; i++) d[i] = d[i] * CONV(s[i]);                                   \
    }                                                                                              \
    PCCL_VEC static void wmin_##SUF(float *restrict d, const uint16_t *restrict s, size_t n) {     \
        for (size_t i = 0; i < n; i++) { float a = d[i], b = CONV(s[i]); d[i] = FMIN(a, b); }      \
    }                                                                                              \
    PCCL_VEC static void wmax_##SUF(float *restrict d, const uint16_t *restrict s, size_t n) {     \
        for (size_t i = 0; i < n; i++) { float a = d[i], b = CONV(s[i]); d[i] = FMAX(a, b); }      \
    }                                                                                              \
    PCCL_VEC static void widen_##SUF(float *restrict d, const uint16_t *restrict s, size_t n) {    \
        for (size_t i = 0; i < n; i++) d[i] = CONV(s[i]);                                          \
    }

DEF_WIDEN_REDUCE(f16, pccl_f16_to_f32)
DEF_WIDEN_REDUCE(bf16, pccl_bf16_to_f32)

#define DISPATCH_WIDEN_OP(SUF)                                                                     \
    switch (op) {                                                                                  \
    case PCCL_SUM:                                                                                 \
    case PCCL_AVG: wsum_##SUF(dst, (const uint16_t *)src, n); return PCCL_OK;                      \
    case PCCL_PROD: wprod_##SUF(dst, (const uint16_t *)src, n); return PCCL_OK;                    \
    case PCCL_MIN: wmin_##SUF(dst, (const uint16_t *)src, n); return PCCL_OK;                      \
    case PCCL_MAX: wmax_##SUF(dst, (const uint16_t *)src, n); return PCCL_OK;                      \
    default: return PCCL_EOP;                                                                      \
    }

PCCL_NOINLINE static int pccl_reduce_widen_impl(int op, int src_dtype, float *dst, const void *src, size_t n) {
    switch (src_dtype) {
    case PCCL_F16: DISPATCH_WIDEN_OP(f16)
    case PCCL_BF16: DISPATCH_WIDEN_OP(bf16)
    default: return PCCL_EDTYPE;
    }
}

int pccl_reduce_widen(int op, int src_dtype, float *dst, const void *src, size_t n) {
    PCCL_IEEE_CALL(pccl_reduce_widen_impl(op, src_dtype, dst, src, n));
}

PCCL_NOINLINE static int pccl_widen_impl(int src_dtype, float *dst, const void *src, size_t n) {
    switch (src_dtype) {
    case PCCL_F16: widen_f16(dst, (const uint16_t *)src, n); return PCCL_OK;
    case PCCL_BF16: widen_bf16(dst, (const uint16_t *)src, n); return PCCL_OK;
    default: return PCCL_EDTYPE;
    }
}

int pccl_widen(int src_dtype, float *dst, const void *src, size_t n) {
    PCCL_IEEE_CALL(pccl_widen_impl(src_dtype, dst, src, n));
}

PCCL_VEC static void narrow_f16(uint16_t *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = pccl_f32_to_f16(s[i]);
}

PCCL_VEC static void narrow_bf16(uint16_t *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = pccl_f32_to_bf16(s[i]);
}

PCCL_NOINLINE static int pccl_narrow_impl(int dst_dtype, void *dst, const float *src, size_t n) {
    switch (dst_dtype) {
    case PCCL_F16: narrow_f16((uint16_t *)dst, src, n); return PCCL_OK;
    case PCCL_BF16: narrow_bf16((uint16_t *)dst, src, n); return PCCL_OK;
    default: return PCCL_EDTYPE;
    }
}

int pccl_narrow(int dst_dtype, void *dst, const float *src, size_t n) {
    PCCL_IEEE_CALL(pccl_narrow_impl(dst_dtype, dst, src, n));
}

/* ---- AVG finalisation ---------------------------------------------------------------- */

/* Floor division of a signed value by a positive count, in int64 (no overflow: |q| <= |a|). */
#define DEF_AVG_SIGNED(SUF, T)                                                                     \
    PCCL_VEC static void avg_##SUF(T *restrict d, size_t n, int64_t c) {                           \
        for (size_t i = 0; i < n; i++) {                                                           \
            int64_t a = (int64_t)d[i];                                                             \
            int64_t q = a / c;                                                                     \
            q -= (q * c != a) & (a < 0);                                                           \
            d[i] = (T)q;                                                                           \
        }                                                                                          \
    }
#define DEF_AVG_UNSIGNED(SUF, T)                                                                   \
    PCCL_VEC static void avg_##SUF(T *restrict d, size_t n, uint64_t c) {                          \
        for (size_t i = 0; i < n; i++) d[i] = (T)((uint64_t)d[i] / c);                             \
    }
#define DEF_AVG_FLOAT(SUF, T)                                                                      \
    PCCL_VEC static void avg_##SUF(T *restrict d, size_t n, uint64_t count) {                      \
        const T c = (T)count;                                                                      \
        for (size_t i = 0; i < n; i++) d[i] = d[i] / c;                                            \
    }

DEF_AVG_SIGNED(i8, int8_t)
DEF_AVG_SIGNED(i16, int16_t)
DEF_AVG_SIGNED(i32, int32_t)
DEF_AVG_SIGNED(i64, int64_t)
DEF_AVG_UNSIGNED(u8, uint8_t)
DEF_AVG_UNSIGNED(u16, uint16_t)
DEF_AVG_UNSIGNED(u32, uint32_t)
DEF_AVG_UNSIGNED(u64, uint64_t)
DEF_AVG_FLOAT(f32, float)
DEF_AVG_FLOAT(f64, double)

PCCL_NOINLINE static int pccl_avg_finalize_impl(int dtype, void *dst, size_t n, uint64_t count) {
    /* counts beyond INT64_MAX are meaningless (a peer count) and would break the signed path */
    if (count == 0 || count > (uint64_t)INT64_MAX) return PCCL_EARG;
    switch (dtype) {
    case PCCL_I8: avg_i8((int8_t *)dst, n, (int64_t)count); return PCCL_OK;
    case PCCL_I16: avg_i16((int16_t *)dst, n, (int64_t)count); return PCCL_OK;
    case PCCL_I32: avg_i32((int32_t *)dst, n, (int64_t)count); return PCCL_OK;
    case PCCL_I64: avg_i64((int64_t *)dst, n, (int64_t)count); return PCCL_OK;
    case PCCL_U8: avg_u8((uint8_t *)dst, n, count); return PCCL_OK;
    case PCCL_U16: avg_u16((uint16_t *)dst, n, count); return PCCL_OK;
    case PCCL_U32: avg_u32((uint32_t *)dst, n, count); return PCCL_OK;
    case PCCL_U64: avg_u64((uint64_t *)dst, n, count); return PCCL_OK;
    case PCCL_F32: avg_f32((float *)dst, n, count); return PCCL_OK;
    case PCCL_F64: avg_f64((double *)dst, n, count); return PCCL_OK;
    default: return PCCL_EDTYPE;
    }
}

int pccl_avg_finalize(int dtype, void *dst, size_t n, uint64_t count) {
    PCCL_IEEE_CALL(pccl_avg_finalize_impl(dtype, dst, n, count));
}
