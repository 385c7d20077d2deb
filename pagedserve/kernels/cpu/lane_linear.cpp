// Matmuls on weights repacked once at load so that one 64-byte vector holds 16 output columns'
// weights for one step of K ("lanes"), for float32 and bfloat16 on AVX-512:
//
//   weight [N, K] -> packed [ceil(N / 16), U, 16] of 32-bit units, rows past N zero, where a unit
//   is one float (float32: U = K) or a pair of bfloat16 (U = K / 2, the pair vdpbf16ps multiplies):
//   group g, unit p is one vector whose lane r holds row 16g + r's unit p.
//
// One multiply-add instruction then adds one activation unit (broadcast) times 16 output
// columns' weights (vfmadd231ps, or vdpbf16ps for two products a lane), so nothing is reduced
// horizontally and nothing is converted (on a CPU without avx512_bf16, each bfloat16 weight pair is
// widened in registers and multiplied in float32): register tiles of 6 activation rows x 64 columns
// (24 float accumulators) per pass over K. On a 2-core AMD EPYC (avx512_bf16, no AMX) the bfloat16
// kernel beat oneDNN's at every row count of the default model's layers (2.1x at 1 row, 1.3-1.6x
// at 8-64, 1.02x at 512; docs/performance.md); the caller picks by row count where oneDNN has
// AMX.
//
// Threads take runs of column groups (multiples of 4, from the kernels' pool: work_pool.h), each
// writing only its own output columns; within a run, 4 groups at a time stay in L1/L2 while every
// row tile passes over them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "lane_linear.h"
#include "parallel_grain.h"
#include "work_pool.h"
#include "simd.h"

