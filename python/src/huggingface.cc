#include "huggingface.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "convert.h"

namespace cairn::python {
namespace {

py::list TensorsToPy(const std::vector<ImportedTensor>& tensors) {
  py::list out;
  for (const ImportedTensor& t : tensors) {
    py::list parts;
    for (const ImportPart& p : t.parts) {
      py::dict d;
      d["source"] = p.source;
      d["source_row"] = p.source_row;
      d["offsets"] = p.box.offsets;
      d["sizes"] = p.box.sizes;
      parts.append(d);
    }
    py::dict d;
    d["fqn"] = t.fqn;
    d["dtype"] = std::string(DTypeName(t.dtype));
    d["shape"] = t.shape;
    d["parts"] = parts;
    out.append(d);
  }
  return out;
}

absl::StatusOr<std::vector<ImportedTensor>> TensorsFromPy(py::handle list) {
  std::vector<ImportedTensor> out;
  try {
    for (py::handle item : py::iter(list)) {
      py::dict d = py::cast<py::dict>(item);
      ImportedTensor t;
      t.fqn = py::cast<std::string>(d["fqn"]);
      absl::StatusOr<DType> dtype =
          DTypeFromName(py::cast<std::string>(d["dtype"]));
      if (!dtype.ok()) return dtype.status();
      t.dtype = *dtype;
      t.shape = py::cast<std::vector<int64_t>>(d["shape"]);
      for (py::handle ph : py::iter(d["parts"])) {
        py::dict p = py::cast<py::dict>(ph);
        ImportPart part;
        part.source = py::cast<std::string>(p["source"]);
        part.source_row =
            p.contains("source_row") ? py::cast<int64_t>(p["source_row"]) : 0;
        part.box.offsets = py::cast<std::vector<int64_t>>(p["offsets"]);
        part.box.sizes = py::cast<std::vector<int64_t>>(p["sizes"]);
        t.parts.push_back(std::move(part));
      }
      out.push_back(std::move(t));
    }
  } catch (const py::error_already_set& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("name_map returned something other than a list of "
                     "tensor dicts: ", e.what()));
  } catch (const py::cast_error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("name_map returned something other than a list of "
                     "tensor dicts (fqn, dtype, shape, parts: source, "
                     "source_row, offsets, sizes): ", e.what()));
  }
  return out;
}

// Holds a Python object; drops its reference with the GIL taken, from
// whatever thread lets go of the last copy.
std::shared_ptr<py::object> Held(py::handle h) {
  return std::shared_ptr<py::object>(
      new py::object(py::reinterpret_borrow<py::object>(h)),
      [](py::object* o) {
        py::gil_scoped_acquire gil;
        delete o;
      });
}

std::optional<DType> DTypeOrNone(py::handle h) {
  if (h.is_none()) return std::nullopt;
  return Unwrap(DTypeFromName(py::cast<std::string>(h)));
}

// `fn` applied to the list of dicts `tensors` as C++ would.
py::list EditTensors(
    py::handle tensors,
    const std::function<absl::Status(std::vector<ImportedTensor>&)>& fn) {
  std::vector<ImportedTensor> ts = Unwrap(TensorsFromPy(tensors));
  Check(fn(ts));
  return TensorsToPy(ts);
}

}  // namespace

bool ImportNameOption(const std::string& key, py::handle v,
                      ImportNames& names) {
  if (key == "strip_prefix") {
    names.strip_prefix = v.is_none() ? "" : py::cast<std::string>(v);
  } else if (key == "add_prefix") {
    names.add_prefix = v.is_none() ? "" : py::cast<std::string>(v);
  } else if (key == "name_map") {
    if (v.is_none()) {
      names.map = nullptr;
      return true;
    }
    if (!PyCallable_Check(v.ptr())) {
      throw py::type_error("option 'name_map' takes a callable");
    }
    std::shared_ptr<py::object> fn = Held(v);
    names.map = [fn](std::vector<ImportedTensor> tensors)
        -> absl::StatusOr<std::vector<ImportedTensor>> {
      py::gil_scoped_acquire gil;
      py::object result;
      try {
        result = (*fn)(TensorsToPy(tensors));
      } catch (py::error_already_set& e) {
        return absl::InvalidArgumentError(
            absl::StrCat("name_map raised ", e.what()));
      }
      return TensorsFromPy(result);
    };
  } else {
    return false;
  }
  return true;
}

