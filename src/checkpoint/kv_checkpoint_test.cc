// Key-value tables through Save and Load: round trips on several ranks,
// loads into other world sizes, other bucketings and column subsets,
// bounded pieces, and each kind of bad input.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/kv_table.h"
#include "cairn/rocksdb_kv_table.h"
#include "cairn/verify.h"
#include "checkpoint/expect_util.h"
#include "checkpoint/kv_save.h"
#include "checkpoint/kv_test_util.h"
#include "checkpoint/test_util.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using testing::HasSubstr;
using testing_util::TempDir;

using testing_util::ExpectRows;
using testing_util::ExpectSameError;
using testing_util::Fill;
using testing_util::Ids;
using testing_util::Batch;
using testing_util::KvSpec;
using testing_util::NextOnlySource;
using testing_util::ScriptedSource;

KvTableSpec Spec(int64_t buckets = 16) { return KvSpec(buckets); }

class KvCheckpointTest : public testing::Test {
 protected:
  // Saves a table of `ids` from `world` ranks (their default buckets);
  // `next_only`: their sources pulled with Next, not NextInto.
  std::vector<absl::Status> SaveTable(int world, const std::vector<int64_t>& ids,
                                      const KvTableSpec& spec,
                                      SaveOptions base = {},
                                      bool next_only = false) {
    return RunInProcess(world, [&](Communicator& comm) -> absl::Status {
      const KvBucketRange mine =
          KvBucketsOfRank(spec.num_buckets, world, comm.rank());
      CAIRN_ASSIGN_OR_RETURN(auto table,
                             InMemoryKvTable::Create("emb", spec, mine));
      CAIRN_RETURN_IF_ERROR(Fill(*table, ids));
      std::unique_ptr<KvSource> source = table->Source(100);
      NextOnlySource batches(*source);
      SaveOptions o = base;
      o.comm = &comm;
      o.kv_tables.push_back({"emb.user", spec, std::nullopt,
                             next_only ? &batches : source.get()});
      StateDict sd;
      return Save(sd, dir(), o).status();
    });
  }

  // Loads it into `world` ranks with destination spec `dest`; checks every
  // rank's rows.
  void LoadAndCheck(int world, const std::vector<int64_t>& ids,
                    const KvTableSpec& saved, const KvTableSpec& dest,
                    std::vector<std::string> columns = {},
                    LoadOptions base = {}) {
    std::vector<size_t> idx;
    KvTableSpec dest_cols = dest;
    if (columns.empty()) {
      for (size_t c = 0; c < saved.columns.size(); ++c) idx.push_back(c);
    } else {
      dest_cols.columns.clear();
      for (const std::string& name : columns) {
        for (size_t c = 0; c < saved.columns.size(); ++c) {
          if (saved.columns[c].name == name) {
            idx.push_back(c);
            dest_cols.columns.push_back(saved.columns[c]);
          }
        }
      }
    }
    std::vector<std::unique_ptr<InMemoryKvTable>> tables(world);
    std::vector<absl::Status> st =
        RunInProcess(world, [&](Communicator& comm) -> absl::Status {
          const KvBucketRange mine =
              KvBucketsOfRank(dest.num_buckets, world, comm.rank());
          CAIRN_ASSIGN_OR_RETURN(
              tables[comm.rank()],
              InMemoryKvTable::Create("emb", dest_cols, mine));
          LoadOptions o = base;
          o.comm = &comm;
          KvTableToLoad t;
          t.fqn = "emb.user";
          t.sink = tables[comm.rank()].get();
          t.num_buckets = dest.num_buckets;
          t.bucketing = dest.bucketing;
          t.bucket_size = dest.bucket_size;
          t.columns = columns;
          o.kv_tables.push_back(t);
          StateDict sd;
          CAIRN_ASSIGN_OR_RETURN(LoadResult r, Load(sd, dir(), o));
          if (r.kv_rows != tables[comm.rank()]->size()) {
            return absl::InternalError(absl::StrCat(
                "kv_rows ", r.kv_rows, " but the table holds ",
                tables[comm.rank()]->size()));
          }
          return absl::OkStatus();
        });
    size_t total = 0;
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r];
      ExpectRows(*tables[r], saved, ids, idx, absl::StrCat("rank ", r));
      total += tables[r]->size();
    }
    EXPECT_EQ(total, ids.size());
  }

  std::string dir() const { return tmp_.path() + "/ckpt"; }
  TempDir tmp_;
};

