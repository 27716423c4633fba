#include "utils/internal.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/checked.h"
#include "core/status.h"
#include "core/strided.h"

namespace cairn::internal_utils {
std::string ShapeString(const Shape& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status ValidateShape(std::string_view where, const Shape& shape,
                           DType dtype) {
  if (!internal_core::CheckedBytes(shape, dtype).has_value()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: shape %s has a negative size or is too large",
                        where, ShapeString(shape)));
  }
  return absl::OkStatus();
}

absl::Status ValidateHostView(std::string_view where, const TensorView& view,
                              DType dtype, const Shape& shape) {
  if (!view.device().is_cpu()) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: tensor on %s; this operation handles host memory only "
        "(OffloadToHost copies device tensors to the host)",
        where, view.device().ToString()));
  }
  if (view.dtype() != dtype) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: view dtype %s differs from tensor dtype %s", where,
                        DTypeName(view.dtype()), DTypeName(dtype)));
  }
  if (view.shape() != shape) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: view shape %s differs from the expected %s", where,
                        ShapeString(view.shape()), ShapeString(shape)));
  }
  for (int64_t s : view.strides()) {
    if (s < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: view has negative strides", where));
    }
  }
  if (view.data() == nullptr && view.num_elements() > 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: view has elements but no data", where));
  }
  return absl::OkStatus();
}

// Finds the outermost dimension k whose slabs (one index of k, all of the
// dimensions inside it) fit the budget; dimensions outside k are walked
// index by index and k is cut into runs of as many slabs as fit.
std::vector<Box> SplitIntoPieces(const Box& box, size_t elem_size,
                                 uint64_t max_bytes) {
  std::vector<Box> pieces;
  if (box.empty()) return pieces;
  const uint64_t budget = std::max<uint64_t>(max_bytes, elem_size);
  const int rank = box.rank();
  // slab[d]: bytes of one index of dimension d (saturated; only compared).
  std::vector<uint64_t> slab(rank + 1, elem_size);
  for (int d = rank - 1; d >= 0; --d) {
    if (__builtin_mul_overflow(slab[d + 1], static_cast<uint64_t>(box.sizes[d]),
                               &slab[d])) {
      slab[d] = UINT64_MAX;
    }
  }
  // slab[0] is the whole box (slab[rank] is one element).
  if (rank == 0 || slab[0] <= budget) return {box};
  int k = 0;
  while (slab[k + 1] > budget) ++k;
  const int64_t step = static_cast<int64_t>(std::min<uint64_t>(
      budget / slab[k + 1], static_cast<uint64_t>(box.sizes[k])));
  std::vector<int64_t> index(k, 0);  // odometer over dimensions [0, k)
  while (true) {
    for (int64_t start = 0; start < box.sizes[k]; start += step) {
      Box piece = box;
      for (int d = 0; d < k; ++d) {
        piece.offsets[d] = box.offsets[d] + index[d];
        piece.sizes[d] = 1;
      }
      piece.offsets[k] = box.offsets[k] + start;
      piece.sizes[k] = std::min(step, box.sizes[k] - start);
      pieces.push_back(std::move(piece));
    }
    int d = k - 1;
    for (; d >= 0; --d) {
      if (++index[d] < box.sizes[d]) break;
      index[d] = 0;
    }
    if (d < 0) break;
  }
  return pieces;
}

}  // namespace cairn::internal_utils
