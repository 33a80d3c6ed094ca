/* Min/max scan, min-max quantization, dequantization and fused dequantize-and-reduce.
 *
 * THE QUANTIZATION MATH (normative; pccl/kernels.py's oracles implement exactly this).
 * Let A be the accumulator type of the source: float64 for float64 chunks, float32 for
 * float32, float16 and bfloat16 chunks (whose values float32 holds exactly).  QMAX is 255 for
 * uint8 and 65535 for uint16.  Every operation below is one IEEE operation in A, round to
 * nearest even, no FMA contraction (the build uses -ffp-contract=off):
 *
 *   lo, hi  = min(x), max(x)            exact; a -0 extreme is reported as +0 (lo + 0)
 *             any NaN/+-Inf in x        -> PCCL_ENONFINITE, nothing written to q
 *   range   = hi - lo                   overflow to Inf -> PCCL_ERANGE
 *   range == 0 (constant chunk):        scale = 0, q[i] = 0      (dequantizes to lo: exact)
 *   otherwise: scale = range / QMAX, inv = QMAX / range, and
 *     if inv is finite (the usual case): v = (x[i] - lo) * inv
 *     else if scale > 0 (range < QMAX / A_MAX, so scale is subnormal): v = (x[i] - lo) / scale
 *     else (range / QMAX underflows to 0): scale = 0, q[i] = 0
 *     q[i] = rint(min(max(v, 0), QMAX))  round to nearest, ties to even (numpy.rint)
 *
 *   Accuracy: |x' - x| <= scale / 2 plus the rounding of lo + q * scale while scale is a
 *   normal number; for ranges so small that scale is subnormal (f32: max - min < ~3e-36)
 *   scale has lost relative precision and the error is only bounded by max - min.
 *
 *   dequantize: x'[i] = lo + (A)q[i] * scale        (two roundings: multiply, then add)
 *
 * Only (lo, scale) travel with the quantized chunk.  Dequantization is a fixed sequence of IEEE
 * operations on (lo, scale, q), so every peer, on every machine, gets bit-identical x'.
 * The fused kernels compute acc op= x' with x' rounded exactly as above.
 *
 * The min/max scan works on integer keys (see DEF_SCAN): integer min/max reductions may be
 * reassociated, so the compiler vectorises them without -ffast-math, and NaN/Inf detection is
 * one more integer max over |bits| in the same pass, which no float optimisation can remove.
 */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "kernels_internal.h"

#define LOAD_ID(v) (v)

/* ---- min/max scan --------------------------------------------------------------------- */

/* Finite floats order like their "keys": the bit pattern with the magnitude bits flipped for
 * negative numbers and the sign bit flipped, compared as unsigned integers (-0 < +0).  Integer
 * min/max reductions may be reassociated, so the compiler vectorises them in strict IEEE mode,
 * and a NaN/Inf check is one more integer max over |bits|.  U: the unsigned type of the
 * storage; SIGN: its top bit; EXPMASK: the all-ones exponent (|bits| >= EXPMASK is Inf/NaN). */
#define DEF_SCAN(SUF, U, SIGN, EXPMASK)                                                            \
    PCCL_VEC static int scan_keys_##SUF(const U *restrict x, size_t n, U *lo_bits, U *hi_bits) {   \
        U kmin = (U)~(U)0, kmax = 0, amax = 0;                                                     \
        for (size_t i = 0; i < n; i++) {                                                           \
            U b = x[i];                                                                            \
            U neg = (U)((U)0 - (U)(b >> (sizeof(U) * 8 - 1))); /* all ones if negative */          \
            U k = (U)(b ^ (U)(neg >> 1) ^ (U)(SIGN));                                              \
            U a = (U)(b & (U)~(U)(SIGN));                                                          \
            kmin = k < kmin ? k : kmin;                                                            \
            kmax = k > kmax ? k : kmax;                                                            \
            amax = a > amax ? a : amax;                                                            \
        }                                                                                          \
        if (amax >= (U)(EXPMASK)) return PCCL_ENONFINITE;                                          \
        /* invert the key map: positive keys have the sign bit set */                              \
        *lo_bits = (kmin & (U)(SIGN)) ? (U)(kmin ^ (U)(SIGN)) : (U)(~kmin);                        \
        *hi_bits = (kmax & (U)(SIGN)) ? (U)(kmax ^ (U)(SIGN)) : (U)(~kmax);                        \
        return PCCL_OK;                                                                            \
    }

