// Compressed checkpoints (SaveOptions::codec, format version 5): saved by
// several ranks and loaded back bit-exact under other shardings, partial
// reads of frames, incompressible chunks stored raw, damage found before
// and after decompression, verify, and staged loads.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/metadata.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"
#include "cairn/verify.h"
#include "checkpoint/test_util.h"
#include "format/metadata_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using ::testing::HasSubstr;
using testing_util::TempDir;

// Compressible and position-dependent: each byte is a small hash of
// where it belongs, so a byte in the wrong place is caught, and zstd
// still finds 2 bits of entropy a byte.
std::byte Value(uint64_t seed, int64_t global_byte) {
  uint64_t x = (static_cast<uint64_t>(global_byte) + seed) *
               0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  return static_cast<std::byte>((x >> 7) & 0x3);
}

// Shards of a [rows, cols] tensor and the memory behind them.
struct Shards {
  std::vector<Tensor> owned;
  std::vector<Shard> shards;
};

// Boxes of a [rows, cols] tensor: `parts` row blocks, or column blocks.
std::vector<Box> Split(int64_t rows, int64_t cols, int parts, bool by_cols,
                       int part) {
  const int64_t n = by_cols ? cols : rows;
  const int64_t lo = n * part / parts, hi = n * (part + 1) / parts;
  if (hi == lo) return {};
  return {by_cols ? Box{{0, lo}, {rows, hi - lo}} : Box{{lo, 0}, {hi - lo, cols}}};
}

Shards Make(DType dtype, int64_t rows, int64_t cols,
            const std::vector<Box>& boxes, uint64_t seed, bool fill) {
  Shards s;
  const size_t es = DTypeSize(dtype);
  for (const Box& b : boxes) {
    Tensor t = *Tensor::Empty(dtype, b.sizes);
    auto* p = static_cast<std::byte*>(t.data());
    for (int64_t r = 0; r < b.sizes[0]; ++r) {
      for (int64_t c = 0; c < b.sizes[1]; ++c) {
        const int64_t g = ((b.offsets[0] + r) * cols + b.offsets[1] + c) * es;
        for (size_t i = 0; i < es; ++i) {
          p[(r * b.sizes[1] + c) * es + i] =
              fill ? Value(seed, g + static_cast<int64_t>(i)) : std::byte{0xEE};
        }
      }
    }
    s.shards.push_back({b, t.view()});
    s.owned.push_back(std::move(t));
  }
  return s;
}

// The first wrong byte of `s`, or "".
std::string Check(DType dtype, int64_t cols, const Shards& s, uint64_t seed) {
  const size_t es = DTypeSize(dtype);
  for (const Shard& sh : s.shards) {
    const auto* p = static_cast<const std::byte*>(sh.view.data());
    for (int64_t r = 0; r < sh.box.sizes[0]; ++r) {
      for (int64_t c = 0; c < sh.box.sizes[1]; ++c) {
        const int64_t g =
            ((sh.box.offsets[0] + r) * cols + sh.box.offsets[1] + c) * es;
        for (size_t i = 0; i < es; ++i) {
          if (p[(r * sh.box.sizes[1] + c) * es + i] !=
              Value(seed, g + static_cast<int64_t>(i))) {
            return absl::StrCat(sh.box.ToString(), " element (", r, ", ", c,
                                ") byte ", i);
          }
        }
      }
    }
  }
  return "";
}

constexpr int64_t kRows = 300, kCols = 250;

