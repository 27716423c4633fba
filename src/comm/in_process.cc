// InProcessCommunicators / RunInProcess: N ranks as threads of one process.
//
// The ranks of a communicator share a Group. Every collective is one or two
// "exchanges" over it:
//  1. Arrive: each rank publishes a pointer to its Contribution (which lives
//     on that rank's own stack and may point at the caller's buffers) in
//     slots_[rank], then waits until all n ranks have arrived.
//  2. Read: without the lock, each rank reads what it needs from the other
//     contributions and writes only its own outputs. Nothing published
//     changes during this step, because no owner may return before step 3.
//  3. Depart: each rank waits until all n have finished reading; the last one
//     resets the counters and starts the next generation. Only now may an
//     owner return and reuse or free what it published.
// Step 3 is what lets BroadcastBytes copy straight out of root's buffer and
// Broadcast out of root's string: there is no staging copy.
//
// Argument checks (roots, sizes, lengths) run on what every rank published,
// after step 1, so that every rank reaches the same verdict and a mistake on
// one rank is an error on all of them, never a hang or a crash.
//
// Only step 1 has a timeout: a rank waiting there past the group's timeout
// marks the group broken (naming the ranks whose slots are still empty) and
// returns; the ranks waiting with it wake and return the same error, and
// every later exchange, including a late rank's call of the abandoned one,
// fails at once. No rank enters step 2 of an exchange that not every rank
// arrived at, so nobody reads what a departed rank published. Step 3 waits
// without a timeout, because the others may still be reading this rank's
// buffers (returning would free them under their feet); it waits only for
// the others' step 2, local copying that waits for no one.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "cairn/communicator.h"
#include "comm/checks.h"
#include "comm/timeout.h"
#include "core/checked.h"
#include "core/status.h"

namespace cairn {
namespace internal_comm {
namespace {

using internal_core::AsAbsl;

class Group;

// What one rank publishes for one exchange; which fields mean what depends
// on the collective.
struct Contribution {
  int root = 0;
  int64_t size = 0;                   // a buffer's length, or Split's color
  int64_t key = 0;                    // Split's key
  const void* object = nullptr;       // a std::string or vector at root
  std::string_view bytes;             // Gather/AllGather
  std::span<const int64_t> values;    // AllReduce
  std::span<const std::byte> buffer;  // BroadcastBytes
  std::shared_ptr<Group> group;       // Split: the new group, from its leader
};

using Slots = std::span<const Contribution* const>;

class Group {
 public:
  Group(int n, absl::Duration timeout)
      : n_(n), timeout_(timeout), slots_(n, nullptr) {}

  int n() const { return n_; }
  absl::Duration timeout() const { return timeout_; }

  // Steps 1-3 above for `rank`, running `read` in step 2. `read`'s error is
  // returned (the exchange still completes for everyone). Fails without
  // reading when the exchange cannot complete, and from then on every
  // exchange over this group fails at once:
  //  - kDeadlineExceeded, naming the ranks that did not arrive, on the ranks
  //    that waited in step 1 past the timeout, or with one that did;
  //  - kAborted when a rank this exchange waits for has left (see Leave);
  //  - kAborted, naming the first failure, in every later exchange.
  absl::Status Exchange(int rank, const Contribution& mine,
                        const std::string& context,
                        absl::FunctionRef<absl::Status(Slots)> read) {
    std::unique_lock<std::mutex> lock(mu_);
    if (broken_) return BrokenError(context);
    const uint64_t generation = generation_;
    slots_[rank] = &mine;
    if (++arrived_ == n_) {
      NotifyAll();
    } else {
      // arrived_ cannot drop back below n_ before this rank departs, so this
      // wait cannot miss its wake-up.
      Await(lock, DeadlineAfter(timeout_),
            [&] { return arrived_ == n_ || broken_ || left_ > 0; });
      if (arrived_ != n_) {
        // The exchange will never complete. Its published pointers are never
        // read again, so returning now (and dropping them) is safe.
        if (!broken_) MarkBroken(context);
        slots_[rank] = nullptr;
        if (broken_generation_ == generation && cause_ == Cause::kTimeout) {
          return absl::DeadlineExceededError(
              absl::StrFormat("%s: %s", context, reason_));
        }
        return BrokenError(context);
      }
    }
    lock.unlock();

    absl::Status status;
    try {
      status = read(Slots(slots_));
    } catch (const std::exception& e) {
      // Only allocation can throw here; departing anyway keeps the others
      // from waiting forever.
      status = absl::ResourceExhaustedError(
          absl::StrFormat("%s: %s", context, e.what()));
    }

    lock.lock();
    if (++departed_ == n_) {
      arrived_ = 0;
      departed_ = 0;
      std::fill(slots_.begin(), slots_.end(), nullptr);
      ++generation_;
      NotifyAll();
    } else {
      Await(lock, std::nullopt, [&] { return generation_ != generation; });
    }
    return status;
  }

