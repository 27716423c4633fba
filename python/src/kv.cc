#include "kv.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace cairn::python {
namespace {

std::string TypeName(py::handle obj) {
  return py::str(py::type::of(obj).attr("__name__"));
}

// ---- specs ---------------------------------------------------------------

KvBucketing BucketingOf(const std::string& name) {
  if (name == "chunked") return KvBucketing::kChunked;
  if (name == "interleaved") return KvBucketing::kInterleaved;
  Raise(absl::InvalidArgumentError(absl::StrCat(
      "bucketing must be 'chunked' or 'interleaved', not '", name, "'")));
}

std::string BucketingName(KvBucketing b) {
  return b == KvBucketing::kChunked ? "chunked" : "interleaved";
}

// A cairn.KvTableSpec (or any object with its attributes) as the library's;
// not validated.
KvTableSpec SpecOf(py::handle spec) {
  KvTableSpec out;
  try {
    out.num_buckets = py::cast<int64_t>(spec.attr("num_buckets"));
    out.bucketing = BucketingOf(py::cast<std::string>(spec.attr("bucketing")));
    out.bucket_size = py::cast<int64_t>(spec.attr("bucket_size"));
    for (py::handle c : spec.attr("columns")) {
      KvColumn col;
      col.name = py::cast<std::string>(c.attr("name"));
      col.dtype = Unwrap(DTypeFromName(py::cast<std::string>(c.attr("dtype"))));
      col.width = py::cast<int64_t>(c.attr("width"));
      out.columns.push_back(std::move(col));
    }
  } catch (const py::cast_error& e) {
    throw py::type_error(absl::StrCat("not a key-value table spec (a ",
                                      TypeName(spec), "): ", e.what()));
  }
  return out;
}

py::dict SpecToDict(const KvTableSpec& spec) {
  py::list columns;
  for (const KvColumn& c : spec.columns) {
    py::dict d;
    d["name"] = c.name;
    d["dtype"] = std::string(DTypeName(c.dtype));
    d["width"] = c.width;
    columns.append(d);
  }
  py::dict d;
  d["num_buckets"] = spec.num_buckets;
  d["bucketing"] = BucketingName(spec.bucketing);
  d["bucket_size"] = spec.bucket_size;
  d["columns"] = columns;
  return d;
}

std::optional<KvBucketRange> RangeOf(py::handle obj) {
  if (obj.is_none()) return std::nullopt;
  auto pair = py::cast<std::pair<int64_t, int64_t>>(obj);
  return KvBucketRange{pair.first, pair.second};
}

py::tuple RangeTuple(KvBucketRange r) { return py::make_tuple(r.begin, r.end); }

// ---- Python exceptions as statuses ---------------------------------------

absl::Status StatusOfPython(py::error_already_set& e) {
  const std::string name = py::str(e.type().attr("__name__"));
  const std::string text = py::str(e.value());
  // A cairn.Error keeps its code and message.
  py::dict types = py::module_::import("cairn._cairn").attr("_error_types");
  for (auto [code, cls] : types) {
    const int c = py::cast<int>(code);
    if (c > 0 && c != 2 && e.matches(cls)) {
      return absl::Status(static_cast<absl::StatusCode>(c), text);
    }
  }
  if (py::isinstance(e.value(), types[py::int_(-1)])) {
    return absl::UnknownError(text);
  }
  absl::StatusCode code = absl::StatusCode::kUnknown;
  if (e.matches(PyExc_ValueError) || e.matches(PyExc_TypeError)) {
    code = absl::StatusCode::kInvalidArgument;
  } else if (e.matches(PyExc_TimeoutError)) {
    code = absl::StatusCode::kDeadlineExceeded;
  } else if (e.matches(PyExc_MemoryError)) {
    code = absl::StatusCode::kResourceExhausted;
  } else if (e.matches(PyExc_NotImplementedError)) {
    code = absl::StatusCode::kUnimplemented;
  } else if (e.matches(PyExc_KeyboardInterrupt)) {
    code = absl::StatusCode::kCancelled;
  }
  return absl::Status(code, text.empty() ? name : absl::StrCat(name, ": ", text));
}

// ---- adapters ------------------------------------------------------------

// A view of `exporter`'s bytes (host memory) as `dtype`.
absl::StatusOr<TensorView> HostView(py::handle exporter, DType dtype,
                                    bool writable, const std::string& what,
                                    KeepAlive& keep) {
  absl::StatusOr<TensorView> v = ImportView(exporter, dtype, writable, what, keep);
  if (v.ok() && !v->device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        Where(what), ": the data is on ", v->device().ToString(),
        "; key-value rows cross in host memory"));
  }
  return v;
}

