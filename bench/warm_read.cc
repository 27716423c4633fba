// The ceiling of a warm load on this machine: how fast can two threads
// move a page-cached file into resident memory, with and without a CRC32C
// of every byte? Not part of the build (a measuring tool, like
// bench/scale/fault_cost.c):
//
//   g++ -O2 -std=c++20 -o /tmp/warm_read bench/warm_read.cc -lisal -lpthread
//   dd if=/dev/urandom of=/var/tmp/warm.dat bs=1M count=1024
//   /tmp/warm_read /var/tmp/warm.dat MODE [PIECE [TASK]]
//
// The file is read once first (so it is cached), the destination is one
// touched buffer of the file's size (huge pages advised, as cairn's
// tensors), and two threads take TASK-byte tasks (default 8 MiB; cairn's
// chunks in the bench's model are about 1 MiB, 3 MiB at most) from a
// shared counter. Three rounds are timed. MODE:
//   0  pread a task, then CRC32C it (what cairn does for a task that goes
//      straight into its destination)
//   1  the same in PIECE-byte steps (pread, CRC, next), so the CRC reads
//      from cache
//   2  map the task's range of the file (MADV_POPULATE_READ), memcpy and
//      CRC in PIECE-byte steps, unmap
//   3  the same with MAP_POPULATE
//   4  pread alone, no CRC: the kernel's copy
//   5  one mapping of the whole file per round (unmapped at its end, as
//      cairn's views are released in batches): populate the task's range,
//      memcpy and CRC in PIECE-byte steps
//   6  the same, but CRC each piece of the source first, then copy it with
//      non-temporal (streaming) stores, so the destination is written
//      without being read (not exact: the bytes checked are the source's)
//   7  pread PIECE bytes into a small buffer of the thread's own (it stays
//      in cache), CRC32C it there, then copy it out with streaming stores:
//      exact (only this thread writes the buffer between check and copy),
//      and the destination is written without being read
//   8  memcpy from a resident copy of the file (no file, no CRC): the
//      bandwidth a warm load is held to, on the same two threads
#include <fcntl.h>
#include <isa-l/crc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include <immintrin.h>

