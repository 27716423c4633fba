// Hugging Face interop from Python (include/cairn/huggingface.h,
// import_names.h): name maps that call Python functions, export options,
// and the module functions that need no state dict.
#ifndef CAIRN_PYTHON_HUGGINGFACE_H_
#define CAIRN_PYTHON_HUGGINGFACE_H_

#include <pybind11/pybind11.h>

#include "cairn/cairn.h"

namespace cairn::python {

namespace py = pybind11;

// The load option keys this file reads ("strip_prefix", "add_prefix",
// "name_map"): true when `key` is one, stored into `names`. A name_map is
// a Python callable taking and returning a list of dicts (fqn, dtype,
// shape, parts: source, source_row, offsets, sizes); it is called with
// the GIL taken, and an exception in it fails the load naming it.
bool ImportNameOption(const std::string& key, py::handle value,
                      ImportNames& names);

// Export options from Python values; dtype is a name or None.
HfExportOptions HfExportOptionsFrom(uint64_t max_shard_size, py::handle dtype,
                                    bool overwrite, py::handle progress);

// The result as a dict: files, total_size, bytes_written, tensors, skipped,
// seconds.
py::dict HfExportResultToDict(const HfExportResult& r);

// export_hf, convert_to_checkpoint, fuse_tensors, split_rows.
void RegisterHuggingFace(py::module_& m);

}  // namespace cairn::python

#endif  // CAIRN_PYTHON_HUGGINGFACE_H_
