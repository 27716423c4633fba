// cairn inspect CKPT [--json] [--chunks]: what a checkpoint holds, from its
// metadata.json alone (no data file is read).
#include <algorithm>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "format/frame_codec.h"
#include "format/names.h"
#include "commands.h"

namespace cairn::tools {
namespace {

struct InspectOptions {
  std::string url;
  bool json = false;
  bool chunks = false;
};

nlohmann::json ScalarJson(const Scalar& s) {
  return std::visit([](const auto& v) { return nlohmann::json(v); }, s);
}

std::string ScalarText(const Scalar& s) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return nlohmann::json(v).dump();  // quoted, escaped
        } else if constexpr (std::is_same_v<T, bool>) {
          return v ? "true" : "false";
        } else if constexpr (std::is_same_v<T, double>) {
          return absl::StrFormat("%.17g", v);
        } else {
          return absl::StrCat(v);
        }
      },
      s);
}

const char* ScalarType(const Scalar& s) {
  static const char* const kNames[] = {"int64", "double", "bool", "string"};
  return kNames[s.index()];
}

// "interleaved", or "chunked by 1000" (ids per bucket).
std::string KvBucketingText(const KvTableSpec& spec) {
  return spec.bucketing == KvBucketing::kInterleaved
             ? std::string("interleaved")
             : absl::StrFormat("chunked by %d", spec.bucket_size);
}

