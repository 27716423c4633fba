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

namespace {

// A strided view's elements as blocks of rows for 2-D copies: contiguous
// runs of `row_bytes` (the innermost dimensions, joined for as long as each
// one's stride equals the elements already in the run; dimensions of size 1
// do not matter), `rows` of them `pitch` bytes apart (the next dimension
// out, when its runs do not overlap), and the blocks at the byte offsets
// `outer` visits, in the view's row-major order.
struct RowBlocks {
  size_t row_bytes = 0;
  size_t rows = 1;
  size_t pitch = 0;
  internal_core::RunPattern outer;
};

RowBlocks RowBlocksOf(const TensorView& view) {
  const int64_t es = static_cast<int64_t>(DTypeSize(view.dtype()));
  int64_t run_elements = 1;
  int d = view.rank() - 1;
  for (; d >= 0; --d) {
    if (view.shape()[d] == 1) continue;
    if (view.strides()[d] != run_elements) break;
    run_elements *= view.shape()[d];
  }
  RowBlocks b;
  b.row_bytes = static_cast<size_t>(run_elements * es);
  b.pitch = b.row_bytes;
  b.outer.run_bytes = run_elements * es;
  for (int i = 0; i <= d; ++i) {
    if (view.shape()[i] == 1) continue;
    b.outer.counts.push_back(view.shape()[i]);
    b.outer.strides.push_back(view.strides()[i] * es);
  }
  if (!b.outer.counts.empty() && b.outer.strides.back() >= b.outer.run_bytes) {
    b.rows = static_cast<size_t>(b.outer.counts.back());
    b.pitch = static_cast<size_t>(b.outer.strides.back());
    b.outer.counts.pop_back();
    b.outer.strides.pop_back();
  }
  return b;
}

}  // namespace

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
  // Strided with rows of 512 bytes or more (a block of columns): one 2-D
  // copy per block straight into the packed tensor, moving only the view's
  // bytes. Shorter rows: copy the whole span once (one large DMA beats many
  // tiny rows), then gather the elements on the host.
  constexpr size_t kMinRowBytes = 512;
  if (const RowBlocks b = RowBlocksOf(view);
      b.rows > 1 && b.row_bytes >= kMinRowBytes) {
    const auto* base = static_cast<const char*>(view.data());
    auto* to = static_cast<char*>(out.data());
    absl::Status s;
    internal_core::ForEachRun(b.outer, [&](int64_t offset) {
      if (!s.ok()) return;  // ForEachRun cannot stop early
      s = (*runtime)->CopyRowsToHostAsync(device, base + offset, b.pitch, to,
                                          b.row_bytes, b.rows);
      to += b.rows * b.row_bytes;
    });
    // Queued copies finish before `out` is returned or freed.
    absl::Status synced = (*runtime)->Synchronize(device);
    if (s.ok()) s = synced;
    if (!s.ok()) return fail(s);
    return out;
  }
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
  // Each cudaMemcpyAsync costs microseconds: one CopyRowsToDeviceAsync
  // (cudaMemcpy2DAsync) per block of rows, so a column slice of a matrix is
  // one call, not one per row. ForEachRun visits the blocks in the view's
  // row-major order: the order they lie in, packed, in `src`.
  const RowBlocks b = RowBlocksOf(dst);
  const auto* from = static_cast<const char*>(src);
  auto* base = static_cast<char*>(dst.data());
  absl::Status status;
  internal_core::ForEachRun(b.outer, [&](int64_t offset) {
    if (!status.ok()) return;  // ForEachRun cannot stop early
    status = b.rows == 1
                 ? runtime.CopyToDeviceAsync(dst.device(), from, base + offset,
                                             b.row_bytes)
                 : runtime.CopyRowsToDeviceAsync(dst.device(), from,
                                                 base + offset, b.row_bytes,
                                                 b.rows, b.pitch);
    from += b.rows * b.row_bytes;
  });
  return fail(status);
}

}  // namespace cairn::internal_cuda
