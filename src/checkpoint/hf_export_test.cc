// Hugging Face folders written by cairn (hf_export.cc): live state dicts on
// several ranks, checkpoints, casts, shard sizes, overwrites, conversion
// back to a checkpoint, and the errors of each.
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/huggingface.h"
#include "cairn/planner.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"
#include "checkpoint/hf_export.h"
#include "checkpoint/hf_test_util.h"
#include "checkpoint/test_util.h"
#include "core/cast.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace cairn {
namespace {

using testing::ElementsAre;
using testing::HasSubstr;
using testing_util::HfBytes;
using testing_util::HfTensor;
using testing_util::ReadFile;
using testing_util::TempDir;
using testing_util::WriteSafetensors;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Tensors of a small model, with their full bytes.
const std::vector<HfTensor>& Model() {
  static const auto* t = new std::vector<HfTensor>{
      {"a.w", DType::kF32, {16, 12}},   // 768 bytes
      {"b.w", DType::kBF16, {10, 8}},   // 160
      {"c.ids", DType::kI64, {6}},      // 48
      {"d.w", DType::kF32, {20, 10}},   // 800
  };
  return *t;
}

// Loads the folder at `dir` whole and compares with Model().
void ExpectModel(const std::string& dir) {
  absl::StatusOr<StateDict> all = LoadAll(dir);
  ASSERT_TRUE(all.ok()) << all.status();
  for (const HfTensor& t : Model()) {
    const StateDict* leaf = all->Find(t.name);
    ASSERT_NE(leaf, nullptr) << t.name;
    const std::string want = HfBytes(t);
    EXPECT_EQ(std::string(static_cast<const char*>(
                              leaf->tensor()->shards()[0].view.data()),
                          want.size()),
              want)
        << t.name;
  }
}

TEST(HfExportTest, LayoutIsGreedyInKeyOrder) {
  std::vector<internal_checkpoint::HfLayoutTensor> ts = {
      {"a", DType::kF32, {100}},  // 400
      {"b", DType::kF32, {100}},  // 400
      {"c", DType::kF32, {300}},  // 1200: a file of its own
      {"d", DType::kU8, {10}},
  };
  absl::StatusOr<internal_checkpoint::HfLayout> l =
      internal_checkpoint::PlanHfLayout(ts, 1000);
  ASSERT_TRUE(l.ok());
  ASSERT_EQ(l->files.size(), 3u);
  EXPECT_EQ(l->files[0].name, "model-00001-of-00003.safetensors");
  EXPECT_EQ(l->files[0].entries.size(), 2u);
  EXPECT_EQ(l->files[1].entries.size(), 1u);
  EXPECT_EQ(l->files[2].entries[0].name, "d");
  EXPECT_EQ(l->total_size, 2010u);
  l = internal_checkpoint::PlanHfLayout(ts, 5'000'000'000);
  ASSERT_TRUE(l.ok());
  ASSERT_EQ(l->files.size(), 1u);
  EXPECT_EQ(l->files[0].name, "model.safetensors");
}

// 4 ranks: a.w in column shards, b.w in row shards, c.ids replicated on
// every rank, d.w whole on rank 3; an object leaf is skipped.
TEST(HfExportTest, LiveStateOnFourRanksWritesOneFolder) {
  TempDir tmp;
  for (const uint64_t max_shard : {uint64_t{900}, uint64_t{5'000'000'000}}) {
    SCOPED_TRACE(max_shard);
    const std::string dir = tmp.Sub(absl::StrCat("m", max_shard));
    std::vector<std::string> full;
    for (const HfTensor& t : Model()) full.push_back(HfBytes(t));
    std::vector<uint64_t> progress_calls(1, 0);
    std::vector<absl::StatusOr<HfExportResult>> results(4, absl::UnknownError(""));
    std::vector<absl::Status> statuses =
        RunInProcess(4, [&](Communicator& comm) -> absl::Status {
          const int r = comm.rank();
          StateDict sd;
          // a.w: columns [3r, 3r + 3) of [16, 12], strided into the full one.
          const HfTensor& a = Model()[0];
          sd["a"]["w"] = ShardedTensor(
              a.dtype, a.shape,
              {Shard{Box{{0, 3 * r}, {16, 3}},
                     TensorView(full[0].data() + 12 * r, a.dtype, {16, 3},
                                {12, 1})}});
          const HfTensor& b = Model()[1];
          const int64_t rows = r < 2 ? 3 : 2;
          const int64_t row0 = r < 2 ? 3 * r : 6 + 2 * (r - 2);
          sd["b"]["w"] = ShardedTensor(
              b.dtype, b.shape,
              {Shard{Box{{row0, 0}, {rows, 8}},
                     TensorView(full[1].data() + row0 * 16, b.dtype, {rows, 8})}});
          sd["c"]["ids"] = TensorView(full[2].data(), DType::kI64, {6});
          if (r == 3) {
            sd["d"]["w"] = TensorView(full[3].data(), DType::kF32, {20, 10});
          } else {
            sd["d"]["w"] = ShardedTensor(DType::kF32, {20, 10}, {});
          }
          sd["note"] = Object{"not a tensor"};
          HfExportOptions o;
          o.comm = &comm;
          o.max_shard_size = max_shard;
          o.progress = [&](uint64_t, uint64_t) { ++progress_calls[0]; };
          results[r] = SaveHuggingFace(sd, dir, o);
          return results[r].status();
        });
    for (const absl::Status& s : statuses) ASSERT_TRUE(s.ok()) << s;
    const HfExportResult& res = *results[0];
    EXPECT_EQ(res.tensors, 4);
    EXPECT_EQ(res.total_size, 768u + 160 + 48 + 800);
    EXPECT_THAT(res.skipped, ElementsAre("note"));
    EXPECT_GT(progress_calls[0], 0u);
    // The replicated c.ids is written once (by rank 0).
    uint64_t written = 0;
    for (const auto& r : results) written += r->bytes_written;
    EXPECT_EQ(written, res.total_size);
    if (max_shard == 900) {
      EXPECT_THAT(FilesIn(dir),
                  ElementsAre("model-00001-of-00003.safetensors",
                              "model-00002-of-00003.safetensors",
                              "model-00003-of-00003.safetensors",
                              "model.safetensors.index.json"));
      const nlohmann::json index =
          nlohmann::json::parse(ReadFile(dir + "/model.safetensors.index.json"));
      EXPECT_EQ(index["metadata"]["total_size"], res.total_size);
      EXPECT_EQ(index["weight_map"]["d.w"], "model-00003-of-00003.safetensors");
    } else {
      EXPECT_THAT(FilesIn(dir), ElementsAre("model.safetensors"));
    }
    ExpectModel(dir);
  }
}

// Live ranks casting on the way: strided column shards (packed before the
// cast) and contiguous row shards (cast in place).
TEST(HfExportTest, LiveRanksCastStridedAndPackedShards) {
  TempDir tmp;
  const HfTensor& a = Model()[0];  // F32 [16, 12]
  const std::string full = HfBytes(a);
  std::vector<absl::Status> statuses =
      RunInProcess(2, [&](Communicator& comm) -> absl::Status {
        const int r = comm.rank();
        auto* data = const_cast<char*>(full.data());
        StateDict sd;
        sd["cols"] = ShardedTensor(
            a.dtype, a.shape,
            {Shard{Box{{0, 6 * r}, {16, 6}},
                   TensorView(data + 24 * r, a.dtype, {16, 6}, {12, 1})}});
        sd["rows"] = ShardedTensor(
            a.dtype, a.shape,
            {Shard{Box{{8 * r, 0}, {8, 12}},
                   TensorView(data + 8 * 48 * r, a.dtype, {8, 12})}});
        HfExportOptions o;
        o.comm = &comm;
        o.dtype = DType::kBF16;
        return SaveHuggingFace(sd, tmp.Sub("hf"), o).status();
      });
  for (const absl::Status& s : statuses) ASSERT_TRUE(s.ok()) << s;
  absl::StatusOr<StateDict> all = LoadAll(tmp.Sub("hf"));
  ASSERT_TRUE(all.ok()) << all.status();
  for (const char* name : {"cols", "rows"}) {
    const TensorView& v = all->Find(name)->tensor()->shards()[0].view;
    ASSERT_EQ(v.dtype(), DType::kBF16) << name;
    const auto* got = static_cast<const uint16_t*>(v.data());
    for (int i = 0; i < 16 * 12; ++i) {
      float f;
      std::memcpy(&f, full.data() + 4 * i, 4);
      ASSERT_EQ(got[i], internal_core::FloatToBFloat16(f)) << name << " " << i;
    }
  }
}

TEST(HfExportTest, CheckpointToFolderAndBackWithCast) {
  TempDir tmp;
  WriteSafetensors(tmp.Sub("model.safetensors"), Model());
  // Folder -> checkpoint -> folder: bytes unchanged, checksums gained.
  absl::StatusOr<SaveResult> saved =
      ConvertToCheckpoint(tmp.Sub("model.safetensors"), tmp.Sub("ckpt"));
  ASSERT_TRUE(saved.ok()) << saved.status();
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.Sub("ckpt"));
  ASSERT_TRUE(md.ok());
  EXPECT_TRUE(md->has_checksums);
  EXPECT_EQ(md->tensors.size(), Model().size());
  HfExportOptions o;
  o.max_shard_size = 900;
  absl::StatusOr<HfExportResult> out =
      ExportToHuggingFace(tmp.Sub("ckpt"), tmp.Sub("hf"), o);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->files.size(), 3u);
  ExpectModel(tmp.Sub("hf"));
  // A load of the checkpoint is verified; of the folder, not.
  std::string buf(768, '\0');
  StateDict sd;
  sd["a.w"] = TensorView(buf.data(), DType::kF32, {16, 12});
  LoadOptions lo;
  lo.strict = false;
  absl::StatusOr<LoadResult> r = Load(sd, tmp.Sub("ckpt"), lo);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->source_has_checksums);
  EXPECT_EQ(r->bytes_verified, 768u);

  // F32 -> BF16 on the way out; the others keep their dtypes.
  o.dtype = DType::kBF16;
  out = ExportToHuggingFace(tmp.Sub("ckpt"), tmp.Sub("bf16"), o);
  ASSERT_TRUE(out.ok()) << out.status();
  md = ReadMetadata(tmp.Sub("bf16"));
  ASSERT_TRUE(md.ok());
  EXPECT_EQ(md->tensors.at("a.w").dtype, DType::kBF16);
  EXPECT_EQ(md->tensors.at("c.ids").dtype, DType::kI64);
  absl::StatusOr<StateDict> all = LoadAll(tmp.Sub("bf16"));
  ASSERT_TRUE(all.ok());
  const std::string a = HfBytes(Model()[0]);
  const auto* got = static_cast<const uint16_t*>(
      all->Find("a.w")->tensor()->shards()[0].view.data());
  for (int i = 0; i < 16 * 12; ++i) {
    float f;
    std::memcpy(&f, a.data() + 4 * i, 4);
    ASSERT_EQ(got[i], internal_core::FloatToBFloat16(f)) << i;
  }
  // Converting with a cast and names.
  ConvertOptions co;
  co.dtype = DType::kF16;
  co.names.add_prefix = "model.";
  saved = ConvertToCheckpoint(tmp.Sub("hf"), tmp.Sub("ckpt16"), co);
  ASSERT_TRUE(saved.ok()) << saved.status();
  md = ReadMetadata(tmp.Sub("ckpt16"));
  ASSERT_TRUE(md.ok());
  EXPECT_EQ(md->tensors.at("model.a.w").dtype, DType::kF16);
  EXPECT_EQ(md->tensors.at("model.c.ids").dtype, DType::kI64);
}

// F4 and F6 tensors go out as safetensors' own F4 / F6 entries, shapes
// counting values, and come back packed; a cast leaves them alone.
TEST(HfExportTest, SubByteTensorsExportAsSafetensorsDTypes) {
  TempDir tmp;
  const std::vector<HfTensor> packed = {
      {"fp4.w", DType::kF4_X2, {3, 5}},        // [3, 10] values, 15 bytes
      {"fp6.w", DType::kF6_E2M3_X4, {2, 3}},   // [2, 12] values, 18 bytes
      {"w", DType::kF32, {4}},
  };
  WriteSafetensors(tmp.Sub("in/model.safetensors"), packed);
  ASSERT_TRUE(ConvertToCheckpoint(tmp.Sub("in"), tmp.Sub("ckpt")).ok());
  HfExportOptions o;
  o.dtype = DType::kBF16;
  absl::StatusOr<HfExportResult> out =
      ExportToHuggingFace(tmp.Sub("ckpt"), tmp.Sub("hf"), o);
  ASSERT_TRUE(out.ok()) << out.status();
  const std::string file = ReadFile(tmp.Sub("hf/model.safetensors"));
  uint64_t n = 0;
  ASSERT_GE(file.size(), 8u);
  std::memcpy(&n, file.data(), 8);
  ASSERT_LE(8 + n, file.size());
  const nlohmann::json header = nlohmann::json::parse(file.substr(8, n));
  EXPECT_EQ(header["fp4.w"]["dtype"], "F4");
  EXPECT_EQ(header["fp4.w"]["shape"], nlohmann::json({3, 10}));
  EXPECT_EQ(header["fp6.w"]["dtype"], "F6_E2M3");
  EXPECT_EQ(header["fp6.w"]["shape"], nlohmann::json({2, 12}));
  EXPECT_EQ(header["w"]["dtype"], "BF16");
  for (size_t i = 0; i < 2; ++i) {
    const auto& at = header[packed[i].name]["data_offsets"];
    const uint64_t begin = at[0].get<uint64_t>(), end = at[1].get<uint64_t>();
    EXPECT_EQ(file.substr(8 + n + begin, end - begin), HfBytes(packed[i]))
        << packed[i].name;
  }
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.Sub("hf"));
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->tensors.at("fp4.w").dtype, DType::kF4_X2);
  EXPECT_EQ(md->tensors.at("fp4.w").shape, (Shape{3, 5}));
  EXPECT_EQ(md->tensors.at("fp6.w").shape, (Shape{2, 3}));
}

