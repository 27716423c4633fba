// The columnar coordinator path against the classic one: on randomized
// local plans both must give the same final-plan messages (byte for byte)
// and the same skeleton; on bad input the columnar path must give up and
// the dispatch must report the classic path's error.
#include "plan/columnar_plan.h"

#include <algorithm>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checked.h"
#include "gtest/gtest.h"
#include "checkpoint/write_report.h"
#include "plan/global_plan.h"
#include "plan/plan_codec.h"

namespace cairn::internal_plan {
namespace {

constexpr char kPrefix[] = "PLANID08";

std::vector<std::string> Encode(const std::vector<SavePlan>& plans) {
  std::vector<std::string> out;
  for (const SavePlan& p : plans) {
    out.push_back(EncodeSavePlan(p, /*with_scalar_values=*/false));
  }
  return out;
}

WriteItem TensorItem(const std::string& fqn, DType dtype, const Shape& shape,
                     const Box& box, int64_t local_index) {
  WriteItem item;
  item.fqn = fqn;
  item.kind = ItemKind::kTensor;
  item.dtype = dtype;
  item.global_shape = shape;
  item.box = box;
  item.nbytes = internal_core::CheckedBytes(box.sizes, dtype).value();
  item.local_index = local_index;
  return item;
}

WriteItem ObjectItem(const std::string& fqn, uint64_t nbytes,
                     int64_t local_index) {
  WriteItem item;
  item.fqn = fqn;
  item.kind = ItemKind::kObject;
  item.nbytes = nbytes;
  item.local_index = local_index;
  return item;
}

// Random local plans of `world` ranks that describe one consistent state:
// tensors of rank 0 to 3 (some with a zero dimension), replicated whole,
// split along one dimension or on a grid, each piece held by one or several
// ranks, empty pieces, a piece listed twice on one rank, objects held by
// several ranks, scalars, several structures, ranks with no items.
std::vector<SavePlan> RandomPlans(std::mt19937_64& rng, int world) {
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  auto random_ranks = [&](int at_least) {
    std::vector<int> ranks;
    for (int r = 0; r < world; ++r) {
      if (uniform(0, 2) == 0) ranks.push_back(r);
    }
    while (static_cast<int>(ranks.size()) < at_least) {
      const int r = static_cast<int>(uniform(0, world - 1));
      if (std::find(ranks.begin(), ranks.end(), r) == ranks.end()) {
        ranks.push_back(r);
      }
    }
    std::sort(ranks.begin(), ranks.end());
    return ranks;
  };
  std::vector<SavePlan> plans(world);
  std::vector<int64_t> next_index(world, 0);
  auto add = [&](int r, WriteItem item) {
    item.local_index = next_index[r]++;
    plans[r].items.push_back(std::move(item));
  };
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kU8, DType::kI64};
  const int tensors = static_cast<int>(uniform(0, 7));
  for (int t = 0; t < tensors; ++t) {
    const std::string fqn = absl::StrCat("model.layers.", t, ".weight");
    const DType dtype = dtypes[uniform(0, 3)];
    Shape shape(uniform(0, 3));
    for (int64_t& d : shape) d = uniform(0, 9) == 0 ? 0 : uniform(1, 7);
    const int64_t how = shape.empty() ? 0 : uniform(0, 2);
    // The pieces: boxes that tile the shape.
    std::vector<Box> pieces;
    if (how == 0 || NumElements(shape) == 0) {
      pieces.push_back(Box::Full(shape));
    } else {
      const size_t d0 = static_cast<size_t>(uniform(0, shape.size() - 1));
      const size_t d1 = how == 2 && shape.size() > 1 ? (d0 + 1) % shape.size()
                                                     : d0;
      auto cuts = [&](int64_t n) {
        std::vector<int64_t> c = {0, n};
        for (int k = static_cast<int>(uniform(0, 3)); k > 0; --k) {
          c.push_back(uniform(0, n));  // repeated cuts give empty pieces
        }
        std::sort(c.begin(), c.end());
        return c;
      };
      const std::vector<int64_t> a = cuts(shape[d0]);
      const std::vector<int64_t> b = d1 != d0 ? cuts(shape[d1])
                                              : std::vector<int64_t>{0, 0};
      for (size_t i = 0; i + 1 < a.size(); ++i) {
        for (size_t j = 0; j + 1 < b.size(); ++j) {
          Box box = Box::Full(shape);
          box.offsets[d0] = a[i];
          box.sizes[d0] = a[i + 1] - a[i];
          if (d1 != d0) {
            box.offsets[d1] = b[j];
            box.sizes[d1] = b[j + 1] - b[j];
          }
          pieces.push_back(box);
        }
      }
    }
    for (const Box& box : pieces) {
      for (int r : random_ranks(1)) {
        add(r, TensorItem(fqn, dtype, shape, box, 0));
        if (uniform(0, 15) == 0) add(r, TensorItem(fqn, dtype, shape, box, 0));
      }
    }
  }
  const int objects = static_cast<int>(uniform(0, 3));
  for (int o = 0; o < objects; ++o) {
    const uint64_t nbytes = static_cast<uint64_t>(uniform(0, 40));
    for (int r : random_ranks(1)) {
      add(r, ObjectItem(absl::StrCat("extra.obj", o), nbytes, 0));
    }
  }
  const std::string shared_structure =
      uniform(0, 1) == 0 ? "{}" : R"({"model":{"layers":["a","b"]}})";
  for (int r = 0; r < world; ++r) {
    SavePlan& p = plans[r];
    std::shuffle(p.items.begin(), p.items.end(), rng);
    if (uniform(0, 1) == 0) p.scalars["step"] = int64_t{7};
    if (uniform(0, 2) == 0) p.scalars[absl::StrCat("rank", r, ".lr")] = 0.5;
    if (uniform(0, 3) == 0) p.scalars["name"] = std::string("x");
    if (uniform(0, 3) == 0) p.scalars["flag"] = true;
    p.structure = uniform(0, 2) == 0
                      ? absl::StrCat(R"({"model":{"layers":["a"]},"r)", r,
                                     R"(":"s"})")
                      : shared_structure;
    p.planner_data = std::string(static_cast<size_t>(uniform(0, 3)), 'p');
    p.storage_data = uniform(0, 1) == 0 ? "" : absl::StrCat("rank ", r);
  }
  return plans;
}