namespace pagedserve {

// Whether lane_linear was compiled for this dtype (float32: AVX-512, or AVX2 with FMA; bfloat16:
// AVX-512, with vdpbf16ps where the CPU has avx512_bf16, else by widening each bfloat16 to float32).
bool lane_linear_available(bool bfloat16) {
#if defined(__AVX512F__)
  return true;
#elif defined(__AVX2__) && defined(__FMA__)
  return !bfloat16;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
namespace {

constexpr int kCols = 16;      // output columns per group: one vector of float lanes
constexpr int kRowTile = 6;    // activation rows per register tile
constexpr int kGroupTile = 4;  // column groups per register tile

// out[0..MR) x [16 * NG columns) = x rows . packed groups over `units` 32-bit units of K;
// `last_valid`: the columns of the tile's last group that exist. X is the activations' type and O
// the output's: float/float (vfmadd231ps), bfloat16/bfloat16 (vdpbf16ps: avx512_bf16), or
// float/bfloat16 on a CPU without avx512_bf16: bfloat16 weights, activations already widened to
// float32, each weight pair widened in registers (a shift and a mask) and multiplied in float32.
template <typename X, typename O, int MR, int NG>
inline void tile(const X* x, int64_t ldx, const uint32_t* w, int64_t group_stride, int64_t units, O* out,
                 int64_t ldo, __mmask16 last_valid) {
  constexpr bool widen = std::is_same_v<X, float> && !std::is_same_v<O, float>;
  constexpr int per_unit = widen ? 2 : 4 / static_cast<int>(sizeof(X));  // elements of x per unit
  __m512 acc[MR][NG];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < units; ++p) {
    if constexpr (widen) {
      for (int j = 0; j < NG; ++j) {
        const __m512i b = _mm512_loadu_si512(w + j * group_stride + p * kCols);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
        for (int i = 0; i < MR; ++i) {
          const float* a = x + i * ldx + per_unit * p;
          acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(a[0]), even, acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(a[1]), odd, acc[i][j]);
        }
      }
      continue;
    }
    __m512i b[NG];
    for (int j = 0; j < NG; ++j) b[j] = _mm512_loadu_si512(w + j * group_stride + p * kCols);
    for (int i = 0; i < MR; ++i) {
      int32_t unit;
      std::memcpy(&unit, x + i * ldx + per_unit * p, sizeof(unit));
      const __m512i a = _mm512_set1_epi32(unit);
      for (int j = 0; j < NG; ++j) {
        if constexpr (std::is_same_v<X, float>) {
          acc[i][j] = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b[j]), acc[i][j]);
        } else {
#if defined(__AVX512BF16__)
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)a, (__m512bh)b[j]);
#endif
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) {
      const __mmask16 valid = j == NG - 1 ? last_valid : __mmask16(0xFFFF);
      O* dst = out + i * ldo + j * kCols;
      if constexpr (std::is_same_v<O, float>) {
        _mm512_mask_storeu_ps(dst, valid, acc[i][j]);
      } else {
#if defined(__AVX512BF16__)
        _mm256_mask_storeu_epi16(dst, valid, (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
#else
        // No vcvtneps2bf16 on this CPU: rounded as in our other kernels (simd.h), then masked.
        alignas(32) c10::BFloat16 narrow[kCols];
        store_f(narrow, (vfloat)acc[i][j]);
        _mm256_mask_storeu_epi16(dst, valid, _mm256_load_si256(reinterpret_cast<const __m256i*>(narrow)));
#endif
      }
    }
}

template <typename X, typename O, int NG>
inline void rows_of(int64_t m, const X* x, int64_t ldx, const uint32_t* w, int64_t group_stride, int64_t units,
                    O* out, int64_t ldo, __mmask16 last_valid) {
  int64_t r = 0;
  for (; r + kRowTile <= m; r += kRowTile)
    tile<X, O, kRowTile, NG>(x + r * ldx, ldx, w, group_stride, units, out + r * ldo, ldo, last_valid);
  switch (m - r) {
    case 1: tile<X, O, 1, NG>(x + r * ldx, ldx, w, group_stride, units, out + r * ldo, ldo, last_valid); break;
    case 2: tile<X, O, 2, NG>(x + r * ldx, ldx, w, group_stride, units, out + r * ldo, ldo, last_valid); break;
    case 3: tile<X, O, 3, NG>(x + r * ldx, ldx, w, group_stride, units, out + r * ldo, ldo, last_valid); break;
    case 4: tile<X, O, 4, NG>(x + r * ldx, ldx, w, group_stride, units, out + r * ldo, ldo, last_valid); break;
    case 5: tile<X, O, 5, NG>(x + r * ldx, ldx, w, group_stride, units, out + r * ldo, ldo, last_valid); break;
    default: break;
  }
}

template <typename X, typename O>
void run(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor& out) {
  const int64_t m = x.size(0), groups = packed.size(0), units = packed.size(1);
  const X* xd = x.data_ptr<X>();
  const auto* wd = static_cast<const uint32_t*>(packed.data_ptr());
  O* od = out.data_ptr<O>();
  const int64_t ldx = x.stride(0), group_stride = units * kCols;
  const int tail = static_cast<int>(n - kCols * (groups - 1));
  const __mmask16 tail_mask = static_cast<__mmask16>((1u << tail) - 1);
  // A group's work: m rows x 16 columns x K multiply-adds; below 16 rows its time is reading the
  // group's weights (~1 us per 18 KB on one core here), counted as 16 rows' worth, so one matrix
  // of a one-row decode splits across threads only from ~13 groups of 576 columns on.
  pool_for(groups, grain_for(std::max<int64_t>(m, 16) * kCols * units * 4), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g += kGroupTile) {
      const int ng = static_cast<int>(std::min<int64_t>(kGroupTile, end - g));
      const __mmask16 valid = g + ng == groups ? tail_mask : __mmask16(0xFFFF);
      const uint32_t* w = wd + g * group_stride;
      O* o = od + g * kCols;
      switch (ng) {
        case 4: rows_of<X, O, 4>(m, xd, ldx, w, group_stride, units, o, n, valid); break;
        case 3: rows_of<X, O, 3>(m, xd, ldx, w, group_stride, units, o, n, valid); break;
        case 2: rows_of<X, O, 2>(m, xd, ldx, w, group_stride, units, o, n, valid); break;
        default: rows_of<X, O, 1>(m, xd, ldx, w, group_stride, units, o, n, valid);
      }
    }
  }, kGroupTile);
}

}  // namespace
#elif defined(__AVX2__) && defined(__FMA__)
// float32 on AVX2 (no AVX-512): the same packed layout, each 16-column group's unit read as two
// 8-lane halves. 16 vector registers hold a tile of MR rows x NG groups (2 * MR * NG accumulators,
// at most 12) and the group's two weight halves. A full tile is 6 rows of one group (12 multiply-
// adds per 2 weight loads and 6 broadcasts); short row counts take 2 groups at once so that a
// 1-row decode still has 4 independent accumulator chains per pass over K.
namespace {

constexpr int kCols = 16;
constexpr int kRowTile = 6;
constexpr int kGroupTile = 2;

template <int MR, int NG>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t group_stride, int64_t units, float* out,
                 int64_t ldo, int last_valid) {
  __m256 acc[MR][NG][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < units; ++p) {
    __m256 b[NG][2];
    for (int j = 0; j < NG; ++j) {
      b[j][0] = _mm256_loadu_ps(w + j * group_stride + p * kCols);
      b[j][1] = _mm256_loadu_ps(w + j * group_stride + p * kCols + 8);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + p);
      for (int j = 0; j < NG; ++j) {
        acc[i][j][0] = _mm256_fmadd_ps(a, b[j][0], acc[i][j][0]);
        acc[i][j][1] = _mm256_fmadd_ps(a, b[j][1], acc[i][j][1]);
      }
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(last_valid), lane);
  const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(last_valid - 8), lane);
  // Unrolled whole, or GCC keeps `acc` indexable in memory and stores every accumulator to the
  // stack on each pass over K (half the speed: the loop became store-bound).
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NG; ++j) {
      float* dst = out + i * ldo + j * kCols;
      if (j < NG - 1 || last_valid == kCols) {
        _mm256_storeu_ps(dst, acc[i][j][0]);
        _mm256_storeu_ps(dst + 8, acc[i][j][1]);
      } else {
        _mm256_maskstore_ps(dst, lo, acc[i][j][0]);
        _mm256_maskstore_ps(dst + 8, hi, acc[i][j][1]);
      }
    }
}

