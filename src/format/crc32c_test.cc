#include "format/crc32c.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace cairn::internal_format {
namespace {

// Bitwise reference CRC32C, independent of ISA-L.
uint32_t ReferenceCrc32c(const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & -(crc & 1));
  }
  return ~crc;
}

std::vector<unsigned char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(Crc32cTest, StandardCheckValue) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
}

TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(Crc32c("", 0), 0u);
  EXPECT_EQ(Crc32c("a", 1), 0xC1D04330u);
  std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720
  std::vector<unsigned char> ones(32, 0xFF);
  EXPECT_EQ(Crc32c(ones.data(), ones.size()), 0x62A8AB43u);  // RFC 3720
}

TEST(Crc32cTest, MatchesBitwiseReference) {
  for (size_t n : {0, 1, 7, 8, 15, 16, 63, 64, 255, 1000, 4096, 100003}) {
    auto data = RandomBytes(n, static_cast<uint32_t>(n));
    EXPECT_EQ(Crc32c(data.data(), n), ReferenceCrc32c(data.data(), n)) << n;
  }
}

TEST(Crc32cTest, ExtendEqualsWhole) {
  auto data = RandomBytes(10000, 1);
  const uint32_t whole = Crc32c(data.data(), data.size());
  for (size_t split : {size_t{0}, size_t{1}, size_t{4999}, size_t{10000}}) {
    uint32_t crc = Crc32c(data.data(), split);
    crc = Crc32cExtend(crc, data.data() + split, data.size() - split);
    EXPECT_EQ(crc, whole) << split;
  }
}

TEST(Crc32cTest, CombineMatchesWholeOnRandomSplits) {
  std::mt19937 rng(42);
  auto data = RandomBytes(70000, 2);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t n = rng() % (data.size() + 1);
    const size_t split = rng() % (n + 1);
    const uint32_t a = Crc32c(data.data(), split);
    const uint32_t b = Crc32c(data.data() + split, n - split);
    EXPECT_EQ(Crc32cCombine(a, b, n - split), Crc32c(data.data(), n))
        << "n=" << n << " split=" << split;
  }
}

TEST(Crc32cTest, CombineWithEmptyPieces) {
  auto data = RandomBytes(100, 3);
  const uint32_t whole = Crc32c(data.data(), data.size());
  EXPECT_EQ(Crc32cCombine(whole, Crc32c(nullptr, 0), 0), whole);
  EXPECT_EQ(Crc32cCombine(Crc32c(nullptr, 0), whole, data.size()), whole);
  EXPECT_EQ(Crc32cCombine(0, 0, 0), 0u);
}

// Signatures: the parts of a chunk cut any way (here: every k-th run of 37
// bytes, as a column cut of a row-major chunk would give) sum to the
// chunk's CRC32C, whichever rank computed which part.
TEST(Crc32cTest, SignaturesOfPartsXorToTheWholeCrc) {
  auto data = RandomBytes(37 * 64 + 5, 9);
  const uint64_t n = data.size();
  const uint32_t whole = Crc32c(data.data(), n);
  std::vector<unsigned char> zeros(n, 0);
  EXPECT_EQ(Crc32cOfZeros(n), Crc32c(zeros.data(), n));
  EXPECT_EQ(Crc32cOfZeros(0), 0u);
  EXPECT_EQ(Crc32cRaw(zeros.data(), n), 0u);
  // Three parts: runs 0, 3, 6, ... / 1, 4, ... / 2, 5, ... and the tail.
  for (int parts = 1; parts <= 4; ++parts) {
    std::vector<uint32_t> sig(parts, 0);
    for (uint64_t run = 0; run * 37 < n; ++run) {
      const uint64_t begin = run * 37;
      const uint64_t len = std::min<uint64_t>(37, n - begin);
      std::vector<unsigned char> masked(n, 0);
      std::memcpy(masked.data() + begin, data.data() + begin, len);
      // Each run's signature on its own, the slow way ...
      const uint32_t slow = Crc32cRaw(masked.data(), n);
      // ... and from its bytes and position.
      const uint32_t fast =
          Crc32cShift(Crc32cRaw(data.data() + begin, len), n - begin - len);
      ASSERT_EQ(slow, fast) << "run " << run;
      EXPECT_EQ(Crc32cPieceSignature(Crc32c(data.data() + begin, len), begin,
                                     len, n),
                fast);
      sig[run % parts] ^= fast;
    }
    uint32_t all = 0;
    for (uint32_t s : sig) all ^= s;
    EXPECT_EQ(all ^ Crc32cOfZeros(n), whole) << parts << " parts";
  }
  // One changed byte changes the sum.
  data[100] ^= 1;
  uint32_t changed = 0;
  for (uint64_t begin = 0; begin < n; begin += 37) {
    const uint64_t len = std::min<uint64_t>(37, n - begin);
    changed ^= Crc32cShift(Crc32cRaw(data.data() + begin, len), n - begin - len);
  }
  EXPECT_NE(changed ^ Crc32cOfZeros(n), whole);
}

TEST(Crc32cTest, ShifterMatchesShift) {
  std::mt19937 rng(11);
  for (uint64_t zeros : {uint64_t{0}, uint64_t{1}, uint64_t{4096},
                         uint64_t{65536 + 17}, uint64_t{1} << 40}) {
    const Crc32cShifter shift(zeros);
    EXPECT_EQ(shift.zero_bytes(), zeros);
    for (int i = 0; i < 100; ++i) {
      const uint32_t raw = static_cast<uint32_t>(rng());
      ASSERT_EQ(shift(raw), Crc32cShift(raw, zeros)) << zeros;
    }
  }
}

