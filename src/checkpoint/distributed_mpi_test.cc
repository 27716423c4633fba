// Distributed save and load over Open MPI, one rank per process. CTest runs
// this binary under `mpiexec -n 4`; every rank runs every test, and the
// process exits non-zero on every rank when any rank failed a test.
#include <mpi.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/kv_table.h"
#include "cairn/rocksdb_kv_table.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/dist_test_util.h"
#include "checkpoint/kv_test_util.h"
#include "checkpoint/test_util.h"
#include "comm/mpi/mpi_test_util.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/fault_injection.h"

namespace cairn {
namespace {

using ::testing::HasSubstr;
using internal_storage::FaultInjectionStorage;
using internal_storage::StorageOp;
using testing_util::CheckRankState;
using testing_util::MakeRankState;
using testing_util::Pattern;
using testing_util::RankState;

Communicator* g_world = nullptr;

// A directory every rank agrees on (made by rank 0), removed by rank 0.
class SharedDir {
 public:
  SharedDir() {
    if (g_world->rank() == 0) tmp_ = std::make_unique<testing_util::TempDir>();
    path_ = tmp_ ? tmp_->path() : "";
    EXPECT_TRUE(g_world->Broadcast(path_, 0).ok());
  }
  ~SharedDir() { EXPECT_TRUE(g_world->Barrier().ok()); }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::unique_ptr<testing_util::TempDir> tmp_;
  std::string path_;
};

// The same status on every rank of the world.
void ExpectSameEverywhere(const absl::Status& s) {
  absl::StatusOr<std::vector<std::string>> all =
      g_world->AllGather(s.ToString());
  ASSERT_TRUE(all.ok());
  for (size_t r = 0; r < all->size(); ++r) {
    EXPECT_EQ((*all)[r], (*all)[0]) << "rank " << r << " differs";
  }
}

absl::Status SaveWorld(const std::string& dir, Pattern p, int64_t step,
                       SavePlanCache* cache = nullptr,
                       bool* hit = nullptr) {
  const int w = g_world->size(), r = g_world->rank();
  RankState s = MakeRankState(p, w, r, step, false);
  SaveOptions o;
  o.comm = g_world;
  o.plan_cache = cache;
  CAIRN_ASSIGN_OR_RETURN(SaveResult res, Save(s.sd, dir, o));
  if (hit != nullptr) *hit = res.plan_cache_hit;
  return absl::OkStatus();
}

// Loads with the first `n` ranks of the world (a Split communicator) under
// `p`, checking every byte; the other ranks only take part in the Split.
absl::Status LoadWithFirst(int n, const std::string& dir, Pattern p,
                           int64_t step) {
  const int r = g_world->rank();
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub,
                         g_world->Split(r < n ? 0 : 1, r));
  if (r >= n) return absl::OkStatus();
  const int saved_world = g_world->size();
  RankState s = MakeRankState(p, n, sub->rank(), step, true,
                              sub->rank() % saved_world);
  LoadOptions o;
  o.comm = sub.get();
  o.bounce_buffer_bytes = 4096;
  CAIRN_RETURN_IF_ERROR(Load(s.sd, dir, o).status());
  if (std::string bad = CheckRankState(s, step); !bad.empty()) {
    return absl::InternalError(absl::StrCat("rank ", r, ": ", bad));
  }
  return absl::OkStatus();
}

TEST(MpiDistributedTest, SaveWithFourLoadWithTwoAndThree) {
  ASSERT_EQ(g_world->size(), 4) << "run under mpiexec -n 4";
  SharedDir dir;
  for (Pattern save : {Pattern::kRows, Pattern::kReplicated, Pattern::kCyclic}) {
    const std::string ckpt = dir.Sub(testing_util::PatternName(save));
    ASSERT_TRUE(SaveWorld(ckpt, save, 12).ok());
    EXPECT_TRUE(LoadWithFirst(2, ckpt, Pattern::kCols, 12).ok());
    EXPECT_TRUE(LoadWithFirst(3, ckpt, Pattern::kBlocks, 12).ok());
    EXPECT_TRUE(LoadWithFirst(3, ckpt, Pattern::kUneven, 12).ok());
    EXPECT_TRUE(LoadWithFirst(4, ckpt, Pattern::kReplicated, 12).ok());
  }
}

TEST(MpiDistributedTest, FailureInEachPhaseReachesEveryRank) {
  SharedDir dir;
  const int r = g_world->rank();
  struct Case {
    std::string phase;
    int rank;
    StorageOp op;
    std::string expect;
  };
  const Case cases[] = {
      {"prepare", 0, StorageOp::kExists, "coordinator"},
      {"write", 1, StorageOp::kWriteAt, "rank 1: UNAVAILABLE"},
      {"finish", 3, StorageOp::kFinish, "rank 3: UNAVAILABLE"},
      {"commit", 0, StorageOp::kWriteAtomically, "at commit (coordinator)"},
  };
  for (const Case& c : cases) {
    const std::string ckpt = dir.Sub(c.phase);
    RankState s = MakeRankState(Pattern::kRows, 4, r, 1, false);
    FaultInjectionStorage faulty(*Storage::Open(ckpt));
    if (r == c.rank) faulty.FailAlways(c.op, absl::UnavailableError("disk on fire"));
    SaveOptions o;
    o.comm = g_world;
    absl::Status st = internal_checkpoint::SaveToStorage(s.sd, &faulty, o).status();
    EXPECT_FALSE(st.ok()) << c.phase;
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.expect)) << c.phase;
    EXPECT_THAT(std::string(st.message()), HasSubstr("disk on fire")) << c.phase;
    ExpectSameEverywhere(st);
    ASSERT_TRUE(g_world->Barrier().ok());
    EXPECT_FALSE(std::filesystem::exists(ckpt + "/metadata.json")) << c.phase;
  }
  // Planning: a rank that cannot open the location.
  {
    RankState s = MakeRankState(Pattern::kRows, 4, r, 1, false);
    SaveOptions o;
    o.comm = g_world;
    absl::StatusOr<std::unique_ptr<Storage>> storage = Storage::Open(dir.Sub("open"));
    absl::StatusOr<Storage*> arg =
        r == 2 ? absl::StatusOr<Storage*>(absl::PermissionDeniedError("no access"))
               : absl::StatusOr<Storage*>(storage->get());
    absl::Status st = internal_checkpoint::SaveToStorage(s.sd, arg, o).status();
    EXPECT_THAT(std::string(st.message()), HasSubstr("rank 2: PERMISSION_DENIED: no access"));
    ExpectSameEverywhere(st);
  }
  // Coverage: rank 3 holds nothing.
  {
    RankState s = MakeRankState(Pattern::kRows, 4, r, 1, false);
    if (r == 3) s.sd["model"]["wq"] = ShardedTensor(DType::kF32, {37, 53}, {});
    SaveOptions o;
    o.comm = g_world;
    absl::Status st = Save(s.sd, dir.Sub("coverage"), o).status();
    EXPECT_THAT(std::string(st.message()), HasSubstr("model.wq [37, 53]"));
    ExpectSameEverywhere(st);
  }
  // Reading: rank 1 of a load cannot read.
  {
    const std::string ckpt = dir.Sub("good");
    ASSERT_TRUE(SaveWorld(ckpt, Pattern::kRows, 2).ok());
    RankState s = MakeRankState(Pattern::kCols, 4, r, 2, true);
    FaultInjectionStorage faulty(*Storage::Open(ckpt));
    if (r == 1) {
      // A job of 4 reads metadata.json on every rank: rank 1's first read
      // after that fails.
      const int64_t before = faulty.calls(StorageOp::kReadAt);
      ASSERT_TRUE(internal_checkpoint::ReadMetadataFromStorage(faulty).ok());
      faulty.FailNthCall(StorageOp::kReadAt,
                         faulty.calls(StorageOp::kReadAt) - before + 1,
                         absl::UnavailableError("disk on fire"));
    }
    LoadOptions o;
    o.comm = g_world;
    absl::Status st = internal_checkpoint::LoadFromStorage(s.sd, &faulty, o).status();
    EXPECT_THAT(std::string(st.message()), HasSubstr("load failed in reading on 1 of 4 ranks: rank 1"));
    ExpectSameEverywhere(st);
  }
}

