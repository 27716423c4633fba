// File-backend specifics: URL parsing, O_DIRECT alignment, the scheme
// registry. Behaviour every backend shares is in storage_conformance_test.cc.
#include "storage/file_storage.h"
#include "storage/known_cached.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cairn/storage.h"
#include "core/aligned_buffer.h"
#include "core/checked.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/page_cache_test_util.h"

namespace cairn::internal_storage {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::CachedPages;
using testing_util::DirectIoWorksIn;

class TempDir {
 public:
  explicit TempDir(const std::string& parent = "/tmp") {
    std::string templ = parent + "/cairn-file-storage-test-XXXXXX";
    if (::mkdtemp(templ.data()) != nullptr) path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ReadFileDirectly(const std::string& path) {
  std::string out;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return "<missing>";
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  std::fclose(f);
  return out;
}

// Writes through `url` and checks the bytes landed in `expected_dir`.
void ExpectUrlReaches(const std::string& url, const std::string& expected_dir) {
  SCOPED_TRACE(url);
  auto storage = Storage::Open(url, StorageOptions{.direct_io = false});
  ASSERT_TRUE(storage.ok()) << storage.status();
  EXPECT_EQ((*storage)->url(), url);
  ASSERT_TRUE((*storage)->CreateLocation().ok());
  ASSERT_TRUE((*storage)->WriteAtomically("probe", url).ok());
  EXPECT_EQ(ReadFileDirectly(expected_dir + "/probe"), url);
  ASSERT_TRUE((*storage)->Remove("probe").ok());
}

TEST(FileStorageTest, OpensAbsolutePathsAndFileUrls) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  ExpectUrlReaches(dir.path(), dir.path());
  ExpectUrlReaches(dir.path() + "/", dir.path());
  ExpectUrlReaches("file://" + dir.path(), dir.path());
  ExpectUrlReaches("file://localhost" + dir.path(), dir.path());
  ExpectUrlReaches("FILE://" + dir.path() + "/a/b", dir.path() + "/a/b");
}

TEST(FileStorageTest, FileUrlsArePercentDecoded) {
  TempDir dir;
  ExpectUrlReaches("file://" + dir.path() + "/with%20space%25",
                   dir.path() + "/with space%");
  // A bare path is taken literally.
  ExpectUrlReaches(dir.path() + "/lit%20eral", dir.path() + "/lit%20eral");
}

TEST(FileStorageTest, RelativePathsResolveAgainstTheCurrentDirectory) {
  TempDir dir;
  char old_cwd[4096];
  ASSERT_NE(::getcwd(old_cwd, sizeof(old_cwd)), nullptr);
  ASSERT_EQ(::chdir(dir.path().c_str()), 0);
  auto storage = Storage::Open("rel/ckpt", StorageOptions{.direct_io = false});
  // Resolved at Open: a later chdir does not move the checkpoint.
  ASSERT_EQ(::chdir(old_cwd), 0);
  ASSERT_TRUE(storage.ok()) << storage.status();
  EXPECT_EQ((*storage)->url(), "rel/ckpt");
  ASSERT_TRUE((*storage)->CreateLocation().ok());
  ASSERT_TRUE((*storage)->WriteAtomically("m", "rel").ok());
  EXPECT_EQ(ReadFileDirectly(dir.path() + "/rel/ckpt/m"), "rel");
}

TEST(FileStorageTest, MalformedUrlsAreInvalidArgument) {
  for (const std::string url :
       {"", "file://", "file://relative/path", "file://otherhost/abs",
        "file:///a%2", "file:///a%zz", "file:///a?query", "file:///a#frag",
        "file:///a%00b", "://x", "1s3://bucket"}) {
    auto storage = Storage::Open(url);
    EXPECT_EQ(storage.status().code(), absl::StatusCode::kInvalidArgument)
        << "url \"" << url << "\": " << storage.status();
  }
  auto nul = Storage::Open(std::string("/tmp/a\0b", 8));
  EXPECT_EQ(nul.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FileStorageTest, UnknownSchemeNamesTheRegisteredOnes) {
  auto storage = Storage::Open("gs://bucket/run/step-100");
  EXPECT_EQ(storage.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(storage.status().message(), HasSubstr("\"gs\""));
  EXPECT_THAT(storage.status().message(), HasSubstr("registered schemes"));
  EXPECT_THAT(storage.status().message(), HasSubstr("file"));
  EXPECT_THAT(storage.status().message(), HasSubstr("s3"));
}

TEST(FileStorageTest, RegisterSchemeMakesAUrlOpenable) {
  std::string seen_url;
  Storage::RegisterScheme(
      "cairn-test",
      [&seen_url](std::string_view url, const StorageOptions& options)
          -> absl::StatusOr<std::unique_ptr<Storage>> {
        seen_url = std::string(url);
        return absl::UnimplementedError("test backend");
      });
  auto storage = Storage::Open("cairn-test://bucket/x");
  EXPECT_EQ(storage.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(seen_url, "cairn-test://bucket/x");
  // And it is listed in the unknown-scheme message.
  auto unknown = Storage::Open("nope://x");
  EXPECT_THAT(unknown.status().message(), HasSubstr("cairn-test"));
}

TEST(FileStorageTest, OpenFileStorageTakesAPath) {
  TempDir dir;
  auto storage = OpenFileStorage(dir.path() + "/p", StorageOptions{});
  ASSERT_TRUE(storage.ok()) << storage.status();
  EXPECT_EQ((*storage)->url(), dir.path() + "/p");
  EXPECT_EQ(OpenFileStorage("", StorageOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// With direct_io, a file in `dir` reports alignment 4096 exactly when the
// kernel accepts O_DIRECT there, else 1 (the buffered fallback).
void ExpectAlignmentMatchesKernel(const std::string& dir) {
  const bool supported = DirectIoWorksIn(dir);
  auto storage = Storage::Open(dir, StorageOptions{.direct_io = true});
  ASSERT_TRUE(storage.ok());
  auto file = (*storage)->Create("f");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->alignment(), supported ? 4096u : 1u);
  EXPECT_TRUE((*file)->Finish(0).ok());
}

TEST(FileStorageTest, DirectIoReportsAlignment4096WhereSupported) {
  TempDir dir;
  ExpectAlignmentMatchesKernel(dir.path());
}

TEST(FileStorageTest, BufferedIoReportsAlignment1) {
  TempDir dir;
  auto storage = Storage::Open(dir.path(), StorageOptions{.direct_io = false});
  ASSERT_TRUE(storage.ok());
  auto file = (*storage)->Create("f");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->alignment(), 1u);
  // Any offset, length and address.
  const char text[] = "unaligned";
  EXPECT_TRUE((*file)->WriteAt(3, std::as_bytes(std::span(text, 9))).ok());
  EXPECT_TRUE((*file)->Finish(12).ok());
  EXPECT_EQ(ReadFileDirectly(dir.path() + "/f"),
            std::string("\0\0\0unaligned", 12));
}

// RssFile of this process (file pages mapped), in KiB; -1 if unknown.
int64_t RssFileKiB() {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  int64_t kib = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "RssFile: %ld kB", &kib) == 1) break;
  }
  std::fclose(f);
  return kib;
}

// Writes `bytes` to dir/name, makes them durable and evicts them from the
// page cache; false when the filesystem keeps them cached (tmpfs).
bool WriteColdFile(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC,
                        0644);
  if (fd < 0) return false;
  const bool written = ::write(fd, bytes.data(), bytes.size()) ==
                       static_cast<ssize_t>(bytes.size());
  ::close(fd);
  return written && testing_util::EvictFromPageCache(path);
}

// A 3 MiB file "data" of patterned bytes (the pattern shifted by `shift`),
// durable and out of the page cache, opened through a storage that reads
// O_DIRECT (with `test_options`); `file` stays null (the test skips) where
// O_DIRECT or evicting is not possible here.
struct ColdFile {
  explicit ColdFile(int shift, const FileStorageTestOptions& test_options = {})
      : path(dir.path() + "/data"), bytes(size_t{3} << 20, '\0') {
    for (size_t i = 0; i < bytes.size(); ++i) {
      bytes[i] = static_cast<char>((i * 2654435761u) >> shift);
    }
    if (!DirectIoWorksIn(dir.path()) || !WriteColdFile(path, bytes)) {
      why_not = dir.path() +
                ": no O_DIRECT, or the page cache cannot be dropped here";
      return;
    }
    auto s = OpenFileStorageForTesting(
        dir.path(), StorageOptions{.direct_io = true}, test_options);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return;
    storage = *std::move(s);
    auto f = storage->OpenForRead("data");
    EXPECT_TRUE(f.ok()) << f.status();
    if (f.ok()) file = *std::move(f);
  }
  TempDir dir;
  std::string path;
  std::string bytes;
  std::unique_ptr<Storage> storage;
  std::unique_ptr<ReadableFile> file;
  std::string why_not;  // when `file` is null
};

// A shared read of a cold, aligned range goes through the page cache (where
// ReadAt would read it O_DIRECT, past the cache), so a second reader of the
// range finds it there; its bytes are exact.
TEST(FileStorageTest, SharedReadsGoThroughThePageCache) {
  ColdFile cold(11);
  if (cold.file == nullptr) GTEST_SKIP() << cold.why_not;
  const std::string& path = cold.path;
  const std::string& bytes = cold.bytes;
  ReadableFile& file = *cold.file;
  absl::StatusOr<internal_core::UniqueAligned> memory =
      internal_core::AllocateAlignedUnique(1 << 20);
  ASSERT_TRUE(memory.ok()) << memory.status();
  const std::span<std::byte> buffer(memory->get(), 1 << 20);
  // ReadAt: direct, the range stays out of the cache.
  ASSERT_TRUE(file.ReadAt(0, buffer).ok());
  EXPECT_EQ(CachedPages(path, 0, 1 << 20), 0);
  // ReadAtShared of the next MiB: cached afterwards, and exact.
  ASSERT_TRUE(file.ReadAtShared(1 << 20, buffer).ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(buffer.data()),
                        buffer.size()),
            bytes.substr(1 << 20, 1 << 20));
  EXPECT_EQ(CachedPages(path, 1 << 20, 2 << 20), 256);
  EXPECT_NE(file.ViewIfInMemory(1 << 20, 1 << 20), nullptr);
  // A small cached range has a view too (a strided copy out of it needs
  // no bounce buffer), exact; an empty one has none.
  {
    std::unique_ptr<ReadableFile::View> v =
        file.ViewIfInMemory((1 << 20) + 4000, 3000);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(v->bytes().data()),
                          v->bytes().size()),
              bytes.substr((1 << 20) + 4000, 3000));
    EXPECT_EQ(file.ViewIfInMemory((1 << 20) + 4000, 0), nullptr);
  }
  // (Whether [0, 1 MiB) is cached now is the kernel's choice: the shared
  // read populates a mapping that reads in 2 MiB folios where it can.)
  // Unaligned and at the end of the file: exact.
  std::vector<std::byte> small(70001);
  ASSERT_TRUE(file.ReadAtShared(bytes.size() - small.size(),
                                    std::span(small)).ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(small.data()),
                        small.size()),
            bytes.substr(bytes.size() - small.size()));
  // Past the end: an error naming the file, not a short read.
  absl::Status past = file.ReadAtShared(bytes.size() - 10, std::span(small));
  EXPECT_EQ(past.code(), absl::StatusCode::kDataLoss) << past;
  EXPECT_NE(past.message().find("data"), std::string::npos) << past;
}

