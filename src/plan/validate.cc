// Checks shared by save and load.
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "plan/validate.h"
#include "core/status.h"
#include "cuda/device_runtime.h"

namespace cairn::internal_plan {

absl::Status ValidatePackedShape(const std::string& fqn, DType dtype,
                                 const Shape& shape) {
  if (DTypeValues(dtype) > 1 && shape.empty()) {
    // Its safetensors entry counts values along the last dimension.
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: a %s tensor holds %d values an element and needs a dimension "
        "to count them; give it shape [1]",
        fqn, DTypeName(dtype), DTypeValues(dtype)));
  }
  return absl::OkStatus();
}

absl::Status ValidateShard(const std::string& fqn, const ShardedTensor& t,
                           const Shard& shard, bool allow_device) {
  const std::string where = absl::StrCat(fqn, " shard ", shard.box.ToString());
  CAIRN_RETURN_IF_ERROR(ValidatePackedShape(fqn, t.dtype(), t.global_shape()));
  CAIRN_RETURN_IF_ERROR(
      internal_core::Annotate(ValidateBox(shard.box, t.global_shape()), where));
  const TensorView& v = shard.view;
  if (!allow_device && !v.device().is_cpu()) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: tensor on %s; this build saves and loads host memory only",
        where, v.device().ToString()));
  }
  if (v.dtype() != t.dtype()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: view dtype %s differs from tensor dtype %s", where,
        DTypeName(v.dtype()), DTypeName(t.dtype())));
  }
  if (v.shape() != shard.box.sizes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: view shape [%s] differs from box sizes", where,
        absl::StrJoin(v.shape(), ", ")));
  }
  if (v.data() == nullptr && v.num_elements() > 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: view has no data pointer", where));
  }
  return absl::OkStatus();
}

absl::Status CheckDeviceRuntime(const std::string& fqn, const Shard& shard) {
  if (shard.view.device().is_cpu()) return absl::OkStatus();
  return internal_core::Annotate(
      internal_cuda::RuntimeFor(shard.view.device()).status(),
      absl::StrCat(fqn, " shard ", shard.box.ToString()));
}

}  // namespace cairn::internal_plan
