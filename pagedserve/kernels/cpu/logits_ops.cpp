// Row-wise passes over a step's logits [rows, vocab] that torch runs far below the memory
// bandwidth on the CPU: argmax (the greedy sampler) and the bfloat16 LM head's float32 copy with
// each row's top k found in the same pass (worker/parallel.py's refine_top_logits). On W64 in
// bfloat16 torch's argmax, topk and copy took ~1 s of a 12 s run (2-core Xeon, docs/performance.md).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "simd.h"
#include "work_pool.h"

namespace pagedserve {

namespace {

// Whether any lane of a comparison result is set.
inline bool any_lane(vint mask) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask(reinterpret_cast<__m512i>(mask), reinterpret_cast<__m512i>(mask)) != 0;
#else
  int32_t lanes[kLanes];
  __builtin_memcpy(lanes, &mask, sizeof(lanes));
  int32_t folded = 0;
  for (int l = 0; l < kLanes; ++l) folded |= lanes[l];
  return folded != 0;
#endif
}

// The first index of the row's maximum; of its first NaN if it has one (torch.argmax's answer).
int64_t argmax_row(const float* row, int64_t n) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_index = 0;
  bool nan = false;
  if (n >= kLanes) {
    // Per lane: its largest value and where it first occurred (a strict > keeps the first).
    vfloat lane_max = load_v(row);
    vint lane_index, step;
    for (int l = 0; l < kLanes; ++l) lane_index[l] = l, step[l] = kLanes;
    vint seen_nan = (lane_max != lane_max);
    vint index = lane_index;
    for (i = kLanes; i + kLanes <= n; i += kLanes) {
      index += step;
      const vfloat v = load_v(row + i);
      const vint greater = v > lane_max;
      lane_max = greater ? v : lane_max;
      lane_index = greater ? index : lane_index;
      seen_nan |= (v != v);
    }
    nan = any_lane(seen_nan);
    best_index = lane_index[0];
    best = lane_max[0];
    for (int l = 1; l < kLanes; ++l) {
      if (lane_max[l] > best || (lane_max[l] == best && lane_index[l] < best_index)) {
        best = lane_max[l];
        best_index = lane_index[l];
      }
    }
  }
  for (; i < n; ++i) {
    if (row[i] != row[i]) {
      nan = true;
    } else if (row[i] > best || (i == 0 && row[i] == best)) {
      best = row[i];
      best_index = i;
    }
  }
  if (nan) {
    for (i = 0; i < n; ++i)
      if (row[i] != row[i]) return i;
  }
  return best_index;
}

// Candidates for one row's k largest: the smallest is replaced by anything larger.
struct TopK {
  std::vector<float> values;
  std::vector<int64_t> indices;
  int64_t smallest = 0;  // position in values of the current smallest
  float threshold = -std::numeric_limits<float>::infinity();

  void reset(int64_t k) {
    values.assign(k, 0.f);
    indices.assign(k, -1);
  }
  // The first k elements, whatever they are (NaN counts as the smallest).
  void fill(const float* row, int64_t k) {
    for (int64_t j = 0; j < k; ++j) values[j] = row[j], indices[j] = j;
    update_threshold();
  }
  void offer(float v, int64_t index) {
    if (!(v > threshold)) return;
    values[smallest] = v;
    indices[smallest] = index;
    update_threshold();
  }
  void update_threshold() {
    smallest = 0;
    for (int64_t j = 1; j < static_cast<int64_t>(values.size()); ++j)
      if (values[j] != values[j] || values[j] < values[smallest]) smallest = j;
    threshold = values[smallest] != values[smallest] ? -std::numeric_limits<float>::infinity() : values[smallest];
  }
};

}  // namespace

// torch.argmax(x, dim=-1) for a contiguous float32 [rows, n].
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "x must be a contiguous float32 [rows, n] tensor with n > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  pool_for(rows, grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