// `saving` ranks save [kRows, kCols] tensors "w" (F32) and "h" (BF16),
// split by rows, plus an object; `loading` ranks load them by columns.
void SaveByRowsLoadByCols(const std::string& dir, Codec codec, int saving,
                          int loading, const LoadOptions& load_options,
                          LoadResult* first_result = nullptr) {
  std::vector<absl::Status> st = RunInProcess(saving, [&](Communicator& comm) {
    const int r = comm.rank();
    Shards w = Make(DType::kF32, kRows, kCols,
                    Split(kRows, kCols, saving, false, r), 1, true);
    Shards h = Make(DType::kBF16, kRows, kCols,
                    Split(kRows, kCols, saving, false, r), 2, true);
    StateDict sd;
    sd["w"] = ShardedTensor(DType::kF32, {kRows, kCols}, w.shards);
    sd["h"] = ShardedTensor(DType::kBF16, {kRows, kCols}, h.shards);
    sd["blob"] = Object{std::string(10000, 'x')};
    SaveOptions o;
    o.comm = &comm;
    o.codec = codec;
    o.crc32c_block_bytes = 4096;  // many frames per chunk
    return Save(sd, dir, o).status();
  });
  for (const absl::Status& s : st) ASSERT_TRUE(s.ok()) << s;
  std::vector<std::string> wrong(loading);
  std::vector<LoadResult> results(loading);
  st = RunInProcess(loading, [&](Communicator& comm) {
    const int r = comm.rank();
    Shards w = Make(DType::kF32, kRows, kCols,
                    Split(kRows, kCols, loading, true, r), 1, false);
    Shards h = Make(DType::kBF16, kRows, kCols,
                    Split(kRows, kCols, loading, true, r), 2, false);
    StateDict sd;
    sd["w"] = ShardedTensor(DType::kF32, {kRows, kCols}, w.shards);
    sd["h"] = ShardedTensor(DType::kBF16, {kRows, kCols}, h.shards);
    sd["blob"] = Object{};
    LoadOptions o = load_options;
    o.comm = &comm;
    absl::StatusOr<LoadResult> res = Load(sd, dir, o);
    if (!res.ok()) return res.status();
    results[r] = *res;
    wrong[r] = Check(DType::kF32, kCols, w, 1) + Check(DType::kBF16, kCols, h, 2);
    if (sd["blob"].object() == nullptr ||
        sd["blob"].object()->bytes != std::string(10000, 'x')) {
      wrong[r] += "blob";
    }
    return absl::OkStatus();
  });
  for (int r = 0; r < loading; ++r) {
    ASSERT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r];
    EXPECT_EQ(wrong[r], "") << "rank " << r;
    EXPECT_EQ(results[r].bytes_unverified, 0u);
  }
  if (first_result != nullptr) *first_result = results[0];
}

Metadata ReadMd(const std::string& dir) {
  absl::StatusOr<Metadata> md = internal_format::DecodeMetadata(
      testing_util::ReadFile(dir + "/metadata.json"), "metadata.json");
  EXPECT_TRUE(md.ok()) << md.status();
  return md.ok() ? *md : Metadata{};
}

TEST(CompressionTest, FourRanksSaveThreeLoadColumnsBitExact) {
  for (Codec codec : {Codec::kZstd, Codec::kGroupedZstd}) {
    TempDir tmp;
    const std::string dir = tmp.Sub("ckpt");
    LoadResult result;
    SaveByRowsLoadByCols(dir, codec, 4, 3, {}, &result);
    const Metadata md = ReadMd(dir);
    EXPECT_EQ(md.version, 6);
    uint64_t stored = 0, raw = 0;
    for (const auto& [fqn, t] : md.tensors) {
      for (const ChunkMetadata& c : t.chunks) {
        EXPECT_EQ(c.location.compression.codec, codec) << fqn;
        stored += c.location.stored_nbytes();
        raw += c.location.nbytes;
      }
    }
    // 2 bits of entropy a byte: well under half the raw size.
    EXPECT_LT(stored * 2, raw);
    EXPECT_FALSE(md.objects.at("blob").compressed());
    // A column reader decompresses whole frames, but never reads the
    // chunk's file bytes twice over.
    EXPECT_GT(result.bytes_read, 0u);
    EXPECT_LE(result.bytes_read, stored + 10000 + 4096);
  }
}

TEST(CompressionTest, PartsOfFramesAcrossSmallBouncesAndStagedWaves) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  // Slabs smaller than a frame, and waves of staging smaller than a chunk.
  LoadOptions tiny;
  tiny.bounce_buffer_bytes = 1000;
  tiny.io_threads = 3;
  SaveByRowsLoadByCols(dir, Codec::kGroupedZstd, 2, 3, tiny);
  LoadOptions rows;
  rows.memory_budget_bytes = 64 << 10;
  SaveByRowsLoadByCols(tmp.Sub("b"), Codec::kZstd, 3, 1, rows);
}

