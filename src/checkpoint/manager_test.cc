// CheckpointManager: step folders, retention, restore, async saves, crash
// leftovers, several ranks.
#include "cairn/manager.h"

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/test_util.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using ::testing::ElementsAre;
using testing_util::TempDir;

// A state whose values derive from the step.
struct State {
  Tensor w = *Tensor::Empty(DType::kF32, {64, 16});
  StateDict sd;
  State() {
    sd["w"] = w;
    sd["step"] = int64_t{0};
  }
  void Set(int64_t step) {
    float* f = static_cast<float*>(w.data());
    for (int i = 0; i < 64 * 16; ++i) f[i] = static_cast<float>(step * 10000 + i);
    *sd["step"].scalar() = step;
  }
  bool Holds(int64_t step) const {
    const float* f = static_cast<const float*>(w.data());
    for (int i = 0; i < 64 * 16; ++i) {
      if (f[i] != static_cast<float>(step * 10000 + i)) return false;
    }
    return std::get<int64_t>(*sd.Find("step")->scalar()) == step;
  }
};

TEST(ManagerTest, RetentionKeepsLastNAndEveryKth) {
  TempDir tmp;
  ManagerOptions options;
  options.keep_last = 3;
  options.keep_every = 4;
  absl::StatusOr<std::unique_ptr<CheckpointManager>> m =
      CheckpointManager::Create(tmp.path(), nullptr, options);
  ASSERT_TRUE(m.ok()) << m.status();
  State s;
  for (int64_t step = 1; step <= 10; ++step) {
    s.Set(step);
    ASSERT_TRUE((*m)->Save(step, s.sd).ok());
    s.Set(-1);  // the loop moves on at once; the save holds step's values
  }
  ASSERT_TRUE((*m)->Wait().ok());
  EXPECT_THAT(*(*m)->Steps(), ElementsAre(4, 8, 9, 10));
  EXPECT_EQ(*(*m)->LatestStep(), std::optional<int64_t>(10));
  State back;
  ASSERT_TRUE((*m)->Restore(back.sd).ok());
  EXPECT_TRUE(back.Holds(10));
  ASSERT_TRUE((*m)->Restore(back.sd, 4).ok());
  EXPECT_TRUE(back.Holds(4));
}

// A file:// root is percent-decoded as Storage::Open decodes it, so that
// its folders are listed, created and pruned where the saves wrote them
// (a root read undecoded would list nothing, and prune a folder spelled
// "%20" if one stood there).
TEST(ManagerTest, FileUrlRootsArePercentDecoded) {
  TempDir tmp;
  const std::string dir = tmp.Sub("a b");
  const std::string decoy = tmp.Sub("a%20b");
  std::filesystem::create_directories(decoy + "/step-0000000001");
  ManagerOptions options;
  options.keep_last = 2;
  absl::StatusOr<std::unique_ptr<CheckpointManager>> m =
      CheckpointManager::Create(
          absl::StrCat("file://", tmp.path(), "/a%20b"), nullptr, options);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(std::filesystem::is_directory(dir));
  State s;
  for (int64_t step = 1; step <= 3; ++step) {
    s.Set(step);
    ASSERT_TRUE((*m)->Save(step, s.sd).ok());
  }
  ASSERT_TRUE((*m)->Wait().ok());
  EXPECT_THAT(*(*m)->Steps(), ElementsAre(2, 3));
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-0000000001"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/step-0000000003"));
  // The folder whose name is the URL's undecoded spelling is untouched.
  EXPECT_TRUE(std::filesystem::exists(decoy + "/step-0000000001"));
  State back;
  ASSERT_TRUE((*m)->Restore(back.sd).ok());
  EXPECT_TRUE(back.Holds(3));
}