// (x as float32, the indices of each row's k largest in no particular order) for a contiguous
// [rows, n] x in float32 or bfloat16, 0 < k <= n: torch's x.float() and x.topk(k, sorted=False)
// in one pass. Ties at the k-th value may pick other indices than torch's; NaN is never picked
// once k other values are there.
std::tuple<at::Tensor, at::Tensor> logits_top(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, n] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k > 0 && k <= n, "k must be in 1..", n, ", got ", k);
  auto out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  auto top = at::empty({rows, k}, x.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "logits_top", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    float* op = out.data_ptr<float>();
    int64_t* tp = top.data_ptr<int64_t>();
    pool_for(rows, grain_for(2 * n), [&](int64_t begin, int64_t end) {
      TopK best;
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* src = xp + r * n;
        float* dst = op + r * n;
        // The head, up to a whole vector past k, one element at a time.
        const int64_t head = std::min(n, (k + kLanes - 1) / kLanes * kLanes);
        for (int64_t i = 0; i < head; ++i) dst[i] = static_cast<float>(src[i]);
        best.reset(k);
        best.fill(dst, k);
        for (int64_t i = k; i < head; ++i) best.offer(dst[i], i);
        int64_t i = head;
        for (; i + kLanes <= n; i += kLanes) {
          const vfloat v = load_f(src + i);
          store_v(dst + i, v);
          if (!any_lane(v > (vfloat{} + best.threshold))) continue;  // almost always, once the row has warmed up
          for (int l = 0; l < kLanes; ++l) best.offer(v[l], i + l);
        }
        for (; i < n; ++i) {
          dst[i] = static_cast<float>(src[i]);
          best.offer(dst[i], i);
        }
        for (int64_t j = 0; j < k; ++j) tp[r * k + j] = best.indices[j];
      }
    });
  });
  return {out, top};
}

