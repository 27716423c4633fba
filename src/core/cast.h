// Casting between floating-point dtypes (F64, F32, F16, BF16), rounding to
// nearest even, as torch's .to() does: the Hugging Face export's
// HfExportOptions::dtype.
#ifndef CAIRN_CORE_CAST_H_
#define CAIRN_CORE_CAST_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "cairn/dtype.h"

namespace cairn::internal_core {

// Whether `dtype` is one of the floating-point dtypes Cast converts.
bool IsCastableFloat(DType dtype);

// Converts `n` packed elements of `from` at `src` to `to` at `dst` (which
// may not overlap). kInvalidArgument unless both are castable floats.
// Infinities and NaNs stay what they are (a NaN stays a quiet NaN);
// finite values out of range become infinities.
absl::Status Cast(DType from, const void* src, DType to, void* dst,
                  uint64_t n);

// The single conversions, for tests.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_CAST_H_
