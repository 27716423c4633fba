// CheckSimilar, CopyInto and OffloadToHost: one-process walks over state
// dicts.
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/state_dict_utils.h"
#include "core/flatten.h"
#include "core/status.h"
#include "core/strided.h"
#include "cuda/device_runtime.h"
#include "utils/internal.h"

namespace cairn {
namespace {

using internal_utils::ShapeString;

const char* KindName(StateDict::Kind kind) {
  switch (kind) {
    case StateDict::Kind::kMap:
      return "map";
    case StateDict::Kind::kList:
      return "list";
    case StateDict::Kind::kTensor:
      return "tensor";
    case StateDict::Kind::kObject:
      return "object";
    case StateDict::Kind::kScalar:
      return "scalar";
  }
  return "?";
}

const char* ScalarTypeName(const Scalar& s) {
  switch (s.index()) {
    case 0:
      return "int";
    case 1:
      return "double";
    case 2:
      return "bool";
    default:
      return "string";
  }
}

// What to call the two sides in messages.
struct Sides {
  const char* a;
  const char* b;
};

std::string Child(const std::string& fqn, const std::string& part) {
  return fqn.empty() ? part : absl::StrCat(fqn, ".", part);
}

std::string Name(const std::string& fqn) {
  return fqn.empty() ? "the root" : fqn;
}

std::optional<std::string> CompareTensors(const ShardedTensor& a,
                                          const ShardedTensor& b,
                                          const std::string& where) {
  if (a.dtype() != b.dtype()) {
    return absl::StrFormat("%s: dtype %s vs %s", where, DTypeName(a.dtype()),
                           DTypeName(b.dtype()));
  }
  if (a.global_shape() != b.global_shape()) {
    return absl::StrFormat("%s: shape %s vs %s", where,
                           ShapeString(a.global_shape()),
                           ShapeString(b.global_shape()));
  }
  if (a.shards().size() != b.shards().size()) {
    return absl::StrFormat("%s: %d vs %d shards", where, a.shards().size(),
                           b.shards().size());
  }
  for (size_t i = 0; i < a.shards().size(); ++i) {
    if (a.shards()[i].box != b.shards()[i].box) {
      return absl::StrFormat("%s: shard %d box %s vs %s", where, i,
                             a.shards()[i].box.ToString(),
                             b.shards()[i].box.ToString());
    }
  }
  return std::nullopt;
}

// The first difference in layout in key order (depth first), or nullopt.
std::optional<std::string> FirstDifference(const StateDict& a,
                                           const StateDict& b,
                                           const std::string& fqn,
                                           const Sides& sides) {
  const std::string where = Name(fqn);
  if (a.kind() != b.kind()) {
    return absl::StrFormat("%s: %s vs %s", where, KindName(a.kind()),
                           KindName(b.kind()));
  }
  switch (a.kind()) {
    case StateDict::Kind::kMap: {
      auto ia = a.items().begin(), ib = b.items().begin();
      while (ia != a.items().end() || ib != b.items().end()) {
        if (ib == b.items().end() ||
            (ia != a.items().end() && ia->first < ib->first)) {
          return absl::StrFormat("%s: only in %s", Child(fqn, ia->first),
                                 sides.a);
        }
        if (ia == a.items().end() || ib->first < ia->first) {
          return absl::StrFormat("%s: only in %s", Child(fqn, ib->first),
                                 sides.b);
        }
        if (auto d = FirstDifference(ia->second, ib->second,
                                     Child(fqn, ia->first), sides)) {
          return d;
        }
        ++ia;
        ++ib;
      }
      return std::nullopt;
    }
    case StateDict::Kind::kList: {
      const size_t n = std::min(a.size(), b.size());
      for (size_t i = 0; i < n; ++i) {
        if (auto d = FirstDifference(*a.At(i), *b.At(i),
                                     Child(fqn, std::to_string(i)), sides)) {
          return d;
        }
      }
      if (a.size() != b.size()) {
        return absl::StrFormat("%s: only in %s", Child(fqn, std::to_string(n)),
                               a.size() > b.size() ? sides.a : sides.b);
      }
      return std::nullopt;
    }
    case StateDict::Kind::kTensor:
      return CompareTensors(*a.tensor(), *b.tensor(), where);
    case StateDict::Kind::kObject:
      return std::nullopt;
    case StateDict::Kind::kScalar:
      if (a.scalar()->index() != b.scalar()->index()) {
        return absl::StrFormat("%s: scalar type %s vs %s", where,
                               ScalarTypeName(*a.scalar()),
                               ScalarTypeName(*b.scalar()));
      }
      return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

Similarity CheckSimilar(const StateDict& a, const StateDict& b) {
  Similarity result;
  if (auto d = FirstDifference(a, b, "", Sides{"a", "b"})) {
    result.similar = false;
    result.first_difference = *std::move(d);
  }
  return result;
}

absl::Status CopyInto(const StateDict& src, StateDict& dst) {
  if (auto d = FirstDifference(src, dst, "",
                               Sides{"the source", "the destination"})) {
    return absl::InvalidArgumentError(absl::StrCat("CopyInto: ", *d));
  }
  // Same layout, so both flatten to the same FQNs in the same order.
  absl::StatusOr<internal_core::Flattened> from = internal_core::Flatten(src);
  CAIRN_RETURN_IF_ERROR(internal_core::Annotate(from.status(), "CopyInto"));
  absl::StatusOr<internal_core::MutableFlattened> to =
      internal_core::FlattenMutable(dst);
  CAIRN_RETURN_IF_ERROR(internal_core::Annotate(to.status(), "CopyInto"));
  if (from->leaves.size() != to->leaves.size()) {
    return absl::InternalError("CopyInto: the state dicts flatten differently");
  }
  // Check every view before writing anything, so that a failure leaves dst
  // as it was.
  for (size_t i = 0; i < from->leaves.size(); ++i) {
    const ShardedTensor* s = from->leaves[i].node->tensor();
    if (s == nullptr) continue;
    const ShardedTensor* t = to->leaves[i].node->tensor();
    for (size_t k = 0; k < s->shards().size(); ++k) {
      const Box& box = s->shards()[k].box;
      const std::string where = absl::StrFormat(
          "CopyInto: %s shard %s", from->leaves[i].fqn, box.ToString());
      CAIRN_RETURN_IF_ERROR(
          internal_core::Annotate(ValidateBox(box, s->global_shape()), where));
      CAIRN_RETURN_IF_ERROR(internal_utils::ValidateHostView(
          absl::StrCat(where, " (source)"), s->shards()[k].view, s->dtype(),
          box.sizes));
      CAIRN_RETURN_IF_ERROR(internal_utils::ValidateHostView(
          absl::StrCat(where, " (destination)"), t->shards()[k].view,
          t->dtype(), box.sizes));
    }
  }
  for (size_t i = 0; i < from->leaves.size(); ++i) {
    const StateDict& s = *from->leaves[i].node;
    StateDict& t = *to->leaves[i].node;
    if (const ShardedTensor* st = s.tensor()) {
      for (size_t k = 0; k < st->shards().size(); ++k) {
        const TensorView& sv = st->shards()[k].view;
        const TensorView& tv = t.tensor()->shards()[k].view;
        if (sv.data() == tv.data() && sv.strides() == tv.strides()) continue;
        internal_core::CopyView(sv, tv);
      }
    } else if (const Object* o = s.object()) {
      *t.object() = *o;
    } else if (const Scalar* v = s.scalar()) {
      *t.scalar() = *v;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StateDict> OffloadToHost(const StateDict& state,
                                        bool copy_host) {
  CAIRN_ASSIGN_OR_RETURN(internal_core::Flattened flat,
                         internal_core::Flatten(state));
  std::map<std::string, const StateDict*> leaves;
  for (const internal_core::FlatLeaf& leaf : flat.leaves) {
    leaves[leaf.fqn] = leaf.node;
  }
  // Copies live as long as the tensor that views them (and the original
  // owner as long as shards still view its memory).
  struct Keep {
    std::shared_ptr<void> owner;
    std::vector<Tensor> copies;
  };
  return internal_core::Unflatten(
      flat.structure, [&](const std::string& fqn) -> absl::StatusOr<StateDict> {
        auto it = leaves.find(fqn);
        if (it == leaves.end()) {
          return absl::InternalError(
              absl::StrCat("OffloadToHost: no leaf ", fqn));
        }
        const StateDict& node = *it->second;
        const ShardedTensor* t = node.tensor();
        if (t == nullptr) return node;
        auto keep = std::make_shared<Keep>();
        keep->owner = t->owner();
        std::vector<Shard> shards;
        for (const Shard& shard : t->shards()) {
          const std::string where = absl::StrFormat(
              "OffloadToHost: %s shard %s", fqn, shard.box.ToString());
          if (!shard.view.device().is_cpu()) {
            // Through the device runtime: after the device's queued work,
            // one copy of the view's span (kUnimplemented without CUDA in
            // the build, kFailedPrecondition without a usable device).
            CAIRN_ASSIGN_OR_RETURN(
                Tensor copy, internal_cuda::CopyToHostTensor(where, shard.view));
            shards.push_back(Shard{shard.box, copy.view()});
            keep->copies.push_back(std::move(copy));
            continue;
          }
          if (!copy_host) {
            shards.push_back(shard);
            continue;
          }
          CAIRN_RETURN_IF_ERROR(internal_utils::ValidateHostView(
              where, shard.view, t->dtype(), shard.box.sizes));
          CAIRN_ASSIGN_OR_RETURN(Tensor copy, Tensor::CopyOf(shard.view));
          shards.push_back(Shard{shard.box, copy.view()});
          keep->copies.push_back(std::move(copy));
        }
        std::shared_ptr<void> owner =
            keep->copies.empty() ? t->owner() : std::shared_ptr<void>(keep);
        return StateDict(ShardedTensor(t->dtype(), t->global_shape(),
                                       std::move(shards), std::move(owner)));
      });
}

}  // namespace cairn
