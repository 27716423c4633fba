#include "plan/global_plan.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/checked.h"
#include "core/status.h"
#include "format/metadata_codec.h"

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

// Key of a distinct stored piece: FQN, kind and box.
std::string PieceKey(const WriteItem& item) {
  std::string key = item.fqn;
  key.push_back('\0');
  key.push_back(static_cast<char>(item.kind));
  for (int64_t v : item.box.offsets) absl::StrAppend(&key, ",", v);
  key.push_back(';');
  for (int64_t v : item.box.sizes) absl::StrAppend(&key, ",", v);
  return key;
}

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
  absl::flat_hash_map<std::string, std::vector<Holder>> pieces;
  std::vector<std::string> order;  // first-seen order, for determinism
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < local_plans[r].items.size(); ++i) {
      std::string key = PieceKey(local_plans[r].items[i]);
      auto [it, inserted] = pieces.try_emplace(key);
      if (inserted) order.push_back(std::move(key));
      std::vector<Holder>& holders = it->second;
      // A rank holding the same piece twice writes it at most once.
      if (holders.empty() || holders.back().rank != r) {
        holders.push_back({r, i});
      }
    }
  }

  std::vector<std::vector<bool>> keep(world);
  for (int r = 0; r < world; ++r) {
    keep[r].assign(local_plans[r].items.size(), false);
  }
  std::vector<uint64_t> load(world, 0);
  std::vector<const std::vector<Holder>*> replicated;
  for (const std::string& key : order) {
    const std::vector<Holder>& holders = pieces[key];
    if (holders.size() == 1 || policy == DedupPolicy::kLowestRank) {
      const Holder& h = holders.front();  // ranks were visited in order
      keep[h.rank][h.item] = true;
      load[h.rank] += local_plans[h.rank].items[h.item].nbytes;
    } else {
      replicated.push_back(&holders);
    }
  }
  // Greedy: the most constrained pieces (fewest holders) first, larger
  // before smaller, each to the holder with the fewest bytes so far; ties
  // go to the lower rank.
  auto bytes_of = [&](const std::vector<Holder>* h) {
    return local_plans[h->front().rank].items[h->front().item].nbytes;
  };
  std::stable_sort(replicated.begin(), replicated.end(),
                   [&](const std::vector<Holder>* a,
                       const std::vector<Holder>* b) {
                     if (a->size() != b->size()) return a->size() < b->size();
                     return bytes_of(a) > bytes_of(b);
                   });
  for (const std::vector<Holder>* holders : replicated) {
    const Holder* best = &holders->front();
    for (const Holder& h : *holders) {
      if (load[h.rank] < load[best->rank]) best = &h;
    }
    keep[best->rank][best->item] = true;
    load[best->rank] += bytes_of(holders);
  }

  // Zero-byte tensor items only declare a tensor: keep one only for a
  // tensor no rank writes bytes of (a zero-element tensor).
  std::set<std::string> has_bytes;
  for (int r = 0; r < world; ++r) {
    for (const WriteItem& item : local_plans[r].items) {
      if (item.kind == ItemKind::kTensor && item.nbytes > 0) {
        has_bytes.insert(item.fqn);
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    for (size_t i = 0; i < keep[r].size(); ++i) {
      const WriteItem& item = local_plans[r].items[i];
      if (item.kind == ItemKind::kTensor && item.nbytes == 0 &&
          has_bytes.contains(item.fqn)) {
        keep[r][i] = false;
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    std::vector<WriteItem>& items = local_plans[r].items;
    size_t kept = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      if (!keep[r][i]) continue;
      if (kept != i) items[kept] = std::move(items[i]);  // never self-move
      ++kept;
    }
    items.resize(kept);
  }
  return local_plans;
}

absl::Status ValidateLocalPlans(const std::vector<SavePlan>& local_plans) {
  struct First {
    int rank;
    const WriteItem* item;
  };
  std::map<std::string, First> first;
  std::map<std::string, int> scalar_rank;
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
      if (inserted) continue;
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
  return absl::OkStatus();
}

absl::Status ValidateFinalPlans(const std::vector<SavePlan>& local_plans,
                                const std::vector<SavePlan>& final_plans,
                                bool require_coverage) {
  struct Written {
    const WriteItem* any = nullptr;  // from the local plans
    std::vector<std::pair<int, Box>> boxes;
  };
  std::map<std::string, Written> written;
  for (const SavePlan& plan : local_plans) {
    for (const WriteItem& item : plan.items) written[item.fqn].any = &item;
  }
  for (int r = 0; r < static_cast<int>(final_plans.size()); ++r) {
    for (const WriteItem& item : final_plans[r].items) {
      auto it = written.find(item.fqn);
      if (it == written.end() || it->second.any->kind != item.kind ||
          it->second.any->dtype != item.dtype ||
          it->second.any->global_shape != item.global_shape) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "the global plan has rank %d write %s, which no rank's local "
            "plan holds in that form",
            r, item.fqn));
      }
      it->second.boxes.push_back({r, item.box});
    }
  }
  for (auto& [fqn, w] : written) {
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
    TensorMetadata tm;
    tm.dtype = w.any->dtype;
    tm.shape = w.any->global_shape;
    for (const auto& [rank, box] : w.boxes) {
      tm.chunks.push_back(ChunkMetadata{box, {}});
    }
    absl::Status coverage = internal_format::ValidateCoverage(fqn, tm);
    if (coverage.ok()) continue;
    // Say which ranks: find an overlapping pair, else list the holders.
    std::sort(w.boxes.begin(), w.boxes.end(),
              [](const auto& a, const auto& b) {
                return a.second.offsets < b.second.offsets;
              });
    for (size_t i = 0; i < w.boxes.size(); ++i) {
      for (size_t j = i + 1; j < w.boxes.size(); ++j) {
        if (Intersect(w.boxes[i].second, w.boxes[j].second)) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s %s: box %s on rank %d overlaps box %s on rank %d; shards "
              "must not overlap unless they are identical (replicas)",
              fqn, ShapeString(tm.shape), w.boxes[i].second.ToString(),
              w.boxes[i].first, w.boxes[j].second.ToString(),
              w.boxes[j].first));
        }
      }
    }
    int64_t covered = 0;
    for (const auto& [rank, box] : w.boxes) covered += box.num_elements();
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s %s: the ranks' shards cover %d of %d elements (%s); every "
        "element must be held by some rank",
        fqn, ShapeString(tm.shape), covered, NumElements(tm.shape),
        ListHolders(w.boxes)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> MergeStructures(
    const std::vector<std::string>& structures) {
  if (structures.empty()) return std::string("{}");
  bool all_same = true;
  for (const std::string& s : structures) all_same &= s == structures[0];
  if (all_same) return structures[0];
  Json merged;
  for (size_t r = 0; r < structures.size(); ++r) {
    Json j = Json::parse(structures[r], nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rank %d sent a malformed structure", r));
    }
    CAIRN_RETURN_IF_ERROR(MergeJson(merged, j, "", static_cast<int>(r)));
  }
  return merged.dump();
}

