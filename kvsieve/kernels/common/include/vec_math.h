/* Vectorizable scalar helpers shared by the native CPU kernels (included, not compiled alone). */
#ifndef KVSIEVE_VEC_MATH_H
#define KVSIEVE_VEC_MATH_H
#include <stdint.h>

/* The head dim and query group the attending and page-ranking kernels take at most. */
#define KV_MAX_D 256
#define KV_MAX_G 16

static inline float bf16_to_f32(uint16_t v) {
  union { uint32_t u; float f; } x = {.u = (uint32_t)v << 16};
  return x.f;
}

/* fp32 -> bf16 rounded to nearest-even, as torch's conversion (a NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
  union { float f; uint32_t u; } x = {.f = f};
  if ((x.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x.u >> 16) | 0x40u); /* a quiet NaN */
  return (uint16_t)((x.u + 0x7FFFu + ((x.u >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0: Cephes expf (Cody-Waite reduction, degree-6 polynomial, ~1 ulp), branch-free so
 * the loop calling it vectorizes; 2^n is applied in two halves so results down to the denormals hold. */
static inline float exp_nonpositive(float x) {
  x = x < -104.0f ? -104.0f : x;
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest, |.| < 2^22 */
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
             + 1.6666665459e-1f) * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;
  union { int32_t i; float f; } s1 = {.i = (n1 + 127) << 23}, s2 = {.i = (n2 + 127) << 23};
  return y * s1.f * s2.f;
}

/* exp_nonpositive on 8 lanes at once (the same operations per lane, so the same results), written with
 * vector types: GCC does not vectorize the scalar one's bit copy of 2^n inside a loop. */
typedef float vm_f32x8 __attribute__((vector_size(32)));
typedef int32_t vm_i32x8 __attribute__((vector_size(32)));
static inline vm_f32x8 exp8_nonpositive(vm_f32x8 x) {
  const vm_f32x8 lo = (vm_f32x8){0} - 104.0f;
  const vm_i32x8 below = x < lo; /* all ones where x < -104 */
  x = (vm_f32x8)((below & (vm_i32x8)lo) | (~below & (vm_i32x8)x));
  vm_f32x8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  vm_f32x8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vm_f32x8 y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
                + 1.6666665459e-1f) * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const vm_i32x8 ni = __builtin_convertvector(n, vm_i32x8), n1 = ni / 2, n2 = ni - n1;
  return y * (vm_f32x8)((n1 + 127) << 23) * (vm_f32x8)((n2 + 127) << 23);
}

/* The sum of the 8 lanes, lane 0 first. */
static inline float lane_sum(vm_f32x8 v) {
  float s = 0.0f;
  for (int j = 0; j < 8; ++j) s += v[j];
  return s;
}

#endif
