// Broadcast load: data-parallel replicas read each stored byte once per
// replica group and share it, instead of once per replica.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/dist_test_util.h"
#include "checkpoint/test_util.h"
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
using testing_util::DataByteCounter;
using testing_util::MakeRankState;
using testing_util::Pattern;
using testing_util::PatternName;
using testing_util::RankState;
using testing_util::TempDir;

constexpr int kShards = 2;    // tensor parallel
constexpr int kReplicas = 2;  // data parallel
constexpr int kWorld = kShards * kReplicas;

struct RankOutcome {
  uint64_t storage_bytes = 0;  // counted by the storage wrapper
  int64_t read_calls = 0;      // ReadAt calls, likewise
  LoadResult result;
};

// Every rank loads tensor-parallel shard (rank % kShards) of `p`; ranks r
// and r + kShards are replicas of each other.
std::vector<absl::Status> LoadReplicas(const std::string& dir, Pattern p,
                                       const LoadOptions& base,
                                       std::vector<RankOutcome>& out,
                                       int failing_rank = -1,
                                       int failing_read = 0) {
  out.assign(kWorld, {});
  return RunInProcess(kWorld, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    const int shard = r % kShards;
    RankState s = MakeRankState(p, kShards, shard, 8, true, shard);
    FaultInjectionStorage faulty(*Storage::Open(dir));
    if (r == failing_rank && failing_read > 0) {
      faulty.FailNthCall(StorageOp::kReadAt, failing_read,
                         absl::UnavailableError("disk on fire"));
    } else if (r == failing_rank) {
      faulty.FailAlways(StorageOp::kReadAt, absl::UnavailableError("disk on fire"));
    }
    DataByteCounter counting(faulty);
    LoadOptions o = base;
    o.comm = &comm;
    absl::StatusOr<LoadResult> loaded =
        internal_checkpoint::LoadFromStorage(s.sd, &counting, o);
    out[r].read_calls = faulty.calls(StorageOp::kReadAt);
    CAIRN_ASSIGN_OR_RETURN(out[r].result, std::move(loaded));
    out[r].storage_bytes = counting.data_bytes();
    if (std::string bad = CheckRankState(s, 8); !bad.empty()) {
      return absl::InternalError(absl::StrCat("rank ", r, ": ", bad));
    }
    return absl::OkStatus();
  });
}

absl::Status SaveShards(const std::string& dir) {
  std::vector<absl::Status> st = RunInProcess(kShards, [&](Communicator& comm) {
    RankState s = MakeRankState(Pattern::kRows, kShards, comm.rank(), 8, false);
    SaveOptions o;
    o.comm = &comm;
    return Save(s.sd, dir, o).status();
  });
  for (const absl::Status& s : st) CAIRN_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

uint64_t Total(const std::vector<RankOutcome>& out) {
  uint64_t total = 0;
  for (const RankOutcome& o : out) total += o.storage_bytes;
  return total;
}

TEST(BroadcastLoadTest, StorageServesOneCopyPerReplicaGroup) {
  TempDir tmp;
  ASSERT_TRUE(SaveShards(tmp.path()).ok());
  for (Pattern p : {Pattern::kRows, Pattern::kCols}) {
    std::vector<RankOutcome> with, without;
    LoadOptions on;
    on.bounce_buffer_bytes = 4096;
    LoadOptions off = on;
    off.broadcast_replicas = false;
    for (const absl::Status& s : LoadReplicas(tmp.path(), p, on, with)) {
      ASSERT_TRUE(s.ok()) << s;
    }
    for (const absl::Status& s : LoadReplicas(tmp.path(), p, off, without)) {
      ASSERT_TRUE(s.ok()) << s;
    }
    // Without broadcast each replica reads its bytes; with it, each group
    // reads them once: exactly half of the storage traffic.
    EXPECT_EQ(Total(without), kReplicas * Total(with)) << PatternName(p);
    // With row shards every byte read is needed: one copy of the tensors,
    // plus the objects each group loads (its rng, and config).
    if (p == Pattern::kRows) {
      absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
      ASSERT_TRUE(md.ok());
      uint64_t one_copy = 0;
      for (const auto& [fqn, tm] : md->tensors) one_copy += tm.nbytes();
      for (int shard = 0; shard < kShards; ++shard) {
        one_copy += md->objects.at(absl::StrCat("rng.rank", shard)).nbytes +
                    md->objects.at("config").nbytes;
      }
      EXPECT_EQ(Total(with), one_copy);
    }
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(with[r].result.replica_group_size, kReplicas);
      EXPECT_EQ(without[r].result.replica_group_size, 1);
      EXPECT_EQ(with[r].storage_bytes, with[r].result.bytes_read);
      EXPECT_EQ(with[r].result.bytes_loaded, without[r].result.bytes_loaded);
      EXPECT_GT(with[r].result.phases.broadcast, 0.0);
    }
    // Reads are spread over the members of each group, not all on one.
    for (int shard = 0; shard < kShards; ++shard) {
      const uint64_t a = with[shard].storage_bytes;
      const uint64_t b = with[shard + kShards].storage_bytes;
      EXPECT_GT(std::min(a, b), 0u) << PatternName(p);
      // Balanced by bytes: the members differ by at most the largest item
      // (here at most half of the largest tensor's rows, rounded up).
      if (p == Pattern::kRows) {
        absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
        ASSERT_TRUE(md.ok());
        uint64_t largest = 0;
        for (const auto& [fqn, tm] : md->tensors) {
          const uint64_t row = tm.nbytes() / static_cast<uint64_t>(tm.shape[0]);
          largest = std::max<uint64_t>(largest, (tm.shape[0] + 1) / 2 * row);
        }
        EXPECT_LE(std::max(a, b) - std::min(a, b), largest) << a << " " << b;
      }
    }
  }
}

