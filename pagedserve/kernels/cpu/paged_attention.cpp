// Paged attention for single-token queries (decode), reading K/V straight from the block pool.
//
// Plain torch needs a gather of every sequence's blocks plus a transpose before its matmuls: on
// a 2-core CPU that copying cost 6x the attention arithmetic. This reads each cached K/V row once.
// A layer's options: a sliding window (the decoded token sees its last `window` keys only: the
// loops start at the window's first, so released blocks before it are never read) and Gemma 2's
// soft-capping of the scaled scores (cap * tanh(score / cap), before the softmax).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "head_dims.h"
#include "simd.h"
#include "work_pool.h"

namespace pagedserve {

// The shapes, strides and data of one decode call, as both kernels below read them.
template <typename scalar_t>
struct DecodeLayout {
  int64_t num_seqs, num_heads, block_size, num_kv_heads, group, max_blocks, block_stride, token_stride, head_stride;
  const scalar_t* q;
  const scalar_t* kc;
  const scalar_t* vc;
  const int64_t* tables;
  const int64_t* lens;
  scalar_t* o;
};

template <typename scalar_t>
DecodeLayout<scalar_t> decode_layout(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out) {
  const int64_t num_heads = query.size(1), num_kv_heads = k_cache.size(2);
  return {query.size(0), num_heads, k_cache.size(1), num_kv_heads, num_heads / num_kv_heads, block_tables.size(1),
          k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), query.data_ptr<scalar_t>(),
          k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(),
          seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>()};
}

// The first cached position a decode of a sequence of len tokens attends to (0 without a window).
inline int64_t window_first(int64_t len, int64_t window) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }

// Scaled scores soft-capped in place: cap * tanh(s / cap) (nothing when cap is 0).
inline void cap_scores(float* s, int64_t n, float cap) {
  if (cap > 0.f)
    for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

// A sequence's work in parallel_grain.h's unit, on the batch's mean length: 2 x len x heads x D
// float multiply-adds, ~4 of the int8 kernels' each.
inline int64_t mean_seq_work(const int64_t* lens, int64_t num_seqs, int64_t heads_x_dim) {
  int64_t total_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total_len += lens[s];
  return 8 * heads_x_dim * total_len / std::max<int64_t>(1, num_seqs);
}

// The head dim is a compile-time constant so the inner loops unroll into whole SIMD vectors.
template <int D, typename scalar_t>
void decode_fixed(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
                  double scale, int64_t window, double softcap) {
  constexpr int NV = D / kLanes;
  const auto [num_seqs, num_heads, block_size, num_kv_heads, group, max_blocks, block_stride, token_stride,
              head_stride, q, kc, vc, tables, lens, o] =
      decode_layout<scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out);
  const float fscale = static_cast<float>(scale);

  // One sequence per work item, all its heads together: each cached token row (every kv head)
  // is read once, front to back.
  pool_for(num_seqs, grain_for(mean_seq_work(lens, num_seqs, num_heads * D)), [&](int64_t begin, int64_t end) {
    std::vector<vfloat> qv(num_heads * NV), acc(num_heads * NV);
    std::vector<float> scores, qrow(D), row(D);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t first = window_first(lens[seq], window), len = lens[seq] - first;
      const int64_t* table = tables + seq * max_blocks;
      scores.resize(num_heads * len);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* src = as_float(q + (seq * num_heads + h) * D, qrow.data(), D);
        for (int i = 0; i < NV; ++i) qv[h * NV + i] = load_v(src + i * kLanes) * fscale;
      }
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = first + t;
        const scalar_t* krows = kc + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
          const float* krow = as_float(krows + kvh * head_stride, row.data(), D);
          vfloat kv[NV];
          for (int i = 0; i < NV; ++i) kv[i] = load_v(krow + i * kLanes);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kvh * group + g;
            const vfloat* qh = qv.data() + h * NV;
            vfloat dot = qh[0] * kv[0];
            for (int i = 1; i < NV; ++i) dot += qh[i] * kv[i];
            scores[h * len + t] = hsum(dot);
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        cap_scores(scores.data() + h * len, len, static_cast<float>(softcap));
        softmax_inplace(scores.data() + h * len, len);
      }
      for (auto& a : acc) a = vfloat{};
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = first + t;
        const scalar_t* vrows = vc + table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
          const float* vrow = as_float(vrows + kvh * head_stride, row.data(), D);
          vfloat vv[NV];
          for (int i = 0; i < NV; ++i) vv[i] = load_v(vrow + i * kLanes);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kvh * group + g;
            const float p = scores[h * len + t];
            vfloat* a = acc.data() + h * NV;
            for (int i = 0; i < NV; ++i) a[i] += p * vv[i];
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* orow = o + (seq * num_heads + h) * D;
        for (int i = 0; i < NV; ++i) store_f(orow + i * kLanes, acc[h * NV + i]);
      }
    }
  });
}