  // `rank` will call no more collectives over this group (RunInProcess calls
  // this when the rank's function has returned or thrown). An exchange that
  // still waits for it fails with kAborted instead of hanging. Not for the
  // groups made by Split: a rank may legitimately stop using one of those
  // while the others carry on with theirs.
  void Leave(int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    if (left_++ == 0) first_left_ = rank;
    NotifyAll();
  }

 private:
  enum class Cause { kNone, kTimeout, kLeft };

  // How long a rank polls for the others before it sleeps on cv_. Ranks of
  // one collective usually arrive within microseconds of each other, and a
  // sleeping thread's wake-up costs far more than that where the cores are
  // virtual (an interprocessor interrupt, a VM exit each way): 140 us per
  // rendezvous of 4 ranks on a 2-core guest. Polling yields the core, so a
  // rank still on its way there, or an IO thread, runs meanwhile.
  static constexpr auto kPollFor = std::chrono::microseconds(200);

  // Wakes the ranks in Await; mu_ held.
  void NotifyAll() {
    events_.fetch_add(1, std::memory_order_release);
    cv_.notify_all();
  }

  // Returns with `lock` (of mu_) held once `done()` is true or `deadline`
  // (none: never) has passed: polls events_ without the lock for up to
  // kPollFor, then sleeps on cv_.
  template <typename Done>
  void Await(std::unique_lock<std::mutex>& lock,
             std::optional<SteadyTime> deadline, Done done) {
    const uint64_t seen = events_.load(std::memory_order_relaxed);
    lock.unlock();
    const auto until = std::chrono::steady_clock::now() + kPollFor;
    for (int i = 0; events_.load(std::memory_order_acquire) == seen; ++i) {
      std::this_thread::yield();
      if (i % 16 == 15 && std::chrono::steady_clock::now() > until) break;
    }
    lock.lock();
    if (deadline.has_value()) {
      cv_.wait_until(lock, *deadline, done);
    } else {
      cv_.wait(lock, done);
    }
  }

  // Marks the group broken by the exchange now in step 1, which `context`
  // (the caller's) gave up on; mu_ held.
  void MarkBroken(const std::string& context) {
    broken_ = true;
    broken_generation_ = generation_;
    if (left_ > 0) {
      cause_ = Cause::kLeft;
      reason_ = absl::StrFormat(
          "rank %d returned from its RunInProcess function without calling "
          "this collective, so it can never complete",
          first_left_);
    } else {
      cause_ = Cause::kTimeout;
      std::vector<int> missing;
      for (int r = 0; r < n_; ++r) {
        if (slots_[r] == nullptr) missing.push_back(r);
      }
      reason_ = absl::StrFormat("%s did not arrive within %s",
                                RankList(missing), Seconds(timeout_));
      first_context_ = context;
    }
    NotifyAll();
  }

  // The error of an exchange over a broken group, other than the one that
  // timed out; mu_ held.
  absl::Status BrokenError(const std::string& context) const {
    if (cause_ == Cause::kLeft) {
      return absl::AbortedError(absl::StrFormat("%s: %s", context, reason_));
    }
    return absl::AbortedError(absl::StrFormat(
        "%s: this communicator can no longer be used, because an earlier "
        "collective over it timed out (%s: %s)",
        context, first_context_, reason_));
  }

