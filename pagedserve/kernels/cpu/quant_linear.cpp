// Matmuls that read GGUF-quantized weight blocks as they are stored (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).
//
// The activation rows are quantized first, llama.cpp's q8 way: int8 per element, a float scale per
// 32 elements and the integer sums of every 16 (which carry the formats' offsets: Q4_0's -8,
// Q4_1's and Q4_K's minimum, Q6_K's -32). Then each 32-element sub-block of a weight row is one
// unsigned-by-signed int8 dot product (AVX-512 VNNI's dpbusd; AVX2's maddubs where there is no
// VNNI), scaled in float. A weight row's blocks are decoded into registers once per tile of
// activation rows and reused across the tile, so a decode batch reads the weights from memory once.
// Threads split the output columns (pool_for, work_pool.h); each writes its own columns only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "quant_blocks.h"
#include "simd.h"
#include "work_pool.h"

namespace pagedserve {
namespace {

// ggml_type ids, as GGUF stores them.
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

struct Format {
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
};

Format format_of(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "unsupported quantization type ", qtype, " (supported: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)");
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; c10's conversion is a dozen integer ops
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// One 32-element sub-block of a weight row: its elements as unsigned bytes, in the activation's
// element order, and how to turn the integer dot product into the float one:
//   sum(w * x) = dx * (scale[half] * dot(q, qx)[half] + offset[half] * sum(qx)[half]) over halves
// of 16 elements (Q6_K scales every 16; the others use one value for both halves). Q8_0's weights
// are signed: `sign` says the activation takes their signs and q holds their magnitudes.
struct SubBlock {
  __m256i q;
  float scale[2];
  float offset[2];
  bool sign = false;
};

inline __m256i nibbles_lo(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i nibbles_hi(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }

// The `s`-th 32-element sub-block of the block at `b` (s < block / 32).
template <int64_t T>
inline SubBlock decode(const uint8_t* b, int s) {
  SubBlock out;
  if constexpr (T == Q4_0 || T == Q4_1) {
    const float d = half_at(b);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (T == Q4_0 ? 2 : 4)));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);  // low nibbles: 0..15
    out.q = nibbles_lo(both);
    out.scale[0] = out.scale[1] = d;
    out.offset[0] = out.offset[1] = T == Q4_0 ? -8.f * d : half_at(b + 2);
  } else if constexpr (T == Q5_0) {  // half d, qh[4] (bit e: the 5th bit of element e), qs[16]; d * (q - 16)
    const float d = half_at(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
    const __m256i low = nibbles_lo(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i high = _mm256_and_si256(_mm256_movm_epi8(qh), _mm256_set1_epi8(0x10));
#else
    alignas(32) uint8_t bits[32];
    for (int e = 0; e < 32; ++e) bits[e] = ((qh >> e) & 1u) << 4;
    const __m256i high = _mm256_load_si256(reinterpret_cast<const __m256i*>(bits));
#endif
    out.q = _mm256_or_si256(low, high);
    out.scale[0] = out.scale[1] = d;
    out.offset[0] = out.offset[1] = -16.f * d;
  } else if constexpr (T == Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    out.q = q;  // the caller takes abs() and moves the signs onto the activation
    out.scale[0] = out.scale[1] = half_at(b);
    out.offset[0] = out.offset[1] = 0.f;
    out.sign = true;
  } else if constexpr (T == Q4_K) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* sc = b + 4;
    int scale, min;
    if (s < 4) {
      scale = sc[s] & 63;
      min = sc[s + 4] & 63;
    } else {
      scale = (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4);
      min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (s / 2)));
    out.q = (s & 1) ? nibbles_hi(packed) : nibbles_lo(packed);
    out.scale[0] = out.scale[1] = d * scale;
    out.offset[0] = out.offset[1] = -dmin * min;
  } else {  // Q6_K: ql[128], qh[64], int8 scales[16], half d; 128-element halves of 4 sub-blocks
    const int half = s / 4, t = s % 4;
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * t;
    const float d = half_at(b + 208);
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * (t & 1)));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    const __m256i bits = _mm256_and_si256(_mm256_srli_epi16(high, 2 * t), _mm256_set1_epi8(3));
    out.q = _mm256_or_si256(t < 2 ? nibbles_lo(low) : nibbles_hi(low), _mm256_slli_epi16(bits, 4));
    out.scale[0] = d * sc[0];
    out.scale[1] = d * sc[1];
    out.offset[0] = -32.f * out.scale[0];
    out.offset[1] = -32.f * out.scale[1];
  }
  return out;
}

