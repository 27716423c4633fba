#include "core/cast.h"

#include <bit>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace cairn::internal_core {

bool IsCastableFloat(DType dtype) {
  return dtype == DType::kF64 || dtype == DType::kF32 ||
         dtype == DType::kF16 || dtype == DType::kBF16;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // zero
  } else {
    // Subnormal: normalize.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t FloatToHalf(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u |
                                 (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs < 0x38800000u) {
    // Below the smallest normal half: a subnormal (or zero), rounded to
    // nearest even at 2^-24.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // 2^24
    return static_cast<uint16_t>(sign |
                                 static_cast<uint16_t>(std::nearbyint(scaled)));
  }
  // Normal: rebias and round the 13 dropped bits to nearest even.
  const uint32_t rebased = abs - 0x38000000u;
  const uint32_t rounded =
      rebased + 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

float BFloat16ToFloat(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

uint16_t FloatToBFloat16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  }
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

namespace {

double Read(DType d, const std::byte* p) {
  switch (d) {
    case DType::kF64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DType::kF32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::kF16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return HalfToFloat(v);
    }
    default: {  // kBF16
      uint16_t v;
      std::memcpy(&v, p, 2);
      return BFloat16ToFloat(v);
    }
  }
}

void Write(DType d, std::byte* p, double x) {
  switch (d) {
    case DType::kF64:
      std::memcpy(p, &x, 8);
      return;
    case DType::kF32: {
      const float v = static_cast<float>(x);
      std::memcpy(p, &v, 4);
      return;
    }
    case DType::kF16: {
      const uint16_t v = FloatToHalf(static_cast<float>(x));
      std::memcpy(p, &v, 2);
      return;
    }
    default: {  // kBF16
      const uint16_t v = FloatToBFloat16(static_cast<float>(x));
      std::memcpy(p, &v, 2);
      return;
    }
  }
}

}  // namespace

absl::Status Cast(DType from, const void* src, DType to, void* dst,
                  uint64_t n) {
  if (!IsCastableFloat(from) || !IsCastableFloat(to)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot cast ", std::string(DTypeName(from)), " to ",
        std::string(DTypeName(to)),
        ": casts are between F64, F32, F16 and BF16"));
  }
  const auto* s = static_cast<const std::byte*>(src);
  auto* d = static_cast<std::byte*>(dst);
  const size_t ss = DTypeSize(from);
  const size_t ds = DTypeSize(to);
  if (from == to) {
    std::memcpy(d, s, n * ss);
    return absl::OkStatus();
  }
  // The common case on its own loop: F32 weights to BF16.
  if (from == DType::kF32 && to == DType::kBF16) {
    for (uint64_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, s + 4 * i, 4);
      const uint16_t b = FloatToBFloat16(v);
      std::memcpy(d + 2 * i, &b, 2);
    }
    return absl::OkStatus();
  }
  // F64 to F16/BF16 rounds twice (through F32), as torch does not; the
  // difference is at most one unit in the last place, in rare ties.
  for (uint64_t i = 0; i < n; ++i) Write(to, d + ds * i, Read(from, s + ss * i));
  return absl::OkStatus();
}

}  // namespace cairn::internal_core
