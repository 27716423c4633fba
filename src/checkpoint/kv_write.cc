// Saving key-value tables, step 4 (kv_save.h): each table's rows are
// pulled from its source, checked, gathered into a chunk (ids and each
// column contiguous, largest rows first) and written into the rank's
// files of that table.
//
// A file's header must come first, but its entries are known only when the
// source ends: the header's room is reserved for kKvChunksPerFile chunks of
// the table (the header those would need with the longest numbers), chunks
// are written behind it as they fill, and the header, padded with spaces to
// that room, is written last. A table with more chunks starts a new file.
// A chunk is gathered in an aligned stage laid out as it lies in the file
// and written from there (no copy): most of it while it fills, the rest on
// its own thread while the other stage fills (Stage, WriteEarly, Emit).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "cairn/metadata.h"
#include "cairn/storage.h"
#include "checkpoint/kv_save.h"
#include "core/aligned_buffer.h"
#include "core/checked.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/names.h"
#include "format/safetensors.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::Annotate;
using internal_format::KvEntryName;
using internal_format::KvFileName;
using internal_format::SafetensorsEntry;

std::map<std::string, std::string> FileMetadata() {
  return {{"format", "cairn"}, {"version", std::to_string(kFormatVersion)}};
}

// The header room of a file of `chunks` chunks of `spec`'s table `fqn`:
// the header with every number at its longest, rounded up to 4096.
uint64_t HeaderRoom(std::string_view fqn, const KvTableSpec& spec,
                    int chunks) {
  std::vector<SafetensorsEntry> entries;
  const int64_t big = int64_t{1000000000000000000};  // 19 digits
  const uint64_t huge = uint64_t{10000000000000000000u};  // 20 digits
  for (int k = 0; k < chunks; ++k) {
    entries.push_back({KvEntryName(fqn, big + k, huge, "ids"), DType::kI64,
                       Shape{big}, huge, huge});
    for (const KvColumn& c : spec.columns) {
      entries.push_back({KvEntryName(fqn, big + k, huge, c.name), c.dtype,
                         Shape{big, c.width}, huge, huge});
    }
  }
  const std::string header = internal_format::EncodeSafetensorsHeader(
      entries, FileMetadata(), internal_core::kIoAlignment);
  return header.size();
}

// The CRC32C of `bytes` and, when longer than a block, of each block.
void Checksum(std::span<const std::byte> bytes, uint64_t block_bytes,
              ByteLocation& loc) {
  loc.nbytes = bytes.size();
  loc.block_crc32c.clear();
  if (bytes.size() <= block_bytes) {
    loc.crc32c = internal_format::Crc32c(bytes.data(), bytes.size());
    return;
  }
  uint32_t crc = 0;
  bool first = true;
  for (uint64_t at = 0; at < bytes.size(); at += block_bytes) {
    const uint64_t n = std::min<uint64_t>(block_bytes, bytes.size() - at);
    const uint32_t block = internal_format::Crc32c(bytes.data() + at, n);
    loc.block_crc32c.push_back(block);
    crc = first ? block : internal_format::Crc32cCombine(crc, block, n);
    first = false;
  }
  loc.crc32c = crc;
}

// A chunk's rows as they are gathered and written: one aligned buffer
// whose first byte is the file's byte `file_at` (aligned). Its first
// `carry` bytes are the end of the chunk before (the part of an aligned
// block that chunk began); then each region (the ids, the columns) of
// up to `cap` rows, region k at carry + cap x (the row bytes of the
// regions before it). Full, the regions lie back to back, as in the file;
// a chunk cut shorter moves its regions together before it is written.
struct Stage {
  internal_core::UniqueAligned bytes;
  uint64_t file_at = 0;
  size_t carry = 0;
  // Writes of the first region's rows while the chunk fills: bytes
  // [0, written) of the buffer are written or being written.
  std::vector<std::future<absl::Status>> early;
  size_t written = 0;
  // The write of the rest of the chunk it holds, and that chunk's index
  // in the part and checksums (filled by the write).
  std::future<absl::Status> write;
  size_t chunk = 0;
  std::vector<ByteLocation> sums;
};

