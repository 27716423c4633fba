#include "core/byte_codec.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace cairn::internal_core {
namespace {

enum ScalarTag : uint8_t { kInt = 0, kDouble = 1, kBool = 2, kString = 3 };

}  // namespace

void AppendTrailer(std::string& message, std::string_view trailer) {
  ByteWriter w;
  w.Raw(trailer);
  w.U64(trailer.size());
  message += w.Take();
}

absl::StatusOr<std::string> TakeTrailer(std::string& message,
                                        std::string_view what,
                                        std::string_view part) {
  if (message.size() < 8) {
    return absl::DataLossError(
        absl::StrFormat("%s: the message has no %s", what, part));
  }
  ByteReader r(std::string_view(message).substr(message.size() - 8), "");
  const uint64_t n = r.U64();
  if (n > message.size() - 8) {
    return absl::DataLossError(
        absl::StrFormat("%s: its %s is longer than the message", what, part));
  }
  const size_t at = message.size() - 8 - n;
  std::string trailer = message.substr(at, n);
  message.resize(at);
  return trailer;
}

void ByteWriter::U32(uint32_t v) {
  for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>(v >> (8 * i)));
}

void ByteWriter::U64(uint64_t v) {
  char bytes[8];
  StoreLittleU64(v, bytes);
  out_.append(bytes, 8);
}

void ByteWriter::Str(std::string_view s) {
  U64(s.size());
  out_.append(s);
}

void ByteWriter::Ints(const std::vector<int64_t>& v) {
  U64(v.size());
  for (int64_t x : v) I64(x);
}

void ByteWriter::Scalar(const cairn::Scalar& s) {
  if (const int64_t* i = std::get_if<int64_t>(&s)) {
    U8(kInt);
    I64(*i);
  } else if (const double* d = std::get_if<double>(&s)) {
    U8(kDouble);
    uint64_t bits;
    std::memcpy(&bits, d, sizeof bits);
    U64(bits);
  } else if (const bool* b = std::get_if<bool>(&s)) {
    U8(kBool);
    U8(*b ? 1 : 0);
  } else {
    U8(kString);
    Str(std::get<std::string>(s));
  }
}

bool ByteReader::Need(uint64_t n) {
  if (!error_.empty()) return false;
  if (n > data_.size() - pos_) {
    error_ = absl::StrCat("truncated at byte ", pos_, " (needs ", n,
                          " more bytes, ", data_.size() - pos_, " left)");
    return false;
  }
  return true;
}

void ByteReader::Fail(std::string_view why) {
  if (error_.empty()) {
    error_ = absl::StrCat(std::string(why), " at byte ", pos_);
  }
}

uint8_t ByteReader::U8() {
  if (!Need(1)) return 0;
  return static_cast<uint8_t>(data_[pos_++]);
}

uint32_t ByteReader::U32() {
  if (!Need(4)) return 0;
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= static_cast<uint32_t>(static_cast<uint8_t>(data_[pos_++])) << (8 * i);
  }
  return v;
}

uint64_t ByteReader::U64() {
  if (!Need(8)) return 0;
  const uint64_t v = LoadLittleU64(data_.data() + pos_);
  pos_ += 8;
  return v;
}

uint64_t ByteReader::Count(uint64_t min_bytes) {
  const uint64_t n = U64();
  if (!error_.empty()) return 0;
  if (min_bytes > 0 && n > (data_.size() - pos_) / min_bytes) {
    Fail(absl::StrCat("count ", n, " exceeds the buffer"));
    return 0;
  }
  return n;
}

std::string ByteReader::Str() { return std::string(StrView()); }

std::string_view ByteReader::StrView() {
  const uint64_t n = Count(1);
  if (!Need(n)) return {};
  const std::string_view s = data_.substr(pos_, n);
  pos_ += n;
  return s;
}

uint64_t ByteReader::SkipInts() {
  const uint64_t n = Count(8);
  if (!Need(8 * n)) return 0;
  pos_ += 8 * n;
  return n;
}

std::string_view ByteReader::Rest() {
  const std::string_view rest = error_.empty() ? data_.substr(pos_) : std::string_view();
  pos_ = data_.size();
  return rest;
}

std::vector<int64_t> ByteReader::Ints() {
  const uint64_t n = Count(8);
  std::vector<int64_t> v;
  v.reserve(n);
  for (uint64_t i = 0; i < n && error_.empty(); ++i) v.push_back(I64());
  return v;
}

cairn::Scalar ByteReader::Scalar() {
  switch (U8()) {
    case kInt:
      return I64();
    case kDouble: {
      const uint64_t bits = U64();
      double d;
      std::memcpy(&d, &bits, sizeof d);
      return d;
    }
    case kBool:
      return U8() != 0;
    case kString:
      return Str();
    default:
      Fail("unknown scalar type");
      return int64_t{0};
  }
}

absl::Status ByteReader::status() const {
  if (!error_.empty()) {
    return absl::DataLossError(absl::StrCat(what_, ": ", error_));
  }
  if (pos_ != data_.size()) {
    return absl::DataLossError(absl::StrCat(what_, ": ", data_.size() - pos_,
                                            " unexpected trailing bytes"));
  }
  return absl::OkStatus();
}

bool SameScalar(const cairn::Scalar& a, const cairn::Scalar& b) {
  ByteWriter wa, wb;
  wa.Scalar(a);
  wb.Scalar(b);
  return wa.data() == wb.data();
}

}  // namespace cairn::internal_core