TEST(Crc32cTest, CombineManyPieces) {
  auto data = RandomBytes(50000, 4);
  std::mt19937 rng(7);
  uint32_t crc = 0;
  size_t pos = 0;
  while (pos < data.size()) {
    const size_t n = std::min<size_t>(rng() % 3000, data.size() - pos);
    crc = Crc32cCombine(crc, Crc32c(data.data() + pos, n), n);
    pos += n;
  }
  EXPECT_EQ(crc, Crc32c(data.data(), data.size()));
}

// Combining with a long run of zeros is checked against Extend over an
// explicit zero buffer; lengths past 2^32 exercise the high table entries
// against the identity x^(8(m+n)) = x^(8m) x^(8n) (checked via composition).
TEST(Crc32cTest, CombineLargeLengths) {
  const size_t kZeros = (size_t{1} << 24) + 13;
  std::vector<unsigned char> zeros(kZeros, 0);
  const uint32_t a = Crc32c("hello", 5);
  const uint32_t zero_crc = Crc32c(zeros.data(), zeros.size());
  EXPECT_EQ(Crc32cCombine(a, zero_crc, kZeros),
            Crc32cExtend(a, zeros.data(), zeros.size()));

  // Combine(Combine(a, b, m), c, n) == Combine(a, Combine(b, c, n), m + n).
  const uint32_t b = Crc32c("world", 5);
  const uint32_t c = Crc32c("!!", 2);
  for (uint64_t m : {uint64_t{5}, uint64_t{1} << 33, (uint64_t{1} << 62) + 3,
                     ~uint64_t{0} >> 1}) {
    for (uint64_t n : {uint64_t{2}, uint64_t{1} << 40, uint64_t{1} << 61}) {
      EXPECT_EQ(Crc32cCombine(Crc32cCombine(a, b, m), c, n),
                Crc32cCombine(a, Crc32cCombine(b, c, n), m + n))
          << m << " " << n;
    }
  }
  // The largest length does not crash and is not the identity.
  EXPECT_NE(Crc32cCombine(a, 0, ~uint64_t{0}), a);
}

// ISA-L takes an int length: inputs over 1 GiB go through several calls.
// Skipped when the buffer cannot be allocated.
TEST(Crc32cTest, InputLargerThanIntSplitsCorrectly) {
  const size_t kSize = (size_t{1} << 30) + 4097;  // 1 GiB + 4097
  std::vector<unsigned char> big;
  try {
    big.assign(kSize, 0);
  } catch (const std::bad_alloc&) {
    GTEST_SKIP() << "cannot allocate 1 GiB";
  }
  for (size_t i = 0; i < kSize; i += 4096)
    big[i] = static_cast<unsigned char>(i >> 12);
  big[kSize - 1] = 0x5a;
  const size_t half = 12345;  // pieces on both sides of the 1 GiB split
  const uint32_t a = Crc32c(big.data(), half);
  const uint32_t b = Crc32c(big.data() + half, kSize - half);
  EXPECT_EQ(Crc32c(big.data(), kSize), Crc32cCombine(a, b, kSize - half));
}

TEST(Crc32cTest, HexRoundTrip) {
  EXPECT_EQ(Crc32cToHex(0x1c291ca3u), "1c291ca3");
  EXPECT_EQ(Crc32cToHex(0), "00000000");
  EXPECT_EQ(Crc32cToHex(0xFFFFFFFFu), "ffffffff");
  for (uint32_t v : {0u, 1u, 0xE3069283u, 0xFFFFFFFFu}) {
    auto parsed = Crc32cFromHex(Crc32cToHex(v));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, v);
  }
  auto upper = Crc32cFromHex("1C291CA3");
  ASSERT_TRUE(upper.ok());
  EXPECT_EQ(*upper, 0x1c291ca3u);
}

TEST(Crc32cTest, HexRejectsMalformed) {
  for (std::string_view bad : std::vector<std::string_view>{
           "", "1c291ca", "1c291ca30", "0x1c291c", "1c291cag", " 1c291ca",
           "1c291ca ", "-1c291ca", "+1c291ca",
           std::string_view("1c29\0ca3", 8)}) {
    auto parsed = Crc32cFromHex(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

// Every byte value in every position: a hex digit gives its value there,
// anything else is refused.
TEST(Crc32cTest, HexTakesEveryDigitAndNothingElse) {
  for (int pos = 0; pos < 8; ++pos) {
    for (int c = 0; c < 256; ++c) {
      std::string hex(8, '0');
      hex[pos] = static_cast<char>(c);
      const bool digit = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') ||
                         (c >= 'A' && c <= 'F');
      absl::StatusOr<uint32_t> parsed = Crc32cFromHex(hex);
      ASSERT_EQ(parsed.ok(), digit) << pos << " " << c;
      if (!digit) continue;
      const uint32_t value =
          std::isdigit(c) ? c - '0' : std::tolower(c) - 'a' + 10;
      EXPECT_EQ(*parsed, value << (4 * (7 - pos))) << pos << " " << c;
    }
  }
}

}  // namespace
}  // namespace cairn::internal_format
