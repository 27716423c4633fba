// Flattening a StateDict to dotted FQNs and rebuilding it.
//
// FQN: map keys and list indices (decimal) joined by '.', e.g.
// "model.layers.0.wq". The structure is a JSON skeleton of the nesting in
// which maps are JSON objects, lists are JSON arrays and each leaf is the
// string of its FQN: {"model": {"layers": [{"wq": "model.layers.0.wq"}]},
// "step": "step"}. Empty maps and lists survive the round trip.
#ifndef CAIRN_CORE_FLATTEN_H_
#define CAIRN_CORE_FLATTEN_H_

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/state_dict.h"

namespace cairn::internal_core {

template <typename NodePtr>
struct FlatLeafT {
  std::string fqn;
  NodePtr node;  // a leaf of the flattened state dict
};
using FlatLeaf = FlatLeafT<const StateDict*>;
using MutableFlatLeaf = FlatLeafT<StateDict*>;

struct Flattened {
  std::vector<FlatLeaf> leaves;  // in FQN order
  std::string structure;         // JSON text of the skeleton
};
struct MutableFlattened {
  std::vector<MutableFlatLeaf> leaves;  // in FQN order
  std::string structure;
};

// kInvalidArgument naming the FQN when two leaves flatten to the same FQN.
// The returned pointers point into `state`.
absl::StatusOr<Flattened> Flatten(const StateDict& state);
absl::StatusOr<MutableFlattened> FlattenMutable(StateDict& state);

// Rebuilds the nesting described by `structure` (JSON text), calling
// make_leaf(fqn) for every leaf. kInvalidArgument for malformed structure
// JSON; make_leaf's error is returned as is.
absl::StatusOr<StateDict> Unflatten(
    std::string_view structure,
    const std::function<absl::StatusOr<StateDict>(const std::string& fqn)>&
        make_leaf);

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_FLATTEN_H_
