// A key-value table for the tests of saving and loading tables (in-process
// and MPI): a spec with three columns of different dtypes, a deterministic
// id set, rows whose bytes follow from their id, the checks of a loaded
// table, and sources that script their batches or hide NextInto.
#ifndef CAIRN_CHECKPOINT_KV_TEST_UTIL_H_
#define CAIRN_CHECKPOINT_KV_TEST_UTIL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"
#include "core/status.h"
#include "gtest/gtest.h"

namespace cairn::testing_util {

inline KvTableSpec KvSpec(int64_t buckets = 16) {
  KvTableSpec s;
  s.num_buckets = buckets;
  s.bucketing = KvBucketing::kInterleaved;
  s.columns = {{"weight", DType::kBF16, 8},
               {"momentum", DType::kF32, 8},
               {"count", DType::kI64, 1}};
  return s;
}

// The table's ids: `n` distinct ids in [0, 10^6), the same on every rank.
inline std::vector<int64_t> Ids(size_t n, uint64_t seed = 7) {
  std::mt19937_64 rng(seed);
  std::set<int64_t> ids;
  while (ids.size() < n) ids.insert(static_cast<int64_t>(rng() % 1000000));
  return {ids.begin(), ids.end()};
}

// Byte i of column c of row `id`.
inline std::byte RowByte(int64_t id, size_t c, size_t i) {
  return static_cast<std::byte>((id * 131 + c * 17 + i * 7 + (id >> 8)) & 0xff);
}

// Fills `table` with the rows of `ids` in its buckets.
template <typename Table>
absl::Status Fill(Table& table, const std::vector<int64_t>& ids) {
  std::vector<int64_t> mine;
  for (int64_t id : ids) {
    if (table.owned().contains(*KvBucketOf(table.spec(), id))) {
      mine.push_back(id);
    }
  }
  const auto n = static_cast<int64_t>(mine.size());
  std::vector<Tensor> cols;
  std::vector<TensorView> views;
  for (size_t c = 0; c < table.spec().columns.size(); ++c) {
    const KvColumn& col = table.spec().columns[c];
    CAIRN_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(col.dtype, {n, col.width}));
    const size_t row = col.width * DTypeSize(col.dtype);
    for (int64_t r = 0; r < n; ++r) {
      for (size_t i = 0; i < row; ++i) {
        static_cast<std::byte*>(t.data())[r * row + i] = RowByte(mine[r], c, i);
      }
    }
    views.push_back(t.view());
    cols.push_back(std::move(t));
  }
  return table.Apply(mine, views);
}

// Checks that a loaded table (its spec, owned buckets, row count and a
// lookup of a row's bytes) holds exactly the rows of `ids` in its buckets,
// of the saved columns `columns` (indices into `saved`'s), in that order.
inline void ExpectRows(
    const KvTableSpec& spec, KvBucketRange owned, uint64_t size,
    const std::function<std::optional<std::string>(int64_t)>& row_of,
    const KvTableSpec& saved, const std::vector<int64_t>& ids,
    const std::vector<size_t>& columns, const std::string& what) {
  size_t want = 0;
  for (int64_t id : ids) {
    if (!owned.contains(*KvBucketOf(spec, id))) continue;
    ++want;
    const std::optional<std::string> row = row_of(id);
    ASSERT_TRUE(row.has_value()) << what << ": id " << id << " missing";
    size_t at = 0;
    for (size_t c : columns) {
      const KvColumn& col = saved.columns[c];
      const size_t bytes = col.width * DTypeSize(col.dtype);
      ASSERT_LE(at + bytes, row->size()) << what;
      for (size_t i = 0; i < bytes; ++i) {
        ASSERT_EQ(static_cast<std::byte>((*row)[at + i]), RowByte(id, c, i))
            << what << ": id " << id << " column " << col.name;
      }
      at += bytes;
    }
  }
  EXPECT_EQ(size, want) << what;
}

inline void ExpectRows(const InMemoryKvTable& table, const KvTableSpec& saved,
                       const std::vector<int64_t>& ids,
                       const std::vector<size_t>& columns,
                       const std::string& what) {
  const size_t row_bytes = static_cast<size_t>(table.spec().row_bytes());
  ExpectRows(
      table.spec(), table.owned(), table.size(),
      [&](int64_t id) -> std::optional<std::string> {
        const std::byte* row = table.Find(id);
        if (row == nullptr) return std::nullopt;
        return std::string(reinterpret_cast<const char*>(row), row_bytes);
      },
      saved, ids, columns, what);
}

// A source that hides NextInto: pulled with Next.
class NextOnlySource : public KvSource {
 public:
  explicit NextOnlySource(KvSource& inner) : inner_(inner) {}
  absl::Status Begin() override { return inner_.Begin(); }
  absl::StatusOr<bool> Next(KvBatch& batch) override {
    return inner_.Next(batch);
  }
  absl::Status End() override { return inner_.End(); }

 private:
  KvSource& inner_;
};

// A source that yields the batches it is given: with Next only, or
// (`into`) through NextInto as well, copying their rows into the room;
// `overclaim`: NextInto says it wrote one row more than there was room for.
class ScriptedSource : public KvSource {
 public:
  explicit ScriptedSource(std::vector<KvBatch> batches, bool into = false,
                          bool overclaim = false)
      : batches_(std::move(batches)), into_(into), overclaim_(overclaim) {}
  absl::StatusOr<bool> Next(KvBatch& batch) override {
    if (next_ == batches_.size()) return false;
    batch = batches_[next_++];
    return true;
  }
  absl::StatusOr<size_t> NextInto(const KvRowsRoom& room) override {
    if (!into_) return KvSource::NextInto(room);
    if (overclaim_) return room.capacity + 1;
    size_t n = 0;
    while (n < room.capacity && next_ < batches_.size()) {
      const KvBatch& b = batches_[next_];
      const size_t take = std::min(b.ids.size() - row_, room.capacity - n);
      std::copy_n(b.ids.begin() + row_, take, room.ids + n);
      for (size_t c = 0; c < b.columns.size(); ++c) {
        const size_t bytes = b.columns[c].nbytes() / b.ids.size();
        std::memcpy(room.columns[c] + n * bytes,
                    static_cast<const std::byte*>(b.columns[c].data()) +
                        row_ * bytes,
                    take * bytes);
      }
      n += take;
      row_ += take;
      if (row_ == b.ids.size()) {
        ++next_;
        row_ = 0;
      }
    }
    return n;
  }

 private:
  std::vector<KvBatch> batches_;
  bool into_;
  bool overclaim_;
  size_t next_ = 0;
  size_t row_ = 0;  // of batches_[next_], for NextInto
};

// A batch of `ids` for KvSpec()'s columns (zeros), or with column `wrong`
// of dtype U8.
inline KvBatch Batch(const std::vector<int64_t>& ids, int wrong = -1) {
  KvBatch b;
  b.ids = ids;
  const KvTableSpec spec = KvSpec();
  for (size_t c = 0; c < spec.columns.size(); ++c) {
    const DType dtype =
        static_cast<int>(c) == wrong ? DType::kU8 : spec.columns[c].dtype;
    b.columns.push_back(*Tensor::Zeros(
        dtype, {static_cast<int64_t>(ids.size()), spec.columns[c].width}));
  }
  return b;
}

}  // namespace cairn::testing_util

#endif  // CAIRN_CHECKPOINT_KV_TEST_UTIL_H_
