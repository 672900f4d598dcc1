/* A whole decode step of a Llama-family model for the decode tokens of a CPU engine step, fp32, in a single call:
 * per layer
 *
 *   h = RMSNorm(x) * ln1;  q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv);  RoPE(q, k);  cache <- k, v;
 *   x += Attention(q, paged K/V) Wo^T;  h = RMSNorm(x) * ln2;  x += (SiLU(h Wg^T) * (h Wu^T)) Wd^T
 *
 * then logits = RMSNorm(x) * norm W_head^T (seed Defs. 19, 15, 17, 16, 20; the torch path is services/text/model.py).
 * A decode step reads every weight once, so its floor is memory bandwidth; run op by op, the hundred small tensor
 * ops per layer around the matrix-vector products cost as much again. Here the threads stay in one OpenMP region
 * for the whole step and split each phase (output features, or (token, head) pairs for attention), with a barrier
 * between phases. Activations are fp32; each projection and the LM head may instead keep a GGUF checkpoint's
 * Q8_0/Q4_0/Q4_1 blocks, bf16 rows, or int8 rows with per-row scales, widened in registers inside the product
 * (quant.h), so the step streams the stored bytes. The embedding may be bf16 and the paged K/V caches bf16 (a bf16
 * model's): rows are widened on read and keys/values rounded to nearest-even on write, as torch's .to() rounds.
 * RoPE is the rotate-half layout, cos/sin tables of (D/2) rows indexed by position.
 *
 * LoRA (Hu et al. 2021) for many adapters in one step, Punica's BGMV (Chen et al. 2023): a projection may carry
 * adapter slots, A (slots, R, in) and B (slots, out, R) with the scale folded into B, and each slot's rank; token i
 * uses slot lora_slots[i] (-1: none). Before a phase of adapted products, one more parallel phase shrinks each
 * token's input, t_i = x_i A^T (at most R values per product); the product's own loop then adds B_j . t_i to output
 * feature j beside the base weight's row, so the adapter rows stay inside the same region and phases. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "element.h"
#include "quant.h"

/* What stays fixed for a layer: weights as (out, in) row-major like nn.Linear (biases may be NULL), sizes. A
 * projection matrix is fp32 or blocks of quant.h; types[] holds the type of wq, wk, wv, wo, wg, wu, wd, and
 * scales[] their per-row scales (int8 rows; NULL otherwise). qn/kn: per-head RMSNorm gains (d,) applied to every
 * query and key head before RoPE (QK-norm: Qwen3), or NULL. */
typedef struct {
    const float *ln1;
    const void *wq, *wk, *wv;
    const float *bq, *bk, *bv;
    const void *wo;
    const float *ln2;
    const void *wg, *wu, *wd;
    int64_t dim, hq, hkv, d, ffn, window;
    float eps, scale;
    int32_t types[7];
    const float *scales[7];
    const float *qn, *kn;
    const float *lora_a[7], *lora_b[7]; /* per projection, adapter slots (NULL: none), as in the header comment */
    const int32_t *lora_ranks[7];
} LayerWeights;

enum { TQ, TK, TV, TO, TG, TU, TD };

/* What one step shares across layers: per token its id, position, flat cache slot, block table row and context
 * length (incl. the token), the slots (n_groups, M) and tables (n_groups, M, max_blocks) once per KV group of a
 * hybrid cache, layer l reading group layer_groups[l] (NULL: every layer group 0); the embedding (vocab, dim; fp32,
 * or bf16 when embed_bf16) and the RoPE tables (n_positions, D/2), read at each token's id and position; scratch
 * h (M, dim), q/att (M, Hq*D), k/v (M, Hkv*D), act (M, ffn); cache_bf16 when the K/V caches hold bf16. LoRA:
 * lora_slots (M,) each token's adapter slot or -1 (NULL: no adapter row in the step), lora_t scratch (7, M, lora_r)
 * for every projection's shrunk input. */
typedef struct {
    const int64_t *tokens, *positions, *slots;
    const int32_t *tables, *lens;
    const void *embed;
    const float *cos, *sin;
    float *h, *q, *k, *v, *att, *act;
    int64_t m, block_size, max_blocks, vocab, n_positions, embed_bf16, cache_bf16;
    const int32_t *lora_slots;
    float *lora_t;
    int64_t lora_r;
    const int64_t *layer_groups;
    int64_t n_groups;
} StepInputs;

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* Rows dotted with one weight row at a time, in tiles of this many rows (a stack buffer per tile). */
#define TILE 16