std::string ShapeText(const Shape& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int RunInspect(const InspectOptions& o) {
  absl::StatusOr<Metadata> md = ReadMetadata(NormalizeUrl(o.url));
  if (!md.ok()) {
    PrintError("inspect", md.status());
    return 1;
  }
  std::set<std::string> files;
  uint64_t tensor_bytes = 0, object_bytes = 0, num_chunks = 0;
  // Compressed chunks (format version 5): how many, and the bytes the
  // tensors take in their files.
  uint64_t compressed = 0, tensor_stored = 0;
  // Chunks kept in referenced checkpoints (format version 6), and bytes.
  uint64_t referenced = 0, referenced_bytes = 0;
  for (const auto& [fqn, t] : md->tensors) {
    tensor_bytes += t.nbytes();
    num_chunks += t.chunks.size();
    for (const ChunkMetadata& c : t.chunks) {
      files.insert(c.location.file);
      compressed += c.location.compressed();
      tensor_stored += c.location.stored_nbytes();
      if (!internal_format::ValidateRelativeName(c.location.file).ok()) {
        ++referenced;
        referenced_bytes += c.location.nbytes;
      }
    }
  }
  for (const auto& [fqn, loc] : md->objects) {
    object_bytes += loc.nbytes;
    files.insert(loc.file);
  }
  uint64_t table_bytes = 0, table_rows = 0;
  for (const auto& [fqn, t] : md->kv_tables) {
    table_bytes += t.nbytes();
    table_rows += t.rows();
    for (const KvChunkMetadata& c : t.chunks) files.insert(c.ids.file);
  }

  if (o.json) {
    nlohmann::json j;
    j["url"] = o.url;
    j["version"] = md->version;
    j["created_by"] = md->created_by;
    j["has_checksums"] = md->has_checksums;
    j["world_size"] = md->world_size;
    nlohmann::json references = nlohmann::json::array();
    for (const CheckpointReference& r : md->references) {
      references.push_back(
          {{"url", r.url},
           {"save_id", r.save_id},
           {"checksum", absl::StrFormat("%08x", r.checksum)}});
    }
    j["references"] = std::move(references);
    nlohmann::json tensors = nlohmann::json::array();
    for (const auto& [fqn, t] : md->tensors) {
      nlohmann::json e = {{"fqn", fqn},
                          {"dtype", std::string(DTypeName(t.dtype))},
                          {"shape", t.shape},
                          {"chunks", t.chunks.size()},
                          {"bytes", t.nbytes()}};
      if (o.chunks) {
        nlohmann::json cs = nlohmann::json::array();
        for (const ChunkMetadata& c : t.chunks) {
          cs.push_back(
              {{"offsets", c.box.offsets},
               {"sizes", c.box.sizes},
               {"file", c.location.file},
               {"offset", c.location.offset},
               {"nbytes", c.location.nbytes},
               {"crc32c", md->has_checksums
                              ? nlohmann::json(absl::StrFormat(
                                    "%08x", c.location.crc32c))
                              : nlohmann::json()}});
          if (c.location.compressed()) {
            cs.back()["codec"] = std::string(
                internal_format::CodecName(c.location.compression.codec));
            cs.back()["stored_nbytes"] = c.location.compression.stored_nbytes;
          }
        }
        e["chunk_list"] = std::move(cs);
      }
      tensors.push_back(std::move(e));
    }
    j["tensors"] = std::move(tensors);
    nlohmann::json objects = nlohmann::json::array();
    for (const auto& [fqn, loc] : md->objects) {
      objects.push_back({{"fqn", fqn},
                         {"bytes", loc.nbytes},
                         {"file", loc.file},
                         {"offset", loc.offset},
                         {"crc32c", absl::StrFormat("%08x", loc.crc32c)}});
    }
    j["objects"] = std::move(objects);
    nlohmann::json scalars = nlohmann::json::object();
    for (const auto& [fqn, s] : md->scalars) scalars[fqn] = ScalarJson(s);
    j["scalars"] = std::move(scalars);
    nlohmann::json tables = nlohmann::json::array();
    for (const auto& [fqn, t] : md->kv_tables) {
      nlohmann::json columns = nlohmann::json::array();
      for (const KvColumn& c : t.spec.columns) {
        columns.push_back({{"name", c.name},
                           {"dtype", std::string(DTypeName(c.dtype))},
                           {"width", c.width}});
      }
      tables.push_back(
          {{"fqn", fqn},
           {"buckets", t.spec.num_buckets},
           {"bucketing", KvBucketingText(t.spec)},
           {"columns", std::move(columns)},
           {"rows", t.rows()},
           {"chunks", t.chunks.size()},
           {"bytes", t.nbytes()}});
    }
    j["kv_tables"] = std::move(tables);
    j["totals"] = {
        {"tensors", md->tensors.size()},        {"chunks", num_chunks},
        {"objects", md->objects.size()},        {"scalars", md->scalars.size()},
        {"tensor_bytes", tensor_bytes},         {"object_bytes", object_bytes},
        {"compressed_chunks", compressed},
        {"tensor_stored_bytes", tensor_stored},
        {"referenced_chunks", referenced},
        {"referenced_bytes", referenced_bytes},
        {"kv_tables", md->kv_tables.size()},   {"kv_rows", table_rows},
        {"kv_bytes", table_bytes},
        {"bytes", tensor_bytes + object_bytes + table_bytes},
        {"files", files.size()}};
    std::cout << j.dump() << std::endl;
    return 0;
  }

  if (md->has_checksums) {
    std::cout << absl::StrFormat(
        "checkpoint %s: format v%d, %s, world size %d\n", o.url, md->version,
        md->created_by.empty() ? "(unknown writer)" : md->created_by,
        md->world_size);
    if (!md->references.empty()) {
      std::vector<std::string> refs;
      for (const CheckpointReference& r : md->references) {
        refs.push_back(absl::StrFormat("%s (save %s)", r.url, r.save_id));
      }
      std::cout << absl::StrFormat(
          "incremental: %s of %s (%s) kept in %s: %s\n",
          Plural(referenced, "chunk"), Plural(num_chunks, "chunk"),
          HumanBytes(referenced_bytes),
          Plural(md->references.size(), "earlier checkpoint"),
          absl::StrJoin(refs, ", "));
    }
  } else {
    std::cout << absl::StrFormat(
        "Hugging Face model %s: safetensors files without checksums (cairn "
        "convert makes a checkpoint with them)\n",
        o.url);
  }
  if (!md->tensors.empty()) {
    size_t w_fqn = 6, w_shape = 5;
    for (const auto& [fqn, t] : md->tensors) {
      w_fqn = std::max(w_fqn, fqn.size());
      w_shape = std::max(w_shape, ShapeText(t.shape).size());
    }
    std::cout << absl::StrFormat(
        "\n%-*s  %-7s  %-*s  %6s  %12s\n", static_cast<int>(w_fqn), "TENSOR",
        "DTYPE", static_cast<int>(w_shape), "SHAPE", "CHUNKS", "BYTES");
    for (const auto& [fqn, t] : md->tensors) {
      std::cout << absl::StrFormat(
          "%-*s  %-7s  %-*s  %6d  %12s\n", static_cast<int>(w_fqn), fqn,
          DTypeName(t.dtype), static_cast<int>(w_shape), ShapeText(t.shape),
          t.chunks.size(), HumanBytes(t.nbytes()));
      if (o.chunks) {
        for (const ChunkMetadata& c : t.chunks) {
          std::cout << absl::StrFormat(
              "    %s  %s @ %d, %d bytes, crc32c %08x%s\n", c.box.ToString(),
              c.location.file, c.location.offset, c.location.nbytes,
              c.location.crc32c,
              c.location.compressed()
                  ? absl::StrFormat(
                        "; %s, %d stored in %d frames",
                        internal_format::CodecName(
                            c.location.compression.codec),
                        c.location.compression.stored_nbytes,
                        c.location.compression.frame_nbytes.size())
                  : std::string());
        }
      }
    }
  }
  if (!md->objects.empty()) {
    size_t w = 6;
    for (const auto& [fqn, loc] : md->objects) w = std::max(w, fqn.size());
    std::cout << absl::StrFormat("\n%-*s  %12s  %s\n", static_cast<int>(w),
                                 "OBJECT", "BYTES", "FILE");
    for (const auto& [fqn, loc] : md->objects) {
      std::cout << absl::StrFormat("%-*s  %12s  %s @ %d\n", static_cast<int>(w),
                                   fqn, HumanBytes(loc.nbytes), loc.file,
                                   loc.offset);
    }
  }
  if (!md->scalars.empty()) {
    size_t w = 6;
    for (const auto& [fqn, s] : md->scalars) w = std::max(w, fqn.size());
    std::cout << absl::StrFormat("\n%-*s  %-6s  %s\n", static_cast<int>(w),
                                 "SCALAR", "TYPE", "VALUE");
    for (const auto& [fqn, s] : md->scalars) {
      std::cout << absl::StrFormat("%-*s  %-6s  %s\n", static_cast<int>(w), fqn,
                                   ScalarType(s), ScalarText(s));
    }
  }
  if (!md->kv_tables.empty()) {
    size_t w = 14;
    for (const auto& [fqn, t] : md->kv_tables) w = std::max(w, fqn.size());
    std::cout << absl::StrFormat("\n%-*s  %-22s  %12s  %6s  %12s  %s\n",
                                 static_cast<int>(w), "KEY-VALUE TABLE",
                                 "BUCKETS", "ROWS", "CHUNKS", "BYTES",
                                 "COLUMNS");
    for (const auto& [fqn, t] : md->kv_tables) {
      std::vector<std::string> cols;
      for (const KvColumn& c : t.spec.columns) {
        cols.push_back(absl::StrFormat("%s %s[%d]", c.name, DTypeName(c.dtype),
                                       c.width));
      }
      std::cout << absl::StrFormat(
          "%-*s  %-22s  %12d  %6d  %12s  %s\n", static_cast<int>(w), fqn,
          absl::StrFormat("%d %s", t.spec.num_buckets, KvBucketingText(t.spec)),
          t.rows(), t.chunks.size(), HumanBytes(t.nbytes()),
          absl::StrJoin(cols, ", "));
      if (o.chunks) {
        for (const KvChunkMetadata& c : t.chunks) {
          std::cout << absl::StrFormat(
              "    rows [%d, %d)  %s @ %d, ids crc32c %08x\n", c.rows.begin,
              c.rows.end, c.ids.file, c.ids.offset, c.ids.crc32c);
        }
      }
    }
  }
  std::string tables;
  if (!md->kv_tables.empty()) {
    tables = absl::StrFormat(", %s (%d rows)",
                             Plural(md->kv_tables.size(), "key-value table"),
                             table_rows);
  }
  const uint64_t total = tensor_bytes + object_bytes + table_bytes;
  std::cout << absl::StrFormat(
      "\ntotal: %s in %s, %s, %s%s; %s (%d bytes) in %s\n",
      Plural(md->tensors.size(), "tensor"), Plural(num_chunks, "chunk"),
      Plural(md->objects.size(), "object"),
      Plural(md->scalars.size(), "scalar"), tables, HumanBytes(total), total,
      Plural(files.size(), "data file"));
  if (compressed > 0) {
    std::cout << absl::StrFormat(
        "compressed: %d of %s; tensors take %s in their files (%.2fx "
        "smaller)\n",
        compressed, Plural(num_chunks, "chunk"), HumanBytes(tensor_stored),
        tensor_stored > 0 ? static_cast<double>(tensor_bytes) /
                                static_cast<double>(tensor_stored)
                          : 1.0);
  }
  return 0;
}

}  // namespace

void RegisterInspect(CLI::App& app) {
  auto o = std::make_shared<InspectOptions>();
  CLI::App* cmd = app.add_subcommand(
      "inspect",
      "List a checkpoint's tensors, objects, scalars and key-value tables, "
      "with totals");
  cmd->add_option("CKPT", o->url, "checkpoint directory or URL (file:///...)")
      ->required();
  cmd->add_flag("--json", o->json, "print one JSON object instead of a table");
  cmd->add_flag("--chunks", o->chunks,
                "also list every chunk: box (or a table's rows), file, "
                "offset, bytes, crc32c");
  cmd->footer(
      "Lists every tensor (dtype, shape, chunk count, bytes), object,\n"
      "scalar and key-value table (buckets, rows, chunks, bytes, columns),\n"
      "and the totals. Reads metadata.json only, no data file.\n\n"
      "Examples:\n"
      "  cairn inspect /ckpt/step-100\n"
      "  cairn inspect --json file:///ckpt/step-100 | jq .totals");
  cmd->callback([o] {
    if (int rc = RunInspect(*o); rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace cairn::tools
