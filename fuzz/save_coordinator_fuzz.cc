// The save coordinator's global planning on what the ranks sent: the
// columnar path (the default planner's, on flat arrays) must give the
// classic path's final plans and skeleton byte for byte whenever it plans
// at all, and leave its input as it was when it gives way; neither may
// crash on any messages.
//
// Input: one byte of options (bit 0: DedupPolicy::kLowestRank, bit 1:
// coverage not required, as for rank-local checkpoints), then up to four
// ranks' encoded local plans as records (fuzz_target.h, SplitRecords).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fuzz/fuzz_target.h"
#include "plan/columnar_plan.h"
#include "plan/global_plan.h"
#include "plan/plan_codec.h"

namespace cairn::fuzz {
namespace {

using internal_plan::EncodedGlobalPlan;

constexpr char kPrefix[] = "PLANID08";

WriteItem Tensor(const std::string& fqn, const Shape& shape, const Box& box,
                 int64_t local_index) {
  WriteItem item;
  item.fqn = fqn;
  item.kind = ItemKind::kTensor;
  item.dtype = DType::kF32;
  item.global_shape = shape;
  item.box = box;
  item.nbytes = static_cast<uint64_t>(box.num_elements()) * 4;
  item.local_index = local_index;
  return item;
}

std::vector<std::string> Seeds() {
  // Two ranks: a tensor split by rows, one replicated on both, an object
  // on rank 1, a scalar on both.
  std::vector<SavePlan> plans(2);
  for (int r = 0; r < 2; ++r) {
    plans[r].items.push_back(
        Tensor("model.w", {4, 3}, Box{{2 * r, 0}, {2, 3}}, 0));
    plans[r].items.push_back(Tensor("model.b", {3}, Box{{0}, {3}}, 1));
    plans[r].scalars["step"] = int64_t{0};
    plans[r].structure = R"({"model":{"w":"T","b":"T"},"step":"S"})";
  }
  WriteItem rng;
  rng.fqn = "rng";
  rng.kind = ItemKind::kObject;
  rng.nbytes = 16;
  rng.local_index = 2;
  plans[1].items.push_back(rng);
  std::vector<std::string> ranks;
  for (const SavePlan& p : plans) {
    ranks.push_back(internal_plan::EncodeSavePlan(p, false));
  }
  // A 2-d grid on three ranks, the last rank empty.
  std::vector<SavePlan> grid(4);
  for (int r = 0; r < 3; ++r) {
    grid[r].items.push_back(Tensor("g", {2, 6}, Box{{0, 2 * r}, {2, 2}}, 0));
  }
  std::vector<std::string> grid_ranks;
  for (const SavePlan& p : grid) {
    grid_ranks.push_back(internal_plan::EncodeSavePlan(p, false));
  }
  return {std::string(1, '\0') + JoinRecords(ranks),
          std::string(1, '\1') + JoinRecords(ranks),
          std::string(1, '\2') + JoinRecords(grid_ranks)};
}

}  // namespace

CAIRN_FUZZ_TARGET(save_coordinator, &Seeds) {
  if (data.empty()) return;
  const uint8_t options = static_cast<uint8_t>(data[0]);
  const DedupPolicy policy =
      options & 1 ? DedupPolicy::kLowestRank : DedupPolicy::kBalanceBytes;
  const bool require_coverage = (options & 2) == 0;
  const std::vector<std::string> encoded = SplitRecords(data.substr(1), 4);
  if (encoded.empty()) return;

  DefaultSavePlanner planner(policy);
  absl::StatusOr<EncodedGlobalPlan> classic =
      internal_plan::PlanGlobalSave(planner, encoded, require_coverage, kPrefix);
  std::vector<std::string> copy = encoded;
  absl::StatusOr<EncodedGlobalPlan> columnar =
      internal_plan::PlanGlobalSaveColumnar(copy, policy, require_coverage,
                                            kPrefix);
  if (!columnar.ok()) {
    CAIRN_FUZZ_CHECK(copy == encoded,
                     "the columnar path changed its input and gave way");
    return;
  }
  CAIRN_FUZZ_CHECK(classic.ok(),
                   absl::StrCat("the columnar path planned what the classic "
                                "path rejects: ",
                                classic.status().ToString()));
  CAIRN_FUZZ_CHECK(classic->payloads == columnar->payloads,
                   "the two paths' final plans differ");
  CAIRN_FUZZ_CHECK(
      classic->skeleton.metadata ==
          internal_plan::SkeletonMetadata(columnar->skeleton),
      "the two paths' skeletons differ");
  absl::StatusOr<std::string> a = internal_plan::EncodeSkeleton(classic->skeleton);
  absl::StatusOr<std::string> b =
      internal_plan::EncodeSkeleton(columnar->skeleton);
  CAIRN_FUZZ_CHECK(a.ok() == b.ok() && (!a.ok() || *a == *b),
                   "the two paths' metadata.json differ");
}

}  // namespace cairn::fuzz
