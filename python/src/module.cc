// _cairn: the extension module under the Python package `cairn`. It binds
// the C++ API one to one; python/cairn turns PyTorch and NumPy state dicts
// into what it takes (convert.h) and gives it Python's idiom. Every call
// that does I/O, planning or waits for other ranks releases the GIL.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cairn/cairn.h"
#include "cairn/version.h"
#include "convert.h"
#include "core/flatten.h"
#include "format/chunk_digest.h"
#include "format/frame_codec.h"
#include "kv.h"
#include "huggingface.h"
#include "s3.h"
#include "prepare.h"
#include "py_communicator.h"

namespace cairn::python {
namespace {

// A communicator handle shared by Python objects (a saver or manager keeps
// the one it was made with alive).
struct Comm {
  std::shared_ptr<Communicator> impl;
};

Communicator* CommOf(const std::optional<Comm>& comm) {
  return comm ? comm->impl.get() : nullptr;
}

// The StateDict of `prepared`: a PreparedState (taken: it serves one call)
// or a nest of Sharded and values (the DCP plugin's). The objects the views
// point into stay in `keep`.
StateDict StateOf(py::handle prepared, bool writable, KeepAlive& keep) {
  if (py::isinstance<PreparedState>(prepared)) {
    auto& p = py::cast<PreparedState&>(prepared);
    if (p.taken) {
      throw py::value_error("this prepared state dict was used already");
    }
    if (p.writable != writable) {
      throw py::value_error(writable
                                ? "a state dict prepared for a save cannot be loaded into"
                                : "a state dict prepared for a load cannot be saved");
    }
    p.taken = true;
    keep.objects = std::move(p.keep.objects);
    return std::move(p.state);
  }
  return Unwrap(ToStateDict(prepared, writable, keep));
}

// The stored values of the scalar and object leaves of a loaded state
// dict, by FQN.
py::dict LoadedValues(StateDict& state) {
  py::dict values;
  auto flat = internal_core::FlattenMutable(state);
  if (!flat.ok()) Raise(flat.status());
  for (const auto& leaf : flat->leaves) {
    if (leaf.node->tensor() != nullptr) continue;
    values[py::str(leaf.fqn)] = LeafValue(*leaf.node);
  }
  return values;
}

py::dict MetadataToDict(const Metadata& m) {
  auto location = [](const ByteLocation& l) {
    py::dict d;
    d["file"] = l.file;
    d["offset"] = l.offset;
    d["nbytes"] = l.nbytes;
    d["crc32c"] = l.crc32c;
    d["block_crc32c"] = l.block_crc32c;
    if (l.compressed()) {
      // Format version 5: the stored frames (docs/format.md 4.2.1).
      d["codec"] = std::string(internal_format::CodecName(l.compression.codec));
      d["stored_nbytes"] = l.compression.stored_nbytes;
      d["frame_nbytes"] = l.compression.frame_nbytes;
      d["frame_crc32c"] = l.compression.frame_crc32c;
    }
    if (l.xxh3) {
      // Format version 6: the chunk's digest (docs/format.md 4.2.2).
      d["xxh3"] = internal_format::DigestToHex(*l.xxh3);
    }
    return d;
  };
  py::dict tensors;
  for (const auto& [fqn, t] : m.tensors) {
    py::list chunks;
    for (const ChunkMetadata& c : t.chunks) {
      py::dict d = location(c.location);
      d["offsets"] = c.box.offsets;
      d["sizes"] = c.box.sizes;
      chunks.append(d);
    }
    py::dict td;
    td["dtype"] = std::string(DTypeName(t.dtype));
    td["shape"] = t.shape;
    td["chunks"] = chunks;
    tensors[py::str(fqn)] = td;
  }
  py::dict objects;
  for (const auto& [fqn, l] : m.objects) objects[py::str(fqn)] = location(l);
  py::dict scalars;
  for (const auto& [fqn, s] : m.scalars) {
    scalars[py::str(fqn)] = LeafValue(StateDict(s));
  }
  py::dict d;
  d["version"] = m.version;
  d["created_by"] = m.created_by;
  d["world_size"] = m.world_size;
  d["rank"] = m.rank;
  d["save_id"] = m.save_id;
  py::list references;
  for (const CheckpointReference& r : m.references) {
    py::dict rd;
    rd["url"] = r.url;
    rd["checksum"] = r.checksum;
    rd["save_id"] = r.save_id;
    references.append(rd);
  }
  d["references"] = references;
  d["crc32c_block_bytes"] = m.crc32c_block_bytes;
  d["tensors"] = tensors;
  d["objects"] = objects;
  d["scalars"] = scalars;
  d["kv_tables"] = KvTablesToDict(m.kv_tables);
  d["structure"] = m.structure;
  d["user"] = m.user;
  d["total_bytes"] = m.total_bytes();
  d["has_checksums"] = m.has_checksums;
  return d;
}

// The keyword options of save, AsyncSaver.save and the manager, over
// SaveOptions' own defaults (comm, planner and plan_cache are set apart).
SaveOptions SaveOptionsFrom(const py::kwargs& kw) {
  SaveOptions o;
  for (auto [k, v] : kw) {
    const std::string key = py::cast<std::string>(k);
    if (key == "overwrite") o.overwrite = OptionAs<bool>(key, v);
    else if (key == "save_id") o.save_id = v.is_none() ? "" : OptionAs<std::string>(key, v);
    else if (key == "io_threads") o.io_threads = OptionAs<int>(key, v);
    else if (key == "direct_io") o.direct_io = OptionAs<bool>(key, v);
    else if (key == "s3") o.s3 = S3OptionsFrom(v);
    else if (key == "write_buffer_bytes") o.write_buffer_bytes = OptionAs<size_t>(key, v);
    else if (key == "crc32c_block_bytes") o.crc32c_block_bytes = OptionAs<uint64_t>(key, v);
    else if (key == "codec") {
      absl::StatusOr<Codec> codec = internal_format::CodecFromName(
          v.is_none() ? "none" : OptionAs<std::string>(key, v));
      if (!codec.ok()) Raise(codec.status());
      o.codec = *codec;
    } else if (key == "codec_level") o.codec_level = OptionAs<int>(key, v);
    else if (key == "user_metadata") o.user_metadata = OptionAs<std::string>(key, v);
    else if (key == "base") o.base = v.is_none() ? "" : OptionAs<std::string>(key, v);
    else if (key == "rank_local") o.rank_local = OptionAs<bool>(key, v);
    else if (key == "kv_chunk_bytes") o.kv_chunk_bytes = OptionAs<uint64_t>(key, v);
    else if (key == "dedup") {
      const std::string dedup = OptionAs<std::string>(key, v);
      if (dedup == "balance_bytes") {
        o.dedup = DedupPolicy::kBalanceBytes;
      } else if (dedup == "lowest_rank") {
        o.dedup = DedupPolicy::kLowestRank;
      } else {
        Raise(absl::InvalidArgumentError(absl::StrCat(
            "dedup must be 'balance_bytes' or 'lowest_rank', not '", dedup,
            "'")));
      }
    } else {
      throw py::type_error(absl::StrCat("unexpected save option '", key, "'"));
    }
  }
  return o;
}

// The keyword options of load and the manager's restore, over LoadOptions'
// own defaults (comm and planner are set apart).
LoadOptions LoadOptionsFrom(const py::kwargs& kw) {
  LoadOptions o;
  for (auto [k, v] : kw) {
    const std::string key = py::cast<std::string>(k);
    if (key == "strict") o.strict = OptionAs<bool>(key, v);
    else if (key == "io_threads") o.io_threads = OptionAs<int>(key, v);
    else if (key == "verify_checksums") o.verify_checksums = OptionAs<bool>(key, v);
    else if (key == "coalesce_gap_bytes") o.coalesce_gap_bytes = OptionAs<uint64_t>(key, v);
    else if (key == "bounce_buffer_bytes") o.bounce_buffer_bytes = OptionAs<uint64_t>(key, v);
    else if (key == "broadcast_replicas") o.broadcast_replicas = OptionAs<bool>(key, v);
    else if (key == "share_node_reads") o.share_node_reads = OptionAs<bool>(key, v);
    else if (key == "broadcast_batch_bytes") o.broadcast_batch_bytes = OptionAs<uint64_t>(key, v);
    else if (key == "device_batch_bytes") o.device_batch_bytes = OptionAs<uint64_t>(key, v);
    else if (key == "memory_budget_bytes") o.memory_budget_bytes = OptionAs<uint64_t>(key, v);
    else if (key == "rank_local") o.rank_local = OptionAs<bool>(key, v);
    else if (key == "s3") o.s3 = S3OptionsFrom(v);
    else if (ImportNameOption(key, v, o.import_names)) continue;
    else throw py::type_error(absl::StrCat("unexpected load option '", key, "'"));
  }
  return o;
}

py::tuple RunLoad(const std::function<absl::StatusOr<LoadResult>(StateDict&)>& fn,
                  py::handle prepared) {
  KeepAlive keep;
  StateDict state = StateOf(prepared, /*writable=*/true, keep);
  absl::StatusOr<LoadResult> result;
  {
    py::gil_scoped_release release;
    result = fn(state);
  }
  LoadResult r = Unwrap(std::move(result));
  return py::make_tuple(std::move(r), LoadedValues(state));
}

// Owns an AsyncSaver; destroys it without the GIL (its destructor waits
// for background saves, whose collectives may need the GIL).
struct Saver {
  std::unique_ptr<AsyncSaver> impl;
  ~Saver() {
    if (impl) {
      py::gil_scoped_release release;
      impl.reset();
    }
  }
};

struct Manager {
  std::shared_ptr<Communicator> comm;  // outlives impl
  std::unique_ptr<CheckpointManager> impl;
  ~Manager() {
    if (impl) {
      py::gil_scoped_release release;
      impl.reset();
    }
  }
};

}  // namespace

PYBIND11_MODULE(_cairn, m) {
  m.doc() = "cairn's C++ library; use the `cairn` package, not this module.";
  m.attr("__version__") = CAIRN_VERSION_STRING;
  m.attr("FORMAT_VERSION") = kFormatVersion;
  m.attr("_error_types") = py::dict();

  py::class_<Sharded>(m, "Sharded")
      .def(py::init([](std::string dtype, std::vector<int64_t> shape,
                       py::list shards) {
             return Sharded{std::move(dtype), std::move(shape),
                            std::move(shards)};
           }),
           py::arg("dtype"), py::arg("shape"), py::arg("shards"))
      .def_readonly("dtype", &Sharded::dtype)
      .def_readonly("shape", &Sharded::shape)
      .def_readonly("shards", &Sharded::shards);

  py::class_<PreparedState>(m, "Prepared")
      .def(py::init([](py::handle state_dict, bool for_load, py::handle hooks) {
             return Unwrap(Prepare(state_dict, for_load, hooks));
           }),
           py::arg("state_dict"), py::arg("for_load"), py::arg("hooks"))
      .def_readonly("slots", &PreparedState::slots);

  py::class_<Exported>(m, "Exported")
      .def_readonly("dtype", &Exported::dtype)
      .def_property_readonly("shape",
                             [](const Exported& e) { return e.view.shape(); })
      .def("__dlpack__",
           [](const Exported& e, py::kwargs) { return ExportCapsule(e); })
      .def("__dlpack_device__",
           [](const Exported&) { return py::make_tuple(1, 0); });

  m.def("dtype_size", [](const std::string& name) {
    return DTypeSize(Unwrap(DTypeFromName(name)));
  });
  m.def("dtype_names", [] {
    std::vector<std::string> names;
    for (DType d : AllDTypes()) names.emplace_back(DTypeName(d));
    return names;
  });

  py::class_<Comm>(m, "Communicator")
      .def_property_readonly("rank", [](const Comm& c) { return c.impl->rank(); })
      .def_property_readonly("size", [](const Comm& c) { return c.impl->size(); })
      .def_property_readonly("kind", [](const Comm& c) {
        return std::string(c.impl->kind());
      })
      .def("barrier", [](Comm& c) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          s = c.impl->Barrier();
        }
        Check(s);
      })
      .def("__repr__", [](const Comm& c) {
        return absl::StrCat("<cairn.Communicator ", std::string(c.impl->kind()), " rank ",
                            c.impl->rank(), " of ", c.impl->size(), ">");
      });
  m.def("local_communicator",
        [] { return Comm{std::shared_ptr<Communicator>(LocalCommunicator())}; });
  m.def("has_mpi", &HasMpi);
  m.def(
      "mpi_world_communicator",
      [](double timeout_s) {
        CommunicatorOptions o;
        if (timeout_s > 0) o.collective_timeout = absl::Seconds(timeout_s);
        std::unique_ptr<Communicator> c;
        {
          py::gil_scoped_release release;
          c = Unwrap(MpiWorldCommunicator(o));
        }
        return Comm{std::move(c)};
      },
      py::arg("timeout_s") = 0.0);
  m.def(
      "in_process_communicators",
      [](int n, double timeout_s) {
        CommunicatorOptions o;
        if (timeout_s > 0) o.collective_timeout = absl::Seconds(timeout_s);
        std::vector<std::unique_ptr<Communicator>> made =
            InProcessCommunicators(n, o);
        if (made.empty()) {
          Raise(absl::InvalidArgumentError(absl::StrCat(
              "in_process_communicators: n must be at least 1, not ", n)));
        }
        std::vector<Comm> out;
        for (auto& c : made) out.push_back(Comm{std::move(c)});
        return out;
      },
      py::arg("n"), py::arg("timeout_s") = 0.0);
  m.def("python_communicator", [](py::object impl) {
    return Comm{Unwrap(MakePyCommunicator(std::move(impl)))};
  });

  BindKv(m);

  py::class_<SavePlanCache>(m, "SavePlanCache")
      .def(py::init<>())
      .def("clear", &SavePlanCache::Clear);

  py::class_<SavePhaseTimes>(m, "SavePhaseTimes")
      .def_readonly("planning", &SavePhaseTimes::planning)
      .def_readonly("prepare", &SavePhaseTimes::prepare)
      .def_readonly("digest", &SavePhaseTimes::digest)
      .def_readonly("write", &SavePhaseTimes::write)
      .def_readonly("commit", &SavePhaseTimes::commit)
      .def("__repr__", [](const SavePhaseTimes& p) {
        return absl::StrCat("SavePhaseTimes(planning=", p.planning,
                            ", prepare=", p.prepare, ", digest=", p.digest,
                            ", write=", p.write,
                            ", commit=", p.commit, ")");
      });

  py::class_<SaveResult>(m, "SaveResult")
      .def_readonly("bytes_written", &SaveResult::bytes_written)
      .def_readonly("data_bytes", &SaveResult::data_bytes)
      .def_readonly("kv_rows", &SaveResult::kv_rows)
      .def_readonly("files", &SaveResult::files)
      .def_readonly("chunks_reused", &SaveResult::chunks_reused)
      .def_readonly("bytes_reused", &SaveResult::bytes_reused)
      .def_readonly("checkpoint_bytes", &SaveResult::checkpoint_bytes)
      .def_readonly("world_size", &SaveResult::world_size)
      .def_readonly("plan_cache_hit", &SaveResult::plan_cache_hit)
      .def_readonly("phases", &SaveResult::phases)
      .def_readonly("seconds", &SaveResult::seconds)
      .def("__repr__", [](const SaveResult& r) {
        return absl::StrCat("SaveResult(data_bytes=", r.data_bytes,
                            ", bytes_written=", r.bytes_written,
                            ", files=", r.files, ", kv_rows=", r.kv_rows,
                            ", bytes_reused=", r.bytes_reused,
                            ", checkpoint_bytes=",
                            r.checkpoint_bytes, ", world_size=", r.world_size,
                            ", seconds=", r.seconds, ")");
      });

  py::class_<LoadPhaseTimes>(m, "LoadPhaseTimes")
      .def_readonly("metadata", &LoadPhaseTimes::metadata)
      .def_readonly("planning", &LoadPhaseTimes::planning)
      .def_readonly("read", &LoadPhaseTimes::read)
      .def_readonly("broadcast", &LoadPhaseTimes::broadcast)
      .def_readonly("copy", &LoadPhaseTimes::copy)
      .def_readonly("staging", &LoadPhaseTimes::staging)
      .def("__repr__", [](const LoadPhaseTimes& p) {
        return absl::StrCat("LoadPhaseTimes(metadata=", p.metadata,
                            ", planning=", p.planning, ", read=", p.read,
                            ", broadcast=", p.broadcast, ", copy=", p.copy,
                            ", staging=", p.staging, ")");
      });

  py::class_<LoadResult>(m, "LoadResult")
      .def_readonly("missing", &LoadResult::missing)
      .def_readonly("unexpected", &LoadResult::unexpected)
      .def_readonly("bytes_loaded", &LoadResult::bytes_loaded)
      .def_readonly("bytes_read", &LoadResult::bytes_read)
      .def_readonly("chunks_verified", &LoadResult::chunks_verified)
      .def_readonly("bytes_verified", &LoadResult::bytes_verified)
      .def_readonly("bytes_unverified", &LoadResult::bytes_unverified)
      .def_readonly("source_has_checksums", &LoadResult::source_has_checksums)
      .def_readonly("device_bytes", &LoadResult::device_bytes)
      .def_readonly("kv_rows", &LoadResult::kv_rows)
      .def_readonly("world_size", &LoadResult::world_size)
      .def_readonly("replica_group_size", &LoadResult::replica_group_size)
      .def_readonly("io_threads", &LoadResult::io_threads)
      .def_readonly("phases", &LoadResult::phases)
      .def_readonly("seconds", &LoadResult::seconds)
      .def("__repr__", [](const LoadResult& r) {
        return absl::StrCat("LoadResult(bytes_loaded=", r.bytes_loaded,
                            ", bytes_read=", r.bytes_read, ", missing=",
                            r.missing.size(), ", unexpected=",
                            r.unexpected.size(), ", kv_rows=", r.kv_rows,
                            ", seconds=", r.seconds, ")");
      });

  m.def(
      "save",
      [](py::handle prepared, const std::string& url, std::optional<Comm> comm,
         SavePlanCache* plan_cache, py::handle kv_tables, py::kwargs kw) {
        SaveOptions options = SaveOptionsFrom(kw);
        options.comm = CommOf(comm);
        options.plan_cache = plan_cache;
        // Python sources run from this thread, taking the GIL (kv.h).
        KvCalls kv;
        KvTablesToSave(kv_tables, kv);
        options.kv_tables = kv.save;
        KeepAlive keep;
        StateDict state = StateOf(prepared, /*writable=*/false, keep);
        absl::StatusOr<SaveResult> result;
        {
          py::gil_scoped_release release;
          result = Save(state, url, options);
        }
        return Unwrap(std::move(result));
      },
      py::arg("prepared"), py::arg("url"), py::arg("comm") = py::none(),
      py::arg("plan_cache") = nullptr, py::arg("kv_tables") = py::none());

  m.def(
      "load",
      [](py::handle prepared, const std::string& url, std::optional<Comm> comm,
         py::handle kv_tables, py::kwargs kw) {
        LoadOptions options = LoadOptionsFrom(kw);
        options.comm = CommOf(comm);
        KvCalls kv;  // Python sinks run from this thread (kv.h)
        KvTablesToLoad(kv_tables, kv);
        options.kv_tables = kv.load;
        return RunLoad(
            [&](StateDict& state) { return Load(state, url, options); },
            prepared);
      },
      py::arg("prepared"), py::arg("url"), py::arg("comm") = py::none(),
      py::arg("kv_tables") = py::none());

  m.def(
      "save_hf",
      [](py::handle prepared, const std::string& dir, std::optional<Comm> comm,
         uint64_t max_shard_size, py::handle dtype, bool overwrite,
         py::handle progress) {
        HfExportOptions options =
            HfExportOptionsFrom(max_shard_size, dtype, overwrite, progress);
        options.comm = CommOf(comm);
        KeepAlive keep;
        StateDict state = StateOf(prepared, /*writable=*/false, keep);
        absl::StatusOr<HfExportResult> result;
        {
          py::gil_scoped_release release;
          result = SaveHuggingFace(state, dir, options);
        }
        return HfExportResultToDict(Unwrap(std::move(result)));
      },
      py::arg("prepared"), py::arg("dir"), py::arg("comm"),
      py::arg("max_shard_size"), py::arg("dtype"), py::arg("overwrite"),
      py::arg("progress"));
  RegisterHuggingFace(m);
  RegisterS3(m);

  m.def(
      "load_all",
      [](const std::string& url, py::kwargs kw) {
        LoadOptions options = LoadOptionsFrom(kw);
        absl::StatusOr<StateDict> state;
        {
          py::gil_scoped_release release;
          state = LoadAll(url, options);
        }
        return FromStateDict(Unwrap(std::move(state)));
      },
      py::arg("url"));

  m.def("read_metadata", [](const std::string& url) {
    absl::StatusOr<Metadata> md;
    {
      py::gil_scoped_release release;
      md = ReadMetadata(url);
    }
    return MetadataToDict(Unwrap(std::move(md)));
  });

  m.def(
      "rewrite",
      [](const std::string& src, const std::string& dst, py::kwargs kw) {
        SaveOptions o = SaveOptionsFrom(kw);
        absl::StatusOr<SaveResult> r;
        {
          py::gil_scoped_release release;
          r = RewriteCheckpoint(src, dst, o);
        }
        return Unwrap(std::move(r));
      },
      py::arg("src"), py::arg("dst"));

  m.def(
      "merge",
      [](const std::string& url, bool overwrite) {
        MergeOptions o;
        o.overwrite = overwrite;
        absl::StatusOr<MergeResult> r;
        {
          py::gil_scoped_release release;
          r = Merge(url, o);
        }
        MergeResult mr = Unwrap(std::move(r));
        py::dict d;
        d["ranks"] = mr.ranks;
        d["data_bytes"] = mr.data_bytes;
        d["duplicates"] = mr.duplicates;
        d["metadata"] = MetadataToDict(mr.metadata);
        return d;
      },
      py::arg("url"), py::arg("overwrite") = false);

  py::class_<VerifyProblem>(m, "VerifyProblem")
      .def_readonly("kind", &VerifyProblem::kind)
      .def_readonly("fqn", &VerifyProblem::fqn)
      .def_readonly("file", &VerifyProblem::file)
      .def_readonly("offset", &VerifyProblem::offset)
      .def_readonly("message", &VerifyProblem::message)
      .def("__repr__", [](const VerifyProblem& p) {
        return absl::StrCat("VerifyProblem(", p.kind, ": ", p.message, ")");
      });

  py::class_<VerifyReport>(m, "VerifyReport")
      .def_readonly("format_version", &VerifyReport::format_version)
      .def_readonly("metadata_checksum", &VerifyReport::metadata_checksum)
      .def_readonly("has_checksums", &VerifyReport::has_checksums)
      .def_readonly("tensors", &VerifyReport::tensors)
      .def_readonly("chunks", &VerifyReport::chunks)
      .def_readonly("objects", &VerifyReport::objects)
      .def_readonly("files", &VerifyReport::files)
      .def_readonly("references", &VerifyReport::references)
      .def_readonly("bytes_checked", &VerifyReport::bytes_checked)
      .def_readonly("problems", &VerifyReport::problems)
      .def_readonly("seconds", &VerifyReport::seconds)
      .def_property_readonly("ok", &VerifyReport::ok)
      .def("__bool__", &VerifyReport::ok)
      .def("__repr__", [](const VerifyReport& r) {
        return absl::StrCat("VerifyReport(ok=", r.ok() ? "True" : "False",
                            ", problems=", r.problems.size(), ", files=",
                            r.files, ", bytes_checked=", r.bytes_checked, ")");
      });

  m.def(
      "verify",
      [](const std::string& url, int io_threads, uint64_t buffer_bytes,
         py::object progress) {
        VerifyOptions o;
        o.io_threads = io_threads;
        o.buffer_bytes = buffer_bytes;
        // Called from the reading threads, one at a time; a Python error
        // in it is reported once verification is over.
        std::string progress_error;
        if (!progress.is_none()) {
          o.progress = [&](uint64_t done, uint64_t total) {
            py::gil_scoped_acquire gil;
            if (!progress_error.empty()) return;
            try {
              progress(done, total);
            } catch (py::error_already_set& e) {
              progress_error = e.what();
            }
          };
        }
        absl::StatusOr<VerifyReport> r;
        {
          py::gil_scoped_release release;
          r = Verify(url, o);
        }
        if (!progress_error.empty()) {
          throw std::runtime_error(
              absl::StrCat("the progress callback failed: ", progress_error));
        }
        return Unwrap(std::move(r));
      },
      py::arg("url"), py::arg("io_threads") = 8,
      py::arg("buffer_bytes") = uint64_t{8} << 20,
      py::arg("progress") = py::none());

  py::class_<AsyncSaveHandle, std::shared_ptr<AsyncSaveHandle>>(m, "SaveHandle")
      .def("done", &AsyncSaveHandle::done)
      .def("wait", [](AsyncSaveHandle& h) {
        absl::StatusOr<SaveResult> r;
        {
          py::gil_scoped_release release;
          r = h.Wait();
        }
        return Unwrap(std::move(r));
      })
      .def_property_readonly("blocked_seconds",
                             &AsyncSaveHandle::blocked_seconds);

  py::class_<Saver>(m, "AsyncSaver")
      .def(py::init([](std::optional<Comm> comm, int max_in_flight,
                       std::optional<uint64_t> max_cached_bytes) {
             AsyncSaveOptions o;
             o.max_in_flight = max_in_flight;
             if (max_cached_bytes) o.stager.max_cached_bytes = *max_cached_bytes;
             absl::StatusOr<std::unique_ptr<AsyncSaver>> s;
             {
               py::gil_scoped_release release;
               s = AsyncSaver::Create(CommOf(comm), o);
             }
             auto saver = std::make_unique<Saver>();
             saver->impl = Unwrap(std::move(s));
             return saver;
           }),
           py::arg("comm") = py::none(), py::arg("max_in_flight") = 1,
           py::arg("max_cached_bytes") = py::none())
      .def(
          "save",
          [](Saver& s, py::handle prepared, const std::string& url,
             py::kwargs kw) {
            SaveOptions options = SaveOptionsFrom(kw);
            KeepAlive keep;
            StateDict state = StateOf(prepared, /*writable=*/false, keep);
            absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> h;
            {
              py::gil_scoped_release release;
              h = s.impl->Save(state, url, options);
            }
            return Unwrap(std::move(h));
          },
          py::arg("prepared"), py::arg("url"))
      .def("wait_all",
           [](Saver& s) {
             absl::Status st;
             {
               py::gil_scoped_release release;
               st = s.impl->WaitAll();
             }
             Check(st);
           })
      .def_property_readonly("in_flight",
                             [](const Saver& s) { return s.impl->in_flight(); })
      .def_property_readonly(
          "staging_bytes", [](const Saver& s) { return s.impl->staging_bytes(); })
      .def_property_readonly("staging_allocations", [](const Saver& s) {
        return s.impl->staging_allocations();
      });

  py::class_<Manager>(m, "CheckpointManager")
      .def(py::init([](const std::string& root, std::optional<Comm> comm,
                       int keep_last, int keep_every, bool async_save,
                       int max_in_flight, py::dict save_kw, py::dict load_kw,
                       bool incremental, int full_every) {
             ManagerOptions o;
             o.keep_last = keep_last;
             o.keep_every = keep_every;
             o.incremental = incremental;
             o.full_every = full_every;
             o.async = async_save;
             o.async_options.max_in_flight = max_in_flight;
             o.save_options =
                 SaveOptionsFrom(py::kwargs(std::move(save_kw)));
             o.load_options =
                 LoadOptionsFrom(py::kwargs(std::move(load_kw)));
             auto mgr = std::make_unique<Manager>();
             if (comm) mgr->comm = comm->impl;
             absl::StatusOr<std::unique_ptr<CheckpointManager>> created;
             {
               py::gil_scoped_release release;
               created = CheckpointManager::Create(root, mgr->comm.get(), o);
             }
             mgr->impl = Unwrap(std::move(created));
             return mgr;
           }),
           py::arg("root"), py::arg("comm"), py::arg("keep_last"),
           py::arg("keep_every"), py::arg("async_save"),
           py::arg("max_in_flight"), py::arg("save_options"),
           py::arg("load_options"), py::arg("incremental") = false,
           py::arg("full_every") = 8)
      .def(
          "save",
          [](Manager& mgr, int64_t step, py::handle prepared) {
            KeepAlive keep;
            StateDict state = StateOf(prepared, /*writable=*/false, keep);
            absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> h;
            {
              py::gil_scoped_release release;
              h = mgr.impl->Save(step, state);
            }
            return Unwrap(std::move(h));
          },
          py::arg("step"), py::arg("prepared"))
      .def(
          "restore",
          [](Manager& mgr, py::handle prepared, std::optional<int64_t> step) {
            return RunLoad(
                [&](StateDict& state) { return mgr.impl->Restore(state, step); },
                prepared);
          },
          py::arg("prepared"), py::arg("step") = py::none())
      .def("steps",
           [](const Manager& mgr) {
             absl::StatusOr<std::vector<int64_t>> r;
             {
               py::gil_scoped_release release;
               r = mgr.impl->Steps();
             }
             return Unwrap(std::move(r));
           })
      .def("latest_step",
           [](const Manager& mgr) {
             absl::StatusOr<std::optional<int64_t>> r;
             {
               py::gil_scoped_release release;
               r = mgr.impl->LatestStep();
             }
             return Unwrap(std::move(r));
           })
      .def("wait",
           [](Manager& mgr) {
             absl::Status st;
             {
               py::gil_scoped_release release;
               st = mgr.impl->Wait();
             }
             Check(st);
           })
      .def("step_dir", [](const Manager& mgr, int64_t step) {
        return mgr.impl->StepDir(step);
      });
}

}  // namespace cairn::python
