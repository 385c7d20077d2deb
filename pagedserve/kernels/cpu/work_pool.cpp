// The kernels' thread pool (work_pool.h). One region at a time, published as:
//
//   region_   what to run: fn, ctx, n, chunk (written by the caller before it bumps `generation_`)
//   tickets_  (generation << 32) | chunks not yet claimed; a thread claims the next chunk (in
//             order: chunk count - left) by a compare-exchange that also checks the generation, so
//             a thread still holding an old generation can never claim (or read the region of) a
//             newer one
//   done_     chunks finished in this region; the caller returns once it equals the chunk count
//
// Invariant: while any chunk of a region is claimed and not done, the caller has not returned, so
// the region (and the ctx it points to) is alive for whoever claimed it. A thread that finds no
// chunk left touches nothing of the region. Sleeping uses futexes on `generation_` (workers) and
// `done_` (the caller), each after a short spin.
#include "work_pool.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <vector>

namespace pagedserve {
namespace {

void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

// How long a thread spins before it sleeps: long enough to span the Python between two kernels of a
// step (tens of microseconds), short enough not to hold a core the front end needs between steps;
// none under OMP_WAIT_POLICY=passive (the worker's --omp-wait-policy passive), as OpenMP's threads.
std::chrono::microseconds spin_time() {
  static const auto spin = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    const bool passive = policy && (std::string(policy) == "passive" || std::string(policy) == "PASSIVE");
    return std::chrono::microseconds(passive ? 0 : 100);
  }();
  return spin;
}

// Spins until pred() or spin_time() has passed; returns pred(). The spin yields the core every 16
// rounds: torch's own ops still run on OpenMP's threads, which spin after their regions too, and a
// pool thread that spun without yielding held the core OpenMP's thread needed (in-process W64 ran
// 0.80x with OpenMP's default spin, 0.94x with GOMP_SPINCOUNT=20000).
template <typename P>
bool spin_until(P&& pred) {
  const auto until = std::chrono::steady_clock::now() + spin_time();
  for (int i = 1;; ++i) {
    if (pred()) return true;
    if ((i & 15) == 0) sched_yield();
    else _mm_pause();
    if ((i & 63) == 0 && std::chrono::steady_clock::now() > until) return pred();
  }
}

thread_local bool t_in_region = false;  // this thread is running a chunk (nested calls run inline)

class Pool {
 public:
  // Runs the region; false when it cannot here (busy with another caller's region, or nested).
  bool run(int64_t n, int64_t chunk, int64_t threads, ChunkFn fn, void* ctx) {
    if (t_in_region) return false;
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    grow(threads - 1);
    const int64_t chunks = (n + chunk - 1) / chunk;
    region_ = Region{fn, ctx, n, chunk};
    active_workers_.store(threads - 1, std::memory_order_relaxed);
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    const uint32_t gen = generation_.load(std::memory_order_relaxed) + 1;
    tickets_.store((uint64_t{gen} << 32) | static_cast<uint64_t>(chunks), std::memory_order_release);
    // seq_cst on both sides (here: store, then load sleepers_; a worker: add to sleepers_, then load
    // the generation): either the worker sees the new generation or this sees the sleeper.
    generation_.store(gen, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&generation_);
    work(gen);
    const auto all = static_cast<uint32_t>(chunks);
    if (!spin_until([&] { return done_.load(std::memory_order_acquire) == all; })) {
      caller_sleeping_.store(true, std::memory_order_seq_cst);
      for (uint32_t d; (d = done_.load(std::memory_order_seq_cst)) != all;) futex_wait(&done_, d);
      caller_sleeping_.store(false, std::memory_order_relaxed);
    }
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  void after_fork_in_child() {  // the threads did not come along; their slots are empty again
    new (&mutex_) std::mutex();
    workers_ = 0;
    sleepers_.store(0);
  }

 private:
  struct Region {
    ChunkFn fn;
    void* ctx;
    int64_t n, chunk;
  };

  void grow(int64_t want) {
    // A new thread starts from the generation before the region about to be published, so it takes
    // part in that region too.
    const uint32_t seen = generation_.load(std::memory_order_relaxed);
    for (; workers_ < want; ++workers_) std::thread([this, index = workers_, seen] { loop(index, seen); }).detach();
  }

  void loop(int64_t index, uint32_t seen) {
    for (;;) {
      if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while (generation_.load(std::memory_order_seq_cst) == seen) futex_wait(&generation_, seen);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = generation_.load(std::memory_order_acquire);
      // The region may already be over and a newer one published: work() checks the generation
      // inside the ticket before reading anything of it.
      work(seen, index);
    }
  }

  // Claims and runs chunks of generation `gen` until none is left. index: the pool thread's (-1:
  // the caller); pool thread i takes part when the region asked for more than i + 1 threads (read
  // racily: a newer region's count only makes a thread join or sit out, and the caller runs
  // whatever nobody claimed).
  void work(uint32_t gen, int64_t index = -1) {
    if (index >= active_workers_.load(std::memory_order_relaxed)) return;
    for (;;) {
      uint64_t t = tickets_.load(std::memory_order_acquire);
      if ((t >> 32) != gen || (t & 0xffffffffu) == 0) return;
      if (!tickets_.compare_exchange_weak(t, t - 1, std::memory_order_acq_rel)) continue;
      const Region r = region_;  // safe: our claimed chunk keeps the caller in this region
      const auto total = static_cast<uint32_t>((r.n + r.chunk - 1) / r.chunk);
      const int64_t c = total - static_cast<int64_t>(t & 0xffffffffu);  // chunks go out in order
      const int64_t begin = c * r.chunk, end = std::min(r.n, begin + r.chunk);
      t_in_region = true;
      try {
        r.fn(r.ctx, begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> g(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      t_in_region = false;
      if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == total &&
          caller_sleeping_.load(std::memory_order_seq_cst))
        futex_wake_all(&done_);
    }
  }

  std::mutex mutex_;        // one region at a time
  std::mutex error_mutex_;  // first exception of a region
  Region region_{};
  std::exception_ptr error_;
  std::atomic<uint64_t> tickets_{0};
  std::atomic<uint32_t> generation_{0}, done_{0}, sleepers_{0};
  std::atomic<bool> caller_sleeping_{false};
  std::atomic<int64_t> active_workers_{0};  // pool threads the current region asked for
  int64_t workers_ = 0;  // pool threads made so far (only the caller holding mutex_ grows it)
};

Pool& pool() {
  static Pool* p = [] {
    auto* made = new Pool();  // never destroyed: its threads outlive static destructors
    pthread_atfork(nullptr, nullptr, [] { pool().after_fork_in_child(); });
    return made;
  }();
  return *p;
}

// Off unless PAGEDSERVE_WORK_POOL=1 when the kernels load: the serving worker sets it (its
// --cpu-kernel-threads pool); the in-process engine keeps OpenMP (worker/main.py says why).
std::atomic<bool> g_disabled{[] {
  const char* on = std::getenv("PAGEDSERVE_WORK_POOL");
  return !(on && std::string(on) == "1");
}()};

bool disabled() { return g_disabled.load(std::memory_order_relaxed); }

}  // namespace

bool set_work_pool(bool on) { return !g_disabled.exchange(!on); }

int64_t pool_threads() { return at::get_num_threads(); }

void run_chunks(int64_t n, int64_t chunk, int64_t threads, ChunkFn fn, void* ctx) {
  if (n <= 0) return;
  if (threads <= 1 || at::in_parallel_region()) return fn(ctx, 0, n);  // one thread, or nested in OpenMP
  if (disabled()) {
    at::parallel_for(0, n, (n + threads - 1) / threads, [&](int64_t begin, int64_t end) { fn(ctx, begin, end); });
    return;
  }
  if (!pool().run(n, chunk, threads, fn, ctx)) fn(ctx, 0, n);  // a region is running (nested, or another caller)
}

// For the tests: items [0, n) in chunks on the pool; each item records 1 if a pool thread ran it (0:
// the caller) and how often it ran. A chunk sleeps sleep_us first; the chunk holding item throw_at
// throws; nested: each chunk runs a region of its own (it must run inline).
std::tuple<at::Tensor, at::Tensor> work_pool_probe(int64_t n, int64_t chunk, int64_t threads, int64_t sleep_us,
                                                   int64_t throw_at, bool nested) {
  auto by_pool = at::zeros({n}, at::kLong), runs = at::zeros({n}, at::kLong);
  auto* pool_flag = by_pool.data_ptr<int64_t>();
  auto* counts = runs.data_ptr<int64_t>();
  const auto caller = std::this_thread::get_id();
  pool_run(n, chunk, threads, [&](int64_t begin, int64_t end) {
    if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    if (throw_at >= begin && throw_at < end) throw std::runtime_error("chunk " + std::to_string(begin) + " failed");
    const bool inner_inline = [&] {
      if (!nested) return true;
      std::thread::id ran_on;
      pool_run(1, 1, threads, [&](int64_t, int64_t) { ran_on = std::this_thread::get_id(); });
      return ran_on == std::this_thread::get_id();
    }();
    for (int64_t i = begin; i < end; ++i) {
      pool_flag[i] = std::this_thread::get_id() != caller;
      counts[i] += inner_inline ? 1 : 100;  // a nested region that left this thread shows as 100
    }
  });
  return {by_pool, runs};
}

}  // namespace pagedserve
