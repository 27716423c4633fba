// LocalCommunicator and the in-process communicators: the conformance suite
// (comm_conformance.h) plus what is particular to threads in one process.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <latch>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cairn/communicator.h"
#include "comm/comm_conformance.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using internal_comm::conformance::EveryCollective;
using internal_comm::conformance::ExpectArgumentErrors;
using internal_comm::conformance::ExpectCollectivesWork;
using internal_comm::conformance::ExpectSplitWorks;
using internal_comm::conformance::NamedCollective;
using ::testing::HasSubstr;

// Runs fn on n in-process ranks and expects every rank to return OK.
void ExpectAllOk(int n, const std::function<absl::Status(Communicator&)>& fn) {
  std::vector<absl::Status> statuses = RunInProcess(n, fn);
  ASSERT_EQ(statuses.size(), static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) EXPECT_TRUE(statuses[r].ok()) << statuses[r];
}

TEST(LocalCommunicatorTest, IsOneRank) {
  std::unique_ptr<Communicator> comm = LocalCommunicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->kind(), "local");
}

TEST(LocalCommunicatorTest, Conformance) {
  std::unique_ptr<Communicator> comm = LocalCommunicator();
  ExpectCollectivesWork(*comm);
  ExpectArgumentErrors(*comm);
  ExpectSplitWorks(*comm);
}

TEST(LocalCommunicatorTest, SplitResultOutlivesParent) {
  std::unique_ptr<Communicator> comm = LocalCommunicator();
  absl::StatusOr<std::unique_ptr<Communicator>> child = comm->Split(3, 1);
  ASSERT_TRUE(child.ok());
  comm.reset();
  EXPECT_EQ((*child)->kind(), "local");
  ExpectCollectivesWork(**child, /*big=*/false);
}

class InProcessTest : public ::testing::TestWithParam<int> {};

INSTANTIATE_TEST_SUITE_P(Sizes, InProcessTest,
                         ::testing::Values(1, 2, 3, 4, 8));

TEST_P(InProcessTest, EveryRankHasItsOwnRank) {
  const int n = GetParam();
  std::vector<std::atomic<int>> seen(n);
  ExpectAllOk(n, [&](Communicator& comm) {
    EXPECT_EQ(comm.size(), n);
    EXPECT_EQ(comm.kind(), "inprocess");
    seen[comm.rank()].fetch_add(1);
    return absl::OkStatus();
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(seen[r].load(), 1) << "rank " << r;
}

TEST_P(InProcessTest, Conformance) {
  ExpectAllOk(GetParam(), [](Communicator& comm) {
    ExpectCollectivesWork(comm);
    return absl::OkStatus();
  });
}

TEST_P(InProcessTest, ArgumentErrors) {
  ExpectAllOk(GetParam(), [](Communicator& comm) {
    ExpectArgumentErrors(comm);
    return absl::OkStatus();
  });
}

TEST_P(InProcessTest, Split) {
  ExpectAllOk(GetParam(), [](Communicator& comm) {
    ExpectSplitWorks(comm);
    return absl::OkStatus();
  });
}

// MPI cannot detect these; the in-process communicator can, and says so on
// every rank.
TEST_P(InProcessTest, DifferentRootsAreAnErrorOnEveryRank) {
  const int n = GetParam();
  if (n == 1) GTEST_SKIP() << "one rank has one root";
  ExpectAllOk(n, [](Communicator& comm) {
    const int root = comm.rank() % 2;
    constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
    std::string s = "x";
    absl::Status status = comm.Broadcast(s, root);
    EXPECT_EQ(status.code(), kInvalid) << status;
    EXPECT_NE(status.message().find("different roots"), absl::string_view::npos)
        << status;
    EXPECT_EQ(comm.Scatter(std::vector<std::string>(comm.size()), root)
                  .status()
                  .code(),
              kInvalid);
    return comm.Barrier();
  });
}

// Parent communicators destroyed before their children are used.
TEST_P(InProcessTest, SplitResultsOutliveTheParent) {
  const int n = GetParam();
  std::vector<std::unique_ptr<Communicator>> parents =
      InProcessCommunicators(n);
  ASSERT_EQ(parents.size(), static_cast<size_t>(n));
  std::vector<std::unique_ptr<Communicator>> children(n);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<Communicator>> child =
            parents[r]->Split(r % 3, 0);
        EXPECT_TRUE(child.ok()) << child.status();
        if (child.ok()) children[r] = *std::move(child);
      });
    }
    for (std::thread& t : threads) t.join();
  }
  parents.clear();
  for (const auto& child : children) ASSERT_NE(child, nullptr);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Communicator& child = *children[r];
      std::vector<int64_t> v = {r};
      EXPECT_TRUE(child.AllReduce(v, ReduceOp::kSum).ok());
      int64_t want = 0;
      for (int s = r % 3; s < n; s += 3) want += s;
      EXPECT_EQ(v[0], want);
    });
  }
  for (std::thread& t : threads) t.join();
}