TEST_F(KvCheckpointTest, RoundTripOnFourRanksAndReshardedWorlds) {
  const std::vector<int64_t> ids = Ids(3000);
  const KvTableSpec spec = Spec();
  for (const absl::Status& s : SaveTable(4, ids, spec)) ASSERT_TRUE(s.ok()) << s;
  absl::StatusOr<Metadata> md = ReadMetadata(dir());
  ASSERT_TRUE(md.ok()) << md.status();
  ASSERT_TRUE(md->kv_tables.contains("emb.user"));
  const KvTableMetadata& t = md->kv_tables.at("emb.user");
  EXPECT_EQ(t.rows(), ids.size());
  EXPECT_EQ(t.spec, spec);
  EXPECT_EQ(t.buckets, (KvBucketRange{0, 16}));
  for (int world : {4, 3, 1, 5, 16}) {
    SCOPED_TRACE(absl::StrCat("load world ", world));
    LoadAndCheck(world, ids, spec, spec);
  }
}

TEST_F(KvCheckpointTest, AnotherBucketingIsRoutedToItsOwners) {
  const std::vector<int64_t> ids = Ids(2000);
  const KvTableSpec spec = Spec();
  for (const absl::Status& s : SaveTable(3, ids, spec)) ASSERT_TRUE(s.ok()) << s;
  KvTableSpec interleaved = Spec(7);
  LoadAndCheck(3, ids, spec, interleaved);
  KvTableSpec chunked = Spec(5);
  chunked.bucketing = KvBucketing::kChunked;
  chunked.bucket_size = 200000;
  LoadAndCheck(2, ids, spec, chunked);
  LoadAndCheck(4, ids, spec, chunked, {"weight"});
}

TEST_F(KvCheckpointTest, ColumnSubsetsInAnyOrder) {
  const std::vector<int64_t> ids = Ids(500);
  const KvTableSpec spec = Spec();
  for (const absl::Status& s : SaveTable(2, ids, spec)) ASSERT_TRUE(s.ok()) << s;
  LoadAndCheck(3, ids, spec, spec, {"weight"});
  LoadAndCheck(2, ids, spec, spec, {"count", "weight"});
}

// Small chunks (many per file, more than one file a rank) read in small
// pieces, checked by 4 KiB checksum blocks.
TEST_F(KvCheckpointTest, SmallChunksFilesAndPieces) {
  const std::vector<int64_t> ids = Ids(6000);
  const KvTableSpec spec = Spec();
  SaveOptions so;
  so.kv_chunk_bytes = 2000;  // 18 rows a chunk
  so.crc32c_block_bytes = 4096;
  for (const absl::Status& s : SaveTable(2, ids, spec, so)) {
    ASSERT_TRUE(s.ok()) << s;
  }
  absl::StatusOr<Metadata> md = ReadMetadata(dir());
  ASSERT_TRUE(md.ok()) << md.status();
  const KvTableMetadata& t = md->kv_tables.at("emb.user");
  std::set<std::string> files;
  for (const KvChunkMetadata& c : t.chunks) files.insert(c.ids.file);
  // 64 bytes a row: at most 31 rows a chunk.
  EXPECT_GE(t.chunks.size(), 6000u / 31);
  EXPECT_GE(files.size(), 4u);  // 64 chunks a file, 2 ranks
  // A chunk ends at the last bucket end in its second half (rows 16 to 30
  // of 31), else full; only a rank's last chunk of a table is shorter
  // otherwise, and it ends at a bucket end too.
  std::set<uint64_t> bucket_ends;
  uint64_t row = 0;
  for (uint64_t n : t.rows_per_bucket) bucket_ends.insert(row += n);
  size_t cut_at_bucket = 0;
  for (const KvChunkMetadata& c : t.chunks) {
    ASSERT_LE(c.rows.size(), 31u);
    if (c.rows.size() < 31) {
      EXPECT_TRUE(bucket_ends.contains(c.rows.end)) << c.rows.end;
      cut_at_bucket += c.rows.size() >= 16;
      continue;
    }
    auto inside = bucket_ends.lower_bound(c.rows.begin + 16);
    EXPECT_TRUE(inside == bucket_ends.end() || *inside >= c.rows.end)
        << "a bucket ends at row " << *inside << " inside chunk ["
        << c.rows.begin << ", " << c.rows.end << ")";
  }
  EXPECT_GT(cut_at_bucket, 0u);
  LoadAndCheck(3, ids, spec, spec);
  // 64 bytes a row: chunks of 65536 rows, read in pieces of 16384 (the
  // smallest budget gives 1 MiB pieces) whose ends cut checksum blocks.
  const std::vector<int64_t> more = Ids(50000, 9);
  so.kv_chunk_bytes = 4 << 20;
  so.overwrite = true;
  for (const absl::Status& s : SaveTable(2, more, spec, so)) {
    ASSERT_TRUE(s.ok()) << s;
  }
  LoadOptions lo;
  lo.memory_budget_bytes = 1;
  LoadAndCheck(3, more, spec, spec, {}, lo);
  LoadAndCheck(2, more, spec, Spec(5), {"momentum"}, lo);
}