// acc + 8 int32 lanes, each the dot product of 4 unsigned bytes of `u` with 4 signed bytes of `s`.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else  // no overflow: |q| <= 128 (Q8_0's magnitude) and |qx| <= 127, two products per int16
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The activation rows quantized: int8 values and a scale per 32 (amax / 127), and (precise) the
// rounding error in int8 steps of 1/256 of that scale: x = scale / 256 * (256 * q + q2) to within
// 1/512 of a step (~1/65,000 of the block's largest value); `scale` then holds scale / 256. Plus
// the exact float sums of every 16 values, for the formats' offsets.
struct QuantizedRows {
  std::vector<int8_t> q, q2;
  std::vector<float> scale;
  std::vector<float> sum16;
  int64_t cols;
};

inline float quantize_block(const float* v, int8_t* q) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(v[j]));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
  return d;
}

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t cols, bool precise) {
  const int64_t n = rows * cols;
  QuantizedRows out{std::vector<int8_t>(n), std::vector<int8_t>(precise ? n : 0), std::vector<float>(n / 32),
                    std::vector<float>(n / 16), cols};
  for (int64_t i = 0; i < n / 32; ++i) {
    const float* v = x + 32 * i;
    const float d = out.scale[i] = quantize_block(v, out.q.data() + 32 * i);
    float sums[2] = {0.f, 0.f};
    for (int j = 0; j < 32; ++j) sums[j / 16] += v[j];
    if (precise) {  // |rest| <= d / 2, so rest / (d / 256) is within [-128, 128]
      const float inv = d > 0.f ? 256.f / d : 0.f;
      for (int j = 0; j < 32; ++j) {
        const float rest = v[j] - d * out.q[32 * i + j];
        out.q2[32 * i + j] = static_cast<int8_t>(std::clamp(std::nearbyint(rest * inv), -127.f, 127.f));
      }
      out.scale[i] = d / 256.f;
    }
    out.sum16[2 * i] = sums[0];
    out.sum16[2 * i + 1] = sums[1];
  }
  return out;
}

template <int64_t T>
constexpr Format kFormat = T == Q4_0 ? Format{32, 18} : T == Q4_1 ? Format{32, 20} : T == Q5_0 ? Format{32, 22}
                         : T == Q8_0 ? Format{32, 34}
                         : T == Q4_K ? Format{256, 144} : Format{256, 210};

// out[m0 + i, col0 + n0 + j] for i < MR activation rows and j < NR weight rows: a register tile.
// Every weight sub-block is decoded once per tile and every activation block loaded once, and the
// MR x NR accumulators are independent chains (compile-time sizes keep them in registers).
template <int64_t T, int MR, int NR, bool P>
inline void tile(const QuantizedRows& x, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t n0,
                 float* out, int64_t out_stride, int64_t col0) {
  constexpr Format f = kFormat<T>;
  constexpr int subs = f.block / 32;
  const int64_t blocks = x.cols / f.block;
  __m256 acc[MR][NR];
  float off[MR][NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps(), off[i][j] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int s = 0; s < subs; ++s) {
      const int64_t k32 = b * subs + s;  // the activation's 32-element block
      SubBlock sb[NR];
      __m256i u[NR];
      __m256 scale[NR];
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        sb[j] = decode<T>(w + (n0 + j) * row_bytes + b * f.bytes, s);
        u[j] = T == Q8_0 ? _mm256_abs_epi8(sb[j].q) : sb[j].q;
        scale[j] = _mm256_set_m128(_mm_set1_ps(sb[j].scale[1]), _mm_set1_ps(sb[j].scale[0]));
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const int64_t r = m0 + i;
        const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + r * x.cols + 32 * k32));
        const float dx = x.scale[r * x.cols / 32 + k32];
        __m256i qx2;
        if constexpr (P) qx2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q2.data() + r * x.cols + 32 * k32));
        const float* sums = x.sum16.data() + r * x.cols / 16 + 2 * k32;
        const __m256 dxv = _mm256_set1_ps(dx);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
          const __m256i q = T == Q8_0 ? _mm256_sign_epi8(qx, sb[j].q) : qx;
          __m256i dot = dot_u8s8(_mm256_setzero_si256(), u[j], q);
          if constexpr (P) {  // the finer rounding: 256 * dot(q) + dot(q2), still exact in int32
            const __m256i q2 = T == Q8_0 ? _mm256_sign_epi8(qx2, sb[j].q) : qx2;
            dot = dot_u8s8(_mm256_slli_epi32(dot, 8), u[j], q2);
          }
          const __m256 prod = _mm256_cvtepi32_ps(dot);
          if constexpr (T == Q6_K) {
            acc[i][j] = _mm256_fmadd_ps(prod, _mm256_mul_ps(scale[j], dxv), acc[i][j]);
            off[i][j] += sb[j].offset[0] * sums[0] + sb[j].offset[1] * sums[1];
          } else {
            acc[i][j] = _mm256_fmadd_ps(prod, _mm256_set1_ps(sb[j].scale[0] * dx), acc[i][j]);
            if constexpr (T != Q8_0) off[i][j] += sb[j].offset[0] * (sums[0] + sums[1]);
          }
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) out[(m0 + i) * out_stride + col0 + n0 + j] = hsum8(acc[i][j]) + off[i][j];
}

