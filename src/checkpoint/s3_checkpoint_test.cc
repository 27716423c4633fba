// Checkpoints on object storage, against a real S3-compatible server
// (moto, storage/s3/moto_test_util.h): round trips on 4 ranks with
// resharded loads, multipart files, async saves, the conditional commit,
// and damage found by the CRC32Cs.
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/async_save.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/manager.h"
#include "cairn/storage.h"
#include "checkpoint/dist_test_util.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/s3/moto_test_util.h"
#include "storage/s3/s3_client.h"

namespace cairn {
namespace {

using ::testing::HasSubstr;
using testing_util::CheckRankState;
using testing_util::MakeRankState;
using testing_util::Pattern;
using testing_util::RankState;

constexpr char kBucket[] = "cairn-checkpoints";

// A fresh prefix per test, and options that reach the test server.
class S3CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CAIRN_MOTO_OR_SKIP(server);
    auto client = server->Client(kBucket);
    ASSERT_TRUE(client.ok()) << client.status();
    static std::atomic<int> counter{0};
    root_ = absl::StrFormat("s3://%s/%d-%d", kBucket, ::getpid(),
                            counter.fetch_add(1));
    s3_ = server->Options();
  }

  absl::StatusOr<std::unique_ptr<Storage>> Open(const std::string& url) {
    return Storage::Open(url, StorageOptions{.s3 = s3_});
  }

  absl::Status SaveRanks(const std::string& url, Pattern p, int world,
                         int64_t step, bool overwrite = false,
                         const std::string& base = "",
                         int* chunks_reused = nullptr) {
    std::atomic<int> reused{0};
    std::vector<absl::Status> st = RunInProcess(world, [&](Communicator& comm) {
      RankState s = MakeRankState(p, world, comm.rank(), step, false);
      SaveOptions o;
      o.comm = &comm;
      o.s3 = s3_;
      o.overwrite = overwrite;
      o.base = base;
      absl::StatusOr<SaveResult> r = Save(s.sd, url, o);
      if (r.ok()) reused += r->chunks_reused;
      return r.status();
    });
    if (chunks_reused != nullptr) *chunks_reused = reused;
    for (const absl::Status& s : st) CAIRN_RETURN_IF_ERROR(s);
    return absl::OkStatus();
  }

  absl::Status LoadRanksAndCheck(const std::string& url, Pattern p, int world,
                                 int saved_world, int64_t step) {
    std::vector<absl::Status> st = RunInProcess(world, [&](Communicator& comm) {
      const int r = comm.rank();
      RankState s = MakeRankState(p, world, r, step, /*poison=*/true,
                                  r % saved_world);
      LoadOptions o;
      o.comm = &comm;
      o.s3 = s3_;
      CAIRN_RETURN_IF_ERROR(Load(s.sd, url, o).status());
      if (std::string bad = CheckRankState(s, step); !bad.empty()) {
        return absl::InternalError(absl::StrCat("rank ", r, ": ", bad));
      }
      return absl::OkStatus();
    });
    for (const absl::Status& s : st) CAIRN_RETURN_IF_ERROR(s);
    return absl::OkStatus();
  }

  std::string root_;
  S3Options s3_;
};

TEST_F(S3CheckpointTest, FourRanksSaveAndReshardedLoadsAreBitExact) {
  const std::string url = root_ + "/ckpt";
  ASSERT_TRUE(SaveRanks(url, Pattern::kRows, 4, 7).ok());
  for (auto [pattern, world] :
       {std::pair{Pattern::kCols, 3}, std::pair{Pattern::kBlocks, 4},
        std::pair{Pattern::kReplicated, 1}, std::pair{Pattern::kCyclic, 2}}) {
    absl::Status s = LoadRanksAndCheck(url, pattern, world, 4, 7);
    EXPECT_TRUE(s.ok()) << testing_util::PatternName(pattern) << " on "
                        << world << ": " << s;
  }
  // Committed: metadata.json and the data objects, and no lock left.
  auto storage = Open(url);
  ASSERT_TRUE(storage.ok()) << storage.status();
  auto names = (*storage)->List();
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_THAT(*names, ::testing::Contains("metadata.json"));
  EXPECT_THAT(*names, ::testing::Not(::testing::Contains("save.lock")));
}

// An incremental checkpoint on object storage: its base is a sibling
// prefix, and loads read the unchanged chunks there.
TEST_F(S3CheckpointTest, IncrementalSavesReferenceTheirBasePrefix) {
  const std::string one = root_ + "/step-1", two = root_ + "/step-2";
  ASSERT_TRUE(SaveRanks(one, Pattern::kRows, 2, 5).ok());
  int reused = 0;
  absl::Status saved =
      SaveRanks(two, Pattern::kRows, 2, 5, false, one, &reused);
  ASSERT_TRUE(saved.ok()) << saved;
  EXPECT_GT(reused, 0);
  auto storage = Open(two);
  ASSERT_TRUE(storage.ok());
  absl::StatusOr<std::string> text =
      (*storage)->ReadAll("metadata.json", uint64_t{1} << 20);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_THAT(*text, HasSubstr("\"url\":\"../step-1\""));
  EXPECT_THAT(*text, HasSubstr("\"file\":\"../step-1/data-"));
  absl::Status loaded = LoadRanksAndCheck(two, Pattern::kCols, 3, 2, 5);
  EXPECT_TRUE(loaded.ok()) << loaded;
}

