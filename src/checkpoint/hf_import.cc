// A Hugging Face folder read as a checkpoint (hf_import.h): finding the
// source, reading its index and headers, carrying them to every rank, and
// building metadata from them with the caller's names.
#include "checkpoint/hf_import.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/huggingface.h"
#include "core/byte_codec.h"
#include "core/status.h"
#include "format/json_util.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "format/safetensors.h"
#include "nlohmann/json.hpp"
#include "storage/file_storage.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::Annotate;

constexpr std::string_view kIndexSuffix = ".safetensors.index.json";
constexpr std::string_view kFileSuffix = ".safetensors";

// Reads `name`'s length prefix and header JSON.
absl::StatusOr<SourceFile> ReadSourceFile(Storage& storage,
                                          const std::string& name) {
  absl::StatusOr<std::unique_ptr<ReadableFile>> file =
      storage.OpenForRead(name);
  if (absl::IsNotFound(file.status())) {
    return absl::NotFoundError(absl::StrFormat(
        "%s/%s is missing", storage.url(), name));
  }
  CAIRN_RETURN_IF_ERROR(file.status());
  SourceFile out;
  out.name = name;
  out.size = (*file)->size();
  const std::string where = absl::StrCat(storage.url(), "/", name);
  std::string first8(std::min<uint64_t>(8, out.size), '\0');
  CAIRN_RETURN_IF_ERROR((*file)->ReadAt(
      0, std::as_writable_bytes(std::span<char>(first8.data(), first8.size()))));
  CAIRN_ASSIGN_OR_RETURN(
      const uint64_t n,
      internal_format::ParseSafetensorsHeaderLength(first8, out.size, where));
  out.header.resize(n);
  CAIRN_RETURN_IF_ERROR((*file)->ReadAt(
      8, std::as_writable_bytes(std::span<char>(out.header.data(), n))));
  return out;
}

// The weight_map of an index file: tensor -> file name.
absl::StatusOr<std::map<std::string, std::string>> ParseIndex(
    std::string_view text, const std::string& where) {
  if (internal_format::json_util::NestingDepth(
          text, internal_format::json_util::kMaxJsonDepth) >
      internal_format::json_util::kMaxJsonDepth) {
    return absl::DataLossError(absl::StrCat(where, ": nested too deeply"));
  }
  const nlohmann::json j = nlohmann::json::parse(text, nullptr,
                                                 /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::DataLossError(
        absl::StrCat(where, ": not a JSON object"));
  }
  auto map = j.find("weight_map");
  if (map == j.end() || !map->is_object()) {
    return absl::DataLossError(absl::StrCat(
        where, ": no \"weight_map\" object (tensor name -> file name)"));
  }
  std::map<std::string, std::string> out;
  for (auto it = map->begin(); it != map->end(); ++it) {
    if (!it->is_string()) {
      return absl::DataLossError(absl::StrFormat(
          "%s: weight_map[\"%s\"] is not a file name", where, it.key()));
    }
    const std::string file = it->get<std::string>();
    absl::Status name = internal_format::ValidateRelativeName(file);
    if (!name.ok()) {
      return absl::DataLossError(absl::StrFormat(
          "%s: weight_map[\"%s\"]: %s", where, it.key(),
          std::string(name.message())));
    }
    out.emplace(it.key(), file);
  }
  return out;
}

// Whether `url` is a local directory (a URL of another scheme never is).
bool IsLocalDirectory(std::string_view url) {
  if (!internal_storage::IsLocalUrl(url)) return false;
  absl::StatusOr<std::string> path = internal_storage::LocalPathOf(url);
  std::error_code ec;
  return path.ok() &&
         std::filesystem::is_directory(std::filesystem::path(*path), ec);
}

absl::Status Invalid(const std::string& fqn, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrFormat("imported tensor '%s': %s", fqn, what));
}

}  // namespace

