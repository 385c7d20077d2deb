// Attention for a step's prefill chunks (every token that is not a lone decode), all sequences in
// one call, reading K/V through block tables from the pool: no gather, no per-sequence dispatch.
//
// Torch's SDPA ran one sequence at a time at 40-55 GFLOP/s on a 2-core AMD EPYC (its math path
// whenever a chunk has cached context, as a mask then has to be built); the work here is tiled so
// that the float multiply-adds run in registers with every operand of the inner loops either a
// vector already loaded or a scalar broadcast from L1:
//   - a work item is (chunk, kv head, up to 3 vectors of query rows: 48 with AVX-512, 24 with
//     AVX2): the rows are (token, query head of
//     the group) pairs, kept TRANSPOSED as lanes (Q^T [D][rows]), so the softmax statistics of
//     all rows are vectors and no horizontal reduction is ever needed;
//   - keys come 16 at a time, widened to float in a small buffer, and for each key and head-dim
//     element one broadcast scalar multiplies a vector of query rows (S^T = K Q^T);
//   - flash-attention's online softmax per row (running max, running sum, rescale of the output);
//   - O^T [D][rows] += V^T P^T the same way, with V's scalars broadcast.
// Causality: a row at position p sees keys 0..p; the key tiles stop at the item's last row, and a
// mask zeroes what a row must not see inside the last tiles. Key rows past the item's last
// position are never read (they may hold anything, NaN included). With a sliding window a row sees
// keys p - window + 1..p: the tiles start at the item's first row's first key (key rows before it
// are never read: their blocks may have been given back) and every tile is masked. Gemma 2's
// soft-cap turns each scaled score s into cap * tanh(s / cap) before the softmax. Bidirectional
// blocks (Gemma 3's images: AttentionMetadata.key_limits): a row sees keys up to its own limit
// (>= its position) instead; the key tiles run to the item's furthest limit, the window still
// counts from the row's position, and the tiles before the item's first row stay unmasked (every
// row sees them: no limit is below its position).
//
// float32 arithmetic for float32 and bfloat16 caches alike (bfloat16 is widened on load).
// One body for AVX-512 (16 lanes, 32 registers) and AVX2 with FMA (8 lanes, 16 registers): the
// few vector operations it needs are the wrappers below, and the register tiles (keys per score
// pass, head-dim elements per accumulate pass) are half a vector's lanes, so that each pass's
// accumulators, its query vectors and the broadcast fit the registers of either.
// Threads: one region of the kernels' pool (work_pool.h) whose threads take items, largest first,
// one at a time (the items of one long chunk differ in size by its length).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "head_dims.h"
#include "simd.h"
#include "work_pool.h"

