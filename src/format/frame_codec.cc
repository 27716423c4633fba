#include "format/frame_codec.h"

#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_format.h"

namespace cairn::internal_format {
namespace {

// Plane p of n / es elements, for one element size known at compile time
// (the loops then vectorise).
template <size_t kSize>
void Group(const std::byte* src, size_t count, std::byte* dst) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t p = 0; p < kSize; ++p) dst[p * count + i] = src[i * kSize + p];
  }
}

template <size_t kSize>
void Ungroup(const std::byte* src, size_t count, std::byte* dst) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t p = 0; p < kSize; ++p) dst[i * kSize + p] = src[p * count + i];
  }
}

}  // namespace

std::string_view CodecName(Codec codec) {
  switch (codec) {
    case Codec::kNone:
      return "none";
    case Codec::kZstd:
      return "zstd";
    case Codec::kGroupedZstd:
      return "grouped-zstd";
  }
  return "unknown";
}

absl::StatusOr<Codec> CodecFromName(std::string_view name) {
  for (Codec c : {Codec::kNone, Codec::kZstd, Codec::kGroupedZstd}) {
    if (CodecName(c) == name) return c;
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "unknown codec \"%s\"; known: none, zstd, grouped-zstd",
      std::string(name)));
}

absl::Status CheckCodecLevel(int level) {
  if (level < ZSTD_minCLevel() || level > ZSTD_maxCLevel()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "codec level %d is outside zstd's levels [%d, %d]", level,
        ZSTD_minCLevel(), ZSTD_maxCLevel()));
  }
  return absl::OkStatus();
}

size_t MaxFrameBytes(size_t raw_bytes) { return ZSTD_compressBound(raw_bytes); }

uint64_t FrameCount(uint64_t nbytes, uint64_t block_bytes) {
  if (block_bytes == 0) return 0;
  return nbytes / block_bytes + (nbytes % block_bytes != 0 ? 1 : 0);
}

absl::Status CheckCompression(const ByteLocation& loc, uint64_t block_bytes) {
  const Compression& c = loc.compression;
  if (c.codec != Codec::kZstd && c.codec != Codec::kGroupedZstd) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "codec \"%s\" has no frames", CodecName(c.codec)));
  }
  if (loc.nbytes == 0 || block_bytes == 0) {
    return absl::InvalidArgumentError(
        "a compressed chunk must have raw bytes and a checksum block size");
  }
  const uint64_t frames = FrameCount(loc.nbytes, block_bytes);
  if (c.frame_nbytes.size() != frames || c.frame_crc32c.size() != frames) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%d raw bytes in frames of %d are %d frames; \"frame_nbytes\" has "
        "%d and \"frame_crc32c\" %d",
        loc.nbytes, block_bytes, frames, c.frame_nbytes.size(),
        c.frame_crc32c.size()));
  }
  if (frames > 1 && loc.block_crc32c.size() != frames) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "a compressed chunk of %d frames needs a \"crc32c_blocks\" checksum "
        "for each",
        frames));
  }
  uint64_t sum = 0;
  for (uint64_t f = 0; f < frames; ++f) {
    const uint64_t raw = std::min(block_bytes, loc.nbytes - f * block_bytes);
    const uint64_t n = c.frame_nbytes[f];
    if (n == 0 || n > MaxFrameBytes(raw)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "frame %d has %d stored bytes; a frame of %d raw bytes takes 1 to "
          "%d",
          f, n, raw, MaxFrameBytes(raw)));
    }
    sum += n;
  }
  uint64_t end = 0;
  if (sum != c.stored_nbytes ||
      __builtin_add_overflow(loc.offset, c.stored_nbytes, &end)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "\"stored_nbytes\" %d is not the frames' sum %d, or overflows at "
        "offset %d",
        c.stored_nbytes, sum, loc.offset));
  }
  return absl::OkStatus();
}

void GroupBytes(const std::byte* src, size_t n, size_t elem_size,
                std::byte* dst) {
  const size_t count = elem_size == 0 ? 0 : n / elem_size;
  switch (elem_size) {
    case 2:
      return Group<2>(src, count, dst);
    case 4:
      return Group<4>(src, count, dst);
    case 8:
      return Group<8>(src, count, dst);
    default:
      for (size_t i = 0; i < count; ++i) {
        for (size_t p = 0; p < elem_size; ++p) {
          dst[p * count + i] = src[i * elem_size + p];
        }
      }
  }
}

