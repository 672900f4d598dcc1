/* GGUF's weight-only quantised blocks (llama.cpp's ggml-common.h), read where they lie in the file's bytes: a
 * weight row of K values is K/32 blocks of 32, each a fp16 scale d (and for Q4_1 a fp16 minimum m) before its
 * quants. The type ids are GGML's (gguf.GGMLQuantizationType), so Python passes them through unchanged.
 *
 *   Q8_0 (34 bytes): d, int8 q[32]           w[t] = d * q[t]
 *   Q4_0 (18 bytes): d, uint8 qs[16]         w[t] = d * ((qs[t] & 15) - 8),  w[t + 16] = d * ((qs[t] >> 4) - 8)
 *   Q4_1 (20 bytes): d, m, uint8 qs[16]      w[t] = d * (qs[t] & 15) + m,    w[t + 16] = d * (qs[t] >> 4) + m
 *
 * Every format is w = d * q + m for one (d, m) per block (Q4_0: q = nibble, m = -8d; Q8_0: m = 0): dequant_block
 * writes the block's 32 fp32 weights, which the callers multiply while they are still in registers/L1.
 *
 * Two unscaled layouts are read as blocks of 32 too, so the same register tile serves them:
 *   BF16 (64 bytes, GGML's id): uint16 w[32], each the top half of a fp32 (widened by one shift)
 *   I8   (32 bytes, ours):      int8 q[32]      w[t] = q[t]; the row's scale multiplies the finished product
 *                               (services/text/quantize.py's per-output-channel int8 rows) */
#ifndef GENSERVE_QUANT_H
#define GENSERVE_QUANT_H

#include <stdint.h>
#include <string.h>

#include "element.h"

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QK 32 /* weights per block, in every format here */

enum { QTYPE_F32 = 0, QTYPE_Q4_0 = 2, QTYPE_Q4_1 = 3, QTYPE_Q8_0 = 8, QTYPE_BF16 = 30, QTYPE_I8 = 1024 };

/* Bytes per block of a quantised type; 0 for a type this file does not read. */
static inline int64_t qblock_bytes(int type) {
    switch (type) {
    case QTYPE_Q4_0: return 18;
    case QTYPE_Q4_1: return 20;
    case QTYPE_Q8_0: return 34;
    case QTYPE_BF16: return 64;
    case QTYPE_I8: return 32;
    default: return 0;
    }
}

/* Bytes from one block of 32 weights to the next; the products below also read fp32 rows, as blocks of 128 bytes. */
static inline int64_t qblock_stride(int type) {
    return type == QTYPE_F32 ? QK * (int64_t)sizeof(float) : qblock_bytes(type);
}

