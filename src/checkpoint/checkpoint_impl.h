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

// `storage` is this rank's opened storage, or the error opening it gave: a
// rank that could not open it still takes part in every collective (and
// reports that error) so the others never wait for it.
absl::StatusOr<SaveResult> SaveToStorage(const StateDict& state,
                                         absl::StatusOr<Storage*> storage,
                                         const SaveOptions& options);

absl::StatusOr<LoadResult> LoadFromStorage(StateDict& state,
                                           absl::StatusOr<Storage*> storage,
                                           const LoadOptions& options);

// Load with metadata already read and validated by this rank (every rank of
// options.comm must pass the same metadata).
absl::StatusOr<LoadResult> LoadWithMetadata(StateDict& state,
                                            absl::StatusOr<Storage*> storage,
                                            const Metadata& metadata,
                                            const LoadOptions& options);

// LoadAll against an opened storage.
absl::StatusOr<StateDict> LoadAllFromStorage(Storage& storage,
                                             const LoadOptions& options);

// The bytes of the metadata file `name` (metadata.json, or a rank folder's),
// with capacity to spare for the message header that the load's broadcast
// puts in front (internal_comm::kSealHeaderBytes), so that it does not copy
// them: 988 MB in the 16k-rank FSDP simulation. kNotFound "no committed
// checkpoint at ..." when the file is missing.
absl::StatusOr<std::string> ReadMetadataText(Storage& storage,
                                             const std::string& name);

// Reads, decodes and validates metadata.json (including chunk coverage).
absl::StatusOr<Metadata> ReadMetadataFromStorage(Storage& storage);

// The same for a metadata file by name (e.g. "rank-00003/metadata.json");
// coverage is checked only when it is global metadata (rank < 0).
absl::StatusOr<Metadata> ReadMetadataFile(Storage& storage,
                                          const std::string& name);

// Merge against an opened storage.
absl::StatusOr<MergeResult> MergeInStorage(Storage& storage,
                                           const MergeOptions& options);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_CHECKPOINT_IMPL_H_
