// Stager: copies that outlive changes to the source, buffers reused across
// calls (memory flat over 100 stagings), aliasing kept, buffers in use never
// overwritten, bounded cache, released sources.
#include "cairn/stager.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cairn/checkpoint.h"
#include "checkpoint/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using ::testing::HasSubstr;

Tensor Iota(Shape shape, float start) {
  Tensor t = *Tensor::Empty(DType::kF32, std::move(shape));
  float* f = static_cast<float*>(t.data());
  for (int64_t i = 0; i < NumElements(t.shape()); ++i) f[i] = start + i;
  return t;
}

const float* Data(const StateDict& sd, const std::string& key, size_t shard = 0) {
  return static_cast<const float*>(sd.Find(key)->tensor()->shards()[shard].view.data());
}

TEST(StagerTest, CopyHoldsTheValuesFromBeforeLaterChanges) {
  Tensor w = Iota({4, 8}, 0);
  StateDict sd;
  sd["w"] = w;
  sd["rng"] = Object{"state"};
  sd["step"] = int64_t{7};
  Stager stager;
  absl::StatusOr<StateDict> copy = stager.Stage(sd);
  ASSERT_TRUE(copy.ok()) << copy.status();
  static_cast<float*>(w.data())[5] = -1;  // the job moves on at once
  *sd["rng"].object() = Object{"changed"};
  EXPECT_EQ(Data(*copy, "w")[5], 5.0f);
  EXPECT_NE(Data(*copy, "w"), static_cast<const float*>(w.data()));
  EXPECT_EQ((*copy)["rng"].object()->bytes, "state");
  EXPECT_EQ(*(*copy)["step"].scalar(), Scalar(int64_t{7}));
}

// 100 stagings of the same state, each copy dropped before the next (as a
// save finishes before the next step's): the same buffers every time.
TEST(StagerTest, HundredStagingsKeepMemoryFlat) {
  std::vector<Tensor> ts;
  StateDict sd;
  for (int i = 0; i < 5; ++i) {
    ts.push_back(Iota({64, 64}, static_cast<float>(i)));
    sd[std::to_string(i)] = ts.back();
  }
  Stager stager;
  uint64_t first_bytes = 0;
  for (int call = 0; call < 100; ++call) {
    static_cast<float*>(ts[0].data())[0] = static_cast<float>(call);
    absl::StatusOr<StateDict> copy = stager.Stage(sd);
    ASSERT_TRUE(copy.ok());
    EXPECT_EQ(Data(*copy, "0")[0], static_cast<float>(call));
    if (call == 0) first_bytes = stager.cached_bytes();
    EXPECT_EQ(stager.cached_bytes(), first_bytes);
  }
  EXPECT_EQ(first_bytes, 5u * 64 * 64 * 4);
  EXPECT_EQ(stager.allocations(), 5);
}

// Views that share memory are staged into one buffer with the same layout.
TEST(StagerTest, SharedStorageStaysShared) {
  Tensor base = Iota({8, 8}, 0);
  TensorView whole = base.view();
  TensorView bottom = *whole.Slice(Box{{4, 0}, {4, 8}});
  // A transposed view of the same bytes.
  TensorView transposed(base.data(), DType::kF32, {8, 8}, {1, 8});
  StateDict sd;
  sd["whole"] = whole;
  sd["bottom"] = bottom;
  sd["t"] = transposed;
  Stager stager;
  absl::StatusOr<StateDict> copy = stager.Stage(sd);
  ASSERT_TRUE(copy.ok());
  EXPECT_EQ(stager.allocations(), 1);  // one storage, one copy
  EXPECT_EQ(Data(*copy, "bottom"), Data(*copy, "whole") + 32);
  EXPECT_EQ(Data(*copy, "t"), Data(*copy, "whole"));
  EXPECT_EQ((*copy)["t"].tensor()->shards()[0].view.strides(),
            (std::vector<int64_t>{1, 8}));
  EXPECT_EQ(Data(*copy, "bottom")[3], 35.0f);
}

// A staged copy still held (its save still running) is never overwritten:
// the next call gets a fresh buffer, and reuses the old one once released.
TEST(StagerTest, BufferInUseIsNotReused) {
  Tensor w = Iota({16}, 0);
  StateDict sd;
  sd["w"] = w;
  Stager stager;
  absl::StatusOr<StateDict> first = stager.Stage(sd);
  ASSERT_TRUE(first.ok());
  static_cast<float*>(w.data())[0] = 100;
  absl::StatusOr<StateDict> second = stager.Stage(sd);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(Data(*first, "w")[0], 0.0f);  // untouched
  EXPECT_EQ(Data(*second, "w")[0], 100.0f);
  EXPECT_EQ(stager.allocations(), 2);
  *first = StateDict();
  *second = StateDict();
  ASSERT_TRUE(stager.Stage(sd).ok());
  EXPECT_EQ(stager.allocations(), 2);  // reused
}

TEST(StagerTest, CacheIsBoundedAndReleasable) {
  StagerOptions options;
  options.max_cached_bytes = 3 * 1024;  // room for three 1 KiB tensors
  Stager stager(options);
  std::vector<Tensor> ts;
  for (int i = 0; i < 6; ++i) ts.push_back(Iota({256}, 0));
  for (int i = 0; i < 6; ++i) {
    StateDict sd;
    sd["x"] = ts[i];
    ASSERT_TRUE(stager.Stage(sd).ok());
    EXPECT_LE(stager.cached_bytes(), options.max_cached_bytes);
  }
  // A call needing more than the bound keeps what it used.
  StateDict big;
  for (int i = 0; i < 6; ++i) big[std::to_string(i)] = ts[i];
  ASSERT_TRUE(stager.Stage(big).ok());
  EXPECT_EQ(stager.cached_bytes(), 6u * 1024);
  stager.Release();
  EXPECT_EQ(stager.cached_bytes(), 0u);
}

// A source with an owner (a cairn Tensor) that goes away frees its buffer
// at the next call.
TEST(StagerTest, BuffersOfSourcesThatWentAwayAreFreed) {
  Stager stager;
  {
    Tensor gone = Iota({256}, 0);
    StateDict sd;
    sd["gone"] = gone;
    ASSERT_TRUE(stager.Stage(sd).ok());
  }
  EXPECT_EQ(stager.cached_bytes(), 1024u);
  Tensor kept = Iota({128}, 0);
  StateDict sd;
  sd["kept"] = kept;
  ASSERT_TRUE(stager.Stage(sd).ok());
  EXPECT_EQ(stager.cached_bytes(), 512u);
}

// The staged copy saves like the original.
TEST(StagerTest, StagedStateSaves) {
  testing_util::TempDir tmp;
  Tensor w = Iota({32, 4}, 1);
  StateDict sd;
  sd["w"] = ShardedTensor(DType::kF32, {64, 4},
                          {Shard{Box{{32, 0}, {32, 4}}, w.view()},
                           Shard{Box{{0, 0}, {32, 4}}, w.view()}});
  Stager stager;
  absl::StatusOr<StateDict> copy = stager.Stage(sd);
  ASSERT_TRUE(copy.ok());
  static_cast<float*>(w.data())[0] = -5;
  ASSERT_TRUE(Save(*copy, tmp.path()).ok());
  absl::StatusOr<StateDict> back = LoadAll(tmp.path());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(Data(*back, "w")[0], 1.0f);
  EXPECT_EQ(Data(*back, "w")[32 * 4], 1.0f);
}

}  // namespace
}  // namespace cairn