/* An IEEE half at p (any alignment: blocks of 18 or 34 bytes put every other scale on an odd address). */
static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else { /* subnormal half: a normal float */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* The 32 fp32 weights of one block b of `type`. */
static inline void dequant_block(int type, const uint8_t *b, float *restrict w) {
    if (type == QTYPE_F32) {
        memcpy(w, b, QK * sizeof(float));
        return;
    }
    if (type == QTYPE_BF16) {
        for (int t = 0; t < QK; t++) w[t] = bf16_at((const uint16_t *)b, t);
        return;
    }
    if (type == QTYPE_I8) {
#pragma omp simd
        for (int t = 0; t < QK; t++) w[t] = (float)((const int8_t *)b)[t];
        return;
    }
    const float d = half_at(b);
    if (type == QTYPE_Q8_0) {
        const int8_t *q = (const int8_t *)(b + 2);
#pragma omp simd
        for (int t = 0; t < QK; t++) w[t] = d * (float)q[t];
        return;
    }
    const float m = type == QTYPE_Q4_1 ? half_at(b + 2) : -8.f * d;
    const uint8_t *qs = b + (type == QTYPE_Q4_1 ? 4 : 2);
#pragma omp simd
    for (int t = 0; t < QK / 2; t++) {
        w[t] = d * (float)(qs[t] & 15) + m;
        w[t + QK / 2] = d * (float)(qs[t] >> 4) + m;
    }
}

/* The products below widen each block into vector registers and multiply it by up to QROWS rows of x before the
 * next block is read: 2 zmm (AVX-512) or 4 ymm (AVX2, 8 rows at a time) per block, else the portable
 * dequant_block + omp simd loop (measured 4-8x slower: GCC keeps its per-row partial sums in memory). */
#if defined(__AVX512F__)
#define QROWS 8
#define QLANES 16
typedef __m512 qvec;
#define qv_zero() _mm512_setzero_ps()
#define qv_set1(f) _mm512_set1_ps(f)
#define qv_load(p) _mm512_loadu_ps(p)
#define qv_fmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define qv_sum(v) _mm512_reduce_add_ps(v)
/* 16 bytes -> 16 floats; a __m128i of 16 int8 (sign) or uint8 */
#define qv_u8(v) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))
#define qv_i8(v) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v))
/* 16 bf16 at p -> 16 floats */
#define qv_bf16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#elif defined(__AVX2__) && defined(__FMA__)
#define QROWS 8
#define QLANES 8
typedef __m256 qvec;
#define qv_zero() _mm256_setzero_ps()
#define qv_set1(f) _mm256_set1_ps(f)
#define qv_load(p) _mm256_loadu_ps(p)
#define qv_fmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float qv_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* the low 8 bytes of a __m128i -> 8 floats */
#define qv_u8(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
#define qv_i8(v) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
/* 8 bf16 at p -> 8 floats */
#define qv_bf16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#else
#define QROWS 8
#endif

#ifdef QLANES
#define QV (QK / QLANES) /* vectors per block */

/* One block's 32 weights as QV vectors, lanes in weight order. */
static inline __attribute__((always_inline)) void block_vectors(int type, const uint8_t *b, qvec *w) {
    if (type == QTYPE_F32) {
        for (int v = 0; v < QV; v++) w[v] = qv_load((const float *)b + v * QLANES);
        return;
    }
    if (type == QTYPE_BF16) {
        for (int v = 0; v < QV; v++) w[v] = qv_bf16((const uint16_t *)b + v * QLANES);
        return;
    }
    if (type == QTYPE_I8) {
        for (int v = 0; v < QV; v++)
            w[v] = qv_i8(QLANES == 16 ? _mm_loadu_si128((const __m128i *)(b + v * QLANES))
                                      : _mm_loadl_epi64((const __m128i *)(b + v * QLANES)));
        return;
    }
    const qvec d = qv_set1(half_at(b));
    if (type == QTYPE_Q8_0) {
        for (int v = 0; v < QV; v++) /* loads of exactly QLANES bytes: never past the block */
            w[v] = qv_fmadd(qv_i8(QLANES == 16 ? _mm_loadu_si128((const __m128i *)(b + 2 + v * QLANES))
                                               : _mm_loadl_epi64((const __m128i *)(b + 2 + v * QLANES))),
                            d, qv_zero());
        return;
    }
    const qvec m = qv_set1(type == QTYPE_Q4_1 ? half_at(b + 2) : -8.f * half_at(b));
    const __m128i qs = _mm_loadu_si128((const __m128i *)(b + (type == QTYPE_Q4_1 ? 4 : 2)));
    /* weights 0..15 are the low nibbles, 16..31 the high ones */
#if QLANES == 16
    /* the block's 16 possible values d * q + m in one register, looked up by nibble (vpermps reads an index's low
     * 4 bits): one permute per 16 weights instead of a mask, a widening conversion and an FMA */
    const __m512 table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d, m);
    const __m512i idx = _mm512_cvtepu8_epi32(qs);
    w[0] = _mm512_permutexvar_ps(idx, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
#else
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    w[0] = qv_fmadd(qv_u8(lo), d, m);
    w[1] = qv_fmadd(qv_u8(_mm_unpackhi_epi64(lo, lo)), d, m);
    w[2] = qv_fmadd(qv_u8(hi), d, m);
    w[3] = qv_fmadd(qv_u8(_mm_unpackhi_epi64(hi, hi)), d, m);
#endif
}
#endif

/* How far ahead of the block being read the products ask for the weight stream, in bytes. The hardware prefetchers
 * stop at every 4 KiB page and restart on each 64-row chunk a thread takes, and a GGUF row is only a few hundred
 * bytes: without this hint the loads wait on memory. Measured on a 2-core Xeon, one row of x against 256 MiB of
 * weights, two threads: Q4_1 5.7 -> 12.3 GB/s, Q8_0 10.1 -> 16.1, bf16 17.5 -> 21, fp32 23 -> 26 (512-4096 bytes
 * all help; 2048 is the best for the mix). A prefetch past the end of the weights is a hint, never a fault. */
#define QPREFETCH 2048

/* out[i * ostride] = x_i . w_row for the m (1..QROWS) rows x_i = x + i * xstride, the weight row `wr` being k / QK
 * blocks of `type`. Inlined with a constant m, so that the partial sums of every row stay in registers. */
static inline __attribute__((always_inline)) void qdot_tile(int type, const uint8_t *restrict wr,
                                                            const float *restrict x, int64_t xstride, const int m,
                                                            int64_t k, float *restrict out, int64_t ostride) {
    const int64_t bytes = qblock_stride(type), nb = k / QK;
#ifdef QLANES
    /* Two chains of sums per row hide the FMA latency for up to half a tile of rows; past that the rows' own chains
     * do, and one sum per row leaves the registers for QROWS rows (AVX2: 8 sums + 4 weight vectors of 16). */
    const int chains = m <= QROWS / 2 ? 2 : 1;
    qvec acc[QROWS][2];
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = qv_zero();
    for (int64_t b = 0; b < nb; b++) {
        qvec w[QV];
        __builtin_prefetch(wr + b * bytes + QPREFETCH, 0, 3);
        block_vectors(type, wr + b * bytes, w);
        for (int i = 0; i < m; i++) {
            const float *xb = x + i * xstride + b * QK;
            for (int v = 0; v < QV; v++)
                acc[i][v % chains] = qv_fmadd(qv_load(xb + v * QLANES), w[v], acc[i][v % chains]);
        }
    }
    for (int i = 0; i < m; i++) out[i * ostride] = qv_sum(acc[i][0]) + qv_sum(acc[i][1]);
#else
    float part[QROWS][QK] = {{0.f}};
    for (int64_t b = 0; b < nb; b++) {
        float w[QK];
        __builtin_prefetch(wr + b * bytes + QPREFETCH, 0, 3);
        dequant_block(type, wr + b * bytes, w);
        for (int i = 0; i < m; i++) {
            const float *xb = x + i * xstride + b * QK;
#pragma omp simd
            for (int t = 0; t < QK; t++) part[i][t] += xb[t] * w[t];
        }
    }
    for (int i = 0; i < m; i++) {
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int t = 0; t < QK; t++) acc += part[i][t];
        out[i * ostride] = acc;
    }
#endif
}