// One table's rows on their way to its files.
class TableWriter {
 public:
  TableWriter(Storage& storage, std::string_view prefix, int file_index,
              int rank, std::string_view save_id, const KvDeclaration& table,
              const SaveOptions& options, int& files_made, KvWritten& out)
      : storage_(storage),
        prefix_(prefix),
        file_index_(file_index),
        rank_(rank),
        save_id_(save_id),
        table_(table),
        options_(options),
        files_made_(files_made),
        out_(out) {
    row_bytes_ = 8 + static_cast<uint64_t>(table.spec.row_bytes());
    cap_ = std::max<uint64_t>(1, options.kv_chunk_bytes / row_bytes_);
    // Regions: the ids (index 0) and each column (index c + 1), largest
    // rows first, so that moving a short chunk's regions together moves
    // the smaller ones (docs/format.md 4.7).
    region_bytes_.push_back(8);
    for (const KvColumn& c : table.spec.columns) {
      region_bytes_.push_back(static_cast<size_t>(c.width) *
                              DTypeSize(c.dtype));
    }
    for (size_t k = 0; k < region_bytes_.size(); ++k) order_.push_back(k);
    std::stable_sort(order_.begin(), order_.end(), [&](size_t a, size_t b) {
      return region_bytes_[a] > region_bytes_[b];
    });
    region_at_.assign(region_bytes_.size(), 0);
    uint64_t at = 0;
    for (size_t k : order_) {
      region_at_[k] = at;
      at += cap_ * region_bytes_[k];
    }
    part_.fqn = table.fqn;
    part_.spec = table.spec;
    part_.buckets = table.buckets;
    part_.rows_per_bucket.assign(table.buckets.size(), 0);
    first_row_.assign(table.buckets.size(), 0);
  }

  ~TableWriter() {
    for (Stage& s : stages_) {
      for (auto& e : s.early) e.wait();
      if (s.write.valid()) s.write.wait();
    }
  }

  absl::Status Run(KvSource& source) {
    CAIRN_RETURN_IF_ERROR(Annotate(source.Begin(), Where("Begin()")));
    absl::Status s = Pull(source);
    absl::Status ended = Annotate(source.End(), Where("End()"));
    CAIRN_RETURN_IF_ERROR(s);
    CAIRN_RETURN_IF_ERROR(ended);
    if (rows_ > 0) CAIRN_RETURN_IF_ERROR(Emit(rows_, /*last=*/true));
    return CloseFile();
  }

  KvTablePart TakePart() { return std::move(part_); }

 private:
  std::string Where(std::string_view what) const {
    return absl::StrFormat("save: key-value table \"%s\" on rank %d: %s",
                           table_.fqn, rank_, what);
  }
  absl::Status Bad(std::string_view why) const {
    return absl::InvalidArgumentError(Where(why));
  }

  // Stage `k`, allocated when first needed: room for the carry, cap_ rows
  // and the padding to the alignment.
  absl::StatusOr<Stage*> GetStage(int k) {
    Stage& s = stages_[k];
    if (s.bytes == nullptr) {
      CAIRN_ASSIGN_OR_RETURN(
          s.bytes, internal_core::AllocateAlignedUnique(
                       internal_core::RoundUp(2 * align_ + cap_ * row_bytes_,
                                              align_)));
    }
    return &s;
  }
  std::byte* Region(Stage& s, size_t k) {
    return s.bytes.get() + s.carry + region_at_[k];
  }

  // Waits for stage `s`'s write, and takes its checksums into the part.
  absl::Status Join(Stage& s) {
    CAIRN_RETURN_IF_ERROR(JoinEarly(s));
    if (!s.write.valid()) return absl::OkStatus();
    CAIRN_RETURN_IF_ERROR(Annotate(s.write.get(), Where(file_path_)));
    KvChunkMetadata& c = part_.chunks[s.chunk];
    for (size_t k = 0; k < s.sums.size(); ++k) {
      ByteLocation& loc = k == 0 ? c.ids : c.columns[k - 1];
      loc.crc32c = s.sums[k].crc32c;
      loc.block_crc32c = std::move(s.sums[k].block_crc32c);
    }
    return absl::OkStatus();
  }

  absl::Status JoinEarly(Stage& s) {
    absl::Status status;
    for (auto& e : s.early) {
      absl::Status w = e.get();
      if (status.ok()) status = w;
    }
    s.early.clear();
    return Annotate(status, Where(file_path_));
  }

