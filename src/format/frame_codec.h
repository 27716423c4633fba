// Compressed chunks' frames (format version 5, docs/format.md 4.2.1): the
// codecs' names, and compressing and decompressing one frame. A frame is
// one zstd frame of the raw bytes, regrouped first for kGroupedZstd (all
// elements' byte 0, then all byte 1, ...: the planes of a float's sign and
// exponent bytes compress much better alone than mixed with mantissas).
#ifndef CAIRN_FORMAT_FRAME_CODEC_H_
#define CAIRN_FORMAT_FRAME_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/metadata.h"
#include "core/scratch_bytes.h"

struct ZSTD_CCtx_s;
struct ZSTD_DCtx_s;

namespace cairn::internal_format {

// "none", "zstd", "grouped-zstd".
std::string_view CodecName(Codec codec);
// The codec of that name; kInvalidArgument listing the names otherwise.
absl::StatusOr<Codec> CodecFromName(std::string_view name);

// kInvalidArgument unless zstd accepts `level` (its minimum, a negative
// "fast" level, to its maximum, 22).
absl::Status CheckCodecLevel(int level);

// The format version that introduced compressed chunks.
inline constexpr int kCompressionFormatVersion = 5;

// Whether kGroupedZstd regroups elements of `elem_size` bytes: those of 2,
// 4 and 8 bytes, which every frame holds whole (frames are a power of two
// of at least 4096 bytes). One-byte elements and the 3-byte F6 quads (whose
// bytes split values) are compressed as they are.
bool Regrouped(size_t elem_size);

// The number of frames of a compressed location of `nbytes` raw bytes
// (one per checksum block of `block_bytes`).
uint64_t FrameCount(uint64_t nbytes, uint64_t block_bytes);

// OK when a decoded location's compression is consistent (docs/format.md
// 4.2.1): a known codec, nbytes > 0, one frame size and CRC32C per block
// of `block_bytes`, each frame at least 1 and at most MaxFrameBytes of its
// raw size, their sum stored_nbytes, offset + stored_nbytes in range, and
// a block CRC32C per frame when there are several. kInvalidArgument
// saying what is wrong (the caller names the chunk).
absl::Status CheckCompression(const ByteLocation& loc, uint64_t block_bytes);

// The most stored bytes a frame of `raw_bytes` can take, and the fewest
// (zstd's format: a 4-byte magic number, at least 2 bytes of frame header
// with the content size, and a block of at least 4 bytes per 128 KiB of
// content), which bounds how far a hostile metadata.json can make a
// reader expand a chunk's stored bytes.
size_t MaxFrameBytes(size_t raw_bytes);
size_t MinFrameBytes(size_t raw_bytes);

// Moves byte p of each `elem_size`-byte element of `src` (n bytes, a
// multiple of elem_size) to plane p of `dst`: dst[p * (n / elem_size) + i]
// = src[i * elem_size + p]. UngroupBytes undoes it. One pass each, with
// SSE2 for 2- and 4-byte elements.
void GroupBytes(const std::byte* src, size_t n, size_t elem_size,
                std::byte* dst);
void UngroupBytes(const std::byte* src, size_t n, size_t elem_size,
                  std::byte* dst);

// Compresses frames; one per thread (it keeps zstd's context and its
// scratch buffers between frames).
class FrameCompressor {
 public:
  FrameCompressor(Codec codec, int level);
  ~FrameCompressor();
  FrameCompressor(const FrameCompressor&) = delete;
  FrameCompressor& operator=(const FrameCompressor&) = delete;

  // Compresses `raw`, whole elements of `elem_size` bytes, into `out` (at
  // least MaxFrameBytes(raw.size()) bytes); returns the stored size.
  // kInternal if zstd fails.
  // A grouped frame holds only literals (each plane Huffman coded in
  // blocks of its own) unless it compresses to under a third of its size
  // that way, when it is also compressed with zstd's matches at `level`
  // and keeps those if they take less than 0.9 of the bytes. Any frame is
  // one standard zstd frame: decompressing is the same for all.
  absl::StatusOr<size_t> Compress(std::span<const std::byte> raw,
                                  size_t elem_size, std::span<std::byte> out);

 private:
  static constexpr size_t kTryMatchesBelow = 3;  // raw / stored
  // zstd's own frame of `src` at level_.
  absl::StatusOr<size_t> Matched(std::span<const std::byte> src,
                                 std::span<std::byte> out);
  // A frame of `grouped`'s literals, no matches.
  absl::StatusOr<size_t> LiteralsOnly(std::span<const std::byte> grouped,
                                      size_t elem_size,
                                      std::span<std::byte> out);

  Codec codec_;
  int level_;
  ZSTD_CCtx_s* ctx_ = nullptr;
  internal_core::ScratchBytes grouped_;
  internal_core::ScratchBytes matched_;  // Matched's frame, while both are tried
};

// Decompresses frames; one per thread.
class FrameDecompressor {
 public:
  FrameDecompressor();
  ~FrameDecompressor();
  FrameDecompressor(const FrameDecompressor&) = delete;
  FrameDecompressor& operator=(const FrameDecompressor&) = delete;

  // Decompresses the frame `stored` into exactly `raw` (its raw size):
  // kDataLoss when `stored` is not one zstd frame of exactly that many
  // bytes (the caller adds which chunk, file and frame).
  absl::Status Decompress(Codec codec, size_t elem_size,
                          std::span<const std::byte> stored,
                          std::span<std::byte> raw);

 private:
  ZSTD_DCtx_s* ctx_ = nullptr;
  internal_core::ScratchBytes grouped_;
};

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_FRAME_CODEC_H_
