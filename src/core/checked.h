// Small helpers every area needs: overflow-checked sizes, rounding to a
// multiple, and the bridge
// between std::string_view and Debian 12's absl::string_view (a distinct
// type there, since that absl is built with ABSL_OPTION_USE_STD_STRING_VIEW
// = 0: absl::StrCat and friends do not take std::string_view).
#ifndef CAIRN_CORE_CHECKED_H_
#define CAIRN_CORE_CHECKED_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <type_traits>

#include "absl/strings/string_view.h"
#include "cairn/box.h"
#include "cairn/dtype.h"

namespace cairn::internal_core {

inline absl::string_view AsAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}
inline std::string_view AsStd(absl::string_view s) {
  return std::string_view(s.data(), s.size());
}

// `x` rounded down, or up, to a multiple of `m` (> 0). RoundUp needs
// x + m - 1 to fit in T, which holds for the sizes and offsets it rounds.
template <typename T>
constexpr T RoundDown(T x, std::type_identity_t<T> m) {
  return x / m * m;
}
template <typename T>
constexpr T RoundUp(T x, std::type_identity_t<T> m) {
  return (x + m - 1) / m * m;
}

// The largest element or byte count cairn accepts anywhere.
inline constexpr uint64_t kInt64Max =
    static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

// Bytes of a row-major block of `sizes` elements of `dtype`, or nullopt when
// a size is negative or the element or byte count does not fit int64. Any
// zero size gives 0, whatever the others.
inline std::optional<uint64_t> CheckedBytes(const Shape& sizes, DType dtype) {
  for (int64_t d : sizes) {
    if (d < 0) return std::nullopt;
  }
  for (int64_t d : sizes) {
    if (d == 0) return 0;
  }
  uint64_t elements = 1;
  for (int64_t d : sizes) {
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(d), &elements) ||
        elements > kInt64Max) {
      return std::nullopt;
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(elements, uint64_t{DTypeSize(dtype)}, &bytes) ||
      bytes > kInt64Max) {
    return std::nullopt;
  }
  return bytes;
}

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_CHECKED_H_