// m rows against NG (1 or 2) adjacent groups; `last_valid`: the columns of the last group that exist.
template <int NG>
inline void rows_of(int64_t m, const float* x, int64_t ldx, const float* w, int64_t group_stride, int64_t units,
                    float* out, int64_t ldo, int last_valid) {
  int64_t r = 0;
  for (; r + kRowTile <= m; r += kRowTile)
    for (int j = 0; j < NG; ++j)
      tile<kRowTile, 1>(x + r * ldx, ldx, w + j * group_stride, group_stride, units, out + r * ldo + j * kCols, ldo,
                        j == NG - 1 ? last_valid : kCols);
  const float* xr = x + r * ldx;
  float* o = out + r * ldo;
  switch (m - r) {
    case 1: tile<1, NG>(xr, ldx, w, group_stride, units, o, ldo, last_valid); break;
    case 2: tile<2, NG>(xr, ldx, w, group_stride, units, o, ldo, last_valid); break;
    case 3: tile<3, NG>(xr, ldx, w, group_stride, units, o, ldo, last_valid); break;
    case 4:
    case 5:
      for (int j = 0; j < NG; ++j) {
        const int valid = j == NG - 1 ? last_valid : kCols;
        if (m - r == 4) tile<4, 1>(xr, ldx, w + j * group_stride, group_stride, units, o + j * kCols, ldo, valid);
        else tile<5, 1>(xr, ldx, w + j * group_stride, group_stride, units, o + j * kCols, ldo, valid);
      }
      break;
    default: break;
  }
}

