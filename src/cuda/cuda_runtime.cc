// The CUDA implementation of DeviceRuntime (built only with CAIRN_WITH_CUDA).
// Plain host C++ against the CUDA runtime API: no kernels, so no nvcc.
//
// Each device gets one non-blocking stream of cairn's own, created on first
// use, so cairn's copies never queue behind (or in front of) the
// application's work on the legacy default stream. Calls switch to the
// device they concern and switch the calling thread back afterwards.
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <cstdint>
#include <map>
#include <mutex>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "cuda/device_runtime.h"

namespace cairn::internal_cuda {
namespace {

absl::Status CudaError(cudaError_t err, const char* call, Device device) {
  return absl::InternalError(absl::StrFormat("%s on %s: %s (%s)", call,
                                             device.ToString(),
                                             cudaGetErrorString(err),
                                             cudaGetErrorName(err)));
}

// Makes `device` current for the scope, restoring the caller's device.
class DeviceScope {
 public:
  explicit DeviceScope(Device device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = cudaSetDevice(device.index);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = -1;
  cudaError_t status_ = cudaSuccess;
};

class CudaDeviceRuntime final : public DeviceRuntime {
 public:
  CudaDeviceRuntime() {
    // Without a driver or a GPU this fails (error 35, "insufficient
    // driver", or 100, "no device") and leaves the count untouched.
    count_error_ = cudaGetDeviceCount(&device_count_);
    if (count_error_ != cudaSuccess) device_count_ = 0;
    cudaRuntimeGetVersion(&runtime_version_);
  }

  std::string Describe() const override {
    return absl::StrFormat("CUDA runtime %d.%d, %d device(s)",
                           runtime_version_ / 1000,
                           (runtime_version_ % 1000) / 10, device_count_);
  }