// Chunks are written while they fill (the first region, in aligned
// pieces of write_buffer_bytes) and cut at bucket starts afterwards: with
// small buckets (a cut on nearly every chunk) and with two (none), across
// file ends (64 chunks a file), every row reads back checked.
TEST_F(KvCheckpointTest, ChunksWrittenWhileTheyFill) {
  const std::vector<int64_t> ids = Ids(150000, 5);
  for (int64_t buckets : {512, 2}) {
    SCOPED_TRACE(absl::StrCat(buckets, " buckets"));
    const KvTableSpec spec = Spec(buckets);
    SaveOptions so;
    so.overwrite = true;
    so.kv_chunk_bytes = 64 << 10;  // 1024 rows of 64 bytes
    so.write_buffer_bytes = 4096;
    so.crc32c_block_bytes = 4096;
    for (const absl::Status& s : SaveTable(2, ids, spec, so)) {
      ASSERT_TRUE(s.ok()) << s;
    }
    absl::StatusOr<Metadata> md = ReadMetadata(dir());
    ASSERT_TRUE(md.ok()) << md.status();
    const KvTableMetadata& t = md->kv_tables.at("emb.user");
    std::set<std::string> files;
    size_t short_chunks = 0;
    for (const KvChunkMetadata& c : t.chunks) {
      files.insert(c.ids.file);
      short_chunks += c.rows.size() < 1024;
    }
    EXPECT_GE(files.size(), 4u);
    if (buckets == 512) {
      EXPECT_GT(short_chunks, t.chunks.size() / 2);
    }
    LoadAndCheck(3, ids, spec, spec);
  }
}

// A source pulled with Next (its batches copied) and the same rows pulled
// with NextInto (written straight into the chunk) save the same chunks,
// byte for byte.
TEST_F(KvCheckpointTest, NextAndNextIntoSaveTheSameChunks) {
  const std::vector<int64_t> ids = Ids(20000, 6);
  const KvTableSpec spec = Spec(64);
  std::vector<KvTableMetadata> saved;
  for (bool into : {true, false}) {
    SCOPED_TRACE(into ? "NextInto" : "Next");
    SaveOptions so;
    so.overwrite = true;
    so.kv_chunk_bytes = 64 << 10;
    so.write_buffer_bytes = 8192;
    for (const absl::Status& s : SaveTable(2, ids, spec, so, !into)) {
      ASSERT_TRUE(s.ok()) << s;
    }
    absl::StatusOr<Metadata> md = ReadMetadata(dir());
    ASSERT_TRUE(md.ok()) << md.status();
    saved.push_back(md->kv_tables.at("emb.user"));
    LoadAndCheck(3, ids, spec, spec);
  }
  ASSERT_EQ(saved[0].chunks.size(), saved[1].chunks.size());
  EXPECT_GT(saved[0].chunks.size(), 10u);
  EXPECT_EQ(saved[0].rows_per_bucket, saved[1].rows_per_bucket);
  for (size_t k = 0; k < saved[0].chunks.size(); ++k) {
    const KvChunkMetadata& a = saved[0].chunks[k];
    const KvChunkMetadata& b = saved[1].chunks[k];
    EXPECT_EQ(a.rows, b.rows) << k;
    EXPECT_EQ(a.ids.crc32c, b.ids.crc32c) << k;
    ASSERT_EQ(a.columns.size(), b.columns.size());
    for (size_t c = 0; c < a.columns.size(); ++c) {
      EXPECT_EQ(a.columns[c].crc32c, b.columns[c].crc32c) << k << " " << c;
      EXPECT_EQ(a.columns[c].nbytes, b.columns[c].nbytes) << k << " " << c;
    }
  }
}

