// The JSON header of a safetensors data file, read by every load before it
// trusts an offset in the file: the fast parser must give the tree parser's
// header or give way to it, ParseSafetensorsHeader must give the tree's
// result or error, and a parsed header must encode and parse back to
// itself.
//
// Input: 8 bytes (little-endian) for the size of the byte buffer after the
// header, then the header's JSON text.
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "format/safetensors.h"
#include "fuzz/fuzz_target.h"

namespace cairn::fuzz {
namespace {

using internal_format::SafetensorsEntry;
using internal_format::SafetensorsHeader;

constexpr char kFile[] = "fuzz/data-00000.safetensors";

bool Same(const SafetensorsHeader& a, const SafetensorsHeader& b) {
  return a.entries == b.entries && a.metadata == b.metadata &&
         a.data_start == b.data_start;
}

std::string Input(uint64_t buffer_bytes, std::string_view json) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(buffer_bytes >> (8 * i));
  out.append(json);
  return out;
}

std::vector<std::string> Seeds() {
  std::vector<SafetensorsEntry> entries = {
      {"model.w", DType::kF32, {2, 3}, 0, 24},
      {"model.s", DType::kBF16, {}, 24, 26},
      {"empty", DType::kI64, {0, 5}, 26, 26},
      {"__obj__rng", DType::kU8, {16}, 26, 42}};
  std::string file = internal_format::EncodeSafetensorsHeader(
      entries, {{"format", "pt"}, {"cairn", "1"}}, 8);
  std::vector<std::string> seeds;
  seeds.push_back(Input(42, std::string_view(file).substr(8)));
  seeds.push_back(Input(0, "{}"));
  seeds.push_back(Input(4, R"({"__metadata__":{"k":"v"},"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})"));
  return seeds;
}

}  // namespace

CAIRN_FUZZ_TARGET(safetensors, &Seeds) {
  // The length prefix of a file that is exactly these bytes.
  (void)internal_format::ParseSafetensorsHeaderLength(data.substr(0, 8),
                                                      data.size(), kFile);
  if (data.size() < 8) return;
  uint64_t buffer_bytes = 0;
  std::memcpy(&buffer_bytes, data.data(), 8);  // little-endian host
  buffer_bytes &= (uint64_t{1} << 48) - 1;
  const std::string_view json = data.substr(8);
  const uint64_t file_size = 8 + json.size() + buffer_bytes;

  const absl::StatusOr<SafetensorsHeader> tree =
      internal_format::ParseSafetensorsHeaderTree(json, file_size, kFile);
  const absl::StatusOr<SafetensorsHeader> both =
      internal_format::ParseSafetensorsHeader(json, file_size, kFile);
  CAIRN_FUZZ_CHECK(both.status() == tree.status(),
                   absl::StrCat("ParseSafetensorsHeader: ",
                                both.status().ToString(),
                                "\ntree: ", tree.status().ToString()));
  if (both.ok()) {
    CAIRN_FUZZ_CHECK(Same(*both, *tree), "ParseSafetensorsHeader: other header");
  }
  const std::optional<SafetensorsHeader> fast =
      internal_format::ParseSafetensorsHeaderFast(json, file_size);
  if (fast) {
    CAIRN_FUZZ_CHECK(tree.ok(), absl::StrCat("fast parse accepted what the tree "
                                             "rejects: ",
                                             tree.status().ToString()));
    CAIRN_FUZZ_CHECK(Same(*fast, *tree), "fast parse: other header");
  }
  if (!tree.ok()) return;

  // Encode what was parsed (with the same data, after a header padded to
  // 8 bytes) and parse it back.
  const std::string file = internal_format::EncodeSafetensorsHeader(
      tree->entries, tree->metadata, 8);
  const uint64_t encoded_size = file.size() + buffer_bytes;
  absl::StatusOr<uint64_t> n = internal_format::ParseSafetensorsHeaderLength(
      std::string_view(file).substr(0, 8), encoded_size, kFile);
  CAIRN_FUZZ_CHECK(n.ok() && *n == file.size() - 8,
                   absl::StrCat("encoded length prefix: ", n.status().ToString()));
  absl::StatusOr<SafetensorsHeader> again = internal_format::ParseSafetensorsHeader(
      std::string_view(file).substr(8), encoded_size, kFile);
  CAIRN_FUZZ_CHECK(again.ok(), absl::StrCat("encoded header does not parse: ",
                                            again.status().ToString()));
  CAIRN_FUZZ_CHECK(again->entries == tree->entries &&
                       again->metadata == tree->metadata,
                   "round trip changed the header");
}

}  // namespace cairn::fuzz
