#include "core/cast.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace cairn::internal_core {
namespace {

TEST(CastTest, HalfRoundTripsEveryValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f)))) << h;
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), h) << h;
  }
}

TEST(CastTest, BFloat16RoundTripsEveryValue) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(f)))) << b;
      continue;
    }
    EXPECT_EQ(FloatToBFloat16(f), b) << b;
  }
}

TEST(CastTest, RoundsToNearestEven) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // rounds up to infinity
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);       // tie: even
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);       // tie: even
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // tie
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f808000u)), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f818000u)), 0x3f82);
  EXPECT_EQ(FloatToBFloat16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(3.4e38f), 0x7f80);  // rounds up to infinity
  const uint16_t nan =
      FloatToBFloat16(std::bit_cast<float>(0x7f800001u));  // signalling
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(nan)));
}

TEST(CastTest, CastsBuffers) {
  const std::vector<float> f = {1.0f, -2.5f, 1e-3f, 3.0e38f};
  std::vector<uint16_t> b(f.size());
  ASSERT_TRUE(Cast(DType::kF32, f.data(), DType::kBF16, b.data(), f.size()).ok());
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(b[i], FloatToBFloat16(f[i]));
  std::vector<double> d(f.size());
  ASSERT_TRUE(Cast(DType::kBF16, b.data(), DType::kF64, d.data(), b.size()).ok());
  for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(d[i], BFloat16ToFloat(b[i]));
  std::vector<uint16_t> h(f.size());
  ASSERT_TRUE(Cast(DType::kF64, d.data(), DType::kF16, h.data(), d.size()).ok());
  EXPECT_EQ(h[0], 0x3c00);
  EXPECT_EQ(h[3], 0x7c00);
  int32_t i32 = 0;
  EXPECT_EQ(Cast(DType::kI32, &i32, DType::kF32, &i32, 1).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cairn::internal_core