// The coordinator groups replicas by a hash of what each rank's plan reads
// (the default planner sends it a summary, not the plan); the ranks then
// check their plans against their group leader's byte for byte. With a
// hash under which every plan collides, all four ranks look alike though
// the two shards read different rows: the check must find it and load
// without groups, bit-exact, instead of broadcasting one shard's bytes
// into the other's tensors.
TEST(BroadcastLoadTest, GroupsFromCollidingHashesAreCheckedAndDropped) {
  TempDir tmp;
  ASSERT_TRUE(SaveShards(tmp.path()).ok());
  struct Restore {
    ~Restore() { internal_checkpoint::SetReplicaHashForTesting(nullptr); }
  } restore;
  internal_checkpoint::SetReplicaHashForTesting(
      [](std::string_view) -> uint64_t { return 42; });
  for (Pattern p : {Pattern::kRows, Pattern::kCols}) {
    std::vector<RankOutcome> out;
    LoadOptions on;
    on.bounce_buffer_bytes = 4096;
    for (const absl::Status& s : LoadReplicas(tmp.path(), p, on, out)) {
      ASSERT_TRUE(s.ok()) << PatternName(p) << ": " << s;
    }
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(out[r].result.replica_group_size, 1) << PatternName(p);
      EXPECT_EQ(out[r].result.phases.broadcast, 0.0) << PatternName(p);
    }
  }
}

TEST(BroadcastLoadTest, SmallBatchesStillBitExact) {
  TempDir tmp;
  ASSERT_TRUE(SaveShards(tmp.path()).ok());
  std::vector<RankOutcome> out;
  LoadOptions o;
  o.broadcast_batch_bytes = 256;  // many batches; items larger than a batch
  for (const absl::Status& s : LoadReplicas(tmp.path(), Pattern::kBlocks, o, out)) {
    EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(BroadcastLoadTest, AReadFailureInAGroupReachesEveryRank) {
  TempDir tmp;
  ASSERT_TRUE(SaveShards(tmp.path()).ok());
  std::vector<RankOutcome> out;
  std::vector<absl::Status> st =
      LoadReplicas(tmp.path(), Pattern::kRows, LoadOptions{}, out, /*failing_rank=*/3);
  for (size_t r = 0; r < st.size(); ++r) {
    EXPECT_FALSE(st[r].ok()) << r;
    EXPECT_EQ(st[r], st[0]) << r;
  }
  EXPECT_THAT(std::string(st[0].message()), HasSubstr("disk on fire"));
}

// With small batches a group loads in many waves, each wave's reads
// running while the wave before is broadcast and placed: a read that fails
// in a later wave fails the load on every rank with the same error (no
// rank hangs in a collective, nothing is left running).
TEST(BroadcastLoadTest, AReadFailureInALaterWaveReachesEveryRank) {
  TempDir tmp;
  ASSERT_TRUE(SaveShards(tmp.path()).ok());
  LoadOptions o;
  o.broadcast_batch_bytes = 256;
  o.io_threads = 1;
  // Rank 1's reads in a clean load (the first reads the data file's
  // header; small reads of one wave are grouped): fail its second and its
  // last, in its first and its last wave.
  std::vector<RankOutcome> clean;
  for (const absl::Status& s : LoadReplicas(tmp.path(), Pattern::kRows, o, clean)) {
    ASSERT_TRUE(s.ok()) << s;
  }
  const int64_t reads = clean[1].read_calls;
  ASSERT_GE(reads, 3) << "too few reads to fail a later wave's";
  for (int64_t nth : {int64_t{2}, reads}) {
    SCOPED_TRACE(absl::StrCat("read ", nth, " of ", reads));
    std::vector<RankOutcome> out;
    std::vector<absl::Status> st =
        LoadReplicas(tmp.path(), Pattern::kRows, o, out, /*failing_rank=*/1,
                     static_cast<int>(nth));
    for (size_t r = 0; r < st.size(); ++r) {
      EXPECT_FALSE(st[r].ok()) << r;
      EXPECT_EQ(st[r], st[0]) << r;
    }
    EXPECT_THAT(std::string(st[0].message()), HasSubstr("disk on fire"));
  }
}

}  // namespace
}  // namespace cairn
