// Fused element-wise steps of a decoder layer. As separate torch ops each one allocates a fresh
// tensor and makes its own pass over memory; on the CPU those passes cost a fifth of a step.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "simd.h"
#include "work_pool.h"

namespace pagedserve {

// out[t, :] = silu(x[t, :I]) * x[t, I:], the gated MLP's activation on the merged gate_up output.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x must be a contiguous [T, 2I] tensor");
  const int64_t tokens = x.size(0), inter = x.size(1) / 2;
  auto out = at::empty({tokens, inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* src = x.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    // ~16 multiply-add equivalents per element (an exp): decode batches stay on one thread
    pool_for(tokens, grain_for(16 * inter, 16), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = src + t * 2 * inter;
        const scalar_t* u = g + inter;
        scalar_t* o = dst + t * inter;
        int64_t i = 0;
        for (; i + kLanes <= inter; i += kLanes) {
          const vfloat gv = load_f(g + i);
          store_f(o + i, gv / (1.0f + exp_v(vfloat{} - gv)) * load_f(u + i));
        }
        for (; i < inter; ++i) {
          const float gf = static_cast<float>(g[i]);
          o[i] = static_cast<scalar_t>(gf / (1.0f + std::exp(-gf)) * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}

// Rotary embedding in place on q [T, H, D] and k [T, KVH, D] (views into the qkv output are
// fine: rows may be strided), HF's rotate-half convention, tables [positions, D] in float32.
void rotary_inplace(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "q, k: [T, heads, D] rows");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "float32 tables");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions: int64");
  const int64_t tokens = q.size(0), dim = q.size(2), half = dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* ctab = cos.data_ptr<float>();
  const float* stab = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_inplace", [&] {
    auto rotate = [&](scalar_t* base, int64_t t, int64_t heads, int64_t token_stride, int64_t head_stride) {
      const float* c = ctab + pos[t] * dim;
      const float* s = stab + pos[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* x = base + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          x[i] = static_cast<scalar_t>(x1 * c[i] - x2 * s[i]);
          x[i + half] = static_cast<scalar_t>(x2 * c[i + half] + x1 * s[i + half]);
        }
      }
    };
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const int64_t per_token = 8 * (q.size(1) + k.size(1)) * dim;  // ~8 per element
    pool_for(tokens, grain_for(per_token, 16), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate(qp, t, q.size(1), q.stride(0), q.stride(1));
        rotate(kp, t, k.size(1), k.stride(0), k.stride(1));
      }
    });
  });
}

}  // namespace pagedserve

namespace pagedserve {

// y[M, N] = x[M, K] @ w[N, K]^T in float32 for decode-sized M. MKL's sgemm runs such shapes at a
// fraction of the memory bandwidth; here each weight row is streamed once and reused from L1
// for four input rows at a time. V: the float vector type (the widest that divides K).
template <typename V>
void small_m_rows(const float* xp, const float* wp, float* yp, int64_t rows, int64_t inner, int64_t outs) {
  constexpr int lanes = sizeof(V) / 4;
  auto load = [](const float* p) { V v; __builtin_memcpy(&v, p, sizeof(v)); return v; };
  // a float32 multiply-add weighs ~4 of the int8 kernels' (8 lanes against VNNI's 32 per instruction)
  pool_for(outs, grain_for(4 * rows * inner, 16), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* wr = wp + n * inner;
      int64_t m = 0;
      for (; m + 4 <= rows; m += 4) {
        const float* x0 = xp + m * inner;
        V a0{}, a1{}, a2{}, a3{};
        for (int64_t k = 0; k < inner; k += lanes) {
          const V wv = load(wr + k);
          a0 += load(x0 + k) * wv;
          a1 += load(x0 + inner + k) * wv;
          a2 += load(x0 + 2 * inner + k) * wv;
          a3 += load(x0 + 3 * inner + k) * wv;
        }
        yp[m * outs + n] = hsum(a0);
        yp[(m + 1) * outs + n] = hsum(a1);
        yp[(m + 2) * outs + n] = hsum(a2);
        yp[(m + 3) * outs + n] = hsum(a3);
      }
      for (; m < rows; ++m) {
        const float* x0 = xp + m * inner;
        V a0{};
        for (int64_t k = 0; k < inner; k += lanes) a0 += load(x0 + k) * load(wr + k);
        yp[m * outs + n] = hsum(a0);
      }
    }
  });
}

at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.is_contiguous() && w.is_contiguous(), "contiguous 2-D x and w");
  TORCH_CHECK(x.size(1) == w.size(1) && x.size(1) % 8 == 0, "K must match and be a multiple of 8");
  const int64_t rows = x.size(0), inner = x.size(1), outs = w.size(0);
  auto y = at::empty({rows, outs}, x.options());
  if (inner % kLanes == 0) {
    small_m_rows<vfloat>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, inner, outs);
  } else {
    small_m_rows<vfloat8>(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, inner, outs);
  }
  return y;
}

}  // namespace pagedserve

namespace pagedserve {

// transformers' LlamaRMSNorm in one pass per row: weight * to_dtype(x * rsqrt(mean(x^2) + eps)),
// the statistics in float32. With `residual`: residual += x first (rounded to the dtype, as
// `hidden + out` is) and the sum is normalised, so a layer's residual add and its next norm read
// the row once instead of six times. As separate torch ops on bfloat16 rows these cost a tenth
// of a step.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, c10::optional<at::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "weight must be [hidden] in x's dtype");
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == x.scalar_type(), "residual must match x");
  }
  const int64_t tokens = x.size(0), hidden = x.size(1);
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const float feps = static_cast<float>(eps);
    pool_for(tokens, grain_for(8 * hidden, 16), [&](int64_t begin, int64_t end) {  // ~8 per element
      std::vector<float> row(hidden);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* src = xp + t * hidden;
        scalar_t* res = rp != nullptr ? rp + t * hidden : nullptr;
        float* f = row.data();
        // Pass 1: the row (residual += x first, rounded to the dtype as `hidden + out` is) into
        // float, and its sum of squares; values stay in registers between the steps.
        vfloat squares{};
        int64_t i = 0;
        for (; i + kLanes <= hidden; i += kLanes) {
          vfloat v = load_f(src + i);
          if (res != nullptr) {
            v = round_to<scalar_t>(load_f(res + i) + v);
            store_f(res + i, v);
          }
          store_v(f + i, v);
          squares += v * v;
        }
        float total = hsum(squares);
        for (; i < hidden; ++i) {
          float v = static_cast<float>(src[i]);
          if (res != nullptr) {
            res[i] = static_cast<scalar_t>(static_cast<float>(res[i]) + v);
            v = static_cast<float>(res[i]);
          }
          f[i] = v;
          total += v * v;
        }
        const float inv = 1.0f / std::sqrt(total / static_cast<float>(hidden) + feps);
        scalar_t* dst = op + t * hidden;
        // Pass 2: the normalised row rounded to the dtype before the weight multiplies it, as
        // transformers does.
        for (i = 0; i + kLanes <= hidden; i += kLanes)
          store_f(dst + i, load_f(wp + i) * round_to<scalar_t>(load_v(f + i) * inv));
        for (; i < hidden; ++i) {
          const scalar_t normed = static_cast<scalar_t>(f[i] * inv);
          dst[i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(normed));
        }
      }
    });
  });
  return out;
}

}  // namespace pagedserve