// Where each location of `md` is, by name: "tensor#chunk" or "object".
std::map<const ByteLocation*, std::string> LocationNames(const Metadata& md) {
  std::map<const ByteLocation*, std::string> names;
  for (const auto& [fqn, t] : md.tensors) {
    for (size_t c = 0; c < t.chunks.size(); ++c) {
      names[&t.chunks[c].location] = absl::StrCat(fqn, "#", c);
    }
  }
  for (const auto& [fqn, loc] : md.objects) names[&loc] = fqn;
  return names;
}

// What (rank, item) of `skeleton` fills: "tensor#chunk" or "object".
std::string RefName(const MetadataSkeleton& skeleton,
                    const std::map<const ByteLocation*, std::string>& names,
                    size_t r, size_t i) {
  if (const ByteLocation* loc = skeleton.refs[r][i]; loc != nullptr) {
    return names.contains(loc) ? names.at(loc) : "(unknown location)";
  }
  if (!skeleton.uses_flat || r >= skeleton.chunk_refs.size() ||
      i >= skeleton.chunk_refs[r].size()) {
    return "(no location)";
  }
  const size_t c = skeleton.chunk_refs[r][i];
  const internal_format::FlatChunks& flat = skeleton.flat;
  size_t t = 0;
  for (const auto& [fqn, tensor] : skeleton.metadata.tensors) {
    if (c >= flat.first[t] && c < flat.first[t + 1]) {
      return absl::StrCat(fqn, "#", c - flat.first[t]);
    }
    ++t;
  }
  return "(chunk out of range)";
}

