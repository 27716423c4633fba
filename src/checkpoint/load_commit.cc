// Steps 3e and 4 of the load (load.cc): committing read items with the
// planner once every check that covers their bytes has passed.
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "cairn/metadata.h"
#include "cairn/planner.h"
#include "checkpoint/load_internal.h"
#include "core/status.h"

namespace cairn::internal_checkpoint {

const ByteLocation* LocationOf(const Metadata& metadata, const ReadItem& item) {
  if (item.kind == ItemKind::kObject) {
    auto it = metadata.objects.find(item.fqn);
    return it == metadata.objects.end() ? nullptr : &it->second;
  }
  auto it = metadata.tensors.find(item.fqn);
  if (it == metadata.tensors.end() || item.chunk >= it->second.chunks.size()) {
    return nullptr;
  }
  return &it->second.chunks[item.chunk].location;
}

Committer::Committer(LoadPlanner& planner, std::span<const ReadItem> items,
                     bool verify)
    : planner_(planner), verify_(verify) {
  for (const ReadItem& item : items) ++left_[item.fqn];
}

void Committer::Add(const ReadItem& item,
                    const std::shared_ptr<LoadSink>& sink, bool checked) {
  if (sink != nullptr) {
    std::vector<std::shared_ptr<LoadSink>>& sinks = sinks_[item.fqn];
    bool known = false;
    for (const auto& s : sinks) known |= s == sink;
    if (!known) sinks.push_back(sink);
  }
  (checked || !verify_ ? ready_ : waiting_).push_back(item);
}

absl::Status Committer::CommitChecked(
    absl::FunctionRef<bool(const ReadItem&)> checked_now) {
  std::vector<ReadItem> ready = std::exchange(ready_, {});
  std::vector<ReadItem> still;
  for (ReadItem& item : waiting_) {
    if (checked_now(item)) {
      ready.push_back(std::move(item));
    } else {
      still.push_back(std::move(item));
    }
  }
  waiting_ = std::move(still);
  for (const ReadItem& item : ready) CAIRN_RETURN_IF_ERROR(Commit(item));
  return absl::OkStatus();
}

absl::Status Committer::CommitRest() {
  std::vector<ReadItem> rest = std::exchange(waiting_, {});
  for (ReadItem& item : std::exchange(ready_, {})) rest.push_back(std::move(item));
  for (const ReadItem& item : rest) CAIRN_RETURN_IF_ERROR(Commit(item));
  return absl::OkStatus();
}

absl::Status Committer::Commit(const ReadItem& item) {
  CAIRN_RETURN_IF_ERROR(planner_.CommitChunk(item));
  auto left = left_.find(item.fqn);
  if (left == left_.end() || --left->second > 0) return absl::OkStatus();
  left_.erase(left);
  auto sinks = sinks_.find(item.fqn);
  if (sinks == sinks_.end()) return absl::OkStatus();
  for (const auto& sink : sinks->second) {
    CAIRN_RETURN_IF_ERROR(sink->Complete(item.fqn));
  }
  sinks_.erase(sinks);
  return absl::OkStatus();
}

}  // namespace cairn::internal_checkpoint
