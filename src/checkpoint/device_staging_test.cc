// Device tensors through staging, synchronous save and async save, on a fake
// device runtime (host memory registered as cuda:N; copies land only at
// Synchronize; failures injected), so these paths are tested on every build.
// cuda_device_test.cc runs the same paths on a real GPU.
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/async_save.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/planner.h"
#include "cairn/stager.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/test_util.h"
#include "cuda/fake_device_runtime.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/fault_injection.h"

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

// QueueCopyToDeviceView, the copy a load makes into a device tensor: the
// source is the packed, row-major image of the view.

// A packed host source of `n` floats: 1000, 1001, ...
std::vector<float> PackedSource(int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = 1000.0f + static_cast<float>(i);
  return v;
}

// What QueueCopyToDeviceView queued: runtime calls, and the contiguous runs
// they copy (a CopyRowsToDeviceAsync call copies several).
struct Queued {
  int64_t calls = 0;
  int64_t runs = 0;
  friend bool operator==(const Queued&, const Queued&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Queued& q) {
    return os << q.calls << " calls, " << q.runs << " runs";
  }
};

class QueueCopyToDeviceTest : public DeviceStagingTest {
 protected:
  // Loads the packed source into the `box` slice of a device tensor of
  // `shape` (holding 0, 1, ...) and checks every element of the tensor: the
  // old values until Synchronize; then, inside the box, the source in the
  // box's row-major order and, outside it, the old values still. Returns
  // what was queued.
  Queued LoadSlice(const Shape& shape, const Box& box) {
    DeviceBuffer buf(runtime_, 0, NumElements(shape), 0);
    absl::StatusOr<TensorView> slice = buf.View(shape).Slice(box);
    EXPECT_TRUE(slice.ok()) << slice.status();
    if (!slice.ok()) return {};
    const std::vector<float> src = PackedSource(NumElements(box.sizes));
    const int64_t copies_before = runtime_.to_device_copies();
    const int64_t bytes_before = runtime_.to_device_bytes();
    absl::Status s =
        internal_cuda::QueueCopyToDeviceView(runtime_, "w", src.data(), *slice);
    EXPECT_TRUE(s.ok()) << s;
    const int64_t copies = runtime_.to_device_copies() - copies_before;
    // Only the slice's bytes went through the runtime, not its whole span.
    EXPECT_EQ(runtime_.to_device_bytes() - bytes_before,
              static_cast<int64_t>(src.size() * sizeof(float)));
    const int64_t runs = runtime_.pending();
    for (size_t i = 0; i < buf.values.size(); ++i) {
      EXPECT_EQ(buf.values[i], static_cast<float>(i)) << "before sync " << i;
    }
    EXPECT_TRUE(runtime_.Synchronize(Device::Cuda(0)).ok());
    for (size_t i = 0; i < buf.values.size(); ++i) {
      // The coordinates of element i, and its row-major index in the box
      // when it lies inside.
      int64_t rest = static_cast<int64_t>(i);
      int64_t packed = 0;
      int64_t scale = 1;
      bool inside = true;
      for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
        const int64_t x = rest % shape[d] - box.offsets[d];
        rest /= shape[d];
        inside &= x >= 0 && x < box.sizes[d];
        packed += x * scale;
        scale *= box.sizes[d];
      }
      const float want = inside ? src[packed] : static_cast<float>(i);
      EXPECT_EQ(buf.values[i], want) << "element " << i;
    }
    return Queued{copies, runs};
  }
};

TEST_F(QueueCopyToDeviceTest, ContiguousViewIsOneCopyThatLandsAtSynchronize) {
  DeviceBuffer buf(runtime_, 0, 24, 0);
  const std::vector<float> src = PackedSource(24);
  ASSERT_TRUE(internal_cuda::QueueCopyToDeviceView(runtime_, "w", src.data(),
                                                   buf.View({2, 3, 4}))
                  .ok());
  EXPECT_EQ(runtime_.to_device_copies(), 1);
  EXPECT_EQ(runtime_.to_device_bytes(), 24 * 4);
  EXPECT_EQ(runtime_.copies(), 0);  // nothing went the other way
  // Deferred: the device memory still holds the old values.
  EXPECT_EQ(runtime_.pending(), 1);
  EXPECT_EQ(buf.values[0], 0.0f);
  EXPECT_EQ(buf.values[23], 23.0f);
  ASSERT_TRUE(runtime_.Synchronize(Device::Cuda(0)).ok());
  EXPECT_EQ(buf.values, src);

  // Dimensions of size 1 with any stride are still one contiguous copy.
  DeviceBuffer other(runtime_, 0, 24, 0);
  ASSERT_TRUE(internal_cuda::QueueCopyToDeviceView(
                  runtime_, "w", src.data(),
                  TensorView(other.values.data(), DType::kF32, {1, 6, 1, 4},
                             {999, 4, 7, 1}, Device::Cuda(0)))
                  .ok());
  EXPECT_EQ(runtime_.to_device_copies(), 2);
  ASSERT_TRUE(runtime_.Synchronize(Device::Cuda(0)).ok());
  EXPECT_EQ(other.values, src);
}