TEST(CompressionTest, RandomReshardsOfEveryElementSize) {
  TempDir tmp;
  std::mt19937 rng(5);
  for (int iter = 0; iter < 24; ++iter) {
    // F6_E2M3_X4: 3-byte elements, which 4096-byte frames cut.
    const DType dtype = std::vector<DType>{
        DType::kF64, DType::kF32, DType::kBF16,
        DType::kU8,  DType::kI16, DType::kF6_E2M3_X4}[iter % 6];
    const int64_t rows = 20 + rng() % 200, cols = 16 + rng() % 300;
    const int saved = 1 + rng() % 4, loaded = 1 + rng() % 4;
    const bool save_cols = rng() % 2, load_cols = rng() % 2;
    const std::string dir = tmp.Sub(absl::StrCat("c", iter));
    StateDict sd;
    std::vector<Shards> keep;
    for (int r = 0; r < saved; ++r) {
      keep.push_back(Make(dtype, rows, cols,
                          Split(rows, cols, saved, save_cols, r), iter, true));
    }
    std::vector<Shard> all;
    for (const Shards& k : keep) all.insert(all.end(), k.shards.begin(), k.shards.end());
    sd["t"] = ShardedTensor(dtype, {rows, cols}, all);
    SaveOptions so;
    so.codec = (iter / 6) % 2 ? Codec::kZstd : Codec::kGroupedZstd;
    so.codec_level = 1 + iter % 5;
    so.crc32c_block_bytes = 4096;
    so.write_buffer_bytes = 4096 << (rng() % 4);
    ASSERT_TRUE(Save(sd, dir, so).ok());
    std::vector<Shards> dst;
    std::vector<Shard> dst_all;
    for (int r = 0; r < loaded; ++r) {
      dst.push_back(Make(dtype, rows, cols,
                         Split(rows, cols, loaded, load_cols, r), iter, false));
      dst_all.insert(dst_all.end(), dst.back().shards.begin(),
                     dst.back().shards.end());
    }
    StateDict ld;
    ld["t"] = ShardedTensor(dtype, {rows, cols}, dst_all);
    LoadOptions lo;
    lo.bounce_buffer_bytes = size_t{1} << (10 + rng() % 10);
    absl::StatusOr<LoadResult> res = Load(ld, dir, lo);
    ASSERT_TRUE(res.ok()) << res.status();
    for (const Shards& d : dst) {
      ASSERT_EQ(Check(dtype, cols, d, iter), "") << "iteration " << iter;
    }
  }
}

TEST(CompressionTest, IncompressibleAndSmallChunksAreStoredRaw) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  Tensor noise = *Tensor::Empty(DType::kU8, {1 << 16});
  std::mt19937 rng(1);
  auto* p = static_cast<uint8_t*>(noise.data());
  for (int i = 0; i < (1 << 16); ++i) p[i] = static_cast<uint8_t>(rng());
  Tensor small = *Tensor::Zeros(DType::kF32, {100});
  Tensor zeros = *Tensor::Zeros(DType::kF32, {1 << 16});
  StateDict sd;
  sd["noise"] = noise;
  sd["small"] = small;
  sd["zeros"] = zeros;
  SaveOptions so;
  so.codec = Codec::kZstd;
  ASSERT_TRUE(Save(sd, dir, so).ok());
  const Metadata md = ReadMd(dir);
  EXPECT_FALSE(md.tensors.at("noise").chunks[0].location.compressed());
  EXPECT_FALSE(md.tensors.at("small").chunks[0].location.compressed());
  const ByteLocation& z = md.tensors.at("zeros").chunks[0].location;
  ASSERT_TRUE(z.compressed());
  EXPECT_LT(z.compression.stored_nbytes, z.nbytes / 100);
  absl::StatusOr<StateDict> back = LoadAll(dir);
  ASSERT_TRUE(back.ok()) << back.status();
  const ShardedTensor* n = (*back)["noise"].tensor();
  ASSERT_NE(n, nullptr);
  ASSERT_EQ(n->shards().size(), 1u);
  EXPECT_EQ(std::memcmp(n->shards()[0].view.data(), noise.data(), 1 << 16), 0);
  absl::StatusOr<VerifyReport> report = Verify(dir);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->problems.empty());
}

TEST(CompressionTest, BadLevelIsRefused) {
  TempDir tmp;
  StateDict sd;
  sd["t"] = *Tensor::Zeros(DType::kF32, {10});
  SaveOptions so;
  so.codec = Codec::kZstd;
  so.codec_level = 100;
  absl::Status s = Save(sd, tmp.Sub("c"), so).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("level 100"));
}

// Flips one byte at `offset` of the first data file.
void Flip(const std::string& dir, uint64_t offset) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("data-")) continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(offset));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(&c, 1);
    return;
  }
}

