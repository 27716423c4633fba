// TensorView: a non-owning, possibly strided view of tensor memory.
// Tensor: an owning tensor in aligned host memory.
//
// Strides are in elements, not bytes (like PyTorch and DLPack). A view never
// owns its memory: whoever made it keeps the memory alive while cairn uses it.
// Thread safety: views and tensors are values; concurrent reads are safe, and
// writes to the underlying memory are the caller's to order.
#ifndef CAIRN_TENSOR_H_
#define CAIRN_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/box.h"
#include "cairn/dtype.h"

namespace cairn {

// Where tensor memory lives.
struct Device {
  enum class Type : uint8_t { kCpu, kCuda };
  Type type = Type::kCpu;
  int index = 0;  // Device ordinal for kCuda; 0 for kCpu.

  static Device Cpu() { return {}; }
  static Device Cuda(int index) { return {Type::kCuda, index}; }
  bool is_cpu() const { return type == Type::kCpu; }
  // "cpu" or "cuda:N".
  std::string ToString() const;
  friend bool operator==(const Device&, const Device&) = default;
};

// Row-major (C-order) strides, in elements, of a contiguous tensor of `shape`.
std::vector<int64_t> ContiguousStrides(const Shape& shape);

class TensorView {
 public:
  TensorView() = default;
  // A contiguous row-major view of `shape` at `data`.
  TensorView(void* data, DType dtype, Shape shape,
             Device device = Device::Cpu());
  // A strided view; `strides` are in elements, one per dimension, and may
  // not be negative. A `strides` of the wrong length is a programming error;
  // since a constructor cannot fail, the view then uses contiguous strides.
  TensorView(void* data, DType dtype, Shape shape, std::vector<int64_t> strides,
             Device device = Device::Cpu());

  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  Device device() const { return device_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t num_elements() const { return NumElements(shape_); }
  // Bytes of the elements (num_elements * DTypeSize), not of the span the
  // strides cover.
  size_t nbytes() const;
  // True when the elements are row-major and adjacent (dimensions of size 1
  // may have any stride).
  bool is_contiguous() const;

  // The sub-view of the elements in `box` (coordinates relative to this
  // view). kInvalidArgument when `box` is not inside shape().
  absl::StatusOr<TensorView> Slice(const Box& box) const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Shape shape_;
  std::vector<int64_t> strides_;
  Device device_;
};

// An owning, contiguous host tensor. Its buffer is aligned to 4096 bytes (so
// it can take O_DIRECT reads) and large buffers ask for transparent huge
// pages. Copies share the buffer (like a shared_ptr); use Clone() for a deep
// copy.
class Tensor {
 public:
  Tensor() = default;

  // Uninitialised memory. kResourceExhausted if it cannot be allocated.
  static absl::StatusOr<Tensor> Empty(DType dtype, Shape shape);
  // Zero-filled memory.
  static absl::StatusOr<Tensor> Zeros(DType dtype, Shape shape);
  // A contiguous deep copy of `view` (host memory only).
  static absl::StatusOr<Tensor> CopyOf(const TensorView& view);

  const TensorView& view() const { return view_; }
  void* data() const { return view_.data(); }
  DType dtype() const { return view_.dtype(); }
  const Shape& shape() const { return view_.shape(); }
  size_t nbytes() const { return view_.nbytes(); }
  // The shared buffer; keeps the memory alive while held.
  const std::shared_ptr<void>& buffer() const { return buffer_; }

 private:
  std::shared_ptr<void> buffer_;
  TensorView view_;
};

}  // namespace cairn

#endif  // CAIRN_TENSOR_H_
