// Device tensors on a real GPU: staging by cudaMemcpyAsync into pinned
// buffers, synchronous save, async save with the device memory overwritten
// right after Save returns, loads into device tensors (column slices too,
// after the application's queued work), and the runtime's checks. Built only with
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

// The application's last write to `dst`: a copy of n floats from `src`,
// queued on the legacy default stream of an idle device and still running
// when this returns (256 MiB take milliseconds).
::testing::AssertionResult QueueApplicationCopy(const DeviceFloats& src,
                                                DeviceFloats& dst, size_t n) {
  if (!src.ok() || !dst.ok()) {
    return ::testing::AssertionFailure() << "cudaMalloc failed";
  }
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyAsync(dst.get(), src.get(), n * sizeof(float),
                      cudaMemcpyDeviceToDevice, nullptr) != cudaSuccess) {
    return ::testing::AssertionFailure() << "could not queue the copy";
  }
  return ::testing::AssertionSuccess();
}

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
  ASSERT_TRUE(QueueApplicationCopy(src, dst, n));
  StateDict sd;
  sd["dst"] = dst.View({static_cast<int64_t>(n)});
  Stager stager;
  absl::StatusOr<StateDict> staged = stager.Stage(sd);
  ASSERT_TRUE(staged.ok()) << staged.status();
  const float* s = Floats(*staged, "dst");
  EXPECT_EQ(s[n - 1], 9.0f + static_cast<float>(n - 1));
  EXPECT_EQ(s[0], 9.0f);
}

// n floats of device memory copied back to the host.
std::vector<float> ToHost(const float* device_ptr, size_t n) {
  std::vector<float> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), device_ptr, n * sizeof(float),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

TEST(CudaDeviceTest, LoadFillsDeviceTensorsIncludingColumnSlices) {
  SKIP_WITHOUT_GPU();
  TempDir tmp;
  // Saved from the host: "a" [64, 48] = 0.., "b" [1M] = 0.5, 1.5, ...
  std::vector<float> a(64 * 48), b(1 << 20);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = 0.5f + static_cast<float>(i);
  StateDict saved;
  saved["a"] = TensorView(a.data(), DType::kF32, {64, 48});
  saved["b"] = TensorView(b.data(), DType::kF32, {1 << 20});
  ASSERT_TRUE(Save(saved, tmp.path()).ok());

  // "a" by columns: [0, 20) into a [64, 20] device tensor, [20, 48) into
  // columns 5..33 of a [64, 40] device buffer (row stride 40), whose other
  // columns keep their values; "b" whole. Batches of 1 MiB: several, so
  // the two pinned buffers take turns.
  DeviceFloats left(64 * 20, -1);
  DeviceFloats wide(64 * 40, -1);
  DeviceFloats whole(1 << 20, -1);
  ASSERT_TRUE(left.ok() && wide.ok() && whole.ok());
  TensorView slice(wide.get() + 5, DType::kF32, {64, 28}, {40, 1},
                   Device::Cuda(0));
  StateDict dst;
  dst["a"] = ShardedTensor(DType::kF32, {64, 48},
                           {{Box{{0, 0}, {64, 20}}, left.View({64, 20})},
                            {Box{{0, 20}, {64, 28}}, slice}});
  dst["b"] = whole.View({1 << 20});
  LoadOptions o;
  o.device_batch_bytes = 1 << 20;
  absl::StatusOr<LoadResult> r = Load(dst, tmp.path(), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->device_bytes, (a.size() + b.size()) * sizeof(float));

  const std::vector<float> l = ToHost(left.get(), 64 * 20);
  const std::vector<float> w = ToHost(wide.get(), 64 * 40);
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 20; ++j) {
      ASSERT_EQ(l[i * 20 + j], a[i * 48 + j]) << i << "," << j;
    }
    for (int j = 0; j < 40; ++j) {
      const float want = j >= 5 && j < 33 ? a[i * 48 + 20 + (j - 5)]
                                          : -1.0f + static_cast<float>(i * 40 + j);
      ASSERT_EQ(w[i * 40 + j], want) << i << "," << j;
    }
  }
  EXPECT_EQ(ToHost(whole.get(), 1 << 20), b);
}

TEST(CudaDeviceTest, LoadWaitsForQueuedDeviceWorkBeforeOverwriting) {
  SKIP_WITHOUT_GPU();
  TempDir tmp;
  const size_t n = size_t{64} << 20;  // 256 MiB
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = static_cast<float>(i % 1000);
  StateDict saved;
  saved["t"] = TensorView(values.data(), DType::kF32, {static_cast<int64_t>(n)});
  ASSERT_TRUE(Save(saved, tmp.path()).ok());
  // The application's last write to the destination is still queued on the
  // default stream when Load starts; cairn copies on a stream of its own,
  // so without waiting first its copies could land before that write and
  // be overwritten by it.
  DeviceFloats src(n, 9);
  DeviceFloats dst(n, 0);
  ASSERT_TRUE(QueueApplicationCopy(src, dst, n));
  StateDict into;
  into["t"] = dst.View({static_cast<int64_t>(n)});
  absl::StatusOr<LoadResult> r = Load(into, tmp.path());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ToHost(dst.get(), n), values);
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
