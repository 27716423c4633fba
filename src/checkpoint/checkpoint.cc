// The public entry points: open the URL, then run the storage-level save or
// load (save.cc, load.cc).
#include "cairn/checkpoint.h"

#include "cairn/storage.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/hf_import.h"
#include "cairn/huggingface.h"
#include "core/status.h"

namespace cairn {

absl::StatusOr<SaveResult> Save(const StateDict& state, std::string_view url,
                                const SaveOptions& options) {
  StorageOptions storage_options;
  storage_options.direct_io = options.direct_io;
  storage_options.s3 = options.s3;
  // A rank that cannot open the URL still takes part in the protocol.
  absl::StatusOr<std::unique_ptr<Storage>> storage =
      Storage::Open(url, storage_options);
  return internal_checkpoint::SaveToStorage(
      state,
      storage.ok() ? absl::StatusOr<Storage*>(storage->get()) : storage.status(),
      options);
}

absl::StatusOr<LoadResult> Load(StateDict& state, std::string_view url,
                                const LoadOptions& options) {
  // A URL may name a Hugging Face file (hf_import.h) in a folder.
  absl::StatusOr<internal_checkpoint::OpenedSource> opened =
      internal_checkpoint::OpenSourceUrl(url, StorageOptions{.s3 = options.s3});
  return internal_checkpoint::LoadFromStorage(
      state,
      opened.ok() ? absl::StatusOr<Storage*>(opened->storage.get())
                  : opened.status(),
      options, opened.ok() ? std::string_view(opened->file) : "");
}

absl::StatusOr<StateDict> LoadAll(std::string_view url,
                                  const LoadOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(
      internal_checkpoint::OpenedSource opened,
      internal_checkpoint::OpenSourceUrl(url, StorageOptions{.s3 = options.s3}));
  return internal_checkpoint::LoadAllFromStorage(*opened.storage, options,
                                                 opened.file);
}

absl::StatusOr<Metadata> ReadMetadata(std::string_view url) {
  CAIRN_ASSIGN_OR_RETURN(internal_checkpoint::OpenedSource opened,
                         internal_checkpoint::OpenSourceUrl(url));
  return internal_checkpoint::ReadAnyMetadata(*opened.storage, opened.file,
                                              {});
}

absl::StatusOr<bool> IsSafetensorsSource(std::string_view url) {
  CAIRN_ASSIGN_OR_RETURN(internal_checkpoint::OpenedSource opened,
                         internal_checkpoint::OpenSourceUrl(url));
  if (!opened.file.empty()) return true;
  CAIRN_ASSIGN_OR_RETURN(bool committed,
                         opened.storage->Exists(kMetadataFileName));
  if (committed) return false;
  return internal_checkpoint::HasImportSource(*opened.storage, "");
}

absl::StatusOr<Metadata> ReadImportedMetadata(std::string_view url,
                                              const ImportNames& names) {
  CAIRN_ASSIGN_OR_RETURN(internal_checkpoint::OpenedSource opened,
                         internal_checkpoint::OpenSourceUrl(url));
  CAIRN_ASSIGN_OR_RETURN(
      internal_checkpoint::ImportSource source,
      internal_checkpoint::ReadImportSource(*opened.storage, opened.file));
  return internal_checkpoint::BuildImportedMetadata(source, names);
}

absl::StatusOr<MergeResult> Merge(std::string_view url,
                                  const MergeOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, Storage::Open(url));
  return internal_checkpoint::MergeInStorage(*storage, options);
}

}  // namespace cairn
