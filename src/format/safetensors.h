// The safetensors container: a little-endian u64 header length N, N bytes of
// JSON header (may be padded with trailing spaces), then the byte buffer.
// Each header entry is {"dtype", "shape", "data_offsets": [begin, end]} with
// offsets relative to the buffer; the entries cover the buffer with no holes
// and no overlaps. "__metadata__" maps strings to strings.
#ifndef CAIRN_FORMAT_SAFETENSORS_H_
#define CAIRN_FORMAT_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "cairn/storage.h"

namespace cairn::internal_format {

// Largest header cairn accepts (the safetensors reference limit).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  uint64_t begin = 0;  // relative to the start of the byte buffer
  uint64_t end = 0;
  friend bool operator==(const SafetensorsEntry&, const SafetensorsEntry&) =
      default;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // sorted by begin
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // absolute offset of the byte buffer: 8 + N
};

// The first data_start bytes of a file: length prefix plus JSON, padded with
// spaces so that data_start is a multiple of `alignment`. `entries` must be
// laid out back to back from offset 0 (their order is kept).
std::string EncodeSafetensorsHeader(
    const std::vector<SafetensorsEntry>& entries,
    const std::map<std::string, std::string>& metadata, uint64_t alignment);

// Reads N from the first 8 bytes. kDataLoss / kInvalidArgument (naming
// `file`) when the file is shorter than 8 bytes, N exceeds
// kMaxSafetensorsHeaderBytes, or 8 + N exceeds `file_size`.
absl::StatusOr<uint64_t> ParseSafetensorsHeaderLength(std::string_view first8,
                                                      uint64_t file_size,
                                                      std::string_view file);

// Parses and validates the N header bytes: well-formed JSON object, known
// dtypes, non-negative shapes, end - begin == bytes of shape, entries that
// tile [0, file_size - 8 - N) exactly. Errors name `file` and the entry.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json,
                                                         uint64_t file_size,
                                                         std::string_view file);

// The same parse through nlohmann's JSON tree alone, and a parse without
// it, for the plain form cairn writes, that gives the same header or
// nullopt (for anything else, errors included). ParseSafetensorsHeader
// tries the second, then the first; both are here for the test that
// compares them.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeaderTree(
    std::string_view json, uint64_t file_size, std::string_view file);
std::optional<SafetensorsHeader> ParseSafetensorsHeaderFast(
    std::string_view json, uint64_t file_size);

// Reads and validates the header of an open data file: the length prefix,
// then the JSON (both of the checks above). Errors name `file`.
absl::StatusOr<SafetensorsHeader> ReadSafetensorsHeader(
    const ReadableFile& file, std::string_view name);

// A chunk or object as metadata.json places it, and so as the header of its
// data file must list it (docs/format.md 3.1).
struct ExpectedEntry {
  std::string_view name;  // EntryName(fqn, box, whole), or an object's FQN
  DType dtype = DType::kU8;           // an object's is U8
  std::span<const int64_t> shape;     // the box's sizes; an object's {nbytes}
  uint64_t offset = 0;                // absolute, in the file
  uint64_t nbytes = 0;
};

// "" when `header` lists an entry named `expected.name` at exactly
// [offset, offset + nbytes) of the file, of its dtype and shape; else what
// differs, as a phrase about the chunk ("its safetensors entry there is
// named 'b', expected 'a'"). Only this check catches a metadata.json whose
// locations were swapped or whose dtype was relabelled (checksums and
// sizes all consistent): the load and `cairn verify` both make it.
std::string EntryMismatch(const SafetensorsHeader& header,
                          const ExpectedEntry& expected);

// The same for a chunk of metadata made from files cairn did not write
// (Metadata::source_entries): "" when the entry named `expected.name`
// holds [offset, offset + nbytes) of the file, of its dtype, as a run of
// its leading rows (`expected.shape` is the entry's shape but for dim 0,
// and the run starts on a row); else what differs.
std::string SourceEntryMismatch(const SafetensorsHeader& header,
                                const ExpectedEntry& expected);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_SAFETENSORS_H_
