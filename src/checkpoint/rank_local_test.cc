// Rank-local checkpoints: saved and loaded with no collective at all, merged
// offline into a global checkpoint that any number of ranks can load.
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "checkpoint/dist_test_util.h"
#include "checkpoint/test_util.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using ::testing::HasSubstr;
using testing_util::CheckRankState;
using testing_util::MakeRankState;
using testing_util::Pattern;
using testing_util::RankState;
using testing_util::TempDir;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// A rank of a world that must not be talked to: every collective fails and
// is counted, so a test can prove rank-local mode never calls one.
class NoCollectives : public Communicator {
 public:
  NoCollectives(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view kind() const override { return "none"; }
  int calls = 0;

  absl::Status Barrier() override { return Called(); }
  absl::Status Broadcast(std::string&, int) override { return Called(); }
  absl::StatusOr<std::vector<std::string>> Gather(std::string_view, int) override {
    return Called();
  }
  absl::StatusOr<std::vector<std::string>> AllGather(std::string_view) override {
    return Called();
  }
  absl::StatusOr<std::string> Scatter(const std::vector<std::string>&, int) override {
    return Called();
  }
  absl::Status AllReduce(std::span<int64_t>, ReduceOp) override { return Called(); }
  absl::Status BroadcastBytes(std::span<std::byte>, int) override { return Called(); }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int, int) override {
    return Called();
  }

 private:
  absl::Status Called() {
    ++calls;
    return absl::FailedPreconditionError("rank-local mode called a collective");
  }
  int rank_, size_;
};

constexpr int kWorld = 4;

// Saves rank-locally, every rank with the same given save id (new for each
// call), so that no rank needs a collective.
absl::Status SaveRankLocal(const std::string& dir, Pattern p, int64_t step,
                           bool overwrite = false) {
  static int saves = 0;
  const std::string id = absl::StrCat("test-", step, "-", ++saves);
  for (int r = 0; r < kWorld; ++r) {
    NoCollectives comm(r, kWorld);
    RankState s = MakeRankState(p, kWorld, r, step, false);
    SaveOptions o;
    o.comm = &comm;
    o.rank_local = true;
    o.overwrite = overwrite;
    o.save_id = id;
    CAIRN_RETURN_IF_ERROR(Save(s.sd, dir, o).status());
    if (comm.calls != 0) return absl::InternalError("a collective was called");
  }
  return absl::OkStatus();
}

// Loads rank `r` of `world` in rank-local mode under `p` and checks it.
absl::Status LoadOneRankLocal(const std::string& dir, Pattern p, int world,
                              int r, int64_t step) {
  NoCollectives comm(r, world);
  RankState s = MakeRankState(p, world, r, step, true, r % kWorld);
  LoadOptions o;
  o.comm = &comm;
  o.rank_local = true;
  CAIRN_RETURN_IF_ERROR(Load(s.sd, dir, o).status());
  if (comm.calls != 0) return absl::InternalError("a collective was called");
  if (std::string bad = CheckRankState(s, step); !bad.empty()) {
    return absl::InternalError(bad);
  }
  return absl::OkStatus();
}

// Loads with `world` in-process ranks in global mode and checks every byte.
absl::Status LoadGlobal(const std::string& dir, Pattern p, int world,
                        int64_t step) {
  std::vector<absl::Status> st = RunInProcess(world, [&](Communicator& comm) {
    RankState s = MakeRankState(p, world, comm.rank(), step, true,
                                comm.rank() % kWorld);
    LoadOptions o;
    o.comm = &comm;
    CAIRN_RETURN_IF_ERROR(Load(s.sd, dir, o).status());
    if (std::string bad = CheckRankState(s, step); !bad.empty()) {
      return absl::InternalError(bad);
    }
    return absl::OkStatus();
  });
  for (const absl::Status& s : st) CAIRN_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

TEST(RankLocalTest, SavesAndLoadsWithoutAnyCollective) {
  TempDir tmp;
  ASSERT_TRUE(SaveRankLocal(tmp.path(), Pattern::kRows, 3).ok());
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(std::filesystem::exists(
        tmp.Sub(absl::StrFormat("rank-%05d/metadata.json", r))));
  }
  // No global commit: a global load refuses it.
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("metadata.json")));
  EXPECT_EQ(ReadMetadata(tmp.path()).status().code(), absl::StatusCode::kNotFound);
  for (int r = 0; r < kWorld; ++r) {
    absl::Status s = LoadOneRankLocal(tmp.path(), Pattern::kRows, kWorld, r, 3);
    EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
  }
}

