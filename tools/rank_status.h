// Statuses of the ranks of a collective tool run (`cairn demo` under
// --comm inproc or mpi): each rank reports what happened to it, every rank
// learns the combined outcome, and the combined error names the ranks that
// failed.
//
// Why: a step that fails on one rank alone (an allocation, a file check)
// must not let that rank skip the next collective, or the others would wait
// in it forever. So every such step ends in AgreeOnStatus, and all ranks
// take the same branch.
//
// Thread safety: pure functions, except AgreeOnStatus, which is a
// collective over its communicator (one thread per communicator).
#ifndef CAIRN_TOOLS_RANK_STATUS_H_
#define CAIRN_TOOLS_RANK_STATUS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cairn/communicator.h"

namespace cairn::tools {

// absl::Status has no wire format of its own: "<code>\n<message>" (payloads
// are dropped).
std::string EncodeStatus(const absl::Status& status);
// The inverse; kInternal naming the text when it is not an encoded status.
absl::Status DecodeStatus(const std::string& text);

// One status from every rank's (indexed by rank): OK when all are OK; the
// error itself when every rank has the same one (cairn's collectives fail
// that way and name the failed rank in the message); otherwise the code of
// the lowest failed rank and each distinct error with its ranks:
// "rank 2: out of memory; ranks 0, 1: ...".
absl::Status CombineRankStatuses(const std::vector<absl::Status>& statuses);

// Collective over `comm`: every rank passes its own status and gets
// CombineRankStatuses of all of them. When the exchange itself fails, the
// local status (prefixed with this rank) or the exchange's error.
absl::Status AgreeOnStatus(Communicator& comm, const absl::Status& local);

}  // namespace cairn::tools

#endif  // CAIRN_TOOLS_RANK_STATUS_H_