TEST(MpiDistributedTest, PlanCacheHitsOnlyWhenNothingChanged) {
  SharedDir dir;
  SavePlanCache cache;
  bool hit = true;
  ASSERT_TRUE(SaveWorld(dir.Sub("a"), Pattern::kRows, 1, &cache, &hit).ok());
  EXPECT_FALSE(hit);
  ASSERT_TRUE(SaveWorld(dir.Sub("b"), Pattern::kRows, 2, &cache, &hit).ok());
  EXPECT_TRUE(hit);
  EXPECT_TRUE(LoadWithFirst(3, dir.Sub("b"), Pattern::kCols, 2).ok());
  // Another sharding: every rank's boxes change.
  ASSERT_TRUE(SaveWorld(dir.Sub("c"), Pattern::kCols, 3, &cache, &hit).ok());
  EXPECT_FALSE(hit);
  EXPECT_TRUE(LoadWithFirst(2, dir.Sub("c"), Pattern::kRows, 3).ok());
}

// Two replica groups of two tensor-parallel shards: storage serves one
// copy of the data per group, and every rank gets every byte.
TEST(MpiDistributedTest, BroadcastLoadReadsOncePerReplicaGroup) {
  SharedDir dir;
  const int r = g_world->rank();
  const std::string ckpt = dir.Sub("bcast");
  ASSERT_TRUE(SaveWorld(ckpt, Pattern::kRows, 4).ok());
  uint64_t totals[2] = {0, 0};
  for (int broadcast = 0; broadcast < 2; ++broadcast) {
    // Row shards read exactly the bytes they need, so "one copy" is exact.
    RankState s = MakeRankState(Pattern::kRows, 2, r % 2, 4, true, r % 2);
    absl::StatusOr<std::unique_ptr<Storage>> base = Storage::Open(ckpt);
    ASSERT_TRUE(base.ok());
    testing_util::DataByteCounter counting(**base);
    LoadOptions o;
    o.comm = g_world;
    o.broadcast_replicas = broadcast == 1;
    o.broadcast_batch_bytes = 1024;
    absl::StatusOr<LoadResult> res =
        internal_checkpoint::LoadFromStorage(s.sd, &counting, o);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->replica_group_size, broadcast ? 2 : 1);
    EXPECT_EQ(CheckRankState(s, 4), "");
    int64_t bytes = static_cast<int64_t>(counting.data_bytes());
    ASSERT_TRUE(g_world->AllReduce(std::span<int64_t>(&bytes, 1), ReduceOp::kSum).ok());
    totals[broadcast] = static_cast<uint64_t>(bytes);
  }
  EXPECT_GT(totals[1], 0u);
  EXPECT_EQ(totals[0], 2 * totals[1]);
  // One copy: every tensor once, plus the objects each group loads.
  absl::StatusOr<Metadata> md = ReadMetadata(ckpt);
  ASSERT_TRUE(md.ok());
  uint64_t one_copy = 0;
  for (const auto& [fqn, tm] : md->tensors) one_copy += tm.nbytes();
  for (int shard = 0; shard < 2; ++shard) {
    one_copy += md->objects.at(absl::StrCat("rng.rank", shard)).nbytes +
                md->objects.at("config").nbytes;
  }
  EXPECT_EQ(totals[1], one_copy);
}

