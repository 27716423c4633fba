// Save, step 4 with a codec (SaveOptions::codec, format version 5): a
// rank's data file streamed with its tensors compressed (save_write.h,
// WriteCompressedDataFile). Entries' stored sizes are known only once
// they are compressed, so the header, which lists them, is written last
// into room reserved for it at the start of the file (safetensors allows
// the header to be padded with spaces).
#include <algorithm>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/metadata.h"
#include "checkpoint/save_write.h"
#include "core/aligned_buffer.h"
#include "core/checked.h"
#include "core/parallel.h"
#include "core/status.h"
#include "core/strided.h"
#include "format/chunk_digest.h"
#include "format/crc32c.h"
#include "format/frame_codec.h"
#include "format/safetensors.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::Annotate;
using internal_format::FrameCompressor;
using internal_format::SafetensorsEntry;

// Tensor entries smaller than this are stored raw: a frame's own overhead
// and a chunk's longer metadata eat what little they would save.
constexpr uint64_t kMinCompressedBytes = 4096;
// Frames compressed together before they are handed to the writer, and
// the sample a chunk's ratio is judged on.
constexpr uint64_t kBatchBytes = uint64_t{64} << 20;
// A chunk whose first batch compresses to more than this share of its raw
// size is stored raw: decompressing would cost more than it saves.
constexpr double kMaxStoredShare = 0.95;

// Bytes appended to the file from `start` on, in aligned blocks of
// `block` bytes, each written once full (the last one padded to the
// storage's alignment; Finish cuts the file back). Not thread-safe: one
// appender at a time (the writer task, or the entry loop between them).
class Appender {
 public:
  Appender(WritableFile& file, uint64_t start, uint64_t block,
           internal_core::UniqueAligned buffer, std::string file_name)
      : file_(file),
        next_write_(start),
        block_(block),
        buffer_(std::move(buffer)),
        file_name_(std::move(file_name)) {}

  absl::Status Append(const std::byte* data, uint64_t n) {
    while (n > 0) {
      const uint64_t k = std::min(n, block_ - filled_);
      if (data != nullptr) {
        std::memcpy(buffer_.get() + filled_, data, k);
        data += k;
      } else {
        std::memset(buffer_.get() + filled_, 0, k);
      }
      filled_ += k;
      n -= k;
      if (filled_ == block_) CAIRN_RETURN_IF_ERROR(Flush(block_));
    }
    return absl::OkStatus();
  }

  // Writes what is left, padded to `align`.
  absl::Status Finish(uint64_t align) {
    if (filled_ == 0) return absl::OkStatus();
    const uint64_t len = internal_core::RoundUp(filled_, align);
    std::memset(buffer_.get() + filled_, 0, len - filled_);
    return Flush(len);
  }

 private:
  absl::Status Flush(uint64_t len) {
    CAIRN_RETURN_IF_ERROR(Annotate(
        file_.WriteAt(next_write_,
                      std::span<const std::byte>(buffer_.get(), len)),
        absl::StrFormat("writing %s at offset %d", file_name_, next_write_)));
    next_write_ += len;
    filled_ = 0;
    return absl::OkStatus();
  }

  WritableFile& file_;
  uint64_t next_write_;
  const uint64_t block_;
  internal_core::UniqueAligned buffer_;
  const std::string file_name_;
  uint64_t filled_ = 0;
};

// What a frame loop's thread works with: a compressor, and a raw frame
// and its compressed form, sized once for the largest frame.
struct FrameWork {
  FrameWork(Codec codec, int level, uint64_t frame_bytes)
      : compressor(codec, level),
        raw(frame_bytes),
        stored(internal_format::MaxFrameBytes(frame_bytes)) {}
  FrameCompressor compressor;
  std::vector<std::byte> raw;
  std::vector<std::byte> stored;
};

// FrameWork for the frame loops, one per thread at a time.
class FrameWorkPool {
 public:
  FrameWorkPool(Codec codec, int level, uint64_t frame_bytes)
      : codec_(codec), level_(level), frame_bytes_(frame_bytes) {}
  std::unique_ptr<FrameWork> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) {
      return std::make_unique<FrameWork>(codec_, level_, frame_bytes_);
    }
    std::unique_ptr<FrameWork> w = std::move(free_.back());
    free_.pop_back();
    return w;
  }
  void Give(std::unique_ptr<FrameWork> w) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(w));
  }

 private:
  const Codec codec_;
  const int level_;
  const uint64_t frame_bytes_;
  std::mutex mu_;
  std::vector<std::unique_ptr<FrameWork>> free_;
};