// The real backend end to end: a table saved from RocksDB on 4
// ranks loads into RocksDB on 3, every id and row compared, then into 2
// ranks of another bucketing.
TEST_F(KvCheckpointTest, RocksDbOnFourRanksIntoRocksDbOnThree) {
  const std::vector<int64_t> ids = Ids(5000, 11);
  const KvTableSpec spec = Spec();
  std::vector<absl::Status> st =
      RunInProcess(4, [&](Communicator& comm) -> absl::Status {
        CAIRN_ASSIGN_OR_RETURN(
            auto db, RocksDbKvTable::Open(
                         absl::StrCat(tmp_.path(), "/src-", comm.rank()),
                         "emb", spec, KvBucketsOfRank(16, 4, comm.rank())));
        CAIRN_RETURN_IF_ERROR(Fill(*db, ids));
        std::unique_ptr<KvSource> source = db->Source(256);
        SaveOptions o;
        o.comm = &comm;
        o.kv_chunk_bytes = 32 << 10;
        o.kv_tables.push_back({"emb.user", spec, std::nullopt, source.get()});
        StateDict sd;
        return Save(sd, dir(), o).status();
      });
  for (const absl::Status& s : st) ASSERT_TRUE(s.ok()) << s;
  for (const auto& [world, dest] :
       std::vector<std::pair<int, KvTableSpec>>{{3, spec}, {2, Spec(6)}}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks, ", dest.num_buckets,
                              " buckets"));
    std::vector<std::unique_ptr<RocksDbKvTable>> dbs(world);
    st = RunInProcess(world, [&](Communicator& comm) -> absl::Status {
      CAIRN_ASSIGN_OR_RETURN(
          dbs[comm.rank()],
          RocksDbKvTable::Open(
              absl::StrCat(tmp_.path(), "/dst-", world, "-", comm.rank()),
              "emb", dest,
              KvBucketsOfRank(dest.num_buckets, world, comm.rank())));
      LoadOptions o;
      o.comm = &comm;
      KvTableToLoad t{.fqn = "emb.user", .sink = dbs[comm.rank()].get()};
      t.num_buckets = dest.num_buckets;
      t.bucketing = dest.bucketing;
      o.kv_tables.push_back(t);
      StateDict sd;
      return Load(sd, dir(), o).status();
    });
    uint64_t total = 0;
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(st[r].ok()) << st[r];
      const RocksDbKvTable& db = *dbs[r];
      absl::StatusOr<uint64_t> size = db.size();
      ASSERT_TRUE(size.ok()) << size.status();
      testing_util::ExpectRows(
          db.spec(), db.owned(), *size,
          [&](int64_t id) -> std::optional<std::string> {
            absl::StatusOr<std::optional<std::string>> row = db.Find(id);
            return row.ok() ? *row : std::nullopt;
          },
          spec, ids, {0, 1, 2}, absl::StrCat("rank ", r));
      total += *size;
    }
    EXPECT_EQ(total, ids.size());
  }
}

