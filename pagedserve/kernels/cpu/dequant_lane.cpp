// float32 matmuls on GGUF blocks at row counts where arithmetic, not the weight bytes, bounds the
// step (prefill chunks, decode batches of more than a few sequences), on CPUs whose weights are not
// repacked for the int8 kernel (no AVX-512 VNNI, or formats it does not take: Q5_0, Q4_K, Q6_K).
//
// Each thread takes 16 weight rows at a time, dequantizes them into an L1/L2-resident buffer laid
// out as one lane group (pack_lane_weight's float32 layout), and runs the float32 lane kernel over
// every activation row against it. The weight is read from memory once per call, as its blocks, and
// the dequantization (16 x K values) is paid once per M x 16 x K multiply-adds. Before this, such
// calls dequantized the whole weight into a fresh float32 matrix and handed it to oneDNN, which
// re-blocked it: on a 2-core AMD EPYC (Zen 3, AVX2) 2x the time of this kernel at 51 rows
// (docs/performance.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "lane_linear.h"
#include "parallel_grain.h"
#include "quant_blocks.h"
#include "work_pool.h"

namespace pagedserve {

namespace {

// 8 rows x 8 floats (rows `stride` apart) -> 8 columns, column j stored at dst + j * dst_stride.
inline void transpose8(const float* src, int64_t stride, float* dst, int64_t dst_stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// 16 rows of k floats (row-major, k a multiple of 8) -> the lane layout: unit p holds the 16 rows'
// element p. In 8 x 8 tiles through registers: element by element, every store went to another
// cache line and the copy cost more than the dequantization.
inline void to_lanes(const float* rows, int64_t k, float* group) {
  for (int64_t p = 0; p < k; p += 8)
    for (int half = 0; half < 2; ++half) transpose8(rows + 8 * half * k + p, k, group + 16 * p + 8 * half, 16);
}

}  // namespace

// x float32 [M, K] (unit column stride) @ concat(weights).T -> float32 [M, sum N_i]; weights[i]
// holds N_i rows of K elements as `qtypes[i]` blocks. Exact float32 arithmetic on the dequantized
// values (no activation rounding, unlike quant_linear).
at::Tensor dequant_lane_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                               const std::vector<int64_t>& qtypes) {
  TORCH_CHECK(lane_linear_available(false), "dequant_lane_linear needs AVX-512, or AVX2 with FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x: float32 [M, K] with unit column stride");
  TORCH_CHECK(!weights.empty() && weights.size() == qtypes.size(), "one qtype per weight");
  const int64_t rows = x.size(0), cols = x.size(1);
  int64_t total = 0;
  std::vector<int64_t> starts;
  for (size_t i = 0; i < weights.size(); ++i) {
    check_quant_weight(weights[i], qtypes[i], cols);
    starts.push_back(total);
    total += weights[i].size(0);
  }
  auto out = at::empty({rows, total}, x.options());
  if (rows == 0 || total == 0) return out;
  constexpr int64_t kGroup = 16;  // weight rows per lane group
  std::vector<std::pair<size_t, int64_t>> chunks;  // (part, first row); a chunk never spans two parts
  for (size_t i = 0; i < weights.size(); ++i)
    for (int64_t n = 0; n < weights[i].size(0); n += kGroup) chunks.emplace_back(i, n);
  const float* xd = x.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  pool_for(static_cast<int64_t>(chunks.size()), grain_for(kGroup * rows * cols),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> plain(kGroup * cols), group(kGroup * cols, 0.f);
    for (int64_t c = begin; c < end; ++c) {
      const auto [i, n0] = chunks[c];
      const at::Tensor& w = weights[i];
      const int valid = static_cast<int>(std::min(kGroup, w.size(0) - n0));
      dequantize_rows_float(qtypes[i], w.data_ptr<uint8_t>() + n0 * w.size(1), valid, cols, plain.data());
      if (valid < kGroup)  // a short last group: rows past its end read as zero (never stored)
        std::fill(plain.begin() + valid * cols, plain.end(), 0.f);
      to_lanes(plain.data(), cols, group.data());
      lane_group_float(rows, xd, ldx, group.data(), cols, od + starts[i] + n0, total, valid);
    }
  });
  return out;
}

}  // namespace pagedserve
