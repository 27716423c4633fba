// Conversions between Python objects and cairn's C++ types, for the
// extension module _cairn.
//
// The pure-Python layer (python/cairn) prepares a state dict before it
// reaches C++: every tensor, DTensor or array becomes a `Sharded` (the
// dtype's safetensors name, the global shape, and per local shard its box
// and an object exporting the shard's bytes by DLPack as an unsigned (or
// signed) integer tensor of the dtype's width), and every object that is
// not an int, float, bool, str or bytes is already pickled into bytes. So
// the C++ side never interprets framework dtypes: it takes the bits and
// the name, and checks that the widths agree.
#ifndef CAIRN_PYTHON_CONVERT_H_
#define CAIRN_PYTHON_CONVERT_H_

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cairn/cairn.h"

namespace cairn::python {

namespace py = pybind11;

// An option's value as T, or a TypeError naming the option (`what`:
// "option", "s3 option") and the type it got (pybind11's own cast error
// names neither).
template <typename T>
T OptionAs(const std::string& key, py::handle v,
           const char* what = "option") {
  try {
    return py::cast<T>(v);
  } catch (const py::cast_error&) {
    throw py::type_error(absl::StrCat(
        what, " '", key, "' does not take a ",
        std::string(py::str(py::type::of(v).attr("__name__")))));
  }
}

// Raises the Python exception class that python/cairn/_errors.py registered
// for the status's code (cairn.Error when none). Needs the GIL.
[[noreturn]] void Raise(const absl::Status& status);

template <typename T>
T Unwrap(absl::StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return *std::move(v);
}

inline void Check(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}

// A tensor leaf as the Python layer prepared it.
struct Sharded {
  std::string dtype;            // "F32", "BF16", ...
  std::vector<int64_t> shape;   // global shape
  // (offsets, sizes, exporter): exporter has __dlpack__.
  py::list shards;
};

// The Python objects a converted StateDict's views point into (DLPack
// capsules), kept alive (and released with the GIL held) by the caller.
struct KeepAlive {
  std::vector<py::object> objects;
};

// Turns the leaves that ToStateDict does not know itself (anything but a
// dict, list or Sharded) into nodes: prepare.h's handler takes a user's
// torch tensors, arrays, scalars and objects straight from the state dict.
class LeafHandler {
 public:
  // The node for `obj` at `fqn`, which is `parent[key]`.
  virtual absl::StatusOr<StateDict> Leaf(py::handle obj, const std::string& fqn,
                                         py::handle parent, py::handle key,
                                         bool writable, KeepAlive& keep) = 0;

 protected:
  ~LeafHandler() = default;
};

// Builds the StateDict of a nested dict/list whose leaves are `Sharded`,
// and the others either go to `leaves` or, without one, are scalars (int,
// float, bool, str) and bytes (objects). `writable`: the views will be
// written (a load), so read-only exports are refused. Errors
// (kInvalidArgument) name the FQN. Needs the GIL.
absl::StatusOr<StateDict> ToStateDict(py::handle tree, bool writable,
                                      KeepAlive& keep,
                                      LeafHandler* leaves = nullptr);

// A scalar (int within int64, float, bool, str) or object (bytes) leaf.
absl::StatusOr<StateDict> ValueLeaf(py::handle obj, const std::string& fqn);

// The tensor of a Sharded leaf at `fqn`.
absl::StatusOr<ShardedTensor> ToShardedTensor(const Sharded& leaf,
                                              bool writable,
                                              const std::string& fqn,
                                              KeepAlive& keep);

// A view of the bytes `exporter` (a DLPack capsule, or an object with
// __dlpack__) hands out, as `dtype`, whose element width must match; the
// exporter and capsule go into `keep`.
absl::StatusOr<TensorView> ImportView(py::handle exporter, DType dtype,
                                      bool writable, const std::string& fqn,
                                      KeepAlive& keep);

// "'fqn'", or the root's name; and a child's FQN.
std::string Where(const std::string& fqn);
std::string Child(const std::string& fqn, const std::string& key);

// The value of a scalar or object leaf as a Python object (bytes for
// objects); None for other nodes. Needs the GIL.
py::object LeafValue(const StateDict& node);

// A StateDict of whole host tensors (LoadAll's) as nested dicts/lists whose
// tensor leaves are `Exported` objects (see module.cc) and whose other
// leaves are Python values. Needs the GIL.
py::object FromStateDict(const StateDict& state);

// An owning host tensor handed to Python by DLPack (__dlpack__ /
// __dlpack_device__): its bytes as an unsigned integer tensor of the
// dtype's width, which the Python layer views as the real dtype.
struct Exported {
  TensorView view;              // contiguous host memory
  std::shared_ptr<void> owner;  // keeps view's memory alive
  std::string dtype;            // cairn's name
};

// A capsule ("dltensor") of `exported`'s bits; the tensor's buffer lives
// until the consumer's deleter runs.
py::capsule ExportCapsule(const Exported& exported);

}  // namespace cairn::python

#endif  // CAIRN_PYTHON_CONVERT_H_
