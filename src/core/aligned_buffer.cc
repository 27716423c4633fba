#include "core/aligned_buffer.h"

#include <sys/mman.h>

#include <cstdlib>

#include "absl/strings/str_format.h"

namespace cairn::internal_core {
namespace {

constexpr size_t kHugePageBytes = size_t{2} << 20;

void* Allocate(size_t size, size_t alignment) {
  // Huge-page-sized buffers are aligned to 2 MiB so whole huge pages back them.
  if (size >= kHugePageBytes && alignment < kHugePageBytes) {
    alignment = kHugePageBytes;
  }
  size_t rounded = (size + alignment - 1) / alignment * alignment;
  if (rounded == 0) rounded = alignment;
  void* p = std::aligned_alloc(alignment, rounded);
  if (p != nullptr && rounded >= kHugePageBytes) {
    // On VMs whose balloon reclaims idle memory, first touch of 4 KiB pages
    // runs at ~1 GB/s; huge pages make it several times faster (PEERS.md).
    // Advisory: failure is harmless.
    madvise(p, rounded, MADV_HUGEPAGE);
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