#define QDOT_CASE(r) \
    case r: qdot_tile(type, wr, xi, xstride, r, k, oi, ostride); break;

/* qdot_tile for any number of rows, QROWS at a time, each tile with its count of rows known at compile time. */
static inline __attribute__((always_inline)) void qdot_rows_of(int type, const uint8_t *wr, const float *x,
                                                              int64_t xstride, int64_t m, int64_t k, float *out,
                                                              int64_t ostride) {
    for (int64_t i0 = 0; i0 < m; i0 += QROWS) {
        const float *xi = x + i0 * xstride;
        float *oi = out + i0 * ostride;
        switch (m - i0 < QROWS ? m - i0 : QROWS) {
            QDOT_CASE(1)
            QDOT_CASE(2)
            QDOT_CASE(3)
#if QROWS > 4
            QDOT_CASE(4)
            QDOT_CASE(5)
            QDOT_CASE(6)
            QDOT_CASE(7)
            default: qdot_tile(type, wr, xi, xstride, 8, k, oi, ostride); break;
#else
            default: qdot_tile(type, wr, xi, xstride, 4, k, oi, ostride); break;
#endif
        }
    }
}

#define QROWS_CASE(t) \
    case t: qdot_rows_of(t, wr, x, xstride, m, k, out, ostride); break;

/* qdot_rows_of with the type known at compile time too, so that no block pays for the choice of layout. */
static inline void qdot_rows(int type, const uint8_t *wr, const float *x, int64_t xstride, int64_t m, int64_t k,
                             float *out, int64_t ostride) {
    switch (type) {
        QROWS_CASE(QTYPE_F32)
        QROWS_CASE(QTYPE_Q4_0)
        QROWS_CASE(QTYPE_Q4_1)
        QROWS_CASE(QTYPE_Q8_0)
        QROWS_CASE(QTYPE_BF16)
        QROWS_CASE(QTYPE_I8)
        default: break;
    }
}

#endif
