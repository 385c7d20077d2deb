// Matmuls on GGUF weights repacked once at load into 16-row interleaved tiles (Q4_0, Q4_1, Q8_0), the layout llama.cpp's ggml-cpu/repack.cpp uses for its
// q4_0_8x8 / q8_0_16x1 kernels, here with one AVX-512 vector per 16 output rows:
//
//   weight rows grouped by 16 (the last group padded with zero rows: a zero scale makes them 0);
//   group g, 32-element block b is one tile at byte (g * blocks + b) * 16 * block_bytes:
//     Q4_0/Q4_1: 4 vectors of 64 bytes; vector j, 32-bit lane r (row 16g + r), byte c holds element
//                4j + c in its low nibble and element 16 + 4j + c in its high nibble; then the 16
//                rows' float16 scales d, then (Q4_1) their 16 float16 minimums m.
//     Q8_0:      8 vectors of 64 bytes; vector j, lane r, byte c: element 4j + c plus 128 (unsigned,
//                for vpdpbusd), then the 16 float16 scales.
//   A tile holds exactly the bytes of the 16 rows' original blocks: repacking costs no memory.
//
// A call: the activation rows are rounded to int8 per 32 (as in quant_linear.cpp, with the
// `precise` second rounding), then per tile one vpdpbusd per 4 elements gives all 16 rows' integer
// dot products in one int32 vector (the activation's 4 bytes broadcast), scaled by d * dx and
// offset by m * sum(x) (Q4_0: -8 d sum(x); Q8_0: -128 d dx isum(qx)) in float, 16 rows at a time:
// no horizontal sums, no per-row decoding. Activation rows go 8 at a time (register tiles of 8 x 16)
// while a group's tiles stay in L1, so any row count reads the weights once: at 64 rows this ran
// ~2x faster than dequantizing to bfloat16 for oneDNN (no AMX here). Threads take contiguous runs
// of groups (all parts of a merged weight in one range), each writing only its own output columns.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "parallel_grain.h"
#include "work_pool.h"

namespace pagedserve {
namespace {

enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
constexpr int kRows = 16;  // rows per group: one zmm of int32 / float lanes
constexpr int64_t kPrefetchTiles = 16;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
  }
  TORCH_CHECK(false, "no repacked kernel for quantization type ", qtype, " (repacked: Q4_0, Q4_1, Q8_0)");
}

// Element e (0..31) of row r's block at `b` <-> its place in the tile `t` (original layouts:
// Q4_0 = half d, 16 bytes of nibbles (low: elements 0..15, high: 16..31); Q4_1 = half d, half m,
// nibbles; Q8_0 = half d, 32 int8).
inline void pack_block(int64_t qtype, const uint8_t* b, uint8_t* t, int r) {
  const int quants = qtype == Q8_0 ? 8 * 64 : 4 * 64;
  std::memcpy(t + quants + 2 * r, b, 2);  // d
  if (qtype == Q4_1) std::memcpy(t + quants + 32 + 2 * r, b + 2, 2);  // m
  if (qtype == Q8_0) {
    for (int e = 0; e < 32; ++e) t[64 * (e / 4) + 4 * r + e % 4] = static_cast<uint8_t>(b[2 + e] ^ 0x80);  // +128
  } else {
    const uint8_t* qs = b + (qtype == Q4_0 ? 2 : 4);
    for (int e = 0; e < 16; ++e) t[64 * (e / 4) + 4 * r + e % 4] = qs[e];  // e and 16 + e share a byte
  }
}

inline void unpack_block(int64_t qtype, const uint8_t* t, uint8_t* b, int r) {
  const int quants = qtype == Q8_0 ? 8 * 64 : 4 * 64;
  std::memcpy(b, t + quants + 2 * r, 2);
  if (qtype == Q4_1) std::memcpy(b + 2, t + quants + 32 + 2 * r, 2);
  if (qtype == Q8_0) {
    for (int e = 0; e < 32; ++e) b[2 + e] = t[64 * (e / 4) + 4 * r + e % 4] ^ 0x80;
  } else {
    uint8_t* qs = b + (qtype == Q4_0 ? 2 : 4);
    for (int e = 0; e < 16; ++e) qs[e] = t[64 * (e / 4) + 4 * r + e % 4];
  }
}

