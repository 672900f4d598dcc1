/* One U-Net spatial transformer (shared/blocks/unet.py, SpatialTransformer) for fp32 CPU inference in one call:
 *
 *   t  = GroupNorm(x) W_in^T + b_in                       image tokens (B*HW, C), channels-last order
 *   t += SelfAttn(LN1(t)) W_o1^T + b_o1
 *   t += CrossAttn(LN2(t), K_txt, V_txt) W_o2^T + b_o2    (when the block has cross-attention)
 *   t += GELU(LN3(t) W_1^T + b_1) W_2^T + b_2
 *   y  = x + t W_out^T + b_out                            written channels-last
 *
 * (seed: Algorithm 2's pre-norm block, Def. 12 attention, the CrossAttn equation). At a diffusion model's latent
 * size a block is ~40 tensor ops on matrices of 32-128 rows, and run op by op through torch, dispatch costs about as
 * much as the arithmetic. Here the products go straight to the sgemm of the BLAS torch links (its address passed
 * in by the caller) and everything between them is a loop over a few thousand floats. Single-threaded apart from
 * what sgemm does itself. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vmath.h"

/* Fortran BLAS, LP64: column-major, every argument by address. */
typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

/* Weights as nn.Linear keeps them, (out, in) row-major; q/k/v of the self-attention stacked into one (3*I, C)
 * matrix. Any bias and any norm affine may be NULL; w_q2 NULL means no cross-attention. I = heads * head_dim. */
typedef struct {
    const float *gn_w, *gn_b, *w_in, *b_in;
    const float *ln1_w, *ln1_b, *w_qkv, *b_qkv, *w_o1, *b_o1;
    const float *ln2_w, *ln2_b, *w_q2, *b_q2, *w_o2, *b_o2;
    const float *ln3_w, *ln3_b, *w_1, *b_1, *w_2, *b_2;
    const float *w_out, *b_out;
    int64_t channels, groups, heads, head_dim, hidden;
    float gn_eps, ln1_eps, ln2_eps, ln3_eps, scale;
} BlockWeights;

/* x (B, C, H, W) stored NCHW (channels_last = 0) or NHWC; the text keys and values (B, ctx_len, I) as the
 * cross-attention's k/v projections answer them, heads side by side (unused without cross-attention); y (B, C, H, W) NHWC; work of spatial_transformer_work_f32() floats. */
typedef struct {
    const float *x, *k_txt, *v_txt;
    float *y, *work;
    int64_t batch, hw, ctx_len, channels_last;
} BlockInputs;

int group_norm_f32(const float *x, const float *gamma, const float *beta, float *y, int64_t b, int64_t c,
                   int64_t hw, int64_t groups, float eps, int channels_last, int silu);

int64_t spatial_transformer_work_f32(const BlockWeights *W, const BlockInputs *in) {
    const int64_t m = in->batch * in->hw, inner = W->heads * W->head_dim;
    const int64_t keys = in->hw > in->ctx_len ? in->hw : in->ctx_len;
    return m * (3 * W->channels + 4 * inner + W->hidden) + in->hw * keys;
}

/* y (rows, n; row stride ldy) = beta * y + x (rows, k; ldx) w^T, w (n, k) row-major: in column-major terms
 * y^T = w x^T, so w goes in transposed and x as is. */
static void gemm_rows(sgemm_fn gemm, const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t rows,
                      int64_t n, int64_t k, float beta) {
    const int m_ = (int)n, n_ = (int)rows, k_ = (int)k, lda = (int)k, ldb = (int)ldx, ldc = (int)ldy;
    const float one = 1.f;
    gemm("T", "N", &m_, &n_, &k_, &one, w, &lda, x, &ldb, &beta, y, &ldc);
}

/* y = x w^T + b, overwriting y */
static void linear(sgemm_fn gemm, const float *x, const float *w, const float *b, float *y, int64_t rows, int64_t n,
                   int64_t k) {
    if (b)
        for (int64_t r = 0; r < rows; r++) memcpy(y + r * n, b, (size_t)n * sizeof *y);
    gemm_rows(gemm, x, k, w, y, n, rows, n, k, b ? 1.f : 0.f);
}

/* y += x w^T + b (a residual branch) */
static void linear_add(sgemm_fn gemm, const float *x, const float *w, const float *b, float *y, int64_t rows,
                       int64_t n, int64_t k) {
    if (b)
        for (int64_t r = 0; r < rows; r++) {
            float *yr = y + r * n;
#pragma omp simd
            for (int64_t j = 0; j < n; j++) yr[j] += b[j];
        }
    gemm_rows(gemm, x, k, w, y, n, rows, n, k, 1.f);
}

/* LayerNorm over the last dimension (biased variance, two passes), with an optional affine map. */
static void layer_norm(const float *x, const float *w, const float *b, float eps, float *out, int64_t rows,
                       int64_t c) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * c;
        float *o = out + r * c, mean = 0.f, var = 0.f;
#pragma omp simd reduction(+ : mean)
        for (int64_t j = 0; j < c; j++) mean += xr[j];
        mean /= (float)c;