// MR activation rows against the weight rows [n0, n1): NR at a time, then one by one.
template <int64_t T, int MR, int NR, bool P>
void tile_row(const QuantizedRows& x, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
              float* out, int64_t out_stride, int64_t col0) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<T, MR, NR, P>(x, m0, w, row_bytes, n, out, out_stride, col0);
  for (; n < n1; ++n) tile<T, MR, 1, P>(x, m0, w, row_bytes, n, out, out_stride, col0);
}

// out[m, col0 + n] = x[m] . w[n] for the weight rows [n0, n1): one activation row against 4
// weight rows (a decode step), or 4 activation rows against 2 (batches and prefill).
template <int64_t T, bool P>
void matmul_rows(const QuantizedRows& x, int64_t rows, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                 float* out, int64_t out_stride, int64_t col0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= rows; m0 += 4) tile_row<T, 4, 2, P>(x, m0, w, row_bytes, n0, n1, out, out_stride, col0);
  switch (rows - m0) {
    case 3: return tile_row<T, 3, 2, P>(x, m0, w, row_bytes, n0, n1, out, out_stride, col0);
    case 2: return tile_row<T, 2, 2, P>(x, m0, w, row_bytes, n0, n1, out, out_stride, col0);
    case 1: return tile_row<T, 1, 4, P>(x, m0, w, row_bytes, n0, n1, out, out_stride, col0);
  }
}

void matmul_dispatch(int64_t qtype, const QuantizedRows& x, int64_t rows, const uint8_t* w, int64_t row_bytes,
                     int64_t n0, int64_t n1, float* out, int64_t out_stride, int64_t col0) {
  switch (qtype) {
    case Q4_0: return x.q2.empty() ? matmul_rows<Q4_0, false>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0)
                              : matmul_rows<Q4_0, true>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
    case Q4_1: return x.q2.empty() ? matmul_rows<Q4_1, false>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0)
                              : matmul_rows<Q4_1, true>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
    case Q5_0: return x.q2.empty() ? matmul_rows<Q5_0, false>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0)
                              : matmul_rows<Q5_0, true>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
    case Q8_0: return x.q2.empty() ? matmul_rows<Q8_0, false>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0)
                              : matmul_rows<Q8_0, true>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
    case Q4_K: return x.q2.empty() ? matmul_rows<Q4_K, false>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0)
                              : matmul_rows<Q4_K, true>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
    case Q6_K: return x.q2.empty() ? matmul_rows<Q6_K, false>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0)
                              : matmul_rows<Q6_K, true>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
  }
  TORCH_CHECK(false, "unsupported quantization type ", qtype);
}

// One block dequantized into `y` (float or bfloat16), through the same decoding as the matmul.
template <int64_t T, typename scalar_t>
inline void dequantize_block(const uint8_t* b, scalar_t* y) {
  for (int s = 0; s < kFormat<T>.block / 32; ++s) {
    const SubBlock sb = decode<T>(b, s);
    for (int g = 0; g < 4; ++g) {  // 8 values at a time
      const auto* lanes = reinterpret_cast<const uint8_t*>(&sb.q) + 8 * g;
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(lanes));
      const __m256i ints = T == Q8_0 ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
      const __m256 q = _mm256_cvtepi32_ps(ints), scale = _mm256_set1_ps(sb.scale[g / 2]);
      const __m256 offset = _mm256_set1_ps(sb.offset[g / 2]);
      // rounded as ggml's reference rounds: d * (q - 8) once (one fma); d * q + m twice
      const __m256 v = T == Q4_1 || T == Q4_K ? _mm256_add_ps(_mm256_mul_ps(q, scale), offset)
                                              : _mm256_fmadd_ps(q, scale, offset);
      vfloat8 f;
      std::memcpy(&f, &v, sizeof(f));
      store_f(y + 32 * s + 8 * g, f);
    }
  }
}

