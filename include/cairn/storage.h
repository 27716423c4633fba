// Storage: where one checkpoint's files live, reached by URL.
//
//   /abs/path or file:///abs/path   the local file backend (POSIX files)
//   s3://bucket/prefix              S3 and S3-compatible object stores
//                                   (StorageOptions::s3; docs/format.md,
//                                   "Object storage")
//
// The interface is narrow and byte-oriented: create a file and write it at
// positions, read byte ranges, list, remove, and replace a file atomically.
// Buffering, alignment, checksums and fault injection are layers above it.
// A backend registers its URL scheme at the bottom of its own .cc file.
//
// File names are relative to the checkpoint location: one or more plain
// components separated by '/', none empty, "." or "..". A name that breaks
// this rule is kInvalidArgument, so untrusted metadata can never reach a file
// outside the checkpoint. Nor can the location's own entries: the file
// backend follows no symbolic link below the location's root (the root
// itself may be one) and opens only regular files, without blocking, so a
// planted link, FIFO or device is kFailedPrecondition naming it, never a
// file written or read elsewhere and never a hang.
//
// Thread safety: a Storage, and the files it returns, may be used from many
// threads at once; WriteAt calls on one file must target disjoint ranges.
#ifndef CAIRN_STORAGE_H_
#define CAIRN_STORAGE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cairn {

// How to reach an S3-compatible store. Every empty field is taken from the
// environment, as the AWS tools do; what is set here wins.
struct S3Options {
  // "http://127.0.0.1:9000"; else $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL,
  // else https://s3.<region>.amazonaws.com.
  std::string endpoint;
  // Else $AWS_REGION, $AWS_DEFAULT_REGION, else "us-east-1".
  std::string region;
  // Else $AWS_ACCESS_KEY_ID, $AWS_SECRET_ACCESS_KEY, $AWS_SESSION_TOKEN.
  // With no access key, requests go unsigned (a public bucket).
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;
  // kAuto: path style (endpoint/bucket/key) for a custom endpoint,
  // virtual-host style (bucket.endpoint/key) for AWS's own; else
  // $CAIRN_S3_ADDRESSING_STYLE ("path" or "virtual").
  enum class Addressing { kAuto, kPath, kVirtualHost };
  Addressing addressing = Addressing::kAuto;
  // Multipart upload part size (raised to 8 MiB at least, and as far as a
  // file needs to fit S3's 10,000 parts) and the size of the ranges one
  // large read is split into.
  uint64_t part_bytes = 16ull << 20;
  // Requests in flight at once per storage (part uploads, read ranges).
  int threads = 8;
  // Reads smaller than this are served from whole aligned blocks of this
  // size, fetched once and kept per storage (the last 2 x threads of
  // them), so that neighbouring small reads, e.g. a column-split load
  // reading chunk after chunk of one file, cost one request instead of one
  // each. 0: every read is its own request.
  uint64_t read_block_bytes = 4ull << 20;
  // Attempts per request (retried on transport errors, 5xx, 429, SlowDown
  // and short bodies, with exponential backoff and full jitter from
  // retry_base_delay_ms), and the timeouts: connecting, and a transfer
  // that moves no byte for stall_timeout_ms (libcurl averages speed over
  // a few seconds, so a stall is noticed up to ~5 s later than this).
  int max_attempts = 6;
  int retry_base_delay_ms = 100;
  int connect_timeout_ms = 5000;
  int stall_timeout_ms = 30000;
};

struct StorageOptions {
  // Write data files with O_DIRECT where the filesystem allows it (the file
  // then reports an alignment > 1), and read the parts of files that are
  // not in the page cache with O_DIRECT. Default: true.
  bool direct_io = true;
  // Copy ranges that are wholly in the page cache out of a read-only
  // mapping of the file (populated in one call, unmapped right after)
  // instead of with pread, and let loads copy strided slices (column
  // shards) out of such a mapping in place (ReadableFile::ViewIfInMemory);
  // and read ranges that several readers share (ReadAtShared) into the page
  // cache through that mapping, in 2 MiB folios where the kernel can, which
  // makes every later mapping of the file cheaper (a fault per folio).
  // On VMs where the kernel's first write to each page of the destination
  // is expensive this is several times faster; it relies on checkpoint
  // files not being truncated while they are read (another process
  // truncating one then would end this one with SIGBUS, as would a device
  // error re-reading a page evicted between the check and the copy).
  // Default: true.
  bool map_cached_reads = true;
  // For s3:// URLs.
  S3Options s3{};
};