// One run per contiguous stretch, the trailing dimensions merged while they
// are contiguous; the innermost loop over runs is one call (rows of a 2-D
// copy), each outer index another; the elements outside the slice stay as
// they were.
TEST_F(QueueCopyToDeviceTest, SlicesCopyOneRunPerContiguousStretch) {
  {
    SCOPED_TRACE("columns 2-4 of a 6x8 matrix: a run per row, one call");
    EXPECT_EQ(LoadSlice({6, 8}, Box{{0, 2}, {6, 3}}), (Queued{1, 6}));
  }
  {
    SCOPED_TRACE("whole rows of a 6x8 matrix: one run");
    EXPECT_EQ(LoadSlice({6, 8}, Box{{2, 0}, {3, 8}}), (Queued{1, 1}));
  }
  {
    SCOPED_TRACE("full last dimension: the last two dimensions merge");
    EXPECT_EQ(LoadSlice({4, 5, 6}, Box{{1, 1, 0}, {2, 3, 6}}), (Queued{1, 2}));
  }
  {
    SCOPED_TRACE("partial last dimension: a run per (i, j), a call per i");
    EXPECT_EQ(LoadSlice({4, 5, 6}, Box{{1, 1, 2}, {2, 3, 3}}), (Queued{2, 6}));
  }
  {
    SCOPED_TRACE("a size-1 middle dimension between strided ones");
    EXPECT_EQ(LoadSlice({4, 5, 6}, Box{{0, 2, 0}, {4, 1, 6}}), (Queued{1, 4}));
  }
  {
    SCOPED_TRACE("whole trailing block at an offset: one run");
    EXPECT_EQ(LoadSlice({4, 5, 6}, Box{{1, 0, 0}, {2, 5, 6}}), (Queued{1, 1}));
  }
  {
    SCOPED_TRACE("a column of a matrix: single elements as rows");
    EXPECT_EQ(LoadSlice({5, 7}, Box{{0, 3}, {5, 1}}), (Queued{1, 5}));
  }
}

// A transposed view has no two adjacent elements: one run per element, each
// to the element the packed row-major order puts there.
TEST_F(QueueCopyToDeviceTest, TransposedViewTakesTheSourceInRowMajorOrder) {
  DeviceBuffer buf(runtime_, 0, 24, 0);  // a 4x6 matrix
  const std::vector<float> src = PackedSource(24);
  TensorView t(buf.values.data(), DType::kF32, {6, 4}, {1, 6},
               Device::Cuda(0));
  ASSERT_TRUE(
      internal_cuda::QueueCopyToDeviceView(runtime_, "t", src.data(), t).ok());
  // Runs of one element; for each of the 6 rows of the view, its 4 elements
  // (24 bytes apart in the buffer) are one call.
  EXPECT_EQ(runtime_.to_device_copies(), 6);
  EXPECT_EQ(runtime_.pending(), 24);
  EXPECT_EQ(runtime_.to_device_bytes(), 24 * 4);
  ASSERT_TRUE(runtime_.Synchronize(Device::Cuda(0)).ok());
  for (int i = 0; i < 6; ++i) {
    for (int j = 0; j < 4; ++j) {
      ASSERT_EQ(buf.values[i + 6 * j], src[i * 4 + j]) << i << "," << j;
    }
  }
}

// CopyToHostTensor (the sync save's copy of a device shard): a block of
// columns with rows of 512 bytes or more is one 2-D copy per block of rows,
// moving only its own bytes; shorter rows copy the view's whole span once
// and gather on the host.
TEST_F(QueueCopyToDeviceTest, CopyToHostTensorMovesOnlyTheBlocksBytes) {
  DeviceBuffer buf(runtime_, 0, 3 * 16 * 512, 0);  // 0, 1, 2, ...
  auto expect_values = [&](const Tensor& t, const Shape& shape,
                           const Box& box) {
    const auto* got = static_cast<const float*>(t.data());
    int64_t i = 0;
    for (int64_t a = 0; a < box.sizes[0]; ++a) {
      for (int64_t b = 0; b < box.sizes[1]; ++b) {
        for (int64_t c = 0; c < box.sizes[2]; ++c, ++i) {
          const int64_t at = ((box.offsets[0] + a) * shape[1] +
                              box.offsets[1] + b) * shape[2] +
                             box.offsets[2] + c;
          ASSERT_EQ(got[i], static_cast<float>(at)) << a << "," << b << "," << c;
        }
      }
    }
  };
  const Shape shape = {3, 16, 512};
  struct Case {
    const char* what;
    Box box;
    int64_t calls;
    int64_t bytes;  // moved from the device
  } cases[] = {
      {"columns 128-383 of one matrix: one call of 16 rows of 1 KiB",
       Box{{1, 0, 128}, {1, 16, 256}}, 1, 16 * 256 * 4},
      {"the same columns of all three: one call per matrix",
       Box{{0, 0, 128}, {3, 16, 256}}, 3, 3 * 16 * 256 * 4},
      {"one column (rows of 4 bytes): the span, once",
       Box{{0, 0, 7}, {1, 16, 1}}, 1, (15 * 512 + 1) * 4},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    absl::StatusOr<TensorView> view = buf.View(shape).Slice(c.box);
    ASSERT_TRUE(view.ok()) << view.status();
    const int64_t calls = runtime_.copies();
    const int64_t bytes = runtime_.to_host_bytes();
    absl::StatusOr<Tensor> t = internal_cuda::CopyToHostTensor("w", *view);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(runtime_.copies() - calls, c.calls);
    EXPECT_EQ(runtime_.to_host_bytes() - bytes, c.bytes);
    EXPECT_EQ(runtime_.pending(), 0);
    EXPECT_EQ(t->shape(), c.box.sizes);
    expect_values(*t, shape, c.box);
  }
  // A failing copy names the tensor and leaves nothing in flight.
  runtime_.fail_copy = absl::InternalError("dma error");
  absl::StatusOr<TensorView> block =
      buf.View(shape).Slice(Box{{0, 0, 128}, {3, 16, 256}});
  ASSERT_TRUE(block.ok());
  absl::Status s = internal_cuda::CopyToHostTensor("opt.m", *block).status();
  runtime_.fail_copy = absl::OkStatus();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(s.message()), HasSubstr("opt.m: dma error"));
  EXPECT_EQ(runtime_.pending(), 0);
}

