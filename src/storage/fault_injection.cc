// FaultInjectionStorage: forwards every call to the wrapped Storage after
// asking MaybeFail() whether this call is the one to fail. Files are wrapped
// too, so per-file operations (WriteAt, Finish, ReadAt) are counted and can
// fail like the others.
#include "storage/fault_injection.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/status.h"

namespace cairn::internal_storage {
namespace {

int Index(StorageOp op) { return static_cast<int>(op); }

class FaultWritableFile final : public WritableFile {
 public:
  FaultWritableFile(FaultInjectionStorage* owner,
                    std::unique_ptr<WritableFile> base)
      : owner_(owner), base_(std::move(base)) {}

  size_t alignment() const override { return base_->alignment(); }

  absl::Status WriteAt(uint64_t offset,
                       std::span<const std::byte> data) override {
    CAIRN_RETURN_IF_ERROR(owner_->MaybeFail(StorageOp::kWriteAt));
    CAIRN_RETURN_IF_ERROR(base_->WriteAt(offset, data));
    owner_->AddBytesWritten(data.size());
    return absl::OkStatus();
  }

  absl::Status Reserve(uint64_t size) override {
    CAIRN_RETURN_IF_ERROR(owner_->MaybeFail(StorageOp::kReserve));
    return base_->Reserve(size);
  }

  // An injected failure leaves the base file unfinished: destroying it then
  // closes without syncing, as after a crash before fdatasync.
  absl::Status Finish(uint64_t size) override {
    CAIRN_RETURN_IF_ERROR(owner_->MaybeFail(StorageOp::kFinish));
    return base_->Finish(size);
  }

 private:
  FaultInjectionStorage* const owner_;
  const std::unique_ptr<WritableFile> base_;
};

class FaultReadableFile final : public ReadableFile {
 public:
  FaultReadableFile(FaultInjectionStorage* owner,
                    std::unique_ptr<ReadableFile> base)
      : owner_(owner), base_(std::move(base)) {}

  uint64_t size() const override { return base_->size(); }

  absl::Status ReadAt(uint64_t offset,
                      std::span<std::byte> data) const override {
    CAIRN_RETURN_IF_ERROR(owner_->MaybeFail(StorageOp::kReadAt));
    CAIRN_RETURN_IF_ERROR(base_->ReadAt(offset, data));
    owner_->AddBytesRead(data.size());
    owner_->AfterRead(data);
    return absl::OkStatus();
  }

  // The base's own shared read (the file backend's differs from its
  // ReadAt), failing and corrupting as ReadAt does.
  absl::Status ReadAtShared(uint64_t offset,
                            std::span<std::byte> data) const override {
    CAIRN_RETURN_IF_ERROR(owner_->MaybeFail(StorageOp::kReadAt));
    CAIRN_RETURN_IF_ERROR(base_->ReadAtShared(offset, data));
    owner_->AddBytesRead(data.size(), /*shared=*/true);
    owner_->AfterRead(data);
    return absl::OkStatus();
  }

 private:
  FaultInjectionStorage* const owner_;
  const std::unique_ptr<ReadableFile> base_;
};

}  // namespace

FaultInjectionStorage::FaultInjectionStorage(std::unique_ptr<Storage> base)
    : base_(std::move(base)) {}

FaultInjectionStorage::~FaultInjectionStorage() = default;

void FaultInjectionStorage::FailNthCall(StorageOp op, int64_t nth,
                                        absl::Status status) {
  absl::MutexLock lock(&mu_);
  const int i = Index(op);
  // nth < 1 would name a call already made: treat it as the next call.
  fail_at_[i] = calls_[i] + (nth < 1 ? 1 : nth);
  fail_status_[i] = std::move(status);
}

void FaultInjectionStorage::FailAlways(StorageOp op, absl::Status status) {
  absl::MutexLock lock(&mu_);
  fail_at_[Index(op)] = -1;
  fail_status_[Index(op)] = std::move(status);
}

void FaultInjectionStorage::CorruptNthRead(int64_t nth) {
  absl::MutexLock lock(&mu_);
  corrupt_read_ = reads_done_ + (nth < 1 ? 1 : nth);
}

void FaultInjectionStorage::Clear() {
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < Index(StorageOp::kNumOps); ++i) {
    fail_at_[i] = 0;
    fail_status_[i] = absl::OkStatus();
  }
  corrupt_read_ = 0;
}

