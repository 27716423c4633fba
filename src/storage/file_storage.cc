// The local file backend.
//
// WriteAtomically(name, contents) is the commit primitive of a checkpoint
// (metadata.json). Its durability steps, in order:
//
//   1. Validate `name` and create its parent directories inside the location
//      (each new directory is recorded so that Sync() makes its entry
//      durable).
//   2. Create `<name>.tmp-<pid>-<random>` in the same directory as `name`
//      with O_CREAT|O_EXCL, so two writers never share a temporary file and
//      the later rename never crosses filesystems.
//   3. Write all of `contents` to it.
//   4. fsync the temporary file: its bytes are on disk before any name points
//      at them.
//   5. close it, checking the result (NFS reports write errors at close).
//   6. rename it over `name`: atomic, so readers see the old file (or none)
//      or the complete new one, never a mix.
//   7. fsync the directory holding `name`: the rename itself survives a
//      crash.
//   CreateAtomically takes the same steps, but step 6 is linkat(2) of the
//   temporary file to `name` (which fails with EEXIST rather than replace
//   anything), then unlinking the temporary name.
//   If any step before 6 fails, the temporary file is unlinked (best effort)
//   and `name` is untouched.
//
// Data files (Create / WriteAt / Finish): opened with O_DIRECT when
// StorageOptions::direct_io is set and the filesystem accepts it (tmpfs
// before Linux 6.6 answers EINVAL: we fall back to buffered IO and report
// alignment 1).
// Reserve(size) = fallocate(size) (none where the filesystem lacks it): the
// writes then stay inside the file's size, which ext4 and XFS run in
// parallel under a shared inode lock, where O_DIRECT writes that extend the
// file take it exclusively, one at a time.
// Finish(size) = ftruncate(size) to cut alignment padding, fdatasync, close.
// Directory entries of created and removed files become durable at Sync().
// Reads (OpenForRead's files: the page cache, O_DIRECT, mapped views) are
// file_read.cc's; file_internal.h is what the two share.
//
// Every name passes internal_format::ValidateRelativeName before any syscall
// and is then opened component by component from the location's root with
// O_NOFOLLOW (OpenParent), so no symbolic link below the root is followed:
// Create is O_CREAT|O_EXCL (nothing existing is truncated or written
// through), readers open with O_NONBLOCK and refuse anything but a regular
// file (a planted FIFO cannot block them), and Remove/rename act on the
// entries themselves. Writes check RLIMIT_FSIZE first: past it the kernel
// would kill the process with SIGXFSZ rather than fail the write. TryLock
// is flock(2) on a file of the location. Every errno becomes a Status in
// internal_core::StatusFromErrno; every file descriptor is opened with
// O_CLOEXEC.
#include "storage/file_storage.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "core/checked.h"
#include "core/status.h"
#include "format/names.h"
#include "storage/file_internal.h"

namespace cairn::internal_storage {
namespace {

using internal_core::StatusFromErrno;

// fsync of a directory: makes entries created, renamed or removed in it
// durable.
absl::Status SyncDirectory(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return StatusFromErrno(errno, "open directory", path);
  absl::Status status;
  // Some filesystems cannot fsync a directory and say EINVAL; their entries
  // are as durable as they will ever be.
  if (::fsync(fd) != 0 && errno != EINVAL) {
    status = StatusFromErrno(errno, "fsync directory", path);
  }
  absl::Status closed = CloseFd(fd, path);
  return status.ok() ? closed : status;
}

// Writes all of `data` at `offset`, handling short writes and EINTR.
absl::Status PwriteAll(int fd, const std::string& path, uint64_t offset,
                       const std::byte* data, size_t size) {
  while (size > 0) {
    const size_t chunk = std::min(size, kMaxIoChunk);
    const ssize_t n = ::pwrite(fd, data, chunk, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return StatusFromErrno(
          errno, absl::StrFormat("pwrite %d bytes at offset %d", chunk, offset),
          path);
    }
    if (n == 0) {
      // No progress and no errno: the device is full in all but name.
      return StatusFromErrno(
          ENOSPC,
          absl::StrFormat("pwrite %d bytes at offset %d (wrote 0)", chunk,
                          offset),
          path);
    }
    data += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// A random 64-bit value for temporary names: unique across threads and
// processes sharing a pid namespace.
uint64_t RandomU64() {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng([] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd();
  }());
  return rng() ^ counter.fetch_add(0x9e3779b97f4a7c15ULL);
}

// A file descriptor, closed when this goes out of scope.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

// What a non-regular entry is, for errors.
std::string_view KindOf(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  return "not a regular file";
}

// The error for an entry of the location that is not what cairn may use.
absl::Status NotPlain(std::string_view path, std::string_view kind,
                      std::string_view want) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "%s is %s, not %s: cairn never follows links inside a checkpoint and "
      "opens only regular files there",
      path, kind, want));
}

