// Paged attention for single-token queries (decode), reading K/V straight from the block pool.
//
// Plain torch needs a gather of every sequence's blocks plus a transpose before its matmuls: on
// a 2-core CPU that copying cost 6x the attention arithmetic. This reads each cached K/V row once.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace pagedserve {

// The head dim is a compile-time constant so the inner loops unroll into whole SIMD vectors.
template <int D, typename scalar_t>
void decode_fixed(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
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
  // is read once, front to back. A sequence's work: 2 x len x heads x D float multiply-adds, ~4
  // of the int8 kernels' each (parallel_grain.h's grain_for, on the batch's mean length).
  int64_t total_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total_len += lens[s];
  const int64_t mean_work = 8 * num_heads * D * total_len / std::max<int64_t>(1, num_seqs);
  at::parallel_for(0, num_seqs, grain_for(mean_work), [&](int64_t begin, int64_t end) {
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
        for (int i = 0; i < NV; ++i) store_f(orow + i * kLanes, acc[h * NV + i]);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                                     const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [seqs, heads, dim] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1, "k_cache must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(), "v_cache must match k_cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables: contiguous int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens: contiguous int64");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query and cache head dims differ");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache dtypes differ");
  auto out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    switch (query.size(2)) {
      case 32: decode_fixed<32, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale); break;
      case 64: decode_fixed<64, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale); break;
      case 80: decode_fixed<80, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale); break;
      case 96: decode_fixed<96, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale); break;
      case 128: decode_fixed<128, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale); break;
      case 256: decode_fixed<256, scalar_t>(query, k_cache, v_cache, block_tables, seq_lens, out, scale); break;
      default: TORCH_CHECK(false, "head_dim ", query.size(2), " not compiled in (32, 64, 80, 96, 128, 256)");
    }
  });
  return out;
}

}  // namespace pagedserve
