/* Element loads shared by the kernels that take fp32 or bf16 tensors: bf16 arrives as raw bits and is widened to
 * fp32 in registers (its top 16 bits), so a bf16 weight or cache streams half the bytes of an fp32 one; bf16_round
 * narrows a value written back into a bf16 cache. */
#ifndef GENSERVE_ELEMENT_H
#define GENSERVE_ELEMENT_H

#include <stdint.h>
#include <string.h>

static inline float f32_at(const float *p, int64_t c) { return p[c]; }

static inline float bf16_at(const uint16_t *p, int64_t c) {
    uint32_t u = (uint32_t)p[c] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16 bits, rounded to nearest-even as torch's .to(torch.bfloat16) rounds; a NaN stays a (quiet) NaN. */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