TEST_F(S3CheckpointTest, CommitNeverReplacesACommittedCheckpoint) {
  const std::string url = root_ + "/ckpt";
  ASSERT_TRUE(SaveRanks(url, Pattern::kRows, 2, 1).ok());
  absl::Status again = SaveRanks(url, Pattern::kRows, 2, 2);
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;
  EXPECT_TRUE(LoadRanksAndCheck(url, Pattern::kCols, 2, 2, 1).ok());
  // With overwrite, the new step replaces it and the old data goes.
  ASSERT_TRUE(SaveRanks(url, Pattern::kCols, 3, 2, /*overwrite=*/true).ok());
  EXPECT_TRUE(LoadRanksAndCheck(url, Pattern::kRows, 2, 3, 2).ok());
  auto storage = Open(url);
  ASSERT_TRUE(storage.ok());
  auto names = (*storage)->List();
  ASSERT_TRUE(names.ok());
  int data_files = 0;
  for (const std::string& n : *names) data_files += n.starts_with("data-");
  EXPECT_LE(data_files, 3) << ::testing::PrintToString(*names);
}

// A tensor larger than several parts: the data object is a multipart
// upload, and a column-split load reads ranges of it.
TEST_F(S3CheckpointTest, MultipartFilesRoundTrip) {
  const std::string url = root_ + "/big";
  const int64_t rows = 2048, cols = 2560;  // 20 MiB of f32
  std::vector<float> values(rows * cols);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 100003) * 0.5f;
  {
    StateDict sd;
    sd["w"] = TensorView(values.data(), DType::kF32, {rows, cols});
    SaveOptions o;
    o.s3 = s3_;
    ASSERT_TRUE(Save(sd, url, o).ok());
  }
  std::vector<absl::Status> st = RunInProcess(2, [&](Communicator& comm) {
    const int64_t c0 = comm.rank() * cols / 2, c1 = (comm.rank() + 1) * cols / 2;
    std::vector<float> mine(rows * (c1 - c0), -1.0f);
    StateDict sd;
    sd["w"] = ShardedTensor(
        DType::kF32, {rows, cols},
        {Shard{Box{{0, c0}, {rows, c1 - c0}},
               TensorView(mine.data(), DType::kF32, {rows, c1 - c0})}});
    LoadOptions o;
    o.comm = &comm;
    o.s3 = s3_;
    CAIRN_RETURN_IF_ERROR(Load(sd, url, o).status());
    for (int64_t r = 0; r < rows; ++r) {
      if (std::memcmp(&mine[r * (c1 - c0)], &values[r * cols + c0],
                      (c1 - c0) * sizeof(float)) != 0) {
        return absl::InternalError(absl::StrCat("row ", r, " differs"));
      }
    }
    return absl::OkStatus();
  });
  for (const absl::Status& s : st) EXPECT_TRUE(s.ok()) << s;
}

TEST_F(S3CheckpointTest, AsyncSaveCommitsTheStagedValues) {
  const std::string url = root_ + "/async";
  auto saver = AsyncSaver::Create(nullptr);
  ASSERT_TRUE(saver.ok()) << saver.status();
  RankState s = MakeRankState(Pattern::kReplicated, 1, 0, 5, false);
  SaveOptions o;
  o.s3 = s3_;
  auto handle = (*saver)->Save(s.sd, url, o);
  ASSERT_TRUE(handle.ok()) << handle.status();
  // Changing the values after staging must not reach the checkpoint.
  RankState later = MakeRankState(Pattern::kReplicated, 1, 0, 6, false);
  for (size_t i = 0; i < s.buffers.size(); ++i) {
    std::memcpy(s.buffers[i].data(), later.buffers[i].data(),
                s.buffers[i].nbytes());
  }
  ASSERT_TRUE((*handle)->Wait().ok());
  EXPECT_TRUE(LoadRanksAndCheck(url, Pattern::kRows, 2, 1, 5).ok());
}

