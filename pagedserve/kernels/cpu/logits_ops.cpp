// Row-wise passes over a step's logits [rows, vocab] that torch runs far below the memory
// bandwidth on the CPU: argmax (the greedy sampler) and the bfloat16 LM head's float32 copy with
// each row's top k found in the same pass (worker/parallel.py's refine_top_logits). On W64 in
// bfloat16 torch's argmax, topk and copy took ~1 s of a 12 s run (2-core Xeon, docs/performance.md).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <limits>

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

}  // namespace pagedserve
