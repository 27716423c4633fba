// FaultInjectionStorage: a Storage decorator for tests. It forwards every
// call to a wrapped Storage, counts calls and bytes per operation, and can be
// told to fail the n-th call of an operation with a given status, or to
// corrupt/short the bytes of reads. Thread-safe.
#ifndef CAIRN_STORAGE_FAULT_INJECTION_H_
#define CAIRN_STORAGE_FAULT_INJECTION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "cairn/storage.h"

namespace cairn::internal_storage {

enum class StorageOp : int {
  kCreateLocation,
  kCreate,
  kWriteAt,  // WritableFile::WriteAt
  kFinish,   // WritableFile::Finish
  kWriteAtomically,
  kRemove,
  kSync,
  kList,
  kOpenForRead,
  kReadAt,  // ReadableFile::ReadAt
  kExists,
  kNumOps,
};

class FaultInjectionStorage : public Storage {
 public:
  explicit FaultInjectionStorage(std::unique_ptr<Storage> base);
  ~FaultInjectionStorage() override;

  // The `nth` call (1-based, counted from now on) of `op` returns `status`
  // instead of running. One pending fault per op; a new call replaces it.
  void FailNthCall(StorageOp op, int64_t nth, absl::Status status);
  // Every call of `op` from now on fails with `status` (until Clear()).
  void FailAlways(StorageOp op, absl::Status status);
  void Clear();

  int64_t calls(StorageOp op) const;
  uint64_t bytes_read() const;     // by ReadAt calls that succeeded
  uint64_t bytes_written() const;  // by WriteAt calls that succeeded

  // Storage:
  std::string url() const override;
  absl::Status CreateLocation() override;
  absl::StatusOr<std::unique_ptr<WritableFile>> Create(
      std::string_view name) override;
  absl::Status WriteAtomically(std::string_view name,
                               std::string_view contents) override;
  absl::Status Remove(std::string_view name) override;
  absl::Status Sync() override;
  absl::StatusOr<std::vector<std::string>> List() override;
  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(
      std::string_view name) override;
  absl::StatusOr<bool> Exists(std::string_view name) override;

  // For the wrapped files: counts the call and returns the injected fault,
  // if this call is the one to fail; OK otherwise.
  absl::Status MaybeFail(StorageOp op);
  void AddBytesRead(uint64_t n);
  void AddBytesWritten(uint64_t n);

 private:
  std::unique_ptr<Storage> base_;
  mutable absl::Mutex mu_;
  int64_t calls_[static_cast<int>(StorageOp::kNumOps)] = {};
  int64_t fail_at_[static_cast<int>(StorageOp::kNumOps)] = {};  // 0: none, -1: always
  absl::Status fail_status_[static_cast<int>(StorageOp::kNumOps)];
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> bytes_written_{0};
};

}  // namespace cairn::internal_storage

#endif  // CAIRN_STORAGE_FAULT_INJECTION_H_
