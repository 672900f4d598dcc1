/* Element loads shared by the kernels that take fp32 or bf16 tensors: bf16 arrives as raw bits and is widened to
 * fp32 in registers (its top 16 bits), so a bf16 weight or cache streams half the bytes of an fp32 one. */
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

#endif
