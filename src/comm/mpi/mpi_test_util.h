// The main of cairn's MPI test binaries: every rank runs the same tests in
// the same order (their collectives must match), every rank reports its own
// failures, and every rank exits nonzero when any rank failed.
#ifndef CAIRN_COMM_MPI_MPI_TEST_UTIL_H_
#define CAIRN_COMM_MPI_MPI_TEST_UTIL_H_

#include <mpi.h>

#include <cstdio>
#include <string>

#include "gtest/gtest.h"

namespace cairn::internal_comm {

// This process's rank and the size of MPI_COMM_WORLD.
inline int WorldRank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

inline int WorldSize() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// Prints each failed check with its rank: only rank 0 keeps gtest's usual
// output, so the others would otherwise fail silently.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  // Remembered here: asking UnitTest for the current test from
  // OnTestPartResult deadlocks (gtest holds its own mutex there).
  void OnTestStart(const ::testing::TestInfo& test) override {
    test_ = std::string(test.test_suite_name()) + "." + test.name();
  }

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] FAILED %s at %s:%d\n%s\n", rank_,
                 test_.c_str(),
                 result.file_name() != nullptr ? result.file_name() : "?",
                 result.line_number(), result.message());
    std::fflush(stderr);
  }

 private:
  int rank_;
  std::string test_ = "(outside any test)";
};

// Call after MPI is initialized and InitGoogleTest: runs every test and
// returns 0 only if every rank of MPI_COMM_WORLD passed.
inline int RunMpiTests() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ::testing::TestEventListeners& listeners =
      ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed) {
    std::fprintf(stderr, "some rank failed (see [rank N] lines above)\n");
  }
  return any_failed;
}

}  // namespace cairn::internal_comm

#endif  // CAIRN_COMM_MPI_MPI_TEST_UTIL_H_