DEF_SCAN(32, uint32_t, 0x80000000u, 0x7f800000u)
DEF_SCAN(64, uint64_t, 0x8000000000000000u, 0x7ff0000000000000u)
DEF_SCAN(f16, uint16_t, 0x8000u, 0x7c00u)
DEF_SCAN(bf16, uint16_t, 0x8000u, 0x7f80u)

/* The typed scans used by quantization: n == 0 gives lo = hi = 0; extremes are canonical
 * (-0 reported as +0, by adding +0). */
static int scan_f32(const float *restrict x, size_t n, float *lo, float *hi) {
    uint32_t lb, hb;
    int rc = scan_keys_32((const uint32_t *)(const void *)x, n, &lb, &hb);
    if (rc != PCCL_OK) return rc;
    *lo = n ? pccl_bits_f32(lb) + 0.0f : 0.0f;
    *hi = n ? pccl_bits_f32(hb) + 0.0f : 0.0f;
    return PCCL_OK;
}

static int scan_f64(const double *restrict x, size_t n, double *lo, double *hi) {
    uint64_t lb, hb;
    double dl, dh;
    int rc = scan_keys_64((const uint64_t *)(const void *)x, n, &lb, &hb);
    if (rc != PCCL_OK) return rc;
    memcpy(&dl, &lb, sizeof dl);
    memcpy(&dh, &hb, sizeof dh);
    *lo = n ? dl + 0.0 : 0.0;
    *hi = n ? dh + 0.0 : 0.0;
    return PCCL_OK;
}

static int scan_f16(const uint16_t *restrict x, size_t n, float *lo, float *hi) {
    uint16_t lb, hb;
    int rc = scan_keys_f16(x, n, &lb, &hb);
    if (rc != PCCL_OK) return rc;
    *lo = n ? pccl_f16_to_f32(lb) + 0.0f : 0.0f;
    *hi = n ? pccl_f16_to_f32(hb) + 0.0f : 0.0f;
    return PCCL_OK;
}

static int scan_bf16(const uint16_t *restrict x, size_t n, float *lo, float *hi) {
    uint16_t lb, hb;
    int rc = scan_keys_bf16(x, n, &lb, &hb);
    if (rc != PCCL_OK) return rc;
    *lo = n ? pccl_bf16_to_f32(lb) + 0.0f : 0.0f;
    *hi = n ? pccl_bf16_to_f32(hb) + 0.0f : 0.0f;
    return PCCL_OK;
}

PCCL_NOINLINE static int pccl_minmax_impl(int dtype, const void *x, size_t n, double *lo, double *hi) {
    float flo, fhi;
    double dlo, dhi;
    int rc;
    switch (dtype) {
    case PCCL_F32: rc = scan_f32((const float *)x, n, &flo, &fhi); break;
    case PCCL_F16: rc = scan_f16((const uint16_t *)x, n, &flo, &fhi); break;
    case PCCL_BF16: rc = scan_bf16((const uint16_t *)x, n, &flo, &fhi); break;
    case PCCL_F64:
        rc = scan_f64((const double *)x, n, &dlo, &dhi);
        if (rc == PCCL_OK) {
            *lo = dlo;
            *hi = dhi;
        }
        return rc;
    default: return PCCL_EDTYPE;
    }
    if (rc == PCCL_OK) {
        *lo = flo;
        *hi = fhi;
    }
    return rc;
}

int pccl_minmax(int dtype, const void *x, size_t n, double *lo, double *hi) {
    PCCL_IEEE_CALL(pccl_minmax_impl(dtype, x, n, lo, hi));
}

/* ---- quantization ------------------------------------------------------------------- */

/* Clamp to [0, QMAX] first (a stray NaN, e.g. from a buffer modified concurrently, maps to 0,
 * so the integer conversion below is always defined), then round to nearest, ties to even, by
 * the classic magic-number addition: for 0 <= v < 2^23 (2^52 for double), (v + 2^23) - 2^23
 * is v rounded to an integer by the FPU's own round-to-nearest-even.  Exact, branch-free,
 * vectorisable, and equal to numpy.rint. */
