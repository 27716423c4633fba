// A LoadPlanner that forwards every call to a DefaultLoadPlanner, but is not
// one: a load treats it as a planner of the user's (whole local plans to the
// coordinator, its CreateGlobalPlan called there) where DefaultLoadPlanner
// and its subclasses send plan summaries. For tests and the scale
// simulation, to run both paths on the same plans.
#ifndef CAIRN_CHECKPOINT_FORWARDING_PLANNER_H_
#define CAIRN_CHECKPOINT_FORWARDING_PLANNER_H_

#include <utility>
#include <vector>

#include "cairn/planner.h"

namespace cairn::internal_checkpoint {

class ForwardingLoadPlanner : public LoadPlanner {
 public:
  explicit ForwardingLoadPlanner(bool strict = true) : inner_(strict) {}

  absl::Status SetUp(StateDict& state, const Metadata& metadata,
                     bool is_coordinator, int rank, int world_size) override {
    return inner_.SetUp(state, metadata, is_coordinator, rank, world_size);
  }
  absl::StatusOr<LoadPlan> CreateLocalPlan() override {
    return inner_.CreateLocalPlan();
  }
  absl::StatusOr<std::vector<LoadPlan>> CreateGlobalPlan(
      std::vector<LoadPlan> local_plans) override {
    ++global_plans_;
    return inner_.CreateGlobalPlan(std::move(local_plans));
  }
  absl::StatusOr<LoadPlan> FinishPlan(LoadPlan plan) override {
    return inner_.FinishPlan(std::move(plan));
  }
  absl::StatusOr<Destination> ResolveDestination(
      const ReadItem& item) override {
    return inner_.ResolveDestination(item);
  }
  absl::Status CommitChunk(const ReadItem& item) override {
    return inner_.CommitChunk(item);
  }

  // How many times CreateGlobalPlan was called (the coordinator's only).
  int global_plans() const { return global_plans_; }

 private:
  DefaultLoadPlanner inner_;
  int global_plans_ = 0;
};

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_FORWARDING_PLANNER_H_