/* A cache row's d values widened to fp32 in out: the row itself when the cache is fp32. */
static inline const float *cache_row(const void *cache, int bf16, int64_t at, int64_t d, float *out) {
    if (!bf16) return (const float *)cache + at;
    for (int64_t c = 0; c < d; c++) out[c] = bf16_at((const uint16_t *)cache, at + c);
    return out;
}

static inline void cache_store(void *cache, int bf16, int64_t at, const float *x, int64_t d) {
    if (bf16)
        for (int64_t c = 0; c < d; c++) ((uint16_t *)cache)[at + c] = bf16_round(x[c]);
    else
        memcpy((float *)cache + at, x, (size_t)d * sizeof *x);
}

/* out[i * ostride] = x_i . row j of w (type: fp32, or blocks of quant.h widened in registers, scale: int8 rows'
 * per-row scales or NULL) for the m <= TILE rows x_i = x + i * xstride. */
static inline void rows_dot(const void *w, int type, const float *scale, int64_t j, int64_t k, const float *x,
                            int64_t xstride, int64_t m, float *out, int64_t ostride) {
    if (type == QTYPE_F32 && k % QK) {
        for (int64_t i = 0; i < m; i++) out[i * ostride] = dot(x + i * xstride, (const float *)w + j * k, k);
    } else if (type == QTYPE_F32) { /* the tile keeps several rows' sums in registers, where dot after dot would
                                      * wait on one accumulator's FMA latency (16 mixed requests: +10-15%), and
                                      * prefetches the weight stream (one row: 21 -> 26 GB/s) */
        qdot_rows(type, (const uint8_t *)w + j * k * (int64_t)sizeof(float), x, xstride, m, k, out, ostride);
    } else {
        qdot_rows(type, (const uint8_t *)w + j * (k / QK * qblock_bytes(type)), x, xstride, m, k, out, ostride);
    }
    if (scale)
        for (int64_t i = 0; i < m; i++) out[i * ostride] *= scale[j];
}

/* Adds x_i . row j of w to acc[i * astride] for every one of the m rows, TILE at a time. */
static inline void rows_dot_add(const void *w, int type, const float *scale, int64_t j, int64_t k, const float *x,
                                int64_t m, float *acc, int64_t astride) {
    float t[TILE];
    for (int64_t i0 = 0; i0 < m; i0 += TILE) {
        const int64_t n = m - i0 < TILE ? m - i0 : TILE;
        rows_dot(w, type, scale, j, k, x + i0 * k, k, n, t, 1);
        for (int64_t i = 0; i < n; i++) acc[(i0 + i) * astride] += t[i];
    }
}

/* The shrink of the adapted products `which` (n of them, sharing the input x (M, k)): t[w][i][c] = A_{slot_i}[c] .
 * x_i for c below the slot's rank, 0 past it and for tokens without an adapter; one worksharing loop over every
 * (product, token, column), so call it from all threads of the region, and only when S->lora_slots is set. */
static void lora_shrink(const LayerWeights *W, const StepInputs *S, const int *which, int n, const float *x,
                        int64_t k) {
    const int64_t m = S->m, r_max = S->lora_r;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < n * m * r_max; p++) {
        const int w = which[p / (m * r_max)];
        const int64_t i = p / r_max % m, c = p % r_max;
        const int32_t slot = S->lora_slots[i];
        float *t = S->lora_t + (w * m + i) * r_max + c;
        *t = slot >= 0 && W->lora_a[w] && c < W->lora_ranks[w][slot]
                 ? dot(W->lora_a[w] + ((int64_t)slot * r_max + c) * k, x + i * k, k)
                 : 0.f;
    }
}

/* out[(i - i0) * ostride] += B_{slot_i}[j] . t_i for the tokens i0..i0+n-1 with an adapter: output feature j (of
 * n_out) of adapted product w, after lora_shrink. */
static inline void lora_expand(const LayerWeights *W, const StepInputs *S, int w, int64_t j, int64_t n_out,
                               int64_t i0, int64_t n, float *out, int64_t ostride) {
    if (!S->lora_slots || !W->lora_b[w]) return;
    const int64_t r_max = S->lora_r;
    for (int64_t i = i0; i < i0 + n; i++) {
        const int32_t slot = S->lora_slots[i];
        if (slot < 0 || !W->lora_ranks[w][slot]) continue;
        out[(i - i0) * ostride] += dot(W->lora_b[w] + ((int64_t)slot * n_out + j) * r_max,
                                       S->lora_t + (w * S->m + i) * r_max, W->lora_ranks[w][slot]);
    }
}

