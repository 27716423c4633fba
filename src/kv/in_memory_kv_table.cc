// InMemoryKvTable: a key-value table in a hash map, the backend of the
// tests and the demo (include/cairn/kv_table.h).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"
#include "core/status.h"

namespace cairn {
namespace {

// The rows of a table's snapshot, in (bucket, id) order, a batch at a time.
class InMemorySource : public KvSource {
 public:
  InMemorySource(const InMemoryKvTable& table, int64_t batch_rows)
      : table_(table), batch_rows_(std::max<int64_t>(batch_rows, 1)) {}

  absl::Status Begin() override {
    order_.clear();
    next_ = 0;
    // The table only holds ids of its own buckets (Apply checks).
    table_.ForEachId([&](int64_t id) {
      order_.emplace_back(*KvBucketOf(table_.spec(), id), id);
    });
    std::sort(order_.begin(), order_.end());
    begun_ = true;
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Next(KvBatch& batch) override {
    if (!begun_) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "key-value table %s: Next() before Begin()", table_.name()));
    }
    if (next_ == order_.size()) return false;
    const size_t n = std::min(order_.size() - next_,
                              static_cast<size_t>(batch_rows_));
    const KvTableSpec& spec = table_.spec();
    batch.ids.resize(n);
    batch.columns.clear();
    for (const KvColumn& c : spec.columns) {
      CAIRN_ASSIGN_OR_RETURN(
          Tensor t, Tensor::Empty(c.dtype, {static_cast<int64_t>(n), c.width}));
      batch.columns.push_back(std::move(t));
    }
    for (size_t i = 0; i < n; ++i) {
      const int64_t id = order_[next_ + i].second;
      batch.ids[i] = id;
      const std::byte* row = table_.Find(id);
      size_t at = 0;
      for (size_t c = 0; c < spec.columns.size(); ++c) {
        const size_t bytes = static_cast<size_t>(spec.columns[c].width) *
                             DTypeSize(spec.columns[c].dtype);
        std::memcpy(static_cast<std::byte*>(batch.columns[c].data()) + i * bytes,
                    row + at, bytes);
        at += bytes;
      }
    }
    next_ += n;
    return true;
  }

  absl::Status End() override {
    order_.clear();
    begun_ = false;
    return absl::OkStatus();
  }

 private:
  const InMemoryKvTable& table_;
  const int64_t batch_rows_;
  std::vector<std::pair<int64_t, int64_t>> order_;  // (bucket, id)
  size_t next_ = 0;
  bool begun_ = false;
};

}  // namespace

InMemoryKvTable::InMemoryKvTable(std::string name, KvTableSpec spec,
                                 KvBucketRange owned)
    : name_(std::move(name)),
      spec_(std::move(spec)),
      owned_(owned),
      row_bytes_(spec_.row_bytes()) {}

absl::StatusOr<std::unique_ptr<InMemoryKvTable>> InMemoryKvTable::Create(
    std::string name, KvTableSpec spec, KvBucketRange owned) {
  CAIRN_RETURN_IF_ERROR(ValidateKvTableSpec(name, spec));
  if (owned.begin < 0 || owned.end < owned.begin ||
      owned.end > spec.num_buckets) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "key-value table %s: owned buckets [%d, %d) are not inside its %d",
        name, owned.begin, owned.end, spec.num_buckets));
  }
  return std::unique_ptr<InMemoryKvTable>(
      new InMemoryKvTable(std::move(name), std::move(spec), owned));
}

absl::Status InMemoryKvTable::Apply(std::span<const int64_t> ids,
                                    std::span<const TensorView> columns) {
  const int64_t n = static_cast<int64_t>(ids.size());
  if (columns.size() != spec_.columns.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "key-value table %s: a batch of %d columns for a table of %d", name_,
        columns.size(), spec_.columns.size()));
  }
  for (size_t c = 0; c < columns.size(); ++c) {
    const KvColumn& want = spec_.columns[c];
    const TensorView& v = columns[c];
    if (v.dtype() != want.dtype || v.shape() != Shape{n, want.width} ||
        !v.device().is_cpu() || (n > 0 && v.data() == nullptr)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "key-value table %s: column \"%s\" of a batch of %d rows must be "
          "host %s [%d, %d], not %s %s",
          name_, want.name, n, DTypeName(want.dtype), n, want.width,
          v.device().ToString(), DTypeName(v.dtype())));
    }
  }
  // Every id first, so a bad batch changes nothing.
  for (int64_t i = 0; i < n; ++i) {
    absl::StatusOr<int64_t> bucket = KvBucketOf(spec_, ids[i]);
    if (!bucket.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "key-value table %s: %s", name_, bucket.status().message()));
    }
    if (!owned_.contains(*bucket)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "key-value table %s: id %d is in bucket %d, not in this table's "
          "buckets [%d, %d)",
          name_, ids[i], *bucket, owned_.begin, owned_.end));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    auto [it, fresh] = index_.try_emplace(ids[i], index_.size());
    if (fresh) rows_.resize(rows_.size() + static_cast<size_t>(row_bytes_));
    std::byte* row = rows_.data() + it->second * static_cast<size_t>(row_bytes_);
    size_t at = 0;
    for (size_t c = 0; c < columns.size(); ++c) {
      const int64_t width = spec_.columns[c].width;
      const size_t es = DTypeSize(spec_.columns[c].dtype);
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
  return absl::OkStatus();
}

std::vector<uint64_t> InMemoryKvTable::RowsPerBucket() const {
  std::vector<uint64_t> counts(static_cast<size_t>(owned_.size()), 0);
  for (const auto& [id, slot] : index_) {
    ++counts[static_cast<size_t>(*KvBucketOf(spec_, id) - owned_.begin)];
  }
  return counts;
}

const std::byte* InMemoryKvTable::Find(int64_t id) const {
  auto it = index_.find(id);
  if (it == index_.end()) return nullptr;
  return rows_.data() + it->second * static_cast<size_t>(row_bytes_);
}

void InMemoryKvTable::ForEachId(absl::FunctionRef<void(int64_t)> fn) const {
  for (const auto& [id, slot] : index_) fn(id);
}

std::unique_ptr<KvSource> InMemoryKvTable::Source(int64_t batch_rows) const {
  return std::make_unique<InMemorySource>(*this, batch_rows);
}

}  // namespace cairn
