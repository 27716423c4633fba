// The RocksDB table against a real database in a temporary directory:
// rows from an in-memory table through Apply and back out of a source,
// byte for byte and in (bucket, id) order; snapshot isolation; refused
// batches; reopening; paths that cannot hold a database.
#include "cairn/rocksdb_kv_table.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv/kv_rows.h"

namespace cairn {
namespace {

using testing::HasSubstr;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// A fresh directory under the test's temporary directory, removed with
// its contents.
class TempDir {
 public:
  TempDir() {
    std::string templ = testing::TempDir();
    if (templ.empty() || templ.back() != '/') templ += '/';
    templ += "cairn-rocksdb-XXXXXX";
    if (mkdtemp(templ.data()) != nullptr) path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// 16 buckets; chunked: 1000 ids each. A weight of width 8 (`weight`'s
// dtype) and an optimizer state of width 1.
KvTableSpec Spec(KvBucketing bucketing, DType weight = DType::kBF16) {
  KvTableSpec spec;
  spec.num_buckets = 16;
  spec.bucketing = bucketing;
  spec.bucket_size = 1000;
  spec.columns = {{"weight", weight, 8}, {"accum", DType::kF32, 1}};
  return spec;
}

constexpr KvBucketRange kOwned{3, 13};

// Deterministic bytes of row `id` (any pattern: compared byte for byte).
std::byte RowByte(int64_t id, size_t i, uint64_t seed) {
  uint64_t x = static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull ^
               (i + 1) * 0xBF58476D1CE4E5B9ull ^ seed * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  return static_cast<std::byte>(x & 0xff);
}

// A batch of `ids` whose rows are RowByte(id, ., seed), column by column.
struct Batch {
  Batch(const KvTableSpec& spec, std::vector<int64_t> ids_in, uint64_t seed)
      : ids(std::move(ids_in)) {
    const int64_t n = static_cast<int64_t>(ids.size());
    columns = *internal_kv::NewKvBatchColumns(spec, n);
    const size_t row_bytes = static_cast<size_t>(spec.row_bytes());
    std::vector<std::byte> row(row_bytes);
    for (int64_t i = 0; i < n; ++i) {
      for (size_t b = 0; b < row_bytes; ++b) row[b] = RowByte(ids[i], b, seed);
      internal_kv::UnpackKvRow(spec, row.data(), i, columns);
    }
    for (const Tensor& t : columns) views.push_back(t.view());
  }
  std::vector<int64_t> ids;
  std::vector<Tensor> columns;
  std::vector<TensorView> views;
};

std::string ExpectedRow(const KvTableSpec& spec, int64_t id, uint64_t seed) {
  std::string row(static_cast<size_t>(spec.row_bytes()), '\0');
  for (size_t b = 0; b < row.size(); ++b) {
    row[b] = static_cast<char>(RowByte(id, b, seed));
  }
  return row;
}

// Every (id, row bytes) a source gives, in its order, checking batch sizes.
std::vector<std::pair<int64_t, std::string>> Drain(const KvTableSpec& spec,
                                                   KvSource& source,
                                                   int64_t batch_rows) {
  std::vector<std::pair<int64_t, std::string>> rows;
  EXPECT_TRUE(source.Begin().ok());
  KvBatch batch;
  while (true) {
    absl::StatusOr<bool> more = source.Next(batch);
    EXPECT_TRUE(more.ok()) << more.status();
    if (!more.ok() || !*more) break;
    EXPECT_GE(batch.ids.size(), 1u);
    EXPECT_LE(static_cast<int64_t>(batch.ids.size()), batch_rows);
    EXPECT_EQ(batch.columns.size(), spec.columns.size());
    std::vector<TensorView> views;
    for (size_t c = 0; c < batch.columns.size(); ++c) {
      EXPECT_EQ(batch.columns[c].dtype(), spec.columns[c].dtype);
      EXPECT_EQ(batch.columns[c].shape(),
                (Shape{static_cast<int64_t>(batch.ids.size()),
                       spec.columns[c].width}));
      views.push_back(batch.columns[c].view());
    }
    for (size_t i = 0; i < batch.ids.size(); ++i) {
      std::string row(static_cast<size_t>(spec.row_bytes()), '\0');
      internal_kv::PackKvRow(spec, views, static_cast<int64_t>(i),
                             reinterpret_cast<std::byte*>(row.data()));
      rows.emplace_back(batch.ids[i], std::move(row));
    }
  }
  EXPECT_TRUE(source.End().ok());
  return rows;
}

std::unique_ptr<RocksDbKvTable> OpenOrDie(const std::string& path,
                                          const KvTableSpec& spec,
                                          KvBucketRange owned = kOwned,
                                          RocksDbKvOptions options = {}) {
  absl::StatusOr<std::unique_ptr<RocksDbKvTable>> table =
      RocksDbKvTable::Open(path, "emb.user", spec, owned, options);
  EXPECT_TRUE(table.ok()) << table.status();
  return table.ok() ? *std::move(table) : nullptr;
}

// Ids of the owned buckets, `count` of them, distinct, in random order;
// interleaved ids spread up to 2^40 so keys differ in many bytes.
std::vector<int64_t> OwnedIds(const KvTableSpec& spec, size_t count,
                              uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t limit = spec.bucketing == KvBucketing::kChunked
                            ? spec.num_buckets * spec.bucket_size
                            : int64_t{1} << 40;
  std::uniform_int_distribution<int64_t> pick(0, limit - 1);
  std::set<int64_t> seen;
  std::vector<int64_t> ids;
  while (ids.size() < count) {
    const int64_t id = pick(rng);
    if (kOwned.contains(*KvBucketOf(spec, id)) && seen.insert(id).second) {
      ids.push_back(id);
    }
  }
  return ids;
}

// A few thousand rows into an in-memory table, through its source into
// RocksDB, and back out of RocksDB's source: the same rows, byte for
// byte, in the same (bucket, id) order, for both bucketings and weight
// dtypes; sizes, counts, Find and ForEachId agree.
TEST(RocksDbKvTableTest, RoundTripFromAnInMemoryTable) {
  for (KvBucketing bucketing :
       {KvBucketing::kChunked, KvBucketing::kInterleaved}) {
    for (DType weight : {DType::kBF16, DType::kF32}) {
      SCOPED_TRACE(testing::Message() << "bucketing "
                                      << static_cast<int>(bucketing) << " "
                                      << DTypeName(weight));
      const KvTableSpec spec = Spec(bucketing, weight);
      auto memory = InMemoryKvTable::Create("emb.user", spec, kOwned);
      ASSERT_TRUE(memory.ok()) << memory.status();
      const std::vector<int64_t> ids = OwnedIds(spec, 3000, 7);
      for (size_t at = 0; at < ids.size(); at += 500) {
        Batch batch(spec, {ids.begin() + at, ids.begin() + at + 500}, 1);
        ASSERT_TRUE((*memory)->Apply(batch.ids, batch.views).ok());
      }

      TempDir dir;
      std::unique_ptr<RocksDbKvTable> rocks = OpenOrDie(dir.Sub("db"), spec);
      ASSERT_NE(rocks, nullptr);
      std::unique_ptr<KvSource> from = (*memory)->Source(257);
      ASSERT_TRUE(from->Begin().ok());
      KvBatch batch;
      while (true) {
        absl::StatusOr<bool> more = from->Next(batch);
        ASSERT_TRUE(more.ok()) << more.status();
        if (!*more) break;
        std::vector<TensorView> views;
        for (const Tensor& t : batch.columns) views.push_back(t.view());
        ASSERT_TRUE(rocks->Apply(batch.ids, views).ok());
      }
      ASSERT_TRUE(from->End().ok());

      std::unique_ptr<KvSource> source = rocks->Source(100);
      const auto rows = Drain(spec, *source, 100);
      ASSERT_EQ(rows.size(), ids.size());
      std::unique_ptr<KvSource> reference = (*memory)->Source(1000);
      const auto expected = Drain(spec, *reference, 1000);
      ASSERT_EQ(rows.size(), expected.size());
      std::vector<std::pair<int64_t, int64_t>> order;  // (bucket, id)
      for (size_t i = 0; i < rows.size(); ++i) {
        ASSERT_EQ(rows[i].first, expected[i].first) << i;
        ASSERT_EQ(rows[i].second, ExpectedRow(spec, rows[i].first, 1))
            << rows[i].first;
        ASSERT_EQ(rows[i].second, expected[i].second) << rows[i].first;
        order.emplace_back(*KvBucketOf(spec, rows[i].first), rows[i].first);
      }
      EXPECT_TRUE(std::is_sorted(order.begin(), order.end()));
      EXPECT_EQ(std::adjacent_find(order.begin(), order.end()), order.end());

      absl::StatusOr<uint64_t> size = rocks->size();
      ASSERT_TRUE(size.ok()) << size.status();
      EXPECT_EQ(*size, ids.size());
      absl::StatusOr<std::vector<uint64_t>> counts = rocks->RowsPerBucket();
      ASSERT_TRUE(counts.ok()) << counts.status();
      EXPECT_EQ(*counts, (*memory)->RowsPerBucket());
      std::vector<int64_t> each;
      ASSERT_TRUE(rocks->ForEachId([&](int64_t id) { each.push_back(id); }).ok());
      std::vector<int64_t> source_ids;
      for (const auto& [id, row] : rows) source_ids.push_back(id);
      EXPECT_EQ(each, source_ids);
      for (size_t i = 0; i < ids.size(); i += 97) {
        absl::StatusOr<std::optional<std::string>> found = rocks->Find(ids[i]);
        ASSERT_TRUE(found.ok()) << found.status();
        ASSERT_TRUE(found->has_value()) << ids[i];
        EXPECT_EQ(**found, std::string(reinterpret_cast<const char*>(
                                           (*memory)->Find(ids[i])),
                                       static_cast<size_t>(spec.row_bytes())));
      }
    }
  }
}

// Batches of one row, and one batch larger than the table; an empty table
// gives nothing.
TEST(RocksDbKvTableTest, BatchOfOneAndLargerThanTheTable) {
  const KvTableSpec spec = Spec(KvBucketing::kInterleaved);
  TempDir dir;
  std::unique_ptr<RocksDbKvTable> table = OpenOrDie(dir.Sub("db"), spec);
  ASSERT_NE(table, nullptr);
  {
    std::unique_ptr<KvSource> source = table->Source(1);
    EXPECT_TRUE(Drain(spec, *source, 1).empty());
  }
  const std::vector<int64_t> ids = OwnedIds(spec, 40, 3);
  Batch batch(spec, ids, 2);
  ASSERT_TRUE(table->Apply(batch.ids, batch.views).ok());
  std::unique_ptr<KvSource> ones = table->Source(1);
  const auto by_one = Drain(spec, *ones, 1);
  std::unique_ptr<KvSource> all = table->Source(1000000);
  const auto at_once = Drain(spec, *all, 1000000);
  ASSERT_EQ(by_one.size(), ids.size());
  EXPECT_EQ(by_one, at_once);
  for (const auto& [id, row] : by_one) {
    EXPECT_EQ(row, ExpectedRow(spec, id, 2)) << id;
  }
  // A batch size below 1 counts as 1.
  std::unique_ptr<KvSource> zero = table->Source(0);
  EXPECT_EQ(Drain(spec, *zero, 1), by_one);
}

// Writes after Begin() are not seen by that source, overwrites included;
// a source begun later sees them. A source dropped without End() releases
// its snapshot (the table then closes and reopens).
TEST(RocksDbKvTableTest, SourceReadsTheSnapshotOfItsBegin) {
  const KvTableSpec spec = Spec(KvBucketing::kChunked);
  TempDir dir;
  std::unique_ptr<RocksDbKvTable> table = OpenOrDie(dir.Sub("db"), spec);
  ASSERT_NE(table, nullptr);
  Batch before(spec, {3000, 3001, 5000, 7000, 9000}, 1);
  ASSERT_TRUE(table->Apply(before.ids, before.views).ok());

  std::unique_ptr<KvSource> source = table->Source(2);
  ASSERT_TRUE(source->Begin().ok());
  KvBatch batch;
  absl::StatusOr<bool> more = source->Next(batch);
  ASSERT_TRUE(more.ok() && *more);
  EXPECT_EQ(batch.ids, (std::vector<int64_t>{3000, 3001}));
  // New rows before and after the source's position, an overwrite of a
  // row it has not reached yet.
  Batch after(spec, {3500, 7000, 8000, 12999}, 9);
  ASSERT_TRUE(table->Apply(after.ids, after.views).ok());
  std::vector<std::pair<int64_t, std::string>> rest;
  while (true) {
    more = source->Next(batch);
    ASSERT_TRUE(more.ok()) << more.status();
    if (!*more) break;
    std::vector<TensorView> views;
    for (const Tensor& t : batch.columns) views.push_back(t.view());
    for (size_t i = 0; i < batch.ids.size(); ++i) {
      std::string row(static_cast<size_t>(spec.row_bytes()), '\0');
      internal_kv::PackKvRow(spec, views, static_cast<int64_t>(i),
                             reinterpret_cast<std::byte*>(row.data()));
      rest.emplace_back(batch.ids[i], row);
    }
  }
  ASSERT_TRUE(source->End().ok());
  ASSERT_EQ(rest.size(), 3u);
  EXPECT_EQ(rest[0].first, 5000);
  EXPECT_EQ(rest[1].first, 7000);
  EXPECT_EQ(rest[1].second, ExpectedRow(spec, 7000, 1)) << "saw the overwrite";
  EXPECT_EQ(rest[2].first, 9000);

  std::unique_ptr<KvSource> later = table->Source(100);
  const auto now = Drain(spec, *later, 100);
  std::vector<int64_t> now_ids;
  for (const auto& [id, row] : now) now_ids.push_back(id);
  EXPECT_EQ(now_ids, (std::vector<int64_t>{3000, 3001, 3500, 5000, 7000, 8000,
                                           9000, 12999}));
  EXPECT_EQ(now[4].second, ExpectedRow(spec, 7000, 9));

  // Begun and dropped without End(); Begin() twice.
  std::unique_ptr<KvSource> dropped = table->Source(3);
  ASSERT_TRUE(dropped->Begin().ok());
  ASSERT_TRUE(dropped->Begin().ok());
  ASSERT_TRUE(dropped->Next(batch).ok());
  dropped.reset();
  table.reset();
  table = OpenOrDie(dir.Sub("db"), spec);
  ASSERT_NE(table, nullptr);
  EXPECT_EQ(*table->size(), 8u);

  // Next() before Begin(), and after End().
  std::unique_ptr<KvSource> unbegun = table->Source(4);
  EXPECT_EQ(unbegun->Next(batch).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(unbegun->Begin().ok());
  ASSERT_TRUE(unbegun->End().ok());
  EXPECT_THAT(Message(unbegun->Next(batch).status()),
              HasSubstr("key-value table emb.user: Next() before Begin()"));
}

// Bad batches change nothing and name the table and the problem, as
// InMemoryKvTable's do.
TEST(RocksDbKvTableTest, BadBatchesAreRefusedWhole) {
  const KvTableSpec spec = Spec(KvBucketing::kChunked);
  TempDir dir;
  std::unique_ptr<RocksDbKvTable> table = OpenOrDie(dir.Sub("db"), spec);
  ASSERT_NE(table, nullptr);
  Batch kept(spec, {4000}, 1);
  ASSERT_TRUE(table->Apply(kept.ids, kept.views).ok());
  auto unchanged = [&] {
    EXPECT_EQ(*table->size(), 1u);
    absl::StatusOr<std::optional<std::string>> row = table->Find(4000);
    ASSERT_TRUE(row.ok() && row->has_value());
    EXPECT_EQ(**row, ExpectedRow(spec, 4000, 1));
  };

  // 4000 first (a good id, overwritten if the batch went in), then 14000 in
  // bucket 14, not owned.
  Batch outside(spec, {4000, 5000, 14000}, 2);
  absl::Status s = table->Apply(outside.ids, outside.views);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("key-value table emb.user: id 14000 is in "
                                    "bucket 14, not in this table's buckets "
                                    "[3, 13)"));
  unchanged();

  Batch past(spec, {4000, 16000}, 2);
  EXPECT_THAT(Message(table->Apply(past.ids, past.views)),
              HasSubstr("id 16000 is past"));
  unchanged();
  std::vector<int64_t> negative = {4000, -3};
  EXPECT_THAT(Message(table->Apply(negative, outside.views)),
              HasSubstr("column \"weight\" of a batch of 2 rows"));
  Batch two(spec, {4000, 4001}, 2);
  EXPECT_THAT(Message(table->Apply(negative, two.views)),
              HasSubstr("id -3 is negative"));
  unchanged();

  Batch good(spec, {4000}, 2);
  std::vector<TensorView> one_column = {good.views[0]};
  EXPECT_THAT(Message(table->Apply(good.ids, one_column)),
              HasSubstr("a batch of 1 columns for a table of 2"));
  unchanged();

  // The weight as F32 where the table has BF16.
  std::vector<float> f32(8, 1.0f);
  std::vector<TensorView> wrong_dtype = good.views;
  wrong_dtype[0] = TensorView(f32.data(), DType::kF32, {1, 8});
  s = table->Apply(good.ids, wrong_dtype);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(s), HasSubstr("column \"weight\" of a batch of 1 rows "
                                    "must be host BF16 [1, 8], not cpu F32"));
  unchanged();

  // A weight of width 4.
  std::vector<uint16_t> narrow(4, 0);
  std::vector<TensorView> wrong_width = good.views;
  wrong_width[0] = TensorView(narrow.data(), DType::kBF16, {1, 4});
  EXPECT_THAT(Message(table->Apply(good.ids, wrong_width)),
              HasSubstr("column \"weight\""));
  unchanged();

  // Find of ids it cannot hold.
  EXPECT_EQ(table->Find(-1).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::optional<std::string>> other = table->Find(100);
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(other->has_value());
  absl::StatusOr<std::optional<std::string>> missing = table->Find(4001);
  ASSERT_TRUE(missing.ok());
  EXPECT_FALSE(missing->has_value());
  // An empty batch is fine and changes nothing.
  std::vector<int64_t> none;
  Batch empty(spec, {}, 1);
  EXPECT_TRUE(table->Apply(none, empty.views).ok());
  unchanged();
}

// Strided column views are read element by element, as by the in-memory
// table.
TEST(RocksDbKvTableTest, StridedColumns) {
  KvTableSpec spec = Spec(KvBucketing::kChunked, DType::kF32);
  TempDir dir;
  std::unique_ptr<RocksDbKvTable> table = OpenOrDie(dir.Sub("db"), spec);
  ASSERT_NE(table, nullptr);
  std::vector<float> wide(2 * 16, 0.0f);
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 8; ++k) wide[i * 16 + k * 2] = 100.0f + i * 10 + k;
  }
  std::vector<float> accum = {1.5f, 2.5f};
  std::vector<int64_t> ids = {3005, 3006};
  std::vector<TensorView> views = {
      TensorView(wide.data(), DType::kF32, {2, 8}, {16, 2}),
      TensorView(accum.data(), DType::kF32, {2, 1})};
  ASSERT_TRUE(table->Apply(ids, views).ok());
  absl::StatusOr<std::optional<std::string>> row = table->Find(3006);
  ASSERT_TRUE(row.ok() && row->has_value());
  float values[9];
  std::memcpy(values, (*row)->data(), sizeof(values));
  EXPECT_EQ(values[0], 110.0f);
  EXPECT_EQ(values[7], 117.0f);
  EXPECT_EQ(values[8], 2.5f);
}

// Reopening sees the rows (also when written without a write-ahead log
// and flushed, or synced); another spec, or owned buckets that leave rows
// out, are refused naming the path and what differs.
TEST(RocksDbKvTableTest, ReopenKeepsRowsAndChecksTheSpec) {
  const KvTableSpec spec = Spec(KvBucketing::kChunked);
  TempDir dir;
  const std::string path = dir.Sub("deep/er/db");
  const std::vector<int64_t> ids = OwnedIds(spec, 200, 11);
  for (RocksDbKvOptions options :
       {RocksDbKvOptions{}, RocksDbKvOptions{.sync_writes = true},
        RocksDbKvOptions{.disable_wal = true}}) {
    std::unique_ptr<RocksDbKvTable> table =
        OpenOrDie(path, spec, kOwned, options);
    ASSERT_NE(table, nullptr);
    EXPECT_EQ(table->path(), path);
    EXPECT_EQ(table->name(), "emb.user");
    EXPECT_EQ(table->spec(), spec);
    EXPECT_EQ(table->owned(), kOwned);
    Batch batch(spec, ids, 5);
    ASSERT_TRUE(table->Apply(batch.ids, batch.views).ok());
    ASSERT_TRUE(table->Flush().ok());
  }
  {
    std::unique_ptr<RocksDbKvTable> table =
        OpenOrDie(path, spec, kOwned, {.create_if_missing = false});
    ASSERT_NE(table, nullptr);
    EXPECT_EQ(*table->size(), ids.size());
    for (int64_t id : ids) {
      absl::StatusOr<std::optional<std::string>> row = table->Find(id);
      ASSERT_TRUE(row.ok() && row->has_value()) << id;
      EXPECT_EQ(**row, ExpectedRow(spec, id, 5));
    }
    // Open twice at once: the second finds the database locked.
    absl::StatusOr<std::unique_ptr<RocksDbKvTable>> again =
        RocksDbKvTable::Open(path, "emb.user", spec, kOwned);
    EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable)
        << again.status();
    EXPECT_THAT(Message(again.status()), HasSubstr(path));
  }

