// Distributed save and load with in-process ranks: resharding across world
// sizes, dedup, the coordinator's checks, failure-safe phases, the plan
// cache and custom planners.
#include <atomic>
#include <filesystem>
#include <functional>
#include <latch>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/planner.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/dist_test_util.h"
#include "checkpoint/expect_util.h"
#include "checkpoint/forwarding_planner.h"
#include "checkpoint/test_util.h"
#include "core/byte_codec.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "storage/fault_injection.h"

namespace cairn {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;
using testing_util::CheckRankState;
using testing_util::kAllPatterns;
using testing_util::MakeRankState;
using testing_util::Pattern;
using testing_util::PatternName;
using testing_util::RankState;
using testing_util::ExpectSameError;
using testing_util::TempDir;
using internal_storage::FaultInjectionStorage;
using internal_storage::StorageOp;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// Runs fn on `n` in-process ranks; returns the statuses by rank.
std::vector<absl::Status> OnRanks(
    int n, const std::function<absl::Status(Communicator&)>& fn) {
  return RunInProcess(n, fn);
}

void ExpectAllOk(const std::vector<absl::Status>& st) {
  for (size_t r = 0; r < st.size(); ++r) EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r];
}

bool NothingCommitted(const std::string& dir) {
  return !std::filesystem::exists(dir + "/metadata.json");
}

absl::Status SaveRanks(const std::string& dir, Pattern p, int world,
                       int64_t step, SaveOptions base = {}) {
  std::vector<absl::Status> st = OnRanks(world, [&](Communicator& comm) {
    RankState s = MakeRankState(p, world, comm.rank(), step, false);
    SaveOptions o = base;
    o.comm = &comm;
    return Save(s.sd, dir, o).status();
  });
  for (const absl::Status& s : st) CAIRN_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// Loads with `world` ranks under `p` and checks every byte; rank r reads the
// rng object of rank r % saved_world.
absl::Status LoadRanksAndCheck(const std::string& dir, Pattern p, int world,
                               int saved_world, int64_t step) {
  std::vector<absl::Status> st = OnRanks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    RankState s = MakeRankState(p, world, r, step, /*poison=*/true,
                                r % saved_world);
    LoadOptions o;
    o.comm = &comm;
    o.strict = true;
    o.bounce_buffer_bytes = 4096;  // several slabs per chunk
    absl::StatusOr<LoadResult> result = Load(s.sd, dir, o);
    CAIRN_RETURN_IF_ERROR(result.status());
    if (std::string bad = CheckRankState(s, step); !bad.empty()) {
      return absl::InternalError(absl::StrCat("rank ", r, ": ", bad));
    }
    const Object* rng = s.sd["rng"][absl::StrCat("rank", r % saved_world)].object();
    if (rng->bytes != absl::StrCat("rng state of rank ", r % saved_world, " at ", step)) {
      return absl::InternalError(absl::StrCat("rank ", r, ": rng is ", rng->bytes));
    }
    if (s.sd["config"].object()->bytes != absl::StrCat("config at ", step) ||
        *s.sd["step"].scalar() != Scalar(step)) {
      return absl::InternalError(absl::StrCat("rank ", r, ": config/step wrong"));
    }
    return absl::OkStatus();
  });
  for (const absl::Status& s : st) CAIRN_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// Save with W ranks under one sharding, load with W' under another, for
// every W, W' in {1, 2, 3, 4, 8} and every pattern on each side.
TEST(DistributedTest, ReshardsAcrossWorldSizes) {
  TempDir tmp;
  const int worlds[] = {1, 2, 3, 4, 8};
  int run = 0;
  for (int w : worlds) {
    for (Pattern save : kAllPatterns) {
      const std::string dir = tmp.Sub(absl::StrCat(w, "-", PatternName(save)));
      ASSERT_TRUE(SaveRanks(dir, save, w, 7).ok())
          << w << " " << PatternName(save);
      for (int w2 : worlds) {
        // Every load pattern meets every save pattern across the world pairs.
        const Pattern load = kAllPatterns[(run++) % std::size(kAllPatterns)];
        absl::Status s = LoadRanksAndCheck(dir, load, w2, w, 7);
        EXPECT_TRUE(s.ok()) << "save " << w << " " << PatternName(save)
                            << " -> load " << w2 << " " << PatternName(load)
                            << ": " << s;
      }
    }
  }
}

// Replicated to sharded and back, explicitly.
TEST(DistributedTest, ReplicatedToShardedAndBack) {
  TempDir tmp;
  ASSERT_TRUE(SaveRanks(tmp.Sub("a"), Pattern::kReplicated, 4, 3).ok());
  EXPECT_TRUE(LoadRanksAndCheck(tmp.Sub("a"), Pattern::kBlocks, 3, 4, 3).ok());
  ASSERT_TRUE(SaveRanks(tmp.Sub("b"), Pattern::kBlocks, 4, 3).ok());
  EXPECT_TRUE(LoadRanksAndCheck(tmp.Sub("b"), Pattern::kReplicated, 2, 4, 3).ok());
}

