// DeviceRuntime: the few device operations cairn needs to get tensors out of
// GPU memory (staging for async save, materializing for a synchronous save)
// and into it (loading a checkpoint into GPU tensors): pinned host buffers,
// a wait for the application's queued work, and device-to-host and
// host-to-device copies on cairn's own stream.
//
// The CUDA implementation (cuda_runtime.cc) is compiled only when the build
// has CAIRN_WITH_CUDA; everything else in cairn talks to this interface, so
// the same code paths run (and are tested, with a fake runtime that treats
// host memory as a device) on machines without a GPU.
//
// Thread safety: implementations are safe to call from several threads.
#ifndef CAIRN_CUDA_DEVICE_RUNTIME_H_
#define CAIRN_CUDA_DEVICE_RUNTIME_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/tensor.h"

namespace cairn::internal_cuda {

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  // "CUDA runtime 13.0, 1 device", for messages.
  virtual std::string Describe() const = 0;

  // kOk when `device` exists and can be used; else why not (no driver, no
  // such ordinal), naming the device.
  virtual absl::Status CheckDevice(Device device) = 0;

  // `bytes` of page-locked host memory that devices copy into at full
  // speed, freed when the last owner lets go. Any alignment of at least
  // 4096 bytes.
  virtual absl::StatusOr<std::shared_ptr<void>> AllocatePinned(
      size_t bytes) = 0;

  // Waits until all work queued on `device` so far, on any stream, is done:
  // the application's kernels that write the tensors about to be copied.
  virtual absl::Status WaitForDevice(Device device) = 0;

  // Queues a copy of `bytes` from device memory at `src` on `device` to host
  // memory at `dst`, on this runtime's own stream for `device`.
  // kInvalidArgument when `src` is not memory of `device`.
  virtual absl::Status CopyToHostAsync(Device device, const void* src,
                                       void* dst, size_t bytes) = 0;

  // Queues a copy of `rows` rows of `row_bytes` each from device memory,
  // where row k starts at src + k * src_pitch (src_pitch >= row_bytes), to
  // host memory at `dst`, packed one after another; otherwise as
  // CopyToHostAsync. One call for a strided block (columns of a matrix).
  virtual absl::Status CopyRowsToHostAsync(Device device, const void* src,
                                           size_t src_pitch, void* dst,
                                           size_t row_bytes, size_t rows) = 0;

  // Queues a copy of `bytes` from host memory at `src` to device memory at
  // `dst` on `device`, on this runtime's own stream for `device`. `src` must
  // stay valid and unchanged until Synchronize(device) returns (the copy may
  // read it any time before then). Pinned memory (AllocatePinned) copies at
  // full speed. kInvalidArgument when `dst` is not memory of `device`.
  virtual absl::Status CopyToDeviceAsync(Device device, const void* src,
                                         void* dst, size_t bytes) = 0;

  // Queues a copy of `rows` rows of `row_bytes` each, packed one after
  // another at `src` (host), to device memory where row k starts at
  // dst + k * dst_pitch (dst_pitch >= row_bytes); otherwise as
  // CopyToDeviceAsync. One call for a strided slice, such as a block of
  // columns of a matrix, that CopyToDeviceAsync would copy row by row.
  virtual absl::Status CopyRowsToDeviceAsync(Device device, const void* src,
                                             void* dst, size_t row_bytes,
                                             size_t rows,
                                             size_t dst_pitch) = 0;

  // Waits for every copy this runtime queued on `device`; returns the first
  // error any of them hit.
  virtual absl::Status Synchronize(Device device) = 0;
};

// The runtime for `device` (a kCuda device): the test override when one is
// set, else the CUDA runtime of a CAIRN_WITH_CUDA build after CheckDevice.
// kUnimplemented in a build without CUDA; kFailedPrecondition (with the
// driver's reason) when CUDA finds no usable device. Messages name the
// device.
absl::StatusOr<DeviceRuntime*> RuntimeFor(Device device);

// Whether this build has the CUDA runtime compiled in.
bool BuiltWithCuda();

// Tests: makes RuntimeFor return `runtime` for every device (nullptr
// restores the real one). Not for concurrent use with RuntimeFor.
void SetRuntimeForTesting(DeviceRuntime* runtime);

// Synchronous copy of a device view into a new contiguous host tensor (one
// copy of the view's byte span, then a host gather when the view is not
// contiguous). `where` prefixes errors (an FQN and box).
absl::StatusOr<Tensor> CopyToHostTensor(const std::string& where,
                                        const TensorView& device_view);

// Queues the copies that fill the device view `dst` from `src`, which holds
// dst.num_elements() elements of dst.dtype() packed row-major. `dst` may
// have any non-negative strides (a column slice of a device tensor, say);
// each contiguous run of it is one CopyToDeviceAsync, with the trailing
// dimensions merged as far as they are contiguous, so a contiguous `dst` is
// one copy and a column slice of R rows is R copies. Nothing lands before
// runtime.Synchronize(dst.device()), and `src` must stay valid and unchanged
// until then, also after an error (copies queued before it may be in
// flight). An empty view queues nothing. kInvalidArgument for a host `dst`,
// negative strides, or elements without a data pointer; every error is
// prefixed with `where` (an FQN and box).
absl::Status QueueCopyToDeviceView(DeviceRuntime& runtime,
                                   const std::string& where, const void* src,
                                   const TensorView& dst);

}  // namespace cairn::internal_cuda

#endif  // CAIRN_CUDA_DEVICE_RUNTIME_H_