TEST_F(S3CheckpointTest, DamagedObjectFailsItsChecksumOnLoad) {
  const std::string url = root_ + "/damaged";
  ASSERT_TRUE(SaveRanks(url, Pattern::kRows, 2, 3).ok());
  auto storage = Open(url);
  ASSERT_TRUE(storage.ok());
  auto names = (*storage)->List();
  ASSERT_TRUE(names.ok());
  // One byte in the middle of each data object's tensor bytes (past the
  // safetensors header, whose length is its first 8 bytes).
  int damaged_files = 0;
  for (const std::string& name : *names) {
    if (!name.starts_with("data-")) continue;
    auto bytes = (*storage)->ReadAll(name, 1 << 30);
    ASSERT_TRUE(bytes.ok());
    std::string damaged = *bytes;
    uint64_t header = 0;
    std::memcpy(&header, damaged.data(), 8);
    ASSERT_LT(8 + header, damaged.size());
    damaged[8 + header + (damaged.size() - 8 - header) / 2] ^= 0x40;
    ASSERT_TRUE((*storage)->WriteAtomically(name, damaged).ok());
    ++damaged_files;
  }
  ASSERT_EQ(damaged_files, 2);
  absl::Status s = LoadRanksAndCheck(url, Pattern::kReplicated, 1, 2, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("crc32c mismatch"));
}

TEST_F(S3CheckpointTest, PrefixWithoutMetadataIsNotACheckpoint) {
  const std::string url = root_ + "/empty";
  RankState s = MakeRankState(Pattern::kReplicated, 1, 0, 1, true);
  LoadOptions o;
  o.s3 = s3_;
  absl::StatusOr<LoadResult> r = Load(s.sd, url, o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr(url));
}

TEST_F(S3CheckpointTest, ManagerKeepsStepsRestoresAndCleansUp) {
  const std::string root = root_ + "/run";
  // A crash leftover: a step prefix with data and a stale lock but no
  // metadata.json.
  {
    auto storage = Open(root);
    ASSERT_TRUE(storage.ok());
    ASSERT_TRUE((*storage)->WriteAtomically("step-0000000001/data-x.safetensors", "x").ok());
    ASSERT_TRUE((*storage)->WriteAtomically("step-0000000001/save.lock", "dead").ok());
  }
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    std::vector<absl::Status> st = RunInProcess(2, [&](Communicator& comm) {
      ManagerOptions mo;
      mo.keep_last = 2;
      mo.async = async;
      mo.save_options.s3 = s3_;
      mo.load_options.s3 = s3_;
      CAIRN_ASSIGN_OR_RETURN(auto manager,
                             CheckpointManager::Create(root, &comm, mo));
      const int64_t first = async ? 10 : 2;
      for (int64_t step = first; step < first + 4; ++step) {
        RankState s = MakeRankState(Pattern::kRows, 2, comm.rank(), step, false);
        CAIRN_RETURN_IF_ERROR(manager->Save(step, s.sd).status());
      }
      CAIRN_RETURN_IF_ERROR(manager->Wait());
      // Retention runs on rank 0, so only its view is settled here.
      CAIRN_ASSIGN_OR_RETURN(std::vector<int64_t> steps, manager->Steps());
      const std::vector<int64_t> expected = {first + 2, first + 3};
      if (comm.rank() == 0 && steps != expected) {
        return absl::InternalError(absl::StrCat(
            "steps ", ::testing::PrintToString(steps)));
      }
      RankState s = MakeRankState(Pattern::kCols, 2, comm.rank(), 0, true);
      CAIRN_RETURN_IF_ERROR(manager->Restore(s.sd).status());
      if (std::string bad = CheckRankState(s, first + 3); !bad.empty()) {
        return absl::InternalError(bad);
      }
      return absl::OkStatus();
    });
    for (const absl::Status& s : st) EXPECT_TRUE(s.ok()) << s;
  }
  // Only the kept steps' objects remain; the leftover went.
  auto storage = Open(root);
  ASSERT_TRUE(storage.ok());
  auto names = (*storage)->List();
  ASSERT_TRUE(names.ok());
  for (const std::string& n : *names) {
    EXPECT_TRUE(n.starts_with("step-0000000012/") ||
                n.starts_with("step-0000000013/"))
        << n;
  }
}

// A column-split load needs a part of every chunk: with the block cache a
// rank reads each file in a few block requests, not one per chunk.
TEST_F(S3CheckpointTest, ColumnSplitLoadsCoalesceSmallReadsIntoBlocks) {
  const std::string url = root_ + "/blocks";
  ASSERT_TRUE(SaveRanks(url, Pattern::kRows, 4, 2).ok());
  auto requests_of_load = [&](uint64_t block_bytes) -> uint64_t {
    s3_.read_block_bytes = block_bytes;
    const uint64_t before =
        internal_s3::ProcessS3Counters().requests.load();
    EXPECT_TRUE(LoadRanksAndCheck(url, Pattern::kCols, 3, 4, 2).ok());
    return internal_s3::ProcessS3Counters().requests.load() - before;
  };
  const uint64_t uncached = requests_of_load(0);
  const uint64_t cached = requests_of_load(4 << 20);
  EXPECT_LT(2 * cached, uncached) << cached << " vs " << uncached;
}

}  // namespace
}  // namespace cairn