// Four ranks each hold four replicated tensors of equal size: each box is
// written once, and balancing gives each rank one of them; lowest-rank
// gives rank 0 all of them.
// The policy is SaveOptions::dedup, or that of a DefaultSavePlanner passed
// in (which the coordinator plans on flat arrays too, and must not mix up
// with SaveOptions::dedup, left at its default then).
TEST(DistributedTest, DedupWritesReplicatedBoxesOnce) {
  TempDir tmp;
  for (const auto& [policy, via_planner] :
       {std::pair{DedupPolicy::kBalanceBytes, false},
        std::pair{DedupPolicy::kLowestRank, false},
        std::pair{DedupPolicy::kLowestRank, true}}) {
    const std::string dir = tmp.Sub(absl::StrCat(
        policy == DedupPolicy::kBalanceBytes ? "bal" : "low",
        via_planner ? "-planner" : ""));
    std::vector<SaveResult> results(4);
    std::vector<absl::Status> st = OnRanks(4, [&](Communicator& comm) {
      std::vector<Tensor> ts;
      StateDict sd;
      for (int i = 0; i < 4; ++i) {
        Tensor t = *Tensor::Zeros(DType::kF32, {64, 16});
        static_cast<float*>(t.data())[0] = static_cast<float>(i);
        sd["rep"][absl::StrCat("t", i)] = t;
        ts.push_back(t);
      }
      SaveOptions o;
      o.comm = &comm;
      DefaultSavePlanner planner(policy);
      if (via_planner) {
        o.planner = &planner;
      } else {
        o.dedup = policy;
      }
      CAIRN_ASSIGN_OR_RETURN(results[comm.rank()], Save(sd, dir, o));
      return absl::OkStatus();
    });
    ExpectAllOk(st);
    absl::StatusOr<Metadata> md = ReadMetadata(dir);
    ASSERT_TRUE(md.ok());
    for (const auto& [fqn, tm] : md->tensors) EXPECT_EQ(tm.chunks.size(), 1u) << fqn;
    const uint64_t one = 64 * 16 * 4;
    for (int r = 0; r < 4; ++r) {
      const uint64_t expect =
          policy == DedupPolicy::kBalanceBytes ? one : (r == 0 ? 4 * one : 0);
      EXPECT_EQ(results[r].data_bytes, expect) << "rank " << r;
      EXPECT_EQ(results[r].files, expect > 0 ? 1 : 0);
    }
    absl::StatusOr<StateDict> all = LoadAll(dir);
    ASSERT_TRUE(all.ok());
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(static_cast<const float*>(
                    (*all)["rep"][absl::StrCat("t", i)].tensor()->shards()[0].view.data())[0],
                static_cast<float>(i));
    }
  }
}

// The coordinator rejects, before any data is written, shards that leave a
// gap, that overlap, or that disagree on dtype or shape; the error names
// the FQN, the ranks and the boxes, and every rank gets it.
TEST(DistributedTest, CoverageErrorsNameFqnRanksAndBoxes) {
  TempDir tmp;
  struct Case {
    std::string name;
    std::function<ShardedTensor(int rank)> tensor;
    std::vector<std::string> expect;
  };
  auto rows = [](int64_t lo, int64_t hi) {
    return Box{{lo, 0}, {hi - lo, 4}};
  };
  std::vector<Tensor> keep;
  std::mutex mu;
  auto make = [&](DType dt, Shape shape, std::vector<Box> boxes) {
    std::vector<Shard> shards;
    std::lock_guard<std::mutex> lock(mu);
    for (const Box& b : boxes) {
      Tensor t = *Tensor::Zeros(dt, b.sizes);
      keep.push_back(t);
      shards.push_back(Shard{b, t.view()});
    }
    return ShardedTensor(dt, std::move(shape), std::move(shards));
  };
  std::vector<Case> cases = {
      {"gap",
       [&](int r) { return make(DType::kF32, {8, 4}, r == 1 ? std::vector<Box>{} : std::vector<Box>{rows(2 * r, 2 * r + 2)}); },
       {"w", "cover 24 of 32 elements", "rank 0 [0:2, 0:4]"}},
      {"overlap",
       [&](int r) { return make(DType::kF32, {8, 4}, {r == 2 ? rows(3, 6) : rows(2 * r, 2 * r + 2)}); },
       {"w", "overlaps", "rank 1", "rank 2", "[3:6, 0:4]"}},
      {"dtype",
       [&](int r) { return make(r == 3 ? DType::kF64 : DType::kF32, {8, 4}, {rows(2 * r, 2 * r + 2)}); },
       {"w", "rank 0 saves F32", "rank 3 saves F64"}},
      {"shape",
       [&](int r) { return make(DType::kF32, r == 2 ? Shape{8, 5} : Shape{8, 4}, {rows(2 * r, 2 * r + 2)}); },
       {"w", "[8, 4]", "[8, 5]", "rank 2"}},
  };
  for (const Case& c : cases) {
    const std::string dir = tmp.Sub(c.name);
    std::vector<absl::Status> st = OnRanks(4, [&](Communicator& comm) {
      StateDict sd;
      sd["w"] = c.tensor(comm.rank());
      SaveOptions o;
      o.comm = &comm;
      return Save(sd, dir, o).status();
    });
    ExpectSameError(st, "w");
    for (const std::string& e : c.expect) {
      EXPECT_THAT(Msg(st[0]), HasSubstr(e)) << c.name;
    }
    EXPECT_TRUE(NothingCommitted(dir)) << c.name;
    // Nothing was written at all: the check runs before any data file.
    EXPECT_FALSE(testing_util::HasDataFile(dir)) << c.name;
  }
}

// A save planner that fails CreateLocalPlan on one rank.
class FailingPlanner : public DefaultSavePlanner {
 public:
  FailingPlanner(bool fail_plan, bool fail_resolve)
      : fail_plan_(fail_plan), fail_resolve_(fail_resolve) {}
  absl::StatusOr<SavePlan> CreateLocalPlan() override {
    if (fail_plan_) return absl::InternalError("planner exploded");
    return DefaultSavePlanner::CreateLocalPlan();
  }
  absl::StatusOr<ResolvedData> ResolveData(const WriteItem& item) override {
    if (fail_resolve_) return absl::UnavailableError("source went away");
    return DefaultSavePlanner::ResolveData(item);
  }

 private:
  bool fail_plan_, fail_resolve_;
};