  const int n_;
  const absl::Duration timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> events_{0};  // NotifyAll calls, for Await's polling
  uint64_t generation_ = 0;  // exchanges completed
  int arrived_ = 0;
  int departed_ = 0;
  int left_ = 0;
  int first_left_ = -1;
  // Set once, by the first exchange that cannot complete; never cleared.
  bool broken_ = false;
  Cause cause_ = Cause::kNone;
  uint64_t broken_generation_ = 0;
  std::string reason_;         // "ranks 2, 3 did not arrive within 300 s"
  std::string first_context_;  // of the rank that timed out
  // Read without mu_ in step 2; written only in steps 1 and 3 (the reset),
  // which no rank can enter while another is in step 2.
  std::vector<const Contribution*> slots_;
};

// Every rank passed `root`, and it is in range.
absl::Status CheckRoots(Slots slots, const std::string& context) {
  const int root = slots[0]->root;
  for (size_t r = 1; r < slots.size(); ++r) {
    if (slots[r]->root != root) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: ranks passed different roots (rank 0 passed %d, rank %d "
          "passed %d)",
          context, root, r, slots[r]->root));
    }
  }
  return CheckRoot(root, static_cast<int>(slots.size()), context);
}

// Every rank passed the same `size` as `reference` did.
absl::Status CheckSameSize(Slots slots, int reference, std::string_view what,
                           const std::string& context) {
  const int64_t expected = slots[reference]->size;
  for (size_t r = 0; r < slots.size(); ++r) {
    if (slots[r]->size != expected) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: every rank must pass the same %s (rank %d passed %d, rank %d "
          "passed %d)",
          context, AsAbsl(what), reference, expected, r, slots[r]->size));
    }
  }
  return absl::OkStatus();
}

int64_t Reduce(int64_t a, int64_t b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      // Wraps on overflow, like MPI_SUM over MPI_INT64_T does in practice,
      // instead of being undefined.
      return static_cast<int64_t>(static_cast<uint64_t>(a) +
                                  static_cast<uint64_t>(b));
    case ReduceOp::kMin:
      return std::min(a, b);
    case ReduceOp::kMax:
      return std::max(a, b);
  }
  return a;
}

class InProcessComm final : public Communicator {
 public:
  InProcessComm(std::shared_ptr<Group> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->n(); }
  std::string_view kind() const override { return "inprocess"; }

  absl::Status Barrier() override {
    return group_->Exchange(rank_, Contribution{}, Context("Barrier"),
                            [](Slots) { return absl::OkStatus(); });
  }

  absl::Status Broadcast(std::string& data, int root) override {
    const std::string context = Context("Broadcast");
    Contribution mine;
    mine.root = root;
    mine.object = &data;
    return group_->Exchange(rank_, mine, context, [&](Slots slots) {
      CAIRN_RETURN_IF_ERROR(CheckRoots(slots, context));
      if (rank_ != root) {
        data = *static_cast<const std::string*>(slots[root]->object);
      }
      return absl::OkStatus();
    });
  }

  absl::StatusOr<std::vector<std::string>> Gather(std::string_view data,
                                                  int root) override {
    const std::string context = Context("Gather");
    Contribution mine;
    mine.root = root;
    mine.bytes = data;
    std::vector<std::string> result;
    CAIRN_RETURN_IF_ERROR(
        group_->Exchange(rank_, mine, context, [&](Slots slots) {
          CAIRN_RETURN_IF_ERROR(CheckRoots(slots, context));
          if (rank_ == root) result = Collect(slots);
          return absl::OkStatus();
        }));
    return result;
  }

  absl::StatusOr<std::vector<std::string>> AllGather(
      std::string_view data) override {
    Contribution mine;
    mine.bytes = data;
    std::vector<std::string> result;
    CAIRN_RETURN_IF_ERROR(
        group_->Exchange(rank_, mine, Context("AllGather"), [&](Slots slots) {
          result = Collect(slots);
          return absl::OkStatus();
        }));
    return result;
  }

