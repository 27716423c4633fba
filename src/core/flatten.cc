// Flatten / Unflatten. The structure JSON is read back from checkpoints on
// disk, so Unflatten treats it as untrusted: every shape and type is checked,
// each leaf's FQN must be the one its position implies, and nlohmann is used
// without exceptions (parse with allow_exceptions=false, typed accessors only
// after a type check).
#include "core/flatten.h"

#include <algorithm>
#include <exception>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace cairn::internal_core {
namespace {

using Json = nlohmann::json;

// Deeper nesting than any real state dict; bounds recursion on hostile JSON.
constexpr int kMaxDepth = 512;

std::string ChildFqn(const std::string& prefix, bool at_root,
                     const std::string& component) {
  return at_root ? component : absl::StrCat(prefix, ".", component);
}

template <typename NodePtr>
void Walk(NodePtr node, const std::string& fqn, bool at_root,
          std::vector<FlatLeafT<NodePtr>>& leaves, Json& skeleton) {
  if (node->is_map()) {
    skeleton = Json::object();
    // items() is const; the mutable walk needs mutable children, which Find
    // gives without copying keys around.
    for (const auto& [key, child] : node->items()) {
      NodePtr child_ptr = node->Find(key);
      Walk(child_ptr, ChildFqn(fqn, at_root, key), false, leaves,
           skeleton[key]);
    }
  } else if (node->is_list()) {
    skeleton = Json::array();
    for (size_t i = 0; i < node->size(); ++i) {
      skeleton.push_back(Json());
      Walk(node->At(i), ChildFqn(fqn, at_root, std::to_string(i)), false,
           leaves, skeleton.back());
    }
  } else {
    skeleton = fqn;
    leaves.push_back({fqn, node});
  }
}

template <typename NodePtr>
absl::StatusOr<std::pair<std::vector<FlatLeafT<NodePtr>>, std::string>>
FlattenImpl(NodePtr root) {
  if (!root->is_map()) {
    return absl::InvalidArgumentError("the root of a state dict must be a map");
  }
  std::vector<FlatLeafT<NodePtr>> leaves;
  Json skeleton;
  Walk(root, std::string(), true, leaves, skeleton);
  std::sort(leaves.begin(), leaves.end(),
            [](const auto& a, const auto& b) { return a.fqn < b.fqn; });
  for (size_t i = 1; i < leaves.size(); ++i) {
    if (leaves[i].fqn == leaves[i - 1].fqn) {
      return absl::InvalidArgumentError(
          absl::StrCat("two state dict entries flatten to the same FQN \"",
                       leaves[i].fqn, "\""));
    }
  }
  std::string structure;
  try {
    structure = skeleton.dump();
  } catch (const std::exception& e) {
    // dump() throws on keys that are not valid UTF-8.
    return absl::InvalidArgumentError(
        absl::StrCat("state dict keys must be valid UTF-8: ", e.what()));
  }
  return std::make_pair(std::move(leaves), std::move(structure));
}

struct UnflattenContext {
  const std::function<absl::StatusOr<StateDict>(const std::string&)>& make_leaf;
  std::set<std::string> seen;
};

absl::StatusOr<StateDict> Build(const Json& node, const std::string& fqn,
                                bool at_root, int depth,
                                UnflattenContext& ctx) {
  if (depth > kMaxDepth) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state dict structure nests deeper than ", kMaxDepth, " levels"));
  }
  const std::string where =
      at_root ? "the root" : absl::StrCat("\"", fqn, "\"");
  switch (node.type()) {
    case Json::value_t::object: {
      StateDict map = StateDict::Map();
      for (const auto& [key, child] : node.items()) {
        CAIRN_ASSIGN_OR_RETURN(
            StateDict value,
            Build(child, ChildFqn(fqn, at_root, key), false, depth + 1, ctx));
        map[key] = std::move(value);
      }
      return map;
    }
    case Json::value_t::array: {
      if (at_root) break;
      StateDict list = StateDict::List();
      for (size_t i = 0; i < node.size(); ++i) {
        CAIRN_ASSIGN_OR_RETURN(
            StateDict value,
            Build(node[i], ChildFqn(fqn, false, std::to_string(i)), false,
                  depth + 1, ctx));
        list.Append(std::move(value));
      }
      return list;
    }
    case Json::value_t::string: {
      if (at_root) break;
      const auto& leaf = node.get_ref<const std::string&>();
      if (leaf != fqn) {
        return absl::InvalidArgumentError(
            absl::StrCat("malformed state dict structure: the leaf at \"", fqn,
                         "\" names FQN \"", leaf, "\""));
      }
      if (!ctx.seen.insert(fqn).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "malformed state dict structure: duplicate FQN \"", fqn, "\""));
      }
      return ctx.make_leaf(fqn);
    }
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("malformed state dict structure: ", where, " is a JSON ",
                   node.type_name(),
                   at_root ? ", not an object"
                           : ", not an object, array or "
                             "string"));
}

}  // namespace

absl::StatusOr<Flattened> Flatten(const StateDict& state) {
  CAIRN_ASSIGN_OR_RETURN(auto flat, FlattenImpl<const StateDict*>(&state));
  return Flattened{std::move(flat.first), std::move(flat.second)};
}

absl::StatusOr<MutableFlattened> FlattenMutable(StateDict& state) {
  CAIRN_ASSIGN_OR_RETURN(auto flat, FlattenImpl<StateDict*>(&state));
  return MutableFlattened{std::move(flat.first), std::move(flat.second)};
}

absl::StatusOr<StateDict> Unflatten(
    std::string_view structure,
    const std::function<absl::StatusOr<StateDict>(const std::string& fqn)>&
        make_leaf) {
  const Json root = Json::parse(structure.begin(), structure.end(),
                                /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(
        "malformed state dict structure: not valid JSON");
  }
  UnflattenContext ctx{make_leaf, {}};
  return Build(root, std::string(), true, 0, ctx);
}

}  // namespace cairn::internal_core