// Both plans: same payloads, metadata, refs naming the same locations,
// and, filled in from the same reports, the same metadata.json.
void ExpectSame(const EncodedGlobalPlan& classic,
                const EncodedGlobalPlan& columnar) {
  ASSERT_EQ(classic.payloads.size(), columnar.payloads.size());
  for (size_t r = 0; r < classic.payloads.size(); ++r) {
    EXPECT_EQ(classic.payloads[r], columnar.payloads[r]) << "rank " << r;
  }
  EXPECT_FALSE(classic.skeleton.uses_flat);
  EXPECT_EQ(classic.skeleton.metadata, SkeletonMetadata(columnar.skeleton));
  const auto a = LocationNames(classic.skeleton.metadata);
  const auto b = LocationNames(columnar.skeleton.metadata);
  ASSERT_EQ(classic.skeleton.refs.size(), columnar.skeleton.refs.size());
  for (size_t r = 0; r < classic.skeleton.refs.size(); ++r) {
    ASSERT_EQ(classic.skeleton.refs[r].size(), columnar.skeleton.refs[r].size());
    for (size_t i = 0; i < classic.skeleton.refs[r].size(); ++i) {
      ASSERT_TRUE(a.contains(classic.skeleton.refs[r][i]));
      EXPECT_EQ(a.at(classic.skeleton.refs[r][i]),
                RefName(columnar.skeleton, b, r, i))
          << "rank " << r << " item " << i;
    }
  }
}

// Fills both skeletons from the same write reports (rank r's item i at
// offset 1000 * r + i, CRC r * 7919 + i) and expects the same
// metadata.json from each.
void ExpectSameMetadataJson(EncodedGlobalPlan& classic,
                            EncodedGlobalPlan& columnar) {
  std::vector<std::string> reports;
  for (size_t r = 0; r < classic.skeleton.refs.size(); ++r) {
    internal_checkpoint::WriteReport report;
    report.file = absl::StrCat("data-", r, ".safetensors");
    for (size_t i = 0; i < classic.skeleton.refs[r].size(); ++i) {
      report.items.push_back({1000 * r + i, 3 + i,
                              static_cast<uint32_t>(r * 7919 + i)});
    }
    report.file_size = 1000 * (r + 1);
    reports.push_back(internal_checkpoint::EncodeReport(report));
  }
  uint64_t total_a = 0, total_b = 0;
  ASSERT_TRUE(internal_checkpoint::AssembleMetadata(classic.skeleton, reports,
                                                    "{}", &total_a)
                  .ok());
  ASSERT_TRUE(internal_checkpoint::AssembleMetadata(columnar.skeleton, reports,
                                                    "{}", &total_b)
                  .ok());
  EXPECT_EQ(total_a, total_b);
  absl::StatusOr<std::string> text_a = EncodeSkeleton(classic.skeleton);
  absl::StatusOr<std::string> text_b = EncodeSkeleton(columnar.skeleton);
  ASSERT_TRUE(text_a.ok()) << text_a.status();
  ASSERT_TRUE(text_b.ok()) << text_b.status();
  EXPECT_EQ(*text_a, *text_b);
  EXPECT_EQ(classic.skeleton.metadata, SkeletonMetadata(columnar.skeleton));
}

// PlanGlobalSaveColumnar on a copy of `encoded` (it consumes its input on
// success, and must leave it as it was otherwise).
absl::StatusOr<EncodedGlobalPlan> Columnar(
    const std::vector<std::string>& encoded, DedupPolicy policy,
    bool require_coverage = true) {
  std::vector<std::string> copy = encoded;
  absl::StatusOr<EncodedGlobalPlan> g =
      PlanGlobalSaveColumnar(copy, policy, require_coverage, kPrefix);
  if (!g.ok()) {
    EXPECT_EQ(copy, encoded);
  }
  return g;
}

absl::StatusOr<EncodedGlobalPlan> Classic(
    const std::vector<std::string>& encoded, DedupPolicy policy,
    bool require_coverage = true) {
  DefaultSavePlanner planner(policy);
  return PlanGlobalSave(planner, encoded, require_coverage, kPrefix);
}