// One batch of an entry's frames, compressed.
struct Batch {
  std::vector<std::vector<std::byte>> stored;  // [frame] bytes, sized
  std::vector<uint32_t> raw_crc;
  std::vector<ChunkDigest> raw_digest;  // when the entry takes digests
  uint64_t raw_bytes = 0;
  uint64_t stored_bytes = 0;
};

// The largest header the file can need: every entry at the largest
// offsets (20 digits) and a padding entry before each, names and all.
uint64_t HeaderRoom(const FileLayout& layout) {
  constexpr uint64_t kBig = std::numeric_limits<uint64_t>::max();
  constexpr int64_t kBigDim = std::numeric_limits<int64_t>::max();
  // A padding entry's name: "__cairn_pad_", the offset, and a "_" for
  // each entry name it could meet.
  size_t pad_name = 12 + 20 + 1;
  for (const auto& e : layout.entries) {
    if (e->st.name.starts_with("__cairn_pad_")) ++pad_name;
  }
  // (Entries are members of one JSON object, so each is measured alone:
  // its text less the braces, plus a comma.)
  auto member = [](SafetensorsEntry e) -> uint64_t {
    return internal_format::EncodeSafetensorsHeader({std::move(e)}, {}, 1)
               .size() -
           8 - 2 + 1;
  };
  uint64_t room = internal_format::EncodeSafetensorsHeader(
                      {},
                      {{"format", "cairn"},
                       {"version", std::to_string(kFormatVersion)}},
                      1)
                      .size();
  for (const auto& e : layout.entries) {
    room += member({std::string(pad_name, 'p'), DType::kU8, Shape{kBigDim},
                    kBig, kBig});
    // Its raw form, or as U8 [n] when compressed: room for the longer.
    SafetensorsEntry raw = e->st;
    raw.begin = raw.end = kBig;
    SafetensorsEntry stored = raw;
    stored.dtype = DType::kU8;
    stored.shape = Shape{kBigDim};
    room += std::max(member(std::move(raw)), member(std::move(stored)));
  }
  return room;
}

}  // namespace

