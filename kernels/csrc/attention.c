/* Bidirectional attention o = softmax(scale q k^T) v on the CPU for small head sizes (D = 8, 16, 24 or 32):
 * the attention of a small diffusion transformer (the SD3-shaped DiT of bench/diffusion.py --dit attends over 1,357
 * tokens with heads of 16), where torch's CPU SDPA reaches 54 GFLOP/s on the 2-core AVX2 EPYC of docs/benchmarks.md:
 * its blocked GEMMs have an inner dimension of D, and every score pays an exp for only 4D flops. At D = 64 SDPA wins,
 * so bigger heads stay with it (kernels/cpu_attention.py).
 *
 * Threads split (batch, head, tile of 6 queries). A tile's scores against all keys are one row each in a scratch
 * buffer (6 x Tk floats: L1/L2-resident at these sizes), made by a register tile of 6 queries x 16 keys over the D
 * dimensions, with the keys transposed once per (batch, KV head) so that 8 keys' values at one dimension are one
 * vector, and the rows' maxima kept on the way; then each row's exp (vmath.h's exp8) and sum; then the weighted
 * sum of values, 6 (D <= 16) or 3 queries x D at a time. Two passes over a full score row, not flash attention's
 * running rescale: a row of Tk floats stays in cache at every size served here, and it saves the rescale per key
 * block. The vectors are vmath.h's GCC/Clang vector extensions of 8 floats. GQA is read natively (query head h uses
 * KV head h / (H / Hkv)). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vmath.h"

#define QT 6 /* queries per tile */
#define KB 16 /* keys per register tile of scores: two vectors */
#define MAX_DV 4 /* D / 8 */

static inline v8 vmax8(v8 a, v8 b) { return (v8)(((v8i)a & (a >= b)) | ((v8i)b & ~(a >= b))); }

/* s[i][j] = scale q_i . k_j for the QT query rows qr against the keys of kt (d rows of kb keys each, transposed),
 * one 6 x 16 register tile at a time (6 loads of q and 2 of keys per 12 FMAs); the rows' maxima over the first tk
 * keys go to mx. */
static void scores(const float *const *qr, const float *kt, int64_t kb, int64_t tk, int64_t d, float scale, float *s,
                   float *mx) {
    v8 top[QT];
    for (int i = 0; i < QT; i++) top[i] = splat8(-INFINITY);
    for (int64_t j = 0; j < kb; j += KB) {
        v8 acc[QT][2];
        for (int i = 0; i < QT; i++) acc[i][0] = acc[i][1] = splat8(0.f);
        for (int64_t c = 0; c < d; c++) {
            const v8 k0 = load8(kt + c * kb + j), k1 = load8(kt + c * kb + j + 8);
            for (int i = 0; i < QT; i++) {
                const v8 qv = splat8(qr[i][c]);
                acc[i][0] += qv * k0;
                acc[i][1] += qv * k1;
            }
        }
        for (int i = 0; i < QT; i++) {
            acc[i][0] *= splat8(scale);
            acc[i][1] *= splat8(scale);
            *(v8u *)(s + i * kb + j) = acc[i][0];
            *(v8u *)(s + i * kb + j + 8) = acc[i][1];
            if (j + KB <= tk) top[i] = vmax8(top[i], vmax8(acc[i][0], acc[i][1]));
        }
    }
    for (int i = 0; i < QT; i++) {
        float m = top[i][0];
        for (int l = 1; l < 8; l++) m = top[i][l] > m ? top[i][l] : m;
        for (int64_t j = tk / KB * KB; j < tk; j++) m = s[i * kb + j] > m ? s[i * kb + j] : m; /* the last block */
        mx[i] = m;
    }
}

/* acc[i] = sum_j p_i[j] v[j] for qp rows of weights p_i over tk keys, v rows `vstride` apart, nd vectors wide.
 * Inlined with constant qp and nd (qp x nd <= 12) so that the sums stay in registers. */
static inline __attribute__((always_inline)) void weighted_values(const float *const *p, const float *v,
                                                                  int64_t vstride, int64_t tk, const int qp,
                                                                  const int nd, v8 acc[QT][MAX_DV]) {
    for (int i = 0; i < qp; i++)
        for (int n = 0; n < nd; n++) acc[i][n] = splat8(0.f);
    for (int64_t j = 0; j < tk; j++) {
        const float *vr = v + j * vstride;
        v8 vv[MAX_DV];
        for (int n = 0; n < nd; n++) vv[n] = load8(vr + 8 * n);
        for (int i = 0; i < qp; i++) {
            const v8 pv = splat8(p[i][j]);
            for (int n = 0; n < nd; n++) acc[i][n] += pv * vv[n];
        }
    }
}

