// The batch checks and row packing every key-value table backend shares
// (kv_rows.h).
#include "kv/kv_rows.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"
#include "core/status.h"

namespace cairn::internal_kv {

absl::Status CheckKvOwnedBuckets(std::string_view table,
                                 const KvTableSpec& spec,
                                 KvBucketRange owned) {
  if (owned.begin < 0 || owned.end < owned.begin ||
      owned.end > spec.num_buckets) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "key-value table %s: owned buckets [%d, %d) are not inside its %d",
        table, owned.begin, owned.end, spec.num_buckets));
  }
  return absl::OkStatus();
}

absl::Status CheckKvBatch(std::string_view table, const KvTableSpec& spec,
                          KvBucketRange owned, std::span<const int64_t> ids,
                          std::span<const TensorView> columns) {
  const int64_t n = static_cast<int64_t>(ids.size());
  if (columns.size() != spec.columns.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "key-value table %s: a batch of %d columns for a table of %d", table,
        columns.size(), spec.columns.size()));
  }
  for (size_t c = 0; c < columns.size(); ++c) {
    const KvColumn& want = spec.columns[c];
    const TensorView& v = columns[c];
    if (v.dtype() != want.dtype || v.shape() != Shape{n, want.width} ||
        !v.device().is_cpu() || (n > 0 && v.data() == nullptr)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "key-value table %s: column \"%s\" of a batch of %d rows must be "
          "host %s [%d, %d], not %s %s",
          table, want.name, n, DTypeName(want.dtype), n, want.width,
          v.device().ToString(), DTypeName(v.dtype())));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    absl::StatusOr<int64_t> bucket = KvBucketOf(spec, ids[i]);
    if (!bucket.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "key-value table %s: %s", table, bucket.status().message()));
    }
    if (!owned.contains(*bucket)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "key-value table %s: id %d is in bucket %d, not in this table's "
          "buckets [%d, %d)",
          table, ids[i], *bucket, owned.begin, owned.end));
    }
  }
  return absl::OkStatus();
}

void PackKvRow(const KvTableSpec& spec, std::span<const TensorView> columns,
               int64_t i, std::byte* row) {
  size_t at = 0;
  for (size_t c = 0; c < columns.size(); ++c) {
    const int64_t width = spec.columns[c].width;
    const size_t es = DTypeSize(spec.columns[c].dtype);
    // Row i of the column (the view may be strided).
    const TensorView& v = columns[c];
    const std::byte* src = static_cast<const std::byte*>(v.data()) +
                           i * v.strides()[0] * static_cast<int64_t>(es);
    if (width == 1 || v.strides()[1] == 1) {
      std::memcpy(row + at, src, static_cast<size_t>(width) * es);
    } else {
      for (int64_t k = 0; k < width; ++k) {
        std::memcpy(row + at + static_cast<size_t>(k) * es,
                    src + k * v.strides()[1] * static_cast<int64_t>(es), es);
      }
    }
    at += static_cast<size_t>(width) * es;
  }
}

absl::StatusOr<std::vector<Tensor>> NewKvBatchColumns(const KvTableSpec& spec,
                                                      int64_t rows) {
  std::vector<Tensor> columns;
  columns.reserve(spec.columns.size());
  for (const KvColumn& c : spec.columns) {
    CAIRN_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(c.dtype, {rows, c.width}));
    columns.push_back(std::move(t));
  }
  return columns;
}

void UnpackKvRow(const KvTableSpec& spec, const std::byte* row, int64_t i,
                 std::span<Tensor> columns) {
  size_t at = 0;
  for (size_t c = 0; c < spec.columns.size(); ++c) {
    const size_t bytes = static_cast<size_t>(spec.columns[c].width) *
                         DTypeSize(spec.columns[c].dtype);
    std::memcpy(static_cast<std::byte*>(columns[c].data()) +
                    static_cast<size_t>(i) * bytes,
                row + at, bytes);
    at += bytes;
  }
}

void UnpackKvRow(const KvTableSpec& spec, const std::byte* row, size_t i,
                 const KvRowsRoom& room) {
  size_t at = 0;
  for (size_t c = 0; c < spec.columns.size(); ++c) {
    const size_t bytes = static_cast<size_t>(spec.columns[c].width) *
                         DTypeSize(spec.columns[c].dtype);
    std::memcpy(room.columns[c] + i * bytes, row + at, bytes);
    at += bytes;
  }
}

}  // namespace cairn::internal_kv