#define QROUND(A, MAGIC, QMAX, v, out)                                                             \
    do {                                                                                           \
        A v_ = (v);                                                                                \
        v_ = v_ > (A)0 ? v_ : (A)0;                                                                \
        v_ = v_ < (A)(QMAX) ? v_ : (A)(QMAX);                                                      \
        v_ = (v_ + (A)(MAGIC)) - (A)(MAGIC);                                                       \
        (out) = (int32_t)v_;                                                                       \
    } while (0)

#define DEF_QUANT_LOOPS(SUF, T, A, MAGIC, LOAD, QSUF, QT, QMAX)                                    \
    PCCL_VEC static void quant_mul_##SUF##_##QSUF(const T *restrict x, QT *restrict q, size_t n,   \
                                         A lo, A inv) {                                            \
        for (size_t i = 0; i < n; i++) {                                                           \
            int32_t r;                                                                             \
            QROUND(A, MAGIC, QMAX, (LOAD(x[i]) - lo) * inv, r);                                    \
            q[i] = (QT)r;                                                                          \
        }                                                                                          \
    }                                                                                              \
    PCCL_VEC static void quant_div_##SUF##_##QSUF(const T *restrict x, QT *restrict q, size_t n,   \
                                         A lo, A scale) {                                          \
        for (size_t i = 0; i < n; i++) {                                                           \
            int32_t r;                                                                             \
            QROUND(A, MAGIC, QMAX, (LOAD(x[i]) - lo) / scale, r);                                  \
            q[i] = (QT)r;                                                                          \
        }                                                                                          \
    }

#define DEF_QUANT(SUF, T, A, MAGIC, LOAD, QSUF, QT, QMAX)                                          \
    DEF_QUANT_LOOPS(SUF, T, A, MAGIC, LOAD, QSUF, QT, QMAX)                                        \
    static int quant_##SUF##_##QSUF(const T *restrict x, QT *restrict q, size_t n,                 \
                                    double *lo_out, double *scale_out) {                           \
        A lo, hi;                                                                                  \
        int rc = scan_##SUF(x, n, &lo, &hi);                                                       \
        if (rc != PCCL_OK) return rc;                                                              \
        A range = hi - lo;                                                                         \
        if (range - range != 0) return PCCL_ERANGE; /* Inf - Inf is NaN */                         \
        A scale = range / (A)(QMAX);                                                               \
        A inv = range > 0 ? (A)(QMAX) / range : (A)0;                                              \
        if (range > 0 && inv - inv == 0) {                                                         \
            quant_mul_##SUF##_##QSUF(x, q, n, lo, inv);                                            \
        } else if (range > 0 && scale > 0) {                                                       \
            quant_div_##SUF##_##QSUF(x, q, n, lo, scale);                                          \
        } else {                                                                                   \
            scale = 0;                                                                             \
            for (size_t i = 0; i < n; i++) q[i] = 0;                                               \
        }                                                                                          \
        *lo_out = (double)lo;                                                                      \
        *scale_out = (double)scale;                                                                \
        return PCCL_OK;                                                                            \
    }

DEF_QUANT(f32, float, float, 0x1p23f, LOAD_ID, u8, uint8_t, 255)
DEF_QUANT(f32, float, float, 0x1p23f, LOAD_ID, u16, uint16_t, 65535)
DEF_QUANT(f64, double, double, 0x1p52, LOAD_ID, u8, uint8_t, 255)
DEF_QUANT(f64, double, double, 0x1p52, LOAD_ID, u16, uint16_t, 65535)
DEF_QUANT(f16, uint16_t, float, 0x1p23f, pccl_f16_to_f32, u8, uint8_t, 255)
DEF_QUANT(f16, uint16_t, float, 0x1p23f, pccl_f16_to_f32, u16, uint16_t, 65535)
DEF_QUANT(bf16, uint16_t, float, 0x1p23f, pccl_bf16_to_f32, u8, uint8_t, 255)
DEF_QUANT(bf16, uint16_t, float, 0x1p23f, pccl_bf16_to_f32, u16, uint16_t, 65535)

