// The coordinator's commit step on its own: AssembleMetadata fills the
// skeleton from the ranks' write reports (on several threads when there are
// many items) and reports the first problem in rank order.
#include "checkpoint/write_report.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "format/metadata_codec.h"
#include "plan/columnar_plan.h"
#include "plan/global_plan.h"
#include "plan/plan_codec.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_plan::BuildMetadataSkeleton;
using internal_plan::MetadataSkeleton;

// `world` ranks, rank r writing rows [r * rows, (r + 1) * rows) of "w"
// ([world * rows, 2] F32), one row per item.
std::vector<SavePlan> RowPlans(int world, int64_t rows) {
  std::vector<SavePlan> plans(world);
  const Shape shape = {world * rows, 2};
  for (int r = 0; r < world; ++r) {
    for (int64_t i = 0; i < rows; ++i) {
      WriteItem item;
      item.fqn = "w";
      item.kind = ItemKind::kTensor;
      item.dtype = DType::kF32;
      item.global_shape = shape;
      item.box = Box{{r * rows + i, 0}, {1, 2}};
      item.nbytes = 8;
      item.local_index = i;
      plans[r].items.push_back(item);
    }
  }
  return plans;
}

// Rank r's report: its items back to back from offset 4096, CRC r * 1e6 + i.
WriteReport Report(int r, size_t items) {
  WriteReport report;
  report.file = absl::StrCat("data-", r, ".safetensors");
  for (size_t i = 0; i < items; ++i) {
    report.items.push_back({4096 + 8 * i, 8, static_cast<uint32_t>(r * 1000000 + i)});
  }
  report.file_size = 4096 + 8 * items;
  report.scalars["step"] = int64_t{7};
  return report;
}

void ExpectFilled(const Metadata& md, int world, int64_t rows) {
  const TensorMetadata& w = md.tensors.at("w");
  ASSERT_EQ(w.chunks.size(), static_cast<size_t>(world * rows));
  for (int r = 0; r < world; ++r) {
    for (int64_t i = 0; i < rows; ++i) {
      const ChunkMetadata& c = w.chunks[r * rows + i];  // box order
      ASSERT_EQ(c.box.offsets[0], r * rows + i);
      EXPECT_EQ(c.location.file, absl::StrCat("data-", r, ".safetensors"));
      EXPECT_EQ(c.location.offset, static_cast<uint64_t>(4096 + 8 * i));
      EXPECT_EQ(c.location.nbytes, 8u);
      ASSERT_EQ(c.location.crc32c, static_cast<uint32_t>(r * 1000000 + i))
          << "rank " << r << " item " << i;
    }
  }
}

TEST(AssembleMetadataTest, FillsEveryLocationAndTheScalars) {
  // Small (one thread) and large enough for several threads.
  for (const auto& [world, rows] : {std::pair{3, int64_t{5}},
                                    std::pair{64, int64_t{2048}}}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks x ", rows));
    absl::StatusOr<MetadataSkeleton> skeleton =
        BuildMetadataSkeleton(RowPlans(world, rows));
    ASSERT_TRUE(skeleton.ok()) << skeleton.status();
    std::vector<std::string> reports;
    for (int r = 0; r < world; ++r) {
      reports.push_back(EncodeReport(Report(r, static_cast<size_t>(rows))));
    }
    uint64_t total = 0;
    absl::StatusOr<const Metadata*> md =
        AssembleMetadata(*skeleton, reports, R"({"run":1})", &total);
    ASSERT_TRUE(md.ok()) << md.status();
    EXPECT_EQ(total, static_cast<uint64_t>(world * (4096 + 8 * rows)));
    EXPECT_EQ((*md)->user, R"({"run":1})");
    ASSERT_EQ((*md)->scalars.size(), 1u);
    EXPECT_EQ(std::get<int64_t>((*md)->scalars.at("step")), 7);
    ExpectFilled(**md, world, rows);
  }
}

