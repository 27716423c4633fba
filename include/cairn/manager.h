// CheckpointManager: a root folder of step-numbered checkpoints
// (root/step-0000000100/, ...), saved asynchronously by default, with
// retention, and restore of the latest committed step after a crash.
//
//   CAIRN_ASSIGN_OR_RETURN(auto manager,
//                          cairn::CheckpointManager::Create("/ckpt", comm));
//   if (auto latest = manager->LatestStep(); latest.ok() && *latest) {
//     CAIRN_RETURN_IF_ERROR(manager->Restore(state).status());  // resume
//   }
//   for (int64_t step = ...; ; ++step) {
//     train(step);
//     if (step % 100 == 0) CAIRN_RETURN_IF_ERROR(manager->Save(step, state).status());
//   }
//
// Only committed checkpoints count (a step folder with metadata.json).
// Retention, run by rank 0 before each save and in Wait(): keep the newest
// `keep_last` committed steps and every step divisible by `keep_every`;
// never delete the newest committed step, a step still being saved, or a
// step that a kept step (or a save in flight) keeps chunks in (an
// incremental checkpoint's references); remove folders that a crash left
// uncommitted. A step is deleted by
// un-committing it first (metadata.json removed, directory synced), so a
// crash mid-delete never leaves a committed, partial checkpoint.
//
// The root is a local directory or an object storage URL
// ("s3://bucket/run"; save_options.s3 says how to reach it): there a step
// is the keys under "step-NNNNNNNNNN/", committed by its metadata.json,
// and deleting one removes metadata.json first, then the rest. Every rank
// calls Create, Save,
// Restore and Wait in the same order. Thread safety: one thread at a time.
#ifndef CAIRN_MANAGER_H_
#define CAIRN_MANAGER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/async_save.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"

namespace cairn {

struct ManagerOptions {
  int keep_last = 3;   // newest committed steps kept (at least 1)
  int keep_every = 0;  // also keep steps divisible by this; 0: none
  bool async = true;   // Save returns after staging
  // Incremental checkpoints (SaveOptions::base): each save is against the
  // newest committed step, so tensor chunks that did not change since
  // (frozen layers, embedding rows nobody touched) are referenced, not
  // written; every `full_every`-th save in a row is a full one, so a step
  // references at most full_every - 1 others and old steps can go.
  // Default: false (every save full).
  bool incremental = false;
  int full_every = 8;  // at least 1 (1: every save full)
  AsyncSaveOptions async_options;
  // comm and overwrite are set by the manager; rank_local is refused
  // (kInvalidArgument from Create: a step is committed by its top-level
  // metadata.json, which rank-local saves do not write).
  SaveOptions save_options;
  LoadOptions load_options;  // comm is set by the manager
};

class CheckpointManager {
 public:
  // Collective over `comm` (null: one rank): creates `root` if needed.
  static absl::StatusOr<std::unique_ptr<CheckpointManager>> Create(
      const std::string& root, Communicator* comm,
      const ManagerOptions& options = {});
  ~CheckpointManager();

  // Saves `state` as `step` (asynchronously unless options.async is false;
  // then the handle is already done). A step that is already committed is
  // kAlreadyExists.
  absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> Save(int64_t step,
                                                        const StateDict& state);
  // Committed steps, ascending; the newest, or nullopt when none.
  absl::StatusOr<std::vector<int64_t>> Steps() const;
  absl::StatusOr<std::optional<int64_t>> LatestStep() const;
  // Loads `step` (default: the newest committed, as rank 0 sees it) into
  // `state`. kNotFound when there is none.
  absl::StatusOr<LoadResult> Restore(StateDict& state,
                                     std::optional<int64_t> step = {});
  // Waits for saves in flight, then applies retention; the first error.
  absl::Status Wait();

  std::string StepDir(int64_t step) const;

 private:
  CheckpointManager(std::string root, Communicator* comm,
                    std::unique_ptr<AsyncSaver> saver, ManagerOptions options);
  absl::Status Retain();
  // Rank 0: the base of the next save ("" for a full one).
  absl::StatusOr<std::string> NextBase();

  std::string root_;
  Communicator* comm_;
  std::unique_ptr<Communicator> local_comm_;
  std::unique_ptr<AsyncSaver> saver_;
  ManagerOptions options_;
  // Saves started and not yet seen finished: never deleted, nor their
  // bases.
  struct Pending {
    int64_t step;
    std::shared_ptr<AsyncSaveHandle> handle;
    std::optional<int64_t> base;
  };
  std::vector<Pending> pending_;
  // Rank 0, incremental: saves since the last full one, in a row (unknown
  // until the first save, which counts them from the steps' metadata).
  std::optional<int> since_full_;
};

}  // namespace cairn

#endif  // CAIRN_MANAGER_H_