TEST_F(QueueCopyToDeviceTest, EmptyViewQueuesNothing) {
  DeviceBuffer buf(runtime_, 0, 8, 0);
  const float src = 1;
  EXPECT_TRUE(internal_cuda::QueueCopyToDeviceView(runtime_, "w", &src,
                                                   buf.View({0, 4}))
                  .ok());
  // No elements, so no pointer is needed either.
  EXPECT_TRUE(internal_cuda::QueueCopyToDeviceView(
                  runtime_, "w", nullptr,
                  TensorView(nullptr, DType::kF32, {3, 0}, Device::Cuda(0)))
                  .ok());
  EXPECT_EQ(runtime_.to_device_copies(), 0);
  EXPECT_EQ(runtime_.pending(), 0);
}

TEST_F(QueueCopyToDeviceTest, ErrorsNameTheTensor) {
  const std::string where = "model.w [0:8]";
  const std::vector<float> src = PackedSource(8);
  auto queue = [&](const TensorView& dst) {
    return internal_cuda::QueueCopyToDeviceView(runtime_, where, src.data(),
                                                dst);
  };
  auto expect_invalid = [&](const absl::Status& s, const std::string& what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(where));
    EXPECT_THAT(std::string(s.message()), HasSubstr(what));
  };
  std::vector<float> host(8);  // never registered
  DeviceBuffer on1(runtime_, 1, 8, 0);
  DeviceBuffer on0(runtime_, 0, 8, 0);
  expect_invalid(
      queue(TensorView(host.data(), DType::kF32, {8}, Device::Cuda(0))),
      "not memory of cuda:0");
  // Memory of another device.
  expect_invalid(queue(TensorView(on1.values.data(), DType::kF32, {8},
                                  Device::Cuda(0))),
                 "not memory of cuda:0");
  // Running past the end of the device allocation.
  expect_invalid(queue(on0.View({4}, 6)), "not memory of cuda:0");
  expect_invalid(queue(TensorView(host.data(), DType::kF32, {8})), "host");
  expect_invalid(queue(TensorView(on0.values.data() + 7, DType::kF32, {8},
                                  {-1}, Device::Cuda(0))),
                 "negative strides");
  expect_invalid(queue(TensorView(nullptr, DType::kF32, {8}, Device::Cuda(0))),
                 "pointer");
  EXPECT_EQ(runtime_.to_device_copies(), 0);

  // A call that would reach outside the device memory fails whole, and ends
  // the copy: for i = 0, elements (0,0) at 0 and (0,1) at 100 (outside the
  // 8 floats) are the rows of one call; i = 1 is never tried.
  expect_invalid(queue(TensorView(on0.values.data(), DType::kF32, {2, 2},
                                  {1, 100}, Device::Cuda(0))),
                 "not memory of cuda:0");
  EXPECT_EQ(runtime_.to_device_copies(), 0);
  EXPECT_EQ(runtime_.pending(), 0);
  ASSERT_TRUE(runtime_.Synchronize(Device::Cuda(0)).ok());

  runtime_.fail_copy_to_device = absl::InternalError("launch failure");
  absl::Status s = queue(on0.View({2, 4}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(s.message()), HasSubstr(where + ": launch failure"));
  EXPECT_EQ(runtime_.pending(), 0);
  runtime_.fail_copy_to_device = absl::OkStatus();
  EXPECT_TRUE(queue(on0.View({2, 4})).ok());
  EXPECT_EQ(runtime_.to_device_copies(), 1);
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

// ---- Loads into device tensors: pinned staging, then copies to the device.

// A host checkpoint of "a" [8, 8] = 1.., "b" [32] = 100.., "h" [3] = 7..,
// and an object.
std::string SaveHostModel(const TempDir& tmp) {
  static std::vector<float> a(64), b(32), h = {7, 8, 9};
  for (size_t i = 0; i < a.size(); ++i) a[i] = 1 + static_cast<float>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = 100 + static_cast<float>(i);
  StateDict sd;
  sd["a"] = TensorView(a.data(), DType::kF32, {8, 8});
  sd["b"] = TensorView(b.data(), DType::kF32, {32});
  sd["h"] = TensorView(h.data(), DType::kF32, {3});
  sd["note"] = Object{"hello"};
  const std::string dir = tmp.Sub("model");
  EXPECT_TRUE(Save(sd, dir).ok());
  return dir;
}

// Load of some of the host model's leaves into `dst` (a non-strict load).
absl::StatusOr<LoadResult> LoadSome(StateDict& dst, const std::string& dir) {
  LoadOptions o;
  o.strict = false;
  return Load(dst, dir, o);
}

TEST_F(DeviceStagingTest, LoadFillsDeviceTensorsThroughPinnedStaging) {
  TempDir tmp;
  const std::string dir = SaveHostModel(tmp);
  DeviceBuffer a(runtime_, 0, 64, -1);
  DeviceBuffer b(runtime_, 1, 32, -1);
  std::vector<float> h(3, -1);
  StateDict dst;
  dst["a"] = a.View({8, 8});
  dst["b"] = b.View({32});
  dst["h"] = TensorView(h.data(), DType::kF32, {3});
  dst["note"] = Object{};
  absl::StatusOr<LoadResult> r = Load(dst, dir);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 64; ++i) ASSERT_EQ(a.values[i], 1 + i) << i;
  for (int i = 0; i < 32; ++i) ASSERT_EQ(b.values[i], 100 + i) << i;
  EXPECT_EQ(h, (std::vector<float>{7, 8, 9}));
  EXPECT_EQ(dst.Find("note")->object()->bytes, "hello");
  // The device bytes went through the runtime (the fake's device memory is
  // host memory: a write straight into it would also give right values),
  // after the application's queued work on each device, and had landed when
  // Load returned; the pinned staging is freed.
  EXPECT_EQ(runtime_.to_device_bytes(), (64 + 32) * sizeof(float));
  EXPECT_EQ(r->device_bytes, (64 + 32) * sizeof(float));
  EXPECT_EQ(r->bytes_loaded, (64 + 32 + 3) * sizeof(float) + 5);
  EXPECT_EQ(runtime_.waits(0), 1);
  EXPECT_EQ(runtime_.waits(1), 1);
  EXPECT_EQ(runtime_.pending(), 0);
  EXPECT_GE(runtime_.pinned_allocations(), 1);
  EXPECT_EQ(runtime_.live_pinned(), 0);
  EXPECT_GE(r->chunks_verified, 3u);
}