static void rms_norm_rows(const float *x, const float *w, float *out, int64_t m, int64_t dim, float eps) {
    for (int64_t i = 0; i < m; i++) {
        const float inv = 1.f / sqrtf(dot(x + i * dim, x + i * dim, dim) / (float)dim + eps);
        for (int64_t c = 0; c < dim; c++) out[i * dim + c] = w[c] * (x[i * dim + c] * inv);
    }
}

static void rotate(float *x, const float *cos, const float *sin, int64_t half) {
    for (int64_t c = 0; c < half; c++) {
        const float x1 = x[c], x2 = x[c + half];
        x[c] = x1 * cos[c] - x2 * sin[c];
        x[c + half] = x2 * cos[c] + x1 * sin[c];
    }
}

/* softmax(q K^T * scale) V over positions [start, n) of token i's paged cache, for one query head, through the
 * block tables of KV group grp; row: scratch of d floats for a widened bf16 cache row. A sliding group's table
 * names the null block below the window, which is never read here. */
static void attend(const LayerWeights *W, const StepInputs *S, int64_t grp, const void *k_cache, const void *v_cache,
                   int64_t i, int64_t head, float *scores, float *row) {
    const int64_t g = head / (W->hq / W->hkv), n = S->lens[i], d = W->d, nkv = W->hkv * d;
    const int64_t start = W->window > 0 && n > W->window ? n - W->window : 0;
    const int32_t *table = S->tables + (grp * S->m + i) * S->max_blocks;
    const float *qr = S->q + (i * W->hq + head) * d;
    float *o = S->att + (i * W->hq + head) * d;
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = start; t < n; t++) {
        const int64_t slot = (int64_t)table[t / S->block_size] * S->block_size + t % S->block_size;
        scores[t - start] = dot(qr, cache_row(k_cache, S->cache_bf16, slot * nkv + g * d, d, row), d) * W->scale;
        mx = scores[t - start] > mx ? scores[t - start] : mx;
    }
    for (int64_t t = 0; t < n - start; t++) sum += scores[t] = expf(scores[t] - mx);
    for (int64_t c = 0; c < d; c++) o[c] = 0.f;
    for (int64_t t = start; t < n; t++) {
        const int64_t slot = (int64_t)table[t / S->block_size] * S->block_size + t % S->block_size;
        const float *vr = cache_row(v_cache, S->cache_bf16, slot * nkv + g * d, d, row), p = scores[t - start] / sum;
#pragma omp simd
        for (int64_t c = 0; c < d; c++) o[c] += p * vr[c];
    }
}

/* Matrix-vector phases hand out rows in chunks of ROWS_PER_CHUNK rather than one fixed slice per thread: the two
 * threads of a small machine rarely stream at the same speed, and with eight phases per layer a static split waits
 * for the slower one eight times (dynamic chunks measured 10-12% faster per layer on a 2-vCPU EPYC). */
#define ROWS_PER_CHUNK 64

/* One layer, run by every thread of the enclosing parallel region (the omp for/single directives bind to it), its
 * K/V slots and tables those of KV group grp. scores: this thread's attention scratch of at least max(lens) +
 * head_dim floats. */
