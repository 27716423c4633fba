#include "checkpoint/referencing_storage.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/metadata_codec.h"
#include "format/references.h"

namespace cairn::internal_checkpoint {

using internal_core::Annotate;

absl::Status CheckReferencedCheckpoint(Storage& storage,
                                       const CheckpointReference& ref,
                                       std::string_view context) {
  absl::StatusOr<std::unique_ptr<ReadableFile>> file =
      storage.OpenForRead(kMetadataFileName);
  if (absl::IsNotFound(file.status())) {
    return absl::NotFoundError(absl::StrFormat(
        "%s: it keeps chunks in %s (reference %s, save %s), where no "
        "committed checkpoint is (%s/%s is missing: was it deleted?)",
        context, storage.url(), ref.url, ref.save_id, storage.url(),
        kMetadataFileName));
  }
  CAIRN_RETURN_IF_ERROR(Annotate(
      file.status(), absl::StrCat(std::string(context),
                                  ": opening the checkpoint it references at ",
                                  storage.url())));
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
        absl::StrCat(std::string(context), ": reading ", storage.url(), "/",
                     kMetadataFileName)));
  }
  if (opening != expected) {
    return absl::DataLossError(absl::StrFormat(
        "%s: it keeps chunks in %s (reference %s), but the checkpoint there "
        "is not the one it was saved against: its metadata.json opens with "
        "\"%s\", where checksum %s (save %s) was recorded (overwritten or "
        "damaged since?)",
        context, storage.url(), ref.url, absl::CHexEscape(opening),
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
  return internal_format::ResolveReference(own_.url(), refs_[k].url);
}

absl::StatusOr<Storage*> ReferencingStorage::Reference(int k) {
  std::lock_guard<std::mutex> lock(mu_);
  Opened& o = opened_[k];
  if (!o.tried) {
    o.tried = true;
    const std::string context =
        absl::StrCat("checkpoint ", own_.url());
    absl::StatusOr<std::unique_ptr<Storage>> storage =
        Storage::Open(ReferenceUrl(k), options_);
    o.status = Annotate(storage.status(),
                        absl::StrCat(context, ": opening its reference ",
                                     refs_[k].url));
    if (o.status.ok()) {
      o.status = CheckReferencedCheckpoint(**storage, refs_[k], context);
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
