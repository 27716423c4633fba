#include "convert.h"

#include <Python.h>
#include <dlpack/dlpack.h>

#include <cstdint>
#include <stdexcept>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace cairn::python {
namespace {

// DLPack 1.x's versioned managed tensor (its ABI, from the DLPack spec):
// Debian's dlpack.h is 0.6, which predates it. Producers hand it out in a
// capsule named "dltensor_versioned" when asked with max_version >= (1, 0);
// it adds the read-only flag that NumPy needs to export read-only arrays.
struct VersionedManagedTensor {
  struct {
    uint32_t major;
    uint32_t minor;
  } version;
  void* manager_ctx;
  void (*deleter)(VersionedManagedTensor*);
  uint64_t flags;
  DLTensor dl_tensor;
};
constexpr uint64_t kDLPackFlagReadOnly = uint64_t{1} << 0;

}  // namespace

[[noreturn]] void Raise(const absl::Status& status) {
  py::module_ mod = py::module_::import("cairn._cairn");
  py::object cls = py::reinterpret_borrow<py::object>(PyExc_RuntimeError);
  if (py::hasattr(mod, "_error_types")) {
    py::dict types = mod.attr("_error_types");
    py::int_ code(static_cast<int>(status.code()));
    if (types.contains(code)) {
      cls = types[code];
    } else if (types.contains(py::int_(-1))) {
      cls = types[py::int_(-1)];
    }
  }
  PyErr_SetString(cls.ptr(), std::string(status.message()).c_str());
  throw py::error_already_set();
}

std::string Where(const std::string& fqn) {
  return fqn.empty() ? std::string("the state dict's root")
                     : absl::StrCat("'", fqn, "'");
}

std::string Child(const std::string& fqn, const std::string& key) {
  return fqn.empty() ? key : absl::StrCat(fqn, ".", key);
}

// A view of the bytes `exporter` hands out by DLPack, as `dtype`. The
// capsule goes into `keep`: it stays unconsumed (its name unchanged), so
// the producer's capsule destructor releases the tensor when `keep` drops
// it.
absl::StatusOr<TensorView> ImportView(py::handle exporter, DType dtype,
                                      bool writable, const std::string& fqn,
                                      KeepAlive& keep) {
  py::object capsule;
  try {
    if (PyCapsule_CheckExact(exporter.ptr())) {
      // Already a capsule: the Python layer passes torch tensors as
      // torch.utils.dlpack.to_dlpack's (0.4 us against 8 us for torch's
      // __dlpack__ here).
      capsule = py::reinterpret_borrow<py::object>(exporter);
    } else if (!py::hasattr(exporter, "__dlpack__")) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(fqn), ": a shard's data has no __dlpack__ (got ",
          std::string(py::str(py::type::of(exporter).attr("__name__"))), ")"));
    } else {
      py::object method = exporter.attr("__dlpack__");
      try {
        capsule = method(py::arg("max_version") = py::make_tuple(1, 0));
      } catch (py::error_already_set& e) {
        // Producers older than DLPack 1.0 take no max_version.
        if (!e.matches(PyExc_TypeError)) throw;
        capsule = method();
      }
    }
  } catch (py::error_already_set& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(fqn), ": cannot export by DLPack: ", e.what()));
  }
  keep.objects.push_back(py::reinterpret_borrow<py::object>(exporter));
  keep.objects.push_back(capsule);
  const char* name = PyCapsule_GetName(capsule.ptr());
  if (name == nullptr) PyErr_Clear();
  const DLTensor* dl = nullptr;
  if (name != nullptr && std::string_view(name) == "dltensor_versioned") {
    auto* managed = static_cast<VersionedManagedTensor*>(
        PyCapsule_GetPointer(capsule.ptr(), name));
    if (managed == nullptr) {
      PyErr_Clear();
      return absl::InvalidArgumentError(
          absl::StrCat(Where(fqn), ": empty DLPack capsule"));
    }
    if (managed->version.major != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(fqn), ": DLPack version ", managed->version.major, ".",
          managed->version.minor, " is not supported (1.x is)"));
    }
    if (writable && (managed->flags & kDLPackFlagReadOnly) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(fqn),
          ": the destination is read-only (a load writes into it in place)"));
    }
    dl = &managed->dl_tensor;
  } else if (name != nullptr && std::string_view(name) == "dltensor") {
    auto* managed = static_cast<DLManagedTensor*>(
        PyCapsule_GetPointer(capsule.ptr(), name));
    if (managed == nullptr) {
      PyErr_Clear();
      return absl::InvalidArgumentError(
          absl::StrCat(Where(fqn), ": empty DLPack capsule"));
    }
    dl = &managed->dl_tensor;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(fqn), ": __dlpack__ returned no DLPack capsule (capsule name ",
        name == nullptr ? "none" : name, ")"));
  }
  absl::StatusOr<TensorView> bits = FromDLPack(*dl);
  if (!bits.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(fqn), ": ", bits.status().message()));
  }
  if (DTypeSize(bits->dtype()) != DTypeSize(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(fqn), ": the exported bytes are ",
        std::string(DTypeName(bits->dtype())), " (", DTypeSize(bits->dtype()),
        " bytes each), but the dtype is ", std::string(DTypeName(dtype)), " (",
        DTypeSize(dtype), " bytes each)"));
  }
  return TensorView(bits->data(), dtype, bits->shape(), bits->strides(),
                    bits->device());
}