static void layer(const LayerWeights *W, const StepInputs *S, int64_t grp, void *k_cache, void *v_cache, float *x,
                  float *scores) {
    const int64_t m = S->m, dim = W->dim, d = W->d, nq = W->hq * d, nkv = W->hkv * d, ffn = W->ffn;
    const int64_t *slots = S->slots + grp * m;
    static const int QKV[] = {TQ, TK, TV}, O[] = {TO}, GU[] = {TG, TU}, D[] = {TD};
#pragma omp single
    rms_norm_rows(x, W->ln1, S->h, m, dim, W->eps);
    if (S->lora_slots) lora_shrink(W, S, QKV, 3, S->h, dim);
    /* q, k, v: one loop over the concatenated output features, so the threads share the load evenly */
#pragma omp for schedule(dynamic, ROWS_PER_CHUNK)
    for (int64_t j = 0; j < nq + 2 * nkv; j++) {
        const void *w = W->wq;
        const float *b = W->bq;
        int which = TQ;
        float *out = S->q;
        int64_t jj = j, width = nq;
        if (j >= nq + nkv) { w = W->wv; b = W->bv; which = TV; out = S->v; jj = j - nq - nkv; width = nkv; }
        else if (j >= nq) { w = W->wk; b = W->bk; which = TK; out = S->k; jj = j - nq; width = nkv; }
        for (int64_t i = 0; i < m; i++) out[i * width + jj] = b ? b[jj] : 0.f;
        rows_dot_add(w, W->types[which], W->scales[which], jj, dim, S->h, m, out + jj, width);
        lora_expand(W, S, which, jj, width, 0, m, out + jj, width);
    }
    /* RoPE on every query and key head; a rotated key head goes straight into the cache with its value head */
#pragma omp for schedule(static)
    for (int64_t p = 0; p < m * (W->hq + W->hkv); p++) {
        const int64_t i = p / (W->hq + W->hkv), head = p % (W->hq + W->hkv);
        const float *cos = S->cos + S->positions[i] * (d / 2), *sin = S->sin + S->positions[i] * (d / 2);
        if (head < W->hq) {
            float *qr = S->q + (i * W->hq + head) * d;
            if (W->qn) rms_norm_rows(qr, W->qn, qr, 1, d, W->eps);
            rotate(qr, cos, sin, d / 2);
        } else {
            const int64_t off = (head - W->hq) * d;
            float *kr = S->k + i * nkv + off;
            if (W->kn) rms_norm_rows(kr, W->kn, kr, 1, d, W->eps);
            rotate(kr, cos, sin, d / 2);
            cache_store(k_cache, S->cache_bf16, slots[i] * nkv + off, kr, d);
            cache_store(v_cache, S->cache_bf16, slots[i] * nkv + off, S->v + i * nkv + off, d);
        }
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < m * W->hq; p++)
        attend(W, S, grp, k_cache, v_cache, p / W->hq, p % W->hq, scores + d, scores);
    if (S->lora_slots) lora_shrink(W, S, O, 1, S->att, nq);
#pragma omp for schedule(dynamic, ROWS_PER_CHUNK)
    for (int64_t j = 0; j < dim; j++) {
        rows_dot_add(W->wo, W->types[TO], W->scales[TO], j, nq, S->att, m, x + j, dim);
        lora_expand(W, S, TO, j, dim, 0, m, x + j, dim);
    }
#pragma omp single
    rms_norm_rows(x, W->ln2, S->h, m, dim, W->eps);
    if (S->lora_slots) lora_shrink(W, S, GU, 2, S->h, dim);
#pragma omp for schedule(dynamic, ROWS_PER_CHUNK)
    for (int64_t j = 0; j < ffn; j++)
        for (int64_t i0 = 0; i0 < m; i0 += TILE) {
            const int64_t n = m - i0 < TILE ? m - i0 : TILE;
            float gate[TILE], up[TILE];
            rows_dot(W->wg, W->types[TG], W->scales[TG], j, dim, S->h + i0 * dim, dim, n, gate, 1);
            rows_dot(W->wu, W->types[TU], W->scales[TU], j, dim, S->h + i0 * dim, dim, n, up, 1);
            lora_expand(W, S, TG, j, ffn, i0, n, gate, 1);
            lora_expand(W, S, TU, j, ffn, i0, n, up, 1);
            for (int64_t i = 0; i < n; i++) S->act[(i0 + i) * ffn + j] = gate[i] / (1.f + expf(-gate[i])) * up[i];
        }
    if (S->lora_slots) lora_shrink(W, S, D, 1, S->act, ffn);
#pragma omp for schedule(dynamic, ROWS_PER_CHUNK)
    for (int64_t j = 0; j < dim; j++) {
        rows_dot_add(W->wd, W->types[TD], W->scales[TD], j, ffn, S->act, m, x + j, dim);
        lora_expand(W, S, TD, j, dim, 0, m, x + j, dim);
    }
}

static int64_t longest_context(const StepInputs *S) {
    int64_t longest = 1;
    for (int64_t i = 0; i < S->m; i++) longest = S->lens[i] > longest ? S->lens[i] : longest;
    return longest;
}

/* Each thread's attention scratch, allocated inside the parallel region. All threads must run the same worksharing
 * constructs, so if any allocation fails every thread gets NULL back (and frees its own) and *failed is set. */
static float *scratch(int64_t n, int *failed) {
    float *p = malloc((size_t)n * sizeof *p);
    if (!p) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp barrier
    int any;
#pragma omp atomic read
    any = *failed;
    if (any) {
        free(p);
        return NULL;
    }
    return p;
}

/* A whole decode step: the embedding lookup into x (M, dim), every layer (caches k_caches[l], v_caches[l]), the final
 * RMSNorm (norm, eps) and the LM head (vocab, dim; fp32 or blocks of head_type, head_scales for int8 rows, else
 * NULL) into logits (M, vocab), in one
 * parallel region, so the threads never leave it between layers. x ends as the last hidden state. 0; -1 when the attention scratch cannot be
 * allocated; -2 when a token id or a position is outside the embedding or the RoPE tables (nothing is written). */