// Many ranks hammering one exchange with collectives whose buffers are read
// in place by the others: under ASan, a rank returning (and freeing or
// rewriting its buffer) before the others finished reading shows up here.
TEST_P(InProcessTest, BuffersAreNotReusedWhileOthersRead) {
  const int n = GetParam();
  ExpectAllOk(n, [n](Communicator& comm) {
    for (int i = 0; i < 200; ++i) {
      const int root = i % n;
      std::vector<std::byte> b(1000 + i);
      if (comm.rank() == root) {
        for (size_t k = 0; k < b.size(); ++k) {
          b[k] = static_cast<std::byte>(k * 3 + i);
        }
      }
      EXPECT_TRUE(comm.BroadcastBytes(b, root).ok());
      for (size_t k = 0; k < b.size(); k += 97) {
        EXPECT_EQ(b[k], static_cast<std::byte>(k * 3 + i));
      }
      std::string s = std::to_string(i * 1000 + comm.rank());
      absl::StatusOr<std::vector<std::string>> all = comm.AllGather(s);
      EXPECT_TRUE(all.ok());
      if (all.ok() && static_cast<int>(all->size()) == n) {
        for (int r = 0; r < n; ++r) {
          EXPECT_EQ((*all)[r], std::to_string(i * 1000 + r));
        }
      }
    }
    return absl::OkStatus();
  });
}

TEST(InProcessTest, RejectsFewerThanOneRank) {
  EXPECT_TRUE(InProcessCommunicators(0).empty());
  EXPECT_TRUE(InProcessCommunicators(-3).empty());
  bool called = false;
  std::vector<absl::Status> statuses = RunInProcess(0, [&](Communicator&) {
    called = true;
    return absl::OkStatus();
  });
  ASSERT_EQ(statuses.size(), 1u);
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(called);
}

TEST(InProcessTest, ReturnsEachRanksStatus) {
  std::vector<absl::Status> statuses =
      RunInProcess(3, [](Communicator& comm) -> absl::Status {
        absl::Status barrier = comm.Barrier();
        if (!barrier.ok()) return barrier;
        if (comm.rank() == 1) return absl::NotFoundError("rank 1's error");
        return absl::OkStatus();
      });
  ASSERT_EQ(statuses.size(), 3u);
  EXPECT_TRUE(statuses[0].ok());
  EXPECT_EQ(statuses[1], absl::NotFoundError("rank 1's error"));
  EXPECT_TRUE(statuses[2].ok());
}

TEST(InProcessTest, ExceptionBecomesInternalStatusOfItsRank) {
  std::vector<absl::Status> statuses =
      RunInProcess(4, [](Communicator& comm) -> absl::Status {
        if (comm.rank() == 1) throw std::runtime_error("boom");
        if (comm.rank() == 2) throw 42;
        return absl::OkStatus();
      });
  ASSERT_EQ(statuses.size(), 4u);
  EXPECT_TRUE(statuses[0].ok());
  EXPECT_EQ(statuses[1].code(), absl::StatusCode::kInternal);
  EXPECT_NE(statuses[1].message().find("boom"), absl::string_view::npos)
      << statuses[1];
  EXPECT_EQ(statuses[2].code(), absl::StatusCode::kInternal);
  EXPECT_NE(statuses[2].message().find("unknown type"), absl::string_view::npos)
      << statuses[2];
  EXPECT_TRUE(statuses[3].ok());
}

