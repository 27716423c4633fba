// A cursor over JSON text for the plain forms cairn writes, read without
// building nlohmann's tree (which costs a heap node per value). Every
// method takes a subset of JSON and returns false on anything else, where
// the caller gives up and lets nlohmann decide: strings of printable ASCII
// without escapes (as views of the text), non-negative integers without a
// leading zero, fraction or exponent, and any JSON whitespace between
// tokens. Internal to src/format (metadata.json's and the safetensors
// header's fast parses).
#ifndef CAIRN_FORMAT_PLAIN_JSON_H_
#define CAIRN_FORMAT_PLAIN_JSON_H_

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/checked.h"

namespace cairn::internal_format {

class PlainJsonCursor {
 public:
  explicit PlainJsonCursor(std::string_view text)
      : p_(text.data()), end_(text.data() + text.size()) {}

  void SkipSpace() {
    while (p_ < end_ &&
           (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) {
      ++p_;
    }
  }
  // Skips whitespace, then consumes `c`.
  bool Take(char c) {
    SkipSpace();
    if (p_ == end_ || *p_ != c) return false;
    ++p_;
    return true;
  }
  // Whitespace, then the end of the text.
  bool AtEnd() {
    SkipSpace();
    return p_ == end_;
  }
  // A string of printable ASCII without escapes, as a view of the text.
  bool String(std::string_view* out) {
    if (!Take('"')) return false;
    const char* start = p_;
    while (p_ < end_ && *p_ != '"') {
      const unsigned char u = static_cast<unsigned char>(*p_);
      if (u < 0x20 || u >= 0x80 || *p_ == '\\') return false;
      ++p_;
    }
    if (p_ == end_) return false;
    *out = std::string_view(start, p_ - start);
    ++p_;
    return true;
  }
  // A plain non-negative integer that fits uint64 and is not followed by a
  // fraction or exponent (nlohmann makes anything else a float or an
  // error).
  bool Uint(uint64_t* out) {
    SkipSpace();
    const char* start = p_;
    uint64_t v = 0;
    while (p_ < end_ && *p_ >= '0' && *p_ <= '9') {
      if (__builtin_mul_overflow(v, 10, &v) ||
          __builtin_add_overflow(v, static_cast<uint64_t>(*p_ - '0'), &v)) {
        return false;
      }
      ++p_;
    }
    if (p_ == start || (*start == '0' && p_ - start > 1)) return false;
    if (p_ < end_ && (*p_ == '.' || *p_ == 'e' || *p_ == 'E')) return false;
    *out = v;
    return true;
  }
  // An array of at most kMaxDims integers in [0, 2^63), appended to `out`:
  // collected first and appended in one step, so they cost one allocation,
  // not one per growth of the vector. More dimensions than that are left
  // to nlohmann, like any other form this cursor does not take.
  static constexpr size_t kMaxDims = 8;
  bool Dims(std::vector<int64_t>* out) {
    if (!Take('[')) return false;
    if (Take(']')) return true;
    int64_t dims[kMaxDims];
    size_t n = 0;
    do {
      uint64_t v;
      if (n == kMaxDims || !Uint(&v) || v > internal_core::kInt64Max) {
        return false;
      }
      dims[n++] = static_cast<int64_t>(v);
    } while (Take(','));
    if (!Take(']')) return false;
    out->insert(out->end(), dims, dims + n);
    return true;
  }
  // Members of an object: calls member(key) for each, which parses the
  // value. False when `member` does, or on malformed text.
  template <typename Fn>
  bool Members(Fn&& member) {
    if (!Take('{')) return false;
    if (Take('}')) return true;
    do {
      std::string_view key;
      if (!String(&key) || !Take(':') || !member(key)) return false;
    } while (Take(','));
    return Take('}');
  }

 protected:
  const char* p_;
  const char* end_;
};

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_PLAIN_JSON_H_
