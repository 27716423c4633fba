// CheckSharedPieces against a brute-force model of what it promises. The
// input is a recipe, not a message: it picks, for up to four ranks, parts
// of the fixed checkpoint's chunks (contiguous byte ranges, or boxes read
// as strided parts) that carry the CRC32C or signature a correct read of
// the chunk's known bytes gives, and may corrupt one of them (XOR a
// nonzero value into its checksum, as a flipped byte read would). The
// messages are built with EncodeSharedPieces. Then, element by element:
//  - a chunk "tiles" when its parts, identical ones counted once, cover it
//    exactly once (bytes for a chunk with contiguous parts only; elements
//    for one with strided parts, whose contiguous parts must then each be
//    a box). With nothing corrupted, the check succeeds and checks exactly
//    the chunks that tile: no false alarm, no chunk wrongly counted.
//  - a corrupted part of a chunk that tiles is always caught (kDataLoss);
//    one in a chunk that does not tile, and that no other rank read the
//    same way, changes nothing.
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_impl.h"
#include "format/crc32c.h"
#include "fuzz/fuzz_target.h"
#include "fuzz/shared_pieces_util.h"

namespace cairn::fuzz {
namespace {

using internal_checkpoint::CrcPiece;
using internal_checkpoint::SharedPieces;
using internal_checkpoint::SignedPart;

struct Chunk {
  std::string fqn;
  size_t index;  // in its tensor
  const ChunkMetadata* meta;
  int elem_size;
};

std::vector<Chunk> AllChunks() {
  std::vector<Chunk> out;
  for (const auto& [fqn, t] : TheMetadata().tensors) {
    for (size_t c = 0; c < t.chunks.size(); ++c) {
      out.push_back(
          {fqn, c, &t.chunks[c], static_cast<int>(DTypeSize(t.dtype))});
    }
  }
  return out;
}

// One part a rank read.
struct Entry {
  int rank;
  size_t chunk;  // into AllChunks()
  bool strided;
  CrcPiece piece;  // contiguous: bytes [offset, +bytes)
  Box box;         // strided
  uint32_t checksum;
};

// The elements of a contiguous piece as a box, if they form one.
std::optional<Box> PieceAsBox(const Chunk& c, const CrcPiece& p) {
  const uint64_t es = static_cast<uint64_t>(c.elem_size);
  if (p.offset % es != 0 || p.bytes % es != 0 || p.bytes == 0) {
    return std::nullopt;
  }
  const int64_t first = static_cast<int64_t>(p.offset / es);
  const int64_t count = static_cast<int64_t>(p.bytes / es);
  const Box& cb = c.meta->box;
  std::vector<int64_t> lo = ElementIndex(cb, first), hi = lo;
  for (int64_t e = first; e < first + count; ++e) {
    const std::vector<int64_t> i = ElementIndex(cb, e);
    for (size_t d = 0; d < i.size(); ++d) {
      lo[d] = std::min(lo[d], i[d]);
      hi[d] = std::max(hi[d], i[d]);
    }
  }
  Box box;
  int64_t volume = 1;
  for (size_t d = 0; d < lo.size(); ++d) {
    box.offsets.push_back(cb.offsets[d] + lo[d]);
    box.sizes.push_back(hi[d] - lo[d] + 1);
    volume *= hi[d] - lo[d] + 1;
  }
  if (volume != count) return std::nullopt;
  return box;
}

// Whether the chunk's parts tile it (see the file comment).
bool Tiles(const Chunk& c, const std::vector<const Entry*>& parts) {
  const bool any_strided = std::any_of(
      parts.begin(), parts.end(), [](const Entry* e) { return e->strided; });
  if (!any_strided) {
    std::set<std::pair<uint64_t, uint64_t>> ranges;
    for (const Entry* e : parts) ranges.insert({e->piece.offset, e->piece.bytes});
    uint64_t covered = 0;
    for (const auto& [offset, bytes] : ranges) {
      if (offset != covered) return false;
      covered += bytes;
    }
    return covered == c.meta->location.nbytes;
  }
  std::set<std::pair<std::vector<int64_t>, std::vector<int64_t>>> boxes;
  for (const Entry* e : parts) {
    std::optional<Box> box = e->strided ? std::optional<Box>(e->box)
                                        : PieceAsBox(c, e->piece);
    if (!box) return false;
    boxes.insert({box->offsets, box->sizes});
  }
  for (int64_t el = 0; el < c.meta->box.num_elements(); ++el) {
    int covered = 0;
    for (const auto& [offsets, sizes] : boxes) {
      covered += ElementIn(c.meta->box, el, Box{offsets, sizes}) ? 1 : 0;
    }
    if (covered != 1) return false;
  }
  return true;
}

std::vector<std::string> Seeds() {
  // Rank 0 reads the left 3 columns of b's chunk 1 (number 3 of the five,
  // in name order a#0 a#1 b#0 b#1 c#0), rank 1 the right 3; rank 0 the
  // first 12 bytes of b's chunk 0 (number 2), rank 1 the rest. Then the
  // same with the second entry's signature corrupted.
  std::string s;
  s += '\2';                           // ranks - 1 (3 ranks: one spare)
  auto entry = [&](int rank, int chunk, bool strided, std::vector<uint8_t> v) {
    s += static_cast<char>(rank);
    s += static_cast<char>(chunk);
    s += static_cast<char>(strided ? 1 : 0);
    for (uint8_t b : v) s += static_cast<char>(b);
  };
  // Sizes are stored less one, and taken modulo what fits.
  entry(0, 3, true, {0, 3, 0, 2});     // rows 4..8 (all 4), cols 0..3
  entry(1, 3, true, {0, 3, 3, 2});     // all rows, cols 3..6
  entry(0, 2, false, {0, 11});         // elements 0..12
  entry(1, 2, false, {12, 11});        // elements 12..24
  std::string corrupt = s;
  s += '\xff';                         // end of entries
  s.append(5, '\0');                   // no corruption
  corrupt += '\xff';
  corrupt += '\1';                     // corrupt entry 1
  corrupt.append("\x01\0\0\0", 4);     // XOR 1
  return {std::string(1, '\0') + s, std::string(1, '\0') + corrupt};
}

}  // namespace

// Recipe: a byte (ignored, room for options), the number of ranks - 1
// (mod 4), then entries until a rank byte of 0xff or the end: rank (mod
// ranks), chunk (mod 5), kind (bit 0: strided), and for a contiguous
// piece its element offset and element count, for a box per dimension an
// offset and a size in the chunk (each taken modulo what fits, at least
// one element); after 0xff, the entry to corrupt (mod entries) and the
// nonzero value XORed into its checksum (none when zero).
CAIRN_FUZZ_TARGET(shared_pieces_model, &Seeds) {
  static const std::vector<Chunk> chunks = AllChunks();
  Recipe in(data);
  (void)in.Byte();
  const int ranks = static_cast<int>(in.In(1, 4));
  std::vector<Entry> entries;
  while (!in.done() && entries.size() < 64) {
    const uint8_t r = in.Byte();
    if (r == 0xff) break;
    Entry e;
    e.rank = r % ranks;
    e.chunk = static_cast<size_t>(
        in.In(0, static_cast<int64_t>(chunks.size()) - 1));
    const Chunk& c = chunks[e.chunk];
    const Box& cb = c.meta->box;
    e.strided = (in.Byte() & 1) != 0 && cb.rank() > 0;
    if (e.strided) {
      e.box = cb;
      for (int d = 0; d < cb.rank(); ++d) {
        const int64_t o = in.In(0, cb.sizes[d] - 1);
        e.box.offsets[d] = cb.offsets[d] + o;
        e.box.sizes[d] = in.In(1, cb.sizes[d] - o);
      }
      e.checksum = SignatureOf(*c.meta, c.elem_size, e.box);
    } else {
      const int64_t n = cb.num_elements();
      const int64_t first = in.In(0, n - 1);
      const int64_t count = in.In(1, n - first);
      e.piece.offset = static_cast<uint64_t>(first * c.elem_size);
      e.piece.bytes = static_cast<uint64_t>(count * c.elem_size);
      const std::string bytes = ChunkBytes(c.meta->location.nbytes);
      e.checksum =
          internal_format::Crc32c(bytes.data() + e.piece.offset, e.piece.bytes);
    }
    entries.push_back(e);
  }
  if (entries.empty()) return;
  const size_t victim =
      static_cast<size_t>(in.In(0, static_cast<int64_t>(entries.size()) - 1));
  const uint32_t flip = in.U32();
  if (flip != 0) entries[victim].checksum ^= flip;

  // The messages.
  std::vector<std::vector<SharedPieces>> shared(ranks);
  for (const Entry& e : entries) {
    const Chunk& c = chunks[e.chunk];
    SharedPieces p{c.fqn, c.index, {}, {}};
    if (e.strided) {
      p.strided.push_back(SignedPart{e.box, e.checksum});
    } else {
      p.pieces.push_back(CrcPiece{e.piece.offset, e.piece.bytes, e.checksum});
    }
    shared[e.rank].push_back(std::move(p));
  }
  std::vector<std::string> payloads;
  for (const auto& s : shared) {
    absl::StatusOr<std::string> m =
        internal_checkpoint::EncodeSharedPieces(TheMetadata(), s);
    CAIRN_FUZZ_CHECK(m.ok(), m.status().ToString());
    payloads.push_back(*std::move(m));
  }
  const absl::StatusOr<uint64_t> checked =
      internal_checkpoint::CheckSharedPieces(TheMetadata(), payloads);

  // The model.
  uint64_t tiling = 0;
  bool victim_tiles = false;
  for (size_t c = 0; c < chunks.size(); ++c) {
    std::vector<const Entry*> parts;
    for (const Entry& e : entries) {
      if (e.chunk == c) parts.push_back(&e);
    }
    if (parts.empty() || !Tiles(chunks[c], parts)) continue;
    ++tiling;
    if (entries[victim].chunk == c) victim_tiles = true;
  }
  // Another part of the victim's chunk with the same bytes (its replica):
  // the same byte range, or the same box, whether either was read as a
  // contiguous piece or as a strided part.
  const Entry& v = entries[victim];
  const Chunk& vc = chunks[v.chunk];
  auto as_box = [&](const Entry& e) {
    return e.strided ? std::optional<Box>(e.box) : PieceAsBox(vc, e.piece);
  };
  const std::optional<Box> victim_box = as_box(v);
  bool victim_has_twin = false;
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry& e = entries[i];
    if (i == victim || e.chunk != v.chunk) continue;
    if (!e.strided && !v.strided && e.piece.offset == v.piece.offset &&
        e.piece.bytes == v.piece.bytes) {
      victim_has_twin = true;
    }
    const std::optional<Box> box = as_box(e);
    if (box && victim_box && *box == *victim_box) victim_has_twin = true;
  }
  if (flip != 0 && victim_tiles) {
    CAIRN_FUZZ_CHECK(checked.status().code() == absl::StatusCode::kDataLoss,
                     absl::StrCat("a corrupted part of a chunk that its parts "
                                  "tile was not caught: ",
                                  checked.status().ToString()));
    return;
  }
  if (flip != 0 && victim_has_twin) return;  // either outcome is right
  CAIRN_FUZZ_CHECK(checked.ok(), absl::StrCat("false alarm: ",
                                              checked.status().ToString()));
  CAIRN_FUZZ_CHECK(*checked == tiling,
                   absl::StrCat("checked ", *checked, " chunks, but ", tiling,
                                " are tiled by their parts"));
}

}  // namespace cairn::fuzz
