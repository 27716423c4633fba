// Saving key-value tables, step 4 (kv_save.h): each table's rows are
// pulled from its source, checked, gathered into a chunk (ids and each
// column contiguous) and written into the rank's files of that table.
//
// A file's header must come first, but its entries are known only when the
// source ends: the header's room is reserved for kKvChunksPerFile chunks of
// the table (the header those would need with the longest numbers), chunks
// are written behind it as they fill, and the header, padded with spaces to
// that room, is written last. A table with more chunks starts a new file.
// Bytes go to storage through two aligned buffers, one written on its own
// thread while the other fills, so the source's pulls overlap the writes.
#include <algorithm>
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

// A file being written: a reserved header room, then bytes appended
// through two aligned buffers.
class KvFile {
 public:
  static absl::StatusOr<std::unique_ptr<KvFile>> Create(
      Storage& storage, std::string path, uint64_t header_room,
      size_t buffer_bytes) {
    auto f = std::unique_ptr<KvFile>(new KvFile());
    f->path_ = std::move(path);
    CAIRN_ASSIGN_OR_RETURN(f->file_, storage.Create(f->path_));
    f->align_ = std::max<size_t>(f->file_->alignment(), 1);
    f->buffer_bytes_ = internal_core::RoundUp(
        std::max<size_t>(buffer_bytes, internal_core::kIoAlignment),
        std::max<size_t>(f->align_, internal_core::kIoAlignment));
    for (auto& b : f->buffers_) {
      CAIRN_ASSIGN_OR_RETURN(
          b, internal_core::AllocateAlignedUnique(f->buffer_bytes_));
    }
    f->header_room_ = header_room;
    f->buffer_start_ = header_room;
    return f;
  }

  ~KvFile() {
    if (pending_.valid()) pending_.wait();
  }

  const std::string& path() const { return path_; }
  uint64_t position() const { return buffer_start_ + fill_; }
  uint64_t data_start() const { return header_room_; }

  absl::Status Append(std::span<const std::byte> bytes) {
    while (!bytes.empty()) {
      const size_t n = std::min(bytes.size(), buffer_bytes_ - fill_);
      std::memcpy(buffers_[current_].get() + fill_, bytes.data(), n);
      fill_ += n;
      bytes = bytes.subspan(n);
      if (fill_ == buffer_bytes_) CAIRN_RETURN_IF_ERROR(Flush(fill_));
    }
    return absl::OkStatus();
  }

  // Writes what is buffered and the header (the entries written, padded
  // to the header room), makes the file durable and closes it.
  absl::Status Finish(const std::vector<SafetensorsEntry>& entries) {
    const uint64_t size = position();
    if (fill_ > 0) {
      const size_t padded = internal_core::RoundUp(fill_, align_);
      std::memset(buffers_[current_].get() + fill_, 0, padded - fill_);
      CAIRN_RETURN_IF_ERROR(Flush(padded));
    }
    if (pending_.valid()) CAIRN_RETURN_IF_ERROR(pending_.get());
    const std::string header = internal_format::EncodeSafetensorsHeader(
        entries, FileMetadata(), header_room_);
    if (header.size() != header_room_) {
      return absl::InternalError(absl::StrFormat(
          "%s: the header takes %d bytes, more than the %d reserved", path_,
          header.size(), header_room_));
    }
    CAIRN_ASSIGN_OR_RETURN(internal_core::UniqueAligned h,
                           internal_core::AllocateAlignedUnique(header_room_));
    std::memcpy(h.get(), header.data(), header.size());
    CAIRN_RETURN_IF_ERROR(file_->WriteAt(
        0, std::span<const std::byte>(h.get(), header_room_)));
    return file_->Finish(size);
  }

 private:
  KvFile() = default;

  // Starts writing the current buffer's first `bytes` (a multiple of the
  // alignment) and switches to the other buffer, once its write is done.
  absl::Status Flush(size_t bytes) {
    if (pending_.valid()) CAIRN_RETURN_IF_ERROR(pending_.get());
    const std::byte* data = buffers_[current_].get();
    const uint64_t at = buffer_start_;
    pending_ = std::async(std::launch::async, [this, data, at, bytes] {
      return file_->WriteAt(at, std::span<const std::byte>(data, bytes));
    });
    buffer_start_ += fill_;
    fill_ = 0;
    current_ ^= 1;
    return absl::OkStatus();
  }