void UngroupBytes(const std::byte* src, size_t n, size_t elem_size,
                  std::byte* dst) {
  const size_t count = elem_size == 0 ? 0 : n / elem_size;
  switch (elem_size) {
    case 2:
      return Ungroup<2>(src, count, dst);
    case 4:
      return Ungroup<4>(src, count, dst);
    case 8:
      return Ungroup<8>(src, count, dst);
    default:
      for (size_t i = 0; i < count; ++i) {
        for (size_t p = 0; p < elem_size; ++p) {
          dst[i * elem_size + p] = src[p * count + i];
        }
      }
  }
}

FrameCompressor::FrameCompressor(Codec codec, int level)
    : codec_(codec), level_(level), ctx_(ZSTD_createCCtx()) {}

FrameCompressor::~FrameCompressor() { ZSTD_freeCCtx(ctx_); }

absl::StatusOr<size_t> FrameCompressor::Compress(
    std::span<const std::byte> raw, size_t elem_size,
    std::span<std::byte> out) {
  if (ctx_ == nullptr) return absl::ResourceExhaustedError("ZSTD_createCCtx");
  const std::byte* src = raw.data();
  if (codec_ == Codec::kGroupedZstd && elem_size > 1) {
    if (raw.size() % elem_size != 0) {
      return absl::InternalError(absl::StrFormat(
          "a frame of %d bytes is not whole elements of %d bytes", raw.size(),
          elem_size));
    }
    grouped_.resize(raw.size());
    GroupBytes(raw.data(), raw.size(), elem_size, grouped_.data());
    src = grouped_.data();
  }
  const size_t n =
      ZSTD_compressCCtx(ctx_, out.data(), out.size(), src, raw.size(), level_);
  if (ZSTD_isError(n)) {
    return absl::InternalError(absl::StrFormat(
        "zstd failed to compress a frame of %d bytes: %s", raw.size(),
        ZSTD_getErrorName(n)));
  }
  return n;
}

FrameDecompressor::FrameDecompressor() : ctx_(ZSTD_createDCtx()) {}

FrameDecompressor::~FrameDecompressor() { ZSTD_freeDCtx(ctx_); }

absl::Status FrameDecompressor::Decompress(Codec codec, size_t elem_size,
                                           std::span<const std::byte> stored,
                                           std::span<std::byte> raw) {
  if (ctx_ == nullptr) return absl::ResourceExhaustedError("ZSTD_createDCtx");
  if (codec != Codec::kZstd && codec != Codec::kGroupedZstd) {
    return absl::InternalError(absl::StrFormat(
        "no frames to decompress for codec %s", CodecName(codec)));
  }
  // Exactly one frame, declaring exactly the raw size: a frame that would
  // decompress to more (or less) is damage, never a larger allocation.
  const size_t frame = ZSTD_findFrameCompressedSize(stored.data(), stored.size());
  if (ZSTD_isError(frame) || frame != stored.size()) {
    return absl::DataLossError(absl::StrFormat(
        "%d stored bytes are not one zstd frame (%s)", stored.size(),
        ZSTD_isError(frame) ? ZSTD_getErrorName(frame) : "bytes after it"));
  }
  const unsigned long long declared =
      ZSTD_getFrameContentSize(stored.data(), stored.size());
  if (declared != raw.size()) {
    return absl::DataLossError(absl::StrFormat(
        "the zstd frame declares %s raw bytes, %d expected",
        declared == ZSTD_CONTENTSIZE_UNKNOWN ? std::string("unknown")
        : declared == ZSTD_CONTENTSIZE_ERROR ? std::string("invalid")
                                             : std::to_string(declared),
        raw.size()));
  }
  const bool grouped = codec == Codec::kGroupedZstd && elem_size > 1;
  if (grouped) grouped_.resize(raw.size());
  std::byte* dst = grouped ? grouped_.data() : raw.data();
  const size_t n = ZSTD_decompressDCtx(ctx_, dst, raw.size(), stored.data(),
                                       stored.size());
  if (ZSTD_isError(n) || n != raw.size()) {
    return absl::DataLossError(absl::StrFormat(
        "zstd could not decompress the frame: %s",
        ZSTD_isError(n) ? ZSTD_getErrorName(n)
                        : absl::StrFormat("%d bytes, %d expected", n,
                                          raw.size())));
  }
  if (grouped) UngroupBytes(grouped_.data(), raw.size(), elem_size, raw.data());
  return absl::OkStatus();
}

}  // namespace cairn::internal_format