// Rank-local: each rank's folder holds its buckets; a rank-local load
// reads its own; Merge joins the folders into a table any world size
// loads; LoadAll of the merged checkpoint (tensors only) passes its file
// checks; checkpoint_bytes counts the table files.
TEST_F(KvCheckpointTest, RankLocalSaveLoadAndMerge) {
  const std::vector<int64_t> ids = Ids(3000, 5);
  const KvTableSpec spec = Spec();
  SaveOptions so;
  so.rank_local = true;
  so.kv_chunk_bytes = 8 << 10;
  std::vector<absl::Status> st =
      RunInProcess(3, [&](Communicator& comm) -> absl::Status {
        const KvBucketRange mine = KvBucketsOfRank(16, 3, comm.rank());
        CAIRN_ASSIGN_OR_RETURN(auto table,
                               InMemoryKvTable::Create("emb", spec, mine));
        CAIRN_RETURN_IF_ERROR(Fill(*table, ids));
        std::unique_ptr<KvSource> source = table->Source(64);
        SaveOptions o = so;
        o.comm = &comm;
        o.kv_tables.push_back({"emb.user", spec, std::nullopt, source.get()});
        float step = 7;
        StateDict sd;
        sd["step"] = TensorView(&step, DType::kF32, {1});
        CAIRN_ASSIGN_OR_RETURN(SaveResult r, Save(sd, dir(), o));
        if (r.checkpoint_bytes != r.bytes_written) {
          return absl::InternalError(absl::StrCat(
              "checkpoint_bytes ", r.checkpoint_bytes, ", bytes_written ",
              r.bytes_written));
        }
        return absl::OkStatus();
      });
  for (const absl::Status& s : st) ASSERT_TRUE(s.ok()) << s;
  // A rank-local load of each rank's own buckets.
  std::vector<std::unique_ptr<InMemoryKvTable>> tables(3);
  st = RunInProcess(3, [&](Communicator& comm) -> absl::Status {
    CAIRN_ASSIGN_OR_RETURN(
        tables[comm.rank()],
        InMemoryKvTable::Create("emb", spec,
                                KvBucketsOfRank(16, 3, comm.rank())));
    LoadOptions o;
    o.comm = &comm;
    o.rank_local = true;
    o.kv_tables.push_back({.fqn = "emb.user", .sink = tables[comm.rank()].get()});
    StateDict sd;
    return Load(sd, dir(), o).status();
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r];
    ExpectRows(*tables[r], spec, ids, {0, 1, 2}, absl::StrCat("rank ", r));
  }
  // Another bucketing is refused rank-locally: merge first.
  st = RunInProcess(1, [&](Communicator& comm) -> absl::Status {
    CAIRN_ASSIGN_OR_RETURN(auto t, InMemoryKvTable::Create("emb", Spec(5),
                                                           {0, 5}));
    LoadOptions o;
    o.rank_local = true;
    KvTableToLoad k{.fqn = "emb.user", .sink = t.get()};
    k.num_buckets = 5;
    k.bucketing = KvBucketing::kInterleaved;
    o.kv_tables.push_back(k);
    StateDict sd;
    return Load(sd, dir(), o).status();
  });
  EXPECT_THAT(std::string(st[0].message()), HasSubstr("merge it"));
  absl::StatusOr<MergeResult> merged = Merge(dir());
  ASSERT_TRUE(merged.ok()) << merged.status();
  const KvTableMetadata& t = merged->metadata.kv_tables.at("emb.user");
  EXPECT_EQ(t.rows(), ids.size());
  EXPECT_EQ(t.buckets, (KvBucketRange{0, 16}));
  LoadAndCheck(2, ids, spec, spec);
  LoadAndCheck(2, ids, spec, Spec(5));
  absl::StatusOr<StateDict> all = LoadAll(dir());
  EXPECT_TRUE(all.ok()) << all.status();
  absl::StatusOr<VerifyReport> report = Verify(dir());
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->problems.empty()) << report->problems[0].message;
}

// A merge refuses rank folders whose tables leave buckets out.
TEST_F(KvCheckpointTest, MergeRefusesMissingBuckets) {
  const std::vector<int64_t> ids = Ids(200);
  const KvTableSpec spec = Spec();
  std::vector<absl::Status> st =
      RunInProcess(2, [&](Communicator& comm) -> absl::Status {
        const KvBucketRange mine =
            comm.rank() == 0 ? KvBucketRange{0, 8} : KvBucketRange{9, 16};
        CAIRN_ASSIGN_OR_RETURN(auto table,
                               InMemoryKvTable::Create("emb", spec, mine));
        CAIRN_RETURN_IF_ERROR(Fill(*table, ids));
        std::unique_ptr<KvSource> source = table->Source(64);
        SaveOptions o;
        o.comm = &comm;
        o.rank_local = true;
        o.kv_tables.push_back({"emb.user", spec, mine, source.get()});
        StateDict sd;
        return Save(sd, dir(), o).status();
      });
  for (const absl::Status& s : st) ASSERT_TRUE(s.ok()) << s;
  absl::StatusOr<MergeResult> merged = Merge(dir());
  ASSERT_FALSE(merged.ok());
  EXPECT_THAT(std::string(merged.status().message()),
              HasSubstr("merge: key-value table \"emb.user\": no rank saves "
                        "buckets [8, 9)"));
  EXPECT_FALSE(std::filesystem::exists(dir() + "/metadata.json"));
}

