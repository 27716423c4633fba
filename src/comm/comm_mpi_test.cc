// The MPI communicator over 4 processes (mpiexec -n 4): the conformance
// suite, plus what only MPI has: duplicates, error handlers, Fortran
// handles, pieces and limits, isolation from the application's messages.
// cairn initializes MPI here (the path of an application that leaves it to
// cairn) and finalizes it at exit.
#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cairn/communicator.h"
#include "comm/comm_conformance.h"
#include "comm/mpi/mpi_communicator.h"
#include "comm/mpi/mpi_test_util.h"
#include "gtest/gtest.h"

namespace cairn::internal_comm {
namespace {

using conformance::Bytes;
using conformance::ExpectArgumentErrors;
using conformance::ExpectCollectivesWork;
using conformance::ExpectSplitWorks;
using conformance::ValueOr;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;

std::unique_ptr<Communicator> World() {
  absl::StatusOr<std::unique_ptr<Communicator>> comm = MpiWorldCommunicator();
  EXPECT_TRUE(comm.ok()) << comm.status();
  return comm.ok() ? *std::move(comm) : nullptr;
}

// `comm` works on a duplicate of `of` (same group, another context) whose
// errors are returned, not fatal.
void ExpectOwnDuplicate(const Communicator& comm, MPI_Comm of) {
  MPI_Comm handle = NativeHandle(comm);
  ASSERT_NE(handle, MPI_COMM_NULL);
  int result = MPI_UNEQUAL;
  MPI_Comm_compare(handle, of, &result);
  EXPECT_EQ(result, MPI_CONGRUENT);
  MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(handle, &handler);
  EXPECT_EQ(handler, MPI_ERRORS_RETURN);
  MPI_Errhandler_free(&handler);
}

TEST(MpiCommunicatorTest, WorldIsADuplicateThatReturnsErrors) {
  std::unique_ptr<Communicator> comm = World();
  ASSERT_NE(comm, nullptr);
  EXPECT_TRUE(HasMpi());
  EXPECT_EQ(comm->kind(), "mpi");
  EXPECT_EQ(comm->rank(), WorldRank());
  EXPECT_EQ(comm->size(), WorldSize());
  ExpectOwnDuplicate(*comm, MPI_COMM_WORLD);

  // A second one is a duplicate of its own.
  std::unique_ptr<Communicator> again = World();
  ASSERT_NE(again, nullptr);
  int result = MPI_IDENT;
  MPI_Comm_compare(NativeHandle(*comm), NativeHandle(*again), &result);
  EXPECT_EQ(result, MPI_CONGRUENT);
}

TEST(MpiCommunicatorTest, CairnInitializedMpiWithThreadMultiple) {
  int provided = MPI_THREAD_SINGLE;
  MPI_Query_thread(&provided);
  EXPECT_EQ(provided, MPI_THREAD_MULTIPLE);
}

TEST(MpiCommunicatorTest, Conformance) {
  std::unique_ptr<Communicator> comm = World();
  ASSERT_NE(comm, nullptr);
  ExpectCollectivesWork(*comm);
}

TEST(MpiCommunicatorTest, ArgumentErrors) {
  std::unique_ptr<Communicator> comm = World();
  ASSERT_NE(comm, nullptr);
  ExpectArgumentErrors(*comm);
}

// Includes 2+2 and 1+3 splits, nested splits, and the parity groups running
// collectives concurrently with the parent used from another thread.
TEST(MpiCommunicatorTest, Split) {
  std::unique_ptr<Communicator> comm = World();
  ASSERT_NE(comm, nullptr);
  ExpectSplitWorks(*comm);
}

TEST(MpiCommunicatorTest, SplitResultReturnsErrorsAndOutlivesItsParent) {
  std::unique_ptr<Communicator> comm = World();
  ASSERT_NE(comm, nullptr);
  absl::StatusOr<std::unique_ptr<Communicator>> child =
      comm->Split(comm->rank() < 2 ? 0 : 1, 0);
  ASSERT_TRUE(child.ok()) << child.status();
  comm.reset();
  MPI_Errhandler handler = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(NativeHandle(**child), &handler);
  EXPECT_EQ(handler, MPI_ERRORS_RETURN);
  MPI_Errhandler_free(&handler);
  ExpectCollectivesWork(**child, /*big=*/false);
}

// cairn's traffic never matches the application's receives: a wildcard
// receive posted on MPI_COMM_WORLD before cairn's collectives is still
// pending after them, and then gets the application's own message.
TEST(MpiCommunicatorTest, MessagesDoNotMixWithTheApplications) {
  const int me = WorldRank();
  const int n = WorldSize();
  int64_t received = -1;
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Irecv(&received, 1, MPI_INT64_T, MPI_ANY_SOURCE, MPI_ANY_TAG,
            MPI_COMM_WORLD, &request);

  {
    std::unique_ptr<Communicator> comm = World();
    ASSERT_NE(comm, nullptr);
    ExpectCollectivesWork(*comm, /*big=*/false);
    absl::StatusOr<std::unique_ptr<Communicator>> child =
        comm->Split(me % 2, 0);
    EXPECT_TRUE(child.ok());
    if (child.ok()) ExpectCollectivesWork(**child, /*big=*/false);
  }

  // Every rank's cairn traffic is sent before the first barrier, and no
  // application message before the second.
  MPI_Barrier(MPI_COMM_WORLD);
  int done = 1;
  MPI_Status status;
  MPI_Test(&request, &done, &status);
  EXPECT_EQ(done, 0) << "a cairn message matched the application's receive";
  MPI_Barrier(MPI_COMM_WORLD);

  const int64_t message = 1000 + me;
  MPI_Send(&message, 1, MPI_INT64_T, (me + 1) % n, 77, MPI_COMM_WORLD);
  if (!done) MPI_Wait(&request, &status);
  const int left = (me + n - 1) % n;
  EXPECT_EQ(status.MPI_SOURCE, left);
  EXPECT_EQ(status.MPI_TAG, 77);
  EXPECT_EQ(received, 1000 + left);
}

TEST(MpiCommunicatorTest, FromFortranHandle) {
  absl::StatusOr<std::unique_ptr<Communicator>> comm =
      MpiCommunicatorFromFortran(MPI_Comm_c2f(MPI_COMM_WORLD));
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->rank(), WorldRank());
  EXPECT_EQ((*comm)->size(), WorldSize());
  ExpectOwnDuplicate(**comm, MPI_COMM_WORLD);
  ExpectCollectivesWork(**comm, /*big=*/false);