// After `openat(dir, name, ... | O_NOFOLLOW)` failed with `err`: the
// error, naming what the entry is when that is why (O_NOFOLLOW on a link
// says ELOOP, O_DIRECTORY on anything else ENOTDIR).
absl::Status OpenError(int dir, const char* name, int err,
                       std::string_view operation, const std::string& path,
                       std::string_view want) {
  if (err == ELOOP || err == ENOTDIR || err == ENXIO) {
    struct stat st;
    // A regular file where a directory was wanted is simply not that
    // directory (kNotFound, as ENOTDIR); anything else is named.
    if (::fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
        !S_ISREG(st.st_mode)) {
      return NotPlain(path, KindOf(st.st_mode), want);
    }
  }
  return StatusFromErrno(err, operation, path);
}

// kResourceExhausted when a file of `size` bytes would pass this process's
// file size limit (RLIMIT_FSIZE, `ulimit -f`): past it the kernel kills
// the writer with SIGXFSZ instead of failing the write, so a save checks
// before it writes rather than die.
absl::Status CheckFileSizeLimit(uint64_t size, const std::string& path) {
  struct rlimit limit;
  if (::getrlimit(RLIMIT_FSIZE, &limit) != 0 ||
      limit.rlim_cur == RLIM_INFINITY || size <= limit.rlim_cur) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrFormat(
      "%s: writing %d bytes would pass this process's file size limit of %d "
      "bytes (RLIMIT_FSIZE, ulimit -f)",
      path, size, static_cast<uint64_t>(limit.rlim_cur)));
}

class FileWritableFile final : public WritableFile {
 public:
  FileWritableFile(int fd, std::string path, size_t alignment)
      : fd_(fd), path_(std::move(path)), alignment_(alignment) {}

  ~FileWritableFile() override {
    if (fd_ >= 0) (void)CloseFd(fd_, path_);
  }

  size_t alignment() const override { return alignment_; }