// The activation rows rounded to int8 per 32 values: q (and q2, the rounding error in steps of
// 1/256, when precise), the float scale per block (scale / 256 when precise), the exact float
// sum per block and the integer sum of the rounded values (256 * sum(q) + sum(q2) when precise).
struct Out {  // the output rows: float32, or bfloat16 (the model's dtype: no conversion after)
  void* p;
  bool bf16;
  int64_t row0;  // the first activation / output row of this call of up to 8
};

struct Activation {
  std::vector<int8_t> q, q2;
  std::vector<float> scale, sum;
  std::vector<int32_t> isum;
};

template <typename scalar_t>
void quantize_activation(const scalar_t* x, int64_t n, bool precise, Activation& a) {
  a.q.resize(n), a.q2.resize(precise ? n : 0), a.scale.resize(n / 32), a.sum.resize(n / 32), a.isum.resize(n / 32);
  for (int64_t i = 0; i < n / 32; ++i) {
    float v[32];
    for (int j = 0; j < 32; ++j) v[j] = static_cast<float>(x[32 * i + j]);
    int8_t* q = a.q.data() + 32 * i;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(v[j])), sum += v[j];
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int32_t isum = 0;
    for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv)), isum += q[j];
    a.scale[i] = d;
    if (precise) {  // |rest| <= d / 2: within [-128, 128] steps of d / 256
      int8_t* q2 = a.q2.data() + 32 * i;
      const float inv2 = d > 0.f ? 256.f / d : 0.f;
      int32_t isum2 = 0;
      for (int j = 0; j < 32; ++j) {
        q2[j] = static_cast<int8_t>(std::clamp(std::nearbyint((v[j] - d * q[j]) * inv2), -127.f, 127.f));
        isum2 += q2[j];
      }
      isum = 256 * isum + isum2;
      a.scale[i] = d / 256.f;
    }
    a.sum[i] = sum;
    a.isum[i] = isum;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDSERVE_REPACKED_KERNEL 1
inline __m512i bcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The integer dot products of one tile's 16 rows with activation block (q [, q2]) at `xq`.
template <int64_t T, bool P>
inline __m512i tile_dot(const __m512i* w, const int8_t* xq, const int8_t* xq2) {
  constexpr int V = T == Q8_0 ? 8 : 4;  // weight vectors per tile (Q4: each holds two sets of 4 elements)
  // two chains per rounding (latency: a chain of 8 dependent vpdpbusd would be 40 cycles)
  __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
  __m512i b0 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
  if constexpr (T == Q8_0) {
#pragma GCC unroll 8
    for (int j = 0; j < V; j += 2) {
      a0 = _mm512_dpbusd_epi32(a0, w[j], bcast(xq + 4 * j));
      a1 = _mm512_dpbusd_epi32(a1, w[j + 1], bcast(xq + 4 * j + 4));
      if constexpr (P) {
        b0 = _mm512_dpbusd_epi32(b0, w[j], bcast(xq2 + 4 * j));
        b1 = _mm512_dpbusd_epi32(b1, w[j + 1], bcast(xq2 + 4 * j + 4));
      }
    }
  } else {  // w[0..3]: low nibbles (elements 0..15), w[4..7]: high nibbles (16..31)
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) {
      a0 = _mm512_dpbusd_epi32(a0, w[j], bcast(xq + 4 * j));
      a1 = _mm512_dpbusd_epi32(a1, w[V + j], bcast(xq + 16 + 4 * j));
      if constexpr (P) {
        b0 = _mm512_dpbusd_epi32(b0, w[j], bcast(xq2 + 4 * j));
        b1 = _mm512_dpbusd_epi32(b1, w[V + j], bcast(xq2 + 16 + 4 * j));
      }
    }
  }
  __m512i dot = _mm512_add_epi32(a0, a1);
  if constexpr (P) dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), _mm512_add_epi32(b0, b1));  // exact: < 2^31
  return dot;
}