// A source whose next() is a Python method (the Python layer's wrapper of
// a user's source, which checks and converts each batch).
class PyKvSource final : public KvSource {
 public:
  PyKvSource(py::object impl, std::string fqn, KvTableSpec spec)
      : impl_(std::move(impl)), fqn_(std::move(fqn)), spec_(std::move(spec)),
        cache_(spec_.columns.size()) {}

  absl::Status Begin() override { return CallMethod("begin"); }
  absl::Status End() override { return CallMethod("end"); }

  absl::StatusOr<bool> Next(KvBatch& batch) override {
    py::gil_scoped_acquire gil;
    try {
      py::object got = impl_.attr("next")();
      if (got.is_none()) return false;
      py::tuple pair = py::cast<py::tuple>(got);
      KeepAlive keep;  // the views are copied before it goes
      CAIRN_ASSIGN_OR_RETURN(
          TensorView ids, HostView(pair[0], DType::kI64, false, fqn_, keep));
      if (ids.rank() != 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            Where(fqn_), ": ids must be 1-D, not of rank ", ids.rank()));
      }
      const int64_t n = ids.shape()[0];
      batch.ids.resize(n);
      const auto* src = static_cast<const int64_t*>(ids.data());
      const int64_t step = ids.strides()[0];
      for (int64_t i = 0; i < n; ++i) batch.ids[i] = src[i * step];
      py::list columns = py::cast<py::list>(pair[1]);
      if (columns.size() != spec_.columns.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            Where(fqn_), ": ", columns.size(), " columns for a table of ",
            spec_.columns.size()));
      }
      batch.columns.resize(columns.size());
      for (size_t c = 0; c < columns.size(); ++c) {
        CAIRN_ASSIGN_OR_RETURN(
            batch.columns[c],
            Copy(columns[c], spec_.columns[c].dtype, c, keep));
      }
      return true;
    } catch (py::error_already_set& e) {
      return StatusOfPython(e);
    } catch (const py::cast_error& e) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(fqn_), ": a batch must be (ids, [columns])"));
    }
  }

  ~PyKvSource() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

 private:
  absl::Status CallMethod(const char* name) {
    py::gil_scoped_acquire gil;
    try {
      impl_.attr(name)();
      return absl::OkStatus();
    } catch (py::error_already_set& e) {
      return StatusOfPython(e);
    }
  }

  // The batch's column: copied into a buffer kept for the next batch of the
  // same size (KvBatch holds owning tensors; the library copies them into
  // its chunk before it asks for the next batch).
  absl::StatusOr<Tensor> Copy(py::handle exporter, DType dtype, size_t c,
                              KeepAlive& keep) {
    CAIRN_ASSIGN_OR_RETURN(TensorView v,
                           HostView(exporter, dtype, false, fqn_, keep));
    if (!v.is_contiguous()) return Tensor::CopyOf(v);
    if (cache_[c].shape() != v.shape() || cache_[c].data() == nullptr) {
      CAIRN_ASSIGN_OR_RETURN(cache_[c], Tensor::Empty(dtype, v.shape()));
    }
    if (v.nbytes() > 0) std::memcpy(cache_[c].data(), v.data(), v.nbytes());
    return cache_[c];
  }

  py::object impl_;
  std::string fqn_;
  KvTableSpec spec_;
  std::vector<Tensor> cache_;
};

// A sink whose apply() is a Python method: it gets `Exported` views of
// cairn's buffers (no copy), valid only during the call.
class PyKvSink final : public KvSink {
 public:
  explicit PyKvSink(py::object impl) : impl_(std::move(impl)) {}

  absl::Status Apply(std::span<const int64_t> ids,
                     std::span<const TensorView> columns) override {
    py::gil_scoped_acquire gil;
    try {
      Exported e;
      e.view = TensorView(const_cast<int64_t*>(ids.data()), DType::kI64,
                          Shape{static_cast<int64_t>(ids.size())});
      e.dtype = "I64";
      py::object ids_obj = py::cast(std::move(e));
      py::list cols;
      for (const TensorView& v : columns) {
        cols.append(py::cast(Exported{v, nullptr, std::string(DTypeName(v.dtype()))}));
      }
      impl_.attr("apply")(ids_obj, cols);
      return absl::OkStatus();
    } catch (py::error_already_set& e) {
      return StatusOfPython(e);
    }
  }

