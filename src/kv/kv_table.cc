// The key-value table model: spec validation and the bucketing arithmetic
// (include/cairn/kv_table.h).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <set>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"

namespace cairn {

int64_t KvTableSpec::row_bytes() const {
  int64_t bytes = 0;
  for (const KvColumn& c : columns) {
    bytes += c.width * static_cast<int64_t>(DTypeSize(c.dtype));
  }
  return bytes;
}

absl::Status ValidateKvTableSpec(std::string_view table,
                                 const KvTableSpec& spec) {
  auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrFormat("key-value table %s: %s", table, why));
  };
  if (spec.num_buckets < 1) {
    return bad(absl::StrFormat("%d buckets; a table needs at least one",
                               spec.num_buckets));
  }
  if (spec.bucketing == KvBucketing::kChunked) {
    if (spec.bucket_size < 1) {
      return bad(absl::StrFormat(
          "chunked bucketing needs a positive bucket size, not %d",
          spec.bucket_size));
    }
    if (spec.num_buckets >
        std::numeric_limits<int64_t>::max() / spec.bucket_size) {
      return bad(absl::StrFormat(
          "%d buckets of %d ids overflow the id space", spec.num_buckets,
          spec.bucket_size));
    }
  } else if (spec.bucketing != KvBucketing::kInterleaved) {
    return bad(absl::StrFormat("unknown bucketing %d",
                               static_cast<int>(spec.bucketing)));
  }
  if (spec.columns.empty()) return bad("no columns");
  std::set<std::string_view> names;
  // A row must fit comfortably in memory: 1 GiB is far beyond any real one.
  constexpr int64_t kMaxRowBytes = int64_t{1} << 30;
  int64_t row = 0;
  for (const KvColumn& c : spec.columns) {
    if (c.name.empty()) return bad("a column without a name");
    if (c.name == "ids") {
      return bad("a column named \"ids\" (a chunk's ids are stored under "
                 "that name)");
    }
    if (!names.insert(c.name).second) {
      return bad(absl::StrFormat("two columns named \"%s\"", c.name));
    }
    const int64_t es = static_cast<int64_t>(DTypeSize(c.dtype));
    if (es == 0) {
      return bad(absl::StrFormat("column \"%s\" has an unknown dtype", c.name));
    }
    if (c.width < 1 || c.width > kMaxRowBytes / es) {
      return bad(absl::StrFormat("column \"%s\" has width %d", c.name,
                                 c.width));
    }
    row += c.width * es;
    if (row > kMaxRowBytes) {
      return bad(absl::StrFormat("rows of more than %d bytes", kMaxRowBytes));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> KvBucketOf(const KvTableSpec& spec, int64_t id) {
  if (id < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("id %d is negative; ids are global and >= 0", id));
  }
  if (spec.bucketing == KvBucketing::kInterleaved) return id % spec.num_buckets;
  const int64_t bucket = id / spec.bucket_size;
  if (bucket >= spec.num_buckets) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "id %d is past the table's %d buckets of %d ids", id,
        spec.num_buckets, spec.bucket_size));
  }
  return bucket;
}

KvBucketRange KvBucketsOfRank(int64_t num_buckets, int world, int rank) {
  const int64_t w = world;
  const int64_t base = num_buckets / w;
  const int64_t extra = num_buckets % w;
  const int64_t r = rank;
  const int64_t begin = r * base + std::min(r, extra);
  return KvBucketRange{begin, begin + base + (r < extra ? 1 : 0)};
}

absl::StatusOr<KvRowRange> KvRowsOfBuckets(
    std::span<const uint64_t> rows_per_bucket, KvBucketRange range) {
  const int64_t buckets = static_cast<int64_t>(rows_per_bucket.size());
  if (range.begin < 0 || range.end < range.begin || range.end > buckets) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "buckets [%d, %d) are not inside the table's %d", range.begin,
        range.end, buckets));
  }
  // Rows before the range, then the range's own.
  uint64_t at = 0;
  KvRowRange rows;
  for (int64_t b = 0; b < range.end; ++b) {
    if (b == range.begin) rows.begin = at;
    if (rows_per_bucket[b] > std::numeric_limits<uint64_t>::max() - at) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the row counts of buckets [0, %d] overflow", b));
    }
    at += rows_per_bucket[b];
  }
  if (range.begin == range.end) rows.begin = at;
  rows.end = at;
  return rows;
}

}  // namespace cairn
