// Device tensors through staging, synchronous save and async save, on a fake
// device runtime (host memory registered as cuda:N; copies land only at
// Synchronize; failures injected), so these paths are tested on every build.
// cuda_device_test.cc runs the same paths on a real GPU.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cairn/async_save.h"
#include "cairn/checkpoint.h"
#include "cairn/stager.h"
#include "checkpoint/test_util.h"
#include "cuda/fake_device_runtime.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using internal_cuda::FakeDeviceRuntime;
using internal_cuda::ScopedRuntimeForTesting;
using ::testing::HasSubstr;
using testing_util::TempDir;

// Simulated device memory: floats start, start + 1, ...
struct DeviceBuffer {
  DeviceBuffer(FakeDeviceRuntime& runtime, int device, size_t n, float start)
      : values(n), index(device) {
    for (size_t i = 0; i < n; ++i) values[i] = start + static_cast<float>(i);
    runtime.AddDeviceMemory(device, values.data(), n * sizeof(float));
  }
  TensorView View(Shape shape, size_t offset = 0) {
    return TensorView(values.data() + offset, DType::kF32, std::move(shape),
                      Device::Cuda(index));
  }
  std::vector<float> values;
  int index;
};

const TensorView& ShardView(const StateDict& sd, const std::string& key,
                            size_t shard = 0) {
  return sd.Find(key)->tensor()->shards()[shard].view;
}

const float* Floats(const StateDict& sd, const std::string& key,
                    size_t shard = 0) {
  return static_cast<const float*>(ShardView(sd, key, shard).data());
}

class DeviceStagingTest : public ::testing::Test {
 protected:
  FakeDeviceRuntime runtime_{/*num_devices=*/2};
  ScopedRuntimeForTesting scope_{&runtime_};
};

TEST_F(DeviceStagingTest, StagesDeviceTensorsIntoPinnedHostBuffers) {
  DeviceBuffer a(runtime_, 0, 64, 1);
  DeviceBuffer b(runtime_, 1, 32, 100);
  std::vector<float> host = {7, 8, 9};
  StateDict sd;
  sd["a"] = a.View({8, 8});
  sd["b"] = b.View({32});
  sd["h"] = TensorView(host.data(), DType::kF32, {3});
  Stager stager;
  absl::StatusOr<StateDict> staged = stager.Stage(sd);
  ASSERT_TRUE(staged.ok()) << staged.status();
  // The application's queued work was waited for once per device, and every
  // copy had landed when Stage returned (the fake lands them only then).
  EXPECT_EQ(runtime_.waits(0), 1);
  EXPECT_EQ(runtime_.waits(1), 1);
  EXPECT_EQ(runtime_.pending(), 0);
  EXPECT_EQ(runtime_.copies(), 2);
  EXPECT_EQ(runtime_.pinned_allocations(), 2);  // host shards: plain memory
  for (const char* key : {"a", "b", "h"}) {
    EXPECT_TRUE(ShardView(*staged, key).device().is_cpu()) << key;
  }
  EXPECT_EQ(Floats(*staged, "a")[63], 64.0f);
  EXPECT_EQ(Floats(*staged, "b")[0], 100.0f);
  EXPECT_EQ(Floats(*staged, "h")[2], 9.0f);
  // The training loop moves on: the staged copy keeps the old values.
  a.values[63] = -1;
  EXPECT_EQ(Floats(*staged, "a")[63], 64.0f);
}

// A tensor and views into its storage stay one staged buffer, same sharing.
TEST_F(DeviceStagingTest, AliasingSurvivesDeviceStaging) {
  DeviceBuffer buf(runtime_, 0, 64, 0);
  StateDict sd;
  sd["whole"] = buf.View({64});
  sd["tail"] = buf.View({16}, 48);
  // A strided view: column 1 of the 8x8 matrix.
  sd["column"] = TensorView(buf.values.data() + 1, DType::kF32, {8}, {8},
                            Device::Cuda(0));
  Stager stager;
  absl::StatusOr<StateDict> staged = stager.Stage(sd);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(runtime_.copies(), 1);
  EXPECT_EQ(runtime_.pinned_allocations(), 1);
  EXPECT_EQ(Floats(*staged, "tail"), Floats(*staged, "whole") + 48);
  EXPECT_EQ(Floats(*staged, "column"), Floats(*staged, "whole") + 1);
  EXPECT_EQ(ShardView(*staged, "column").strides(), std::vector<int64_t>{8});
  EXPECT_EQ(Floats(*staged, "column")[8 * 7], 57.0f);
}

