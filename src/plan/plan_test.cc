// The plan wire format and the coordinator's checks of the global plan.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "plan/global_plan.h"
#include "plan/plan_codec.h"

namespace cairn::internal_plan {
namespace {

using ::testing::HasSubstr;

WriteItem Rows(const std::string& fqn, int64_t begin, int64_t rows,
               int64_t local_index) {
  WriteItem item;
  item.fqn = fqn;
  item.kind = ItemKind::kTensor;
  item.dtype = DType::kF32;
  item.global_shape = {4, 3};
  item.box = Box{{begin, 0}, {rows, 3}};
  item.nbytes = static_cast<uint64_t>(rows * 3 * 4);
  item.local_index = local_index;
  return item;
}

SavePlan SamplePlan() {
  SavePlan plan;
  plan.items.push_back(Rows("model.layers.0.attention.wq.weight", 0, 2, 0));
  WriteItem object;
  object.fqn = "rng";
  object.kind = ItemKind::kObject;
  object.nbytes = 5;
  object.local_index = 1;
  plan.items.push_back(object);
  plan.scalars["step"] = int64_t{7};
  plan.scalars["name"] = std::string(300, 'n');  // longer than the estimate
  plan.structure = R"({"model":{}})";
  plan.planner_data = "p";
  plan.storage_data = "s";
  return plan;
}

TEST(PlanCodecTest, SavePlanRoundTripsWithAPrefix) {
  const SavePlan plan = SamplePlan();
  const std::string plain = EncodeSavePlan(plan, /*with_scalar_values=*/true);
  const std::string prefixed = EncodeSavePlan(plan, true, "HEADER");
  ASSERT_EQ(prefixed, "HEADER" + plain);
  absl::StatusOr<SavePlan> back = DecodeSavePlan(plain, "plan");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->items, plan.items);
  EXPECT_EQ(back->scalars, plan.scalars);
  EXPECT_EQ(back->structure, plan.structure);
  EXPECT_EQ(back->planner_data, "p");
  EXPECT_EQ(back->storage_data, "s");
  // The prefix is read off with ByteReader::Rest.
  internal_core::ByteReader r(prefixed, "message");
  EXPECT_EQ(r.U8(), 'H');
  const std::string_view rest = r.Rest();
  EXPECT_TRUE(r.status().ok());
  EXPECT_EQ(rest, "EADER" + plain);
}

TEST(PlanCodecTest, EveryTruncationIsAnErrorNamingTheMessage) {
  const std::string bytes = EncodeSavePlan(SamplePlan(), true);
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    absl::StatusOr<SavePlan> p =
        DecodeSavePlan(std::string_view(bytes).substr(0, cut), "plan of rank 3");
    ASSERT_FALSE(p.ok()) << cut;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kDataLoss) << cut;
    EXPECT_THAT(std::string(p.status().message()), HasSubstr("plan of rank 3"));
  }
}

TEST(PlanCodecTest, RestAfterAFailureIsEmpty) {
  internal_core::ByteReader r("abc", "short");
  r.U64();  // fails: 3 bytes
  EXPECT_TRUE(r.Rest().empty());
  EXPECT_FALSE(r.status().ok());
}

// The global plan is checked against what the local plans agree on per FQN,
// after the local plans were handed (moved) to the planner.
TEST(GlobalPlanTest, FinalPlansAreCheckedAgainstTheLocalSummary) {
  std::vector<SavePlan> locals(2);
  locals[0].items = {Rows("w", 0, 2, 0)};
  locals[1].items = {Rows("w", 2, 2, 0), Rows("w", 0, 2, 1)};  // a replica
  absl::StatusOr<LocalSummary> summary = ValidateLocalPlans(locals);
  ASSERT_TRUE(summary.ok()) << summary.status();
  ASSERT_EQ(summary->size(), 1u);
  EXPECT_EQ(summary->at("w").global_shape, (Shape{4, 3}));

  std::vector<SavePlan> finals =
      DedupSavePlans(std::move(locals), DedupPolicy::kBalanceBytes);
  EXPECT_TRUE(ValidateFinalPlans(*summary, finals).ok());

  // A final plan that drops a box leaves a gap.
  std::vector<SavePlan> gap = finals;
  for (SavePlan& p : gap) {
    if (!p.items.empty() && p.items[0].box.offsets[0] == 2) p.items.clear();
  }
  absl::Status st = ValidateFinalPlans(*summary, gap);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("cover 6 of 12"));
  EXPECT_TRUE(ValidateFinalPlans(*summary, gap, /*require_coverage=*/false).ok());

  // A tensor no local plan holds, or in another shape or dtype.
  std::vector<SavePlan> renamed = finals;
  renamed[0].items.push_back(Rows("x", 0, 4, 0));
  st = ValidateFinalPlans(*summary, renamed);
  EXPECT_THAT(std::string(st.message()), HasSubstr("write x, which no rank"));
  std::vector<SavePlan> reshaped = finals;
  for (SavePlan& p : reshaped) {
    for (WriteItem& item : p.items) item.global_shape = {4, 4};
  }
  EXPECT_EQ(ValidateFinalPlans(*summary, reshaped).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<SavePlan> retyped = finals;
  for (SavePlan& p : retyped) {
    for (WriteItem& item : p.items) item.dtype = DType::kBF16;
  }
  EXPECT_EQ(ValidateFinalPlans(*summary, retyped).code(),
            absl::StatusCode::kInvalidArgument);

  // A local FQN the global plan forgot.
  std::vector<SavePlan> none(2);
  st = ValidateFinalPlans(*summary, none);
  EXPECT_THAT(std::string(st.message()), HasSubstr("writes w on no rank"));
}

// The skeleton's location pointers survive moves (the plan cache keeps the
// skeleton) and each points at the location of its own item.
TEST(GlobalPlanTest, SkeletonRefsPointAtTheirItemsAfterAMove) {
  std::vector<SavePlan> finals(2);
  finals[0].items = {Rows("w", 2, 2, 0)};
  finals[1].items = {Rows("w", 0, 2, 0)};
  WriteItem object;
  object.fqn = "rng";
  object.kind = ItemKind::kObject;
  object.nbytes = 3;
  finals[1].items.push_back(object);
  absl::StatusOr<MetadataSkeleton> built = BuildMetadataSkeleton(finals);
  ASSERT_TRUE(built.ok()) << built.status();
  MetadataSkeleton moved = *std::move(built);
  MetadataSkeleton again;
  again = std::move(moved);
  ASSERT_EQ(again.refs.size(), 2u);
  again.refs[0][0]->offset = 100;  // rows 2-3: the second chunk
  again.refs[1][0]->offset = 200;  // rows 0-1: the first chunk
  again.refs[1][1]->offset = 300;
  const TensorMetadata& w = again.metadata.tensors.at("w");
  ASSERT_EQ(w.chunks.size(), 2u);
  EXPECT_EQ(w.chunks[0].box.offsets[0], 0);
  EXPECT_EQ(w.chunks[0].location.offset, 200u);
  EXPECT_EQ(w.chunks[1].location.offset, 100u);
  EXPECT_EQ(again.metadata.objects.at("rng").offset, 300u);
}

}  // namespace
}  // namespace cairn::internal_plan