// A packed scalar has no last dimension to count its values in.
TEST(HfExportTest, PackedScalarsAreRefused) {
  TempDir tmp;
  std::string byte(1, '\x21');
  StateDict sd;
  sd["s"] = TensorView(byte.data(), DType::kF4_X2, {});
  absl::StatusOr<SaveResult> saved = Save(sd, tmp.Sub("ckpt"));
  ASSERT_EQ(saved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(saved.status()), HasSubstr("F4_X2"));
  EXPECT_THAT(Msg(saved.status()), HasSubstr("s"));
}

// A planner of the user's (not a DefaultSavePlanner) that plans tensor
// `fqn` as a scalar: what ValidateShard refuses at the default planner.
class ScalarizingPlanner : public SavePlanner {
 public:
  explicit ScalarizingPlanner(std::string fqn) : fqn_(std::move(fqn)) {}
  absl::Status SetUp(const StateDict& state, bool is_coordinator, int rank,
                     int world_size) override {
    return inner_.SetUp(state, is_coordinator, rank, world_size);
  }
  absl::StatusOr<SavePlan> CreateLocalPlan() override {
    CAIRN_ASSIGN_OR_RETURN(SavePlan plan, inner_.CreateLocalPlan());
    for (WriteItem& item : plan.items) {
      if (item.fqn == fqn_) {
        item.global_shape = {};
        item.box = Box{};
      }
    }
    return plan;
  }
  absl::StatusOr<std::vector<SavePlan>> CreateGlobalPlan(
      std::vector<SavePlan> local_plans) override {
    return inner_.CreateGlobalPlan(std::move(local_plans));
  }
  absl::StatusOr<SavePlan> FinishPlan(SavePlan plan) override {
    return inner_.FinishPlan(std::move(plan));
  }
  absl::StatusOr<ResolvedData> ResolveData(const WriteItem& item) override {
    return inner_.ResolveData(item);
  }

