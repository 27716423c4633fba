// CRC32C (Castagnoli), the checksum of every stored chunk, over ISA-L.
#ifndef CAIRN_FORMAT_CRC32C_H_
#define CAIRN_FORMAT_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace cairn::internal_format {

// The standard CRC32C of `data` (Crc32c("123456789") == 0xE3069283).
// Extend(Crc32c(a), b) == Crc32c(a + b). Any length (ISA-L takes an int, so
// longer inputs are split).
uint32_t Crc32c(const void* data, size_t size);
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);

// CRC32C of a+b given crc_a = Crc32c(a), crc_b = Crc32c(b), and b's length.
// Lets pieces of one chunk be checksummed on different threads.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t size_b);

// Signatures of parts of a chunk. A chunk's bytes can be cut into parts that
// are not contiguous (the columns of a row-major chunk, a 2-d block of it)
// and read by different ranks. CRC32C is affine over GF(2), so each part can
// be summarized on its own: its signature is the linear CRC of the chunk
// with every byte outside the part zeroed (ISA-L's register with initial
// value 0 and no final inversion). Signatures of parts that tile the chunk
// XOR to Crc32c(chunk) ^ Crc32cOfZeros(chunk size), whatever the parts'
// shapes and order.
//
// The linear CRC of `data`: Crc32cRaw(a + b) == Crc32cShift(Crc32cRaw(a),
// |b|) ^ Crc32cRaw(b), and Crc32cRaw(zeros) == 0.
uint32_t Crc32cRaw(const void* data, size_t size);
// `raw` followed by `zero_bytes` zero bytes: raw * x^(8 * zero_bytes) mod P.
uint32_t Crc32cShift(uint32_t raw, uint64_t zero_bytes);
// Crc32c of `size` zero bytes.
uint32_t Crc32cOfZeros(uint64_t size);
// The signature of a contiguous part of a chunk of `chunk_bytes` bytes: its
// `bytes` bytes at `offset`, whose Crc32c is `crc`.
uint32_t Crc32cPieceSignature(uint32_t crc, uint64_t offset, uint64_t bytes,
                              uint64_t chunk_bytes);

// Crc32cShift by one fixed number of zero bytes, through four 256-entry
// tables (the shift is linear in `raw`): for the many runs of a strided
// part, which lie a fixed stride apart.
class Crc32cShifter {
 public:
  explicit Crc32cShifter(uint64_t zero_bytes);
  uint64_t zero_bytes() const { return zero_bytes_; }
  uint32_t operator()(uint32_t raw) const {
    return table_[0][raw & 0xff] ^ table_[1][(raw >> 8) & 0xff] ^
           table_[2][(raw >> 16) & 0xff] ^ table_[3][raw >> 24];
  }

 private:
  uint64_t zero_bytes_;
  uint32_t table_[4][256];
};

// "1c291ca3": 8 lower-case hex digits.
std::string Crc32cToHex(uint32_t crc);
// kInvalidArgument unless exactly 8 hex digits.
absl::StatusOr<uint32_t> Crc32cFromHex(std::string_view hex);

// Block checksums (format version 3, docs/format.md 4.2): the CRC32Cs of
// consecutive `block_bytes`-byte blocks of a chunk's or object's stored
// bytes (the last block shorter), recorded for one of more than one block.
// The number of them a location of `nbytes` bytes records: 0 when it is
// one block or less, else ceil(nbytes / block_bytes). `block_bytes` > 0.
inline uint64_t Crc32cBlockCount(uint64_t nbytes, uint64_t block_bytes) {
  return nbytes <= block_bytes ? 0 : (nbytes - 1) / block_bytes + 1;
}
// A block size metadata.json may record: a power of two in
// [kMinCrc32cBlockBytes, kMaxCrc32cBlockBytes].
inline constexpr uint64_t kMinCrc32cBlockBytes = uint64_t{1} << 12;
inline constexpr uint64_t kMaxCrc32cBlockBytes = uint64_t{1} << 30;
inline bool ValidCrc32cBlockBytes(uint64_t b) {
  return b >= kMinCrc32cBlockBytes && b <= kMaxCrc32cBlockBytes &&
         (b & (b - 1)) == 0;
}
// The CRCs as one string of 8 lower-case hex digits each, in order.
std::string Crc32cBlocksToHex(std::span<const uint32_t> crcs);
// kInvalidArgument unless a non-empty multiple of 8 hex digits.
absl::StatusOr<std::vector<uint32_t>> Crc32cBlocksFromHex(
    std::string_view hex);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_CRC32C_H_
