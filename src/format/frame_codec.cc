#include "format/frame_codec.h"

// ZSTD_compressSequences and ZSTD_Sequence (zstd's "experimental" API,
// exported by Debian's libzstd 1.5.4): the literal-only frames below.
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_format.h"
#include "core/status.h"

namespace cairn::internal_format {
namespace {

// Plane p of n / es elements, for one element size known at compile time.
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

#if defined(__SSE2__)
// The even bytes of src[0, 2n) to even[0, n), the odd ones to odd[0, n):
// 16 pairs at a time (SSE2), the rest one by one.
void SplitPairs(const std::byte* src, size_t n, std::byte* even,
                std::byte* odd) {
  const __m128i low = _mm_set1_epi16(0x00ff);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i + 16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(even + i),
                     _mm_packus_epi16(_mm_and_si128(a, low), _mm_and_si128(b, low)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(odd + i),
                     _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8)));
  }
  for (; i < n; ++i) {
    even[i] = src[2 * i];
    odd[i] = src[2 * i + 1];
  }
}

// SplitPairs undone: even[i], odd[i] to dst[2i], dst[2i + 1].
void JoinPairs(const std::byte* even, const std::byte* odd, size_t n,
               std::byte* dst) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(even + i));
    const __m128i o = _mm_loadu_si128(reinterpret_cast<const __m128i*>(odd + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i),
                     _mm_unpacklo_epi8(e, o));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i + 16),
                     _mm_unpackhi_epi8(e, o));
  }
  for (; i < n; ++i) {
    dst[2 * i] = even[i];
    dst[2 * i + 1] = odd[i];
  }
}
// The even and odd bytes of the 16 pairs in a, b (SplitPairs' step).
inline void SplitVectors(__m128i a, __m128i b, __m128i& even, __m128i& odd) {
  const __m128i low = _mm_set1_epi16(0x00ff);
  even = _mm_packus_epi16(_mm_and_si128(a, low), _mm_and_si128(b, low));
  odd = _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
}

// Bytes 0-3 of each 4-byte element of src[0, 4n) to planes[0-3][0, n),
// 16 elements at a time in one pass: splitting pairs twice, in registers.
void SplitQuads(const std::byte* src, size_t n, std::byte* const planes[4]) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const auto* in = reinterpret_cast<const __m128i*>(src + 4 * i);
    __m128i e1, o1, e2, o2;  // bytes 0 and 2, 1 and 3, of 8 elements each
    SplitVectors(_mm_loadu_si128(in), _mm_loadu_si128(in + 1), e1, o1);
    SplitVectors(_mm_loadu_si128(in + 2), _mm_loadu_si128(in + 3), e2, o2);
    __m128i p0, p1, p2, p3;
    SplitVectors(e1, e2, p0, p2);
    SplitVectors(o1, o2, p1, p3);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(planes[0] + i), p0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(planes[1] + i), p1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(planes[2] + i), p2);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(planes[3] + i), p3);
  }
  for (; i < n; ++i) {
    for (size_t p = 0; p < 4; ++p) planes[p][i] = src[4 * i + p];
  }
}

// SplitQuads undone, in one pass: planes[p][i] to dst[4i + p].
void JoinQuads(const std::byte* const planes[4], size_t n, std::byte* dst) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i v[4];
    for (int p = 0; p < 4; ++p) {
      v[p] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes[p] + i));
    }
    const __m128i lo01 = _mm_unpacklo_epi8(v[0], v[1]);
    const __m128i hi01 = _mm_unpackhi_epi8(v[0], v[1]);
    const __m128i lo23 = _mm_unpacklo_epi8(v[2], v[3]);
    const __m128i hi23 = _mm_unpackhi_epi8(v[2], v[3]);
    auto* out = reinterpret_cast<__m128i*>(dst + 4 * i);
    _mm_storeu_si128(out, _mm_unpacklo_epi16(lo01, lo23));
    _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(lo01, lo23));
    _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(hi01, hi23));
    _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(hi01, hi23));
  }
  for (; i < n; ++i) {
    for (size_t p = 0; p < 4; ++p) dst[4 * i + p] = planes[p][i];
  }
}
#endif

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

size_t MinFrameBytes(size_t raw_bytes) {
  constexpr size_t kBlock = size_t{128} << 10;
  return 4 + 2 + 4 * ((raw_bytes + kBlock - 1) / kBlock);
}

bool Regrouped(size_t elem_size) {
  return elem_size == 2 || elem_size == 4 || elem_size == 8;
}

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
    if (n < MinFrameBytes(raw) || n > MaxFrameBytes(raw)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "frame %d has %d stored bytes; a zstd frame of %d raw bytes takes "
          "%d to %d",
          f, n, raw, MinFrameBytes(raw), MaxFrameBytes(raw)));
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
#if defined(__SSE2__)
  if (elem_size == 2) return SplitPairs(src, count, dst, dst + count);
  if (elem_size == 4) {
    std::byte* const planes[4] = {dst, dst + count, dst + 2 * count,
                                  dst + 3 * count};
    return SplitQuads(src, count, planes);
  }
#endif
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
#if defined(__SSE2__)
  if (elem_size == 2) return JoinPairs(src, src + count, count, dst);
  if (elem_size == 4) {
    const std::byte* const planes[4] = {src, src + count, src + 2 * count,
                                        src + 3 * count};
    return JoinQuads(planes, count, dst);
  }
