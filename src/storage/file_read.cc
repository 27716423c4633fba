// The file backend's reads (FileReadableFile, made by FileStorage's
// OpenForRead in file_storage.cc): what a read of a cached range copies
// from, when it goes O_DIRECT, and the mapped views of cached ranges that
// loads copy strided slices out of. The comment on the class says how.
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "cairn/storage.h"
#include "core/checked.h"
#include "core/status.h"
#include "storage/file_internal.h"
#include "storage/known_cached.h"

namespace cairn::internal_storage {
namespace {

using internal_core::RoundDown;
using internal_core::RoundUp;
using internal_core::StatusFromErrno;

// madvise(MADV_POPULATE_READ), Linux 5.14; older headers lack the name.
#ifdef MADV_POPULATE_READ
constexpr int kMadvPopulateRead = MADV_POPULATE_READ;
#else
constexpr int kMadvPopulateRead = 22;
#endif

// cachestat(2), Linux 6.5: how many pages of a file range are in the page
// cache, counted over its folios, without mapping anything. Debian 12's
// headers predate it, so the number and structs are declared here (the
// syscall number is the same on every architecture since 4.x's unified
// table).
constexpr long kCachestatSyscall = 451;
struct CachestatRange {
  uint64_t off;
  uint64_t len;
};
struct Cachestat {
  uint64_t nr_cache;
  uint64_t nr_dirty;
  uint64_t nr_writeback;
  uint64_t nr_evicted;
  uint64_t nr_recently_evicted;
};

// Reads. A range wholly in the page cache is copied out of it: with a
// buffered pread when the destination is already faulted in (the common
// case: a model's parameters exist before they are loaded into), else from
// a read-only mapping of the file (MADV_POPULATE_READ maps the range in one
// call, memcpy copies it, MADV_DONTNEED unmaps it again, in batches of 8 MiB
// per file, so the pages count against this process's memory only
// briefly). A view (ViewIfInMemory) is not populated: its reader touches
// only some of its bytes (a column shard), and faulting in what it touches
// maps 16 pages per fault where MADV_POPULATE_READ walks every page one by
// one (a 1/4 column shard of a cached 91 MB model, one thread: 15.7 ms
// against 18.5 ms a load; bench/RESULTS.md, 2026-12-02). The kernel's own
// copy (pread) writes each destination page
// from kernel mode, which on the PVM guests we benchmark on costs a
// hypervisor exit per 4 KiB page the first time; the user-space copy does
// not. Into resident pages the kernel's copy is the
// faster one (no mapping to build and tear down: 12 against 9.4 GB/s for a
// cached 1 GiB file on two threads on such a guest).
// A range not (wholly) cached is read with O_DIRECT straight into the
// caller's buffer, so a cold read neither copies through the page cache nor
// fills it, with as many requests in flight as there are reader threads:
// its 4096-aligned middle, when the destination address has the same
// alignment, with the unaligned head and tail buffered.
// Whether file pages are cached is asked of cachestat(2) (mincore() before
// Linux 6.5), whether destination pages are resident of mincore(); neither
// touches the pages.
class FileReadableFile final : public ReadableFile, public KnownCachedViews {
 public:
  using Options = FileReadOptions;

  // `direct_fd`: the same file opened with O_DIRECT, or -1.
  FileReadableFile(int fd, int direct_fd, const Options& options,
                   std::string path, uint64_t size)
      : fd_(fd),
        direct_fd_(direct_fd),
        copy_mapped_(options.copy_mapped),
        cachestat_(options.cachestat),
        release_batch_(std::max<uint64_t>(options.release_batch, 1)),
        direct_bytes_read_(options.direct_bytes_read),
        path_(std::move(path)),
        size_(size) {
    if ((direct_fd_ >= 0 || copy_mapped_) && size_ > 0) {
      void* map = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
      if (map != MAP_FAILED) map_ = static_cast<unsigned char*>(map);
      // Pages this mapping reads in from the device (ReadAtShared) come
      // in 2 MiB folios where the kernel can (a filesystem with large
      // folios, transparent huge pages not "never"); else this does
      // nothing.
      if (map_ != nullptr && copy_mapped_ && size_ >= kReleaseBlock) {
        (void)::madvise(map_, size_, MADV_HUGEPAGE);
      }
    }
  }

  ~FileReadableFile() override {
    if (map_ != nullptr) ::munmap(map_, size_);
    if (direct_fd_ >= 0) (void)CloseFd(direct_fd_, path_);
    (void)CloseFd(fd_, path_);
  }

  uint64_t size() const override { return size_; }

  absl::Status ReadAt(uint64_t offset,
                      std::span<std::byte> data) const override {
    return Read(offset, data, copy_mapped_);
  }

