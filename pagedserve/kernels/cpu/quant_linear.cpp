// Matmuls that read GGUF-quantized weight blocks as they are stored (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K).
//
// The activation rows are quantized first, llama.cpp's q8 way: int8 per element, a float scale per
// 32 elements and the integer sums of every 16 (which carry the formats' offsets: Q4_0's -8,
// Q4_1's and Q4_K's minimum, Q6_K's -32). Then each 32-element sub-block of a weight row is one
// unsigned-by-signed int8 dot product (AVX-512 VNNI's dpbusd; AVX2's maddubs where there is no
// VNNI), scaled in float. A weight row's blocks are decoded into registers once per tile of
// activation rows and reused across the tile, so a decode batch reads the weights from memory once.
// Threads split the output columns (at::parallel_for); each writes its own columns only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

namespace pagedserve {
namespace {

// ggml_type ids, as GGUF stores them.
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

struct Format {
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
};

Format format_of(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "unsupported quantization type ", qtype, " (supported: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)");
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

// 8 int32 lanes, each the dot product of 4 unsigned bytes of `u` with 4 signed bytes of `s`.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else  // no overflow: |q| <= 128 (Q8_0's magnitude) and |qx| <= 127, two products per int16
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The activation rows quantized: int8 values, a scale per 32 and the sums of every 16.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> sum16;  // scale * the integer sum of each 16 values
  int64_t cols;
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t cols) {
  QuantizedRows out{std::vector<int8_t>(rows * cols), std::vector<float>(rows * cols / 32),
                    std::vector<float>(rows * cols / 16), cols};
  for (int64_t i = 0; i < rows * cols / 32; ++i) {
    const float* v = x + 32 * i;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(v[j]));
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    int32_t sums[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      const int q = static_cast<int>(std::nearbyint(v[j] * inv));
      out.q[32 * i + j] = static_cast<int8_t>(q);
      sums[j / 16] += q;
    }
    out.scale[i] = d;
    out.sum16[2 * i] = d * sums[0];
    out.sum16[2 * i + 1] = d * sums[1];
  }
  return out;
}

constexpr int64_t kTile = 8;  // activation rows per register tile

// out[m, col0 + n] = x[m] . w[n] for the weight rows [n0, n1).
template <int64_t T>
void matmul_rows(const QuantizedRows& x, int64_t rows, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                 float* out, int64_t out_stride, int64_t col0) {
  constexpr Format f = T == Q4_0 ? Format{32, 18} : T == Q4_1 ? Format{32, 20} : T == Q8_0 ? Format{32, 34}
                     : T == Q4_K ? Format{256, 144} : Format{256, 210};
  constexpr int subs = f.block / 32;
  const int64_t blocks = x.cols / f.block;
  for (int64_t m0 = 0; m0 < rows; m0 += kTile) {
    const int64_t tile = std::min(kTile, rows - m0);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      __m256 acc[kTile];
      float off[kTile];
      for (int64_t m = 0; m < tile; ++m) acc[m] = _mm256_setzero_ps(), off[m] = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        for (int s = 0; s < subs; ++s) {
          const SubBlock sb = decode<T>(row + b * f.bytes, s);
          const int64_t k32 = b * subs + s;  // the activation's 32-element block
          const __m256i u = sb.sign ? _mm256_abs_epi8(sb.q) : sb.q;
          const __m256 scale = _mm256_set_m128(_mm_set1_ps(sb.scale[1]), _mm_set1_ps(sb.scale[0]));
          for (int64_t m = 0; m < tile; ++m) {
            const int64_t r = m0 + m;
            __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + r * x.cols + 32 * k32));
            if (sb.sign) qx = _mm256_sign_epi8(qx, sb.q);
            const float dx = x.scale[r * x.cols / 32 + k32];
            const __m256 prod = _mm256_cvtepi32_ps(dot_u8s8(u, qx));
            if constexpr (T == Q6_K) acc[m] = _mm256_fmadd_ps(prod, _mm256_mul_ps(scale, _mm256_set1_ps(dx)), acc[m]);
            else acc[m] = _mm256_fmadd_ps(prod, _mm256_set1_ps(sb.scale[0] * dx), acc[m]);
            const float* sums = x.sum16.data() + r * x.cols / 16 + 2 * k32;
            if constexpr (T == Q6_K) off[m] += sb.offset[0] * sums[0] + sb.offset[1] * sums[1];
            else if constexpr (T != Q8_0) off[m] += sb.offset[0] * (sums[0] + sums[1]);
          }
        }
      }
      for (int64_t m = 0; m < tile; ++m) out[(m0 + m) * out_stride + col0 + n] = hsum8(acc[m]) + off[m];
    }
  }
}

