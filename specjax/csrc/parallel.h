// Work split across XLA's intra-op thread pool for the CPU kernels.

#ifndef SPECJAX_CSRC_PARALLEL_H_
#define SPECJAX_CSRC_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace specjax {

// Runs body(u) for u in [0, units): units are claimed from a shared counter by the
// calling thread and by helpers scheduled on `pool`. The caller waits only for units some
// thread has claimed, so a helper that never gets a thread costs nothing (and two kernels
// waiting on each other's helpers cannot deadlock); the counters outlive the call for
// helpers that start late and find no work. `body` must stay valid until this returns.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t units, const Body& body) {
  struct Progress {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto work = [progress, units, &body] {
    for (int64_t u; (u = progress->next.fetch_add(1)) < units;) {
      body(u);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, units - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));
  work();
  while (progress->done.load(std::memory_order_acquire) < units) std::this_thread::yield();
}

}  // namespace specjax

#endif  // SPECJAX_CSRC_PARALLEL_H_
