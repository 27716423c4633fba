#include "cairn/tensor.h"

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace cairn {
namespace {

TEST(TensorTest, DeviceToString) {
  EXPECT_EQ(Device::Cpu().ToString(), "cpu");
  EXPECT_EQ(Device::Cuda(3).ToString(), "cuda:3");
  EXPECT_TRUE(Device::Cpu().is_cpu());
  EXPECT_FALSE(Device::Cuda(0).is_cpu());
}

TEST(TensorTest, ContiguousStrides) {
  struct Case {
    Shape shape;
    std::vector<int64_t> strides;
  };
  const Case cases[] = {
      {{}, {}},
      {{5}, {1}},
      {{2, 3, 4}, {12, 4, 1}},
      {{2, 0, 4}, {4, 4, 1}},  // zero dims stride like size 1
      {{1, 1}, {1, 1}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(ContiguousStrides(c.shape), c.strides);
  }
}

TEST(TensorTest, ViewBasics) {
  float data[6];
  TensorView v(data, DType::kF32, {2, 3});
  EXPECT_EQ(v.data(), data);
  EXPECT_EQ(v.rank(), 2);
  EXPECT_EQ(v.num_elements(), 6);
  EXPECT_EQ(v.nbytes(), 24u);
  EXPECT_EQ(v.strides(), (std::vector<int64_t>{3, 1}));
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_TRUE(v.device().is_cpu());
}

TEST(TensorTest, MismatchedStridesFallBackToContiguous) {
  float data[6];
  TensorView v(data, DType::kF32, {2, 3}, {1});
  EXPECT_EQ(v.strides(), (std::vector<int64_t>{3, 1}));
}

TEST(TensorTest, IsContiguous) {
  struct Case {
    Shape shape;
    std::vector<int64_t> strides;
    bool contiguous;
  };
  const Case cases[] = {
      {{2, 3}, {3, 1}, true},
      {{2, 3}, {1, 2}, false},   // transposed
      {{2, 3}, {4, 1}, false},   // padded rows
      {{1, 3}, {999, 1}, true},  // size-1 dims may have any stride
      {{2, 1, 3}, {3, 7, 1}, true},
      {{0, 3}, {5, 9}, true},  // empty
      {{}, {}, true},
      {{4}, {2}, false},
  };
  for (const Case& c : cases) {
    TensorView v(nullptr, DType::kU8, c.shape, c.strides);
    EXPECT_EQ(v.is_contiguous(), c.contiguous)
        << testing::PrintToString(c.shape) << testing::PrintToString(c.strides);
  }
}

TEST(TensorTest, SliceOffsetsDataAndKeepsStrides) {
  std::vector<int32_t> data(4 * 5);
  std::iota(data.begin(), data.end(), 0);
  TensorView v(data.data(), DType::kI32, {4, 5});
  auto s = v.Slice(Box{{1, 2}, {2, 3}});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->shape(), (Shape{2, 3}));
  EXPECT_EQ(s->strides(), (std::vector<int64_t>{5, 1}));
  EXPECT_EQ(*static_cast<int32_t*>(s->data()), 7);
  EXPECT_FALSE(s->is_contiguous());
  // Slicing a slice composes.
  auto s2 = s->Slice(Box{{1, 1}, {1, 2}});
  ASSERT_TRUE(s2.ok());
  EXPECT_EQ(*static_cast<int32_t*>(s2->data()), 13);
}

TEST(TensorTest, SliceOutsideShapeIsInvalidArgument) {
  int32_t data[4];
  TensorView v(data, DType::kI32, {2, 2});
  EXPECT_EQ(v.Slice(Box{{1, 1}, {2, 1}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(v.Slice(Box{{0}, {1}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TensorTest, EmptySliceKeepsBasePointer) {
  int32_t data[4];
  TensorView v(data, DType::kI32, {2, 2});
  auto s = v.Slice(Box{{2, 0}, {0, 2}});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->num_elements(), 0);
  EXPECT_EQ(s->data(), data);
}

TEST(TensorTest, EmptyIsAlignedAndSized) {
  auto t = Tensor::Empty(DType::kBF16, {3, 1000});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data()) % 4096, 0u);
  EXPECT_EQ(t->nbytes(), 6000u);
  EXPECT_EQ(t->shape(), (Shape{3, 1000}));
  EXPECT_EQ(t->dtype(), DType::kBF16);
  EXPECT_TRUE(t->view().is_contiguous());
  EXPECT_EQ(t->buffer().get(), t->data());
}

TEST(TensorTest, ZeroElementTensorHasData) {
  auto t = Tensor::Empty(DType::kF32, {0, 5});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->nbytes(), 0u);
  EXPECT_NE(t->data(), nullptr);
}

TEST(TensorTest, ZerosIsZero) {
  auto t = Tensor::Zeros(DType::kF64, {17, 3});
  ASSERT_TRUE(t.ok());
  const auto* p = static_cast<const unsigned char*>(t->data());
  for (size_t i = 0; i < t->nbytes(); ++i) ASSERT_EQ(p[i], 0) << i;
}

TEST(TensorTest, EmptyRejectsBadShapes) {
  EXPECT_EQ(Tensor::Empty(DType::kF32, {-1, 3}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tensor::Empty(DType::kF32, {int64_t{1} << 40, int64_t{1} << 40})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Elements fit in int64 but bytes do not.
  EXPECT_EQ(Tensor::Empty(DType::kF64, {int64_t{1} << 62}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TensorTest, CopiesShareTheBuffer) {
  auto t = Tensor::Zeros(DType::kU8, {8});
  ASSERT_TRUE(t.ok());
  Tensor copy = *t;
  EXPECT_EQ(copy.data(), t->data());
  EXPECT_EQ(copy.buffer().use_count(), 2);
}

TEST(TensorTest, CopyOfStridedViewIsContiguous) {
  std::vector<int16_t> data(6 * 7);
  std::iota(data.begin(), data.end(), 0);
  TensorView v(data.data(), DType::kI16, {6, 7});
  // Transposed 3x4 sub-view: rows 1..4, cols 2..5, then swap axes.
  auto s = v.Slice(Box{{1, 2}, {4, 3}});
  ASSERT_TRUE(s.ok());
  TensorView t(s->data(), DType::kI16, {3, 4}, {1, 7});
  auto copy = Tensor::CopyOf(t);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_TRUE(copy->view().is_contiguous());
  EXPECT_NE(copy->data(), data.data());
  const auto* out = static_cast<const int16_t*>(copy->data());
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(out[i * 4 + j], data[(1 + j) * 7 + (2 + i)]) << i << "," << j;
    }
  }
}

TEST(TensorTest, CopyOfRankZeroAndEmpty) {
  double x = 2.5;
  auto scalar = Tensor::CopyOf(TensorView(&x, DType::kF64, {}));
  ASSERT_TRUE(scalar.ok());
  EXPECT_EQ(*static_cast<double*>(scalar->data()), 2.5);
  auto empty = Tensor::CopyOf(TensorView(nullptr, DType::kF64, {3, 0}));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->nbytes(), 0u);
}

TEST(TensorTest, CopyOfDeviceViewIsInvalidArgument) {
  TensorView v(reinterpret_cast<void*>(0x1000), DType::kF32, {4},
               Device::Cuda(0));
  EXPECT_EQ(Tensor::CopyOf(v).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cairn
