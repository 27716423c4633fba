// Parallel loops for IO work.
#ifndef CAIRN_CORE_PARALLEL_H_
#define CAIRN_CORE_PARALLEL_H_

#include <cstddef>
#include <cstdint>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace cairn::internal_core {

// Runs fn(i) for every i in [0, n) on up to `threads` threads (the calling
// thread is one of them), handing out indices in increasing order. After the
// first failure no new indices start; returns the failure of the lowest
// index that failed, or OK. fn must be safe to call concurrently.
absl::Status ParallelFor(int64_t n, int threads,
                         absl::FunctionRef<absl::Status(int64_t)> fn);

// Threads for CPU-bound loops of one process, such as the save
// coordinator's global planning and metadata encoding: the machine's
// hardware threads, at least 1 and at most `cap`.
int CpuThreads(int cap = 16);
// Threads for a CPU-bound loop over `items` (chunks, plan items, ...):
// CpuThreads() from 65536 items on, 1 (the loop runs inline) below, where
// starting threads costs more than it saves.
int ThreadsFor(size_t items);

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_PARALLEL_H_