// Each kind of bad table on save fails every rank with the same error,
// naming the table, and commits nothing.
TEST_F(KvCheckpointTest, BadSavesFailEveryRankAndCommitNothing) {
  struct Case {
    std::string name;
    std::string expect;
    // What rank r saves (Spec(), B = 16, over 2 ranks).
    std::function<void(int, KvTableToSave&, std::vector<KvBatch>&)> edit;
    bool tensor_named_like_table = false;
    bool overclaim = false;  // rank 0's NextInto
  };
  std::vector<Case> cases = {
      {"id outside the rank's buckets",
       "id 3 is in bucket 3, not one of this rank's buckets [8, 16)",
       [](int r, KvTableToSave&, std::vector<KvBatch>& b) {
         if (r == 1) b = {Batch({8, 3})};
       }},
      {"duplicate id", "a duplicate id",
       [](int r, KvTableToSave&, std::vector<KvBatch>& b) {
         if (r == 0) b = {Batch({1, 17}), Batch({17})};
       }},
      {"out of order", "rows must come in (bucket, id) order",
       [](int r, KvTableToSave&, std::vector<KvBatch>& b) {
         if (r == 0) b = {Batch({2, 1})};
       }},
      {"wrong column dtype", "column \"momentum\" is U8",
       [](int r, KvTableToSave&, std::vector<KvBatch>& b) {
         if (r == 1) b = {Batch({9}, 1)};
       }},
      {"specs differ", "ranks 0 and 1 give different specs",
       [](int r, KvTableToSave& t, std::vector<KvBatch>&) {
         if (r == 1) t.spec.columns[0].width = 4;
       }},
      {"buckets overlap", "buckets [6, 16) of rank 1 overlap those of rank 0",
       [](int r, KvTableToSave& t, std::vector<KvBatch>& b) {
         if (r == 1) t.buckets = KvBucketRange{6, 16};
       }},
      {"buckets missing", "no rank saves buckets [8, 10)",
       [](int r, KvTableToSave& t, std::vector<KvBatch>& b) {
         if (r == 1) t.buckets = KvBucketRange{10, 16};
       }},
      {"no source", "buckets [0, 8) but no source",
       [](int r, KvTableToSave& t, std::vector<KvBatch>&) {
         if (r == 0) t.source = nullptr;
       }},
      {"a tensor of the same name", "it names both a key-value table and a leaf",
       [](int, KvTableToSave&, std::vector<KvBatch>&) {}, true},
      {"NextInto claims more rows than its room",
       "NextInto() says it wrote",
       [](int r, KvTableToSave&, std::vector<KvBatch>& b) {
         if (r == 0) b = {Batch({0})};
       },
       false, true},
  };
  // Each case with sources pulled through Next, then through NextInto (a
  // batch's wrong dtype cannot happen there; overclaiming only can).
  int run = 0;
  for (bool into : {false, true}) for (const Case& c : cases) {
    if (into ? c.name == "wrong column dtype" : c.overclaim) continue;
    SCOPED_TRACE(absl::StrCat(c.name, into ? ", NextInto" : ", Next"));
    const std::string where = tmp_.path() + "/" + std::to_string(run++);
    float value = 1;
    std::vector<absl::Status> st =
        RunInProcess(2, [&](Communicator& comm) -> absl::Status {
          const int r = comm.rank();
          KvTableToSave t{"emb.user", Spec(), std::nullopt, nullptr};
          std::vector<KvBatch> batches = {Batch({r == 0 ? int64_t{0} : 8})};
          c.edit(r, t, batches);
          ScriptedSource source(batches, into, c.overclaim && r == 0);
          if (t.source == nullptr && !(c.name == "no source")) {
            t.source = &source;
          }
          SaveOptions o;
          o.comm = &comm;
          o.kv_tables.push_back(t);
          StateDict sd;
          if (c.tensor_named_like_table) {
            sd["emb"]["user"] = TensorView(&value, DType::kF32, {1});
          }
          return Save(sd, where, o).status();
        });
    ExpectSameError(st, c.expect);
    EXPECT_THAT(std::string(st[0].message()), HasSubstr("emb.user"));
    EXPECT_FALSE(std::filesystem::exists(where + "/metadata.json"));
  }
}

