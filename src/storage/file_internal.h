// What the file backend's two files share: file_storage.cc (the Storage:
// names, links, writes and their durability) and file_read.cc (its files
// opened for reading: the page cache, O_DIRECT, mapped views).
#ifndef CAIRN_STORAGE_FILE_INTERNAL_H_
#define CAIRN_STORAGE_FILE_INTERNAL_H_

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "cairn/storage.h"
#include "core/status.h"

namespace cairn::internal_storage {

inline uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// Alignment O_DIRECT needs for offsets, lengths and buffer addresses. 4096
// covers every logical block size in use (512 and 4096).
inline constexpr size_t kDirectIoAlignment = 4096;

// pwrite/pread move at most this much per call on Linux anyway.
inline constexpr size_t kMaxIoChunk = size_t{1} << 30;

// Closes `fd`, retrying nothing: on Linux the descriptor is released even
// when close() reports EINTR, so retrying could close someone else's fd.
inline absl::Status CloseFd(int fd, std::string_view path) {
  if (::close(fd) != 0 && errno != EINTR) {
    return internal_core::StatusFromErrno(errno, "close", path);
  }
  return absl::OkStatus();
}

struct FileReadOptions {
  // Copy cached ranges out of the mapping, and give views of them.
  bool copy_mapped = true;
  // Ask the page cache with cachestat(2), falling back to mincore() where
  // the kernel lacks it; false: mincore() only.
  bool cachestat = true;
  // Ended views' pages are unmapped once this many bytes of them (or of
  // the blocks between them) are waiting.
  uint64_t release_batch = uint64_t{8} << 20;
  // Tests: counts the bytes read with O_DIRECT.
  std::atomic<uint64_t>* direct_bytes_read = nullptr;
};

// The regular file open at `fd` (`size` bytes when opened; `path` names it
// in errors), for reading; it closes `fd` and `direct_fd` (the same file
// opened with O_DIRECT, or -1) when destroyed.
std::unique_ptr<ReadableFile> NewFileReadableFile(int fd, int direct_fd,
                                                  const FileReadOptions& options,
                                                  std::string path,
                                                  uint64_t size);

}  // namespace cairn::internal_storage

#endif  // CAIRN_STORAGE_FILE_INTERNAL_H_