// out[i, col0 + 16 g + r] for M activation rows and the `valid` rows of one group.
template <int64_t T, int M, bool P>
void group_rows(const uint8_t* tiles, int64_t blocks, const Activation& a, int64_t cols, Out out,
                int64_t out_stride, int64_t col0, int valid) {
  constexpr int64_t tile = kRows * (T == Q4_0 ? 18 : T == Q4_1 ? 20 : 34);
  constexpr int quants = T == Q8_0 ? 8 * 64 : 4 * 64;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[M], acc2[M];  // two accumulators per row (even and odd blocks): shorter fma chains
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps(), acc2[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* t = tiles + b * tile;
    // Software prefetch: the hardware's stream prefetcher alone left a 66 MiB model's layers at
    // ~7 GB/s; 16 tiles ahead (5 KiB of Q4_1) ran them at ~11 (the next group's tiles follow).
#pragma GCC unroll 16
    for (int64_t l = 0; l < tile; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(t + kPrefetchTiles * tile + l), _MM_HINT_T0);
    __m512i w[8];
    if constexpr (T == Q8_0) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(t + 64 * j);
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(t + 64 * j);
        w[j] = _mm512_and_si512(v, low4);
        w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + quants)));
    __m512 m;
    if constexpr (T == Q4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + quants + 32)));
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const int64_t k = (out.row0 + i) * (cols / 32) + b;  // the activation's block
      const int8_t* xq = a.q.data() + 32 * k;
      const int8_t* xq2 = P ? a.q2.data() + 32 * k : nullptr;
      __m512i dot = tile_dot<T, P>(w, xq, xq2);
      if constexpr (T == Q8_0) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * a.isum[k]));
      __m512& c = (b & 1) ? acc2[i] : acc[i];
      c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a.scale[k])), c);
      if constexpr (T == Q4_1) c = _mm512_fmadd_ps(m, _mm512_set1_ps(a.sum[k]), c);
      if constexpr (T == Q4_0) c = _mm512_fmadd_ps(d, _mm512_set1_ps(-8.f * a.sum[k]), c);
    }
  }
  const __mmask16 mask = valid >= kRows ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    const __m512 v = _mm512_add_ps(acc[i], acc2[i]);
    if (out.bf16) {  // rounded to nearest even, as c10's conversion
#ifdef __AVX512BF16__
      const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
      const __m512i bits = _mm512_castps_si512(v);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m256i h = _mm512_cvtepi32_epi16(
          _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
#endif
      _mm256_mask_storeu_epi16(static_cast<c10::BFloat16*>(out.p) + (out.row0 + i) * out_stride + col0, mask, h);
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(out.p) + (out.row0 + i) * out_stride + col0, mask, v);
    }
  }
}

template <int64_t T, bool P>
void group_dispatch(int64_t m, const uint8_t* tiles, int64_t blocks, const Activation& a, int64_t cols, Out out,
                    int64_t out_stride, int64_t col0, int valid) {
  switch (m) {
    case 1: return group_rows<T, 1, P>(tiles, blocks, a, cols, out, out_stride, col0, valid);
    case 2: return group_rows<T, 2, P>(tiles, blocks, a, cols, out, out_stride, col0, valid);
    case 3: return group_rows<T, 3, P>(tiles, blocks, a, cols, out, out_stride, col0, valid);
    case 4: return group_rows<T, 4, P>(tiles, blocks, a, cols, out, out_stride, col0, valid);
    case 5: return group_rows<T, 5, P>(tiles, blocks, a, cols, out, out_stride, col0, valid);
    case 6: return group_rows<T, 6, P>(tiles, blocks, a, cols, out, out_stride, col0, valid);
    case 7: return group_rows<T, 7, P>(tiles, blocks, a, cols, out, out_stride, col0, valid);
    case 8: return group_rows<T, 8, P>(tiles, blocks, a, cols, out, out_stride, col0, valid);
  }
  TORCH_CHECK(false, "the repacked kernel takes 1..8 rows, got ", m);
}