// Reads of every alignment return the file's bytes whether they come from
// the page cache or from the device: an uncached aligned middle is read with
// O_DIRECT (so it stays out of the cache), its head and tail and anything
// cached through the cache, an unaligned destination buffered. Whether a
// range is cached is asked of cachestat(2), or of mincore() where the kernel
// lacks cachestat (`test_options` can force that). Ended views are
// released as soon as 1 MiB of them waits (every one here), so that each
// step starts with nothing mapped.
void ExpectReadsExactCachedOrNot(FileStorageTestOptions test_options) {
  test_options.view_release_batch = 1 << 20;
  ColdFile cold(13, test_options);
  if (cold.file == nullptr) GTEST_SKIP() << cold.why_not;
  const std::string& path = cold.path;
  const std::string& bytes = cold.bytes;
  ReadableFile& file = *cold.file;
  // 4096-aligned destination memory, offset by `shift` bytes.
  auto read = [&](uint64_t offset, size_t size, size_t shift) {
    std::vector<std::byte> buffer(size + 8192);
    const auto base = reinterpret_cast<uintptr_t>(buffer.data());
    std::byte* dst = buffer.data() + ((4096 - base % 4096) % 4096) + shift;
    absl::Status s = file.ReadAt(offset, std::span(dst, size));
    EXPECT_TRUE(s.ok()) << s;
    return std::string(reinterpret_cast<const char*>(dst), size);
  };
  // Cold, aligned: direct. The middle stays out of the page cache.
  EXPECT_EQ(read(1 << 20, 1 << 20, 0), bytes.substr(1 << 20, 1 << 20));
  EXPECT_EQ(CachedPages(path, 1 << 20, 2 << 20), 0);
  // Not cached: no in-place view.
  EXPECT_EQ(file.ViewIfInMemory(1 << 20, 1 << 20), nullptr);
  // Cold, unaligned offset and size with the destination aligned like the
  // file offset: buffered head and tail, direct middle.
  EXPECT_EQ(read(100, 500000, 100), bytes.substr(100, 500000));
  // The buffered head read may read a few pages ahead, not the middle.
  EXPECT_LT(CachedPages(path, 4096, 495 * 1024), 30);
  // Unaligned destination: all buffered, still exact.
  EXPECT_EQ(read(8192, 300000, 1), bytes.substr(8192, 300000));
  // Small and tail reads.
  EXPECT_EQ(read(5, 10, 0), bytes.substr(5, 10));
  EXPECT_EQ(read(bytes.size() - 70000, 70000, 0),
            bytes.substr(bytes.size() - 70000));
  // Warm: now cached, read again through the cache.
  std::string all = ReadFileDirectly(path);
  ASSERT_EQ(all, bytes);
  EXPECT_EQ(read(1 << 20, 1 << 20, 0), bytes.substr(1 << 20, 1 << 20));
  EXPECT_EQ(read(100, 500000, 7), bytes.substr(100, 500000));
  EXPECT_EQ(read(5, 10, 0), bytes.substr(5, 10));
  EXPECT_EQ(read(bytes.size() - 70001, 70001, 3),
            bytes.substr(bytes.size() - 70001));
  // Cached, into destination memory never touched (copied out of the
  // mapping) and into memory partly touched (the same) or wholly touched
  // (a buffered pread): exact every time.
  {
    const size_t size = size_t{2} << 20;
    void* fresh = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(fresh, MAP_FAILED);
    auto* dst = static_cast<std::byte*>(fresh);
    ASSERT_TRUE(file.ReadAt(4096, std::span(dst, size)).ok());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(dst), size),
              bytes.substr(4096, size));
    ASSERT_EQ(::madvise(fresh, size, MADV_DONTNEED), 0);  // untouched again
    dst[size / 2] = std::byte{1};  // one page resident
    ASSERT_TRUE(file.ReadAt(100, std::span(dst, size - 100)).ok());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(dst), size - 100),
              bytes.substr(100, size - 100));
    ASSERT_TRUE(file.ReadAt(300000, std::span(dst + 5, size - 5)).ok());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(dst + 5), size - 5),
              bytes.substr(300000, size - 5));
    ::munmap(fresh, size);
  }
  // Cached: in place, the file's bytes; the mapped pages go with the view.
  {
    const int64_t rss_before = RssFileKiB();
    std::unique_ptr<ReadableFile::View> view =
        file.ViewIfInMemory(12345, 2 << 20);
    ASSERT_NE(view, nullptr);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(view->bytes().data()),
                          view->bytes().size()),
              bytes.substr(12345, 2 << 20));
    EXPECT_GE(RssFileKiB() - rss_before, 1024) << "the view is mapped";
    view.reset();
    EXPECT_LT(RssFileKiB() - rss_before, 256) << "KiB left mapped";
    // Views are released in whole 2 MiB blocks; a view still in use keeps
    // the blocks it shares with one that ended, and reads the same after
    // the other's release.
    std::unique_ptr<ReadableFile::View> a =
        file.ViewIfInMemory(100000, 1 << 20);
    std::unique_ptr<ReadableFile::View> b =
        file.ViewIfInMemory(1 << 20 | 500000, 1 << 20);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    b.reset();
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(a->bytes().data()),
                          a->bytes().size()),
              bytes.substr(100000, 1 << 20));
    a.reset();
    EXPECT_LT(RssFileKiB() - rss_before, 256) << "KiB left mapped";
    // Past the end of the file: none. A small range has one (a view
    // costs no madvise of its own).
    EXPECT_EQ(file.ViewIfInMemory(bytes.size() - 4096, 8192), nullptr);
    std::unique_ptr<ReadableFile::View> small = file.ViewIfInMemory(0, 100);
    ASSERT_NE(small, nullptr);
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(small->bytes().data()),
                          small->bytes().size()),
              bytes.substr(0, 100));
  }
  // A cached read copied out of the mapping leaves nothing mapped: the
  // process's file-backed RSS does not grow by what it read (into resident
  // memory, as `read` gives, and into untouched memory).
  const int64_t rss_before = RssFileKiB();
  EXPECT_EQ(read(0, bytes.size(), 0), bytes);
  {
    void* fresh = ::mmap(nullptr, bytes.size(), PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(fresh, MAP_FAILED);
    auto* dst = static_cast<std::byte*>(fresh);
    ASSERT_TRUE(file.ReadAt(0, std::span(dst, bytes.size())).ok());
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(dst), bytes.size()),
              bytes);
    ::munmap(fresh, bytes.size());
  }
  EXPECT_LT(RssFileKiB() - rss_before, 1024) << "KiB of file pages left mapped";
  // One page evicted: a range that has its first byte, or only its last,
  // is not wholly cached (where the kernel can evict a lone page of a large
  // folio at all).
  {
    const uint64_t hole = (1 << 20) + 65536;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    ::posix_fadvise(fd, static_cast<off_t>(hole), 4096, POSIX_FADV_DONTNEED);
    ::close(fd);
    if (CachedPages(path, hole, hole + 4096) == 0 &&
        CachedPages(path, 1 << 20, hole) == 16) {
      EXPECT_EQ(file.ViewIfInMemory(1 << 20, 65537), nullptr);
      EXPECT_EQ(file.ViewIfInMemory(hole + 4095, 65536), nullptr);
      EXPECT_NE(file.ViewIfInMemory(1 << 20, 65536), nullptr);
      EXPECT_NE(file.ViewIfInMemory(hole + 4096, 65536), nullptr);
    }
  }
  // Past the end: kDataLoss naming the file, also on the direct path.
  std::vector<std::byte> big(size_t{2} << 20);
  absl::Status past = file.ReadAt((2 << 20) - 4096, std::span(big));
  EXPECT_EQ(past.code(), absl::StatusCode::kDataLoss) << past;
  EXPECT_THAT(past.message(), HasSubstr(path));
}