  ~PyKvSink() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

 private:
  py::object impl_;
};

// ---- the library's tables ------------------------------------------------

// An InMemoryKvTable or a RocksDbKvTable. `users` counts its live sources
// and the calls using it without the GIL; close() waits for none.
struct KvTable {
  std::unique_ptr<InMemoryKvTable> memory;
  std::unique_ptr<RocksDbKvTable> rocks;
  std::string name;
  KvTableSpec spec;
  KvBucketRange owned;
  std::string path;  // RocksDB's
  std::atomic<int> users{0};

  bool open() const { return memory != nullptr || rocks != nullptr; }
  void CheckOpen() const {
    if (!open()) {
      Raise(absl::FailedPreconditionError(
          absl::StrCat("key-value table ", name, " is closed")));
    }
  }
  KvSink& sink() {
    CheckOpen();
    return memory ? static_cast<KvSink&>(*memory) : *rocks;
  }
};

// Keeps `t` open (and alive) while held.
std::shared_ptr<void> Lease(const std::shared_ptr<KvTable>& t) {
  t->CheckOpen();
  ++t->users;
  return std::shared_ptr<void>(nullptr, [t](void*) { --t->users; });
}

// A table's source, usable from Python (begin, next, end) and, as it is,
// in a save.
struct KvTableSource {
  std::shared_ptr<void> lease;  // declared first: outlives impl
  std::unique_ptr<KvSource> impl;
  KvBatch batch;
};

py::object NextBatch(KvTableSource& s) {
  absl::StatusOr<bool> more;
  {
    py::gil_scoped_release release;
    more = s.impl->Next(s.batch);
  }
  if (!Unwrap(std::move(more))) return py::none();
  auto ids = std::make_shared<std::vector<int64_t>>(std::move(s.batch.ids));
  s.batch.ids.clear();
  Exported e{TensorView(ids->data(), DType::kI64,
                        Shape{static_cast<int64_t>(ids->size())}),
             ids, "I64"};
  py::list cols;
  for (Tensor& t : s.batch.columns) {
    cols.append(py::cast(
        Exported{t.view(), t.buffer(), std::string(DTypeName(t.dtype()))}));
  }
  s.batch.columns.clear();
  return py::make_tuple(py::cast(std::move(e)), cols);
}

// Runs `fn` without the GIL, `t` kept open meanwhile.
template <typename F>
auto Released(const std::shared_ptr<KvTable>& t, F fn) {
  std::shared_ptr<void> lease = Lease(t);
  py::gil_scoped_release release;
  return fn();
}

py::object Find(const std::shared_ptr<KvTable>& t, int64_t id) {
  t->CheckOpen();
  Unwrap(KvBucketOf(t->spec, id));
  if (t->memory) {
    const std::byte* row = t->memory->Find(id);
    if (row == nullptr) return py::none();
    return py::bytes(reinterpret_cast<const char*>(row), t->spec.row_bytes());
  }
  auto row = Unwrap(Released(t, [&] { return t->rocks->Find(id); }));
  if (!row) return py::none();
  return py::bytes(*row);
}

py::array_t<int64_t> Ids(const std::shared_ptr<KvTable>& t) {
  t->CheckOpen();
  std::vector<int64_t> ids;
  if (t->memory) {
    t->memory->ForEachId([&](int64_t id) { ids.push_back(id); });
  } else {
    Check(Released(t, [&] {
      return t->rocks->ForEachId([&](int64_t id) { ids.push_back(id); });
    }));
  }
  return py::array_t<int64_t>(static_cast<py::ssize_t>(ids.size()), ids.data());
}

