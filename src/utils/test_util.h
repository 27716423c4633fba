// Helpers for the state-dict utility tests (in-process and MPI): tensors
// whose every element encodes its global index, so that a misplaced,
// missing or doubled element is caught byte for byte; and a communicator
// wrapper that records the sizes of the transfers.
#ifndef CAIRN_UTILS_TEST_UTIL_H_
#define CAIRN_UTILS_TEST_UTIL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cairn/box.h"
#include "cairn/communicator.h"
#include "comm/counting_communicator.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"
#include "gtest/gtest.h"

namespace cairn::testing_util {

// The bytes of element `index` (global, row-major) of a tensor tagged
// `salt`: a mix of both, so that neighbours and tensors differ.
inline uint64_t ElementValue(int64_t index, uint64_t salt) {
  uint64_t x = static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull + salt;
  x ^= x >> 29;
  return x * 0xBF58476D1CE4E5B9ull;
}

// Calls fn(global linear index, element offset in `view`) for every element
// of `box` (global coordinates of a tensor of `global`), `view` holding it.
template <typename Fn>
void ForEachElement(const Shape& global, const Box& box, const TensorView& view,
                    Fn fn) {
  if (box.empty()) return;
  const int rank = box.rank();
  const std::vector<int64_t> gstrides = ContiguousStrides(global);
  std::vector<int64_t> idx(rank, 0);
  while (true) {
    int64_t g = 0, off = 0;
    for (int d = 0; d < rank; ++d) {
      g += (box.offsets[d] + idx[d]) * gstrides[d];
      off += idx[d] * view.strides()[d];
    }
    fn(g, off);
    int d = rank - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < box.sizes[d]) break;
      idx[d] = 0;
    }
    if (d < 0) return;
  }
}

// Writes each element's value into `view`, which holds `box` of `global`.
inline void FillBox(const TensorView& view, const Shape& global, const Box& box,
                    uint64_t salt) {
  const size_t es = DTypeSize(view.dtype());
  auto* base = static_cast<unsigned char*>(view.data());
  ForEachElement(global, box, view, [&](int64_t g, int64_t off) {
    const uint64_t v = ElementValue(g, salt);
    std::memcpy(base + off * static_cast<int64_t>(es), &v, es);
  });
}

// How many elements of `view` (holding `box` of `global`) have the wrong
// value; EXPECTs none.
inline int64_t CountWrong(const TensorView& view, const Shape& global,
                          const Box& box, uint64_t salt) {
  const size_t es = DTypeSize(view.dtype());
  const auto* base = static_cast<const unsigned char*>(view.data());
  int64_t wrong = 0;
  ForEachElement(global, box, view, [&](int64_t g, int64_t off) {
    const uint64_t v = ElementValue(g, salt);
    if (std::memcmp(base + off * static_cast<int64_t>(es), &v, es) != 0) {
      ++wrong;
    }
  });
  EXPECT_EQ(wrong, 0) << "elements of " << box.ToString() << " out of place";
  return wrong;
}

// A new contiguous tensor holding `box` of a tensor of `global` tagged
// `salt`.
inline Tensor MakePart(DType dtype, const Shape& global, const Box& box,
                       uint64_t salt) {
  Tensor t = *Tensor::Empty(dtype, box.sizes);
  FillBox(t.view(), global, box, salt);
  return t;
}

// A strided view of `box`: the box's transpose-free image inside a padded
// buffer (every row `pad` elements longer), owned by the returned tensor.
inline TensorView PaddedView(const Tensor& padded, const Box& box, int pad) {
  std::vector<int64_t> strides = ContiguousStrides(box.sizes);
  const int rank = box.rank();
  if (rank >= 1) {
    int64_t stride = 1;
    for (int d = rank - 1; d >= 0; --d) {
      strides[d] = stride;
      stride *= box.sizes[d] + (d == rank - 1 ? pad : 0);
    }
  }
  return TensorView(padded.data(), padded.dtype(), box.sizes, strides);
}

// A buffer big enough for PaddedView(box, pad).
inline Tensor PaddedBuffer(DType dtype, const Box& box, int pad) {
  Shape s = box.sizes;
  if (!s.empty()) s.back() += pad;
  return *Tensor::Zeros(dtype, s);
}


}  // namespace cairn::testing_util

#endif  // CAIRN_UTILS_TEST_UTIL_H_