TEST(ManagerTest, CrashLeftoversAreIgnoredAndCleaned) {
  TempDir tmp;
  absl::StatusOr<std::unique_ptr<CheckpointManager>> m =
      CheckpointManager::Create(tmp.path(), nullptr);
  ASSERT_TRUE(m.ok());
  State s;
  s.Set(1);
  ASSERT_TRUE((*m)->Save(1, s.sd).ok());
  ASSERT_TRUE((*m)->Wait().ok());
  // What a killed save leaves: a step folder with data but no metadata.json.
  const std::string partial = (*m)->StepDir(7);
  std::filesystem::create_directories(partial);
  testing_util::WriteFile(partial + "/data-00000.safetensors", "half a file");
  EXPECT_THAT(*(*m)->Steps(), ElementsAre(1));
  EXPECT_EQ(*(*m)->LatestStep(), std::optional<int64_t>(1));
  ASSERT_TRUE((*m)->Wait().ok());  // retention runs
  EXPECT_FALSE(std::filesystem::exists(partial));
  EXPECT_TRUE(std::filesystem::exists((*m)->StepDir(1) + "/metadata.json"));
}

TEST(ManagerTest, NothingToRestoreAndCommittedStepsAreNotReplaced) {
  TempDir tmp;
  ManagerOptions options;
  options.async = false;
  absl::StatusOr<std::unique_ptr<CheckpointManager>> m =
      CheckpointManager::Create(tmp.path(), nullptr, options);
  ASSERT_TRUE(m.ok());
  State s;
  EXPECT_EQ((*m)->Restore(s.sd).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*(*m)->LatestStep(), std::nullopt);
  s.Set(5);
  ASSERT_TRUE((*m)->Save(5, s.sd).ok());
  EXPECT_EQ((*m)->Save(5, s.sd).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ((*m)->Save(-1, s.sd).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ManagerOptions{}.keep_last, 3);
}

// With keep_last 1 the newest committed step is the only one, and never
// deleted while the next is being written.
TEST(ManagerTest, NewestCommittedStepSurvivesWhileTheNextIsWritten) {
  TempDir tmp;
  ManagerOptions options;
  options.keep_last = 1;
  absl::StatusOr<std::unique_ptr<CheckpointManager>> m =
      CheckpointManager::Create(tmp.path(), nullptr, options);
  ASSERT_TRUE(m.ok());
  State s;
  for (int64_t step = 1; step <= 6; ++step) {
    s.Set(step);
    ASSERT_TRUE((*m)->Save(step, s.sd).ok());
    // Whatever is committed right now includes a loadable newest step.
    absl::StatusOr<std::optional<int64_t>> latest = (*m)->LatestStep();
    ASSERT_TRUE(latest.ok());
    if (step > 1) {
      ASSERT_TRUE(latest->has_value()) << step;
    }
  }
  ASSERT_TRUE((*m)->Wait().ok());
  EXPECT_THAT(*(*m)->Steps(), ElementsAre(6));
}

TEST(ManagerTest, SeveralRanksSaveAndRestore) {
  TempDir tmp;
  std::vector<absl::Status> st = RunInProcess(2, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    Tensor mine = *Tensor::Empty(DType::kF32, {8, 4});
    StateDict sd;
    sd["w"] = ShardedTensor(DType::kF32, {16, 4}, {Shard{Box{{8 * r, 0}, {8, 4}}, mine.view()}});
    CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointManager> m,
                           CheckpointManager::Create(tmp.path(), &comm));
    for (int64_t step = 1; step <= 4; ++step) {
      static_cast<float*>(mine.data())[0] = static_cast<float>(step * 10 + r);
      CAIRN_RETURN_IF_ERROR(m->Save(step, sd).status());
    }
    CAIRN_RETURN_IF_ERROR(m->Wait());
    static_cast<float*>(mine.data())[0] = -1;
    CAIRN_ASSIGN_OR_RETURN(LoadResult loaded, m->Restore(sd));
    if (static_cast<float*>(mine.data())[0] != static_cast<float>(40 + r)) {
      return absl::InternalError("restored the wrong step");
    }
    return absl::OkStatus();
  });
  for (const absl::Status& s : st) EXPECT_TRUE(s.ok()) << s;
}

// A rank-local step has no top-level metadata.json, so retention would take
// every one for a crash leftover and delete it: the option is refused at
// Create, saying why, and nothing is saved or deleted.
TEST(ManagerTest, RankLocalSavesAreRefusedClearly) {
  TempDir tmp;
  ManagerOptions options;
  options.save_options.rank_local = true;
  absl::StatusOr<std::unique_ptr<CheckpointManager>> m =
      CheckpointManager::Create(tmp.path(), nullptr, options);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), ::testing::HasSubstr("rank_local"));
}

}  // namespace
}  // namespace cairn