// Saved by four processes in rows, loaded by three: model.wq's rows 10..19
// (the second saved chunk) fall to loaders 0 (10..13) and 1 (13..25), so
// each reads a part of it and neither reads it whole. Their parts' CRC32Cs
// meet at the coordinator over MPI: a changed bit in that chunk fails the
// load on all three, naming the chunk and both ranks.
TEST(MpiDistributedTest, RowPartsAreCheckedAcrossProcesses) {
  SharedDir dir;
  const int r = g_world->rank();
  const std::string ckpt = dir.Sub("parts");
  ASSERT_TRUE(SaveWorld(ckpt, Pattern::kRows, 7).ok());
  ASSERT_TRUE(LoadWithFirst(3, ckpt, Pattern::kRows, 7).ok());
  absl::StatusOr<Metadata> md = ReadMetadata(ckpt);
  ASSERT_TRUE(md.ok()) << md.status();
  const ByteLocation* at = nullptr;
  for (const ChunkMetadata& c : md->tensors.at("model.wq").chunks) {
    if (c.box.offsets[0] == 10) at = &c.location;
  }
  ASSERT_NE(at, nullptr);
  const std::string path = ckpt + "/" + at->file;
  // Flips one bit in the chunk's third row (loader 0's part) on rank 0.
  // (Every rank reaches the barrier, whatever rank 0's flip did.)
  auto flip = [&] {
    const absl::Status flipped =
        r == 0 ? testing_util::FlipBits(path, at->offset + 2 * 53 * 4 + 1, 0x10)
               : absl::OkStatus();
    EXPECT_TRUE(flipped.ok()) << flipped;
    ASSERT_TRUE(g_world->Barrier().ok());
  };
  flip();
  const absl::Status bad = LoadWithFirst(3, ckpt, Pattern::kRows, 7);
  if (r < 3) {
    EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss) << bad;
    EXPECT_THAT(bad.message(),
                HasSubstr("crc32c mismatch in model.wq@10,0 (" + at->file));
    EXPECT_THAT(bad.message(), HasSubstr("read in parts by ranks 0, 1)"));
  } else {
    EXPECT_TRUE(bad.ok()) << bad;  // took part in the Split only
  }
  flip();  // back as it was
  EXPECT_TRUE(LoadWithFirst(3, ckpt, Pattern::kRows, 7).ok());
}