void matmul_dispatch(int64_t qtype, const QuantizedRows& x, int64_t rows, const uint8_t* w, int64_t row_bytes,
                     int64_t n0, int64_t n1, float* out, int64_t out_stride, int64_t col0) {
  switch (qtype) {
    case Q4_0: return matmul_rows<Q4_0>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
    case Q4_1: return matmul_rows<Q4_1>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
    case Q8_0: return matmul_rows<Q8_0>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
    case Q4_K: return matmul_rows<Q4_K>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
    case Q6_K: return matmul_rows<Q6_K>(x, rows, w, row_bytes, n0, n1, out, out_stride, col0);
  }
  TORCH_CHECK(false, "unsupported quantization type ", qtype);
}

// Plain (scalar) dequantization of one block into `y`, the reference layout of ggml.
void dequantize_block(int64_t qtype, const uint8_t* b, float* y) {
  const Format f = format_of(qtype);
  if (qtype == Q8_0) {
    const float d = half_at(b);
    for (int j = 0; j < 32; ++j) y[j] = d * static_cast<int8_t>(b[2 + j]);
    return;
  }
  if (qtype == Q4_0 || qtype == Q4_1) {
    const float d = half_at(b), m = qtype == Q4_0 ? 0.f : half_at(b + 2);
    const uint8_t* qs = b + (qtype == Q4_0 ? 2 : 4);
    const int shift = qtype == Q4_0 ? 8 : 0;
    for (int j = 0; j < 16; ++j) {
      y[j] = d * ((qs[j] & 0xF) - shift) + m;
      y[j + 16] = d * ((qs[j] >> 4) - shift) + m;
    }
    return;
  }
  // K-quants: through the same decoding the matmul uses, so the two cannot drift apart.
  for (int s = 0; s < f.block / 32; ++s) {
    const SubBlock sb = qtype == Q4_K ? decode<Q4_K>(b, s) : decode<Q6_K>(b, s);
    uint8_t q[32];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), sb.q);
    for (int j = 0; j < 32; ++j) y[32 * s + j] = sb.scale[j / 16] * q[j] + sb.offset[j / 16];
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
// N_i rows of K elements as `qtypes[i]` blocks.
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& weights, const std::vector<int64_t>& qtypes) {
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
  const QuantizedRows qx = quantize_rows(xf.data_ptr<float>(), rows, cols);
  float* dst = out.data_ptr<float>();
  // Columns split into chunks across all parts; a chunk never spans two parts.
  constexpr int64_t kChunk = 16;
  std::vector<std::pair<size_t, int64_t>> chunks;
  for (size_t i = 0; i < weights.size(); ++i)
    for (int64_t n = 0; n < weights[i].size(0); n += kChunk) chunks.emplace_back(i, n);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const auto [i, n0] = chunks[c];
      const at::Tensor& w = weights[i];
      const int64_t n1 = std::min(n0 + kChunk, w.size(0));
      matmul_dispatch(qtypes[i], qx, rows, w.data_ptr<uint8_t>(), w.size(1), n0, n1, dst, total, starts[i]);
    }
  });
  return out;
}

// The rows of `w` (uint8 [N, bytes] of `qtype` blocks) as float32 [N, cols].
at::Tensor dequantize_rows(const at::Tensor& w, int64_t qtype, int64_t cols) {
  check_weight(w, qtype, cols);
  const Format f = format_of(qtype);
  auto out = at::empty({w.size(0), cols}, w.options().dtype(at::kFloat));
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const int64_t blocks = w.size(0) * (cols / f.block);
  at::parallel_for(0, blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) dequantize_block(qtype, src + b * f.bytes, dst + b * f.block);
  });
  return out;
}

}  // namespace pagedserve
