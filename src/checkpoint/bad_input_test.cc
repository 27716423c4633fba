// Each kind of damaged or hostile checkpoint gives a clear error naming what
// is wrong (FQN, file, offset), never a crash or an out-of-bounds read. Run
// under ASan/UBSan to make the second half of that claim stick.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "checkpoint/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using testing::HasSubstr;
using testing_util::ReadFile;
using testing_util::TempDir;
using testing_util::WriteFile;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

class BadInputTest : public testing::Test {
 protected:
  void SetUp() override {
    w_.resize(64 * 32);
    for (size_t i = 0; i < w_.size(); ++i) w_[i] = static_cast<float>(i);
    StateDict sd;
    sd["model"]["w"] = ShardedTensor(
        DType::kF32, {64, 32},
        {{Box{{0, 0}, {32, 32}}, TensorView(w_.data(), DType::kF32, {32, 32})},
         {Box{{32, 0}, {32, 32}},
          TensorView(w_.data() + 32 * 32, DType::kF32, {32, 32})}});
    sd["rng"] = Object{"0123456789"};
    sd["step"] = int64_t{3};
    SaveOptions o;
    o.save_id = "bad";  // so that the data file has a known name
    ASSERT_TRUE(Save(sd, dir(), o).ok());
  }

  std::string dir() const { return tmp_.path(); }
  std::string metadata_path() const { return dir() + "/metadata.json"; }
  static std::string data_name() { return "data-00000-bad.safetensors"; }
  std::string data_path() const { return dir() + "/" + data_name(); }

  nlohmann::json Metadata() const {
    return nlohmann::json::parse(ReadFile(metadata_path()));
  }
  // Writes `j` as metadata.json with a fresh checksum: the edit, not the
  // checksum, is what the test checks.
  void SetMetadata(const nlohmann::json& j) {
    WriteFile(metadata_path(), testing_util::Resealed(j.dump()));
  }

  // Loads everything into fresh destinations.
  absl::Status LoadAllInto() {
    out_.assign(64 * 32, 0.0f);
    StateDict dst;
    dst["model"]["w"] = TensorView(out_.data(), DType::kF32, {64, 32});
    dst["rng"] = Object{};
    dst["step"] = int64_t{0};
    return Load(dst, dir()).status();
  }

  TempDir tmp_;
  std::vector<float> w_, out_;
};

TEST_F(BadInputTest, GoodCheckpointLoads) {
  ASSERT_TRUE(LoadAllInto().ok());
  EXPECT_EQ(out_, w_);
}

TEST_F(BadInputTest, MalformedMetadataJson) {
  const std::string text = ReadFile(metadata_path());
  for (size_t cut : {size_t{0}, size_t{1}, text.size() / 2, text.rfind('}')}) {
    WriteFile(metadata_path(), text.substr(0, cut));
    absl::Status s = LoadAllInto();
    EXPECT_FALSE(s.ok()) << cut;
    EXPECT_THAT(Msg(s), HasSubstr("metadata.json")) << cut;
  }
  WriteFile(metadata_path(), "[1, 2, 3]");
  EXPECT_FALSE(ReadMetadata(dir()).ok());
  WriteFile(metadata_path(), std::string("\xff\xfe\0garbage", 10));
  EXPECT_FALSE(ReadMetadata(dir()).ok());
}

TEST_F(BadInputTest, WrongTypesInMetadata) {
  nlohmann::json j = Metadata();
  j["tensors"]["model.w"]["shape"] = "not a shape";
  SetMetadata(j);
  absl::Status s = LoadAllInto();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(Msg(s), HasSubstr("model.w"));
}

TEST_F(BadInputTest, UnknownFormatVersion) {
  nlohmann::json j = Metadata();
  j["version"] = kFormatVersion + 1;
  SetMetadata(j);
  absl::Status s = ReadMetadata(dir()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(s), HasSubstr("version"));
}

