// AsyncSaver: returns after staging, the checkpoint holds the values from
// before later changes, at most max_in_flight saves, flat staging memory,
// errors through the handle or the next Save, and background collectives
// that never mix with the application's.
#include "cairn/async_save.h"

#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/kv_table.h"
#include "checkpoint/test_util.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using ::testing::HasSubstr;
using testing_util::TempDir;

Tensor Filled(Shape shape, float v) {
  Tensor t = *Tensor::Empty(DType::kF32, std::move(shape));
  float* f = static_cast<float*>(t.data());
  for (int64_t i = 0; i < NumElements(t.shape()); ++i) f[i] = v + i;
  return t;
}

float First(const std::string& dir, const std::string& key) {
  absl::StatusOr<StateDict> all = LoadAll(dir);
  if (!all.ok()) return -12345;
  return static_cast<const float*>(
      (*all)[key].tensor()->shards()[0].view.data())[0];
}

TEST(AsyncSaveTest, CheckpointHoldsValuesFromBeforeTheChange) {
  TempDir tmp;
  Tensor w = Filled({256, 256}, 1);
  StateDict sd;
  sd["w"] = w;
  sd["step"] = int64_t{1};
  absl::StatusOr<std::unique_ptr<AsyncSaver>> saver = AsyncSaver::Create(nullptr);
  ASSERT_TRUE(saver.ok());
  absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> h =
      (*saver)->Save(sd, tmp.Sub("a"));
  ASSERT_TRUE(h.ok()) << h.status();
  // Mutate at once, before the background save can have written anything.
  static_cast<float*>(w.data())[0] = -7;
  *sd["step"].scalar() = int64_t{2};
  absl::StatusOr<SaveResult> r = (*h)->Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE((*h)->done());
  EXPECT_EQ(First(tmp.Sub("a"), "w"), 1.0f);
  EXPECT_EQ(ReadMetadata(tmp.Sub("a"))->scalars.at("step"), Scalar(int64_t{1}));
}

// Tables are refused (their sources would be pulled after Save returned),
// before anything is staged or written.
TEST(AsyncSaveTest, KeyValueTablesAreRefused) {
  TempDir tmp;
  KvTableSpec spec;
  spec.num_buckets = 2;
  spec.bucketing = KvBucketing::kInterleaved;
  spec.columns = {{"weight", DType::kF32, 4}};
  absl::StatusOr<std::unique_ptr<InMemoryKvTable>> table =
      InMemoryKvTable::Create("emb", spec, {0, 2});
  ASSERT_TRUE(table.ok());
  std::unique_ptr<KvSource> source = (*table)->Source(16);
  SaveOptions o;
  o.kv_tables.push_back({"emb", spec, std::nullopt, source.get()});
  absl::StatusOr<std::unique_ptr<AsyncSaver>> saver = AsyncSaver::Create(nullptr);
  ASSERT_TRUE(saver.ok());
  StateDict sd;
  absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> h =
      (*saver)->Save(sd, tmp.Sub("a"), o);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("key-value tables"));
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("a")));
}

// With max_in_flight 1, a Save returns only after the previous one is done;
// a hundred saves reuse one set of staging buffers.
TEST(AsyncSaveTest, OneInFlightAndFlatStagingMemory) {
  TempDir tmp;
  Tensor w = Filled({64, 64}, 0);
  StateDict sd;
  sd["w"] = w;
  absl::StatusOr<std::unique_ptr<AsyncSaver>> saver = AsyncSaver::Create(nullptr);
  ASSERT_TRUE(saver.ok());
  std::shared_ptr<AsyncSaveHandle> previous;
  for (int i = 0; i < 100; ++i) {
    static_cast<float*>(w.data())[0] = static_cast<float>(i);
    SaveOptions o;
    o.overwrite = true;
    absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> h =
        (*saver)->Save(sd, tmp.Sub(absl::StrCat("s", i % 3)), o);
    ASSERT_TRUE(h.ok()) << h.status();
    if (previous) {
      EXPECT_TRUE(previous->done()) << i;
    }
    EXPECT_LE((*saver)->in_flight(), 1);
    previous = *h;
  }
  ASSERT_TRUE((*saver)->WaitAll().ok());
  EXPECT_EQ(First(tmp.Sub("s0"), "w"), 99.0f);  // 99 % 3 == 0
  EXPECT_EQ((*saver)->staging_allocations(), 1);
  EXPECT_EQ((*saver)->staging_bytes(), 64u * 64 * 4);
}

