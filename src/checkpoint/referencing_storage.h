// The storage of an incremental checkpoint (format version 6, docs/format.md
// 4.2.2): its own files, and the chunk files it keeps in the checkpoints it
// references, named "<reference url>/<name there>". Reads of such a name
// go to that checkpoint, which is opened, and shown to be the one this
// checkpoint was saved against, on first use: its metadata.json must be
// there (else kNotFound naming both checkpoints) and open with the
// checksum the reference recorded (else kDataLoss: it was overwritten or
// damaged since). Everything else goes to the checkpoint's own storage.
// Loads, LoadAll and verify read through it, so they follow references
// with no other change.
#ifndef CAIRN_CHECKPOINT_REFERENCING_STORAGE_H_
#define CAIRN_CHECKPOINT_REFERENCING_STORAGE_H_

#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/metadata.h"
#include "cairn/storage.h"

namespace cairn::internal_checkpoint {

class ReferencingStorage final : public Storage {
 public:
  // `own` must outlive this.
  ReferencingStorage(Storage& own, std::vector<CheckpointReference> refs,
                     StorageOptions options);
  ~ReferencingStorage() override;

  // The URL reference k resolves to, from this checkpoint.
  std::string ReferenceUrl(int k) const;
  // Opens reference k and checks that it is the checkpoint recorded.
  absl::StatusOr<Storage*> Reference(int k);

  std::string url() const override { return own_.url(); }
  absl::Status CreateLocation() override { return own_.CreateLocation(); }
  absl::StatusOr<std::unique_ptr<WritableFile>> Create(
      std::string_view name) override {
    return own_.Create(name);
  }
  absl::Status WriteAtomically(std::string_view name,
                               std::string_view contents) override {
    return own_.WriteAtomically(name, contents);
  }
  absl::Status CreateAtomically(std::string_view name,
                                std::string_view contents) override {
    return own_.CreateAtomically(name, contents);
  }
  absl::Status Remove(std::string_view name) override {
    return own_.Remove(name);
  }
  absl::Status Sync() override { return own_.Sync(); }
  absl::StatusOr<std::vector<std::string>> List() override {
    return own_.List();
  }
  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(
      std::string_view name) override;
  absl::StatusOr<bool> Exists(std::string_view name) override;
  absl::StatusOr<std::unique_ptr<Lock>> TryLock(
      std::string_view name) override {
    return own_.TryLock(name);
  }

 private:
  Storage& own_;
  const std::vector<CheckpointReference> refs_;
  const StorageOptions options_;
  std::mutex mu_;
  // Per reference: opened and checked (or why not), on first use.
  struct Opened {
    bool tried = false;
    absl::Status status;
    std::unique_ptr<Storage> storage;
  };
  std::vector<Opened> opened_;
};

// Reads the opening of `storage`'s metadata.json and checks that it is the
// checkpoint `ref` records: kNotFound when no metadata.json is there,
// kDataLoss when its checksum differs; both name the reference.
absl::Status CheckReferencedCheckpoint(Storage& storage,
                                       const CheckpointReference& ref);

// A checkpoint URL in the form references are made and resolved in: local
// paths absolute (file:// or bare), any URL without trailing '/'s.
absl::StatusOr<std::string> CanonicalCheckpointUrl(std::string_view url);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_REFERENCING_STORAGE_H_