  // A reused buffer's pages are warm: the kernel's copy costs no more than
  // ours there, and needs no mapping of the source.
  absl::Status ReadAtIntoReusedBuffer(
      uint64_t offset, std::span<std::byte> data) const override {
    return Read(offset, data, /*copy_mapped=*/false);
  }

  // Through the page cache, which holds the bytes for the other readers
  // (and a reader that comes second finds them there, or waits for the
  // first one's read of them, where O_DIRECT would read them again): by
  // populating the mapping (MADV_HUGEPAGE: the device's bytes land in
  // 2 MiB folios) and copying out of it; with a buffered pread when the
  // kernel would not populate (an error pread then reports). Four ranks
  // reading a cold 91 MB model this way, each from another quarter first,
  // took 33-42 ms against 72-83 ms with pread, and mapping it whole later
  // cost 0.1-0.5 ms of system time against 3.5-4 ms (the page cache's
  // folios: small ones cost per 4 KiB page; issue 37).
  absl::Status ReadAtShared(uint64_t offset,
                            std::span<std::byte> data) const override {
    if (copy_mapped_ && data.size() >= kMinMappedBytes) {
      if (std::unique_ptr<View> view =
              MapCached(offset, data.size(), /*populate=*/true,
                        /*known_cached=*/true)) {
        std::memcpy(data.data(), view->bytes().data(), data.size());
        return absl::OkStatus();
      }
    }
    return ReadAll(fd_, offset, data, offset, data.size());
  }

  // The mapping's pages of a wholly cached range, faulted in as they are
  // touched and unmapped again (MADV_DONTNEED; the page cache keeps them)
  // in a batch after the view goes (see ViewEnded), so they count against
  // this process's memory only meanwhile.
  std::unique_ptr<View> ViewIfInMemory(uint64_t offset,
                                       uint64_t size) const override {
    return copy_mapped_ ? MapCached(offset, size, /*populate=*/false)
                        : nullptr;
  }

  std::unique_ptr<View> ViewKnownInMemory(uint64_t offset,
                                          uint64_t size) const override {
    return copy_mapped_ ? MapCached(offset, size, /*populate=*/false,
                                    /*known_cached=*/true)
                        : nullptr;
  }

  // Inside the file, mapped, and wholly in the page cache.
  bool InMemory(uint64_t offset, uint64_t size) const override {
    const uint64_t end = offset + size;
    return map_ != nullptr && end >= offset && end <= size_ &&
           Cached(offset, end);
  }

 private:
  absl::Status Read(uint64_t offset, std::span<std::byte> data,
                    bool copy_mapped) const {
    const uint64_t end = offset + data.size();
    // (MapCached maps nothing smaller than kMinMappedBytes, so a smaller
    // read skips the residency question, a syscall.)
    if (copy_mapped && data.size() >= kMinMappedBytes &&
        !Resident(data.data(), data.size())) {
      if (std::unique_ptr<View> view =
              MapCached(offset, data.size(), /*populate=*/true)) {
        std::memcpy(data.data(), view->bytes().data(), data.size());
        return absl::OkStatus();
      }
    }
    if (direct_fd_ < 0) return ReadAll(fd_, offset, data, offset, data.size());
    const uint64_t a = RoundUp(offset, kDirectIoAlignment);
    const uint64_t b = RoundDown(end, kDirectIoAlignment);
    const auto address = reinterpret_cast<uintptr_t>(data.data()) + (a - offset);
    if (map_ == nullptr || b <= a || b - a < kMinDirectReadBytes ||
        b > size_ || address % kDirectIoAlignment != 0 || Cached(a, b)) {
      return ReadAll(fd_, offset, data, offset, data.size());
    }
    // Head and tail through the page cache, the aligned middle direct.
    CAIRN_RETURN_IF_ERROR(
        ReadAll(fd_, offset, data.first(a - offset), offset, data.size()));
    CAIRN_RETURN_IF_ERROR(ReadAll(direct_fd_, a,
                                  data.subspan(a - offset, b - a), offset,
                                  data.size()));
    if (direct_bytes_read_ != nullptr) *direct_bytes_read_ += b - a;
    return ReadAll(fd_, b, data.subspan(b - offset), offset, data.size());
  }

  // Reads below this size are not worth a device round trip of their own
  // when part of them may be cached.
  static constexpr uint64_t kMinDirectReadBytes = uint64_t{64} << 10;
  // Smaller cached reads take one pread rather than three madvise/memcpy
  // steps. A view of any size is one question (cachestat) and no madvise
  // until its batch is released: a small one saves its reader a bounce
  // buffer (2 MiB of huge page zeroed at its first read).
  static constexpr uint64_t kMinMappedBytes = uint64_t{64} << 10;
  // A view's mapping is released in blocks of this size (the PMD size).
  static constexpr uint64_t kReleaseBlock = uint64_t{2} << 20;