TEST(CompressionTest, DamageIsFoundBeforeDecompressingByLoadAndVerify) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  Shards w = Make(DType::kF32, kRows, kCols, {Box{{0, 0}, {kRows, kCols}}}, 1,
                  true);
  StateDict sd;
  sd["w"] = ShardedTensor(DType::kF32, {kRows, kCols}, w.shards);
  SaveOptions so;
  so.codec = Codec::kGroupedZstd;
  so.crc32c_block_bytes = 4096;
  ASSERT_TRUE(Save(sd, dir, so).ok());
  const Metadata md = ReadMd(dir);
  const ByteLocation& loc = md.tensors.at("w").chunks[0].location;
  ASSERT_TRUE(loc.compressed());
  // A byte inside frame 3.
  uint64_t at = loc.offset;
  for (int f = 0; f < 3; ++f) at += loc.compression.frame_nbytes[f];
  Flip(dir, at + 5);
  // A load of only the rows in frame 3 (4096 bytes a frame: about 4 rows
  // of 1000 bytes) finds it; one of rows elsewhere does not read it.
  auto load_rows = [&](int64_t first, int64_t n) {
    Shards d = Make(DType::kF32, kRows, kCols, {Box{{first, 0}, {n, kCols}}},
                    1, false);
    StateDict ld;
    ld["w"] = ShardedTensor(DType::kF32, {kRows, kCols}, d.shards);
    absl::Status s = Load(ld, dir).status();
    return std::pair(s, s.ok() ? Check(DType::kF32, kCols, d, 1) : "");
  };
  auto [bad, unused] = load_rows(13, 1);
  EXPECT_EQ(bad.code(), absl::StatusCode::kDataLoss) << bad;
  EXPECT_THAT(bad.message(), HasSubstr("frame 3"));
  EXPECT_THAT(bad.message(), HasSubstr("before decompressing"));
  auto [good, wrong] = load_rows(100, 50);
  EXPECT_TRUE(good.ok()) << good;
  EXPECT_EQ(wrong, "");
  absl::StatusOr<VerifyReport> report = Verify(dir);
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->problems.size(), 1u);
  EXPECT_THAT(report->problems[0].message, HasSubstr("frame 3"));
}

TEST(CompressionTest, MetadataThatLiesAboutFramesIsRefused) {
  TempDir tmp;
  const std::string dir = tmp.Sub("ckpt");
  StateDict sd;
  sd["z"] = *Tensor::Zeros(DType::kF32, {1 << 14});
  SaveOptions so;
  so.codec = Codec::kZstd;
  so.crc32c_block_bytes = 4096;
  ASSERT_TRUE(Save(sd, dir, so).ok());
  const std::string text = testing_util::ReadFile(dir + "/metadata.json");
  Metadata md = ReadMd(dir);
  ASSERT_TRUE(md.tensors.at("z").chunks[0].location.compressed());
  auto decode = [](Metadata m) {
    absl::StatusOr<std::string> t = internal_format::EncodeMetadata(m);
    if (!t.ok()) return t.status();
    return internal_format::DecodeMetadata(*t, "metadata.json").status();
  };
  {
    Metadata m = md;
    m.tensors.at("z").chunks[0].location.compression.frame_nbytes.pop_back();
    EXPECT_THAT(decode(m).message(), HasSubstr("frame"));
  }
  {
    Metadata m = md;
    m.tensors.at("z").chunks[0].location.compression.stored_nbytes += 1;
    EXPECT_THAT(decode(m).message(), HasSubstr("stored_nbytes"));
  }
  {
    Metadata m = md;
    m.tensors.at("z").chunks[0].location.compression.frame_nbytes[0] =
        1u << 30;
    EXPECT_EQ(decode(m).code(), absl::StatusCode::kDataLoss);
  }
  {
    // Before version 5 the members are unknown ones: ignored, and the
    // entry (U8 of the stored bytes) no longer matches the raw tensor.
    Metadata m = md;
    m.version = 4;
    absl::StatusOr<std::string> t = internal_format::EncodeMetadata(m);
    ASSERT_TRUE(t.ok());
    absl::StatusOr<Metadata> back = internal_format::DecodeMetadata(*t, "m");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_FALSE(back->tensors.at("z").chunks[0].location.compressed());
  }
  EXPECT_TRUE(text.find("\"codec\":\"zstd\"") != std::string::npos);
}

}  // namespace
}  // namespace cairn
