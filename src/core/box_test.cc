#include "cairn/box.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

TEST(BoxTest, NumElements) {
  struct Case {
    Shape shape;
    int64_t expected;
  };
  const Case cases[] = {
      {{}, 1},
      {{0}, 0},
      {{7}, 7},
      {{2, 3, 4}, 24},
      {{4096, 4096}, 16777216},
      {{3, 0, 5}, 0},
      {{0, kMax, kMax}, 0},  // zero wins over overflow
      {{kMax, 2}, kMax},     // overflow saturates
      {{-1, 4}, 0},          // negative sizes count as empty
  };
  for (const Case& c : cases) {
    EXPECT_EQ(NumElements(c.shape), c.expected)
        << "shape size " << c.shape.size();
  }
}

TEST(BoxTest, FullCoversShape) {
  const Box full = Box::Full({4, 5});
  EXPECT_EQ(full.offsets, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(full.sizes, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(full.rank(), 2);
  EXPECT_EQ(full.num_elements(), 20);
  EXPECT_EQ(Box::Full({}).rank(), 0);
}

TEST(BoxTest, Empty) {
  EXPECT_FALSE(Box{}.empty()) << "rank 0 is one element";
  EXPECT_EQ(Box{}.num_elements(), 1);
  EXPECT_TRUE((Box{{0, 0}, {3, 0}}.empty()));
  EXPECT_FALSE((Box{{0, 0}, {3, 1}}.empty()));
}

TEST(BoxTest, ToString) {
  EXPECT_EQ((Box{{0, 512}, {1024, 3584}}.ToString()), "[0:1024, 512:4096]");
  EXPECT_EQ(Box{}.ToString(), "[]");
  EXPECT_EQ((Box{{5}, {0}}.ToString()), "[5:5]");
}

TEST(BoxTest, Intersect) {
  struct Case {
    Box a, b;
    std::optional<Box> expected;
  };
  const Case cases[] = {
      {{{0, 0}, {4, 4}}, {{2, 2}, {4, 4}}, Box{{2, 2}, {2, 2}}},
      {{{0, 0}, {4, 4}}, {{1, 1}, {2, 2}}, Box{{1, 1}, {2, 2}}},
      {{{0}, {10}}, {{0}, {10}}, Box{{0}, {10}}},
      {{{0}, {5}}, {{5}, {5}}, std::nullopt},  // touching, not overlapping
      {{{0}, {5}}, {{7}, {5}}, std::nullopt},  // disjoint
      {{{0, 0}, {4, 4}}, {{0, 4}, {4, 4}}, std::nullopt},
      {{{0}, {0}}, {{0}, {5}}, std::nullopt},        // empty
      {{{0}, {5}}, {{0, 0}, {5, 5}}, std::nullopt},  // rank mismatch
      {{}, {}, Box{}},                               // two scalars
      {{{kMax - 1}, {1}}, {{0}, {kMax}}, Box{{kMax - 1}, {1}}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Intersect(c.a, c.b), c.expected)
        << c.a.ToString() << " & " << c.b.ToString();
    EXPECT_EQ(Intersect(c.b, c.a), c.expected)
        << c.b.ToString() << " & " << c.a.ToString();
  }
}

TEST(BoxTest, IntersectionOfDisjointBoxesIsEmpty) {
  EXPECT_FALSE(Intersect(Box{{0, 0}, {2, 2}}, Box{{2, 0}, {2, 2}}));
  EXPECT_FALSE(Intersect(Box{{0, 0}, {2, 2}}, Box{{5, 5}, {1, 1}}));
}

TEST(BoxTest, IntersectMalformedBoxIsNullopt) {
  EXPECT_FALSE(Intersect(Box{{0}, {2, 2}}, Box{{0, 0}, {2, 2}}));
}

TEST(BoxTest, Contains) {
  struct Case {
    Box outer, inner;
    bool expected;
  };
  const Case cases[] = {
      {{{0, 0}, {4, 4}}, {{1, 1}, {2, 2}}, true},
      {{{0, 0}, {4, 4}}, {{0, 0}, {4, 4}}, true},
      {{{0, 0}, {4, 4}}, {{3, 3}, {2, 1}}, false},
      {{{2}, {4}}, {{1}, {2}}, false},
      {{{2}, {4}}, {{6}, {0}}, true},   // empty at the end
      {{{2}, {4}}, {{7}, {0}}, false},  // empty but outside
      {{{0}, {4}}, {{0, 0}, {1, 1}}, false},
      {{}, {}, true},
      {{{0}, {kMax}}, {{kMax - 1}, {kMax}}, false},  // end overflows
      {{{0}, {4}}, {{1}, {-1}}, false},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Contains(c.outer, c.inner), c.expected)
        << c.outer.ToString() << " contains " << c.inner.ToString();
  }
}

TEST(BoxTest, ValidateBoxAcceptsBoxesInside) {
  EXPECT_TRUE(ValidateBox(Box{{0, 0}, {4, 5}}, {4, 5}).ok());
  EXPECT_TRUE(ValidateBox(Box{{1, 2}, {3, 3}}, {4, 5}).ok());
  EXPECT_TRUE(ValidateBox(Box{{4, 0}, {0, 5}}, {4, 5}).ok());
  EXPECT_TRUE(ValidateBox(Box{}, {}).ok());
  EXPECT_TRUE(ValidateBox(Box{{0, 0}, {0, 0}}, {0, 0}).ok());
}

TEST(BoxTest, ValidateBoxRejectsBadBoxes) {
  struct Case {
    const char* name;
    Box box;
    Shape shape;
    const char* message_part;
  };
  const Case cases[] = {
      {"rank mismatch", {{0}, {4}}, {4, 4}, "rank"},
      {"offsets/sizes mismatch", {{0, 0}, {4}}, {4}, "offsets"},
      {"negative offset", {{-1, 0}, {2, 2}}, {4, 4}, "negative offset"},
      {"negative size", {{0, 0}, {2, -2}}, {4, 4}, "negative size"},
      {"past the end", {{3, 0}, {2, 4}}, {4, 4}, "exceeds"},
      {"offset past the end", {{5}, {0}}, {4}, "exceeds"},
      {"end overflows", {{kMax}, {1}}, {kMax}, "overflows"},
      {"end overflows big", {{kMax - 5}, {kMax}}, {kMax}, "overflows"},
      {"count overflows",
       {{0, 0}, {1 << 20, 1 << 20}},
       {kMax / 2, kMax / 2},
       "overflows"},
      {"count overflows past zero",
       {{0, 0, 0}, {0, 1, 1}},
       {0, kMax, kMax},
       "overflows"},
      {"negative shape", {{0}, {0}}, {-3}, "negative"},
  };
  for (const Case& c : cases) {
    const absl::Status status = ValidateBox(c.box, c.shape);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(std::string(status.message()),
                testing::HasSubstr(c.message_part))
        << c.name << ": " << status;
  }
}

}  // namespace
}  // namespace cairn