HfExportOptions HfExportOptionsFrom(uint64_t max_shard_size, py::handle dtype,
                                    bool overwrite, py::handle progress) {
  HfExportOptions o;
  o.max_shard_size = max_shard_size;
  o.dtype = DTypeOrNone(dtype);
  o.overwrite = overwrite;
  if (!progress.is_none()) {
    std::shared_ptr<py::object> fn = Held(progress);
    o.progress = [fn](uint64_t done, uint64_t total) {
      py::gil_scoped_acquire gil;
      try {
        (*fn)(done, total);
      } catch (py::error_already_set&) {
        // A failing progress callback does not fail the export.
      }
    };
  }
  return o;
}

py::dict HfExportResultToDict(const HfExportResult& r) {
  py::dict d;
  d["files"] = r.files;
  d["total_size"] = r.total_size;
  d["bytes_written"] = r.bytes_written;
  d["tensors"] = r.tensors;
  d["skipped"] = r.skipped;
  d["seconds"] = r.seconds;
  return d;
}

void RegisterHuggingFace(py::module_& m) {
  m.def(
      "export_hf",
      [](const std::string& url, const std::string& dir,
         uint64_t max_shard_size, py::handle dtype, bool overwrite,
         py::handle progress) {
        HfExportOptions o =
            HfExportOptionsFrom(max_shard_size, dtype, overwrite, progress);
        absl::StatusOr<HfExportResult> r;
        {
          py::gil_scoped_release release;
          r = ExportToHuggingFace(url, dir, o);
        }
        return HfExportResultToDict(Unwrap(std::move(r)));
      },
      py::arg("url"), py::arg("dir"), py::arg("max_shard_size"),
      py::arg("dtype"), py::arg("overwrite"), py::arg("progress"));

  m.def(
      "convert_to_checkpoint",
      [](const std::string& src, const std::string& dst, py::handle dtype,
         bool overwrite, py::kwargs kw) {
        ConvertOptions o;
        o.dtype = DTypeOrNone(dtype);
        o.save.overwrite = overwrite;
        for (auto [k, v] : kw) {
          const std::string key = py::cast<std::string>(k);
          if (!ImportNameOption(key, v, o.names)) {
            throw py::type_error(
                absl::StrCat("unexpected convert option '", key, "'"));
          }
        }
        absl::StatusOr<SaveResult> r;
        {
          py::gil_scoped_release release;
          r = ConvertToCheckpoint(src, dst, o);
        }
        return Unwrap(std::move(r));
      },
      py::arg("src"), py::arg("dst"), py::arg("dtype"), py::arg("overwrite"));

  m.def("is_safetensors_source", [](const std::string& url) {
    return Unwrap(IsSafetensorsSource(url));
  });

  m.def(
      "fuse_tensors",
      [](py::handle tensors, std::vector<std::string> sources,
         const std::string& fqn, int dim) {
        return EditTensors(tensors, [&](std::vector<ImportedTensor>& ts) {
          return FuseTensors(ts, sources, fqn, dim);
        });
      },
      py::arg("tensors"), py::arg("sources"), py::arg("fqn"), py::arg("dim"));

  m.def(
      "split_rows",
      [](py::handle tensors, const std::string& source,
         std::vector<std::pair<std::string, int64_t>> pieces) {
        return EditTensors(tensors, [&](std::vector<ImportedTensor>& ts) {
          return SplitRows(ts, source, pieces);
        });
      },
      py::arg("tensors"), py::arg("source"), py::arg("pieces"));
}

}  // namespace cairn::python
