#include "core/parallel.h"

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace cairn::internal_core {
namespace {

// The loop semantics, checked on the free function and on a pool's
// ParallelFor (a pool used again for each call, so threads kept from one
// loop serve the next).
using Loop = std::function<absl::Status(
    int64_t, int, absl::FunctionRef<absl::Status(int64_t)>)>;
std::vector<Loop> Loops(WorkerPool& pool) {
  return {ParallelFor,
          [&pool](int64_t n, int threads,
                  absl::FunctionRef<absl::Status(int64_t)> fn) {
            return pool.ParallelFor(n, threads, fn);
          }};
}

TEST(ParallelTest, RunsEveryIndexOnce) {
  WorkerPool pool;
  for (const Loop& loop : Loops(pool)) {
    for (int threads : {1, 2, 8}) {
      std::vector<std::atomic<int>> hits(1000);
      ASSERT_TRUE(loop(1000, threads, [&](int64_t i) {
                    hits[i].fetch_add(1);
                    return absl::OkStatus();
                  }).ok());
      for (auto& h : hits) EXPECT_EQ(h.load(), 1);
    }
  }
}

TEST(ParallelTest, EmptyRangeIsOk) {
  WorkerPool pool;
  for (const Loop& loop : Loops(pool)) {
    EXPECT_TRUE(loop(0, 4, [](int64_t) {
                  return absl::InternalError("never called");
                }).ok());
  }
  EXPECT_EQ(pool.started(), 0u);
}

TEST(ParallelTest, ReturnsLowestFailure) {
  WorkerPool pool;
  for (const Loop& loop : Loops(pool)) {
    absl::Status s = loop(100000, 4, [&](int64_t i) {
      if (i == 7 || i == 9) return absl::DataLossError(std::to_string(i));
      return absl::OkStatus();
    });
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(s.message(), "7");
  }
}

// With several threads, how many indices start before the others see the
// failure depends on scheduling (a loaded CI machine may run them all), so
// stopping early is checked with one thread, where it is deterministic.
TEST(ParallelTest, StopsStartingIndicesAfterAFailure) {
  WorkerPool pool;
  for (const Loop& loop : Loops(pool)) {
    std::atomic<int> ran{0};
    absl::Status s = loop(100000, 1, [&](int64_t i) {
      ran.fetch_add(1);
      if (i == 7) return absl::DataLossError("7");
      return absl::OkStatus();
    });
    EXPECT_EQ(s.message(), "7");
    EXPECT_EQ(ran.load(), 8);
  }
}

TEST(WorkerPoolTest, RunsEveryIndexOnceAndKeepsItsThreads) {
  WorkerPool pool;
  std::mutex mu;
  std::set<std::thread::id> seen;
  for (int call = 0; call < 200; ++call) {
    const int64_t n = 1 + call % 37;
    std::vector<std::atomic<int>> hits(n);
    ASSERT_TRUE(pool.ParallelFor(n, 4, [&](int64_t i) {
                      hits[i].fetch_add(1);
                      std::lock_guard<std::mutex> lock(mu);
                      seen.insert(std::this_thread::get_id());
                      return absl::OkStatus();
                    }).ok());
    for (auto& h : hits) ASSERT_EQ(h.load(), 1) << "call " << call;
  }
  // Three pool threads and this one, over all 200 loops.
  EXPECT_EQ(pool.started(), 3u);
  EXPECT_LE(seen.size(), 4u);
  EXPECT_TRUE(seen.contains(std::this_thread::get_id()));
}

TEST(WorkerPoolTest, StartsThreadsOnlyWhenALoopNeedsThem) {
  WorkerPool pool;
  std::set<std::thread::id> seen;
  ASSERT_TRUE(pool.ParallelFor(1, 8, [&](int64_t) {
                    seen.insert(std::this_thread::get_id());
                    return absl::OkStatus();
                  }).ok());
  ASSERT_TRUE(pool.ParallelFor(100, 1, [&](int64_t) {
                    seen.insert(std::this_thread::get_id());
                    return absl::OkStatus();
                  }).ok());
  EXPECT_EQ(pool.started(), 0u);
  EXPECT_EQ(seen, std::set<std::thread::id>{std::this_thread::get_id()});
  // Grows to the most threads a call asks for, and no further.
  ASSERT_TRUE(pool.ParallelFor(3, 8, [](int64_t) {
                    return absl::OkStatus();
                  }).ok());
  EXPECT_EQ(pool.started(), 2u);
  ASSERT_TRUE(pool.ParallelFor(100, 6, [](int64_t) {
                    return absl::OkStatus();
                  }).ok());
  EXPECT_EQ(pool.started(), 5u);
  ASSERT_TRUE(pool.ParallelFor(100, 2, [](int64_t) {
                    return absl::OkStatus();
                  }).ok());
  EXPECT_EQ(pool.started(), 5u);
}

// A failed loop leaves the pool ready for the next.
TEST(WorkerPoolTest, CarriesOnAfterAFailedLoop) {
  WorkerPool pool;
  for (int call = 0; call < 20; ++call) {
    absl::Status s = pool.ParallelFor(100000, 4, [&](int64_t i) {
      if (i == 7 || i == 9) return absl::DataLossError(std::to_string(i));
      return absl::OkStatus();
    });
    EXPECT_EQ(s.message(), "7");
    std::atomic<int> ran{0};
    EXPECT_TRUE(pool.ParallelFor(1000, 4, [&](int64_t) {
                      ran.fetch_add(1);
                      return absl::OkStatus();
                    }).ok());
    EXPECT_EQ(ran.load(), 1000);
  }
}

// Every index of a loop has finished when ParallelFor returns, also the
// ones pool threads ran: the caller may free what they wrote to.
TEST(WorkerPoolTest, ReturnsOnlyAfterEveryIndexFinished) {
  WorkerPool pool;
  for (int call = 0; call < 50; ++call) {
    std::vector<int> out(64, 0);
    ASSERT_TRUE(pool.ParallelFor(64, 4, [&](int64_t i) {
                      if (i % 16 == 3) {
                        std::this_thread::sleep_for(
                            std::chrono::microseconds(200));
                      }
                      out[i] = static_cast<int>(i) + 1;
                      return absl::OkStatus();
                    }).ok());
    for (int i = 0; i < 64; ++i) ASSERT_EQ(out[i], i + 1);
  }
}

// Two callers share one pool: their loops run one after the other.
TEST(WorkerPoolTest, CallsFromSeveralThreadsTakeTurns) {
  WorkerPool pool;
  std::atomic<int> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&] {
      for (int k = 0; k < 30; ++k) {
        EXPECT_TRUE(pool.ParallelFor(100, 3, [&](int64_t) {
                          total.fetch_add(1);
                          return absl::OkStatus();
                        }).ok());
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(total.load(), 3 * 30 * 100);
  EXPECT_EQ(pool.started(), 2u);
}

}  // namespace
}  // namespace cairn::internal_core
