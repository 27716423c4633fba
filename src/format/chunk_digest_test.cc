#include "format/chunk_digest.h"

#include <cstddef>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "xxhash.h"

namespace cairn::internal_format {
namespace {

std::vector<std::byte> Bytes(size_t n, unsigned seed) {
  std::vector<std::byte> out(n);
  unsigned x = seed;
  for (std::byte& b : out) {
    x = x * 1103515245u + 12345u;
    b = static_cast<std::byte>(x >> 24);
  }
  return out;
}

TEST(ChunkDigestTest, BlockDigestIsXxh3Of128Bits) {
  const std::vector<std::byte> data = Bytes(1000, 1);
  const XXH128_hash_t h = XXH3_128bits(data.data(), data.size());
  const ChunkDigest d = BlockDigest(data.data(), data.size());
  EXPECT_EQ(d.high, h.high64);
  EXPECT_EQ(d.low, h.low64);
}

// The chunk digest is XXH3-128 of the blocks' canonical (big-endian)
// digests, one after another: the definition in docs/format.md 4.2.2,
// computed here independently with xxHash's own canonical form.
TEST(ChunkDigestTest, CombinesCanonicalBlockDigests) {
  const uint64_t block = 4096;
  const std::vector<std::byte> data = Bytes(3 * block + 100, 2);
  std::vector<unsigned char> canonical;
  for (uint64_t at = 0; at < data.size(); at += block) {
    const size_t n = std::min<uint64_t>(block, data.size() - at);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(data.data() + at, n));
    canonical.insert(canonical.end(), c.digest, c.digest + 16);
  }
  const XXH128_hash_t expected =
      XXH3_128bits(canonical.data(), canonical.size());
  const ChunkDigest d = DigestOf(data.data(), data.size(), block);
  EXPECT_EQ(d.high, expected.high64);
  EXPECT_EQ(d.low, expected.low64);
  // Any changed byte changes it, and so does another block size.
  std::vector<std::byte> changed = data;
  changed[2 * block + 7] ^= std::byte{1};
  EXPECT_NE(DigestOf(changed.data(), changed.size(), block), d);
  EXPECT_NE(DigestOf(data.data(), data.size(), 2 * block), d);
}

TEST(ChunkDigestTest, EmptyChunkIsTheDigestOfNothing) {
  const XXH128_hash_t h = XXH3_128bits(nullptr, 0);
  const ChunkDigest d = DigestOf(nullptr, 0, 4096);
  EXPECT_EQ(d.high, h.high64);
  EXPECT_EQ(d.low, h.low64);
}

TEST(ChunkDigestTest, HexRoundTripsAndRejectsBadText) {
  const ChunkDigest d{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  EXPECT_EQ(DigestToHex(d), "0123456789abcdeffedcba9876543210");
  absl::StatusOr<ChunkDigest> back =
      DigestFromHex("0123456789ABCDEFfedcba9876543210");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, d);
  for (const char* bad : {"", "0123", "0123456789abcdeffedcba987654321",
                          "0123456789abcdeffedcba98765432100",
                          "0123456789abcdeffedcba987654321g"}) {
    EXPECT_EQ(DigestFromHex(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

}  // namespace
}  // namespace cairn::internal_format