// One rank fails in each phase of a save in turn: every rank returns the
// same error naming that rank and its message, no rank hangs, nothing is
// committed (and an existing checkpoint being overwritten is not left
// half-committed).
TEST(DistributedTest, FailureInAnySavePhaseReachesEveryRank) {
  TempDir tmp;
  struct Case {
    std::string phase;
    int rank;
    std::string message;
  };
  const Case cases[] = {
      {"open", 1, "cannot open"},        {"planning", 2, "planner exploded"},
      {"resolve", 1, "source went away"}, {"write", 3, "disk on fire"},
      {"finish", 2, "disk on fire"},      {"prepare", 0, "disk on fire"},
      {"commit", 0, "disk on fire"},
  };
  for (const Case& c : cases) {
    const std::string dir = tmp.Sub(c.phase);
    std::vector<absl::Status> st = OnRanks(4, [&](Communicator& comm) {
      const int r = comm.rank();
      RankState s = MakeRankState(Pattern::kRows, 4, r, 1, false);
      SaveOptions o;
      o.comm = &comm;
      o.write_buffer_bytes = 4096;
      FailingPlanner planner(c.phase == "planning" && r == c.rank,
                             c.phase == "resolve" && r == c.rank);
      o.planner = &planner;
      absl::StatusOr<std::unique_ptr<Storage>> base = Storage::Open(dir);
      CAIRN_RETURN_IF_ERROR(base.status());
      FaultInjectionStorage faulty(*std::move(base));
      const absl::Status fire = absl::UnavailableError("disk on fire");
      if (r == c.rank) {
        if (c.phase == "write") faulty.FailAlways(StorageOp::kWriteAt, fire);
        if (c.phase == "finish") faulty.FailAlways(StorageOp::kFinish, fire);
        if (c.phase == "prepare") faulty.FailAlways(StorageOp::kExists, fire);
        if (c.phase == "commit") faulty.FailAlways(StorageOp::kWriteAtomically, fire);
      }
      absl::StatusOr<Storage*> storage = &faulty;
      if (c.phase == "open" && r == c.rank) {
        storage = absl::PermissionDeniedError("cannot open the location");
      }
      return internal_checkpoint::SaveToStorage(s.sd, storage, o).status();
    });
    ExpectSameError(st, c.message);
    if (c.phase != "prepare" && c.phase != "commit") {
      EXPECT_THAT(Msg(st[0]), HasSubstr(absl::StrCat("rank ", c.rank, ":")))
          << c.phase;
      EXPECT_THAT(Msg(st[0]), HasSubstr("1 of 4 ranks")) << c.phase;
    } else {
      EXPECT_THAT(Msg(st[0]), HasSubstr("coordinator")) << c.phase;
    }
    EXPECT_TRUE(NothingCommitted(dir)) << c.phase;
  }
}

// Several ranks failing are all named.
TEST(DistributedTest, EveryFailedRankIsNamed) {
  TempDir tmp;
  std::vector<absl::Status> st = OnRanks(4, [&](Communicator& comm) {
    RankState s = MakeRankState(Pattern::kRows, 4, comm.rank(), 1, false);
    SaveOptions o;
    o.comm = &comm;
    FailingPlanner planner(comm.rank() % 2 == 1, false);
    o.planner = &planner;
    return Save(s.sd, tmp.path(), o).status();
  });
  ExpectSameError(st, "2 of 4 ranks");
  EXPECT_THAT(Msg(st[0]), HasSubstr("rank 1: INTERNAL: planner exploded"));
  EXPECT_THAT(Msg(st[0]), HasSubstr("rank 3: INTERNAL: planner exploded"));
}

// One rank fails in each phase of a load.
TEST(DistributedTest, FailureInAnyLoadPhaseReachesEveryRank) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  ASSERT_TRUE(SaveRanks(dir, Pattern::kRows, 4, 5).ok());
  struct Case {
    std::string phase;
    int rank;
    std::string message;
  };
  const Case cases[] = {
      {"metadata", 0, "disk on fire"},
      {"missing key", 2, "not in the checkpoint"},
      {"read", 2, "disk on fire"},
  };
  for (const Case& c : cases) {
    std::vector<absl::Status> st = OnRanks(3, [&](Communicator& comm) {
      const int r = comm.rank();
      RankState s = MakeRankState(Pattern::kCols, 3, r, 5, true, r);
      if (c.phase == "missing key" && r == c.rank) s.sd["not_saved"] = int64_t{1};
      FaultInjectionStorage faulty(*Storage::Open(dir));
      const absl::Status fire = absl::UnavailableError("disk on fire");
      if (r == c.rank) {
        if (c.phase == "metadata") faulty.FailAlways(StorageOp::kOpenForRead, fire);
        if (c.phase == "read") faulty.FailAlways(StorageOp::kReadAt, fire);
      }
      LoadOptions o;
      o.comm = &comm;
      return internal_checkpoint::LoadFromStorage(s.sd, &faulty, o).status();
    });
    ExpectSameError(st, c.message);
    if (c.phase != "metadata") {
      EXPECT_THAT(Msg(st[0]), HasSubstr(absl::StrCat("rank ", c.rank, ":")));
      EXPECT_THAT(Msg(st[0]), HasSubstr("on 1 of 3 ranks"));
    }
  }
}

