// Argument checks shared by the communicators, so that every implementation
// words the same mistake the same way.
#ifndef CAIRN_COMM_CHECKS_H_
#define CAIRN_COMM_CHECKS_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/checked.h"

namespace cairn::internal_comm {

// "inprocess Gather (rank 2 of 4)": the prefix of every error a collective
// returns, so that a message read in one rank's log says where it came from.
inline std::string OpContext(std::string_view kind, std::string_view op,
                             int rank, int size) {
  return absl::StrFormat("%s %s (rank %d of %d)", internal_core::AsAbsl(kind),
                         internal_core::AsAbsl(op), rank, size);
}

inline absl::Status CheckRoot(int root, int size, std::string_view context) {
  if (root >= 0 && root < size) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: root %d is out of range [0, %d)",
                      internal_core::AsAbsl(context), root, size));
}

}  // namespace cairn::internal_comm

#endif  // CAIRN_COMM_CHECKS_H_