TEST(AsyncSaveTest, BackgroundFailureReachesTheHandleOrTheNextSave) {
  TempDir tmp;
  // A file where the checkpoint directory should be: every save fails.
  testing_util::WriteFile(tmp.Sub("blocked"), "not a directory");
  Tensor w = Filled({8}, 0);
  StateDict sd;
  sd["w"] = w;
  absl::StatusOr<std::unique_ptr<AsyncSaver>> saver = AsyncSaver::Create(nullptr);
  ASSERT_TRUE(saver.ok());
  auto h = (*saver)->Save(sd, tmp.Sub("blocked"));
  ASSERT_TRUE(h.ok());  // staging succeeded; the failure comes later
  EXPECT_FALSE((*h)->Wait().ok());
  // Not waited for: the next Save reports it and does not start.
  auto h2 = (*saver)->Save(sd, tmp.Sub("blocked"));
  ASSERT_TRUE(h2.ok());
  while (!(*h2)->done()) std::this_thread::yield();
  absl::Status next = (*saver)->Save(sd, tmp.Sub("ok")).status();
  EXPECT_FALSE(next.ok());
  EXPECT_THAT(std::string(next.message()), HasSubstr("earlier async save"));
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("ok/metadata.json")));
  // Reported once: the save after that goes ahead.
  auto h3 = (*saver)->Save(sd, tmp.Sub("ok"));
  ASSERT_TRUE(h3.ok()) << h3.status();
  EXPECT_TRUE((*h3)->Wait().ok());
  EXPECT_TRUE((*saver)->WaitAll().ok());
}

// Two ranks: while the background save runs its collectives, the
// application keeps using its own communicator; neither sees the other's
// messages, and the checkpoint loads with another rank count.
TEST(AsyncSaveTest, BackgroundCollectivesDoNotMixWithTheApplications) {
  TempDir tmp;
  std::vector<absl::Status> st = RunInProcess(2, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    Tensor mine = Filled({128, 64}, static_cast<float>(1000 * r));
    StateDict sd;
    sd["w"] = ShardedTensor(DType::kF32, {256, 64},
                            {Shard{Box{{128 * r, 0}, {128, 64}}, mine.view()}});
    CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<AsyncSaver> saver,
                           AsyncSaver::Create(&comm));
    std::vector<std::shared_ptr<AsyncSaveHandle>> handles;
    for (int step = 0; step < 5; ++step) {
      static_cast<float*>(mine.data())[0] = static_cast<float>(1000 * r + step);
      CAIRN_ASSIGN_OR_RETURN(auto h, saver->Save(sd, tmp.Sub(absl::StrCat("step", step))));
      handles.push_back(h);
      // The application's own collectives, while the save runs.
      for (int i = 0; i < 20; ++i) {
        CAIRN_ASSIGN_OR_RETURN(std::vector<std::string> all,
                               comm.AllGather(absl::StrCat("app", r, ":", i)));
        if (all[0] != absl::StrCat("app0:", i) || all[1] != absl::StrCat("app1:", i)) {
          return absl::InternalError("application messages got mixed up");
        }
      }
    }
    return saver->WaitAll();
  });
  for (const absl::Status& s : st) ASSERT_TRUE(s.ok()) << s;
  for (int step = 0; step < 5; ++step) {
    absl::StatusOr<StateDict> all = LoadAll(tmp.Sub(absl::StrCat("step", step)));
    ASSERT_TRUE(all.ok()) << all.status();
    const float* f = static_cast<const float*>(all->Find("w")->tensor()->shards()[0].view.data());
    EXPECT_EQ(f[0], static_cast<float>(step));
    EXPECT_EQ(f[128 * 64], static_cast<float>(1000 + step));
  }
}

// Staging fails on one rank only (a device tensor in a build without
// CUDA): that rank's Save returns the error, the other ranks' background
// saves fail with it instead of waiting forever, and the next save works.
TEST(AsyncSaveTest, StagingFailureOnOneRankDoesNotHangTheOthers) {
  TempDir tmp;
  std::vector<std::string> errors(2);
  std::vector<absl::Status> st = RunInProcess(2, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    Tensor mine = Filled({8, 4}, static_cast<float>(r));
    float device_bytes[4] = {};
    StateDict sd;
    sd["w"] = ShardedTensor(DType::kF32, {16, 4}, {Shard{Box{{8 * r, 0}, {8, 4}}, mine.view()}});
    if (r == 1) sd["gpu"] = TensorView(device_bytes, DType::kF32, {4}, Device::Cuda(0));
    CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<AsyncSaver> saver, AsyncSaver::Create(&comm));
    absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> h = saver->Save(sd, tmp.Sub("bad"));
    if (r == 1) {
      if (h.ok()) return absl::InternalError("rank 1 staged a device tensor");
      errors[r] = std::string(h.status().message());
    } else {
      if (!h.ok()) return h.status();
      absl::StatusOr<SaveResult> res = (*h)->Wait();
      if (res.ok()) return absl::InternalError("rank 0's save succeeded alone");
      errors[r] = std::string(res.status().message());
    }
    // Fixed on rank 1: the next save goes through on both.
    sd = StateDict();
    sd["w"] = ShardedTensor(DType::kF32, {16, 4}, {Shard{Box{{8 * r, 0}, {8, 4}}, mine.view()}});
    CAIRN_ASSIGN_OR_RETURN(auto good, saver->Save(sd, tmp.Sub("good")));
    CAIRN_RETURN_IF_ERROR(good->Wait().status());
    return saver->WaitAll();
  });
  for (const absl::Status& s : st) ASSERT_TRUE(s.ok()) << s;
  EXPECT_THAT(errors[1], HasSubstr("gpu"));
  EXPECT_THAT(errors[0], HasSubstr("rank 1"));
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("bad/metadata.json")));
  EXPECT_TRUE(std::filesystem::exists(tmp.Sub("good/metadata.json")));
}

}  // namespace
}  // namespace cairn
