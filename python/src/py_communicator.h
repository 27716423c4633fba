// PyCommunicator: a cairn::Communicator whose collectives are methods of a
// Python object, so that the ranks of a PyTorch job talk over a
// torch.distributed process group (cairn/_comm.py's TorchCommunicator),
// with no MPI.
//
// The Python object provides, every method collective over its ranks:
//   rank() -> int, size() -> int, kind() -> str
//   barrier()
//   broadcast(data: bytes, root: int) -> bytes
//   gather(data: bytes, root: int) -> list[bytes]   ([] off the root)
//   all_gather(data: bytes) -> list[bytes]
//   scatter(data: list[bytes] | None, root: int) -> bytes
//   all_reduce(values: list[int], op: "sum" | "min" | "max") -> list[int]
//   broadcast_into(buffer: memoryview, root: int)   (writable, in place)
//   split(color: int, key: int) -> a new object of this kind
//
// cairn calls them from the thread running a save or load, with the GIL
// released around its own work; each call takes the GIL. A Python
// exception becomes a status (kDeadlineExceeded for a TimeoutError,
// kAborted otherwise) that names the method and keeps the message; after
// one, the communicator refuses every later collective (kAborted), since
// the ranks may no longer be in step.
#ifndef CAIRN_PYTHON_PY_COMMUNICATOR_H_
#define CAIRN_PYTHON_PY_COMMUNICATOR_H_

#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "cairn/communicator.h"

namespace cairn::python {

namespace py = pybind11;

// Wraps `impl` (needs the GIL; reads rank(), size() and kind() once).
absl::StatusOr<std::unique_ptr<Communicator>> MakePyCommunicator(
    py::object impl);

}  // namespace cairn::python

#endif  // CAIRN_PYTHON_PY_COMMUNICATOR_H_