  absl::Status WriteAt(uint64_t offset,
                       std::span<const std::byte> data) override {
    if (fd_ < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("WriteAt on finished file ", path_));
    }
    if (alignment_ > 1) {
      const auto address = reinterpret_cast<uintptr_t>(data.data());
      if (offset % alignment_ != 0 || data.size() % alignment_ != 0 ||
          address % alignment_ != 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "WriteAt %s: offset %d, length %d and buffer address %#x must be "
            "multiples of %d (O_DIRECT)",
            path_, offset, data.size(), address, alignment_));
      }
    }
    uint64_t end;
    if (__builtin_add_overflow(offset, data.size(), &end)) end = UINT64_MAX;
    CAIRN_RETURN_IF_ERROR(CheckFileSizeLimit(end, path_));
    return PwriteAll(fd_, path_, offset, data.data(), data.size());
  }

  absl::Status Reserve(uint64_t size) override {
    if (fd_ < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("Reserve on finished file ", path_));
    }
    if (size == 0) return absl::OkStatus();
    if (size > static_cast<uint64_t>(std::numeric_limits<off_t>::max())) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Reserve %s: size %d too large", path_, size));
    }
    CAIRN_RETURN_IF_ERROR(CheckFileSizeLimit(size, path_));
    int rc;
    do {
      rc = ::fallocate(fd_, 0, 0, static_cast<off_t>(size));
    } while (rc != 0 && errno == EINTR);
    if (rc == 0) return absl::OkStatus();
    // A filesystem without fallocate: the writes allocate as they go.
    if (errno == EOPNOTSUPP || errno == ENOSYS) return absl::OkStatus();
    return StatusFromErrno(errno, absl::StrCat("fallocate ", size, " bytes"),
                           path_);
  }

  absl::Status Finish(uint64_t size) override {
    if (fd_ < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("Finish called twice on ", path_));
    }
    const int fd = std::exchange(fd_, -1);
    absl::Status status =
        size > static_cast<uint64_t>(std::numeric_limits<off_t>::max())
            ? absl::InvalidArgumentError(
                  absl::StrFormat("Finish %s: size %d too large", path_, size))
            : CheckFileSizeLimit(size, path_);
    if (!status.ok()) {
      // Reported below, after closing.
    } else if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      status =
          StatusFromErrno(errno, absl::StrCat("ftruncate to ", size), path_);
    } else if (::fdatasync(fd) != 0) {
      status = StatusFromErrno(errno, "fdatasync", path_);
    }
    absl::Status closed = CloseFd(fd, path_);
    return status.ok() ? closed : status;
  }

 private:
  int fd_;
  const std::string path_;
  const size_t alignment_;
};

class FileStorage final : public Storage {
 public:
  FileStorage(std::string url, std::string root, const StorageOptions& options,
              const FileStorageTestOptions& test_options = {})
      : url_(std::move(url)),
        root_(std::move(root)),
        options_(options),
        test_options_(test_options) {}

  std::string url() const override { return url_; }

  absl::Status CreateLocation() override { return MakeDirectories(root_); }

  absl::StatusOr<std::unique_ptr<WritableFile>> Create(
      std::string_view name) override {
    CAIRN_ASSIGN_OR_RETURN(Parent parent, OpenParent(name, /*create=*/true));
    const std::string path = PathOf(name);
    // O_EXCL: an existing entry of that name (a file, or a link to one
    // anywhere) is never truncated or written through.
    const int base_flags =
        O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    auto created = [&](int flags) {
      int fd;
      do {
        fd = ::openat(parent.dir.get(), parent.last.c_str(), flags, 0644);
      } while (fd < 0 && errno == EINTR);
      return fd;
    };
    auto failed = [&](int err) -> absl::Status {
      if (err == EEXIST) {
        struct stat st;
        if (::fstatat(parent.dir.get(), parent.last.c_str(), &st,
                      AT_SYMLINK_NOFOLLOW) == 0 &&
            !S_ISREG(st.st_mode)) {
          return NotPlain(path, KindOf(st.st_mode), "a file cairn may create");
        }
      }
      return StatusFromErrno(err, "create", path);
    };
    if (options_.direct_io && direct_io_supported_.load()) {
      int fd = -1;
      if (test_options_.refuse_direct_io) {
        errno = EINVAL;
      } else {
        fd = created(base_flags | O_DIRECT);
      }
      if (fd >= 0) {
        MarkDirty(DirName(path));
        return std::make_unique<FileWritableFile>(fd, path, kDirectIoAlignment);
      }
      if (errno != EINVAL) return failed(errno);
      // The filesystem refuses O_DIRECT (old tmpfs): buffered from now on.
      direct_io_supported_.store(false);
    }
    const int fd = created(base_flags);
    if (fd < 0) return failed(errno);
    MarkDirty(DirName(path));
    return std::make_unique<FileWritableFile>(fd, path, 1);
  }

