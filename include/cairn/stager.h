// Stager: copies the tensors of a state dict into host staging buffers that
// it keeps from one call to the next, so that a save can work from the copy
// while the job changes its tensors (the first step of an async save).
//
//   cairn::Stager stager;
//   for (int step = 0; ; ++step) {
//     train(step);
//     CAIRN_ASSIGN_OR_RETURN(cairn::StateDict copy, stager.Stage(state));
//     // `copy` holds this step's values; `state` may change at once.
//     ... save `copy` ...
//   }
//
// Buffers are keyed by the source's storage: the device and byte span of the
// tensor views that share memory (pinned host memory for device storages).
// Views whose spans overlap (a tensor and a view into it, shards of one
// allocation) are staged into one buffer at the same relative offsets, so aliasing survives staging: one copy, same sharing.
// A cached buffer is reused only when nothing else still holds it (a staged
// state dict from an earlier call that is still being saved keeps its
// buffer, and the new call gets a fresh one), so a reuse can never change
// bytes someone is reading. The cache is bounded (StagerOptions) and drops
// buffers whose source is gone (a ShardedTensor with an owner that
// expired) or that were not used by the latest call, or everything on
// Release().
//
// Thread safety: one Stager is used by one thread at a time.
#ifndef CAIRN_STAGER_H_
#define CAIRN_STAGER_H_

#include <cstdint>
#include <limits>
#include <memory>

#include "absl/status/statusor.h"
#include "cairn/state_dict.h"

namespace cairn {

struct StagerOptions {
  // Staging bytes the cache may keep after a call: buffers not used by the
  // latest call are freed, oldest first, until the cache fits. Buffers the
  // latest call used are always kept. Default: no limit.
  uint64_t max_cached_bytes = std::numeric_limits<uint64_t>::max();
};

class Stager {
 public:
  explicit Stager(StagerOptions options = {});
  ~Stager();
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  // A state dict of the same nesting in which every tensor shard views a
  // host staging copy of its source (objects and scalars copied too). The
  // staged tensors keep their buffers alive.
  //
  // Device (CUDA) shards: Stage first waits for the work already queued on
  // each device (so the copy holds the values the application's kernels
  // wrote), then copies each device storage's span with one
  // cudaMemcpyAsync on cairn's own stream into a pinned host buffer, copies
  // the host shards meanwhile, and returns once every copy has landed. In a
  // build without CUDA, or on a machine without a usable GPU, device shards
  // are an error naming the FQN and the device (kUnimplemented /
  // kFailedPrecondition).
  absl::StatusOr<StateDict> Stage(const StateDict& state);

  // Frees every cached buffer (staged state dicts still alive keep theirs).
  void Release();

  uint64_t cached_bytes() const;  // bytes of the buffers in the cache
  int64_t allocations() const;    // staging buffers allocated so far

 private:
  struct Cache;
  StagerOptions options_;
  std::unique_ptr<Cache> cache_;
};

}  // namespace cairn

#endif  // CAIRN_STAGER_H_
