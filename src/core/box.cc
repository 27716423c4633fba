// Box math. Boxes come from users and from checkpoint metadata on disk, so
// every function here must stay well-defined on malformed input (mismatched
// vector lengths, negative or huge values): arithmetic that could overflow is
// done with overflow checks, never left to signed wrap-around (UB).
#include "cairn/box.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace cairn {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// offset + size, saturated at INT64_MAX; only for reporting and for
// comparisons on boxes that might not have been validated.
int64_t SaturatingEnd(int64_t offset, int64_t size) {
  int64_t end;
  if (__builtin_add_overflow(offset, size, &end)) {
    return size > 0 ? kInt64Max : std::numeric_limits<int64_t>::min();
  }
  return end;
}

bool WellFormed(const Box& box) {
  return box.offsets.size() == box.sizes.size();
}

}  // namespace

// Defined as 0 when any dimension is 0 or negative (a negative size is a bug
// elsewhere, but the count must not be negative), and saturated at INT64_MAX
// when the product overflows; ValidateBox reports both cases as errors.
int64_t NumElements(const Shape& shape) {
  // Zero first: {0, 2^40, 2^40} has 0 elements and must not report overflow.
  for (int64_t d : shape) {
    if (d <= 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return kInt64Max;
  }
  return n;
}

Box Box::Full(const Shape& shape) {
  return Box{std::vector<int64_t>(shape.size(), 0), shape};
}

bool Box::empty() const {
  return std::any_of(sizes.begin(), sizes.end(),
                     [](int64_t s) { return s <= 0; });
}

std::string Box::ToString() const {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i > 0) out += ", ";
    const int64_t offset = i < offsets.size() ? offsets[i] : 0;
    absl::StrAppend(&out, offset, ":", SaturatingEnd(offset, sizes[i]));
  }
  out += "]";
  return out;
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  if (a.rank() != b.rank() || !WellFormed(a) || !WellFormed(b) || a.empty() ||
      b.empty()) {
    return std::nullopt;
  }
  // Disjoint boxes first, without allocating: a planner asks this of every
  // stored chunk for every destination box, and most pairs do not meet.
  auto lo = [&](size_t i) { return std::max(a.offsets[i], b.offsets[i]); };
  auto hi = [&](size_t i) {
    return std::min(SaturatingEnd(a.offsets[i], a.sizes[i]),
                    SaturatingEnd(b.offsets[i], b.sizes[i]));
  };
  for (size_t i = 0; i < a.sizes.size(); ++i) {
    if (hi(i) <= lo(i)) return std::nullopt;
  }
  Box out;
  out.offsets.resize(a.sizes.size());
  out.sizes.resize(a.sizes.size());
  for (size_t i = 0; i < a.sizes.size(); ++i) {
    out.offsets[i] = lo(i);
    out.sizes[i] = hi(i) - lo(i);
  }
  return out;
}

bool Contains(const Box& outer, const Box& inner) {
  if (outer.rank() != inner.rank() || !WellFormed(outer) ||
      !WellFormed(inner)) {
    return false;
  }
  for (size_t i = 0; i < outer.sizes.size(); ++i) {
    if (inner.sizes[i] < 0 || outer.sizes[i] < 0) return false;
    if (inner.offsets[i] < outer.offsets[i]) return false;
    // A box whose end overflows contains nothing and is inside nothing.
    int64_t inner_end, outer_end;
    if (__builtin_add_overflow(inner.offsets[i], inner.sizes[i], &inner_end) ||
        __builtin_add_overflow(outer.offsets[i], outer.sizes[i], &outer_end) ||
        inner_end > outer_end) {
      return false;
    }
  }
  return true;
}

absl::Status ValidateBox(const Box& box, const Shape& shape) {
  if (box.offsets.size() != box.sizes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("box has ", box.offsets.size(), " offsets but ",
                     box.sizes.size(), " sizes"));
  }
  if (box.sizes.size() != shape.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("box ", box.ToString(), " has rank ", box.sizes.size(),
                     " but the tensor shape [", absl::StrJoin(shape, ", "),
                     "] has rank ", shape.size()));
  }
  int64_t shape_elements = 1;
  int64_t box_elements = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t offset = box.offsets[i];
    const int64_t size = box.sizes[i];
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor shape [", absl::StrJoin(shape, ", "),
                       "] has a negative size in dimension ", i));
    }
    if (offset < 0 || size < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("box ", box.ToString(), " has a negative ",
                       offset < 0 ? "offset" : "size", " in dimension ", i));
    }
    int64_t end;
    if (__builtin_add_overflow(offset, size, &end)) {
      return absl::InvalidArgumentError(
          absl::StrCat("box offset ", offset, " + size ", size,
                       " overflows int64 in dimension ", i));
    }
    if (end > shape[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("box ", box.ToString(), " exceeds the tensor shape [",
                       absl::StrJoin(shape, ", "), "] in dimension ", i));
    }
    // Products are checked even past a zero dimension: a shape whose element
    // count overflows is unusable however it is sliced.
    if (__builtin_mul_overflow(shape_elements, std::max<int64_t>(shape[i], 1),
                               &shape_elements) ||
        __builtin_mul_overflow(box_elements, std::max<int64_t>(size, 1),
                               &box_elements)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the element count of tensor shape [",
                       absl::StrJoin(shape, ", "), "] overflows int64"));
    }
  }
  return absl::OkStatus();
}

}  // namespace cairn
