// Small SIMD helpers shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <immintrin.h>

#include "parallel_grain.h"

namespace pagedserve {

// GCC vector extensions, without intrinsics: as wide as the CPU's widest float vector under
// -march=native (16 lanes with AVX-512, else 8). Every element-wise kernel here is bound by how
// many vector instructions it issues per element, so the width is its speed (2x on AVX-512).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(4 * kLanes)));
typedef int32_t vint __attribute__((vector_size(4 * kLanes)));
// Eight lanes whatever the CPU: the float side of the AVX2 int8 kernels (quant_linear.cpp).
typedef float vfloat8 __attribute__((vector_size(32)));

inline vfloat load_v(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_v(float* p, vfloat v) { __builtin_memcpy(p, &v, sizeof(v)); }

// kLanes elements of any dtype widened to float (bfloat16: a shift, as c10 does it, but whole
// vectors at once; a scalar conversion per element cost more than the arithmetic around it).
template <typename scalar_t>
inline vfloat load_f(const scalar_t* p) {
  vfloat v;
  for (int l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}
template <>
inline vfloat load_f<float>(const float* p) { return load_v(p); }
template <>
inline vfloat load_f<c10::BFloat16>(const c10::BFloat16* p) {
  typedef uint16_t vu16 __attribute__((vector_size(2 * kLanes)));
  typedef uint32_t vu32 __attribute__((vector_size(4 * kLanes)));
  vu16 h;
  __builtin_memcpy(&h, p, sizeof(h));
  const vu32 w = __builtin_convertvector(h, vu32) << 16;
  vfloat v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
}

// A float vector (any width) narrowed to scalar_t, rounding to nearest even as c10's conversions do.
template <typename scalar_t, typename V>
inline void store_f(scalar_t* p, V v) {
  for (int l = 0; l < static_cast<int>(sizeof(V) / 4); ++l) p[l] = static_cast<scalar_t>(v[l]);
}
template <typename V>
inline void store_f(float* p, V v) { __builtin_memcpy(p, &v, sizeof(v)); }
// (One body per width: GCC's __builtin_convertvector does not take a vector type that depends on
// a template parameter.)
#define PAGEDSERVE_STORE_BF16(V, N)                                        \
  inline void store_f(c10::BFloat16* p, V v) {                             \
    typedef uint32_t U __attribute__((vector_size(4 * (N))));              \
    typedef uint16_t H __attribute__((vector_size(2 * (N))));              \
    U b;                                                                   \
    __builtin_memcpy(&b, &v, sizeof(b));                                   \
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;                            \
    const U nan = (U)(v != v); /* c10 turns any NaN into 0x7FC0 */         \
    b = (b & ~nan) | (0x7FC0u & nan);                                      \
    const H h = __builtin_convertvector(b, H);                             \
    __builtin_memcpy(p, &h, sizeof(h));                                    \
  }
PAGEDSERVE_STORE_BF16(vfloat, kLanes)
#if defined(__AVX512F__)
PAGEDSERVE_STORE_BF16(vfloat8, 8)
#endif
#undef PAGEDSERVE_STORE_BF16

// v rounded to scalar_t's precision, kept in float: what storing it and loading it back gives,
// without the trip through memory.
template <typename scalar_t>
inline vfloat round_to(vfloat v) {
  scalar_t narrow[kLanes];
  store_f(narrow, v);
  return load_f(static_cast<const scalar_t*>(narrow));
}
template <>
inline vfloat round_to<float>(vfloat v) { return v; }
template <>
inline vfloat round_to<c10::BFloat16>(vfloat v) {
  typedef uint32_t U __attribute__((vector_size(4 * kLanes)));
  U b;
  __builtin_memcpy(&b, &v, sizeof(b));
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  const U nan = (U)(v != v);
  b = (b & ~nan) | (0x7FC00000u & nan);
  __builtin_memcpy(&v, &b, sizeof(v));
  return v;
}

// float rows are used in place; narrower types are widened into `buffer` once per row.
template <typename scalar_t>
inline const float* as_float(const scalar_t* src, float* buffer, int64_t n) {
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) store_v(buffer + d, load_f(src + d));
  for (; d < n; ++d) buffer[d] = static_cast<float>(src[d]);
  return buffer;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }
template <typename V>
inline float hsum(V v) {
#if defined(__AVX512F__)
  if constexpr (sizeof(V) == 64) return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#endif
  float s = 0.f;
  for (int l = 0; l < static_cast<int>(sizeof(V) / 4); ++l) s += v[l];
  return s;
}

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
// The largest of len scores, a vector at a time (std::max_element compares one by one: ~12% of the
// AVX-512 decode kernel's time with the cache in L2).
inline float max_of(const float* sc, int64_t len) {
  vfloat peak_v = vfloat{} - std::numeric_limits<float>::infinity();
  int64_t t = 0;
  for (; t + kLanes <= len; t += kLanes) {
    const vfloat v = load_v(sc + t);
    peak_v = v > peak_v ? v : peak_v;
  }
  float peak = peak_v[0];
  for (int l = 1; l < kLanes; ++l) peak = std::max(peak, peak_v[l]);
  for (; t < len; ++t) peak = std::max(peak, sc[t]);
  return peak;
}

inline void softmax_inplace(float* sc, int64_t len) {
  const float peak = max_of(sc, len);
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