TEST_F(DeviceStagingTest, LoadReshardsIntoStridedDeviceViews) {
  TempDir tmp;
  const std::string dir = SaveHostModel(tmp);
  // "a" split by columns over two devices: columns [0, 3) into a [8, 3]
  // device tensor, columns [3, 8) into a column slice of a [8, 10] device
  // buffer (a strided view: row stride 10), whose other columns must stay.
  DeviceBuffer left(runtime_, 0, 24, -1);
  DeviceBuffer wide(runtime_, 1, 80, -1);
  TensorView slice(wide.values.data() + 2, DType::kF32, {8, 5}, {10, 1},
                   Device::Cuda(1));
  StateDict dst;
  dst["a"] = ShardedTensor(DType::kF32, {8, 8},
                           {{Box{{0, 0}, {8, 3}}, left.View({8, 3})},
                            {Box{{0, 3}, {8, 5}}, slice}});
  absl::StatusOr<LoadResult> r = LoadSome(dst, dir);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 3; ++j) {
      ASSERT_EQ(left.values[i * 3 + j], 1 + i * 8 + j) << i << "," << j;
    }
    for (int j = 0; j < 10; ++j) {
      const float want = j >= 2 && j < 7
                             ? 1 + i * 8 + (j - 2 + 3)
                             : -1.0f + static_cast<float>(i * 10 + j);
      ASSERT_EQ(wide.values[i * 10 + j], want) << i << "," << j;
    }
  }
  EXPECT_EQ(runtime_.to_device_bytes(), 64 * sizeof(float));
  EXPECT_EQ(runtime_.pending(), 0);
  EXPECT_EQ(runtime_.live_pinned(), 0);
}

