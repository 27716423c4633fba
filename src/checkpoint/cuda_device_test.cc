// Device tensors on a real GPU: staging by cudaMemcpyAsync into pinned
// buffers, synchronous save, async save with the device memory overwritten
// right after Save returns, and the runtime's checks. Built only with
// CAIRN_WITH_CUDA; on a machine without a usable GPU every test skips and
// says why.
#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "cairn/async_save.h"
#include "cairn/checkpoint.h"
#include "cairn/stager.h"
#include "checkpoint/test_util.h"
#include "cuda/device_runtime.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using ::testing::HasSubstr;
using testing_util::TempDir;

// Why there is no GPU to test on, or "" when there is one.
std::string NoGpuReason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return absl::StrFormat("no usable CUDA device: cudaGetDeviceCount: %s (%s)",
                           cudaGetErrorString(err), cudaGetErrorName(err));
  }
  if (count == 0) return "no CUDA device on this machine";
  return "";
}

#define SKIP_WITHOUT_GPU()                                  \
  do {                                                      \
    const std::string reason = NoGpuReason();               \
    if (!reason.empty()) GTEST_SKIP() << reason;            \
  } while (0)

// n floats of device memory, filled with start, start + 1, ...
class DeviceFloats {
 public:
  DeviceFloats(size_t n, float start) : n_(n) {
    if (cudaMalloc(&ptr_, n * sizeof(float)) != cudaSuccess) ptr_ = nullptr;
    Fill(start);
  }
  ~DeviceFloats() { cudaFree(ptr_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;

  bool ok() const { return ptr_ != nullptr; }
  void Fill(float start) {
    std::vector<float> host(n_);
    for (size_t i = 0; i < n_; ++i) host[i] = start + static_cast<float>(i);
    cudaMemcpy(ptr_, host.data(), n_ * sizeof(float), cudaMemcpyHostToDevice);
  }
  float* get() const { return static_cast<float*>(ptr_); }
  TensorView View(Shape shape, size_t offset = 0) const {
    return TensorView(get() + offset, DType::kF32, std::move(shape),
                      Device::Cuda(0));
  }

 private:
  size_t n_;
  void* ptr_ = nullptr;
};

const float* Floats(const StateDict& sd, const std::string& key) {
  return static_cast<const float*>(
      sd.Find(key)->tensor()->shards()[0].view.data());
}

TEST(CudaDeviceTest, StagesDeviceMemoryIntoPinnedHostBuffers) {
  SKIP_WITHOUT_GPU();
  DeviceFloats w(1 << 20, 1);
  ASSERT_TRUE(w.ok());
  StateDict sd;
  sd["w"] = w.View({1024, 1024});
  sd["tail"] = w.View({1024}, (1 << 20) - 1024);  // shares w's storage
  Stager stager;
  for (int round = 0; round < 3; ++round) {
    w.Fill(static_cast<float>(round));
    absl::StatusOr<StateDict> staged = stager.Stage(sd);
    ASSERT_TRUE(staged.ok()) << staged.status();
    const float* s = Floats(*staged, "w");
    EXPECT_EQ(Floats(*staged, "tail"), s + (1 << 20) - 1024);
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, s), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeHost) << "staging is pinned memory";
    for (int i = 0; i < (1 << 20); i += 4099) {
      ASSERT_EQ(s[i], static_cast<float>(round + i)) << i;
    }
  }
  EXPECT_EQ(stager.allocations(), 1);  // one pinned buffer, reused
}