TEST(FileStorageTest, ReadsAreExactCachedOrNot) {
  ExpectReadsExactCachedOrNot({});
}

TEST(FileStorageTest, ReadsAreExactCachedOrNotAskingMincore) {
  ExpectReadsExactCachedOrNot({.probe_cache_with_mincore = true});
}

// Ended views stay mapped until a batch of them waits, then go in one
// unmapping, which stops below the first block of a view still in use.
TEST(FileStorageTest, EndedViewsAreReleasedInBatches) {
  ColdFile cold(5, {.view_release_batch = 3 << 20});  // the whole file
  if (cold.file == nullptr) GTEST_SKIP() << cold.why_not;
  ASSERT_EQ(ReadFileDirectly(cold.path), cold.bytes);  // cached now
  ReadableFile& file = *cold.file;
  auto view = [&](uint64_t offset, uint64_t size) {
    std::unique_ptr<ReadableFile::View> v = file.ViewIfInMemory(offset, size);
    EXPECT_NE(v, nullptr);
    if (v != nullptr) {
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(v->bytes().data()),
                            v->bytes().size()),
                cold.bytes.substr(offset, size));
    }
    return v;
  };
  const int64_t rss_before = RssFileKiB();
  // Blocks [0, 2 MiB) wait, less than a batch: still mapped.
  view(0, 1 << 20).reset();
  EXPECT_GE(RssFileKiB() - rss_before, 1024) << "KiB mapped after one view";
  // Blocks [2 MiB, 3 MiB) too: a batch, released.
  view(2 << 20, 512 << 10).reset();
  EXPECT_LT(RssFileKiB() - rss_before, 256) << "KiB left mapped";
  // A view in use from block [2 MiB, 3 MiB) holds that block back.
  std::unique_ptr<ReadableFile::View> in_use = view((2 << 20) + 4096, 65536);
  view(0, 1 << 20).reset();
  view((3 << 19), 1 << 20).reset();  // [1.5, 2.5) MiB: blocks [0, 3 MiB)
  // Block [2 MiB, 3 MiB) stays as populated: the view in use, and the half
  // MiB of it the ended view mapped.
  const int64_t kept = RssFileKiB() - rss_before;
  EXPECT_GE(kept, 512) << "KiB of the view in use's block kept mapped";
  EXPECT_LE(kept, 1024 + 64) << "KiB mapped, more than that block";
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(in_use->bytes().data()),
                        in_use->bytes().size()),
            cold.bytes.substr((2 << 20) + 4096, 65536));
  in_use.reset();
  // Closing the file unmaps whatever still waits.
  cold.file.reset();
  EXPECT_LT(RssFileKiB() - rss_before, 256) << "KiB left mapped";
}