/* 4-bit codes are computed into a uint8 tile (QMAX 15) and packed two per byte afterwards. */
DEF_QUANT_LOOPS(f32, float, float, 0x1p23f, LOAD_ID, u4, uint8_t, 15)
DEF_QUANT_LOOPS(f64, double, double, 0x1p52, LOAD_ID, u4, uint8_t, 15)
DEF_QUANT_LOOPS(f16, uint16_t, float, 0x1p23f, pccl_f16_to_f32, u4, uint8_t, 15)
DEF_QUANT_LOOPS(bf16, uint16_t, float, 0x1p23f, pccl_bf16_to_f32, u4, uint8_t, 15)

#define QUANT_CASE(SUF, T)                                                                         \
    if (q_dtype == PCCL_U8) return quant_##SUF##_u8((const T *)x, (uint8_t *)q, n, lo, scale);     \
    if (q_dtype == PCCL_U16) return quant_##SUF##_u16((const T *)x, (uint16_t *)q, n, lo, scale);  \
    return PCCL_EDTYPE;

PCCL_NOINLINE static int pccl_quantize_impl(int src_dtype, const void *x, size_t n, int q_dtype, void *q,
                              double *lo, double *scale) {
    switch (src_dtype) {
    case PCCL_F32: QUANT_CASE(f32, float)
    case PCCL_F64: QUANT_CASE(f64, double)
    case PCCL_F16: QUANT_CASE(f16, uint16_t)
    case PCCL_BF16: QUANT_CASE(bf16, uint16_t)
    default: return PCCL_EDTYPE;
    }
}

int pccl_quantize(int src_dtype, const void *x, size_t n, int q_dtype, void *q,
                  double *lo, double *scale) {
    PCCL_IEEE_CALL(pccl_quantize_impl(src_dtype, x, n, q_dtype, q, lo, scale));
}

/* ---- dequantization and fused dequantize-reduce ------------------------------------- */

/* numpy.minimum / numpy.maximum semantics, as in reduce.c */
#define FMIN(d, s) (((d) < (s) || (d) != (d)) ? (d) : (s))
#define FMAX(d, s) (((d) > (s) || (d) != (d)) ? (d) : (s))
#define OP_SUM(a, b) ((a) + (b))
#define OP_PROD(a, b) ((a) * (b))

#define DEF_DEQ(ASUF, A, QSUF, QT)                                                                 \
    PCCL_VEC static void deq_##ASUF##_##QSUF(const QT *restrict q, A *restrict out, size_t n,      \
                                    A lo, A scale) {                                               \
        for (size_t i = 0; i < n; i++) out[i] = lo + (A)q[i] * scale;                              \
    }                                                                                              \
    DEF_DEQ_OP(ASUF, A, QSUF, QT, sum, OP_SUM)                                                     \
    DEF_DEQ_OP(ASUF, A, QSUF, QT, prod, OP_PROD)                                                   \
    DEF_DEQ_OP(ASUF, A, QSUF, QT, min, FMIN)                                                       \
    DEF_DEQ_OP(ASUF, A, QSUF, QT, max, FMAX)

#define DEF_DEQ_OP(ASUF, A, QSUF, QT, NAME, OP)                                                    \
    PCCL_VEC static void deq_##NAME##_##ASUF##_##QSUF(const QT *restrict q, A *restrict acc,       \
                                             size_t n, A lo, A scale) {                            \
        for (size_t i = 0; i < n; i++) {                                                           \
            A a = acc[i], v = lo + (A)q[i] * scale;                                                \
            acc[i] = OP(a, v);                                                                     \
        }                                                                                          \
    }

DEF_DEQ(f32, float, u8, uint8_t)
DEF_DEQ(f32, float, u16, uint16_t)
DEF_DEQ(f64, double, u8, uint8_t)
DEF_DEQ(f64, double, u16, uint16_t)

#define DEQ_CALL(NAME, ASUF, A)                                                                    \
    do {                                                                                           \
        if (q_dtype == PCCL_U8)                                                                    \
            NAME##_##ASUF##_u8((const uint8_t *)q, (A *)out, n, (A)lo, (A)scale);                  \
        else if (q_dtype == PCCL_U16)                                                              \
            NAME##_##ASUF##_u16((const uint16_t *)q, (A *)out, n, (A)lo, (A)scale);                \
        else                                                                                       \
            return PCCL_EDTYPE;                                                                    \
        return PCCL_OK;                                                                            \
    } while (0)

