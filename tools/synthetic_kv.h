// A synthetic key-value embedding table for `cairn demo --kv` and the
// benchmark's kv row: `rows` distinct ids spread over [0, 2^40) (id i is
// i times an odd constant, mod 2^40: distinct by construction), rows of a
// bf16 weight of width 128 and two optimizer columns (a rowwise Adagrad
// sum, f32[1], and a last-seen step, i64[1]), every byte a function of its
// id, so a load is checked without keeping the table.
#ifndef CAIRN_TOOLS_SYNTHETIC_KV_H_
#define CAIRN_TOOLS_SYNTHETIC_KV_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"

namespace cairn::tools {

inline constexpr int64_t kKvIdSpace = int64_t{1} << 40;

// The table's spec: `buckets` interleaved buckets.
KvTableSpec SyntheticKvSpec(int64_t buckets);

// The ids of `rows` that fall in `owned` buckets of `spec`, in (bucket, id)
// order.
std::vector<int64_t> SyntheticKvIds(const KvTableSpec& spec, uint64_t rows,
                                    KvBucketRange owned);

// A source of the rows of `ids` (in (bucket, id) order), made on the fly:
// straight into the save's chunk (NextInto), or `batch_rows` a batch
// (Next). `spec`'s columns are the synthetic ones whatever its buckets.
std::unique_ptr<KvSource> SyntheticKvSource(const KvTableSpec& spec,
                                            std::vector<int64_t> ids,
                                            int64_t batch_rows);

// The rows of `ids` made before they are saved, each column contiguous, as
// a table in memory holds them: the benchmark's source, so that its timed
// save measures cairn, not the generator.
struct SyntheticKvRows {
  std::vector<int64_t> ids;
  std::vector<std::vector<std::byte>> columns;  // the synthetic spec's
};
SyntheticKvRows MakeSyntheticKvRows(std::vector<int64_t> ids);

// A source that copies `rows` (which must outlive it) straight into the
// save's chunk (NextInto), or out in batches of `batch_rows` (Next).
std::unique_ptr<KvSource> SyntheticKvRowsSource(const SyntheticKvRows& rows,
                                                int64_t batch_rows);

// A sink that checks every row it is given against the generator (and its
// id against `owned` buckets of `dest`) and counts them; it keeps nothing.
// The columns it takes are `columns` (indices into the synthetic spec's).
class CheckingKvSink : public KvSink {
 public:
  CheckingKvSink(KvTableSpec dest, KvBucketRange owned,
                 std::vector<int> columns);
  absl::Status Apply(std::span<const int64_t> ids,
                     std::span<const TensorView> columns) override;
  uint64_t rows() const { return rows_; }

 private:
  KvTableSpec dest_;
  KvBucketRange owned_;
  std::vector<int> columns_;
  KvTableSpec saved_;  // the synthetic spec, for its columns' sizes
  uint64_t rows_ = 0;
};

// A sink that keeps every row (all columns of the synthetic spec) in
// memory allocated and touched up front for `capacity` rows, as a table's
// backend would hold them; Check() then checks them, after the timer. More
// rows than `capacity` fail the load.
class KeepingKvSink : public KvSink {
 public:
  explicit KeepingKvSink(uint64_t capacity);
  absl::Status Apply(std::span<const int64_t> ids,
                     std::span<const TensorView> columns) override;
  uint64_t rows() const { return rows_; }

  // Every row kept is in one of `dest`'s `owned` buckets and holds what
  // was saved for its id, and the ids kept are `expected`, each once.
  absl::Status Check(const KvTableSpec& dest, KvBucketRange owned,
                     std::vector<int64_t> expected) const;

 private:
  SyntheticKvRows kept_;
  std::vector<size_t> row_bytes_;  // of each column
  uint64_t rows_ = 0;
};

}  // namespace cairn::tools

#endif  // CAIRN_TOOLS_SYNTHETIC_KV_H_
