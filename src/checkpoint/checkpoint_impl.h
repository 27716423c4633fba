// Save and load against an already opened Storage, so tests can wrap the
// storage (fault injection, byte counting). The public functions in
// checkpoint.h open the URL and call these.
#ifndef CAIRN_CHECKPOINT_CHECKPOINT_IMPL_H_
#define CAIRN_CHECKPOINT_CHECKPOINT_IMPL_H_

#include <cstdint>
#include <span>

#include "absl/status/statusor.h"
#include "cairn/checkpoint.h"
#include "cairn/storage.h"
#include "cairn/tensor.h"

namespace cairn::internal_checkpoint {

absl::StatusOr<SaveResult> SaveToStorage(const StateDict& state,
                                         Storage& storage,
                                         const SaveOptions& options);

absl::StatusOr<LoadResult> LoadFromStorage(StateDict& state, Storage& storage,
                                           const LoadOptions& options);

// Load with metadata already read (and validated).
absl::StatusOr<LoadResult> LoadWithMetadata(StateDict& state, Storage& storage,
                                            const Metadata& metadata,
                                            const LoadOptions& options);

// LoadAll against an opened storage.
absl::StatusOr<StateDict> LoadAllFromStorage(Storage& storage,
                                             const LoadOptions& options);

// Reads, decodes and validates metadata.json (including chunk coverage).
absl::StatusOr<Metadata> ReadMetadataFromStorage(Storage& storage);

// Copies bytes [begin, end) of the row-major image of `view` to `dst`,
// honouring the view's strides. The range may split elements.
void CopyRowMajorBytes(const TensorView& view, uint64_t begin, uint64_t end,
                       std::byte* dst);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_CHECKPOINT_IMPL_H_
