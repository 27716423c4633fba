// Binary encodings of what ranks send each other during a save or a load:
// local and final plans. Compact (fixed-width
// little-endian integers, length-prefixed strings) because the coordinator
// receives one per rank; decoded with bounds checks on every field, so a
// damaged or mismatched message is an error, never a read outside the
// buffer.
#ifndef CAIRN_PLAN_PLAN_CODEC_H_
#define CAIRN_PLAN_PLAN_CODEC_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/planner.h"
#include "core/byte_codec.h"

namespace cairn::internal_plan {

// Without scalar values, only each scalar's type is kept (decoded as a
// default value of that type): the plan cache compares structure, not
// values, and values travel at commit. `prefix` (e.g. a message header)
// goes first; the result is built in one allocation, reserved up front
// (the coordinator encodes millions of items).
std::string EncodeSavePlan(const SavePlan& plan, bool with_scalar_values,
                           std::string_view prefix = {});
absl::StatusOr<SavePlan> DecodeSavePlan(std::string_view data,
                                        std::string_view what);

std::string EncodeLoadPlan(const LoadPlan& plan);
absl::StatusOr<LoadPlan> DecodeLoadPlan(std::string_view data,
                                        std::string_view what);

}  // namespace cairn::internal_plan

#endif  // CAIRN_PLAN_PLAN_CODEC_H_