  absl::Status WriteAtomically(std::string_view name,
                               std::string_view contents) override {
    return WriteThroughTemporary(name, contents, /*replace=*/true);
  }

  absl::Status CreateAtomically(std::string_view name,
                                std::string_view contents) override {
    return WriteThroughTemporary(name, contents, /*replace=*/false);
  }

  // WriteAtomically's steps; without `replace`, step 6 links the temporary
  // file in (linkat never replaces an entry: EEXIST) and then unlinks it.
  absl::Status WriteThroughTemporary(std::string_view name,
                                     std::string_view contents, bool replace) {
    // Step 1.
    CAIRN_ASSIGN_OR_RETURN(Parent parent, OpenParent(name, /*create=*/true));
    const std::string path = PathOf(name);
    CAIRN_RETURN_IF_ERROR(CheckFileSizeLimit(contents.size(), path));
    // Step 2.
    const std::string temp_last = absl::StrFormat(
        "%s.tmp-%d-%016x", parent.last, ::getpid(), RandomU64());
    const std::string temp = absl::StrCat(DirName(path), "/", temp_last);
    int fd;
    do {
      fd = ::openat(parent.dir.get(), temp_last.c_str(),
                    O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return StatusFromErrno(errno, "create", temp);
    // Steps 3-5.
    absl::Status status = PwriteAll(
        fd, temp, 0, reinterpret_cast<const std::byte*>(contents.data()),
        contents.size());
    if (status.ok() && ::fsync(fd) != 0) {
      status = StatusFromErrno(errno, "fsync", temp);
    }
    absl::Status closed = CloseFd(fd, temp);
    if (status.ok()) status = closed;
    // Step 6: renameat replaces the entry `name` itself, never what a link
    // there points at.
    if (status.ok() && replace &&
        ::renameat(parent.dir.get(), temp_last.c_str(), parent.dir.get(),
                   parent.last.c_str()) != 0) {
      status =
          StatusFromErrno(errno, absl::StrCat("rename ", temp, " to"), path);
    }
    if (status.ok() && !replace) {
      if (::linkat(parent.dir.get(), temp_last.c_str(), parent.dir.get(),
                   parent.last.c_str(), 0) != 0) {
        status = errno == EEXIST
                     ? absl::AlreadyExistsError(absl::StrFormat(
                           "%s already exists; not replaced", path))
                     : StatusFromErrno(errno,
                                       absl::StrCat("link ", temp, " to"), path);
      }
      (void)::unlinkat(parent.dir.get(), temp_last.c_str(), 0);
    }
    if (!status.ok()) {
      (void)::unlinkat(parent.dir.get(), temp_last.c_str(), 0);
      return status;
    }
    // Step 7.
    if (::fsync(parent.dir.get()) != 0 && errno != EINVAL) {
      return StatusFromErrno(errno, "fsync directory", DirName(path));
    }
    return absl::OkStatus();
  }

  absl::Status Remove(std::string_view name) override {
    absl::StatusOr<Parent> parent = OpenParent(name, /*create=*/false);
    if (absl::IsNotFound(parent.status())) return absl::OkStatus();
    CAIRN_RETURN_IF_ERROR(parent.status());
    const std::string path = PathOf(name);
    // unlinkat removes a link itself, never its target.
    if (::unlinkat(parent->dir.get(), parent->last.c_str(), 0) != 0) {
      if (errno == ENOENT) return absl::OkStatus();
      return StatusFromErrno(errno, "unlink", path);
    }
    MarkDirty(DirName(path));
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    std::set<std::string> dirs;
    {
      absl::MutexLock lock(&mu_);
      dirs.swap(dirty_dirs_);
    }
    dirs.insert(root_);
    absl::Status status;
    for (const std::string& dir : dirs) {
      absl::Status s = SyncDirectory(dir);
      if (!s.ok() && status.ok()) status = s;
    }
    if (!status.ok()) {
      // Not durable yet: let the next Sync try again.
      absl::MutexLock lock(&mu_);
      dirty_dirs_.insert(dirs.begin(), dirs.end());
    }
    return status;
  }

  absl::StatusOr<std::vector<std::string>> List() override {
    std::vector<std::string> names;
    CAIRN_RETURN_IF_ERROR(ListDirectory(root_, "", names));
    std::sort(names.begin(), names.end());
    return names;
  }

  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(
      std::string_view name) override {
    CAIRN_ASSIGN_OR_RETURN(Parent parent, OpenParent(name, /*create=*/false));
    const std::string path = PathOf(name);
    // O_NONBLOCK: a FIFO planted in place of a file would otherwise block
    // this open until some writer came; it is refused below instead.
    auto open_file = [&](int extra) {
      int fd;
      do {
        fd = ::openat(parent.dir.get(), parent.last.c_str(),
                      O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | extra);
      } while (fd < 0 && errno == EINTR);
      return fd;
    };
    Fd fd(open_file(0));
    if (fd.get() < 0) {
      return OpenError(parent.dir.get(), parent.last.c_str(), errno, "open",
                       path, "a regular file");
    }
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) return StatusFromErrno(errno, "fstat", path);
    if (!S_ISREG(st.st_mode)) {
      return NotPlain(path, KindOf(st.st_mode), "a regular file");
    }
    // Reads of a regular file never block; the flag goes all the same.
    (void)::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
    // A second descriptor for direct reads, where allowed (best effort:
    // without it every read is buffered), of the same file: the name may
    // have been replaced since the first open.
    int direct_fd = -1;
    if (options_.direct_io && direct_io_supported_.load() &&
        !test_options_.refuse_direct_io) {
      Fd direct(open_file(O_DIRECT));
      struct stat dst;
      if (direct.get() >= 0 && ::fstat(direct.get(), &dst) == 0 &&
          dst.st_dev == st.st_dev && dst.st_ino == st.st_ino) {
        (void)::fcntl(direct.get(), F_SETFL,
                      ::fcntl(direct.get(), F_GETFL) & ~O_NONBLOCK);
        direct_fd = direct.release();
      }
    }
    FileReadOptions read_options;
    read_options.copy_mapped = options_.map_cached_reads;
    read_options.cachestat = !test_options_.probe_cache_with_mincore;
    read_options.direct_bytes_read = test_options_.direct_bytes_read;
    if (test_options_.view_release_batch > 0) {
      read_options.release_batch = test_options_.view_release_batch;
    }
    return NewFileReadableFile(
        fd.release(), direct_fd, read_options, path,
        static_cast<uint64_t>(st.st_size));
  }

  absl::StatusOr<bool> Exists(std::string_view name) override {
    absl::StatusOr<Parent> parent = OpenParent(name, /*create=*/false);
    if (absl::IsNotFound(parent.status())) return false;
    CAIRN_RETURN_IF_ERROR(parent.status());
    const std::string path = PathOf(name);
    struct stat st;
    if (::fstatat(parent->dir.get(), parent->last.c_str(), &st,
                  AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return false;
      return StatusFromErrno(errno, "stat", path);
    }
    if (!S_ISREG(st.st_mode)) {
      return NotPlain(path, KindOf(st.st_mode), "a regular file");
    }
    return true;
  }

  absl::StatusOr<std::unique_ptr<Lock>> TryLock(
      std::string_view name) override {
    CAIRN_ASSIGN_OR_RETURN(Parent parent, OpenParent(name, /*create=*/true));
    const std::string path = PathOf(name);
    int raw;
    do {
      raw = ::openat(parent.dir.get(), parent.last.c_str(),
                     O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC,
                     0644);
    } while (raw < 0 && errno == EINTR);
    if (raw < 0) {
      return OpenError(parent.dir.get(), parent.last.c_str(), errno,
                       "open lock file", path, "a regular file");
    }
    Fd fd(raw);
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) return StatusFromErrno(errno, "fstat", path);
    if (!S_ISREG(st.st_mode)) {
      return NotPlain(path, KindOf(st.st_mode), "a regular file");
    }
    MarkDirty(DirName(path));
    int rc;
    do {
      rc = ::flock(fd.get(), LOCK_EX | LOCK_NB);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      if (errno != EWOULDBLOCK) return StatusFromErrno(errno, "flock", path);
      // The holder wrote who it is (below); best effort.
      char holder[128] = {};
      const ssize_t n = ::pread(fd.get(), holder, sizeof(holder) - 1, 0);
      std::string who(holder, n > 0 ? static_cast<size_t>(n) : 0);
      who = who.substr(0, who.find('\n'));
      return absl::AbortedError(absl::StrFormat(
          "%s is locked by another save (%s): only one save into a location "
          "runs at a time",
          path, who.empty() ? "holder unknown" : absl::CEscape(who)));
    }
    // Who holds it, for the error another saver will see. The lock does
    // not depend on it: flock is released when the holder exits, however
    // it exits.
    char host[256] = {};
    (void)::gethostname(host, sizeof(host) - 1);
    const std::string who =
        absl::StrFormat("process %d on %s\n", ::getpid(), host);
    if (::ftruncate(fd.get(), 0) == 0) {
      (void)::pwrite(fd.get(), who.data(), who.size(), 0);
    }
    return std::unique_ptr<Lock>(new FileLock(std::move(fd)));
  }

 private:
  class FileLock final : public Lock {
   public:
    explicit FileLock(Fd fd) : fd_(std::move(fd)) {}
    // Closing the descriptor releases the lock.

   private:
    Fd fd_;
  };

  // The directory holding a name's last component, opened.
  struct Parent {
    Fd dir;
    std::string last;
  };

  // Opens the directory inside the location that holds `name`, following
  // no symbolic link below the location's root (the root itself is the
  // caller's path and may be one): each component is opened relative to
  // the one before with O_NOFOLLOW. With `create`, missing directories are
  // made (each marks its parent dirty); without, a missing one is
  // kNotFound.
  absl::StatusOr<Parent> OpenParent(std::string_view name, bool create) {
    CAIRN_RETURN_IF_ERROR(internal_format::ValidateRelativeName(name));
    int raw;
    do {
      raw = ::open(root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    } while (raw < 0 && errno == EINTR);
    if (raw < 0) return StatusFromErrno(errno, "open directory", root_);
    Parent parent{Fd(raw), ""};
    std::string path = root_ == "/" ? "" : root_;
    size_t start = 0;
    while (true) {
      const size_t slash = name.find('/', start);
      if (slash == std::string_view::npos) {
        parent.last = std::string(name.substr(start));
        return parent;
      }
      const std::string component(name.substr(start, slash - start));
      const std::string dir_path = absl::StrCat(path, "/", component);
      auto open_dir = [&] {
        int fd;
        do {
          fd = ::openat(parent.dir.get(), component.c_str(),
                        O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        } while (fd < 0 && errno == EINTR);
        return fd;
      };
      int fd = open_dir();
      if (fd < 0 && errno == ENOENT && create) {
        if (::mkdirat(parent.dir.get(), component.c_str(), 0755) == 0) {
          MarkDirty(path.empty() ? "/" : path);
        } else if (errno != EEXIST) {
          return StatusFromErrno(errno, "mkdir", dir_path);
        }
        fd = open_dir();
      }
      if (fd < 0) {
        return OpenError(parent.dir.get(), component.c_str(), errno,
                         "open directory", dir_path, "a directory");
      }
      parent.dir = Fd(fd);
      path = dir_path;
      start = slash + 1;
    }
  }

  std::string PathOf(std::string_view name) const {
    return absl::StrFormat("%s/%s", root_ == "/" ? "" : root_, name);
  }

  void MarkDirty(std::string dir) {
    absl::MutexLock lock(&mu_);
    dirty_dirs_.insert(std::move(dir));
  }

  // mkdir -p `path`. Each directory created marks its parent dirty.
  absl::Status MakeDirectories(const std::string& path) {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) return absl::OkStatus();
      return StatusFromErrno(ENOTDIR, "mkdir", path);
    }
    if (errno != ENOENT) return StatusFromErrno(errno, "stat", path);
    const std::string parent = DirName(path);
    if (parent != path) CAIRN_RETURN_IF_ERROR(MakeDirectories(parent));
    if (::mkdir(path.c_str(), 0755) != 0) {
      if (errno == EEXIST && ::stat(path.c_str(), &st) == 0 &&
          S_ISDIR(st.st_mode)) {
        return absl::OkStatus();  // Created concurrently.
      }
      return StatusFromErrno(errno, "mkdir", path);
    }
    MarkDirty(parent);
    return absl::OkStatus();
  }

  // Appends the regular files under `dir` to `names`, as `prefix` + relative
  // name. Symbolic links are not followed.
  absl::Status ListDirectory(const std::string& dir, const std::string& prefix,
                             std::vector<std::string>& names) {
    int fd;
    do {
      fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return StatusFromErrno(errno, "open directory", dir);
    DIR* d = ::fdopendir(fd);
    if (d == nullptr) {
      absl::Status status = StatusFromErrno(errno, "fdopendir", dir);
      (void)CloseFd(fd, dir);
      return status;
    }
    std::vector<std::string> subdirs;
    absl::Status status;
    while (true) {
      errno = 0;
      struct dirent* entry = ::readdir(d);
      if (entry == nullptr) {
        if (errno != 0) status = StatusFromErrno(errno, "readdir", dir);
        break;
      }
      const std::string_view entry_name = entry->d_name;
      if (entry_name == "." || entry_name == "..") continue;
      unsigned char type = entry->d_type;
      if (type == DT_UNKNOWN) {
        struct stat st;
        if (::fstatat(fd, entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
          if (errno == ENOENT) continue;  // Removed while listing.
          status = StatusFromErrno(errno, "stat",
                                   absl::StrFormat("%s/%s", dir, entry_name));
          break;
        }
        type = S_ISREG(st.st_mode)   ? DT_REG
               : S_ISDIR(st.st_mode) ? DT_DIR
                                     : DT_UNKNOWN;
      }
      if (type == DT_REG) {
        names.push_back(prefix + std::string(entry_name));
      } else if (type == DT_DIR) {
        subdirs.emplace_back(entry_name);
      }
    }
    ::closedir(d);  // Also closes fd.
    if (!status.ok()) return status;
    for (const std::string& sub : subdirs) {
      absl::Status s = ListDirectory(absl::StrCat(dir, "/", sub),
                                     absl::StrCat(prefix, sub, "/"), names);
      // A subdirectory removed while listing simply has no files.
      if (!s.ok() && !absl::IsNotFound(s)) return s;
    }
    return absl::OkStatus();
  }

  const std::string url_;
  const std::string root_;  // Absolute, no trailing '/' (unless "/").
  const StorageOptions options_;
  const FileStorageTestOptions test_options_;
  std::atomic<bool> direct_io_supported_{true};
  absl::Mutex mu_;
  // Directories whose entries changed since the last Sync().
  std::set<std::string> dirty_dirs_ ABSL_GUARDED_BY(mu_);
};

// Decodes %XX escapes of a file URL's path.
absl::StatusOr<std::string> PercentDecode(std::string_view in,
                                          std::string_view url) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out.push_back(in[i]);
      continue;
    }
    if (i + 2 >= in.size() || hex(in[i + 1]) < 0 || hex(in[i + 2]) < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("bad percent escape in URL \"%s\"", url));
    }
    out.push_back(static_cast<char>(hex(in[i + 1]) * 16 + hex(in[i + 2])));
    i += 2;
  }
  return out;
}

