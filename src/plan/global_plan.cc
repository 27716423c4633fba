#include "plan/global_plan.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/big_vector.h"
#include "core/checked.h"
#include "core/status.h"
#include "format/metadata_codec.h"
#include "plan/plan_codec.h"
#include "plan/validate.h"

namespace cairn::internal_plan {
namespace {

using Json = nlohmann::json;

// Lists at most this many (rank, box) pairs in an error message.
constexpr size_t kMaxListed = 16;

std::string ShapeString(const Shape& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

struct Holder {
  int rank;
  size_t item;
};

// A distinct stored piece is an item's (FQN, kind, box); items are hashed
// and compared in place, so no key string is built per item (the save
// coordinator sees ranks x tensors of them).
struct PieceHash {
  size_t operator()(const WriteItem* item) const {
    return absl::HashOf(absl::string_view(item->fqn), item->kind,
                        item->box.offsets, item->box.sizes);
  }
};
struct PieceEq {
  bool operator()(const WriteItem* a, const WriteItem* b) const {
    return a->fqn == b->fqn && a->kind == b->kind && a->box == b->box;
  }
};

std::string ListHolders(const std::vector<std::pair<int, Box>>& holders) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < holders.size() && i < kMaxListed; ++i) {
    parts.push_back(absl::StrCat("rank ", holders[i].first, " ",
                                 holders[i].second.ToString()));
  }
  std::string s = absl::StrJoin(parts, ", ");
  if (holders.size() > kMaxListed) {
    absl::StrAppend(&s, " and ", holders.size() - kMaxListed, " more");
  }
  return s;
}

absl::Status MergeJson(Json& into, const Json& from, const std::string& path,
                       int rank) {
  if (into.is_null()) {
    into = from;
    return absl::OkStatus();
  }
  if (into.type() != from.type() ||
      (into.is_string() && into != from)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "the ranks disagree on the nesting at '%s': rank %d has %s where an "
        "earlier rank has %s",
        path.empty() ? "<root>" : path, rank, from.dump(), into.dump()));
  }
  if (into.is_object()) {
    for (auto it = from.begin(); it != from.end(); ++it) {
      CAIRN_RETURN_IF_ERROR(MergeJson(
          into[it.key()], it.value(),
          path.empty() ? it.key() : absl::StrCat(path, ".", it.key()), rank));
    }
  } else if (into.is_array()) {
    for (size_t i = 0; i < from.size(); ++i) {
      if (i >= into.size()) into.push_back(Json());
      CAIRN_RETURN_IF_ERROR(MergeJson(
          into[i], from[i],
          path.empty() ? std::to_string(i) : absl::StrCat(path, ".", i), rank));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<SavePlan> DedupImpl(std::vector<SavePlan> local_plans,
                                DedupPolicy policy) {
  const int world = static_cast<int>(local_plans.size());
  // Items of all ranks in one index space: rank r's item i is base[r] + i.
  std::vector<size_t> base(world + 1, 0);
  for (int r = 0; r < world; ++r) {
    base[r + 1] = base[r] + local_plans[r].items.size();
  }
  // Pieces are numbered in first-seen order, for determinism. A rank
  // holding the same piece twice is one holder (it writes it at most once):
  // its later copies get no holder slot.
  constexpr size_t kNotHolder = ~size_t{0};
  absl::flat_hash_map<const WriteItem*, size_t, PieceHash, PieceEq> ids;
  ids.reserve(base[world]);
  std::vector<size_t> piece_of(base[world]);
  std::vector<int> last_rank;
  std::vector<size_t> num_holders;
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < local_plans[r].items.size(); ++i) {
      auto [it, inserted] =
          ids.try_emplace(&local_plans[r].items[i], last_rank.size());
      const size_t id = it->second;
      if (inserted) {
        last_rank.push_back(r);
        num_holders.push_back(1);
      } else if (last_rank[id] != r) {
        last_rank[id] = r;
        ++num_holders[id];
      } else {
        piece_of[base[r] + i] = kNotHolder;
        continue;
      }
      piece_of[base[r] + i] = id;
    }
  }
  internal_core::ReleaseStorage(ids);
  internal_core::ReleaseStorage(last_rank);
  // Each piece's holders, in rank order, at [first[id], first[id + 1]).
  const size_t num_pieces = num_holders.size();
  std::vector<size_t> first(num_pieces + 1, 0);
  for (size_t id = 0; id < num_pieces; ++id) {
    first[id + 1] = first[id] + num_holders[id];
  }
  std::vector<Holder> holders(first[num_pieces]);
  {
    std::vector<size_t> next(first.begin(), first.end() - 1);
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < local_plans[r].items.size(); ++i) {
        const size_t id = piece_of[base[r] + i];
        if (id != kNotHolder) holders[next[id]++] = Holder{r, i};
      }
    }
  }
  internal_core::ReleaseStorage(piece_of);

  std::vector<bool> keep(base[world], false);
  std::vector<uint64_t> load(world, 0);
  auto bytes_of = [&](size_t id) {
    const Holder& h = holders[first[id]];
    return local_plans[h.rank].items[h.item].nbytes;
  };
  std::vector<size_t> replicated;
  for (size_t id = 0; id < num_pieces; ++id) {
    if (num_holders[id] == 1 || policy == DedupPolicy::kLowestRank) {
      const Holder& h = holders[first[id]];  // ranks were visited in order
      keep[base[h.rank] + h.item] = true;
      load[h.rank] += local_plans[h.rank].items[h.item].nbytes;
    } else {
      replicated.push_back(id);
    }
  }
  // Greedy: the most constrained pieces (fewest holders) first, larger
  // before smaller, each to the holder with the fewest bytes so far; ties
  // go to the lower rank.
  std::stable_sort(replicated.begin(), replicated.end(),
                   [&](size_t a, size_t b) {
                     if (num_holders[a] != num_holders[b]) {
                       return num_holders[a] < num_holders[b];
                     }
                     return bytes_of(a) > bytes_of(b);
                   });
  for (size_t id : replicated) {
    const Holder* best = &holders[first[id]];
    for (size_t h = first[id]; h < first[id + 1]; ++h) {
      if (load[holders[h].rank] < load[best->rank]) best = &holders[h];
    }
    keep[base[best->rank] + best->item] = true;
    load[best->rank] += bytes_of(id);
  }

  // Zero-byte tensor items only declare a tensor: keep one only for a
  // tensor no rank writes bytes of (a zero-element tensor). Which tensors
  // have bytes is only worked out when a declaration was kept.
  bool kept_declaration = false;
  for (int r = 0; r < world && !kept_declaration; ++r) {
    for (size_t i = 0; i < local_plans[r].items.size(); ++i) {
      const WriteItem& item = local_plans[r].items[i];
      if (keep[base[r] + i] && item.kind == ItemKind::kTensor &&
          item.nbytes == 0) {
        kept_declaration = true;
        break;
      }
    }
  }
  if (kept_declaration) {
    absl::flat_hash_set<absl::string_view> has_bytes;
    for (int r = 0; r < world; ++r) {
      for (const WriteItem& item : local_plans[r].items) {
        if (item.kind == ItemKind::kTensor && item.nbytes > 0) {
          has_bytes.insert(item.fqn);
        }
      }
    }
    for (int r = 0; r < world; ++r) {
      for (size_t i = 0; i < local_plans[r].items.size(); ++i) {
        const WriteItem& item = local_plans[r].items[i];
        if (item.kind == ItemKind::kTensor && item.nbytes == 0 &&
            has_bytes.contains(item.fqn)) {
          keep[base[r] + i] = false;
        }
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    std::vector<WriteItem>& items = local_plans[r].items;
    size_t kept = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!keep[base[r] + i]) continue;
      if (kept != i) items[kept] = std::move(items[i]);  // never self-move
      ++kept;
    }
    items.resize(kept);
  }
  return local_plans;
}