// Issue 33: a rank that never reaches a save or a load (stopped,
// deadlocked) hung every other rank forever. Their first collective now
// times out, and Save and Load return that error, naming the rank; the late
// rank, let go once the others have given up, fails at once too. (A load
// of 4 ranks begins with the planning gather, which a rank other than the
// coordinator leaves once its message is handed over: such a rank finds
// the communicator unusable in the next collective instead, kAborted,
// naming the same timeout.)
TEST(DistributedTest, RankThatNeverArrivesTimesOutTheOthers) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  ASSERT_TRUE(SaveRanks(dir, Pattern::kRows, 4, 5).ok());
  CommunicatorOptions options;
  options.collective_timeout = absl::Milliseconds(200);
  for (bool save : {true, false}) {
    SCOPED_TRACE(save ? "save" : "load");
    const std::string where = tmp.Sub(save ? "again" : "ckpt");
    std::latch others_gave_up(3);
    std::vector<absl::Status> st = RunInProcess(
        4,
        [&](Communicator& comm) {
          const int r = comm.rank();
          if (r == 3) others_gave_up.wait();
          RankState s = MakeRankState(Pattern::kRows, 4, r, 5, !save);
          absl::Status status;
          if (save) {
            SaveOptions o;
            o.comm = &comm;
            status = Save(s.sd, where, o).status();
          } else {
            LoadOptions o;
            o.comm = &comm;
            status = Load(s.sd, where, o).status();
          }
          if (r != 3) others_gave_up.count_down();
          return status;
        },
        options);
    ASSERT_EQ(st.size(), 4u);
    for (int r = 0; r < 3; ++r) {
      if (save || r == 0) {
        EXPECT_EQ(st[r].code(), absl::StatusCode::kDeadlineExceeded) << st[r];
      } else {
        EXPECT_THAT(st[r].code(),
                    AnyOf(absl::StatusCode::kDeadlineExceeded,
                          absl::StatusCode::kAborted))
            << st[r];
      }
      EXPECT_THAT(Msg(st[r]), HasSubstr("rank 3 did not arrive within 0.2 s"));
    }
    EXPECT_EQ(st[3].code(), absl::StatusCode::kAborted) << st[3];
    EXPECT_THAT(Msg(st[3]), HasSubstr("rank 3 did not arrive within 0.2 s"));
    if (save) {
      EXPECT_TRUE(NothingCommitted(where));
    }
  }
}

// The coordinator reads metadata.json and sends its bytes; every rank
// decodes them, the coordinator alone checks chunk coverage. Damaged
// metadata fails every rank alike either way, naming the file.
TEST(DistributedTest, DamagedMetadataFailsEveryRank) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  ASSERT_TRUE(SaveRanks(dir, Pattern::kRows, 4, 5).ok());
  const std::string path = dir + "/metadata.json";
  const std::string good = testing_util::ReadFile(path);
  // 3 ranks each read metadata.json; 9 get the coordinator's by broadcast.
  for (const int world : {3, 9}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks"));
    const std::string of = absl::StrCat(" of ", world, " ranks");
    auto load = [&] {
      return OnRanks(world, [&](Communicator& comm) {
        RankState s = MakeRankState(Pattern::kCols, world, comm.rank(), 5,
                                    true, comm.rank() % 4);
        LoadOptions o;
        o.comm = &comm;
        return Load(s.sd, dir, o).status();
      });
    };
    // Cut short: no rank can decode it.
    testing_util::WriteFile(path, good.substr(0, good.size() / 2));
    std::vector<absl::Status> st = load();
    ExpectSameError(st, path);
    EXPECT_THAT(Msg(st[0]), HasSubstr(absl::StrCat("on ", world, of)));
    // One chunk gone: it decodes everywhere, and the coordinator's coverage
    // check fails the load on every rank.
    nlohmann::json j = nlohmann::json::parse(good);
    std::string fqn;
    for (auto& [name, tensor] : j["tensors"].items()) {
      if (tensor["chunks"].size() > 1) {
        tensor["chunks"].erase(tensor["chunks"].begin());
        fqn = name;
        break;
      }
    }
    ASSERT_FALSE(fqn.empty());
    testing_util::WriteFile(path, testing_util::Resealed(j.dump()));
    st = load();
    ExpectSameError(st, "elements are in no chunk");
    EXPECT_THAT(Msg(st[0]), HasSubstr(fqn));
    EXPECT_THAT(Msg(st[0]), HasSubstr(path));
    // (Other ranks' plans may fail too: the chunk is missing for them.)
    EXPECT_THAT(Msg(st[0]), HasSubstr("ranks: rank 0: DATA_LOSS"));
    testing_util::WriteFile(path, good);
    ExpectAllOk(load());
  }
}

// In a job of up to 8 ranks every rank reads metadata.json itself. Ranks
// that read different ones (another save committed between their reads,
// or ranks pointed at different checkpoints) are refused while planning,
// on every rank, before any byte is read: kAborted naming the first rank
// that differs. Loads of 9 and 12 ranks, which get the coordinator's by
// broadcast, reshard exactly.
TEST(DistributedTest, RanksThatReadOtherMetadataAreRefused) {
  TempDir tmp;
  const std::string a = tmp.Sub("a");
  const std::string b = tmp.Sub("b");
  ASSERT_TRUE(SaveRanks(a, Pattern::kRows, 4, 5).ok());
  ASSERT_TRUE(SaveRanks(b, Pattern::kRows, 4, 6).ok());
  std::vector<absl::Status> st = OnRanks(3, [&](Communicator& comm) {
    const int r = comm.rank();
    RankState s = MakeRankState(Pattern::kCols, 3, r, 5, /*poison=*/true, r);
    LoadOptions o;
    o.comm = &comm;
    absl::Status loaded = Load(s.sd, r == 2 ? b : a, o).status();
    // Nothing was read: the destinations still hold the poison.
    if (CheckRankState(s, 5).empty() || CheckRankState(s, 6).empty()) {
      return absl::InternalError(absl::StrCat("rank ", r, " was loaded"));
    }
    return loaded;
  });
  ExpectSameError(st, "rank 2 read other metadata than rank 0 did");
  EXPECT_EQ(st[0].code(), absl::StatusCode::kAborted) << st[0];
  EXPECT_THAT(Msg(st[0]), HasSubstr(a));
  for (const int world : {9, 12}) {
    EXPECT_TRUE(LoadRanksAndCheck(a, Pattern::kCols, world, 4, 5).ok())
        << world;
  }
}

