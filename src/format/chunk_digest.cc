#include "format/chunk_digest.h"

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "xxhash.h"

namespace cairn::internal_format {
namespace {

ChunkDigest FromHash(const XXH128_hash_t& h) {
  return ChunkDigest{h.high64, h.low64};
}

// The canonical (big-endian) 16 bytes of a digest.
void Canonical(const ChunkDigest& d, unsigned char* out) {
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<unsigned char>(d.high >> (56 - 8 * i));
    out[8 + i] = static_cast<unsigned char>(d.low >> (56 - 8 * i));
  }
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

ChunkDigest BlockDigest(const std::byte* data, size_t n) {
  return FromHash(XXH3_128bits(data, n));
}

ChunkDigest CombineBlockDigests(std::span<const ChunkDigest> blocks) {
  XXH3_state_t* state = XXH3_createState();
  // XXH3_createState only fails without memory; hash in one call then.
  if (state == nullptr) {
    std::vector<unsigned char> all(16 * blocks.size());
    for (size_t i = 0; i < blocks.size(); ++i) {
      Canonical(blocks[i], all.data() + 16 * i);
    }
    return FromHash(XXH3_128bits(all.data(), all.size()));
  }
  XXH3_128bits_reset(state);
  unsigned char canonical[16];
  for (const ChunkDigest& b : blocks) {
    Canonical(b, canonical);
    XXH3_128bits_update(state, canonical, sizeof canonical);
  }
  const XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  return FromHash(h);
}

ChunkDigest DigestOf(const std::byte* data, uint64_t n, uint64_t block_bytes) {
  std::vector<ChunkDigest> blocks;
  for (uint64_t at = 0; at < n; at += block_bytes) {
    const uint64_t len = n - at < block_bytes ? n - at : block_bytes;
    blocks.push_back(BlockDigest(data + at, len));
  }
  return CombineBlockDigests(blocks);
}

std::string DigestToHex(const ChunkDigest& digest) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[i] = kHex[(digest.high >> (60 - 4 * i)) & 0xf];
    out[16 + i] = kHex[(digest.low >> (60 - 4 * i)) & 0xf];
  }
  return out;
}

absl::StatusOr<ChunkDigest> DigestFromHex(std::string_view hex) {
  if (hex.size() != 32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a chunk digest must be 32 hex digits, got ", hex.size(),
        " characters"));
  }
  ChunkDigest d;
  for (int i = 0; i < 32; ++i) {
    const int v = HexValue(hex[i]);
    if (v < 0) {
      return absl::InvalidArgumentError(
          "a chunk digest must be 32 hex digits");
    }
    uint64_t& half = i < 16 ? d.high : d.low;
    half = (half << 4) | static_cast<uint64_t>(v);
  }
  return d;
}

}  // namespace cairn::internal_format