absl::StatusOr<LocalSummary> ValidateLocalPlans(
    const std::vector<SavePlan>& local_plans) {
  struct First {
    int rank;
    const WriteItem* item;
  };
  // Keyed by views of the plans' own FQN strings: ranks x tensors lookups,
  // no copies.
  absl::flat_hash_map<absl::string_view, First> first;
  absl::flat_hash_map<absl::string_view, int> scalar_rank;
  LocalSummary summary;
  for (int r = 0; r < static_cast<int>(local_plans.size()); ++r) {
    for (const auto& [fqn, unused] : local_plans[r].scalars) {
      scalar_rank.try_emplace(fqn, r);
    }
  }
  for (int r = 0; r < static_cast<int>(local_plans.size()); ++r) {
    for (const WriteItem& item : local_plans[r].items) {
      const std::string& fqn = item.fqn;
      if (auto s = scalar_rank.find(fqn); s != scalar_rank.end()) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s is a scalar on rank %d but a %s on rank %d", fqn, s->second,
            item.kind == ItemKind::kTensor ? "tensor" : "byte object", r));
      }
      if (item.kind == ItemKind::kTensor) {
        if (absl::Status s = ValidateBox(item.box, item.global_shape); !s.ok()) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: rank %d saves box %s outside the shape %s: %s", fqn, r,
              item.box.ToString(), ShapeString(item.global_shape),
              s.message()));
        }
        const std::optional<uint64_t> bytes =
            internal_core::CheckedBytes(item.box.sizes, item.dtype);
        if (!bytes || *bytes != item.nbytes) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: rank %d's item for box %s says %d bytes; the box holds %s",
              fqn, r, item.box.ToString(), item.nbytes,
              bytes ? std::to_string(*bytes) : "too many to count"));
        }
      }
      auto [it, inserted] = first.try_emplace(fqn, First{r, &item});
      if (inserted) {
        if (item.kind == ItemKind::kTensor) {
          // A planner of the user's may plan what ValidateShard refuses.
          CAIRN_RETURN_IF_ERROR(
              ValidatePackedShape(fqn, item.dtype, item.global_shape));
        }
        summary.try_emplace(fqn, FqnInfo{item.kind, item.dtype, item.global_shape});
        continue;
      }
      const WriteItem& a = *it->second.item;
      const int ra = it->second.rank;
      if (a.kind != item.kind) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s is a %s on rank %d but a %s on rank %d", fqn,
            a.kind == ItemKind::kTensor ? "tensor" : "byte object", ra,
            item.kind == ItemKind::kTensor ? "tensor" : "byte object", r));
      }
      if (item.kind == ItemKind::kObject) {
        if (a.nbytes != item.nbytes) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "byte object %s is held by rank %d (%d bytes) and rank %d (%d "
              "bytes); an object held by several ranks is saved once, so "
              "every copy must be the same (give per-rank objects per-rank "
              "names)",
              fqn, ra, a.nbytes, r, item.nbytes));
        }
      } else if (a.dtype != item.dtype || a.global_shape != item.global_shape) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: rank %d saves %s %s but rank %d saves %s %s", fqn, ra,
            DTypeName(a.dtype), ShapeString(a.global_shape), r,
            DTypeName(item.dtype), ShapeString(item.global_shape)));
      }
    }
  }
  return summary;
}

