// Splitting a kernel's output columns over the calling thread and XLA's intra-op pool (the
// FFI's ThreadPool context): chunks of whole tiles claimed from an atomic counter, so a
// thread that starts late or runs slowly hands its share over, for any kernel that
// computes columns [c0, c1) independently (quant_matmul.cc's comments give the
// measurements behind the constants).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace xlm {

template <class Compute>
struct ColumnJob {
  Compute compute;
  int64_t n = 0;
  int64_t chunk_cols = 0;
  int64_t num_chunks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  explicit ColumnJob(Compute c) : compute(std::move(c)) {}

  // Computes unclaimed chunks until none is left; returns how many it computed.
  int64_t run() {
    for (int64_t count = 0;; ++count) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= num_chunks) return count;
      compute(c * chunk_cols, std::min(n, (c + 1) * chunk_cols));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

using SplitClock = std::chrono::steady_clock;

// A small call gains little from more threads, and a many-core host should not spin
// all of its cores through a decode.
constexpr int64_t kMaxSpinHelpers = 7;

// Helper threads of the kernels' own that spin for a while between jobs. XLA's intra-op
// pool parks its threads soon after their last task, and a parked thread started ~40 us
// after Schedule here (a spinning one ~0.3 us): a decode step makes ~200 kernel calls of
// 20-300 us each with a few us of XLA fusions between them, so a helper woken per call
// joins late in most of them. These stay awake XLM_CPU_SPIN_US microseconds (default
// 200; 0: off, every split goes to XLA's pool) after their last job, yielding the core
// between polls (a runnable thread, the engine's host loop, gets it), then sleep until
// the next. Only small calls use them (kSpinMaxWork: decode-sized, where a late helper
// costs a large part of the call); a batch's long calls wake XLA's pool as before, so
// the helpers sleep through them rather than spin beside the engine's host thread. One
// call holds them at a time; a call that finds them held schedules on XLA's pool.
class SpinHelpers {
 public:
  // The process's helpers (XLA's pool size - 1 of them, at most kMaxSpinHelpers, made on
  // first use); null when XLM_CPU_SPIN_US=0 or the pool has one thread.
  static SpinHelpers* Get(int64_t pool_threads) {
    static SpinHelpers* helpers = [pool_threads]() -> SpinHelpers* {
      const char* env = std::getenv("XLM_CPU_SPIN_US");
      const double spin_us = env != nullptr && *env != '\0' ? std::atof(env) : 200.0;
      if (spin_us <= 0 || pool_threads < 2) return nullptr;
      // Lives as long as the process.
      return new SpinHelpers(std::min<int64_t>(pool_threads - 1, kMaxSpinHelpers),
                             static_cast<int64_t>(spin_us));
    }();
    return helpers;
  }

  int64_t size() const { return static_cast<int64_t>(threads_.size()); }

  // Runs `task` on `count` (<= size()) helpers and returns true, unless another call holds
  // them (false: nothing posted). The caller calls Release() once its job is done.
  bool Post(int64_t count, std::shared_ptr<std::function<void()>> task) {
    bool expected = false;
    if (!held_.compare_exchange_strong(expected, true, std::memory_order_acquire)) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = std::move(task);
    tickets_.store(count, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    if (sleepers_ > 0) wake_.notify_all();
    return true;
  }

  void Release() { held_.store(false, std::memory_order_release); }

 private:
  SpinHelpers(int64_t count, int64_t spin_us) : spin_(std::chrono::microseconds(spin_us)) {
    for (int64_t t = 0; t < count; ++t) threads_.emplace_back([this] { Loop(); });
    for (auto& thread : threads_) thread.detach();
  }

  void Loop() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      const auto idle_since = SplitClock::now();
      while (generation_.load(std::memory_order_acquire) == seen) {
        for (int i = 0; i < 32; ++i) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
        }
        std::this_thread::yield();
        if (SplitClock::now() - idle_since > spin_) {
          std::unique_lock<std::mutex> lock(mutex_);
          ++sleepers_;
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          --sleepers_;
        }
      }
      std::shared_ptr<std::function<void()>> task;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        seen = generation_.load(std::memory_order_acquire);
        task = task_;
      }
      if (task && tickets_.fetch_sub(1, std::memory_order_acq_rel) > 0) (*task)();
    }
  }

  const SplitClock::duration spin_;
  std::vector<std::thread> threads_;
  std::atomic<bool> held_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> tickets_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  int64_t sleepers_ = 0;  // guarded by mutex_
  std::shared_ptr<std::function<void()>> task_;  // guarded by mutex_
};

