// Load, step 2 (see load.cc): what each rank sends the coordinator of its
// plan (EncodeLocalLoadPlan: its whole plan, or a summary), the
// coordinator's global planning (PlanLoadGlobally), and the replica groups
// of ranks whose plans read the same items: found by hash, then checked
// exactly (KeepVerifiedGroup).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/communicator.h"
#include "cairn/metadata.h"
#include "cairn/planner.h"
#include "checkpoint/load_internal.h"
#include "core/byte_codec.h"
#include "core/status.h"
#include "plan/plan_codec.h"

namespace cairn::internal_checkpoint {
namespace {

// What a rank's plan reads, for finding replicas: each item's FQN, kind,
// chunk and overlap (local_index is the planner's own reference, not what
// is read).
std::string ReplicaKey(const LoadPlan& plan) {
  internal_core::ByteWriter key;
  for (const ReadItem& item : plan.items) {
    key.Str(item.fqn);
    key.U8(static_cast<uint8_t>(item.kind));
    key.U64(item.chunk);
    key.Ints(item.overlap.offsets);
    key.Ints(item.overlap.sizes);
  }
  return key.Take();
}

// Replica groups: ranks whose final plans read exactly the same items
// (data-parallel replicas). groups[r] is the lowest rank of r's group.
std::vector<int> ReplicaGroups(const std::vector<LoadPlan>& plans) {
  std::map<std::string, int> first;
  std::vector<int> groups(plans.size());
  for (size_t r = 0; r < plans.size(); ++r) {
    groups[r] = plans[r].items.empty()
                    ? static_cast<int>(r)
                    : first.try_emplace(ReplicaKey(plans[r]),
                                        static_cast<int>(r))
                          .first->second;
  }
  return groups;
}

// True for cairn's DefaultLoadPlanner and its subclasses (its
// CreateGlobalPlan, which returns the local plans, is final).
bool KeepsLocalPlans(const LoadPlanner& planner) {
  return dynamic_cast<const DefaultLoadPlanner*>(&planner) != nullptr;
}

// The stored leaves in an order every rank derives from the same metadata:
// tensors, objects, scalars, each by name.
std::vector<const std::string*> StoredLeaves(const Metadata& metadata) {
  std::vector<const std::string*> leaves;
  leaves.reserve(metadata.tensors.size() + metadata.objects.size() +
                 metadata.scalars.size());
  for (const auto& [name, unused] : metadata.tensors) leaves.push_back(&name);
  for (const auto& [name, unused] : metadata.objects) leaves.push_back(&name);
  for (const auto& [name, unused] : metadata.scalars) leaves.push_back(&name);
  return leaves;
}

// `names` (stored leaves) as a bit set over StoredLeaves: bit i of byte
// i / 8 for leaf i. A name the metadata lacks is an internal error. (Each
// name is counted once, where it is first found: decoding refuses an FQN
// in two of tensors, objects and scalars, and a name counted twice would
// make the count of those not found wrap.)
absl::StatusOr<std::string> LeafBits(const Metadata& metadata,
                                     const std::vector<std::string>& names) {
  const std::vector<const std::string*> leaves = StoredLeaves(metadata);
  absl::flat_hash_set<std::string_view> wanted(names.begin(), names.end());
  const size_t asked = wanted.size();
  std::string bits((leaves.size() + 7) / 8, '\0');
  for (size_t i = 0; i < leaves.size() && !wanted.empty(); ++i) {
    if (wanted.erase(*leaves[i]) > 0) {
      bits[i / 8] = static_cast<char>(bits[i / 8] | (1 << (i % 8)));
    }
  }
  if (!wanted.empty()) {
    return absl::InternalError(absl::StrFormat(
        "%d of the planner's %d unexpected leaves are not in the checkpoint",
        wanted.size(), asked));
  }
  return bits;
}

uint64_t MixBits(uint64_t h) {  // splitmix64's finalizer
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

// A 64-bit hash of a ReplicaKey, the same in every process. The groups it
// suggests are checked byte for byte afterwards (KeepVerifiedGroup), so a
// collision costs the broadcast, never a wrong byte.
uint64_t HashReplicaKey(std::string_view key) {
  uint64_t h = MixBits(0x9e3779b97f4a7c15ULL ^ key.size());
  size_t i = 0;
  for (; i + 8 <= key.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, key.data() + i, 8);
    h = MixBits(h ^ word) + 0x9e3779b97f4a7c15ULL;
  }
  uint64_t tail = 0;
  std::memcpy(&tail, key.data() + i, key.size() - i);
  return MixBits(h ^ tail);
}

std::atomic<uint64_t (*)(std::string_view)> replica_hash{&HashReplicaKey};

bool HasGroups(const std::vector<int>& groups) {
  for (size_t r = 0; r < groups.size(); ++r) {
    if (groups[r] != static_cast<int>(r)) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> LeafNames(const Metadata& metadata,
                                                   std::string_view bits) {
  const std::vector<const std::string*> leaves = StoredLeaves(metadata);
  if (bits.size() != (leaves.size() + 7) / 8) {
    return absl::DataLossError(absl::StrFormat(
        "load plan from the coordinator: %d bytes of unexpected leaves for "
        "%d stored leaves",
        bits.size(), leaves.size()));
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < leaves.size(); ++i) {
    if ((static_cast<uint8_t>(bits[i / 8]) >> (i % 8)) & 1) {
      names.push_back(*leaves[i]);
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

absl::Status KeepVerifiedGroup(Communicator& comm, const LoadPlan& plan,
                               std::unique_ptr<Communicator>& group) {
  int64_t same = 1;
  if (group->size() > 1) {
    const std::string key = ReplicaKey(plan);
    std::string leader = key;
    CAIRN_RETURN_IF_ERROR(group->Broadcast(leader, 0));
    same = leader == key ? 1 : 0;
  }
  CAIRN_RETURN_IF_ERROR(
      comm.AllReduce(std::span<int64_t>(&same, 1), ReduceOp::kMin));
  if (same == 0) group.reset();
  return absl::OkStatus();
}

void SetReplicaHashForTesting(uint64_t (*hash)(std::string_view)) {
  replica_hash.store(hash != nullptr ? hash : &HashReplicaKey);
}

absl::StatusOr<std::string> EncodeLocalLoadPlan(const LoadPlanner& planner,
                                                const LoadPlan& plan,
                                                const Metadata& metadata,
                                                bool node_reads) {
  internal_core::ByteWriter w;
  if (!KeepsLocalPlans(planner)) {
    w.U8(kFullPlan);
    w.Str(internal_plan::EncodeLoadPlan(plan));
    w.U8(node_reads ? 1 : 0);
    return w.Take();
  }
  CAIRN_ASSIGN_OR_RETURN(std::string bits, LeafBits(metadata, plan.unexpected));
  w.U8(kPlanSummary);
  w.U64(plan.items.size());
  w.U64(plan.items.empty() ? 0 : replica_hash.load()(ReplicaKey(plan)));
  w.Str(bits);
  w.U8(node_reads ? 1 : 0);
  return w.Take();
}

absl::StatusOr<std::vector<std::string>> PlanLoadGlobally(
    LoadPlanner& planner, const Metadata& metadata,
    const std::vector<std::string>& gathered, bool broadcast_replicas) {
  const size_t world = gathered.size();
  const uint8_t kind = KeepsLocalPlans(planner) ? kPlanSummary : kFullPlan;
  std::vector<internal_core::ByteReader> readers;
  readers.reserve(world);
  for (size_t r = 0; r < world; ++r) {
    internal_core::ByteReader& reader = readers.emplace_back(
        gathered[r], absl::StrCat("load plan of rank ", r));
    const uint8_t got = reader.U8();
    if (reader.failed()) return reader.status();
    if (got != kind) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "rank %d planned its load with %s, the coordinator with %s: every "
          "rank must pass the same kind of LoadOptions::planner",
          r, got == kPlanSummary ? "cairn's default planner" : "its own planner",
          kind == kPlanSummary ? "cairn's default planner"
                               : "its own planner"));
    }
  }
  // Each rank's unexpected leaves (as a bit set over StoredLeaves), what
  // its plan reads (the number of items, and a hash of them, or the whole
  // plan), for the replica groups.
  std::string unexpected_bits;
  bool node_reads = false;  // any rank asked for them
  std::vector<int> groups;
  std::vector<LoadPlan> plans;
  if (kind == kPlanSummary) {
    const size_t leaves = StoredLeaves(metadata).size();
    const size_t bytes = (leaves + 7) / 8;
    unexpected_bits.assign(bytes, static_cast<char>(0xff));
    std::map<std::pair<uint64_t, uint64_t>, int> first;
    groups.resize(world);
    for (size_t r = 0; r < world; ++r) {
      internal_core::ByteReader& reader = readers[r];
      const uint64_t items = reader.U64();
      const uint64_t hash = reader.U64();
      const std::string_view bits = reader.StrView();
      node_reads |= reader.U8() != 0;
      CAIRN_RETURN_IF_ERROR(reader.status());
      if (bits.size() != bytes) {
        return absl::DataLossError(absl::StrFormat(
            "load plan of rank %d: %d bytes of unexpected leaves for %d "
            "stored leaves",
            r, bits.size(), leaves));
      }
      // A stored leaf is unexpected only when no rank asked for it.
      for (size_t i = 0; i < bytes; ++i) unexpected_bits[i] &= bits[i];
      groups[r] = items == 0 ? static_cast<int>(r)
                             : first.try_emplace({items, hash},
                                                 static_cast<int>(r))
                                   .first->second;
    }
    if (!broadcast_replicas) groups.clear();
  } else {
    std::vector<LoadPlan> locals;
    locals.reserve(world);
    for (size_t r = 0; r < world; ++r) {
      const std::string_view bytes = readers[r].StrView();
      node_reads |= readers[r].U8() != 0;
      CAIRN_RETURN_IF_ERROR(readers[r].status());
      CAIRN_ASSIGN_OR_RETURN(
          LoadPlan p, internal_plan::DecodeLoadPlan(
                          bytes, absl::StrCat("load plan of rank ", r)));
      locals.push_back(std::move(p));
    }
    // A stored leaf is unexpected only when no rank asked for it.
    std::vector<std::string> unexpected;
    if (!locals.empty()) {
      unexpected = locals[0].unexpected;
      for (size_t r = 1; r < locals.size(); ++r) {
        std::vector<std::string> both;
        std::set_intersection(unexpected.begin(), unexpected.end(),
                              locals[r].unexpected.begin(),
                              locals[r].unexpected.end(),
                              std::back_inserter(both));
        unexpected = std::move(both);
      }
    }
    CAIRN_ASSIGN_OR_RETURN(plans, planner.CreateGlobalPlan(std::move(locals)));
    if (plans.size() != world) {
      return absl::InternalError(
          absl::StrFormat("CreateGlobalPlan returned %d plans for %d ranks",
                          plans.size(), world));
    }
    for (LoadPlan& p : plans) p.unexpected = unexpected;
    if (broadcast_replicas) groups = ReplicaGroups(plans);
  }
  const bool any_group = HasGroups(groups);
  std::vector<std::string> finals;
  finals.reserve(world);
  for (size_t r = 0; r < world; ++r) {
    internal_core::ByteWriter w;
    w.U8(kind);
    w.U8(any_group ? 1 : 0);
    w.U8(node_reads ? 1 : 0);
    w.I64(any_group ? groups[r] : static_cast<int64_t>(r));
    w.Str(kind == kPlanSummary ? unexpected_bits
                               : internal_plan::EncodeLoadPlan(plans[r]));
    finals.push_back(w.Take());
  }
  return finals;
}

}  // namespace cairn::internal_checkpoint
