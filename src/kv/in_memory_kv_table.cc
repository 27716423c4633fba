// InMemoryKvTable: a key-value table in a hash map, the backend of the
// tests and the demo (include/cairn/kv_table.h).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"
#include "core/status.h"
#include "kv/kv_rows.h"

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
    batch.ids.resize(n);
    CAIRN_ASSIGN_OR_RETURN(
        batch.columns,
        internal_kv::NewKvBatchColumns(table_.spec(), static_cast<int64_t>(n)));
    for (size_t i = 0; i < n; ++i) {
      const int64_t id = order_[next_ + i].second;
      batch.ids[i] = id;
      internal_kv::UnpackKvRow(table_.spec(), table_.Find(id),
                               static_cast<int64_t>(i), batch.columns);
    }
    next_ += n;
    return true;
  }

  absl::StatusOr<size_t> NextInto(const KvRowsRoom& room) override {
    if (!begun_) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "key-value table %s: NextInto() before Begin()", table_.name()));
    }
    const size_t n = std::min(order_.size() - next_, room.capacity);
    for (size_t i = 0; i < n; ++i) {
      const int64_t id = order_[next_ + i].second;
      room.ids[i] = id;
      internal_kv::UnpackKvRow(table_.spec(), table_.Find(id), i, room);
    }
    next_ += n;
    return n;
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
  CAIRN_RETURN_IF_ERROR(internal_kv::CheckKvOwnedBuckets(name, spec, owned));
  return std::unique_ptr<InMemoryKvTable>(
      new InMemoryKvTable(std::move(name), std::move(spec), owned));
}

absl::Status InMemoryKvTable::Apply(std::span<const int64_t> ids,
                                    std::span<const TensorView> columns) {
  // The whole batch first, so a bad batch changes nothing.
  CAIRN_RETURN_IF_ERROR(
      internal_kv::CheckKvBatch(name_, spec_, owned_, ids, columns));
  for (size_t i = 0; i < ids.size(); ++i) {
    auto [it, fresh] = index_.try_emplace(ids[i], index_.size());
    if (fresh) rows_.resize(rows_.size() + static_cast<size_t>(row_bytes_));
    internal_kv::PackKvRow(
        spec_, columns, static_cast<int64_t>(i),
        rows_.data() + it->second * static_cast<size_t>(row_bytes_));
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