#if defined(__AVX512F__)
// Lane i of the result is the sum of v[i]'s 16 lanes: sixteen horizontal sums in 45 instructions
// (a transpose folded into the adds) instead of 16 separate reductions.
inline __m512 sum16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane k of y[i]: lane k's partial sums of v[4i..4i+3]
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 elements of a cached row widened to float.
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One query head against one cached key row: a vector whose lanes sum to the dot product.
// bfloat16 with avx512_bf16: pairs of products straight from the stored halves (vdpbf16ps).
template <int D, typename scalar_t>
struct QueryRow {
  __m512 q[D / 16];
  void set(const scalar_t* src) {
    for (int i = 0; i < D / 16; ++i) q[i] = widen16(src + 16 * i);
  }
  __m512 dot(const scalar_t* k) const {
    __m512 acc = _mm512_mul_ps(q[0], widen16(k));
    for (int i = 1; i < D / 16; ++i) acc = _mm512_fmadd_ps(q[i], widen16(k + 16 * i), acc);
    return acc;
  }
};
#if defined(__AVX512BF16__)
template <int D>
  requires(D % 32 == 0)
struct QueryRow<D, c10::BFloat16> {
  __m512bh q[D / 32];
  void set(const c10::BFloat16* src) {
    for (int i = 0; i < D / 32; ++i) q[i] = (__m512bh)_mm512_loadu_si512(src + 32 * i);
  }
  __m512 dot(const c10::BFloat16* k) const {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k));
    for (int i = 1; i < D / 32; ++i) acc = _mm512_dpbf16_ps(acc, q[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
    return acc;
  }
};
#endif

// Query heads whose value accumulators fit in registers at once beside a row (16 of 32 zmm).
template <int NV>
constexpr int kValueHeads = std::max(1, std::min(4, 16 / NV));

// acc[g] += sum over tokens t in [t0, t1) of p[g * padded + t] * value row t, for G query heads of
// one kv head (vbase: the pool at that head), the accumulators held in registers over the tile.
template <int G, int NV, typename scalar_t>
inline void value_tile(const scalar_t* vbase, const int64_t* rows, int64_t t0, int64_t t1, const float* p,
                       int64_t padded, __m512* acc) {
  __m512 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = acc[g * NV + i];
  for (int64_t t = t0; t < t1; ++t) {
    const scalar_t* vrow = vbase + rows[t];
    __m512 vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = widen16(vrow + 16 * i);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * padded + t]);
      for (int i = 0; i < NV; ++i) a[g][i] = _mm512_fmadd_ps(pg, vv[i], a[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) acc[g * NV + i] = a[g][i];
}

