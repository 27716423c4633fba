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
  // Appended: safetensors' dtypes of fewer than 8 bits, held packed, so
  // that every element is whole bytes: kF4_X2 is two F4 (E2M1) values in
  // a byte (torch's float4_e2m1fn_x2), kF6_E2M3_X4 and kF6_E3M2_X4 four
  // 6-bit values in 3 bytes. A safetensors entry of shape [..., n] is held
  // as [..., n / DTypeValues(dtype)]: a box then always starts on a byte,
  // and bytes are moved, never reinterpreted.
  kF4_X2,
  kF6_E2M3_X4,
  kF6_E3M2_X4,
};

// Every dtype, in the order above.
std::span<const DType> AllDTypes();

// Bytes per element (1 for kBool, 3 for the F6 quads).
size_t DTypeSize(DType dtype);

// Values per element: 2 for kF4_X2, 4 for the F6 quads, else 1.
int DTypeValues(DType dtype);

// The name in metadata.json: safetensors' name ("F32", "BF16", "F8_E4M3",
// "BOOL", ...), and for the packed dtypes "F4_X2", "F6_E2M3_X4" and
// "F6_E3M2_X4" (their safetensors entries say "F4", "F6_E2M3", "F6_E3M2",
// with the values' shape).
std::string_view DTypeName(DType dtype);

// Inverse of DTypeName. kInvalidArgument for an unknown name; for
// safetensors' own sub-byte names (F4, F6_E2M3, F6_E3M2) kInvalidArgument
// naming the packed dtype that holds them.
absl::StatusOr<DType> DTypeFromName(std::string_view name);

// safetensors' name of the dtype, and the dtype of a safetensors name: as
// DTypeName, but "F4", "F6_E2M3" and "F6_E3M2" for the packed dtypes.
std::string_view SafetensorsDTypeName(DType dtype);
absl::StatusOr<DType> DTypeFromSafetensorsName(std::string_view name);

}  // namespace cairn

#endif  // CAIRN_DTYPE_H_
