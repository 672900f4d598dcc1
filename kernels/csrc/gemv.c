/* y = x W^T + b for the few rows of a CPU decode step (M <= 8), where every weight is read once per step.
 *
 * Threads split the output features. Each weight row is streamed once, 8 values at a time, and every row of x is
 * multiplied by that vector while it is in a register: M independent chains of sums (two per row below 4 rows),
 * so the FMA latency is hidden. One chain per dot product (the loop this replaced) left the FMA unit waiting on
 * its own result: at 4 rows of SmolLM2-sized or expert-sized matrices it ran at 5 GB/s of weights, compute-bound,
 * where one row ran at 8.5 (bench in docs/benchmarks.md, "Decode products"). GCC vector extensions keep it portable
 * to the SSE-only build; -march=native makes them AVX2 or AVX-512. */
#include <stdint.h>
#include <string.h>

#include "element.h"
#include "vmath.h"

#define MAX_ROWS 8

typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8w __attribute__((vector_size(32)));

static inline v8 load8_bf16(const uint16_t *p) {
    v8w bits = __builtin_convertvector(*(const v8h *)p, v8w) << 16;
    v8 f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* One weight row against M rows of x: M (M < 4: 2M) vector chains, then the tail of K past a multiple of 8. The
 * constant M of each instance lets the compiler keep every chain in a register. */
#define DOT_ROWS(name, wtype, loadw, at)                                                                        \
    static inline void name(const float *x, const wtype *wr, float *out, int64_t k, const int M) {              \
        const int U = M < 4 ? 2 : 1;                                                                           \
        v8 acc[MAX_ROWS][2];                                                                                   \
        for (int i = 0; i < M; i++) acc[i][0] = acc[i][1] = splat8(0.f);                                       \
        int64_t c = 0;                                                                                         \
        for (; c + 8 * U <= k; c += 8 * U)                                                                     \
            for (int u = 0; u < U; u++) {                                                                      \
                v8 wv = loadw(wr + c + 8 * u);                                                                 \
                for (int i = 0; i < M; i++) acc[i][u] += load8(x + i * k + c + 8 * u) * wv;                    \
            }                                                                                                  \
        for (int i = 0; i < M; i++) {                                                                          \
            float s = hsum8(acc[i][0] + acc[i][1]);                                                            \
            for (int64_t t = c; t < k; t++) s += x[i * k + t] * at(wr, t);                                    \
            out[i] = s;                                                                                        \
        }                                                                                                      \
    }
DOT_ROWS(dot_rows_f32, float, load8, f32_at)
DOT_ROWS(dot_rows_bf16, uint16_t, load8_bf16, bf16_at)

/* x (M, K) fp32, w (N, K) in `wtype` (bf16 as raw bits, widened to fp32 in registers: half the bytes streamed),
 * bias (N,) fp32 or NULL, y (M, N) fp32; all contiguous. 0, or -1 for M outside 1..8. */
#define GEMV(name, wtype, dot)                                                                                \
    int name(const float *x, const wtype *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,     \
             int threads) {                                                                                    \
        if (m < 1 || m > MAX_ROWS) return -1;                                                                  \
        _Pragma("omp parallel for num_threads(threads) schedule(static)") for (int64_t j = 0; j < n; j++) {    \
            float out[MAX_ROWS];                                                                               \
            switch (m) {                                                                                       \
            case 1: dot(x, w + j * k, out, k, 1); break;                                                       \
            case 2: dot(x, w + j * k, out, k, 2); break;                                                       \
            case 3: dot(x, w + j * k, out, k, 3); break;                                                       \
            case 4: dot(x, w + j * k, out, k, 4); break;                                                       \
            case 5: dot(x, w + j * k, out, k, 5); break;                                                       \
            case 6: dot(x, w + j * k, out, k, 6); break;                                                       \
            case 7: dot(x, w + j * k, out, k, 7); break;                                                       \
            default: dot(x, w + j * k, out, k, 8); break;                                                      \
            }                                                                                                  \
            for (int64_t i = 0; i < m; i++) y[i * n + j] = bias ? out[i] + bias[j] : out[i];                   \
        }                                                                                                      \
        return 0;                                                                                              \
    }
GEMV(gemv_f32, float, dot_rows_f32)
GEMV(gemv_bf16, uint16_t, dot_rows_bf16)