void run_avx2(const at::Tensor& x, const at::Tensor& packed, int64_t n, at::Tensor& out) {
  const int64_t m = x.size(0), groups = packed.size(0), units = packed.size(1);
  const float* xd = x.data_ptr<float>();
  const auto* wd = static_cast<const float*>(packed.data_ptr());
  float* od = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), group_stride = units * kCols;
  const int tail = static_cast<int>(n - kCols * (groups - 1));
  // The grain as on AVX-512 (see run() there).
  pool_for(groups, grain_for(std::max<int64_t>(m, 16) * kCols * units * 4), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g += kGroupTile) {
      const int ng = static_cast<int>(std::min<int64_t>(kGroupTile, end - g));
      const int valid = g + ng == groups ? tail : kCols;
      if (ng == 2) rows_of<2>(m, xd, ldx, wd + g * group_stride, group_stride, units, od + g * kCols, n, valid);
      else rows_of<1>(m, xd, ldx, wd + g * group_stride, group_stride, units, od + g * kCols, n, valid);
    }
  }, kGroupTile);
}

}  // namespace
#endif

void lane_group_float(int64_t m, const float* x, int64_t ldx, const float* group, int64_t k, float* out, int64_t ldo,
                      int valid) {
  TORCH_CHECK(lane_linear_available(false), "lane_group_float needs AVX-512, or AVX2 with FMA");
#if defined(__AVX512F__)
  rows_of<float, float, 1>(m, x, ldx, reinterpret_cast<const uint32_t*>(group), k * kCols, k, out, ldo,
                    static_cast<__mmask16>((1u << valid) - 1));
#elif defined(__AVX2__) && defined(__FMA__)
  rows_of<1>(m, x, ldx, group, k * kCols, k, out, ldo, valid);
#endif
}

// weight [N, K] float32 or bfloat16 (K even) -> [ceil(N / 16), units, 16] int32 holding the
// layout above (the bits of floats or of bfloat16 pairs).
at::Tensor pack_lane_weight(const at::Tensor& weight) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (bf16 || weight.scalar_type() == at::kFloat), "weight: float32 or bfloat16 [N, K]");
  TORCH_CHECK(!bf16 || weight.size(1) % 2 == 0, "weight: K must be even for bfloat16, got ", weight.size(1));
  const int64_t n = weight.size(0), units = bf16 ? weight.size(1) / 2 : weight.size(1), groups = (n + 15) / 16;
  const auto w = weight.contiguous();
  auto packed = at::zeros({groups, units, 16}, weight.options().dtype(at::kInt));
  const auto* src = static_cast<const uint32_t*>(w.data_ptr());
  auto* dst = static_cast<uint32_t*>(packed.data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t r = 0; r < 16 && 16 * g + r < n; ++r)
        for (int64_t p = 0; p < units; ++p) dst[(g * units + p) * 16 + r] = src[(16 * g + r) * units + p];
  });
  return packed;
}

// x [M, K] @ weight.T -> [M, N] in x's dtype (float32 accumulation), weight given as
// pack_lane_weight(weight) of the same dtype with N rows.
at::Tensor lane_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(lane_linear_available(bf16), "lane_linear for ", x.scalar_type(), " needs ",
              bf16 ? "AVX-512" : "AVX-512 or AVX2 with FMA");
  TORCH_CHECK(x.dim() == 2 && (bf16 || x.scalar_type() == at::kFloat) && x.stride(1) == 1,
              "x: float32 or bfloat16 [M, K], unit column stride");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.size(2) == 16,
              "packed: the output of pack_lane_weight");
  const int64_t k = packed.size(1) * (bf16 ? 2 : 1);
  TORCH_CHECK(k == x.size(1), "x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(n > 0 && (n + 15) / 16 == packed.size(0), "n = ", n, " does not match the packed groups");
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if (bf16) run<c10::BFloat16, c10::BFloat16>(x, packed, n, out);
#else
  // Widened once here (M x K, small beside the weights), so that the tiles broadcast floats.
  if (bf16) run<float, c10::BFloat16>(x.to(at::kFloat), packed, n, out);
#endif
  else run<float, float>(x, packed, n, out);
#elif defined(__AVX2__) && defined(__FMA__)
  run_avx2(x, packed, n, out);
#endif
  return out;
}

}  // namespace pagedserve