void run_group(int64_t qtype, bool precise, int64_t m, const uint8_t* tiles, int64_t blocks, const Activation& a,
               int64_t cols, Out out, int64_t out_stride, int64_t col0, int valid) {
#define PAGEDSERVE_REPACK_CASE(T)                                                                         \
  case T: return precise ? group_dispatch<T, true>(m, tiles, blocks, a, cols, out, out_stride, col0, valid) \
                         : group_dispatch<T, false>(m, tiles, blocks, a, cols, out, out_stride, col0, valid);
  switch (qtype) {
    PAGEDSERVE_REPACK_CASE(Q4_0)
    PAGEDSERVE_REPACK_CASE(Q4_1)
    PAGEDSERVE_REPACK_CASE(Q8_0)
  }
#undef PAGEDSERVE_REPACK_CASE
  TORCH_CHECK(false, "no repacked kernel for quantization type ", qtype);
}

#endif  // AVX-512 VNNI

void check_packed(const at::Tensor& p, int64_t qtype, int64_t rows, int64_t cols) {
  TORCH_CHECK(p.scalar_type() == at::kByte && p.dim() == 2 && p.is_contiguous(), "repacked weight: contiguous uint8");
  TORCH_CHECK(cols % 32 == 0 && p.size(0) == (rows + kRows - 1) / kRows &&
                  p.size(1) == cols / 32 * kRows * block_bytes(qtype),
              "a repacked weight of ", p.size(0), " x ", p.size(1), " bytes does not hold ", rows, " rows of ", cols,
              " elements of type ", qtype);
}

}  // namespace

// GGUF blocks uint8 [N, K / 32 * bytes] -> the tiles [ceil(N / 16), K / 32 * 16 * bytes].
at::Tensor repack_rows(const at::Tensor& w, int64_t qtype) {
  const int64_t bytes = block_bytes(qtype);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) % bytes == 0,
              "weight blocks: contiguous uint8 [N, bytes]");
  const int64_t rows = w.size(0), blocks = w.size(1) / bytes, groups = (rows + kRows - 1) / kRows;
  auto out = at::zeros({groups, blocks * kRows * bytes}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int r = 0; r < kRows && g * kRows + r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b)
          pack_block(qtype, src + (g * kRows + r) * w.size(1) + b * bytes, dst + (g * blocks + b) * kRows * bytes, r);
  });
  return out;
}

// The same, in the blocks' own storage (N a multiple of 16: group g's tiles take the bytes its 16
// rows took), through a 16-row buffer per group: no second copy of the weight, even for a moment.
void repack_rows_(at::Tensor& w, int64_t qtype) {
  const int64_t bytes = block_bytes(qtype);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) % bytes == 0 &&
                  w.size(0) % kRows == 0, "weight blocks: contiguous uint8 [N, bytes], N a multiple of 16");
  const int64_t row_bytes = w.size(1), blocks = row_bytes / bytes;
  uint8_t* data = w.data_ptr<uint8_t>();
  at::parallel_for(0, w.size(0) / kRows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> rows(kRows * row_bytes);
    for (int64_t g = begin; g < end; ++g) {
      uint8_t* group = data + g * kRows * row_bytes;
      std::memcpy(rows.data(), group, rows.size());
      for (int r = 0; r < kRows; ++r)
        for (int64_t b = 0; b < blocks; ++b)
          pack_block(qtype, rows.data() + r * row_bytes + b * bytes, group + b * kRows * bytes, r);
    }
  });
}