template <typename scalar_t>
void dequantize_range(int64_t qtype, const uint8_t* src, scalar_t* dst, int64_t begin, int64_t end) {
  const Format f = format_of(qtype);
  for (int64_t b = begin; b < end; ++b) {
    const uint8_t* blk = src + b * f.bytes;
    scalar_t* y = dst + b * f.block;
    switch (qtype) {
      case Q4_0: dequantize_block<Q4_0>(blk, y); break;
      case Q4_1: dequantize_block<Q4_1>(blk, y); break;
      case Q5_0: dequantize_block<Q5_0>(blk, y); break;
      case Q8_0: dequantize_block<Q8_0>(blk, y); break;
      case Q4_K: dequantize_block<Q4_K>(blk, y); break;
      case Q6_K: dequantize_block<Q6_K>(blk, y); break;
    }
  }
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t cols) {
  const Format f = format_of(qtype);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "weight blocks: contiguous uint8 [N, bytes]");
  TORCH_CHECK(cols % f.block == 0 && w.size(1) == cols / f.block * f.bytes,
              "weight rows of ", w.size(1), " bytes do not hold ", cols, " elements of type ", qtype);
}

}  // namespace

// x [M, K] (float or bfloat16) @ concat(weights).T -> float32 [M, sum N_i]; weights[i] holds
// N_i rows of K elements as `qtypes[i]` blocks. precise: the activation in two int8 roundings
// (twice the integer work; the error of the one rounding flips ~3% of a small model's top-1 tokens).
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& qtypes,
                        bool precise) {
  TORCH_CHECK(x.dim() == 2 && weights.size() == qtypes.size() && !weights.empty(), "x: [M, K]; one qtype per weight");
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(cols % 32 == 0, "the input width ", cols, " is not a multiple of 32");
  int64_t total = 0;
  std::vector<int64_t> starts;
  for (size_t i = 0; i < weights.size(); ++i) {
    check_weight(weights[i], qtypes[i], cols);
    starts.push_back(total);
    total += weights[i].size(0);
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({rows, total}, x.options().dtype(at::kFloat));
  if (rows == 0 || total == 0) return out;
  const QuantizedRows qx = quantize_rows(xf.data_ptr<float>(), rows, cols, precise);
  float* dst = out.data_ptr<float>();
  // Columns split into chunks across all parts; a chunk never spans two parts.
  constexpr int64_t kChunk = 16;
  std::vector<std::pair<size_t, int64_t>> chunks;
  for (size_t i = 0; i < weights.size(); ++i)
    for (int64_t n = 0; n < weights[i].size(0); n += kChunk) chunks.emplace_back(i, n);
  // A chunk: kChunk x rows x cols multiply-adds, counted as 16 rows below that (its blocks' unpacking
  // and reading, not the rows, take its time there; quant_repack.cpp's grain does the same).
  const int64_t grain = grain_for(kChunk * std::max<int64_t>(rows, 16) * cols);
  pool_for(static_cast<int64_t>(chunks.size()), grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const auto [i, n0] = chunks[c];
      const at::Tensor& w = weights[i];
      const int64_t n1 = std::min(n0 + kChunk, w.size(0));
      matmul_dispatch(qtypes[i], qx, rows, w.data_ptr<uint8_t>(), w.size(1), n0, n1, dst, total, starts[i]);
    }
  });
  return out;
}

void check_quant_weight(const at::Tensor& w, int64_t qtype, int64_t cols) { check_weight(w, qtype, cols); }

void dequantize_rows_float(int64_t qtype, const uint8_t* src, int64_t rows, int64_t cols, float* dst) {
  dequantize_range(qtype, src, dst, 0, rows * (cols / format_of(qtype).block));
}

// The rows of `w` (uint8 [N, bytes] of `qtype` blocks) as [N, cols] float32, or bfloat16.
at::Tensor dequantize_rows(const at::Tensor& w, int64_t qtype, int64_t cols, bool bfloat16) {
  check_weight(w, qtype, cols);
  const Format f = format_of(qtype);
  auto out = at::empty({w.size(0), cols}, w.options().dtype(bfloat16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* src = w.data_ptr<uint8_t>();
  const int64_t blocks = w.size(0) * (cols / f.block);
  pool_for(blocks, grain_for(2 * f.block, 256), [&](int64_t begin, int64_t end) {  // ~2 per element
    if (bfloat16) dequantize_range(qtype, src, out.data_ptr<c10::BFloat16>(), begin, end);
    else dequantize_range(qtype, src, out.data_ptr<float>(), begin, end);
  });
  return out;
}

}  // namespace pagedserve
