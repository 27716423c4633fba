#include "cairn/dlpack.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace cairn {
namespace {

DLTensor MakeDL(void* data, std::vector<int64_t>& shape, DLDataType dtype,
                int64_t* strides = nullptr,
                DLDevice device = DLDevice{kDLCPU, 0}) {
  DLTensor t{};
  t.data = data;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  t.dtype = dtype;
  t.shape = shape.data();
  t.strides = strides;
  t.byte_offset = 0;
  return t;
}

TEST(DLPackTest, DTypeMapping) {
  struct Case {
    uint8_t code;
    uint8_t bits;
    DType dtype;
  };
  const Case cases[] = {
      {kDLFloat, 64, DType::kF64}, {kDLFloat, 32, DType::kF32},
      {kDLFloat, 16, DType::kF16}, {kDLBfloat, 16, DType::kBF16},
      {10, 8, DType::kF8_E4M3},    {12, 8, DType::kF8_E5M2},
      {kDLInt, 64, DType::kI64},   {kDLInt, 32, DType::kI32},
      {kDLInt, 16, DType::kI16},   {kDLInt, 8, DType::kI8},
      {kDLUInt, 64, DType::kU64},  {kDLUInt, 32, DType::kU32},
      {kDLUInt, 16, DType::kU16},  {kDLUInt, 8, DType::kU8},
      {6, 8, DType::kBool},        {14, 8, DType::kF8_E8M0},
      {kDLComplex, 64, DType::kC64},
  };
  // Every dtype but the packed ones (F4 pairs, F6 quads), which DLPack has
  // no code for: ToDLPack refuses them by name.
  ASSERT_EQ(std::size(cases) + 3, AllDTypes().size());
  for (DType packed :
       {DType::kF4_X2, DType::kF6_E2M3_X4, DType::kF6_E3M2_X4}) {
    char bytes[3] = {};
    absl::StatusOr<DLManagedTensor*> refused =
        ToDLPack(TensorView(bytes, packed, {1}));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
        << DTypeName(packed);
  }
  char data[8];
  std::vector<int64_t> shape = {1};
  for (const Case& c : cases) {
    auto view = FromDLPack(MakeDL(data, shape, DLDataType{c.code, c.bits, 1}));
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->dtype(), c.dtype) << DTypeName(c.dtype);
    // And back.
    auto managed = ToDLPack(*view);
    ASSERT_TRUE(managed.ok());
    EXPECT_EQ((*managed)->dl_tensor.dtype.code, c.code) << DTypeName(c.dtype);
    EXPECT_EQ((*managed)->dl_tensor.dtype.bits, c.bits);
    EXPECT_EQ((*managed)->dl_tensor.dtype.lanes, 1);
    (*managed)->deleter(*managed);
  }
}

