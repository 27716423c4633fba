// CRC32C (Castagnoli), the checksum of every stored chunk, over ISA-L.
#ifndef CAIRN_FORMAT_CRC32C_H_
#define CAIRN_FORMAT_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

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

// "1c291ca3": 8 lower-case hex digits.
std::string Crc32cToHex(uint32_t crc);
// kInvalidArgument unless exactly 8 hex digits.
absl::StatusOr<uint32_t> Crc32cFromHex(std::string_view hex);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_CRC32C_H_