int decode_step_f32(const LayerWeights *layers, int64_t n_layers, const StepInputs *S, void *const *k_caches,
                    void *const *v_caches, float *x, const float *norm, float eps, const void *head, int head_type,
                    const float *head_scales, int64_t vocab, float *logits, int threads) {
    const int64_t longest = longest_context(S), m = S->m, dim = layers[0].dim;
    for (int64_t i = 0; i < m; i++)
        if (S->tokens[i] < 0 || S->tokens[i] >= S->vocab || S->positions[i] < 0 || S->positions[i] >= S->n_positions)
            return -2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = scratch(longest + layers[0].d, &failed);
        if (scores) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++)
                for (int64_t c = 0; c < dim; c++)
                    x[i * dim + c] = S->embed_bf16 ? bf16_at(S->embed, S->tokens[i] * dim + c)
                                                   : f32_at(S->embed, S->tokens[i] * dim + c);
            for (int64_t l = 0; l < n_layers; l++)
                layer(&layers[l], S, S->layer_groups ? S->layer_groups[l] : 0, k_caches[l], v_caches[l], x, scores);
#pragma omp single
            rms_norm_rows(x, norm, S->h, m, dim, eps);
#pragma omp for schedule(static)
            for (int64_t j = 0; j < vocab; j++)
                rows_dot(head, head_type, head_scales, j, dim, S->h, dim, m, logits + j, vocab);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* The first index of the largest of n values, a NaN counting as the largest (numpy's and torch's argmax rule). */
static int64_t argmax_row(const float *v, int64_t n) {
    int64_t best = 0;
    for (int64_t j = 0; j < n; j++) {
        if (v[j] != v[j]) return j;
        if (v[j] > v[best]) best = j;
    }
    return best;
}

/* n_steps greedy decode steps in a row for the same M sequences (multi-step decoding, as vLLM's multi-step
 * scheduling): after each step every row's next token is the argmax of its logits, and it is fed back at the next
 * position, its cache slot in each KV group read from the row's block table in that group. out_tokens (M, n_steps)
 * receives the tokens; logits hold the last step's. The caller's block tables must already cover every position up
 * to positions[i] + n_steps - 1; a position past a table's width returns -2 before anything is computed, and the
 * per-step checks of decode_step_f32 apply (-1, -2). */
int decode_steps_f32(const LayerWeights *layers, int64_t n_layers, const StepInputs *S, void *const *k_caches,
                     void *const *v_caches, float *x, const float *norm, float eps, const void *head, int head_type,
                     const float *head_scales, int64_t vocab, float *logits, int64_t n_steps, int64_t *out_tokens,
                     int threads) {
    const int64_t m = S->m, bs = S->block_size, n_groups = S->n_groups;
    for (int64_t i = 0; i < m; i++)
        if (S->positions[i] < 0 || (S->positions[i] + n_steps - 1) / bs >= S->max_blocks) return -2;
    int64_t *ids = malloc((size_t)((2 + n_groups) * m) * sizeof *ids);
    int32_t *lens = malloc((size_t)m * sizeof *lens);
    if (!ids || !lens) {
        free(ids);
        free(lens);
        return -1;
    }
    StepInputs step = *S; /* the caller's arrays stay as given; this step's tokens, positions, slots are ours */
    memcpy(ids, S->tokens, (size_t)m * sizeof *ids);
    memcpy(ids + m, S->positions, (size_t)m * sizeof *ids);
    memcpy(ids + 2 * m, S->slots, (size_t)(n_groups * m) * sizeof *ids);
    memcpy(lens, S->lens, (size_t)m * sizeof *lens);
    step.tokens = ids, step.positions = ids + m, step.slots = ids + 2 * m, step.lens = lens;
    int status = 0;
    for (int64_t s = 0; s < n_steps && !status; s++) {
        status = decode_step_f32(layers, n_layers, &step, k_caches, v_caches, x, norm, eps, head, head_type,
                                 head_scales, vocab, logits, threads);
        for (int64_t i = 0; i < m && !status; i++) {
            const int64_t token = argmax_row(logits + i * vocab, vocab), pos = ids[m + i] + 1;
            out_tokens[i * n_steps + s] = token;
            if (s + 1 == n_steps) continue;
            ids[i] = token;
            ids[m + i] = pos;
            for (int64_t grp = 0; grp < n_groups; grp++)
                ids[(2 + grp) * m + i] = (int64_t)S->tables[(grp * m + i) * S->max_blocks + pos / bs] * bs + pos % bs;
            lens[i] += 1;
        }
    }
    free(ids);
    free(lens);
    return status;
}