  // The application's own sub-communicator.
  MPI_Comm halves = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, WorldRank() % 2, 0, &halves);
  absl::StatusOr<std::unique_ptr<Communicator>> half =
      MpiCommunicatorFromFortran(MPI_Comm_c2f(halves));
  ASSERT_TRUE(half.ok()) << half.status();
  int half_size = 0;
  MPI_Comm_size(halves, &half_size);
  EXPECT_EQ((*half)->size(), half_size);
  ExpectOwnDuplicate(**half, halves);
  std::vector<int64_t> v = {1};
  EXPECT_TRUE((*half)->AllReduce(v, ReduceOp::kSum).ok());
  EXPECT_EQ(v[0], half_size);
  half->reset();
  MPI_Comm_free(&halves);

  for (int64_t bad : {int64_t{-1}, int64_t{1} << 20, int64_t{1} << 40}) {
    absl::Status s = MpiCommunicatorFromFortran(bad).status();
    EXPECT_EQ(s.code(), kInvalid) << bad << ": " << s;
  }
}

// Small pieces and limits stand in for 256 MiB and INT_MAX.
TEST(MpiCommunicatorTest, PiecesAndLimits) {
  MpiOptions options;
  options.max_piece_bytes = 1000;
  options.max_gather_bytes = 5000;
  absl::StatusOr<std::unique_ptr<Communicator>> made =
      NewMpiCommunicator(MPI_COMM_WORLD, options);
  ASSERT_TRUE(made.ok()) << made.status();
  Communicator& comm = **made;
  const int me = comm.rank();
  const int n = comm.size();

  for (size_t size : {size_t{999}, size_t{1000}, size_t{1001}, size_t{10007}}) {
    std::vector<std::byte> b =
        me == 1 ? Bytes(7, size) : std::vector<std::byte>(size);
    EXPECT_TRUE(comm.BroadcastBytes(b, 1).ok());
    EXPECT_TRUE(b == Bytes(7, size)) << size;
    std::string s = me == 2 ? std::string(size, 'q') : "";
    EXPECT_TRUE(comm.Broadcast(s, 2).ok());
    EXPECT_EQ(s, std::string(size, 'q'));
  }
  std::vector<int64_t> many(300);  // 125 values per piece
  for (size_t i = 0; i < many.size(); ++i) many[i] = i * (me + 1);
  EXPECT_TRUE(comm.AllReduce(many, ReduceOp::kSum).ok());
  for (size_t i = 0; i < many.size(); ++i) {
    EXPECT_EQ(many[i], static_cast<int64_t>(i) * n * (n + 1) / 2);
  }

  // Each buffer fits, the total does not: an error on every rank.
  const std::string big(1500, 'b');
  absl::Status s = comm.Gather(big, 0).status();
  EXPECT_EQ(s.code(), kInvalid) << s;
  EXPECT_NE(s.message().find("6000 bytes"), absl::string_view::npos) << s;
  EXPECT_EQ(comm.AllGather(big).status().code(), kInvalid);
  // One buffer alone too large.
  s = comm.AllGather(me == 3 ? std::string(5001, 'x') : "").status();
  EXPECT_EQ(s.code(), kInvalid) << s;
  EXPECT_NE(s.message().find("rank 3's buffer is 5001 bytes"),
            absl::string_view::npos)
      << s;
  std::vector<std::string> parts(n, big);
  s = comm.Scatter(parts, 0).status();
  EXPECT_EQ(s.code(), kInvalid) << s;

  // Within the limits, all is well again.
  const std::string fits(1200, 'f');
  std::vector<std::string> all = ValueOr(comm.AllGather(fits), {});
  EXPECT_EQ(all, std::vector<std::string>(n, fits));
  EXPECT_EQ(ValueOr(comm.Scatter(std::vector<std::string>(n, fits), 0),
                    std::string()),
            fits);
}

