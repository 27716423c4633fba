// What a checkpoint will record of a key-value table (issue 36, in
// progress: Save does not write tables yet, nor Load read them): its spec,
// the row count of each bucket, and its chunks, each a range of rows in
// (bucket, id) order whose ids and columns lie side by side in one data
// file. The checks a load makes of it as untrusted input, and the chunks a
// rank's buckets need.
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

// Rows [rows.begin, rows.end) of a table: their ids (I64 [n]) and each
// column ([n, width] of its dtype), n = rows.size().
struct KvChunk {
  KvRowRange rows;
  ByteLocation ids;
  std::vector<ByteLocation> columns;  // one per spec column, in order
};

struct KvTableMetadata {
  KvTableSpec spec;
  std::vector<uint64_t> rows_per_bucket;  // B counts, in bucket order
  std::vector<KvChunk> chunks;            // in row order
};

// OK when `md` is a consistent table: a valid spec; B row counts whose sum
// fits; chunks of at least one row that tile the rows in order; each
// chunk's ids and columns sized for its rows (8 bytes an id, width x dtype
// a column row) and all in one file, as the format keeps them. Otherwise
// kDataLoss naming `table`, the chunk and what is wrong.
absl::Status ValidateKvTableMetadata(std::string_view table,
                                     const KvTableMetadata& md);

// The chunks [first, last) that hold rows of buckets `range`, and those
// rows. `md` must be valid; kInvalidArgument when `range` is not inside
// [0, B). An empty range, or buckets without rows, need no chunk.
struct KvChunkSpan {
  size_t first = 0;
  size_t last = 0;
  KvRowRange rows;
};
absl::StatusOr<KvChunkSpan> KvChunksOfBuckets(const KvTableMetadata& md,
                                              KvBucketRange range);

}  // namespace cairn::internal_kv

#endif  // CAIRN_KV_KV_METADATA_H_
