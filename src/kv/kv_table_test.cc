// The key-value table model: specs, bucketing, rank ranges, row ranges,
// and the in-memory table as sink and source.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using testing::HasSubstr;

// Weight [D] bf16-sized (here F32 for easy values), a momentum of width 1,
// and an I64 timestamp.
KvTableSpec Spec(KvBucketing bucketing = KvBucketing::kChunked) {
  KvTableSpec spec;
  spec.num_buckets = 10;
  spec.bucketing = bucketing;
  spec.bucket_size = 100;  // ids [0, 1000) when chunked
  spec.columns = {{"weight", DType::kF32, 4},
                  {"momentum", DType::kF32, 1},
                  {"timestamp", DType::kI64, 1}};
  return spec;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(KvTableSpecTest, ValidSpecsAndRowBytes) {
  EXPECT_TRUE(ValidateKvTableSpec("t", Spec()).ok());
  EXPECT_TRUE(ValidateKvTableSpec("t", Spec(KvBucketing::kInterleaved)).ok());
  EXPECT_EQ(Spec().row_bytes(), 4 * 4 + 4 + 8);
}

TEST(KvTableSpecTest, BadSpecsNameTheTableAndTheProblem) {
  struct Case {
    std::string why;
    KvTableSpec spec;
  };
  std::vector<Case> cases;
  KvTableSpec s = Spec();
  s.num_buckets = 0;
  cases.push_back({"0 buckets", s});
  s = Spec();
  s.bucket_size = 0;
  cases.push_back({"positive bucket size", s});
  s = Spec();
  s.num_buckets = int64_t{1} << 40;
  s.bucket_size = int64_t{1} << 30;
  cases.push_back({"overflow the id space", s});
  s = Spec();
  s.columns.clear();
  cases.push_back({"no columns", s});
  s = Spec();
  s.columns[1].name = "weight";
  cases.push_back({"two columns named \"weight\"", s});
  s = Spec();
  s.columns[1].name = "ids";
  cases.push_back({"a column named \"ids\"", s});
  s = Spec();
  s.columns[2].name = "";
  cases.push_back({"without a name", s});
  s = Spec();
  s.columns[0].width = 0;
  cases.push_back({"\"weight\" has width 0", s});
  s = Spec();
  s.columns[0].width = int64_t{1} << 40;
  cases.push_back({"has width", s});
  for (const Case& c : cases) {
    absl::Status st = ValidateKvTableSpec("emb.user", c.spec);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.why;
    EXPECT_THAT(Message(st), HasSubstr("key-value table emb.user")) << c.why;
    EXPECT_THAT(Message(st), HasSubstr(c.why)) << st;
  }
}

TEST(KvBucketTest, ChunkedAndInterleaved) {
  const KvTableSpec chunked = Spec();
  EXPECT_EQ(*KvBucketOf(chunked, 0), 0);
  EXPECT_EQ(*KvBucketOf(chunked, 99), 0);
  EXPECT_EQ(*KvBucketOf(chunked, 100), 1);
  EXPECT_EQ(*KvBucketOf(chunked, 999), 9);
  absl::StatusOr<int64_t> past = KvBucketOf(chunked, 1000);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(past.status()), HasSubstr("id 1000"));
  EXPECT_EQ(KvBucketOf(chunked, -1).status().code(),
            absl::StatusCode::kInvalidArgument);

  const KvTableSpec interleaved = Spec(KvBucketing::kInterleaved);
  EXPECT_EQ(*KvBucketOf(interleaved, 0), 0);
  EXPECT_EQ(*KvBucketOf(interleaved, 13), 3);
  EXPECT_EQ(*KvBucketOf(interleaved, int64_t{1} << 60), (int64_t{1} << 60) % 10);
  EXPECT_THAT(Message(KvBucketOf(interleaved, -5).status()),
              HasSubstr("id -5 is negative"));
}

// The uneven split: ranges tile [0, B) in rank order, the first B % W one
// larger; past B ranks, empty.
TEST(KvBucketTest, RanksOwnContiguousUnevenRanges) {
  EXPECT_EQ(KvBucketsOfRank(10, 3, 0), (KvBucketRange{0, 4}));
  EXPECT_EQ(KvBucketsOfRank(10, 3, 1), (KvBucketRange{4, 7}));
  EXPECT_EQ(KvBucketsOfRank(10, 3, 2), (KvBucketRange{7, 10}));
  for (int64_t buckets : {1, 7, 64, 1000}) {
    for (int world : {1, 2, 3, 4, 7, 8, 13}) {
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        const KvBucketRange range = KvBucketsOfRank(buckets, world, r);
        EXPECT_EQ(range.begin, next) << buckets << " " << world << " " << r;
        EXPECT_GE(range.size(), buckets / world);
        EXPECT_LE(range.size(), buckets / world + 1);
        next = range.end;
      }
      EXPECT_EQ(next, buckets) << buckets << " " << world;
    }
  }
  EXPECT_EQ(KvBucketsOfRank(2, 4, 3).size(), 0);
}

