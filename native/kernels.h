/* pccl native kernels: the public declarations, shared by the C sources and the cffi build.
 *
 * This file is fed verbatim to cffi's cdef(), so it holds declarations only: no #include,
 * no #if, no macros.  The C sources include <stddef.h> and <stdint.h> before it.
 *
 * Conventions (every kernel):
 *   - buffers are contiguous arrays of n elements, aligned to their element size, and never
 *     overlap (the Python wrappers in pccl/kernels.py check all of this and realign odd views);
 *   - n == 0 is a no-op that touches no memory;
 *   - the return value is a pccl_status; nothing else reports errors, nothing aborts.
 *
 * Dtype and op codes equal the wire values of pccl.types.DType and pccl.types.ReduceOp.
 * Exact semantics (integer wrapping, NaN rules, AVG rounding, the quantization formulas)
 * are specified in reduce.c and quant.c, next to the code that implements them.
 */

enum pccl_status {
    PCCL_OK = 0,
    PCCL_EDTYPE = -1,     /* unsupported dtype or dtype/op combination */
    PCCL_EOP = -2,        /* unknown reduce op */
    PCCL_ENONFINITE = -3, /* NaN or +-Inf in the input of a min/max scan or a quantization */
    PCCL_ERANGE = -4,     /* max - min of a chunk overflows the accumulator type */
    PCCL_EARG = -5        /* other bad argument (AVG count of 0) */
};

enum pccl_dtype {
    PCCL_U8 = 0, PCCL_I8 = 1, PCCL_U16 = 2, PCCL_I16 = 3,
    PCCL_U32 = 4, PCCL_I32 = 5, PCCL_U64 = 6, PCCL_I64 = 7,
    PCCL_F16 = 8, PCCL_BF16 = 9, PCCL_F32 = 10, PCCL_F64 = 11
};

enum pccl_op { PCCL_SUM = 0, PCCL_AVG = 1, PCCL_PROD = 2, PCCL_MIN = 3, PCCL_MAX = 4 };

int pccl_kernels_abi_version(void);

/* ---- reduce.c ---------------------------------------------------------------------------- */

/* dst[i] = dst[i] op src[i]; dst and src both of `dtype` (f32, f64 or an integer type).
 * AVG accumulates like SUM (finalise with pccl_avg_finalize). */
int pccl_reduce(int op, int dtype, void *dst, const void *src, size_t n);

/* dst[i] = a[i] op b[i] (all of `dtype`, as for pccl_reduce): the result of copying a into dst
 * and then pccl_reduce(op, dtype, dst, b, n), in one pass (bit for bit, except which payload a
 * float SUM/PROD of two NaNs keeps: the compiler may swap the operands of + and *). */
int pccl_reduce_to(int op, int dtype, void *dst, const void *a, const void *b, size_t n);

/* backup[i] = dst[i]; dst[i] = dst[i] op src[i] in one pass (same dtypes and arithmetic as
 * pccl_reduce; backup has dst's dtype): the in-place all-reduce's save-before-overwrite. */
int pccl_reduce_save(int op, int dtype, void *dst, const void *src, void *backup, size_t n);

/* memcpy(backup, src, nbytes) for a backup that is written once and read only on abort:
 * non-temporal stores on x86-64 (no cache pollution, no read-for-ownership).  Any alignment. */
int pccl_save_copy(void *backup, const void *src, size_t nbytes);

/* dst[i] = dst[i] op (float)src[i] with src of dtype f16 or bf16 and an f32 destination. */
int pccl_reduce_widen(int op, int src_dtype, float *dst, const void *src, size_t n);

/* dst[i] = (float)src[i], src f16 or bf16 (exact). */
int pccl_widen(int src_dtype, float *dst, const void *src, size_t n);

/* dst[i] = src[i] rounded to f16 or bf16, round-to-nearest-even. */
int pccl_narrow(int dst_dtype, void *dst, const float *src, size_t n);

