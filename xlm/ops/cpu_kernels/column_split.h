// Splitting a kernel's output columns over the calling thread and XLA's intra-op pool (the
// FFI's ThreadPool context): chunks of whole tiles claimed from an atomic counter, so a
// thread that starts late or runs slowly hands its share over, for any kernel that
// computes columns [c0, c1) independently (quant_matmul.cc's comments give the
// measurements behind the constants).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

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
// After waiting on a descheduled pool thread, calls run on the caller alone this long.
inline std::atomic<SplitClock::rep> g_split_single_until{0};

inline double split_seconds_since(SplitClock::time_point t) {
  return std::chrono::duration<double>(SplitClock::now() - t).count();
}

// compute(c0, c1) over [0, n) in chunks of `tile_cols`-column tiles, on up to max_workers
// threads (0: all of the pool's, plus the caller); `work` (multiply-adds) below ~10 us of
// one core runs on the caller alone. `page_tiles` > 0 (tall weights): chunks at least
// that many tiles wide where the balance allows, since every row of a chunk is a page walk.
template <class Compute>
void RunColumns(xla::ffi::ThreadPool& pool, int64_t n, int64_t tile_cols, int64_t work,
                int64_t max_workers, Compute compute, int64_t page_tiles = 0) {
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
  int64_t chunks = workers * 4;
  if (page_tiles > 0) {
    const int64_t per_worker_pages = (tiles + workers * page_tiles - 1) / (workers * page_tiles);
    chunks = std::min(chunks, workers * per_worker_pages);
  }
  const int64_t chunk_tiles = (tiles + chunks - 1) / chunks;
  auto job = std::make_shared<ColumnJob<Compute>>(std::move(compute));
  job->n = n;
  job->chunk_cols = chunk_tiles * tile_cols;
  job->num_chunks = (n + job->chunk_cols - 1) / job->chunk_cols;
  for (int64_t t = 1; t < workers; ++t) pool.Schedule([job] { job->run(); });
  const auto start = SplitClock::now();
  const int64_t own_chunks = job->run();
  if (job->done.load(std::memory_order_acquire) == job->num_chunks) return;
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
    const SplitClock::time_point until = SplitClock::now() + std::chrono::milliseconds(100);
    g_split_single_until.store(until.time_since_epoch().count(), std::memory_order_relaxed);
  }
}

}  // namespace xlm
