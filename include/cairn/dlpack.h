// Exchange of tensors with frameworks (PyTorch, JAX, NumPy, CuPy) through
// DLPack. Debian 12 ships DLPack 0.6, which has no bool or float8 type codes;
// cairn uses the codes later DLPack versions assign (kDLBool = 6,
// kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12) so exchange with newer
// frameworks works.
#ifndef CAIRN_DLPACK_H_
#define CAIRN_DLPACK_H_

#include <dlpack/dlpack.h>

#include <memory>

#include "absl/status/statusor.h"
#include "cairn/tensor.h"

namespace cairn {

// A view of the memory `tensor` describes (honouring byte_offset and strides;
// null strides mean row-major). Ownership stays with the producer.
// kInvalidArgument for an unsupported dtype, lanes != 1, negative strides or
// an unsupported device type (cpu, cuda and cuda-host are supported).
absl::StatusOr<TensorView> FromDLPack(const DLTensor& tensor);

// A DLManagedTensor describing `view`. The caller (the consumer) calls its
// deleter when done; the deleter frees only the shape/stride arrays, so the
// view's memory must outlive the consumer's use.
absl::StatusOr<DLManagedTensor*> ToDLPack(const TensorView& view);

// Like ToDLPack(view), but the managed tensor keeps `tensor`'s buffer alive
// until its deleter runs.
absl::StatusOr<DLManagedTensor*> ToDLPack(const Tensor& tensor);

// Like ToDLPack(view), but the managed tensor holds `owner` (e.g. the buffer
// of a Tensor of which `view` reinterprets the bytes) until its deleter runs.
absl::StatusOr<DLManagedTensor*> ToDLPack(const TensorView& view,
                                          std::shared_ptr<void> owner);

}  // namespace cairn

#endif  // CAIRN_DLPACK_H_
