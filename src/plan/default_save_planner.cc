// DefaultSavePlanner: one write item per non-empty shard, per object; scalars
// in the plan; replicated boxes deduplicated by DedupSavePlans.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/planner.h"
#include "core/checked.h"
#include "core/flatten.h"
#include "core/status.h"
#include "cuda/device_runtime.h"
#include "plan/validate.h"

namespace cairn {

struct DefaultSavePlanner::Leaf {
  std::string fqn;
  const StateDict* node = nullptr;
  bool materialize = false;
};

// Host copies of one tensor's shards, shared by the tensor's items while
// they are written.
struct DefaultSavePlanner::Materialized {
  std::mutex mu;  // held while materializing
  bool done = false;
  absl::Status status;
  std::vector<Tensor> copies;
  int64_t remaining = 0;  // items not yet released; guarded by the planner's mu_
};

DefaultSavePlanner::DefaultSavePlanner(DedupPolicy dedup) : dedup_(dedup) {}
DefaultSavePlanner::~DefaultSavePlanner() = default;

bool DefaultSavePlanner::NeedsMaterialize(const std::string&,
                                          const ShardedTensor& tensor) const {
  for (const Shard& shard : tensor.shards()) {
    if (!shard.view.device().is_cpu()) return true;
  }
  return false;
}

absl::StatusOr<std::vector<Tensor>> DefaultSavePlanner::Materialize(
    const std::string& fqn, const ShardedTensor& tensor) {
  // Device shards are copied to host memory (one device-to-host copy per
  // shard, on cairn's own stream, after the device's queued work); host
  // shards of the same tensor are copied too, so the copies are uniform.
  std::vector<Tensor> copies;
  copies.reserve(tensor.shards().size());
  for (const Shard& shard : tensor.shards()) {
    if (shard.view.device().is_cpu()) {
      CAIRN_ASSIGN_OR_RETURN(Tensor copy, Tensor::CopyOf(shard.view));
      copies.push_back(std::move(copy));
    } else {
      CAIRN_ASSIGN_OR_RETURN(
          Tensor copy,
          internal_cuda::CopyToHostTensor(
              absl::StrCat(fqn, " shard ", shard.box.ToString()), shard.view));
      copies.push_back(std::move(copy));
    }
  }
  return copies;
}

absl::Status DefaultSavePlanner::SetUp(const StateDict& state,
                                       bool is_coordinator, int rank,
                                       int world_size) {
  is_coordinator_ = is_coordinator;
  rank_ = rank;
  world_size_ = world_size;
  leaves_.clear();
  sources_.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    materialized_.clear();
  }
  CAIRN_ASSIGN_OR_RETURN(internal_core::Flattened flat,
                         internal_core::Flatten(state));
  structure_ = std::move(flat.structure);
  leaves_.reserve(flat.leaves.size());
  for (internal_core::FlatLeaf& leaf : flat.leaves) {
    leaves_.push_back(Leaf{std::move(leaf.fqn), leaf.node, false});
  }
  return absl::OkStatus();
}

absl::StatusOr<SavePlan> DefaultSavePlanner::CreateLocalPlan() {
  SavePlan plan;
  plan.structure = structure_;
  for (size_t l = 0; l < leaves_.size(); ++l) {
    Leaf& leaf = leaves_[l];
    const StateDict& node = *leaf.node;
    if (const Scalar* s = node.scalar()) {
      plan.scalars[leaf.fqn] = *s;
    } else if (const Object* o = node.object()) {
      WriteItem item;
      item.fqn = leaf.fqn;
      item.kind = ItemKind::kObject;
      item.dtype = DType::kU8;
      item.nbytes = o->bytes.size();
      item.local_index = static_cast<int64_t>(sources_.size());
      sources_.push_back({l, 0});
      plan.items.push_back(std::move(item));
    } else if (const ShardedTensor* t = node.tensor()) {
      for (int64_t d : t->global_shape()) {
        if (d < 0) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: negative dimension in shape [%s]", leaf.fqn,
              absl::StrJoin(t->global_shape(), ", ")));
        }
      }
      leaf.materialize = NeedsMaterialize(leaf.fqn, *t);
      if (NumElements(t->global_shape()) == 0) {
        // Nothing to write, but the tensor must still be in the checkpoint:
        // one zero-byte item for its (empty) whole box.
        for (const Shard& shard : t->shards()) {
          CAIRN_RETURN_IF_ERROR(internal_plan::ValidateShard(
              leaf.fqn, *t, shard, /*allow_device=*/true));
        }
        WriteItem item;
        item.fqn = leaf.fqn;
        item.dtype = t->dtype();
        item.global_shape = t->global_shape();
        item.box = Box::Full(t->global_shape());
        item.local_index = static_cast<int64_t>(sources_.size());
        sources_.push_back({l, 0});
        plan.items.push_back(std::move(item));
        continue;
      }
      const size_t items_before = plan.items.size();
      for (size_t s = 0; s < t->shards().size(); ++s) {
        const Shard& shard = t->shards()[s];
        CAIRN_RETURN_IF_ERROR(internal_plan::ValidateShard(
            leaf.fqn, *t, shard, /*allow_device=*/leaf.materialize));
        CAIRN_RETURN_IF_ERROR(
            internal_plan::CheckDeviceRuntime(leaf.fqn, shard));
        if (shard.box.empty()) continue;
        WriteItem item;
        item.fqn = leaf.fqn;
        item.kind = ItemKind::kTensor;
        item.dtype = t->dtype();
        item.global_shape = t->global_shape();
        item.box = shard.box;
        item.nbytes =
            internal_core::CheckedBytes(shard.box.sizes, t->dtype()).value_or(0);
        item.local_index = static_cast<int64_t>(sources_.size());
        sources_.push_back({l, s});
        plan.items.push_back(std::move(item));
      }
      // (A rank-0 tensor has no empty box to declare it with.)
      if (plan.items.size() == items_before && !t->global_shape().empty()) {
        // This rank holds none of the tensor's bytes but does hold the
        // tensor: declare it with a zero-byte item, so that a rank-local
        // checkpoint still lists it (dedup drops the declaration when
        // another rank writes bytes of the tensor).
        WriteItem item;
        item.fqn = leaf.fqn;
        item.dtype = t->dtype();
        item.global_shape = t->global_shape();
        item.box = Box::Full(t->global_shape());
        item.box.sizes[0] = 0;
        item.local_index = static_cast<int64_t>(sources_.size());
        sources_.push_back({l, 0});
        plan.items.push_back(std::move(item));
      }
    } else {
      return absl::InternalError(
          absl::StrCat("flatten returned a non-leaf at ", leaf.fqn));
    }
  }
  return plan;
}

