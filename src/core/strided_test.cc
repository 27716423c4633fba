#include "core/strided.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace cairn::internal_core {
namespace {

using Runs = std::vector<std::pair<int64_t, int64_t>>;  // (offset, bytes)

// Calls fn(index) for every index of `sizes` in row-major order.
template <typename Fn>
void ForEachIndex(const std::vector<int64_t>& sizes, Fn fn) {
  for (int64_t s : sizes) {
    if (s <= 0) return;
  }
  std::vector<int64_t> index(sizes.size(), 0);
  while (true) {
    fn(index);
    int d = static_cast<int>(sizes.size()) - 1;
    for (; d >= 0; --d) {
      if (++index[d] < sizes[d]) break;
      index[d] = 0;
    }
    if (d < 0) return;
  }
}

// Brute force: the byte range of every element of `inner`, merged where
// adjacent.
Runs ReferenceRuns(const Box& outer, const Box& inner, size_t elem_size) {
  Runs runs;
  ForEachIndex(inner.sizes, [&](const std::vector<int64_t>& index) {
    int64_t offset = 0;
    for (int i = 0; i < outer.rank(); ++i) {
      offset = offset * outer.sizes[i] +
               (inner.offsets[i] + index[i] - outer.offsets[i]);
    }
    offset *= static_cast<int64_t>(elem_size);
    if (!runs.empty() && runs.back().first + runs.back().second == offset) {
      runs.back().second += static_cast<int64_t>(elem_size);
    } else {
      runs.emplace_back(offset, static_cast<int64_t>(elem_size));
    }
  });
  return runs;
}

Runs ExpandPattern(const RunPattern& pattern) {
  Runs runs;
  ForEachRun(pattern, [&](int64_t offset) {
    runs.emplace_back(offset, pattern.run_bytes);
  });
  return runs;
}

std::string Describe(const Box& outer, const Box& inner, size_t elem_size) {
  return outer.ToString() + " / " + inner.ToString() +
         " elem=" + std::to_string(elem_size);
}

TEST(StridedTest, SubBoxRunsTable) {
  struct Case {
    Box outer, inner;
    size_t elem_size;
    RunPattern expected;
  };
  const Case cases[] = {
      // Whole rows coalesce into one run.
      {{{0, 0}, {4, 8}}, {{1, 0}, {2, 8}}, 4, {32, 64, {}, {}}},
      // The whole box is one run.
      {{{0, 0, 0}, {2, 3, 4}}, {{0, 0, 0}, {2, 3, 4}}, 2, {0, 48, {}, {}}},
      // A column: one run per row.
      {{{0, 0}, {100000, 16}},
       {{0, 3}, {100000, 1}},
       4,
       {12, 4, {100000}, {64}}},
      // Outer loops merge: dims 0 and 1 are one progression.
      {{{0, 0, 0}, {4, 6, 8}}, {{0, 0, 2}, {4, 6, 2}}, 1, {2, 2, {24}, {8}}},
      // Size-1 dimensions drop out.
      {{{0, 0, 0}, {4, 6, 8}},
       {{1, 2, 2}, {1, 3, 2}},
       1,
       {48 + 16 + 2, 2, {3}, {8}}},
      // Absolute coordinates: the outer box need not start at 0.
      {{{10, 20}, {4, 8}}, {{11, 22}, {2, 3}}, 8, {(8 + 2) * 8, 24, {2}, {64}}},
      // Rank 0: a single element.
      {{}, {}, 4, {0, 4, {}, {}}},
      // Empty.
      {{{0, 0}, {4, 8}}, {{1, 0}, {0, 8}}, 4, {0, 0, {}, {}}},
  };
  for (const Case& c : cases) {
    const RunPattern p = SubBoxRuns(c.outer, c.inner, c.elem_size);
    const std::string what = Describe(c.outer, c.inner, c.elem_size);
    EXPECT_EQ(p.first_offset, c.expected.first_offset) << what;
    EXPECT_EQ(p.run_bytes, c.expected.run_bytes) << what;
    EXPECT_EQ(p.counts, c.expected.counts) << what;
    EXPECT_EQ(p.strides, c.expected.strides) << what;
  }
}

TEST(StridedTest, EmptyPatternHasNoRuns) {
  const RunPattern p = SubBoxRuns(Box{{0, 0}, {4, 8}}, Box{{4, 8}, {0, 0}}, 4);
  EXPECT_EQ(p.num_runs(), 0);
  EXPECT_EQ(p.total_bytes(), 0);
  int calls = 0;
  ForEachRun(p, [&](int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(StridedTest, NumRunsAndTotalBytes) {
  RunPattern p{0, 16, {3, 5}, {1000, 100}};
  EXPECT_EQ(p.num_runs(), 15);
  EXPECT_EQ(p.total_bytes(), 240);
  RunPattern single{8, 16, {}, {}};
  EXPECT_EQ(single.num_runs(), 1);
  EXPECT_EQ(single.total_bytes(), 16);
}

TEST(StridedTest, ForEachRunVisitsInIncreasingOrder) {
  RunPattern p{5, 2, {2, 3, 4}, {1000, 100, 10}};
  std::vector<int64_t> offsets;
  ForEachRun(p, [&](int64_t offset) { offsets.push_back(offset); });
  ASSERT_EQ(offsets.size(), 24u);
  std::vector<int64_t> expected;
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 3; ++b)
      for (int c = 0; c < 4; ++c)
        expected.push_back(5 + a * 1000 + b * 100 + c * 10);
  EXPECT_EQ(offsets, expected);
}

// Random outer boxes of rank 0-4 with uneven sizes and random sub-boxes
// (including empty ones), checked against the element-by-element reference.
TEST(StridedTest, SubBoxRunsMatchesBruteForce) {
  std::mt19937_64 rng(20240611);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 3000; ++iter) {
    const int rank = static_cast<int>(uniform(0, 4));
    Box outer, inner;
    for (int i = 0; i < rank; ++i) {
      const int64_t size = uniform(1, 7);
      outer.offsets.push_back(uniform(0, 20));
      outer.sizes.push_back(size);
      // Often full, sometimes partial, occasionally empty.
      int64_t lo = 0, hi = size;
      switch (uniform(0, 5)) {
        case 0:
        case 1:
          break;
        case 2:
          lo = uniform(0, size);
          hi = lo;
          if (uniform(0, 3) != 0) {
            lo = uniform(0, size - 1);
            hi = uniform(lo + 1, size);
          }
          break;
        default:
          lo = uniform(0, size - 1);
          hi = uniform(lo + 1, size);
      }
      inner.offsets.push_back(outer.offsets.back() + lo);
      inner.sizes.push_back(hi - lo);
    }
    const size_t elem_size = std::vector<size_t>{1, 2, 4, 8, 3}[uniform(0, 4)];
    const std::string what = Describe(outer, inner, elem_size);
    const RunPattern p = SubBoxRuns(outer, inner, elem_size);
    const Runs expected = ReferenceRuns(outer, inner, elem_size);
    const Runs actual = ExpandPattern(p);
    EXPECT_EQ(actual, expected) << what;
    EXPECT_EQ(p.num_runs(), static_cast<int64_t>(expected.size())) << what;
    EXPECT_EQ(p.total_bytes(),
              inner.num_elements() * static_cast<int64_t>(elem_size))
        << what;
    EXPECT_EQ(p.counts.size(), p.strides.size()) << what;
    if (!expected.empty()) {
      EXPECT_EQ(p.first_offset, expected.front().first) << what;
    }
    if (::testing::Test::HasFailure()) break;
  }
}

// A random strided layout for `shape`: dimensions padded and laid out in a
// random order. Returns byte strides and the buffer size in bytes.
std::pair<std::vector<int64_t>, int64_t> RandomLayout(
    const std::vector<int64_t>& shape, size_t elem_size, std::mt19937_64& rng,
    bool allow_broadcast) {
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const int rank = static_cast<int>(shape.size());
  std::vector<int> order(rank);
  std::iota(order.begin(), order.end(), 0);
  if (uniform(0, 2) == 0) std::shuffle(order.begin(), order.end(), rng);
  std::vector<int64_t> strides(rank);
  int64_t stride = static_cast<int64_t>(elem_size);
  for (int j = rank - 1; j >= 0; --j) {
    const int d = order[j];
    if (allow_broadcast && uniform(0, 9) == 0) {
      strides[d] = 0;
      continue;
    }
    strides[d] = stride;
    const int64_t padded = shape[d] + (uniform(0, 3) == 0 ? uniform(1, 3) : 0);
    stride *= std::max<int64_t>(padded, 1);
  }
  return {strides, stride};
}

void ReferenceCopy(const char* src, const std::vector<int64_t>& src_strides,
                   char* dst, const std::vector<int64_t>& dst_strides,
                   const std::vector<int64_t>& shape, size_t elem_size) {
  ForEachIndex(shape, [&](const std::vector<int64_t>& index) {
    int64_t s = 0, d = 0;
    for (size_t i = 0; i < shape.size(); ++i) {
      s += index[i] * src_strides[i];
      d += index[i] * dst_strides[i];
    }
    std::memcpy(dst + d, src + s, elem_size);
  });
}

TEST(StridedTest, CopyStridedMatchesBruteForce) {
  std::mt19937_64 rng(7);
  auto uniform = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  for (int iter = 0; iter < 3000; ++iter) {
    const int rank = static_cast<int>(uniform(0, 4));
    std::vector<int64_t> shape;
    for (int i = 0; i < rank; ++i) {
      shape.push_back(uniform(0, 20) == 0 ? 0 : uniform(1, 6));
    }
    const size_t elem_size =
        std::vector<size_t>{1, 2, 4, 8, 16, 3, 6}[uniform(0, 6)];
    auto [src_strides, src_bytes] =
        RandomLayout(shape, elem_size, rng, /*allow_broadcast=*/true);
    auto [dst_strides, dst_bytes] =
        RandomLayout(shape, elem_size, rng, /*allow_broadcast=*/false);
    std::vector<char> src(src_bytes);
    for (char& c : src) c = static_cast<char>(rng());
    std::vector<char> expected(dst_bytes, '\x5a');
    std::vector<char> actual(dst_bytes, '\x5a');
    ReferenceCopy(src.data(), src_strides, expected.data(), dst_strides, shape,
                  elem_size);
    CopyStrided(src.data(), src_strides.data(), actual.data(),
                dst_strides.data(), shape.data(), rank, elem_size);
    ASSERT_EQ(actual, expected)
        << "iter " << iter << " rank " << rank << " elem " << elem_size;
  }
}

TEST(StridedTest, CopyStridedContiguousIsOneMemcpy) {
  // 3-d contiguous block into a contiguous destination: all dims merge.
  std::vector<int32_t> src(2 * 3 * 5);
  std::iota(src.begin(), src.end(), 0);
  std::vector<int32_t> dst(src.size(), -1);
  const int64_t shape[] = {2, 3, 5};
  const int64_t strides[] = {60, 20, 4};
  CopyStrided(src.data(), strides, dst.data(), strides, shape, 3, 4);
  EXPECT_EQ(dst, src);
}

TEST(StridedTest, CopyStridedTransposes) {
  // src is 2x3 row-major; dst receives its transpose view (3x2).
  const int16_t src[] = {1, 2, 3, 4, 5, 6};
  int16_t dst[6] = {};
  const int64_t shape[] = {3, 2};
  const int64_t src_strides[] = {2, 6};  // bytes: column-major walk of src
  const int64_t dst_strides[] = {4, 2};
  CopyStrided(src, src_strides, dst, dst_strides, shape, 2, 2);
  const int16_t expected[] = {1, 4, 2, 5, 3, 6};
  EXPECT_TRUE(std::equal(std::begin(dst), std::end(dst), std::begin(expected)));
}

TEST(StridedTest, CopyStridedRankZeroCopiesOneElement) {
  const double src = 3.25;
  double dst = 0;
  CopyStrided(&src, nullptr, &dst, nullptr, nullptr, 0, sizeof(double));
  EXPECT_EQ(dst, 3.25);
}

TEST(StridedTest, CopyStridedEmptyCopiesNothing) {
  const int64_t shape[] = {4, 0};
  const int64_t strides[] = {8, 4};
  // Null buffers: an empty copy must not touch them.
  CopyStrided(nullptr, strides, nullptr, strides, shape, 2, 4);
}

// Any byte range of the row-major image of a padded, possibly transposed
// view, including ranges that cut elements, equals the same range of the
// image built element by element.
TEST(StridedTest, CopyRowMajorBytesMatchesBruteForce) {
  std::mt19937_64 rng(11);
  const DType dtypes[] = {DType::kU8, DType::kI16, DType::kF32, DType::kF64};
  for (int iter = 0; iter < 2000; ++iter) {
    const DType dtype = dtypes[rng() % 4];
    const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
    const int rank = 1 + static_cast<int>(rng() % 3);
    Shape shape(rank), padded(rank);
    for (int d = 0; d < rank; ++d) {
      shape[d] = 1 + static_cast<int64_t>(rng() % 5);
      padded[d] = shape[d] + static_cast<int64_t>(rng() % 2);
    }
    std::vector<int64_t> strides = ContiguousStrides(padded);
    if (rank >= 2 && rng() % 2) {  // last two dimensions transposed in memory
      strides[rank - 1] = padded[rank - 2];
      strides[rank - 2] = 1;
    }
    int64_t span = 1;
    for (int d = 0; d < rank; ++d) span += (shape[d] - 1) * strides[d];
    std::vector<std::byte> memory(span * es);
    for (auto& b : memory) b = static_cast<std::byte>(rng());
    const TensorView view(memory.data(), dtype, shape, strides);

    // The whole image, element by element.
    const int64_t n = NumElements(shape);
    std::vector<std::byte> image(n * es);
    for (int64_t e = 0; e < n; ++e) {
      int64_t rest = e, offset = 0;
      for (int d = rank - 1; d >= 0; --d) {
        offset += (rest % shape[d]) * strides[d];
        rest /= shape[d];
      }
      std::memcpy(image.data() + e * es, memory.data() + offset * es, es);
    }
    uint64_t begin = rng() % (image.size() + 1);
    uint64_t end = rng() % (image.size() + 1);
    if (begin > end) std::swap(begin, end);
    std::vector<std::byte> out(end - begin + 1, std::byte{0x5a});
    CopyRowMajorBytes(view, begin, end, out.data());
    ASSERT_EQ(std::memcmp(out.data(), image.data() + begin, end - begin), 0)
        << "iteration " << iter << " bytes [" << begin << ", " << end << ")";
    ASSERT_EQ(out.back(), std::byte{0x5a}) << "wrote past the range";
  }
}

}  // namespace
}  // namespace cairn::internal_core
