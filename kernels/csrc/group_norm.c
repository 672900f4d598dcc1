/* GroupNorm (seed Def. 6) with its per-channel affine map, optionally followed by SiLU, in one call:
 *
 *   y = act((x - mean_g) / sqrt(var_g + eps) * gamma_c + beta_c),   act = SiLU or the identity,
 *
 * mean_g and var_g (biased) taken per sample over the H*W positions of the channels of group g. The residual blocks
 * of a diffusion U-Net normalise activations of a few thousand elements each, where torch's op costs several times
 * its arithmetic in dispatch, and twice more on channels-last input (what oneDNN convolutions answer with). x is
 * (B, C, H, W) fp32 stored NCHW (channels_last = 0) or NHWC (channels_last = 1); y is written in x's layout. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vmath.h"

static inline float act(float v, int silu) { return silu ? v / (1.f + exp_poly(-v)) : v; }

/* Per (sample, channel) sums of x, or of (x - mean)^2 when mean is given, for NCHW: each channel a contiguous plane. */
static void plane_sums(const float *x, const float *mean, float *out, int64_t nc_all, int64_t hw) {
    for (int64_t nc = 0; nc < nc_all; nc++) {
        const float *xp = x + nc * hw, m = mean ? mean[nc] : 0.f;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t p = 0; p < hw; p++) acc += (xp[p] - m) * (mean ? xp[p] - m : 1.f);
        out[nc] = acc;
    }
}

/* The same for NHWC: positions are rows of C contiguous channels, accumulated channel-wise. */
static void row_sums(const float *x, const float *mean, float *out, int64_t b, int64_t c, int64_t hw) {
    for (int64_t nc = 0; nc < b * c; nc++) out[nc] = 0.f;
    for (int64_t n = 0; n < b; n++)
        for (int64_t p = 0; p < hw; p++) {
            const float *xr = x + (n * hw + p) * c, *m = mean ? mean + n * c : NULL;
            float *o = out + n * c;
#pragma omp simd
            for (int64_t ch = 0; ch < c; ch++) o[ch] += m ? (xr[ch] - m[ch]) * (xr[ch] - m[ch]) : xr[ch];
        }
}

/* Per-channel sums -> every channel gets its group's total divided by count. */
static void group_means(const float *sums, float *out, int64_t nc_all, int64_t cg, float count) {
    for (int64_t first = 0; first < nc_all; first += cg) {
        float acc = 0.f;
        for (int64_t j = 0; j < cg; j++) acc += sums[first + j];
        for (int64_t j = 0; j < cg; j++) out[first + j] = acc / count;
    }
}

/* 0, or -1 when C is not a multiple of groups or the scratch cannot be allocated. gamma/beta may be NULL (no
 * affine map). Single-threaded: at the sizes it serves (a few thousand to a few tens of thousands of elements) a
 * second thread costs more in synchronisation than it saves. */
int group_norm_f32(const float *x, const float *gamma, const float *beta, float *y, int64_t b, int64_t c,
                   int64_t hw, int64_t groups, float eps, int channels_last, int silu) {
    if (groups < 1 || c % groups) return -1;
    const int64_t cg = c / groups, nc_all = b * c;
    const float count = (float)(cg * hw);
    /* per (sample, channel): partial sums, its group's mean, then the scale and shift that fold in the norm */
    float *part = malloc((size_t)(4 * nc_all) * sizeof *part);
    if (!part) return -1;
    float *mean = part + nc_all, *scale = mean + nc_all, *shift = scale + nc_all;
    /* two passes, not E[x^2] - E[x]^2, which cancels badly for activations far from zero mean */
    if (channels_last) row_sums(x, NULL, part, b, c, hw); else plane_sums(x, NULL, part, nc_all, hw);
    group_means(part, mean, nc_all, cg, count);
    if (channels_last) row_sums(x, mean, part, b, c, hw); else plane_sums(x, mean, part, nc_all, hw);
    group_means(part, scale, nc_all, cg, count);  /* the group variance, for now */
    for (int64_t nc = 0; nc < nc_all; nc++) {
        const int64_t ch = nc % c;
        scale[nc] = (gamma ? gamma[ch] : 1.f) / sqrtf(scale[nc] + eps);
        shift[nc] = (beta ? beta[ch] : 0.f) - mean[nc] * scale[nc];
    }
    if (channels_last) {
        for (int64_t row = 0; row < b * hw; row++) {
            const float *xr = x + row * c, *sc = scale + (row / hw) * c, *sh = shift + (row / hw) * c;
            float *yr = y + row * c;
#pragma omp simd
            for (int64_t ch = 0; ch < c; ch++) yr[ch] = act(xr[ch] * sc[ch] + sh[ch], silu);
        }
    } else {
        for (int64_t nc = 0; nc < nc_all; nc++) {
            const float *xp = x + nc * hw, sc = scale[nc], sh = shift[nc];
            float *yp = y + nc * hw;
#pragma omp simd
            for (int64_t p = 0; p < hw; p++) yp[p] = act(xp[p] * sc + sh, silu);
        }
    }
    free(part);
    return 0;
}