PCCL_NOINLINE static int pccl_dequantize_impl(int q_dtype, const void *q, size_t n, int out_dtype, void *out,
                                double lo, double scale) {
    if (out_dtype == PCCL_F32) DEQ_CALL(deq, f32, float);
    if (out_dtype == PCCL_F64) DEQ_CALL(deq, f64, double);
    return PCCL_EDTYPE;
}

int pccl_dequantize(int q_dtype, const void *q, size_t n, int out_dtype, void *out,
                    double lo, double scale) {
    PCCL_IEEE_CALL(pccl_dequantize_impl(q_dtype, q, n, out_dtype, out, lo, scale));
}

#define DEQ_OP_DISPATCH(ASUF, A)                                                                   \
    switch (op) {                                                                                  \
    case PCCL_SUM:                                                                                 \
    case PCCL_AVG: DEQ_CALL(deq_sum, ASUF, A);                                                     \
    case PCCL_PROD: DEQ_CALL(deq_prod, ASUF, A);                                                   \
    case PCCL_MIN: DEQ_CALL(deq_min, ASUF, A);                                                     \
    case PCCL_MAX: DEQ_CALL(deq_max, ASUF, A);                                                     \
    default: return PCCL_EOP;                                                                      \
    }

PCCL_NOINLINE static int pccl_dequantize_reduce_impl(int op, int q_dtype, const void *q, size_t n,
                                       int acc_dtype, void *acc, double lo, double scale) {
    void *out = acc; /* DEQ_CALL writes through `out` */
    if (acc_dtype == PCCL_F32) DEQ_OP_DISPATCH(f32, float)
    if (acc_dtype == PCCL_F64) DEQ_OP_DISPATCH(f64, double)
    return PCCL_EDTYPE;
}

int pccl_dequantize_reduce(int op, int q_dtype, const void *q, size_t n, int acc_dtype,
                           void *acc, double lo, double scale) {
    PCCL_IEEE_CALL(pccl_dequantize_reduce_impl(op, q_dtype, q, n, acc_dtype, acc, lo, scale));
}

/* Block by block like pccl_reduce_save (see reduce.c): copy a block of acc to the backup with
 * streaming stores, then dequantize-reduce into it while it is in L1. */
int pccl_dequantize_reduce_save(int op, int q_dtype, const void *q, size_t n, int acc_dtype,
                                void *acc, void *backup, double lo, double scale) {
    int rc = pccl_dequantize_reduce(op, q_dtype, q, 0, acc_dtype, acc, lo, scale);
    if (rc != PCCL_OK) return rc;
    size_t asize = acc_dtype == PCCL_F64 ? 8 : 4;
    size_t qsize = q_dtype == PCCL_U16 ? 2 : 1;
    size_t block = PCCL_SAVE_BLOCK / asize;
    char *a = (char *)acc, *b = (char *)backup;
    const char *qq = (const char *)q;
    for (size_t i = 0; i < n; i += block) {
        size_t len = n - i < block ? n - i : block;
        pccl_save_block(b + i * asize, a + i * asize, len * asize);
        pccl_dequantize_reduce(op, q_dtype, qq + i * qsize, len, acc_dtype, a + i * asize, lo, scale);
    }
    pccl_save_fence();
    return PCCL_OK;
}

/* ---- blockwise and 4-bit quantization ------------------------------------------------- */

/* pccl_quantize_blocks cuts x into blocks of `block` elements (the last one may be shorter) and
 * quantizes each exactly as pccl_quantize quantizes a chunk (the math above, per block, with
 * QMAX = 15 for 4-bit codes), writing block b's lo and scale to lo[b] and scale[b] in the
 * accumulator type A (float for f16/bf16/f32 sources, double for f64).  Codes: 16 bits: uint16
 * q[i]; 8 bits: uint8 q[i]; 4 bits: two per byte, element 2j in the low nibble of q[j] and
 * element 2j+1 in the high nibble (an odd n leaves the last high nibble 0).  4-bit codes are
 * computed into a tile and packed a tile at a time (QTILE is even, so tiles start on bytes).
 * Dequantization of element i of block b is lo[b] + (A)q_i * scale[b], as above. */