/* q, k, v, o address element [b][h][t][0] at b * s_b + h * s_h + t * s_t (the last dimension contiguous), with
 * q and o of H heads and Tq tokens, k and v of Hkv heads and Tk tokens. 0; -1 for a head size this file does not
 * take (D not a multiple of 8, or above 32), H not a multiple of Hkv, or a scratch allocation that failed. */
int attention_f32(const float *q, const float *k, const float *v, float *o, int64_t batch, int64_t heads,
                  int64_t kv_heads, int64_t tq, int64_t tk, int64_t d, const int64_t *q_strides,
                  const int64_t *k_strides, const int64_t *v_strides, const int64_t *o_strides, float scale,
                  int threads) {
    if (d % 8 || d / 8 > MAX_DV || d <= 0 || kv_heads <= 0 || heads % kv_heads || tq <= 0 || tk <= 0) return -1;
    const int64_t nd = d / 8, kb = (tk + KB - 1) / KB * KB, tiles = (tq + QT - 1) / QT, group = heads / kv_heads;
    /* rows of the value sum per pass: as many as keep qp x nd <= 12 sums in registers */
    const int qp = nd <= 2 ? 6 : 3;
    /* keys transposed per (batch, KV head): kt[(b * Hkv + g) * d + c][j] = k[b][g][j][c], zero past Tk */
    float *kt = malloc((size_t)(batch * kv_heads * d * kb) * sizeof *kt);
    if (!kt) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < batch * kv_heads; p++) {
            const float *kp = k + (p / kv_heads) * k_strides[0] + (p % kv_heads) * k_strides[1];
            float *dst = kt + p * d * kb;
            for (int64_t c = 0; c < d; c++)
                for (int64_t j = 0; j < kb; j++) dst[c * kb + j] = j < tk ? kp[j * k_strides[2] + c] : 0.f;
        }
        float *s = malloc((size_t)(QT * kb) * sizeof *s);
        if (!s) failed = 1;
#pragma omp for schedule(dynamic, 4)
        for (int64_t w = 0; w < batch * heads * tiles; w++) {
            if (failed) continue;
            const int64_t b = w / (heads * tiles), h = (w / tiles) % heads, i0 = (w % tiles) * QT;
            const int64_t rows = tq - i0 < QT ? tq - i0 : QT, g = h / group;
            const float *qp_ = q + b * q_strides[0] + h * q_strides[1];
            const float *vp = v + b * v_strides[0] + g * v_strides[1];
            float *op = o + b * o_strides[0] + h * o_strides[1];
            const float *qr[QT];
            float mx[QT], inv[QT];
            for (int i = 0; i < QT; i++) qr[i] = qp_ + (i0 + (i < rows ? i : rows - 1)) * q_strides[2];
            scores(qr, kt + (b * kv_heads + g) * d * kb, kb, tk, d, scale, s, mx);
            for (int i = 0; i < rows; i++) inv[i] = 1.f / exp_shifted_sum(s + i * kb, tk, mx[i]);
            for (int r0 = 0; r0 < rows; r0 += qp) { /* o = p v / sum */
                v8 acc[QT][MAX_DV];
                const float *rows_p[QT];
                for (int i = 0; i < qp; i++) rows_p[i] = s + (r0 + i < rows ? r0 + i : r0) * kb;
                switch (nd) {
                case 1: weighted_values(rows_p, vp, v_strides[2], tk, 6, 1, acc); break;
                case 2: weighted_values(rows_p, vp, v_strides[2], tk, 6, 2, acc); break;
                case 3: weighted_values(rows_p, vp, v_strides[2], tk, 3, 3, acc); break;
                default: weighted_values(rows_p, vp, v_strides[2], tk, 3, 4, acc); break;
                }
                for (int i = 0; i < qp && r0 + i < rows; i++) {
                    float *out = op + (i0 + r0 + i) * o_strides[2];
                    for (int64_t n = 0; n < nd; n++) *(v8u *)(out + 8 * n) = acc[i][n] * splat8(inv[r0 + i]);
                }
            }
        }
        free(s);
    }
    free(kt);
    return failed ? -1 : 0;
}