// The original blocks of rows `ids` (int64) of a repacked weight: uint8 [len(ids), K / 32 * bytes].
at::Tensor unpack_rows(const at::Tensor& packed, int64_t qtype, int64_t cols, const at::Tensor& ids) {
  const int64_t bytes = block_bytes(qtype), blocks = cols / 32;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) == blocks * kRows * bytes, "repacked weight: contiguous uint8 of ", cols, " columns");
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t n = idx.numel(), limit = packed.size(0) * kRows;
  auto out = at::empty({n, blocks * bytes}, packed.options());
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < limit, "row ", id[i], " out of range");
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = id[i] / kRows;
      const int r = static_cast<int>(id[i] % kRows);
      for (int64_t b = 0; b < blocks; ++b)
        unpack_block(qtype, src + (g * blocks + b) * kRows * bytes, dst + i * blocks * bytes + b * bytes, r);
    }
  });
  return out;
}

// x [M, K] (float or bfloat16) @ concat(weights).T -> float32 (bf16_out: bfloat16)
// [M, sum rows_i]; packed[i] holds rows[i] weight rows repacked from `qtypes[i]` blocks.
at::Tensor repacked_linear(const at::Tensor& x, const std::vector<at::Tensor>& packed, const std::vector<int64_t>& qtypes,
                           const std::vector<int64_t>& rows, bool precise, bool bf16_out) {
  TORCH_CHECK(x.dim() == 2 && packed.size() == qtypes.size() && packed.size() == rows.size() && !packed.empty(),
              "x: [M, K]; one qtype and row count per weight");
  const int64_t m = x.size(0), cols = x.size(1);
#ifndef PAGEDSERVE_REPACKED_KERNEL
  TORCH_CHECK(false, "the repacked kernel needs AVX-512 VNNI (check repacked_kernel_available() first)");
  return at::Tensor();
#else
  std::vector<int64_t> starts, group_starts;  // output column / global group of each part
  int64_t total = 0, groups = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    check_packed(packed[i], qtypes[i], rows[i], cols);
    starts.push_back(total), group_starts.push_back(groups);
    total += rows[i], groups += packed[i].size(0);
  }
  auto out = at::empty({m, total}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (m == 0 || total == 0) return out;
  const at::Tensor xc = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  thread_local Activation reused;  // no allocation per call once warm
  Activation& act = reused;  // the workers must read this thread's instance, not their own
  if (xc.scalar_type() == at::kBFloat16) quantize_activation(xc.data_ptr<c10::BFloat16>(), m * cols, precise, act);
  else quantize_activation(xc.data_ptr<float>(), m * cols, precise, act);
  const Out dst{out.data_ptr(), bf16_out, 0};
  // Runs of groups across all parts, claimed from the kernels' pool (work_pool.h). A group is kRows x
  // cols x m multiply-adds; below 16 rows its time is unpacking and reading its tiles, so it counts
  // as 16 rows' worth (as lane_linear does): a one-row decode then splits every matrix of the
  // default model across two threads (its four shapes x 30 layers: 4.6-6.0 -> 3.7-4.4 ms a token,
  // docs/performance.md), where the one-row count kept all but the LM head on one thread.
  pool_for(groups, grain_for(kRows * cols * std::max<int64_t>(m, 16), 4), [&](int64_t begin, int64_t end) {
    size_t part = 0;
    for (int64_t g = begin; g < end; ++g) {
      while (g >= group_starts[part] + packed[part].size(0)) ++part;
      const int64_t local = g - group_starts[part];
      const int64_t blocks = cols / 32;
      const uint8_t* tiles = packed[part].data_ptr<uint8_t>() + local * packed[part].size(1);
      const int valid = static_cast<int>(std::min<int64_t>(kRows, rows[part] - local * kRows));
      for (int64_t r0 = 0; r0 < m; r0 += 8)  // 8 rows at a time while the group's tiles stay in L1
        run_group(qtypes[part], precise, std::min<int64_t>(8, m - r0), tiles, blocks, act, cols,
                  Out{dst.p, dst.bf16, r0}, total, starts[part] + local * kRows, valid);
    }
  });
  return out;
#endif
}

bool repacked_kernel_available() {
#ifdef PAGEDSERVE_REPACKED_KERNEL
  return true;
#else
  return false;
#endif
}

}  // namespace pagedserve
