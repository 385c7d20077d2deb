// Paged attention for single-token queries (decode), reading K/V straight from the block pool.
//
// Plain torch needs a gather of every sequence's blocks plus a transpose before its matmuls: on
// a 2-core CPU that copying cost 6x the attention arithmetic. This reads each cached K/V row once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// float rows are used in place; narrower types are widened into `buffer` once per row.
template <typename scalar_t>
inline const float* as_float(const scalar_t* src, float* buffer, int64_t n) {
  for (int64_t d = 0; d < n; ++d) buffer[d] = static_cast<float>(src[d]);
  return buffer;
}
template <>
inline const float* as_float<float>(const float* src, float*, int64_t) { return src; }

template <typename scalar_t>
void decode_impl(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
                 double scale) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t block_stride = k_cache.stride(0), token_stride = k_cache.stride(1), head_stride = k_cache.stride(2);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores, row(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = lens[seq];
      const int64_t* table = tables + seq * max_blocks;
      scores.assign(group * len, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qrow = q + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(qrow[d]);
      }
      // Walk block by block: rows inside a block are contiguous, and no division per token.
      for (int64_t start = 0; start < len; start += block_size) {
        const scalar_t* kblock = kc + table[start / block_size] * block_stride + kv_head * head_stride;
        const int64_t rows = std::min(block_size, len - start);
        for (int64_t j = 0; j < rows; ++j) {
          const float* krow = as_float(kblock + j * token_stride, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * krow[d];
            scores[g * len + start + j] = dot * fscale;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float peak = *std::max_element(s, s + len);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - peak);
          total += s[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const scalar_t* vblock = vc + table[start / block_size] * block_stride + kv_head * head_stride;
        const int64_t rows = std::min(block_size, len - start);
        for (int64_t j = 0; j < rows; ++j) {
          const float* vrow = as_float(vblock + j * token_stride, row.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + start + j];
            float* a = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vrow[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* orow = o + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) orow[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
    }
  });
}

// Head dims known at compile time get explicit SIMD (GCC vector extensions compile to AVX2 or
// AVX-512 under -march=native): the generic loop above leaves the float reductions scalar.
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

template <int D, typename scalar_t>
void decode_fixed(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens, torch::Tensor& out,
                  double scale) {
  constexpr int NV = D / kLanes;
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t block_stride = k_cache.stride(0), token_stride = k_cache.stride(1), head_stride = k_cache.stride(2);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  // One sequence per work item, all its heads together: each cached token row (every kv head)
  // is read once, front to back.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<vfloat> qv(num_heads * NV), acc(num_heads * NV);
    std::vector<float> scores, qrow(D), row(D);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = lens[seq];
      const int64_t* table = tables + seq * max_blocks;
      scores.resize(num_heads * len);
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* src = as_float(q + (seq * num_heads + h) * D, qrow.data(), D);
        for (int i = 0; i < NV; ++i) qv[h * NV + i] = load_v(src + i * kLanes) * fscale;
      }
      for (int64_t start = 0; start < len; start += block_size) {
        const scalar_t* kblock = kc + table[start / block_size] * block_stride;
        const int64_t rows = std::min(block_size, len - start);
        for (int64_t j = 0; j < rows; ++j) {
          for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
            const float* krow = as_float(kblock + j * token_stride + kvh * head_stride, row.data(), D);
            vfloat kv[NV];
            for (int i = 0; i < NV; ++i) kv[i] = load_v(krow + i * kLanes);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = kvh * group + g;
              const vfloat* qh = qv.data() + h * NV;
              vfloat dot = qh[0] * kv[0];
              for (int i = 1; i < NV; ++i) dot += qh[i] * kv[i];
              scores[h * len + start + j] = hsum(dot);
            }
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) softmax_inplace(scores.data() + h * len, len);
      for (auto& a : acc) a = vfloat{};
      for (int64_t start = 0; start < len; start += block_size) {
        const scalar_t* vblock = vc + table[start / block_size] * block_stride;
        const int64_t rows = std::min(block_size, len - start);
        for (int64_t j = 0; j < rows; ++j) {
          for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
            const float* vrow = as_float(vblock + j * token_stride + kvh * head_stride, row.data(), D);
            vfloat vv[NV];
            for (int i = 0; i < NV; ++i) vv[i] = load_v(vrow + i * kLanes);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t h = kvh * group + g;
              const float p = scores[h * len + start + j];
              vfloat* a = acc.data() + h * NV;
              for (int i = 0; i < NV; ++i) a[i] += p * vv[i];
            }
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* orow = o + (seq * num_heads + h) * D;
        for (int i = 0; i < NV; ++i)
          for (int l = 0; l < kLanes; ++l) orow[i * kLanes + l] = static_cast<scalar_t>(acc[h * NV + i][l]);
      }
    }
  });
}

torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [seqs, heads, dim] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1, "k_cache must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(), "v_cache must match k_cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(), "block_tables: contiguous int64");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(), "seq_lens: contiguous int64");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query and cache head dims differ");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache dtypes differ");
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    switch (query.size(2)) {
      case 64: decode_fixed<64, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale); break;
      case 128: decode_fixed<128, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale); break;
      default: decode_impl<scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (query [B,H,D], caches [N,bs,KVH,D])");
}
