// Parallel loops for IO work.
#ifndef CAIRN_CORE_PARALLEL_H_
#define CAIRN_CORE_PARALLEL_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace cairn::internal_core {

// Runs fn(i) for every i in [0, n) on up to `threads` threads (the calling
// thread is one of them), handing out indices in increasing order. After the
// first failure no new indices start; returns the failure of the lowest
// index that failed, or OK. fn must be safe to call concurrently.
absl::Status ParallelFor(int64_t n, int threads,
                         absl::FunctionRef<absl::Status(int64_t)> fn);

// ParallelFor on threads that are kept between calls: for a caller that runs
// many short loops one after another (a staged load reads a batch at a
// time, each batch a loop over its read tasks), where starting and joining
// the threads of every loop costs more than the loop (0.34-0.47 ms for 7
// threads on the 2-core VM the benchmarks run on, and every new thread
// grows a fresh malloc arena). Threads start on the first call that needs
// them and the pool grows to the most any call asked for; the destructor
// joins them. Calls run one at a time (a second caller waits); fn must not
// call back into the same pool.
struct ParallelLoop;  // parallel.cc

class WorkerPool {
 public:
  WorkerPool() = default;
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Exactly ParallelFor(n, threads, fn), on the caller and threads - 1 of
  // the pool's threads.
  absl::Status ParallelFor(int64_t n, int threads,
                           absl::FunctionRef<absl::Status(int64_t)> fn);

  // Threads started so far (not counting callers).
  size_t started() const;

 private:
  void Serve();

  std::mutex call_;  // held for a whole ParallelFor: one loop at a time
  mutable std::mutex mu_;
  std::condition_variable wake_;  // tickets handed out, or stopping
  std::condition_variable done_;  // the last worker left the loop
  std::vector<std::thread> threads_;
  ParallelLoop* loop_ = nullptr;  // the loop running, while tickets_ or running_
  int tickets_ = 0;       // workers that may still join it
  int running_ = 0;       // workers in it now
  bool stop_ = false;
};

// Threads for CPU-bound loops of one process, such as the save
// coordinator's global planning and metadata encoding: the machine's
// hardware threads, at least 1 and at most `cap`.
int CpuThreads(int cap = 16);
// Threads for a CPU-bound loop over `items` (chunks, plan items, ...):
// CpuThreads() from 65536 items on, 1 (the loop runs inline) below, where
// starting threads costs more than it saves.
int ThreadsFor(size_t items);

// The ranks that share this node's cores, as the launcher says:
// LOCAL_WORLD_SIZE (torchrun), OMPI_COMM_WORLD_LOCAL_SIZE (Open MPI),
// MPI_LOCALNRANKS (MPICH); 1 when none is set or valid.
int LocalRanks();
// Threads for this rank's share of a copy-bound job (loads from the page
// cache): the cores this process may run on (its affinity mask) divided
// by LocalRanks(), at least 1 and at most `cap`. Four ranks on two cores
// that each ran two threads took turns: a cached column-split load of a
// 90 MB model ran 1.2-1.4x slower than with one each.
int SharedCpuThreads(int cap);

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_PARALLEL_H_