// The plan cache: an unchanged structure reuses the plan (values still
// change); one changed shape, one added key on one rank, or one rank's
// changed box all force full planning, and each checkpoint loads exactly.
TEST(DistributedTest, PlanCacheNeverReusesAStalePlan) {
  TempDir tmp;
  constexpr int kWorld = 4;
  std::vector<SavePlanCache> caches(kWorld);
  struct Step {
    std::string name;
    bool expect_hit;
    // Edits rank r's state before saving.
    std::function<void(int r, RankState&)> edit;
  };
  std::vector<Tensor> keep;
  std::mutex mu;
  auto extra = [&](Shape shape, std::vector<Box> boxes) {
    std::vector<Shard> shards;
    std::lock_guard<std::mutex> lock(mu);
    for (const Box& b : boxes) {
      Tensor t = *Tensor::Zeros(DType::kF32, b.sizes);
      keep.push_back(t);
      shards.push_back(Shard{b, t.view()});
    }
    return ShardedTensor(DType::kF32, std::move(shape), std::move(shards));
  };
  auto row = [](int64_t r, int64_t cols) { return Box{{r, 0}, {1, cols}}; };
  const std::vector<Step> steps = {
      {"first", false, [&](int r, RankState& s) { s.sd["x"] = extra({4, 8}, {row(r, 8)}); }},
      {"same", true, [&](int r, RankState& s) { s.sd["x"] = extra({4, 8}, {row(r, 8)}); }},
      {"shape", false, [&](int r, RankState& s) { s.sd["x"] = extra({4, 9}, {row(r, 9)}); }},
      {"same again", true, [&](int r, RankState& s) { s.sd["x"] = extra({4, 9}, {row(r, 9)}); }},
      {"key on rank 2", false, [&](int r, RankState& s) {
         s.sd["x"] = extra({4, 9}, {row(r, 9)});
         if (r == 2) s.sd["only_on_2"] = Object{"hello"};
       }},
      {"box on rank 3", false, [&](int r, RankState& s) {
         // Rank 3 now also holds a replica of row 0.
         s.sd["x"] = extra({4, 9}, r == 3 ? std::vector<Box>{row(0, 9), row(3, 9)}
                                         : std::vector<Box>{row(r, 9)});
       }},
      {"same as before", true, [&](int r, RankState& s) {
         s.sd["x"] = extra({4, 9}, r == 3 ? std::vector<Box>{row(0, 9), row(3, 9)}
                                         : std::vector<Box>{row(r, 9)});
       }},
  };
  int64_t step_no = 10;
  for (const Step& step : steps) {
    ++step_no;
    const std::string dir = tmp.Sub(absl::StrCat("s", step_no));
    // One byte per rank: ranks are threads, and std::vector<bool> packs its
    // elements into shared words, so concurrent writes would race.
    std::vector<char> hits(kWorld, 0);
    std::vector<absl::Status> st = OnRanks(kWorld, [&](Communicator& comm) {
      const int r = comm.rank();
      RankState s = MakeRankState(Pattern::kRows, kWorld, r, step_no, false);
      step.edit(r, s);
      SaveOptions o;
      o.comm = &comm;
      o.plan_cache = &caches[r];
      CAIRN_ASSIGN_OR_RETURN(SaveResult res, Save(s.sd, dir, o));
      hits[r] = res.plan_cache_hit;
      return absl::OkStatus();
    });
    ExpectAllOk(st);
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(hits[r] != 0, step.expect_hit) << step.name << " rank " << r;
    }
    EXPECT_TRUE(LoadRanksAndCheck(dir, Pattern::kCols, 3, kWorld, step_no).ok())
        << step.name;
    absl::StatusOr<Metadata> md = ReadMetadata(dir);
    ASSERT_TRUE(md.ok());
    EXPECT_EQ(md->scalars.at("step"), Scalar(step_no)) << step.name;
    EXPECT_EQ(md->tensors.at("x").shape[1], step.name == "first" || step.name == "same" ? 8 : 9);
    EXPECT_EQ(md->objects.contains("only_on_2"), step.name == "key on rank 2");
  }
}

// A change on one rank that makes the state invalid is caught even when
// every other rank's plan is unchanged (a stale plan would have saved it).
TEST(DistributedTest, PlanCacheMissStillChecksCoverage) {
  TempDir tmp;
  std::vector<SavePlanCache> caches(2);
  for (int round = 0; round < 2; ++round) {
    std::vector<absl::Status> st = OnRanks(2, [&](Communicator& comm) {
      const int r = comm.rank();
      Tensor t = *Tensor::Zeros(DType::kF32, {1, 4});
      StateDict sd;
      // Round 1: rank 1 moves its row onto rank 0's.
      const int64_t row = round == 1 ? 0 : r;
      sd["x"] = ShardedTensor(DType::kF32, {2, 4}, {Shard{Box{{row, 0}, {1, 4}}, t.view()}});
      SaveOptions o;
      o.comm = &comm;
      o.plan_cache = &caches[r];
      return Save(sd, tmp.Sub(absl::StrCat(round)), o).status();
    });
    if (round == 0) {
      ExpectAllOk(st);
    } else {
      ExpectSameError(st, "cover 4 of 8 elements");
    }
  }
}

// A save planner that stores every key under "renamed." and a load planner
// that maps the names back.
class PrefixSavePlanner : public DefaultSavePlanner {
 public:
  absl::StatusOr<SavePlan> CreateLocalPlan() override {
    CAIRN_ASSIGN_OR_RETURN(SavePlan plan, DefaultSavePlanner::CreateLocalPlan());
    for (WriteItem& item : plan.items) item.fqn = "renamed." + item.fqn;
    return plan;
  }
};

class PrefixLoadPlanner : public DefaultLoadPlanner {
 public:
  std::vector<std::string> loaded;  // OnTensorLoaded calls, in order
  std::string bad;                  // a tensor reported before it was complete

 protected:
  std::string StoredName(const std::string& fqn) const override {
    return fqn == "step" ? fqn : "renamed." + fqn;
  }
  absl::Status OnTensorLoaded(const std::string& fqn) override {
    loaded.push_back(fqn);
    return absl::OkStatus();
  }
};