namespace {

absl::StatusOr<std::vector<int64_t>> Int64List(py::handle obj,
                                               const std::string& what,
                                               const std::string& fqn) {
  std::vector<int64_t> out;
  try {
    for (py::handle item : obj) out.push_back(py::cast<int64_t>(item));
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(fqn), ": ", what, " must be a sequence of integers: ", e.what()));
  }
  return out;
}

}  // namespace

absl::StatusOr<ShardedTensor> ToShardedTensor(const Sharded& leaf,
                                              bool writable,
                                              const std::string& fqn,
                                              KeepAlive& keep) {
  absl::StatusOr<DType> dtype = DTypeFromName(leaf.dtype);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(fqn), ": ", dtype.status().message()));
  }
  std::vector<Shard> shards;
  for (py::handle item : leaf.shards) {
    py::tuple shard;
    try {
      shard = py::cast<py::tuple>(item);
    } catch (const std::exception&) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(fqn), ": a shard must be a tuple (offsets, sizes, data)"));
    }
    if (shard.size() != 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(fqn), ": a shard must be a tuple (offsets, sizes, data)"));
    }
    auto offsets = Int64List(shard[0], "a shard's offsets", fqn);
    if (!offsets.ok()) return offsets.status();
    auto sizes = Int64List(shard[1], "a shard's sizes", fqn);
    if (!sizes.ok()) return sizes.status();
    auto view = ImportView(shard[2], *dtype, writable, fqn, keep);
    if (!view.ok()) return view.status();
    if (view->shape() != *sizes) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(fqn), ": a shard's data has shape [",
          absl::StrJoin(view->shape(), ", "), "], its box has sizes [",
          absl::StrJoin(*sizes, ", "), "]"));
    }
    shards.push_back(Shard{Box{*std::move(offsets), *std::move(sizes)},
                           *std::move(view)});
  }
  return ShardedTensor(*dtype, leaf.shape, std::move(shards));
}

namespace {

absl::StatusOr<StateDict> Build(py::handle obj, const std::string& fqn,
                                bool writable, KeepAlive& keep,
                                LeafHandler* leaves, py::handle parent,
                                py::handle key) {
  if (py::isinstance<py::dict>(obj)) {
    StateDict node = StateDict::Map();
    for (auto [name, value] : py::reinterpret_borrow<py::dict>(obj)) {
      if (!py::isinstance<py::str>(name)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "state dict keys must be str; ", Where(fqn), " has a key of type ",
            std::string(py::str(py::type::of(name).attr("__name__")))));
      }
      const std::string k = py::cast<std::string>(name);
      auto child = Build(value, Child(fqn, k), writable, keep, leaves, obj, name);
      if (!child.ok()) return child.status();
      node[k] = *std::move(child);
    }
    return node;
  }
  if (py::isinstance<py::list>(obj)) {
    StateDict node = StateDict::List();
    size_t i = 0;
    for (py::handle value : obj) {
      auto child = Build(value, Child(fqn, std::to_string(i)), writable, keep,
                         leaves, obj, py::int_(i));
      ++i;
      if (!child.ok()) return child.status();
      node.Append(*std::move(child));
    }
    return node;
  }
  if (py::isinstance<Sharded>(obj)) {
    auto tensor = ToShardedTensor(py::cast<const Sharded&>(obj), writable,
                                  fqn, keep);
    if (!tensor.ok()) return tensor.status();
    return StateDict(*std::move(tensor));
  }
  if (leaves != nullptr) {
    return leaves->Leaf(obj, fqn, parent, key, writable, keep);
  }
  return ValueLeaf(obj, fqn);
}

}  // namespace