// Calls of up to kSpinMaxRows rows (tokens) and kSpinMaxWork multiply-adds (or the like)
// use the spinning helpers: a layer's projections at one row of SmolLM2 are 0.1-1.8 M,
// its attention 0.1-1 M; its LM head (28 M a row) and a batch's calls take XLA's pool.
// Without the row bound (32 M alone), a batch of 64's attention and q/k/v/o calls kept
// the helpers spinning through its steps beside the engine's busy host thread: batch-64
// decode measured 5-15% slower, where one request gained 8-15%.
constexpr int64_t kSpinMaxRows = 8;
constexpr int64_t kSpinMaxWork = int64_t{1} << 22;

// Holds the spinning helpers for one call (none when the call went to XLA's pool) and
// releases them when it goes out of scope, after the caller has waited for its job.
class HelperLease {
 public:
  explicit HelperLease(SpinHelpers* held = nullptr) : held_(held) {}
  HelperLease(const HelperLease&) = delete;
  HelperLease& operator=(const HelperLease&) = delete;
  ~HelperLease() {
    if (held_ != nullptr) held_->Release();
  }

 private:
  SpinHelpers* held_;
};

// Runs job->run() on `helpers` more threads: the spinning helpers when the call is small
// (`rows`, `work`) and they are free, else XLA's pool. Keep the lease until the job is
// done.
template <class Job>
[[nodiscard]] std::unique_ptr<HelperLease> StartHelpers(xla::ffi::ThreadPool& pool,
                                                        int64_t helpers,
                                                        const std::shared_ptr<Job>& job,
                                                        int64_t rows, int64_t work) {
  const bool small = rows <= kSpinMaxRows && work <= kSpinMaxWork;
  SpinHelpers* spin = small ? SpinHelpers::Get(pool.num_threads()) : nullptr;
  // More workers than helpers: the helpers alone (the chunks are claimed, so fewer threads
  // only take more chunks each).
  if (spin != nullptr && spin->Post(std::min(helpers, spin->size()),
                                    std::make_shared<std::function<void()>>([job] { job->run(); }))) {
    return std::make_unique<HelperLease>(spin);
  }
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { job->run(); });
  return std::make_unique<HelperLease>();
}
// After waiting on a descheduled helper, calls run on the caller alone until this time.
inline std::atomic<SplitClock::rep> g_split_single_until{0};

// How long calls run alone after such a wait: XLM_CPU_SPLIT_BACKOFF_US (default 2000) at
// first, doubled each time the first split after a backoff waits again (sustained load:
// other processes hold the cores), at most 100 ms; back to the base after a split that
// did not wait. In a one-request decode the helper is mostly descheduled by the engine's
// own host thread, whose work between steps takes a few ms: a fixed 100 ms (before) kept
// ~5 steps single-threaded after each such burst. One request, alternating processes:
// bfloat16 47.5 -> 49.8 tok/s, w8a8 60.0 -> 62.0, and 36.3 -> 38.8 (bfloat16) with a busy
// process beside (RESULTS.md, session 14).
class SplitBackoff {
 public:
  static SplitBackoff& Get() {
    static SplitBackoff backoff;
    return backoff;
  }

  // A split waited too long: run alone for the current backoff, and double it.
  void Waited() {
    const int64_t us = std::max(current_us_.load(std::memory_order_relaxed), base_us_);
    const SplitClock::time_point until = SplitClock::now() + std::chrono::microseconds(us);
    g_split_single_until.store(until.time_since_epoch().count(), std::memory_order_relaxed);
    current_us_.store(std::min(2 * us, kMaxUs), std::memory_order_relaxed);
  }

