// Save and load against an already opened Storage, so tests can wrap the
// storage (fault injection, byte counting). The public functions in
// checkpoint.h open the URL and call these.
#ifndef CAIRN_CHECKPOINT_CHECKPOINT_IMPL_H_
#define CAIRN_CHECKPOINT_CHECKPOINT_IMPL_H_

#include <cstdint>
#include <span>
#include <string>

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

// OK when `shard` of tensor `fqn` can be saved from or loaded into: its box
// lies inside the tensor, its view is host memory with the box's shape and
// the tensor's dtype, and has data. Errors name the FQN and the box.
absl::Status ValidateShard(const std::string& fqn, const ShardedTensor& t,
                           const Shard& shard);

// Reads, decodes and validates metadata.json (including chunk coverage).
absl::StatusOr<Metadata> ReadMetadataFromStorage(Storage& storage);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_CHECKPOINT_IMPL_H_