void Apply(const std::shared_ptr<KvTable>& t, py::handle ids_obj,
           py::list columns) {
  KeepAlive keep;
  TensorView ids = Unwrap(HostView(ids_obj, DType::kI64, false, t->name, keep));
  if (ids.rank() != 1 || !ids.is_contiguous()) {
    Raise(absl::InvalidArgumentError(absl::StrCat(
        "key-value table ", t->name, ": ids must be 1-D and contiguous")));
  }
  std::vector<TensorView> cols;
  for (size_t c = 0; c < columns.size(); ++c) {
    const DType dtype = c < t->spec.columns.size() ? t->spec.columns[c].dtype
                                                   : DType::kU8;
    cols.push_back(Unwrap(HostView(columns[c], dtype, false, t->name, keep)));
  }
  std::span<const int64_t> id_span(static_cast<const int64_t*>(ids.data()),
                                   static_cast<size_t>(ids.shape()[0]));
  Check(Released(t, [&] { return t->sink().Apply(id_span, cols); }));
}

}  // namespace

// ---- entries -------------------------------------------------------------

void KvTablesToSave(py::handle entries, KvCalls& out) {
  if (entries.is_none()) return;
  for (py::handle item : entries) {
    py::tuple e = py::cast<py::tuple>(item);
    KvTableToSave t;
    t.fqn = py::cast<std::string>(e[0]);
    t.spec = SpecOf(e[1]);
    t.buckets = RangeOf(e[2]);
    py::handle source = e[3];
    if (py::isinstance<KvTableSource>(source)) {
      auto& s = py::cast<KvTableSource&>(source);
      t.source = s.impl.get();
      out.keep.objects.push_back(py::reinterpret_borrow<py::object>(source));
    } else if (!source.is_none()) {
      out.sources.push_back(std::make_unique<PyKvSource>(
          py::reinterpret_borrow<py::object>(source), t.fqn, t.spec));
      t.source = out.sources.back().get();
    }
    out.save.push_back(std::move(t));
  }
}

void KvTablesToLoad(py::handle entries, KvCalls& out) {
  if (entries.is_none()) return;
  for (py::handle item : entries) {
    py::tuple e = py::cast<py::tuple>(item);
    KvTableToLoad t;
    t.fqn = py::cast<std::string>(e[0]);
    py::handle sink = e[1];
    if (py::isinstance<KvTable>(sink)) {
      auto table = py::cast<std::shared_ptr<KvTable>>(sink);
      out.leases.push_back(Lease(table));
      t.sink = &table->sink();
    } else {
      out.sinks.push_back(
          std::make_unique<PyKvSink>(py::reinterpret_borrow<py::object>(sink)));
      t.sink = out.sinks.back().get();
    }
    t.num_buckets = py::cast<int64_t>(e[2]);
    t.bucketing = BucketingOf(py::cast<std::string>(e[3]));
    t.bucket_size = py::cast<int64_t>(e[4]);
    t.buckets = RangeOf(e[5]);
    t.columns = py::cast<std::vector<std::string>>(e[6]);
    out.load.push_back(std::move(t));
  }
}

py::dict KvTablesToDict(const std::map<std::string, KvTableMetadata>& tables) {
  py::dict out;
  for (const auto& [fqn, t] : tables) {
    py::dict d;
    d["spec"] = SpecToDict(t.spec);
    d["buckets"] = RangeTuple(t.buckets);
    d["rows"] = t.rows();
    d["rows_per_bucket"] = t.rows_per_bucket;
    d["chunks"] = t.chunks.size();
    d["bytes"] = t.nbytes();
    out[py::str(fqn)] = d;
  }
  return out;
}

