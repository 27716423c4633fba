// Loads that return part of a stored chunk (a slice: an inference worker's
// shard, ranks that each load half of their rows) return only verified
// bytes (issue 33, item 8): the parts that no other rank's parts complete
// are checked after the load by the ranks that read them, from the block
// checksums around them (format version 3) or, for a checkpoint without
// them, by reading the whole chunk.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "checkpoint/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include <nlohmann/json.hpp>

namespace cairn {
namespace {

using ::testing::HasSubstr;
using testing_util::TempDir;

constexpr int64_t kRows = 1024, kCols = 1024;  // F32: 4 KiB a row

std::vector<float> Arange(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  return v;
}

// The whole [kRows, kCols] tensor "w", saved by `world` ranks, each its
// kRows / world rows as one chunk (of 4 MiB / world).
void SaveRows(const std::string& dir, int world, const SaveOptions& base = {}) {
  static const std::vector<float> full = Arange(kRows * kCols);
  const int64_t rows = kRows / world;
  std::vector<absl::Status> statuses =
      RunInProcess(world, [&](Communicator& comm) -> absl::Status {
        const int64_t r0 = comm.rank() * rows;
        StateDict sd;
        sd["w"] = ShardedTensor(
            DType::kF32, {kRows, kCols},
            {{Box{{r0, 0}, {rows, kCols}},
              TensorView(const_cast<float*>(full.data()) + r0 * kCols,
                         DType::kF32, {rows, kCols})}});
        SaveOptions options = base;
        options.comm = &comm;
        return Save(sd, dir, options).status();
      });
  for (const absl::Status& s : statuses) ASSERT_TRUE(s.ok()) << s;
}

// Flips a bit of element (row, col) of "w" in its stored chunk.
void Flip(const std::string& dir, int64_t row, int64_t col) {
  absl::StatusOr<Metadata> md = ReadMetadata(dir);
  ASSERT_TRUE(md.ok()) << md.status();
  for (const ChunkMetadata& c : md->tensors.at("w").chunks) {
    if (row < c.box.offsets[0] || row >= c.box.offsets[0] + c.box.sizes[0]) {
      continue;
    }
    const uint64_t at = c.location.offset +
                        ((row - c.box.offsets[0]) * kCols + col) * 4 + 1;
    ASSERT_TRUE(testing_util::FlipBits(dir + "/" + c.location.file, at, 0x40)
                    .ok());
    return;
  }
  FAIL() << "no chunk holds row " << row;
}

struct Loaded {
  std::vector<absl::Status> statuses;
  std::vector<LoadResult> results;
  std::vector<std::vector<float>> values;
};

// Rank r of `world` loads boxes[r] of "w".
Loaded LoadBoxes(const std::string& dir, const std::vector<Box>& boxes,
                 const LoadOptions& base = {}) {
  const int world = static_cast<int>(boxes.size());
  Loaded out;
  out.results.resize(world);
  out.values.resize(world);
  out.statuses = RunInProcess(world, [&](Communicator& comm) -> absl::Status {
    const Box& box = boxes[comm.rank()];
    std::vector<float>& v = out.values[comm.rank()];
    v.assign(box.num_elements(), -1.0f);
    StateDict sd;
    sd["w"] = ShardedTensor(DType::kF32, {kRows, kCols},
                            {{box, TensorView(v.data(), DType::kF32, box.sizes)}});
    LoadOptions options = base;
    options.comm = &comm;
    absl::StatusOr<LoadResult> r = Load(sd, dir, options);
    if (r.ok()) out.results[comm.rank()] = *r;
    return r.status();
  });
  return out;
}

// Whether `v` holds exactly box's elements of Arange.
bool Holds(const std::vector<float>& v, const Box& box) {
  for (int64_t i = 0; i < box.sizes[0]; ++i) {
    for (int64_t j = 0; j < box.sizes[1]; ++j) {
      const float want =
          static_cast<float>((box.offsets[0] + i) * kCols + box.offsets[1] + j);
      if (v[i * box.sizes[1] + j] != want) return false;
    }
  }
  return true;
}

// Each of 4 ranks the first half of the rows it saved.
std::vector<Box> HalfOfEachRanksRows() {
  std::vector<Box> boxes;
  for (int64_t r = 0; r < 4; ++r) boxes.push_back(Box{{r * 256, 0}, {128, kCols}});
  return boxes;
}

void ExpectDataLossNaming(const absl::Status& s, const std::string& entry) {
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(entry)) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(".safetensors")) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("offset")) << s;
}