TEST(DistributedTest, CustomPlannersRenameOnSaveAndMapBackOnLoad) {
  TempDir tmp;
  std::vector<absl::Status> st = OnRanks(3, [&](Communicator& comm) {
    RankState s = MakeRankState(Pattern::kUneven, 3, comm.rank(), 9, false);
    PrefixSavePlanner planner;
    SaveOptions o;
    o.comm = &comm;
    o.planner = &planner;
    return Save(s.sd, tmp.path(), o).status();
  });
  ExpectAllOk(st);
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok());
  EXPECT_TRUE(md->tensors.contains("renamed.model.wq"));
  EXPECT_FALSE(md->tensors.contains("model.wq"));
  EXPECT_TRUE(md->objects.contains("renamed.rng.rank2"));

  std::vector<std::vector<std::string>> loaded(2);
  st = OnRanks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    RankState s = MakeRankState(Pattern::kBlocks, 2, r, 9, true, r);
    PrefixLoadPlanner planner;
    LoadOptions o;
    o.comm = &comm;
    o.planner = &planner;
    o.bounce_buffer_bytes = 4096;
    CAIRN_RETURN_IF_ERROR(Load(s.sd, tmp.path(), o).status());
    if (std::string bad = CheckRankState(s, 9); !bad.empty()) {
      return absl::InternalError(bad);
    }
    loaded[r] = planner.loaded;
    return absl::OkStatus();
  });
  ExpectAllOk(st);
  // Every tensor (5) and object (rng.rankR, config) reported exactly once.
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> sorted = loaded[r];
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
    EXPECT_EQ(sorted.size(), 7u) << absl::StrJoin(sorted, ",");
  }
}

// CommitChunk is count-based: OnTensorLoaded for a tensor comes once, after
// all of its chunks have landed (checked inside the callback).
class CheckingLoadPlanner : public DefaultLoadPlanner {
 public:
  explicit CheckingLoadPlanner(RankState* state) : state_(state) {}
  int calls = 0;
  int commits = 0;
  std::string error;
  absl::Status CommitChunk(const ReadItem& item) override {
    ++commits;
    return DefaultLoadPlanner::CommitChunk(item);
  }

 protected:
  absl::Status OnTensorLoaded(const std::string& fqn) override {
    ++calls;
    // The whole destination of model.wq must already be correct.
    if (fqn == "model.wq") {
      if (std::string bad = CheckWq(); !bad.empty()) error = bad;
    }
    return absl::OkStatus();
  }

 private:
  std::string CheckWq() {
    const ShardedTensor& t = *state_->sd["model"]["wq"].tensor();
    for (const Shard& s : t.shards()) {
      const auto* bytes = static_cast<const std::byte*>(s.view.data());
      for (int64_t e = 0; e < s.box.num_elements(); ++e) {
        const int64_t g = testing_util::GlobalIndex(t.global_shape(), s.box, e);
        for (size_t i = 0; i < 4; ++i) {
          if (bytes[e * 4 + i] !=
              testing_util::ByteAt(DType::kF32, g, i, testing_util::SeedOf("model.wq", 4))) {
            return "model.wq incomplete when reported";
          }
        }
      }
    }
    return "";
  }
  RankState* state_;
};

TEST(DistributedTest, CommitChunkReportsEachTensorOnceWhenComplete) {
  TempDir tmp;
  ASSERT_TRUE(SaveRanks(tmp.path(), Pattern::kCyclic, 4, 4).ok());
  std::vector<absl::Status> st = OnRanks(2, [&](Communicator& comm) {
    const int r = comm.rank();
    RankState s = MakeRankState(Pattern::kCols, 2, r, 4, true, r);
    CheckingLoadPlanner planner(&s);
    LoadOptions o;
    o.comm = &comm;
    o.planner = &planner;
    CAIRN_RETURN_IF_ERROR(Load(s.sd, tmp.path(), o).status());
    if (!planner.error.empty()) return absl::InternalError(planner.error);
    // 5 tensors + rng + config, each once; model.wq alone arrives in many
    // chunks (cyclic rows of 3), so commits outnumber tensors.
    if (planner.calls != 7) {
      return absl::InternalError(absl::StrCat("OnTensorLoaded calls: ", planner.calls));
    }
    if (planner.commits <= planner.calls) {
      return absl::InternalError(absl::StrCat("commits: ", planner.commits));
    }
    return absl::OkStatus();
  });
  ExpectAllOk(st);
}

// A planner that materializes "computed.*" tensors (here: their values
// doubled) once per tensor, however many shards and blocks, and releases
// each copy after its last item is written.
class DoublingPlanner : public DefaultSavePlanner {
 public:
  std::atomic<int> materialized{0};
  std::mutex mu;
  std::vector<std::weak_ptr<void>> copies;

 protected:
  bool NeedsMaterialize(const std::string& fqn,
                        const ShardedTensor&) const override {
    return fqn.starts_with("computed.");
  }
  absl::StatusOr<std::vector<Tensor>> Materialize(
      const std::string& fqn, const ShardedTensor& t) override {
    ++materialized;
    std::vector<Tensor> out;
    for (const Shard& s : t.shards()) {
      CAIRN_ASSIGN_OR_RETURN(Tensor c, Tensor::CopyOf(s.view));
      auto* f = static_cast<float*>(c.data());
      for (int64_t i = 0; i < s.box.num_elements(); ++i) f[i] *= 2;
      std::lock_guard<std::mutex> lock(mu);
      copies.push_back(c.buffer());
      out.push_back(std::move(c));
    }
    return out;
  }
};