TEST(CudaDeviceTest, SyncSaveAndAsyncSaveRoundTrip) {
  SKIP_WITHOUT_GPU();
  TempDir tmp;
  DeviceFloats w(1 << 18, 3);
  ASSERT_TRUE(w.ok());
  StateDict sd;
  sd["w"] = w.View({512, 512});
  // Its transpose: a strided device view.
  sd["t"] = TensorView(w.get(), DType::kF32, {512, 512}, {1, 512},
                       Device::Cuda(0));
  absl::StatusOr<SaveResult> saved = Save(sd, tmp.Sub("sync"));
  ASSERT_TRUE(saved.ok()) << saved.status();
  absl::StatusOr<StateDict> back = LoadAll(tmp.Sub("sync"));
  ASSERT_TRUE(back.ok()) << back.status();
  for (int i = 0; i < 512; i += 7) {
    for (int j = 0; j < 512; j += 5) {
      ASSERT_EQ(Floats(*back, "w")[i * 512 + j], 3.0f + i * 512 + j);
      ASSERT_EQ(Floats(*back, "t")[i * 512 + j], 3.0f + j * 512 + i);
    }
  }

  absl::StatusOr<std::unique_ptr<AsyncSaver>> saver =
      AsyncSaver::Create(nullptr);
  ASSERT_TRUE(saver.ok()) << saver.status();
  absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> h =
      (*saver)->Save(sd, tmp.Sub("async"));
  ASSERT_TRUE(h.ok()) << h.status();
  // The next step overwrites the weights at once, on the device.
  ASSERT_EQ(cudaMemset(w.get(), 0, (1 << 18) * sizeof(float)), cudaSuccess);
  absl::StatusOr<SaveResult> r = (*h)->Wait();
  ASSERT_TRUE(r.ok()) << r.status();
  back = LoadAll(tmp.Sub("async"));
  ASSERT_TRUE(back.ok()) << back.status();
  for (int i = 0; i < (1 << 18); i += 31) {
    ASSERT_EQ(Floats(*back, "w")[i], 3.0f + i) << i;
  }
}

// A kernel-free stand-in for the application's queued work: a large
// device-to-device copy on the legacy default stream, then staging at once.
// Stage must wait for it (cudaDeviceSynchronize) before copying out.
TEST(CudaDeviceTest, StagingWaitsForQueuedDeviceWork) {
  SKIP_WITHOUT_GPU();
  const size_t n = size_t{64} << 20;  // 256 MiB
  DeviceFloats src(n, 9);
  DeviceFloats dst(n, 0);
  ASSERT_TRUE(src.ok() && dst.ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(dst.get(), src.get(), n * sizeof(float),
                            cudaMemcpyDeviceToDevice, nullptr),
            cudaSuccess);
  StateDict sd;
  sd["dst"] = dst.View({static_cast<int64_t>(n)});
  Stager stager;
  absl::StatusOr<StateDict> staged = stager.Stage(sd);
  ASSERT_TRUE(staged.ok()) << staged.status();
  const float* s = Floats(*staged, "dst");
  EXPECT_EQ(s[n - 1], 9.0f + static_cast<float>(n - 1));
  EXPECT_EQ(s[0], 9.0f);
}

TEST(CudaDeviceTest, HostPointerLabelledAsDeviceIsRejected) {
  SKIP_WITHOUT_GPU();
  std::vector<float> host(16);
  StateDict sd;
  sd["liar"] = TensorView(host.data(), DType::kF32, {16}, Device::Cuda(0));
  Stager stager;
  absl::Status s = stager.Stage(sd).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("liar"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("not memory of that device"));
}

TEST(CudaDeviceTest, DeviceThatDoesNotExistIsAnError) {
  SKIP_WITHOUT_GPU();
  DeviceFloats w(16, 0);
  StateDict sd;
  sd["w"] = TensorView(w.get(), DType::kF32, {16}, Device::Cuda(4096));
  TempDir tmp;
  absl::Status s = Save(sd, tmp.path()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cuda:4096"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("w"));
}

// On a machine without a GPU, device tensors fail with the driver's reason
// (and this is the test that runs there instead of skipping).
TEST(CudaDeviceTest, WithoutAGpuDeviceTensorsFailWithTheReason) {
  if (NoGpuReason().empty()) GTEST_SKIP() << "this machine has a GPU";
  float x[4] = {};
  StateDict sd;
  sd["w"] = TensorView(x, DType::kF32, {4}, Device::Cuda(0));
  Stager stager;
  absl::Status s = stager.Stage(sd).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("w"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("no usable GPU"));
}

}  // namespace
}  // namespace cairn