// The case: one flipped bit in a chunk, four ranks each loading
// half of their rows. The parts tile no chunk, so before block checksums
// the load returned the wrong value with OK; now every rank fails with
// the same kDataLoss naming the chunk.
TEST(PartialVerifyTest, FlippedBitInHalfTheRowsFailsOnEveryRank) {
  TempDir tmp;
  SaveRows(tmp.path(), 4);
  Loaded clean = LoadBoxes(tmp.path(), HalfOfEachRanksRows());
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(clean.statuses[r].ok()) << clean.statuses[r];
    EXPECT_TRUE(Holds(clean.values[r], HalfOfEachRanksRows()[r]));
    EXPECT_EQ(clean.results[r].bytes_verified, 128 * kCols * 4);
    EXPECT_EQ(clean.results[r].bytes_unverified, 0u);
  }
  Flip(tmp.path(), 300, 17);  // chunk 1 (rows 256..512), in rank 1's half
  Loaded damaged = LoadBoxes(tmp.path(), HalfOfEachRanksRows());
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE(r);
    ExpectDataLossNaming(damaged.statuses[r], "w@256,0");
    EXPECT_EQ(damaged.statuses[r], damaged.statuses[0]);
  }
}

// With verify_checksums off the same load is not checked, and says so.
TEST(PartialVerifyTest, UncheckedPartialLoadReportsUnverifiedBytes) {
  TempDir tmp;
  SaveRows(tmp.path(), 4);
  Flip(tmp.path(), 300, 17);
  LoadOptions off;
  off.verify_checksums = false;
  Loaded blind = LoadBoxes(tmp.path(), HalfOfEachRanksRows(), off);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(blind.statuses[r].ok()) << blind.statuses[r];
    EXPECT_EQ(blind.results[r].bytes_verified, 0u);
    EXPECT_EQ(blind.results[r].bytes_unverified, 128 * kCols * 4);
  }
  EXPECT_FALSE(Holds(blind.values[1], HalfOfEachRanksRows()[1]));
}

// One process loading a slice of a stored chunk (4 MiB, blocks of 1 MiB):
// rows, or a column (a byte in every block), of a damaged chunk fail; of
// an undamaged one they load, verified, reading the slice and the blocks
// around it (not the whole chunk, for rows).
TEST(PartialVerifyTest, SliceOfOneChunkIsCheckedByItsBlocks) {
  TempDir tmp;
  SaveRows(tmp.path(), 1);
  const Box rows{{90, 0}, {20, kCols}};
  const Box column{{0, 500}, {kRows, 2}};
  Loaded ok = LoadBoxes(tmp.path(), {rows});
  ASSERT_TRUE(ok.statuses[0].ok()) << ok.statuses[0];
  EXPECT_TRUE(Holds(ok.values[0], rows));
  EXPECT_EQ(ok.results[0].bytes_verified, 20 * kCols * 4);
  EXPECT_EQ(ok.results[0].bytes_unverified, 0u);
  EXPECT_EQ(ok.results[0].chunks_verified, 1u);
  // The rows, then their one block again: far less than the chunk.
  EXPECT_EQ(ok.results[0].bytes_read, 20 * kCols * 4 + kDefaultCrc32cBlockBytes);
  Loaded col = LoadBoxes(tmp.path(), {column});
  ASSERT_TRUE(col.statuses[0].ok()) << col.statuses[0];
  EXPECT_EQ(col.results[0].bytes_verified, kRows * 2 * 4);

  // A bit in row 100 (block 0): both slices fail, naming the tensor.
  Flip(tmp.path(), 100, 3);
  ExpectDataLossNaming(LoadBoxes(tmp.path(), {rows}).statuses[0], "w");
  ExpectDataLossNaming(LoadBoxes(tmp.path(), {column}).statuses[0], "block 0");
  // Rows whose blocks hold no damaged byte still load, verified.
  const Box far{{900, 0}, {20, kCols}};
  Loaded other = LoadBoxes(tmp.path(), {far});
  ASSERT_TRUE(other.statuses[0].ok()) << other.statuses[0];
  EXPECT_TRUE(Holds(other.values[0], far));
  EXPECT_EQ(other.results[0].bytes_verified, 20 * kCols * 4);
}

