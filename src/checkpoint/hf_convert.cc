// ExportToHuggingFace and ConvertToCheckpoint (include/cairn/
// huggingface.h): a checkpoint loaded straight into the mapped files of a
// Hugging Face folder, and a folder's mapped files saved as a checkpoint.
#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/huggingface.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/hf_import.h"
#include "core/cast.h"
#include "core/status.h"
#include "storage/file_storage.h"

namespace cairn {

using internal_core::Annotate;

absl::StatusOr<HfExportResult> ExportToHuggingFace(
    std::string_view checkpoint_url, std::string_view dir,
    const HfExportOptions& options) {
  using namespace internal_checkpoint;  // NOLINT
  const auto start = std::chrono::steady_clock::now();
  CAIRN_RETURN_IF_ERROR(CheckCast(options.dtype));
  CAIRN_ASSIGN_OR_RETURN(OpenedSource opened, OpenSourceUrl(checkpoint_url));
  CAIRN_ASSIGN_OR_RETURN(
      Metadata md, ReadAnyMetadata(*opened.storage, opened.file,
                                   options.load.import_names));
  HfExportResult result;
  std::vector<HfLayoutTensor> tensors;
  for (const auto& [fqn, t] : md.tensors) {
    tensors.push_back({fqn, ExportedDType(t.dtype, options.dtype), t.shape});
  }
  for (const auto& [fqn, unused] : md.objects) result.skipped.push_back(fqn);
  for (const auto& [fqn, unused] : md.scalars) result.skipped.push_back(fqn);
  for (const auto& [fqn, unused] : md.kv_tables) result.skipped.push_back(fqn);
  std::sort(result.skipped.begin(), result.skipped.end());
  CAIRN_ASSIGN_OR_RETURN(HfLayout layout,
                         PlanHfLayout(tensors, options.max_shard_size));
  CAIRN_ASSIGN_OR_RETURN(std::string path,
                         PrepareFolder(dir, options.overwrite));
  absl::Status s = [&]() -> absl::Status {
    CAIRN_RETURN_IF_ERROR(CreateFiles(path, layout));
    std::vector<std::unique_ptr<MappedFile>> mapped;
    for (const HfLayoutFile& f : layout.files) {
      CAIRN_ASSIGN_OR_RETURN(
          mapped.emplace_back(),
          MappedFile::Open(absl::StrCat(path, "/", f.name, kPartialSuffix),
                           /*write=*/true));
    }
    // Batches of about this many bytes: each one Load, into the mapped
    // files in place, or, to be cast, into buffers first.
    const uint64_t batch_bytes =
        std::max<uint64_t>(options.load.memory_budget_bytes / 2, 64 << 20);
    LoadOptions load = options.load;
    load.comm = nullptr;
    load.strict = true;
    load.planner = nullptr;
    load.kv_tables.clear();
    uint64_t done = 0;
    auto it = md.tensors.begin();
    while (it != md.tensors.end()) {
      StateDict batch;
      std::vector<std::pair<std::string, Tensor>> to_cast;
      uint64_t bytes = 0;
      for (; it != md.tensors.end() && (bytes == 0 || bytes < batch_bytes); ++it) {
        const auto& [fqn, t] = *it;
        const auto& [f, offset] = layout.where.at(fqn);
        const DType to = ExportedDType(t.dtype, options.dtype);
        if (to == t.dtype) {
          batch[fqn] = TensorView(mapped[f]->data() + offset, t.dtype, t.shape);
        } else {
          CAIRN_ASSIGN_OR_RETURN(Tensor buffer, Tensor::Empty(t.dtype, t.shape));
          batch[fqn] = buffer.view();
          to_cast.emplace_back(fqn, std::move(buffer));
        }
        bytes += t.nbytes();
      }
      // Keys with dots are leaves of the flat batch: a map by FQN.
      CAIRN_RETURN_IF_ERROR(
          LoadWithMetadata(batch, opened.storage.get(), md, load).status());
      for (auto& [fqn, buffer] : to_cast) {
        const auto& [f, offset] = layout.where.at(fqn);
        const TensorMetadata& t = md.tensors.at(fqn);
        CAIRN_RETURN_IF_ERROR(internal_core::Cast(
            t.dtype, buffer.view().data(), ExportedDType(t.dtype, options.dtype),
            mapped[f]->data() + offset,
            static_cast<uint64_t>(NumElements(t.shape))));
      }
      done += bytes;
      if (options.progress) options.progress(done, md.total_bytes());
    }
    for (const auto& m : mapped) CAIRN_RETURN_IF_ERROR(m->Sync());
    result.bytes_written = layout.total_size;
    return CommitFolder(path, layout);
  }();
  if (!s.ok()) {
    RemovePartials(path, layout);
    return Annotate(s, absl::StrFormat("exporting %s to %s", checkpoint_url, dir));
  }
  for (const HfLayoutFile& f : layout.files) result.files.push_back(f.name);
  result.total_size = layout.total_size;
  result.tensors = static_cast<int>(layout.where.size());
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

absl::StatusOr<SaveResult> ConvertToCheckpoint(std::string_view source_url,
                                               std::string_view dst,
                                               const ConvertOptions& options) {
  using namespace internal_checkpoint;  // NOLINT
  CAIRN_RETURN_IF_ERROR(CheckCast(options.dtype));
  CAIRN_ASSIGN_OR_RETURN(OpenedSource opened, OpenSourceUrl(source_url));
  CAIRN_ASSIGN_OR_RETURN(
      Metadata md, ReadAnyMetadata(*opened.storage, opened.file, options.names));
  if (md.has_checksums) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is a cairn checkpoint already; ExportToHuggingFace writes a "
        "Hugging Face folder of one",
        source_url));
  }
  absl::StatusOr<std::string> folder = internal_storage::LocalPathOf(
      opened.storage->url());
  if (!folder.ok()) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: conversion maps local files only (%s)", source_url,
        std::string(folder.status().message())));
  }
  // The source files, mapped: a save reads each chunk straight from them.
  // They, and the cast buffers, outlive the Save below.
  std::map<std::string, std::unique_ptr<MappedFile>> files;
  std::vector<Tensor> owned;
  for (const auto& [fqn, t] : md.tensors) {
    for (const ChunkMetadata& c : t.chunks) {
      if (files.contains(c.location.file)) continue;
      CAIRN_ASSIGN_OR_RETURN(
          std::unique_ptr<MappedFile> m,
          MappedFile::Open(absl::StrCat(*folder, "/", c.location.file),
                           /*write=*/false));
      files[c.location.file] = std::move(m);
    }
  }
  StateDict state;
  for (const auto& [fqn, t] : md.tensors) {
    const DType to = ExportedDType(t.dtype, options.dtype);
    std::vector<Shard> shards;
    for (const ChunkMetadata& c : t.chunks) {
      const MappedFile& m = *files.at(c.location.file);
      if (c.location.offset + c.location.nbytes > m.size()) {
        return absl::DataLossError(absl::StrFormat(
            "%s/%s is shorter than its header says (tensor '%s')", *folder,
            c.location.file, fqn));
      }
      std::byte* at = m.data() + c.location.offset;
      if (to == t.dtype) {
        shards.push_back({c.box, TensorView(at, t.dtype, c.box.sizes)});
      } else {
        CAIRN_ASSIGN_OR_RETURN(Tensor cast, Tensor::Empty(to, c.box.sizes));
        CAIRN_RETURN_IF_ERROR(internal_core::Cast(
            t.dtype, at, to, cast.view().data(),
            static_cast<uint64_t>(c.box.num_elements())));
        shards.push_back({c.box, cast.view()});
        owned.push_back(std::move(cast));
      }
    }
    state[fqn] = ShardedTensor(to, t.shape, std::move(shards));
  }
  SaveOptions save = options.save;
  save.comm = nullptr;
  return Save(state, dst, save);
}

}  // namespace cairn
