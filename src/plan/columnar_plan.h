// The save coordinator's global planning for the default planner, on flat
// arrays. PlanGlobalSave (global_plan.h) decodes every rank's local plan
// into WriteItems (a heap string and three heap vectors each), moves them
// through dedup and reads them back to encode the final plans: at 16k ranks
// x 500 tensors that is 8M items, some 2 GB of small allocations that the
// kernel faults in one page at a time. The columnar path never builds a
// WriteItem: it reads the encoded local plans in place (an item is the
// offsets of its fields in its rank's message, its FQN an id into a table of
// distinct names), deduplicates, checks and builds the skeleton from those,
// and encodes a final plan by copying its items' bytes out of the local
// plans (a final item's encoding is the local item's, byte for byte).
//
// Its results are those of PlanGlobalSave with a DefaultSavePlanner of the
// same policy, byte for byte: final-plan messages, skeleton and refs. It
// does not report errors of its own: anything wrong or unusual in the input
// (a failed check, a malformed message, a plan with scalar values) makes it
// return a non-OK status that only means "use PlanGlobalSave", which names
// what is wrong (PlanGlobalSaveDispatch does that).
#ifndef CAIRN_PLAN_COLUMNAR_PLAN_H_
#define CAIRN_PLAN_COLUMNAR_PLAN_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/planner.h"
#include "plan/global_plan.h"

namespace cairn::internal_plan {

// The steps of PlanGlobalSaveColumnar, public so that the scale simulator
// can time each. Holds views into `encoded`, which must outlive it.
class ColumnarPlans {
 public:
  ColumnarPlans(ColumnarPlans&&) noexcept;
  ColumnarPlans& operator=(ColumnarPlans&&) noexcept;
  ~ColumnarPlans();

  // Reads every rank's encoded local plan, interning FQNs, and runs the
  // checks of ValidateLocalPlans on the items as they are read.
  static absl::StatusOr<ColumnarPlans> Decode(
      const std::vector<std::string>& encoded);
  // DedupImpl's choice of the items each rank writes.
  void Dedup(DedupPolicy policy);
  // BuildMetadataSkeleton of the final plans. After Dedup.
  absl::StatusOr<MetadataSkeleton> BuildSkeleton() const;
  // ValidateFinalPlans' checks of the final plans, given their skeleton
  // (coverage is checked on its chunks).
  absl::Status ValidateFinal(const MetadataSkeleton& skeleton,
                             bool require_coverage) const;
  // EncodedGlobalPlan::payloads, built in the strings of `encoded` (the
  // vector Decode read), which are moved out where items were dropped (a
  // rank with none dropped gets `prefix` alone, its string is left as it
  // was); this object is left empty.
  std::vector<std::string> EncodeFinals(std::vector<std::string>& encoded,
                                        std::string_view prefix);

 private:
  struct State;
  explicit ColumnarPlans(std::unique_ptr<State> state);
  std::string CopyFinal(size_t rank, std::string_view prefix) const;
  std::unique_ptr<State> s_;
};

// PlanGlobalSave for a DefaultSavePlanner with `policy`, on flat arrays. A
// non-OK status means only that this input needs PlanGlobalSave, and
// leaves `encoded` as it was; on success its strings have become the
// payloads (the final plans are built in place).
absl::StatusOr<EncodedGlobalPlan> PlanGlobalSaveColumnar(
    std::vector<std::string>& encoded, DedupPolicy policy,
    bool require_coverage, std::string_view prefix);

// What the save coordinator calls: PlanGlobalSaveColumnar when
// `default_policy` is set (the caller has checked that `planner` is exactly
// a DefaultSavePlanner with that policy; a subclass may override
// CreateGlobalPlan) and it can plan the input, otherwise PlanGlobalSave,
// whose errors are the ones reported. `encoded` is consumed as by
// PlanGlobalSaveColumnar.
absl::StatusOr<EncodedGlobalPlan> PlanGlobalSaveDispatch(
    SavePlanner& planner, std::optional<DedupPolicy> default_policy,
    std::vector<std::string>& encoded, bool require_coverage,
    std::string_view prefix);

}  // namespace cairn::internal_plan

#endif  // CAIRN_PLAN_COLUMNAR_PLAN_H_
