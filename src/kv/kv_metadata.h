// The checks a load makes of a key-value table's metadata
// (cairn::KvTableMetadata, include/cairn/metadata.h) as untrusted input,
// and the chunks a rank's buckets need.
#ifndef CAIRN_KV_KV_METADATA_H_
#define CAIRN_KV_KV_METADATA_H_

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/kv_table.h"
#include "cairn/metadata.h"

namespace cairn::internal_kv {

using KvChunk = KvChunkMetadata;

// OK when `md` is a consistent table: a valid spec; a held bucket range
// inside [0, B) with one row count per held bucket, whose sum fits; chunks of at least one row that tile the rows in order; each
// chunk's ids and columns sized for its rows (8 bytes an id, width x dtype
// a column row) and all in one file, as the format keeps them. Otherwise
// kDataLoss naming `table`, the chunk and what is wrong.
absl::Status ValidateKvTableMetadata(std::string_view table,
                                     const KvTableMetadata& md);

// The chunks [first, last) that hold rows of buckets `range`, and those
// rows (counted from the first held bucket). `md` must be valid;
// kInvalidArgument when `range` is not inside the held buckets. An empty range, or buckets without rows, need no chunk.
struct KvChunkSpan {
  size_t first = 0;
  size_t last = 0;
  KvRowRange rows;
};
absl::StatusOr<KvChunkSpan> KvChunksOfBuckets(const KvTableMetadata& md,
                                              KvBucketRange range);

}  // namespace cairn::internal_kv

#endif  // CAIRN_KV_KV_METADATA_H_
