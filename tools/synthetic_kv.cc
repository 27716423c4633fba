// The synthetic key-value table of `cairn demo --kv` and `cairn bench`
// (synthetic_kv.h).
#include "synthetic_kv.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"
#include "core/status.h"

namespace cairn::tools {
namespace {

constexpr uint64_t kOdd = 0x9E3779B97F4A7C15u;

// Row `id`'s bytes of a column: 8-byte words, word k of column c being
// Word(id, c, k) (little-endian; a column's last word cut to its length).
// Words, not bytes: the demo and the benchmark make and check every byte
// inside the timed save and load, so this must cost far less than the IO.
inline uint64_t Word(int64_t id, size_t c, size_t k) {
  return (static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15u) ^
         ((c + 1) * 0xC2B2AE3D27D4EB4Fu + k * 0x165667B19E3779F9u);
}

void FillRow(int64_t id, size_t c, std::byte* out, size_t bytes) {
  size_t k = 0;
  for (; (k + 1) * 8 <= bytes; ++k) {
    const uint64_t w = Word(id, c, k);
    std::memcpy(out + k * 8, &w, 8);
  }
  if (k * 8 < bytes) {
    const uint64_t w = Word(id, c, k);
    std::memcpy(out + k * 8, &w, bytes - k * 8);
  }
}

bool RowMatches(int64_t id, size_t c, const std::byte* in, size_t bytes) {
  size_t k = 0;
  uint64_t diff = 0;
  for (; (k + 1) * 8 <= bytes; ++k) {
    uint64_t w = 0;
    std::memcpy(&w, in + k * 8, 8);
    diff |= w ^ Word(id, c, k);
  }
  if (k * 8 < bytes) {
    uint64_t w = 0, want = Word(id, c, k);
    std::memcpy(&w, in + k * 8, bytes - k * 8);
    const uint64_t mask = (uint64_t{1} << (8 * (bytes - k * 8))) - 1;
    diff |= (w ^ want) & mask;
  }
  return diff == 0;
}

// A source of the synthetic spec's columns whose Next fills its batch
// through its own NextInto.
class IntoSource : public KvSource {
 public:
  explicit IntoSource(int64_t batch_rows)
      : spec_(SyntheticKvSpec(1)),
        batch_rows_(static_cast<size_t>(std::max<int64_t>(batch_rows, 1))) {}

  absl::StatusOr<bool> Next(KvBatch& batch) override {
    const size_t n = std::min(left(), batch_rows_);
    if (n == 0) return false;
    batch.ids.resize(n);
    batch.columns.resize(spec_.columns.size());
    KvRowsRoom room{n, batch.ids.data(), {}};
    for (size_t c = 0; c < spec_.columns.size(); ++c) {
      const KvColumn& col = spec_.columns[c];
      Tensor& t = batch.columns[c];
      const Shape shape{static_cast<int64_t>(n), col.width};
      if (t.dtype() != col.dtype || t.shape() != shape) {
        absl::StatusOr<Tensor> fresh = Tensor::Empty(col.dtype, shape);
        if (!fresh.ok()) return fresh.status();
        t = *std::move(fresh);
      }
      room.columns.push_back(static_cast<std::byte*>(t.data()));
    }
    absl::StatusOr<size_t> got = NextInto(room);
    if (!got.ok()) return got.status();
    return true;
  }

 protected:
  virtual size_t left() const = 0;
  size_t RowBytes(size_t c) const {
    return spec_.columns[c].width * DTypeSize(spec_.columns[c].dtype);
  }

  KvTableSpec spec_;

 private:
  size_t batch_rows_;
};

// Makes each row as it is pulled.
class Source : public IntoSource {
 public:
  Source(std::vector<int64_t> ids, int64_t batch_rows)
      : IntoSource(batch_rows), ids_(std::move(ids)) {}