#define QTILE 2048

PCCL_VEC static void pack4(const uint8_t *restrict t, uint8_t *restrict q, size_t m) {
    size_t half = m / 2;
    for (size_t j = 0; j < half; j++) q[j] = (uint8_t)(t[2 * j] | (uint8_t)(t[2 * j + 1] << 4));
    if (m & 1) q[half] = t[m - 1];
}

PCCL_VEC static void unpack4(const uint8_t *restrict q, uint8_t *restrict t, size_t m) {
    size_t half = m / 2;
    for (size_t j = 0; j < half; j++) {
        uint8_t b = q[j];
        t[2 * j] = (uint8_t)(b & 15u);
        t[2 * j + 1] = (uint8_t)(b >> 4);
    }
    if (m & 1) t[m - 1] = (uint8_t)(q[half] & 15u);
}

/* A block's parameters from its extremes, as pccl_quantize computes a chunk's: the mode its
 * codes are computed in (1: times inv, 2: divided by scale, 0: every code 0, scale 0). */
#define BLOCK_PARAMS(A, QMAXV, lo, hi, scale, param, mode)                                         \
    do {                                                                                           \
        A range_ = (hi) - (lo);                                                                    \
        if (range_ - range_ != 0) return PCCL_ERANGE;                                              \
        (scale) = range_ / (A)(QMAXV);                                                             \
        A inv_ = range_ > 0 ? (A)(QMAXV) / range_ : (A)0;                                          \
        if (range_ > 0 && inv_ - inv_ == 0) {                                                      \
            (mode) = 1;                                                                            \
            (param) = inv_;                                                                        \
        } else if (range_ > 0 && (scale) > 0) {                                                    \
            (mode) = 2;                                                                            \
            (param) = (scale);                                                                     \
        } else {                                                                                   \
            (mode) = 0;                                                                            \
            (scale) = 0;                                                                           \
            (param) = 0;                                                                           \
        }                                                                                          \
    } while (0)

#define QRUN(SUF, QSUF, mode, xp, qp, len, lo, param)                                              \
    do {                                                                                           \
        if ((mode) == 1)                                                                           \
            quant_mul_##SUF##_##QSUF(xp, qp, len, lo, param);                                      \
        else if ((mode) == 2)                                                                      \
            quant_div_##SUF##_##QSUF(xp, qp, len, lo, param);                                      \
        else                                                                                       \
            for (size_t k_ = 0; k_ < (len); k_++) (qp)[k_] = 0;                                    \
    } while (0)