// A sink that fails on its second batch.
class FailingSink : public KvSink {
 public:
  absl::Status Apply(std::span<const int64_t> ids,
                     std::span<const TensorView>) override {
    if (++calls_ == 2) return absl::UnavailableError("the store is full");
    return absl::OkStatus();
  }

 private:
  int calls_ = 0;
};

TEST_F(KvCheckpointTest, BadLoadsFailEveryRank) {
  const std::vector<int64_t> ids = Ids(40000);
  const KvTableSpec spec = Spec();
  SaveOptions so;
  so.kv_chunk_bytes = 64 << 10;
  for (const absl::Status& s : SaveTable(2, ids, spec, so)) {
    ASSERT_TRUE(s.ok()) << s;
  }
  // Runs a load of the table on 3 ranks, rank 1's request edited.
  auto load = [&](const std::function<void(KvTableToLoad&)>& edit,
                  LoadOptions base = {}) {
    return RunInProcess(3, [&](Communicator& comm) -> absl::Status {
      CAIRN_ASSIGN_OR_RETURN(
          auto table,
          InMemoryKvTable::Create(
              "emb", spec, KvBucketsOfRank(spec.num_buckets, 3, comm.rank())));
      FailingSink failing;
      KvTableToLoad t;
      t.fqn = "emb.user";
      t.sink = table.get();
      if (comm.rank() == 1) {
        t.sink = &failing;
        edit(t);
      }
      LoadOptions o = base;
      o.comm = &comm;
      o.memory_budget_bytes = 1;
      o.kv_tables.push_back(t);
      StateDict sd;
      return Load(sd, dir(), o).status();
    });
  };
  {
    SCOPED_TRACE("a sink that fails midway");
    std::vector<absl::Status> st = load([](KvTableToLoad&) {});
    ExpectSameError(st, "the store is full");
    EXPECT_THAT(std::string(st[0].message()),
                HasSubstr("the sink of key-value table \"emb.user\" on rank 1"));
  }
  {
    SCOPED_TRACE("a sink that fails midway, routed");
    std::vector<absl::Status> st = load([](KvTableToLoad& t) {
      t.num_buckets = 5;
      t.bucketing = KvBucketing::kInterleaved;
    });
    ExpectSameError(st, "the store is full");
  }
  // Requests that cannot be planned (the other ranks' sinks are fine).
  struct Case {
    std::string expect;
    std::function<void(KvTableToLoad&)> edit;
    absl::StatusCode code = absl::StatusCode::kInvalidArgument;
  };
  const std::vector<Case> cases = {
      {"no column \"velocity\" (it has weight, momentum, count)",
       [](KvTableToLoad& t) { t.columns = {"velocity"}; }},
      {"buckets [0, 20) are not a range of its 16",
       [](KvTableToLoad& t) { t.buckets = KvBucketRange{0, 20}; }},
      {"key-value table \"emb.other\" is not in the checkpoint",
       [](KvTableToLoad& t) { t.fqn = "emb.other"; },
       absl::StatusCode::kNotFound},
      {"no sink", [](KvTableToLoad& t) { t.sink = nullptr; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.expect);
    std::vector<absl::Status> st = load(c.edit);
    ExpectSameError(st, c.expect);
    EXPECT_EQ(st[0].code(), c.code);
  }
  {
    SCOPED_TRACE("non-strict: a missing table is listed");
    std::vector<absl::Status> st =
        RunInProcess(1, [&](Communicator& comm) -> absl::Status {
          CAIRN_ASSIGN_OR_RETURN(auto table, InMemoryKvTable::Create(
                                                 "emb", spec, {0, 16}));
          LoadOptions o;
          o.strict = false;
          o.kv_tables.push_back({.fqn = "emb.other", .sink = table.get()});
          StateDict sd;
          CAIRN_ASSIGN_OR_RETURN(LoadResult r, Load(sd, dir(), o));
          if (r.missing != std::vector<std::string>{"emb.other"}) {
            return absl::InternalError("emb.other not listed as missing");
          }
          return absl::OkStatus();
        });
    EXPECT_TRUE(st[0].ok()) << st[0];
  }
  // A flipped byte in a table's data file: every rank fails naming the
  // table and the chunk, direct or routed.
  std::string kv_file;
  for (const auto& e : std::filesystem::directory_iterator(dir())) {
    if (e.path().filename().string().find("-kv") != std::string::npos) {
      kv_file = e.path().string();
    }
  }
  ASSERT_FALSE(kv_file.empty());
  const uint64_t at = std::filesystem::file_size(kv_file) - 100;
  ASSERT_TRUE(testing_util::FlipBits(kv_file, at, 0x10).ok());
  for (bool routed : {false, true}) {
    SCOPED_TRACE(routed ? "routed" : "direct");
    std::vector<absl::Status> st =
        RunInProcess(2, [&](Communicator& comm) -> absl::Status {
          CAIRN_ASSIGN_OR_RETURN(
              auto table, InMemoryKvTable::Create(
                              "emb", routed ? Spec(3) : spec,
                              KvBucketsOfRank(routed ? 3 : 16, 2, comm.rank())));
          LoadOptions o;
          o.comm = &comm;
          KvTableToLoad t{.fqn = "emb.user", .sink = table.get()};
          if (routed) {
            t.num_buckets = 3;
            t.bucketing = KvBucketing::kInterleaved;
          }
          o.kv_tables.push_back(t);
          StateDict sd;
          return Load(sd, dir(), o).status();
        });
    ExpectSameError(st, "CRC32C mismatch");
    EXPECT_EQ(st[0].code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(st[0].message()),
                HasSubstr("key-value table \"emb.user\", chunk"));
  }
}

// What ranks send the coordinator about their tables is checked as it is
// decoded: a valid spec, a range of its buckets, a row count per bucket.
// (Found by the kv_messages fuzz target: a range from -2^63 overflowed the
// coordinator's arithmetic.)
TEST(KvSaveCodecTest, DecodersRefuseBadTablesFromRanks) {
  using internal_checkpoint::DecodeKvDeclarations;
  using internal_checkpoint::DecodeKvWritten;
  using internal_checkpoint::EncodeKvDeclarations;
  using internal_checkpoint::EncodeKvWritten;
  using internal_checkpoint::KvDeclaration;
  using internal_checkpoint::KvTablePart;
  using internal_checkpoint::KvWritten;
  auto part = [](KvBucketRange buckets, size_t counts) {
    KvWritten w;
    w.parts.push_back(KvTablePart{"emb.user", Spec(), buckets,
                                  std::vector<uint64_t>(counts, 1), {}});
    return EncodeKvWritten(w);
  };
  EXPECT_TRUE(DecodeKvWritten(part({2, 4}, 2), "rank 1's report").ok());
  for (const auto& [bytes, expect] :
       std::vector<std::pair<std::string, std::string>>{
           {part({INT64_MIN + 4, 2}, 0), "are not a range of its 16"},
           {part({3, 2}, 0), "buckets [3, 2) are not a range of its 16"},
           {part({14, 17}, 3), "buckets [14, 17) are not a range of its 16"},
           {part({2, 4}, 3), "3 row counts for buckets [2, 4)"}}) {
    absl::StatusOr<KvWritten> got = DecodeKvWritten(bytes, "rank 1's report");
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << expect;
    EXPECT_THAT(std::string(got.status().message()),
                testing::AllOf(HasSubstr("rank 1's report"),
                               HasSubstr("emb.user"), HasSubstr(expect)));
  }
  KvTableSpec no_buckets = Spec();
  no_buckets.num_buckets = 0;
  for (const KvDeclaration& d :
       {KvDeclaration{"emb.user", no_buckets, {0, 0}},
        KvDeclaration{"emb.user", Spec(), {-1, 3}},
        KvDeclaration{"", Spec(), {0, 3}}}) {
    absl::StatusOr<std::vector<KvDeclaration>> got =
        DecodeKvDeclarations(EncodeKvDeclarations({d}), "rank 2's plan");
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(got.status().message()), HasSubstr("rank 2's plan"));
  }
}

}  // namespace
}  // namespace cairn