TEST(MpiCommunicatorTest, ErrorCodesBecomeStatuses) {
  EXPECT_TRUE(MpiErrorToStatus(MPI_SUCCESS, "MPI_Bcast").ok());
  absl::Status s = MpiErrorToStatus(MPI_ERR_TRUNCATE, "MPI_Bcast");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("MPI_Bcast: "), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("truncated"), absl::string_view::npos) << s;
  EXPECT_EQ(MpiErrorToStatus(MPI_ERR_NO_MEM, "MPI_Alloc_mem").code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(MpiCommunicatorTest, NativeHandleOfOtherCommunicatorsIsNull) {
  EXPECT_EQ(NativeHandle(*LocalCommunicator()), MPI_COMM_NULL);
}

}  // namespace
}  // namespace cairn::internal_comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int initialized = 1;
  MPI_Initialized(&initialized);
  if (initialized) {
    std::fprintf(stderr, "MPI initialized before cairn was asked to\n");
    return 1;
  }
  absl::StatusOr<std::unique_ptr<cairn::Communicator>> world =
      cairn::MpiWorldCommunicator();
  if (!world.ok()) {
    std::fprintf(stderr, "MpiWorldCommunicator: %s\n",
                 world.status().ToString().c_str());
    return 1;
  }
  const int failed = cairn::internal_comm::RunMpiTests();
  // Freed before the MPI_Finalize that cairn runs at exit.
  world->reset();
  return failed;
}
