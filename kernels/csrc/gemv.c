/* y = x W^T + b for the few rows of a CPU decode step (M <= 8), where every weight is read once per step and
 * memory bandwidth, not arithmetic, sets the speed.
 *
 * Threads split the output features; each weight row is streamed from memory once and stays in L1 while every
 * row of x is multiplied by it. Built by kernels/cpu_gemv.py with -O3 -march=native -fopenmp: the simd
 * reductions become AVX-512 (or AVX2) FMAs, and OpenMP runs on the libgomp that torch has already loaded. A
 * register-tiled variant (all M rows against one weight slice) measured slower up to M = 8 on a 2-core EPYC. */
#include <stdint.h>
#include <string.h>

#include "element.h"

#define MAX_ROWS 8

/* x (M, K) fp32, w (N, K) in `wtype` (bf16 as raw bits, widened to fp32 in registers: half the bytes streamed),
 * bias (N,) fp32 or NULL, y (M, N) fp32; all contiguous. 0, or -1 for M outside 1..8. */
#define GEMV(name, wtype, at)                                                                                 \
    int name(const float *x, const wtype *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,     \
             int threads) {                                                                                    \
        if (m < 1 || m > MAX_ROWS) return -1;                                                                  \
        _Pragma("omp parallel for num_threads(threads) schedule(static)") for (int64_t j = 0; j < n; j++) {    \
            const wtype *wr = w + j * k;                                                                       \
            for (int64_t i = 0; i < m; i++) {                                                                  \
                const float *xr = x + i * k;                                                                   \
                float acc = 0.f;                                                                               \
                _Pragma("omp simd reduction(+ : acc)") for (int64_t c = 0; c < k; c++) acc += xr[c] * at(wr, c);\
                y[i * n + j] = bias ? acc + bias[j] : acc;                                                     \
            }                                                                                                  \
        }                                                                                                      \
        return 0;                                                                                              \
    }
GEMV(gemv_f32, float, f32_at)
GEMV(gemv_bf16, uint16_t, bf16_at)