// metadata.json changed after it was written (one digit of a scalar, which
// nothing else checks): the load fails naming the file, and nothing is
// placed. Version 1 metadata (no checksum) still loads.
TEST_F(BadInputTest, MetadataChangedAfterItWasWritten) {
  std::string text = ReadFile(metadata_path());
  const size_t at = text.find(R"("step":{"int64":3})");
  ASSERT_NE(at, std::string::npos);
  text[at + 16] = '7';
  WriteFile(metadata_path(), text);
  absl::Status s = LoadAllInto();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(s), HasSubstr(metadata_path()));
  EXPECT_THAT(Msg(s), HasSubstr("metadata checksum mismatch"));
  EXPECT_EQ(out_, std::vector<float>(64 * 32, 0.0f));
  EXPECT_EQ(ReadMetadata(dir()).status().code(), absl::StatusCode::kDataLoss);
  // Re-sealed, the edit loads (the checksum is the only thing that saw it).
  WriteFile(metadata_path(), testing_util::Resealed(text));
  StateDict dst;
  dst["step"] = int64_t{0};
  ASSERT_TRUE(Load(dst, dir()).ok());
  EXPECT_EQ(std::get<int64_t>(*dst.Find("step")->scalar()), 7);
  // Version 1, as earlier builds wrote it: no checksum, and it loads.
  nlohmann::json j = Metadata();
  j.erase("checksum");
  j["version"] = 1;
  WriteFile(metadata_path(), j.dump());
  ASSERT_TRUE(LoadAllInto().ok());
  EXPECT_EQ(out_, w_);
}

TEST_F(BadInputTest, UnknownFieldsAreIgnored) {
  nlohmann::json j = Metadata();
  j["future_field"] = {{"x", 1}};
  j["tensors"]["model.w"]["chunks"][0]["future"] = true;
  SetMetadata(j);
  EXPECT_TRUE(LoadAllInto().ok());
}

TEST_F(BadInputTest, FileNamesOutsideTheCheckpoint) {
  for (const char* name : {"../data-00000.safetensors", "/etc/passwd",
                           "sub/../../x", "a//b"}) {
    nlohmann::json j = Metadata();
    j["tensors"]["model.w"]["chunks"][0]["file"] = name;
    SetMetadata(j);
    absl::Status s = LoadAllInto();
    // A damaged checkpoint, so kDataLoss; the message says what is wrong.
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << name;
    EXPECT_THAT(Msg(s), HasSubstr("unsafe file name")) << name;
    EXPECT_THAT(Msg(s), HasSubstr("model.w")) << name;
  }
}

TEST_F(BadInputTest, ChunkOutsideTheFile) {
  const uint64_t size = std::filesystem::file_size(data_path());
  for (uint64_t offset : {size - 4, size + 4096, uint64_t{1} << 62}) {
    nlohmann::json j = Metadata();
    j["tensors"]["model.w"]["chunks"][1]["offset"] = offset;
    SetMetadata(j);
    absl::Status s = LoadAllInto();
    EXPECT_FALSE(s.ok()) << offset;
    EXPECT_THAT(Msg(s), HasSubstr(data_name())) << offset << s;
  }
  // A chunk moved inside the file but off its header entry.
  nlohmann::json j = Metadata();
  j["tensors"]["model.w"]["chunks"][1]["offset"] =
      j["tensors"]["model.w"]["chunks"][1]["offset"].get<uint64_t>() - 4;
  SetMetadata(j);
  absl::Status s = LoadAllInto();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(s), HasSubstr("model.w@32,0"));
}

