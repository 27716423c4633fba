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

#include "cairn/dtype.h"

namespace cairn::testing_util {

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

}  // namespace cairn::testing_util

#endif  // CAIRN_CHECKPOINT_TEST_UTIL_H_