TEST(DistributedTest, ResolveDataMaterializesOncePerTensorAndReleases) {
  TempDir tmp;
  constexpr int kWorld = 2;
  std::vector<int> counts(kWorld);
  std::vector<int> live(kWorld);
  std::vector<absl::Status> st = OnRanks(kWorld, [&](Communicator& comm) {
    const int r = comm.rank();
    StateDict sd;
    std::vector<Tensor> keep;
    for (int k = 0; k < 3; ++k) {
      // Three shards per rank of each tensor: rows 3r, 3r+1, 3r+2 of 6.
      std::vector<Shard> shards;
      for (int i = 0; i < 3; ++i) {
        Tensor t = *Tensor::Empty(DType::kF32, {1, 2048});
        for (int j = 0; j < 2048; ++j) static_cast<float*>(t.data())[j] = 3 * r + i + k;
        keep.push_back(t);
        shards.push_back(Shard{Box{{3 * r + i, 0}, {1, 2048}}, t.view()});
      }
      sd["computed"][absl::StrCat("t", k)] =
          ShardedTensor(DType::kF32, {6, 2048}, std::move(shards));
    }
    DoublingPlanner planner;
    SaveOptions o;
    o.comm = &comm;
    o.planner = &planner;
    o.write_buffer_bytes = 4096;  // each 8 KiB shard spans several blocks
    o.io_threads = 3;
    CAIRN_RETURN_IF_ERROR(Save(sd, tmp.path(), o).status());
    counts[r] = planner.materialized;
    for (const auto& w : planner.copies) live[r] += !w.expired();
    return absl::OkStatus();
  });
  ExpectAllOk(st);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(counts[r], 3) << "rank " << r;  // once per tensor, not per shard
    EXPECT_EQ(live[r], 0) << "rank " << r;    // released before Save returned
  }
  absl::StatusOr<StateDict> all = LoadAll(tmp.path());
  ASSERT_TRUE(all.ok());
  for (int k = 0; k < 3; ++k) {
    const float* f = static_cast<const float*>(
        (*all)["computed"][absl::StrCat("t", k)].tensor()->shards()[0].view.data());
    for (int row = 0; row < 6; ++row) EXPECT_EQ(f[row * 2048 + 7], 2.0f * (row + k));
  }
}

// In a distributed load a stored leaf is "unexpected" only when no rank
// asked for it: tensors, objects and scalars alike, sorted by name, with
// cairn's default planner (plan summaries) and with a planner derived from
// LoadPlanner (whole plans, its CreateGlobalPlan called at the coordinator).
TEST(DistributedTest, UnexpectedListsLeavesNoRankAskedFor) {
  TempDir tmp;
  StateDict saved;
  saved["a"] = int64_t{1};
  saved["b"] = int64_t{2};
  saved["c"] = int64_t{3};
  saved["m_object"] = Object{"bytes"};
  saved["n_object"] = Object{"more bytes"};
  Tensor t = *Tensor::Zeros(DType::kF32, {2, 4});
  saved["z_tensor"] =
      ShardedTensor(DType::kF32, {2, 4}, {Shard{Box{{0, 0}, {2, 4}}, t.view()}});
  saved["y_tensor"] =
      ShardedTensor(DType::kF32, {2, 4}, {Shard{Box{{0, 0}, {2, 4}}, t.view()}});
  ASSERT_TRUE(Save(saved, tmp.path()).ok());
  for (bool users : {false, true}) {
    SCOPED_TRACE(users ? "the user's planner" : "the default planner");
    std::vector<std::vector<std::string>> unexpected(2);
    ExpectAllOk(OnRanks(2, [&](Communicator& comm) {
      StateDict dst;
      Tensor mine = *Tensor::Zeros(DType::kF32, {1, 4});
      dst[comm.rank() == 0 ? "a" : "b"] = int64_t{0};
      if (comm.rank() == 1) dst["n_object"] = Object{};
      dst["y_tensor"] = ShardedTensor(
          DType::kF32, {2, 4},
          {Shard{Box{{comm.rank(), 0}, {1, 4}}, mine.view()}});
      internal_checkpoint::ForwardingLoadPlanner planner;
      LoadOptions o;
      o.comm = &comm;
      if (users) o.planner = &planner;
      CAIRN_ASSIGN_OR_RETURN(LoadResult r, Load(dst, tmp.path(), o));
      unexpected[comm.rank()] = r.unexpected;
      if (planner.global_plans() != (users && comm.rank() == 0 ? 1 : 0)) {
        return absl::InternalError(absl::StrCat(
            "CreateGlobalPlan called ", planner.global_plans(), " times"));
      }
      return absl::OkStatus();
    }));
    for (int r = 0; r < 2; ++r) {
      EXPECT_THAT(unexpected[r],
                  ::testing::ElementsAre("c", "m_object", "z_tensor"));
    }
  }
}

// Every rank must plan with the same kind of planner: one that sends a
// summary next to one that sends its whole plan is a clear error on every
// rank, not a hang or a misread message. A subclass of DefaultLoadPlanner
// sends a summary as the default one does, so they mix.
class RenamingLoadPlanner : public DefaultLoadPlanner {
 protected:
  std::string StoredName(const std::string& fqn) const override {
    return fqn == "b" ? "a" : fqn;
  }
};

TEST(DistributedTest, RanksMustPlanWithTheSameKindOfPlanner) {
  TempDir tmp;
  StateDict saved;
  saved["a"] = int64_t{1};
  ASSERT_TRUE(Save(saved, tmp.path()).ok());
  std::vector<int64_t> got(2, 0);
  ExpectAllOk(OnRanks(2, [&](Communicator& comm) {
    const std::string leaf = comm.rank() == 1 ? "b" : "a";
    StateDict dst;
    dst[leaf] = int64_t{0};
    RenamingLoadPlanner renaming;
    LoadOptions o;
    o.comm = &comm;
    if (comm.rank() == 1) o.planner = &renaming;
    CAIRN_RETURN_IF_ERROR(Load(dst, tmp.path(), o).status());
    got[comm.rank()] = std::get<int64_t>(*dst[leaf].scalar());
    return absl::OkStatus();
  }));
  EXPECT_EQ(got, (std::vector<int64_t>{1, 1}));

  std::vector<absl::Status> st = OnRanks(2, [&](Communicator& comm) {
    StateDict dst;
    dst["a"] = int64_t{0};
    internal_checkpoint::ForwardingLoadPlanner planner;
    LoadOptions o;
    o.comm = &comm;
    if (comm.rank() == 1) o.planner = &planner;
    return Load(dst, tmp.path(), o).status();
  });
  for (const absl::Status& s : st) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("rank 1 planned its load with its own "
                                       "planner, the coordinator with "
                                       "cairn's default planner"));
  }
}

