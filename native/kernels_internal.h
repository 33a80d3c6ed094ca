/* Internal helpers shared by reduce.c and quant.c: portable bit-level float16 / bfloat16
 * conversions and the floating-point environment checks that determinism relies on.
 *
 * The conversions are written with integer operations and selects only, so that the compiler
 * vectorises them on the plain x86-64 baseline (no F16C needed) and so that they give the same
 * bits on every machine.
 */
#ifndef PCCL_KERNELS_INTERNAL_H
#define PCCL_KERNELS_INTERNAL_H

#include <float.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Quantized values must dequantize to identical bits on every peer.  That holds for IEEE
 * single/double arithmetic evaluated in its own precision without contraction into FMAs
 * (the build passes -ffp-contract=off).  x87 excess precision (FLT_EVAL_METHOD 1 or 2, e.g.
 * 32-bit x86 without -mfpmath=sse) would break it, so refuse to build there. */
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "pccl kernels need FLT_EVAL_METHOD == 0 (compile with SSE2 math, e.g. -mfpmath=sse)"
#endif

/* On x86-64, every peer computes the same bits whatever the calling thread's floating-point
 * mode: a thread may run with flush-to-zero / denormals-are-zero or another rounding mode (set
 * by user code, e.g. torch.set_flush_denormal(True)), and where two peers compute the same
 * element (the two-peer exchange, the dequantization of the gather phase) one peer's subnormals
 * would become zeros.  Each exported float kernel runs under PCCL_IEEE_CALL, which puts the SSE
 * control register in its IEEE default (round to nearest, no FTZ, no DAZ) for the call if it is
 * not there already, and restores it afterwards (keeping the exception flags the kernel raised).
 * The work is an out-of-line call (PCCL_NOINLINE), so the compiler cannot move float operations
 * across the mode switch.  Elsewhere (aarch64's FPCR, 32-bit x86) the mode is not reset yet:
 * peers there must not run in flush-to-zero mode. */
#if defined(__GNUC__) || defined(__clang__)
#define PCCL_NOINLINE __attribute__((noinline))
#elif defined(_MSC_VER)
#define PCCL_NOINLINE __declspec(noinline)
#else
#define PCCL_NOINLINE
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define PCCL_MXCSR_MODE 0xE040u /* FTZ (bit 15), rounding control (13-14), DAZ (6) */
typedef unsigned int pccl_fpmode;
static inline pccl_fpmode pccl_ieee_enter(void) {
    unsigned int csr = _mm_getcsr();
    if (csr & PCCL_MXCSR_MODE) _mm_setcsr(csr & ~PCCL_MXCSR_MODE);
    return csr;
}
static inline void pccl_ieee_leave(pccl_fpmode csr) {
    if (csr & PCCL_MXCSR_MODE) _mm_setcsr(csr | (_mm_getcsr() & 0x3Fu));
}
#else
typedef int pccl_fpmode;
static inline pccl_fpmode pccl_ieee_enter(void) { return 0; }
static inline void pccl_ieee_leave(pccl_fpmode mode) { (void)mode; }
#endif
#define PCCL_IEEE_CALL(call)                                                                       \
    do {                                                                                           \
        pccl_fpmode mode_ = pccl_ieee_enter();                                                     \
        int rc_ = (call);                                                                          \
        pccl_ieee_leave(mode_);                                                                    \
        return rc_;                                                                                \
    } while (0)

#if defined(__GNUC__)
#define PCCL_INLINE static inline __attribute__((always_inline))
#else
#define PCCL_INLINE static inline
#endif

/* The loops are plain C and vectorise on the baseline ISA (SSE2 on x86-64).  Where the toolchain
 * supports function multi-versioning (gcc/clang with ifunc on x86-64 Linux), each hot loop is
 * also compiled for AVX2 and picked at load time: this matters for the integer-key min/max scan
 * (SSE2 has no unsigned min/max) and the float16 conversions.  AVX2 alone does not include
 * FMA, and -ffp-contract=off forbids contraction anyway, so both versions compute identical
 * bits; only speed differs. */
