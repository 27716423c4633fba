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
  int values = 1;                  // per element
  std::string_view safetensors{};  // when not `name`
};

// Indexed by the enum value; order must match the enum in dtype.h.
constexpr std::array<DTypeInfo, 20> kDTypeInfo = {{
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
    {DType::kF4_X2, 1, "F4_X2", 2, "F4"},
    {DType::kF6_E2M3_X4, 3, "F6_E2M3_X4", 4, "F6_E2M3"},
    {DType::kF6_E3M2_X4, 3, "F6_E3M2_X4", 4, "F6_E3M2"},
}};

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

int DTypeValues(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  return info == nullptr ? 1 : info->values;
}

std::string_view SafetensorsDTypeName(DType dtype) {
  const DTypeInfo* info = Find(dtype);
  if (info == nullptr) return "INVALID";
  return info->safetensors.empty() ? info->name : info->safetensors;
}

absl::StatusOr<DType> DTypeFromName(std::string_view name) {
  for (const DTypeInfo& info : kDTypeInfo) {
    if (info.name == name) return info.dtype;
  }
  for (const DTypeInfo& info : kDTypeInfo) {
    if (!info.safetensors.empty() && info.safetensors == name) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dtype \"", std::string(name), "\" is safetensors' name; cairn ",
          "holds it packed, as \"", std::string(info.name), "\""));
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype name \"", std::string(name), "\""));
}

absl::StatusOr<DType> DTypeFromSafetensorsName(std::string_view name) {
  for (const DTypeInfo& info : kDTypeInfo) {
    if (SafetensorsDTypeName(info.dtype) == name) return info.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype name \"", std::string(name), "\""));
}

}  // namespace cairn
