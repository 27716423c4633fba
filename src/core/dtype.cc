// DType tables. One table drives sizes, names and the name lookup, so the
// three can never disagree.
#include "cairn/dtype.h"

#include <array>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace cairn {
namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view name;
};

// Indexed by the enum value; order must match the enum in dtype.h.
constexpr std::array<DTypeInfo, 17> kDTypeInfo = {{
    {DType::kF64, 8, "F64"},
    {DType::kF32, 4, "F32"},
    {DType::kF16, 2, "F16"},
    {DType::kBF16, 2, "BF16"},
    {DType::kF8_E4M3, 1, "F8_E4M3"},
    {DType::kF8_E5M2, 1, "F8_E5M2"},
    {DType::kI64, 8, "I64"},
    {DType::kI32, 4, "I32"},
    {DType::kI16, 2, "I16"},
    {DType::kI8, 1, "I8"},
    {DType::kU64, 8, "U64"},
    {DType::kU32, 4, "U32"},
    {DType::kU16, 2, "U16"},
    {DType::kU8, 1, "U8"},
    {DType::kBool, 1, "BOOL"},
    {DType::kF8_E8M0, 1, "F8_E8M0"},
    {DType::kC64, 8, "C64"},
}};

// Safetensors dtypes of fewer than 8 bits an element, packed: no cairn
// DType (a box's bytes would not start on a byte).
constexpr std::string_view kSubByteNames[] = {"F4", "F6_E2M3", "F6_E3M2"};

constexpr bool TableMatchesEnum() {
  for (size_t i = 0; i < kDTypeInfo.size(); ++i) {
    if (static_cast<size_t>(kDTypeInfo[i].dtype) != i) return false;
  }
  return true;
}
static_assert(TableMatchesEnum(), "kDTypeInfo must follow the DType enum");

constexpr std::array<DType, kDTypeInfo.size()> MakeAllDTypes() {
  std::array<DType, kDTypeInfo.size()> all{};
  for (size_t i = 0; i < kDTypeInfo.size(); ++i) all[i] = kDTypeInfo[i].dtype;
  return all;
}
constexpr std::array<DType, kDTypeInfo.size()> kAllDTypes = MakeAllDTypes();

const DTypeInfo* Find(DType dtype) {
  const auto index = static_cast<size_t>(dtype);
  // A value outside the enum (a corrupt cast) must not index past the table.
  return index < kDTypeInfo.size() ? &kDTypeInfo[index] : nullptr;
}

}  // namespace

std::span<const DType> AllDTypes() { return kAllDTypes; }

size_t DTypeSize(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info == nullptr ? 0 : info->size;
}

std::string_view DTypeName(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info == nullptr ? std::string_view("INVALID") : info->name;
}

absl::StatusOr<DType> DTypeFromName(std::string_view name) {
  for (const DTypeInfo& info : kDTypeInfo) {
    if (info.name == name) return info.dtype;
  }
  for (std::string_view sub : kSubByteNames) {
    if (sub == name) {
      return absl::UnimplementedError(absl::StrCat(
          "dtype \"", std::string(name),
          "\" packs elements of fewer than 8 bits, which cairn does not "
          "support"));
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype name \"", std::string(name), "\""));
}

}  // namespace cairn
