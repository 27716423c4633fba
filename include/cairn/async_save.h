// AsyncSaver: saves that return as soon as the state is staged, so the
// training loop is blocked only for a host copy.
//
//   CAIRN_ASSIGN_OR_RETURN(auto saver, cairn::AsyncSaver::Create(comm));
//   for (int step = 1; ; ++step) {
//     train(step);                                   // changes `state`
//     if (step % 100 == 0) {
//       CAIRN_ASSIGN_OR_RETURN(auto handle,
//           saver->Save(state, absl::StrCat("/ckpt/step-", step)));
//       // `state` may change at once: the checkpoint holds this step's
//       // values. handle->Wait() gives the final result.
//     }
//   }
//
// Save() first waits until fewer than `max_in_flight` saves are in flight,
// then stages the state (Stager: cached host buffers, reused once the save
// that used them is done), then hands the staged copy to a background
// thread that plans, writes and commits it exactly like cairn::Save.
// Background saves run one after another, on a private communicator split
// from the caller's at Create, so their collectives never interleave with
// the application's.
//
// Errors: a background failure is returned by its handle's Wait(); if the
// caller never waited for it, the next Save() returns it (and does not
// start), so no failure passes unseen. A staging failure (this rank only)
// is returned by Save() at once, and the rank still takes part in that
// save's collectives carrying the error, so the other ranks' saves fail
// with it instead of waiting. Nothing is committed by a failed save.
//
// Every rank must call Create, Save and WaitAll in the same order, like any
// collective. Thread safety: one AsyncSaver is used by one thread at a time.
#ifndef CAIRN_ASYNC_SAVE_H_
#define CAIRN_ASYNC_SAVE_H_

#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/stager.h"

namespace cairn {

struct AsyncSaveOptions {
  // Saves staged or running at once; a Save() beyond this waits. Each save
  // in flight holds one staged copy of the state. Default: 1.
  int max_in_flight = 1;
  StagerOptions stager;
};

class AsyncSaveHandle {
 public:
  virtual ~AsyncSaveHandle() = default;
  // True once the save has committed or failed.
  virtual bool done() const = 0;
  // Blocks until done; the save's result.
  virtual absl::StatusOr<SaveResult> Wait() = 0;
  // Seconds Save() spent blocking the caller (waiting for a free slot and
  // staging).
  virtual double blocked_seconds() const = 0;
};

class AsyncSaver {
 public:
  // Collective over `comm` (null: this process alone): splits a private
  // communicator for the background saves.
  static absl::StatusOr<std::unique_ptr<AsyncSaver>> Create(
      Communicator* comm, const AsyncSaveOptions& options = {});
  // Waits for every save in flight.
  virtual ~AsyncSaver() = default;

  // Stages `state` and starts saving it to `url` in the background.
  // `options.comm` is ignored (the saver's private communicator is used).
  // Key-value tables (options.kv_tables) are kUnimplemented: their rows
  // are not staged; save them with cairn::Save.
  virtual absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> Save(
      const StateDict& state, std::string_view url,
      const SaveOptions& options = {}) = 0;

  // Waits for every save in flight; the first error among those not yet
  // waited for.
  virtual absl::Status WaitAll() = 0;

  // Saves in flight now.
  virtual int in_flight() const = 0;
  // The stager's cache: bytes held, and buffers allocated so far.
  virtual uint64_t staging_bytes() const = 0;
  virtual int64_t staging_allocations() const = 0;
};

}  // namespace cairn

#endif  // CAIRN_ASYNC_SAVE_H_
