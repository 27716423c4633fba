// An application that initializes MPI itself at CAIRN_TEST_THREAD_LEVEL
// (below MPI_THREAD_MULTIPLE) and finalizes it itself: cairn serializes its
// calls under MPI_THREAD_SERIALIZED, refuses lower levels, never finalizes
// MPI it did not initialize, and a communicator destroyed after the
// application's MPI_Finalize does not touch MPI.
#include <mpi.h>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "cairn/communicator.h"
#include "comm/mpi/mpi_test_util.h"
#include "gtest/gtest.h"

#ifndef CAIRN_TEST_THREAD_LEVEL
#error "define CAIRN_TEST_THREAD_LEVEL to the MPI thread level to test"
#endif

namespace cairn {
namespace {

int provided_level = MPI_THREAD_SINGLE;

// Outlives MPI_Finalize (see main).
std::unique_ptr<Communicator>& Survivor() {
  static auto* survivor = new std::unique_ptr<Communicator>;
  return *survivor;
}

TEST(MpiThreadLevelTest, SerializedIsUsableFromOneThreadAtATime) {
  if (provided_level != MPI_THREAD_SERIALIZED) {
    GTEST_SKIP() << "MPI provided level " << provided_level;
  }
  absl::StatusOr<std::unique_ptr<Communicator>> comm = MpiWorldCommunicator();
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int n = (*comm)->size();
  // Used from a thread other than main, then from main: serialized is not
  // funneled.
  std::thread([&] {
    std::vector<int64_t> v = {1};
    EXPECT_TRUE((*comm)->AllReduce(v, ReduceOp::kSum).ok());
    EXPECT_EQ(v[0], n);
  }).join();
  std::string s = (*comm)->rank() == 0 ? "hello" : "";
  EXPECT_TRUE((*comm)->Broadcast(s, 0).ok());
  EXPECT_EQ(s, "hello");
  absl::StatusOr<std::unique_ptr<Communicator>> child =
      (*comm)->Split((*comm)->rank(), 0);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ((*child)->size(), 1);
  absl::StatusOr<std::vector<std::string>> all =
      (*comm)->AllGather(std::to_string((*comm)->rank()));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), static_cast<size_t>(n));

  absl::StatusOr<std::unique_ptr<Communicator>> fortran =
      MpiCommunicatorFromFortran(MPI_Comm_c2f(MPI_COMM_WORLD));
  ASSERT_TRUE(fortran.ok()) << fortran.status();
  EXPECT_TRUE((*fortran)->Barrier().ok());
  Survivor() = *std::move(fortran);
}

TEST(MpiThreadLevelTest, LowerLevelsAreRefused) {
  if (provided_level >= MPI_THREAD_SERIALIZED) {
    GTEST_SKIP() << "MPI provided level " << provided_level;
  }
  absl::Status s = MpiWorldCommunicator().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("MPI_THREAD_SERIALIZED"), absl::string_view::npos)
      << s;
  s = MpiCommunicatorFromFortran(MPI_Comm_c2f(MPI_COMM_WORLD)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
}

}  // namespace
}  // namespace cairn

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  MPI_Init_thread(&argc, &argv, CAIRN_TEST_THREAD_LEVEL,
                  &cairn::provided_level);
  if (cairn::provided_level != CAIRN_TEST_THREAD_LEVEL) {
    std::fprintf(stderr, "asked MPI for thread level %d, got %d\n",
                 CAIRN_TEST_THREAD_LEVEL, cairn::provided_level);
  }
  int failed = cairn::internal_comm::RunMpiTests();
  // cairn did not initialize MPI, so it must not have finalized it.
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (finalized) {
    std::fprintf(stderr, "cairn finalized the application's MPI\n");
    failed = 1;
  }
  MPI_Finalize();
  // Its MPI communicator went with MPI_Finalize; destroying it must not
  // call MPI (which would abort).
  cairn::Survivor().reset();
  return failed;
}