absl::StatusOr<OpenedSource> OpenSourceUrl(std::string_view url,
                                           const StorageOptions& options) {
  OpenedSource out;
  if ((url.ends_with(kFileSuffix) || url.ends_with(kIndexSuffix)) &&
      !IsLocalDirectory(url)) {
    const size_t slash = url.rfind('/');
    const std::string_view folder =
        slash == std::string_view::npos ? std::string_view(".")
                                        : url.substr(0, std::max<size_t>(slash, 1));
    out.file = std::string(
        slash == std::string_view::npos ? url : url.substr(slash + 1));
    CAIRN_ASSIGN_OR_RETURN(out.storage, Storage::Open(folder, options));
    return out;
  }
  CAIRN_ASSIGN_OR_RETURN(out.storage, Storage::Open(url, options));
  return out;
}

absl::Status NothingToLoad(const absl::Status& not_found) {
  return absl::NotFoundError(absl::StrCat(
      std::string(not_found.message()), ", and it is no Hugging Face folder (",
      kHfIndexFileName, " and ", kHfSingleFileName, " are missing too)"));
}

absl::StatusOr<bool> HasImportSource(Storage& storage, std::string_view file) {
  if (!file.empty()) return true;
  CAIRN_ASSIGN_OR_RETURN(bool index, storage.Exists(kHfIndexFileName));
  if (index) return true;
  return storage.Exists(kHfSingleFileName);
}

absl::StatusOr<ImportSource> ReadImportSource(Storage& storage,
                                              std::string_view file) {
  ImportSource source;
  source.url = storage.url();
  std::string index_name;
  std::string single;
  if (file.ends_with(kIndexSuffix)) {
    index_name = std::string(file);
  } else if (!file.empty()) {
    single = std::string(file);
  } else {
    CAIRN_ASSIGN_OR_RETURN(bool has_index, storage.Exists(kHfIndexFileName));
    CAIRN_ASSIGN_OR_RETURN(bool has_single, storage.Exists(kHfSingleFileName));
    if (has_index) {
      index_name = kHfIndexFileName;
    } else if (has_single) {
      single = kHfSingleFileName;
    } else {
      return absl::NotFoundError(absl::StrFormat(
          "no checkpoint at %s: neither %s, %s nor %s exists", storage.url(),
          kMetadataFileName, kHfIndexFileName, kHfSingleFileName));
    }
  }
  if (!single.empty()) {
    source.url = absl::StrCat(storage.url(), "/", single);
    CAIRN_ASSIGN_OR_RETURN(SourceFile f, ReadSourceFile(storage, single));
    source.files.push_back(std::move(f));
  } else {
    source.index = index_name;
    const std::string where = absl::StrCat(storage.url(), "/", index_name);
    absl::StatusOr<std::string> text =
        storage.ReadAll(index_name, kMaxIndexBytes);
    if (absl::IsNotFound(text.status())) {
      return absl::NotFoundError(absl::StrCat(where, " is missing"));
    }
    CAIRN_RETURN_IF_ERROR(Annotate(text.status(), where));
    CAIRN_ASSIGN_OR_RETURN(auto weight_map, ParseIndex(*text, where));
    std::map<std::string, size_t> file_index;
    for (const auto& [tensor, name] : weight_map) {
      auto [it, inserted] = file_index.try_emplace(name, source.files.size());
      if (inserted) {
        absl::StatusOr<SourceFile> f = ReadSourceFile(storage, name);
        CAIRN_RETURN_IF_ERROR(Annotate(
            f.status(), absl::StrFormat("%s names it for tensor '%s'", where,
                                        tensor)));
        source.files.push_back(*std::move(f));
      }
      source.tensors.emplace(tensor, it->second);
    }
  }
  // Validated here, on the coordinator, so that a damaged source fails
  // before the broadcast; every rank parses them again to build metadata.
  std::vector<internal_format::SafetensorsHeader> headers;
  for (const SourceFile& f : source.files) {
    absl::StatusOr<internal_format::SafetensorsHeader> h =
        internal_format::ParseSafetensorsHeader(
            f.header, f.size, absl::StrCat(storage.url(), "/", f.name));
    CAIRN_RETURN_IF_ERROR(h.status());
    if (source.index.empty()) {
      for (const internal_format::SafetensorsEntry& e : h->entries) {
        source.tensors.emplace(e.name, 0);
      }
    }
  }
  return source;
}

