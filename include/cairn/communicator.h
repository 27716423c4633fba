// Communicator: how the ranks of a job talk to each other during a save or a
// load. cairn uses it for small collectives (plans, statuses, hashes) and for
// broadcasts of large buffers; it never mixes its messages with the
// application's (the MPI communicator works on its own duplicate).
//
//   // One process, one rank:
//   auto comm = cairn::LocalCommunicator();
//   // N ranks as threads of this process (tests, the demo):
//   cairn::RunInProcess(4, [&](cairn::Communicator& comm) { ... });
//   // One rank per MPI process (cairn built with CAIRN_WITH_MPI):
//   CAIRN_ASSIGN_OR_RETURN(auto comm, cairn::MpiWorldCommunicator());
//
// Every collective must be called by every rank of the communicator, in the
// same order (like MPI). A rank that has failed locally still calls the
// collective; cairn's save and load do so to exchange errors, which is what
// keeps a failure on one rank from hanging the others.
//
// Timeouts: a rank that is stopped, deadlocked or dead never arrives, and
// the others would wait for it forever. So each rank waits at most
// CommunicatorOptions::collective_timeout (default 10 minutes) for the others
// in a collective; past it the collective fails with kDeadlineExceeded
// naming the ranks that did not arrive (as far as this rank can tell; see
// MpiWorldCommunicator). The communicator is then broken for good: every
// later collective on it, and a late rank's call of the abandoned one, fails
// at once with kAborted naming the timeout (under MPI, a late rank may
// complete the abandoned one first). The timeout bounds waiting for ranks
// to arrive, not the transfer: MPI applies it to each piece of a collective
// (a piece of at most 256 MiB), and the in-process communicator to the
// rendezvous only. Split's results inherit it.
//
// Thread safety: one communicator object is used by one thread at a time.
// Different communicators (e.g. the results of Split) may be used from
// different threads concurrently.
#ifndef CAIRN_COMMUNICATOR_H_
#define CAIRN_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace cairn {

enum class ReduceOp : uint8_t { kSum, kMin, kMax };

// Long enough for a rank to write a few hundred GB at 0.5 GB/s while the
// others wait at the save's next collective; short enough that a stopped
// rank is reported within the quarter hour.
inline constexpr absl::Duration kDefaultCollectiveTimeout = absl::Minutes(10);

// How a communicator is made; fixed for its life and inherited by Split.
struct CommunicatorOptions {
  // How long a rank waits in a collective for the other ranks before it
  // fails the collective with kDeadlineExceeded (see "Timeouts" above).
  // It must exceed the longest a rank may spend between two collectives
  // while the others wait in the second, such as the slowest rank's write
  // of its data file in a save. absl::InfiniteDuration() waits forever, as
  // MPI itself does. Must be positive. Default: kDefaultCollectiveTimeout
  // (10 minutes).
  absl::Duration collective_timeout = kDefaultCollectiveTimeout;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "local", "inprocess", "mpi": for messages and summaries.
  virtual std::string_view kind() const = 0;

  virtual absl::Status Barrier() = 0;

  // Replaces `data` on every rank with root's `data` (any size).
  virtual absl::Status Broadcast(std::string& data, int root) = 0;

  // Root receives every rank's `data`, indexed by rank; other ranks receive
  // an empty vector.
  virtual absl::StatusOr<std::vector<std::string>> Gather(
      std::string_view data, int root) = 0;

  // Every rank receives every rank's `data`, indexed by rank.
  virtual absl::StatusOr<std::vector<std::string>> AllGather(
      std::string_view data) = 0;

  // Root passes size() buffers (ignored elsewhere); rank r receives
  // `data[r]`. kInvalidArgument at root when data.size() != size().
  virtual absl::StatusOr<std::string> Scatter(
      const std::vector<std::string>& data, int root) = 0;

  // Element-wise reduction of `values` across ranks, in place. Every rank
  // passes the same number of values.
  virtual absl::Status AllReduce(std::span<int64_t> values, ReduceOp op) = 0;

  // Copies root's `data` into every rank's `data` (all ranks pass buffers of
  // the same size). Meant for large buffers: no extra copy of the whole
  // buffer is made, and transfers are split into bounded pieces.
  virtual absl::Status BroadcastBytes(std::span<std::byte> data, int root) = 0;

  // A new communicator per distinct `color`, holding the ranks that passed
  // that color, ranked by (key, old rank). Collective over this
  // communicator. The result is independent of this one and may outlive it.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color,
                                                              int key) = 0;
};

// One rank: every collective returns at once with the rank's own data.
std::unique_ptr<Communicator> LocalCommunicator();

// `n` ranks as threads of this process: communicators[r] is rank r. The
// communicators share state; destroy them after every thread is done. Empty
// when n < 1 or options.collective_timeout is not positive.
std::vector<std::unique_ptr<Communicator>> InProcessCommunicators(
    int n, const CommunicatorOptions& options = {});

// Runs fn(comm) on `n` threads, one per rank, and returns each rank's status
// (indexed by rank) after every thread has finished. kInvalidArgument (one
// status) when n < 1 or options.collective_timeout is not positive.
std::vector<absl::Status> RunInProcess(
    int n, const std::function<absl::Status(Communicator&)>& fn,
    const CommunicatorOptions& options = {});

// Whether this build of cairn has the MPI communicator.
bool HasMpi();

// A communicator over MPI_COMM_WORLD (a duplicate of it). Initializes MPI
// with MPI_THREAD_MULTIPLE when the application has not (and finalizes it at
// exit); when the application initialized MPI with a lower thread level,
// calls are serialized and only one thread may use cairn at a time.
// kUnimplemented when cairn was built without MPI; kInvalidArgument when
// options.collective_timeout is not positive.
//
// Timeouts under MPI: collectives run as MPI's nonblocking ones (e.g.
// MPI_Ibcast), polled until done or the timeout. A rank waits only for the
// ranks MPI needs it to: the non-roots of a Broadcast or Scatter complete
// without a late non-root. MPI reports only that an operation is
// incomplete, not who is missing, so a rank that times out asks every other
// rank, point to point, which collective it is waiting in, and names those
// that do not answer within a short grace (2 s, or the timeout if shorter)
// or answer from an earlier one; it then tells the others its verdict, so
// that ranks waiting with it fail at once with the same list. A rank busy
// outside cairn cannot answer and is named with the stopped and the dead.
// MPI cannot cancel a collective: the abandoned one stays pending and, if
// the missing ranks arrive after all, may still read or write the buffers
// passed to it. After a timeout, end the job (MPI_Abort) rather than go on.
// One step has no timeout: Split's MPI_Comm_split, which MPI offers only
// blocking, runs after a barrier that every rank passed, so it hangs only
// if a rank stops between the two.
absl::StatusOr<std::unique_ptr<Communicator>> MpiWorldCommunicator(
    const CommunicatorOptions& options = {});

// A communicator over a duplicate of the application's communicator, given
// by its Fortran handle (MPI_Comm_c2f(comm) in C, comm.py2f() in mpi4py), so
// that this header needs no <mpi.h>. MPI must be initialized.
absl::StatusOr<std::unique_ptr<Communicator>> MpiCommunicatorFromFortran(
    int64_t fortran_handle, const CommunicatorOptions& options = {});

}  // namespace cairn

#endif  // CAIRN_COMMUNICATOR_H_