absl::Status ValidateFinalPlans(const LocalSummary& local,
                                const std::vector<SavePlan>& final_plans,
                                bool require_coverage) {
  // Boxes are pointers into the final plans (not copies), FQNs views of the
  // summary's strings: one entry per FQN, millions of boxes.
  struct Written {
    const std::string* fqn = nullptr;
    const FqnInfo* any = nullptr;
    std::vector<std::pair<int, const Box*>> boxes;
  };
  std::vector<Written> written;
  written.reserve(local.size());
  absl::flat_hash_map<absl::string_view, size_t> index;
  index.reserve(local.size());
  for (const auto& [fqn, info] : local) {
    index.try_emplace(fqn, written.size());
    written.push_back(Written{&fqn, &info, {}});
  }
  for (int r = 0; r < static_cast<int>(final_plans.size()); ++r) {
    for (const WriteItem& item : final_plans[r].items) {
      auto it = index.find(item.fqn);
      const FqnInfo* any =
          it == index.end() ? nullptr : written[it->second].any;
      if (any == nullptr || any->kind != item.kind ||
          (item.kind == ItemKind::kTensor &&
           (any->dtype != item.dtype ||
            any->global_shape != item.global_shape))) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "the global plan has rank %d write %s, which no rank's local "
            "plan holds in that form",
            r, item.fqn));
      }
      written[it->second].boxes.push_back({r, &item.box});
    }
  }
  // In FQN order, so the first error reported does not depend on hashing.
  std::sort(written.begin(), written.end(),
            [](const Written& a, const Written& b) { return *a.fqn < *b.fqn; });
  std::vector<const Box*> boxes;
  for (Written& w : written) {
    const std::string& fqn = *w.fqn;
    if (w.boxes.empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the global plan writes %s on no rank", fqn));
    }
    if (w.any->kind == ItemKind::kObject) {
      if (w.boxes.size() > 1) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "the global plan writes byte object %s on ranks %d and %d", fqn,
            w.boxes[0].first, w.boxes[1].first));
      }
      continue;
    }
    if (!require_coverage) continue;
    const Shape& shape = w.any->global_shape;
    boxes.clear();
    for (const auto& [rank, box] : w.boxes) boxes.push_back(box);
    if (internal_format::ValidateCoverage(fqn, shape, boxes).ok()) continue;
    // Say which ranks: find an overlapping pair, else list the holders.
    std::vector<std::pair<int, Box>> holders;
    for (const auto& [rank, box] : w.boxes) holders.push_back({rank, *box});
    std::sort(holders.begin(), holders.end(),
              [](const auto& a, const auto& b) {
                return a.second.offsets < b.second.offsets;
              });
    for (size_t i = 0; i < holders.size(); ++i) {
      for (size_t j = i + 1; j < holders.size(); ++j) {
        if (Intersect(holders[i].second, holders[j].second)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s %s: box %s on rank %d overlaps box %s on rank %d; shards "
              "must not overlap unless they are identical (replicas)",
              fqn, ShapeString(shape), holders[i].second.ToString(),
              holders[i].first, holders[j].second.ToString(),
              holders[j].first));
        }
      }
    }
    int64_t covered = 0;
    for (const auto& [rank, box] : holders) covered += box.num_elements();
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s %s: the ranks' shards cover %d of %d elements (%s); every "
        "element must be held by some rank",
        fqn, ShapeString(shape), covered, NumElements(shape),
        ListHolders(holders)));
  }
  return absl::OkStatus();
}