TEST_F(DeviceStagingTest, SmallBatchesTakeTwoPinnedBuffersInTurn) {
  // Twelve tensors of 40 floats and one of 400: with 256-byte batches, each
  // small tensor is a batch of its own and the large one seven (pieces of
  // 64 floats), so each staging buffer is refilled while the copies of the
  // batch before are in flight. The fake lands a copy only
  // at Synchronize, from whatever the staging holds then: a buffer refilled
  // before its copies were waited for shows up as wrong values.
  TempDir tmp;
  std::vector<std::vector<float>> src;
  StateDict sd;
  for (int t = 0; t < 13; ++t) {
    const size_t n = t == 6 ? 400 : 40;
    src.emplace_back(n);
    for (size_t i = 0; i < n; ++i) {
      src.back()[i] = t * 1000 + static_cast<float>(i);
    }
    sd[absl::StrCat("t", t)] = TensorView(src.back().data(), DType::kF32,
                                          {static_cast<int64_t>(n)});
  }
  ASSERT_TRUE(Save(sd, tmp.path()).ok());
  std::vector<std::unique_ptr<DeviceBuffer>> dev;
  StateDict dst;
  for (int t = 0; t < 13; ++t) {
    dev.push_back(
        std::make_unique<DeviceBuffer>(runtime_, t % 2, src[t].size(), -1));
    dst[absl::StrCat("t", t)] =
        dev.back()->View({static_cast<int64_t>(src[t].size())});
  }
  LoadOptions o;
  o.device_batch_bytes = 256;
  o.io_threads = 3;
  absl::StatusOr<LoadResult> r = Load(dst, tmp.path(), o);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int t = 0; t < 13; ++t) EXPECT_EQ(dev[t]->values, src[t]) << "t" << t;
  EXPECT_EQ(runtime_.pinned_allocations(), 2);
  EXPECT_EQ(runtime_.to_device_copies(), 12 + 7);
  EXPECT_EQ(runtime_.live_pinned(), 0);
  EXPECT_GT(r->phases.staging, 0.0);

  // Pinning the second buffer fails: the load fails naming the staging, the
  // first buffer is freed, and nothing was placed or stays in flight.
  for (auto& d : dev) std::fill(d->values.begin(), d->values.end(), -1.0f);
  runtime_.fail_pinned = absl::ResourceExhaustedError("no more pinned");
  runtime_.fail_pinned_after = runtime_.pinned_allocations() + 1;
  absl::Status second = Load(dst, tmp.path(), o).status();
  runtime_.fail_pinned = absl::OkStatus();
  runtime_.fail_pinned_after = 0;
  EXPECT_EQ(second.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(second.message()), HasSubstr("no more pinned"));
  EXPECT_THAT(std::string(second.message()),
              HasSubstr("pinned staging of 256 bytes"));
  EXPECT_EQ(runtime_.pinned_allocations(), 3);
  EXPECT_EQ(runtime_.live_pinned(), 0);
  EXPECT_EQ(runtime_.pending(), 0);
  EXPECT_EQ(runtime_.to_device_copies(), 12 + 7) << "no batch was placed";

  // The batches share one reader: its data file is opened (and its header
  // read and checked) once, not once per batch.
  internal_storage::FaultInjectionStorage counting(*Storage::Open(tmp.path()));
  for (auto& d : dev) std::fill(d->values.begin(), d->values.end(), -1.0f);
  r = internal_checkpoint::LoadFromStorage(dst, &counting, o);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int t = 0; t < 13; ++t) EXPECT_EQ(dev[t]->values, src[t]) << "t" << t;
  EXPECT_EQ(counting.calls(internal_storage::StorageOp::kOpenForRead), 2)
      << "metadata.json and the one data file";
}

TEST_F(DeviceStagingTest, ItemsLargerThanABatchAreStagedInPiecesAndChecked) {
  // With 4 KiB batches: "m" [10, 1000] floats (40,000 bytes) goes in pieces
  // of whole rows (one row, 4,000 bytes, each), "v" [5000] in 1024-element
  // ranges, and "c" [2, 3, 2000], whose rows are 8,000 bytes, in 1024-element
  // ranges of single rows. The pinned staging stays within a batch, every
  // element lands, and each chunk's CRC32C is checked across its pieces.
  TempDir tmp;
  std::vector<float> m(10 * 1000), v(5000), c(2 * 3 * 2000);
  for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<float>(i);
  for (size_t i = 0; i < v.size(); ++i) v[i] = -static_cast<float>(i);
  for (size_t i = 0; i < c.size(); ++i) c[i] = 0.5f + static_cast<float>(i);
  StateDict sd;
  sd["c"] = TensorView(c.data(), DType::kF32, {2, 3, 2000});
  sd["m"] = TensorView(m.data(), DType::kF32, {10, 1000});
  sd["v"] = TensorView(v.data(), DType::kF32, {5000});
  ASSERT_TRUE(Save(sd, tmp.path()).ok());
  DeviceBuffer dc(runtime_, 0, c.size(), 0);
  DeviceBuffer dm(runtime_, 0, m.size(), 0);
  DeviceBuffer dv(runtime_, 1, v.size(), 0);
  StateDict dst;
  dst["c"] = dc.View({2, 3, 2000});
  dst["m"] = dm.View({10, 1000});
  dst["v"] = dv.View({5000});
  LoadOptions o;
  o.device_batch_bytes = 4096;
  absl::StatusOr<LoadResult> r = Load(dst, tmp.path(), o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(dc.values, c);
  EXPECT_EQ(dm.values, m);
  EXPECT_EQ(dv.values, v);
  EXPECT_EQ(r->chunks_verified, 3u);
  EXPECT_EQ(r->device_bytes, (c.size() + m.size() + v.size()) * 4);
  EXPECT_LE(runtime_.largest_pinned_bytes(), 4096);
  // c: 2 x 3 rows of 2 pieces; m: 10 rows; v: 5 ranges.
  EXPECT_EQ(runtime_.to_device_copies(), 12 + 10 + 5);
  EXPECT_EQ(runtime_.live_pinned(), 0);

  // A byte flipped in m's sixth row: only the pieces' combined CRC32C can
  // see it (no single read covers the chunk).
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok()) << md.status();
  const ByteLocation& loc = md->tensors.at("m").chunks[0].location;
  ASSERT_TRUE(testing_util::FlipBits(tmp.path() + "/" + loc.file,
                                     loc.offset + 5 * 4000 + 17, 0x40)
                  .ok());
  absl::Status bad = Load(dst, tmp.path(), o).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("m [0:10, 0:1000]"));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("read in 10 pieces"));
  EXPECT_EQ(runtime_.pending(), 0);
  EXPECT_EQ(runtime_.live_pinned(), 0);
  // Without checksums the same load goes through (and takes the flip).
  o.verify_checksums = false;
  ASSERT_TRUE(Load(dst, tmp.path(), o).ok());
  EXPECT_NE(dm.values, m);
  EXPECT_EQ(dv.values, v);
}

