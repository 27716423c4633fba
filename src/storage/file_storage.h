// The local file backend: URLs "/abs/path" and "file:///abs/path".
//
// Data files are opened with O_DIRECT when StorageOptions::direct_io is set
// and the filesystem accepts it (tmpfs before Linux 6.6 does not: then
// buffered writes plus fdatasync in Finish). Reads are positional pread()
// calls, or copies out of a mapping of page-cached ranges (file_read.cc).
// See file_storage.cc for the durability steps of WriteAtomically.
#ifndef CAIRN_STORAGE_FILE_STORAGE_H_
#define CAIRN_STORAGE_FILE_STORAGE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "cairn/storage.h"

namespace cairn::internal_storage {

// Opens the directory `path` (absolute or relative; not created).
absl::StatusOr<std::unique_ptr<Storage>> OpenFileStorage(
    std::string path, const StorageOptions& options);

// Whether `url` names local files: a bare path, or a URL whose scheme is
// "file" (in any case). The one test of it every caller makes.
bool IsLocalUrl(std::string_view url);

// The absolute local path (no trailing slash) that a "file" URL or a bare
// path names, percent-decoded; kInvalidArgument for another scheme or a
// malformed URL.
absl::StatusOr<std::string> LocalPathOf(std::string_view url);

// Test seams of the file backend; production code never sets them.
struct FileStorageTestOptions {
  // Create's open(O_DIRECT) fails with EINVAL without being tried, as on a
  // filesystem that refuses O_DIRECT (tmpfs before Linux 6.6; since 6.6
  // tmpfs accepts it, so /dev/shm no longer exercises the fallback).
  bool refuse_direct_io = false;
  // Whether file pages are cached is asked of mincore() only, as on a
  // kernel without cachestat(2) (before 6.5).
  bool probe_cache_with_mincore = false;
  // Ended views' pages are unmapped once this many bytes of them wait
  // (0: the default, 8 MiB).
  uint64_t view_release_batch = 0;
  // When set, counts the bytes that the storage's files read with O_DIRECT.
  std::atomic<uint64_t>* direct_bytes_read = nullptr;
};
absl::StatusOr<std::unique_ptr<Storage>> OpenFileStorageForTesting(
    std::string path, const StorageOptions& options,
    const FileStorageTestOptions& test_options);

// Registers the "file" scheme (and bare paths) with Storage::Open. Called by
// Storage::Open itself, so that the backend is linked in even from the static
// library; idempotent.
void RegisterFileStorage();

}  // namespace cairn::internal_storage

#endif  // CAIRN_STORAGE_FILE_STORAGE_H_