TEST(RankLocalTest, MergedCheckpointLoadsWithOtherWorldSizes) {
  TempDir tmp;
  for (Pattern p : {Pattern::kCyclic, Pattern::kReplicated}) {
    const std::string dir = tmp.Sub(testing_util::PatternName(p));
    ASSERT_TRUE(SaveRankLocal(dir, p, 5).ok());
    absl::StatusOr<MergeResult> merged = Merge(dir);
    ASSERT_TRUE(merged.ok()) << merged.status();
    EXPECT_EQ(merged->ranks, kWorld);
    // Replicas were stored by every rank; the merge keeps one of each.
    if (p == Pattern::kReplicated) {
      EXPECT_GT(merged->duplicates, 0u);
    }
    absl::StatusOr<Metadata> md = ReadMetadata(dir);
    ASSERT_TRUE(md.ok()) << md.status();
    EXPECT_EQ(md->rank, -1);
    EXPECT_EQ(md->world_size, kWorld);
    EXPECT_EQ(md->version, kFormatVersion);
    EXPECT_THAT(md->tensors.at("model.wq").chunks[0].location.file,
                HasSubstr("rank-0000"));
    // The rank folders' and the merged metadata carry their checksums.
    for (const std::string name :
         {"metadata.json", "rank-00000/metadata.json"}) {
      EXPECT_TRUE(testing_util::ReadFile(dir + "/" + name)
                      .starts_with(internal_format::kChecksumKeyPrefix))
          << name;
    }
    EXPECT_TRUE(LoadGlobal(dir, Pattern::kCols, 2, 5).ok());
    EXPECT_TRUE(LoadGlobal(dir, Pattern::kBlocks, 3, 5).ok());
    // Merging twice needs overwrite.
    EXPECT_EQ(Merge(dir).status().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_TRUE(Merge(dir, {.overwrite = true}).ok());
  }
}

// A rank that holds none of a tensor writes it with an empty box; the
// merged checkpoint lists only the chunks with bytes, as a global save of
// the same state does (found by fuzz/reshard_fuzz.cc).
TEST(RankLocalTest, MergeDropsTheEmptyBoxOfARankThatHoldsNothing) {
  TempDir tmp;
  std::vector<float> rows(4 * 3);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
  for (bool rank_local : {true, false}) {
    const std::string dir = tmp.Sub(rank_local ? "local" : "global");
    std::vector<absl::Status> st = RunInProcess(2, [&](Communicator& comm) {
      std::vector<Shard> shards;
      if (comm.rank() == 0) {
        shards.push_back({Box{{0, 0}, {4, 3}},
                          TensorView(rows.data(), DType::kF32, {4, 3})});
      }
      StateDict sd;
      sd["t"] = ShardedTensor(DType::kF32, {4, 3}, shards);
      SaveOptions o;
      o.comm = &comm;
      o.rank_local = rank_local;
      return Save(sd, dir, o).status();
    });
    for (const absl::Status& s : st) ASSERT_TRUE(s.ok()) << s;
    if (rank_local) {
      absl::StatusOr<MergeResult> merged = Merge(dir);
      ASSERT_TRUE(merged.ok()) << merged.status();
      EXPECT_EQ(merged->duplicates, 0u);
    }
    absl::StatusOr<Metadata> md = ReadMetadata(dir);
    ASSERT_TRUE(md.ok()) << md.status();
    const std::vector<ChunkMetadata>& chunks = md->tensors.at("t").chunks;
    ASSERT_EQ(chunks.size(), 1u) << dir;
    EXPECT_EQ(chunks[0].box, (Box{{0, 0}, {4, 3}}));
    EXPECT_EQ(chunks[0].location.nbytes, 48u);
  }
}

TEST(RankLocalTest, MissingRankFolderIsAClearError) {
  TempDir tmp;
  ASSERT_TRUE(SaveRankLocal(tmp.path(), Pattern::kRows, 1).ok());
  std::filesystem::remove_all(tmp.Sub("rank-00002"));
  absl::Status s = LoadOneRankLocal(tmp.path(), Pattern::kRows, kWorld, 2, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(s), HasSubstr("rank-local load of rank 2"));
  EXPECT_THAT(Msg(s), HasSubstr("rank-00002/metadata.json"));
  // The others still load.
  EXPECT_TRUE(LoadOneRankLocal(tmp.path(), Pattern::kRows, kWorld, 1, 1).ok());
  absl::Status m = Merge(tmp.path()).status();
  EXPECT_EQ(m.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(m), HasSubstr("rank-00002/metadata.json is missing"));
}

TEST(RankLocalTest, AnotherShardingNeedsAMerge) {
  TempDir tmp;
  ASSERT_TRUE(SaveRankLocal(tmp.path(), Pattern::kRows, 1).ok());
  absl::Status s = LoadOneRankLocal(tmp.path(), Pattern::kCols, kWorld, 1, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(s), HasSubstr("only partly in the checkpoint"));
  EXPECT_THAT(Msg(s), HasSubstr("cairn merge"));
  // A rank with no folder of its own falls back to the global metadata,
  // once there is one.
  EXPECT_EQ(LoadOneRankLocal(tmp.path(), Pattern::kReplicated, kWorld + 1, kWorld, 1).code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(Merge(tmp.path()).ok());
  EXPECT_TRUE(LoadOneRankLocal(tmp.path(), Pattern::kReplicated, kWorld + 1, kWorld, 1).ok());
}

TEST(RankLocalTest, OverwriteUncommitsTheMergedCheckpointFirst) {
  TempDir tmp;
  ASSERT_TRUE(SaveRankLocal(tmp.path(), Pattern::kRows, 1).ok());
  ASSERT_TRUE(Merge(tmp.path()).ok());
  absl::Status again = SaveRankLocal(tmp.path(), Pattern::kRows, 2);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;
  ASSERT_TRUE(SaveRankLocal(tmp.path(), Pattern::kRows, 2, /*overwrite=*/true).ok());
  // The merged metadata pointed into folders that were rewritten: gone.
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("metadata.json")));
  EXPECT_TRUE(LoadOneRankLocal(tmp.path(), Pattern::kRows, kWorld, 3, 2).ok());
}