TEST_F(DeviceStagingTest, ShardsOfOneChunkInSeveralBatchesAreCheckedTogether) {
  // Two device shards (rows 0-3 and 4-7) of "a", stored as one [8, 8] chunk,
  // with batches of one shard each: neither read covers the chunk, so only
  // the two pieces' combined CRC32C can check it.
  TempDir tmp;
  const std::string dir = SaveHostModel(tmp);
  DeviceBuffer a(runtime_, 0, 64, -1);
  StateDict dst;
  dst["a"] = ShardedTensor(DType::kF32, {8, 8},
                           {{Box{{4, 0}, {4, 8}}, a.View({4, 8}, 32)},
                            {Box{{0, 0}, {4, 8}}, a.View({4, 8})}});
  LoadOptions o;
  o.strict = false;
  o.device_batch_bytes = 4 * 8 * sizeof(float);
  absl::StatusOr<LoadResult> r = Load(dst, dir, o);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int i = 0; i < 64; ++i) ASSERT_EQ(a.values[i], 1 + i) << i;
  EXPECT_EQ(r->chunks_verified, 1u);
  EXPECT_EQ(runtime_.to_device_copies(), 2);

  absl::StatusOr<Metadata> md = ReadMetadata(dir);
  ASSERT_TRUE(md.ok()) << md.status();
  const ByteLocation& loc = md->tensors.at("a").chunks[0].location;
  ASSERT_TRUE(
      testing_util::FlipBits(dir + "/" + loc.file, loc.offset + 200, 0x01)
          .ok());
  absl::Status bad = Load(dst, dir, o).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("a [0:8, 0:8]"));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("read in 2 pieces"));
  EXPECT_EQ(runtime_.pending(), 0);
  EXPECT_EQ(runtime_.live_pinned(), 0);
}

TEST_F(DeviceStagingTest, LargeItemsSitInStagingAtTheirFilePageOffset) {
  // A cold read goes O_DIRECT only into an address with the file offset's
  // alignment, so a large item's staging slot starts at its file offset
  // modulo a page (small items just follow each other).
  TempDir tmp;
  std::vector<float> small(10, 1), big(64 << 10), rows(48 * 1000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = -static_cast<float>(i);
  StateDict sd;
  sd["a_small"] = TensorView(small.data(), DType::kF32, {10});
  sd["b_big"] = TensorView(big.data(), DType::kF32, {64 << 10});
  sd["c_rows"] = TensorView(rows.data(), DType::kF32, {48, 1000});
  ASSERT_TRUE(Save(sd, tmp.path()).ok());
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok()) << md.status();
  const uint64_t big_at = md->tensors.at("b_big").chunks[0].location.offset;
  const uint64_t rows_at = md->tensors.at("c_rows").chunks[0].location.offset;

  DeviceBuffer d_small(runtime_, 0, 10, 0);
  DeviceBuffer d_big(runtime_, 0, 64 << 10, 0);
  DeviceBuffer d_rows(runtime_, 0, 32 * 1000, 0);  // rows [16, 48)
  StateDict dst;
  dst["a_small"] = d_small.View({10});
  dst["b_big"] = d_big.View({64 << 10});
  dst["c_rows"] = ShardedTensor(DType::kF32, {48, 1000},
                                {{Box{{16, 0}, {32, 1000}},
                                  d_rows.View({32, 1000})}});
  absl::StatusOr<LoadResult> r = Load(dst, tmp.path());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(d_big.values, big);
  EXPECT_EQ(d_rows.values,
            std::vector<float>(rows.begin() + 16 * 1000, rows.end()));
  const std::vector<const void*> sources = runtime_.to_device_sources();
  ASSERT_EQ(sources.size(), 3u);
  auto page_offset = [](const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 4096;
  };
  // Plan order: a_small, b_big, c_rows (rows 16.. start 64,000 bytes into
  // the chunk, not a whole number of pages).
  EXPECT_EQ(page_offset(sources[1]), big_at % 4096);
  EXPECT_EQ(page_offset(sources[2]), (rows_at + 16 * 1000 * 4) % 4096);
  EXPECT_EQ(page_offset(sources[0]) % 64, 0u);
}