// Small blocks (SaveOptions::crc32c_block_bytes): a slice reads only the
// blocks it touches, and a bit in another block of the chunk does not
// fail it; in its own block it does.
TEST(PartialVerifyTest, SmallBlocksNarrowTheCheck) {
  TempDir tmp;
  SaveOptions small;
  small.crc32c_block_bytes = 16384;  // 4 rows
  SaveRows(tmp.path(), 4, small);
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->crc32c_block_bytes, 16384u);
  EXPECT_EQ(md->tensors.at("w").chunks[1].location.block_crc32c.size(), 64u);
  Flip(tmp.path(), 450, 5);  // chunk 1, outside every rank's half
  Loaded ok = LoadBoxes(tmp.path(), HalfOfEachRanksRows());
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(ok.statuses[r].ok()) << ok.statuses[r];
    // Rows r*256..r*256+128 are 32 whole blocks: read again once.
    EXPECT_EQ(ok.results[r].bytes_read, 2 * 128 * kCols * 4);
  }
  Flip(tmp.path(), 450, 5);
  Flip(tmp.path(), 383, 5);  // the last row of rank 1's half
  Loaded bad = LoadBoxes(tmp.path(), HalfOfEachRanksRows());
  for (int r = 0; r < 4; ++r) {
    ExpectDataLossNaming(bad.statuses[r], "w@256,0");
    EXPECT_THAT(std::string(bad.statuses[r].message()), HasSubstr("block 31"));
  }
}

// A version 2 checkpoint (no block checksums) still loads in part: the
// rest of the chunk is read to check its CRC32C, so damage anywhere in
// the chunk fails the slice.
TEST(PartialVerifyTest, Version2SliceIsCheckedByReadingTheWholeChunk) {
  TempDir tmp;
  SaveRows(tmp.path(), 1);
  const std::string path = tmp.path() + "/metadata.json";
  nlohmann::json j = nlohmann::json::parse(testing_util::ReadFile(path));
  j.erase("checksum");
  j.erase("crc32c_block_bytes");
  for (auto& chunk : j["tensors"]["w"]["chunks"]) chunk.erase("crc32c_blocks");
  j["version"] = 2;
  testing_util::WriteFile(path, testing_util::Resealed(j.dump()));
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok()) << md.status();
  ASSERT_EQ(md->version, 2);
  const Box rows{{90, 0}, {20, kCols}};
  Loaded ok = LoadBoxes(tmp.path(), {rows});
  ASSERT_TRUE(ok.statuses[0].ok()) << ok.statuses[0];
  EXPECT_TRUE(Holds(ok.values[0], rows));
  EXPECT_EQ(ok.results[0].bytes_verified, 20 * kCols * 4);
  EXPECT_EQ(ok.results[0].bytes_read, 20 * kCols * 4 + kRows * kCols * 4);
  Flip(tmp.path(), 900, 3);  // far from the slice, in its chunk
  ExpectDataLossNaming(LoadBoxes(tmp.path(), {rows}).statuses[0],
                       "read whole to check");
}

// Full loads, row reshards whose parts tile every chunk, read nothing
// more than before: no chunk is left for the ranks to check.
TEST(PartialVerifyTest, LoadsThatCoverEveryChunkReadNoMore) {
  TempDir tmp;
  SaveRows(tmp.path(), 4);
  std::vector<Box> thirds;  // 3 ranks: row boundaries inside chunks
  for (int64_t r = 0; r < 3; ++r) {
    const int64_t begin = r * kRows / 3, end = (r + 1) * kRows / 3;
    thirds.push_back(Box{{begin, 0}, {end - begin, kCols}});
  }
  Loaded l = LoadBoxes(tmp.path(), thirds);
  uint64_t read = 0;
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(l.statuses[r].ok()) << l.statuses[r];
    EXPECT_TRUE(Holds(l.values[r], thirds[r]));
    EXPECT_EQ(l.results[r].bytes_unverified, 0u);
    read += l.results[r].bytes_read;
  }
  EXPECT_EQ(read, kRows * kCols * 4);
}

}  // namespace
}  // namespace cairn
