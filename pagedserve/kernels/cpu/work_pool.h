// A parallel-for whose caller never waits for a thread that has not started: the kernels' own
// thread pool, for the worker that shares its cores with the front-end services.
//
// Why not at::parallel_for (OpenMP): an OpenMP region splits its items among its threads up front
// and ends in a barrier, so when another process holds one core at the moment a region starts, the
// region lasts until that process lets go, while the other core idles at the barrier. On two cores
// a synthetic front end using 21% of one core (1 ms bursts) slowed in-process W64 by 25-40%, not
// the ~11% it takes from the machine (docs/performance.md). Here the items are cut into chunks that
// threads claim from one atomic counter: a thread that is late finds nothing left and does nothing,
// and the caller waits only for chunks that were claimed.
//
// Threads: the calling thread plus at::get_num_threads() - 1 pool threads (made on first use and
// never destroyed). One region at a time: a second thread that calls while a region runs, or a
// call from inside a region, runs its items itself. Workers spin ~0.1 ms after a region, then sleep
// on a futex. A child made by fork() starts without pool threads (the caller does every chunk until
// it makes new ones).
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>

namespace pagedserve {

using ChunkFn = void (*)(void* ctx, int64_t begin, int64_t end);

// Runs fn(ctx, begin, end) over [0, n) in chunks of `chunk` items on up to `threads` threads
// (the caller included); returns when every chunk is done, rethrowing the first exception a chunk
// threw. The pool is used when PAGEDSERVE_WORK_POOL=1 at load or after set_work_pool(true); else
// the items go to at::parallel_for (OpenMP) as before.
void run_chunks(int64_t n, int64_t chunk, int64_t threads, ChunkFn fn, void* ctx);

// at::parallel_for's use (body(begin, end) over disjoint runs covering [0, n); as many threads as
// at::parallel_for would take: min(at::get_num_threads(), n / grain)), run on the pool in chunks of
// about a quarter of a thread's share (at least a quarter grain), rounded up to `align` items, so a
// late thread's share is taken by the others. One thread: body(0, n) on the caller.
template <typename F>
void pool_for(int64_t n, int64_t grain, F&& body, int64_t align = 1);

int64_t pool_threads();  // at::get_num_threads(): what pool_for may use

// Turns the pool on or off (off: OpenMP), e.g. for A/B measurements in one process; returns
// whether it was on.
bool set_work_pool(bool on);

// body(begin, end) over [0, n) in chunks of `chunk` items (the last may be shorter), handed out in
// order, on up to `threads` threads (the caller included); off the pool (OpenMP, or a nested call)
// the runs are larger.
template <typename F>
void pool_run(int64_t n, int64_t chunk, int64_t threads, F&& body) {
  using Fn = std::remove_reference_t<F>;
  run_chunks(n, chunk, threads, [](void* ctx, int64_t begin, int64_t end) { (*static_cast<Fn*>(ctx))(begin, end); },
             const_cast<void*>(static_cast<const void*>(std::addressof(body))));
}

template <typename F>
void pool_for(int64_t n, int64_t grain, F&& body, int64_t align) {
  if (n <= 0) return;
  grain = grain < 1 ? 1 : grain;
  int64_t threads = (n + grain - 1) / grain;
  const int64_t most = pool_threads();
  if (threads > most) threads = most;
  if (threads <= 1) {
    body(int64_t{0}, n);
    return;
  }
  int64_t chunk = (n + 4 * threads - 1) / (4 * threads);
  if (chunk < grain / 4) chunk = grain / 4 < n ? grain / 4 : n;  // not finer than a quarter grain
  if (align > 1) chunk = (chunk + align - 1) / align * align;
  if (chunk < 1) chunk = 1;
  pool_run(n, chunk, threads, std::forward<F>(body));
}

}  // namespace pagedserve
