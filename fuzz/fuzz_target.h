// How cairn's fuzz targets are declared. Each target is one function over
// arbitrary bytes that must never crash, hang, or read outside a buffer, and
// that checks its own invariants (a fast decoder against the reference one,
// an encoding that decodes back to what was encoded) with CAIRN_FUZZ_CHECK.
//
// The same sources build two ways (fuzz/CMakeLists.txt):
//  - with -DCAIRN_FUZZ=ON (clang): one libFuzzer binary per target,
//    cairn_fuzz_<name>, to explore new inputs;
//  - always, with the tests: cairn_fuzz_replay, which runs every target on
//    every file of its corpus (fuzz/corpus/<name>/) under CTest, so inputs
//    that once failed stay fixed in the ordinary (and sanitizer) builds.
#ifndef CAIRN_FUZZ_FUZZ_TARGET_H_
#define CAIRN_FUZZ_FUZZ_TARGET_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"

namespace cairn::fuzz {

using TargetFn = void (*)(std::string_view data);

struct Target {
  const char* name;
  TargetFn fn;
  // Writes seed inputs for the corpus (`cairn_fuzz_replay --write-seeds`):
  // well-formed inputs built with cairn's own encoders, which fuzzing then
  // mutates.
  std::vector<std::string> (*seeds)();
};

// Every target linked into this binary.
std::vector<Target>& Registry();

struct Registrar {
  explicit Registrar(Target t) { Registry().push_back(t); }
};

// Reports a broken invariant with `what` and aborts (a finding for
// libFuzzer, a failed test for the replay).
[[noreturn]] void Fail(const char* file, int line, const std::string& what);

// Reads a structure-aware target's input as a recipe of small numbers;
// zeros once the bytes run out, so that every input is a valid recipe.
class Recipe {
 public:
  explicit Recipe(std::string_view data) : data_(data) {}
  uint8_t Byte() {
    if (data_.empty()) return 0;
    const uint8_t b = static_cast<uint8_t>(data_[0]);
    data_.remove_prefix(1);
    return b;
  }
  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{Byte()} << (8 * i);
    return v;
  }
  // In [lo, hi] (a byte modulo the range: hi - lo below 256 to reach all).
  int64_t In(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(Byte()) % (hi - lo + 1);
  }
  bool done() const { return data_.empty(); }

 private:
  std::string_view data_;
};

// Splits `data` into records, each a 2-byte little-endian length and that
// many bytes (a short last record takes what is left): several ranks'
// messages from one input.
std::vector<std::string> SplitRecords(std::string_view data, size_t max);
// The inverse, for seeds.
std::string JoinRecords(const std::vector<std::string>& records);

}  // namespace cairn::fuzz

#define CAIRN_FUZZ_CHECK(cond, what)                              \
  do {                                                            \
    if (!(cond)) ::cairn::fuzz::Fail(__FILE__, __LINE__, (what)); \
  } while (0)

// CAIRN_FUZZ_TARGET(name, seeds_fn) { ... body over `data` ... }
#define CAIRN_FUZZ_TARGET(name, seeds_fn)                                    \
  static void CairnFuzz_##name(std::string_view data);                      \
  static const ::cairn::fuzz::Registrar cairn_fuzz_registrar_##name(        \
      ::cairn::fuzz::Target{#name, &CairnFuzz_##name, seeds_fn});           \
  static void CairnFuzz_##name(std::string_view data)

namespace cairn::fuzz {

// For codecs: decode `data`, encode, decode and encode again; the two
// encodings must agree (encoding what decoded is a fixed point). `decode`
// returns a StatusOr; bytes it refuses are fine.
template <typename Decode, typename Encode>
void CheckFixedPoint(std::string_view data, Decode decode, Encode encode,
                     const char* what) {
  auto first = decode(data);
  if (!first.ok()) return;
  const std::string once = encode(*first);
  auto second = decode(once);
  CAIRN_FUZZ_CHECK(second.ok(), absl::StrCat(what, ": its own encoding does "
                                             "not decode: ",
                                             second.status().ToString()));
  CAIRN_FUZZ_CHECK(encode(*second) == once,
                   absl::StrCat(what, ": encoding is not a fixed point"));
}

}  // namespace cairn::fuzz

#endif  // CAIRN_FUZZ_FUZZ_TARGET_H_
