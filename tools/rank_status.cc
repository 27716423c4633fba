#include "rank_status.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace cairn::tools {

std::string EncodeStatus(const absl::Status& status) {
  return absl::StrCat(static_cast<int>(status.code()), "\n", status.message());
}

absl::Status DecodeStatus(const std::string& text) {
  const size_t nl = text.find('\n');
  int code = 0;
  if (nl == std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(text.data(), nl), &code) ||
      code < 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError(
        absl::StrCat("malformed status from another rank: '", text, "'"));
  }
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::string_view(text).substr(nl + 1));
}

absl::Status CombineRankStatuses(const std::vector<absl::Status>& statuses) {
  // Distinct errors in the order of the first rank that hit each.
  std::vector<std::pair<absl::Status, std::vector<int>>> groups;
  size_t failed = 0;
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (statuses[r].ok()) continue;
    ++failed;
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) {
      return g.first == statuses[r];
    });
    if (it == groups.end()) {
      groups.push_back({statuses[r], {}});
      it = groups.end() - 1;
    }
    it->second.push_back(static_cast<int>(r));
  }
  if (groups.empty()) return absl::OkStatus();
  if (groups.size() == 1 && failed == statuses.size()) return groups[0].first;
  const absl::StatusCode code = groups[0].first.code();
  std::vector<std::string> parts;
  for (const auto& [status, ranks] : groups) {
    parts.push_back(absl::StrCat(
        ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "),
        ": ",
        // The combined status carries the first code; others keep theirs.
        status.code() == code ? std::string(status.message())
                              : status.ToString()));
  }
  return absl::Status(code, absl::StrJoin(parts, "; "));
}

absl::Status AgreeOnStatus(Communicator& comm, const absl::Status& local) {
  absl::StatusOr<std::vector<std::string>> all =
      comm.AllGather(EncodeStatus(local));
  if (!all.ok()) {
    return local.ok() ? all.status()
                      : absl::Status(local.code(),
                                     absl::StrCat("rank ", comm.rank(), ": ",
                                                  local.message()));
  }
  std::vector<absl::Status> statuses;
  statuses.reserve(all->size());
  for (const std::string& s : *all) statuses.push_back(DecodeStatus(s));
  return CombineRankStatuses(statuses);
}

}  // namespace cairn::tools
