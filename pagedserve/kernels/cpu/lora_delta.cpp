// The LoRA delta of one linear layer for a whole step, in one pass: each row's shrink by its own
// slot's A (every part of a merged q/k/v or gate/up layer at once), then the expand by that slot's
// B, added into the base output in place. Rows of no adapter (slot -1) cost nothing, and a slot no
// row uses is never read. (The torch path multiplies every row by every used slot's A and B and
// masks: slots x the work, and ~8 small ops per layer; worker/lora/layers.py.)
//
// Layouts (worker/lora/packed.py writes them; a "unit" is 32 bits: one float32, or a pair of
// bfloat16 adjacent along K, the pair vdpbf16ps multiplies; W = elements per unit):
//   a [slots, in / W, C]  unit u of column c: A's row c at inputs W*u.., where c = part * R + j
//                         (R = the rank padded to a multiple of W; C = parts * R padded to 16)
//   b [slots, R / W, N]   unit u of output column n: scaling * B[n, W*u..] of n's part
// so that one 64-byte load holds 16 output columns of one unit, as lane_linear.cpp lays weights.
//
// A row tile (up to 6 rows of one slot) shrinks into V [rows, C] (float32; bfloat16 rounded, as
// a bfloat16 matmul's output is, for the bfloat16 expand), then expands part by part and adds
// into out. Tiles write disjoint rows of out: threads (the kernels' work pool) take whole tiles.
// AVX-512 only (bfloat16: avx512_bf16); elsewhere lora_delta_available says no and the torch path
// runs.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel_grain.h"
#include "work_pool.h"

namespace pagedserve {

bool lora_delta_available(bool bfloat16) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#elif defined(__AVX512F__)
  return !bfloat16;
#else
  (void)bfloat16;
  return false;
#endif
}

#if defined(__AVX512F__)
namespace {

constexpr int kCols = 16;     // columns per vector
constexpr int kRowTile = 6;   // rows per register tile
constexpr int kGroupTile = 4; // column groups per register tile
constexpr int kMaxC = 1024;   // shrink columns (parts x padded rank) a tile's V may hold

// acc[i][j] += sum over units p of row i's unit p . w's unit p of columns 16j.. (masked: `last`
// the valid columns of group NG-1). X: float (fused multiply-add) or bfloat16 pairs (vdpbf16ps).
template <typename X, int MR, int NG>
inline void mac(const X* const* rows, int64_t units, const uint32_t* w, int64_t unit_stride, __mmask16 last,
                __m512 (&acc)[MR][NG]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < units; ++p) {
    __m512i b[NG];
    for (int j = 0; j < NG; ++j)
      b[j] = _mm512_maskz_loadu_epi32(j == NG - 1 ? last : __mmask16(0xFFFF), w + p * unit_stride + j * kCols);
    for (int i = 0; i < MR; ++i) {
      int32_t unit;
      std::memcpy(&unit, reinterpret_cast<const char*>(rows[i]) + 4 * p, sizeof(unit));
      const __m512i a = _mm512_set1_epi32(unit);
      for (int j = 0; j < NG; ++j) {
        if constexpr (std::is_same_v<X, float>) {
          acc[i][j] = _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b[j]), acc[i][j]);
        } else {
#if defined(__AVX512BF16__)
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)a, (__m512bh)b[j]);
#endif
        }
      }
    }
  }
}

// out rows += acc (columns 16j.., the last group masked), rounded once to the output's dtype.
template <typename X, int MR, int NG>
inline void add_into(X* const* out, __mmask16 last, const __m512 (&acc)[MR][NG]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) {
      const __mmask16 m = j == NG - 1 ? last : __mmask16(0xFFFF);
      X* dst = out[i] + j * kCols;
      if constexpr (std::is_same_v<X, float>) {
        _mm512_mask_storeu_ps(dst, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, dst), acc[i][j]));
      } else {
#if defined(__AVX512BF16__)
        const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, dst)), 16);
        const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(wide), acc[i][j]);
        _mm256_mask_storeu_epi16(dst, m, (__m256i)_mm512_cvtneps_pbh(sum));
#endif
      }
    }
}

// V rows (X: float32, or bfloat16 for the bfloat16 expand) = acc, 16 full columns per group.
template <typename X, int MR, int NG>
inline void store_v(X* v, int64_t ldv, const __m512 (&acc)[MR][NG]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NG; ++j) {
      if constexpr (std::is_same_v<X, float>) {
        _mm512_storeu_ps(v + i * ldv + j * kCols, acc[i][j]);
      } else {
#if defined(__AVX512BF16__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i * ldv + j * kCols), (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
#endif
      }
    }
}