TEST(AssembleMetadataTest, TheFirstProblemInRankOrderIsReported) {
  constexpr int kWorld = 4;
  constexpr int64_t kRows = 20000;  // several threads
  absl::StatusOr<MetadataSkeleton> skeleton =
      BuildMetadataSkeleton(RowPlans(kWorld, kRows));
  ASSERT_TRUE(skeleton.ok()) << skeleton.status();
  std::vector<std::string> good;
  for (int r = 0; r < kWorld; ++r) good.push_back(EncodeReport(Report(r, kRows)));
  uint64_t total = 0;

  // A truncated report: the error names its rank.
  std::vector<std::string> reports = good;
  reports[2].resize(reports[2].size() / 2);
  absl::StatusOr<const Metadata*> md =
      AssembleMetadata(*skeleton, reports, "{}", &total);
  ASSERT_FALSE(md.ok());
  EXPECT_NE(md.status().message().find("write report of rank 2"),
            std::string::npos)
      << md.status();

  // One item too few on rank 3.
  reports = good;
  WriteReport short_report = Report(3, kRows - 1);
  reports[3] = EncodeReport(short_report);
  md = AssembleMetadata(*skeleton, reports, "{}", &total);
  EXPECT_EQ(md.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(md.status().message().find("rank 3 reports 19999 written items"),
            std::string::npos)
      << md.status();

  // A scalar that differs on rank 1 comes before rank 3's bad report.
  WriteReport other = Report(1, kRows);
  other.scalars["step"] = int64_t{8};
  reports[1] = EncodeReport(other);
  md = AssembleMetadata(*skeleton, reports, "{}", &total);
  EXPECT_EQ(md.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(md.status().message().find(
                "scalar step differs between rank 0 and rank 1"),
            std::string::npos)
      << md.status();

  // The same skeleton, reused with good reports, is filled anew.
  md = AssembleMetadata(*skeleton, good, "{}", &total);
  ASSERT_TRUE(md.ok()) << md.status();
  ExpectFilled(**md, kWorld, kRows);
}

// The columnar coordinator's skeleton keeps its chunks flat; filled from
// the same reports it gives the same metadata, on several threads too, and
// refs that do not match a rank's plan are an internal error, never a
// write outside the arrays.
TEST(AssembleMetadataTest, FillsFlatChunks) {
  constexpr int kWorld = 64;
  constexpr int64_t kRows = 2048;  // several threads
  std::vector<std::string> encoded;
  for (const SavePlan& p : RowPlans(kWorld, kRows)) {
    encoded.push_back(internal_plan::EncodeSavePlan(p, false));
  }
  absl::StatusOr<internal_plan::EncodedGlobalPlan> g =
      internal_plan::PlanGlobalSaveColumnar(encoded, DedupPolicy::kBalanceBytes,
                                            true, "");
  ASSERT_TRUE(g.ok()) << g.status();
  MetadataSkeleton& skeleton = g->skeleton;
  ASSERT_TRUE(skeleton.uses_flat);
  EXPECT_TRUE(skeleton.metadata.tensors.at("w").chunks.empty());
  std::vector<std::string> reports;
  for (int r = 0; r < kWorld; ++r) reports.push_back(EncodeReport(Report(r, kRows)));
  uint64_t total = 0;
  ASSERT_TRUE(AssembleMetadata(skeleton, reports, "{}", &total).ok());
  const Metadata md = internal_plan::SkeletonMetadata(skeleton);
  ExpectFilled(md, kWorld, kRows);
  absl::StatusOr<std::string> text = internal_plan::EncodeSkeleton(skeleton);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, internal_format::EncodeMetadata(md).value());

  skeleton.chunk_refs[5].pop_back();
  absl::StatusOr<const Metadata*> bad =
      AssembleMetadata(skeleton, reports, "{}", &total);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(bad.status().message().find("rank 5"), std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace cairn::internal_checkpoint