TEST(RankLocalTest, MergeRejectsReplicasThatDiffer) {
  TempDir tmp;
  for (int r = 0; r < 2; ++r) {
    NoCollectives comm(r, 2);
    StateDict sd;
    sd["config"] = Object{r == 0 ? "lr=0.1" : "lr=0.2"};
    SaveOptions o;
    o.comm = &comm;
    o.rank_local = true;
    o.save_id = "one-save";
    ASSERT_TRUE(Save(sd, tmp.path(), o).ok());
  }
  absl::Status m = Merge(tmp.path()).status();
  EXPECT_EQ(m.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(m), HasSubstr("object config is stored by rank 0 and rank 1"));
}

// A rank folder whose metadata (resealed) points one object at another's
// bytes, size and CRC32C: the merge refuses it, naming both, rather than
// commit a checkpoint that loads the wrong bytes.
TEST(RankLocalTest, MergeRefusesObjectsThatShareBytes) {
  TempDir tmp;
  for (int r = 0; r < 2; ++r) {
    NoCollectives comm(r, 2);
    StateDict sd;
    sd[absl::StrCat("a", r)] = Object{"first!"};
    sd[absl::StrCat("b", r)] = Object{"second"};
    SaveOptions o;
    o.comm = &comm;
    o.rank_local = true;
    o.save_id = "one-save";
    ASSERT_TRUE(Save(sd, tmp.path(), o).ok());
  }
  const std::string path = tmp.Sub("rank-00001/metadata.json");
  nlohmann::json j = nlohmann::json::parse(testing_util::ReadFile(path));
  j["objects"]["b1"] = j["objects"]["a1"];
  testing_util::WriteFile(path, testing_util::Resealed(j.dump()));
  absl::Status m = Merge(tmp.path()).status();
  EXPECT_EQ(m.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(m), HasSubstr("object \"b1\""));
  EXPECT_THAT(Msg(m), HasSubstr("shares bytes with object \"a1\""));
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("metadata.json")));
}

// Overwriting with fewer ranks un-commits the extra ranks' folders, so the
// merge sees one save, not two.
TEST(RankLocalTest, SmallerOverwriteUncommitsExtraRankFolders) {
  TempDir tmp;
  ASSERT_TRUE(SaveRankLocal(tmp.path(), Pattern::kRows, 1).ok());  // 4 ranks
  for (int r = 0; r < 2; ++r) {
    NoCollectives comm(r, 2);
    RankState s = MakeRankState(Pattern::kRows, 2, r, 2, false);
    SaveOptions o;
    o.comm = &comm;
    o.rank_local = true;
    o.save_id = "smaller";
    // Without overwrite, the old folders are refused.
    absl::Status saved = Save(s.sd, tmp.path(), o).status();
    EXPECT_EQ(saved.code(), absl::StatusCode::kAlreadyExists) << saved;
    o.overwrite = true;
    saved = Save(s.sd, tmp.path(), o).status();
    ASSERT_TRUE(saved.ok()) << saved;
  }
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("rank-00002/metadata.json")));
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("rank-00003/metadata.json")));
  absl::StatusOr<MergeResult> merged = Merge(tmp.path());
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->ranks, 2);
  EXPECT_TRUE(LoadGlobal(tmp.path(), Pattern::kCols, 2, 2).ok());
}