#if defined(__x86_64__) && defined(__linux__) && !defined(PCCL_NO_CLONES) &&                       \
    ((defined(__clang__) && __clang_major__ >= 14) ||                                              \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 8))
#define PCCL_VEC __attribute__((target_clones("avx2", "default")))
#else
#define PCCL_VEC
#endif

PCCL_INLINE uint32_t pccl_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

PCCL_INLINE float pccl_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float16 -> float32, exact.  Normal numbers rebias the exponent; subnormals are rebuilt by
 * a float subtraction (exact: the operands share the exponent); Inf/NaN keep their payload. */
PCCL_INLINE float pccl_f16_to_f32(uint16_t h) {
    uint32_t mag = ((uint32_t)h & 0x7fffu) << 13;   /* exponent and mantissa in f32 position */
    uint32_t exp = mag & 0x0f800000u;                /* the f16 exponent field, shifted */
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
    uint32_t normal = mag + ((127u - 15u) << 23);
    uint32_t infnan = mag + ((255u - 31u) << 23);
    /* subnormal/zero: mantissa * 2^-24 = bits(mag + 2^-14 exponent) - 2^-14 */
    float sub = pccl_bits_f32(mag + (113u << 23)) - pccl_bits_f32(113u << 23);
    uint32_t out = exp == 0x0f800000u ? infnan : normal;
    out = exp == 0 ? pccl_f32_bits(sub) : out;
    return pccl_bits_f32(out | sign);
}

/* float32 -> float16, round to nearest, ties to even (the IEEE default; numpy's astype).
 * |x| >= 65520 rounds to Inf; NaN becomes a quiet NaN keeping the sign and the top payload
 * bits (what F16C's vcvtps2ph does); subnormal results are rounded by a float addition that
 * lines the mantissa up at 2^-24 (the hardware's own RNE does the rounding). */
PCCL_INLINE uint16_t pccl_f32_to_f16(float f) {
    uint32_t x = pccl_f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    /* normal result: rebias, add half an ulp minus one plus the lowest kept bit (RNE) */
    uint32_t norm = (a + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
    /* subnormal result (|x| < 2^-14): 0.5f has exponent 2^-1, so adding it aligns the
     * mantissa ulp at 2^-24; the low 10 bits of the sum are the f16 subnormal. */
    uint32_t sub = pccl_f32_bits(pccl_bits_f32(a) + 0.5f) - pccl_f32_bits(0.5f);
    uint32_t special = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x3ffu)) : 0x7c00u;
    uint32_t out = a < (113u << 23) ? sub : norm;
    out = a >= (143u << 23) ? special : out;  /* >= 65536: Inf (or NaN) */
    return (uint16_t)(out | sign);
}

PCCL_INLINE float pccl_bf16_to_f32(uint16_t h) {
    return pccl_bits_f32((uint32_t)h << 16);
}

/* float32 -> bfloat16, round to nearest, ties to even; overflow rounds to Inf naturally
 * (the carry runs into the exponent); NaN becomes a quiet NaN with sign and top payload. */
PCCL_INLINE uint16_t pccl_f32_to_bf16(float f) {
    uint32_t x = pccl_f32_bits(f);
    uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t quiet = (x >> 16) | 0x40u;
    return (uint16_t)((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

/* reduce.c: copy nbytes of dst to backup with non-temporal stores where available (the backup
 * of an in-place all-reduce is written once and read only on abort); pccl_save_fence orders
 * those stores before anything that follows (call it before returning). */
void pccl_save_block(void *restrict backup, const void *restrict dst, size_t nbytes);
#define PCCL_SAVE_BLOCK 8192 /* bytes per block of the saving kernels: inside L1 with the source */
void pccl_save_fence(void);

#endif /* PCCL_KERNELS_INTERNAL_H */