// A metadata.json (consistent with itself, checksum included) that declares
// model.w 2^36 rows tall, its second chunk covering all but the first 32:
// LoadAll refuses it because that chunk runs past its file, before it
// allocates the 8 TiB tensor the shape asks for.
TEST_F(BadInputTest, LoadAllChecksTheFilesBeforeAllocating) {
  const int64_t rows = int64_t{1} << 36;
  nlohmann::json j = Metadata();
  nlohmann::json& w = j["tensors"]["model.w"];
  w["shape"] = {rows, 32};
  w["chunks"][1]["sizes"] = {rows - 32, 32};
  w["chunks"][1]["nbytes"] = static_cast<uint64_t>(rows - 32) * 32 * 4;
  SetMetadata(j);
  ASSERT_TRUE(ReadMetadata(dir()).ok());  // the metadata alone is valid
  absl::StatusOr<StateDict> all = LoadAll(dir());
  EXPECT_EQ(all.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(all.status()), HasSubstr("model.w@32,0"));
  EXPECT_THAT(Msg(all.status()), HasSubstr("runs past the end of the file"));
  // A data file gone: kNotFound naming it, also before allocating.
  std::filesystem::remove(data_path());
  all = LoadAll(dir());
  EXPECT_EQ(all.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(all.status()), HasSubstr(data_name()));
}

// A metadata.json (checksum included) in which model.w is 96 rows tall and
// its third chunk, rows 64-95, points at the first chunk's bytes (CRC32C and
// all): LoadAll refuses it, naming both chunks, in the check it runs before
// allocating (LoadAllChecksTheFilesBeforeAllocating shows the order), so
// many chunks on one entry cannot make it allocate more than the files hold. A
// Load into the caller's own tensors, which would otherwise fill rows 64-95
// with rows 0-31, refuses it too: the header entry there is model.w@0,0's.
// Two locations that name the same entry (an FQN may hold '@') are refused
// as sharing bytes.
TEST_F(BadInputTest, ChunksThatShareBytes) {
  const nlohmann::json original = Metadata();
  nlohmann::json j = original;
  nlohmann::json& w = j["tensors"]["model.w"];
  w["shape"] = {96, 32};
  nlohmann::json third = w["chunks"][0];
  third["offsets"] = {64, 0};
  w["chunks"].push_back(third);
  SetMetadata(j);
  ASSERT_TRUE(ReadMetadata(dir()).ok());  // the metadata alone is valid
  absl::StatusOr<StateDict> all = LoadAll(dir());
  EXPECT_EQ(all.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(all.status()), HasSubstr("shares bytes with"));
  EXPECT_THAT(Msg(all.status()), HasSubstr("\"model.w@0,0\""));
  EXPECT_THAT(Msg(all.status()), HasSubstr("\"model.w@64,0\""));
  EXPECT_THAT(Msg(all.status()), HasSubstr(data_name()));

  std::vector<float> out(96 * 32, -1.0f);
  StateDict dst;
  dst["model"]["w"] = TensorView(out.data(), DType::kF32, {96, 32});
  absl::Status s = Load(dst, dir()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(s), HasSubstr("header mismatch for model.w@64,0 "
                                "(data-00000-bad.safetensors, offset 4096"));
  EXPECT_THAT(Msg(s), HasSubstr("its safetensors entry there is named "
                                "'model.w@0,0', expected 'model.w@64,0'"));
  EXPECT_EQ(out, std::vector<float>(96 * 32, -1.0f));  // nothing placed

  // A tensor named "model.w@0,0" whose one chunk (whole, so its entry is
  // named "model.w@0,0" too) points at model.w's first chunk: the entry
  // matches both, and they share its bytes.
  j = original;
  nlohmann::json alias = j["tensors"]["model.w"];
  alias["shape"] = {32, 32};
  alias["chunks"].erase(1);
  j["tensors"]["model.w@0,0"] = alias;
  SetMetadata(j);
  ASSERT_TRUE(ReadMetadata(dir()).ok());
  out.assign(64 * 32, -1.0f);
  std::vector<float> out_alias(32 * 32, -1.0f);
  dst = StateDict();
  dst["model"]["w"] = TensorView(out.data(), DType::kF32, {64, 32});
  dst["model.w@0,0"] = TensorView(out_alias.data(), DType::kF32, {32, 32});
  s = Load(dst, dir()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(s), HasSubstr("model.w@0,0 and model.w@0,0 are both "
                                "stored at data-00000-bad.safetensors"));

  // An object pointed at a chunk's bytes (its size and CRC32C too): refused.
  j = original;
  nlohmann::json& rng = j["objects"]["rng"];
  const nlohmann::json& chunk = j["tensors"]["model.w"]["chunks"][1];
  rng["offset"] = chunk["offset"];
  rng["nbytes"] = chunk["nbytes"];
  rng["crc32c"] = chunk["crc32c"];
  SetMetadata(j);
  all = LoadAll(dir());
  EXPECT_EQ(all.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(all.status()), HasSubstr("object \"rng\""));
  EXPECT_THAT(Msg(all.status()), HasSubstr("model.w@32,0"));
  out.assign(64 * 32, -1.0f);
  dst = StateDict();
  dst["model"]["w"] = TensorView(out.data(), DType::kF32, {64, 32});
  dst["rng"] = Object{};
  s = Load(dst, dir()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(s), HasSubstr("header mismatch for rng"));
}

