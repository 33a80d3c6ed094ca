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
 *   float32 SUM equals numpy's float32 add bit for bit.  MIN/MAX follow numpy.minimum /
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

int pccl_kernels_abi_version(void) { return 2; }

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

int pccl_reduce(int op, int dtype, void *dst, const void *src, size_t n) {
    switch (dtype) {
    case PCCL_U8: DISPATCH_OP(u8, uint8_t)
    case PCCL_I8: DISPATCH_OP(i8, int8_t)
    case PCCL_U16: DISPATCH_OP(u16, uint16_t)
    case PCCL_I16: DISPATCH_OP(i16, int16_t)
    case PCCL_U32: DISPATCH_OP(u32, uint32_t)
    case PCCL_I32: DISPATCH_OP(i32, int32_t)
    case PCCL_U64: DISPATCH_OP(u64, uint64_t)
    case PCCL_I64: DISPATCH_OP(i64, int64_t)
    case PCCL_F32: DISPATCH_OP(f32, float)
    case PCCL_F64: DISPATCH_OP(f64, double)
    default: return PCCL_EDTYPE;
    }
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

int pccl_reduce_widen(int op, int src_dtype, float *dst, const void *src, size_t n) {
    switch (src_dtype) {
    case PCCL_F16: DISPATCH_WIDEN_OP(f16)
    case PCCL_BF16: DISPATCH_WIDEN_OP(bf16)
    default: return PCCL_EDTYPE;
    }
}

int pccl_widen(int src_dtype, float *dst, const void *src, size_t n) {
    switch (src_dtype) {
    case PCCL_F16: widen_f16(dst, (const uint16_t *)src, n); return PCCL_OK;
    case PCCL_BF16: widen_bf16(dst, (const uint16_t *)src, n); return PCCL_OK;
    default: return PCCL_EDTYPE;
    }
}

PCCL_VEC static void narrow_f16(uint16_t *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = pccl_f32_to_f16(s[i]);
}

PCCL_VEC static void narrow_bf16(uint16_t *restrict d, const float *restrict s, size_t n) {
    for (size_t i = 0; i < n; i++) d[i] = pccl_f32_to_bf16(s[i]);
}

int pccl_narrow(int dst_dtype, void *dst, const float *src, size_t n) {
    switch (dst_dtype) {
    case PCCL_F16: narrow_f16((uint16_t *)dst, src, n); return PCCL_OK;
    case PCCL_BF16: narrow_bf16((uint16_t *)dst, src, n); return PCCL_OK;
    default: return PCCL_EDTYPE;
    }
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

int pccl_avg_finalize(int dtype, void *dst, size_t n, uint64_t count) {
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