// The indices of each row's k largest (no particular order) of a contiguous float32 [rows, n], 0 < k <=
// n: torch's x.topk(k, sorted=False).indices in one pass a row without logits_top's copy (the quantized
// LM head's float32 logits: torch's topk took ~2 ms of a batch-50 step over 49k tokens). Ties at the
// k-th value may pick other indices than torch's; NaN is never picked once k other values are there.
at::Tensor top_indices(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be a contiguous float32 [rows, n] tensor");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k > 0 && k <= n, "k must be in 1..", n, ", got ", k);
  auto top = at::empty({rows, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* tp = top.data_ptr<int64_t>();
  pool_for(rows, grain_for(n), [&](int64_t begin, int64_t end) {
    TopK best;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * n;
      best.reset(k);
      best.fill(row, k);
      int64_t i = k;
      for (; i < n && i % kLanes; ++i) best.offer(row[i], i);
      for (; i + kLanes <= n; i += kLanes) {
        const vfloat v = load_v(row + i);
        if (!any_lane(v > (vfloat{} + best.threshold))) continue;
        for (int l = 0; l < kLanes; ++l) best.offer(v[l], i + l);
      }
      for (; i < n; ++i) best.offer(row[i], i);
      for (int64_t j = 0; j < k; ++j) tp[r * k + j] = best.indices[j];
    }
  });
  return top;
}

// One token a row drawn from softmax(y) by inverse transform: the first index whose cumulative
// exp(y - max) passes u x their total, u one uniform in [0, 1) a row. torch took softmax (three
// passes), cumsum (one, sequential, in double) and searchsorted: ~4.3 ms for 64 rows of 49k tokens
// on a 2-core Xeon. Here: the row's max, then exp(y - max) in place of y and their total, then a
// walk by 16-token blocks. Tokens at -inf (truncated, masked) get exactly 0 and are never drawn; so
// are scores more than 87 below the max (exp below float's normal range, < 1e-37 of the max's). A
// row whose every token is -inf draws its first. y: contiguous float32 [rows, n], overwritten.
//
// nucleus_draw_rows first narrows each row to its top_k, top_p's nucleus and min_p's floor
// (worker/truncation.py's rules, as the GPU's kernels/triton/nucleus.py keeps top_p: token i stays when
// fewer than top_k tokens are more likely, then when the mass of the tokens more likely than i is
// below top_p x the mass top_k kept, tokens of equal probability at either edge together; then those
// with e = exp(y - max) below min_p go), then draws among what stays. With e in [0, 1] the
// kept set is every token whose float bits reach a threshold pattern: a histogram of the masses (of
// the counts, for top_k) by the top 16 bits of the pattern finds the bucket where the mass (count)
// from the top crosses top_p x Z (top_k), and that bucket's tokens, sorted, the pattern. No sort of the row, no candidate guesses (torch.topk
// of 64, then 1,024, then 8,192 candidates: ~27 ms of 64 flat rows).
namespace {

constexpr float kExpFloor = -87.3f;  // exp_v's lowest argument
constexpr int kBucketShift = 16;
constexpr uint32_t kOneBits = 0x3F800000u;  // the float bits of 1.0: e of the most likely token

inline uint32_t bits_of(float v) {
  uint32_t b;
  __builtin_memcpy(&b, &v, sizeof(b));
  return b;
}

// The histogram bucket of e in [0, 1] (exp_in_place's): its top 16 bits, at most 1.0's bucket.
inline uint32_t bucket_of(float e) { return std::min(bits_of(e) >> kBucketShift, kOneBits >> kBucketShift); }

// e = exp(y - peak) in place (0 for -inf and far below), returns their total; peak: the row's max
// (NaN tokens aside). Every e is in [0, 1], never NaN: the thresholds' histograms index buckets by
// e's bits, and a NaN (a NaN logit, or +inf - +inf) would index past them. NaN tokens get 0 (never
// drawn); in a row with +inf tokens (a logit over a tiny temperature) those get 1 and the others 0.
float exp_in_place(float* row, int64_t n, float peak) {
  float total = 0.f;
  if (peak == std::numeric_limits<float>::infinity()) {
    for (int64_t i = 0; i < n; ++i) {
      row[i] = row[i] == peak ? 1.f : 0.f;
      total += row[i];
    }
    return total;
  }
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat d = load_v(row + i) - peak;
    vfloat e = d < (vfloat{} + kExpFloor) ? vfloat{} : exp_v(d);
    e = e == e ? e : vfloat{};
    store_v(row + i, e);
    total += hsum(e);
  }
  for (; i < n; ++i) {
    const float d = row[i] - peak;
    row[i] = d < kExpFloor || d != d ? 0.f : std::exp(d);
    total += row[i];
  }
  return total;
}

// The smallest bit pattern B with mass(e > B) < need, over e = row (non-negative): the kept tokens are
// those with bits(e) >= B. `mass`, `members`: scratch.
uint32_t nucleus_threshold(const float* row, int64_t n, float need, std::vector<float>& mass,
                           std::vector<uint32_t>& members) {
  mass.assign((kOneBits >> kBucketShift) + 1, 0.f);
  for (int64_t i = 0; i < n; ++i) mass[bucket_of(row[i])] += row[i];
  float above = 0.f;  // mass of the buckets above the one looked at
  int64_t k = static_cast<int64_t>(mass.size()) - 1;
  for (; k >= 0; --k) {
    if (above + mass[k] >= need) break;
    above += mass[k];
  }
  if (k < 0) return 0;  // rounding left the whole row short of need: keep it all
  members.clear();
  for (int64_t i = 0; i < n; ++i)
    if (bucket_of(row[i]) == static_cast<uint32_t>(k)) members.push_back(bits_of(row[i]));
  std::sort(members.begin(), members.end(), std::greater<uint32_t>());
  for (size_t j = 0; j < members.size();) {
    const uint32_t pattern = members[j];
    float group = 0.f;
    for (; j < members.size() && members[j] == pattern; ++j) {
      float e;
      __builtin_memcpy(&e, &members[j], sizeof(e));
      group += e;
    }
    if (above + group >= need) return pattern;
    above += group;
  }
  return members.empty() ? 0 : members.back();  // (the bucket's own sum crossed, its parts did not)
}

// The bit pattern of the k-th largest e (0 < k < n): the kept tokens are those with bits(e) >= it (ties
// at the k-th value kept together). `count`, `members`: scratch.
uint32_t top_k_threshold(const float* row, int64_t n, int64_t k, std::vector<int32_t>& count,
                         std::vector<uint32_t>& members) {
  count.assign((kOneBits >> kBucketShift) + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++count[bucket_of(row[i])];
  int64_t above = 0;  // tokens in the buckets above the one looked at
  int64_t b = static_cast<int64_t>(count.size()) - 1;
  for (; b >= 0 && above + count[b] < k; --b) above += count[b];
  if (b < 0) return 0;
  members.clear();
  for (int64_t i = 0; i < n; ++i)
    if (bucket_of(row[i]) == static_cast<uint32_t>(b)) members.push_back(bits_of(row[i]));
  std::sort(members.begin(), members.end(), std::greater<uint32_t>());
  return members[k - above - 1];
}

// The mass of the tokens with bits(e) >= keep.
float kept_mass(const float* row, int64_t n, uint32_t keep) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) total += bits_of(row[i]) >= keep ? row[i] : 0.f;
  return total;
}

