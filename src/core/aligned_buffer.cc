#include "core/aligned_buffer.h"

#include <sys/mman.h>

#include <cstdlib>

#include "absl/strings/str_format.h"
#include "core/checked.h"

namespace cairn::internal_core {
namespace {

constexpr size_t kHugePageBytes = size_t{2} << 20;

void* Allocate(size_t size, size_t alignment) {
  // Huge-page-sized buffers start on a 2 MiB boundary so that whole huge
  // pages back them. Only the size is rounded (to `alignment`, as O_DIRECT
  // needs), not to 2 MiB: the tail past the last 2 MiB boundary stays in
  // 4 KiB pages instead of a mostly unused huge page, which over hundreds of
  // tensors would add hundreds of MiB of resident memory.
  const size_t start = size >= kHugePageBytes && alignment < kHugePageBytes
                           ? kHugePageBytes
                           : alignment;
  size_t rounded = RoundUp(size, alignment);
  if (rounded == 0) rounded = alignment;
  void* p = nullptr;
  if (posix_memalign(&p, start, rounded) != 0) return nullptr;
  const size_t huge = rounded / kHugePageBytes * kHugePageBytes;
  if (huge > 0 && start >= kHugePageBytes) {
    // On VMs whose balloon reclaims idle memory, first touch of 4 KiB pages
    // runs at ~1 GB/s, and the kernel's first write to each (a read into
    // it) costs a hypervisor exit; huge pages make both several times
    // cheaper (PEERS.md, bench/README.md). Advisory: failure is harmless.
    madvise(p, huge, MADV_HUGEPAGE);
  }
  return p;
}

}  // namespace

void FreeDeleter::operator()(void* p) const { std::free(p); }

absl::StatusOr<UniqueAligned> AllocateAlignedUnique(size_t size,
                                                    size_t alignment) {
  void* p = Allocate(size, alignment);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("cannot allocate %d bytes aligned to %d", size,
                        alignment));
  }
  return UniqueAligned(static_cast<std::byte*>(p));
}

absl::StatusOr<std::shared_ptr<void>> AllocateAligned(size_t size,
                                                      size_t alignment) {
  absl::StatusOr<UniqueAligned> p = AllocateAlignedUnique(size, alignment);
  if (!p.ok()) return p.status();
  return std::shared_ptr<void>(p->release(), FreeDeleter());
}

}  // namespace cairn::internal_core
