// Collective timeouts, shared by the in-process and MPI communicators so
// that both check the option and word a timeout the same way.
#ifndef CAIRN_COMM_TIMEOUT_H_
#define CAIRN_COMM_TIMEOUT_H_

#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "core/checked.h"

namespace cairn::internal_comm {

using SteadyTime = std::chrono::steady_clock::time_point;

// kInvalidArgument unless `timeout` is positive (infinite is).
inline absl::Status CheckCollectiveTimeout(absl::Duration timeout,
                                           std::string_view context) {
  if (timeout > absl::ZeroDuration()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s: the collective timeout must be positive (absl::InfiniteDuration() "
      "for none), got %s",
      internal_core::AsAbsl(context), absl::FormatDuration(timeout)));
}

// When a wait that starts now and lasts `timeout` must end; none for an
// infinite timeout, or one so long (over a century) that adding it to the
// clock could overflow.
inline std::optional<SteadyTime> DeadlineAfter(absl::Duration timeout) {
  if (timeout >= absl::Hours(24 * 365 * 100)) return std::nullopt;
  return std::chrono::steady_clock::now() +
         absl::ToChronoNanoseconds(timeout);
}

// "0.2 s", "300 s": the timeout as a user who set it reads it.
inline std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%g s", absl::ToDoubleSeconds(d));
}

// "rank 3", "ranks 2, 3", or the first 16 and "and 984 more": a timeout at
// thousands of ranks must not make a message of megabytes.
inline std::string RankList(std::span<const int> ranks) {
  constexpr size_t kListed = 16;
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < kListed; ++i) {
    absl::StrAppend(&s, i == 0 ? "" : ", ", ranks[i]);
  }
  if (ranks.size() > kListed) {
    absl::StrAppend(&s, " and ", ranks.size() - kListed, " more");
  }
  return s;
}

}  // namespace cairn::internal_comm

#endif  // CAIRN_COMM_TIMEOUT_H_