// decode_fixed's contract with AVX-512 code: keys 16 at a time, each head's 16 scores from one
// sum16 (the per-key horizontal sum was most of the kernel), values widened once per row for
// every query head of their group. Threads over sequences as there.
template <int D, typename scalar_t>
void decode_avx512(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                   int64_t window, double softcap) {
  constexpr int NV = D / 16;
  const auto [num_seqs, num_heads, block_size, num_kv_heads, group, max_blocks, block_stride, token_stride,
              head_stride, q, kc, vc, tables, lens, o] =
      decode_layout<scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out);
  const __m512 vscale = _mm512_set1_ps(static_cast<float>(scale));

  pool_for(num_seqs, grain_for(mean_seq_work(lens, num_seqs, num_heads * D)), [&](int64_t begin, int64_t end) {
    std::vector<QueryRow<D, scalar_t>> qrows(num_heads);
    std::vector<float> scores;
    std::vector<__m512> acc(num_heads * NV);
    std::vector<int64_t> rows;  // each key's row in the pool (element offset, kv head 0)
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t first = window_first(lens[seq], window), len = lens[seq] - first;
      const int64_t padded = (len + 15) & ~int64_t{15};
      const int64_t* table = tables + seq * max_blocks;
      rows.resize(len);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = first + t;
        rows[t] = table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
      }
      scores.resize(num_heads * padded);
      for (int64_t h = 0; h < num_heads; ++h) qrows[h].set(q + (seq * num_heads + h) * D);
      // Token rows (every kv head) front to back: one sequential stream through each block.
      // Blocks lie anywhere in the pool, so the hardware prefetchers lose the stream at every block
      // edge and a core waits on DRAM: ask for key rows two tiles and value rows 16 tokens ahead
      // (into L2: L1's few miss buffers filled up and the prefetches themselves stalled). On a
      // 2-core AMD EPYC, 51 sequences x 30 layers from DRAM: 1.45x in bfloat16 and float32.
      const int64_t row_bytes = num_kv_heads * head_stride * static_cast<int64_t>(sizeof(scalar_t));
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
        for (int64_t t = t0 + 32; t < std::min(len, t0 + 48); ++t)  // key rows two tiles ahead
          for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(kc + rows[t]) + b, _MM_HINT_T1);
        for (int64_t h = 0; h < num_heads; ++h) {
          const int64_t koff = (h / group) * head_stride;
          __m512 dots[16];
          for (int j = 0; j < n; ++j) dots[j] = qrows[h].dot(kc + rows[t0 + j] + koff);
          for (int j = n; j < 16; ++j) dots[j] = _mm512_setzero_ps();
          _mm512_storeu_ps(scores.data() + h * padded + t0, _mm512_mul_ps(sum16(dots), vscale));
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        cap_scores(scores.data() + h * padded, len, static_cast<float>(softcap));
        softmax_inplace(scores.data() + h * padded, len);
      }
      for (auto& a : acc) a = _mm512_setzero_ps();
      // bfloat16 values a tile of 16 tokens at a time: the tile's rows stay in L1 while each group
      // of up to kValueHeads query heads runs over them with its accumulators in registers (token
      // by token, they were loaded and stored again for every head: 36 vector stores a token for
      // the default model). 30 layers of distinct caches on a 2-core Zen 4: 1.3x at 1 sequence,
      // 1.1x at 16, even at 51 (DRAM-bound there). float32's rows, twice as long, keep the token by
      // token loop: tiled they ran 0.9-0.95x from DRAM at 16-51 sequences (docs/performance.md).
      if constexpr (sizeof(scalar_t) == 2) {
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
          const int64_t t1 = std::min(len, t0 + 16);
          for (int64_t t = t0 + 16; t < std::min(len, t0 + 32); ++t)  // the next tile's value rows
            for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(vc + rows[t]) + b, _MM_HINT_T1);
          for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
            const scalar_t* vbase = vc + kvh * head_stride;
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h += kValueHeads<NV>) {
              const int64_t heads = std::min<int64_t>(kValueHeads<NV>, (kvh + 1) * group - h);
              const float* p = scores.data() + h * padded;
              __m512* a = acc.data() + h * NV;
              switch (heads) {
                case 1: value_tile<1, NV>(vbase, rows.data(), t0, t1, p, padded, a); break;
                case 2: if constexpr (kValueHeads<NV> >= 2) value_tile<2, NV>(vbase, rows.data(), t0, t1, p, padded, a); break;
                case 3: if constexpr (kValueHeads<NV> >= 3) value_tile<3, NV>(vbase, rows.data(), t0, t1, p, padded, a); break;
                default: if constexpr (kValueHeads<NV> >= 4) value_tile<4, NV>(vbase, rows.data(), t0, t1, p, padded, a); break;
              }
            }
          }
        }
      } else {
        for (int64_t t = 0; t < len; ++t) {
          if (t + 16 < len)  // value rows 16 tokens ahead
            for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(vc + rows[t + 16]) + b, _MM_HINT_T1);
          for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
            const scalar_t* vrow = vc + rows[t] + kvh * head_stride;
            __m512 vv[NV];
            for (int i = 0; i < NV; ++i) vv[i] = widen16(vrow + 16 * i);
            for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
              const __m512 p = _mm512_set1_ps(scores[h * padded + t]);
              for (int i = 0; i < NV; ++i) acc[h * NV + i] = _mm512_fmadd_ps(p, vv[i], acc[h * NV + i]);
            }
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* orow = o + (seq * num_heads + h) * D;
        for (int i = 0; i < NV; ++i) {
          vfloat f;
          __builtin_memcpy(&f, &acc[h * NV + i], sizeof(f));
          store_f(orow + 16 * i, f);
        }
      }
    }
  });
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Lane i of the result is the sum of v[i]'s 8 lanes (three rounds of pairwise adds and a swap of
// 128-bit halves) instead of 8 separate reductions.
inline __m256 sum8(const __m256* v) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// decode_avx512 for float32 on AVX2 (no AVX-512): keys 8 at a time, each head's 8 scores from one
// sum8 (decode_fixed reduced every key's dot product for every head on its own), values read once
// per row for every query head of their group, key and value rows prefetched 32 tokens ahead. On a
// 2-core AMD EPYC (Zen 3), 51 sequences x 30 layers with the cache in DRAM: 34-38 ms against
// decode_fixed's 50-52 (16 tokens ahead: 43-45; 64: 32-35; docs/performance.md).
template <int D>
void decode_avx2(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
                 int64_t window, double softcap) {
  constexpr int NV = D / 8;
  const auto [num_seqs, num_heads, block_size, num_kv_heads, group, max_blocks, block_stride, token_stride,
              head_stride, q, kc, vc, tables, lens, o] =
      decode_layout<float>(query, k_cache, v_cache, block_tables, seq_lens, out);
  const __m256 vscale = _mm256_set1_ps(static_cast<float>(scale));

  pool_for(num_seqs, grain_for(mean_seq_work(lens, num_seqs, num_heads * D)), [&](int64_t begin, int64_t end) {
    std::vector<__m256> qv(num_heads * NV), acc(num_heads * NV);
    std::vector<float> scores;
    std::vector<int64_t> rows;  // each key's row in the pool (element offset, kv head 0)
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t first = window_first(lens[seq], window), len = lens[seq] - first;
      const int64_t padded = (len + 7) & ~int64_t{7};
      const int64_t* table = tables + seq * max_blocks;
      rows.resize(len);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t pos = first + t;
        rows[t] = table[pos / block_size] * block_stride + (pos % block_size) * token_stride;
      }
      scores.resize(num_heads * padded);
      for (int64_t h = 0; h < num_heads; ++h)
        for (int i = 0; i < NV; ++i) qv[h * NV + i] = _mm256_loadu_ps(q + (seq * num_heads + h) * D + 8 * i);
      const int64_t row_bytes = num_kv_heads * head_stride * static_cast<int64_t>(sizeof(float));
      for (int64_t t0 = 0; t0 < len; t0 += 8) {
        const int n = static_cast<int>(std::min<int64_t>(8, len - t0));
        for (int64_t t = t0 + 32; t < std::min(len, t0 + 40); ++t)  // key rows four tiles ahead (32 tokens, as on AVX-512)
          for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(kc + rows[t]) + b, _MM_HINT_T1);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* kh = kc + (h / group) * head_stride;
          const __m256* qh = qv.data() + h * NV;
          __m256 dots[8];
          for (int j = 0; j < n; ++j) {
            const float* k = kh + rows[t0 + j];
            __m256 d = _mm256_mul_ps(qh[0], _mm256_loadu_ps(k));
            for (int i = 1; i < NV; ++i) d = _mm256_fmadd_ps(qh[i], _mm256_loadu_ps(k + 8 * i), d);
            dots[j] = d;
          }
          for (int j = n; j < 8; ++j) dots[j] = _mm256_setzero_ps();
          _mm256_storeu_ps(scores.data() + h * padded + t0, _mm256_mul_ps(sum8(dots), vscale));
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        cap_scores(scores.data() + h * padded, len, static_cast<float>(softcap));
        softmax_inplace(scores.data() + h * padded, len);
      }
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        if (t + 32 < len)  // value rows 32 tokens ahead
          for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(vc + rows[t + 32]) + b, _MM_HINT_T1);
        for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
          const float* vrow = vc + rows[t] + kvh * head_stride;
          __m256 vv[NV];
          for (int i = 0; i < NV; ++i) vv[i] = _mm256_loadu_ps(vrow + 8 * i);
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
            const __m256 p = _mm256_set1_ps(scores[h * padded + t]);
            for (int i = 0; i < NV; ++i) acc[h * NV + i] = _mm256_fmadd_ps(p, vv[i], acc[h * NV + i]);
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h)
        for (int i = 0; i < NV; ++i) _mm256_storeu_ps(o + (seq * num_heads + h) * D + 8 * i, acc[h * NV + i]);
    }
  });
}
#endif

