#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace cairn::internal_core {

absl::Status ParallelFor(int64_t n, int threads,
                         absl::FunctionRef<absl::Status(int64_t)> fn) {
  if (n <= 0) return absl::OkStatus();
  const int64_t workers = std::clamp<int64_t>(threads, 1, n);
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  int64_t failed_index = n;
  absl::Status failure;

  auto work = [&] {
    while (!failed.load(std::memory_order_relaxed)) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) return;
      absl::Status s = fn(i);
      if (!s.ok()) {
        absl::MutexLock lock(&mu);
        if (i < failed_index) {
          failed_index = i;
          failure = std::move(s);
        }
        failed.store(true, std::memory_order_relaxed);
      }
    }
  };

  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int64_t t = 1; t < workers; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  return failure;
}

int ThreadsFor(size_t items) {
  return items >= (size_t{1} << 16) ? CpuThreads() : 1;
}

int CpuThreads(int cap) {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(hw, cap));
}

}  // namespace cairn::internal_core