// The coordinator reads the ranks' plan summaries as untrusted bytes: a
// truncated message, one with bytes left over, or one whose unexpected
// leaves do not match the metadata is kDataLoss naming the rank, never a
// read past the message.
TEST(DistributedTest, MalformedPlanSummariesAreErrorsNamingTheRank) {
  TempDir tmp;
  StateDict saved;
  saved["a"] = int64_t{1};
  saved["b"] = int64_t{2};
  ASSERT_TRUE(Save(saved, tmp.path()).ok());
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok()) << md.status();
  DefaultLoadPlanner planner;
  LoadPlan plan;
  plan.unexpected = {"b"};
  absl::StatusOr<std::string> good =
      internal_checkpoint::EncodeLocalLoadPlan(planner, plan, *md);
  ASSERT_TRUE(good.ok()) << good.status();
  absl::StatusOr<std::vector<std::string>> fine =
      internal_checkpoint::PlanLoadGlobally(planner, *md, {*good, *good}, true);
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_EQ(fine->size(), 2u);
  // One rank asking for node reads: every rank is told (the answer's
  // third byte, after its kind and the replica-group flag).
  absl::StatusOr<std::string> asks =
      internal_checkpoint::EncodeLocalLoadPlan(planner, plan, *md, true);
  ASSERT_TRUE(asks.ok()) << asks.status();
  for (const auto& messages : {std::vector<std::string>{*good, *good},
                               std::vector<std::string>{*good, *asks}}) {
    absl::StatusOr<std::vector<std::string>> answers =
        internal_checkpoint::PlanLoadGlobally(planner, *md, messages, true);
    ASSERT_TRUE(answers.ok()) << answers.status();
    for (const std::string& a : *answers) {
      ASSERT_GT(a.size(), 2u);
      EXPECT_EQ(a[2], messages[1] == *asks ? 1 : 0);
    }
  }

  internal_core::ByteWriter wide;
  wide.U8(2);  // a summary
  wide.U64(0);
  wide.U64(0);
  wide.Str("too many bytes of leaves");
  wide.U8(0);  // no node reads
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "load plan of rank 1"},
      {good->substr(0, 9), "load plan of rank 1"},
      {*good + "x", "load plan of rank 1"},
      {wide.Take(), "load plan of rank 1: 24 bytes of unexpected leaves for 2 "
                    "stored leaves"},
  };
  for (const auto& [message, expected] : bad) {
    absl::StatusOr<std::vector<std::string>> r =
        internal_checkpoint::PlanLoadGlobally(planner, *md, {*good, message},
                                              true);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(expected));
  }
  // A leaf the metadata lacks cannot be summarized.
  plan.unexpected = {"not stored"};
  EXPECT_EQ(internal_checkpoint::EncodeLocalLoadPlan(planner, plan, *md)
                .status()
                .code(),
            absl::StatusCode::kInternal);
}

// A scalar held by several ranks is saved once, so the copies must agree
// (bit for bit: a NaN on every rank is fine).
TEST(DistributedTest, ScalarsMustAgreeAcrossRanks) {
  TempDir tmp;
  for (bool differ : {false, true}) {
    const std::string dir = tmp.Sub(differ ? "differ" : "same");
    std::vector<absl::Status> st = OnRanks(3, [&](Communicator& comm) {
      StateDict sd;
      sd["step"] = int64_t{differ && comm.rank() == 2 ? 8 : 7};
      sd["loss"] = std::numeric_limits<double>::quiet_NaN();
      SaveOptions o;
      o.comm = &comm;
      return Save(sd, dir, o).status();
    });
    if (differ) {
      ExpectSameError(st, "scalar step differs between rank 0 and rank 2");
      EXPECT_TRUE(NothingCommitted(dir));
    } else {
      ExpectAllOk(st);
    }
  }
}

// Dedup as a pure function: balancing spreads equal replicated boxes, and
// the lowest-rank policy gives each replicated box to its lowest holder.
TEST(DistributedTest, DedupSavePlansIsDeterministic) {
  std::vector<SavePlan> plans(3);
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 6; ++i) {
      WriteItem item;
      item.fqn = absl::StrCat("t", i);
      item.dtype = DType::kU8;
      item.global_shape = {100};
      item.box = Box{{0}, {100}};
      item.nbytes = 100;
      if (i < 3 || r > 0) plans[r].items.push_back(item);  // t3..t5: ranks 1, 2
    }
  }
  std::vector<SavePlan> bal = DedupSavePlans(plans, DedupPolicy::kBalanceBytes);
  EXPECT_EQ(bal[0].items.size() + bal[1].items.size() + bal[2].items.size(), 6u);
  for (const SavePlan& p : bal) EXPECT_EQ(p.items.size(), 2u);
  std::vector<SavePlan> low = DedupSavePlans(plans, DedupPolicy::kLowestRank);
  EXPECT_EQ(low[0].items.size(), 3u);
  EXPECT_EQ(low[1].items.size(), 3u);
  EXPECT_EQ(low[2].items.size(), 0u);
  EXPECT_EQ(DedupSavePlans(plans, DedupPolicy::kBalanceBytes)[1].items,
            bal[1].items);
}

}  // namespace
}  // namespace cairn
