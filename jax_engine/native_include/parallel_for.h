// Work items shared out over XLA's intra-op thread pool, as the engine's C++ kernels run them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jax_engine {

// Runs fn(item) for item in [0, items) on the calling thread and the pool's helpers; returns when all are done.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t items, std::function<void(int64_t)> fn) {
  // Held by shared_ptr: a pool task that starts after the call has returned finds no item left and touches
  // nothing else.
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::function<void(int64_t)> fn;
    int64_t items;
    void run() {
      for (int64_t i; (i = next.fetch_add(1)) < items;) {
        fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>();
  shared->fn = std::move(fn);
  shared->items = items;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->run(); });
  shared->run();
  // Wait for the items helpers took (never for a task not started: a busy pool cannot deadlock this call).
  while (shared->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace jax_engine