#endif
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
  if (codec_ != Codec::kGroupedZstd || !Regrouped(elem_size)) {
    return Matched(raw, out);
  }
  if (raw.size() % elem_size != 0) {
    return absl::InternalError(absl::StrFormat(
        "a frame of %d bytes is not whole elements of %d bytes", raw.size(),
        elem_size));
  }
  std::byte* const grouped_bytes = grouped_.Get(raw.size());
  GroupBytes(raw.data(), raw.size(), elem_size, grouped_bytes);
  const std::span<const std::byte> grouped(grouped_bytes, raw.size());
  // A float's planes are mostly symbols without repeats (mantissas) or
  // with repeats too short to pay (exponents), and zstd decodes short
  // matches slowly: literals alone, Huffman coded per plane, store
  // fine-tuned MiniLM's bf16 weights at 1.49x where zstd's level-1 frames
  // did 1.45x, and warm loads of them went from 0.58x of raw's speed to
  // 0.86x-0.94x (bench/RESULTS.md, 12-02). Frames that compress far
  // better than that (zeros, counters) are where matches pay: those are
  // also compressed with them, keeping the matches if they save a tenth.
  CAIRN_ASSIGN_OR_RETURN(const size_t literal,
                         LiteralsOnly(grouped, elem_size, out));
  if (literal * kTryMatchesBelow > raw.size()) return literal;
  const std::span<std::byte> alt(matched_.Get(out.size()), out.size());
  CAIRN_ASSIGN_OR_RETURN(const size_t matched, Matched(grouped, alt));
  if (matched * 10 >= literal * 9) return literal;
  std::memcpy(out.data(), alt.data(), matched);
  return matched;
}

absl::StatusOr<size_t> FrameCompressor::Matched(
    std::span<const std::byte> src, std::span<std::byte> out) {
  const size_t n = ZSTD_compressCCtx(ctx_, out.data(), out.size(), src.data(),
                                     src.size(), level_);
  if (ZSTD_isError(n)) {
    return absl::InternalError(absl::StrFormat(
        "zstd failed to compress a frame of %d bytes: %s", src.size(),
        ZSTD_getErrorName(n)));
  }
  return n;
}

absl::StatusOr<size_t> FrameCompressor::LiteralsOnly(
    std::span<const std::byte> grouped, size_t elem_size,
    std::span<std::byte> out) {
  // One block per 128 KiB of each plane (zstd's largest), so that no block
  // mixes two planes' symbols under one Huffman table; each ends with a
  // delimiter (offset 0, no match) whose literals are the whole block.
  const size_t plane = grouped.size() / elem_size;
  std::vector<ZSTD_Sequence> sequences;
  for (size_t p = 0; p < elem_size; ++p) {
    for (size_t at = 0; at < plane; at += ZSTD_BLOCKSIZE_MAX) {
      ZSTD_Sequence s{};
      s.litLength = static_cast<unsigned>(
          std::min<size_t>(ZSTD_BLOCKSIZE_MAX, plane - at));
      sequences.push_back(s);
    }
  }
  size_t n = ZSTD_CCtx_reset(ctx_, ZSTD_reset_session_and_parameters);
  if (!ZSTD_isError(n)) {
    n = ZSTD_CCtx_setParameter(ctx_, ZSTD_c_compressionLevel, level_);
  }
  if (!ZSTD_isError(n)) {
    n = ZSTD_CCtx_setParameter(ctx_, ZSTD_c_blockDelimiters,
                               ZSTD_sf_explicitBlockDelimiters);
  }
  // Huffman coding is the point of these frames, also at the negative
  // levels, where zstd would otherwise store literals raw.
  if (!ZSTD_isError(n)) {
    n = ZSTD_CCtx_setParameter(ctx_, ZSTD_c_literalCompressionMode,
                               ZSTD_ps_enable);
  }
  if (!ZSTD_isError(n)) {
    n = ZSTD_compressSequences(ctx_, out.data(), out.size(),
                               sequences.data(), sequences.size(),
                               grouped.data(), grouped.size());
  }
  // No reset after: ZSTD_compressCCtx (Matched) resets every parameter
  // itself, and this function resets them before setting its own.
  if (ZSTD_isError(n)) {
    return absl::InternalError(absl::StrFormat(
        "zstd failed to compress the literals of a frame of %d bytes: %s",
        grouped.size(), ZSTD_getErrorName(n)));
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
  const bool grouped = codec == Codec::kGroupedZstd && Regrouped(elem_size);
  std::byte* dst = grouped ? grouped_.Get(raw.size()) : raw.data();
  const size_t n = ZSTD_decompressDCtx(ctx_, dst, raw.size(), stored.data(),
                                       stored.size());
  if (ZSTD_isError(n) || n != raw.size()) {
    return absl::DataLossError(absl::StrFormat(
        "zstd could not decompress the frame: %s",
        ZSTD_isError(n) ? ZSTD_getErrorName(n)
                        : absl::StrFormat("%d bytes, %d expected", n,
                                          raw.size())));
  }
  if (grouped) {
    UngroupBytes(dst, raw.size(), elem_size, raw.data());
  }
  return absl::OkStatus();
}

}  // namespace cairn::internal_format
