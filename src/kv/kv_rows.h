// What every key-value table backend does the same way: the checks of a
// table's owned buckets and of a batch given to KvSink::Apply, and the
// packing of a batch's row into a table's row bytes (every column's
// elements one after another, include/cairn/kv_table.h) and back into a
// KvBatch. InMemoryKvTable and RocksDbKvTable both use them, so they
// refuse the same batches with the same messages.
#ifndef CAIRN_KV_KV_ROWS_H_
#define CAIRN_KV_KV_ROWS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"

namespace cairn::internal_kv {

// OK when `owned` lies inside [0, B) of `spec` (which must be valid);
// kInvalidArgument naming `table` otherwise.
absl::Status CheckKvOwnedBuckets(std::string_view table,
                                 const KvTableSpec& spec, KvBucketRange owned);

// OK when a batch of `ids` and `columns` may be applied to table `table` of
// `spec` owning `owned`: one column per spec column, each a host view of
// the column's dtype and shape [ids.size(), width] (any strides), and
// every id one of an owned bucket. kInvalidArgument naming the table and
// the first problem otherwise (for an id: the id, its bucket and the
// owned range).
absl::Status CheckKvBatch(std::string_view table, const KvTableSpec& spec,
                          KvBucketRange owned, std::span<const int64_t> ids,
                          std::span<const TensorView> columns);

// Copies row `i` of the checked batch `columns` into `row` (spec.row_bytes()
// bytes), column after column.
void PackKvRow(const KvTableSpec& spec, std::span<const TensorView> columns,
               int64_t i, std::byte* row);

// Empty batch columns for `rows` rows: one [rows, width] host tensor of
// each spec column's dtype.
absl::StatusOr<std::vector<Tensor>> NewKvBatchColumns(const KvTableSpec& spec,
                                                      int64_t rows);

// Copies `row` (spec.row_bytes() bytes) into row `i` of `columns`, made by
// NewKvBatchColumns.
void UnpackKvRow(const KvTableSpec& spec, const std::byte* row, int64_t i,
                 std::span<Tensor> columns);

// Copies `row` (spec.row_bytes() bytes) into row `i` of `room`.
void UnpackKvRow(const KvTableSpec& spec, const std::byte* row, size_t i,
                 const KvRowsRoom& room);

}  // namespace cairn::internal_kv

#endif  // CAIRN_KV_KV_ROWS_H_
