// Save, steps 3 and 4 against a base (SaveOptions::base; incremental
// checkpoints, format version 6, docs/format.md 4.2.2). The coordinator
// reads the base's metadata.json at step 3 and sends its text with the save
// id; every rank indexes the base's chunks (IndexBase), then, before it
// lays out its file, digests each tensor item of its final plan that the
// base stores with the same FQN, box, dtype and shape, on all cores
// (DigestItems): XXH3-128 and CRC32C per checksum block. An item whose
// CRC32C and digest both equal the base chunk's is not written: its
// location is the base chunk's, named as this checkpoint names it
// ("<reference url>/<file>"). The other items' digests are taken by the
// writers as they pass (save_write.h), so a save without a base makes no
// extra pass; every written chunk records its digest, so the next save
// can reuse it in turn.
#ifndef CAIRN_CHECKPOINT_SAVE_REUSE_H_
#define CAIRN_CHECKPOINT_SAVE_REUSE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/checkpoint.h"
#include "cairn/metadata.h"
#include "cairn/planner.h"
#include "checkpoint/referencing_storage.h"
#include "checkpoint/write_report.h"

namespace cairn::internal_checkpoint {

// What a save knows of its base.
struct BaseChunks {
  // Where a reused chunk may be kept, as this checkpoint names them: the
  // base first, then the checkpoints the base itself references (a chunk
  // the base keeps in one of those stays there: references never chain).
  std::vector<CheckpointReference> candidates;
  uint64_t crc32c_block_bytes = 0;
  struct Chunk {
    DType dtype;
    Shape shape;  // the tensor's
    Box box;
    ByteLocation location;  // file named as this checkpoint names it
  };
  // Chunks with a digest, by entry name ("fqn@o0,o1,..."; EntryName).
  std::unordered_map<std::string, Chunk> chunks;
};

// Coordinator, step 3: the base's metadata.json text, validated (decoded,
// chunk coverage), kInvalidArgument when the base is the checkpoint being
// saved, or another block size than `options`'; errors name the base.
absl::StatusOr<std::string> ReadBase(std::string_view own_url,
                                     const SaveOptions& options);

// Every rank: the base's chunks from ReadBase's text.
absl::StatusOr<BaseChunks> IndexBase(std::string_view text,
                                     std::string_view own_url,
                                     std::string_view base_url);

struct ItemDigest {
  // Items the base stores (with a digest) under the same FQN, box, dtype
  // and shape: the digest of the bytes being saved.
  std::optional<ChunkDigest> xxh3;
  // Set when the base holds the item unchanged: its location there.
  const ByteLocation* reuse = nullptr;
  // Digested and not reused: the item's resolved data, held for the
  // writer (a planner resolves each item once).
  std::optional<ResolvedData> held;
};

// A reused chunk's write report entry: the base chunk's location, file
// name and all.
WriteReport::Loc ReusedLocation(const ByteLocation& base);

// Step 4, first: one per item of `plan`. Resolves the items `base` may
// hold with `planner` (at least a batch of `batch_bytes` at a time) and
// digests them in blocks of `block_bytes` on every core; the others are
// left alone.
absl::StatusOr<std::vector<ItemDigest>> DigestItems(
    const SavePlan& plan, SavePlanner& planner, const BaseChunks* base,
    uint64_t block_bytes, uint64_t batch_bytes = uint64_t{256} << 20);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_SAVE_REUSE_H_