absl::Status WriteCompressedDataFile(FileLayout& layout, SavePlanner& planner,
                                     Storage& storage,
                                     const std::string& file_name,
                                     const SaveOptions& options) {
  CAIRN_RETURN_IF_ERROR(internal_format::CheckCodecLevel(options.codec_level));
  uint64_t align = 1;
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                         CreateDataFile(storage, file_name, &align));
  const uint64_t data_start =
      internal_core::RoundUp(HeaderRoom(layout), kAlignment);
  uint64_t block = std::max<uint64_t>(options.write_buffer_bytes, kAlignment);
  block = internal_core::RoundUp(block, kAlignment);
  CAIRN_ASSIGN_OR_RETURN(internal_core::UniqueAligned buffer,
                         internal_core::AllocateAlignedUnique(block));
  Appender out(*file, data_start, block, std::move(buffer), file_name);

  const uint64_t frame_bytes = options.crc32c_block_bytes;
  const int threads = internal_core::CpuThreads();
  const uint64_t batch_frames =
      std::max<uint64_t>(threads, kBatchBytes / frame_bytes);
  FrameWorkPool work(options.codec, options.codec_level, frame_bytes);
  // The writer task appends one batch while the next is compressed; two
  // batches alternate. `pos`: where the appended bytes will end, relative
  // to the byte buffer.
  Batch batches[2];
  int in_flight = -1;  // the batch the writer has, if any
  std::future<absl::Status> writing;
  auto wait_writer = [&]() -> absl::Status {
    return writing.valid() ? writing.get() : absl::OkStatus();
  };
  uint64_t pos = 0;
  std::set<std::string> names;
  for (const auto& e : layout.entries) names.insert(e->st.name);
  std::vector<SafetensorsEntry> st;
  // Pads to kAlignment before an entry of `raw` bytes that needs it.
  auto align_entry = [&](uint64_t raw) -> absl::Status {
    const uint64_t aligned = internal_core::RoundUp(pos, kAlignment);
    if (raw < kAlignedEntryBytes || aligned == pos) return absl::OkStatus();
    std::string name = PaddingName(pos, names);
    names.insert(name);
    st.push_back({std::move(name), DType::kU8,
                  Shape{static_cast<int64_t>(aligned - pos)}, pos, aligned});
    CAIRN_RETURN_IF_ERROR(wait_writer());
    CAIRN_RETURN_IF_ERROR(out.Append(nullptr, aligned - pos));
    pos = aligned;
    return absl::OkStatus();
  };
  // Compresses frames [first, first + count) of `e` into `b`.
  auto compress = [&](Entry& e, const ResolvedData& data, uint64_t first,
                      uint64_t count, Batch& b) -> absl::Status {
    const uint64_t raw_total = e.item->nbytes;
    const size_t es = DTypeSize(e.item->dtype);
    b.stored.resize(count);
    b.raw_crc.assign(count, 0);
    b.raw_digest.assign(e.block_digest.empty() ? 0 : count, ChunkDigest{});
    std::vector<uint64_t> sizes(count, 0);
    CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
        static_cast<int64_t>(count), threads, [&](int64_t i) -> absl::Status {
          const uint64_t lo = (first + i) * frame_bytes;
          const uint64_t hi = std::min(raw_total, lo + frame_bytes);
          std::unique_ptr<FrameWork> w = work.Take();
          const std::span<std::byte> raw(w->raw.data(), hi - lo);
          internal_core::CopyRowMajorBytes(data.view, lo, hi, raw.data());
          b.raw_crc[i] = internal_format::Crc32c(raw.data(), raw.size());
          if (!b.raw_digest.empty()) {
            b.raw_digest[i] =
                internal_format::BlockDigest(raw.data(), raw.size());
          }
          absl::StatusOr<size_t> n = w->compressor.Compress(raw, es, w->stored);
          if (n.ok()) {
            b.stored[i].assign(w->stored.data(), w->stored.data() + *n);
            sizes[i] = *n;
          }
          work.Give(std::move(w));
          return Annotate(n.status(),
                          absl::StrFormat("compressing %s, frame %d",
                                          e.st.name, first + i));
        }));
    b.raw_bytes = std::min(raw_total, (first + count) * frame_bytes) -
                  first * frame_bytes;
    b.stored_bytes = 0;
    for (uint64_t n : sizes) b.stored_bytes += n;
    return absl::OkStatus();
  };

  for (const auto& entry : layout.entries) {
    Entry& e = *entry;
    const WriteItem& item = *e.item;
    const uint64_t raw_total = item.nbytes;
    e.blocks_left = 1;
    StartDigests(e, frame_bytes);
    CAIRN_ASSIGN_OR_RETURN(const ResolvedData* data, Acquire(e, planner));
    const uint64_t frames =
        internal_format::FrameCount(raw_total, frame_bytes);
    bool compressed = item.kind == ItemKind::kTensor &&
                      raw_total >= kMinCompressedBytes;
    int cur = in_flight == 0 ? 1 : 0;  // never the batch being written
    uint64_t done = 0;  // frames compressed so far
    if (compressed) {
      CAIRN_RETURN_IF_ERROR(compress(e, *data, 0,
                                     std::min(frames, batch_frames),
                                     batches[cur]));
      compressed = static_cast<double>(batches[cur].stored_bytes) <=
                   kMaxStoredShare * static_cast<double>(batches[cur].raw_bytes);
    }
    CAIRN_RETURN_IF_ERROR(align_entry(raw_total));
    const uint64_t begin = pos;
    e.crc32c = 0;
    e.block_crc32c.clear();
    e.compression = Compression{};
    if (compressed) {
      e.compression.codec = options.codec;
      e.block_crc32c.reserve(frames);
      while (true) {
        Batch& b = batches[cur];
        const uint64_t count = b.stored.size();
        for (uint64_t i = 0; i < count; ++i) {
          const uint64_t raw = std::min(frame_bytes,
                                        raw_total - (done + i) * frame_bytes);
          e.crc32c = done + i == 0 ? b.raw_crc[i]
                                   : internal_format::Crc32cCombine(
                                         e.crc32c, b.raw_crc[i], raw);
          e.block_crc32c.push_back(b.raw_crc[i]);
          if (!b.raw_digest.empty()) e.block_digest[done + i] = b.raw_digest[i];
          e.compression.frame_nbytes.push_back(
              static_cast<uint32_t>(b.stored[i].size()));
          e.compression.frame_crc32c.push_back(internal_format::Crc32c(
              b.stored[i].data(), b.stored[i].size()));
        }
        done += count;
        pos += b.stored_bytes;
        // Hand the batch to the writer (after the last one is written)
        // and compress the next meanwhile.
        CAIRN_RETURN_IF_ERROR(wait_writer());
        auto append = [&out, &b]() -> absl::Status {
          for (const std::vector<std::byte>& f : b.stored) {
            CAIRN_RETURN_IF_ERROR(out.Append(f.data(), f.size()));
          }
          return absl::OkStatus();
        };
        try {
          writing = std::async(std::launch::async, append);
          in_flight = cur;
        } catch (const std::system_error&) {
          CAIRN_RETURN_IF_ERROR(append());  // no thread: write it here
        }
        if (done == frames) break;
        cur ^= 1;
        CAIRN_RETURN_IF_ERROR(compress(
            e, *data, done, std::min(frames - done, batch_frames),
            batches[cur]));
      }
      e.compression.stored_nbytes = pos - begin;
      if (frames == 1) e.block_crc32c.clear();  // crc32c is the block's
      e.st.dtype = DType::kU8;
      e.st.shape = Shape{static_cast<int64_t>(pos - begin)};
    } else {
      // Raw, as WriteDataFile writes it: checksummed whole and per block
      // as it is appended.
      CAIRN_RETURN_IF_ERROR(wait_writer());
      std::vector<std::byte> piece(std::min<uint64_t>(raw_total, frame_bytes));
      for (uint64_t lo = 0; lo < raw_total; lo += frame_bytes) {
        const uint64_t hi = std::min(raw_total, lo + frame_bytes);
        if (item.kind == ItemKind::kObject) {
          std::memcpy(piece.data(), data->bytes.data() + lo, hi - lo);
        } else {
          internal_core::CopyRowMajorBytes(data->view, lo, hi, piece.data());
        }
        const uint32_t crc = internal_format::Crc32c(piece.data(), hi - lo);
        if (!e.block_digest.empty()) {
          e.block_digest[lo / frame_bytes] =
              internal_format::BlockDigest(piece.data(), hi - lo);
        }
        e.crc32c = lo == 0 ? crc
                           : internal_format::Crc32cCombine(e.crc32c, crc,
                                                            hi - lo);
        e.block_crc32c.push_back(crc);
        CAIRN_RETURN_IF_ERROR(out.Append(piece.data(), hi - lo));
      }
      if (e.block_crc32c.size() <= 1) e.block_crc32c.clear();
      pos += raw_total;
    }
    Release(e);
    FinishDigests(e);
    e.st.begin = begin;
    e.st.end = pos;
    st.push_back(e.st);
  }
  CAIRN_RETURN_IF_ERROR(wait_writer());
  CAIRN_RETURN_IF_ERROR(out.Finish(align));

  // The header, padded with spaces to fill its room exactly.
  std::string header = internal_format::EncodeSafetensorsHeader(
      st, {{"format", "cairn"}, {"version", std::to_string(kFormatVersion)}},
      data_start);
  if (header.size() != data_start) {
    return absl::InternalError(absl::StrFormat(
        "%s: the header needs %d bytes; %d were reserved", file_name,
        header.size(), data_start));
  }
  CAIRN_ASSIGN_OR_RETURN(internal_core::UniqueAligned head,
                         internal_core::AllocateAlignedUnique(data_start));
  std::memcpy(head.get(), header.data(), header.size());
  CAIRN_RETURN_IF_ERROR(Annotate(
      file->WriteAt(0, std::span<const std::byte>(head.get(), data_start)),
      absl::StrFormat("writing %s's header", file_name)));
  layout.header = std::move(header);
  layout.data_start = data_start;
  layout.file_size = data_start + pos;
  return file->Finish(layout.file_size);
}

}  // namespace cairn::internal_checkpoint