struct Layer {
  int64_t in_units, c, r_units, n, ldx, ldo;
  const uint32_t* a;  // this slot's [in_units, c]
  const uint32_t* b;  // this slot's [r_units, n]
  const std::vector<int64_t>* offsets;
  const std::vector<int64_t>* sizes;
  int64_t rank_stride;  // V columns per part (R)
};

template <typename X, int MR>
void tile(const Layer& L, const X* const* xrows, X* const* orows) {
  alignas(64) X v[MR * kMaxC];
  // shrink: V = x rows . A^T over every part at once
  for (int64_t g = 0; g < L.c; g += kCols * kGroupTile) {
    const int ng = static_cast<int>(std::min<int64_t>(kGroupTile, (L.c - g) / kCols));
    const uint32_t* w = L.a + g;
    switch (ng) {
      case 4: { __m512 acc[MR][4]; mac<X, MR, 4>(xrows, L.in_units, w, L.c, 0xFFFF, acc); store_v<X, MR, 4>(v + g, L.c, acc); break; }
      case 3: { __m512 acc[MR][3]; mac<X, MR, 3>(xrows, L.in_units, w, L.c, 0xFFFF, acc); store_v<X, MR, 3>(v + g, L.c, acc); break; }
      case 2: { __m512 acc[MR][2]; mac<X, MR, 2>(xrows, L.in_units, w, L.c, 0xFFFF, acc); store_v<X, MR, 2>(v + g, L.c, acc); break; }
      default: { __m512 acc[MR][1]; mac<X, MR, 1>(xrows, L.in_units, w, L.c, 0xFFFF, acc); store_v<X, MR, 1>(v + g, L.c, acc); }
    }
  }
  // expand: out[:, part] += V[:, part] . B_part^T, part by part
  for (size_t part = 0; part < L.offsets->size(); ++part) {
    const X* vrows[MR];
    for (int i = 0; i < MR; ++i) vrows[i] = v + i * L.c + part * L.rank_stride;
    const int64_t begin = (*L.offsets)[part], end = begin + (*L.sizes)[part];
    for (int64_t col = begin; col < end; col += kCols * kGroupTile) {
      const int64_t left = end - col;
      const int ng = static_cast<int>(std::min<int64_t>(kGroupTile, (left + kCols - 1) / kCols));
      const int tail = static_cast<int>(std::min<int64_t>(kCols, left - (ng - 1) * kCols));
      const __mmask16 last = static_cast<__mmask16>((1u << tail) - 1);
      const uint32_t* w = L.b + col;
      X* o[MR];
      for (int i = 0; i < MR; ++i) o[i] = orows[i] + col;
      switch (ng) {
        case 4: { __m512 acc[MR][4]; mac<X, MR, 4>(vrows, L.r_units, w, L.n, last, acc); add_into<X, MR, 4>(o, last, acc); break; }
        case 3: { __m512 acc[MR][3]; mac<X, MR, 3>(vrows, L.r_units, w, L.n, last, acc); add_into<X, MR, 3>(o, last, acc); break; }
        case 2: { __m512 acc[MR][2]; mac<X, MR, 2>(vrows, L.r_units, w, L.n, last, acc); add_into<X, MR, 2>(o, last, acc); break; }
        default: { __m512 acc[MR][1]; mac<X, MR, 1>(vrows, L.r_units, w, L.n, last, acc); add_into<X, MR, 1>(o, last, acc); }
      }
    }
  }
}

struct Tile {
  int32_t slot, begin, count;  // rows order[begin .. begin + count) of one slot
};

