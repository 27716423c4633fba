// ShardedTensor and the StateDict node.
#include "cairn/state_dict.h"

#include <utility>

namespace cairn {

ShardedTensor::ShardedTensor(DType dtype, Shape global_shape,
                             std::vector<Shard> shards,
                             std::shared_ptr<void> owner)
    : dtype_(dtype),
      global_shape_(std::move(global_shape)),
      shards_(std::move(shards)),
      owner_(std::move(owner)) {}

ShardedTensor ShardedTensor::Whole(const TensorView& view) {
  return ShardedTensor(view.dtype(), view.shape(),
                       {Shard{Box::Full(view.shape()), view}});
}

ShardedTensor ShardedTensor::Whole(const Tensor& tensor) {
  ShardedTensor t = Whole(tensor.view());
  t.owner_ = tensor.buffer();
  return t;
}

StateDict::StateDict() : node_(MapT{}) {}
StateDict::StateDict(const TensorView& view)
    : node_(ShardedTensor::Whole(view)) {}
StateDict::StateDict(const Tensor& tensor)
    : node_(ShardedTensor::Whole(tensor)) {}
StateDict::StateDict(ShardedTensor tensor) : node_(std::move(tensor)) {}
StateDict::StateDict(Object object) : node_(std::move(object)) {}
StateDict::StateDict(Scalar scalar) : node_(std::move(scalar)) {}

StateDict StateDict::List() {
  StateDict d;
  d.node_ = ListT{};
  return d;
}

StateDict::Kind StateDict::kind() const {
  // The variant's alternatives are declared in Kind's order.
  return static_cast<Kind>(node_.index());
}

StateDict& StateDict::operator[](const std::string& key) {
  if (!std::holds_alternative<MapT>(node_)) node_ = MapT{};
  return std::get<MapT>(node_)[key];
}

const StateDict* StateDict::Find(const std::string& key) const {
  const MapT* map = std::get_if<MapT>(&node_);
  if (map == nullptr) return nullptr;
  auto it = map->find(key);
  return it == map->end() ? nullptr : &it->second;
}

StateDict* StateDict::Find(const std::string& key) {
  return const_cast<StateDict*>(std::as_const(*this).Find(key));
}

const std::map<std::string, StateDict>& StateDict::items() const {
  static const MapT* const kEmpty = new MapT();
  const MapT* map = std::get_if<MapT>(&node_);
  return map == nullptr ? *kEmpty : *map;
}

StateDict& StateDict::Append(StateDict value) {
  if (!std::holds_alternative<ListT>(node_)) node_ = ListT{};
  ListT& list = std::get<ListT>(node_);
  list.push_back(std::move(value));
  return list.back();
}

size_t StateDict::size() const {
  if (const MapT* map = std::get_if<MapT>(&node_)) return map->size();
  if (const ListT* list = std::get_if<ListT>(&node_)) return list->size();
  return 0;
}

const StateDict* StateDict::At(size_t index) const {
  const ListT* list = std::get_if<ListT>(&node_);
  if (list == nullptr || index >= list->size()) return nullptr;
  return &(*list)[index];
}

StateDict* StateDict::At(size_t index) {
  return const_cast<StateDict*>(std::as_const(*this).At(index));
}

const std::vector<StateDict>& StateDict::elements() const {
  static const ListT* const kEmpty = new ListT();
  const ListT* list = std::get_if<ListT>(&node_);
  return list == nullptr ? *kEmpty : *list;
}

const ShardedTensor* StateDict::tensor() const {
  return std::get_if<ShardedTensor>(&node_);
}
ShardedTensor* StateDict::tensor() {
  return std::get_if<ShardedTensor>(&node_);
}
const Object* StateDict::object() const { return std::get_if<Object>(&node_); }
Object* StateDict::object() { return std::get_if<Object>(&node_); }
const Scalar* StateDict::scalar() const { return std::get_if<Scalar>(&node_); }
Scalar* StateDict::scalar() { return std::get_if<Scalar>(&node_); }

}  // namespace cairn