absl::StatusOr<std::vector<SavePlan>> DefaultSavePlanner::CreateGlobalPlan(
    std::vector<SavePlan> local_plans) {
  return DedupSavePlans(std::move(local_plans), dedup_);
}

absl::StatusOr<SavePlan> DefaultSavePlanner::FinishPlan(SavePlan plan) {
  std::lock_guard<std::mutex> lock(mu_);
  materialized_.clear();
  for (const WriteItem& item : plan.items) {
    if (item.local_index < 0 ||
        static_cast<size_t>(item.local_index) >= sources_.size()) {
      return absl::InternalError(absl::StrFormat(
          "%s: the final plan refers to source %d, which this rank's local "
          "plan does not have",
          item.fqn, item.local_index));
    }
    const size_t leaf = sources_[item.local_index].first;
    if (!leaves_[leaf].materialize) continue;
    std::shared_ptr<Materialized>& m = materialized_[static_cast<int64_t>(leaf)];
    if (!m) m = std::make_shared<Materialized>();
    ++m->remaining;
  }
  return plan;
}

absl::StatusOr<ResolvedData> DefaultSavePlanner::ResolveData(
    const WriteItem& item) {
  if (item.local_index < 0 ||
      static_cast<size_t>(item.local_index) >= sources_.size()) {
    return absl::InternalError(absl::StrFormat(
        "%s: no source %d on this rank", item.fqn, item.local_index));
  }
  const auto [l, s] = sources_[item.local_index];
  const Leaf& leaf = leaves_[l];
  ResolvedData data;
  if (const Object* o = leaf.node->object()) {
    data.bytes = std::as_bytes(std::span<const char>(o->bytes));
    return data;
  }
  const ShardedTensor* t = leaf.node->tensor();
  if (t == nullptr || s >= t->shards().size()) {
    return absl::InternalError(
        absl::StrFormat("%s: source %d is not a tensor shard", item.fqn,
                        item.local_index));
  }
  if (!leaf.materialize) {
    data.view = t->shards()[s].view;
    data.keep_alive = t->owner();
    return data;
  }

  std::shared_ptr<Materialized> m;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = materialized_.find(static_cast<int64_t>(l));
    if (it == materialized_.end()) {
      return absl::InternalError(absl::StrFormat(
          "%s: resolved more items than the final plan holds", item.fqn));
    }
    m = it->second;
  }
  {
    std::lock_guard<std::mutex> lock(m->mu);
    if (!m->done) {
      absl::StatusOr<std::vector<Tensor>> copies = Materialize(leaf.fqn, *t);
      m->done = true;
      if (!copies.ok()) {
        m->status = copies.status();
      } else if (copies->size() != t->shards().size()) {
        m->status = absl::InternalError(absl::StrFormat(
            "%s: Materialize returned %d tensors for %d shards", leaf.fqn,
            copies->size(), t->shards().size()));
      } else {
        m->copies = *std::move(copies);
      }
    }
    CAIRN_RETURN_IF_ERROR(m->status);
  }
  const Tensor& copy = m->copies[s];
  if (copy.dtype() != t->dtype() || copy.shape() != t->shards()[s].box.sizes) {
    return absl::InternalError(absl::StrFormat(
        "%s: Materialize returned a %s [%s] copy for shard %s", leaf.fqn,
        DTypeName(copy.dtype()), absl::StrJoin(copy.shape(), ", "),
        t->shards()[s].box.ToString()));
  }
  data.view = copy.view();
  // Released after this item's last byte is written; the last item of the
  // tensor frees the copies.
  const int64_t key = static_cast<int64_t>(l);
  data.keep_alive = std::shared_ptr<const void>(
      m.get(), [this, key, m](const void*) {
        std::lock_guard<std::mutex> lock(mu_);
        if (--m->remaining == 0) {
          m->copies.clear();
          materialized_.erase(key);
        }
      });
  return data;
}

}  // namespace cairn