std::string EncodeImportSource(const ImportSource& source) {
  internal_core::ByteWriter w;
  w.U8(static_cast<uint8_t>(kImportSourceMarker));
  w.Str(source.url);
  w.Str(source.index);
  w.U64(source.files.size());
  for (const SourceFile& f : source.files) {
    w.Str(f.name);
    w.U64(f.size);
    w.Str(f.header);
  }
  w.U64(source.tensors.size());
  for (const auto& [name, file] : source.tensors) {
    w.Str(name);
    w.U64(file);
  }
  return w.Take();
}

absl::StatusOr<ImportSource> DecodeImportSource(std::string_view bytes) {
  internal_core::ByteReader r(bytes, "imported source from the coordinator");
  ImportSource source;
  if (r.U8() != static_cast<uint8_t>(kImportSourceMarker)) {
    return absl::DataLossError(
        "imported source from the coordinator: wrong marker");
  }
  source.url = r.Str();
  source.index = r.Str();
  const uint64_t files = r.Count(17);
  for (uint64_t i = 0; i < files && !r.failed(); ++i) {
    SourceFile f;
    f.name = r.Str();
    f.size = r.U64();
    f.header = r.Str();
    source.files.push_back(std::move(f));
  }
  const uint64_t tensors = r.Count(16);
  for (uint64_t i = 0; i < tensors && !r.failed(); ++i) {
    std::string name = r.Str();
    const uint64_t file = r.U64();
    if (file >= source.files.size()) {
      return absl::DataLossError(absl::StrFormat(
          "imported source from the coordinator: tensor '%s' in file %d of "
          "%d",
          name, file, source.files.size()));
    }
    source.tensors.emplace(std::move(name), file);
  }
  CAIRN_RETURN_IF_ERROR(r.status());
  if (!r.done()) {
    return absl::DataLossError(
        "imported source from the coordinator: trailing bytes");
  }
  return source;
}

