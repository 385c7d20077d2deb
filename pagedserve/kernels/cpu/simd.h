// Small SIMD helpers shared by the CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pagedserve {

// float rows are used in place; narrower types are widened into `buffer` once per row.
template <typename scalar_t>
inline const float* as_float(const scalar_t* src, float* buffer, int64_t n) {
  for (int64_t d = 0; d < n; ++d) buffer[d] = static_cast<float>(src[d]);
  return buffer;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

// GCC vector extensions: AVX2 (or AVX-512) code under -march=native, without intrinsics.
typedef float vfloat __attribute__((vector_size(32)));
constexpr int kLanes = 8;

inline vfloat load_v(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline float hsum(vfloat v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

typedef int32_t vint __attribute__((vector_size(32)));

// exp for a vector of non-positive scores (Cephes' expf: range reduction by ln 2 and a degree-5
// polynomial, within 2 ulp). A scalar std::exp per score cost more than the whole K/V read.
inline vfloat exp_v(vfloat x) {
  const vfloat lo = vfloat{} - 87.3f;
  x = x < lo ? lo : x;
  vfloat fx = x * 1.44269504088896341f + 0.5f;
  vint n = __builtin_convertvector(fx, vint);
  n += (fx < __builtin_convertvector(n, vfloat));  // truncation toward zero -> floor (mask is -1)
  fx = __builtin_convertvector(n, vfloat);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  const vfloat z = x * x;
  vfloat y = 1.9875691500e-4f * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  vint bits = (n + 127) << 23;
  vfloat scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// Softmax of one head's scores in place (len may be any size; the tail is done lane by lane).
inline void softmax_inplace(float* sc, int64_t len) {
  const float peak = *std::max_element(sc, sc + len);
  vfloat total_v{};
  int64_t t = 0;
  for (; t + kLanes <= len; t += kLanes) {
    vfloat e = exp_v(load_v(sc + t) - peak);
    __builtin_memcpy(sc + t, &e, sizeof(e));
    total_v += e;
  }
  float total = hsum(total_v);
  for (; t < len; ++t) {
    sc[t] = std::exp(sc[t] - peak);
    total += sc[t];
  }
  const float inv = 1.f / total;
  for (int64_t i = 0; i < len; ++i) sc[i] *= inv;
}

}  // namespace pagedserve
