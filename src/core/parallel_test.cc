#include "core/parallel.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace cairn::internal_core {
namespace {

TEST(ParallelTest, RunsEveryIndexOnce) {
  for (int threads : {1, 2, 8}) {
    std::vector<std::atomic<int>> hits(1000);
    ASSERT_TRUE(ParallelFor(1000, threads, [&](int64_t i) {
                  hits[i].fetch_add(1);
                  return absl::OkStatus();
                }).ok());
    for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  }
}

TEST(ParallelTest, EmptyRangeIsOk) {
  EXPECT_TRUE(ParallelFor(0, 4, [](int64_t) {
                return absl::InternalError("never called");
              }).ok());
}

TEST(ParallelTest, ReturnsLowestFailure) {
  absl::Status s = ParallelFor(100000, 4, [&](int64_t i) {
    if (i == 7 || i == 9) return absl::DataLossError(std::to_string(i));
    return absl::OkStatus();
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "7");
}

// With several threads, how many indices start before the others see the
// failure depends on scheduling (a loaded CI machine may run them all), so
// stopping early is checked with one thread, where it is deterministic.
TEST(ParallelTest, StopsStartingIndicesAfterAFailure) {
  std::atomic<int> ran{0};
  absl::Status s = ParallelFor(100000, 1, [&](int64_t i) {
    ran.fetch_add(1);
    if (i == 7) return absl::DataLossError("7");
    return absl::OkStatus();
  });
  EXPECT_EQ(s.message(), "7");
  EXPECT_EQ(ran.load(), 8);
}

}  // namespace
}  // namespace cairn::internal_core