namespace {

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

constexpr int kMadvPopulateRead = 22;  // MADV_POPULATE_READ, Linux 5.14

// memcpy with 32-byte non-temporal stores (the tail with memcpy).
__attribute__((target("avx2"))) void StreamCopy(char* d, const char* s,
                                                size_t n) {
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    for (size_t k = 0; k < 128; k += 32) {
      const __m256i v =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + k));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + k), v);
    }
  }
  if (i < n) std::memcpy(d + i, s + i, n - i);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s FILE MODE(0-8) [PIECE [TASK]]\n",
                 argv[0]);
    return 2;
  }
  const int mode = std::atoi(argv[2]);
  const size_t piece = argc > 3 ? std::strtoull(argv[3], nullptr, 0) : 262144;
  const size_t task = argc > 4 ? std::strtoull(argv[4], nullptr, 0)
                               : size_t{8} << 20;
  const int fd = open(argv[1], O_RDONLY);
  if (fd < 0 || piece == 0 || task == 0) {
    std::perror(argv[1]);
    return 1;
  }
  const size_t size = static_cast<size_t>(lseek(fd, 0, SEEK_END));
  constexpr size_t kHuge = size_t{2} << 20;
  char* dst = static_cast<char*>(
      std::aligned_alloc(kHuge, (size + kHuge - 1) / kHuge * kHuge));
  madvise(dst, size, MADV_HUGEPAGE);
  std::memset(dst, 1, size);
  std::vector<char> warm(size_t{1} << 20);
  for (size_t o = 0; o < size; o += warm.size()) {
    if (pread(fd, warm.data(), warm.size(), static_cast<off_t>(o)) < 0) {
      std::perror("pread");
      return 1;
    }
  }
  std::vector<char> copy;  // mode 8's source
  if (mode == 8) {
    copy.resize(size);
    if (pread(fd, copy.data(), size, 0) != static_cast<ssize_t>(size)) {
      std::perror("pread");
      return 1;
    }
  }
  for (int round = 0; round < 3; ++round) {
    std::atomic<size_t> next{0};
    std::atomic<unsigned> sink{0};
    const double start = Now();
    char* whole = nullptr;
    if (mode == 5 || mode == 6) {
      void* map = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (map == MAP_FAILED) {
        std::perror("mmap");
        return 1;
      }
      whole = static_cast<char*>(map);
    }
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&] {
        unsigned acc = 0;
        std::vector<unsigned char> bounce(mode == 7 ? piece : 0);
        for (;;) {
          const size_t off = next.fetch_add(task);
          if (off >= size) break;
          const size_t n = std::min(task, size - off);
          auto* out = reinterpret_cast<unsigned char*>(dst + off);
          unsigned crc = ~0u;
          if (mode == 0) {
            (void)!pread(fd, out, n, static_cast<off_t>(off));
            crc = crc32_iscsi(out, static_cast<int>(n), crc);
          } else if (mode == 1) {
            for (size_t p = 0; p < n; p += piece) {
              const size_t m = std::min(piece, n - p);
              (void)!pread(fd, out + p, m, static_cast<off_t>(off + p));
              crc = crc32_iscsi(out + p, static_cast<int>(m), crc);
            }
          } else if (mode == 5 || mode == 6) {
            const char* src = whole + off;
            madvise(const_cast<char*>(src), n, kMadvPopulateRead);
            for (size_t p = 0; p < n; p += piece) {
              const size_t m = std::min(piece, n - p);
              if (mode == 5) {
                std::memcpy(out + p, src + p, m);
                crc = crc32_iscsi(out + p, static_cast<int>(m), crc);
              } else {
                crc = crc32_iscsi(
                    reinterpret_cast<unsigned char*>(const_cast<char*>(src)) +
                        p,
                    static_cast<int>(m), crc);
                StreamCopy(reinterpret_cast<char*>(out) + p, src + p, m);
              }
            }
            _mm_sfence();
          } else if (mode == 7) {
            for (size_t p = 0; p < n; p += piece) {
              const size_t m = std::min(piece, n - p);
              (void)!pread(fd, bounce.data(), m, static_cast<off_t>(off + p));
              crc = crc32_iscsi(bounce.data(), static_cast<int>(m), crc);
              StreamCopy(reinterpret_cast<char*>(out) + p,
                         reinterpret_cast<const char*>(bounce.data()), m);
            }
            _mm_sfence();
          } else if (mode == 8) {
            std::memcpy(out, copy.data() + off, n);
          } else if (mode == 2 || mode == 3) {
            void* map = mmap(nullptr, n, PROT_READ,
                             MAP_SHARED | (mode == 3 ? MAP_POPULATE : 0), fd,
                             static_cast<off_t>(off));
            if (map == MAP_FAILED) break;
            if (mode == 2) madvise(map, n, kMadvPopulateRead);
            for (size_t p = 0; p < n; p += piece) {
              const size_t m = std::min(piece, n - p);
              std::memcpy(out + p, static_cast<char*>(map) + p, m);
              crc = crc32_iscsi(out + p, static_cast<int>(m), crc);
            }
            munmap(map, n);
          } else {
            (void)!pread(fd, out, n, static_cast<off_t>(off));
          }
          acc ^= crc;
        }
        sink ^= acc;
      });
    }
    for (std::thread& t : threads) t.join();
    if (whole != nullptr) munmap(whole, size);
    const double seconds = Now() - start;
    std::printf("mode %d piece %zu: %.3f s, %.2f GB/s\n", mode, piece,
                seconds, static_cast<double>(size) / seconds / 1e9);
  }
  std::free(dst);
  return 0;
}
