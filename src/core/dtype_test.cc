#include "cairn/dtype.h"

#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

TEST(DTypeTest, SizesAndNames) {
  struct Case {
    DType dtype;
    size_t size;
    const char* name;
  };
  const Case cases[] = {
      {DType::kF64, 8, "F64"},         {DType::kF32, 4, "F32"},
      {DType::kF16, 2, "F16"},         {DType::kBF16, 2, "BF16"},
      {DType::kF8_E4M3, 1, "F8_E4M3"}, {DType::kF8_E5M2, 1, "F8_E5M2"},
      {DType::kI64, 8, "I64"},         {DType::kI32, 4, "I32"},
      {DType::kI16, 2, "I16"},         {DType::kI8, 1, "I8"},
      {DType::kU64, 8, "U64"},         {DType::kU32, 4, "U32"},
      {DType::kU16, 2, "U16"},         {DType::kU8, 1, "U8"},
      {DType::kBool, 1, "BOOL"},
      {DType::kF8_E8M0, 1, "F8_E8M0"}, {DType::kC64, 8, "C64"},
      {DType::kF4_X2, 1, "F4_X2"},     {DType::kF6_E2M3_X4, 3, "F6_E2M3_X4"},
      {DType::kF6_E3M2_X4, 3, "F6_E3M2_X4"},
  };
  ASSERT_EQ(std::size(cases), AllDTypes().size());
  for (const Case& c : cases) {
    EXPECT_EQ(DTypeSize(c.dtype), c.size) << c.name;
    EXPECT_EQ(DTypeName(c.dtype), c.name);
    auto parsed = DTypeFromName(c.name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, c.dtype) << c.name;
  }
}

TEST(DTypeTest, AllDTypesInEnumOrderAndDistinct) {
  std::set<std::string_view> names;
  int i = 0;
  for (DType d : AllDTypes()) {
    EXPECT_EQ(static_cast<int>(d), i++);
    EXPECT_TRUE(names.insert(DTypeName(d)).second) << DTypeName(d);
  }
}

TEST(DTypeTest, UnknownNameIsInvalidArgument) {
  for (const char* name : {"", "f32", "FLOAT32", "F8", "BOOLEAN", "F32 "}) {
    auto parsed = DTypeFromName(name);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument)
        << "\"" << name << "\"";
  }
}

// safetensors' sub-byte dtypes are held packed: their names map to the
// packed dtypes only as safetensors names; in metadata.json they are an
// error that names the packed dtype.
TEST(DTypeTest, SubByteDTypesAreHeldPacked) {
  struct Case {
    const char* safetensors;
    DType dtype;
    int values;
  };
  for (const Case& c : {Case{"F4", DType::kF4_X2, 2},
                        Case{"F6_E2M3", DType::kF6_E2M3_X4, 4},
                        Case{"F6_E3M2", DType::kF6_E3M2_X4, 4}}) {
    SCOPED_TRACE(c.safetensors);
    EXPECT_EQ(DTypeValues(c.dtype), c.values);
    EXPECT_EQ(SafetensorsDTypeName(c.dtype), c.safetensors);
    absl::StatusOr<DType> parsed = DTypeFromSafetensorsName(c.safetensors);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, c.dtype);
    EXPECT_FALSE(DTypeFromSafetensorsName(DTypeName(c.dtype)).ok());
    absl::StatusOr<DType> named = DTypeFromName(c.safetensors);
    EXPECT_EQ(named.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(named.status().message()),
                testing::HasSubstr(std::string(DTypeName(c.dtype))));
  }
  for (DType d : AllDTypes()) {
    if (DTypeValues(d) == 1) {
      EXPECT_EQ(SafetensorsDTypeName(d), DTypeName(d));
      EXPECT_EQ(*DTypeFromSafetensorsName(DTypeName(d)), d);
    }
  }
}

TEST(DTypeTest, OutOfRangeEnumDoesNotCrash) {
  const auto bogus = static_cast<DType>(200);
  EXPECT_EQ(DTypeSize(bogus), 0u);
  EXPECT_EQ(DTypeName(bogus), "INVALID");
}

}  // namespace
}  // namespace cairn