  class MappedView final : public View {
   public:
    // `block`: where its blocks begin in the mapping, `block_end`: where
    // they end.
    MappedView(std::span<const std::byte> bytes, const FileReadableFile* file,
               uint64_t block, uint64_t block_end)
        : bytes_(bytes), file_(file), block_(block), block_end_(block_end) {}
    ~MappedView() override { file_->ViewEnded(block_, block_end_); }
    std::span<const std::byte> bytes() const override { return bytes_; }

   private:
    const std::span<const std::byte> bytes_;
    const FileReadableFile* const file_;
    const uint64_t block_;
    const uint64_t block_end_;
  };

  // [offset, offset + size) of the mapping when it lies inside the file,
  // is worth a mapping (any view; a copy of kMinMappedBytes or more) and
  // is wholly cached; null otherwise. With
  // `populate` (a copy of every byte) its pages are mapped in one call
  // first, and null comes back too when the kernel would not (before
  // 5.14, or a page it could not read: an error pread then reports, where
  // a fault would be SIGBUS). Without, the reader's touches fault them in:
  // a page evicted since the check is read again then, and only a device
  // failing that read ends the process.
  // With `known_cached` the page cache is not asked: the caller has just
  // found the range cached (KnownCachedViews), or `populate` reads it in
  // (ReadAtShared).
  std::unique_ptr<View> MapCached(uint64_t offset, uint64_t size,
                                  bool populate,
                                  bool known_cached = false) const {
    const uint64_t stop = offset + size;
    if (size == 0 || (populate && size < kMinMappedBytes) ||
        (known_cached ? map_ == nullptr || stop < offset || stop > size_
                      : !InMemory(offset, size))) {
      return nullptr;
    }
    const uint64_t end = offset + size;
    const uint64_t page = PageSize();
    const uint64_t begin = RoundDown(offset, page);
    // The view's blocks: whole 2 MiB blocks of the address space, within
    // the mapping. The page cache may hold the file in 2 MiB folios that
    // the populate mapped whole, and unmapping part of one splits it first
    // (a TLB flush, an interprocessor interrupt on every core, which costs
    // a VM exit on a guest).
    const uint64_t at = reinterpret_cast<uintptr_t>(map_);
    const uint64_t block =
        std::max(at, RoundDown(at + begin, kReleaseBlock)) - at;
    const uint64_t block_end =
        std::min(at + RoundUp(size_, page), RoundUp(at + end, kReleaseBlock)) -
        at;
    {
      // In use before it is touched, so that no release takes it back.
      absl::MutexLock lock(&release_mu_);
      live_blocks_.emplace(block, block_end);
    }
    if (populate &&
        ::madvise(map_ + begin, end - begin, kMadvPopulateRead) != 0) {
      ViewEnded(block, block_end);
      return nullptr;
    }
    return std::make_unique<MappedView>(
        std::span<const std::byte>(
            reinterpret_cast<const std::byte*>(map_ + offset), size),
        this, block, block_end);
  }

  // A view of blocks [block, block_end) has ended. Its pages stay mapped
  // (they count in this process's RSS) until release_batch_ bytes of
  // ended views' blocks wait, then go together (the page cache keeps
  // them): every unmapping is a TLB flush on every core, which on a guest
  // cost 15% of a column-resharding load when each view did its own. The
  // blocks of views still in use are skipped, so those keep their mapping;
  // their own end puts them back in the waiting range.
  void ViewEnded(uint64_t block, uint64_t block_end) const {
    absl::MutexLock lock(&release_mu_);
    auto [first, last] = live_blocks_.equal_range(block);
    for (auto it = first; it != last; ++it) {
      if (it->second == block_end) {
        live_blocks_.erase(it);
        break;
      }
    }
    waiting_begin_ = std::min(waiting_begin_, block);
    waiting_end_ = std::max(waiting_end_, block_end);
    if (waiting_end_ - waiting_begin_ < release_batch_) return;
    uint64_t from = waiting_begin_;
    auto release_until = [&](uint64_t until) {
      if (until > from) {
        (void)::madvise(map_ + from, until - from, MADV_DONTNEED);
      }
    };
    for (const auto& [begin, end] : live_blocks_) {
      if (begin >= waiting_end_) break;
      release_until(begin);
      from = std::max(from, end);
    }
    release_until(waiting_end_);
    waiting_begin_ = std::numeric_limits<uint64_t>::max();
    waiting_end_ = 0;
  }