 private:
  DefaultSavePlanner inner_;
  std::string fqn_;
};

// The global planning refuses a packed scalar from any planner: an export
// of it would write [2] (values) where the checkpoint says [].
TEST(HfExportTest, PackedScalarsFromAnyPlannerAreRefused) {
  TempDir tmp;
  std::string byte(1, '\x21');
  StateDict sd;
  sd["s"] = TensorView(byte.data(), DType::kF4_X2, {1});
  ScalarizingPlanner planner("s");
  SaveOptions o;
  o.planner = &planner;
  absl::StatusOr<SaveResult> saved = Save(sd, tmp.Sub("ckpt"), o);
  ASSERT_EQ(saved.status().code(), absl::StatusCode::kInvalidArgument)
      << saved.status();
  EXPECT_THAT(Msg(saved.status()), HasSubstr("s: a F4_X2 tensor"));
  EXPECT_FALSE(std::filesystem::exists(tmp.Sub("ckpt/metadata.json")));
}

TEST(HfExportTest, OverwriteReplacesTheWholeModel) {
  TempDir tmp;
  WriteSafetensors(tmp.Sub("src/model.safetensors"), Model());
  HfExportOptions o;
  o.max_shard_size = 900;
  ASSERT_TRUE(ExportToHuggingFace(tmp.Sub("src"), tmp.Sub("out"), o).ok());
  EXPECT_EQ(FilesIn(tmp.Sub("out")).size(), 4u);
  absl::Status again = ExportToHuggingFace(tmp.Sub("src"), tmp.Sub("out"), o).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;
  o.max_shard_size = 5'000'000'000;
  o.overwrite = true;
  ASSERT_TRUE(ExportToHuggingFace(tmp.Sub("src"), tmp.Sub("out"), o).ok());
  EXPECT_THAT(FilesIn(tmp.Sub("out")), ElementsAre("model.safetensors"));
  ExpectModel(tmp.Sub("out"));
}

