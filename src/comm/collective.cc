#include "comm/collective.h"

#include <algorithm>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/byte_codec.h"
#include "core/checked.h"
#include "core/status.h"

namespace cairn::internal_comm {
namespace {

using internal_core::ByteReader;
using internal_core::ByteWriter;

// Errors listed in full in a combined error; the rest are counted.
constexpr int kMaxListedRanks = 8;
// Longest message kept per rank in a combined error.
constexpr size_t kMaxMessageBytes = 2048;

// Marks the errors CommError makes (a status payload's type URL).
constexpr char kCommFailureUrl[] = "cairn/comm-failure";

// An error from the communicator itself: the protocol cannot go on, and
// ranks may disagree (the transport failed, not a rank's work).
absl::Status CommError(const absl::Status& s, std::string_view phase) {
  absl::Status e = internal_core::Annotate(
      s, absl::StrCat("communicator failed in ", std::string(phase)));
  e.SetPayload(kCommFailureUrl, absl::Cord());
  return e;
}

}  // namespace

bool IsCommFailure(const absl::Status& status) {
  return status.GetPayload(kCommFailureUrl).has_value();
}

Ranks::Ranks(Communicator* comm) : comm_(comm) {
  if (comm_ == nullptr) {
    local_ = LocalCommunicator();
    comm_ = local_.get();
  }
}

std::string Seal(const absl::Status& status, std::string_view payload) {
  ByteWriter w;
  w.U32(static_cast<uint32_t>(status.code()));
  w.Str(status.ok() ? payload : internal_core::AsStd(status.message()));
  return w.Take();
}

std::string SealInPlace(const absl::Status& status, std::string payload) {
  if (!status.ok()) return Seal(status);
  ByteWriter header;  // Seal's, without the payload's bytes
  header.U32(0);
  header.U64(payload.size());
  static_assert(sizeof(uint32_t) + sizeof(uint64_t) == kSealHeaderBytes);
  payload.insert(0, header.data());
  return payload;
}

absl::StatusOr<std::string> Unseal(std::string message,
                                   std::string_view what) {
  size_t body_at = 0;
  {
    ByteReader r(message, std::string(what));
    const uint32_t code = r.U32();
    const std::string_view body = r.StrView();
    CAIRN_RETURN_IF_ERROR(r.status());
    if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
      return absl::DataLossError(
          absl::StrCat(std::string(what), ": unknown status code ", code));
    }
    if (code != 0) {
      return absl::Status(static_cast<absl::StatusCode>(code),
                          internal_core::AsAbsl(body));
    }
    body_at = static_cast<size_t>(body.data() - message.data());
  }
  message.erase(0, body_at);
  return message;
}

absl::Status CombineStatuses(const std::vector<absl::Status>& statuses,
                             std::string_view operation,
                             std::string_view phase) {
  int failed = 0;
  absl::StatusCode code = absl::StatusCode::kOk;
  std::string list;
  for (size_t r = 0; r < statuses.size(); ++r) {
    const absl::Status& s = statuses[r];
    if (s.ok()) continue;
    if (failed == 0) code = s.code();
    if (failed < kMaxListedRanks) {
      std::string message(internal_core::AsStd(s.message()));
      if (message.size() > kMaxMessageBytes) {
        message.resize(kMaxMessageBytes);
        message += "...";
      }
      absl::StrAppend(&list, failed == 0 ? "" : "; ", "rank ", r, ": ",
                      absl::StatusCodeToString(s.code()), ": ", message);
    }
    ++failed;
  }
  if (failed == 0) return absl::OkStatus();
  if (failed > kMaxListedRanks) {
    absl::StrAppend(&list, "; and ", failed - kMaxListedRanks,
                    " more ranks");
  }
  return absl::Status(
      code, absl::StrFormat("%s failed%s on %d of %d ranks: %s", operation,
                            phase.empty() ? "" : absl::StrCat(" in ", std::string(phase)),
                            failed, statuses.size(), list));
}

absl::Status AgreeOnStatus(Communicator& comm, const absl::Status& local,
                           std::string_view operation,
                           std::string_view phase) {
  int64_t failed = local.ok() ? 0 : 1;
  if (absl::Status s = comm.AllReduce(std::span<int64_t>(&failed, 1),
                                      ReduceOp::kMax);
      !s.ok()) {
    return CommError(s, phase);
  }
  if (failed == 0) return absl::OkStatus();
  absl::StatusOr<std::vector<std::string>> all =
      comm.AllGather(Seal(local));
  if (!all.ok()) return CommError(all.status(), phase);
  std::vector<absl::Status> statuses;
  for (size_t r = 0; r < all->size(); ++r) {
    absl::StatusOr<std::string> s =
        Unseal(std::move((*all)[r]), absl::StrCat("status from rank ", r));
    statuses.push_back(s.status());
  }
  return CombineStatuses(statuses, operation, phase);
}

absl::StatusOr<std::vector<std::string>> GatherOrError(
    Communicator& comm, const absl::Status& local, std::string_view payload,
    std::string_view operation, std::string_view phase) {
  absl::StatusOr<std::vector<std::string>> all =
      comm.Gather(Seal(local, payload), kCoordinator);
  if (!all.ok()) return CommError(all.status(), phase);
  if (comm.rank() != kCoordinator) return std::vector<std::string>{};
  std::vector<absl::Status> statuses;
  std::vector<std::string> payloads;
  bool any_failed = false;
  for (size_t r = 0; r < all->size(); ++r) {
    absl::StatusOr<std::string> p =
        Unseal(std::move((*all)[r]), absl::StrCat("message from rank ", r));
    any_failed |= !p.ok();
    statuses.push_back(p.status());
    payloads.push_back(p.ok() ? *std::move(p) : std::string());
  }
  if (any_failed) return CombineStatuses(statuses, operation, phase);
  return payloads;
}

absl::StatusOr<std::string> ScatterOutcome(Communicator& comm,
                                           const absl::Status& status,
                                           std::vector<std::string> payloads) {
  // A collective that failed before (the coordinator's gather) has left
  // the communicator unusable: its error, not the next one's.
  if (comm.rank() == kCoordinator && IsCommFailure(status)) return status;
  std::vector<std::string> sealed;
  if (comm.rank() == kCoordinator) {
    sealed.reserve(comm.size());
    for (int r = 0; r < comm.size(); ++r) {
      sealed.push_back(
          status.ok() && static_cast<size_t>(r) < payloads.size()
              ? SealInPlace(status, std::move(payloads[r]))
              : Seal(status.ok() ? absl::InternalError("no plan for this rank")
                                 : status));
    }
  }
  absl::StatusOr<std::string> mine = comm.Scatter(sealed, kCoordinator);
  if (!mine.ok()) return CommError(mine.status(), "scatter");
  return Unseal(*std::move(mine), "message from the coordinator");
}

absl::StatusOr<std::string> BroadcastOutcome(Communicator& comm,
                                             const absl::Status& status,
                                             std::string payload) {
  if (comm.rank() == kCoordinator && IsCommFailure(status)) return status;
  std::string message;
  if (comm.rank() == kCoordinator) {
    message = SealInPlace(status, std::move(payload));
  }
  if (absl::Status s = comm.Broadcast(message, kCoordinator); !s.ok()) {
    return CommError(s, "broadcast");
  }
  return Unseal(std::move(message), "message from the coordinator");
}

}  // namespace cairn::internal_comm