// `path` made absolute and without trailing slashes.
absl::StatusOr<std::string> ResolvePath(std::string path) {
  if (path.empty()) {
    return absl::InvalidArgumentError("empty storage path");
  }
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "storage path \"", absl::CEscape(path), "\" contains a NUL character"));
  }
  if (path[0] != '/') {
    // Resolved now, so that a later chdir() does not move the checkpoint.
    std::string cwd(4096, '\0');
    while (::getcwd(cwd.data(), cwd.size()) == nullptr) {
      if (errno != ERANGE) return StatusFromErrno(errno, "getcwd", path);
      cwd.resize(cwd.size() * 2);
    }
    cwd.resize(std::strlen(cwd.c_str()));
    path = absl::StrCat(cwd == "/" ? "" : cwd, "/", path);
  }
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

// The local path a "file" URL or a bare path names.
absl::StatusOr<std::string> PathFromUrl(std::string_view url) {
  std::string path;
  constexpr std::string_view kScheme = "file://";
  std::string head(url.substr(0, kScheme.size()));
  for (char& c : head) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (head == kScheme) {  // Schemes are case-insensitive (RFC 3986).
    std::string_view rest = url.substr(kScheme.size());
    constexpr std::string_view kLocalhost = "localhost";
    if (rest.substr(0, kLocalhost.size()) == kLocalhost) {
      rest.remove_prefix(kLocalhost.size());
    }
    if (rest.empty() || rest[0] != '/') {
      return absl::InvalidArgumentError(absl::StrFormat(
          "file URL \"%s\" must name an absolute path on this host "
          "(file:///abs/path)",
          url));
    }
    if (rest.find_first_of("?#") != std::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "file URL \"%s\" has a query or fragment; escape '?' and '#' as "
          "%%3F and %%23",
          url));
    }
    CAIRN_ASSIGN_OR_RETURN(path, PercentDecode(rest, url));
  } else {
    path = std::string(url);
  }
  return ResolvePath(std::move(path));
}

