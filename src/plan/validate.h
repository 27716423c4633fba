// Checks of a state dict's shards shared by the save and load planners.
#ifndef CAIRN_PLAN_VALIDATE_H_
#define CAIRN_PLAN_VALIDATE_H_

#include <string>

#include "absl/status/status.h"
#include "cairn/state_dict.h"

namespace cairn::internal_plan {

// OK when `shard` of tensor `fqn` can be saved from or loaded into: its box
// lies inside the tensor, its view has the box's shape and the tensor's
// dtype, and has data; and, unless `allow_device`, the view is host memory.
// Errors name the FQN and the box.
absl::Status ValidateShard(const std::string& fqn, const ShardedTensor& t,
                           const Shard& shard, bool allow_device = false);

// kInvalidArgument naming `fqn` when a tensor of a packed dtype (several
// values an element: F4_X2, F6) has no dimension: its safetensors entry
// counts values along the last one, so a scalar would read back as [n].
// ValidateShard checks it, and the save's global planning again for
// plans of any planner.
absl::Status ValidatePackedShape(const std::string& fqn, DType dtype,
                                 const Shape& shape);

// OK for a host shard; for a device shard, OK when this build and machine
// can copy to and from its device (internal_cuda::RuntimeFor), else that
// error naming the FQN and the box. The planners call it so that a save or
// load fails at planning, before any byte is written or read.
absl::Status CheckDeviceRuntime(const std::string& fqn, const Shard& shard);

}  // namespace cairn::internal_plan

#endif  // CAIRN_PLAN_VALIDATE_H_