int64_t FaultInjectionStorage::calls(StorageOp op) const {
  absl::MutexLock lock(&mu_);
  return calls_[Index(op)];
}

uint64_t FaultInjectionStorage::bytes_read() const {
  return bytes_read_.load();
}

uint64_t FaultInjectionStorage::bytes_written() const {
  return bytes_written_.load();
}

absl::Status FaultInjectionStorage::MaybeFail(StorageOp op) {
  absl::MutexLock lock(&mu_);
  const int i = Index(op);
  const int64_t call = ++calls_[i];
  if (fail_at_[i] == -1) return fail_status_[i];
  if (fail_at_[i] == call) {
    fail_at_[i] = 0;
    return std::exchange(fail_status_[i], absl::OkStatus());
  }
  return absl::OkStatus();
}

void FaultInjectionStorage::AfterRead(std::span<std::byte> data) {
  absl::MutexLock lock(&mu_);
  ++reads_done_;
  if (corrupt_read_ != 0 && reads_done_ == corrupt_read_) {
    corrupt_read_ = 0;
    if (!data.empty()) data[data.size() / 2] ^= std::byte{0xff};
  }
}

void FaultInjectionStorage::AddBytesRead(uint64_t n, bool shared) {
  bytes_read_ += n;
  if (shared) shared_bytes_read_ += n;
}

uint64_t FaultInjectionStorage::shared_bytes_read() const {
  return shared_bytes_read_.load();
}

void FaultInjectionStorage::AddBytesWritten(uint64_t n) { bytes_written_ += n; }

std::string FaultInjectionStorage::url() const { return base_->url(); }

absl::Status FaultInjectionStorage::CreateLocation() {
  CAIRN_RETURN_IF_ERROR(MaybeFail(StorageOp::kCreateLocation));
  return base_->CreateLocation();
}

absl::StatusOr<std::unique_ptr<WritableFile>> FaultInjectionStorage::Create(
    std::string_view name) {
  CAIRN_RETURN_IF_ERROR(MaybeFail(StorageOp::kCreate));
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                         base_->Create(name));
  return std::make_unique<FaultWritableFile>(this, std::move(file));
}

absl::Status FaultInjectionStorage::WriteAtomically(std::string_view name,
                                                    std::string_view contents) {
  CAIRN_RETURN_IF_ERROR(MaybeFail(StorageOp::kWriteAtomically));
  return base_->WriteAtomically(name, contents);
}

absl::Status FaultInjectionStorage::CreateAtomically(
    std::string_view name, std::string_view contents) {
  CAIRN_RETURN_IF_ERROR(MaybeFail(StorageOp::kWriteAtomically));
  return base_->CreateAtomically(name, contents);
}

absl::Status FaultInjectionStorage::Remove(std::string_view name) {
  CAIRN_RETURN_IF_ERROR(MaybeFail(StorageOp::kRemove));
  return base_->Remove(name);
}

absl::Status FaultInjectionStorage::Sync() {
  CAIRN_RETURN_IF_ERROR(MaybeFail(StorageOp::kSync));
  return base_->Sync();
}

absl::StatusOr<std::vector<std::string>> FaultInjectionStorage::List() {
  CAIRN_RETURN_IF_ERROR(MaybeFail(StorageOp::kList));
  return base_->List();
}

absl::StatusOr<std::unique_ptr<ReadableFile>>
FaultInjectionStorage::OpenForRead(std::string_view name) {
  CAIRN_RETURN_IF_ERROR(MaybeFail(StorageOp::kOpenForRead));
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file,
                         base_->OpenForRead(name));
  return std::make_unique<FaultReadableFile>(this, std::move(file));
}

absl::StatusOr<std::unique_ptr<Storage::Lock>> FaultInjectionStorage::TryLock(
    std::string_view name) {
  return base_->TryLock(name);
}

absl::StatusOr<bool> FaultInjectionStorage::Exists(std::string_view name) {
  CAIRN_RETURN_IF_ERROR(MaybeFail(StorageOp::kExists));
  return base_->Exists(name);
}

}  // namespace cairn::internal_storage
