// AsyncSaver: a FIFO of staged saves run by one background thread on a
// private communicator. Per Save():
//  1. Report an unobserved failure of an earlier save, if any.
//  2. Wait until fewer than max_in_flight saves are queued or running.
//  3. Stage the state (Stager); the staged copy holds its buffers until the
//     background save drops it, so the Stager never reuses them early.
//  4. Queue (staged copy, url, options); return the handle.
// The worker pops saves in order and runs the ordinary save protocol on
// the private communicator, so all ranks run the same collectives in the
// same order.
#include "cairn/async_save.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_impl.h"
#include "core/status.h"

namespace cairn {
namespace {

class Handle : public AsyncSaveHandle {
 public:
  explicit Handle(std::string url) : url_(std::move(url)) {}
  bool done() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  absl::StatusOr<SaveResult> Wait() override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    observed_ = true;
    return result_;
  }
  double blocked_seconds() const override { return blocked_seconds_; }

  void Finish(absl::StatusOr<SaveResult> result) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      result_ = std::move(result);
      done_ = true;
    }
    cv_.notify_all();
  }
  // The failure of a finished save nobody waited for, once.
  absl::Status TakeUnobservedFailure() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_ || observed_ || result_.ok()) return absl::OkStatus();
    observed_ = true;
    return internal_core::Annotate(
        result_.status(), absl::StrCat("an earlier async save to ", url_,
                                       " failed"));
  }
  // Waits; the failure, unless it was already reported.
  absl::Status WaitUnobserved() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    const bool seen = observed_;
    observed_ = true;
    return seen ? absl::OkStatus() : result_.status();
  }
  void set_blocked_seconds(double s) { blocked_seconds_ = s; }
  void MarkObserved() {
    std::lock_guard<std::mutex> lock(mu_);
    observed_ = true;
  }

 private:
  const std::string url_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool observed_ = false;
  absl::StatusOr<SaveResult> result_ = absl::UnknownError("not finished");
  double blocked_seconds_ = 0;
};

class Saver : public AsyncSaver {
 public:
  Saver(std::unique_ptr<Communicator> comm, const AsyncSaveOptions& options)
      : comm_(std::move(comm)),
        options_(options),
        stager_(options.stager),
        worker_([this] { Work(); }) {}

  ~Saver() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> Save(
      const StateDict& state, std::string_view url,
      const SaveOptions& options) override {
    const auto start = std::chrono::steady_clock::now();
    if (!options.kv_tables.empty()) {
      // Not built: the sources would be pulled after Save returned, while
      // the tables change; a staged snapshot of a table is a task of its
      // own.
      return absl::UnimplementedError(
          "async save: key-value tables (SaveOptions::kv_tables) are not "
          "supported; save them with cairn::Save");
    }
    for (const std::shared_ptr<Handle>& h : handles_) {
      CAIRN_RETURN_IF_ERROR(h->TakeUnobservedFailure());
    }
    std::erase_if(handles_, [](const std::shared_ptr<Handle>& h) {
      return h->done();
    });
    {
      std::unique_lock<std::mutex> lock(mu_);
      idle_.wait(lock, [&] {
        return in_flight_ < std::max(1, options_.max_in_flight);
      });
    }
    // A save that finished while we waited may have failed.
    for (const std::shared_ptr<Handle>& h : handles_) {
      CAIRN_RETURN_IF_ERROR(h->TakeUnobservedFailure());
    }
    // A staging failure is this rank's alone: the other ranks' background
    // saves are already waiting in collectives for this one, so it still
    // queues a save that takes part carrying the error (every rank then
    // fails it alike), and returns the error now.
    absl::StatusOr<StateDict> staged = stager_.Stage(state);
    auto handle = std::make_shared<Handle>(std::string(url));
    handle->set_blocked_seconds(std::chrono::duration<double>(
                                    std::chrono::steady_clock::now() - start)
                                    .count());
    Job job{staged.ok() ? *std::move(staged) : StateDict(), std::string(url),
            options, handle, staged.status()};
    job.options.comm = comm_.get();
    const absl::Status job_error = job.error;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(job));
      ++in_flight_;
    }
    cv_.notify_all();
    handles_.push_back(handle);
    if (!job_error.ok()) {
      handle->MarkObserved();  // reported here, not again
      return internal_core::Annotate(job_error, "staging for an async save");
    }
    return std::shared_ptr<AsyncSaveHandle>(handle);
  }

  absl::Status WaitAll() override {
    absl::Status first;
    for (const std::shared_ptr<Handle>& h : handles_) {
      absl::Status s = h->WaitUnobserved();
      if (first.ok() && !s.ok()) first = s;
    }
    handles_.clear();
    return first;
  }

  int in_flight() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return in_flight_;
  }
  uint64_t staging_bytes() const override { return stager_.cached_bytes(); }
  int64_t staging_allocations() const override { return stager_.allocations(); }

 private:
  struct Job {
    StateDict staged;
    std::string url;
    SaveOptions options;
    std::shared_ptr<Handle> handle;
    absl::Status error;  // staging failed on this rank
  };

  void Work() {
    while (true) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left to save
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      absl::StatusOr<SaveResult> result =
          job.error.ok()
              ? cairn::Save(job.staged, job.url, job.options)
              : internal_checkpoint::SaveToStorage(job.staged, job.error,
                                                   job.options);
      job.staged = StateDict();  // release the staging buffers first
      job.handle->Finish(std::move(result));
      {
        std::lock_guard<std::mutex> lock(mu_);
        --in_flight_;
      }
      idle_.notify_all();
    }
  }

  std::unique_ptr<Communicator> comm_;
  const AsyncSaveOptions options_;
  Stager stager_;  // used by the caller's thread only
  std::vector<std::shared_ptr<Handle>> handles_;  // caller's thread only
  mutable std::mutex mu_;
  std::condition_variable cv_;    // work queued or stopping
  std::condition_variable idle_;  // a save finished
  std::deque<Job> queue_;
  int in_flight_ = 0;
  bool stopping_ = false;
  std::thread worker_;  // last: starts after everything above exists
};

}  // namespace

absl::StatusOr<std::unique_ptr<AsyncSaver>> AsyncSaver::Create(
    Communicator* comm, const AsyncSaveOptions& options) {
  std::unique_ptr<Communicator> own;
  if (comm == nullptr) {
    own = LocalCommunicator();
  } else {
    CAIRN_ASSIGN_OR_RETURN(own, comm->Split(0, comm->rank()));
  }
  return std::unique_ptr<AsyncSaver>(new Saver(std::move(own), options));
}

}  // namespace cairn