// The draw among the tokens with bits(e) >= keep (0: all), e = row: the first whose cumulative weight
// passes u x the kept total, by 16-token blocks (block sums in the same order for the total and the walk).
int64_t draw_kept(const float* row, int64_t n, uint32_t keep, float u, std::vector<float>& blocks) {
  const int64_t num_blocks = (n + kLanes - 1) / kLanes;
  blocks.resize(num_blocks);
  float total = 0.f;
  for (int64_t b = 0; b < num_blocks; ++b) {
    float sum = 0.f;
    const int64_t end = std::min(n, (b + 1) * kLanes);
    if (keep == 0 && end - b * kLanes == kLanes) {
      sum = hsum(load_v(row + b * kLanes));
    } else {
      for (int64_t j = b * kLanes; j < end; ++j) sum += bits_of(row[j]) >= keep ? row[j] : 0.f;
    }
    blocks[b] = sum;
    total += sum;
  }
  const float target = u * total;
  float cumulative = 0.f;
  int64_t last = -1;  // the last token of positive weight seen: the answer when rounding leaves none
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t end = std::min(n, (b + 1) * kLanes);
    if (!(cumulative + blocks[b] > target)) {
      cumulative += blocks[b];
      if (blocks[b] > 0.f)
        for (int64_t j = end - 1; j >= b * kLanes; --j)
          if (row[j] > 0.f && bits_of(row[j]) >= keep) { last = j; break; }
      continue;
    }
    for (int64_t j = b * kLanes; j < end; ++j) {
      if (!(row[j] > 0.f && bits_of(row[j]) >= keep)) continue;
      last = j;
      cumulative += row[j];
      if (cumulative > target) return j;
    }
    return last;  // the block's sum passed the target, its partial sums (other rounding) did not
  }
  return std::max<int64_t>(last, 0);
}

float row_peak(const float* row, int64_t n) {
  float peak = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) peak = row[i] > peak ? row[i] : peak;
  return peak;
}

void check_rows(const at::Tensor& y, const at::Tensor& u) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat && y.size(1) > 0,
              "y must be a contiguous float32 [rows, n] tensor with n > 0");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == y.size(0) && u.scalar_type() == at::kFloat && u.is_contiguous(),
              "u must be a contiguous float32 [rows] tensor");
}

// Scratch for sample_row, one a thread.
struct RowScratch {
  std::vector<float> blocks, mass;
  std::vector<int32_t> count;
  std::vector<uint32_t> members;
};

// One row's token: e = exp(y - max) in place, then top_k (0 < k < n), top_p (< 1) and min_p (> 0) as
// thresholds on e's bits, then the draw among what they keep. A row of -inf draws its first token.
int64_t sample_row(float* row, int64_t n, int64_t k, float top_p, float min_p, float u, RowScratch& scratch) {
  const float peak = row_peak(row, n);
  if (peak == -std::numeric_limits<float>::infinity()) return 0;
  float total = exp_in_place(row, n, peak);
  uint32_t keep = 0;
  if (0 < k && k < n) {  // top_k first; top_p then renormalises over what it keeps
    keep = top_k_threshold(row, n, k, scratch.count, scratch.members);
    if (top_p < 1.f) total = kept_mass(row, n, keep);
  }
  if (top_p < 1.f) keep = std::max(keep, nucleus_threshold(row, n, top_p * total, scratch.mass, scratch.members));
  if (min_p > 0.f) keep = std::max(keep, bits_of(std::min(min_p, 1.f)));
  return draw_kept(row, n, keep, u, scratch.blocks);
}

}  // namespace

at::Tensor draw_rows(at::Tensor& y, const at::Tensor& u) {
  check_rows(y, u);
  const int64_t rows = y.size(0), n = y.size(1);
  auto out = at::empty({rows}, y.options().dtype(at::kLong));
  float* yp = y.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  pool_for(rows, grain_for(8 * n), [&](int64_t begin, int64_t end) {
    RowScratch scratch;
    for (int64_t r = begin; r < end; ++r) op[r] = sample_row(yp + r * n, n, 0, 1.f, 0.f, up[r], scratch);
  });
  return out;
}

at::Tensor nucleus_draw_rows(at::Tensor& y, const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& min_p,
                             const at::Tensor& u) {
  check_rows(y, u);
  TORCH_CHECK(top_p.sizes() == u.sizes() && min_p.sizes() == u.sizes() && top_p.scalar_type() == at::kFloat &&
                  min_p.scalar_type() == at::kFloat && top_p.is_contiguous() && min_p.is_contiguous(),
              "top_p and min_p must be contiguous float32 [rows] tensors");
  TORCH_CHECK(top_k.sizes() == u.sizes() && top_k.scalar_type() == at::kLong && top_k.is_contiguous(),
              "top_k must be a contiguous int64 [rows] tensor");
  const int64_t rows = y.size(0), n = y.size(1);
  auto out = at::empty({rows}, y.options().dtype(at::kLong));
  float* yp = y.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float *up = u.data_ptr<float>(), *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  pool_for(rows, grain_for(16 * n), [&](int64_t begin, int64_t end) {
    RowScratch scratch;
    for (int64_t r = begin; r < end; ++r) op[r] = sample_row(yp + r * n, n, kp[r], pp[r], mp[r], up[r], scratch);
  });
  return out;
}

