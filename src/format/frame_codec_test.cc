#include "format/frame_codec.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::internal_format {
namespace {

using ::testing::HasSubstr;

// Values like a layer's weights: small floats around zero, as float32.
std::vector<std::byte> Weights(size_t count, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<std::byte> out(count * sizeof(float));
  for (size_t i = 0; i < count; ++i) {
    const float v = dist(gen);
    std::memcpy(out.data() + i * sizeof(float), &v, sizeof(float));
  }
  return out;
}

std::vector<std::byte> Compress(Codec codec, size_t es,
                                const std::vector<std::byte>& raw,
                                int level = 3) {
  FrameCompressor c(codec, level);
  std::vector<std::byte> out(MaxFrameBytes(raw.size()));
  absl::StatusOr<size_t> n = c.Compress(raw, es, out);
  EXPECT_TRUE(n.ok()) << n.status();
  out.resize(n.ok() ? *n : 0);
  return out;
}

TEST(FrameCodecTest, NamesRoundTrip) {
  for (Codec c : {Codec::kNone, Codec::kZstd, Codec::kGroupedZstd}) {
    EXPECT_EQ(*CodecFromName(CodecName(c)), c);
  }
  EXPECT_THAT(CodecFromName("lz4").status().message(),
              HasSubstr("unknown codec \"lz4\""));
  EXPECT_TRUE(CheckCodecLevel(3).ok());
  EXPECT_EQ(CheckCodecLevel(99).code(), absl::StatusCode::kInvalidArgument);
}

TEST(FrameCodecTest, GroupingIsUndone) {
  for (size_t es : {1, 2, 3, 4, 8}) {
    std::vector<std::byte> src(es * 37);
    for (size_t i = 0; i < src.size(); ++i) src[i] = std::byte(i * 7 + 1);
    std::vector<std::byte> grouped(src.size()), back(src.size());
    GroupBytes(src.data(), src.size(), es, grouped.data());
    // Every element's first byte, then every second byte, ...: byte by
    // byte against the definition (the SSE2 paths take 16 elements at a
    // time, and 37 leaves a tail).
    for (size_t i = 0; i < 37; ++i) {
      for (size_t p = 0; p < es; ++p) {
        ASSERT_EQ(grouped[p * 37 + i], src[i * es + p]) << es << " " << i;
      }
    }
    UngroupBytes(grouped.data(), grouped.size(), es, back.data());
    EXPECT_EQ(back, src) << es;
  }
}

TEST(FrameCodecTest, RoundTripsEveryCodecAndElementSize) {
  const std::vector<std::byte> raw = Weights(100000, 1);
  for (Codec codec : {Codec::kZstd, Codec::kGroupedZstd}) {
    // 3: the F6 quads, not regrouped (a frame need not hold them whole:
    // 400000 bytes are not).
    for (size_t es : {1, 2, 3, 4, 8}) {
      const std::vector<std::byte> stored = Compress(codec, es, raw);
      ASSERT_FALSE(stored.empty());
      FrameDecompressor d;
      std::vector<std::byte> back(raw.size());
      ASSERT_TRUE(d.Decompress(codec, es, stored, back).ok());
      EXPECT_EQ(back, raw) << CodecName(codec) << " " << es;
    }
  }
}

// zstd never writes a frame under MinFrameBytes: the bound a decoder
// enforces on hostile metadata must hold for what zstd makes of the most
// compressible input, at every level.
TEST(FrameCodecTest, ZerosCompressNoSmallerThanTheBound) {
  for (size_t n : {size_t{4096}, size_t{100000}, size_t{1} << 20,
                   size_t{3} << 20}) {
    const std::vector<std::byte> zeros(n, std::byte{0});
    for (int level : {-5, 1, 3, 19}) {
      for (Codec codec : {Codec::kZstd, Codec::kGroupedZstd}) {
        for (size_t es : {1, 2, 4, 8}) {
          FrameCompressor c(codec, level);
          std::vector<std::byte> out(MaxFrameBytes(n));
          absl::StatusOr<size_t> got = c.Compress(zeros, es, out);
          ASSERT_TRUE(got.ok());
          EXPECT_GE(*got, MinFrameBytes(n))
              << n << " bytes, level " << level << " " << CodecName(codec)
              << " " << es;
        }
      }
    }
  }
}

// Grouped frames hold literals only unless matches pay: an int64 count
// (positions, step counters) has planes that Huffman codes at best 1 bit
// a byte, where zstd's matches take a frame of it to almost nothing.
TEST(FrameCodecTest, GroupedFramesUseMatchesWhereTheyPay) {
  std::vector<std::byte> raw((size_t{1} << 20) + 8 * 333);
  for (size_t i = 0; i < raw.size() / 8; ++i) {
    const int64_t v = static_cast<int64_t>(i);
    std::memcpy(raw.data() + 8 * i, &v, 8);
  }
  const std::vector<std::byte> stored = Compress(Codec::kGroupedZstd, 8, raw);
  EXPECT_LT(stored.size(), raw.size() / 50) << stored.size();
  FrameDecompressor d;
  std::vector<std::byte> back(raw.size());
  ASSERT_TRUE(d.Decompress(Codec::kGroupedZstd, 8, stored, back).ok());
  EXPECT_EQ(back, raw);
}

// Random bytes: no plane compresses, and the frame stays within the bound
// every reader checks (MaxFrameBytes), at every element size.
TEST(FrameCodecTest, IncompressibleGroupedFramesStayWithinTheBound) {
  std::mt19937 gen(7);
  std::vector<std::byte> raw((size_t{1} << 20) + 24);
  for (std::byte& b : raw) b = std::byte(gen());
  for (size_t es : {2, 4, 8}) {
    const std::vector<std::byte> stored = Compress(Codec::kGroupedZstd, es, raw);
    EXPECT_LE(stored.size(), MaxFrameBytes(raw.size())) << es;
    EXPECT_GE(stored.size(), raw.size()) << es;
    FrameDecompressor d;
    std::vector<std::byte> back(raw.size());
    ASSERT_TRUE(d.Decompress(Codec::kGroupedZstd, es, stored, back).ok());
    EXPECT_EQ(back, raw) << es;
  }
}

TEST(FrameCodecTest, GroupingCompressesFloatsBetter) {
  const std::vector<std::byte> raw = Weights(1 << 18, 2);
  for (int level : {-5, 1, 3}) {
    const size_t plain = Compress(Codec::kZstd, 4, raw, level).size();
    const size_t grouped = Compress(Codec::kGroupedZstd, 4, raw, level).size();
    EXPECT_LT(grouped, plain) << level;
    // Under the 0.95 a save needs to keep a chunk compressed: the
    // exponent plane is Huffman coded at the fast levels too.
    EXPECT_LT(grouped, raw.size() * 0.9) << level;
  }
}

TEST(FrameCodecTest, DamageIsDataLossNeverAnOverrun) {
  const std::vector<std::byte> raw = Weights(4096, 3);
  const std::vector<std::byte> stored = Compress(Codec::kGroupedZstd, 4, raw);
  FrameDecompressor d;
  std::vector<std::byte> back(raw.size());
  // Cut short.
  absl::Status s = d.Decompress(
      Codec::kGroupedZstd, 4,
      std::span<const std::byte>(stored.data(), stored.size() - 3), back);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  // Bytes after the frame.
  std::vector<std::byte> longer = stored;
  longer.push_back(std::byte{0});
  s = d.Decompress(Codec::kGroupedZstd, 4, longer, back);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("not one zstd frame"));
  // A raw size other than the frame's.
  std::vector<std::byte> small(raw.size() - 4);
  s = d.Decompress(Codec::kGroupedZstd, 4, stored, small);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("expected"));
  // Not zstd at all.
  std::vector<std::byte> junk(64, std::byte{0x5a});
  s = d.Decompress(Codec::kZstd, 4, junk, back);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  // Every single flipped byte of the frame: an error or (where zstd cannot
  // tell) other bytes, never a crash; the stored CRC32C catches those.
  for (size_t i = 0; i < stored.size(); ++i) {
    std::vector<std::byte> bad = stored;
    bad[i] ^= std::byte{0x40};
    (void)d.Decompress(Codec::kGroupedZstd, 4, bad, back);
  }
}

}  // namespace
}  // namespace cairn::internal_format
