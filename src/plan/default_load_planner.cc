// DefaultLoadPlanner: one read item per (destination box, stored chunk) that
// overlap, one per object; scalars assigned in SetUp.
#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/planner.h"
#include "core/flatten.h"
#include "core/status.h"
#include "plan/validate.h"

namespace cairn {

struct DefaultLoadPlanner::Target {
  std::string fqn;     // in the destination state dict
  std::string stored;  // in the checkpoint
  ShardedTensor* tensor = nullptr;
  size_t shard = 0;
  Object* object = nullptr;
};

DefaultLoadPlanner::DefaultLoadPlanner(bool strict) : strict_(strict) {}
DefaultLoadPlanner::~DefaultLoadPlanner() = default;

std::string DefaultLoadPlanner::StoredName(const std::string& fqn) const {
  return fqn;
}

absl::Status LoadSink::Complete(const std::string&) {
  return absl::OkStatus();
}

absl::Status DefaultLoadPlanner::OnTensorLoaded(const std::string&) {
  return absl::OkStatus();
}

absl::Status DefaultLoadPlanner::SetUp(StateDict& state,
                                       const Metadata& metadata,
                                       bool is_coordinator, int rank,
                                       int world_size) {
  metadata_ = &metadata;
  targets_.clear();
  remaining_.clear();
  missing_.clear();
  unexpected_.clear();
  CAIRN_ASSIGN_OR_RETURN(internal_core::MutableFlattened flat,
                         internal_core::FlattenMutable(state));
  auto stored_kind = [&](const std::string& name) -> std::string_view {
    return metadata.tensors.contains(name)   ? "a tensor"
           : metadata.objects.contains(name) ? "a byte object"
           : metadata.scalars.contains(name) ? "a scalar"
                                              : "";
  };
  auto absent = [&](const std::string& fqn, const std::string& stored,
                    std::string_view want) -> absl::Status {
    if (std::string_view have = stored_kind(stored); !have.empty()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: the destination is %s but the checkpoint holds %s", fqn, want,
          have));
    }
    if (strict_) {
      return absl::NotFoundError(absl::StrFormat(
          "%s '%s' is not in the checkpoint (load with strict = false to "
          "skip it)",
          want, stored));
    }
    missing_.push_back(fqn);
    return absl::OkStatus();
  };

  std::set<std::string> requested;
  for (internal_core::MutableFlatLeaf& leaf : flat.leaves) {
    std::string stored = StoredName(leaf.fqn);
    requested.insert(stored);
    StateDict& node = *leaf.node;
    if (node.scalar() != nullptr || node.object() != nullptr) {
      // A scalar or object leaf takes whichever of the two is stored (a
      // Python int too large for int64 is stored as an object, say).
      if (auto it = metadata.scalars.find(stored);
          it != metadata.scalars.end()) {
        node = StateDict(it->second);
      } else if (metadata.objects.contains(stored)) {
        if (node.object() == nullptr) node = StateDict(Object{});
        targets_.push_back(Target{leaf.fqn, stored, nullptr, 0, node.object()});
      } else {
        CAIRN_RETURN_IF_ERROR(absent(leaf.fqn, stored,
                                     node.scalar() != nullptr
                                         ? "a scalar"
                                         : "a byte object"));
      }
    } else if (ShardedTensor* t = node.tensor()) {
      auto it = metadata.tensors.find(stored);
      if (it == metadata.tensors.end()) {
        CAIRN_RETURN_IF_ERROR(absent(leaf.fqn, stored, "a tensor"));
        continue;
      }
      const TensorMetadata& tm = it->second;
      if (t->dtype() != tm.dtype) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "%s: dtype mismatch: checkpoint has %s, destination is %s",
            leaf.fqn, DTypeName(tm.dtype), DTypeName(t->dtype())));
      }
      if (t->global_shape() != tm.shape) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "%s: shape mismatch: checkpoint has [%s], destination is [%s]",
            leaf.fqn, absl::StrJoin(tm.shape, ", "),
            absl::StrJoin(t->global_shape(), ", ")));
      }
      for (size_t s = 0; s < t->shards().size(); ++s) {
        const Shard& shard = t->shards()[s];
        // Device destinations are filled from pinned host staging (see
        // StagedLoad in load_staged.cc).
        CAIRN_RETURN_IF_ERROR(internal_plan::ValidateShard(
            leaf.fqn, *t, shard, /*allow_device=*/true));
        CAIRN_RETURN_IF_ERROR(
            internal_plan::CheckDeviceRuntime(leaf.fqn, shard));
        if (shard.box.empty()) continue;
        targets_.push_back(Target{leaf.fqn, stored, t, s, nullptr});
      }
    } else {
      return absl::InternalError(absl::StrCat("non-leaf at ", leaf.fqn));
    }
  }
  auto note_unexpected = [&](const auto& map) {
    for (const auto& [fqn, unused] : map) {
      if (!requested.contains(fqn)) unexpected_.push_back(fqn);
    }
  };
  note_unexpected(metadata.tensors);
  note_unexpected(metadata.objects);
  note_unexpected(metadata.scalars);
  std::sort(unexpected_.begin(), unexpected_.end());
  return absl::OkStatus();
}

