// The checks of a key-value table's metadata, and the chunks a bucket
// range needs (kv_metadata.h).
#include "kv/kv_metadata.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "core/status.h"

namespace cairn::internal_kv {

absl::Status ValidateKvTableMetadata(std::string_view table,
                                     const KvTableMetadata& md) {
  if (absl::Status s = ValidateKvTableSpec(table, md.spec); !s.ok()) {
    return absl::DataLossError(s.message());
  }
  auto bad = [&](std::string_view why) {
    return absl::DataLossError(
        absl::StrFormat("key-value table %s: %s", table, why));
  };
  if (md.buckets.begin < 0 || md.buckets.end < md.buckets.begin ||
      md.buckets.end > md.spec.num_buckets) {
    return bad(absl::StrFormat("holds buckets [%d, %d), not a range of the "
                               "%d buckets",
                               md.buckets.begin, md.buckets.end,
                               md.spec.num_buckets));
  }
  if (md.rows_per_bucket.size() != static_cast<uint64_t>(md.buckets.size())) {
    return bad(absl::StrFormat("%d row counts for the %d buckets [%d, %d)",
                               md.rows_per_bucket.size(), md.buckets.size(),
                               md.buckets.begin, md.buckets.end));
  }
  uint64_t rows = 0;
  for (size_t b = 0; b < md.rows_per_bucket.size(); ++b) {
    if (md.rows_per_bucket[b] > std::numeric_limits<int64_t>::max() - rows) {
      return bad(absl::StrFormat("the row counts overflow at bucket %d", b));
    }
    rows += md.rows_per_bucket[b];
  }
  uint64_t next = 0;  // the first row the next chunk must start at
  for (size_t k = 0; k < md.chunks.size(); ++k) {
    const KvChunk& c = md.chunks[k];
    auto chunk_bad = [&](std::string_view why) {
      return bad(absl::StrFormat("chunk %d (rows [%d, %d)): %s", k,
                                 c.rows.begin, c.rows.end, why));
    };
    if (c.rows.begin != next) {
      return chunk_bad(absl::StrFormat(
          "starts at row %d, but the chunks before end at row %d", c.rows.begin,
          next));
    }
    if (c.rows.end <= c.rows.begin || c.rows.end > rows) {
      return chunk_bad(absl::StrFormat("not a non-empty range of the %d rows",
                                       rows));
    }
    const uint64_t n = c.rows.size();
    // Sizes are computed with overflow checks: rows read from untrusted
    // metadata can number up to 2^63, and a wrapped product could match a
    // small stored size.
    uint64_t ids_bytes = 0;
    if (__builtin_mul_overflow(n, uint64_t{8}, &ids_bytes)) {
      return chunk_bad(absl::StrFormat("the ids of %d rows overflow", n));
    }
    if (c.ids.nbytes != ids_bytes) {
      return chunk_bad(absl::StrFormat("its ids take %d bytes, not %d",
                                       c.ids.nbytes, ids_bytes));
    }
    if (c.columns.size() != md.spec.columns.size()) {
      return chunk_bad(absl::StrFormat("%d columns stored, the table has %d",
                                       c.columns.size(),
                                       md.spec.columns.size()));
    }
    for (size_t j = 0; j < c.columns.size(); ++j) {
      const KvColumn& col = md.spec.columns[j];
      // A valid spec's row of a column is at most 1 GiB.
      const uint64_t row_bytes =
          static_cast<uint64_t>(col.width) * DTypeSize(col.dtype);
      uint64_t want = 0;
      if (__builtin_mul_overflow(n, row_bytes, &want)) {
        return chunk_bad(absl::StrFormat(
            "column \"%s\" of %d rows overflows", col.name, n));
      }
      if (c.columns[j].nbytes != want) {
        return chunk_bad(absl::StrFormat("column \"%s\" takes %d bytes, not %d",
                                         col.name, c.columns[j].nbytes, want));
      }
      if (c.columns[j].file != c.ids.file) {
        return chunk_bad(absl::StrFormat(
            "column \"%s\" is in %s, its ids in %s: a chunk's ids and rows "
            "are stored together",
            col.name, c.columns[j].file, c.ids.file));
      }
    }
    next = c.rows.end;
  }
  if (next != rows) {
    return bad(absl::StrFormat("the chunks hold rows [0, %d) of %d", next,
                               rows));
  }
  return absl::OkStatus();
}

absl::StatusOr<KvChunkSpan> KvChunksOfBuckets(const KvTableMetadata& md,
                                              KvBucketRange range) {
  if (range.size() > 0 && !(range.begin >= md.buckets.begin &&
                            range.end <= md.buckets.end)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "buckets [%d, %d) are not inside the held buckets [%d, %d)",
        range.begin, range.end, md.buckets.begin, md.buckets.end));
  }
  if (range.size() <= 0) return KvChunkSpan{};
  CAIRN_ASSIGN_OR_RETURN(
      KvRowRange rows,
      KvRowsOfBuckets(md.rows_per_bucket,
                      {range.begin - md.buckets.begin,
                       range.end - md.buckets.begin}));
  KvChunkSpan span;
  span.rows = rows;
  if (rows.size() == 0) return span;
  // The first chunk ending past rows.begin, through the first starting at
  // or past rows.end.
  auto first = std::upper_bound(
      md.chunks.begin(), md.chunks.end(), rows.begin,
      [](uint64_t row, const KvChunk& c) { return row < c.rows.end; });
  auto last = std::lower_bound(
      first, md.chunks.end(), rows.end,
      [](const KvChunk& c, uint64_t row) { return c.rows.begin < row; });
  span.first = static_cast<size_t>(first - md.chunks.begin());
  span.last = static_cast<size_t>(last - md.chunks.begin());
  return span;
}

}  // namespace cairn::internal_kv
