// Chunk digests (format version 6, docs/format.md 4.2.2): XXH3-128 of the
// XXH3-128 digests of a chunk's checksum blocks, each in canonical
// (big-endian) form, one after another. Per block, so a writer computes
// them on any number of threads and combines them in order.
#ifndef CAIRN_FORMAT_CHUNK_DIGEST_H_
#define CAIRN_FORMAT_CHUNK_DIGEST_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "cairn/metadata.h"

namespace cairn::internal_format {

// The first format version with chunk digests and references.
inline constexpr int kReferencesFormatVersion = 6;

// XXH3-128 (seed 0) of one block's bytes.
ChunkDigest BlockDigest(const std::byte* data, size_t n);

// The chunk's digest from its blocks' digests, in order (none: a chunk of
// zero bytes).
ChunkDigest CombineBlockDigests(std::span<const ChunkDigest> blocks);

// Both steps over bytes held in memory, in blocks of `block_bytes`.
ChunkDigest DigestOf(const std::byte* data, uint64_t n, uint64_t block_bytes);

// 32 lower-case hex digits, high half first; and back (either case; any
// other text is kInvalidArgument).
std::string DigestToHex(const ChunkDigest& digest);
absl::StatusOr<ChunkDigest> DigestFromHex(std::string_view hex);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_CHUNK_DIGEST_H_