absl::StatusOr<LoadPlan> DefaultLoadPlanner::CreateLocalPlan() {
  if (metadata_ == nullptr) {
    return absl::FailedPreconditionError("CreateLocalPlan before SetUp");
  }
  LoadPlan plan;
  plan.missing = missing_;
  plan.unexpected = unexpected_;
  for (size_t i = 0; i < targets_.size(); ++i) {
    const Target& target = targets_[i];
    if (target.object != nullptr) {
      ReadItem item;
      item.fqn = target.stored;
      item.kind = ItemKind::kObject;
      item.local_index = static_cast<int64_t>(i);
      plan.items.push_back(std::move(item));
      continue;
    }
    const Box& box = target.tensor->shards()[target.shard].box;
    const TensorMetadata& tm = metadata_->tensors.at(target.stored);
    int64_t covered = 0;
    for (size_t c = 0; c < tm.chunks.size(); ++c) {
      std::optional<Box> overlap = Intersect(box, tm.chunks[c].box);
      if (!overlap) continue;
      covered += overlap->num_elements();
      ReadItem item;
      item.fqn = target.stored;
      item.kind = ItemKind::kTensor;
      item.local_index = static_cast<int64_t>(i);
      item.chunk = c;
      item.overlap = *std::move(overlap);
      plan.items.push_back(std::move(item));
    }
    // Stored chunks never overlap, so this counts each element once. In a
    // global checkpoint they cover every tensor; a rank-local one holds one
    // rank's part, and a destination beyond it must not be left unfilled.
    if (covered != box.num_elements()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: destination box %s is only partly in the checkpoint (%d of "
          "%d elements)%s",
          target.fqn, box.ToString(), covered, box.num_elements(),
          metadata_->rank >= 0
              ? absl::StrFormat("; this is rank %d's folder of a rank-local "
                                "checkpoint, which holds only what that "
                                "rank saved: load with the same sharding, "
                                "or merge it (cairn merge) first",
                                metadata_->rank)
              : ""));
    }
  }
  return plan;
}

absl::StatusOr<std::vector<LoadPlan>> DefaultLoadPlanner::CreateGlobalPlan(
    std::vector<LoadPlan> local_plans) {
  return local_plans;
}

absl::StatusOr<LoadPlan> DefaultLoadPlanner::FinishPlan(LoadPlan plan) {
  remaining_.clear();
  for (const ReadItem& item : plan.items) {
    if (item.local_index < 0 ||
        static_cast<size_t>(item.local_index) >= targets_.size()) {
      return absl::InternalError(absl::StrFormat(
          "%s: the final plan refers to destination %d, which this rank's "
          "local plan does not have",
          item.fqn, item.local_index));
    }
    ++remaining_[targets_[item.local_index].fqn];
  }
  return plan;
}

absl::StatusOr<Destination> DefaultLoadPlanner::ResolveDestination(
    const ReadItem& item) {
  if (item.local_index < 0 ||
      static_cast<size_t>(item.local_index) >= targets_.size()) {
    return absl::InternalError(absl::StrFormat(
        "%s: no destination %d on this rank", item.fqn, item.local_index));
  }
  const Target& target = targets_[item.local_index];
  Destination dst;
  if (target.object != nullptr) {
    dst.object = &target.object->bytes;
    return dst;
  }
  const Shard& shard = target.tensor->shards()[target.shard];
  Box local = item.overlap;
  if (local.rank() != shard.box.rank()) {
    return absl::InternalError(absl::StrFormat(
        "%s: read item box %s does not match shard %s", target.fqn,
        item.overlap.ToString(), shard.box.ToString()));
  }
  for (int d = 0; d < local.rank(); ++d) {
    local.offsets[d] -= shard.box.offsets[d];
  }
  CAIRN_ASSIGN_OR_RETURN(dst.view, shard.view.Slice(local));
  return dst;
}

absl::Status DefaultLoadPlanner::CommitChunk(const ReadItem& item) {
  if (item.local_index < 0 ||
      static_cast<size_t>(item.local_index) >= targets_.size()) {
    return absl::InternalError(absl::StrFormat(
        "%s: no destination %d on this rank", item.fqn, item.local_index));
  }
  const std::string& fqn = targets_[item.local_index].fqn;
  auto it = remaining_.find(fqn);
  if (it == remaining_.end() || it->second <= 0) {
    return absl::InternalError(
        absl::StrFormat("%s: more items committed than planned", fqn));
  }
  if (--it->second == 0) return OnTensorLoaded(fqn);
  return absl::OkStatus();
}

}  // namespace cairn