TEST_F(DeviceStagingTest, HundredStagingsReuseThePinnedBuffers) {
  DeviceBuffer a(runtime_, 0, 1024, 0);
  DeviceBuffer b(runtime_, 0, 1024, 0);
  StateDict sd;
  sd["a"] = a.View({32, 32});
  sd["b"] = b.View({1024});
  Stager stager;
  for (int i = 0; i < 100; ++i) {
    a.values[0] = static_cast<float>(i);
    absl::StatusOr<StateDict> staged = stager.Stage(sd);
    ASSERT_TRUE(staged.ok()) << staged.status();
    ASSERT_EQ(Floats(*staged, "a")[0], static_cast<float>(i));
  }
  EXPECT_EQ(runtime_.pinned_allocations(), 2);
  EXPECT_EQ(runtime_.live_pinned(), 2);
  EXPECT_EQ(stager.cached_bytes(), 2 * 1024 * sizeof(float));
  stager.Release();
  EXPECT_EQ(runtime_.live_pinned(), 0);
}

TEST_F(DeviceStagingTest, EmptyDeviceShardsBecomeEmptyHostViews) {
  DeviceBuffer a(runtime_, 0, 4, 0);
  StateDict sd;
  sd["e"] = ShardedTensor(DType::kF32, {0, 4},
                          {Shard{Box{{0, 0}, {0, 4}}, a.View({0, 4})}});
  Stager stager;
  absl::StatusOr<StateDict> staged = stager.Stage(sd);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_TRUE(ShardView(*staged, "e").device().is_cpu());
  EXPECT_EQ(runtime_.copies(), 0);
}

TEST_F(DeviceStagingTest, MissingDeviceIsAnErrorNamingTheTensor) {
  std::vector<float> x(4);
  StateDict sd;
  sd["model"]["w"] = TensorView(x.data(), DType::kF32, {4}, Device::Cuda(5));
  Stager stager;
  absl::Status s = stager.Stage(sd).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("model.w"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("cuda:5"));
}

TEST_F(DeviceStagingTest, PointerThatIsNotDeviceMemoryIsRejected) {
  std::vector<float> x(4);  // never registered
  StateDict sd;
  sd["w"] = TensorView(x.data(), DType::kF32, {4}, Device::Cuda(0));
  Stager stager;
  absl::Status s = stager.Stage(sd).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("w"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("not memory of cuda:0"));
}

// A failing copy: an error naming the tensor and device, and no copy still
// in flight into a buffer once Stage has returned.
TEST_F(DeviceStagingTest, CopyFailureLeavesNoCopyInFlight) {
  DeviceBuffer a(runtime_, 0, 16, 0);
  DeviceBuffer b(runtime_, 0, 16, 0);
  StateDict sd;
  sd["a"] = a.View({16});
  sd["b"] = b.View({16});
  Stager stager;
  runtime_.fail_sync = absl::DataLossError("ECC error");
  absl::Status s = stager.Stage(sd).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("ECC error"));
  EXPECT_EQ(runtime_.pending(), 0);
  runtime_.fail_sync = absl::OkStatus();

  runtime_.fail_copy = absl::InternalError("launch failed");
  s = stager.Stage(sd).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cuda:0"));
  EXPECT_EQ(runtime_.pending(), 0);
  runtime_.fail_copy = absl::OkStatus();

  runtime_.fail_pinned = absl::ResourceExhaustedError("cudaHostAlloc");
  Stager fresh;
  s = fresh.Stage(sd).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("from cuda:0: cudaHostAlloc"));
  runtime_.fail_pinned = absl::OkStatus();

  runtime_.fail_wait = absl::AbortedError("kernel fault");
  s = fresh.Stage(sd).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  runtime_.fail_wait = absl::OkStatus();

  // And it works again afterwards.
  absl::StatusOr<StateDict> staged = stager.Stage(sd);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(Floats(*staged, "b")[15], 15.0f);
}