  // Starts writing the first region's rows that are sure to be in the
  // chunk, in whole aligned pieces of write_buffer_bytes: that region's
  // place in the file is known before the chunk's length is (the regions
  // after it move when the chunk is cut short), so most of a chunk is
  // written while it fills. Sure: the rows before the chunk's second half
  // (it is cut, if at all, at a bucket start in that half) and those
  // before the last bucket start seen in it (a cut is at that one or a
  // later one).
  void WriteEarly(Stage& s) {
    const size_t half = (cap_ + 1) / 2;
    const size_t sure =
        rows_ < half ? rows_ : std::max(half, boundary_ >= half ? boundary_ : 0);
    const size_t piece = WritePiece();
    const size_t ready = internal_core::RoundDown(
        s.carry + sure * region_bytes_[order_[0]], align_);
    if (ready < s.written + piece) return;
    const std::byte* data = s.bytes.get() + s.written;
    const uint64_t at = s.file_at + s.written;
    const size_t length = ready - s.written;
    s.early.push_back(std::async(std::launch::async, [this, data, at, length] {
      return file_->WriteAt(at, std::span<const std::byte>(data, length));
    }));
    s.written = ready;
  }

  size_t WritePiece() const {
    return internal_core::RoundUp(
        std::max<size_t>(options_.write_buffer_bytes, align_), align_);
  }

