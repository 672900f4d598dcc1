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

/* Eight floats as one GCC/Clang vector (AVX on x86-64-v3 and later, two SSE registers on a portable build, NEON
 * pairs on arm64), and the same lanes as int32. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* for an unaligned load or store */

static inline v8 splat8(float f) { return (v8){f, f, f, f, f, f, f, f}; }
static inline v8 load8(const float *p) { return *(const v8u *)p; }

/* exp_poly on 8 lanes, written with vector operations: GCC 12 leaves an `omp simd` loop of exp_poly scalar ("control
 * flow in loop": its clamps). n is rounded by adding and taking away 1.5 * 2^23, exact for |n| < 2^22. */
static inline v8 exp8(v8 x) {
    const v8i low = x < splat8(-87.f), high = x > splat8(88.f);
    x = (v8)(((v8i)x & ~(low | high)) | ((v8i)splat8(-87.f) & low) | ((v8i)splat8(88.f) & high));
    const v8 n = (x * splat8(1.44269504f) + splat8(12582912.f)) - splat8(12582912.f);
    const v8 r = (x - n * splat8(0.693359375f)) + n * splat8(2.12194440e-4f);
    const v8 p = splat8(1.f) + r * (splat8(1.f) + r * (splat8(0.5f) + r * (splat8(1.f / 6) + r * (splat8(1.f / 24)
                 + r * (splat8(1.f / 120) + r * splat8(1.f / 720))))));
    return p * (v8)((__builtin_convertvector(n, v8i) + 127) << 23);
}

/* row[j] = exp(row[j] - mx) for j < n; their sum. */
static inline float exp_shifted_sum(float *row, int64_t n, float mx) {
    v8 acc = splat8(0.f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const v8 e = exp8(*(v8u *)(row + j) - splat8(mx));
        *(v8u *)(row + j) = e;
        acc += e;
    }
    float sum = 0.f;
    for (; j < n; j++) sum += row[j] = exp_poly(row[j] - mx);
    for (int l = 0; l < 8; l++) sum += acc[l];
    return sum;
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