// Each distinct text is merged once: merging a
// structure again changes nothing and cannot fail (everything it holds is
// already in `merged`, with the same types and leaf strings), and the first
// rank holding a text is the one an error names, so the result and the
// errors are those of merging every rank's in turn. Ranks of one pipeline
// stage share a structure, so a save of 16k ranks parses a handful.
absl::StatusOr<std::string> MergeStructureViews(
    const std::vector<absl::string_view>& structures) {
  if (structures.empty()) return std::string("{}");
  bool all_same = true;
  for (absl::string_view s : structures) all_same &= s == structures[0];
  if (all_same) return std::string(structures[0]);
  Json merged;
  absl::flat_hash_set<absl::string_view> seen;
  for (size_t r = 0; r < structures.size(); ++r) {
    if (!seen.insert(structures[r]).second) continue;
    Json j = Json::parse(structures[r].begin(), structures[r].end(), nullptr,
                         /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rank %d sent a malformed structure", r));
    }
    CAIRN_RETURN_IF_ERROR(MergeJson(merged, j, "", static_cast<int>(r)));
  }
  return merged.dump();
}

absl::StatusOr<std::string> MergeStructures(
    const std::vector<std::string>& structures) {
  return MergeStructureViews(
      std::vector<absl::string_view>(structures.begin(), structures.end()));
}

