#include "format/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <tuple>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/checked.h"
#include "core/status.h"
#include "format/json_util.h"
#include "format/plain_json.h"
#include "nlohmann/json.hpp"

namespace cairn::internal_format {
namespace {

using json_util::Describe;
using json_util::Find;
using json_util::GetUint;
using nlohmann::json;

constexpr char kMetadataKey[] = "__metadata__";
using internal_core::kInt64Max;

absl::Status Corrupt(absl::string_view file, absl::string_view what) {
  return absl::DataLossError(
      absl::StrCat("invalid safetensors file ", file, ": ", what));
}

absl::Status BadEntry(absl::string_view file, absl::string_view entry,
                      absl::string_view what) {
  return absl::DataLossError(
      absl::StrCat("invalid safetensors file ", file, ": entry \"",
                   absl::CHexEscape(entry.substr(0, 256)), "\": ", what));
}

// For a packed dtype (F4, F6), the values' shape to the elements': the
// last dimension divided by the values an element holds. "" when done,
// else why it cannot be (the caller names the entry).
std::string PackValues(DType dtype, Shape& shape) {
  const int values = DTypeValues(dtype);
  if (values == 1) return "";
  if (shape.empty() || shape.back() % values != 0) {
    return absl::StrFormat(
        "a %s entry of shape [%s]: cairn holds %s as %s, %d values to an "
        "element, so the last dimension must be a multiple of %d",
        SafetensorsDTypeName(dtype), absl::StrJoin(shape, ", "),
        SafetensorsDTypeName(dtype), DTypeName(dtype), values, values);
  }
  shape.back() /= values;
  return "";
}

absl::StatusOr<SafetensorsEntry> ParseEntry(const std::string& name,
                                            const json& value,
                                            absl::string_view file) {
  if (!value.is_object()) {
    return BadEntry(file, name,
                    absl::StrCat("expected an object, got ", Describe(value)));
  }
  SafetensorsEntry entry;
  entry.name = name;

  const json* dtype = Find(value, "dtype");
  if (dtype == nullptr || !dtype->is_string()) {
    return BadEntry(file, name, "\"dtype\" missing or not a string");
  }
  auto parsed_dtype =
      DTypeFromSafetensorsName(dtype->get_ref<const std::string&>());
  if (!parsed_dtype.ok()) {
    return BadEntry(
        file, name,
        absl::StrCat("unknown dtype \"",
                     absl::CHexEscape(
                         dtype->get_ref<const std::string&>().substr(0, 64)),
                     "\""));
  }
  entry.dtype = *parsed_dtype;

  const json* shape = Find(value, "shape");
  if (shape == nullptr || !shape->is_array()) {
    return BadEntry(file, name, "\"shape\" missing or not an array");
  }
  for (const json& dim : *shape) {
    auto d = GetUint(dim, kInt64Max);
    if (!d) {
      return BadEntry(file, name,
                      absl::StrCat("shape dimension must be an integer in "
                                   "[0, 2^63), got ",
                                   Describe(dim)));
    }
    entry.shape.push_back(static_cast<int64_t>(*d));
  }
  if (const std::string why = PackValues(entry.dtype, entry.shape);
      !why.empty()) {
    // A valid entry cairn cannot hold packed: not damage, so not kDataLoss.
    return absl::UnimplementedError(BadEntry(file, name, why).message());
  }

  const json* offsets = Find(value, "data_offsets");
  if (offsets == nullptr || !offsets->is_array() || offsets->size() != 2) {
    return BadEntry(file, name,
                    "\"data_offsets\" missing or not an array of 2 integers");
  }
  auto begin = GetUint((*offsets)[0]);
  auto end = GetUint((*offsets)[1]);
  if (!begin || !end) {
    return BadEntry(file, name,
                    "\"data_offsets\" must be non-negative 64-bit integers");
  }
  if (*begin > *end) {
    return BadEntry(file, name,
                    absl::StrCat("data_offsets [", *begin, ", ", *end,
                                 "] end before begin"));
  }
  entry.begin = *begin;
  entry.end = *end;

  auto bytes = internal_core::CheckedBytes(entry.shape, entry.dtype);
  if (!bytes) {
    return BadEntry(file, name, "shape size overflows");
  }
  if (entry.end - entry.begin != *bytes) {
    return BadEntry(file, name,
                    absl::StrCat("data_offsets [", entry.begin, ", ", entry.end,
                                 "] hold ", entry.end - entry.begin,
                                 " bytes but the shape needs ", *bytes));
  }
  return entry;
}

// Parses the plain form of a header that cairn writes (and most writers
// do) without building nlohmann's tree, which costs a few allocations per
// value: about 0.5 ms for a rank file's 222 entries, paid once per data
// file a rank reads. It accepts a subset of what ParseEntry and
// ParseSafetensorsHeader accept (JSON whitespace anywhere, members in any
// order; strings of printable ASCII without escapes, plain non-negative
// integers, entries with exactly dtype, shape and data_offsets, each name
// once) and yields what they yield for it. On anything else, any check
// that fails included, it gives up and the tree parse decides, with the
// error it always gave.
class FastHeaderParser : private PlainJsonCursor {
 public:
  FastHeaderParser(std::string_view text, uint64_t buffer_size)
      : PlainJsonCursor(text), buffer_size_(buffer_size) {}