  struct Case {
    std::string why;
    KvTableSpec spec;
  };
  std::vector<Case> cases;
  KvTableSpec s = spec;
  s.num_buckets = 32;
  cases.push_back({"it has 16 buckets, not 32", s});
  s = spec;
  s.bucketing = KvBucketing::kInterleaved;
  cases.push_back({"it has chunked bucketing, not interleaved", s});
  s = spec;
  s.bucket_size = 2000;
  cases.push_back({"it has buckets of 1000 ids, not 2000", s});
  s = spec;
  s.columns[0].width = 16;
  cases.push_back(
      {"its column 0 is \"weight\" BF16 x 8, not \"weight\" BF16 x 16", s});
  s = spec;
  s.columns[1].dtype = DType::kF64;
  cases.push_back({"its column 1 is \"accum\" F32 x 1, not \"accum\" F64", s});
  s = spec;
  s.columns.push_back({"count", DType::kI64, 1});
  cases.push_back({"it has 2 columns", s});
  for (const Case& c : cases) {
    absl::StatusOr<std::unique_ptr<RocksDbKvTable>> table =
        RocksDbKvTable::Open(path, "emb.user", c.spec, kOwned);
    ASSERT_FALSE(table.ok()) << c.why;
    EXPECT_EQ(table.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(Message(table.status()),
                HasSubstr("key-value table emb.user: the RocksDB database at " +
                          path + " was made with another spec"));
    EXPECT_THAT(Message(table.status()), HasSubstr(c.why));
  }

  // Owned buckets that leave held rows out.
  const int64_t first_bucket = *KvBucketOf(spec, *std::min_element(
                                                     ids.begin(), ids.end()));
  absl::StatusOr<std::unique_ptr<RocksDbKvTable>> narrower =
      RocksDbKvTable::Open(path, "emb.user", spec, {first_bucket + 1, 13});
  EXPECT_EQ(narrower.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(narrower.status()),
              HasSubstr("holds rows of bucket " + std::to_string(first_bucket)));
  // Wider is fine.
  EXPECT_NE(OpenOrDie(path, spec, {0, 16}), nullptr);
}

// Paths that cannot hold a database, bad specs and owned ranges, and a
// database that is not a table's.
TEST(RocksDbKvTableTest, OpenErrors) {
  const KvTableSpec spec = Spec(KvBucketing::kChunked);
  TempDir dir;
  const std::string file = dir.Sub("a-file");
  std::ofstream(file) << "not a directory";
  absl::StatusOr<std::unique_ptr<RocksDbKvTable>> under_file =
      RocksDbKvTable::Open(file + "/db", "emb.user", spec, kOwned);
  ASSERT_FALSE(under_file.ok());
  EXPECT_THAT(Message(under_file.status()),
              HasSubstr("key-value table emb.user"));
  EXPECT_THAT(Message(under_file.status()), HasSubstr(file + "/db"));
  EXPECT_THAT(Message(under_file.status()), HasSubstr("Not a directory"));
  // A regular file where the database would be.
  absl::StatusOr<std::unique_ptr<RocksDbKvTable>> at_file =
      RocksDbKvTable::Open(file, "emb.user", spec, kOwned);
  ASSERT_FALSE(at_file.ok());
  EXPECT_THAT(Message(at_file.status()), HasSubstr(file));

  absl::StatusOr<std::unique_ptr<RocksDbKvTable>> missing =
      RocksDbKvTable::Open(dir.Sub("none"), "emb.user", spec, kOwned,
                           {.create_if_missing = false});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(missing.status()), HasSubstr("create_if_missing"));
  EXPECT_FALSE(std::filesystem::exists(dir.Sub("none")));

  EXPECT_EQ(RocksDbKvTable::Open(dir.Sub("x"), "emb.user", spec, {5, 17})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  KvTableSpec bad = spec;
  bad.columns.clear();
  absl::Status no_columns =
      RocksDbKvTable::Open(dir.Sub("x"), "emb.user", bad, {0, 1}).status();
  EXPECT_EQ(no_columns.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(no_columns), HasSubstr("key-value table emb.user"));
  EXPECT_FALSE(std::filesystem::exists(dir.Sub("x")))
      << "a refused spec created the database";
}

}  // namespace
}  // namespace cairn
