// Helpers shared by the checkpoint tests.
#ifndef CAIRN_CHECKPOINT_TEST_UTIL_H_
#define CAIRN_CHECKPOINT_TEST_UTIL_H_

#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "cairn/tensor.h"
#include "format/metadata_codec.h"

namespace cairn::testing_util {

// The text of a metadata.json a test edited on purpose, with its checksum
// recomputed, so that the load reaches the check of the edit (a text that
// cannot take one is returned as it is).
inline std::string Resealed(const std::string& text) {
  absl::StatusOr<std::string> sealed =
      internal_format::WithMetadataChecksum(text);
  return sealed.ok() ? *std::move(sealed) : text;
}

// A fresh directory under $TMPDIR (or /tmp), removed with its contents.
class TempDir {
 public:
  TempDir() {
    const char* base = getenv("TMPDIR");
    std::string templ =
        std::string(base != nullptr && *base ? base : "/tmp") + "/cairn-test-XXXXXX";
    path_ = mkdtemp(templ.data()) != nullptr ? templ : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Whether `dir` holds any data file ("data-*.safetensors", whatever save
// wrote it).
inline bool HasDataFile(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("data-") && name.ends_with(".safetensors")) return true;
  }
  return false;
}

// Deterministic content: byte `i` of element `index` of a tensor.
inline std::byte ByteAt(DType dtype, int64_t index, size_t i, uint64_t seed) {
  uint64_t x = (static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull) ^
               (seed * 0xBF58476D1CE4E5B9ull) ^ (i * 0x94D049BB133111EBull) ^
               static_cast<uint64_t>(dtype);
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 32;
  return static_cast<std::byte>(x & 0xff);
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

// XORs the byte at `offset` of the file at `path` with `mask` (a second call
// puts it back): a damaged checkpoint. The change is written before this
// returns.
inline absl::Status FlipBits(const std::string& path, uint64_t offset,
                             unsigned char mask) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  char byte = 0;
  const auto at = static_cast<std::streamoff>(offset);
  if (!f.seekg(at) || !f.read(&byte, 1)) {
    return absl::NotFoundError(absl::StrCat(path, ": no byte at ", offset));
  }
  byte = static_cast<char>(byte ^ static_cast<char>(mask));
  if (!f.seekp(at) || !f.write(&byte, 1) || !f.flush()) {
    return absl::InternalError(absl::StrCat(path, ": cannot write at ", offset));
  }
  return absl::OkStatus();
}

// Element pointer of a view at `index` (relative to the view).
inline std::byte* ElementPtr(const TensorView& v,
                             const std::vector<int64_t>& index) {
  int64_t off = 0;
  for (int d = 0; d < v.rank(); ++d) off += index[d] * v.strides()[d];
  return static_cast<std::byte*>(v.data()) +
         off * static_cast<int64_t>(DTypeSize(v.dtype()));
}

// Calls fn(local index, global index) for every element of `box`.
template <typename Fn>
void ForEachIndex(const Box& box, Fn fn) {
  if (box.empty()) return;
  std::vector<int64_t> local(box.rank(), 0), global = box.offsets;
  while (true) {
    fn(local, global);
    int d = box.rank() - 1;
    for (; d >= 0; --d) {
      ++local[d];
      ++global[d];
      if (local[d] < box.sizes[d]) break;
      local[d] = 0;
      global[d] = box.offsets[d];
    }
    if (d < 0) return;
  }
}

// Row-major index in a tensor of `shape` of the element at `index`.
inline int64_t LinearIndex(const Shape& shape,
                           const std::vector<int64_t>& index) {
  int64_t li = 0;
  for (size_t d = 0; d < shape.size(); ++d) li = li * shape[d] + index[d];
  return li;
}

}  // namespace cairn::testing_util

#endif  // CAIRN_CHECKPOINT_TEST_UTIL_H_