  // True when every page of [begin, end) (inside the file) is in the page
  // cache. cachestat(2) counts them over the cache's folios in one call;
  // mincore() on the (unpopulated) mapping looks up every 4 KiB page, which
  // cost 4.4 ms per cached 256 MiB here against 0.04 ms. A kernel without
  // cachestat (before 6.5, or a seccomp filter refusing it) is asked with
  // mincore() from then on. Either failing says no: the read then goes
  // direct, which is always correct.
  bool Cached(uint64_t begin, uint64_t end) const {
    if (end <= begin) return true;
    static std::atomic<bool> cachestat_works{true};
    if (cachestat_ && cachestat_works.load(std::memory_order_relaxed)) {
      CachestatRange range{begin, end - begin};
      Cachestat stat{};
      if (::syscall(kCachestatSyscall, fd_, &range, &stat, 0) == 0) {
        const uint64_t page = PageSize();
        return stat.nr_cache == (end - 1) / page - begin / page + 1;
      }
      if (errno != ENOSYS && errno != EPERM) return false;
      cachestat_works.store(false, std::memory_order_relaxed);
    }
    return Resident(map_ + begin, end - begin);
  }

  // True when every page of [p, p + len) is resident: for a file mapping,
  // in the page cache; for the caller's (anonymous) memory, already
  // faulted in. mincore() never touches the pages; a failure (e.g. memory
  // it cannot tell about) says no.
  static bool Resident(const void* p, uint64_t len) {
    const uint64_t page = PageSize();
    uint64_t begin = reinterpret_cast<uintptr_t>(p) / page * page;
    const uint64_t end = reinterpret_cast<uintptr_t>(p) + len;
    unsigned char vec[1024];
    while (begin < end) {
      const uint64_t n = std::min<uint64_t>(end - begin, page * sizeof(vec));
      if (::mincore(reinterpret_cast<void*>(begin), n, vec) != 0) return false;
      const uint64_t pages = (n + page - 1) / page;
      for (uint64_t i = 0; i < pages; ++i) {
        if ((vec[i] & 1) == 0) return false;
      }
      begin += n;
    }
    return true;
  }

  // Reads all of `data` from `fd` at `position`; `offset` and `total`
  // describe the caller's whole request, for the error message.
  absl::Status ReadAll(int fd, uint64_t position, std::span<std::byte> data,
                       uint64_t offset, size_t total) const {
    std::byte* out = data.data();
    size_t left = data.size();
    while (left > 0) {
      const size_t chunk = std::min(left, kMaxIoChunk);
      const ssize_t n = ::pread(fd, out, chunk, static_cast<off_t>(position));
      if (n < 0) {
        if (errno == EINTR) continue;
        return StatusFromErrno(
            errno,
            absl::StrFormat("pread %d bytes at offset %d%s", chunk, position,
                            fd == direct_fd_ ? " (O_DIRECT)" : ""),
            path_);
      }
      if (n == 0) {
        return absl::DataLossError(absl::StrFormat(
            "%s ends at offset %d: reading %d bytes at offset %d got only %d "
            "(file size %d when opened)",
            path_, position, total, offset, position - offset, size_));
      }
      out += n;
      left -= static_cast<size_t>(n);
      position += static_cast<uint64_t>(n);
    }
    return absl::OkStatus();
  }

  const int fd_;
  const int direct_fd_;
  const bool copy_mapped_;
  const bool cachestat_;
  const uint64_t release_batch_;
  std::atomic<uint64_t>* const direct_bytes_read_;
  const std::string path_;
  const uint64_t size_;
  // The whole file, mapped read-only: asked by mincore() where cachestat
  // is missing, and its pages mapped only for the range being copied or
  // viewed.
  unsigned char* map_ = nullptr;
  // Views' blocks (offsets in the mapping), for ViewEnded.
  mutable absl::Mutex release_mu_;
  // The blocks of every view in use: first -> end.
  mutable std::multimap<uint64_t, uint64_t> live_blocks_
      ABSL_GUARDED_BY(release_mu_);
  // Ended views' blocks still mapped lie in [waiting_begin_, waiting_end_).
  mutable uint64_t waiting_begin_ ABSL_GUARDED_BY(release_mu_) =
      std::numeric_limits<uint64_t>::max();
  mutable uint64_t waiting_end_ ABSL_GUARDED_BY(release_mu_) = 0;
};

}  // namespace

std::unique_ptr<ReadableFile> NewFileReadableFile(int fd, int direct_fd,
                                                  const FileReadOptions& options,
                                                  std::string path,
                                                  uint64_t size) {
  return std::make_unique<FileReadableFile>(fd, direct_fd, options,
                                            std::move(path), size);
}

}  // namespace cairn::internal_storage