  // A split finished without waiting: the next wait backs off for the base again.
  void Finished() {
    if (current_us_.load(std::memory_order_relaxed) != base_us_) {
      current_us_.store(base_us_, std::memory_order_relaxed);
    }
  }

 private:
  static constexpr int64_t kDefaultBaseUs = 2000;
  static constexpr int64_t kMaxUs = 100000;

  static int64_t BaseFromEnv() {
    const char* env = std::getenv("XLM_CPU_SPLIT_BACKOFF_US");
    const int64_t us = env != nullptr && *env != '\0' ? std::atoll(env) : kDefaultBaseUs;
    return std::clamp<int64_t>(us, 0, kMaxUs);
  }

  SplitBackoff() : base_us_(BaseFromEnv()), current_us_(base_us_) {}

  const int64_t base_us_;
  std::atomic<int64_t> current_us_;
};

inline double split_seconds_since(SplitClock::time_point t) {
  return std::chrono::duration<double>(SplitClock::now() - t).count();
}

// RunColumns' chunks a worker unless a caller chooses (a late thread's share is taken over
// in quarters).
constexpr int64_t kDefaultChunksPerWorker = 4;

// compute(c0, c1) over [0, n) in chunks of `tile_cols`-column tiles, on up to max_workers
// threads (0: all of the pool's, plus the caller); `work` (multiply-adds over `rows` rows
// of input) below ~10 us of one core runs on the caller alone. `chunks_per_worker`
// chunks a worker (fewer: longer runs of columns; more: a late thread's share is taken
// over in smaller pieces). `page_tiles` > 0 (tall weights): chunks at least that many
// tiles wide where the balance allows, since every row of a chunk is a page walk.
template <class Compute>
void RunColumns(xla::ffi::ThreadPool& pool, int64_t n, int64_t tile_cols, int64_t rows,
                int64_t work, int64_t max_workers, Compute compute, int64_t page_tiles = 0,
                int64_t chunks_per_worker = kDefaultChunksPerWorker) {
  constexpr int64_t kMinParallelWork = 1 << 18;
  const int64_t tiles = (n + tile_cols - 1) / tile_cols;
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (max_workers > 0) threads = std::min(threads, max_workers);
  int64_t workers = work < kMinParallelWork ? 1 : std::min(threads, tiles);
  const SplitClock::rep now = SplitClock::now().time_since_epoch().count();
  if (workers > 1 && now < g_split_single_until.load(std::memory_order_relaxed)) workers = 1;
  if (workers <= 1) {
    compute(0, n);
    return;
  }
  int64_t chunks = workers * chunks_per_worker;
  if (page_tiles > 0) {
    const int64_t per_worker_pages = (tiles + workers * page_tiles - 1) / (workers * page_tiles);
    chunks = std::min(chunks, workers * per_worker_pages);
  }
  const int64_t chunk_tiles = (tiles + chunks - 1) / chunks;
  auto job = std::make_shared<ColumnJob<Compute>>(std::move(compute));
  job->n = n;
  job->chunk_cols = chunk_tiles * tile_cols;
  job->num_chunks = (n + job->chunk_cols - 1) / job->chunk_cols;
  const auto lease = StartHelpers(pool, workers - 1, job, rows, work);
  const auto start = SplitClock::now();
  const int64_t own_chunks = job->run();
  if (job->done.load(std::memory_order_acquire) == job->num_chunks) {
    SplitBackoff::Get().Finished();
    return;
  }
  const double own_seconds = split_seconds_since(start);
  const auto wait_start = SplitClock::now();
  for (int spins = 0; job->done.load(std::memory_order_acquire) < job->num_chunks; ++spins) {
    if (spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
  // Longer than a chunk takes, with margin: the helper was descheduled.
  const double chunk_seconds = own_seconds / std::max<int64_t>(own_chunks, 1);
  if (split_seconds_since(wait_start) > 2 * chunk_seconds + 50e-6) {
    SplitBackoff::Get().Waited();
  } else {
    SplitBackoff::Get().Finished();
  }
}

}  // namespace xlm