  bool Parse(SafetensorsHeader* header) {
    bool metadata = false;
    if (!Members([&](std::string_view key) {
          if (key == kMetadataKey) {
            return !std::exchange(metadata, true) && Metadata(header);
          }
          return Entry(key, &header->entries.emplace_back());
        })) {
      return false;
    }
    if (!AtEnd()) return false;
    // A name twice: the tree keeps one of them; let it.
    std::vector<std::string_view> names;
    names.reserve(header->entries.size());
    for (const SafetensorsEntry& e : header->entries) names.push_back(e.name);
    std::sort(names.begin(), names.end());
    return std::adjacent_find(names.begin(), names.end()) == names.end();
  }

 private:
  bool Metadata(SafetensorsHeader* header) {
    return Members([&](std::string_view key) {
      std::string_view value;
      return String(&value) &&
             header->metadata.emplace(std::string(key), std::string(value))
                 .second;
    });
  }
  // ParseEntry's checks, and the end inside the byte buffer.
  bool Entry(std::string_view name, SafetensorsEntry* entry) {
    uint32_t seen = 0;
    std::string_view dtype;
    if (!Members([&](std::string_view key) {
          uint32_t bit = 0;
          bool ok = false;
          if (key == "dtype") {
            bit = 1, ok = String(&dtype);
          } else if (key == "shape") {
            bit = 2, ok = Dims(&entry->shape);
          } else if (key == "data_offsets") {
            bit = 4, ok = Take('[') && Uint(&entry->begin) && Take(',') &&
                          Uint(&entry->end) && Take(']');
          }
          if (!ok || (seen & bit)) return false;
          seen |= bit;
          return true;
        }) ||
        seen != 7) {
      return false;
    }
    absl::StatusOr<DType> parsed = DTypeFromSafetensorsName(dtype);
    if (!parsed.ok()) return false;
    entry->dtype = *parsed;
    if (!PackValues(entry->dtype, entry->shape).empty()) return false;
    entry->name = std::string(name);
    const std::optional<uint64_t> bytes =
        internal_core::CheckedBytes(entry->shape, entry->dtype);
    return entry->begin <= entry->end && bytes &&
           entry->end - entry->begin == *bytes && entry->end <= buffer_size_;
  }

