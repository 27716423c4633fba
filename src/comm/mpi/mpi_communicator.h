// The Open MPI communicator's insides, for its tests. Only src/comm/mpi and
// MPI tests include this header (it includes <mpi.h>); the public entry
// points are MpiWorldCommunicator and MpiCommunicatorFromFortran in
// cairn/communicator.h.
//
// Threading: when MPI provides MPI_THREAD_MULTIPLE, each communicator may be
// used by its own thread concurrently with the others. When it provides only
// MPI_THREAD_SERIALIZED, every MPI call cairn makes holds one process-wide
// mutex; the application must then not call MPI concurrently with cairn, and
// only one thread may use cairn's communicators at a time (collectives are
// polled with the mutex released in between, but MPI_Comm_dup and
// MPI_Comm_split block holding it, and two threads in those over different
// communicators could deadlock across processes). Lower levels are refused
// with kFailedPrecondition.
#ifndef CAIRN_COMM_MPI_MPI_COMMUNICATOR_H_
#define CAIRN_COMM_MPI_MPI_COMMUNICATOR_H_

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cairn/communicator.h"

namespace cairn::internal_comm {

struct MpiOptions {
  // Largest single MPI_Bcast of Broadcast and BroadcastBytes; larger buffers
  // go in several pieces. Default: 256 MiB.
  int64_t max_piece_bytes = int64_t{256} << 20;
  // Largest buffer, and largest total that one rank receives (Gather,
  // AllGather) or sends (Scatter), in those three collectives, whose MPI
  // counts and displacements are ints; beyond it they return
  // kInvalidArgument on every rank. Default: INT_MAX.
  int64_t max_gather_bytes = INT_MAX;
  // CommunicatorOptions::collective_timeout: how long each MPI operation of
  // a collective waits. Default: kDefaultCollectiveTimeout (5 minutes).
  absl::Duration collective_timeout = kDefaultCollectiveTimeout;
};

// A communicator over a duplicate of `comm` (collective over `comm`), with
// MPI_ERRORS_RETURN set on the duplicate. MPI must be initialized with at
// least MPI_THREAD_SERIALIZED. kInvalidArgument when
// options.collective_timeout is not positive.
absl::StatusOr<std::unique_ptr<Communicator>> NewMpiCommunicator(
    MPI_Comm comm, const MpiOptions& options = {});

// The MPI communicator `comm` works on, or MPI_COMM_NULL when `comm` is not
// one of cairn's MPI communicators.
MPI_Comm NativeHandle(const Communicator& comm);

// OK for MPI_SUCCESS; otherwise kInternal "operation: MPI's error string".
absl::Status MpiErrorToStatus(int error_code, std::string_view operation);

}  // namespace cairn::internal_comm

#endif  // CAIRN_COMM_MPI_MPI_COMMUNICATOR_H_