// A shared read of a cold range reads it in through the file's mapping
// (MADV_POPULATE_READ; the mapping asks for 2 MiB folios), then copies out
// of it: exact, the range cached afterwards, and its pages mapped in this
// process until the batch of ended views is released (with the file here).
TEST(FileStorageTest, SharedColdReadsPopulateTheMapping) {
  {
    // Kernels before 5.14 have no MADV_POPULATE_READ: a buffered pread.
    void* probe = ::mmap(nullptr, 4096, PROT_READ,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(probe, MAP_FAILED);
    const bool populates = ::madvise(probe, 4096, 22 /*POPULATE_READ*/) == 0;
    ::munmap(probe, 4096);
    if (!populates) GTEST_SKIP() << "no MADV_POPULATE_READ";
  }
  ColdFile cold(7);
  if (cold.file == nullptr) GTEST_SKIP() << cold.why_not;
  const int64_t rss_before = RssFileKiB();
  std::string got(1 << 20, '\0');
  ASSERT_TRUE(cold.file
                  ->ReadAtShared((1 << 20) + 123,
                                 std::as_writable_bytes(std::span(got)))
                  .ok());
  EXPECT_EQ(got, cold.bytes.substr((1 << 20) + 123, 1 << 20));
  EXPECT_EQ(CachedPages(cold.path, (1 << 20) + 4096, 2 << 20), 255);
  EXPECT_GE(RssFileKiB() - rss_before, 1000) << "KiB mapped by the read";
  cold.file.reset();
  EXPECT_LT(RssFileKiB() - rss_before, 256) << "KiB left mapped";
}

// A view of a range the reader has just found cached (KnownCachedViews,
// which the loader takes after one InMemory of a file's whole span) skips
// asking the page cache again: the same bytes as ViewIfInMemory's; one of
// a range evicted since reads it back when touched, exact; none past the
// end of the file.
TEST(FileStorageTest, KnownCachedViewsSkipTheCacheQuestion) {
  // (Each ended view unmapped at once: mapped pages are not evicted.)
  ColdFile cold(6, {.view_release_batch = 1});
  if (cold.file == nullptr) GTEST_SKIP() << cold.why_not;
  ASSERT_EQ(ReadFileDirectly(cold.path), cold.bytes);  // cached now
  const ReadableFile& file = *cold.file;
  const auto* known =
      dynamic_cast<const internal_storage::KnownCachedViews*>(&file);
  ASSERT_NE(known, nullptr);
  auto text = [](const ReadableFile::View& v) {
    return std::string(reinterpret_cast<const char*>(v.bytes().data()),
                       v.bytes().size());
  };
  ASSERT_TRUE(file.InMemory(0, cold.bytes.size()));
  {
    std::unique_ptr<ReadableFile::View> v =
        internal_storage::ViewOf(file, 12345, 1 << 20, true);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(text(*v), cold.bytes.substr(12345, 1 << 20));
  }
  // Evicted: ViewIfInMemory says no, the known view reads it back.
  ASSERT_TRUE(testing_util::EvictFromPageCache(cold.path));
  EXPECT_EQ(file.ViewIfInMemory(0, 1 << 20), nullptr);
  EXPECT_EQ(internal_storage::ViewOf(file, 0, 1 << 20, false), nullptr);
  {
    std::unique_ptr<ReadableFile::View> v =
        known->ViewKnownInMemory(4096, 1 << 20);
    ASSERT_NE(v, nullptr);
    EXPECT_EQ(text(*v), cold.bytes.substr(4096, 1 << 20));
  }
  EXPECT_EQ(known->ViewKnownInMemory(cold.bytes.size() - 100, 101), nullptr);
  EXPECT_EQ(known->ViewKnownInMemory(0, 0), nullptr);
}

// With both read paths off, every read is a buffered pread; still exact.
TEST(FileStorageTest, PlainPreadReadsAreExact) {
  TempDir dir;
  std::string bytes(size_t{1} << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i % 251);
  {
    FILE* f = std::fopen((dir.path() + "/data").c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
  }
  auto storage = Storage::Open(
      dir.path(),
      StorageOptions{.direct_io = false, .map_cached_reads = false});
  ASSERT_TRUE(storage.ok()) << storage.status();
  auto file = (*storage)->OpenForRead("data");
  ASSERT_TRUE(file.ok()) << file.status();
  std::string out(bytes.size() - 8191, '\0');
  ASSERT_TRUE((*file)
                  ->ReadAt(8191, std::as_writable_bytes(std::span(out)))
                  .ok());
  EXPECT_EQ(out, bytes.substr(8191));
  // Mapped reads off: never a view, cached or not.
  EXPECT_EQ((*file)->ViewIfInMemory(0, bytes.size()), nullptr);
}

TEST(FileStorageTest, TmpfsAlignmentMatchesWhatTheKernelAccepts) {
  struct stat st;
  if (::stat("/dev/shm", &st) != 0) GTEST_SKIP() << "/dev/shm is absent";
  TempDir dir("/dev/shm");
  ASSERT_FALSE(dir.path().empty());
  // tmpfs accepts O_DIRECT since Linux 6.6; before, Create falls back.
  ExpectAlignmentMatchesKernel(dir.path());
}

TEST(FileStorageTest, RefusedDirectIoFallsBackToBufferedIo) {
  TempDir dir;
  auto storage = OpenFileStorageForTesting(
      dir.path(), StorageOptions{.direct_io = true},
      FileStorageTestOptions{.refuse_direct_io = true});
  ASSERT_TRUE(storage.ok());
  for (int i = 0; i < 2; ++i) {  // The second Create skips the O_DIRECT try.
    auto file = (*storage)->Create("f" + std::to_string(i));
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ((*file)->alignment(), 1u);
    EXPECT_TRUE((*file)->WriteAt(1, std::as_bytes(std::span("x", 1))).ok());
    EXPECT_TRUE((*file)->Finish(2).ok());
    EXPECT_EQ(ReadFileDirectly(dir.path() + "/f" + std::to_string(i)),
              std::string("\0x", 2));
  }
}

TEST(FileStorageTest, UnalignedDirectWriteIsInvalidArgument) {
  TempDir dir;
  if (!DirectIoWorksIn(dir.path())) GTEST_SKIP() << "no O_DIRECT here";
  auto storage = Storage::Open(dir.path(), StorageOptions{.direct_io = true});
  ASSERT_TRUE(storage.ok());
  auto file = (*storage)->Create("f");
  ASSERT_TRUE(file.ok());
  ASSERT_EQ((*file)->alignment(), 4096u);
  auto* buffer = static_cast<std::byte*>(std::aligned_alloc(4096, 8192));
  std::memset(buffer, 1, 8192);
  const std::span<const std::byte> aligned(buffer, 4096);
  EXPECT_TRUE((*file)->WriteAt(4096, aligned).ok());
  absl::Status offset = (*file)->WriteAt(100, aligned);
  EXPECT_EQ(offset.code(), absl::StatusCode::kInvalidArgument) << offset;
  EXPECT_THAT(offset.message(), HasSubstr("4096"));
  EXPECT_EQ((*file)->WriteAt(0, aligned.first(100)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      (*file)->WriteAt(0, std::span<const std::byte>(buffer + 1, 4096)).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*file)->Finish(5000).ok());
  std::free(buffer);
  struct stat st;
  ASSERT_EQ(::stat((dir.path() + "/f").c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 5000);
}

// Whether fallocate(2) allocates space in `dir` (ext4, XFS, tmpfs do).
bool FallocateWorksIn(const std::string& dir) {
  const std::string path = dir + "/fallocate-probe";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return false;
  const bool ok = ::fallocate(fd, 0, 0, 4096) == 0;
  ::close(fd);
  ::unlink(path.c_str());
  return ok;
}

// A file "f" being written in a fresh directory where fallocate works;
// `file` is null (and `why_not` says why) where it does not.
struct NewFile {
  NewFile() {
    if (!FallocateWorksIn(dir.path())) {
      why_not = "no fallocate in " + dir.path();
      return;
    }
    auto s = Storage::Open(dir.path());
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return;
    storage = *std::move(s);
    auto f = storage->Create("f");
    EXPECT_TRUE(f.ok()) << f.status();
    if (f.ok()) file = *std::move(f);
  }
  TempDir dir;
  std::unique_ptr<Storage> storage;
  std::unique_ptr<WritableFile> file;
  std::string why_not;
};

TEST(FileStorageTest, ReserveAllocatesTheFileBeforeItsWrites) {
  NewFile f;
  if (f.file == nullptr) GTEST_SKIP() << f.why_not;
  const TempDir& dir = f.dir;
  WritableFile* file = f.file.get();
  constexpr uint64_t kReserved = uint64_t{1} << 20;
  ASSERT_TRUE(file->Reserve(kReserved).ok());
  const std::string path = dir.path() + "/f";
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), kReserved);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, kReserved);
  // Writes land inside the reservation; Finish cuts it back to the size.
  const size_t align = std::max<size_t>(1, file->alignment());
  absl::StatusOr<internal_core::UniqueAligned> buffer =
      internal_core::AllocateAlignedUnique(8192);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  std::memset(buffer->get(), 'x', 8192);
  const uint64_t len = internal_core::RoundUp(uint64_t{5000}, align);
  ASSERT_TRUE(
      file->WriteAt(0, std::span<const std::byte>(buffer->get(), len)).ok());
  ASSERT_TRUE(file->Finish(5000).ok());
  EXPECT_EQ(ReadFileDirectly(path), std::string(5000, 'x'));
  EXPECT_EQ(file->Reserve(4096).code(),
            absl::StatusCode::kFailedPrecondition);
}

