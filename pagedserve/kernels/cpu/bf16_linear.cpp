// bfloat16 matmuls at the row counts of a decode step (1 to ~64 rows), on weights repacked once at
// load into the pair-interleaved layout vdpbf16ps reads (avx512_bf16):
//
//   weight [N, K] -> packed [ceil(N / 16), K / 2, 16, 2]: group g, pair p is one 64-byte vector
//   whose 32-bit lane r holds (W[16g + r][2p], W[16g + r][2p + 1]); rows past N are zeros.
//
// One vdpbf16ps then adds the products of one activation pair (broadcast) with 16 output columns'
// weight pairs, so nothing is reduced horizontally and nothing is converted: register tiles of 6
// activation rows x 64 columns (24 float accumulators) per pass over K. oneDNN's small-row kernels
// ran at 40-50% of this CPU's bfloat16 rate at 20-50 rows and streamed weights at ~12 GB/s at 1
// row on a 2-core AMD EPYC (docs/performance.md); at larger row counts oneDNN's blocking wins, so
// the caller picks by row count.
//
// Threads take contiguous runs of column groups, each writing only its own output columns; within
// a run, 4 groups at a time stay in L1/L2 while every row tile passes over them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "parallel_grain.h"

namespace pagedserve {

bool bf16_linear_available() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

constexpr int kCols = 16;     // output columns per group: one vector of float lanes
constexpr int kRowTile = 6;   // activation rows per register tile
constexpr int kGroupTile = 4; // column groups per register tile

// out[0..MR) x [16 * NG columns) = x rows . packed groups; `valid` = the columns of the last group that exist.
template <int MR, int NG>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t group_stride, int64_t pairs,
                 c10::BFloat16* out, int64_t ldo, __mmask16 last_valid) {
  __m512 acc[MR][NG];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NG];
    for (int j = 0; j < NG; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * group_stride + p * 2 * kCols);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * p, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NG; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) {
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(acc[i][j]);
      auto* dst = reinterpret_cast<__m256i*>(out + i * ldo + j * kCols);
      if (j == NG - 1 && last_valid != 0xFFFF) _mm256_mask_storeu_epi16(dst, last_valid, v);
      else _mm256_storeu_si256(dst, v);
    }
}

template <int NG>
inline void rows_of(int64_t m, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t group_stride,
                    int64_t pairs, c10::BFloat16* out, int64_t ldo, __mmask16 last_valid) {
  int64_t r = 0;
  for (; r + kRowTile <= m; r += kRowTile)
    tile<kRowTile, NG>(x + r * ldx, ldx, w, group_stride, pairs, out + r * ldo, ldo, last_valid);
  switch (m - r) {
    case 1: tile<1, NG>(x + r * ldx, ldx, w, group_stride, pairs, out + r * ldo, ldo, last_valid); break;
    case 2: tile<2, NG>(x + r * ldx, ldx, w, group_stride, pairs, out + r * ldo, ldo, last_valid); break;
    case 3: tile<3, NG>(x + r * ldx, ldx, w, group_stride, pairs, out + r * ldo, ldo, last_valid); break;
    case 4: tile<4, NG>(x + r * ldx, ldx, w, group_stride, pairs, out + r * ldo, ldo, last_valid); break;
    case 5: tile<5, NG>(x + r * ldx, ldx, w, group_stride, pairs, out + r * ldo, ldo, last_valid); break;
    default: break;
  }
}

}  // namespace
#endif

// weight [N, K] bfloat16 (K even) -> [ceil(N / 16), K / 2, 16, 2] bfloat16, the layout above.
at::Tensor pack_bf16_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight: bfloat16 [N, K]");
  TORCH_CHECK(weight.size(1) % 2 == 0, "weight: K must be even, got ", weight.size(1));
  const int64_t n = weight.size(0), k = weight.size(1), groups = (n + 15) / 16;
  const auto w = weight.contiguous();
  auto packed = at::zeros({groups, k / 2, 16, 2}, weight.options());
  const auto* src = reinterpret_cast<const uint32_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t r = 0; r < 16 && 16 * g + r < n; ++r)
        for (int64_t p = 0; p < k / 2; ++p) dst[(g * (k / 2) + p) * 16 + r] = src[(16 * g + r) * (k / 2) + p];
  });
  return packed;
}

// x [M, K] bfloat16 @ weight.T -> [M, N] bfloat16, weight given as pack_bf16_weight(weight) with N rows.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(bf16_linear_available(), "bf16_linear needs avx512_bf16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x: bfloat16 [M, K], unit column stride");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "packed: the output of pack_bf16_weight");
  TORCH_CHECK(packed.size(1) * 2 == x.size(1), "x has ", x.size(1), " columns, the weight ", packed.size(1) * 2);
  TORCH_CHECK(n > 0 && (n + 15) / 16 == packed.size(0), "n = ", n, " does not match the packed groups");
  const int64_t m = x.size(0), pairs = packed.size(1), groups = packed.size(0);
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const auto* xd = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wd = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  auto* od = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), group_stride = pairs * 2 * kCols;
  const int tail = static_cast<int>(n - 16 * (groups - 1));
  const __mmask16 tail_mask = static_cast<__mmask16>((1u << tail) - 1);
  // A group's work: m rows x 16 columns x K multiply-adds; below 16 rows its time is reading the
  // group's weights (~1 us per 18 KB on one core here), counted as 16 rows' worth, so one matrix
  // of a one-row decode splits across threads only from ~13 groups of 576 columns on.
  at::parallel_for(0, groups, grain_for(std::max<int64_t>(m, 16) * 16 * pairs * 2 * 2), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g += kGroupTile) {
      const int ng = static_cast<int>(std::min<int64_t>(kGroupTile, end - g));
      const __mmask16 valid = g + ng == groups ? tail_mask : __mmask16(0xFFFF);
      const uint16_t* w = wd + g * group_stride;
      c10::BFloat16* o = od + g * kCols;
      switch (ng) {
        case 4: rows_of<4>(m, xd, ldx, w, group_stride, pairs, o, n, valid); break;
        case 3: rows_of<3>(m, xd, ldx, w, group_stride, pairs, o, n, valid); break;
        case 2: rows_of<2>(m, xd, ldx, w, group_stride, pairs, o, n, valid); break;
        default: rows_of<1>(m, xd, ldx, w, group_stride, pairs, o, n, valid);
      }
    }
  });
#endif
  return out;
}

}  // namespace pagedserve