  absl::StatusOr<std::string> Scatter(const std::vector<std::string>& data,
                                      int root) override {
    const std::string context = Context("Scatter");
    Contribution mine;
    mine.root = root;
    mine.object = &data;
    mine.size = static_cast<int64_t>(data.size());
    std::string result;
    CAIRN_RETURN_IF_ERROR(
        group_->Exchange(rank_, mine, context, [&](Slots slots) {
          CAIRN_RETURN_IF_ERROR(CheckRoots(slots, context));
          if (slots[root]->size != size()) {
            return absl::InvalidArgumentError(
                absl::StrFormat("%s: root %d passed %d buffers for %d ranks",
                                context, root, slots[root]->size, size()));
          }
          result = (*static_cast<const std::vector<std::string>*>(
              slots[root]->object))[rank_];
          return absl::OkStatus();
        }));
    return result;
  }

  absl::Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    const std::string context = Context("AllReduce");
    Contribution mine;
    mine.values = values;
    mine.size = static_cast<int64_t>(values.size());
    // Reduced into a private vector and copied back after the exchange:
    // writing `values` while the others may still read it would be a race.
    std::vector<int64_t> result;
    CAIRN_RETURN_IF_ERROR(
        group_->Exchange(rank_, mine, context, [&](Slots slots) {
          CAIRN_RETURN_IF_ERROR(
              CheckSameSize(slots, 0, "number of values", context));
          result.assign(slots[0]->values.begin(), slots[0]->values.end());
          for (size_t r = 1; r < slots.size(); ++r) {
            for (size_t i = 0; i < result.size(); ++i) {
              result[i] = Reduce(result[i], slots[r]->values[i], op);
            }
          }
          return absl::OkStatus();
        }));
    std::copy(result.begin(), result.end(), values.begin());
    return absl::OkStatus();
  }

  absl::Status BroadcastBytes(std::span<std::byte> data, int root) override {
    const std::string context = Context("BroadcastBytes");
    Contribution mine;
    mine.root = root;
    mine.buffer = data;
    mine.size = static_cast<int64_t>(data.size());
    return group_->Exchange(rank_, mine, context, [&](Slots slots) {
      CAIRN_RETURN_IF_ERROR(CheckRoots(slots, context));
      CAIRN_RETURN_IF_ERROR(CheckSameSize(slots, root, "buffer size", context));
      // One memcpy straight from root's buffer; nobody writes it until every
      // rank has departed.
      const std::span<const std::byte> source = slots[root]->buffer;
      if (rank_ != root && !data.empty() && data.data() != source.data()) {
        std::memcpy(data.data(), source.data(), data.size());
      }
      return absl::OkStatus();
    });
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color,
                                                      int key) override {
    const std::string context = Context("Split");
    // First exchange: everyone learns every (color, key), so each rank
    // knows its new rank, its group's size and its group's leader (new rank
    // 0).
    Contribution mine;
    mine.size = color;
    mine.key = key;
    int new_rank = -1;
    int new_size = 0;
    int leader = -1;
    CAIRN_RETURN_IF_ERROR(
        group_->Exchange(rank_, mine, context, [&](Slots slots) {
          std::vector<std::pair<int64_t, int>> members;  // (key, old rank)
          for (size_t r = 0; r < slots.size(); ++r) {
            if (slots[r]->size == color) {
              members.emplace_back(slots[r]->key, static_cast<int>(r));
            }
          }
          std::sort(members.begin(), members.end());
          new_size = static_cast<int>(members.size());
          leader = members[0].second;
          for (int i = 0; i < new_size; ++i) {
            if (members[i].second == rank_) new_rank = i;
          }
          return absl::OkStatus();
        }));
    // Second exchange: each leader publishes its group's new shared state,
    // and the members take a reference to it.
    Contribution offer;
    if (leader == rank_) {
      offer.group = std::make_shared<Group>(new_size, group_->timeout());
    }
    std::shared_ptr<Group> group;
    CAIRN_RETURN_IF_ERROR(
        group_->Exchange(rank_, offer, context, [&](Slots slots) {
          group = slots[leader]->group;
          return absl::OkStatus();
        }));
    return std::unique_ptr<Communicator>(
        std::make_unique<InProcessComm>(std::move(group), new_rank));
  }

 private:
  std::string Context(std::string_view op) const {
    return OpContext(kind(), op, rank_, size());
  }

  static std::vector<std::string> Collect(Slots slots) {
    std::vector<std::string> result;
    result.reserve(slots.size());
    for (const Contribution* c : slots) result.emplace_back(c->bytes);
    return result;
  }

  std::shared_ptr<Group> group_;
  int rank_;
};

