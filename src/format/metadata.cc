// Out-of-line members of the structs in include/cairn/metadata.h.
#include "cairn/metadata.h"

#include <limits>

namespace cairn {
namespace {

constexpr uint64_t kSaturated = std::numeric_limits<uint64_t>::max();

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  uint64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? kSaturated : sum;
}

}  // namespace

// Saturates at 2^64 - 1 instead of wrapping for a shape whose size does not
// fit (decoded metadata never has one: DecodeMetadata rejects it).
uint64_t TensorMetadata::nbytes() const {
  for (int64_t d : shape) {
    if (d <= 0) return 0;
  }
  uint64_t bytes = DTypeSize(dtype);
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) {
      return kSaturated;
    }
  }
  return bytes;
}

// The bytes stored in the checkpoint: every tensor chunk, every object and
// every key-value table's ids and columns.
// For a tensor whose chunks cover it exactly once (a global checkpoint that
// passed ValidateCoverage) its stored bytes equal nbytes(); in rank-local
// metadata, which lists only that rank's chunks, they are what that rank
// wrote. Saturates instead of wrapping.
uint64_t Metadata::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [fqn, tensor] : tensors) {
    for (const ChunkMetadata& chunk : tensor.chunks) {
      total = SaturatingAdd(total, chunk.location.nbytes);
    }
  }
  for (const auto& [fqn, object] : objects) {
    total = SaturatingAdd(total, object.nbytes);
  }
  for (const auto& [fqn, table] : kv_tables) {
    total = SaturatingAdd(total, table.nbytes());
  }
  return total;
}

uint64_t KvTableMetadata::rows() const {
  uint64_t total = 0;
  for (uint64_t n : rows_per_bucket) total = SaturatingAdd(total, n);
  return total;
}

uint64_t KvTableMetadata::nbytes() const {
  uint64_t total = 0;
  for (const KvChunkMetadata& chunk : chunks) {
    total = SaturatingAdd(total, chunk.ids.nbytes);
    for (const ByteLocation& c : chunk.columns) {
      total = SaturatingAdd(total, c.nbytes);
    }
  }
  return total;
}

}  // namespace cairn
