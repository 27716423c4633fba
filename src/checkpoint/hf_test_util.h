// Writing Hugging Face folders for tests: safetensors files of given
// tensors (bytes made by ByteAt) and index files.
#ifndef CAIRN_CHECKPOINT_HF_TEST_UTIL_H_
#define CAIRN_CHECKPOINT_HF_TEST_UTIL_H_

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "checkpoint/test_util.h"
#include "format/safetensors.h"

namespace cairn::testing_util {

struct HfTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
};

// A seed from a tensor's name (FNV-1a).
inline uint64_t NameSeed(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

// The bytes of `t` as the tests store it: ByteAt seeded by its name.
inline std::string HfBytes(const HfTensor& t) {
  const uint64_t n = static_cast<uint64_t>(NumElements(t.shape)) *
                     DTypeSize(t.dtype);
  std::string out(n, '\0');
  const size_t es = DTypeSize(t.dtype);
  for (uint64_t i = 0; i < n; ++i) {
    out[i] = static_cast<char>(
        ByteAt(t.dtype, static_cast<int64_t>(i / es), i % es, NameSeed(t.name)));
  }
  return out;
}

// Writes a safetensors file of `tensors`, in this order, with
// {"format": "pt"} as metadata.
inline void WriteSafetensors(const std::string& path,
                             const std::vector<HfTensor>& tensors) {
  std::filesystem::create_directories(
      std::filesystem::path(path).parent_path());
  std::vector<internal_format::SafetensorsEntry> entries;
  std::string data;
  for (const HfTensor& t : tensors) {
    const std::string bytes = HfBytes(t);
    entries.push_back({t.name, t.dtype, t.shape, data.size(),
                       data.size() + bytes.size()});
    data += bytes;
  }
  WriteFile(path, internal_format::EncodeSafetensorsHeader(
                      entries, {{"format", "pt"}}, 8) +
                      data);
}

// An index file whose weight_map is `weight_map` (tensor -> file).
inline void WriteIndex(const std::string& path,
                       const std::map<std::string, std::string>& weight_map) {
  std::string text = "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {";
  bool first = true;
  for (const auto& [t, f] : weight_map) {
    absl::StrAppend(&text, first ? "" : ", ", "\"", t, "\": \"", f, "\"");
    first = false;
  }
  WriteFile(path, text + "}}");
}

}  // namespace cairn::testing_util

#endif  // CAIRN_CHECKPOINT_HF_TEST_UTIL_H_
