// Load, step 4 (see load.cc): the check of the chunks that ranks read
// parts of. Each rank encodes the CRC32Cs and signatures of its parts
// (EncodeSharedPieces); the coordinator combines the parts of each chunk
// that they tile and compares them with its CRC32C (CheckSharedPieces:
// contiguous pieces in a chain, a chunk with a strided part as boxes,
// CheckBoxParts), and names the chunks that no set of parts tiles.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "cairn/metadata.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/load_internal.h"
#include "core/byte_codec.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/names.h"

namespace cairn::internal_checkpoint {

absl::StatusOr<std::string> EncodeSharedPieces(
    const Metadata& metadata, const std::vector<SharedPieces>& shared) {
  internal_core::ByteWriter w;
  uint64_t n = 0;
  uint64_t strided = 0;
  uint64_t strided_bytes = 0;
  for (const SharedPieces& s : shared) {
    n += s.pieces.size();
    strided += s.strided.size();
    for (const SignedPart& part : s.strided) {
      strided_bytes += 16 + 16 * part.box.offsets.size();
    }
  }
  w.Reserve(16 + n * kSharedPieceBytes + strided_bytes);
  w.U64(n);
  if (n == 0 && strided == 0) {
    w.U64(0);
    return w.Take();
  }
  // Tensors by their index in metadata.tensors (the same on every rank).
  absl::flat_hash_map<std::string_view, uint32_t> index;
  index.reserve(metadata.tensors.size());
  for (const auto& [fqn, unused] : metadata.tensors) {
    index.emplace(fqn, static_cast<uint32_t>(index.size()));
  }
  std::vector<uint32_t> tensor_of;  // of each shared[i]
  tensor_of.reserve(shared.size());
  for (const SharedPieces& s : shared) {
    auto it = index.find(s.fqn);
    if (it == index.end()) {
      return absl::InternalError(absl::StrCat(
          "checksummed parts of ", s.fqn, ", which the checkpoint lacks"));
    }
    tensor_of.push_back(it->second);
    for (const CrcPiece& p : s.pieces) {
      w.U32(it->second);
      w.U64(s.chunk);
      w.U64(p.offset);
      w.U64(p.bytes);
      w.U32(p.crc);
    }
  }
  w.U64(strided);
  for (size_t i = 0; i < shared.size(); ++i) {
    const SharedPieces& s = shared[i];
    for (const SignedPart& part : s.strided) {
      w.U32(tensor_of[i]);
      w.U64(s.chunk);
      w.U32(part.signature);
      for (int64_t o : part.box.offsets) w.U64(static_cast<uint64_t>(o));
      for (int64_t z : part.box.sizes) w.U64(static_cast<uint64_t>(z));
    }
  }
  return w.Take();
}

namespace {

// ", read in parts by ranks 0, 2" (with `parts` > 0: "in 3 parts").
std::string ReadByRanks(const std::set<int>& ranks, size_t parts = 0) {
  return absl::StrFormat(", read in %sparts by rank%s %s",
                         parts > 0 ? absl::StrCat(parts, " ") : "",
                         ranks.size() > 1 ? "s" : "",
                         absl::StrJoin(ranks, ", "));
}

// The box that bytes [offset, offset + bytes) of a chunk (row-major,
// elements of `es` bytes) are, in global coordinates, or nullopt when they
// are not one (they start or end inside an element, or cross a row without
// taking whole rows).
std::optional<Box> PieceBox(const Box& chunk, size_t es, uint64_t offset,
                            uint64_t bytes) {
  if (offset % es != 0 || bytes % es != 0 || bytes == 0) return std::nullopt;
  const uint64_t e0 = offset / es;
  const uint64_t e1 = (offset + bytes) / es;
  const int rank = chunk.rank();
  if (rank == 0) {
    if (e0 == 0 && e1 == 1) return chunk;
    return std::nullopt;
  }
  // The outermost dimension d such that the range is whole blocks of the
  // dimensions after d, all within one index of the dimensions before d.
  uint64_t inner = 1;  // elements of one index of dimension d
  std::vector<uint64_t> inners(rank);
  for (int d = rank - 1; d >= 0; --d) {
    inners[d] = inner;
    inner *= static_cast<uint64_t>(chunk.sizes[d]);
  }
  for (int d = 0; d < rank; ++d) {
    const uint64_t block = inners[d];
    const uint64_t size = static_cast<uint64_t>(chunk.sizes[d]);
    if (e0 % block != 0 || e1 % block != 0) continue;
    const uint64_t i0 = e0 / block;
    const uint64_t i1 = e1 / block;  // exclusive, along dims 0..d flattened
    if (i0 / size != (i1 - 1) / size) continue;
    Box box = chunk;
    uint64_t prefix = i0 / size;  // the index over dims before d
    for (int k = d - 1; k >= 0; --k) {
      const uint64_t n = static_cast<uint64_t>(chunk.sizes[k]);
      box.offsets[k] += static_cast<int64_t>(prefix % n);
      box.sizes[k] = 1;
      prefix /= n;
    }
    box.offsets[d] += static_cast<int64_t>(i0 % size);
    box.sizes[d] = static_cast<int64_t>(i1 - i0);
    return box;
  }
  return std::nullopt;
}

// One part of a chunk for the strided check: a contiguous piece as a box
// (its CRC32C made a signature), or a strided part.
struct BoxPart {
  Box box;
  uint32_t signature;
  int rank;
};

// The strided check of one chunk (CheckSharedPieces): true when its parts
// tile it and their signatures sum to its CRC32C, false when they do not
// tile it (unchecked), kDataLoss when they tile it with other bytes or two
// ranks read one box differently.
absl::StatusOr<bool> CheckBoxParts(std::string_view fqn,
                                   const TensorMetadata& tm,
                                   const ChunkMetadata& chunk,
                                   std::vector<BoxPart>& parts) {
  auto entry = [&] {
    return internal_format::EntryName(fqn, chunk.box,
                                      chunk.box == Box::Full(tm.shape));
  };
  std::sort(parts.begin(), parts.end(), [](const BoxPart& a, const BoxPart& b) {
    return std::tie(a.box.offsets, a.box.sizes, a.rank) <
           std::tie(b.box.offsets, b.box.sizes, b.rank);
  });
  // The same box read by two ranks (replicated destinations) once.
  std::vector<const BoxPart*> kept;
  const int64_t whole = chunk.box.num_elements();
  int64_t volume = 0;
  for (const BoxPart& part : parts) {
    const BoxPart* last = kept.empty() ? nullptr : kept.back();
    if (last != nullptr && last->box == part.box) {
      if (last->signature != part.signature) {
        return absl::DataLossError(absl::StrFormat(
            "%s (%s, offset %d): ranks %d and %d read different bytes in %s "
            "of it (signatures %s and %s); was the file changed during the "
            "load?",
            entry(), chunk.location.file, chunk.location.offset, last->rank,
            part.rank, part.box.ToString(),
            internal_format::Crc32cToHex(last->signature),
            internal_format::Crc32cToHex(part.signature)));
      }
      continue;
    }
    // Each part lies inside the chunk, so whole - volume cannot overflow.
    const int64_t n = part.box.num_elements();
    if (n > whole - volume) return false;  // an overlap
    volume += n;
    kept.push_back(&part);
  }
  if (volume != whole) return false;  // a gap (or an overlap and a gap)
  // Disjoint (so, with the volumes, a tiling): sorted by their first
  // dimension's offsets, a part can only meet the parts after it that start
  // before it ends there.
  for (size_t i = 0; i < kept.size(); ++i) {
    const Box& a = kept[i]->box;
    for (size_t j = i + 1; j < kept.size(); ++j) {
      const Box& b = kept[j]->box;
      if (b.offsets[0] >= a.offsets[0] + a.sizes[0]) break;
      if (Intersect(a, b)) return false;
    }
  }
  uint32_t sum = 0;
  std::set<int> ranks;
  for (const BoxPart* part : kept) {
    sum ^= part->signature;
    ranks.insert(part->rank);
  }
  const uint32_t crc = sum ^ internal_format::Crc32cOfZeros(chunk.location.nbytes);
  if (crc != chunk.location.crc32c) {
    return CrcMismatch(entry(), chunk.location, ReadByRanks(ranks, kept.size()),
                       crc);
  }
  return true;
}

}  // namespace

absl::StatusOr<uint64_t> CheckSharedPieces(
    const Metadata& metadata, const std::vector<std::string>& payloads,
    std::vector<std::pair<uint32_t, uint64_t>>* unchecked) {
  // Every chunk of the checkpoint by a number: its tensor's first chunk's
  // number plus its index in the tensor.
  using Stored = decltype(metadata.tensors)::value_type;
  std::vector<const Stored*> tensors;
  std::vector<uint64_t> first_chunk;
  tensors.reserve(metadata.tensors.size());
  first_chunk.reserve(metadata.tensors.size() + 1);
  uint64_t chunks = 0;
  for (const Stored& t : metadata.tensors) {
    tensors.push_back(&t);
    first_chunk.push_back(chunks);
    chunks += t.second.chunks.size();
  }
  first_chunk.push_back(chunks);
  // Every rank's pieces, read as untrusted bytes.
  struct Part {
    uint64_t chunk;  // its number
    CrcPiece piece;
    int rank;
  };
  auto what = [](size_t r) {
    return absl::StrCat("chunk checksums from rank ", r);
  };
  struct Strided {
    uint64_t chunk;  // its number
    SignedPart part;
    int rank;
  };
  uint64_t payload_bytes = 0;
  for (const std::string& p : payloads) payload_bytes += p.size();
  std::vector<Part> parts;
  parts.reserve(payload_bytes / kSharedPieceBytes);
  std::vector<Strided> strided;
  for (size_t r = 0; r < payloads.size(); ++r) {
    internal_core::ByteReader in(payloads[r], what(r));
    // The tensor and chunk of a piece or part, or an error.
    auto locate = [&](uint32_t t, uint64_t c)
        -> absl::StatusOr<const ChunkMetadata*> {
      if (t >= tensors.size()) {
        return absl::InternalError(absl::StrFormat(
            "%s: tensor %d of a checkpoint with %d", what(r), t,
            tensors.size()));
      }
      const auto& [fqn, tm] = *tensors[t];
      if (c >= tm.chunks.size()) {
        return absl::InternalError(absl::StrFormat(
            "%s: chunk %d of %s, which the checkpoint does not hold", what(r),
            c, fqn));
      }
      return &tm.chunks[c];
    };
    const uint64_t count = in.Count(kSharedPieceBytes);
    for (uint64_t i = 0; i < count; ++i) {
      const uint32_t t = in.U32();
      const uint64_t c = in.U64();
      const CrcPiece p{in.U64(), in.U64(), in.U32()};
      if (in.failed()) break;
      CAIRN_ASSIGN_OR_RETURN(const ChunkMetadata* chunk, locate(t, c));
      const uint64_t nbytes = chunk->location.nbytes;
      if (p.offset > nbytes || p.bytes > nbytes - p.offset) {
        return absl::InternalError(absl::StrFormat(
            "%s: bytes [%d, +%d) of chunk %d of %s, which has %d", what(r),
            p.offset, p.bytes, c, tensors[t]->first, nbytes));
      }
      parts.push_back({first_chunk[t] + c, p, static_cast<int>(r)});
    }
    // Strided parts: at least a tensor, chunk, signature and one
    // dimension's offset and size.
    const uint64_t count_strided = in.failed() ? 0 : in.Count(32);
    for (uint64_t i = 0; i < count_strided; ++i) {
      const uint32_t t = in.U32();
      const uint64_t c = in.U64();
      const uint32_t signature = in.U32();
      if (in.failed()) break;
      CAIRN_ASSIGN_OR_RETURN(const ChunkMetadata* chunk, locate(t, c));
      const Box& cb = chunk->box;
      const int rank = cb.rank();
      Strided s{first_chunk[t] + c, {Box{}, signature}, static_cast<int>(r)};
      std::vector<uint64_t> dims(2 * rank);
      for (uint64_t& v : dims) v = in.U64();
      if (in.failed()) break;
      bool inside = rank > 0;
      for (int d = 0; d < rank && inside; ++d) {
        // Inside the chunk's box and not empty, without overflow.
        const uint64_t o = dims[d], z = dims[rank + d];
        const uint64_t co = static_cast<uint64_t>(cb.offsets[d]);
        const uint64_t cz = static_cast<uint64_t>(cb.sizes[d]);
        inside = o >= co && o - co < cz && z >= 1 && z <= cz - (o - co);
      }
      if (!inside) {
        return absl::InternalError(absl::StrFormat(
            "%s: a part [%s] of chunk %d of %s, which is %s", what(r),
            absl::StrJoin(dims, ", "), c, tensors[t]->first, cb.ToString()));
      }
      s.part.box.offsets.assign(dims.begin(), dims.begin() + rank);
      s.part.box.sizes.assign(dims.begin() + rank, dims.end());
      strided.push_back(std::move(s));
    }
    CAIRN_RETURN_IF_ERROR(in.status());
  }
  // Chunks with strided parts are checked on boxes, after the others.
  std::sort(strided.begin(), strided.end(),
            [](const Strided& a, const Strided& b) { return a.chunk < b.chunk; });
  auto has_strided = [&](uint64_t c) {
    auto it = std::lower_bound(
        strided.begin(), strided.end(), c,
        [](const Strided& s, uint64_t n) { return s.chunk < n; });
    return it != strided.end() && it->chunk == c;
  };
  if (parts.empty() && strided.empty()) return 0;  // most loads
  // The parts of each chunk together (a counting sort by chunk number: the
  // parts run to millions at thousands of ranks), then by offset.
  std::vector<uint64_t> begin(chunks + 1, 0);
  for (const Part& part : parts) ++begin[part.chunk + 1];
  for (uint64_t c = 0; c < chunks; ++c) begin[c + 1] += begin[c];
  std::vector<const Part*> by_chunk(parts.size());
  {
    std::vector<uint64_t> next(begin.begin(), begin.end() - 1);
    for (const Part& part : parts) by_chunk[next[part.chunk]++] = &part;
  }
  uint64_t checked = 0;
  std::vector<const Part*> tiling;
  // Chunk numbers with parts that no set of parts tiles (for `unchecked`).
  std::vector<uint64_t> untiled;
  size_t t = 0;  // the tensor of chunk number c
  for (uint64_t c = 0; c < chunks; ++c) {
    if (begin[c] == begin[c + 1]) continue;
    if (!strided.empty() && has_strided(c)) continue;
    while (first_chunk[t + 1] <= c) ++t;
    // Not a structured binding: lambdas may capture those only since
    // C++20, which clang 14 (the fuzz build's compiler) lacks.
    const std::string& fqn = tensors[t]->first;
    const TensorMetadata& tm = tensors[t]->second;
    const ChunkMetadata& chunk = tm.chunks[c - first_chunk[t]];
    auto entry = [&] {
      return internal_format::EntryName(fqn, chunk.box,
                                        chunk.box == Box::Full(tm.shape));
    };
    const auto mine = std::span(by_chunk).subspan(begin[c], begin[c + 1] - begin[c]);
    std::sort(mine.begin(), mine.end(), [](const Part* a, const Part* b) {
      return std::tuple(a->piece.offset, a->piece.bytes, a->rank) <
             std::tuple(b->piece.offset, b->piece.bytes, b->rank);
    });
    tiling.clear();
    uint32_t crc = 0;
    uint64_t covered = 0;
    bool tiles = true;
    for (const Part* part : mine) {
      const CrcPiece& p = part->piece;
      const Part* last = tiling.empty() ? nullptr : tiling.back();
      if (last != nullptr && p.offset == last->piece.offset &&
          p.bytes == last->piece.bytes) {
        // The same bytes read by two ranks (replicated destinations).
        if (p.crc != last->piece.crc) {
          return absl::DataLossError(absl::StrFormat(
              "%s (%s, offset %d): ranks %d and %d read different bytes at "
              "[%d, +%d) of it (CRC32C %s and %s); was the file changed "
              "during the load?",
              entry(), chunk.location.file, chunk.location.offset, last->rank,
              part->rank, p.offset, p.bytes,
              internal_format::Crc32cToHex(last->piece.crc),
              internal_format::Crc32cToHex(p.crc)));
        }
        continue;
      }
      if (p.offset != covered) {  // a gap, or an uneven overlap
        tiles = false;
        break;
      }
      crc = covered == 0 ? p.crc
                         : internal_format::Crc32cCombine(crc, p.crc, p.bytes);
      covered += p.bytes;
      tiling.push_back(part);
    }
    if (!tiles || covered != chunk.location.nbytes) {
      untiled.push_back(c);
      continue;
    }
    if (crc != chunk.location.crc32c) {
      std::vector<CrcPiece> pieces;
      std::set<int> ranks;
      for (const Part* part : tiling) {
        pieces.push_back(part->piece);
        ranks.insert(part->rank);
      }
      return CheckPieces(entry(), chunk.location, std::move(pieces),
                         ReadByRanks(ranks));
    }
    ++checked;
  }
  // Chunks with strided parts, each with its contiguous pieces as boxes.
  std::vector<BoxPart> box_parts;
  for (size_t i = 0; i < strided.size();) {
    const uint64_t c = strided[i].chunk;
    const size_t tensor =
        static_cast<size_t>(std::upper_bound(first_chunk.begin(),
                                             first_chunk.end(), c) -
                            first_chunk.begin()) - 1;
    const auto& [fqn, tm] = *tensors[tensor];
    const ChunkMetadata& chunk = tm.chunks[c - first_chunk[tensor]];
    box_parts.clear();
    bool boxes = true;
    for (uint64_t k = begin[c]; k < begin[c + 1] && boxes; ++k) {
      const Part& part = *by_chunk[k];
      std::optional<Box> box = PieceBox(chunk.box, DTypeSize(tm.dtype),
                                        part.piece.offset, part.piece.bytes);
      if (!box) {
        boxes = false;  // not a box: this chunk stays unchecked
        break;
      }
      box_parts.push_back({*std::move(box),
                           internal_format::Crc32cPieceSignature(
                               part.piece.crc, part.piece.offset,
                               part.piece.bytes, chunk.location.nbytes),
                           part.rank});
    }
    for (; i < strided.size() && strided[i].chunk == c; ++i) {
      box_parts.push_back(
          {strided[i].part.box, strided[i].part.signature, strided[i].rank});
    }
    if (!boxes) {
      untiled.push_back(c);
      continue;
    }
    CAIRN_ASSIGN_OR_RETURN(bool tiled, CheckBoxParts(fqn, tm, chunk, box_parts));
    checked += tiled ? 1 : 0;
    if (!tiled) untiled.push_back(c);
  }
  if (unchecked != nullptr) {
    std::sort(untiled.begin(), untiled.end());
    for (uint64_t c : untiled) {
      const size_t tensor =
          static_cast<size_t>(std::upper_bound(first_chunk.begin(),
                                               first_chunk.end(), c) -
                              first_chunk.begin()) - 1;
      unchecked->emplace_back(static_cast<uint32_t>(tensor),
                              c - first_chunk[tensor]);
    }
  }
  return checked;
}

}  // namespace cairn::internal_checkpoint
