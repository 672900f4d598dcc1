/* y = x W^T + b with W kept in GGUF's quantised blocks (quant.h): the weights are dequantised block by block inside
 * the product, in registers, so a decode step streams the file's 4.5-8.5 bits per weight instead of fp32's 32. For
 * the larger products of a prefill, quant_dequant_rows widens a slice of rows to fp32 for a BLAS sgemm. Threads
 * split the output features, in chunks (see decode_step.c on why dynamic). */
#include <stdint.h>

#include "quant.h"

#define ROWS_PER_CHUNK 16

/* x (M, K) fp32, w (N, K / 32 blocks of `type`), bias (N,) or NULL, y (M, N) fp32; K a multiple of 32. 0; -1 for a
 * type not in quant.h or K not a multiple of 32. Any M: rows go through the tile QROWS at a time. */
int quant_gemv(const float *x, const uint8_t *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
               int type, int threads) {
    const int64_t row_bytes = k / QK * qblock_bytes(type);
    if (!row_bytes || k % QK || m < 1) return -1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, ROWS_PER_CHUNK)
    for (int64_t j = 0; j < n; j++) {
        qdot_rows(type, w + j * row_bytes, x, k, m, k, y + j, n);
        if (bias)
            for (int64_t i = 0; i < m; i++) y[i * n + j] += bias[j];
    }
    return 0;
}

/* Rows [row0, row0 + rows) of w (N, K / 32 blocks of `type`) as fp32 into out (rows, K). 0; -1 as quant_gemv. */
int quant_dequant_rows(const uint8_t *w, float *out, int64_t row0, int64_t rows, int64_t k, int type, int threads) {
    const int64_t bytes = qblock_bytes(type), nb = k / QK;
    if (!bytes || k % QK) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) dequant_block(type, w + ((row0 + r) * nb + b) * bytes, out + r * k + b * QK);
    return 0;
}
