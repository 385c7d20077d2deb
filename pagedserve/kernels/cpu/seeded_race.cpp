// The few tokens that can win a seeded row's exponential race, found without a logarithm a token.
//
// A seeded row draws argmax_i p_i / q_i with q_i = float32(-log(u_i)), u_i from splitmix64 of (key, i)
// (worker/seeded_draws.py gives the scheme; worker/sampler.py the race). The full form hashes every
// token, takes 49k float64 logarithms and divides: ~30 ms for 64 rows on a Xeon, ~125 on a Zen 1
// EPYC. Since 1 - u <= -log(u) <= (1 - u) / u for u in (0, 1):
//   - every ratio is at least p_i u_i / (1 - u_i) (up to the roundings of q and of the division), so
//     L = (1 - 1e-6) max_i p_i u_i / (1 - u_i) is at most the winning ratio;
//   - a token's ratio is at most p_i / (1 - u_i) (the same roundings), so a token with
//     p_i (1 + 1e-6) < L (1 - u_i) has a ratio below the winner's: it can neither win nor tie.
// The margins cover the float32 rounding of q (2^-24 relative), the division's (2^-24) and the
// logarithm's last bits many times over. What is left (about one token a row beside the winner: the
// winner's u is near 1, where both bounds meet) goes back to Python with its u, which takes numpy's
// logarithm of exactly those u, as the full form did of all of them: the same q, the same ratios,
// the same token bit for bit (tests/test_seeded_draws.py compares the two on many rows).
//
// u is computed here as seeded_draws.py computes it: splitmix64's output number i + 1 from the key,
// its top 52 bits as m, u = 1 + m 2^-52 - (1 - 2^-53), exact in float64. 1 - u is exact too.
// Threads: the kernels' pool, a row per item; each row's candidates in its own list.
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "parallel_grain.h"
#include "work_pool.h"

namespace pagedserve {

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull, kM1 = 0xBF58476D1CE4E5B9ull, kM2 = 0x94D049BB133111EBull;
constexpr uint64_t kOneBits = 0x3FF0000000000000ull;
constexpr double kLow = 1.0 - 1e-6, kHigh = 1.0 + 1e-6;

inline double uniform(uint64_t key, int64_t i) {
  uint64_t x = key + static_cast<uint64_t>(i + 1) * kGolden;
  x = (x ^ (x >> 30)) * kM1;
  x = (x ^ (x >> 27)) * kM2;
  x ^= x >> 31;
  const uint64_t bits = (x >> 12) | kOneBits;
  double d;
  std::memcpy(&d, &bits, sizeof(d));
  return d - (1.0 - 0x1p-53);
}

// Row r's candidates (token, u) appended to index / draws. NaN probabilities are kept as candidates
// (the race's argmax answers the first NaN, as torch's does).
void row_candidates(const float* p, int64_t n, uint64_t key, std::vector<double>& u, std::vector<int64_t>& index,
                    std::vector<double>& draws) {
  u.resize(n);
  double bound = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double ui = uniform(key, i);
    u[i] = ui;
    const double low = static_cast<double>(p[i]) * ui / (1.0 - ui);
    bound = low > bound ? low : bound;
  }
  bound *= kLow;
  for (int64_t i = 0; i < n; ++i) {
    const double pi = static_cast<double>(p[i]);
    if (!(pi * kHigh < bound * (1.0 - u[i]))) {
      index.push_back(i);
      draws.push_back(u[i]);
    }
  }
}

}  // namespace

// probs [rows, n] float32 (each row a distribution), keys [rows] int64 -> (counts [rows] int64,
// index [C] int64 token ids, u [C] float64), the candidates row after row in token order.
std::tuple<at::Tensor, at::Tensor, at::Tensor> seeded_race_candidates(const at::Tensor& probs, const at::Tensor& keys) {
  TORCH_CHECK(probs.dim() == 2 && probs.is_contiguous() && probs.scalar_type() == at::kFloat,
              "probs must be a contiguous float32 [rows, n] tensor");
  TORCH_CHECK(keys.dim() == 1 && keys.is_contiguous() && keys.scalar_type() == at::kLong && keys.size(0) == probs.size(0),
              "keys must be a contiguous int64 [rows] tensor, one key a row of probs");
  const int64_t rows = probs.size(0), n = probs.size(1);
  const float* pp = probs.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> index(rows);
  std::vector<std::vector<double>> draws(rows);
  pool_for(rows, grain_for(16 * n), [&](int64_t begin, int64_t end) {
    std::vector<double> u;
    for (int64_t r = begin; r < end; ++r)
      row_candidates(pp + r * n, n, static_cast<uint64_t>(kp[r]), u, index[r], draws[r]);
  });
  int64_t total = 0;
  for (const auto& row : index) total += static_cast<int64_t>(row.size());
  auto counts = at::empty({rows}, at::kLong);
  auto out_index = at::empty({total}, at::kLong);
  auto out_u = at::empty({total}, at::kDouble);
  int64_t at = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t c = static_cast<int64_t>(index[r].size());
    counts.data_ptr<int64_t>()[r] = c;
    std::memcpy(out_index.data_ptr<int64_t>() + at, index[r].data(), c * sizeof(int64_t));
    std::memcpy(out_u.data_ptr<double>() + at, draws[r].data(), c * sizeof(double));
    at += c;
  }
  return {counts, out_index, out_u};
}

}  // namespace pagedserve