// A file being written. Not durable until Finish() returns OK.
class WritableFile {
 public:
  virtual ~WritableFile() = default;

  // WriteAt's offset, length and buffer address must be multiples of this
  // (1 when there is no constraint).
  virtual size_t alignment() const = 0;

  // Writes all of `data` at `offset`. On failure the file's contents are
  // unspecified. Safe to call from several threads for disjoint ranges.
  virtual absl::Status WriteAt(uint64_t offset,
                               std::span<const std::byte> data) = 0;

  // Says, before the first WriteAt, that the file will be `size` bytes long
  // (alignment padding included), so that the backend can allocate its
  // space at once. Optional; a backend that cannot does nothing (the
  // default). The file backend fallocates: the space is then known to be
  // there before any byte is written (kResourceExhausted naming the file
  // when it is not), and on ext4 and XFS concurrent O_DIRECT writes inside
  // the allocated size run in parallel, where writes past the end of the
  // file are serialised.
  virtual absl::Status Reserve(uint64_t size) { return absl::OkStatus(); }

  // Sets the file size to `size` (cutting alignment padding past it), makes
  // the data durable (fdatasync) and closes the file. Call exactly once, after
  // every WriteAt has returned. Destroying an unfinished file closes it
  // without syncing.
  virtual absl::Status Finish(uint64_t size) = 0;
};

// A file opened for reading.
class ReadableFile {
 public:
  virtual ~ReadableFile() = default;

  // Size in bytes when opened.
  virtual uint64_t size() const = 0;

  // Reads exactly data.size() bytes at `offset` into `data`. kDataLoss naming
  // the file and offset if the file ends first. Thread-safe.
  virtual absl::Status ReadAt(uint64_t offset, std::span<std::byte> data) const = 0;

  // ReadAt into a buffer the caller reuses for many reads (a bounce
  // buffer), whose pages are already mapped and warm: a backend may read
  // differently for it (the file backend lets the kernel copy cached bytes
  // instead of copying them out of a mapping). Default: ReadAt.
  virtual absl::Status ReadAtIntoReusedBuffer(
      uint64_t offset, std::span<std::byte> data) const {
    return ReadAt(offset, data);
  }

  // ReadAt into a reused buffer (as ReadAtIntoReusedBuffer) of a range
  // that other readers, e.g. the other ranks of a load, are likely to read
  // as well: the span of a chunk of which this reader needs only some
  // columns. A backend that can share reads among them should: the file
  // backend reads such a range through the page cache, never O_DIRECT, so
  // the device serves it once however many ranks read it. Default:
  // ReadAtIntoReusedBuffer.
  virtual absl::Status ReadAtShared(uint64_t offset,
                                    std::span<std::byte> data) const {
    return ReadAtIntoReusedBuffer(offset, data);
  }

  // Bytes of the file a reader may use in place, with no copy into a
  // buffer of its own; they stay valid while this object lives.
  class View {
   public:
    virtual ~View() = default;
    virtual std::span<const std::byte> bytes() const = 0;
  };
  // [offset, offset + size) in place when the backend holds those bytes in
  // memory already (the file backend: wholly in the page cache, mapped
  // read-only for the view's lifetime); null when it does not, and from
  // backends that do not override this (the default). A reader that needs
  // only some of a range's bytes (a strided slice) then touches only those,
  // where a read would copy them all. The bytes are the file's as long as
  // nobody truncates or rewrites it meanwhile, which a committed
  // checkpoint's data files never are. Thread-safe.
  virtual std::unique_ptr<View> ViewIfInMemory(uint64_t offset,
                                               uint64_t size) const {
    return nullptr;
  }