absl::StatusOr<std::unique_ptr<Storage>> OpenFileUrl(
    std::string_view url, const StorageOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(std::string path, PathFromUrl(url));
  return std::make_unique<FileStorage>(std::string(url), std::move(path),
                                       options);
}

}  // namespace

bool IsLocalUrl(std::string_view url) {
  const size_t scheme = url.find("://");
  return scheme == std::string_view::npos ||
         absl::AsciiStrToLower(std::string(url.substr(0, scheme))) == "file";
}

absl::StatusOr<std::string> LocalPathOf(std::string_view url) {
  if (!IsLocalUrl(url)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "\"%s\" is not a local path or file:// URL", url));
  }
  return PathFromUrl(url);
}

absl::StatusOr<std::unique_ptr<Storage>> OpenFileStorage(
    std::string path, const StorageOptions& options) {
  std::string url = path;
  CAIRN_ASSIGN_OR_RETURN(std::string resolved, ResolvePath(std::move(path)));
  return std::make_unique<FileStorage>(std::move(url), std::move(resolved),
                                       options);
}

absl::StatusOr<std::unique_ptr<Storage>> OpenFileStorageForTesting(
    std::string path, const StorageOptions& options,
    const FileStorageTestOptions& test_options) {
  std::string url = path;
  CAIRN_ASSIGN_OR_RETURN(std::string resolved, ResolvePath(std::move(path)));
  return std::make_unique<FileStorage>(std::move(url), std::move(resolved),
                                       options, test_options);
}

void RegisterFileStorage() {
  static std::once_flag once;
  std::call_once(once, [] { Storage::RegisterScheme("file", OpenFileUrl); });
}

namespace {
// Registration when this object file is linked in; Storage::Open also calls
// RegisterFileStorage() since a static library may drop this file's
// initialisers.
[[maybe_unused]] const bool kRegistered = [] {
  RegisterFileStorage();
  return true;
}();
}  // namespace

}  // namespace cairn::internal_storage
