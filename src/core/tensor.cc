// TensorView and Tensor.
#include "cairn/tensor.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/aligned_buffer.h"
#include "core/status.h"
#include "core/strided.h"

namespace cairn {
namespace {

// Byte size of a tensor of `shape` and `dtype`, or kInvalidArgument when the
// shape has a negative dimension or the size overflows.
absl::StatusOr<size_t> CheckedNumBytes(DType dtype, const Shape& shape) {
  int64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor shape [",
                                                     absl::StrJoin(shape, ", "),
                                                     "] has a negative size"));
    }
    // max(d, 1): a zero dimension must not hide an overflow elsewhere.
    if (__builtin_mul_overflow(elements, std::max<int64_t>(d, 1), &elements)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor shape [", absl::StrJoin(shape, ", "), "] is too large"));
    }
  }
  size_t bytes;
  if (__builtin_mul_overflow(static_cast<size_t>(NumElements(shape)),
                             DTypeSize(dtype), &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor shape [", absl::StrJoin(shape, ", "), "] is too large"));
  }
  return bytes;
}

}  // namespace

std::string Device::ToString() const {
  if (type == Type::kCuda) return absl::StrCat("cuda:", index);
  return "cpu";
}

// Dimensions of size 0 or 1 count as 1 (like PyTorch), so the strides stay
// meaningful for empty tensors. Saturates instead of overflowing: a shape
// that large is rejected wherever it is allocated or validated.
std::vector<int64_t> ContiguousStrides(const Shape& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    if (__builtin_mul_overflow(stride, std::max<int64_t>(shape[i], 1),
                               &stride)) {
      stride = std::numeric_limits<int64_t>::max();
    }
  }
  return strides;
}

TensorView::TensorView(void* data, DType dtype, Shape shape, Device device)
    : data_(data),
      dtype_(dtype),
      shape_(std::move(shape)),
      strides_(ContiguousStrides(shape_)),
      device_(device) {}

// A strides vector of the wrong length is a programming error, but a
// constructor cannot report it and cairn must not crash on it, so the view
// falls back to contiguous strides (the layout callers almost always mean).
// Negative strides are outside the contract; they are kept as given, and
// FromDLPack rejects them before a view is ever made from foreign memory.
TensorView::TensorView(void* data, DType dtype, Shape shape,
                       std::vector<int64_t> strides, Device device)
    : data_(data),
      dtype_(dtype),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      device_(device) {
  if (strides_.size() != shape_.size()) strides_ = ContiguousStrides(shape_);
}

size_t TensorView::nbytes() const {
  return static_cast<size_t>(num_elements()) * DTypeSize(dtype_);
}

bool TensorView::is_contiguous() const {
  if (num_elements() == 0) return true;
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

absl::StatusOr<TensorView> TensorView::Slice(const Box& box) const {
  CAIRN_RETURN_IF_ERROR(ValidateBox(box, shape_));
  // An empty slice touches no memory; keep the base pointer rather than
  // computing one that may lie past the end of the buffer.
  int64_t offset = 0;
  if (!box.empty()) {
    for (size_t i = 0; i < shape_.size(); ++i) {
      offset += box.offsets[i] * strides_[i];
    }
  }
  void* data = data_;
  if (offset != 0 && data_ != nullptr) {
    data = static_cast<char*>(data_) +
           offset * static_cast<int64_t>(DTypeSize(dtype_));
  }
  return TensorView(data, dtype_, box.sizes, strides_, device_);
}

absl::StatusOr<Tensor> Tensor::Empty(DType dtype, Shape shape) {
  CAIRN_ASSIGN_OR_RETURN(size_t bytes, CheckedNumBytes(dtype, shape));
  // Zero-byte tensors still get a (tiny) buffer so data() is never null.
  CAIRN_ASSIGN_OR_RETURN(
      std::shared_ptr<void> buffer,
      internal_core::AllocateAligned(std::max<size_t>(bytes, 1)));
  Tensor t;
  t.view_ = TensorView(buffer.get(), dtype, std::move(shape));
  t.buffer_ = std::move(buffer);
  return t;
}

absl::StatusOr<Tensor> Tensor::Zeros(DType dtype, Shape shape) {
  CAIRN_ASSIGN_OR_RETURN(Tensor t, Empty(dtype, std::move(shape)));
  std::memset(t.data(), 0, t.nbytes());
  return t;
}

absl::StatusOr<Tensor> Tensor::CopyOf(const TensorView& view) {
  if (!view.device().is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Tensor::CopyOf needs host memory, got a view on ",
                     view.device().ToString()));
  }
  CAIRN_ASSIGN_OR_RETURN(Tensor t, Empty(view.dtype(), view.shape()));
  if (t.nbytes() == 0) return t;
  if (view.data() == nullptr) {
    return absl::InvalidArgumentError(
        "Tensor::CopyOf: view has elements but a null data pointer");
  }
  const auto elem = static_cast<int64_t>(DTypeSize(view.dtype()));
  const int rank = view.rank();
  std::vector<int64_t> src_strides(rank), dst_strides(rank);
  const std::vector<int64_t> contiguous = ContiguousStrides(view.shape());
  for (int i = 0; i < rank; ++i) {
    src_strides[i] = view.strides()[i] * elem;
    dst_strides[i] = contiguous[i] * elem;
  }
  internal_core::CopyStrided(view.data(), src_strides.data(), t.data(),
                             dst_strides.data(), view.shape().data(), rank,
                             static_cast<size_t>(elem));
  return t;
}

}  // namespace cairn
