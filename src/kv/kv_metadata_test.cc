// The checks of a key-value table's metadata, and the chunks a rank's
// buckets need.
#include "kv/kv_metadata.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cairn/kv_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::internal_kv {
namespace {

using testing::HasSubstr;

// 4 buckets with 3, 0, 5 and 2 rows (10 rows), in chunks of rows [0, 4),
// [4, 8), [8, 10); columns F32 [2] and I64 [1].
KvTableMetadata Table() {
  KvTableMetadata md;
  md.spec.num_buckets = 4;
  md.spec.bucketing = KvBucketing::kInterleaved;
  md.spec.columns = {{"weight", DType::kF32, 2}, {"count", DType::kI64, 1}};
  md.buckets = {0, 4};
  md.rows_per_bucket = {3, 0, 5, 2};
  uint64_t offset = 0;
  for (auto [begin, end] : {std::pair<uint64_t, uint64_t>{0, 4}, {4, 8}, {8, 10}}) {
    KvChunk c;
    c.rows = {begin, end};
    const uint64_t n = end - begin;
    c.ids = ByteLocation{"data-0.safetensors", offset, n * 8};
    offset += n * 8;
    c.columns.push_back(ByteLocation{"data-0.safetensors", offset, n * 8});
    offset += n * 8;
    c.columns.push_back(ByteLocation{"data-0.safetensors", offset, n * 8});
    offset += n * 8;
    md.chunks.push_back(c);
  }
  return md;
}

TEST(KvMetadataTest, AConsistentTablePasses) {
  EXPECT_TRUE(ValidateKvTableMetadata("emb", Table()).ok());
  KvTableMetadata empty = Table();
  empty.rows_per_bucket = {0, 0, 0, 0};
  empty.chunks.clear();
  EXPECT_TRUE(ValidateKvTableMetadata("emb", empty).ok());
}

// Each kind of inconsistency is kDataLoss naming the table, the chunk and
// the problem.
TEST(KvMetadataTest, InconsistentTablesAreDataLoss) {
  struct Case {
    std::string expect;
    KvTableMetadata md;
  };
  std::vector<Case> cases;
  KvTableMetadata md = Table();
  md.spec.columns.clear();
  cases.push_back({"no columns", md});
  md = Table();
  md.rows_per_bucket.pop_back();
  cases.push_back({"3 row counts for the 4 buckets [0, 4)", md});
  md = Table();
  md.rows_per_bucket[0] = ~uint64_t{0};
  cases.push_back({"overflow at bucket", md});
  md = Table();
  md.chunks[1].rows.begin = 5;
  cases.push_back({"chunk 1 (rows [5, 8)): starts at row 5, but the chunks "
                   "before end at row 4",
                   md});
  md = Table();
  md.chunks[2].rows.end = 11;
  cases.push_back({"chunk 2 (rows [8, 11)): not a non-empty range", md});
  md = Table();
  md.chunks.pop_back();
  cases.push_back({"the chunks hold rows [0, 8) of 10", md});
  md = Table();
  md.chunks[0].ids.nbytes = 24;
  cases.push_back({"chunk 0 (rows [0, 4)): its ids take 24 bytes, not 32", md});
  md = Table();
  md.chunks[1].columns[0].nbytes = 16;
  cases.push_back({"column \"weight\" takes 16 bytes, not 32", md});
  md = Table();
  md.chunks[1].columns.pop_back();
  cases.push_back({"1 columns stored, the table has 2", md});
  md = Table();
  md.chunks[2].columns[1].file = "data-1.safetensors";
  cases.push_back({"column \"count\" is in data-1.safetensors", md});
  // Sizes that only match modulo 2^64: 2^61 + 1 rows in one chunk, whose
  // ids' and 8-byte columns' 2^64 + 8 bytes wrap to 8.
  md = Table();
  md.rows_per_bucket = {(uint64_t{1} << 61) + 1, 0, 0, 0};
  md.chunks.resize(1);
  md.chunks[0].rows = {0, (uint64_t{1} << 61) + 1};
  md.chunks[0].ids.nbytes = 8;
  for (ByteLocation& c : md.chunks[0].columns) c.nbytes = 8;
  cases.push_back({"the ids of 2305843009213693953 rows overflow", md});
  md.spec.columns[0].dtype = DType::kF64;  // 16 bytes a row: wraps to 16
  md.spec.columns[0].width = 2;
  md.chunks[0].ids.nbytes = 8 * ((uint64_t{1} << 61) - 1);
  md.rows_per_bucket[0] = (uint64_t{1} << 61) - 1;
  md.chunks[0].rows.end = (uint64_t{1} << 61) - 1;
  md.chunks[0].columns[0].nbytes = 16 * ((uint64_t{1} << 61) - 1);
  cases.push_back({"column \"weight\" of 2305843009213693951 rows overflows",
                   md});
  for (const Case& c : cases) {
    absl::Status s = ValidateKvTableMetadata("emb.user", c.md);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << c.expect << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("key-value table emb.user"));
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.expect));
  }
}