absl::StatusOr<StateDict> ValueLeaf(py::handle obj, const std::string& fqn) {
  if (PyBool_Check(obj.ptr())) return StateDict(obj.ptr() == Py_True);
  if (PyLong_Check(obj.ptr())) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(obj.ptr(), &overflow);
    if (overflow != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(fqn), ": integer does not fit in int64 (", std::string(py::str(obj)), ")"));
    }
    return StateDict(static_cast<int64_t>(v));
  }
  if (PyFloat_Check(obj.ptr())) return StateDict(PyFloat_AsDouble(obj.ptr()));
  if (py::isinstance<py::str>(obj)) {
    return StateDict(Scalar(py::cast<std::string>(obj)));
  }
  if (py::isinstance<py::bytes>(obj)) {
    return StateDict(Object{py::cast<std::string>(obj)});
  }
  return absl::InvalidArgumentError(absl::StrCat(
      Where(fqn), ": unsupported value of type ",
      std::string(py::str(py::type::of(obj).attr("__name__")))));
}

namespace {

// The unsigned dtype of an element's width; the F6 quads' 3 bytes have
// none (the Python side refuses them before asking for a capsule).
DType BitsType(DType dtype) {
  switch (DTypeSize(dtype)) {
    case 1:
      return DType::kU8;
    case 2:
      return DType::kU16;
    case 4:
      return DType::kU32;
    case 8:
      return DType::kU64;
    default:
      throw std::invalid_argument(absl::StrCat(
          "dtype ", std::string(DTypeName(dtype)),
          " has elements of ", DTypeSize(dtype),
          " bytes, which DLPack cannot carry"));
  }
}

void DeleteCapsule(PyObject* capsule) {
  // Consumed capsules are renamed "used_dltensor": the consumer owns the
  // tensor then.
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* managed =
      static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr && managed->deleter != nullptr) {
    managed->deleter(managed);
  }
}

}  // namespace

absl::StatusOr<StateDict> ToStateDict(py::handle tree, bool writable,
                                      KeepAlive& keep, LeafHandler* leaves) {
  return Build(tree, "", writable, keep, leaves, py::none(), py::none());
}

py::object LeafValue(const StateDict& node) {
  if (const Object* o = node.object()) return py::bytes(o->bytes);
  if (const Scalar* s = node.scalar()) {
    return std::visit(
        [](const auto& v) -> py::object {
          using T = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<T, bool>) return py::bool_(v);
          else if constexpr (std::is_same_v<T, int64_t>) return py::int_(v);
          else if constexpr (std::is_same_v<T, double>) return py::float_(v);
          else return py::str(v);
        },
        *s);
  }
  return py::none();
}

py::object FromStateDict(const StateDict& state) {
  if (state.is_map()) {
    py::dict out;
    for (const auto& [key, child] : state.items()) {
      out[py::str(key)] = FromStateDict(child);
    }
    return out;
  }
  if (state.is_list()) {
    py::list out;
    for (const StateDict& child : state.elements()) {
      out.append(FromStateDict(child));
    }
    return out;
  }
  if (const ShardedTensor* t = state.tensor()) {
    // LoadAll's tensors: one shard covering the whole tensor, owned.
    Exported e;
    const TensorView& view = t->shards().front().view;
    e.view = view;
    e.owner = t->owner();
    e.dtype = std::string(DTypeName(t->dtype()));
    return py::cast(std::move(e));
  }
  return LeafValue(state);
}

py::capsule ExportCapsule(const Exported& exported) {
  const TensorView& v = exported.view;
  TensorView bits(v.data(), BitsType(v.dtype()), v.shape(), v.strides(),
                  v.device());
  absl::StatusOr<DLManagedTensor*> managed = ToDLPack(bits, exported.owner);
  if (!managed.ok()) throw std::runtime_error(managed.status().ToString());
  PyObject* capsule = PyCapsule_New(*managed, "dltensor", &DeleteCapsule);
  if (capsule == nullptr) {
    (*managed)->deleter(*managed);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::capsule>(capsule);
}

}  // namespace cairn::python