absl::StatusOr<MetadataSkeleton> BuildMetadataSkeleton(
    const std::vector<SavePlan>& final_plans) {
  MetadataSkeleton out;
  Metadata& md = out.metadata;
  md.world_size = static_cast<int>(final_plans.size());
  std::vector<std::string> structures;
  out.refs.resize(final_plans.size());
  // Chunks in box order so the metadata does not depend on rank order.
  struct Pending {
    int rank;
    size_t item;
  };
  std::map<std::string, std::vector<Pending>> chunks;
  for (int r = 0; r < static_cast<int>(final_plans.size()); ++r) {
    const SavePlan& plan = final_plans[r];
    structures.push_back(plan.structure);
    out.refs[r].resize(plan.items.size());
    for (size_t i = 0; i < plan.items.size(); ++i) {
      const WriteItem& item = plan.items[i];
      out.refs[r][i].fqn = item.fqn;
      if (item.kind == ItemKind::kObject) {
        md.objects[item.fqn] = ByteLocation{};
        out.refs[r][i].object = true;
      } else {
        TensorMetadata& tm = md.tensors[item.fqn];
        tm.dtype = item.dtype;
        tm.shape = item.global_shape;
        chunks[item.fqn].push_back({r, i});
      }
    }
  }
  for (auto& [fqn, pending] : chunks) {
    std::sort(pending.begin(), pending.end(),
              [&](const Pending& a, const Pending& b) {
                return final_plans[a.rank].items[a.item].box.offsets <
                       final_plans[b.rank].items[b.item].box.offsets;
              });
    TensorMetadata& tm = md.tensors[fqn];
    for (const Pending& p : pending) {
      out.refs[p.rank][p.item].chunk = tm.chunks.size();
      tm.chunks.push_back(
          ChunkMetadata{final_plans[p.rank].items[p.item].box, {}});
    }
  }
  CAIRN_ASSIGN_OR_RETURN(md.structure, MergeStructures(structures));
  return out;
}

}  // namespace cairn::internal_plan

namespace cairn {

std::vector<SavePlan> DedupSavePlans(std::vector<SavePlan> local_plans,
                                     DedupPolicy policy) {
  return internal_plan::DedupImpl(std::move(local_plans), policy);
}

}  // namespace cairn