TEST_F(DeviceStagingTest,
       DeviceLoadFailuresNameTheTensorAndLeaveNothingInFlight) {
  TempDir tmp;
  const std::string dir = SaveHostModel(tmp);
  DeviceBuffer a(runtime_, 0, 64, -1);
  auto load = [&]() {
    StateDict dst;
    dst["a"] = a.View({8, 8});
    return LoadSome(dst, dir).status();
  };
  struct Case {
    absl::Status* inject;
    const char* error;  // what the runtime says
    const char* want;   // what the load's error must hold
  } cases[] = {
      {&runtime_.fail_copy_to_device, "device refused", "a [0:8, 0:8]"},
      {&runtime_.fail_sync, "sync failed", "sync failed"},
      {&runtime_.fail_pinned, "device refused", "pinned staging"},
      {&runtime_.fail_wait, "wait failed", "wait failed"},
  };
  for (const Case& c : cases) {
    *c.inject = absl::InternalError(c.error);
    absl::Status s = load();
    *c.inject = absl::OkStatus();
    EXPECT_FALSE(s.ok()) << c.want;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.want));
    EXPECT_EQ(runtime_.pending(), 0) << c.want;
    EXPECT_EQ(runtime_.live_pinned(), 0) << c.want;
  }
  // With nothing injected the same load succeeds.
  ASSERT_TRUE(load().ok());
  EXPECT_EQ(a.values[63], 64.0f);
}