// A reservation the filesystem cannot give is an error naming the file,
// before any byte is written.
TEST(FileStorageTest, ReserveBeyondTheFilesystemNamesTheFile) {
  NewFile f;
  if (f.file == nullptr) GTEST_SKIP() << f.why_not;
  const TempDir& dir = f.dir;
  WritableFile* file = f.file.get();
  // 2^60 bytes: more than any test machine's disk (ENOSPC) and than ext4's
  // largest file (EFBIG).
  absl::Status huge = file->Reserve(uint64_t{1} << 60);
  EXPECT_FALSE(huge.ok());
  EXPECT_THAT(huge.message(), HasSubstr(dir.path() + "/f"));
  EXPECT_THAT(huge.message(), HasSubstr("fallocate"));
  absl::Status too_large = file->Reserve(~uint64_t{0});
  EXPECT_EQ(too_large.code(), absl::StatusCode::kInvalidArgument) << too_large;
  EXPECT_THAT(too_large.message(), HasSubstr(dir.path() + "/f"));
  EXPECT_TRUE(file->Finish(0).ok());
}

TEST(FileStorageTest, FinishTwiceIsFailedPrecondition) {
  TempDir dir;
  auto storage = Storage::Open(dir.path());
  ASSERT_TRUE(storage.ok());
  auto file = (*storage)->Create("f");
  ASSERT_TRUE(file.ok());
  EXPECT_TRUE((*file)->Finish(0).ok());
  EXPECT_EQ((*file)->Finish(0).code(), absl::StatusCode::kFailedPrecondition);
  const std::byte b[1] = {};
  EXPECT_EQ((*file)->WriteAt(0, b).code(),
            absl::StatusCode::kFailedPrecondition);
}