// Key-value tables across processes: 4 save from RocksDB, 3 load into
// RocksDB with the saved bucketing (each reads its own rows) and with
// another (rows routed between processes by Scatter); a sink that fails
// on one process fails the load on all of them.
TEST(MpiDistributedTest, KvTableSavedByFourLoadsIntoThree) {
  ASSERT_EQ(g_world->size(), 4) << "run under mpiexec -n 4";
  SharedDir dir;
  const int r = g_world->rank();
  const std::string ckpt = dir.Sub("kv");
  const std::vector<int64_t> ids = testing_util::Ids(4000, 3);
  const KvTableSpec spec = testing_util::KvSpec(16);
  absl::Status saved = [&]() -> absl::Status {
    CAIRN_ASSIGN_OR_RETURN(
        auto db, RocksDbKvTable::Open(dir.Sub(absl::StrCat("src-", r)), "emb",
                                      spec, KvBucketsOfRank(16, 4, r)));
    CAIRN_RETURN_IF_ERROR(testing_util::Fill(*db, ids));
    std::unique_ptr<KvSource> source = db->Source(300);
    SaveOptions o;
    o.comm = g_world;
    o.kv_chunk_bytes = 16 << 10;
    o.kv_tables.push_back({"emb.user", spec, std::nullopt, source.get()});
    StateDict sd;
    return Save(sd, ckpt, o).status();
  }();
  ASSERT_TRUE(saved.ok()) << saved;
  for (int64_t buckets : {16, 5}) {
    SCOPED_TRACE(absl::StrCat(buckets, " buckets"));
    const KvTableSpec dest = testing_util::KvSpec(buckets);
    absl::StatusOr<std::unique_ptr<Communicator>> sub =
        g_world->Split(r < 3 ? 0 : 1, r);
    ASSERT_TRUE(sub.ok()) << sub.status();
    if (r >= 3) continue;
    absl::StatusOr<std::unique_ptr<RocksDbKvTable>> db = RocksDbKvTable::Open(
        dir.Sub(absl::StrCat("dst-", buckets, "-", r)), "emb", dest,
        KvBucketsOfRank(buckets, 3, r));
    ASSERT_TRUE(db.ok()) << db.status();
    LoadOptions o;
    o.comm = sub->get();
    o.memory_budget_bytes = 1;
    KvTableToLoad t{.fqn = "emb.user", .sink = db->get()};
    t.num_buckets = buckets;
    t.bucketing = KvBucketing::kInterleaved;
    o.kv_tables.push_back(t);
    StateDict sd;
    absl::StatusOr<LoadResult> loaded = Load(sd, ckpt, o);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    absl::StatusOr<uint64_t> size = (*db)->size();
    ASSERT_TRUE(size.ok());
    EXPECT_EQ(loaded->kv_rows, *size);
    testing_util::ExpectRows(
        dest, (*db)->owned(), *size,
        [&](int64_t id) -> std::optional<std::string> {
          absl::StatusOr<std::optional<std::string>> row = (*db)->Find(id);
          return row.ok() ? *row : std::nullopt;
        },
        spec, ids, {0, 1, 2}, absl::StrCat("rank ", r));
  }
  // Rank 2's sink refuses every batch (a table of other buckets).
  absl::StatusOr<std::unique_ptr<InMemoryKvTable>> table =
      InMemoryKvTable::Create("emb", spec,
                              r == 2 ? KvBucketRange{0, 0}
                                     : KvBucketsOfRank(16, 4, r));
  ASSERT_TRUE(table.ok());
  LoadOptions o;
  o.comm = g_world;
  o.kv_tables.push_back({.fqn = "emb.user", .sink = table->get()});
  StateDict sd;
  const absl::Status bad = Load(sd, ckpt, o).status();
  ExpectSameEverywhere(bad);
  EXPECT_THAT(bad.message(), HasSubstr("on rank 2"));
}

}  // namespace
}  // namespace cairn

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  absl::StatusOr<std::unique_ptr<cairn::Communicator>> world =
      cairn::MpiWorldCommunicator();
  if (!world.ok()) {
    fprintf(stderr, "cannot start MPI: %s\n", world.status().ToString().c_str());
    return 1;
  }
  cairn::g_world = world->get();
  const int failed = cairn::internal_comm::RunMpiTests();
  world->reset();
  return failed;
}