// The AVX-512 kernel for float and bfloat16 where the CPU has it, the AVX2 one for float32 where
// that is the widest; decode_fixed otherwise.
template <int D, typename scalar_t>
void decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out, double scale,
            int64_t window, double softcap) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    decode_avx512<D, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale, window, softcap);
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<scalar_t, float> && D % 8 == 0) {
    decode_avx2<D>(query, k_cache, v_cache, block_tables, seq_lens, out, scale, window, softcap);
    return;
  }
#endif
  decode_fixed<D, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale, window, softcap);
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [seqs, heads, dim] tensor");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1, "k_cache must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(), "v_cache must match k_cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables: contiguous int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens: contiguous int64");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query and cache head dims differ");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache dtypes differ");
  auto out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    with_head_dim(query.size(2), [&](auto d) {
      decode<decltype(d)::value, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale, window,
                                           softcap);
    });
  });
  return out;
}

// The step's new keys and values [tokens, kv_heads, dim] into the caches' flat slots: what two
// index_copy_ calls did, in one call from Python (a one-token decode step made 60 of them, ~5 us
// each). Each token's heads must be contiguous (the rows of the fused QKV projection's split are).
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [tokens, kv_heads, dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be contiguous [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3), "key rows and cache rows differ");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "key, value and cache dtypes differ");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 && value.stride(1) == value.size(2),
              "each token's key and value heads must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) == key.size(0), "slot_mapping: contiguous int64, one slot per token");
  const int64_t elem = key.element_size(), slots = k_cache.size(0) * k_cache.size(1);
  const size_t bytes = static_cast<size_t>(key.size(1) * key.size(2) * elem);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const char* kd = static_cast<const char*>(key.data_ptr());
  const char* vd = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t t = 0; t < key.size(0); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "slot ", slot[t], " is outside the cache's ", slots, " slots");
    std::memcpy(kc + slot[t] * bytes, kd + t * key.stride(0) * elem, bytes);
    std::memcpy(vc + slot[t] * bytes, vd + t * value.stride(0) * elem, bytes);
  }
}

}  // namespace pagedserve