// fn(comm), with an escaping exception turned into kInternal: a thread must
// not let one escape (std::terminate).
absl::Status RunRank(const std::function<absl::Status(Communicator&)>& fn,
                     Communicator& comm) {
  try {
    return fn(comm);
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrFormat("rank %d of %d: uncaught exception: %s", comm.rank(),
                        comm.size(), e.what()));
  } catch (...) {
    return absl::InternalError(
        absl::StrFormat("rank %d of %d: uncaught exception of unknown type",
                        comm.rank(), comm.size()));
  }
}

}  // namespace
}  // namespace internal_comm

std::vector<std::unique_ptr<Communicator>> InProcessCommunicators(
    int n, const CommunicatorOptions& options) {
  std::vector<std::unique_ptr<Communicator>> comms;
  if (n < 1 || !internal_comm::CheckCollectiveTimeout(
                    options.collective_timeout, "InProcessCommunicators")
                    .ok()) {
    return comms;
  }
  auto group =
      std::make_shared<internal_comm::Group>(n, options.collective_timeout);
  comms.reserve(n);
  for (int r = 0; r < n; ++r) {
    comms.push_back(std::make_unique<internal_comm::InProcessComm>(group, r));
  }
  return comms;
}

// A rank whose function returns (or throws) without calling a collective
// that the others call would leave them waiting forever. For the
// communicator passed to fn, those others get kAborted instead (Group::Leave).
// Communicators made from it by Split have no such guard: a rank that
// abandons one of those while its peers still use it leaves them waiting
// until their collective timeout.
std::vector<absl::Status> RunInProcess(
    int n, const std::function<absl::Status(Communicator&)>& fn,
    const CommunicatorOptions& options) {
  if (n < 1) {
    return {absl::InvalidArgumentError(absl::StrFormat(
        "RunInProcess: the number of ranks must be at least 1, got %d", n))};
  }
  if (absl::Status s = internal_comm::CheckCollectiveTimeout(
          options.collective_timeout, "RunInProcess");
      !s.ok()) {
    return {s};
  }
  auto group =
      std::make_shared<internal_comm::Group>(n, options.collective_timeout);
  std::vector<internal_comm::InProcessComm> comms;
  comms.reserve(n);
  for (int r = 0; r < n; ++r) comms.emplace_back(group, r);
  std::vector<absl::Status> statuses(n);

  // No rank starts before every thread exists: if one cannot be created, the
  // ones already running must not call collectives that can never complete.
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool open = false;
  absl::Status start_failure;

  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    try {
      threads.emplace_back([&, r] {
        {
          std::unique_lock<std::mutex> lock(gate_mu);
          gate_cv.wait(lock, [&] { return open; });
          if (!start_failure.ok()) return;
        }
        statuses[r] = internal_comm::RunRank(fn, comms[r]);
        group->Leave(r);
      });
    } catch (const std::system_error& e) {
      std::lock_guard<std::mutex> lock(gate_mu);
      start_failure = absl::ResourceExhaustedError(absl::StrFormat(
          "RunInProcess: cannot start the thread of rank %d of %d: %s", r, n,
          e.what()));
      break;
    }
  }
  {
    std::lock_guard<std::mutex> lock(gate_mu);
    open = true;
  }
  gate_cv.notify_all();
  for (std::thread& t : threads) t.join();
  if (!start_failure.ok()) statuses.assign(n, start_failure);
  return statuses;
}

}  // namespace cairn
