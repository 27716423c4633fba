// StateDict: the nested state of a job (model weights, optimizer state, step
// counters, RNG states) as string-keyed maps and lists whose leaves are
// tensors, sharded tensors, opaque byte objects and scalars.
//
//   cairn::StateDict sd;
//   sd["model"]["wq"] = cairn::ShardedTensor(DType::kBF16, {4096, 4096},
//                                           {{box, view}});
//   sd["model"]["norm"] = norm_view;             // a plain (whole) tensor
//   sd["step"] = int64_t{100};
//   sd["rng"] = cairn::Object{rng_state_bytes};
//   sd["layers"] = cairn::StateDict::List();     // lists index by position
//
// cairn flattens a state dict to dotted names (FQNs): "model.wq",
// "layers.0.bias". Two leaves that flatten to the same FQN are an error.
//
// Thread safety: a StateDict is a value; concurrent const access is safe.
// Tensor leaves hold views, so copying a StateDict never copies tensor data.
#ifndef CAIRN_STATE_DICT_H_
#define CAIRN_STATE_DICT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "cairn/box.h"
#include "cairn/dtype.h"
#include "cairn/tensor.h"

namespace cairn {

// One locally held piece of a sharded tensor: its place in the global tensor
// and a view of its elements (view.shape() == box.sizes).
struct Shard {
  Box box;
  TensorView view;
};

// A tensor of `global_shape` of which this rank holds `shards`. A plain
// tensor is one shard covering the whole shape. Several ranks holding the
// same box means the box is replicated. Shards are validated when the state
// dict is saved or loaded, not here.
class ShardedTensor {
 public:
  ShardedTensor() = default;
  ShardedTensor(DType dtype, Shape global_shape, std::vector<Shard> shards,
                std::shared_ptr<void> owner = nullptr);
  // A plain tensor: one shard covering all of `view`.
  static ShardedTensor Whole(const TensorView& view);
  // A plain tensor that also keeps `tensor`'s buffer alive.
  static ShardedTensor Whole(const Tensor& tensor);

  DType dtype() const { return dtype_; }
  const Shape& global_shape() const { return global_shape_; }
  const std::vector<Shard>& shards() const { return shards_; }
  // Keeps owned memory alive (set for tensors cairn allocated); may be null.
  const std::shared_ptr<void>& owner() const { return owner_; }

 private:
  DType dtype_ = DType::kF32;
  Shape global_shape_;
  std::vector<Shard> shards_;
  std::shared_ptr<void> owner_;
};

// An opaque byte object (a pickled Python object, an RNG state, ...).
struct Object {
  std::string bytes;
  friend bool operator==(const Object&, const Object&) = default;
};

// A scalar leaf.
using Scalar = std::variant<int64_t, double, bool, std::string>;

class StateDict {
 public:
  enum class Kind : uint8_t { kMap, kList, kTensor, kObject, kScalar };

  // An empty map.
  StateDict();
  // Leaves.
  StateDict(const TensorView& view);  // NOLINT: implicit on purpose
  StateDict(const Tensor& tensor);    // NOLINT
  StateDict(ShardedTensor tensor);    // NOLINT
  StateDict(Object object);           // NOLINT
  StateDict(Scalar scalar);           // NOLINT
  StateDict(int64_t v) : StateDict(Scalar(v)) {}                  // NOLINT
  StateDict(int v) : StateDict(Scalar(int64_t{v})) {}             // NOLINT
  StateDict(double v) : StateDict(Scalar(v)) {}                   // NOLINT
  StateDict(bool v) : StateDict(Scalar(v)) {}                     // NOLINT
  StateDict(std::string v) : StateDict(Scalar(std::move(v))) {}   // NOLINT
  StateDict(const char* v) : StateDict(Scalar(std::string(v))) {} // NOLINT

  static StateDict Map() { return StateDict(); }
  static StateDict List();

  Kind kind() const;
  bool is_map() const { return kind() == Kind::kMap; }
  bool is_list() const { return kind() == Kind::kList; }
  bool is_leaf() const { return !is_map() && !is_list(); }

  // Map access. operator[] inserts an empty map under a missing key; called
  // on a node that is not a map, it first turns the node into an empty map
  // (discarding what it held), like assigning a new value would.
  StateDict& operator[](const std::string& key);
  // nullptr when this is not a map or has no such key.
  const StateDict* Find(const std::string& key) const;
  StateDict* Find(const std::string& key);
  // The entries in key order; empty for a node that is not a map.
  const std::map<std::string, StateDict>& items() const;

  // List access. Append turns a node that is not a list into an empty list
  // first. size() counts map entries or list elements (0 for leaves).
  StateDict& Append(StateDict value);
  size_t size() const;
  // nullptr when this is not a list or `index` is out of range.
  const StateDict* At(size_t index) const;
  StateDict* At(size_t index);
  const std::vector<StateDict>& elements() const;

  // Leaf access; nullptr when the node is not that kind of leaf.
  const ShardedTensor* tensor() const;
  ShardedTensor* tensor();
  const Object* object() const;
  Object* object();
  const Scalar* scalar() const;
  Scalar* scalar();

 private:
  using MapT = std::map<std::string, StateDict>;
  using ListT = std::vector<StateDict>;
  std::variant<MapT, ListT, ShardedTensor, Object, Scalar> node_;
};

}  // namespace cairn

#endif  // CAIRN_STATE_DICT_H_
