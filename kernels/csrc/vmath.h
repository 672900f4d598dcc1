/* Elementwise maths written so that `omp simd` loops vectorise without -ffast-math (which would change the FPU
 * mode of the whole process): libm's expf and erff are scalar calls. */
#ifndef GENSERVE_VMATH_H
#define GENSERVE_VMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) as 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p a degree-6 Taylor polynomial (relative error < 2e-7). */
static inline float exp_poly(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = rintf(x * 1.44269504f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    const float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* erf(x) by Abramowitz & Stegun 7.1.26: 1 - t (a1 + t (a2 + ...)) exp(-x^2), t = 1 / (1 + p|x|), odd in x
 * (absolute error < 1.5e-7). */
static inline float erf_poly(float x) {
    const float ax = fabsf(x), t = 1.f / (1.f + 0.3275911f * ax);
    const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f
                       + t * 1.061405429f))));
    return copysignf(1.f - poly * exp_poly(-ax * ax), x);
}

#endif