  const uint64_t buffer_size_;
};

// Sorts the entries by offset and checks that they tile the byte buffer.
absl::Status SortAndCheckTiling(SafetensorsHeader& header, uint64_t buffer_size,
                                absl::string_view file) {
  std::sort(header.entries.begin(), header.entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return std::tie(a.begin, a.end, a.name) <
                     std::tie(b.begin, b.end, b.name);
            });
  // Tiling: each entry starts where the previous one ended.
  uint64_t pos = 0;
  for (const SafetensorsEntry& e : header.entries) {
    if (e.begin > pos) {
      return BadEntry(file, e.name,
                      absl::StrCat("hole in the byte buffer: [", pos, ", ",
                                   e.begin, ") belongs to no entry"));
    }
    if (e.begin < pos) {
      return BadEntry(
          file, e.name,
          absl::StrCat("data_offsets [", e.begin, ", ", e.end,
                       "] overlap another entry (which ends at ", pos, ")"));
    }
    pos = e.end;
  }
  if (pos != buffer_size) {
    return Corrupt(file,
                   absl::StrCat("entries cover ", pos, " of the ", buffer_size,
                                " bytes of the byte buffer (trailing bytes)"));
  }
  return absl::OkStatus();
}

// The checks on the header's size that both parses start with; the size of
// the byte buffer.
absl::StatusOr<uint64_t> CheckHeaderSize(std::string_view json_text,
                                         uint64_t file_size,
                                         absl::string_view file) {
  if (json_text.size() > kMaxSafetensorsHeaderBytes) {
    return Corrupt(file, absl::StrCat("header length ", json_text.size(),
                                      " exceeds the limit of ",
                                      kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (file_size < 8 || json_text.size() > file_size - 8) {
    return Corrupt(file,
                   absl::StrCat("header of ", json_text.size(),
                                " bytes runs past the end of the file (size ",
                                file_size, ")"));
  }
  return file_size - 8 - json_text.size();
}

}  // namespace

std::string EncodeSafetensorsHeader(
    const std::vector<SafetensorsEntry>& entries,
    const std::map<std::string, std::string>& metadata, uint64_t alignment) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header[kMetadataKey] = std::move(meta);
  }
  for (const SafetensorsEntry& e : entries) {
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = std::string(SafetensorsDTypeName(e.dtype));
    // A packed dtype's entry counts values (ValidateShard refuses packed
    // scalars: [values] here would read back as [1]).
    Shape shape = e.shape;
    if (const int values = DTypeValues(e.dtype); values > 1) {
      if (shape.empty()) shape.push_back(1);
      shape.back() *= values;
    }
    entry["shape"] = std::move(shape);
    entry["data_offsets"] = {e.begin, e.end};
    header[e.name] = std::move(entry);
  }
  // Names are expected to be valid UTF-8 (metadata encoding rejects others);
  // `replace` keeps this function total instead of throwing.
  std::string text = header.dump(
      -1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  if (alignment == 0) alignment = 1;
  const uint64_t unpadded = 8 + text.size();
  const uint64_t padded = internal_core::RoundUp(unpadded, alignment);
  text.append(padded - unpadded, ' ');

  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  }
  out += text;
  return out;
}

absl::StatusOr<uint64_t> ParseSafetensorsHeaderLength(
    std::string_view first8, uint64_t file_size, std::string_view file_sv) {
  const absl::string_view file = AsAbsl(file_sv);
  if (first8.size() < 8 || file_size < 8) {
    return Corrupt(
        file,
        absl::StrCat("file too short for a header length (",
                     std::min<uint64_t>(first8.size(), file_size), " bytes)"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) {
    n = (n << 8) | static_cast<unsigned char>(first8[i]);
  }
  // The value is not printed: these bytes may be anything (a file that is
  // no safetensors file at all), and an error must not show a file's
  // contents as if they were a length.
  if (n > kMaxSafetensorsHeaderBytes) {
    return Corrupt(
        file, absl::StrCat("the header length in its first 8 bytes exceeds "
                           "the limit of ",
                           kMaxSafetensorsHeaderBytes,
                           " bytes: not a safetensors file, or a damaged one"));
  }
  if (n > file_size - 8) {
    return Corrupt(file,
                   absl::StrCat("the header length in its first 8 bytes runs "
                                "past the end of the file (size ",
                                file_size,
                                "): a truncated or damaged safetensors file"));
  }
  return n;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeaderTree(
    std::string_view json_text, uint64_t file_size, std::string_view file_sv) {
  const absl::string_view file = AsAbsl(file_sv);
  CAIRN_ASSIGN_OR_RETURN(const uint64_t buffer_size,
                         CheckHeaderSize(json_text, file_size, file));
  SafetensorsHeader header;
  header.data_start = 8 + json_text.size();

  std::string why;
  std::optional<json> parsed = json_util::Parse(json_text, &why);
  if (!parsed) return Corrupt(file, absl::StrCat("malformed header: ", why));
  if (!parsed->is_object()) {
    return Corrupt(file, absl::StrCat("header must be a JSON object, got ",
                                      Describe(*parsed)));
  }
  for (const auto& [name, value] : parsed->items()) {
    if (name == kMetadataKey) {
      if (!value.is_object()) {
        return Corrupt(file, "\"__metadata__\" must be an object of strings");
      }
      for (const auto& [key, v] : value.items()) {
        if (!v.is_string()) {
          return Corrupt(
              file, absl::StrCat("\"__metadata__\" value of \"",
                                 absl::CHexEscape(key.substr(0, 256)),
                                 "\" must be a string, got ", Describe(v)));
        }
        header.metadata[key] = v.get_ref<const std::string&>();
      }
      continue;
    }
    CAIRN_ASSIGN_OR_RETURN(SafetensorsEntry entry,
                           ParseEntry(name, value, file));
    if (entry.end > buffer_size) {
      return BadEntry(
          file, name,
          absl::StrCat("data_offsets [", entry.begin, ", ", entry.end,
                       "] run past the end of the byte buffer (", buffer_size,
                       " bytes from offset ", header.data_start, ")"));
    }
    header.entries.push_back(std::move(entry));
  }

  CAIRN_RETURN_IF_ERROR(SortAndCheckTiling(header, buffer_size, file));
  return header;
}

std::optional<SafetensorsHeader> ParseSafetensorsHeaderFast(
    std::string_view json_text, uint64_t file_size) {
  absl::StatusOr<uint64_t> buffer_size =
      CheckHeaderSize(json_text, file_size, "");
  if (!buffer_size.ok()) return std::nullopt;
  SafetensorsHeader header;
  header.data_start = 8 + json_text.size();
  if (!FastHeaderParser(json_text, *buffer_size).Parse(&header) ||
      !SortAndCheckTiling(header, *buffer_size, "").ok()) {
    return std::nullopt;
  }
  return header;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(
    std::string_view json_text, uint64_t file_size, std::string_view file) {
  if (std::optional<SafetensorsHeader> header =
          ParseSafetensorsHeaderFast(json_text, file_size)) {
    return *std::move(header);
  }
  return ParseSafetensorsHeaderTree(json_text, file_size, file);
}

absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(
    const ReadableFile& file, std::string_view name) {
  const uint64_t size = file.size();
  std::string first8(std::min<uint64_t>(8, size), '\0');
  CAIRN_RETURN_IF_ERROR(file.ReadAt(
      0, std::as_writable_bytes(std::span<char>(first8.data(), first8.size()))));
  CAIRN_ASSIGN_OR_RETURN(uint64_t header_len,
                         ParseSafetensorsHeaderLength(first8, size, name));
  std::string json(header_len, '\0');
  CAIRN_RETURN_IF_ERROR(file.ReadAt(
      8, std::as_writable_bytes(std::span<char>(json.data(), json.size()))));
  return ParseSafetensorsHeader(json, size, name);
}

std::string EntryMismatch(const SafetensorsHeader& header,
                          const ExpectedEntry& expected) {
  // Entries are sorted by begin: those at the offset are a run (zero-length
  // ones, then at most one that is not, as they tile the buffer). The one
  // of the expected name, else of the expected length, else any describes
  // the difference.
  const std::vector<SafetensorsEntry>& entries = header.entries;
  if (expected.offset < header.data_start) {
    return absl::StrFormat("it lies in the safetensors header (%d bytes)",
                           header.data_start);
  }
  const uint64_t begin = expected.offset - header.data_start;
  const auto first = std::lower_bound(
      entries.begin(), entries.end(), begin,
      [](const SafetensorsEntry& e, uint64_t b) { return e.begin < b; });
  auto last = first;
  while (last != entries.end() && last->begin == begin) ++last;
  const SafetensorsEntry* e = nullptr;
  for (auto it = first; it != last && e == nullptr; ++it) {
    if (it->name == expected.name) e = &*it;
  }
  for (auto it = first; it != last && e == nullptr; ++it) {
    if (it->end - it->begin == expected.nbytes) e = &*it;
  }
  if (e == nullptr && first != last) e = &*(last - 1);
  if (e == nullptr) return "its safetensors header lists no entry at that offset";
  const auto quoted = [](std::string_view name) {
    return absl::StrCat("'", absl::CHexEscape(AsAbsl(name.substr(0, 256))), "'");
  };
  if (e->end - e->begin != expected.nbytes) {
    return absl::StrFormat("its safetensors entry %s there is %d bytes",
                           quoted(e->name), e->end - e->begin);
  }
  if (e->name != expected.name) {
    return absl::StrFormat(
        "its safetensors entry there is named %s, expected %s",
        quoted(e->name), quoted(expected.name));
  }
  if (e->dtype != expected.dtype ||
      !std::equal(e->shape.begin(), e->shape.end(), expected.shape.begin(),
                  expected.shape.end())) {
    return absl::StrFormat(
        "its safetensors entry %s is %s [%s], expected %s [%s]",
        quoted(e->name), AsAbsl(DTypeName(e->dtype)),
        absl::StrJoin(e->shape, ", "), AsAbsl(DTypeName(expected.dtype)),
        absl::StrJoin(expected.shape, ", "));
  }
  return std::string();
}

std::string SourceEntryMismatch(const SafetensorsHeader& header,
                                const ExpectedEntry& expected) {
  const std::vector<SafetensorsEntry>& entries = header.entries;
  const auto quoted = [](std::string_view name) {
    return absl::StrCat("'", absl::CHexEscape(AsAbsl(name.substr(0, 256))), "'");
  };
  if (expected.offset < header.data_start) {
    return absl::StrFormat("it lies in the safetensors header (%d bytes)",
                           header.data_start);
  }
  const uint64_t begin = expected.offset - header.data_start;
  // The entry of that name whose bytes hold `begin` (entries are sorted by
  // begin; zero-length ones share it with the next).
  const SafetensorsEntry* e = nullptr;
  auto it = std::upper_bound(
      entries.begin(), entries.end(), begin,
      [](uint64_t b, const SafetensorsEntry& x) { return b < x.begin; });
  while (it != entries.begin()) {
    --it;
    if (it->name == expected.name) {
      e = &*it;
      break;
    }
    if (it->end <= begin && it->end != it->begin) break;
  }
  if (e == nullptr) {
    return absl::StrFormat("the file has no entry %s at that offset",
                           quoted(expected.name));
  }
  if (begin + expected.nbytes > e->end) {
    return absl::StrFormat("it runs past the end of entry %s (%d bytes)",
                           quoted(e->name), e->end - e->begin);
  }
  const bool rank_ok = e->shape.size() == expected.shape.size();
  const bool rest_ok =
      rank_ok && std::equal(e->shape.begin() + (e->shape.empty() ? 0 : 1),
                            e->shape.end(),
                            expected.shape.begin() +
                                (expected.shape.empty() ? 0 : 1));
  if (e->dtype != expected.dtype || !rest_ok) {
    return absl::StrFormat(
        "its safetensors entry %s is %s [%s], which has no run of rows %s "
        "[%s]",
        quoted(e->name), AsAbsl(DTypeName(e->dtype)),
        absl::StrJoin(e->shape, ", "), AsAbsl(DTypeName(expected.dtype)),
        absl::StrJoin(expected.shape, ", "));
  }
  uint64_t row = DTypeSize(e->dtype);
  for (size_t d = 1; d < e->shape.size(); ++d) {
    row *= static_cast<uint64_t>(e->shape[d]);
  }
  if (row != 0 && (begin - e->begin) % row != 0) {
    return absl::StrFormat("it starts inside a row of entry %s",
                           quoted(e->name));
  }
  return std::string();
}

}  // namespace cairn::internal_format
