#include "cuda/device_runtime.h"

#include <atomic>

#include "absl/strings/str_format.h"
#include "core/status.h"
#include "core/strided.h"

namespace cairn::internal_cuda {

#ifdef CAIRN_HAVE_CUDA
// cuda_runtime.cc: the process-wide CUDA runtime.
DeviceRuntime* CudaRuntime();
#endif

namespace {
std::atomic<DeviceRuntime*> test_runtime{nullptr};
}  // namespace

bool BuiltWithCuda() {
#ifdef CAIRN_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

void SetRuntimeForTesting(DeviceRuntime* runtime) { test_runtime = runtime; }

absl::StatusOr<DeviceRuntime*> RuntimeFor(Device device) {
  if (device.is_cpu()) {
    return absl::InternalError("RuntimeFor called for host memory");
  }
  DeviceRuntime* runtime = test_runtime.load();
#ifdef CAIRN_HAVE_CUDA
  if (runtime == nullptr) runtime = CudaRuntime();
#endif
  if (runtime == nullptr) {
    return absl::UnimplementedError(absl::StrFormat(
        "tensor on %s, but this build of cairn has no CUDA support "
        "(configure with -DCAIRN_WITH_CUDA=ON where a CUDA toolkit is "
        "installed)",
        device.ToString()));
  }
  CAIRN_RETURN_IF_ERROR(runtime->CheckDevice(device));
  return runtime;
}

absl::StatusOr<Tensor> CopyToHostTensor(const std::string& where,
                                        const TensorView& view) {
  auto fail = [&](const absl::Status& s) {
    return internal_core::Annotate(s, where);
  };
  absl::StatusOr<DeviceRuntime*> runtime = RuntimeFor(view.device());
  if (!runtime.ok()) return fail(runtime.status());
  CAIRN_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(view.dtype(), view.shape()));
  if (view.num_elements() == 0) return out;
  if (view.data() == nullptr) {
    return fail(absl::InvalidArgumentError("the view has no data pointer"));
  }
  // The bytes from the view's first element to its last one.
  const size_t es = DTypeSize(view.dtype());
  uint64_t last = 0;
  for (int d = 0; d < view.rank(); ++d) {
    if (view.strides()[d] < 0) {
      return fail(absl::InvalidArgumentError("negative strides"));
    }
    last += static_cast<uint64_t>(view.shape()[d] - 1) *
            static_cast<uint64_t>(view.strides()[d]);
  }
  const size_t span = (last + 1) * es;
  const Device device = view.device();
  if (absl::Status s = (*runtime)->WaitForDevice(device); !s.ok()) {
    return fail(s);
  }
  if (view.is_contiguous()) {
    absl::Status s =
        (*runtime)->CopyToHostAsync(device, view.data(), out.data(), span);
    if (s.ok()) s = (*runtime)->Synchronize(device);
    if (!s.ok()) return fail(s);
    return out;
  }
  // Strided: copy the whole span once (one large DMA beats many small
  // ones), then gather the elements on the host.
  CAIRN_ASSIGN_OR_RETURN(
      Tensor staging, Tensor::Empty(DType::kU8, {static_cast<int64_t>(span)}));
  absl::Status s =
      (*runtime)->CopyToHostAsync(device, view.data(), staging.data(), span);
  if (s.ok()) s = (*runtime)->Synchronize(device);
  if (!s.ok()) return fail(s);
  internal_core::CopyView(
      TensorView(staging.data(), view.dtype(), view.shape(), view.strides()),
      out.view());
  return out;
}

}  // namespace cairn::internal_cuda
