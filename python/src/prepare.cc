#include "prepare.h"

#include <Python.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cairn::python {
namespace {

// The torch objects the fast path compares against (see prepare.h).
struct Torch {
  py::tuple tensor_types;
  py::object strided;
  py::dict dtype_names;
  py::tuple float8;
  py::object uint8;
  py::object to_dlpack;
};

bool Contains(const py::tuple& items, py::handle x) {
  for (py::handle item : items) {
    if (item.ptr() == x.ptr()) return true;
  }
  return false;
}

std::vector<int64_t> Ints(py::handle seq) {
  std::vector<int64_t> out;
  for (py::handle v : seq) {
    out.push_back(PyLong_AsLongLong(v.ptr()));
    if (PyErr_Occurred()) throw py::error_already_set();
  }
  return out;
}

class Leaves final : public LeafHandler {
 public:
  Leaves(py::handle hooks, bool for_load, py::list& slots)
      : for_load_(for_load), slots_(slots) {
    py::tuple h = py::reinterpret_borrow<py::tuple>(hooks);
    if (!h[0].is_none()) {
      py::tuple t = h[0];
      torch_ = Torch{t[0], t[1], t[2], t[3], t[4], t[5]};
    }
    sharded_type_ = h[1];
    tensor_leaf_ = h[2];
    encode_ = h[3];
  }

  absl::StatusOr<StateDict> Leaf(py::handle obj, const std::string& fqn,
                                 py::handle parent, py::handle key,
                                 bool writable, KeepAlive& keep) override {
    if (torch_) {
      std::optional<ShardedTensor> fast;
      if (Contains(torch_->tensor_types, py::type::handle_of(obj))) {
        fast = WholeTensor(obj, writable, fqn, keep);
      } else if (py::type::handle_of(obj).is(sharded_type_)) {
        fast = ShardsOf(obj, writable, fqn, keep);
      }
      if (fast) return StateDict(*std::move(fast));
    }
    if (IsScalar(obj)) {
      slots_.append(py::make_tuple(fqn, parent, key));
      return ValueLeaf(obj, fqn);
    }
    // Anything else: the Python layer's (DTensors, arrays, and the errors
    // for bad tensors), then an object.
    py::object leaf = tensor_leaf_(obj, fqn);
    if (!leaf.is_none()) {
      auto tensor = ToShardedTensor(py::cast<const Sharded&>(leaf), writable,
                                    fqn, keep);
      if (!tensor.ok()) return tensor.status();
      return StateDict(*std::move(tensor));
    }
    slots_.append(py::make_tuple(fqn, parent, key));
    if (for_load_) return StateDict(Object{});  // the stored one replaces it
    return StateDict(Object{py::cast<std::string>(encode_(obj))});
  }

 private:
  // bool, float, str, and int within int64 (larger ints are pickled).
  static bool IsScalar(py::handle obj) {
    PyObject* p = obj.ptr();
    if (PyBool_Check(p) || PyFloat_Check(p) || PyUnicode_Check(p)) return true;
    if (!PyLong_Check(p)) return false;
    int overflow = 0;
    PyLong_AsLongLongAndOverflow(p, &overflow);
    return overflow == 0;
  }

  // The cairn dtype name of a strided torch tensor, or nullptr where the
  // Python layer must decide (it raises for sparse tensors and dtypes
  // cairn does not store).
  const char* DTypeName(py::handle t) const {
    if (t.attr("layout").ptr() != torch_->strided.ptr()) return nullptr;
    PyObject* name = PyDict_GetItemWithError(torch_->dtype_names.ptr(),
                                             t.attr("dtype").ptr());
    if (name == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return nullptr;
    }
    return PyUnicode_AsUTF8(name);
  }

  // A view of torch tensor `t`'s bytes by DLPack (float8 as uint8, whose
  // DLPack codes differ across versions).
  absl::StatusOr<TensorView> View(py::handle t, DType dtype, bool writable,
                                  const std::string& fqn, KeepAlive& keep) {
    py::object bits = py::reinterpret_borrow<py::object>(t);
    if (Contains(torch_->float8, t.attr("dtype"))) {
      bits = bits.attr("view")(torch_->uint8);
    }
    return ImportView(torch_->to_dlpack(bits), dtype, writable, fqn, keep);
  }

  std::optional<ShardedTensor> WholeTensor(py::handle t, bool writable,
                                           const std::string& fqn,
                                           KeepAlive& keep) {
    const char* name = DTypeName(t);
    if (name == nullptr) return std::nullopt;
    absl::StatusOr<DType> dtype = DTypeFromName(name);
    if (!dtype.ok()) return std::nullopt;
    absl::StatusOr<TensorView> view = View(t, *dtype, writable, fqn, keep);
    if (!view.ok()) return std::nullopt;  // the Python layer says why
    std::vector<int64_t> shape = view->shape();
    std::vector<Shard> shards;
    shards.push_back(Shard{
        Box{std::vector<int64_t>(shape.size(), 0), shape}, *std::move(view)});
    return ShardedTensor(*dtype, std::move(shape), std::move(shards));
  }

  // A cairn.ShardedTensor whose shards are all plain torch tensors of one
  // dtype with offsets of the shape's rank; otherwise nullopt.
  std::optional<ShardedTensor> ShardsOf(py::handle x, bool writable,
                                        const std::string& fqn,
                                        KeepAlive& keep) {
    std::vector<int64_t> shape = Ints(x.attr("shape"));
    py::list pairs = x.attr("shards");
    if (pairs.empty()) return std::nullopt;
    const char* first = nullptr;
    std::vector<Shard> shards;
    for (py::handle pair : pairs) {
      py::tuple p = py::reinterpret_borrow<py::tuple>(pair);
      py::handle local = p[1];
      if (!Contains(torch_->tensor_types, py::type::handle_of(local))) {
        return std::nullopt;
      }
      const char* name = DTypeName(local);
      if (name == nullptr) return std::nullopt;
      if (first == nullptr) first = name;
      if (std::string_view(first) != name) return std::nullopt;
      std::vector<int64_t> offsets = Ints(p[0]);
      if (offsets.size() != shape.size()) return std::nullopt;
      absl::StatusOr<DType> dtype = DTypeFromName(name);
      if (!dtype.ok()) return std::nullopt;
      absl::StatusOr<TensorView> view = View(local, *dtype, writable, fqn, keep);
      if (!view.ok()) return std::nullopt;
      std::vector<int64_t> sizes = view->shape();
      shards.push_back(
          Shard{Box{std::move(offsets), std::move(sizes)}, *std::move(view)});
    }
    absl::StatusOr<DType> dtype = DTypeFromName(first);
    return ShardedTensor(*dtype, std::move(shape), std::move(shards));
  }

  bool for_load_;
  py::list& slots_;
  std::optional<Torch> torch_;
  py::object sharded_type_;
  py::object tensor_leaf_;
  py::object encode_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PreparedState>> Prepare(py::handle state_dict,
                                                       bool for_load,
                                                       py::handle hooks) {
  auto prepared = std::make_unique<PreparedState>();
  prepared->writable = for_load;
  Leaves leaves(hooks, for_load, prepared->slots);
  absl::StatusOr<StateDict> state =
      ToStateDict(state_dict, for_load, prepared->keep, &leaves);
  if (!state.ok()) return state.status();
  prepared->state = *std::move(state);
  return prepared;
}

}  // namespace cairn::python
