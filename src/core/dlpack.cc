// DLPack exchange. The DLPack 0.6 header Debian ships predates bool and
// float8, so their type codes are spelled out here with the values later
// DLPack releases assign; a DLPack 1.x producer or consumer sees the same
// numbers.
#include "cairn/dlpack.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace cairn {
namespace {

constexpr uint8_t kDLBoolCode = 6;
constexpr uint8_t kDLFloat8E4M3FnCode = 10;
constexpr uint8_t kDLFloat8E5M2Code = 12;
constexpr uint8_t kDLFloat8E8M0FnuCode = 14;

struct DLTypeMapping {
  DType dtype;
  uint8_t code;
  uint8_t bits;
};

constexpr DLTypeMapping kDLTypes[] = {
    {DType::kF64, kDLFloat, 64},
    {DType::kF32, kDLFloat, 32},
    {DType::kF16, kDLFloat, 16},
    {DType::kBF16, kDLBfloat, 16},
    {DType::kF8_E4M3, kDLFloat8E4M3FnCode, 8},
    {DType::kF8_E5M2, kDLFloat8E5M2Code, 8},
    {DType::kI64, kDLInt, 64},
    {DType::kI32, kDLInt, 32},
    {DType::kI16, kDLInt, 16},
    {DType::kI8, kDLInt, 8},
    {DType::kU64, kDLUInt, 64},
    {DType::kU32, kDLUInt, 32},
    {DType::kU16, kDLUInt, 16},
    {DType::kU8, kDLUInt, 8},
    {DType::kBool, kDLBoolCode, 8},
    {DType::kF8_E8M0, kDLFloat8E8M0FnuCode, 8},
    {DType::kC64, kDLComplex, 64},
};

absl::StatusOr<DType> DTypeFromDL(DLDataType t) {
  if (t.lanes != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DLPack tensors with vector lanes are not supported (lanes=",
        int{t.lanes}, ")"));
  }
  for (const DLTypeMapping& m : kDLTypes) {
    if (m.code == t.code && m.bits == t.bits) return m.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported DLPack dtype (code=", int{t.code},
                   ", bits=", int{t.bits}, ")"));
}

absl::StatusOr<DLDataType> DTypeToDL(DType dtype) {
  for (const DLTypeMapping& m : kDLTypes) {
    if (m.dtype == dtype) return DLDataType{m.code, m.bits, 1};
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "dtype ", static_cast<int>(dtype), " has no DLPack equivalent"));
}

// Owns what a DLManagedTensor points to: the shape and stride arrays and,
// optionally, the tensor's buffer.
struct ManagerContext {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  std::shared_ptr<void> owner;
};

void DeleteManaged(DLManagedTensor* self) {
  if (self == nullptr) return;
  delete static_cast<ManagerContext*>(self->manager_ctx);
}

absl::StatusOr<DLManagedTensor*> MakeManaged(const TensorView& view,
                                             std::shared_ptr<void> owner) {
  auto ctx = std::make_unique<ManagerContext>();
  DLTensor& t = ctx->managed.dl_tensor;
  auto dl_dtype = DTypeToDL(view.dtype());
  if (!dl_dtype.ok()) return dl_dtype.status();
  t.dtype = *dl_dtype;
  if (view.device().is_cpu()) {
    t.device = DLDevice{kDLCPU, 0};
  } else {
    t.device = DLDevice{kDLCUDA, view.device().index};
  }
  ctx->shape = view.shape();
  ctx->strides = view.strides();
  t.data = view.data();
  t.byte_offset = 0;
  t.ndim = view.rank();
  // Consumers index shape/strides even for rank 0 in some versions; never
  // hand them a null pointer.
  if (ctx->shape.empty()) {
    ctx->shape.reserve(1);
    ctx->strides.reserve(1);
  }
  t.shape = ctx->shape.data();
  t.strides = ctx->strides.data();
  ctx->owner = std::move(owner);
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = &DeleteManaged;
  return &ctx.release()->managed;
}

}  // namespace

absl::StatusOr<TensorView> FromDLPack(const DLTensor& tensor) {
  auto dtype = DTypeFromDL(tensor.dtype);
  if (!dtype.ok()) return dtype.status();

  Device device;
  switch (tensor.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:  // pinned host memory: plain CPU memory to cairn
      device = Device::Cpu();
      break;
    case kDLCUDA:
      device = Device::Cuda(tensor.device.device_id);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unsupported DLPack device type ",
                       static_cast<int>(tensor.device.device_type)));
  }

  if (tensor.ndim < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DLPack tensor has negative ndim ", tensor.ndim));
  }
  if (tensor.ndim > 0 && tensor.shape == nullptr) {
    return absl::InvalidArgumentError("DLPack tensor has a null shape");
  }
  Shape shape(tensor.shape, tensor.shape + tensor.ndim);
  int64_t elements = 1;
  for (int i = 0; i < tensor.ndim; ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DLPack tensor has negative size ", shape[i], " in dimension ", i));
    }
    if (__builtin_mul_overflow(elements, std::max<int64_t>(shape[i], 1),
                               &elements)) {
      return absl::InvalidArgumentError(
          "DLPack tensor's element count overflows int64");
    }
  }
  std::vector<int64_t> strides;
  if (tensor.strides == nullptr) {
    strides = ContiguousStrides(shape);
  } else {
    strides.assign(tensor.strides, tensor.strides + tensor.ndim);
    for (int i = 0; i < tensor.ndim; ++i) {
      if (strides[i] < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("DLPack tensor has negative stride ", strides[i],
                         " in dimension ", i,
                         "; negative strides are not "
                         "supported"));
      }
    }
  }
  if (tensor.data == nullptr && NumElements(shape) > 0) {
    return absl::InvalidArgumentError(
        "DLPack tensor has elements but a null data pointer");
  }
  if (tensor.byte_offset >
      static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DLPack byte_offset ", tensor.byte_offset, " is out of range"));
  }
  void* data = tensor.data;
  if (data != nullptr && tensor.byte_offset != 0) {
    data = static_cast<char*>(data) + tensor.byte_offset;
  }
  return TensorView(data, *dtype, std::move(shape), std::move(strides), device);
}

absl::StatusOr<DLManagedTensor*> ToDLPack(const TensorView& view) {
  return MakeManaged(view, nullptr);
}

absl::StatusOr<DLManagedTensor*> ToDLPack(const Tensor& tensor) {
  return MakeManaged(tensor.view(), tensor.buffer());
}

absl::StatusOr<DLManagedTensor*> ToDLPack(const TensorView& view,
                                          std::shared_ptr<void> owner) {
  return MakeManaged(view, std::move(owner));
}

}  // namespace cairn