// Regression for the hang a rank that leaves early would cause: the others'
// next collective fails instead, naming the rank that left.
TEST(InProcessTest, RankThatLeavesEarlyAbortsTheOthersInsteadOfHanging) {
  for (bool throws : {false, true}) {
    std::vector<absl::Status> statuses =
        RunInProcess(4, [throws](Communicator& comm) -> absl::Status {
          if (comm.rank() == 2) {
            if (throws) throw std::runtime_error("rank 2 gave up");
            return absl::OkStatus();
          }
          absl::Status barrier = comm.Barrier();
          if (!barrier.ok()) return barrier;
          return comm.AllGather("x").status();
        });
    ASSERT_EQ(statuses.size(), 4u);
    EXPECT_EQ(statuses[2].code(),
              throws ? absl::StatusCode::kInternal : absl::StatusCode::kOk);
    for (int r : {0, 1, 3}) {
      EXPECT_EQ(statuses[r].code(), absl::StatusCode::kAborted) << statuses[r];
      EXPECT_NE(statuses[r].message().find("rank 2"), absl::string_view::npos)
          << statuses[r];
    }
  }
}

// A rank waits for the others by polling for a while, then by sleeping:
// collectives complete and agree both when the others arrive within the
// poll and when they arrive long after it.
TEST(InProcessTest, CollectivesCompleteWhetherTheOthersArriveSoonOrLate) {
  for (int late_ms : {0, 5}) {
    ExpectAllOk(4, [late_ms](Communicator& comm) -> absl::Status {
      for (int round = 0; round < 5; ++round) {
        // A different rank is the late one each round.
        if (comm.rank() == round % 4) {
          std::this_thread::sleep_for(std::chrono::milliseconds(late_ms));
        }
        int64_t value = comm.rank() + round;
        absl::Status s =
            comm.AllReduce(std::span<int64_t>(&value, 1), ReduceOp::kSum);
        if (!s.ok()) return s;
        if (value != 0 + 1 + 2 + 3 + 4 * round) {
          return absl::InternalError("wrong sum");
        }
        s = comm.Barrier();
        if (!s.ok()) return s;
      }
      return absl::OkStatus();
    });
  }
}

// The ranks that finish together are not taken for ranks that left early.
TEST(InProcessTest, RanksFinishingAtDifferentTimesAfterTheLastCollective) {
  ExpectAllOk(4, [](Communicator& comm) {
    absl::Status s = comm.Barrier();
    if (comm.rank() != 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return s;
  });
}

TEST(InProcessTest, AllReduceSumWrapsAroundInsteadOfOverflowing) {
  ExpectAllOk(2, [](Communicator& comm) {
    std::vector<int64_t> v = {
        comm.rank() == 0 ? std::numeric_limits<int64_t>::max() : int64_t{1}};
    absl::Status s = comm.AllReduce(v, ReduceOp::kSum);
    EXPECT_EQ(v[0], std::numeric_limits<int64_t>::min());
    return s;
  });
}

TEST(InProcessTest, ErrorsNameTheCollectiveAndTheRank) {
  ExpectAllOk(3, [](Communicator& comm) {
    std::vector<std::byte> b(comm.rank() == 2 ? 5 : 4);
    absl::Status s = comm.BroadcastBytes(b, 0);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("inprocess BroadcastBytes (rank " +
                               std::to_string(comm.rank()) + " of 3)"),
              absl::string_view::npos)
        << s;
    EXPECT_NE(s.message().find("rank 2 passed 5"), absl::string_view::npos)
        << s;
    return absl::OkStatus();
  });
}

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

CommunicatorOptions WithTimeout(absl::Duration timeout) {
  CommunicatorOptions options;
  options.collective_timeout = timeout;
  return options;
}