absl::StatusOr<Metadata> BuildImportedMetadata(const ImportSource& source,
                                               const ImportNames& names) {
  // Every stored tensor, by name: its file and header entry.
  struct Stored {
    size_t file = 0;
    internal_format::SafetensorsEntry entry;
  };
  std::vector<internal_format::SafetensorsHeader> headers;
  headers.reserve(source.files.size());
  std::string prefix = source.url;
  if (!source.index.empty()) prefix = absl::StrCat(source.url, "/");
  for (const SourceFile& f : source.files) {
    const std::string where =
        source.index.empty() ? source.url : absl::StrCat(prefix, f.name);
    CAIRN_ASSIGN_OR_RETURN(internal_format::SafetensorsHeader h,
                           internal_format::ParseSafetensorsHeader(
                               f.header, f.size, where));
    headers.push_back(std::move(h));
  }
  std::map<std::string, Stored> stored;
  for (size_t i = 0; i < headers.size(); ++i) {
    for (internal_format::SafetensorsEntry& e : headers[i].entries) {
      auto it = source.tensors.find(e.name);
      if (it == source.tensors.end() || it->second != i) continue;
      std::string name = e.name;
      stored[std::move(name)] = Stored{i, std::move(e)};
    }
  }
  for (const auto& [name, file] : source.tensors) {
    if (!stored.contains(name)) {
      return absl::DataLossError(absl::StrFormat(
          "%s names %s for tensor '%s', whose header has no such entry",
          absl::StrCat(prefix, source.index), source.files[file].name, name));
    }
  }
  // The stored tensors, whole, under their names after the prefixes.
  std::vector<ImportedTensor> tensors;
  tensors.reserve(stored.size());
  std::set<std::string> seen;
  for (const auto& [name, s] : stored) {
    std::string fqn = name;
    if (!names.strip_prefix.empty() &&
        fqn.starts_with(names.strip_prefix)) {
      fqn.erase(0, names.strip_prefix.size());
    }
    fqn = absl::StrCat(names.add_prefix, fqn);
    if (!seen.insert(fqn).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "two stored tensors become '%s' after the prefixes (one is '%s')",
          fqn, name));
    }
    ImportedTensor t;
    t.fqn = std::move(fqn);
    t.dtype = s.entry.dtype;
    t.shape = s.entry.shape;
    t.parts.push_back(ImportPart{name, 0, Box::Full(s.entry.shape)});
    tensors.push_back(std::move(t));
  }
  std::sort(tensors.begin(), tensors.end(),
            [](const ImportedTensor& a, const ImportedTensor& b) {
              return a.fqn < b.fqn;
            });
  if (names.map) {
    absl::StatusOr<std::vector<ImportedTensor>> mapped =
        names.map(std::move(tensors));
    CAIRN_RETURN_IF_ERROR(Annotate(mapped.status(), "the import name map"));
    tensors = *std::move(mapped);
  }

  Metadata md;
  md.created_by = absl::StrCat("safetensors files at ", source.url);
  md.has_checksums = false;
  for (const ImportedTensor& t : tensors) {
    if (t.fqn.empty()) return Invalid(t.fqn, "empty name");
    for (int64_t d : t.shape) {
      if (d < 0) return Invalid(t.fqn, "negative dimension");
    }
    if (t.parts.empty() && NumElements(t.shape) != 0) {
      return Invalid(t.fqn, "no parts");
    }
    TensorMetadata tm;
    tm.dtype = t.dtype;
    tm.shape = t.shape;
    const size_t es = DTypeSize(t.dtype);
    for (const ImportPart& p : t.parts) {
      auto it = stored.find(p.source);
      if (it == stored.end()) {
        return Invalid(t.fqn, absl::StrFormat("no stored tensor '%s'",
                                              p.source));
      }
      const internal_format::SafetensorsEntry& e = it->second.entry;
      const std::string part = absl::StrFormat(
          "part %s from '%s' row %d", p.box.ToString(), p.source,
          p.source_row);
      if (e.dtype != t.dtype) {
        return Invalid(t.fqn, absl::StrFormat(
                                  "%s: stored as %s, the tensor is %s (no "
                                  "cast on import)",
                                  part, DTypeName(e.dtype),
                                  DTypeName(t.dtype)));
      }
      const size_t rank = e.shape.size();
      bool fits = p.box.offsets.size() == t.shape.size() &&
                  p.box.sizes.size() == t.shape.size() &&
                  p.box.sizes.size() == rank;
      for (size_t d = 0; fits && d < rank; ++d) {
        fits = p.box.offsets[d] >= 0 && p.box.sizes[d] >= 0 &&
               p.box.offsets[d] <= t.shape[d] - p.box.sizes[d] &&
               (d == 0 ? p.source_row >= 0 &&
                             p.source_row <= e.shape[0] - p.box.sizes[0]
                       : p.box.sizes[d] == e.shape[d]);
      }
      if (rank == 0) fits = fits && p.source_row == 0;
      if (!fits) {
        return Invalid(
            t.fqn,
            absl::StrFormat("%s does not fit: the tensor is [%s], the "
                            "source [%s], and a part is a run of the "
                            "source's leading rows",
                            part, absl::StrJoin(t.shape, ", "),
                            absl::StrJoin(e.shape, ", ")));
      }
      uint64_t row = es;
      for (size_t d = 1; d < rank; ++d) row *= static_cast<uint64_t>(e.shape[d]);
      ChunkMetadata chunk;
      chunk.box = p.box;
      chunk.location.file = source.files[it->second.file].name;
      chunk.location.offset = headers[it->second.file].data_start +
                              e.begin +
                              static_cast<uint64_t>(p.source_row) * row;
      chunk.location.nbytes =
          static_cast<uint64_t>(NumElements(p.box.sizes)) * es;
      tm.chunks.push_back(std::move(chunk));
      tm.source_entries.push_back(p.source);
    }
    if (!md.tensors.emplace(t.fqn, std::move(tm)).second) {
      return Invalid(t.fqn, "named twice");
    }
  }
  CAIRN_RETURN_IF_ERROR(Annotate(internal_format::ValidateAllCoverage(md),
                                 "imported tensors"));
  // No stored byte loads into two places (a name map that uses a source
  // twice): ValidateDisjointLocations names both.
  CAIRN_RETURN_IF_ERROR(Annotate(internal_format::ValidateDisjointLocations(md),
                                 "imported tensors"));
  return md;
}

}  // namespace cairn::internal_checkpoint