// A synchronous Save copies device shards to host memory (the default
// planner materializes them), strided ones too, and loads back bit-exact.
TEST_F(DeviceStagingTest, SyncSaveOfDeviceTensorsRoundTrips) {
  TempDir tmp;
  DeviceBuffer a(runtime_, 0, 64, 1);
  DeviceBuffer b(runtime_, 1, 64, 1000);
  StateDict sd;
  // Row-sharded over two devices: rows 0-3 on cuda:0, rows 4-7 on cuda:1.
  sd["w"] = ShardedTensor(DType::kF32, {8, 8},
                          {Shard{Box{{0, 0}, {4, 8}}, a.View({4, 8})},
                           Shard{Box{{4, 0}, {4, 8}}, b.View({4, 8})}});
  // The transpose of a's 8x8 matrix, a strided device view.
  sd["t"] = TensorView(a.values.data(), DType::kF32, {8, 8}, {1, 8},
                       Device::Cuda(0));
  absl::StatusOr<SaveResult> saved = Save(sd, tmp.path());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(runtime_.pending(), 0);
  absl::StatusOr<StateDict> back = LoadAll(tmp.path());
  ASSERT_TRUE(back.ok()) << back.status();
  const float* w = Floats(*back, "w");
  EXPECT_EQ(w[0], 1.0f);
  EXPECT_EQ(w[31], 32.0f);
  EXPECT_EQ(w[32], 1000.0f);
  EXPECT_EQ(w[63], 1031.0f);
  const float* t = Floats(*back, "t");
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 8; ++j) {
      ASSERT_EQ(t[i * 8 + j], a.values[j * 8 + i]) << i << "," << j;
    }
  }
}

// A device that cannot be read fails the save at planning, naming the tensor,
// and nothing is committed.
TEST_F(DeviceStagingTest, SyncSaveFailsBeforeWritingWhenDeviceIsMissing) {
  TempDir tmp;
  std::vector<float> x(4);
  StateDict sd;
  sd["ok"] = TensorView(x.data(), DType::kF32, {4});
  sd["far"] = TensorView(x.data(), DType::kF32, {4}, Device::Cuda(3));
  absl::Status s = Save(sd, tmp.Sub("ckpt")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("far"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("cuda:3"));
  EXPECT_EQ(ReadMetadata(tmp.Sub("ckpt")).status().code(),
            absl::StatusCode::kNotFound);
}

// AsyncSave of device tensors returns after staging; the device memory may
// change at once and the checkpoint holds the values from before.
TEST_F(DeviceStagingTest, AsyncSaveOfDeviceTensorsHoldsValuesFromBefore) {
  TempDir tmp;
  DeviceBuffer a(runtime_, 0, 4096, 5);
  StateDict sd;
  sd["w"] = a.View({64, 64});
  sd["step"] = int64_t{3};
  absl::StatusOr<std::unique_ptr<AsyncSaver>> saver =
      AsyncSaver::Create(nullptr);
  ASSERT_TRUE(saver.ok()) << saver.status();
  absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> h =
      (*saver)->Save(sd, tmp.Sub("a"));
  ASSERT_TRUE(h.ok()) << h.status();
  for (float& v : a.values) v = -1;  // the next step overwrites the weights
  absl::StatusOr<SaveResult> r = (*h)->Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<StateDict> back = LoadAll(tmp.Sub("a"));
  ASSERT_TRUE(back.ok()) << back.status();
  const float* w = Floats(*back, "w");
  for (int i = 0; i < 4096; ++i) ASSERT_EQ(w[i], 5.0f + i) << i;
}

// Without any runtime (the test override cleared): a build without CUDA says
// so; a CUDA build on a machine without a GPU (or this host pointer on a real
// one) fails too. Either way the error names the tensor.
TEST(DeviceStagingNoRuntimeTest, DeviceTensorsWithoutARuntimeFail) {
  float x[4] = {};
  StateDict sd;
  sd["gpu"] = TensorView(x, DType::kF32, {4}, Device::Cuda(0));
  Stager stager;
  absl::Status s = stager.Stage(sd).status();
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("gpu"));
  if (!internal_cuda::BuiltWithCuda()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
    EXPECT_THAT(std::string(s.message()), HasSubstr("CAIRN_WITH_CUDA"));
  }
  TempDir tmp;
  absl::Status saved = Save(sd, tmp.path()).status();
  ASSERT_FALSE(saved.ok());
  EXPECT_THAT(std::string(saved.message()), HasSubstr("gpu"));
}

}  // namespace
}  // namespace cairn