TEST_F(BadInputTest, SizesThatDisagreeWithTheBox) {
  nlohmann::json j = Metadata();
  j["tensors"]["model.w"]["chunks"][0]["nbytes"] = 12;
  SetMetadata(j);
  absl::Status s = LoadAllInto();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(Msg(s), HasSubstr("model.w"));

  j = Metadata();  // (rewritten above; reload the original shape)
  j["tensors"]["model.w"]["chunks"][0]["sizes"] = {33, 32};
  SetMetadata(j);
  EXPECT_FALSE(LoadAllInto().ok());

  j = Metadata();
  j["tensors"]["model.w"]["shape"] = {int64_t{1} << 40, int64_t{1} << 40};
  SetMetadata(j);
  EXPECT_FALSE(LoadAllInto().ok());
}

TEST_F(BadInputTest, SafetensorsHeaderLengthOverTheCap) {
  std::string data = ReadFile(data_path());
  const uint64_t huge = uint64_t{200} << 20;
  std::memcpy(data.data(), &huge, 8);
  WriteFile(data_path(), data);
  absl::Status s = LoadAllInto();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(Msg(s), HasSubstr(data_name()));
}

TEST_F(BadInputTest, SafetensorsHeaderPastEndOfFile) {
  std::string data = ReadFile(data_path());
  const uint64_t past = data.size();  // 8 + N > size
  std::memcpy(data.data(), &past, 8);
  WriteFile(data_path(), data);
  absl::Status s = LoadAllInto();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(Msg(s), HasSubstr(data_name()));
}

TEST_F(BadInputTest, CorruptSafetensorsHeaderJson) {
  std::string data = ReadFile(data_path());
  data[10] = '{';
  data[11] = '{';
  WriteFile(data_path(), data);
  absl::Status s = LoadAllInto();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(Msg(s), HasSubstr(data_name()));
}

TEST_F(BadInputTest, TruncatedDataFile) {
  const uint64_t size = std::filesystem::file_size(data_path());
  for (uint64_t keep : {size - 1, size / 2, uint64_t{4}, uint64_t{0}}) {
    std::filesystem::resize_file(data_path(), keep);
    absl::Status s = LoadAllInto();
    EXPECT_FALSE(s.ok()) << keep;
    EXPECT_THAT(Msg(s), HasSubstr(data_name())) << keep << s;
  }
}

TEST_F(BadInputTest, MissingDataFile) {
  std::filesystem::remove(data_path());
  absl::Status s = LoadAllInto();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(s), HasSubstr(data_name()));
}

TEST_F(BadInputTest, CrcMismatchNamesChunkFileAndOffset) {
  nlohmann::json j = Metadata();
  const uint64_t offset = j["tensors"]["model.w"]["chunks"][1]["offset"];
  std::string data = ReadFile(data_path());
  data[offset + 100] ^= 0x01;
  WriteFile(data_path(), data);
  absl::Status s = LoadAllInto();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(s), HasSubstr("crc32c mismatch in model.w@32,0"));
  EXPECT_THAT(Msg(s), HasSubstr(data_name()));
  EXPECT_THAT(Msg(s), HasSubstr("offset " + std::to_string(offset)));
}

