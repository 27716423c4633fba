// The libFuzzer entry point of a cairn_fuzz_<name> binary, which links
// exactly one target (fuzz/CMakeLists.txt).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const cairn::fuzz::TargetFn fn = [] {
    if (cairn::fuzz::Registry().size() != 1) {
      cairn::fuzz::Fail(__FILE__, __LINE__, "a fuzz binary links one target");
    }
    return cairn::fuzz::Registry()[0].fn;
  }();
  fn(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
