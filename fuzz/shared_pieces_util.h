// The checkpoint both shared-pieces targets check parts against: a fixed
// metadata whose chunks hold known bytes, so that parts can carry the
// CRC32Cs and signatures a correct read would give.
#ifndef CAIRN_FUZZ_SHARED_PIECES_UTIL_H_
#define CAIRN_FUZZ_SHARED_PIECES_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cairn/metadata.h"
#include "format/crc32c.h"

namespace cairn::fuzz {

// Chunk bytes: byte i of every chunk is 7 * i + 1.
inline std::string ChunkBytes(uint64_t n) {
  std::string bytes(n, '\0');
  for (uint64_t i = 0; i < n; ++i) bytes[i] = static_cast<char>(7 * i + 1);
  return bytes;
}

inline const Metadata& TheMetadata() {
  static const Metadata md = [] {
    Metadata m;
    m.world_size = 2;
    auto add = [&](const std::string& fqn, DType dtype, const Shape& shape,
                   const std::vector<Box>& boxes) {
      TensorMetadata t;
      t.dtype = dtype;
      t.shape = shape;
      uint64_t offset = 0;
      for (const Box& box : boxes) {
        const uint64_t n = static_cast<uint64_t>(box.num_elements()) *
                           static_cast<uint64_t>(DTypeSize(dtype));
        const std::string bytes = ChunkBytes(n);
        t.chunks.push_back(
            {box, ByteLocation{"data-00000.safetensors", offset, n,
                               internal_format::Crc32c(bytes.data(), n), {}}});
        offset += n;
      }
      m.tensors[fqn] = t;
    };
    add("a", DType::kF32, {64}, {Box{{0}, {32}}, Box{{32}, {32}}});
    add("b", DType::kU8, {8, 6}, {Box{{0, 0}, {4, 6}}, Box{{4, 0}, {4, 6}}});
    add("c", DType::kBF16, {2, 4, 4}, {Box{{0, 0, 0}, {2, 4, 4}}});
    return m;
  }();
  return md;
}

// The multi-index (in the chunk's box, row-major) of element `e`.
inline std::vector<int64_t> ElementIndex(const Box& chunk, int64_t e) {
  std::vector<int64_t> index(chunk.sizes.size());
  for (size_t d = chunk.sizes.size(); d-- > 0;) {
    index[d] = e % chunk.sizes[d];
    e /= chunk.sizes[d];
  }
  return index;
}

// Whether element `e` of `chunk` lies in `part` (global coordinates).
inline bool ElementIn(const Box& chunk, int64_t e, const Box& part) {
  const std::vector<int64_t> index = ElementIndex(chunk, e);
  for (size_t d = 0; d < index.size(); ++d) {
    const int64_t g = chunk.offsets[d] + index[d];
    if (g < part.offsets[d] || g >= part.offsets[d] + part.sizes[d]) {
      return false;
    }
  }
  return true;
}

// A part's signature as a correct read gives it (crc32c.h): the linear CRC
// of the chunk's bytes with every byte outside `part` zeroed.
inline uint32_t SignatureOf(const ChunkMetadata& chunk, int elem_size,
                            const Box& part) {
  std::string bytes = ChunkBytes(chunk.location.nbytes);
  for (int64_t e = 0; e < chunk.box.num_elements(); ++e) {
    if (!ElementIn(chunk.box, e, part)) {
      for (int k = 0; k < elem_size; ++k) bytes[e * elem_size + k] = 0;
    }
  }
  return internal_format::Crc32cRaw(bytes.data(), bytes.size());
}

}  // namespace cairn::fuzz

#endif  // CAIRN_FUZZ_SHARED_PIECES_UTIL_H_