template <typename X>
void run(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& row_slots,
         int64_t rank_stride, const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes) {
  const int64_t rows = x.size(0), slots = a.size(0);
  const int32_t* slot_of = row_slots.data_ptr<int32_t>();
  // rows grouped by slot (counting sort), then cut into tiles of near-equal size per slot
  std::vector<int32_t> count(slots + 1, 0), order(rows);
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slot_of[t] < slots, "row ", t, " uses slot ", slot_of[t], " of ", slots);
    if (slot_of[t] >= 0) ++count[slot_of[t] + 1];
  }
  for (int64_t s = 0; s < slots; ++s) count[s + 1] += count[s];
  std::vector<int32_t> fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < rows; ++t)
    if (slot_of[t] >= 0) order[fill[slot_of[t]]++] = static_cast<int32_t>(t);
  std::vector<Tile> tiles;
  for (int32_t s = 0; s < slots; ++s) {
    const int32_t n = count[s + 1] - count[s];
    if (n == 0) continue;
    const int32_t pieces = (n + kRowTile - 1) / kRowTile;
    for (int32_t p = 0, at = count[s]; p < pieces; ++p) {
      const int32_t size = (n - (at - count[s])) / (pieces - p);
      tiles.push_back({s, at, size});
      at += size;
    }
  }
  if (tiles.empty()) return;
  Layer base{a.size(1), a.size(2), b.size(1), b.size(2), x.stride(0), out.stride(0), nullptr, nullptr,
             &offsets, &sizes, rank_stride};
  const X* xd = static_cast<const X*>(x.data_ptr());
  X* od = static_cast<X*>(out.data_ptr());
  const auto* ad = static_cast<const uint32_t*>(a.data_ptr());
  const auto* bd = static_cast<const uint32_t*>(b.data_ptr());
  const int64_t per_row = base.in_units * base.c + base.r_units * base.n;  // unit multiply-adds
  pool_for(static_cast<int64_t>(tiles.size()), grain_for(per_row * kRowTile * 16 / kCols), [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const Tile& t = tiles[k];
      Layer L = base;
      L.a = ad + t.slot * base.in_units * base.c;
      L.b = bd + t.slot * base.r_units * base.n;
      const X* xr[kRowTile];
      X* orow[kRowTile];
      for (int i = 0; i < t.count; ++i) {
        xr[i] = xd + order[t.begin + i] * L.ldx;
        orow[i] = od + order[t.begin + i] * L.ldo;
      }
      switch (t.count) {
        case 6: tile<X, 6>(L, xr, orow); break;
        case 5: tile<X, 5>(L, xr, orow); break;
        case 4: tile<X, 4>(L, xr, orow); break;
        case 3: tile<X, 3>(L, xr, orow); break;
        case 2: tile<X, 2>(L, xr, orow); break;
        default: tile<X, 1>(L, xr, orow);
      }
    }
  });
}

}  // namespace
#endif

// out [T, N] += each row's adapter delta (see the top of this file); x [T, in]; a, b: the packed
// stacks; row_slots int32 [T] (-1: no adapter); parts: (offsets[i], sizes[i]) of out's columns,
// V columns part * rank_stride ...
void lora_delta_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& row_slots, int64_t rank_stride, const std::vector<int64_t>& offsets,
                 const std::vector<int64_t>& sizes) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(lora_delta_available(bf16), "lora_delta_ for ", x.scalar_type(), " needs AVX-512",
              bf16 ? " with avx512_bf16" : "");
  TORCH_CHECK((bf16 || x.scalar_type() == at::kFloat) && out.scalar_type() == x.scalar_type(),
              "x and out: float32 or bfloat16 alike");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.stride(1) == 1 && out.stride(1) == 1,
              "x [T, in], out [T, N]: unit column strides");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.scalar_type() == at::kInt && b.scalar_type() == at::kInt &&
              a.is_contiguous() && b.is_contiguous() && a.size(0) == b.size(0), "a, b: the packed stacks (int32)");
  const int64_t w = bf16 ? 2 : 1;
  TORCH_CHECK(a.size(1) * w == x.size(1) && a.size(2) % 16 == 0 && a.size(2) <= 1024 && b.size(2) == out.size(1),
              "a [slots, in / W, C (multiple of 16, at most 1024)], b [slots, R / W, N]");
  TORCH_CHECK(row_slots.scalar_type() == at::kInt && row_slots.is_contiguous() && row_slots.size(0) == x.size(0),
              "row_slots: int32 [T]");
  TORCH_CHECK(offsets.size() == sizes.size() && rank_stride == b.size(1) * w, "parts and rank do not match");
  for (size_t p = 0; p < offsets.size(); ++p)
    TORCH_CHECK(offsets[p] >= 0 && offsets[p] + sizes[p] <= out.size(1) &&
                static_cast<int64_t>(p + 1) * rank_stride <= a.size(2), "part ", p, " out of range");
#if defined(__AVX512F__)
  if (bf16) run<c10::BFloat16>(out, x, a, b, row_slots, rank_stride, offsets, sizes);
  else run<float>(out, x, a, b, row_slots, rank_stride, offsets, sizes);
#endif
}

}  // namespace pagedserve