// --- Entries planted in the location: links, FIFOs, existing files ---

// A file outside the location, with known contents, that must never change.
struct Outside {
  TempDir dir;
  std::string path = dir.path() + "/victim";
  Outside() { WriteWhole(path, "precious"); }
  static void WriteWhole(const std::string& p, const std::string& text) {
    FILE* f = std::fopen(p.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);
  }
};

// A symbolic link at `at` to `target`.
void PlantLink(const std::string& target, const std::string& at) {
  ASSERT_EQ(::symlink(target.c_str(), at.c_str()), 0) << at;
}

std::span<const std::byte> Bytes(std::string_view s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

TEST(FileStorageTest, CreateNeverTruncatesOrWritesThroughALink) {
  TempDir dir;
  Outside outside;
  ASSERT_NO_FATAL_FAILURE(
      PlantLink(outside.path, dir.path() + "/data-00000.safetensors"));
  StorageOptions o;
  o.direct_io = false;
  auto storage = Storage::Open(dir.path(), o);
  ASSERT_TRUE(storage.ok());
  auto file = (*storage)->Create("data-00000.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(file.status().message(), HasSubstr("a symbolic link"));
  EXPECT_EQ(ReadFileDirectly(outside.path), "precious");
  // With O_DIRECT too (where the filesystem takes it).
  auto direct = Storage::Open(dir.path());
  ASSERT_TRUE(direct.ok());
  EXPECT_FALSE((*direct)->Create("data-00000.safetensors").ok());
  EXPECT_EQ(ReadFileDirectly(outside.path), "precious");
}

TEST(FileStorageTest, CreateRefusesAnExistingFile) {
  TempDir dir;
  Outside::WriteWhole(dir.path() + "/f", "old");
  auto storage = Storage::Open(dir.path());
  ASSERT_TRUE(storage.ok());
  auto file = (*storage)->Create("f");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ReadFileDirectly(dir.path() + "/f"), "old");
}

TEST(FileStorageTest, NoLinkedDirectoryIsFollowed) {
  TempDir dir;
  Outside outside;
  // rank-00003 -> a folder elsewhere.
  ASSERT_NO_FATAL_FAILURE(
      PlantLink(outside.dir.path(), dir.path() + "/rank-00003"));
  auto storage = Storage::Open(dir.path());
  ASSERT_TRUE(storage.ok());
  EXPECT_EQ((*storage)->Create("rank-00003/new").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(std::filesystem::exists(outside.dir.path() + "/new"));
  EXPECT_EQ((*storage)->WriteAtomically("rank-00003/victim", "x").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*storage)->OpenForRead("rank-00003/victim").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*storage)->Exists("rank-00003/victim").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE((*storage)->Remove("rank-00003/victim").ok());
  EXPECT_EQ(ReadFileDirectly(outside.path), "precious");
}

TEST(FileStorageTest, ReadersRefuseLinksAndSayWhy) {
  TempDir dir;
  Outside outside;
  ASSERT_NO_FATAL_FAILURE(
      PlantLink(outside.path, dir.path() + "/data-00000.safetensors"));
  auto storage = Storage::Open(dir.path());
  ASSERT_TRUE(storage.ok());
  auto read = (*storage)->OpenForRead("data-00000.safetensors");
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(read.status().message(),
              HasSubstr("data-00000.safetensors is a symbolic link"));
  EXPECT_EQ((*storage)->Exists("data-00000.safetensors").status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Remove takes the link away, never its target.
  ASSERT_TRUE((*storage)->Remove("data-00000.safetensors").ok());
  EXPECT_EQ(ReadFileDirectly(outside.path), "precious");
  // WriteAtomically replaces a link by a file; the target stays.
  ASSERT_NO_FATAL_FAILURE(
      PlantLink(outside.path, dir.path() + "/metadata.json"));
  ASSERT_TRUE((*storage)->WriteAtomically("metadata.json", "new").ok());
  EXPECT_EQ(ReadFileDirectly(outside.path), "precious");
  EXPECT_EQ(ReadFileDirectly(dir.path() + "/metadata.json"), "new");
}

TEST(FileStorageTest, AFifoNeverBlocksAReader) {
  TempDir dir;
  ASSERT_EQ(::mkfifo((dir.path() + "/metadata.json").c_str(), 0644), 0);
  ASSERT_EQ(::mkfifo((dir.path() + "/data-00000.safetensors").c_str(), 0644),
            0);
  auto storage = Storage::Open(dir.path());
  ASSERT_TRUE(storage.ok());
  // Without O_NONBLOCK each of these waits for a writer that never comes.
  auto read = (*storage)->OpenForRead("data-00000.safetensors");
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(read.status().message(), HasSubstr("is a FIFO"));
  EXPECT_EQ((*storage)->ReadAll("metadata.json", 1 << 20).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*storage)->Exists("metadata.json").status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Nor a writer: Create is exclusive, so it never opens the FIFO.
  EXPECT_FALSE((*storage)->Create("data-00000.safetensors").ok());
}

TEST(FileStorageTest, OneLockHolderAtATime) {
  TempDir dir;
  auto a = Storage::Open(dir.path());
  auto b = Storage::Open(dir.path());
  ASSERT_TRUE(a.ok() && b.ok());
  auto held = (*a)->TryLock("save.lock");
  ASSERT_TRUE(held.ok()) << held.status();
  // Another Storage (here in the same process, as flock locks are per open
  // file, not per process) is refused, and told who holds it.
  auto refused = (*b)->TryLock("save.lock");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr(absl::StrCat("process ", ::getpid())));
  held->reset();
  auto again = (*b)->TryLock("save.lock");
  EXPECT_TRUE(again.ok()) << again.status();
  // The lock file is not a file of the checkpoint's data, but it is a
  // regular file: a link in its place is refused.
  Outside outside;
  ASSERT_NO_FATAL_FAILURE(PlantLink(outside.path, dir.path() + "/other.lock"));
  EXPECT_EQ((*a)->TryLock("other.lock").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadFileDirectly(outside.path), "precious");
}

// Lowers this process's RLIMIT_FSIZE for the test's lifetime.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &old_);
    struct rlimit lower = old_;
    lower.rlim_cur = bytes;
    ok_ = ::setrlimit(RLIMIT_FSIZE, &lower) == 0;
  }
  ~FileSizeLimit() { ::setrlimit(RLIMIT_FSIZE, &old_); }
  bool ok() const { return ok_; }

 private:
  struct rlimit old_;
  bool ok_ = false;
};