  // True when the backend holds all of [offset, offset + size) in memory
  // already (the file backend: in the page cache), so reading it is a copy,
  // with no device to keep busy: the loader then reads on one thread per
  // core rather than LoadOptions::io_threads. A hint, and may be stale by
  // the time of the read. Default: false.
  virtual bool InMemory(uint64_t offset, uint64_t size) const { return false; }
};

class Storage {
 public:
  virtual ~Storage() = default;

  // Opens the checkpoint location at `url` without creating anything.
  // kInvalidArgument for a malformed URL or an unknown scheme.
  static absl::StatusOr<std::unique_ptr<Storage>> Open(
      std::string_view url, const StorageOptions& options = {});

  // Makes `scheme` ("file", "s3", ...) openable by Open. `factory` receives
  // the whole URL. Called by backends at static-initialisation time.
  using Factory = std::function<absl::StatusOr<std::unique_ptr<Storage>>(
      std::string_view url, const StorageOptions& options)>;
  static void RegisterScheme(std::string scheme, Factory factory);

  // The URL this storage was opened from.
  virtual std::string url() const = 0;

  // Creates the location (and missing parents). OK if it exists.
  virtual absl::Status CreateLocation() = 0;

  // Creates `name`, which must not exist (kAlreadyExists naming it: an
  // existing file, or a link, is never truncated or written through), ready
  // for positional writes.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> Create(
      std::string_view name) = 0;

  // Replaces `name` with `contents` atomically and durably: temporary file,
  // fsync, rename over `name`, fsync of the directory. After a crash, `name`
  // holds either its old contents (or is absent) or all of `contents`.
  virtual absl::Status WriteAtomically(std::string_view name,
                                       std::string_view contents) = 0;

  // As WriteAtomically, but only when `name` does not exist: kAlreadyExists
  // naming it when it does, and then nothing is written. A save commits
  // its metadata.json this way, so a committed checkpoint is never
  // replaced by accident (an overwrite un-commits first). The file backend
  // links the synced temporary file into place (link(2) never replaces);
  // object storage sends a conditional PUT (If-None-Match: *). The default
  // checks, then writes: correct without a concurrent writer only.
  virtual absl::Status CreateAtomically(std::string_view name,
                                        std::string_view contents);

  // Removes `name`; OK if it does not exist. Not durable until Sync().
  virtual absl::Status Remove(std::string_view name) = 0;

  // Makes creations, renames and removals in the location durable.
  virtual absl::Status Sync() = 0;

  // Names of all regular files in the location, recursively, sorted.
  // kNotFound if the location does not exist.
  virtual absl::StatusOr<std::vector<std::string>> List() = 0;

  // kNotFound naming the file if it does not exist.
  virtual absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(
      std::string_view name) = 0;

  // Whether `name` exists as a file; kFailedPrecondition naming it when it
  // exists as something else (a link, a FIFO, a directory).
  virtual absl::StatusOr<bool> Exists(std::string_view name) = 0;

  // An exclusive lock, held until the handle is destroyed.
  class Lock {
   public:
    virtual ~Lock() = default;
  };
  // Takes the lock `name` (a file of the location that holds no checkpoint
  // data) without waiting. Held by one holder at a time across threads and
  // processes (the file backend: flock(2) on the file, which the kernel
  // releases when the holder dies, so a crash never leaves it held);
  // kAborted naming the location, and the holder where known, when
  // another holds it. A save holds its location's lock from before it
  // looks at what is there until after it has committed and cleaned up.
  virtual absl::StatusOr<std::unique_ptr<Lock>> TryLock(
      std::string_view name) = 0;

  // Reads all of `name`; kFailedPrecondition if it is larger than
  // `max_bytes`.
  absl::StatusOr<std::string> ReadAll(std::string_view name,
                                      uint64_t max_bytes);
};

}  // namespace cairn

#endif  // CAIRN_STORAGE_H_
