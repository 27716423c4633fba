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

absl::Status QueueCopyToDeviceView(DeviceRuntime& runtime,
                                   const std::string& where, const void* src,
                                   const TensorView& dst) {
  auto fail = [&](const absl::Status& s) {
    return internal_core::Annotate(s, where);
  };
  if (dst.device().is_cpu()) {
    return fail(absl::InvalidArgumentError(
        "a copy to a device was given a host view"));
  }
  for (int64_t stride : dst.strides()) {
    if (stride < 0) return fail(absl::InvalidArgumentError("negative strides"));
  }
  if (dst.num_elements() == 0) return absl::OkStatus();
  if (dst.data() == nullptr || src == nullptr) {
    return fail(absl::InvalidArgumentError(absl::StrFormat(
        "a copy of %d elements to %s without a %s pointer",
        dst.num_elements(), dst.device().ToString(),
        dst.data() == nullptr ? "destination" : "source")));
  }
  // Each cudaMemcpyAsync costs microseconds, so copy in runs as long as the
  // view allows: the innermost dimensions join the run for as long as each
  // one's stride equals the elements already in it. The dimensions left
  // outside are loops over runs. Dimensions of size 1 do not matter (their
  // stride is never used).
  const int64_t es = static_cast<int64_t>(DTypeSize(dst.dtype()));
  int64_t run_elements = 1;
  int d = dst.rank() - 1;
  for (; d >= 0; --d) {
    if (dst.shape()[d] == 1) continue;
    if (dst.strides()[d] != run_elements) break;
    run_elements *= dst.shape()[d];
  }
  internal_core::RunPattern runs;
  runs.run_bytes = run_elements * es;
  for (int i = 0; i <= d; ++i) {
    if (dst.shape()[i] == 1) continue;
    runs.counts.push_back(dst.shape()[i]);
    runs.strides.push_back(dst.strides()[i] * es);
  }
  // The innermost loop over runs becomes rows of one CopyRowsToDeviceAsync
  // (cudaMemcpy2DAsync) when its runs do not overlap: a column slice of a
  // matrix is one call, not one per row. ForEachRun nests the loops left
  // outermost first, so it visits the rows in the view's row-major order:
  // the order they lie in, packed, in `src`.
  const auto* from = static_cast<const char*>(src);
  auto* base = static_cast<char*>(dst.data());
  const size_t run_bytes = static_cast<size_t>(runs.run_bytes);
  size_t rows = 1;
  size_t pitch = run_bytes;
  if (!runs.counts.empty() && runs.strides.back() >= runs.run_bytes) {
    rows = static_cast<size_t>(runs.counts.back());
    pitch = static_cast<size_t>(runs.strides.back());
    runs.counts.pop_back();
    runs.strides.pop_back();
  }
  absl::Status status;
  internal_core::ForEachRun(runs, [&](int64_t offset) {
    if (!status.ok()) return;  // ForEachRun cannot stop early
    status = rows == 1
                 ? runtime.CopyToDeviceAsync(dst.device(), from, base + offset,
                                             run_bytes)
                 : runtime.CopyRowsToDeviceAsync(dst.device(), from,
                                                 base + offset, run_bytes,
                                                 rows, pitch);
    from += rows * run_bytes;
  });
  return fail(status);
}

}  // namespace cairn::internal_cuda
