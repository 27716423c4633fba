// Fixed-width little-endian integers, length-prefixed strings and scalars:
// the wire format of what ranks send each other (plans, statuses, reports).
// Messages come from other ranks of the same job but are still decoded with
// bounds checks on every field, so a damaged or mismatched message is an
// error, never a read outside the buffer.
#ifndef CAIRN_CORE_BYTE_CODEC_H_
#define CAIRN_CORE_BYTE_CODEC_H_

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/state_dict.h"

namespace cairn::internal_core {

// The 8 bytes at `p` as a little-endian integer, and `v` into 8 bytes at
// `out`: one load or store where the machine is little-endian (GCC 12 does
// not merge the byte loop, and the save coordinator reads 8M items' fields
// this way at 16k ranks).
inline uint64_t LoadLittleU64(const char* p) {
  uint64_t v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, 8);
  } else {
    for (int i = 0; i < 8; ++i) {
      v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
    }
  }
  return v;
}
inline void StoreLittleU64(uint64_t v, char* out) {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(out, &v, 8);
  } else {
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(v >> (8 * i));
  }
}

class ByteWriter {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v);
  void U64(uint64_t v);
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void Str(std::string_view s);
  void Raw(std::string_view s) { out_.append(s); }  // no length prefix
  void Ints(const std::vector<int64_t>& v);
  void Scalar(const cairn::Scalar& s);
  void Reserve(size_t bytes) { out_.reserve(bytes); }
  std::string Take() { return std::move(out_); }
  const std::string& data() const { return out_; }

 private:
  std::string out_;
};

// Every accessor fails (kDataLoss naming `what`) past the end of the buffer
// and leaves the reader failed (returning zeros); check status() once at the
// end.
class ByteReader {
 public:
  ByteReader(std::string_view data, std::string what)
      : data_(data), what_(std::move(what)) {}
  uint8_t U8();
  uint32_t U32();
  uint64_t U64();
  int64_t I64() { return static_cast<int64_t>(U64()); }
  std::string Str();
  std::vector<int64_t> Ints();
  cairn::Scalar Scalar();
  // The bytes not read yet, all of them (a message's trailing payload).
  std::string_view Rest();
  // A count of following elements, each at least `min_bytes` long: fails
  // when the rest of the buffer cannot hold that many.
  uint64_t Count(uint64_t min_bytes);
  // Str and Ints without the copy, for decoders that keep views into the
  // buffer (the save coordinator's columnar plans): the string's bytes, and
  // the list's element count (its elements are skipped). Same checks.
  std::string_view StrView();
  uint64_t SkipInts();
  // Bytes read so far (the offset of the next field).
  size_t position() const { return pos_; }
  bool failed() const { return !error_.empty(); }
  bool done() const { return pos_ == data_.size(); }
  absl::Status status() const;  // also fails when bytes are left over

  void Fail(std::string_view why);

 private:
  bool Need(uint64_t n);
  std::string_view data_;
  std::string what_;
  size_t pos_ = 0;
  std::string error_;
};

// `message` with `trailer` appended behind it (its bytes, then their count),
// and the reverse: the trailer cut off the end of `message`, which keeps
// the rest in place (kDataLoss naming `what` and the trailer's `part` when
// it is not there). A phase's gather carries a second payload this way.
void AppendTrailer(std::string& message, std::string_view trailer);
absl::StatusOr<std::string> TakeTrailer(std::string& message,
                                        std::string_view what,
                                        std::string_view part);

// True when `a` and `b` encode to the same bytes: same type and value bit
// for bit (a NaN equals the same NaN, 0.0 differs from -0.0).
bool SameScalar(const cairn::Scalar& a, const cairn::Scalar& b);

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_BYTE_CODEC_H_