// Repetition, presence and frequency penalties on x's rows `which`, their histories the rows
// `table_rows` of a PenaltyCounts table (output counts, float32; prompt marks, bool): worker/
// penalties.py's float32 arithmetic in its order — a positive logit divided by the repetition, a
// negative one multiplied, on every token the prompt marks or the outputs count; then (x - presence)
// - frequency x count on every token the outputs count — with no fused multiply-add (this function
// is compiled without contraction), so the same values bit for bit. One vectorized pass a row finds
// the seen tokens (a row's few hundred among 49k): numpy's two nonzero scans and union a row took
// ~16 ms of 64 rows.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace {

inline void penalize_token(float* row, int64_t v, float count, bool prompt, float repetition, float presence,
                           float frequency) {
  if (repetition != 1.f && (prompt || count > 0.f)) {
    const float value = row[v];
    row[v] = value > 0.f ? value / repetition : value * repetition;
  }
  if (count > 0.f && (presence != 0.f || frequency != 0.f)) {
    const float shifted = row[v] - presence;
    const float scaled = frequency * count;
    row[v] = shifted - scaled;
  }
}

}  // namespace

void penalize_rows(at::Tensor& x, const at::Tensor& which, const at::Tensor& counts, const at::Tensor& prompt,
                   const at::Tensor& table_rows, const at::Tensor& repetition, const at::Tensor& presence,
                   const at::Tensor& frequency) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be contiguous float32 [rows, n]");
  const int64_t n = x.size(1), r = which.numel();
  TORCH_CHECK(counts.dim() == 2 && counts.size(1) == n && counts.is_contiguous() && counts.scalar_type() == at::kFloat,
              "counts must be contiguous float32 [table rows, n]");
  TORCH_CHECK(prompt.sizes() == counts.sizes() && prompt.is_contiguous() && prompt.scalar_type() == at::kBool,
              "prompt must be contiguous bool, the shape of counts");
  for (const auto* t : {&which, &table_rows})
    TORCH_CHECK(t->dim() == 1 && t->numel() == r && t->is_contiguous() && t->scalar_type() == at::kLong,
                "which and table_rows must be contiguous int64 [rows]");
  for (const auto* t : {&repetition, &presence, &frequency})
    TORCH_CHECK(t->dim() == 1 && t->numel() == r && t->is_contiguous() && t->scalar_type() == at::kFloat,
                "repetition, presence and frequency must be contiguous float32 [rows]");
  const int64_t* wp = which.data_ptr<int64_t>();
  const int64_t* tp = table_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < r; ++i)
    TORCH_CHECK(0 <= wp[i] && wp[i] < x.size(0) && 0 <= tp[i] && tp[i] < counts.size(0), "row index out of range");
  float* xp = x.data_ptr<float>();
  const float* cp = counts.data_ptr<float>();
  const bool* pp = prompt.data_ptr<bool>();
  const float *rep = repetition.data_ptr<float>(), *pres = presence.data_ptr<float>(), *freq = frequency.data_ptr<float>();
  pool_for(r, grain_for(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = xp + wp[i] * n;
      const float* c = cp + tp[i] * n;
      const bool* marks = pp + tp[i] * n;
      int64_t v = 0;
      for (; v + kLanes <= n; v += kLanes) {
        uint64_t flags[kLanes / 8];
        __builtin_memcpy(flags, marks + v, kLanes);
        uint64_t any_mark = 0;
        for (int k = 0; k < kLanes / 8; ++k) any_mark |= flags[k];
        if (!any_mark && !any_lane(load_v(c + v) > vfloat{})) continue;
        for (int64_t t = v; t < v + kLanes; ++t) penalize_token(row, t, c[t], marks[t], rep[i], pres[i], freq[i]);
      }
      for (; v < n; ++v) penalize_token(row, v, c[v], marks[v], rep[i], pres[i], freq[i]);
    }
  });
}
#pragma GCC pop_options

}  // namespace pagedserve
