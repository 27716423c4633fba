// Verify (cairn/verify.h): a clean checkpoint verifies with the right
// counts; each kind of damage in the data files is a problem of its kind
// naming the FQN, the file and the offset; damage that stops the check
// (metadata.json, no checkpoint, bad options) is an error status.
#include "cairn/verify.h"

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "checkpoint/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using testing::HasSubstr;
using testing::SizeIs;
using testing_util::FlipBits;
using testing_util::ReadFile;
using testing_util::TempDir;
using testing_util::WriteFile;

constexpr uint64_t kBlockBytes = 4096;

// The kinds of a report's problems, in order.
std::vector<std::string> Kinds(const VerifyReport& report) {
  std::vector<std::string> kinds;
  for (const VerifyProblem& p : report.problems) kinds.push_back(p.kind);
  return kinds;
}

std::string Messages(const VerifyReport& report) {
  std::string all;
  for (const VerifyProblem& p : report.problems) {
    absl::StrAppend(&all, p.message, "\n");
  }
  return all;
}

// One rank's checkpoint in one data file: "model.w" in two chunks of two
// 4 KiB blocks each (format version 3 block checksums), "model.b" in one
// chunk smaller than a block (no block checksums), an object and a scalar.
class VerifyTest : public testing::Test {
 protected:
  void SetUp() override {
    w_.resize(64 * 64);
    for (size_t i = 0; i < w_.size(); ++i) w_[i] = static_cast<float>(i);
    b_.assign(16, 0.5f);
    StateDict sd;
    sd["model"]["w"] = ShardedTensor(
        DType::kF32, {64, 64},
        {{Box{{0, 0}, {32, 64}}, TensorView(w_.data(), DType::kF32, {32, 64})},
         {Box{{32, 0}, {32, 64}},
          TensorView(w_.data() + 32 * 64, DType::kF32, {32, 64})}});
    sd["model"]["b"] = TensorView(b_.data(), DType::kF32, {16});
    sd["rng"] = Object{"0123456789"};
    sd["step"] = int64_t{3};
    SaveOptions o;
    o.save_id = "vt";  // so that the data file has a known name
    o.crc32c_block_bytes = kBlockBytes;
    ASSERT_TRUE(Save(sd, dir(), o).ok());
    absl::StatusOr<Metadata> md = ReadMetadata(dir());
    ASSERT_TRUE(md.ok()) << md.status();
    md_ = *std::move(md);
  }

  std::string dir() const { return tmp_.path(); }
  std::string metadata_path() const { return dir() + "/metadata.json"; }
  static std::string data_name() { return "data-00000-vt.safetensors"; }
  std::string data_path() const { return dir() + "/" + data_name(); }
  const ByteLocation& chunk(const std::string& fqn, size_t i) const {
    return md_.tensors.at(fqn).chunks.at(i).location;
  }

  // Verify that must return a report.
  VerifyReport MustVerify(const VerifyOptions& options = {}) {
    absl::StatusOr<VerifyReport> report = Verify(dir(), options);
    EXPECT_TRUE(report.ok()) << report.status();
    return report.ok() ? *std::move(report) : VerifyReport{};
  }

  TempDir tmp_;
  std::vector<float> w_, b_;
  Metadata md_;
};

TEST_F(VerifyTest, CleanCheckpointVerifiesWithTheRightCounts) {
  ASSERT_THAT(chunk("model.w", 1).block_crc32c, SizeIs(2));
  ASSERT_TRUE(chunk("model.b", 0).block_crc32c.empty());
  const VerifyReport r = MustVerify();
  EXPECT_TRUE(r.ok()) << Messages(r);
  EXPECT_EQ(r.format_version, kFormatVersion);
  EXPECT_TRUE(r.metadata_checksum);
  EXPECT_EQ(r.tensors, 2u);
  EXPECT_EQ(r.chunks, 3u);
  EXPECT_EQ(r.objects, 1u);
  EXPECT_EQ(r.files, 1);
  EXPECT_EQ(r.bytes_checked, md_.total_bytes());
  EXPECT_EQ(r.bytes_checked, (64 * 64 + 16) * 4 + 10);
  EXPECT_GE(r.seconds, 0.0);
}

