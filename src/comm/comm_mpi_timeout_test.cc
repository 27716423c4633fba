// Collective timeouts of the MPI communicator over 4 processes (mpiexec -n
// 4): a rank that does not come, because it is busy elsewhere or stopped by
// SIGSTOP, no longer hangs the others; they fail within the timeout plus
// the grace, naming it, and the communicator is broken on every rank.
//
// The late rank is held back on MPI_COMM_WORLD until the others have
// given up, so that what each rank sees does not depend on timing. Every
// test leaves every rank's MPI state such that the next one can run (the
// abandoned operations stay pending on freed communicators, which Open MPI
// allows), and the binary exits through MPI_Finalize.
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cairn/communicator.h"
#include "comm/comm_conformance.h"
#include "comm/mpi/mpi_communicator.h"
#include "comm/mpi/mpi_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::internal_comm {
namespace {

using conformance::EveryCollective;
using conformance::NamedCollective;
using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr absl::Duration kTimeout = absl::Seconds(1);
// The timeout, the grace for answers (at most the timeout), and slack for
// 4 processes on 2 busy cores.
constexpr absl::Duration kBound = absl::Seconds(10);
constexpr int kReleaseTag = 4242;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

std::unique_ptr<Communicator> WorldWithTimeout(absl::Duration timeout) {
  MpiOptions options;
  options.collective_timeout = timeout;
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      NewMpiCommunicator(MPI_COMM_WORLD, options);
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? *std::move(comm) : nullptr;
}

// The on-time ranks tell `late` they are done; `late` waits for all of them.
void ReleaseLateRank(int late) {
  const int me = WorldRank();
  if (me == late) {
    for (int i = 0; i < WorldSize() - 1; ++i) {
      int64_t ignored = 0;
      MPI_Recv(&ignored, 1, MPI_INT64_T, MPI_ANY_SOURCE, kReleaseTag,
               MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
  } else {
    const int64_t done = 1;
    MPI_Send(&done, 1, MPI_INT64_T, late, kReleaseTag, MPI_COMM_WORLD);
  }
}

// Regression for issue 33: a rank that did not call a collective hung the
// others forever. Each collective, with the late rank a non-root and (for
// the rooted ones) the root. Under MPI a rank waits only for what it
// needs: the other ranks of a broadcast or scatter need only the root, so
// a late non-root there makes nobody wait (and so no error).
TEST(MpiTimeoutTest, EveryCollectiveFailsNamingTheRankThatDidNotArrive) {
  ASSERT_EQ(WorldSize(), 4);
  const int me = WorldRank();
  for (const NamedCollective& collective : EveryCollective()) {
    const bool only_root_awaited =
        collective.name == "Broadcast" || collective.name == "Scatter";
    for (int late : {3, 0}) {
      if (late == 3 && only_root_awaited) continue;
      if (late == 0 && !only_root_awaited && collective.name != "Gather") {
        continue;
      }
      SCOPED_TRACE(collective.name + " without rank " + std::to_string(late));
      std::unique_ptr<Communicator> comm = WorldWithTimeout(kTimeout);
      ASSERT_NE(comm, nullptr);
      const std::string context =
          "mpi " + collective.name + " (rank " + std::to_string(me) + " of 4)";
      const std::string missing =
          "rank " + std::to_string(late) + " did not arrive within 1 s";
      absl::Status status;
      if (me != late) {
        const absl::Time start = absl::Now();
        status = collective.call(*comm);
        const absl::Duration waited = absl::Now() - start;
        ReleaseLateRank(late);
        EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded)
            << status;
        EXPECT_THAT(Msg(status), HasSubstr(context));
        EXPECT_THAT(Msg(status), HasSubstr(missing));
        EXPECT_LT(waited, kBound);
      } else {
        ReleaseLateRank(late);
        status = collective.call(*comm);
        // Usually the others' verdict is here first; if not, MPI may match
        // this rank's call with their abandoned operations and complete it.
        if (!status.ok()) {
          EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
          EXPECT_THAT(Msg(status), HasSubstr(missing));
        }
      }
      // Broken for good, on every rank.
      absl::Status after = comm->Barrier();
      EXPECT_EQ(after.code(), absl::StatusCode::kAborted) << after;
      EXPECT_THAT(Msg(after), HasSubstr(missing));
    }
  }
}

// The case of the issue itself: a stopped rank. The others name it as one
// that did not answer, then wake it (SIGCONT) so the job can end.
TEST(MpiTimeoutTest, StoppedRankIsNamedAndTheOthersDoNotHang) {
  const int me = WorldRank();
  constexpr int kStopped = 2;
  std::vector<int> pids(WorldSize());
  const int pid = getpid();
  MPI_Allgather(&pid, 1, MPI_INT, pids.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::unique_ptr<Communicator> comm = WorldWithTimeout(kTimeout);
  ASSERT_NE(comm, nullptr);
  if (me == kStopped) raise(SIGSTOP);
  const absl::Time start = absl::Now();
  absl::Status status = comm->Barrier();
  const absl::Duration waited = absl::Now() - start;
  if (me != kStopped) {
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    EXPECT_THAT(Msg(status), HasSubstr("rank 2 did not arrive within 1 s"));
    // Answers from the others are part of every rank's own verdict; a rank
    // that adopted another's verdict says who found the rank missing.
    EXPECT_THAT(Msg(status),
                AnyOf(HasSubstr("(no answer from rank 2: stopped"),
                      HasSubstr("found them missing and told this rank")));
    EXPECT_LT(waited, kBound);
    int64_t done = 1;
    // Every on-time rank has given up before the stopped one wakes.
    if (me == 0) {
      for (int r = 1; r < WorldSize(); ++r) {
        if (r == kStopped) continue;
        MPI_Recv(&done, 1, MPI_INT64_T, r, kReleaseTag, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
      }
      kill(pids[kStopped], SIGCONT);
    } else {
      MPI_Send(&done, 1, MPI_INT64_T, 0, kReleaseTag, MPI_COMM_WORLD);
    }
  } else if (!status.ok()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  }
  absl::Status after = comm->AllGather("x").status();
  EXPECT_EQ(after.code(), absl::StatusCode::kAborted) << after;
  EXPECT_THAT(Msg(after), HasSubstr("rank 2 did not arrive within 1 s"));
}

// The errors name the ranks of the communicator that timed out: the child's
// own for a communicator made by Split, which inherits the timeout.
TEST(MpiTimeoutTest, SplitResultsInheritTheTimeout) {
  const int me = WorldRank();
  std::unique_ptr<Communicator> comm = WorldWithTimeout(kTimeout);
  ASSERT_NE(comm, nullptr);
  // {0, 2} and {1, 3}; world rank 2 is rank 1 of the first.
  absl::StatusOr<std::unique_ptr<Communicator>> child =
      comm->Split(me % 2, me);
  ASSERT_TRUE(child.ok()) << child.status();
  absl::Status status;
  if (me == 0) {
    status = (*child)->Barrier();
    int64_t done = 1;
    MPI_Send(&done, 1, MPI_INT64_T, 2, kReleaseTag, MPI_COMM_WORLD);
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    EXPECT_THAT(Msg(status), HasSubstr("mpi Barrier (rank 0 of 2): rank 1 "
                                       "did not arrive within 1 s"));
  } else if (me == 2) {
    int64_t done = 0;
    MPI_Recv(&done, 1, MPI_INT64_T, 0, kReleaseTag, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
    status = (*child)->Barrier();
    if (!status.ok()) {
      EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
    }
  } else {
    EXPECT_TRUE((*child)->Barrier().ok());
  }
  // The parent is unaffected (once rank 0 is done waiting on the child).
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_TRUE(comm->Barrier().ok());
}

// The timeout bounds the wait for ranks that do not come, not the
// collective: a rank that comes late, but within it, completes it; without
// a timeout a rank waits as long as it takes. Every collective, a large
// broadcast in several pieces included.
TEST(MpiTimeoutTest, RanksThatArriveWithinTheTimeoutComplete) {
  for (absl::Duration timeout : {absl::Seconds(30), absl::InfiniteDuration()}) {
    SCOPED_TRACE(absl::FormatDuration(timeout));
    MpiOptions options;
    options.collective_timeout = timeout;
    options.max_piece_bytes = 1 << 20;
    absl::StatusOr<std::unique_ptr<Communicator>> made =
        NewMpiCommunicator(MPI_COMM_WORLD, options);
    ASSERT_TRUE(made.ok()) << made.status();
    Communicator& comm = **made;
    for (const NamedCollective& collective : EveryCollective()) {
      if (comm.rank() == 3) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
      EXPECT_TRUE(collective.call(comm).ok()) << collective.name;
    }
    std::vector<std::byte> big =
        conformance::Bytes(comm.rank() == 1 ? 1 : 9, 5 << 20);
    EXPECT_TRUE(comm.BroadcastBytes(big, 1).ok());
    EXPECT_TRUE(big == conformance::Bytes(1, 5 << 20));
  }
}

TEST(MpiTimeoutTest, RejectsATimeoutThatIsNotPositive) {
  MpiOptions options;
  options.collective_timeout = absl::ZeroDuration();
  absl::Status s = NewMpiCommunicator(MPI_COMM_WORLD, options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  CommunicatorOptions public_options;
  public_options.collective_timeout = -absl::Seconds(1);
  s = MpiWorldCommunicator(public_options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

}  // namespace
}  // namespace cairn::internal_comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int provided = MPI_THREAD_SINGLE;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const int failed = cairn::internal_comm::RunMpiTests();
  MPI_Finalize();
  return failed;
}
