// A user's state dict as the C++ library takes it, built in one walk.
//
// python/cairn/_state.py hands the state dict itself (nested dicts and
// lists of torch tensors, DTensors, NumPy arrays, cairn.ShardedTensor,
// scalars and objects) to `Prepare`. Plain torch tensors and ShardedTensors
// of them, the common case, are converted here without running Python
// code; any other leaf goes to the Python layer's hooks (DTensors, arrays,
// objects to pickle), which also raise the errors for bad leaves. So the
// GIL is held for a few Python C-API calls per tensor, not an interpreted
// walk: in a job whose ranks are threads of one process, that time adds up
// across the ranks.
#ifndef CAIRN_PYTHON_PREPARE_H_
#define CAIRN_PYTHON_PREPARE_H_

#include <pybind11/pybind11.h>

#include <memory>

#include "cairn/cairn.h"
#include "convert.h"

namespace cairn::python {

// A converted state dict, with the Python objects its views point into.
// `slots` lists (fqn, container, key) of every scalar and object leaf, so
// that a load can put the stored values back.
struct PreparedState {
  StateDict state;
  KeepAlive keep;
  py::list slots;
  bool writable = false;
  bool taken = false;
};

// Builds a PreparedState of `state_dict`. `for_load`: views will be
// written, and objects are placeholders. `hooks` is the Python layer's
// tuple (torch, sharded_type, tensor_leaf, encode_object): torch is None
// or (exact tensor types, torch.strided, {torch dtype: cairn name},
// (float8 dtypes), torch.uint8, to_dlpack); tensor_leaf(x, fqn) returns a
// Sharded or None; encode_object(x) returns the bytes to store. Python
// exceptions from the hooks propagate; other errors (kInvalidArgument)
// name the FQN. Needs the GIL.
absl::StatusOr<std::unique_ptr<PreparedState>> Prepare(py::handle state_dict,
                                                       bool for_load,
                                                       py::handle hooks);

}  // namespace cairn::python

#endif  // CAIRN_PYTHON_PREPARE_H_