TEST(KvBucketTest, RowsOfBucketsFromTheCounts) {
  const std::vector<uint64_t> counts = {3, 0, 5, 2};
  EXPECT_EQ(*KvRowsOfBuckets(counts, {0, 4}), (KvRowRange{0, 10}));
  EXPECT_EQ(*KvRowsOfBuckets(counts, {1, 3}), (KvRowRange{3, 8}));
  EXPECT_EQ(*KvRowsOfBuckets(counts, {3, 4}), (KvRowRange{8, 10}));
  EXPECT_EQ(*KvRowsOfBuckets(counts, {2, 2}), (KvRowRange{3, 3}));
  EXPECT_EQ(*KvRowsOfBuckets(counts, {4, 4}), (KvRowRange{10, 10}));
  EXPECT_EQ(KvRowsOfBuckets(counts, {2, 5}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvRowsOfBuckets(counts, {-1, 2}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::vector<uint64_t> huge = {~uint64_t{0}, 1};
  EXPECT_THAT(Message(KvRowsOfBuckets(huge, {0, 2}).status()),
              HasSubstr("overflow"));
}

// Columns for `ids`: weight[k] = id + k / 10, momentum = -id, timestamp =
// id * 7.
struct Columns {
  explicit Columns(const std::vector<int64_t>& ids)
      : weight(ids.size() * 4), momentum(ids.size()), timestamp(ids.size()) {
    for (size_t i = 0; i < ids.size(); ++i) {
      for (int k = 0; k < 4; ++k) {
        weight[i * 4 + k] = static_cast<float>(ids[i]) + k / 10.0f;
      }
      momentum[i] = -static_cast<float>(ids[i]);
      timestamp[i] = ids[i] * 7;
    }
    const int64_t n = static_cast<int64_t>(ids.size());
    views = {TensorView(weight.data(), DType::kF32, {n, 4}),
             TensorView(momentum.data(), DType::kF32, {n, 1}),
             TensorView(timestamp.data(), DType::kI64, {n, 1})};
  }
  std::vector<float> weight, momentum;
  std::vector<int64_t> timestamp;
  std::vector<TensorView> views;
};

void ExpectRow(const InMemoryKvTable& table, int64_t id) {
  const std::byte* row = table.Find(id);
  ASSERT_NE(row, nullptr) << id;
  float w[4], m;
  int64_t ts;
  std::memcpy(w, row, 16);
  std::memcpy(&m, row + 16, 4);
  std::memcpy(&ts, row + 20, 8);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(w[k], static_cast<float>(id) + k / 10.0f);
  EXPECT_EQ(m, -static_cast<float>(id));
  EXPECT_EQ(ts, id * 7);
}

// Rows applied in any order come back from a source in (bucket, id) order,
// in batches of the size asked, with their values; counts per bucket.
TEST(InMemoryKvTableTest, AppliedRowsComeBackInBucketOrder) {
  for (KvBucketing bucketing :
       {KvBucketing::kChunked, KvBucketing::kInterleaved}) {
    SCOPED_TRACE(static_cast<int>(bucketing));
    const KvTableSpec spec = Spec(bucketing);
    const KvBucketRange owned{2, 6};
    auto table = InMemoryKvTable::Create("emb", spec, owned);
    ASSERT_TRUE(table.ok()) << table.status();
    // Ids of buckets 2..5, in a scrambled order, in two batches.
    std::vector<int64_t> ids;
    for (int64_t id = 0; id < 1000; id += 7) {
      if (owned.contains(*KvBucketOf(spec, id))) ids.push_back(id);
    }
    std::vector<int64_t> scrambled(ids.rbegin(), ids.rend());
    std::vector<int64_t> first(scrambled.begin(),
                               scrambled.begin() + scrambled.size() / 2);
    std::vector<int64_t> second(scrambled.begin() + scrambled.size() / 2,
                                scrambled.end());
    for (const auto& batch : {first, second}) {
      Columns cols(batch);
      ASSERT_TRUE((*table)->Apply(batch, cols.views).ok());
    }
    EXPECT_EQ((*table)->size(), ids.size());
    for (int64_t id : ids) ExpectRow(**table, id);

    std::vector<uint64_t> counts = (*table)->RowsPerBucket();
    ASSERT_EQ(counts.size(), 4u);
    uint64_t total = 0;
    for (uint64_t c : counts) total += c;
    EXPECT_EQ(total, ids.size());

    std::unique_ptr<KvSource> source = (*table)->Source(10);
    ASSERT_TRUE(source->Begin().ok());
    std::vector<std::pair<int64_t, int64_t>> seen;  // (bucket, id)
    KvBatch batch;
    while (true) {
      absl::StatusOr<bool> more = source->Next(batch);
      ASSERT_TRUE(more.ok()) << more.status();
      if (!*more) break;
      ASSERT_LE(batch.ids.size(), 10u);
      ASSERT_EQ(batch.columns.size(), 3u);
      for (size_t i = 0; i < batch.ids.size(); ++i) {
        const int64_t id = batch.ids[i];
        seen.emplace_back(*KvBucketOf(spec, id), id);
        EXPECT_EQ(static_cast<const float*>(batch.columns[0].data())[i * 4 + 3],
                  static_cast<float>(id) + 0.3f);
        EXPECT_EQ(static_cast<const int64_t*>(batch.columns[2].data())[i],
                  id * 7);
      }
    }
    ASSERT_TRUE(source->End().ok());
    EXPECT_EQ(seen.size(), ids.size());
    EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
    // Bucket counts agree with what the source gave.
    std::map<int64_t, uint64_t> per_bucket;
    for (const auto& [b, id] : seen) ++per_bucket[b];
    for (int64_t b = owned.begin; b < owned.end; ++b) {
      EXPECT_EQ(per_bucket[b], counts[b - owned.begin]) << b;
    }
  }
}

// Applying an id again overwrites its row; strided column views are read
// element by element.
TEST(InMemoryKvTableTest, OverwritesAndStridedColumns) {
  auto table = InMemoryKvTable::Create("emb", Spec(), {0, 10});
  ASSERT_TRUE(table.ok());
  std::vector<int64_t> ids = {5, 6};
  Columns cols(ids);
  ASSERT_TRUE((*table)->Apply(ids, cols.views).ok());
  // The weight as every other float of a wider buffer.
  std::vector<float> wide(2 * 8, 0.0f);
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) wide[i * 8 + k * 2] = 100.0f + i * 10 + k;
  }
  std::vector<TensorView> views = cols.views;
  views[0] = TensorView(wide.data(), DType::kF32, {2, 4}, {8, 2});
  ASSERT_TRUE((*table)->Apply(ids, views).ok());
  EXPECT_EQ((*table)->size(), 2u);
  float w[4];
  std::memcpy(w, (*table)->Find(6), 16);
  EXPECT_EQ(w[0], 110.0f);
  EXPECT_EQ(w[3], 113.0f);
  EXPECT_EQ((*table)->Find(7), nullptr);
}

// Bad batches change nothing and name the table and the problem.
TEST(InMemoryKvTableTest, BadBatchesAreRefusedWhole) {
  auto table = InMemoryKvTable::Create("emb.item", Spec(), {2, 4});
  ASSERT_TRUE(table.ok());
  std::vector<int64_t> ids = {250, 999};  // bucket 2, then bucket 9
  Columns cols(ids);
  absl::Status outside = (*table)->Apply(ids, cols.views);
  EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(outside),
              HasSubstr("emb.item: id 999 is in bucket 9, not in this "
                        "table's buckets [2, 4)"));
  EXPECT_EQ((*table)->size(), 0u) << "a refused batch changed the table";

  std::vector<int64_t> past = {2000};
  Columns past_cols(past);
  EXPECT_THAT(Message((*table)->Apply(past, past_cols.views)),
              HasSubstr("id 2000 is past"));

  std::vector<int64_t> good = {250};
  Columns good_cols(good);
  std::vector<TensorView> two(good_cols.views.begin(),
                              good_cols.views.begin() + 2);
  EXPECT_THAT(Message((*table)->Apply(good, two)),
              HasSubstr("a batch of 2 columns for a table of 3"));
  std::vector<TensorView> wrong = good_cols.views;
  wrong[2] = TensorView(good_cols.momentum.data(), DType::kF32, {1, 1});
  EXPECT_THAT(Message((*table)->Apply(good, wrong)),
              HasSubstr("column \"timestamp\""));
  EXPECT_EQ((*table)->size(), 0u);

  EXPECT_EQ(InMemoryKvTable::Create("t", Spec(), {5, 11}).status().code(),
            absl::StatusCode::kInvalidArgument);
  KvTableSpec bad = Spec();
  bad.columns.clear();
  EXPECT_EQ(InMemoryKvTable::Create("t", bad, {0, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A source must begin before it gives rows.
  std::unique_ptr<KvSource> source = (*table)->Source(4);
  KvBatch batch;
  EXPECT_EQ(source->Next(batch).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace cairn
