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

// Runs work->run() on the calling thread and on up to pool.num_threads() - 1 of the pool's threads; returns when
// all work->num_items items are done. Work takes its items from a shared counter (next) and counts each one done
// (done, released). Held by shared_ptr: a pool task that starts after the call has returned finds no item left
// and touches nothing else.
template <typename Work>
void share_work(xla::ffi::ThreadPool& pool, const std::shared_ptr<Work>& work) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->num_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  // Wait for the items helpers took (never for a task not started: a busy pool cannot deadlock this call).
  while (work->done.load(std::memory_order_acquire) < work->num_items) std::this_thread::yield();
}

// Runs fn(item) for item in [0, items) on the calling thread and the pool's helpers; returns when all are done.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t items, std::function<void(int64_t)> fn) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::function<void(int64_t)> fn;
    int64_t num_items;
    void run() {
      for (int64_t i; (i = next.fetch_add(1)) < num_items;) {
        fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto shared = std::make_shared<Shared>();
  shared->fn = std::move(fn);
  shared->num_items = items;
  share_work(pool, shared);
}

}  // namespace jax_engine
