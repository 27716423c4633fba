// Helpers for reading untrusted JSON with nlohmann::json without exceptions
// and without recursion deep enough to overflow the stack. Internal to
// src/format. Pure functions; safe from any thread.
#ifndef CAIRN_FORMAT_JSON_UTIL_H_
#define CAIRN_FORMAT_JSON_UTIL_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include "absl/strings/string_view.h"
#include "core/checked.h"
#include "nlohmann/json.hpp"

namespace cairn::internal_format {

// Debian 12's Abseil is built with its own absl::string_view class, not an
// alias of std::string_view, and the two do not convert implicitly.
using internal_core::AsAbsl;
using internal_core::AsStd;

namespace json_util {

// nlohmann parses iteratively, but copying and dumping a value recurse once
// per nesting level, so untrusted text deeper than this is refused before
// parsing.
inline constexpr int kMaxJsonDepth = 256;

// Largest bracket nesting of `text`, skipping string contents; stops early
// (returning a value > limit) once `limit` is exceeded. Malformed text is
// left to the parser.
inline int NestingDepth(std::string_view text, int limit) {
  int depth = 0;
  int max_depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        max_depth = depth;
        if (max_depth > limit) return max_depth;
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return max_depth;
}

// Parses without exceptions; nullopt for malformed text (including invalid
// UTF-8 in strings) or text nested deeper than kMaxJsonDepth.
inline std::optional<nlohmann::json> Parse(std::string_view text) {
  if (NestingDepth(text, kMaxJsonDepth) > kMaxJsonDepth) return std::nullopt;
  try {
    nlohmann::json value = nlohmann::json::parse(text, nullptr, false);
    if (value.is_discarded()) return std::nullopt;
    return value;
  } catch (...) {  // only std::bad_alloc is expected here
    return std::nullopt;
  }
}

// The member `key` of `object`, or nullptr when `object` is not an object or
// has no such member.
inline const nlohmann::json* Find(const nlohmann::json& object,
                                  std::string_view key) {
  if (!object.is_object()) return nullptr;
  auto it = object.find(key);
  return it == object.end() ? nullptr : &*it;
}

// A JSON integer in [0, max]; nullopt for anything else (negative numbers,
// floats, numbers too large for uint64, which nlohmann stores as floats).
inline std::optional<uint64_t> GetUint(
    const nlohmann::json& value,
    uint64_t max = std::numeric_limits<uint64_t>::max()) {
  if (!value.is_number_unsigned()) return std::nullopt;
  const uint64_t v = value.get<uint64_t>();
  if (v > max) return std::nullopt;
  return v;
}

// A JSON integer representable as int64.
inline std::optional<int64_t> GetInt64(const nlohmann::json& value) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return std::nullopt;
    }
    return static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  return std::nullopt;
}

// Text of `value` for error messages, shortened.
inline std::string Describe(const nlohmann::json& value) {
  std::string type = value.type_name();
  if (value.is_primitive()) {
    try {
      std::string text =
          value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      if (text.size() > 64) text = text.substr(0, 61) + "...";
      return type + " " + text;
    } catch (...) {
    }
  }
  return type;
}

}  // namespace json_util
}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_JSON_UTIL_H_
