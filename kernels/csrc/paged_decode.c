/* Decode attention over the engine's paged KV cache on the CPU: softmax(q K^T * scale) V for one query token
 * per sequence (the layout of kernels/paged_attention.py: caches (num_blocks, block_size, Hkv, D), token t of
 * sequence b in block tables[b, t / block_size], slot t % block_size).
 *
 * One call replaces the gather + mask + SDPA of the torch path, which costs a dozen tensor ops per layer on a
 * decode step that is otherwise a few matrix-vector products. Threads split the (sequence, query head) pairs;
 * GQA is read natively (query head h uses KV head h / (Hq / Hkv)). Two passes over the keys: scores and their
 * maximum, then exp and the weighted sum of values. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "element.h"

/* q (B, Hq, D) fp32, caches in `ctype`, tables int32 (B, max_blocks), lens int32 (B,), out (B, Hq, D) fp32.
 * 0, or -1 when a scratch buffer cannot be allocated. */
#define PAGED_DECODE(name, ctype, at)                                                                         \
    int name(const float *q, const ctype *k_cache, const ctype *v_cache, const int32_t *tables,              \
             const int32_t *lens, float *out, int64_t batch, int64_t hq, int64_t hkv, int64_t d,               \
             int64_t block_size, int64_t max_blocks, float scale, int threads) {                               \
        int failed = 0;                                                                                        \
        _Pragma("omp parallel num_threads(threads) reduction(| : failed)") {                                   \
            float *scores = NULL;                                                                              \
            int64_t capacity = 0;                                                                              \
            _Pragma("omp for schedule(static)") for (int64_t p = 0; p < batch * hq; p++) {                     \
                const int64_t s = p / hq, g = (p % hq) / (hq / hkv), n = lens[s];                              \
                const float *qr = q + p * d;                                                                   \
                float *o = out + p * d;                                                                        \
                memset(o, 0, (size_t)d * sizeof *o);                                                           \
                if (n <= 0 || failed) continue;                                                                \
                if (n > capacity) {                                                                            \
                    float *grown = realloc(scores, (size_t)n * sizeof *scores);                                \
                    if (!grown) { failed = 1; continue; }                                                      \
                    scores = grown;                                                                            \
                    capacity = n;                                                                              \
                }                                                                                              \
                float mx = -INFINITY;                                                                          \
                for (int64_t t = 0; t < n; t++) {                                                              \
                    const int64_t slot = (int64_t)tables[s * max_blocks + t / block_size] * block_size         \
                                         + t % block_size;                                                     \
                    const ctype *kr = k_cache + (slot * hkv + g) * d;                                          \
                    float acc = 0.f;                                                                           \
                    _Pragma("omp simd reduction(+ : acc)") for (int64_t c = 0; c < d; c++)                     \
                        acc += qr[c] * at(kr, c);                                                              \
                    scores[t] = acc * scale;                                                                   \
                    mx = scores[t] > mx ? scores[t] : mx;                                                      \
                }                                                                                              \
                float sum = 0.f;                                                                               \
                for (int64_t t = 0; t < n; t++) sum += scores[t] = expf(scores[t] - mx);                       \
                for (int64_t t = 0; t < n; t++) {                                                              \
                    const int64_t slot = (int64_t)tables[s * max_blocks + t / block_size] * block_size         \
                                         + t % block_size;                                                     \
                    const ctype *vr = v_cache + (slot * hkv + g) * d;                                          \
                    const float w = scores[t] / sum;                                                           \
                    _Pragma("omp simd") for (int64_t c = 0; c < d; c++) o[c] += w * at(vr, c);                 \
                }                                                                                              \
            }                                                                                                  \
            free(scores);                                                                                      \
        }                                                                                                      \
        return failed ? -1 : 0;                                                                                \
    }
PAGED_DECODE(paged_decode_f32, float, f32_at)
PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_at)