/* dst[i] = dst[i] / count; floats: IEEE division by (T)count; integers: floor division. */
int pccl_avg_finalize(int dtype, void *dst, size_t n, uint64_t count);

/* ---- quant.c ----------------------------------------------------------------------------- */

/* One pass over x (f16, bf16, f32 or f64): *lo = min, *hi = max (as doubles; -0 reported as
 * +0).  PCCL_ENONFINITE if any element is NaN or +-Inf.  n == 0 gives lo = hi = 0. */
int pccl_minmax(int dtype, const void *x, size_t n, double *lo, double *hi);

/* Min-max quantization of x (f16, bf16, f32, f64) to q (u8 or u16).  Writes the parameters
 * that pccl_dequantize needs to *lo and *scale. */
int pccl_quantize(int src_dtype, const void *x, size_t n, int q_dtype, void *q,
                  double *lo, double *scale);

/* out[i] = lo + (A)q[i] * scale in the accumulator type A = out_dtype (f32 or f64). */
int pccl_dequantize(int q_dtype, const void *q, size_t n, int out_dtype, void *out,
                    double lo, double scale);

/* acc[i] = acc[i] op (lo + (A)q[i] * scale), A = acc_dtype (f32 or f64): bit-identical to
 * pccl_dequantize into a temporary followed by pccl_reduce, in one pass. */
int pccl_dequantize_reduce(int op, int q_dtype, const void *q, size_t n, int acc_dtype,
                           void *acc, double lo, double scale);

/* pccl_dequantize_reduce that first saves acc[i] into backup[i] (acc's dtype), in one pass. */
int pccl_dequantize_reduce_save(int op, int q_dtype, const void *q, size_t n, int acc_dtype,
                                void *acc, void *backup, double lo, double scale);

/* ---- quant.c: blockwise and 4-bit ------------------------------------------------------- */

/* Min-max quantization of x (f16, bf16, f32, f64) block by block: every `block` elements (the
 * last block may be shorter) get their own lo[b], scale[b] (accumulator type: float for f16,
 * bf16 and f32, double for f64; ceil(n / block) of each), computed as pccl_quantize computes a
 * chunk's.  q_bits 16: uint16 codes; 8: uint8; 4: two codes per byte, element 2j in the low
 * nibble of q[j], 2j+1 in the high one (ceil(n / 2) bytes; an odd n leaves the last high nibble
 * 0).  PCCL_ENONFINITE / PCCL_ERANGE as pccl_quantize (q, lo and scale are then unspecified). */
int pccl_quantize_blocks(int src_dtype, const void *x, size_t n, int q_bits, void *q, size_t block,
                         void *lo, void *scale);

/* out[i] = lo[b] + (A)q_i * scale[b], b = i / block, A = out_dtype (f32 or f64). */
int pccl_dequantize_blocks(int q_bits, const void *q, size_t n, int out_dtype, void *out, size_t block,
                           const void *lo, const void *scale);

/* acc[i] = acc[i] op (lo[b] + (A)q_i * scale[b]): pccl_dequantize_blocks into a temporary
 * followed by pccl_reduce, in one pass. */
int pccl_dequantize_reduce_blocks(int op, int q_bits, const void *q, size_t n, int acc_dtype, void *acc,
                                  size_t block, const void *lo, const void *scale);

/* pccl_dequantize_reduce_blocks that first saves acc[i] into backup[i], in one pass. */
int pccl_dequantize_reduce_blocks_save(int op, int q_bits, const void *q, size_t n, int acc_dtype,
                                       void *acc, void *backup, size_t block, const void *lo,
                                       const void *scale);

/* lo[b], hi[b] = min and max of block b of x (accumulator type, -0 reported as +0), as
 * pccl_minmax computes them; PCCL_ENONFINITE on NaN/Inf. */
int pccl_minmax_blocks(int dtype, const void *x, size_t n, size_t block, void *lo, void *hi);