TEST(DLPackTest, UnsupportedDTypeIsInvalidArgument) {
  char data[16];
  std::vector<int64_t> shape = {1};
  const DLDataType bad[] = {
      {kDLComplex, 128, 1}, {kDLOpaqueHandle, 64, 1}, {kDLFloat, 8, 1},
      {kDLInt, 4, 1},      {kDLBfloat, 32, 1},       {6, 1, 1},  // 1-bit bool
      {7, 8, 1},                                                 // float8_e3m4
  };
  for (const DLDataType& t : bad) {
    EXPECT_EQ(FromDLPack(MakeDL(data, shape, t)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << int{t.code} << "/" << int{t.bits};
  }
}

TEST(DLPackTest, LanesOtherThanOneAreRejected) {
  float data[8];
  std::vector<int64_t> shape = {2};
  EXPECT_EQ(FromDLPack(MakeDL(data, shape, DLDataType{kDLFloat, 32, 4}))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DLPackTest, NullStridesMeanRowMajor) {
  float data[6];
  std::vector<int64_t> shape = {2, 3};
  auto view = FromDLPack(MakeDL(data, shape, DLDataType{kDLFloat, 32, 1}));
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->data(), data);
  EXPECT_EQ(view->shape(), (Shape{2, 3}));
  EXPECT_EQ(view->strides(), (std::vector<int64_t>{3, 1}));
  EXPECT_TRUE(view->device().is_cpu());
}

TEST(DLPackTest, ExplicitStridesAndByteOffset) {
  int32_t data[20];
  std::vector<int64_t> shape = {3, 2};
  int64_t strides[] = {1, 5};
  DLTensor t = MakeDL(data, shape, DLDataType{kDLInt, 32, 1}, strides);
  t.byte_offset = 8;
  auto view = FromDLPack(t);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->data(), &data[2]);
  EXPECT_EQ(view->strides(), (std::vector<int64_t>{1, 5}));
  EXPECT_FALSE(view->is_contiguous());
}

TEST(DLPackTest, NegativeStridesAreRejected) {
  float data[6];
  std::vector<int64_t> shape = {2, 3};
  int64_t strides[] = {3, -1};
  EXPECT_EQ(
      FromDLPack(MakeDL(data, shape, DLDataType{kDLFloat, 32, 1}, strides))
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(DLPackTest, MalformedTensorsAreRejected) {
  float data[6];
  std::vector<int64_t> shape = {2, -3};
  EXPECT_EQ(FromDLPack(MakeDL(data, shape, DLDataType{kDLFloat, 32, 1}))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<int64_t> ok_shape = {2, 3};
  DLTensor null_shape = MakeDL(data, ok_shape, DLDataType{kDLFloat, 32, 1});
  null_shape.shape = nullptr;
  EXPECT_EQ(FromDLPack(null_shape).status().code(),
            absl::StatusCode::kInvalidArgument);
  DLTensor null_data = MakeDL(nullptr, ok_shape, DLDataType{kDLFloat, 32, 1});
  EXPECT_EQ(FromDLPack(null_data).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DLPackTest, Devices) {
  float data[1];
  std::vector<int64_t> shape = {1};
  const DLDataType f32{kDLFloat, 32, 1};
  auto host = FromDLPack(MakeDL(data, shape, f32, nullptr, {kDLCUDAHost, 0}));
  ASSERT_TRUE(host.ok());
  EXPECT_TRUE(host->device().is_cpu());
  auto cuda = FromDLPack(MakeDL(data, shape, f32, nullptr, {kDLCUDA, 2}));
  ASSERT_TRUE(cuda.ok());
  EXPECT_EQ(cuda->device(), Device::Cuda(2));
  EXPECT_EQ(FromDLPack(MakeDL(data, shape, f32, nullptr, {kDLOpenCL, 0}))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FromDLPack(MakeDL(data, shape, f32, nullptr, {kDLROCM, 0}))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DLPackTest, RankZero) {
  double x = 1.5;
  std::vector<int64_t> shape;
  DLTensor t = MakeDL(&x, shape, DLDataType{kDLFloat, 64, 1});
  t.shape = nullptr;
  auto view = FromDLPack(t);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->rank(), 0);
  EXPECT_EQ(view->num_elements(), 1);
  auto managed = ToDLPack(*view);
  ASSERT_TRUE(managed.ok());
  EXPECT_EQ((*managed)->dl_tensor.ndim, 0);
  EXPECT_NE((*managed)->dl_tensor.shape, nullptr);
  (*managed)->deleter(*managed);
}

TEST(DLPackTest, ToDLPackDescribesView) {
  int16_t data[12];
  TensorView v(data, DType::kI16, {3, 2}, {4, 1}, Device::Cuda(1));
  auto managed = ToDLPack(v);
  ASSERT_TRUE(managed.ok());
  const DLTensor& t = (*managed)->dl_tensor;
  EXPECT_EQ(t.data, data);
  EXPECT_EQ(t.byte_offset, 0u);
  EXPECT_EQ(t.ndim, 2);
  EXPECT_EQ(t.shape[0], 3);
  EXPECT_EQ(t.shape[1], 2);
  EXPECT_EQ(t.strides[0], 4);
  EXPECT_EQ(t.strides[1], 1);
  EXPECT_EQ(t.device.device_type, kDLCUDA);
  EXPECT_EQ(t.device.device_id, 1);
  // Round trip.
  auto back = FromDLPack(t);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->shape(), v.shape());
  EXPECT_EQ(back->strides(), v.strides());
  EXPECT_EQ(back->device(), v.device());
  (*managed)->deleter(*managed);
}

TEST(DLPackTest, ToDLPackOfTensorKeepsBufferAlive) {
  auto tensor = Tensor::Zeros(DType::kF32, {4});
  ASSERT_TRUE(tensor.ok());
  std::weak_ptr<void> weak = tensor->buffer();
  auto managed = ToDLPack(*tensor);
  ASSERT_TRUE(managed.ok());
  *tensor = Tensor();
  EXPECT_FALSE(weak.expired());
  static_cast<float*>((*managed)->dl_tensor.data)[3] = 1.0f;  // still valid
  (*managed)->deleter(*managed);
  EXPECT_TRUE(weak.expired());
}

TEST(DLPackTest, ToDLPackWithOwnerReinterpretsAndKeepsOwnerAlive) {
  auto tensor = Tensor::Zeros(DType::kBF16, {2, 3});
  ASSERT_TRUE(tensor.ok());
  std::weak_ptr<void> weak = tensor->buffer();
  // The bytes of a BF16 tensor as U16, as the Python module hands them out.
  TensorView bits(tensor->data(), DType::kU16, tensor->shape());
  auto managed = ToDLPack(bits, tensor->buffer());
  ASSERT_TRUE(managed.ok());
  *tensor = Tensor();
  EXPECT_FALSE(weak.expired());
  EXPECT_EQ((*managed)->dl_tensor.dtype.code, kDLUInt);
  EXPECT_EQ((*managed)->dl_tensor.dtype.bits, 16);
  EXPECT_EQ((*managed)->dl_tensor.shape[1], 3);
  (*managed)->deleter(*managed);
  EXPECT_TRUE(weak.expired());
}

}  // namespace
}  // namespace cairn