TEST(FileStorageTest, FileSizeLimitIsAnErrorNotSigxfsz) {
  TempDir dir;
  StorageOptions o;
  o.direct_io = false;
  auto storage = Storage::Open(dir.path(), o);
  ASSERT_TRUE(storage.ok());
  auto file = (*storage)->Create("f");
  ASSERT_TRUE(file.ok());
  const std::string block(8192, 'x');
  FileSizeLimit limit(4096);
  ASSERT_TRUE(limit.ok());
  // Past the limit the kernel would send SIGXFSZ, which ends the process.
  absl::Status wrote = (*file)->WriteAt(0, Bytes(block));
  EXPECT_EQ(wrote.code(), absl::StatusCode::kResourceExhausted) << wrote;
  EXPECT_THAT(wrote.message(), HasSubstr("RLIMIT_FSIZE"));
  EXPECT_EQ((*file)->Reserve(8192).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*storage)->WriteAtomically("m", block).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE((*file)->WriteAt(0, Bytes(block.substr(0, 4096))).ok());
  EXPECT_TRUE((*file)->Finish(4096).ok());
}

TEST(FileStorageTest, CreateNeedsTheLocation) {
  TempDir dir;
  auto storage = Storage::Open(dir.path() + "/not-created");
  ASSERT_TRUE(storage.ok());
  EXPECT_EQ((*storage)->Create("f").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ((*storage)->Create("a/f").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(FileStorageTest, LocationThatIsAFileIsAnError) {
  TempDir dir;
  const std::string file_path = dir.path() + "/plain";
  FILE* f = std::fopen(file_path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  auto storage = Storage::Open(file_path);
  ASSERT_TRUE(storage.ok());
  EXPECT_FALSE((*storage)->CreateLocation().ok());
}

TEST(FileStorageTest, FailedWriteAtomicallyLeavesNoTempFile) {
  TempDir dir;
  auto storage = Storage::Open(dir.path());
  ASSERT_TRUE(storage.ok());
  // "sub" is a non-empty directory: renaming a file over it fails.
  ASSERT_TRUE((*storage)->WriteAtomically("sub/x", "x").ok());
  EXPECT_FALSE((*storage)->WriteAtomically("sub", "y").ok());
  auto names = (*storage)->List();
  ASSERT_TRUE(names.ok());
  EXPECT_THAT(*names, ElementsAre("sub/x"));
}

TEST(FileStorageTest, DirectoriesAndSymlinksAreNotFiles) {
  TempDir dir;
  auto storage = Storage::Open(dir.path());
  ASSERT_TRUE(storage.ok());
  ASSERT_TRUE((*storage)->WriteAtomically("d/real", "r").ok());
  ASSERT_NO_FATAL_FAILURE(
      PlantLink(dir.path() + "/d/real", dir.path() + "/link"));
  ASSERT_NO_FATAL_FAILURE(PlantLink(dir.path(), dir.path() + "/loop"));
  auto names = (*storage)->List();
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, ElementsAre("d/real"));
  // Neither is a file: Exists says what each is instead.
  auto d = (*storage)->Exists("d");
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(d.status().message(), HasSubstr("is a directory"));
  auto link = (*storage)->Exists("link");
  EXPECT_EQ(link.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(link.status().message(), HasSubstr("is a symbolic link"));
  EXPECT_EQ((*storage)->OpenForRead("d").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

int CountOpenFds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n;
}

TEST(FileStorageTest, NoFileDescriptorLeaks) {
  TempDir dir;
  const int before = CountOpenFds();
  {
    auto storage = Storage::Open(dir.path());
    ASSERT_TRUE(storage.ok());
    for (int i = 0; i < 10; ++i) {
      ASSERT_TRUE((*storage)->WriteAtomically("n/m", "x").ok());
      auto file = (*storage)->Create("f" + std::to_string(i));
      ASSERT_TRUE(file.ok());
      EXPECT_FALSE((*storage)->Create("n/m").ok());  // exists
      {
        auto lock = (*storage)->TryLock("save.lock");
        ASSERT_TRUE(lock.ok());
        EXPECT_FALSE((*storage)->TryLock("save.lock").ok());
      }
      if (i % 2 == 0) {
        ASSERT_TRUE((*file)->Finish(0).ok());
      }
      auto reader = (*storage)->OpenForRead("n/m");
      ASSERT_TRUE(reader.ok());
      ASSERT_TRUE((*storage)->List().ok());
      ASSERT_TRUE((*storage)->Sync().ok());
      EXPECT_FALSE((*storage)->OpenForRead("missing").ok());
    }
  }
  EXPECT_EQ(CountOpenFds(), before);
}

}  // namespace
}  // namespace cairn::internal_storage