// A rank's buckets need the chunks that overlap their rows, no more.
TEST(KvMetadataTest, ChunksOfBuckets) {
  const KvTableMetadata md = Table();
  auto span = [&](int64_t b0, int64_t b1) {
    absl::StatusOr<KvChunkSpan> s = KvChunksOfBuckets(md, {b0, b1});
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : KvChunkSpan{};
  };
  // Bucket 0: rows [0, 3), in chunk 0.
  KvChunkSpan s = span(0, 1);
  EXPECT_EQ(s.rows, (KvRowRange{0, 3}));
  EXPECT_EQ(s.first, 0u);
  EXPECT_EQ(s.last, 1u);
  // Buckets 1-2: rows [3, 8), chunks 0 and 1.
  s = span(1, 3);
  EXPECT_EQ(s.rows, (KvRowRange{3, 8}));
  EXPECT_EQ(s.first, 0u);
  EXPECT_EQ(s.last, 2u);
  // Bucket 3: rows [8, 10), chunk 2.
  s = span(3, 4);
  EXPECT_EQ(s.rows, (KvRowRange{8, 10}));
  EXPECT_EQ(s.first, 2u);
  EXPECT_EQ(s.last, 3u);
  // Bucket 1 has no rows, an empty range none: no chunk.
  EXPECT_EQ(span(1, 2).first, span(1, 2).last);
  EXPECT_EQ(span(2, 2).first, span(2, 2).last);
  // Every bucket: every chunk.
  s = span(0, 4);
  EXPECT_EQ(s.first, 0u);
  EXPECT_EQ(s.last, 3u);
  // Each rank of a 3-way split gets chunks covering exactly its rows.
  for (int r = 0; r < 3; ++r) {
    const KvBucketRange b = KvBucketsOfRank(4, 3, r);
    const KvChunkSpan got = span(b.begin, b.end);
    if (got.rows.size() == 0) continue;
    EXPECT_LE(md.chunks[got.first].rows.begin, got.rows.begin) << r;
    EXPECT_GE(md.chunks[got.last - 1].rows.end, got.rows.end) << r;
    if (got.first + 1 < got.last) {
      EXPECT_GT(md.chunks[got.first].rows.end, got.rows.begin) << r;
      EXPECT_LT(md.chunks[got.last - 1].rows.begin, got.rows.end) << r;
    }
  }
  EXPECT_EQ(KvChunksOfBuckets(md, {2, 5}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Rank-local metadata holds some buckets only: rows count from the first
// held one, and other buckets are not there.
TEST(KvMetadataTest, ChunksOfHeldBuckets) {
  KvTableMetadata md = Table();
  md.spec.num_buckets = 10;
  md.buckets = {3, 7};  // the same counts, for buckets 3..6
  ASSERT_TRUE(ValidateKvTableMetadata("emb", md).ok());
  absl::StatusOr<KvChunkSpan> s = KvChunksOfBuckets(md, {5, 7});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->rows, (KvRowRange{3, 10}));
  EXPECT_EQ(s->first, 0u);
  EXPECT_EQ(s->last, 3u);
  EXPECT_EQ(KvChunksOfBuckets(md, {2, 4}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(KvChunksOfBuckets(md, {0, 0}).ok());
  md.buckets = {8, 12};
  EXPECT_THAT(ValidateKvTableMetadata("emb", md).message(),
              HasSubstr("holds buckets [8, 12)"));
  md.buckets = {3, 6};
  EXPECT_THAT(ValidateKvTableMetadata("emb", md).message(),
              HasSubstr("4 row counts for the 3 buckets"));
}

}  // namespace
}  // namespace cairn::internal_kv
