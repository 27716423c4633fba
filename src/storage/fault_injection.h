// FaultInjectionStorage: a Storage decorator for tests. It forwards every
// call to a wrapped Storage, counts calls and bytes per operation, and can be
// told to fail the n-th call of an operation with a given status, or to
// corrupt/short the bytes of reads. Thread-safe. The files it returns wrap
// the base's files and must not outlive this object.
#ifndef CAIRN_STORAGE_FAULT_INJECTION_H_
#define CAIRN_STORAGE_FAULT_INJECTION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "cairn/storage.h"

namespace cairn::internal_storage {

enum class StorageOp : int {
  kCreateLocation,
  kCreate,
  kWriteAt,  // WritableFile::WriteAt
  kReserve,  // WritableFile::Reserve
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
  // The `nth` successful ReadAt (1-based, counted from now on) returns OK
  // with one byte of its output flipped (the middle one): what a checksum
  // must catch. One pending corruption; a new call replaces it. (A short
  // read is a failed ReadAt: FailNthCall(kReadAt, n, DataLossError(...)).)
  void CorruptNthRead(int64_t nth);
  // Drops every pending fault and corruption; counters keep counting.
  void Clear();

  int64_t calls(StorageOp op) const;
  uint64_t bytes_read() const;     // by ReadAt calls that succeeded
  // The part of bytes_read() read by ReadAtShared (a kReadAt call too).
  uint64_t shared_bytes_read() const;
  uint64_t bytes_written() const;  // by WriteAt calls that succeeded

  // Storage:
  std::string url() const override;
  absl::Status CreateLocation() override;
  absl::StatusOr<std::unique_ptr<WritableFile>> Create(
      std::string_view name) override;
  absl::Status WriteAtomically(std::string_view name,
                               std::string_view contents) override;
  // Fails as kWriteAtomically: both are a commit.
  absl::Status CreateAtomically(std::string_view name,
                                std::string_view contents) override;
  absl::Status Remove(std::string_view name) override;
  absl::Status Sync() override;
  absl::StatusOr<std::vector<std::string>> List() override;
  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(
      std::string_view name) override;
  absl::StatusOr<bool> Exists(std::string_view name) override;
  absl::StatusOr<std::unique_ptr<Lock>> TryLock(std::string_view name) override;

  // For the wrapped files: counts the call and returns the injected fault,
  // if this call is the one to fail; OK otherwise.
  absl::Status MaybeFail(StorageOp op);
  // For the wrapped readable files, after a ReadAt succeeded: counts it
  // and flips a byte of `data` if it is the read to corrupt.
  void AfterRead(std::span<std::byte> data);
  void AddBytesRead(uint64_t n, bool shared = false);
  void AddBytesWritten(uint64_t n);

 private:
  std::unique_ptr<Storage> base_;
  mutable absl::Mutex mu_;
  int64_t calls_[static_cast<int>(StorageOp::kNumOps)] = {};
  int64_t fail_at_[static_cast<int>(StorageOp::kNumOps)] =
      {};  // 0: none, -1: always
  absl::Status fail_status_[static_cast<int>(StorageOp::kNumOps)];
  int64_t reads_done_ = 0;    // successful ReadAt calls
  int64_t corrupt_read_ = 0;  // reads_done_ value to corrupt; 0: none
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> shared_bytes_read_{0};
  std::atomic<uint64_t> bytes_written_{0};
};

}  // namespace cairn::internal_storage

#endif  // CAIRN_STORAGE_FAULT_INJECTION_H_
