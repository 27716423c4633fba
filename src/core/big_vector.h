// std::vector for the flat arrays of the save coordinator (up to hundreds
// of MB at 16k ranks): a block of 2 MiB or more is its own mapping, advised
// for transparent huge pages.
#ifndef CAIRN_CORE_BIG_VECTOR_H_
#define CAIRN_CORE_BIG_VECTOR_H_

#include <sys/mman.h>

#include <cstddef>
#include <memory>
#include <new>
#include <vector>

namespace cairn::internal_core {

// First-touch page faults are what the coordinator's WriteItem path spent
// most of its time on; on the 2-core PVM guest the benchmarks run on,
// faulting in 1 GiB took 2.8 s with 4 KiB pages and 0.12 s with 2 MiB ones.
// The 0.12 s holds only for memory the guest freed a moment ago: it hands
// free 2 MiB blocks back to its host after a second or so (virtio-balloon
// free page reporting), and faulting huge pages in from those took 1.6-3.8 s
// a GiB (bench/scale/fault_cost.c; bench/RESULTS.md, 2026-11-23, night).
// So there the cost is how far a phase raises the process's memory. A
// cache that reused freed blocks, and leaving huge pages off, were both
// measured in the scale simulator and neither made a difference.
constexpr size_t kHugePage = size_t{2} << 20;

template <typename T>
struct BigAllocator {
  using value_type = T;
  BigAllocator() = default;
  template <typename U>
  BigAllocator(const BigAllocator<U>&) {}  // NOLINT: rebinding

  static size_t MappedBytes(size_t n) {
    return (n * sizeof(T) + kHugePage - 1) / kHugePage * kHugePage;
  }
  T* allocate(size_t n) {
    if (n * sizeof(T) < kHugePage) return std::allocator<T>().allocate(n);
    void* p = mmap(nullptr, MappedBytes(n), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    // What std::allocator does when memory runs out.
    if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    madvise(p, MappedBytes(n), MADV_HUGEPAGE);  // advice: failing is fine
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kHugePage) {
      std::allocator<T>().deallocate(p, n);
    } else {
      munmap(p, MappedBytes(n));
    }
  }
  friend bool operator==(const BigAllocator&, const BigAllocator&) {
    return true;
  }
};
template <typename T>
using BigVector = std::vector<T, BigAllocator<T>>;

// Frees a container's memory now. `v = {}` does not: it assigns an empty
// list and keeps a vector's capacity, and `s = std::string()` keeps a
// string's (libstdc++ copies a short string into the buffer it has).
template <typename Container>
void ReleaseStorage(Container& c) {
  Container().swap(c);
}

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_BIG_VECTOR_H_