void BindKv(py::module_& m) {
  m.def("kv_check_spec", [](py::handle spec, const std::string& table) {
    Check(ValidateKvTableSpec(table, SpecOf(spec)));
  });
  m.def("kv_row_bytes",
        [](py::handle spec) { return SpecOf(spec).row_bytes(); });
  m.def("kv_buckets_of_rank", [](int64_t num_buckets, int world, int rank) {
    if (num_buckets < 0 || world < 1 || rank < 0 || rank >= world) {
      Raise(absl::InvalidArgumentError(absl::StrCat(
          "kv_buckets_of_rank: needs num_buckets >= 0, world >= 1 and "
          "0 <= rank < world; got ", num_buckets, ", ", world, ", ", rank)));
    }
    return RangeTuple(KvBucketsOfRank(num_buckets, world, rank));
  });
  m.def("kv_bucket_of", [](py::handle spec, int64_t id) {
    return Unwrap(KvBucketOf(SpecOf(spec), id));
  });
  m.def("kv_buckets_of_ids",
        [](py::handle spec_obj,
           py::array_t<int64_t, py::array::c_style | py::array::forcecast> ids) {
          const KvTableSpec spec = SpecOf(spec_obj);
          py::array_t<int64_t> out(ids.size());
          const int64_t* in = ids.data();
          int64_t* dst = out.mutable_data();
          absl::Status st;
          {
            py::gil_scoped_release release;
            for (py::ssize_t i = 0; i < ids.size() && st.ok(); ++i) {
              absl::StatusOr<int64_t> b = KvBucketOf(spec, in[i]);
              if (b.ok()) dst[i] = *b;
              else st = b.status();
            }
          }
          Check(st);
          return out;
        });

  py::class_<KvTable, std::shared_ptr<KvTable>>(m, "KvTable")
      .def_static(
          "in_memory",
          [](std::string name, py::handle spec, std::pair<int64_t, int64_t> owned) {
            auto t = std::make_shared<KvTable>();
            t->spec = SpecOf(spec);
            t->owned = {owned.first, owned.second};
            t->memory = Unwrap(InMemoryKvTable::Create(name, t->spec, t->owned));
            t->name = std::move(name);
            return t;
          },
          py::arg("name"), py::arg("spec"), py::arg("owned"))
      .def_static(
          "rocksdb",
          [](std::string path, std::string name, py::handle spec,
             std::pair<int64_t, int64_t> owned, bool create_if_missing,
             bool sync_writes, bool disable_wal) {
            auto t = std::make_shared<KvTable>();
            t->spec = SpecOf(spec);
            t->owned = {owned.first, owned.second};
            RocksDbKvOptions o;
            o.create_if_missing = create_if_missing;
            o.sync_writes = sync_writes;
            o.disable_wal = disable_wal;
            absl::StatusOr<std::unique_ptr<RocksDbKvTable>> db;
            {
              py::gil_scoped_release release;
              db = RocksDbKvTable::Open(path, name, t->spec, t->owned, o);
            }
            t->rocks = Unwrap(std::move(db));
            t->name = std::move(name);
            t->path = std::move(path);
            return t;
          },
          py::arg("path"), py::arg("name"), py::arg("spec"), py::arg("owned"),
          py::arg("create_if_missing"), py::arg("sync_writes"),
          py::arg("disable_wal"))
      .def_property_readonly("closed",
                             [](const KvTable& t) { return !t.open(); })
      .def("size",
           [](const std::shared_ptr<KvTable>& t) -> uint64_t {
             t->CheckOpen();
             if (t->memory) return t->memory->size();
             return Unwrap(Released(t, [&] { return t->rocks->size(); }));
           })
      .def("rows_per_bucket",
           [](const std::shared_ptr<KvTable>& t) {
             t->CheckOpen();
             if (t->memory) return t->memory->RowsPerBucket();
             return Unwrap(
                 Released(t, [&] { return t->rocks->RowsPerBucket(); }));
           })
      .def("find", &Find, py::arg("id"))
      .def("ids", &Ids)
      .def("apply", &Apply, py::arg("ids"), py::arg("columns"))
      .def("flush",
           [](const std::shared_ptr<KvTable>& t) {
             t->CheckOpen();
             if (t->rocks) Check(Released(t, [&] { return t->rocks->Flush(); }));
           })
      .def("source",
           [](const std::shared_ptr<KvTable>& t, int64_t batch_rows) {
             auto s = std::make_unique<KvTableSource>();
             s->lease = Lease(t);
             s->impl = t->memory ? t->memory->Source(batch_rows)
                                 : t->rocks->Source(batch_rows);
             return s;
           },
           py::arg("batch_rows"))
      .def("close", [](KvTable& t) {
        if (t.users > 0) {
          Raise(absl::FailedPreconditionError(absl::StrCat(
              "key-value table ", t.name, " is in use (", t.users.load(),
              " sources or calls); drop its sources first")));
        }
        py::gil_scoped_release release;
        t.memory.reset();
        t.rocks.reset();
      });

  py::class_<KvTableSource>(m, "KvTableSource")
      .def("begin",
           [](KvTableSource& s) {
             absl::Status st;
             {
               py::gil_scoped_release release;
               st = s.impl->Begin();
             }
             Check(st);
           })
      .def("next", &NextBatch)
      .def("end", [](KvTableSource& s) {
        absl::Status st;
        {
          py::gil_scoped_release release;
          st = s.impl->End();
        }
        Check(st);
      });
}

}  // namespace cairn::python