  absl::StatusOr<size_t> NextInto(const KvRowsRoom& room) override {
    const size_t n = std::min(left(), room.capacity);
    std::memcpy(room.ids, ids_.data() + next_, n * 8);
    for (size_t c = 0; c < spec_.columns.size(); ++c) {
      const size_t row = RowBytes(c);
      for (size_t r = 0; r < n; ++r) {
        FillRow(ids_[next_ + r], c, room.columns[c] + r * row, row);
      }
    }
    next_ += n;
    return n;
  }

 private:
  size_t left() const override { return ids_.size() - next_; }

  std::vector<int64_t> ids_;
  size_t next_ = 0;
};

// Copies rows made before.
class RowsSource : public IntoSource {
 public:
  RowsSource(const SyntheticKvRows& rows, int64_t batch_rows)
      : IntoSource(batch_rows), rows_(rows) {}

  absl::StatusOr<size_t> NextInto(const KvRowsRoom& room) override {
    const size_t n = std::min(left(), room.capacity);
    std::memcpy(room.ids, rows_.ids.data() + next_, n * 8);
    for (size_t c = 0; c < spec_.columns.size(); ++c) {
      const size_t row = RowBytes(c);
      std::memcpy(room.columns[c], rows_.columns[c].data() + next_ * row,
                  n * row);
    }
    next_ += n;
    return n;
  }

 private:
  size_t left() const override { return rows_.ids.size() - next_; }

