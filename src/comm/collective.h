// The failure-safe building blocks of cairn's collective operations (save,
// load, the state-dict utilities). Every phase ends in a collective that
// carries each rank's status next to its payload, so a rank that failed
// still takes part, and every rank leaves the phase with the same verdict:
// all OK, or one error naming each failed rank.
#ifndef CAIRN_COMM_COLLECTIVE_H_
#define CAIRN_COMM_COLLECTIVE_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/communicator.h"

namespace cairn::internal_comm {

inline constexpr int kCoordinator = 0;

// The caller's communicator, or a one-rank one when it passed none.
class Ranks {
 public:
  explicit Ranks(Communicator* comm);
  Communicator& comm() const { return *comm_; }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  bool coordinator() const { return rank() == kCoordinator; }

 private:
  std::unique_ptr<Communicator> local_;
  Communicator* comm_;
};

// A status and, when OK, a payload, as one message: a header of this many
// bytes (the status code, the payload's length), then the payload.
inline constexpr size_t kSealHeaderBytes = 12;
std::string Seal(const absl::Status& status, std::string_view payload = {});
// The same message, built in `payload`'s own buffer (its bytes moved up
// behind the header) instead of a copy of it. That buffer is reallocated
// unless its capacity has room for the header (kSealHeaderBytes more).
std::string SealInPlace(const absl::Status& status, std::string payload);
// The payload, or the status the sender sealed; kDataLoss naming `what` for
// a malformed message. The payload is returned in `message`'s own buffer
// (moved down over the header), so a caller that moves its message in makes
// no copy: metadata.json and the ranks' plans run to hundreds of MB at
// thousands of ranks.
absl::StatusOr<std::string> Unseal(std::string message, std::string_view what);

// One error from every rank's status (indexed by rank), or OK when all are
// OK: "<operation> failed in <phase> on 2 of 4 ranks: rank 1: ...; rank 3:
// ..." (without " in <phase>" when `phase` is empty). The code is that of
// the lowest failed rank.
absl::Status CombineStatuses(const std::vector<absl::Status>& statuses,
                             std::string_view operation,
                             std::string_view phase = {});

// Collective: OK on every rank when `local` is OK on every rank; else the
// same combined error on every rank. One AllReduce when all is well; an
// AllGather of the errors only when something failed.
absl::Status AgreeOnStatus(Communicator& comm, const absl::Status& local,
                           std::string_view operation,
                           std::string_view phase = {});

// Collective: every rank sends (status, payload) to the coordinator, which
// receives each rank's payload, or a combined error when any rank failed
// (non-coordinators receive an empty vector). The coordinator must then
// reach every rank with the outcome (ScatterOutcome / BroadcastOutcome).
absl::StatusOr<std::vector<std::string>> GatherOrError(
    Communicator& comm, const absl::Status& local, std::string_view payload,
    std::string_view operation, std::string_view phase);

// Whether `status` says a collective itself failed (the communicator broke
// or timed out: the errors of the functions here that begin "communicator
// failed in"), not a rank's work.
bool IsCommFailure(const absl::Status& status);

// Collective: the coordinator sends rank r `payloads[r]`, or `status` to
// all when it is an error; each rank returns its payload or that error.
// A `status` for which IsCommFailure holds ends it on the coordinator at
// once (the communicator is unusable; the other ranks' collectives fail
// on their own). So for BroadcastOutcome.
absl::StatusOr<std::string> ScatterOutcome(Communicator& comm,
                                           const absl::Status& status,
                                           std::vector<std::string> payloads);

// Collective: the coordinator's (status, payload) to every rank.
absl::StatusOr<std::string> BroadcastOutcome(Communicator& comm,
                                             const absl::Status& status,
                                             std::string payload);

}  // namespace cairn::internal_comm

#endif  // CAIRN_COMM_COLLECTIVE_H_