// Pieces smaller than a block, and not dividing it, on several threads:
// the same bytes are checked, and progress counts up to them one call at
// a time.
TEST_F(VerifyTest, SmallPiecesCheckTheSameBytesAndReportProgress) {
  VerifyOptions o;
  o.io_threads = 3;
  o.buffer_bytes = 1000;
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  std::atomic<int> in_call = 0;
  std::atomic<bool> overlapped = false;
  o.progress = [&](uint64_t done, uint64_t total) {
    if (++in_call > 1) overlapped = true;
    calls.emplace_back(done, total);
    --in_call;
  };
  const VerifyReport r = MustVerify(o);
  EXPECT_TRUE(r.ok()) << Messages(r);
  EXPECT_EQ(r.bytes_checked, md_.total_bytes());
  EXPECT_FALSE(overlapped);
  ASSERT_FALSE(calls.empty());
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].second, md_.total_bytes());
    if (i > 0) {
      EXPECT_GE(calls[i].first, calls[i - 1].first);
    }
  }
  EXPECT_EQ(calls.back().first, md_.total_bytes());
}

TEST_F(VerifyTest, FlippedByteInAChunkIsACrc32cProblemNamingIt) {
  const ByteLocation& loc = chunk("model.b", 0);
  ASSERT_TRUE(FlipBits(data_path(), loc.offset + 10, 0x10).ok());
  const VerifyReport r = MustVerify();
  ASSERT_THAT(Kinds(r), testing::ElementsAre("crc32c")) << Messages(r);
  const VerifyProblem& p = r.problems[0];
  EXPECT_EQ(p.fqn, "model.b");
  EXPECT_EQ(p.file, data_name());
  EXPECT_EQ(p.offset, loc.offset);
  EXPECT_THAT(p.message, HasSubstr("crc32c mismatch in model.b (" +
                                   data_name() + ", offset " +
                                   std::to_string(loc.offset)));
  EXPECT_FALSE(r.ok());
}

TEST_F(VerifyTest, FlippedByteInOneBlockNamesTheBlock) {
  const ByteLocation& loc = chunk("model.w", 1);
  ASSERT_TRUE(FlipBits(data_path(), loc.offset + kBlockBytes + 5, 0x01).ok());
  const VerifyReport r = MustVerify();
  ASSERT_THAT(Kinds(r), testing::ElementsAre("crc32c")) << Messages(r);
  const VerifyProblem& p = r.problems[0];
  EXPECT_EQ(p.fqn, "model.w");
  EXPECT_EQ(p.file, data_name());
  EXPECT_EQ(p.offset, loc.offset);
  EXPECT_THAT(p.message, HasSubstr("crc32c mismatch in model.w@[32:64, 0:64]"));
  EXPECT_THAT(p.message,
              HasSubstr("first in block 1 (bytes [4096, 8192) of it)"));
}

// Two block checksums swapped in metadata.json (resealed): the chunk's
// whole checksum still matches, its blocks' do not.
TEST_F(VerifyTest, SwappedBlockChecksumsAreNamed) {
  nlohmann::json j = nlohmann::json::parse(ReadFile(metadata_path()));
  // One string of 8 hex digits per block.
  nlohmann::json& blocks =
      j["tensors"]["model.w"]["chunks"][0]["crc32c_blocks"];
  const std::string hex = blocks.get<std::string>();
  ASSERT_EQ(hex.size(), 16u) << j.dump();
  blocks = hex.substr(8) + hex.substr(0, 8);
  WriteFile(metadata_path(), testing_util::Resealed(j.dump()));
  const VerifyReport r = MustVerify();
  ASSERT_THAT(Kinds(r), testing::ElementsAre("crc32c")) << Messages(r);
  EXPECT_THAT(r.problems[0].message,
              HasSubstr("block checksum mismatch in model.w@[0:32, 0:64]"));
  EXPECT_THAT(r.problems[0].message, HasSubstr("block 0 (bytes [0, 4096)"));
}