// A folder whose metadata names another rank (copied or renamed by hand)
// is refused by both the rank-local load and the merge.
TEST(RankLocalTest, FolderOfAnotherRankIsRefused) {
  TempDir tmp;
  ASSERT_TRUE(SaveRankLocal(tmp.path(), Pattern::kRows, 1).ok());
  const std::string path = tmp.Sub("rank-00001/metadata.json");
  std::string text = testing_util::ReadFile(path);
  const size_t at = text.find("\"rank\":1");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 8, "\"rank\":2");
  testing_util::WriteFile(path, testing_util::Resealed(text));
  absl::Status load = LoadOneRankLocal(tmp.path(), Pattern::kRows, kWorld, 1, 1);
  EXPECT_EQ(load.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(load), HasSubstr("written by rank 2, not 1"));
  absl::Status merge = Merge(tmp.path()).status();
  EXPECT_EQ(merge.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(merge), HasSubstr("rank-00001/metadata.json says it was written by rank 2"));
}

// Folders of two saves side by side (ranks 0-2 from a second save, rank 3
// left from the first, as after a crash): each save's id is in every folder,
// so Merge and rank 3's rank-local load refuse the mix instead of loading
// mixed values.
TEST(RankLocalTest, FoldersOfDifferentSavesAreNeverMixed) {
  TempDir tmp;
  ASSERT_TRUE(SaveRankLocal(tmp.Sub("first"), Pattern::kRows, 3).ok());
  ASSERT_TRUE(SaveRankLocal(tmp.Sub("second"), Pattern::kRows, 4).ok());
  // The second save's folders, but rank 3's from the first.
  std::filesystem::remove_all(tmp.Sub("second/rank-00003"));
  std::filesystem::copy(tmp.Sub("first/rank-00003"), tmp.Sub("second/rank-00003"));
  absl::Status stale = LoadOneRankLocal(tmp.Sub("second"), Pattern::kRows,
                                        kWorld, 3, 3);
  EXPECT_EQ(stale.code(), absl::StatusCode::kDataLoss) << stale;
  EXPECT_THAT(Msg(stale), HasSubstr("come from different saves"));
  for (int r = 0; r < 3; ++r) {
    absl::Status s = LoadOneRankLocal(tmp.Sub("second"), Pattern::kRows,
                                      kWorld, r, 4);
    EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
  }
  absl::StatusOr<MergeResult> merged = Merge(tmp.Sub("second"));
  ASSERT_FALSE(merged.ok());
  EXPECT_EQ(merged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(merged.status()), HasSubstr("different saves"));
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("second/metadata.json")));
  // Unmixed, the same folders merge.
  EXPECT_TRUE(Merge(tmp.Sub("first")).ok());
}

// Without a given save id, rank 0's fresh one reaches every folder (the
// rank-local save's one collective).
TEST(RankLocalTest, RankZerosSaveIdReachesEveryFolder) {
  TempDir tmp;
  std::vector<absl::Status> st = RunInProcess(kWorld, [&](Communicator& comm) {
    RankState s = MakeRankState(Pattern::kRows, kWorld, comm.rank(), 5, false);
    SaveOptions o;
    o.comm = &comm;
    o.rank_local = true;
    return Save(s.sd, tmp.path(), o).status();
  });
  for (const absl::Status& s : st) ASSERT_TRUE(s.ok()) << s;
  std::string id;
  for (int r = 0; r < kWorld; ++r) {
    nlohmann::json j = nlohmann::json::parse(testing_util::ReadFile(
        tmp.Sub(absl::StrFormat("rank-%05d/metadata.json", r))));
    ASSERT_TRUE(j.contains("save_id")) << r;
    if (r == 0) id = j["save_id"];
    EXPECT_EQ(j["save_id"], id) << r;
  }
  EXPECT_EQ(id.size(), 16u);
  EXPECT_TRUE(Merge(tmp.path()).ok());
}

}  // namespace
}  // namespace cairn
