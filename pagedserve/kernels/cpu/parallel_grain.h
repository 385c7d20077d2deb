// How finely the CPU kernels split their work across OpenMP threads.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pagedserve {

// The least work one thread of a parallel region must get, in multiply-adds of the int8 matmul
// kernels (~16 G/s on one core here; other ops weigh their items in the same unit). Waking a
// sleeping OpenMP thread costs tens of microseconds to ~0.1 ms on a VM (a futex and an
// inter-processor interrupt): with the worker's passive wait policy a one-stream decode step took
// 15-16 ms when every matmul woke the other thread, ~10 ms when only the LM head did (2 cores,
// docs/performance.md). A region of at most this much work runs on the calling thread alone.
constexpr int64_t kMinWorkPerThread = 4'000'000;

// The grain (pool_for's or at::parallel_for's) for items of `work_per_item` each: at least `floor`
// items per thread.
inline int64_t grain_for(int64_t work_per_item, int64_t floor = 1) {
  return std::max<int64_t>(floor, kMinWorkPerThread / std::max<int64_t>(1, work_per_item));
}

}  // namespace pagedserve
