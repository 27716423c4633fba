// Save and load against an already opened Storage, so tests can wrap the
// storage (fault injection, byte counting). The public functions in
// checkpoint.h open the URL and call these.
#ifndef CAIRN_CHECKPOINT_CHECKPOINT_IMPL_H_
#define CAIRN_CHECKPOINT_CHECKPOINT_IMPL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/box.h"
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

// `source_file`: the URL named a Hugging Face file in this folder
// (hf_import.h, OpenSourceUrl), which is the source.
absl::StatusOr<LoadResult> LoadFromStorage(StateDict& state,
                                           absl::StatusOr<Storage*> storage,
                                           const LoadOptions& options,
                                           std::string_view source_file = {});

// Load with metadata already read and validated by this rank (every rank of
// options.comm must pass the same metadata).
absl::StatusOr<LoadResult> LoadWithMetadata(StateDict& state,
                                            absl::StatusOr<Storage*> storage,
                                            const Metadata& metadata,
                                            const LoadOptions& options);

// A rank's load-planning message to the coordinator: its whole local plan,
// or, for a DefaultLoadPlanner or subclass (whose final CreateGlobalPlan
// returns the local plans unchanged, so each rank keeps its own), a summary: how many
// items it reads, a hash of them (for replica groups), and its unexpected
// leaves as one bit per stored leaf. Either way it ends with a flag: the
// rank asks for node reads (LoadOptions::share_node_reads).
absl::StatusOr<std::string> EncodeLocalLoadPlan(const LoadPlanner& planner,
                                                const LoadPlan& plan,
                                                const Metadata& metadata,
                                                bool node_reads = false);

// The coordinator's step of load planning: `gathered[r]` is rank r's
// EncodeLocalLoadPlan. Narrows `unexpected` to the stored leaves no rank
// asked for, calls planner.CreateGlobalPlan (whole plans only), finds the
// replica groups (when `broadcast_replicas`; from summaries by hash, which
// the ranks then check exactly), and returns the scatter's payloads: rank
// r's group, whether any rank asked for node reads, and its final plan, or
// for summaries the unexpected leaves.
absl::StatusOr<std::vector<std::string>> PlanLoadGlobally(
    LoadPlanner& planner, const Metadata& metadata,
    const std::vector<std::string>& gathered, bool broadcast_replicas);

// Tests only: the hash replica grouping compares plan summaries by (null:
// cairn's own). One that collides shows that groups are checked exactly.
void SetReplicaHashForTesting(uint64_t (*hash)(std::string_view));

// LoadAll against an opened storage.
absl::StatusOr<StateDict> LoadAllFromStorage(Storage& storage,
                                             const LoadOptions& options,
                                             std::string_view source_file = {});

// The bytes of the metadata file `name` (metadata.json, or a rank folder's),
// with capacity to spare for the message header that the load's broadcast
// puts in front (internal_comm::kSealHeaderBytes), so that it does not copy
// them: 988 MB in the 16k-rank FSDP simulation. kNotFound "no committed
// checkpoint at ..." when the file is missing.
absl::StatusOr<std::string> ReadMetadataText(Storage& storage,
                                             const std::string& name);

// Reads, decodes and validates metadata.json (including chunk coverage).
absl::StatusOr<Metadata> ReadMetadataFromStorage(Storage& storage);

// The same, or, where there is no metadata.json (or `source_file` names a
// Hugging Face file), the metadata of the Hugging Face source named by
// `names` (hf_import.h).
absl::StatusOr<Metadata> ReadAnyMetadata(Storage& storage,
                                         std::string_view source_file,
                                         const ImportNames& names);

// The same for a metadata file by name (e.g. "rank-00003/metadata.json");
// coverage is checked only when it is global metadata (rank < 0).
absl::StatusOr<Metadata> ReadMetadataFile(Storage& storage,
                                          const std::string& name);

// OK when every chunk and object of `metadata` lies inside its data file
// (ValidateAgainstFileSizes with the files' real sizes) and no two share a
// byte (ValidateDisjointLocations): kDataLoss naming the FQN, file, offset
// and size, kNotFound naming a missing file. So what LoadAll allocates is
// bounded by the files' total size, whatever metadata.json declares. LoadAll
// asks it before allocating, Merge before committing.
absl::Status CheckLocationsAgainstFiles(Storage& storage,
                                        const Metadata& metadata);

// A checksummed, contiguous piece of a stored chunk (or object): where it
// starts in the chunk, its bytes and their CRC32C.
struct CrcPiece {
  uint64_t offset;
  uint64_t bytes;
  uint32_t crc;
};