  absl::Status CheckDevice(Device device) override {
    if (count_error_ != cudaSuccess) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "tensor on %s, but CUDA finds no usable GPU: cudaGetDeviceCount: "
          "%s (%s)",
          device.ToString(), cudaGetErrorString(count_error_),
          cudaGetErrorName(count_error_)));
    }
    if (device.index < 0 || device.index >= device_count_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tensor on %s, but this machine has %d CUDA device(s)",
          device.ToString(), device_count_));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<void>> AllocatePinned(size_t bytes) override {
    if (std::shared_ptr<void> huge = AllocatePinnedHuge(bytes)) return huge;
    void* p = nullptr;
    // Portable: usable from every device's stream.
    const cudaError_t err =
        cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable);
    if (err != cudaSuccess) {
      return absl::ResourceExhaustedError(
          absl::StrFormat("cudaHostAlloc of %d pinned bytes: %s", bytes,
                          cudaGetErrorString(err)));
    }
    return std::shared_ptr<void>(p, [](void* q) { cudaFreeHost(q); });
  }

  absl::Status WaitForDevice(Device device) override {
    DeviceScope scope(device);
    if (scope.status() != cudaSuccess) {
      return CudaError(scope.status(), "cudaSetDevice", device);
    }
    if (cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {
      return CudaError(err, "cudaDeviceSynchronize", device);
    }
    return absl::OkStatus();
  }

  absl::Status CopyToHostAsync(Device device, const void* src, void* dst,
                               size_t bytes) override {
    CAIRN_RETURN_IF_ERROR(CheckDeviceMemory(device, src));
    return QueueCopy(device, src, dst, bytes, cudaMemcpyDeviceToHost);
  }

  absl::Status CopyToDeviceAsync(Device device, const void* src, void* dst,
                                 size_t bytes) override {
    CAIRN_RETURN_IF_ERROR(CheckDeviceMemory(device, dst));
    return QueueCopy(device, src, dst, bytes, cudaMemcpyHostToDevice);
  }

  absl::Status CopyRowsToDeviceAsync(Device device, const void* src,
                                     void* dst, size_t row_bytes, size_t rows,
                                     size_t dst_pitch) override {
    CAIRN_RETURN_IF_ERROR(CheckDeviceMemory(device, dst));
    return QueueRows(device, src, row_bytes, dst, dst_pitch, row_bytes, rows,
                     cudaMemcpyHostToDevice);
  }

  absl::Status CopyRowsToHostAsync(Device device, const void* src,
                                   size_t src_pitch, void* dst,
                                   size_t row_bytes, size_t rows) override {
    CAIRN_RETURN_IF_ERROR(CheckDeviceMemory(device, src));
    return QueueRows(device, src, src_pitch, dst, row_bytes, row_bytes, rows,
                     cudaMemcpyDeviceToHost);
  }

  absl::Status Synchronize(Device device) override {
    DeviceScope scope(device);
    if (scope.status() != cudaSuccess) {
      return CudaError(scope.status(), "cudaSetDevice", device);
    }
    absl::StatusOr<cudaStream_t> stream = StreamFor(device);
    if (!stream.ok()) return stream.status();
    if (cudaError_t err = cudaStreamSynchronize(*stream); err != cudaSuccess) {
      return CudaError(err, "cudaStreamSynchronize", device);
    }
    return absl::OkStatus();
  }

 private:
  // A view labelled cuda:N must point into memory of device N; a copy from
  // or to anywhere else would touch the wrong bytes or fault.
  static absl::Status CheckDeviceMemory(Device device, const void* p) {
    cudaPointerAttributes attr{};
    if (cudaError_t err = cudaPointerGetAttributes(&attr, p);
        err != cudaSuccess) {
      cudaGetLastError();  // so that a later call does not report it again
      return CudaError(err, "cudaPointerGetAttributes", device);
    }
    if ((attr.type != cudaMemoryTypeDevice &&
         attr.type != cudaMemoryTypeManaged) ||
        attr.device != device.index) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "a view on %s points at %p, which is not memory of that device "
          "(CUDA memory type %d on device %d)",
          device.ToString(), p, static_cast<int>(attr.type), attr.device));
    }
    return absl::OkStatus();
  }

  // A buffer of 2 MiB or more: anonymous memory on 2 MiB boundaries that
  // asks for transparent huge pages, then pinned with cudaHostRegister
  // (portable). Reads from the page cache into it (a load's staging) and
  // the driver's pinning then walk 2 MiB pages instead of 4 KiB ones where
  // the kernel grants them. Null where any step fails (the caller falls
  // back to cudaHostAlloc).
  static std::shared_ptr<void> AllocatePinnedHuge(size_t bytes) {
    constexpr size_t kHuge = size_t{2} << 20;
    if (bytes < kHuge) return nullptr;
    const size_t len = (bytes + kHuge - 1) / kHuge * kHuge;
    void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    // Trim to a 2 MiB-aligned [p, p + len).
    const auto start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
    if (aligned > start) munmap(raw, aligned - start);
    const uintptr_t end = start + len + kHuge;
    if (end > aligned + len) {
      munmap(reinterpret_cast<void*>(aligned + len), end - (aligned + len));
    }
    void* p = reinterpret_cast<void*>(aligned);
    madvise(p, len, MADV_HUGEPAGE);  // advice: no error matters
    if (cudaHostRegister(p, len, cudaHostRegisterPortable) != cudaSuccess) {
      cudaGetLastError();  // so that a later call does not report it again
      munmap(p, len);
      return nullptr;
    }
    return std::shared_ptr<void>(p, [len](void* q) {
      cudaHostUnregister(q);
      munmap(q, len);
    });
  }

  // Queues cudaMemcpyAsync on cairn's stream for `device`.
  absl::Status QueueCopy(Device device, const void* src, void* dst,
                         size_t bytes, cudaMemcpyKind kind) {
    DeviceScope scope(device);
    if (scope.status() != cudaSuccess) {
      return CudaError(scope.status(), "cudaSetDevice", device);
    }
    absl::StatusOr<cudaStream_t> stream = StreamFor(device);
    if (!stream.ok()) return stream.status();
    if (cudaError_t err = cudaMemcpyAsync(dst, src, bytes, kind, *stream);
        err != cudaSuccess) {
      return CudaError(err, "cudaMemcpyAsync", device);
    }
    return absl::OkStatus();
  }

  // Queues cudaMemcpy2DAsync of `rows` rows of `row_bytes` on cairn's
  // stream for `device`. Pitches over the device's maximum
  // (cudaDevAttrMaxPitch, 2^31 - 1 on current GPUs) go row by row.
  absl::Status QueueRows(Device device, const void* src, size_t src_pitch,
                         void* dst, size_t dst_pitch, size_t row_bytes,
                         size_t rows, cudaMemcpyKind kind) {
    constexpr size_t kMaxPitch = (size_t{1} << 31) - 1;
    if (rows == 1 || src_pitch > kMaxPitch || dst_pitch > kMaxPitch) {
      const auto* from = static_cast<const char*>(src);
      auto* to = static_cast<char*>(dst);
      for (size_t k = 0; k < rows; ++k) {
        CAIRN_RETURN_IF_ERROR(QueueCopy(device, from + k * src_pitch,
                                        to + k * dst_pitch, row_bytes, kind));
      }
      return absl::OkStatus();
    }
    DeviceScope scope(device);
    if (scope.status() != cudaSuccess) {
      return CudaError(scope.status(), "cudaSetDevice", device);
    }
    absl::StatusOr<cudaStream_t> stream = StreamFor(device);
    if (!stream.ok()) return stream.status();
    if (cudaError_t err = cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch,
                                            row_bytes, rows, kind, *stream);
        err != cudaSuccess) {
      return CudaError(err, "cudaMemcpy2DAsync", device);
    }
    return absl::OkStatus();
  }

  // The current device must be `device`.
  absl::StatusOr<cudaStream_t> StreamFor(Device device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(device.index);
    if (it != streams_.end()) return it->second;
    cudaStream_t stream = nullptr;
    if (cudaError_t err =
            cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        err != cudaSuccess) {
      return CudaError(err, "cudaStreamCreateWithFlags", device);
    }
    // Kept for the life of the process (destroying streams at exit races
    // the CUDA runtime's own teardown).
    streams_[device.index] = stream;
    return stream;
  }

  cudaError_t count_error_ = cudaSuccess;
  int device_count_ = 0;
  int runtime_version_ = 0;
  std::mutex mu_;
  std::map<int, cudaStream_t> streams_;
};

}  // namespace

DeviceRuntime* CudaRuntime() {
  static CudaDeviceRuntime* runtime = new CudaDeviceRuntime();  // never freed
  return runtime;
}

}  // namespace cairn::internal_cuda
