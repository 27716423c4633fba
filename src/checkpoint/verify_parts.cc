// VerifyUncheckedParts: the check of the parts of chunks that a load
// returned but that no set of the ranks' parts tiles (see
// checkpoint_impl.h and docs/architecture.md, load step 4).
#include <algorithm>
#include <cstddef>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/dtype.h"
#include "checkpoint/checkpoint_impl.h"
#include "core/status.h"
#include "core/strided.h"
#include "format/crc32c.h"
#include "format/names.h"

namespace cairn::internal_checkpoint {
namespace {

// Largest single read of the check.
constexpr uint64_t kPieceBytes = uint64_t{8} << 20;

// The CRC32C of bytes [begin, end) of a chunk, read from `file` (whose
// first byte of the chunk is at `base`) in pieces of at most kPieceBytes
// into `buf`; `on_bytes(offset in the chunk, bytes)` sees every piece.
template <typename OnBytes>
absl::StatusOr<uint32_t> ReadAndChecksum(const ReadableFile& file,
                                         uint64_t base, uint64_t begin,
                                         uint64_t end, std::vector<std::byte>& buf,
                                         uint64_t* bytes_read, OnBytes on_bytes) {
  uint32_t crc = 0;
  for (uint64_t at = begin; at < end;) {
    const uint64_t n = std::min(end - at, kPieceBytes);
    buf.resize(n);
    CAIRN_RETURN_IF_ERROR(file.ReadAt(base + at, std::span(buf.data(), n)));
    *bytes_read += n;
    const uint32_t piece = internal_format::Crc32c(buf.data(), n);
    crc = at == begin ? piece : internal_format::Crc32cCombine(crc, piece, n);
    on_bytes(at, std::span<const std::byte>(buf.data(), n));
    at += n;
  }
  return crc;
}

}  // namespace

absl::Status VerifyChunkParts(Storage& storage, const std::string& fqn,
                              const TensorMetadata& tm,
                              const ChunkMetadata& chunk, uint64_t block_bytes,
                              const SharedPieces& mine, OpenFiles& files,
                              uint64_t* bytes_read) {
  const ByteLocation& loc = chunk.location;
  if (loc.nbytes == 0) return absl::OkStatus();
  const std::string what = internal_format::EntryName(
      fqn, chunk.box, chunk.box == Box::Full(tm.shape));
  std::unique_ptr<ReadableFile>& file = files[loc.file];
  if (file == nullptr) {
    CAIRN_ASSIGN_OR_RETURN(file, storage.OpenForRead(loc.file));
  }
  // The contiguous parts' CRC32Cs, recomputed from the bytes read again.
  struct Again {
    uint32_t crc = 0;
    uint64_t done = 0;
  };
  std::vector<Again> again(mine.pieces.size());
  auto on_bytes = [&](uint64_t at, std::span<const std::byte> bytes) {
    for (size_t i = 0; i < mine.pieces.size(); ++i) {
      const CrcPiece& p = mine.pieces[i];
      const uint64_t lo = std::max(at, p.offset);
      const uint64_t hi = std::min(at + bytes.size(), p.offset + p.bytes);
      if (lo >= hi) continue;
      const uint32_t c = internal_format::Crc32c(bytes.data() + (lo - at), hi - lo);
      again[i].crc = again[i].done == 0
                         ? c
                         : internal_format::Crc32cCombine(again[i].crc, c, hi - lo);
      again[i].done += hi - lo;
    }
  };
  std::vector<std::byte> buf;
  const std::vector<uint32_t>& blocks = loc.block_crc32c;
  if (blocks.empty() || block_bytes == 0) {
    // No block checksums (format version 1 or 2): the whole chunk.
    CAIRN_ASSIGN_OR_RETURN(
        uint32_t crc, ReadAndChecksum(*file, loc.offset, 0, loc.nbytes, buf,
                                      bytes_read, on_bytes));
    if (crc != loc.crc32c) {
      return absl::DataLossError(absl::StrFormat(
          "crc32c mismatch in %s (%s, offset %d, read whole to check the "
          "part of it this load returned): stored %s, computed %s",
          what, loc.file, loc.offset, internal_format::Crc32cToHex(loc.crc32c),
          internal_format::Crc32cToHex(crc)));
    }
  } else {
    // The blocks every byte of the parts lies in.
    std::vector<bool> needed(blocks.size(), false);
    auto mark = [&](uint64_t offset, uint64_t bytes) {
      if (bytes == 0) return;
      const uint64_t last =
          std::min<uint64_t>((offset + bytes - 1) / block_bytes, blocks.size() - 1);
      for (uint64_t k = offset / block_bytes; k <= last; ++k) needed[k] = true;
    };
    for (const CrcPiece& p : mine.pieces) mark(p.offset, p.bytes);
    const size_t es = DTypeSize(tm.dtype);
    for (const SignedPart& part : mine.strided) {
      const internal_core::RunPattern runs =
          internal_core::SubBoxRuns(chunk.box, part.box, es);
      internal_core::ForEachRun(runs, [&](int64_t offset) {
        mark(static_cast<uint64_t>(offset),
             static_cast<uint64_t>(runs.run_bytes));
      });
    }
    for (size_t k = 0; k < blocks.size(); ++k) {
      if (!needed[k]) continue;
      const uint64_t begin = k * block_bytes;
      const uint64_t end = std::min(loc.nbytes, begin + block_bytes);
      CAIRN_ASSIGN_OR_RETURN(
          uint32_t crc, ReadAndChecksum(*file, loc.offset, begin, end, buf,
                                        bytes_read, on_bytes));
      if (crc != blocks[k]) {
        return absl::DataLossError(absl::StrFormat(
            "crc32c mismatch in %s (%s, offset %d), block %d (bytes [%d, %d) "
            "of it), which holds part of what this load returned: stored "
            "%s, computed %s",
            what, loc.file, loc.offset, k, begin, end,
            internal_format::Crc32cToHex(blocks[k]),
            internal_format::Crc32cToHex(crc)));
      }
    }
  }
  for (size_t i = 0; i < mine.pieces.size(); ++i) {
    const CrcPiece& p = mine.pieces[i];
    if (again[i].done != p.bytes || again[i].crc != p.crc) {
      return absl::DataLossError(absl::StrFormat(
          "%s (%s, offset %d): bytes [%d, +%d) of it read again for the "
          "check have CRC32C %s, not the %s they had when this load read "
          "them; was the file changed during the load?",
          what, loc.file, loc.offset, p.offset, p.bytes,
          internal_format::Crc32cToHex(again[i].crc),
          internal_format::Crc32cToHex(p.crc)));
    }
  }
  return absl::OkStatus();
}

absl::Status VerifyUncheckedParts(
    Storage& storage, const Metadata& metadata,
    const std::vector<SharedPieces>& shared,
    const std::vector<std::pair<uint32_t, uint64_t>>& unchecked,
    uint64_t* bytes_read) {
  if (unchecked.empty() || shared.empty()) return absl::OkStatus();
  std::set<std::pair<std::string_view, uint64_t>> todo;
  {
    std::vector<const std::string*> names;
    names.reserve(metadata.tensors.size());
    for (const auto& [fqn, unused] : metadata.tensors) names.push_back(&fqn);
    for (const auto& [t, c] : unchecked) {
      if (t < names.size()) todo.emplace(*names[t], c);
    }
  }
  OpenFiles files;
  for (const SharedPieces& mine : shared) {
    if (!todo.contains({mine.fqn, mine.chunk})) continue;
    auto it = metadata.tensors.find(mine.fqn);
    if (it == metadata.tensors.end() || mine.chunk >= it->second.chunks.size()) {
      return absl::InternalError(absl::StrCat(
          "parts of chunk ", mine.chunk, " of ", mine.fqn,
          ", which the checkpoint does not hold"));
    }
    CAIRN_RETURN_IF_ERROR(VerifyChunkParts(
        storage, mine.fqn, it->second, it->second.chunks[mine.chunk],
        metadata.crc32c_block_bytes, mine, files, bytes_read));
  }
  return absl::OkStatus();
}

}  // namespace cairn::internal_checkpoint