// A part of a stored chunk that is not contiguous in it (a box cut across
// its rows and columns: global coordinates, inside the chunk's box) and the
// part's signature (format/crc32c.h: the linear CRC of the chunk with the
// bytes outside the part zeroed).
struct SignedPart {
  Box box;
  uint32_t signature = 0;
};

// The checked parts of a chunk of which a rank's load read only parts, for
// the coordinator to combine with the other ranks' parts: the chunk is
// chunks[chunk] of the stored tensor `fqn`.
struct SharedPieces {
  std::string fqn;
  uint64_t chunk = 0;
  // Contiguous runs of it (rows), with their CRC32Cs; adjacent ones merged.
  std::vector<CrcPiece> pieces;
  std::vector<SignedPart> strided;
};

// One rank's SharedPieces, as it sends them to the coordinator at the end
// of a load: a count, then per contiguous piece its tensor's index in
// metadata.tensors (every rank holds the same metadata; U32), chunk index,
// offset and size (U64 each) and CRC32C (U32): kSharedPieceBytes each; then
// a count of strided parts, and per part the tensor's index (U32), chunk
// index (U64), signature (U32), and the box's offsets and sizes (U64 each,
// as many as the tensor has dimensions). kInternal for a tensor the
// metadata lacks.
inline constexpr uint64_t kSharedPieceBytes = 32;
absl::StatusOr<std::string> EncodeSharedPieces(
    const Metadata& metadata, const std::vector<SharedPieces>& shared);

// The coordinator, after a load's reads: `payloads[r]` is rank r's
// EncodeSharedPieces. A chunk whose pieces tile it, from one rank or
// several, has their CRC32Cs combined and compared with its stored one
// (kDataLoss naming the chunk, file, offset and ranks when they differ); a
// chunk that no set of pieces tiles (bytes nobody loaded, or parts that
// overlap unevenly) stays unchecked. A chunk with strided parts is checked
// the same way on boxes: its contiguous pieces as boxes (unchecked when one
// is not a box), identical boxes counted once, the rest disjoint and
// filling the chunk, their signatures XORed. Two ranks that read the same
// bytes must have read the same CRC32C or signature (kDataLoss naming
// both). A malformed payload is kDataLoss, a piece of a chunk the metadata
// lacks an internal error. Returns how many chunks were checked. Linear in
// the pieces and the checkpoint's chunks (a counting sort by chunk), plus,
// for strided parts, the pairs of one chunk's parts whose first dimensions
// overlap.
// With `unchecked`, also the chunks that some rank read parts of and that
// were not checked (no set of parts tiles them), as (the tensor's index in
// metadata.tensors, chunk index), in that order.
absl::StatusOr<uint64_t> CheckSharedPieces(
    const Metadata& metadata, const std::vector<std::string>& payloads,
    std::vector<std::pair<uint32_t, uint64_t>>* unchecked = nullptr);

// A rank's check, after a load, of the parts it read of chunks that the
// coordinator could not check (CheckSharedPieces' `unchecked`, the same
// list on every rank): for each such chunk of which `shared` (this rank's
// parts) holds parts, reads from storage the blocks that enclose them when
// the chunk has block checksums (format version 3, every block a byte of
// a part lies in), else the whole chunk, and compares their CRC32Cs with
// the stored ones; and the bytes read again of each contiguous part must
// have the CRC32C the part had when it was loaded. kDataLoss naming the
// chunk's entry (FQN and box), file and offset. Adds what it read to
// *bytes_read.
absl::Status VerifyUncheckedParts(
    Storage& storage, const Metadata& metadata,
    const std::vector<SharedPieces>& shared,
    const std::vector<std::pair<uint32_t, uint64_t>>& unchecked,
    uint64_t* bytes_read);

// Data files opened by name, kept across checks.
using OpenFiles = std::map<std::string, std::unique_ptr<ReadableFile>>;

// VerifyUncheckedParts's check of one chunk (`fqn`'s `chunk`, of `tm`) for
// the parts `mine` holds, `block_bytes` its block size
// (Metadata::crc32c_block_bytes). Files it opens stay in `files`, so a
// caller checking many pieces opens each file once.
absl::Status VerifyChunkParts(Storage& storage, const std::string& fqn,
                              const TensorMetadata& tm,
                              const ChunkMetadata& chunk, uint64_t block_bytes,
                              const SharedPieces& mine, OpenFiles& files,
                              uint64_t* bytes_read);

// Merge against an opened storage.
absl::StatusOr<MergeResult> MergeInStorage(Storage& storage,
                                           const MergeOptions& options);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_CHECKPOINT_IMPL_H_
