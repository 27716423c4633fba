// Element types of tensors. Names are safetensors' dtype names, so a cairn
// data file is readable by any safetensors reader.
//
// Thread safety: everything here is a pure function.
#ifndef CAIRN_DTYPE_H_
#define CAIRN_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "absl/status/statusor.h"

namespace cairn {

enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8_E4M3,
  kF8_E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU64,
  kU32,
  kU16,
  kU8,
  kBool,
  // Appended (the enum's values are stable): the 8-bit exponent-only scale
  // format of microscaling (MX) blocks, and complex64 (two F32s).
  kF8_E8M0,
  kC64,
};

// Every dtype, in the order above.
std::span<const DType> AllDTypes();

// Bytes per element (1 for kBool).
size_t DTypeSize(DType dtype);

// The safetensors name: "F32", "BF16", "F8_E4M3", "BOOL", ...
std::string_view DTypeName(DType dtype);

// Inverse of DTypeName. kInvalidArgument for an unknown name, and
// kUnimplemented for the sub-byte safetensors dtypes (F4, F6_E2M3,
// F6_E3M2), which cairn, addressing whole bytes, does not hold.
absl::StatusOr<DType> DTypeFromName(std::string_view name);

}  // namespace cairn

#endif  // CAIRN_DTYPE_H_
