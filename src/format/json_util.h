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
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
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

// Builds nlohmann's tree from its SAX events, as nlohmann::json::parse does,
// but stops at the first object that has a key twice: parse keeps the last
// value ({"step":1,"step":2} reads as 2, where another reader may read 1),
// so such text must be refused. (parse's callback could see the keys, but
// its parser rescans an array's elements at the end of each one, so a
// chunks array of 16k objects costs 16k^2.)
class CheckedTreeBuilder {
 public:
  using json = nlohmann::json;
  explicit CheckedTreeBuilder(json& root) : root_(root) {}

  bool null() { return Add(nullptr) != nullptr; }
  bool boolean(bool v) { return Add(v) != nullptr; }
  bool number_integer(json::number_integer_t v) { return Add(v) != nullptr; }
  bool number_unsigned(json::number_unsigned_t v) { return Add(v) != nullptr; }
  bool number_float(json::number_float_t v, const json::string_t&) {
    return Add(v) != nullptr;
  }
  bool string(json::string_t& v) { return Add(std::move(v)) != nullptr; }
  bool binary(json::binary_t& v) {
    return Add(json::binary(std::move(v))) != nullptr;
  }
  bool start_object(std::size_t) { return Open(json::object()); }
  bool start_array(std::size_t) { return Open(json::array()); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }
  bool key(json::string_t& key) {
    Level& level = open_.back();
    if (level.value->contains(key)) {
      duplicate_ = key;
      for (size_t i = 0; i + 1 < open_.size(); ++i) {
        path_ += "/";
        path_ += open_[i].value->is_object()
                     ? open_[i].key
                     : std::to_string(open_[i].value->size() - 1);
      }
      found_ = true;
      return false;  // stops the parse
    }
    level.key = std::move(key);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const json::exception&) {
    return false;
  }

  bool found() const { return found_; }
  // The first key found twice, and where its object is: the keys and array
  // indices leading to it ("/tensors/w/chunks/0"; "" for the root).
  const std::string& duplicate() const { return duplicate_; }
  const std::string& path() const { return path_; }

 private:
  struct Level {
    json* value;      // an open object or array
    std::string key;  // an object's current member
  };
  // Places `v` in the open object or array (or as the root); where it is.
  json* Add(json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Level& level = open_.back();
    if (level.value->is_object()) {
      json& slot = (*level.value)[level.key];
      slot = std::move(v);
      return &slot;
    }
    level.value->push_back(std::move(v));
    return &level.value->back();
  }
  // An open container's address holds while it is open: only its own
  // elements are added meanwhile.
  bool Open(json v) {
    json* placed = Add(std::move(v));
    open_.push_back(Level{placed, std::string()});
    return true;
  }
  bool Close() {
    open_.pop_back();
    return true;
  }

  json& root_;
  std::vector<Level> open_;
  bool found_ = false;
  std::string duplicate_;
  std::string path_;
};

// Parses without exceptions; nullopt for malformed text (including invalid
// UTF-8 in strings), text nested deeper than kMaxJsonDepth, or an object
// with a key twice, at any level. With `error`, says which (in words that
// follow "malformed JSON: ").
inline std::optional<nlohmann::json> Parse(std::string_view text,
                                           std::string* error = nullptr) {
  auto fail = [&](std::string why) -> std::optional<nlohmann::json> {
    if (error != nullptr) *error = std::move(why);
    return std::nullopt;
  };
  if (NestingDepth(text, kMaxJsonDepth) > kMaxJsonDepth) {
    return fail("nested deeper than " + std::to_string(kMaxJsonDepth) +
                " levels");
  }
  try {
    nlohmann::json value;
    CheckedTreeBuilder builder(value);
    if (nlohmann::json::sax_parse(text, &builder)) return value;
    if (!builder.found()) return fail("not well-formed UTF-8 JSON");
    const auto shown = [](std::string_view s) {
      return "\"" + std::string(absl::CHexEscape(AsAbsl(s.substr(0, 256)))) +
             "\"";
    };
    return fail("the key " + shown(builder.duplicate()) +
                " appears twice in one object (" +
                (builder.path().empty() ? std::string("the top level")
                                        : "at " + shown(builder.path())) +
                ")");
  } catch (...) {  // only std::bad_alloc is expected here
    return fail("out of memory");
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