absl::StatusOr<MetadataSkeleton> BuildMetadataSkeleton(
    const std::vector<SavePlan>& final_plans) {
  MetadataSkeleton out;
  Metadata& md = out.metadata;
  md.world_size = static_cast<int>(final_plans.size());
  std::vector<absl::string_view> structures;
  structures.reserve(final_plans.size());
  out.refs.resize(final_plans.size());
  // Chunks in box order so the metadata does not depend on rank order.
  struct Pending {
    int rank;
    size_t item;
  };
  struct Chunks {
    TensorMetadata* tensor;  // a node of md.tensors: stable
    std::vector<Pending> pending;
  };
  // One map lookup per FQN, not per item.
  absl::flat_hash_map<absl::string_view, Chunks> chunks;
  for (int r = 0; r < static_cast<int>(final_plans.size()); ++r) {
    const SavePlan& plan = final_plans[r];
    structures.push_back(plan.structure);
    out.refs[r].resize(plan.items.size());
    for (size_t i = 0; i < plan.items.size(); ++i) {
      const WriteItem& item = plan.items[i];
      if (item.kind == ItemKind::kObject) {
        ByteLocation& loc = md.objects[item.fqn];  // a node: stable
        loc = ByteLocation{};
        out.refs[r][i] = &loc;
      } else {
        auto [it, inserted] = chunks.try_emplace(item.fqn);
        if (inserted) {
          TensorMetadata& tm = md.tensors[item.fqn];
          tm.dtype = item.dtype;
          tm.shape = item.global_shape;
          it->second.tensor = &tm;
        }
        it->second.pending.push_back({r, i});
      }
    }
  }
  for (auto& [fqn, c] : chunks) {
    std::vector<Pending>& pending = c.pending;
    std::sort(pending.begin(), pending.end(),
              [&](const Pending& a, const Pending& b) {
                return final_plans[a.rank].items[a.item].box.offsets <
                       final_plans[b.rank].items[b.item].box.offsets;
              });
    TensorMetadata& tm = *c.tensor;
    // Reserved exactly: the chunks never move, so the pointers stay valid.
    tm.chunks.reserve(pending.size());
    for (const Pending& p : pending) {
      tm.chunks.push_back(
          ChunkMetadata{final_plans[p.rank].items[p.item].box, {}});
      out.refs[p.rank][p.item] = &tm.chunks.back().location;
    }
  }
  CAIRN_ASSIGN_OR_RETURN(md.structure, MergeStructureViews(structures));
  return out;
}

absl::StatusOr<EncodedGlobalPlan> PlanGlobalSave(
    SavePlanner& planner, const std::vector<std::string>& encoded,
    bool require_coverage, std::string_view prefix) {
  std::vector<SavePlan> locals;
  locals.reserve(encoded.size());
  for (size_t r = 0; r < encoded.size(); ++r) {
    CAIRN_ASSIGN_OR_RETURN(
        SavePlan p,
        DecodeSavePlan(encoded[r], absl::StrCat("local plan of rank ", r)));
    locals.push_back(std::move(p));
  }
  // The per-FQN summary is all the final plans are checked against, so the
  // local plans (ranks x tensors items) move into the planner uncopied.
  CAIRN_ASSIGN_OR_RETURN(LocalSummary summary, ValidateLocalPlans(locals));
  const size_t world = locals.size();
  CAIRN_ASSIGN_OR_RETURN(std::vector<SavePlan> finals,
                         planner.CreateGlobalPlan(std::move(locals)));
  if (finals.size() != world) {
    return absl::InternalError(absl::StrFormat(
        "CreateGlobalPlan returned %d plans for %d ranks", finals.size(),
        world));
  }
  CAIRN_RETURN_IF_ERROR(ValidateFinalPlans(summary, finals, require_coverage));
  EncodedGlobalPlan g;
  CAIRN_ASSIGN_OR_RETURN(g.skeleton, BuildMetadataSkeleton(finals));
  g.payloads.reserve(finals.size());
  for (size_t r = 0; r < world; ++r) {
    std::string e = EncodeSavePlan(finals[r], /*with_scalar_values=*/false);
    std::string payload(prefix);
    if (e != encoded[r]) payload += e;
    g.payloads.push_back(std::move(payload));
  }
  return g;
}

Metadata SkeletonMetadata(const MetadataSkeleton& skeleton) {
  if (!skeleton.uses_flat) return skeleton.metadata;
  return internal_format::WithFlatChunks(skeleton.metadata, skeleton.flat);
}

absl::StatusOr<std::string> EncodeSkeleton(const MetadataSkeleton& skeleton) {
  if (!skeleton.uses_flat) {
    return internal_format::EncodeMetadata(skeleton.metadata);
  }
  return internal_format::EncodeMetadata(skeleton.metadata, skeleton.flat);
}

absl::StatusOr<SavePlan> DecodeFinalPlan(std::string_view rest,
                                         std::string_view encoded_local,
                                         std::string_view what) {
  // An encoded plan is never empty (it starts with a flag and a count).
  if (!rest.empty()) return DecodeSavePlan(rest, what);
  return DecodeSavePlan(encoded_local,
                        std::string(what) + " (the local plan, unchanged)");
}

}  // namespace cairn::internal_plan

namespace cairn {

std::vector<SavePlan> DedupSavePlans(std::vector<SavePlan> local_plans,
                                     DedupPolicy policy) {
  return internal_plan::DedupImpl(std::move(local_plans), policy);
}

}  // namespace cairn