TEST_F(VerifyTest, TruncatedDataFileIsNamedWithWhatItCutsOff) {
  const uint64_t size = std::filesystem::file_size(data_path());
  const ByteLocation& last = chunk("model.w", 1);
  ASSERT_LT(last.offset, size - 100);
  std::filesystem::resize_file(data_path(), last.offset + 100);
  const VerifyReport r = MustVerify();
  ASSERT_FALSE(r.problems.empty());
  // The file first, with its real size; then each chunk or object past it.
  EXPECT_EQ(r.problems[0].kind, "truncated");
  EXPECT_EQ(r.problems[0].file, data_name());
  EXPECT_EQ(r.problems[0].offset, last.offset + 100);
  EXPECT_THAT(r.problems[0].message, HasSubstr("truncated"));
  bool named = false;
  for (const VerifyProblem& p : r.problems) {
    EXPECT_THAT(p.kind, testing::AnyOf("truncated", "header")) << p.message;
    named |= p.kind == "truncated" && p.fqn == "model.w" &&
             p.offset == last.offset;
  }
  EXPECT_TRUE(named) << Messages(r);
  EXPECT_LT(r.bytes_checked, md_.total_bytes());
}

TEST_F(VerifyTest, MissingDataFileIsNamed) {
  ASSERT_TRUE(std::filesystem::remove(data_path()));
  const VerifyReport r = MustVerify();
  ASSERT_THAT(Kinds(r), testing::ElementsAre("missing_file")) << Messages(r);
  EXPECT_EQ(r.problems[0].file, data_name());
  EXPECT_FALSE(r.problems[0].offset.has_value());
  EXPECT_THAT(r.problems[0].message, HasSubstr("cannot open data file"));
  EXPECT_EQ(r.files, 1);
  EXPECT_EQ(r.chunks, 3u);  // from the metadata, whatever was read
  EXPECT_EQ(r.bytes_checked, 0u);
}

// metadata.json changed after it was written (one digit of a scalar, which
// nothing else checks): nothing to verify against, so an error naming it.
TEST_F(VerifyTest, DamagedMetadataIsDataLossNamingTheFile) {
  std::string text = ReadFile(metadata_path());
  const size_t at = text.find(R"("step":{"int64":3})");
  ASSERT_NE(at, std::string::npos);
  text[at + 16] = '7';
  WriteFile(metadata_path(), text);
  absl::StatusOr<VerifyReport> r = Verify(dir());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr(metadata_path() + ": metadata checksum mismatch"));
}

TEST_F(VerifyTest, NoCheckpointIsNotFound) {
  TempDir empty;
  absl::StatusOr<VerifyReport> r = Verify(empty.path());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  // Uncommitted: the data file is there, metadata.json is not.
  ASSERT_TRUE(std::filesystem::remove(metadata_path()));
  r = Verify(dir());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_THAT(std::string(r.status().message()),
              HasSubstr("no committed checkpoint"));
}

TEST_F(VerifyTest, BadOptionsAreInvalidArgument) {
  for (int threads : {0, -1}) {
    VerifyOptions o;
    o.io_threads = threads;
    absl::StatusOr<VerifyReport> r = Verify(dir(), o);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << threads << ": " << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("io_threads"));
  }
  VerifyOptions o;
  o.buffer_bytes = 0;
  absl::StatusOr<VerifyReport> r = Verify(dir(), o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
      << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("buffer_bytes"));
}

}  // namespace
}  // namespace cairn
