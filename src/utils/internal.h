// Helpers shared by the state-dict utilities: checks of views, and the
// cutting of a box into bounded pieces.
#ifndef CAIRN_UTILS_INTERNAL_H_
#define CAIRN_UTILS_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/box.h"
#include "cairn/communicator.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"

namespace cairn::internal_utils {

// The wire codec and status agreement are shared with save and load:
// core/byte_codec.h (ByteWriter, ByteReader) and comm/collective.h (Seal,
// Unseal, CombineStatuses, AgreeOnStatus).

// "[4, 8]".
std::string ShapeString(const Shape& shape);

// kInvalidArgument naming `where` unless every size of `shape` is >= 0 and
// its byte size (for `dtype`) fits in int64.
absl::Status ValidateShape(std::string_view where, const Shape& shape,
                           DType dtype);

// OK when `view` can be read or written as `dtype` elements of `shape` in
// host memory: else kUnimplemented for device memory, kInvalidArgument for
// another dtype or shape, negative strides, or no data. Errors start with
// `where`.
absl::Status ValidateHostView(std::string_view where, const TensorView& view,
                              DType dtype, const Shape& shape);


// `box` cut into boxes of at most `max_bytes` bytes each (at least one
// element each), in row-major order: whole outer slabs where they fit, so
// that pieces stay as large and as few as the budget allows. An empty box
// gives no pieces.
std::vector<Box> SplitIntoPieces(const Box& box, size_t elem_size,
                                 uint64_t max_bytes);

}  // namespace cairn::internal_utils

#endif  // CAIRN_UTILS_INTERNAL_H_