// Regression for issue 33: a rank that never arrives (stopped, deadlocked)
// hung every other rank of the collective forever. Now they give up after
// the timeout, naming it; the late ranks, which are held back until the
// others have given up, then find the communicator broken instead of
// waiting for (or reading the freed buffers of) ranks that have left, and
// so does every later collective.
TEST(InProcessTimeoutTest, EveryCollectiveFailsNamingTheRanksThatDidNotArrive) {
  constexpr int kRanks = 4;
  constexpr absl::Duration kTimeout = absl::Milliseconds(200);
  for (const NamedCollective& collective : EveryCollective()) {
    for (const std::vector<int>& late :
         {std::vector<int>{2, 3}, std::vector<int>{0}}) {
      SCOPED_TRACE(collective.name + " without ranks " +
                   absl::StrJoin(late, ","));
      const std::string missing =
          (late.size() == 1 ? "rank " : "ranks ") + absl::StrJoin(late, ", ") +
          " did not arrive within 0.2 s";
      std::latch others_gave_up(kRanks - static_cast<int>(late.size()));
      std::vector<absl::Duration> waited(kRanks);
      std::vector<absl::Status> after(kRanks);
      std::vector<absl::Status> statuses = RunInProcess(
          kRanks,
          [&](Communicator& comm) {
            const int me = comm.rank();
            const bool is_late =
                std::find(late.begin(), late.end(), me) != late.end();
            if (is_late) others_gave_up.wait();
            const absl::Time start = absl::Now();
            absl::Status s = collective.call(comm);
            waited[me] = absl::Now() - start;
            if (!is_late) others_gave_up.count_down();
            after[me] = comm.Barrier();
            return s;
          },
          WithTimeout(kTimeout));
      ASSERT_EQ(statuses.size(), static_cast<size_t>(kRanks));
      absl::Duration longest;
      for (int r = 0; r < kRanks; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        const std::string context = "inprocess " + collective.name +
                                    " (rank " + std::to_string(r) + " of 4)";
        if (std::find(late.begin(), late.end(), r) == late.end()) {
          EXPECT_EQ(statuses[r].code(), absl::StatusCode::kDeadlineExceeded)
              << statuses[r];
          EXPECT_THAT(Msg(statuses[r]), HasSubstr(context + ": " + missing));
          longest = std::max(longest, waited[r]);
        } else {
          // Late: the collective was abandoned before this rank came.
          EXPECT_EQ(statuses[r].code(), absl::StatusCode::kAborted)
              << statuses[r];
          EXPECT_THAT(Msg(statuses[r]), HasSubstr(context));
          EXPECT_THAT(Msg(statuses[r]), HasSubstr("timed out"));
          EXPECT_THAT(Msg(statuses[r]), HasSubstr(missing));
          EXPECT_LT(waited[r], absl::Seconds(1)) << "a late rank waited";
        }
        EXPECT_EQ(after[r].code(), absl::StatusCode::kAborted) << after[r];
        EXPECT_THAT(Msg(after[r]), HasSubstr("can no longer be used"));
        EXPECT_THAT(Msg(after[r]), HasSubstr(missing));
      }
      EXPECT_GE(longest, kTimeout);
      EXPECT_LT(longest, absl::Seconds(30));
    }
  }
}

// The timeout bounds the wait for ranks that do not come, not the
// collective: ranks that come late, but within it, complete it. Without a
// timeout a rank waits as long as it takes.
TEST(InProcessTimeoutTest, RanksThatArriveWithinTheTimeoutComplete) {
  for (absl::Duration timeout :
       {absl::Seconds(60), absl::InfiniteDuration()}) {
    SCOPED_TRACE(absl::FormatDuration(timeout));
    std::vector<absl::Status> statuses = RunInProcess(
        4,
        [](Communicator& comm) -> absl::Status {
          for (const NamedCollective& collective : EveryCollective()) {
            if (comm.rank() == 3) {
              std::this_thread::sleep_for(std::chrono::milliseconds(50));
            }
            absl::Status s = collective.call(comm);
            if (!s.ok()) return s;
          }
          return absl::OkStatus();
        },
        WithTimeout(timeout));
    for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
  }
}

