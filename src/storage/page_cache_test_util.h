// Test helpers about O_DIRECT and the page cache, shared by the storage and
// checkpoint tests: whether a filesystem accepts O_DIRECT, how much of a file
// is cached, and pushing a file out of the cache.
#ifndef CAIRN_STORAGE_PAGE_CACHE_TEST_UTIL_H_
#define CAIRN_STORAGE_PAGE_CACHE_TEST_UTIL_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

namespace cairn::testing_util {

// Whether `dir`'s filesystem accepts O_DIRECT, asked directly.
inline bool DirectIoWorksIn(const std::string& dir) {
  const std::string probe = dir + "/direct-probe";
  const int fd =
      ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  return fd >= 0;
}

// How many of the pages of `path` in [begin, end) are in the page cache;
// -1 when that cannot be told.
inline int64_t CachedPages(const std::string& path, uint64_t begin,
                           uint64_t end) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return -1;
  }
  if (st.st_size == 0) {
    ::close(fd);
    return 0;
  }
  void* map = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ,
                     MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return -1;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  begin = begin / page * page;
  std::vector<unsigned char> vec((end - begin + page - 1) / page);
  int64_t cached = -1;
  if (::mincore(static_cast<char*>(map) + begin, end - begin, vec.data()) ==
      0) {
    cached = 0;
    for (unsigned char v : vec) cached += v & 1;
  }
  ::munmap(map, static_cast<size_t>(st.st_size));
  return cached;
}

// Makes `path` durable and pushes it out of the page cache; false when it
// stays cached (tmpfs) or something failed.
inline bool EvictFromPageCache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st;
  const bool ok = ::fdatasync(fd) == 0 &&
                  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0 &&
                  ::fstat(fd, &st) == 0;
  ::close(fd);
  return ok && CachedPages(path, 0, static_cast<uint64_t>(st.st_size)) == 0;
}

}  // namespace cairn::testing_util

#endif  // CAIRN_STORAGE_PAGE_CACHE_TEST_UTIL_H_