namespace pagedserve {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PAGEDSERVE_PREFILL_KERNEL 1
#endif

bool prefill_attention_available() {
#if defined(PAGEDSERVE_PREFILL_KERNEL)
  return true;
#else
  return false;
#endif
}

#if defined(PAGEDSERVE_PREFILL_KERNEL)
namespace {

// The vector operations of the kernel, on the widest float vector: V holds W lanes, M a mask of them.
#if defined(__AVX512F__)
using V = __m512;
using M = __mmask16;
constexpr int W = 16;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float x) { return _mm512_set1_ps(x); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline M mask_le(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline M mask_all() { return 0xFFFF; }
inline M mask_and(M a, M b) { return a & b; }
inline M mask_none() { return 0; }
inline V max_where(M m, V a, V b) { return _mm512_mask_max_ps(a, m, a, b); }  // m ? max(a, b) : a
inline V zero_unless(M m, V a) { return _mm512_maskz_mov_ps(m, a); }
inline void widen_row(const c10::BFloat16* src, float* dst, int d) {
  for (int i = 0; i < d; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
}
#else
using V = __m256;
using M = __m256;  // all ones or all zeros in each lane
constexpr int W = 8;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float x) { return _mm256_set1_ps(x); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline M mask_le(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
inline M mask_all() { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
inline M mask_and(M a, M b) { return _mm256_and_ps(a, b); }
inline M mask_none() { return _mm256_setzero_ps(); }
inline V max_where(M m, V a, V b) { return _mm256_blendv_ps(a, _mm256_max_ps(a, b), m); }
inline V zero_unless(M m, V a) { return _mm256_and_ps(m, a); }
inline void widen_row(const c10::BFloat16* src, float* dst, int d) {
  for (int i = 0; i < d; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
}
#endif
static_assert(W == kLanes, "vfloat (simd.h) and V must be the same width");
inline void widen_row(const float* src, float* dst, int d) { std::copy(src, src + d, dst); }

inline V vexp(V x) {
  vfloat v;
  __builtin_memcpy(&v, &x, sizeof(v));
  v = exp_v(v);
  V r;
  __builtin_memcpy(&r, &v, sizeof(r));
  return r;
}

constexpr int kKeys = 16;         // keys per tile
constexpr int kMaxRows = 3 * W;   // query rows per work item: 3 vectors
constexpr int kPass = W / 2;      // keys per score pass, head-dim elements per accumulate pass

// A layer's options: its sliding window (0: none) and score soft-cap (0: none); a step's key
// limits (int64 [query rows], the last key position each row sees; nullptr: causal).
struct Options {
  int64_t window;
  float cap;
  const int64_t* limits;
};

// cap * tanh(s / cap) for each of n score vectors, as cap * (1 - 2 / (e^(2s / cap) + 1)).
inline void cap_tile(V* s, int n, float cap) {
  const V two_over_cap = vset1(2.f / cap), one = vset1(1.f), two = vset1(2.f), vcap = vset1(cap);
  for (int i = 0; i < n; ++i)
    s[i] = vmul(vcap, vsub(one, vdiv(two, vadd(vexp(vmul(s[i], two_over_cap)), one))));
}

struct Item {
  int64_t chunk, kv_head, row0;  // row0: the first of the item's tokens, counted within the chunk
  int64_t rows;                  // tokens x group
  double cost;
};

// S^T[j][rows] = sum_d K[j][d] Q^T[d][rows] for the tile's 16 keys, kPass keys at a time.
template <int D, int RV>
inline void scores_tile(const float* qt, const float* keys, V* s) {
  for (int j0 = 0; j0 < kKeys; j0 += kPass) {
    V acc[kPass][RV];
    for (int j = 0; j < kPass; ++j)
      for (int v = 0; v < RV; ++v) acc[j][v] = vzero();
    for (int d = 0; d < D; ++d) {
      V q[RV];
      for (int v = 0; v < RV; ++v) q[v] = vload(qt + d * kMaxRows + W * v);
      for (int j = 0; j < kPass; ++j) {
        const V k = vset1(keys[(j0 + j) * D + d]);
        for (int v = 0; v < RV; ++v) acc[j][v] = vfma(k, q[v], acc[j][v]);
      }
    }
    for (int j = 0; j < kPass; ++j)
      for (int v = 0; v < RV; ++v) s[(j0 + j) * RV + v] = acc[j][v];
  }
}

// O^T[d][rows] = O^T[d][rows] * corr[rows] + sum_j V[j][d] P^T[j][rows], kPass head-dim elements at a time.
template <int D, int RV>
inline void accumulate_tile(float* ot, const float* values, const V* p, const V* corr) {
  for (int d0 = 0; d0 < D; d0 += kPass) {
    V acc[kPass][RV];
    for (int dd = 0; dd < kPass; ++dd)
      for (int v = 0; v < RV; ++v) acc[dd][v] = vmul(vload(ot + (d0 + dd) * kMaxRows + W * v), corr[v]);
    for (int j = 0; j < kKeys; ++j) {
      for (int dd = 0; dd < kPass; ++dd) {
        const V x = vset1(values[j * D + d0 + dd]);
        for (int v = 0; v < RV; ++v) acc[dd][v] = vfma(x, p[j * RV + v], acc[dd][v]);
      }
    }
    for (int dd = 0; dd < kPass; ++dd)
      for (int v = 0; v < RV; ++v) vstore(ot + (d0 + dd) * kMaxRows + W * v, acc[dd][v]);
  }
}

template <int D, int RV, typename scalar_t>
void run_item(const Item& item, const Options& opt, const at::Tensor& query, const at::Tensor& k_cache,
              const at::Tensor& v_cache,
              const int64_t* tables, int64_t max_blocks, const int64_t* info, float scale, at::Tensor& out,
              float* buffers) {
  const int64_t heads = query.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t block_size = k_cache.size(1), block_stride = k_cache.stride(0), token_stride = k_cache.stride(1);
  const int64_t kv_off = item.kv_head * k_cache.stride(2);
  const int64_t q_start = info[item.chunk * 3], context = info[item.chunk * 3 + 2];
  const int64_t* table = tables + item.chunk * max_blocks;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const int64_t qt_stride = query.stride(0), qh_stride = query.stride(1);

  float* qt = buffers;                    // [D][kMaxRows]
  float* ot = qt + D * kMaxRows;          // [D][kMaxRows]
  float* keys = ot + D * kMaxRows;        // [kKeys][D]
  float* values = keys + kKeys * D;       // [kKeys][D]
  float* position = values + kKeys * D;   // [kMaxRows]: each row's token position (padding: +inf)
  float* limit = position + kMaxRows;     // [kMaxRows]: the last key each row sees (padding: +inf)

  // Rows are token-major: row i is token row0 + i / group, query head kv_head * group + i % group.
  for (int i = 0; i < W * RV; ++i) {
    const bool real = i < item.rows;
    const int64_t token = item.row0 + i / group, head = item.kv_head * group + i % group;
    position[i] = real ? static_cast<float>(context + token) : std::numeric_limits<float>::infinity();
    limit[i] = real && opt.limits ? static_cast<float>(opt.limits[q_start + token]) : position[i];
    const scalar_t* src = q + (q_start + token) * qt_stride + head * qh_stride;
    for (int d = 0; d < D; ++d) qt[d * kMaxRows + i] = real ? static_cast<float>(src[d]) * scale : 0.f;
  }
  for (int d = 0; d < D; ++d)
    for (int v = 0; v < RV; ++v) vstore(ot + d * kMaxRows + W * v, vzero());

  V row_max[RV], row_sum[RV], pos[RV], low[RV], last[RV];
  for (int v = 0; v < RV; ++v) {
    // finite: under a window a row may see no key of the first tiles, and exp(max - max) must stay 1
    row_max[v] = vset1(-1e30f);
    row_sum[v] = vzero();
    pos[v] = vload(position + W * v);
    last[v] = vload(limit + W * v);
    low[v] = vsub(pos[v], vset1(static_cast<float>(opt.window - 1)));  // a windowed row's first key
  }
  const int64_t last_token = item.row0 + (item.rows - 1) / group;
  int64_t num_keys = context + last_token + 1;  // the last row sees keys 0..num_keys-1
  if (opt.limits) {  // or, in a bidirectional block, the row that sees furthest, within the chunk's keys
    for (int64_t token = item.row0; token <= last_token; ++token)
      num_keys = std::max<int64_t>(num_keys, opt.limits[q_start + token] + 1);
    num_keys = std::min<int64_t>(num_keys, context + info[item.chunk * 3 + 1]);
  }
  // keys from here on are hidden from some row (under a window, all of them)
  const int64_t first_masked = opt.window > 0 ? 0 : context + item.row0 + 1;
  const int64_t first_key = opt.window > 0 ? std::max<int64_t>(0, context + item.row0 - opt.window + 1) : 0;
  V s[kKeys * RV];
  for (int64_t t0 = first_key; t0 < num_keys; t0 += kKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kKeys, num_keys - t0));
    for (int j = 0; j < n; ++j) {
      const int64_t t = t0 + j;
      const int64_t row = table[t / block_size] * block_stride + (t % block_size) * token_stride + kv_off;
      widen_row(kc + row, keys + j * D, D);
      widen_row(vc + row, values + j * D, D);
    }
    for (int j = n; j < kKeys; ++j) {  // past the last key: zeros, never a stale row's NaN
      std::fill(keys + j * D, keys + (j + 1) * D, 0.f);
      std::fill(values + j * D, values + (j + 1) * D, 0.f);
    }
    scores_tile<D, RV>(qt, keys, s);
    if (opt.cap > 0.f) cap_tile(s, kKeys * RV, opt.cap);
    const bool masked = t0 + kKeys > first_masked;
    M visible[kKeys][RV];
    V tile_max[RV];
    for (int v = 0; v < RV; ++v) tile_max[v] = row_max[v];
    for (int j = 0; j < kKeys; ++j) {
      const V key_pos = vset1(static_cast<float>(t0 + j));
      for (int v = 0; v < RV; ++v) {
        M seen = masked ? mask_le(key_pos, last[v]) : mask_all();
        if (opt.window > 0) seen = mask_and(seen, mask_le(low[v], key_pos));
        visible[j][v] = j < n ? seen : mask_none();
        tile_max[v] = max_where(visible[j][v], tile_max[v], s[j * RV + v]);
      }
    }
    V corr[RV];
    for (int v = 0; v < RV; ++v) {
      corr[v] = vexp(vsub(row_max[v], tile_max[v]));
      row_sum[v] = vmul(row_sum[v], corr[v]);
      row_max[v] = tile_max[v];
    }
    for (int j = 0; j < kKeys; ++j)
      for (int v = 0; v < RV; ++v) {
        const V p = zero_unless(visible[j][v], vexp(vsub(s[j * RV + v], row_max[v])));
        s[j * RV + v] = p;
        row_sum[v] = vadd(row_sum[v], p);
      }
    accumulate_tile<D, RV>(ot, values, s, corr);
  }

  float inv[kMaxRows];
  for (int v = 0; v < RV; ++v) vstore(inv + W * v, vdiv(vset1(1.f), row_sum[v]));
  scalar_t* o = out.data_ptr<scalar_t>();
  for (int64_t i = 0; i < item.rows; ++i) {
    const int64_t token = item.row0 + i / group, head = item.kv_head * group + i % group;
    scalar_t* dst = o + ((q_start + token) * heads + head) * D;
    for (int d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(ot[d * kMaxRows + i] * inv[i]);
  }
}

template <int D, typename scalar_t>
void prefill(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
             const at::Tensor& block_tables, const at::Tensor& chunks, double scale, const Options& opt,
             at::Tensor& out) {
  const int64_t num_chunks = chunks.size(0), kv_heads = k_cache.size(2), group = query.size(1) / kv_heads;
  const int64_t* info = chunks.data_ptr<int64_t>();
  const int64_t tokens_per_item = std::max<int64_t>(1, kMaxRows / group);
  std::vector<Item> items;
  double total = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t len = info[c * 3 + 1], context = info[c * 3 + 2];
    for (int64_t r0 = 0; r0 < len; r0 += tokens_per_item) {
      const int64_t tokens = std::min(tokens_per_item, len - r0);
      const int64_t keys = opt.window > 0 ? std::min(context + r0 + tokens, opt.window + tokens - 1) : context + r0 + tokens;
      const double cost = static_cast<double>(tokens * group) * keys + 64.0 * tokens * group;
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({c, h, r0, tokens * group, cost});
      total += cost * kv_heads;
    }
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  const float fscale = static_cast<float>(scale);
  // cost counts (row, key) pairs; each is ~4 D float multiply-adds, the grain's unit ~1/4 of one.
  const bool parallel = total * D > static_cast<double>(kMinWorkPerThread) && at::get_num_threads() > 1;
  const int64_t buffer_floats = 2 * D * kMaxRows + 2 * kKeys * D + 2 * kMaxRows;
  auto work = [&](std::vector<float>& buffers, size_t n) {
    const Item& item = items[n];
    switch ((item.rows + W - 1) / W) {
      case 1: run_item<D, 1, scalar_t>(item, opt, query, k_cache, v_cache, tables, max_blocks, info, fscale, out, buffers.data()); break;
      case 2: run_item<D, 2, scalar_t>(item, opt, query, k_cache, v_cache, tables, max_blocks, info, fscale, out, buffers.data()); break;
      default: run_item<D, 3, scalar_t>(item, opt, query, k_cache, v_cache, tables, max_blocks, info, fscale, out, buffers.data());
    }
  };
  const int64_t threads = parallel ? std::min<int64_t>(at::get_num_threads(), items.size()) : 1;
  if (threads <= 1) {
    std::vector<float> buffers(buffer_floats);
    for (size_t n = 0; n < items.size(); ++n) work(buffers, n);
    return;
  }
  // One item per chunk, claimed largest first (the pool hands out chunks in order).
  pool_run(static_cast<int64_t>(items.size()), 1, threads, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffers;
    buffers.resize(buffer_floats);
    for (int64_t n = begin; n < end; ++n) work(buffers, static_cast<size_t>(n));
  });
}

}  // namespace
#endif

// The most query heads per kv head it takes: a work item's rows hold at least one token's whole
// group. 0 where it is not compiled.
int64_t prefill_attention_max_group() {
#if defined(PAGEDSERVE_PREFILL_KERNEL)
  return kMaxRows;
#else
  return 0;
#endif
}

// out[rows of each chunk] = causal attention of those query rows over the chunk's sequence: its
// context_len cached tokens and its own new tokens (already written to the cache); window > 0: a
// row sees its last `window` keys only; softcap > 0: scaled scores capped at softcap * tanh(s / softcap). chunks is
// int64 [P, 3] = (first row in query/out, number of rows, context_len); block_tables int64
// [P, max_blocks] covering context_len + rows tokens, or up to the furthest of key_limits (int64
// [query rows]: the last key position each row sees, at least its own; none: causal). Rows of out
// outside the chunks are untouched.
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& chunks, double scale, at::Tensor& out,
                             int64_t window, double softcap, const c10::optional<at::Tensor>& key_limits) {
  TORCH_CHECK(prefill_attention_available(), "paged_prefill_attention needs AVX-512, or AVX2 with FMA");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [tokens, heads, dim] with unit dim stride");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == query.scalar_type(),
              "out must be a contiguous tensor shaped and typed as query");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.stride(3) == 1, "k_cache must be [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(), "v_cache must match k_cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables: contiguous int64 [chunks, max_blocks]");
  TORCH_CHECK(chunks.scalar_type() == at::kLong && chunks.is_contiguous() && chunks.dim() == 2 && chunks.size(1) == 3 &&
                  chunks.size(0) == block_tables.size(0),
              "chunks: contiguous int64 [chunks, 3] (row start, rows, context_len), one per block table row");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(query.size(1) / k_cache.size(2) <= prefill_attention_max_group(), "at most ",
              prefill_attention_max_group(), " query heads per kv head (one work item holds a token's group)");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query and cache head dims differ");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query and cache dtypes differ");
  const bool limited = key_limits.has_value() && key_limits->defined();
  TORCH_CHECK(!limited || (key_limits->scalar_type() == at::kLong && key_limits->is_contiguous() &&
                           key_limits->dim() == 1 && key_limits->size(0) == query.size(0)),
              "key_limits: contiguous int64 [query rows]");
  const int64_t* limits = limited ? key_limits->data_ptr<int64_t>() : nullptr;
#if defined(PAGEDSERVE_PREFILL_KERNEL)
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "paged_prefill_attention", [&] {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
      with_head_dim(query.size(2), [&](auto d) {
        prefill<decltype(d)::value, scalar_t>(query, k_cache, v_cache, block_tables, chunks, scale,
                                              Options{window, static_cast<float>(softcap), limits}, out);
      });
    } else {
      TORCH_CHECK(false, "paged_prefill_attention: float32 or bfloat16 only, got ", query.scalar_type());
    }
  });
#endif
}

}  // namespace pagedserve