// The errors name the ranks of the communicator that timed out: the child's
// own ranks for a communicator made by Split, which inherits the timeout.
TEST(InProcessTimeoutTest, SplitResultsInheritTheTimeout) {
  std::latch rank_0_gave_up(1);
  std::vector<absl::Status> child_status(4);
  std::vector<absl::Status> statuses = RunInProcess(
      4,
      [&](Communicator& comm) -> absl::Status {
        // {0, 2} and {1, 3}; old rank 2 is new rank 1 of the first.
        absl::StatusOr<std::unique_ptr<Communicator>> child =
            comm.Split(comm.rank() % 2, comm.rank());
        if (!child.ok()) return child.status();
        if (comm.rank() == 2) rank_0_gave_up.wait();
        child_status[comm.rank()] = (*child)->Barrier();
        if (comm.rank() == 0) rank_0_gave_up.count_down();
        return absl::OkStatus();
      },
      WithTimeout(absl::Milliseconds(100)));
  for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(child_status[0].code(), absl::StatusCode::kDeadlineExceeded)
      << child_status[0];
  EXPECT_THAT(Msg(child_status[0]),
              HasSubstr("inprocess Barrier (rank 0 of 2): rank 1 did not "
                        "arrive within 0.1 s"));
  EXPECT_EQ(child_status[2].code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(child_status[1].ok()) << child_status[1];
  EXPECT_TRUE(child_status[3].ok()) << child_status[3];
}

// Ranks of a group that times out wake together: the one that gives up
// first breaks the group, and the others, also waiting, fail at once with
// the same list instead of each serving its own timeout.
TEST(InProcessTimeoutTest, RanksWaitingTogetherGiveUpTogether) {
  std::latch others_gave_up(3);
  absl::Duration rank_1_waited;
  std::vector<absl::Status> statuses = RunInProcess(
      4,
      [&](Communicator& comm) {
        if (comm.rank() == 3) others_gave_up.wait();
        if (comm.rank() == 1) {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
        }
        const absl::Time start = absl::Now();
        absl::Status s = comm.Barrier();
        if (comm.rank() == 1) rank_1_waited = absl::Now() - start;
        if (comm.rank() != 3) others_gave_up.count_down();
        return s;
      },
      WithTimeout(absl::Seconds(1)));
  EXPECT_LT(rank_1_waited, absl::Milliseconds(950));
  for (int r : {0, 1, 2}) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kDeadlineExceeded)
        << statuses[r];
    EXPECT_THAT(Msg(statuses[r]),
                HasSubstr("rank 3 did not arrive within 1 s"));
  }
  EXPECT_EQ(statuses[3].code(), absl::StatusCode::kAborted) << statuses[3];
}

TEST(InProcessTimeoutTest, RejectsATimeoutThatIsNotPositive) {
  for (absl::Duration bad : {absl::ZeroDuration(), absl::Seconds(-1)}) {
    EXPECT_TRUE(InProcessCommunicators(2, WithTimeout(bad)).empty());
    bool called = false;
    std::vector<absl::Status> statuses = RunInProcess(
        2,
        [&](Communicator&) {
          called = true;
          return absl::OkStatus();
        },
        WithTimeout(bad));
    ASSERT_EQ(statuses.size(), 1u);
    EXPECT_EQ(statuses[0].code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Msg(statuses[0]), HasSubstr("timeout must be positive"));
    EXPECT_FALSE(called);
  }
  EXPECT_EQ(InProcessCommunicators(2, WithTimeout(absl::InfiniteDuration()))
                .size(),
            2u);
}

TEST(MpiEntryPointsTest, AnswerWithoutMpiOrBeforeMpiIsInitialized) {
  if (!HasMpi()) {
    absl::Status world = MpiWorldCommunicator().status();
    EXPECT_EQ(world.code(), absl::StatusCode::kUnimplemented);
    EXPECT_NE(world.message().find("CAIRN_WITH_MPI"), absl::string_view::npos);
    EXPECT_EQ(MpiCommunicatorFromFortran(0).status().code(),
              absl::StatusCode::kUnimplemented);
  } else {
    // This binary never initializes MPI.
    absl::Status s = MpiCommunicatorFromFortran(0).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("not initialized"), absl::string_view::npos)
        << s;
    // Checked before MPI would be initialized.
    s = MpiWorldCommunicator(WithTimeout(absl::ZeroDuration())).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(Msg(s), HasSubstr("timeout must be positive"));
  }
}

}  // namespace
}  // namespace cairn