TEST_F(BadInputTest, CrcMismatchInObject) {
  nlohmann::json j = Metadata();
  const uint64_t offset = j["objects"]["rng"]["offset"];
  std::string data = ReadFile(data_path());
  data[offset] ^= 0x40;
  WriteFile(data_path(), data);
  absl::Status s = LoadAllInto();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(s), HasSubstr("rng"));
}

// "rng" both an object and a scalar in metadata.json (checksum resealed):
// a multi-rank load once counted it twice among the stored leaves it did
// not read and failed with "INTERNAL: 18446744073709551615 of the
// planner's 3 unexpected leaves ...". Decoding refuses it, naming it.
TEST_F(BadInputTest, AnFqnThatIsBothAnObjectAndAScalar) {
  nlohmann::json j = Metadata();
  j["scalars"]["rng"] = {{"int64", 5}};
  SetMetadata(j);
  const std::string both = R"("rng" is in both "objects" and "scalars")";
  EXPECT_EQ(ReadMetadata(dir()).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(ReadMetadata(dir()).status()), HasSubstr(both));
  EXPECT_EQ(LoadAll(dir()).status().code(), absl::StatusCode::kDataLoss);
  std::vector<absl::Status> statuses =
      RunInProcess(2, [&](Communicator& comm) -> absl::Status {
        std::vector<float> out(32 * 32);
        const Box mine{{comm.rank() * 32, 0}, {32, 32}};
        StateDict dst;
        dst["model"]["w"] = ShardedTensor(
            DType::kF32, {64, 32},
            {{mine, TensorView(out.data(), DType::kF32, {32, 32})}});
        LoadOptions o;
        o.comm = &comm;
        return Load(dst, dir(), o).status();
      });
  for (const absl::Status& s : statuses) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(Msg(s), HasSubstr(both));
  }
}

// A structure that names a leaf twice ("model.w" at the top level, and
// "w" under "model"): LoadAll cannot rebuild the state dict, and says so as
// damage.
TEST_F(BadInputTest, StructureThatNamesALeafTwice) {
  nlohmann::json j = Metadata();
  j["structure"]["model.w"] = "model.w";
  SetMetadata(j);
  absl::StatusOr<StateDict> all = LoadAll(dir());
  EXPECT_EQ(all.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(all.status()), HasSubstr("duplicate FQN \"model.w\""));
  EXPECT_THAT(Msg(all.status()), HasSubstr(metadata_path()));
}

// Two F32 tensors of one shape, each stored as two row chunks of 8 x 8
// (256 bytes), and two 10-byte objects, all in one data file: a
// metadata.json edited to point one at another's bytes (CRC32C included,
// and resealed) is consistent with itself and with the file's size, so
// only the safetensors header, which names and types every entry, tells.
class HeaderMismatchTest : public testing::Test {
 protected:
  static constexpr int64_t kRows = 16, kCols = 8;

  void SetUp() override {
    for (int64_t i = 0; i < kRows * kCols; ++i) {
      a_.push_back(static_cast<float>(i));
      b_.push_back(static_cast<float>(1000 + i));
    }
    StateDict sd;
    for (auto [name, values] : {std::pair{"a", &a_}, std::pair{"b", &b_}}) {
      std::vector<Shard> shards;
      for (int64_t row : {int64_t{0}, kRows / 2}) {
        shards.push_back(
            {Box{{row, 0}, {kRows / 2, kCols}},
             TensorView(values->data() + row * kCols, DType::kF32,
                        {kRows / 2, kCols})});
      }
      sd[name] = ShardedTensor(DType::kF32, {kRows, kCols}, shards);
    }
    sd["o1"] = Object{"0123456789"};
    sd["o2"] = Object{"abcdefghij"};
    ASSERT_TRUE(Save(sd, dir()).ok());
  }