TEST(HfExportTest, BadExportsFailCleanly) {
  TempDir tmp;
  WriteSafetensors(tmp.Sub("src/model.safetensors"), Model());
  // Into a checkpoint.
  ASSERT_TRUE(ConvertToCheckpoint(tmp.Sub("src"), tmp.Sub("ckpt")).ok());
  absl::Status s = ExportToHuggingFace(tmp.Sub("src"), tmp.Sub("ckpt")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  // A cast to a dtype that is not a float.
  HfExportOptions o;
  o.dtype = DType::kI32;
  s = ExportToHuggingFace(tmp.Sub("src"), tmp.Sub("x"), o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // Converting a checkpoint again.
  s = ConvertToCheckpoint(tmp.Sub("ckpt"), tmp.Sub("y")).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // Ranks that disagree, and shards that leave a gap: no files are left.
  for (const bool gap : {false, true}) {
    SCOPED_TRACE(gap ? "gap" : "disagree");
    const std::string dir = tmp.Sub(gap ? "gap" : "disagree");
    std::vector<float> data(64, 1.0f);
    std::vector<absl::Status> statuses =
        RunInProcess(2, [&](Communicator& comm) -> absl::Status {
          const int r = comm.rank();
          StateDict sd;
          const Shape shape = (!gap && r == 1) ? Shape{8, 9} : Shape{8, 8};
          const int64_t rows = gap ? 3 : 4;
          sd["w"] = ShardedTensor(
              DType::kF32, shape,
              {Shard{Box{{4 * r, 0}, {rows, 8}},
                     TensorView(data.data(), DType::kF32, {rows, 8})}});
          HfExportOptions eo;
          eo.comm = &comm;
          return SaveHuggingFace(sd, dir, eo).status();
        });
    for (const absl::Status& st : statuses) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_THAT(Msg(st), HasSubstr("'w'"));
    }
    if (std::filesystem::exists(dir)) {
      EXPECT_TRUE(FilesIn(dir).empty());
    }
  }
}

}  // namespace
}  // namespace cairn