#define DEF_QBLOCKS(SUF, T, A)                                                                     \
    static int qblocks_##SUF(const T *restrict x, size_t n, int bits, void *q, size_t block,       \
                             A *restrict lo_out, A *restrict scale_out) {                          \
        uint8_t tile[QTILE];                                                                       \
        size_t tile_at = 0; /* element index of tile[0] (4 bits) */                                \
        int qmax = bits == 4 ? 15 : bits == 8 ? 255 : 65535;                                       \
        for (size_t s = 0, b = 0; s < n; s += block, b++) {                                        \
            size_t len = n - s < block ? n - s : block;                                            \
            A lo, hi, scale, param;                                                                \
            int mode;                                                                              \
            int rc = scan_##SUF(x + s, len, &lo, &hi);                                             \
            if (rc != PCCL_OK) return rc;                                                          \
            BLOCK_PARAMS(A, qmax, lo, hi, scale, param, mode);                                     \
            lo_out[b] = lo;                                                                        \
            scale_out[b] = scale;                                                                  \
            if (bits == 8) {                                                                       \
                QRUN(SUF, u8, mode, x + s, (uint8_t *)q + s, len, lo, param);                      \
            } else if (bits == 16) {                                                               \
                QRUN(SUF, u16, mode, x + s, (uint16_t *)q + s, len, lo, param);                    \
            } else {                                                                               \
                for (size_t i = s, end = s + len; i < end;) {                                      \
                    size_t stop = end < tile_at + QTILE ? end : tile_at + QTILE;                   \
                    QRUN(SUF, u4, mode, x + i, tile + (i - tile_at), stop - i, lo, param);         \
                    i = stop;                                                                      \
                    if (i == tile_at + QTILE) {                                                    \
                        pack4(tile, (uint8_t *)q + tile_at / 2, QTILE);                            \
                        tile_at += QTILE;                                                          \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        if (bits == 4 && n > tile_at) pack4(tile, (uint8_t *)q + tile_at / 2, n - tile_at);        \
        return PCCL_OK;                                                                            \
    }

DEF_QBLOCKS(f32, float, float)
DEF_QBLOCKS(f64, double, double)
DEF_QBLOCKS(f16, uint16_t, float)
DEF_QBLOCKS(bf16, uint16_t, float)

PCCL_NOINLINE static int pccl_quantize_blocks_impl(int src_dtype, const void *x, size_t n, int q_bits, void *q,
                                                   size_t block, void *lo, void *scale) {
    if (q_bits != 4 && q_bits != 8 && q_bits != 16) return PCCL_EDTYPE;
    if (block == 0) return PCCL_EARG;
    switch (src_dtype) {
    case PCCL_F32: return qblocks_f32((const float *)x, n, q_bits, q, block, (float *)lo, (float *)scale);
    case PCCL_F64: return qblocks_f64((const double *)x, n, q_bits, q, block, (double *)lo, (double *)scale);
    case PCCL_F16: return qblocks_f16((const uint16_t *)x, n, q_bits, q, block, (float *)lo, (float *)scale);
    case PCCL_BF16: return qblocks_bf16((const uint16_t *)x, n, q_bits, q, block, (float *)lo, (float *)scale);
    default: return PCCL_EDTYPE;
    }
}

int pccl_quantize_blocks(int src_dtype, const void *x, size_t n, int q_bits, void *q, size_t block, void *lo,
                         void *scale) {
    PCCL_IEEE_CALL(pccl_quantize_blocks_impl(src_dtype, x, n, q_bits, q, block, lo, scale));
}

#define DQ_ASSIGN (-1) /* internal op code: plain dequantization */

#define DQRUN(ASUF, QSUF, qp, ap, len, l, sc)                                                      \
    do {                                                                                           \
        switch (op) {                                                                              \
        case DQ_ASSIGN: deq_##ASUF##_##QSUF(qp, ap, len, l, sc); break;                            \
        case PCCL_PROD: deq_prod_##ASUF##_##QSUF(qp, ap, len, l, sc); break;                       \
        case PCCL_MIN: deq_min_##ASUF##_##QSUF(qp, ap, len, l, sc); break;                         \
        case PCCL_MAX: deq_max_##ASUF##_##QSUF(qp, ap, len, l, sc); break;                         \
        default: deq_sum_##ASUF##_##QSUF(qp, ap, len, l, sc); break; /* SUM, AVG */                \
        }                                                                                          \
    } while (0)

/* Tile by tile: save the tile of acc (the saving variant), unpack its 4-bit codes, then run the
 * dequantize(-reduce) loops of pccl_dequantize_reduce over each block's piece of the tile. */
#define DEF_DQBLOCKS(ASUF, A)                                                                      \
    static void dqblocks_##ASUF(int op, int bits, const void *q, size_t n, A *restrict acc,        \
                                A *restrict backup, size_t block, const A *lo, const A *scale) {   \
        uint8_t tile[QTILE];                                                                       \
        for (size_t t = 0; t < n; t += QTILE) {                                                    \
            size_t tend = n - t < QTILE ? n : t + QTILE;                                           \
            if (backup) pccl_save_block(backup + t, acc + t, (tend - t) * sizeof(A));              \
            if (bits == 4) unpack4((const uint8_t *)q + t / 2, tile, tend - t);                    \
            for (size_t i = t; i < tend;) {                                                        \
                size_t b = i / block;                                                              \
                size_t stop = tend - b * block <= block ? tend : b * block + block;                \
                A l = lo[b], sc = scale[b];                                                        \
                if (bits == 4)                                                                     \
                    DQRUN(ASUF, u8, tile + (i - t), acc + i, stop - i, l, sc);                     \
                else if (bits == 8)                                                                \
                    DQRUN(ASUF, u8, (const uint8_t *)q + i, acc + i, stop - i, l, sc);             \
                else                                                                               \
                    DQRUN(ASUF, u16, (const uint16_t *)q + i, acc + i, stop - i, l, sc);           \
                i = stop;                                                                          \
            }                                                                                      \
        }                                                                                          \
        if (backup) pccl_save_fence();                                                             \
    }

DEF_DQBLOCKS(f32, float)
DEF_DQBLOCKS(f64, double)

PCCL_NOINLINE static int pccl_dqblocks_impl(int op, int q_bits, const void *q, size_t n, int acc_dtype, void *acc,
                                            void *backup, size_t block, const void *lo, const void *scale) {
    if (q_bits != 4 && q_bits != 8 && q_bits != 16) return PCCL_EDTYPE;
    if (block == 0) return PCCL_EARG;
    if (op != DQ_ASSIGN && (op < PCCL_SUM || op > PCCL_MAX)) return PCCL_EOP;
    if (acc_dtype == PCCL_F32)
        dqblocks_f32(op, q_bits, q, n, (float *)acc, (float *)backup, block, (const float *)lo, (const float *)scale);
    else if (acc_dtype == PCCL_F64)
        dqblocks_f64(op, q_bits, q, n, (double *)acc, (double *)backup, block, (const double *)lo,
                     (const double *)scale);
    else
        return PCCL_EDTYPE;
    return PCCL_OK;
}

int pccl_dequantize_blocks(int q_bits, const void *q, size_t n, int out_dtype, void *out, size_t block,
                           const void *lo, const void *scale) {
    PCCL_IEEE_CALL(pccl_dqblocks_impl(DQ_ASSIGN, q_bits, q, n, out_dtype, out, NULL, block, lo, scale));
}

int pccl_dequantize_reduce_blocks(int op, int q_bits, const void *q, size_t n, int acc_dtype, void *acc,
                                  size_t block, const void *lo, const void *scale) {
    PCCL_IEEE_CALL(pccl_dqblocks_impl(op, q_bits, q, n, acc_dtype, acc, NULL, block, lo, scale));
}

int pccl_dequantize_reduce_blocks_save(int op, int q_bits, const void *q, size_t n, int acc_dtype, void *acc,
                                       void *backup, size_t block, const void *lo, const void *scale) {
    PCCL_IEEE_CALL(pccl_dqblocks_impl(op, q_bits, q, n, acc_dtype, acc, backup, block, lo, scale));
}

#define DEF_MMBLOCKS(SUF, T, A)                                                                    \
    static int mmblocks_##SUF(const T *restrict x, size_t n, size_t block, A *lo, A *hi) {         \
        for (size_t s = 0, b = 0; s < n; s += block, b++) {                                        \
            int rc = scan_##SUF(x + s, n - s < block ? n - s : block, lo + b, hi + b);             \
            if (rc != PCCL_OK) return rc;                                                          \
        }                                                                                          \
        return PCCL_OK;                                                                            \
    }

DEF_MMBLOCKS(f32, float, float)
DEF_MMBLOCKS(f64, double, double)
DEF_MMBLOCKS(f16, uint16_t, float)
DEF_MMBLOCKS(bf16, uint16_t, float)

PCCL_NOINLINE static int pccl_minmax_blocks_impl(int dtype, const void *x, size_t n, size_t block, void *lo,
                                                 void *hi) {
    if (block == 0) return PCCL_EARG;
    switch (dtype) {
    case PCCL_F32: return mmblocks_f32((const float *)x, n, block, (float *)lo, (float *)hi);
    case PCCL_F64: return mmblocks_f64((const double *)x, n, block, (double *)lo, (double *)hi);
    case PCCL_F16: return mmblocks_f16((const uint16_t *)x, n, block, (float *)lo, (float *)hi);
    case PCCL_BF16: return mmblocks_bf16((const uint16_t *)x, n, block, (float *)lo, (float *)hi);
    default: return PCCL_EDTYPE;
    }
}

int pccl_minmax_blocks(int dtype, const void *x, size_t n, size_t block, void *lo, void *hi) {
    PCCL_IEEE_CALL(pccl_minmax_blocks_impl(dtype, x, n, block, lo, hi));
}
