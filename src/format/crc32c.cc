#include "format/crc32c.h"

#include <isa-l/crc.h>

#include <array>
#include <climits>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "format/json_util.h"

namespace cairn::internal_format {
namespace {

// ISA-L's crc32_iscsi neither inverts its initial value nor its result: with
// init 0xFFFFFFFF and a final inversion it computes the standard CRC32C. So
// the "register" it works on is ~crc, and extending a finished CRC means
// feeding ~crc back in as init and inverting the result again.
constexpr size_t kMaxIsalChunk = size_t{1} << 30;  // fits an int

uint32_t Update(uint32_t reg, const void* data, size_t size) {
  // crc32_iscsi takes a non-const pointer but only reads from it.
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  while (size > 0) {
    const size_t n = size < kMaxIsalChunk ? size : kMaxIsalChunk;
    reg = crc32_iscsi(p, static_cast<int>(n), reg);
    p += n;
    size -= n;
  }
  return reg;
}

// GF(2) polynomials modulo the Castagnoli polynomial, in the reflected bit
// order of the CRC itself: bit 31 holds the coefficient of x^0, bit 0 that of
// x^31. 0x82F63B78 is x^32 mod P (P = 0x1EDC6F41 with x^32 implied),
// reflected.
constexpr uint32_t kPolyReflected = 0x82F63B78u;
constexpr uint32_t kOne = 0x80000000u;  // the polynomial 1 (x^0)

// a * b mod P.
uint32_t MulModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  // Walk a's coefficients from x^0 upwards; b holds b * x^i mod P.
  for (uint32_t bit = kOne; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPolyReflected : b >> 1;
  }
  return product;
}

// kPow2[k] = x^(2^k) mod P, for every k a uint64 byte count can need:
// x^(8 * len) with len < 2^64 uses k up to 3 + 63.
constexpr int kPow2Count = 67;

const std::array<uint32_t, kPow2Count>& Pow2Table() {
  static const std::array<uint32_t, kPow2Count> table = [] {
    std::array<uint32_t, kPow2Count> t{};
    t[0] = kOne >> 1;  // x^1
    for (int k = 1; k < kPow2Count; ++k) t[k] = MulModP(t[k - 1], t[k - 1]);
    return t;
  }();
  return table;
}

// x^(8 * len) mod P, by square-and-multiply over the bits of len.
uint32_t XPow8N(uint64_t len) {
  const auto& table = Pow2Table();
  uint32_t result = kOne;
  for (int k = 3; len != 0; len >>= 1, ++k) {
    if (len & 1) result = MulModP(table[k], result);
  }
  return result;
}

// Each byte's hex digit value, or -1. A table rather than range tests:
// a decode of metadata.json reads one CRC per chunk, and the table made
// the whole decode about 5% faster (RESULTS.md, 2026-11-24 fifth session).
constexpr std::array<int8_t, 256> MakeHexTable() {
  std::array<int8_t, 256> table{};
  for (int c = 0; c < 256; ++c) {
    table[c] = c >= '0' && c <= '9'   ? static_cast<int8_t>(c - '0')
               : c >= 'a' && c <= 'f' ? static_cast<int8_t>(c - 'a' + 10)
               : c >= 'A' && c <= 'F' ? static_cast<int8_t>(c - 'A' + 10)
                                      : int8_t{-1};
  }
  return table;
}
constexpr std::array<int8_t, 256> kHexTable = MakeHexTable();

}  // namespace

uint32_t Crc32c(const void* data, size_t size) {
  return Crc32cExtend(0, data, size);
}

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  return ~Update(~crc, data, size);
}

// CRC is affine in its input; the pre- and post-inversions of a and b cancel
// out, leaving crc(a + b) = crc(a) * x^(8 * |b|) + crc(b) over GF(2).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b) {
  return Crc32cShift(crc_a, size_b) ^ crc_b;
}

uint32_t Crc32cRaw(const void* data, size_t size) {
  return Update(0, data, size);
}

uint32_t Crc32cShift(uint32_t raw, uint64_t zero_bytes) {
  return zero_bytes == 0 ? raw : MulModP(XPow8N(zero_bytes), raw);
}

// The register starts at all ones, zero bytes only shift it, and the result
// is inverted.
uint32_t Crc32cOfZeros(uint64_t size) {
  return ~Crc32cShift(0xFFFFFFFFu, size);
}

// Crc32c(piece) = Crc32cRaw(piece) ^ Crc32cOfZeros(bytes); then the zeros
// after it in the chunk.
uint32_t Crc32cPieceSignature(uint32_t crc, uint64_t offset, uint64_t bytes,
                              uint64_t chunk_bytes) {
  return Crc32cShift(crc ^ Crc32cOfZeros(bytes), chunk_bytes - offset - bytes);
}

Crc32cShifter::Crc32cShifter(uint64_t zero_bytes) : zero_bytes_(zero_bytes) {
  const uint32_t factor = XPow8N(zero_bytes);
  for (int t = 0; t < 4; ++t) {
    // table_[t][b] = (b << 8t) * factor, built from the eight single bits.
    uint32_t basis[8];
    for (int bit = 0; bit < 8; ++bit) {
      basis[bit] = MulModP(factor, uint32_t{1} << (8 * t + bit));
    }
    table_[t][0] = 0;
    for (int b = 1; b < 256; ++b) {
      const int low = __builtin_ctz(static_cast<unsigned>(b));
      table_[t][b] = table_[t][b & (b - 1)] ^ basis[low];
    }
  }
}

std::string Crc32cToHex(uint32_t crc) { return absl::StrFormat("%08x", crc); }

absl::StatusOr<uint32_t> Crc32cFromHex(std::string_view hex) {
  if (hex.size() != 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("crc32c must be 8 hex digits, got \"",
                     absl::CHexEscape(AsAbsl(hex.substr(0, 64))), "\""));
  }
  uint32_t value = 0;
  int bad = 0;  // negative once any character is not a hex digit
  for (char c : hex) {
    const int v = kHexTable[static_cast<unsigned char>(c)];
    bad |= v;
    value = (value << 4) | static_cast<uint32_t>(v & 0xf);
  }
  if (bad < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("crc32c must be 8 hex digits, got \"",
                     absl::CHexEscape(AsAbsl(hex)), "\""));
  }
  return value;
}

std::string Crc32cBlocksToHex(std::span<const uint32_t> crcs) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(8 * crcs.size(), '0');
  for (size_t i = 0; i < crcs.size(); ++i) {
    for (int k = 0; k < 8; ++k) {
      out[8 * i + k] = kHex[(crcs[i] >> (28 - 4 * k)) & 0xf];
    }
  }
  return out;
}

absl::StatusOr<std::vector<uint32_t>> Crc32cBlocksFromHex(
    std::string_view hex) {
  if (hex.empty() || hex.size() % 8 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "crc32c_blocks must be groups of 8 hex digits, got ", hex.size(),
        " characters"));
  }
  std::vector<uint32_t> out(hex.size() / 8);
  int bad = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    uint32_t value = 0;
    for (size_t k = 0; k < 8; ++k) {
      const int v = kHexTable[static_cast<unsigned char>(hex[8 * i + k])];
      bad |= v;
      value = (value << 4) | static_cast<uint32_t>(v & 0xf);
    }
    out[i] = value;
  }
  if (bad < 0) {
    return absl::InvalidArgumentError(
        "crc32c_blocks must be groups of 8 hex digits, got a character that "
        "is not a hex digit");
  }
  return out;
}

}  // namespace cairn::internal_format
