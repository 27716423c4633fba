// Box: an axis-aligned block of a tensor's global index space, given by the
// offset of its first element and its size along each dimension. A shard of a
// sharded tensor, a stored chunk and a destination region are all boxes.
//
// Box math is pure: no allocation beyond the result, no state.
#ifndef CAIRN_BOX_H_
#define CAIRN_BOX_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace cairn {

// Sizes of a tensor along each dimension, outermost first (row-major).
using Shape = std::vector<int64_t>;

// Number of elements of `shape` (1 for a rank-0 shape).
int64_t NumElements(const Shape& shape);

struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;

  // The box covering all of `shape`.
  static Box Full(const Shape& shape);

  int rank() const { return static_cast<int>(sizes.size()); }
  int64_t num_elements() const { return NumElements(sizes); }
  // True when some dimension has size 0 (a rank-0 box is never empty).
  bool empty() const;
  // "[0:1024, 512:4096]" (start:end per dimension).
  std::string ToString() const;

  friend bool operator==(const Box&, const Box&) = default;
};

// The common part of `a` and `b`; nullopt when they do not overlap, either is
// empty, or their ranks differ.
std::optional<Box> Intersect(const Box& a, const Box& b);

// True when `inner` lies inside `outer` (same rank).
bool Contains(const Box& outer, const Box& inner);

// OK when `box` has the rank of `shape`, non-negative offsets and sizes, and
// lies inside `shape` (without integer overflow); else kInvalidArgument
// describing the problem.
absl::Status ValidateBox(const Box& box, const Shape& shape);

}  // namespace cairn

#endif  // CAIRN_BOX_H_