// Plans `encoded` both ways with `policy`; both must succeed, the same.
void ExpectBothPlanTheSame(const std::vector<std::string>& encoded,
                           DedupPolicy policy, bool require_coverage = true) {
  absl::StatusOr<EncodedGlobalPlan> classic =
      Classic(encoded, policy, require_coverage);
  absl::StatusOr<EncodedGlobalPlan> columnar =
      Columnar(encoded, policy, require_coverage);
  ASSERT_TRUE(classic.ok()) << classic.status();
  ASSERT_TRUE(columnar.ok()) << columnar.status();
  EXPECT_TRUE(columnar->skeleton.uses_flat);
  ExpectSame(*classic, *columnar);
  ExpectSameMetadataJson(*classic, *columnar);
  // And what each rank's FinishPlan gets: its payload decoded (its own
  // local plan when the payload is the prefix alone) is its plan as the
  // public DedupSavePlans chooses it.
  std::vector<SavePlan> locals;
  for (const std::string& e : encoded) {
    absl::StatusOr<SavePlan> p = DecodeSavePlan(e, "local");
    ASSERT_TRUE(p.ok()) << p.status();
    locals.push_back(*std::move(p));
  }
  const std::vector<SavePlan> expected = DedupSavePlans(locals, policy);
  for (size_t r = 0; r < encoded.size(); ++r) {
    const std::string& payload = columnar->payloads[r];
    ASSERT_EQ(std::string_view(payload).substr(0, 8), kPrefix);
    absl::StatusOr<SavePlan> final_plan = DecodeFinalPlan(
        std::string_view(payload).substr(8), encoded[r], "final");
    ASSERT_TRUE(final_plan.ok()) << final_plan.status();
    EXPECT_EQ(EncodeSavePlan(*final_plan, false),
              EncodeSavePlan(expected[r], false))
        << "rank " << r;
    // The prefix alone exactly when no item was dropped.
    EXPECT_EQ(payload.size() == 8,
              expected[r].items.size() == locals[r].items.size())
        << "rank " << r;
  }
}

