#include "checkpoint/referencing_storage.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/metadata_codec.h"
#include "format/references.h"
#include "storage/file_storage.h"

namespace cairn::internal_checkpoint {

using internal_core::Annotate;

absl::StatusOr<std::string> CanonicalCheckpointUrl(std::string_view url) {
  if (!internal_storage::IsLocalUrl(url)) {
    return std::string(internal_format::TrimUrl(url));
  }
  CAIRN_ASSIGN_OR_RETURN(std::string path, internal_storage::LocalPathOf(url));
  return std::string(internal_format::TrimUrl(path));
}

absl::Status CheckReferencedCheckpoint(Storage& storage,
                                       const CheckpointReference& ref) {
  absl::StatusOr<std::unique_ptr<ReadableFile>> file =
      storage.OpenForRead(kMetadataFileName);
  if (absl::IsNotFound(file.status())) {
    return absl::NotFoundError(absl::StrFormat(
        "reference %s (%s, save %s): no committed checkpoint is there (%s/%s "
        "is missing: was it deleted?)",
        ref.url, storage.url(), ref.save_id, storage.url(),
        kMetadataFileName));
  }
  CAIRN_RETURN_IF_ERROR(Annotate(
      file.status(),
      absl::StrCat("reference ", ref.url, " (", storage.url(), ")")));
  const size_t n = internal_format::kChecksumPrefixBytes;
  std::string opening(n, '\0');
  const std::string expected =
      absl::StrCat(std::string(internal_format::kChecksumKeyPrefix),
                   internal_format::Crc32cToHex(ref.checksum), "\",");
  if ((*file)->size() >= n) {
    CAIRN_RETURN_IF_ERROR(Annotate(
        (*file)->ReadAt(0, std::span<std::byte>(
                               reinterpret_cast<std::byte*>(opening.data()),
                               n)),
        absl::StrCat("reference ", ref.url, ": reading ", storage.url(), "/",
                     kMetadataFileName)));
  }
  if (opening != expected) {
    return absl::DataLossError(absl::StrFormat(
        "reference %s (%s): the checkpoint there is not the one it was "
        "saved against: its metadata.json opens with \"%s\", where checksum "
        "%s (save %s) was recorded (overwritten or damaged since?)",
        ref.url, storage.url(), absl::CHexEscape(opening),
        internal_format::Crc32cToHex(ref.checksum), ref.save_id));
  }
  return absl::OkStatus();
}

ReferencingStorage::ReferencingStorage(Storage& own,
                                       std::vector<CheckpointReference> refs,
                                       StorageOptions options)
    : own_(own),
      refs_(std::move(refs)),
      options_(std::move(options)),
      opened_(refs_.size()) {}

ReferencingStorage::~ReferencingStorage() = default;

std::string ReferencingStorage::ReferenceUrl(int k) const {
  // "../<name>" is resolved against the absolute form of the URL.
  absl::StatusOr<std::string> own = CanonicalCheckpointUrl(own_.url());
  return internal_format::ResolveReference(own.ok() ? *own : own_.url(),
                                           refs_[k].url);
}

absl::StatusOr<Storage*> ReferencingStorage::Reference(int k) {
  std::lock_guard<std::mutex> lock(mu_);
  Opened& o = opened_[k];
  if (!o.tried) {
    o.tried = true;
    absl::StatusOr<std::unique_ptr<Storage>> storage =
        Storage::Open(ReferenceUrl(k), options_);
    o.status = Annotate(storage.status(),
                        absl::StrCat("opening reference ", refs_[k].url));
    if (o.status.ok()) {
      o.status = CheckReferencedCheckpoint(**storage, refs_[k]);
    }
    if (o.status.ok()) o.storage = *std::move(storage);
  }
  CAIRN_RETURN_IF_ERROR(o.status);
  return o.storage.get();
}

absl::StatusOr<std::unique_ptr<ReadableFile>> ReferencingStorage::OpenForRead(
    std::string_view name) {
  std::string_view there;
  absl::StatusOr<int> k = internal_format::ReferenceOf(name, refs_, &there);
  if (!k.ok() || *k < 0) return own_.OpenForRead(name);
  CAIRN_ASSIGN_OR_RETURN(Storage * storage, Reference(*k));
  return storage->OpenForRead(there);
}

absl::StatusOr<bool> ReferencingStorage::Exists(std::string_view name) {
  std::string_view there;
  absl::StatusOr<int> k = internal_format::ReferenceOf(name, refs_, &there);
  if (!k.ok() || *k < 0) return own_.Exists(name);
  CAIRN_ASSIGN_OR_RETURN(Storage * storage, Reference(*k));
  return storage->Exists(there);
}

}  // namespace cairn::internal_checkpoint