TEST_F(DeviceStagingTest, LoadIntoHostMemoryLabelledAsDeviceNamesTheTensor) {
  TempDir tmp;
  const std::string dir = SaveHostModel(tmp);
  std::vector<float> host(64, -1);
  StateDict dst;
  dst["a"] = TensorView(host.data(), DType::kF32, {8, 8}, Device::Cuda(0));
  absl::Status s = LoadSome(dst, dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // One verdict for the one rank, naming the tensor, box and device.
  EXPECT_EQ(std::string(s.message()),
            absl::StrCat("load failed in reading on 1 of 1 ranks: rank 0: "
                         "INVALID_ARGUMENT: a [0:8, 0:8]: ",
                         absl::StrFormat("%p", host.data()),
                         " (+256 bytes) is not memory of cuda:0"));
  EXPECT_EQ(host, std::vector<float>(64, -1));
  EXPECT_EQ(runtime_.pending(), 0);
  EXPECT_EQ(runtime_.live_pinned(), 0);
}

TEST_F(DeviceStagingTest, ReversedDeviceViewIsRefusedNamingTheTensor) {
  // A device view with a negative stride (a reversed tensor): cairn copies
  // contiguous runs of non-negative strides only, and says so.
  TempDir tmp;
  const std::string dir = SaveHostModel(tmp);
  DeviceBuffer b(runtime_, 0, 32, -1);
  StateDict dst;
  dst["b"] = TensorView(b.values.data() + 31, DType::kF32, {32}, {-1},
                        Device::Cuda(0));
  absl::Status s = LoadSome(dst, dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("b [0:32]"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("negative strides"));
  EXPECT_EQ(b.values[0], -1.0f);
  EXPECT_EQ(runtime_.to_device_copies(), 0);
  EXPECT_EQ(runtime_.live_pinned(), 0);
}

TEST_F(DeviceStagingTest, LoadIntoADeviceThatDoesNotExistFailsAtPlanning) {
  TempDir tmp;
  const std::string dir = SaveHostModel(tmp);
  std::vector<float> host(32, -1);
  std::vector<float> nowhere(64, -1);
  StateDict dst;
  dst["a"] = TensorView(nowhere.data(), DType::kF32, {8, 8}, Device::Cuda(5));
  dst["b"] = TensorView(host.data(), DType::kF32, {32});
  absl::Status s = LoadSome(dst, dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("a shard"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("cuda:5"));
  // Planning failed: nothing was read into the host destination either.
  EXPECT_EQ(host, std::vector<float>(32, -1));
  EXPECT_EQ(runtime_.to_device_copies(), 0);
}

// Counts what the load asks of the planner.
class CountingPlanner : public DefaultLoadPlanner {
 public:
  CountingPlanner() : DefaultLoadPlanner(/*strict=*/false) {}
  absl::StatusOr<LoadPlan> FinishPlan(LoadPlan plan) override {
    items += plan.items.size();
    return DefaultLoadPlanner::FinishPlan(std::move(plan));
  }
  absl::StatusOr<Destination> ResolveDestination(
      const ReadItem& item) override {
    ++resolved;
    return DefaultLoadPlanner::ResolveDestination(item);
  }
  absl::Status CommitChunk(const ReadItem& item) override {
    ++committed;
    return DefaultLoadPlanner::CommitChunk(item);
  }
  size_t items = 0, resolved = 0, committed = 0;
};

TEST_F(DeviceStagingTest, EachDestinationIsResolvedAndCommittedOnce) {
  // A planner may do work per ResolveDestination (allocate, say): a device
  // load asks once per item, as a host load does.
  TempDir tmp;
  const std::string dir = SaveHostModel(tmp);
  DeviceBuffer a(runtime_, 0, 64, -1);
  std::vector<float> b(32, -1);
  StateDict dst;
  dst["a"] = ShardedTensor(DType::kF32, {8, 8},
                           {{Box{{0, 0}, {4, 8}}, a.View({4, 8})},
                            {Box{{4, 0}, {4, 8}}, a.View({4, 8}, 32)}});
  dst["b"] = TensorView(b.data(), DType::kF32, {32});
  CountingPlanner planner;
  LoadOptions o;
  o.planner = &planner;
  ASSERT_TRUE(Load(dst, dir, o).ok());
  EXPECT_EQ(planner.items, 3u);
  EXPECT_EQ(planner.resolved, 3u);
  EXPECT_EQ(planner.committed, 3u);
  EXPECT_EQ(a.values[63], 64.0f);
  EXPECT_EQ(b[31], 131.0f);
}

// Hands out destinations on cuda:5, a device the fake runtime does not
// have: a custom planner's device destinations are checked at the read.
class ElsewherePlanner : public DefaultLoadPlanner {
 public:
  ElsewherePlanner() : DefaultLoadPlanner(/*strict=*/false) {}
  absl::StatusOr<Destination> ResolveDestination(
      const ReadItem& item) override {
    CAIRN_ASSIGN_OR_RETURN(Destination d,
                           DefaultLoadPlanner::ResolveDestination(item));
    d.view = TensorView(d.view.data(), d.view.dtype(), d.view.shape(),
                        d.view.strides(), Device::Cuda(5));
    return d;
  }
};

TEST_F(DeviceStagingTest, CustomPlannersDeviceOnAMissingDeviceNamesTheItem) {
  TempDir tmp;
  const std::string dir = SaveHostModel(tmp);
  std::vector<float> a(64, -1);
  StateDict dst;
  dst["a"] = TensorView(a.data(), DType::kF32, {8, 8});
  ElsewherePlanner planner;
  LoadOptions o;
  o.planner = &planner;
  absl::Status s = Load(dst, dir, o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("a [0:8, 0:8]"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("cuda:5"));
  EXPECT_EQ(a, std::vector<float>(64, -1));
  EXPECT_EQ(runtime_.to_device_copies(), 0);
}

TEST_F(DeviceStagingTest, ReplicaGroupsBroadcastIntoDeviceTensors) {
  // Two ranks with the same plan form a replica group: each reads half the
  // items and broadcasts them; every rank's device tensors get every byte.
  TempDir tmp;
  const std::string dir = SaveHostModel(tmp);
  std::vector<std::unique_ptr<DeviceBuffer>> a, b;
  for (int r = 0; r < 2; ++r) {
    a.push_back(std::make_unique<DeviceBuffer>(runtime_, r, 64, -1));
    b.push_back(std::make_unique<DeviceBuffer>(runtime_, r, 32, -1));
  }
  std::vector<LoadResult> results(2);
  std::vector<absl::Status> st = RunInProcess(2, [&](Communicator& comm) {
    const int r = comm.rank();
    StateDict dst;
    dst["a"] = a[r]->View({8, 8});
    dst["b"] = b[r]->View({32});
    LoadOptions o;
    o.strict = false;
    o.comm = &comm;
    absl::StatusOr<LoadResult> res = Load(dst, dir, o);
    if (res.ok()) results[r] = *res;
    return res.status();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r];
    EXPECT_EQ(results[r].replica_group_size, 2);
    EXPECT_EQ(results[r].device_bytes, (64 + 32) * sizeof(float));
    for (int i = 0; i < 64; ++i) ASSERT_EQ(a[r]->values[i], 1 + i) << r;
    for (int i = 0; i < 32; ++i) ASSERT_EQ(b[r]->values[i], 100 + i) << r;
  }
  // Each stored byte was read by one of the two.
  EXPECT_EQ(results[0].bytes_read + results[1].bytes_read,
            (64 + 32) * sizeof(float));
  EXPECT_EQ(runtime_.to_device_bytes(), 2 * (64 + 32) * sizeof(float));
  EXPECT_EQ(runtime_.pending(), 0);
  EXPECT_EQ(runtime_.live_pinned(), 0);
}

}  // namespace
}  // namespace cairn