  std::string path_;
  std::unique_ptr<WritableFile> file_;
  size_t align_ = 1;
  size_t buffer_bytes_ = 0;
  internal_core::UniqueAligned buffers_[2];
  int current_ = 0;
  size_t fill_ = 0;            // bytes in the current buffer
  uint64_t buffer_start_ = 0;  // file offset of its first byte
  uint64_t header_room_ = 0;
  std::future<absl::Status> pending_;
};

// The CRC32C of `bytes` and, when longer than a block, of each block.
void Checksum(std::span<const std::byte> bytes, uint64_t block_bytes,
              ByteLocation& loc) {
  loc.nbytes = bytes.size();
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
    const uint64_t row = 8 + static_cast<uint64_t>(table.spec.row_bytes());
    cap_ = std::max<uint64_t>(1, options.kv_chunk_bytes / row);
    for (const KvColumn& c : table.spec.columns) {
      col_bytes_.push_back(static_cast<size_t>(c.width) * DTypeSize(c.dtype));
    }
    part_.fqn = table.fqn;
    part_.spec = table.spec;
    part_.buckets = table.buckets;
    part_.rows_per_bucket.assign(table.buckets.size(), 0);
    first_row_.assign(table.buckets.size(), 0);
  }

  absl::Status Run(KvSource& source) {
    CAIRN_RETURN_IF_ERROR(Annotate(source.Begin(), Where("Begin()")));
    absl::Status s = Pull(source);
    absl::Status ended = Annotate(source.End(), Where("End()"));
    CAIRN_RETURN_IF_ERROR(s);
    CAIRN_RETURN_IF_ERROR(ended);
    if (rows_ > 0) CAIRN_RETURN_IF_ERROR(Emit(rows_));
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

  absl::Status Allocate() {
    ids_.resize(cap_);
    cols_.resize(col_bytes_.size());
    for (size_t c = 0; c < cols_.size(); ++c) {
      cols_[c].resize(cap_ * col_bytes_[c]);
    }
    return absl::OkStatus();
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
            col.name, DTypeName(t.dtype()), absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]"), n,
            DTypeName(col.dtype), n, col.width));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Pull(KvSource& source) {
    CAIRN_RETURN_IF_ERROR(Allocate());
    KvBatch batch;
    while (true) {
      absl::StatusOr<bool> more = source.Next(batch);
      CAIRN_RETURN_IF_ERROR(Annotate(more.status(), Where("Next()")));
      if (!*more) return absl::OkStatus();
      CAIRN_RETURN_IF_ERROR(CheckBatch(batch));
      const size_t n = batch.ids.size();
      size_t pos = 0;
      while (pos < n) {
        const size_t take = std::min<size_t>(n - pos, cap_ - rows_);
        for (size_t i = pos; i < pos + take; ++i) {
          CAIRN_RETURN_IF_ERROR(Check(batch.ids[i], rows_ + (i - pos)));
        }
        std::memcpy(ids_.data() + rows_, batch.ids.data() + pos, take * 8);
        for (size_t c = 0; c < cols_.size(); ++c) {
          std::memcpy(cols_[c].data() + rows_ * col_bytes_[c],
                      static_cast<const std::byte*>(batch.columns[c].data()) +
                          pos * col_bytes_[c],
                      take * col_bytes_[c]);
        }
        rows_ += take;
        pos += take;
        if (rows_ == cap_) {
          // End the chunk at the last bucket boundary in its second half,
          // else where it is full.
          CAIRN_RETURN_IF_ERROR(
              Emit(boundary_ >= (cap_ + 1) / 2 ? boundary_ : rows_));
        }
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

  // Writes the first `n` rows of the chunk being filled as a chunk, and
  // moves the rest to its front.
  absl::Status Emit(size_t n) {
    if (file_ != nullptr && chunks_in_file_ == kKvChunksPerFile) {
      CAIRN_RETURN_IF_ERROR(CloseFile());
    }
    if (file_ == nullptr) CAIRN_RETURN_IF_ERROR(OpenFile());
    const int64_t bucket = *KvBucketOf(table_.spec, ids_[0]);
    const uint64_t row_in_bucket =
        chunk_first_row_ - first_row_[bucket - table_.buckets.begin];
    KvChunkMetadata chunk;
    chunk.rows = {chunk_first_row_, chunk_first_row_ + n};
    auto put = [&](std::string_view what, DType dtype, Shape shape,
                   std::span<const std::byte> bytes,
                   ByteLocation& loc) -> absl::Status {
      loc.file = file_name_;
      loc.offset = file_->position();
      Checksum(bytes, options_.crc32c_block_bytes, loc);
      const uint64_t begin = loc.offset - file_->data_start();
      entries_.push_back({KvEntryName(table_.fqn, bucket, row_in_bucket, what),
                          dtype, std::move(shape), begin,
                          begin + bytes.size()});
      out_.data_bytes += bytes.size();
      return file_->Append(bytes);
    };
    CAIRN_RETURN_IF_ERROR(
        put("ids", DType::kI64, Shape{static_cast<int64_t>(n)},
            std::as_bytes(std::span<const int64_t>(ids_.data(), n)),
            chunk.ids));
    chunk.columns.resize(cols_.size());
    for (size_t c = 0; c < cols_.size(); ++c) {
      const KvColumn& col = table_.spec.columns[c];
      CAIRN_RETURN_IF_ERROR(
          put(col.name, col.dtype, Shape{static_cast<int64_t>(n), col.width},
              std::span<const std::byte>(cols_[c].data(), n * col_bytes_[c]),
              chunk.columns[c]));
    }
    part_.chunks.push_back(std::move(chunk));
    ++chunks_in_file_;
    out_.rows += n;
    // The rest (rows past a bucket boundary) starts the next chunk.
    const size_t rest = rows_ - n;
    if (rest > 0) {
      std::memmove(ids_.data(), ids_.data() + n, rest * 8);
      for (size_t c = 0; c < cols_.size(); ++c) {
        std::memmove(cols_[c].data(), cols_[c].data() + n * col_bytes_[c],
                     rest * col_bytes_[c]);
      }
    }
    rows_ = rest;
    chunk_first_row_ += n;
    boundary_ = 0;
    return absl::OkStatus();
  }

  absl::Status OpenFile() {
    file_name_ = KvFileName(file_index_, files_made_++, save_id_);
    if (header_room_ == 0) {
      header_room_ = HeaderRoom(table_.fqn, table_.spec, kKvChunksPerFile);
    }
    CAIRN_ASSIGN_OR_RETURN(
        file_, KvFile::Create(storage_, std::string(prefix_) + file_name_,
                              header_room_, options_.write_buffer_bytes));
    chunks_in_file_ = 0;
    entries_.clear();
    return absl::OkStatus();
  }

  absl::Status CloseFile() {
    if (file_ == nullptr) return absl::OkStatus();
    const uint64_t size = file_->position();
    absl::Status s = Annotate(file_->Finish(entries_), Where(file_->path()));
    file_.reset();
    CAIRN_RETURN_IF_ERROR(s);
    out_.bytes_written += size;
    ++out_.files;
    return absl::OkStatus();
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

  uint64_t cap_ = 1;  // rows a chunk holds at most
  std::vector<size_t> col_bytes_;  // bytes of a row of each column
  KvTablePart part_;
  std::vector<uint64_t> first_row_;  // each bucket's first row in the part

  // The chunk being filled: rows_ rows, its first the part's
  // chunk_first_row_; boundary_ > 0: the index of its last row that
  // starts a bucket.
  std::vector<int64_t> ids_;
  std::vector<std::vector<std::byte>> cols_;
  size_t rows_ = 0;
  uint64_t chunk_first_row_ = 0;
  size_t boundary_ = 0;

  uint64_t total_rows_ = 0;
  int64_t prev_bucket_ = -1;
  int64_t prev_id_ = -1;

  std::unique_ptr<KvFile> file_;
  std::string file_name_;
  uint64_t header_room_ = 0;
  int chunks_in_file_ = 0;
  std::vector<SafetensorsEntry> entries_;
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