#pragma omp simd reduction(+ : var)
        for (int64_t j = 0; j < c; j++) var += (xr[j] - mean) * (xr[j] - mean);
        const float inv = 1.f / sqrtf(var / (float)c + eps);
#pragma omp simd
        for (int64_t j = 0; j < c; j++) o[j] = (xr[j] - mean) * inv * (w ? w[j] : 1.f) + (b ? b[j] : 0.f);
    }
}

/* o (nq, d; ldo) = softmax(scale q k^T) v for one head: q (nq, d; ldq), k and v (nk, d; ldk, ldv); s is (nq, nk)
 * scratch. */
static void attend(sgemm_fn gemm, const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v,
                   int64_t ldv, float *o, int64_t ldo, int64_t nq, int64_t nk, int64_t d, float scale, float *s) {
    const int nq_ = (int)nq, nk_ = (int)nk, d_ = (int)d, ldq_ = (int)ldq, ldk_ = (int)ldk, ldv_ = (int)ldv,
              ldo_ = (int)ldo;
    const float zero = 0.f, one = 1.f;
    gemm("T", "N", &nk_, &nq_, &d_, &scale, k, &ldk_, q, &ldq_, &zero, s, &nk_);  /* s = scale q k^T, (nq, nk) */
    for (int64_t i = 0; i < nq; i++) {
        float *row = s + i * nk, mx = row[0];
#pragma omp simd reduction(max : mx)
        for (int64_t j = 1; j < nk; j++) mx = row[j] > mx ? row[j] : mx;
        const float inv = 1.f / exp_shifted_sum(row, nk, mx);
#pragma omp simd
        for (int64_t j = 0; j < nk; j++) row[j] *= inv;
    }
    gemm("N", "N", &d_, &nq_, &nk_, &one, v, &ldv_, s, &nk_, &zero, o, &ldo_);  /* o = s v, (nq, d) */
}

/* 0, or -1 when the GroupNorm's groups do not divide C or its scratch cannot be allocated. */
int spatial_transformer_f32(const BlockWeights *W, const BlockInputs *in, sgemm_fn gemm) {
    const int64_t c = W->channels, hw = in->hw, m = in->batch * hw, d = W->head_dim, inner = W->heads * d;
    float *xt = in->work, *t = xt + m * c, *a = t + m * c, *qkv = a + m * c, *o = qkv + 3 * m * inner;
    float *f = o + m * inner, *s = f + m * W->hidden;
    const float *x = in->x;
    if (!in->channels_last) { /* tokens are channels-last rows: transpose once, the residual reads them too */
        for (int64_t n = 0; n < in->batch; n++)
            for (int64_t ch = 0; ch < c; ch++)
                for (int64_t p = 0; p < hw; p++) xt[(n * hw + p) * c + ch] = x[(n * c + ch) * hw + p];
        x = xt;
    }
    if (group_norm_f32(x, W->gn_w, W->gn_b, a, in->batch, c, hw, W->groups, W->gn_eps, 1, 0)) return -1;
    linear(gemm, a, W->w_in, W->b_in, t, m, c, c);

    layer_norm(t, W->ln1_w, W->ln1_b, W->ln1_eps, a, m, c);
    linear(gemm, a, W->w_qkv, W->b_qkv, qkv, m, 3 * inner, c);  /* (M, 3I): q | k | v per token */
    for (int64_t n = 0; n < in->batch; n++)
        for (int64_t h = 0; h < W->heads; h++) {
            const float *q = qkv + n * hw * 3 * inner + h * d;
            attend(gemm, q, 3 * inner, q + inner, 3 * inner, q + 2 * inner, 3 * inner, o + n * hw * inner + h * d,
                   inner, hw, hw, d, W->scale, s);
        }
    linear_add(gemm, o, W->w_o1, W->b_o1, t, m, c, inner);

    if (W->w_q2) {
        layer_norm(t, W->ln2_w, W->ln2_b, W->ln2_eps, a, m, c);
        linear(gemm, a, W->w_q2, W->b_q2, qkv, m, inner, c);  /* (M, I) queries */
        for (int64_t n = 0; n < in->batch; n++)
            for (int64_t h = 0; h < W->heads; h++) {
                const int64_t kv = n * in->ctx_len * inner + h * d;
                attend(gemm, qkv + n * hw * inner + h * d, inner, in->k_txt + kv, inner, in->v_txt + kv, inner,
                       o + n * hw * inner + h * d, inner, hw, in->ctx_len, d, W->scale, s);
            }
        linear_add(gemm, o, W->w_o2, W->b_o2, t, m, c, inner);
    }

    layer_norm(t, W->ln3_w, W->ln3_b, W->ln3_eps, a, m, c);
    linear(gemm, a, W->w_1, W->b_1, f, m, W->hidden, c);
#pragma omp simd
    for (int64_t i = 0; i < m * W->hidden; i++) f[i] = 0.5f * f[i] * (1.f + erf_poly(f[i] * 0.70710678f));
    linear_add(gemm, f, W->w_2, W->b_2, t, m, c, W->hidden);

    memcpy(in->y, x, (size_t)(m * c) * sizeof *in->y);
    linear_add(gemm, t, W->w_out, W->b_out, in->y, m, c, c);
    return 0;
}