TEST(ColumnarPlanTest, SameAsClassicOnRandomPlans) {
  std::mt19937_64 rng(20261123);
  for (int world : {1, 2, 3, 5, 8, 16}) {
    for (int round = 0; round < 60; ++round) {
      const std::vector<SavePlan> plans = RandomPlans(rng, world);
      const std::vector<std::string> encoded = Encode(plans);
      for (DedupPolicy policy :
           {DedupPolicy::kBalanceBytes, DedupPolicy::kLowestRank}) {
        SCOPED_TRACE(absl::StrCat("world ", world, " round ", round,
                                  " policy ", static_cast<int>(policy)));
        ExpectBothPlanTheSame(encoded, policy);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(ColumnarPlanTest, SameAsClassicWithoutCoverage) {
  // Rank-local saves do not require coverage: a gap is fine.
  std::vector<SavePlan> plans(2);
  const Shape shape = {6, 4};
  plans[0].items.push_back(
      TensorItem("w", DType::kF32, shape, Box{{0, 0}, {2, 4}}, 0));
  plans[1].items.push_back(
      TensorItem("w", DType::kF32, shape, Box{{4, 0}, {2, 4}}, 0));
  const std::vector<std::string> encoded = Encode(plans);
  for (DedupPolicy policy :
       {DedupPolicy::kBalanceBytes, DedupPolicy::kLowestRank}) {
    ExpectBothPlanTheSame(encoded, policy, /*require_coverage=*/false);
    EXPECT_FALSE(Columnar(encoded, policy).ok());
  }
}

TEST(ColumnarPlanTest, BalancesReplicasLikeClassic) {
  // Several replicated pieces of several sizes and holder counts: the
  // greedy order and its ties decide who writes what.
  std::vector<SavePlan> plans(4);
  const Shape shape = {8, 2};
  for (int64_t row = 0; row < 8; ++row) {
    const Box box{{row, 0}, {1, 2}};
    for (int r = 0; r < 4; ++r) {
      if ((row + r) % 3 != 0) {
        plans[r].items.push_back(TensorItem("a", DType::kF32, shape, box, row));
      }
      plans[r].items.push_back(TensorItem("b", DType::kU8, shape, box, row));
    }
  }
  for (int r = 0; r < 4; ++r) plans[r].items.push_back(ObjectItem("o", 3, 99));
  const std::vector<std::string> encoded = Encode(plans);
  for (DedupPolicy policy :
       {DedupPolicy::kBalanceBytes, DedupPolicy::kLowestRank}) {
    ExpectBothPlanTheSame(encoded, policy);
  }
}

TEST(ColumnarPlanTest, SameAsClassicWhenPlannedOnSeveralThreads) {
  // Enough items (256 ranks x 300) that dedup and the skeleton run on
  // several threads: rows held by two ranks each, small tensors by all,
  // of several sizes so that the greedy balance has ties to break.
  constexpr int kWorld = 256;
  std::vector<SavePlan> plans(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    int64_t index = 0;
    for (int t = 0; t < 100; ++t) {
      const Shape shape = {kWorld / 2, 4 + t % 3};
      const Box row{{r % (kWorld / 2), 0}, {1, shape[1]}};
      plans[r].items.push_back(TensorItem(absl::StrCat("layer", t, ".w"),
                                          DType::kF32, shape, row, index++));
    }
    for (int t = 0; t < 200; ++t) {
      const Shape shape = {1 + t % 5};
      plans[r].items.push_back(TensorItem(absl::StrCat("norm", t),
                                          DType::kBF16, shape,
                                          Box::Full(shape), index++));
    }
  }
  const std::vector<std::string> encoded = Encode(plans);
  for (DedupPolicy policy :
       {DedupPolicy::kBalanceBytes, DedupPolicy::kLowestRank}) {
    ExpectBothPlanTheSame(encoded, policy);
  }
}

TEST(ColumnarPlanTest, UnchangedPlansAreSentAsThePrefixAlone) {
  // Rank 0 writes "a"; rank 1 holds a replica of "a", dropped, and "b".
  std::vector<SavePlan> plans(2);
  const Shape shape = {4, 2};
  plans[0].items.push_back(
      TensorItem("a", DType::kF32, shape, Box::Full(shape), 0));
  plans[1].items.push_back(
      TensorItem("a", DType::kF32, shape, Box::Full(shape), 0));
  plans[1].items.push_back(
      TensorItem("b", DType::kF32, shape, Box::Full(shape), 1));
  const std::vector<std::string> encoded = Encode(plans);
  for (bool columnar : {false, true}) {
    SCOPED_TRACE(columnar ? "columnar" : "classic");
    absl::StatusOr<EncodedGlobalPlan> g =
        columnar ? Columnar(encoded, DedupPolicy::kLowestRank)
                 : Classic(encoded, DedupPolicy::kLowestRank);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->payloads[0], kPrefix);
    ASSERT_GT(g->payloads[1].size(), 8u);
    absl::StatusOr<SavePlan> p1 = DecodeFinalPlan(
        std::string_view(g->payloads[1]).substr(8), encoded[1], "final");
    ASSERT_TRUE(p1.ok()) << p1.status();
    ASSERT_EQ(p1->items.size(), 1u);
    EXPECT_EQ(p1->items[0].fqn, "b");
    absl::StatusOr<SavePlan> p0 =
        DecodeFinalPlan("", encoded[0], "final");
    ASSERT_TRUE(p0.ok()) << p0.status();
    ASSERT_EQ(p0->items.size(), 1u);
    EXPECT_EQ(p0->items[0].fqn, "a");
  }
  // A damaged own plan is an error naming what it is, never a crash.
  absl::StatusOr<SavePlan> bad =
      DecodeFinalPlan("", std::string_view(encoded[0]).substr(0, 5), "final");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("the local plan, unchanged"),
            std::string::npos)
      << bad.status();
}

// `encoded` is bad: the classic path refuses it, the columnar path declines
// it, and the dispatch reports the classic path's error.
void ExpectTheClassicError(const std::vector<std::string>& encoded) {
  DefaultSavePlanner planner;
  absl::StatusOr<EncodedGlobalPlan> classic =
      PlanGlobalSave(planner, encoded, true, kPrefix);
  ASSERT_FALSE(classic.ok());
  EXPECT_FALSE(Columnar(encoded, DedupPolicy::kBalanceBytes).ok());
  std::vector<std::string> copy = encoded;
  EXPECT_EQ(PlanGlobalSaveDispatch(planner, DedupPolicy::kBalanceBytes, copy,
                                   true, kPrefix)
                .status(),
            classic.status());
}

// Two ranks holding the rows of a [4, 3] F32 tensor, an object and a
// scalar; each bad input breaks one thing.
std::vector<SavePlan> GoodPlans() {
  std::vector<SavePlan> plans(2);
  const Shape shape = {4, 3};
  plans[0].items.push_back(
      TensorItem("w", DType::kF32, shape, Box{{0, 0}, {2, 3}}, 0));
  plans[1].items.push_back(
      TensorItem("w", DType::kF32, shape, Box{{2, 0}, {2, 3}}, 0));
  plans[0].items.push_back(ObjectItem("o", 5, 1));
  plans[1].items.push_back(ObjectItem("o", 5, 1));
  plans[0].scalars["step"] = int64_t{1};
  plans[1].scalars["step"] = int64_t{1};
  return plans;
}

TEST(ColumnarPlanTest, BadInputGivesTheClassicError) {
  struct Case {
    std::string name;
    std::function<void(std::vector<SavePlan>&)> change;
  };
  const std::vector<Case> cases = {
      {"gap", [](auto& p) { p[1].items[0].box = Box{{3, 0}, {1, 3}};
                            p[1].items[0].nbytes = 12; }},
      {"overlap", [](auto& p) { p[1].items[0].box = Box{{1, 0}, {3, 3}};
                                p[1].items[0].nbytes = 36; }},
      {"dtype", [](auto& p) { p[1].items[0].dtype = DType::kI32; }},
      {"shape", [](auto& p) { p[1].items[0].global_shape = {5, 3}; }},
      {"outside", [](auto& p) { p[1].items[0].box = Box{{3, 0}, {2, 3}}; }},
      {"nbytes", [](auto& p) { p[1].items[0].nbytes = 4; }},
      {"object size", [](auto& p) { p[1].items[1].nbytes = 6; }},
      {"kind", [](auto& p) { p[1].items[1].fqn = "w"; }},
      {"scalar name", [](auto& p) { p[1].scalars["o"] = int64_t{2}; }},
      {"structure", [](auto& p) { p[0].structure = R"({"a":"x"})";
                                  p[1].structure = R"({"a":{}})"; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<SavePlan> plans = GoodPlans();
    c.change(plans);
    ExpectTheClassicError(Encode(plans));
  }
}

TEST(ColumnarPlanTest, MalformedMessagesGiveTheClassicError) {
  const std::vector<std::string> good = Encode(GoodPlans());
  std::vector<std::vector<std::string>> bad;
  for (size_t cut : {size_t{1}, size_t{3}, size_t{20}, good[1].size() - 1}) {
    bad.push_back(good);
    bad.back()[1].resize(good[1].size() - cut);  // truncated
  }
  bad.push_back(good);
  bad.back()[0] += "x";  // a byte left over
  bad.push_back(good);
  bad.back()[0][9 + 8 + 1] = 7;  // the first item's kind
  for (size_t i = 0; i < bad.size(); ++i) {
    SCOPED_TRACE(i);
    ExpectTheClassicError(bad[i]);
  }
}

TEST(ColumnarPlanTest, PlansWithScalarValuesGoTheClassicWay) {
  // Not something save.cc sends, but the codec allows it: the final plans
  // are encoded without values, so the columnar path cannot copy them.
  std::vector<std::string> encoded;
  for (const SavePlan& p : GoodPlans()) {
    encoded.push_back(EncodeSavePlan(p, /*with_scalar_values=*/true));
  }
  EXPECT_FALSE(Columnar(encoded, DedupPolicy::kBalanceBytes).ok());
  DefaultSavePlanner planner;
  absl::StatusOr<EncodedGlobalPlan> classic =
      PlanGlobalSave(planner, encoded, true, kPrefix);
  absl::StatusOr<EncodedGlobalPlan> dispatched = PlanGlobalSaveDispatch(
      planner, DedupPolicy::kBalanceBytes, encoded, true, kPrefix);
  ASSERT_TRUE(classic.ok()) << classic.status();
  ASSERT_TRUE(dispatched.ok()) << dispatched.status();
  ExpectSame(*classic, *dispatched);
}

}  // namespace
}  // namespace cairn::internal_plan
