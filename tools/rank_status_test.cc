#include "rank_status.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::tools {
namespace {

using ::testing::Each;

TEST(RankStatusTest, EncodeDecodeRoundTrips) {
  for (const absl::Status& s :
       {absl::OkStatus(), absl::DataLossError("crc32c mismatch\nline two"),
        absl::AbortedError(""), absl::UnauthenticatedError("x")}) {
    EXPECT_EQ(DecodeStatus(EncodeStatus(s)), s) << s;
  }
  for (const char* bad : {"", "7", "x\nmsg", "99\nmsg", "-1\nmsg"}) {
    absl::Status s = DecodeStatus(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << bad;
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("malformed"));
  }
}

TEST(RankStatusTest, AllOkIsOk) {
  EXPECT_TRUE(CombineRankStatuses({}).ok());
  EXPECT_TRUE(CombineRankStatuses({absl::OkStatus(), absl::OkStatus()}).ok());
}

TEST(RankStatusTest, TheSameErrorOnEveryRankIsReturnedAsIs) {
  const absl::Status e = absl::AbortedError("save failed on rank 1: disk full");
  EXPECT_EQ(CombineRankStatuses({e, e, e}), e);
}

TEST(RankStatusTest, ErrorsOfSomeRanksNameTheRanks) {
  const absl::Status oom = absl::ResourceExhaustedError("out of memory");
  EXPECT_EQ(CombineRankStatuses({absl::OkStatus(), absl::OkStatus(), oom}),
            absl::ResourceExhaustedError("rank 2: out of memory"));
  const absl::Status gone = absl::NotFoundError("no file");
  EXPECT_EQ(CombineRankStatuses({gone, oom, gone, absl::OkStatus()}),
            absl::NotFoundError(
                "ranks 0, 2: no file; rank 1: RESOURCE_EXHAUSTED: out of "
                "memory"));
}

TEST(RankStatusTest, EveryRankLearnsOfOneRanksFailure) {
  std::vector<absl::Status> agreed(4);
  std::vector<absl::Status> returned = RunInProcess(4, [&](Communicator& comm) {
    absl::Status local = comm.rank() == 2 ? absl::InternalError("fill failed")
                                          : absl::OkStatus();
    agreed[static_cast<size_t>(comm.rank())] = AgreeOnStatus(comm, local);
    return absl::OkStatus();
  });
  EXPECT_THAT(returned, Each(absl::OkStatus()));
  EXPECT_THAT(agreed, Each(absl::InternalError("rank 2: fill failed")));

  returned = RunInProcess(3, [&](Communicator& comm) {
    return AgreeOnStatus(comm, absl::OkStatus());
  });
  EXPECT_THAT(returned, Each(absl::OkStatus()));
}

}  // namespace
}  // namespace cairn::tools
