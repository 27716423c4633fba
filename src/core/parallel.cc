#include "core/parallel.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <atomic>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace cairn::internal_core {

// One loop's shared state: indices handed out in increasing order, the
// lowest failure kept, no index started after a failure is seen.
struct ParallelLoop {
  ParallelLoop(int64_t n, absl::FunctionRef<absl::Status(int64_t)> fn)
      : n(n), fn(fn) {}

  // Runs indices until none is left or one has failed.
  void Work() {
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
  }

  const int64_t n;
  const absl::FunctionRef<absl::Status(int64_t)> fn;
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  int64_t failed_index = n;
  absl::Status failure;
};

absl::Status ParallelFor(int64_t n, int threads,
                         absl::FunctionRef<absl::Status(int64_t)> fn) {
  if (n <= 0) return absl::OkStatus();
  const int64_t workers = std::clamp<int64_t>(threads, 1, n);
  ParallelLoop loop(n, fn);
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (int64_t t = 1; t < workers; ++t) {
    // A thread that cannot start (the process's limit) leaves the work to
    // fewer; letting the exception unwind past the started ones, still
    // joinable, would terminate the process.
    try {
      pool.emplace_back([&] { loop.Work(); });
    } catch (const std::system_error&) {
      break;
    }
  }
  loop.Work();
  for (auto& t : pool) t.join();
  return std::move(loop.failure);
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

size_t WorkerPool::started() const {
  std::lock_guard<std::mutex> lock(mu_);
  return threads_.size();
}

absl::Status WorkerPool::ParallelFor(
    int64_t n, int threads, absl::FunctionRef<absl::Status(int64_t)> fn) {
  if (n <= 0) return absl::OkStatus();
  const int helpers =
      static_cast<int>(std::clamp<int64_t>(threads, 1, n)) - 1;
  ParallelLoop loop(n, fn);
  if (helpers == 0) {
    loop.Work();
    return std::move(loop.failure);
  }
  std::lock_guard<std::mutex> call(call_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (threads_.size() < static_cast<size_t>(helpers)) {
      try {
        threads_.emplace_back([this] { Serve(); });
      } catch (const std::system_error&) {
        break;  // as in ParallelFor: fewer helpers
      }
    }
    loop_ = &loop;
    tickets_ = std::min(helpers, static_cast<int>(threads_.size()));
  }
  wake_.notify_all();
  loop.Work();
  // Every index has been handed out: workers that have not joined yet need
  // not, and the loop ends when the ones in it leave.
  std::unique_lock<std::mutex> lock(mu_);
  tickets_ = 0;
  done_.wait(lock, [&] { return running_ == 0; });
  loop_ = nullptr;
  return std::move(loop.failure);
}

void WorkerPool::Serve() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || tickets_ > 0; });
    if (stop_) return;
    --tickets_;
    ++running_;
    ParallelLoop* loop = loop_;
    lock.unlock();
    loop->Work();
    lock.lock();
    if (--running_ == 0) done_.notify_all();
  }
}

int ThreadsFor(size_t items) {
  return items >= (size_t{1} << 16) ? CpuThreads() : 1;
}

int LocalRanks() {
  for (const char* name :
       {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(value, &end, 10);
    if (errno == 0 && *end == '\0' && n >= 1 && n <= (1 << 20)) {
      return static_cast<int>(n);
    }
  }
  return 1;
}

int SharedCpuThreads(int cap) {
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  return std::max(1, std::min(cap, cores / LocalRanks()));
}

int CpuThreads(int cap) {
  const int hw = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(hw, cap));
}

}  // namespace cairn::internal_core