  std::string dir() const { return tmp_.path(); }
  std::string metadata_path() const { return dir() + "/metadata.json"; }

  nlohmann::json Metadata() const {
    return nlohmann::json::parse(ReadFile(metadata_path()));
  }
  void SetMetadata(const nlohmann::json& j) {
    WriteFile(metadata_path(), testing_util::Resealed(j.dump()));
  }
  // Swaps where metadata.json says `x` and `y` lie (file, offset and
  // CRC32C; they are the same size).
  void SwapLocations(nlohmann::json& x, nlohmann::json& y) {
    ASSERT_EQ(x["nbytes"], y["nbytes"]);
    for (const char* key : {"file", "offset", "crc32c"}) std::swap(x[key], y[key]);
  }

  // Loads on `world` in-process ranks, each reading its columns of a and b
  // (with one rank, all of them) into destinations of `dtype` filled with
  // -1, and the objects; the statuses, and whether every rank's
  // destinations are as they were (nothing placed).
  std::pair<std::vector<absl::Status>, bool> LoadOn(int world,
                                                   DType dtype = DType::kF32) {
    std::atomic<bool> untouched = true;
    std::vector<absl::Status> statuses =
        RunInProcess(world, [&](Communicator& comm) -> absl::Status {
          const int64_t cols = kCols / world;
          const Box mine{{0, comm.rank() * cols}, {kRows, cols}};
          std::vector<float> out_a(kRows * cols, -1.0f),
              out_b(kRows * cols, -1.0f);
          StateDict dst;
          dst["a"] = ShardedTensor(
              dtype, {kRows, kCols},
              {{mine, TensorView(out_a.data(), dtype, mine.sizes)}});
          dst["b"] = ShardedTensor(
              dtype, {kRows, kCols},
              {{mine, TensorView(out_b.data(), dtype, mine.sizes)}});
          dst["o1"] = Object{};
          dst["o2"] = Object{};
          LoadOptions o;
          o.comm = &comm;
          o.share_node_reads = node_reads_;
          absl::Status s = Load(dst, dir(), o).status();
          const std::vector<float> fresh(kRows * cols, -1.0f);
          if (out_a != fresh || out_b != fresh ||
              !dst.Find("o1")->object()->bytes.empty() ||
              !dst.Find("o2")->object()->bytes.empty()) {
            untouched = false;
          }
          return s;
        });
    return {statuses, untouched.load()};
  }

  TempDir tmp_;
  std::vector<float> a_, b_;
  bool node_reads_ = false;  // LoadOptions::share_node_reads of LoadOn
};

TEST_F(HeaderMismatchTest, GoodCheckpointLoads) {
  for (int world : {1, 2}) {
    auto [statuses, untouched] = LoadOn(world);
    for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
    EXPECT_FALSE(untouched);
  }
  ASSERT_TRUE(LoadAll(dir()).ok());
}

// The first chunks of a and b swapped in metadata.json (each CRC32C moved
// with its bytes, so every checksum matches): a load would give a's rows
// 0-7 from b and b's from a. Load, on one rank and resharded by columns on
// two, and LoadAll refuse it, naming the chunk, the file, the offset and
// the entry the header has there; nothing is placed.
TEST_F(HeaderMismatchTest, SwappedChunksOfTwoTensors) {
  nlohmann::json j = Metadata();
  nlohmann::json& a0 = j["tensors"]["a"]["chunks"][0];
  nlohmann::json& b0 = j["tensors"]["b"]["chunks"][0];
  SwapLocations(a0, b0);
  const std::string file = a0["file"];
  const uint64_t a_offset = a0["offset"];  // where b@0,0 is stored
  SetMetadata(j);
  ASSERT_TRUE(ReadMetadata(dir()).ok());  // the metadata alone is valid
  for (int world : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks"));
    auto [statuses, untouched] = LoadOn(world);
    for (const absl::Status& s : statuses) {
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_THAT(Msg(s), HasSubstr(file)) << s;
    }
    // Whichever chunk the rank checked first is named, with its offset.
    const std::string m = Msg(statuses[0]);
    EXPECT_THAT(m, testing::AnyOf(
                       HasSubstr(absl::StrCat("a@0,0 (", file, ", offset ",
                                              a_offset)),
                       HasSubstr("b@0,0 (")))
        << m;
    EXPECT_THAT(m, HasSubstr("safetensors entry there is named")) << m;
    EXPECT_TRUE(untouched);
  }
  absl::StatusOr<StateDict> all = LoadAll(dir());
  EXPECT_EQ(all.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(all.status()), HasSubstr("safetensors entry there is named"));
  EXPECT_THAT(Msg(all.status()), HasSubstr(file));
}

