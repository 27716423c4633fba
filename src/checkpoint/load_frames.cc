// Load, step 3 for compressed chunks (format version 5, docs/format.md
// 4.2.1): the Loader's planning of the frames a region needs and the read
// task that checks and decompresses them. A compressed chunk needs no
// check across ranks: each frame read is checked twice, its stored bytes
// before zstd sees them and its raw bytes after, so every byte a rank
// returns of it is checked by that rank, whatever part it reads.
#include <algorithm>
#include <cstring>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "checkpoint/load_internal.h"
#include "core/status.h"
#include "core/strided.h"
#include "format/crc32c.h"
#include "format/frame_codec.h"

namespace cairn::internal_checkpoint {

using internal_core::Annotate;

// Cuts `overlap` (a region of the compressed `chunk`) into slabs of at
// most a bounce buffer of raw bytes (ForEachSlab), one kFrames task each,
// reading the frames that hold the slab's bytes.
absl::Status Loader::PlanFrames(const std::string& what,
                                const TensorMetadata& tm,
                                const ChunkMetadata& chunk, const Box& overlap,
                                std::span<const Target> targets, int file) {
  const ByteLocation& loc = chunk.location;
  // The entry is a U8 one of the stored bytes (CheckLocations).
  needed_.push_back({file, &loc, what, DType::kU8, nullptr});
  const uint64_t frame_bytes = metadata_.crc32c_block_bytes;
  const Compression& z = loc.compression;
  // Where each frame starts in the stored bytes (the decoder checked that
  // there is one per block and that they sum to stored_nbytes).
  std::vector<uint64_t> starts(z.frame_nbytes.size() + 1, 0);
  for (size_t f = 0; f < z.frame_nbytes.size(); ++f) {
    starts[f + 1] = starts[f] + z.frame_nbytes[f];
  }
  const size_t es = DTypeSize(tm.dtype);
  const std::vector<int64_t> cs = RowMajorByteStrides(chunk.box.sizes, es);
  const uint64_t limit =
      std::max<uint64_t>(options_.bounce_buffer_bytes, frame_bytes);
  return ForEachSlab(overlap, cs, es, limit, [&](const Box& slab) {
    uint64_t in_chunk = 0;
    for (int d = 0; d < slab.rank(); ++d) {
      in_chunk += (slab.offsets[d] - chunk.box.offsets[d]) * cs[d];
    }
    const uint64_t span = SpanBytes(slab.sizes, cs, es);
    const uint64_t first = in_chunk / frame_bytes;
    const uint64_t last = (in_chunk + span - 1) / frame_bytes;
    if (span == 0 || last + 1 >= starts.size()) {
      return absl::InternalError(absl::StrFormat(
          "%s: slab %s lies outside the chunk's %d frames", what,
          slab.ToString(), z.frame_nbytes.size()));
    }
    ReadTask task;
    task.mode = ReadTask::Mode::kFrames;
    task.file = file;
    task.file_offset = loc.offset + starts[first];
    task.span = starts[last + 1] - starts[first];
    task.what = what;
    task.elem_size = es;
    task.check_offset = in_chunk;
    task.src_strides = cs;
    task.frames_of = &loc;
    task.first_frame = first;
    task.frame_count = last - first + 1;
    task.frame_bytes = frame_bytes;
    task.raw_bytes = span;
    CAIRN_RETURN_IF_ERROR(AddCopies(task, targets, slab, cs, es, nullptr));
    if (task.copies.size() == 1 && task.copies[0].shape == slab.sizes &&
        internal_core::SubBoxRuns(chunk.box, slab, es).num_runs() == 1 &&
        IsDense(task.copies[0].shape, task.copies[0].dst_strides, es)) {
      // The slab is one run of the chunk, to one dense destination: its
      // whole frames are decompressed straight into it.
      task.dst = task.copies[0].dst;
      task.copies.clear();
    }
    if (!task.copies.empty() || task.dst != nullptr) {
      tasks_.push_back(std::move(task));
    }
    return absl::OkStatus();
  });
}

// Reads the task's frames, checks each frame's stored CRC32C, decompresses
// it and checks its raw CRC32C (the chunk's block checksum, or its CRC32C
// when it is one frame), then makes the copies.
absl::Status Loader::RunFramesTask(const ReadTask& t) {
  const ReadableFile& file = *files_[t.file].file;
  const ByteLocation& loc = *t.frames_of;
  const Compression& z = loc.compression;
  const bool verify = options_.verify_checksums;
  auto where = [&](uint64_t f, uint64_t at) {
    return absl::StrFormat("%s (%s, offset %d), frame %d at offset %d", t.what,
                           loc.file, loc.offset, f, at);
  };
  std::unique_ptr<FrameScratch> scratch = TakeFrameScratch();
  struct GiveBack {
    Loader* loader;
    std::unique_ptr<FrameScratch>& scratch;
    ~GiveBack() { loader->GiveFrameScratch(std::move(scratch)); }
  } give_back{this, scratch};
  // The stored bytes: in place when the storage holds them in memory.
  std::unique_ptr<ReadableFile::View> view =
      file.ViewIfInMemory(t.file_offset, t.span);
  const std::byte* stored = nullptr;
  if (view != nullptr && view->bytes().size() == t.span) {
    stored = view->bytes().data();
  } else {
    std::byte* const buffer = scratch->stored.Get(t.span);
    CAIRN_RETURN_IF_ERROR(Annotate(
        file.ReadAt(t.file_offset, std::span<std::byte>(buffer, t.span)),
        absl::StrFormat("reading %s (%s, offset %d)", t.what, loc.file,
                        t.file_offset)));
    stored = buffer;
  }
  const uint64_t raw_begin = t.first_frame * t.frame_bytes;
  const uint64_t raw_end =
      std::min(loc.nbytes, (t.first_frame + t.frame_count) * t.frame_bytes);
  // The raw bytes go straight into a dense destination; only the frames
  // that stick out of it (or all, for copies) need the scratch buffer.
  const bool whole = t.dst != nullptr && raw_begin == t.check_offset &&
                     raw_end == t.check_offset + t.raw_bytes;
  std::byte* const raw =
      whole ? nullptr : scratch->raw.Get(raw_end - raw_begin);
  internal_format::FrameDecompressor& decompressor = scratch->decompressor;
  uint64_t at = 0;  // in `stored`
  for (uint64_t f = t.first_frame; f < t.first_frame + t.frame_count; ++f) {
    const uint64_t n = z.frame_nbytes[f];
    const uint64_t file_at = t.file_offset + at;
    if (verify) {
      const uint32_t crc = internal_format::Crc32c(stored + at, n);
      if (crc != z.frame_crc32c[f]) {
        return absl::DataLossError(absl::StrFormat(
            "crc32c mismatch in %s (%d stored bytes), before decompressing: "
            "stored %08x, computed %08x",
            where(f, file_at), n, z.frame_crc32c[f], crc));
      }
    }
    const uint64_t lo = f * t.frame_bytes - raw_begin;
    const uint64_t len = std::min(t.frame_bytes, loc.nbytes - f * t.frame_bytes);
    // Into the destination when the frame lies inside the slab and it
    // has one; else into the scratch buffer.
    const uint64_t first_byte = f * t.frame_bytes;
    const bool direct = t.dst != nullptr && first_byte >= t.check_offset &&
                        first_byte + len <= t.check_offset + t.raw_bytes;
    const std::span<std::byte> out(
        direct ? t.dst + (first_byte - t.check_offset) : raw + lo, len);
    CAIRN_RETURN_IF_ERROR(Annotate(
        decompressor.Decompress(z.codec, t.elem_size,
                                std::span<const std::byte>(stored + at, n),
                                out),
        absl::StrFormat("decompressing %s (%s codec)", where(f, file_at),
                        internal_format::CodecName(z.codec))));
    if (verify) {
      const uint32_t want =
          loc.block_crc32c.empty() ? loc.crc32c : loc.block_crc32c[f];
      const uint32_t crc = internal_format::Crc32c(out.data(), out.size());
      if (crc != want) {
        return absl::DataLossError(absl::StrFormat(
            "crc32c mismatch in %s, after decompressing its %d raw bytes: "
            "stored %08x, computed %08x",
            where(f, file_at), len, want, crc));
      }
    }
    if (t.dst != nullptr && !direct) {
      // The part of an edge frame inside the slab.
      const uint64_t b = std::max(first_byte, t.check_offset);
      const uint64_t e = std::min(first_byte + len, t.check_offset + t.raw_bytes);
      if (e > b) {
        std::memcpy(t.dst + (b - t.check_offset), raw + (b - raw_begin), e - b);
      }
    }
    at += n;
  }
  if (t.dst == nullptr) CopyOut(t, raw + (t.check_offset - raw_begin));
  return absl::OkStatus();
}

std::unique_ptr<Loader::FrameScratch> Loader::TakeFrameScratch() {
  std::lock_guard<std::mutex> lock(frame_scratch_mu_);
  if (frame_scratch_.empty()) return std::make_unique<FrameScratch>();
  std::unique_ptr<FrameScratch> s = std::move(frame_scratch_.back());
  frame_scratch_.pop_back();
  return s;
}

void Loader::GiveFrameScratch(std::unique_ptr<FrameScratch> scratch) {
  if (scratch == nullptr) return;
  std::lock_guard<std::mutex> lock(frame_scratch_mu_);
  frame_scratch_.push_back(std::move(scratch));
}

}  // namespace cairn::internal_checkpoint
