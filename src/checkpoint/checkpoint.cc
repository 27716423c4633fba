// The public entry points: open the URL, then run the storage-level save or
// load (save.cc, load.cc).
#include "cairn/checkpoint.h"

#include "cairn/storage.h"
#include "checkpoint/checkpoint_impl.h"
#include "core/status.h"

namespace cairn {

absl::StatusOr<SaveResult> Save(const StateDict& state, std::string_view url,
                                const SaveOptions& options) {
  StorageOptions storage_options;
  storage_options.direct_io = options.direct_io;
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
  absl::StatusOr<std::unique_ptr<Storage>> storage = Storage::Open(url);
  return internal_checkpoint::LoadFromStorage(
      state,
      storage.ok() ? absl::StatusOr<Storage*>(storage->get()) : storage.status(),
      options);
}

absl::StatusOr<StateDict> LoadAll(std::string_view url,
                                  const LoadOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, Storage::Open(url));
  return internal_checkpoint::LoadAllFromStorage(*storage, options);
}

absl::StatusOr<Metadata> ReadMetadata(std::string_view url) {
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, Storage::Open(url));
  return internal_checkpoint::ReadMetadataFromStorage(*storage);
}

absl::StatusOr<MergeResult> Merge(std::string_view url,
                                  const MergeOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, Storage::Open(url));
  return internal_checkpoint::MergeInStorage(*storage, options);
}

}  // namespace cairn