// Two objects of one size swapped: each would load the other's bytes.
//
// With node reads, the column halves are read (and placed) before the
// objects: every location is still checked against its header first, so
// nothing lands.
TEST_F(HeaderMismatchTest, SwappedObjects) {
  nlohmann::json j = Metadata();
  SwapLocations(j["objects"]["o1"], j["objects"]["o2"]);
  SetMetadata(j);
  for (int world : {1, 2, -2}) {
    node_reads_ = world < 0;
    world = std::abs(world);
    SCOPED_TRACE(absl::StrCat(world, " ranks", node_reads_ ? ", node reads" : ""));
    auto [statuses, untouched] = LoadOn(world);
    for (const absl::Status& s : statuses) {
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_THAT(Msg(s), testing::AnyOf(HasSubstr("o1 ("), HasSubstr("o2 (")));
      EXPECT_THAT(Msg(s), HasSubstr("named"));
    }
    EXPECT_TRUE(untouched);
  }
  EXPECT_EQ(LoadAll(dir()).status().code(), absl::StatusCode::kDataLoss);
}

// a relabelled I32 in metadata.json (same sizes, so nothing else
// disagrees): a load into I32 tensors would give the F32 bits as integers.
// Refused, naming both dtypes.
TEST_F(HeaderMismatchTest, DTypeRelabelled) {
  nlohmann::json j = Metadata();
  j["tensors"]["a"]["dtype"] = "I32";
  SetMetadata(j);
  ASSERT_TRUE(ReadMetadata(dir()).ok());
  // a alone is loaded: b is still F32, which the planner would refuse to
  // load into I32 before any read.
  for (int world : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks"));
    std::atomic<bool> untouched = true;
    std::vector<absl::Status> statuses =
        RunInProcess(world, [&](Communicator& comm) -> absl::Status {
          const int64_t cols = kCols / world;
          const Box mine{{0, comm.rank() * cols}, {kRows, cols}};
          std::vector<int32_t> out(kRows * cols, -1);
          StateDict dst;
          dst["a"] = ShardedTensor(
              DType::kI32, {kRows, kCols},
              {{mine, TensorView(out.data(), DType::kI32, mine.sizes)}});
          LoadOptions o;
          o.comm = &comm;
          absl::Status s = Load(dst, dir(), o).status();
          if (out != std::vector<int32_t>(kRows * cols, -1)) untouched = false;
          return s;
        });
    for (const absl::Status& s : statuses) {
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_THAT(Msg(s), HasSubstr("a@")) << s;
      EXPECT_THAT(Msg(s), HasSubstr("is F32 [8, 8], expected I32 [8, 8]")) << s;
    }
    EXPECT_TRUE(untouched);
  }
  absl::StatusOr<StateDict> all = LoadAll(dir());
  EXPECT_EQ(all.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(all.status()), HasSubstr("is F32 [8, 8], expected I32 [8, 8]"));
}

TEST_F(BadInputTest, CoverageGapInMetadata) {
  nlohmann::json j = Metadata();
  j["tensors"]["model.w"]["chunks"].erase(1);
  SetMetadata(j);
  absl::Status s = ReadMetadata(dir()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(Msg(s), HasSubstr("model.w"));
}

}  // namespace
}  // namespace cairn
