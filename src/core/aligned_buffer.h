// Owned, aligned host memory for IO buffers and tensors.
#ifndef CAIRN_CORE_ALIGNED_BUFFER_H_
#define CAIRN_CORE_ALIGNED_BUFFER_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"

namespace cairn::internal_core {

inline constexpr size_t kIoAlignment = 4096;

// `size` bytes aligned to `alignment` (a power of two), uninitialised. Buffers
// of 2 MiB or more ask for transparent huge pages (madvise), which makes the
// first touch of fresh memory several times faster on VMs. The deleter frees.
// kResourceExhausted naming the size when allocation fails.
absl::StatusOr<std::shared_ptr<void>> AllocateAligned(
    size_t size, size_t alignment = kIoAlignment);

// Same, as a unique owner.
struct FreeDeleter {
  void operator()(void* p) const;
};
using UniqueAligned = std::unique_ptr<std::byte, FreeDeleter>;
absl::StatusOr<UniqueAligned> AllocateAlignedUnique(
    size_t size, size_t alignment = kIoAlignment);

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_ALIGNED_BUFFER_H_
