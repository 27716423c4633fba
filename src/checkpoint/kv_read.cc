// Reading key-value table rows back, checked (kv_read.h).
#include "checkpoint/kv_read.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "cairn/metadata.h"
#include "checkpoint/kv_save.h"
#include "core/aligned_buffer.h"
#include "core/checked.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/names.h"
#include "format/safetensors.h"

namespace cairn::internal_checkpoint {

using internal_format::KvEntryName;

std::vector<KvPiece> KvPiecesOf(const KvTableMetadata& md, size_t first,
                                size_t last, KvRowRange rows,
                                uint64_t row_bytes, uint64_t piece_bytes) {
  const uint64_t per_piece =
      std::max<uint64_t>(1, piece_bytes / std::max<uint64_t>(row_bytes, 1));
  std::vector<KvPiece> out;
  for (size_t k = first; k < last; ++k) {
    const KvRowRange& c = md.chunks[k].rows;
    const uint64_t begin = std::max(c.begin, rows.begin);
    const uint64_t end = std::min(c.end, rows.end);
    for (uint64_t at = begin; at < end; at += per_piece) {
      out.push_back({k, at, std::min(end, at + per_piece)});
    }
  }
  return out;
}

KvPieceReader::KvPieceReader(Storage& storage, std::string fqn,
                             const KvTableMetadata& md, uint64_t block_bytes,
                             std::vector<int> columns, bool verify)
    : storage_(storage),
      fqn_(std::move(fqn)),
      md_(md),
      block_bytes_(block_bytes),
      columns_(std::move(columns)),
      verify_(verify),
      checked_(md.chunks.size(), false) {
  first_row_.reserve(md.rows_per_bucket.size() + 1);
  uint64_t row = 0;
  for (uint64_t n : md.rows_per_bucket) {
    first_row_.push_back(row);
    row += n;
  }
  first_row_.push_back(row);
}

int64_t KvPieceReader::BucketOfRow(uint64_t row) const {
  // The last bucket starting at or before `row` (empty buckets start where
  // the next one does, so this is the one that holds it).
  const auto it = std::upper_bound(first_row_.begin(), first_row_.end(), row);
  return md_.buckets.begin + (it - first_row_.begin()) - 1;
}

absl::StatusOr<const KvPieceReader::File*> KvPieceReader::Open(
    const std::string& name) {
  auto it = files_.find(name);
  if (it != files_.end()) return &it->second;
  File f;
  CAIRN_ASSIGN_OR_RETURN(f.file, storage_.OpenForRead(name));
  CAIRN_ASSIGN_OR_RETURN(f.header,
                         internal_format::ReadSafetensorsHeader(*f.file, name));
  return &files_.emplace(name, std::move(f)).first->second;
}

// Every entry of chunk `chunk` is in its file's header under its name, at
// its offset, of its dtype and shape (docs/format.md 7).
absl::Status KvPieceReader::CheckEntries(size_t chunk) {
  const KvChunkMetadata& c = md_.chunks[chunk];
  CAIRN_ASSIGN_OR_RETURN(const File* f, Open(c.ids.file));
  if (starts_.empty()) starts_ = KvChunkStarts(md_);
  const int64_t bucket = starts_[chunk].bucket;
  const uint64_t row_in_bucket = starts_[chunk].row;
  const auto n = static_cast<int64_t>(c.rows.size());
  auto check = [&](const ByteLocation& loc, std::string_view what, DType dtype,
                   const Shape& shape) -> absl::Status {
    const std::string name = KvEntryName(fqn_, bucket, row_in_bucket, what);
    const std::string wrong = internal_format::EntryMismatch(
        f->header, {name, dtype, shape, loc.offset, loc.nbytes});
    if (wrong.empty()) return absl::OkStatus();
    return absl::DataLossError(absl::StrFormat(
        "key-value table \"%s\", chunk %d (%s, offset %d, %d bytes): %s; "
        "metadata.json and the data file disagree",
        fqn_, chunk, loc.file, loc.offset, loc.nbytes, wrong));
  };
  CAIRN_RETURN_IF_ERROR(check(c.ids, "ids", DType::kI64, Shape{n}));
  for (size_t j = 0; j < c.columns.size(); ++j) {
    const KvColumn& col = md_.spec.columns[j];
    CAIRN_RETURN_IF_ERROR(
        check(c.columns[j], col.name, col.dtype, Shape{n, col.width}));
  }
  return absl::OkStatus();
}

KvPieceReader::Span KvPieceReader::ToRead(const ByteLocation& loc,
                                          uint64_t begin,
                                          uint64_t end) const {
  if (verify_ && !loc.block_crc32c.empty()) {
    return {internal_core::RoundDown(begin, block_bytes_),
            std::min(internal_core::RoundUp(end, block_bytes_), loc.nbytes)};
  }
  if (verify_) return {0, loc.nbytes};
  return {begin, end};
}

void KvPieceReader::Recycle(KvPieceBytes&& piece) {
  if (piece.buffer == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  free_.emplace_back(std::move(piece.buffer), piece.capacity);
  piece.capacity = 0;
}

absl::StatusOr<const std::byte*> KvPieceReader::ReadEntry(
    const ByteLocation& loc, uint64_t begin, uint64_t end,
    std::string_view what, size_t chunk, std::byte* into, KvPieceBytes& out) {
  const bool blocks = !loc.block_crc32c.empty();
  const auto [from, to] = ToRead(loc, begin, end);
  const File* f = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    CAIRN_ASSIGN_OR_RETURN(f, Open(loc.file));
  }
  CAIRN_RETURN_IF_ERROR(f->file->ReadAt(
      loc.offset + from, std::span<std::byte>(into, to - from)));
  out.bytes_read += to - from;
  auto mismatch = [&](uint64_t at, uint64_t n, uint32_t want, uint32_t got) {
    return absl::DataLossError(absl::StrFormat(
        "key-value table \"%s\", chunk %d, %s: CRC32C mismatch in bytes "
        "[%d, %d) of the entry (%s, offset %d): stored %s, computed %s",
        fqn_, chunk, what, at, at + n, loc.file, loc.offset,
        internal_format::Crc32cToHex(want), internal_format::Crc32cToHex(got)));
  };
  if (verify_ && blocks) {
    for (uint64_t at = from; at < to; at += block_bytes_) {
      const uint64_t n = std::min(block_bytes_, to - at);
      const uint64_t k = at / block_bytes_;
      const uint32_t got = internal_format::Crc32c(into + (at - from), n);
      if (k >= loc.block_crc32c.size() || got != loc.block_crc32c[k]) {
        return mismatch(at, n,
                        k < loc.block_crc32c.size() ? loc.block_crc32c[k] : 0,
                        got);
      }
    }
  } else if (verify_) {
    const uint32_t got = internal_format::Crc32c(into, to - from);
    if (got != loc.crc32c) return mismatch(0, loc.nbytes, loc.crc32c, got);
  }
  return into + (begin - from);
}

absl::Status KvPieceReader::CheckIds(const KvPieceBytes& p) const {
  int64_t bucket = BucketOfRow(p.piece.begin);
  int64_t prev = -1;
  for (uint64_t i = 0; i < p.piece.rows(); ++i) {
    const uint64_t row = p.piece.begin + i;
    bool new_bucket = false;
    while (first_row_[bucket - md_.buckets.begin + 1] <= row) {
      ++bucket;
      new_bucket = true;
    }
    const int64_t id = p.ids[i];
    absl::StatusOr<int64_t> b = KvBucketOf(md_.spec, id);
    const bool ordered = i == 0 || new_bucket || id > prev;
    if (!b.ok() || *b != bucket || !ordered) {
      return absl::DataLossError(absl::StrFormat(
          "key-value table \"%s\", chunk %d (%s): row %d has id %d, %s", fqn_,
          p.piece.chunk, md_.chunks[p.piece.chunk].ids.file, row, id,
          !b.ok() ? std::string("which has no bucket")
          : *b != bucket
              ? absl::StrFormat("of bucket %d, but is stored in bucket %d", *b,
                                bucket)
              : absl::StrFormat("not above the id before it (%d) in bucket %d",
                                prev, bucket)));
    }
    prev = id;
  }
  return absl::OkStatus();
}

absl::StatusOr<KvPieceBytes> KvPieceReader::Read(const KvPiece& piece) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!checked_[piece.chunk]) {
      CAIRN_RETURN_IF_ERROR(CheckEntries(piece.chunk));
      checked_[piece.chunk] = true;
    }
  }
  const KvChunkMetadata& c = md_.chunks[piece.chunk];
  const uint64_t first = piece.begin - c.rows.begin;
  const uint64_t n = piece.rows();
  // The entries read, ids first, each from an aligned offset of one
  // buffer.
  struct Entry {
    const ByteLocation* loc;
    uint64_t row_bytes;
    std::string_view what;
    size_t at = 0;  // in the buffer
  };
  std::vector<Entry> entries = {{&c.ids, 8, "ids"}};
  for (int j : columns_) {
    const KvColumn& col = md_.spec.columns[j];
    entries.push_back({&c.columns[j],
                       static_cast<uint64_t>(col.width) * DTypeSize(col.dtype),
                       col.name});
  }
  size_t need = 0;
  for (Entry& e : entries) {
    e.at = need;
    const Span s = ToRead(*e.loc, first * e.row_bytes, (first + n) * e.row_bytes);
    need += internal_core::RoundUp(std::max<uint64_t>(s.to - s.from, 1),
                                   internal_core::kIoAlignment);
  }
  KvPieceBytes out;
  out.piece = piece;
  {
    // The smallest free buffer that holds the piece (pieces are of about
    // one size, so a load reuses the pages of the two it has in flight).
    std::lock_guard<std::mutex> lock(mu_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second >= need &&
          (best == free_.end() || it->second < best->second)) {
        best = it;
      }
    }
    if (best != free_.end()) {
      out.buffer = std::move(best->first);
      out.capacity = best->second;
      free_.erase(best);
    }
  }
  if (out.buffer == nullptr) {
    CAIRN_ASSIGN_OR_RETURN(out.buffer,
                           internal_core::AllocateAlignedUnique(need));
    out.capacity = need;
  }
  for (size_t k = 0; k < entries.size(); ++k) {
    const Entry& e = entries[k];
    CAIRN_ASSIGN_OR_RETURN(
        const std::byte* data,
        ReadEntry(*e.loc, first * e.row_bytes, (first + n) * e.row_bytes,
                  e.what, piece.chunk, out.buffer.get() + e.at, out));
    if (k == 0) {
      out.ids = reinterpret_cast<const int64_t*>(data);
    } else {
      out.columns.push_back(data);
    }
  }
  CAIRN_RETURN_IF_ERROR(CheckIds(out));
  return out;
}

}  // namespace cairn::internal_checkpoint