  absl::Status CheckBatch(const KvBatch& b) const {
    const KvTableSpec& spec = table_.spec;
    const auto n = static_cast<int64_t>(b.ids.size());
    if (b.columns.size() != spec.columns.size()) {
      return Bad(absl::StrFormat("the source gave %d columns, the table has %d",
                                 b.columns.size(), spec.columns.size()));
    }
    for (size_t c = 0; c < spec.columns.size(); ++c) {
      const KvColumn& col = spec.columns[c];
      const Tensor& t = b.columns[c];
      if (t.dtype() != col.dtype || t.shape() != Shape{n, col.width} ||
          (n > 0 && t.data() == nullptr)) {
        return Bad(absl::StrFormat(
            "the source's column \"%s\" is %s %s for %d ids, not %s [%d, %d]",
            col.name, DTypeName(t.dtype()),
            absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]"), n,
            DTypeName(col.dtype), n, col.width));
      }
    }
    return absl::OkStatus();
  }

  // Pulls with NextInto, or with Next when the source has only that.
  absl::Status Pull(KvSource& source) {
    // Rows a NextInto call gets room for: a write piece's worth, so that
    // the early writes keep up.
    const size_t per_call =
        std::max<size_t>(1, WritePiece() / static_cast<size_t>(row_bytes_));
    while (true) {
      CAIRN_ASSIGN_OR_RETURN(Stage * s, GetStage(current_));
      KvRowsRoom room;
      room.capacity = std::min(per_call, cap_ - rows_);
      room.ids = reinterpret_cast<int64_t*>(Region(*s, 0)) + rows_;
      for (size_t c = 0; c + 1 < region_bytes_.size(); ++c) {
        room.columns.push_back(Region(*s, c + 1) + rows_ * region_bytes_[c + 1]);
      }
      absl::StatusOr<size_t> got = source.NextInto(room);
      if (absl::IsUnimplemented(got.status()) && total_rows_ == 0) {
        return PullBatches(source);
      }
      CAIRN_RETURN_IF_ERROR(Annotate(got.status(), Where("NextInto()")));
      if (*got == 0) return absl::OkStatus();
      if (*got > room.capacity) {
        return Bad(absl::StrFormat(
            "NextInto() says it wrote %d rows into room for %d", *got,
            room.capacity));
      }
      if (file_ == nullptr) CAIRN_RETURN_IF_ERROR(OpenFile());
      for (size_t i = 0; i < *got; ++i) {
        CAIRN_RETURN_IF_ERROR(Check(room.ids[i], rows_ + i));
      }
      CAIRN_RETURN_IF_ERROR(Took(*got));
    }
  }

  // `n` rows more are in the chunk being filled, checked.
  absl::Status Took(size_t n) {
    rows_ += n;
    WriteEarly(stages_[current_]);
    if (rows_ < cap_) return absl::OkStatus();
    // End the chunk at the last bucket boundary in its second half, else
    // where it is full.
    return Emit(boundary_ >= (cap_ + 1) / 2 ? boundary_ : rows_, false);
  }

  absl::Status PullBatches(KvSource& source) {
    KvBatch batch;
    while (true) {
      absl::StatusOr<bool> more = source.Next(batch);
      CAIRN_RETURN_IF_ERROR(Annotate(more.status(), Where("Next()")));
      if (!*more) return absl::OkStatus();
      CAIRN_RETURN_IF_ERROR(CheckBatch(batch));
      const size_t n = batch.ids.size();
      size_t pos = 0;
      while (pos < n) {
        if (file_ == nullptr) CAIRN_RETURN_IF_ERROR(OpenFile());
        Stage& s = stages_[current_];
        const size_t take = std::min<size_t>(n - pos, cap_ - rows_);
        for (size_t i = pos; i < pos + take; ++i) {
          CAIRN_RETURN_IF_ERROR(Check(batch.ids[i], rows_ + (i - pos)));
        }
        std::memcpy(Region(s, 0) + rows_ * 8, batch.ids.data() + pos,
                    take * 8);
        for (size_t c = 0; c < batch.columns.size(); ++c) {
          const size_t row = region_bytes_[c + 1];
          std::memcpy(Region(s, c + 1) + rows_ * row,
                      static_cast<const std::byte*>(batch.columns[c].data()) +
                          pos * row,
                      take * row);
        }
        pos += take;
        CAIRN_RETURN_IF_ERROR(Took(take));
      }
    }
  }

  // The row at index `at` of the chunk being filled has id `id`.
  absl::Status Check(int64_t id, size_t at) {
    absl::StatusOr<int64_t> bucket = KvBucketOf(table_.spec, id);
    if (!bucket.ok()) return Bad(std::string(bucket.status().message()));
    if (!table_.buckets.contains(*bucket)) {
      return Bad(absl::StrFormat(
          "id %d is in bucket %d, not one of this rank's buckets [%d, %d)", id,
          *bucket, table_.buckets.begin, table_.buckets.end));
    }
    if (*bucket < prev_bucket_ ||
        (*bucket == prev_bucket_ && id <= prev_id_)) {
      return Bad(absl::StrFormat(
          "id %d (bucket %d) comes after id %d (bucket %d): %s", id, *bucket,
          prev_id_, prev_bucket_,
          id == prev_id_ ? "a duplicate id"
                         : "rows must come in (bucket, id) order"));
    }
    const size_t b = static_cast<size_t>(*bucket - table_.buckets.begin);
    if (*bucket != prev_bucket_) {
      first_row_[b] = total_rows_;
      if (at > 0) boundary_ = at;
    }
    ++part_.rows_per_bucket[b];
    ++total_rows_;
    prev_bucket_ = *bucket;
    prev_id_ = id;
    return absl::OkStatus();
  }

  // Writes the first `n` rows of the chunk being filled as a chunk, on
  // its own thread, and starts the next chunk in the other stage with the
  // rest and the unaligned end of this one. `last`: no rows follow.
  absl::Status Emit(size_t n, bool last) {
    Stage& s = stages_[current_];
    const uint64_t begin = position_;  // the chunk's first byte in the file
    const uint64_t end = begin + n * row_bytes_;
    const bool closes = last || chunks_in_file_ + 1 == kKvChunksPerFile;
    // The entries, in the file's order, and the chunk in the part.
    const int64_t bucket = *KvBucketOf(table_.spec, Ids(s)[0]);
    const uint64_t row_in_bucket =
        chunk_first_row_ - first_row_[bucket - table_.buckets.begin];
    KvChunkMetadata chunk;
    chunk.rows = {chunk_first_row_, chunk_first_row_ + n};
    chunk.columns.resize(table_.spec.columns.size());
    uint64_t at = begin;
    for (size_t k : order_) {
      ByteLocation& loc = k == 0 ? chunk.ids : chunk.columns[k - 1];
      loc.file = file_name_;
      loc.offset = at;
      loc.nbytes = n * region_bytes_[k];
      const uint64_t from = at - header_room_;
      if (k == 0) {
        entries_.push_back({KvEntryName(table_.fqn, bucket, row_in_bucket,
                                        "ids"),
                            DType::kI64, Shape{static_cast<int64_t>(n)}, from,
                            from + loc.nbytes});
      } else {
        const KvColumn& col = table_.spec.columns[k - 1];
        entries_.push_back(
            {KvEntryName(table_.fqn, bucket, row_in_bucket, col.name),
             col.dtype, Shape{static_cast<int64_t>(n), col.width}, from,
             from + loc.nbytes});
      }
      at += loc.nbytes;
    }
    const size_t index = part_.chunks.size();
    part_.chunks.push_back(std::move(chunk));
    // The rows past n start the next chunk: copied into the other stage
    // before this one's regions move together.
    const size_t rest = rows_ - n;
    Stage* next = nullptr;
    if (!last) {
      CAIRN_ASSIGN_OR_RETURN(next, GetStage(current_ ^ 1));
      CAIRN_RETURN_IF_ERROR(Join(*next));
      next->carry = closes ? 0 : end % align_;
      next->file_at = closes ? header_room_ : end - next->carry;
      next->written = 0;
      for (size_t k = 0; k < region_bytes_.size(); ++k) {
        std::memcpy(Region(*next, k), Region(s, k) + n * region_bytes_[k],
                    rest * region_bytes_[k]);
      }
    }
    // The early writes (still running) read only rows the chunk keeps,
    // none of the bytes about to move, and the rest is written from where
    // they end.
    const size_t start = s.written;
    if (n < cap_) {
      uint64_t to = 0;
      for (size_t k : order_) {
        std::memmove(Region(s, 0) - region_at_[0] + to, Region(s, k),
                     n * region_bytes_[k]);
        to += n * region_bytes_[k];
      }
    }
    // What is written: from the stage's aligned start to the chunk's end,
    // rounded down (the rest goes with the next chunk) or, when the file
    // ends, up with zeros.
    const size_t used = s.carry + (end - begin);
    size_t length = internal_core::RoundDown(used, align_);
    if (closes) {
      length = internal_core::RoundUp(used, align_);
      std::memset(s.bytes.get() + used, 0, length - used);
    } else {
      std::memcpy(next->bytes.get(), s.bytes.get() + length, used - length);
    }
    out_.data_bytes += end - begin;
    out_.rows += n;
    s.chunk = index;
    s.sums.assign(region_bytes_.size(), {});
    const std::byte* data = s.bytes.get() + start;
    const uint64_t file_at = s.file_at + start;
    const std::byte* regions = s.bytes.get() + s.carry;
    s.write = std::async(std::launch::async, [this, &s, data, file_at,
                                              length = length - start,
                                              regions, n] {
      return WriteStage(s, data, file_at, length, regions, n);
    });
    ++chunks_in_file_;
    position_ = end;
    rows_ = rest;
    chunk_first_row_ += n;
    boundary_ = 0;
    if (!last) current_ ^= 1;
    if (closes) CAIRN_RETURN_IF_ERROR(CloseFile());
    return absl::OkStatus();
  }

  // On the stage's own thread: the regions' checksums, then `length`
  // bytes from `data` at `file_at`, in pieces of at most
  // write_buffer_bytes written io_threads at a time.
  absl::Status WriteStage(Stage& s, const std::byte* data, uint64_t file_at,
                          size_t length, const std::byte* regions, size_t n) {
    uint64_t at = 0;
    for (size_t k : order_) {
      const size_t bytes = n * region_bytes_[k];
      Checksum(std::span<const std::byte>(regions + at, bytes),
               options_.crc32c_block_bytes, s.sums[k]);
      at += bytes;
    }
    const size_t piece = WritePiece();
    const size_t pieces = (length + piece - 1) / piece;
    const size_t threads =
        std::clamp<size_t>(options_.io_threads, 1, std::max<size_t>(pieces, 1));
    std::atomic<size_t> next{0};
    auto work = [&]() -> absl::Status {
      for (size_t i = next++; i < pieces; i = next++) {
        const size_t from = i * piece;
        const size_t len = std::min(piece, length - from);
        CAIRN_RETURN_IF_ERROR(file_->WriteAt(
            file_at + from, std::span<const std::byte>(data + from, len)));
      }
      return absl::OkStatus();
    };
    std::vector<std::future<absl::Status>> helpers;
    for (size_t t = 1; t < threads; ++t) {
      helpers.push_back(std::async(std::launch::async, work));
    }
    absl::Status status = work();
    for (auto& h : helpers) {
      absl::Status hs = h.get();
      if (status.ok()) status = hs;
    }
    return status;
  }

  const int64_t* Ids(Stage& s) {
    return reinterpret_cast<const int64_t*>(Region(s, 0));
  }

  absl::Status OpenFile() {
    file_name_ = KvFileName(file_index_, files_made_++, save_id_);
    file_path_ = std::string(prefix_) + file_name_;
    if (header_room_ == 0) {
      header_room_ = HeaderRoom(table_.fqn, table_.spec, kKvChunksPerFile);
    }
    CAIRN_ASSIGN_OR_RETURN(file_, storage_.Create(file_path_));
    align_ = std::max<size_t>(file_->alignment(), internal_core::kIoAlignment);
    chunks_in_file_ = 0;
    entries_.clear();
    position_ = header_room_;
    // A new file's first chunk starts right after its header room (rows
    // past the cut of the file before's last chunk are in place already).
    CAIRN_ASSIGN_OR_RETURN(Stage * s, GetStage(current_));
    s->carry = 0;
    s->file_at = header_room_;
    s->written = 0;
    return absl::OkStatus();
  }

  // Waits for the file's writes, writes its header (the entries written,
  // padded to the header room), makes it durable and closes it.
  absl::Status CloseFile() {
    if (file_ == nullptr) return absl::OkStatus();
    absl::Status s = JoinAll();
    if (s.ok()) {
      const std::string header = internal_format::EncodeSafetensorsHeader(
          entries_, FileMetadata(), header_room_);
      if (header.size() != header_room_) {
        s = absl::InternalError(absl::StrFormat(
            "%s: the header takes %d bytes, more than the %d reserved",
            file_path_, header.size(), header_room_));
      }
      absl::StatusOr<internal_core::UniqueAligned> h =
          internal_core::AllocateAlignedUnique(header_room_);
      if (s.ok()) s = h.status();
      if (s.ok()) {
        std::memcpy(h->get(), header.data(), header.size());
        s = file_->WriteAt(
            0, std::span<const std::byte>(h->get(), header_room_));
      }
      if (s.ok()) s = file_->Finish(position_);
    }
    s = Annotate(s, Where(file_path_));
    file_.reset();
    CAIRN_RETURN_IF_ERROR(s);
    out_.bytes_written += position_;
    ++out_.files;
    return absl::OkStatus();
  }

  absl::Status JoinAll() {
    absl::Status status;
    for (Stage& s : stages_) {
      absl::Status j = Join(s);
      if (status.ok()) status = j;
    }
    return status;
  }

  Storage& storage_;
  std::string_view prefix_;
  int file_index_;
  int rank_;
  std::string_view save_id_;
  const KvDeclaration& table_;
  const SaveOptions& options_;
  int& files_made_;
  KvWritten& out_;

  uint64_t row_bytes_ = 8;  // ids and every column
  uint64_t cap_ = 1;        // rows a chunk holds at most
  std::vector<size_t> region_bytes_;  // a row's bytes: ids, then columns
  std::vector<size_t> order_;         // the regions in the file's order
  std::vector<uint64_t> region_at_;   // each region's offset in a stage
  KvTablePart part_;
  std::vector<uint64_t> first_row_;  // each bucket's first row in the part

  // The chunk being filled, in stages_[current_]: rows_ rows, its first
  // the part's chunk_first_row_; boundary_ > 0: the index of its last row
  // that starts a bucket.
  size_t rows_ = 0;
  uint64_t chunk_first_row_ = 0;
  size_t boundary_ = 0;

  uint64_t total_rows_ = 0;
  int64_t prev_bucket_ = -1;
  int64_t prev_id_ = -1;

  std::unique_ptr<WritableFile> file_;
  std::string file_name_;
  std::string file_path_;
  size_t align_ = internal_core::kIoAlignment;
  uint64_t header_room_ = 0;
  uint64_t position_ = 0;  // the file's next byte
  int chunks_in_file_ = 0;
  std::vector<SafetensorsEntry> entries_;
  // Last: destroyed first, once their writes are done (the destructor
  // waits for them), while the file is still open.
  Stage stages_[2];
  int current_ = 0;
};

}  // namespace

absl::StatusOr<KvWritten> WriteKvTables(
    Storage& storage, std::string_view prefix, int file_index, int rank,
    std::string_view save_id, const std::vector<KvDeclaration>& tables,
    const SaveOptions& options) {
  KvWritten out;
  int files_made = 0;
  for (const KvDeclaration& table : tables) {
    TableWriter writer(storage, prefix, file_index, rank, save_id, table,
                       options, files_made, out);
    if (table.buckets.size() > 0) {
      auto it = std::find_if(
          options.kv_tables.begin(), options.kv_tables.end(),
          [&](const KvTableToSave& t) { return t.fqn == table.fqn; });
      CAIRN_RETURN_IF_ERROR(writer.Run(*it->source));
    }
    out.parts.push_back(writer.TakePart());
  }
  if (out.files > 0) CAIRN_RETURN_IF_ERROR(storage.Sync());
  return out;
}

}  // namespace cairn::internal_checkpoint