  const SyntheticKvRows& rows_;
  size_t next_ = 0;
};

}  // namespace

KvTableSpec SyntheticKvSpec(int64_t buckets) {
  KvTableSpec s;
  s.num_buckets = buckets;
  s.bucketing = KvBucketing::kInterleaved;
  s.columns = {{"weight", DType::kBF16, 128},
               {"adagrad_sum", DType::kF32, 1},
               {"last_seen", DType::kI64, 1}};
  return s;
}

std::vector<int64_t> SyntheticKvIds(const KvTableSpec& spec, uint64_t rows,
                                    KvBucketRange owned) {
  std::vector<std::pair<int64_t, int64_t>> keyed;
  for (uint64_t i = 0; i < rows; ++i) {
    const auto id = static_cast<int64_t>((i * kOdd) & (kKvIdSpace - 1));
    const int64_t b = *KvBucketOf(spec, id);
    if (owned.contains(b)) keyed.emplace_back(b, id);
  }
  std::sort(keyed.begin(), keyed.end());
  std::vector<int64_t> ids;
  ids.reserve(keyed.size());
  for (const auto& [b, id] : keyed) ids.push_back(id);
  return ids;
}

std::unique_ptr<KvSource> SyntheticKvSource(const KvTableSpec& spec,
                                            std::vector<int64_t> ids,
                                            int64_t batch_rows) {
  return std::make_unique<Source>(std::move(ids), batch_rows);
}

SyntheticKvRows MakeSyntheticKvRows(std::vector<int64_t> ids) {
  const KvTableSpec spec = SyntheticKvSpec(1);
  SyntheticKvRows out;
  out.ids = std::move(ids);
  for (size_t c = 0; c < spec.columns.size(); ++c) {
    const size_t row = spec.columns[c].width * DTypeSize(spec.columns[c].dtype);
    std::vector<std::byte>& col = out.columns.emplace_back(out.ids.size() * row);
    for (size_t r = 0; r < out.ids.size(); ++r) {
      FillRow(out.ids[r], c, col.data() + r * row, row);
    }
  }
  return out;
}

std::unique_ptr<KvSource> SyntheticKvRowsSource(const SyntheticKvRows& rows,
                                                int64_t batch_rows) {
  return std::make_unique<RowsSource>(rows, batch_rows);
}

CheckingKvSink::CheckingKvSink(KvTableSpec dest, KvBucketRange owned,
                               std::vector<int> columns)
    : dest_(std::move(dest)),
      owned_(owned),
      columns_(std::move(columns)),
      saved_(SyntheticKvSpec(1)) {}

absl::Status CheckingKvSink::Apply(std::span<const int64_t> ids,
                                   std::span<const TensorView> columns) {
  const KvTableSpec& saved = saved_;
  if (columns.size() != columns_.size()) {
    return absl::InternalError(absl::StrFormat(
        "got %d columns, asked for %d", columns.size(), columns_.size()));
  }
  for (size_t k = 0; k < ids.size(); ++k) {
    const int64_t id = ids[k];
    absl::StatusOr<int64_t> b = KvBucketOf(dest_, id);
    if (!b.ok() || !owned_.contains(*b)) {
      return absl::InternalError(absl::StrFormat(
          "id %d is not in this rank's buckets [%d, %d)", id, owned_.begin,
          owned_.end));
    }
    for (size_t j = 0; j < columns_.size(); ++j) {
      const KvColumn& col = saved.columns[columns_[j]];
      const size_t row = col.width * DTypeSize(col.dtype);
      const auto* p = static_cast<const std::byte*>(columns[j].data()) + k * row;
      if (!RowMatches(id, columns_[j], p, row)) {
        return absl::DataLossError(absl::StrFormat(
            "id %d, column %s differs from what was saved", id, col.name));
      }
    }
  }
  rows_ += ids.size();
  return absl::OkStatus();
}

KeepingKvSink::KeepingKvSink(uint64_t capacity) {
  const KvTableSpec spec = SyntheticKvSpec(1);
  // Zero-filled: every page touched before the load, as the dense rows'
  // destinations are.
  kept_.ids.assign(capacity, 0);
  for (const KvColumn& c : spec.columns) {
    row_bytes_.push_back(c.width * DTypeSize(c.dtype));
    kept_.columns.emplace_back(capacity * row_bytes_.back());
  }
}

absl::Status KeepingKvSink::Apply(std::span<const int64_t> ids,
                                  std::span<const TensorView> columns) {
  if (columns.size() != kept_.columns.size()) {
    return absl::InternalError(absl::StrFormat(
        "got %d columns, the table has %d", columns.size(),
        kept_.columns.size()));
  }
  if (ids.size() > kept_.ids.size() - rows_) {
    return absl::DataLossError(absl::StrFormat(
        "got %d rows more than the %d this rank's buckets hold",
        ids.size() - (kept_.ids.size() - rows_), kept_.ids.size()));
  }
  std::memcpy(kept_.ids.data() + rows_, ids.data(), ids.size() * 8);
  for (size_t c = 0; c < columns.size(); ++c) {
    const size_t row = row_bytes_[c];
    if (columns[c].nbytes() != ids.size() * row) {
      return absl::InternalError(absl::StrFormat(
          "column %d holds %d bytes for %d rows of %d", c, columns[c].nbytes(),
          ids.size(), row));
    }
    std::memcpy(kept_.columns[c].data() + rows_ * row, columns[c].data(),
                columns[c].nbytes());
  }
  rows_ += ids.size();
  return absl::OkStatus();
}

absl::Status KeepingKvSink::Check(const KvTableSpec& dest, KvBucketRange owned,
                                  std::vector<int64_t> expected) const {
  const KvTableSpec spec = SyntheticKvSpec(1);
  CheckingKvSink check(dest, owned, {0, 1, 2});
  std::vector<TensorView> views;
  for (size_t c = 0; c < spec.columns.size(); ++c) {
    // TensorView takes a mutable pointer; the checking sink only reads.
    views.emplace_back(const_cast<std::byte*>(kept_.columns[c].data()),
                       spec.columns[c].dtype,
                       Shape{static_cast<int64_t>(rows_), spec.columns[c].width});
  }
  CAIRN_RETURN_IF_ERROR(check.Apply(
      std::span<const int64_t>(kept_.ids.data(), rows_), views));
  std::vector<int64_t> got(kept_.ids.begin(), kept_.ids.begin() + rows_);
  std::sort(got.begin(), got.end());
  std::sort(expected.begin(), expected.end());
  if (got != expected) {
    const auto dup = std::adjacent_find(got.begin(), got.end());
    return absl::DataLossError(
        dup != got.end()
            ? absl::StrFormat("id %d was loaded twice", *dup)
            : absl::StrFormat("%d rows loaded where %d were saved, or other ids",
                              got.size(), expected.size()));
  }
  return absl::OkStatus();
}

}  // namespace cairn::tools
