// Object storage under faults: tests/s3_fault_proxy.py between cairn and a
// real S3-compatible server (moto) answers 500/503, truncates and shortens
// bodies, flips bytes and hangs. Retries must succeed; exhausted retries
// must fail the save on every rank with nothing committed; damaged bytes
// must fail their CRC32C; a dead endpoint must fail, never hang.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/storage.h"
#include "checkpoint/dist_test_util.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/s3/moto_test_util.h"

namespace cairn {
namespace {

using ::testing::HasSubstr;
using testing_util::CheckRankState;
using testing_util::MakeRankState;
using testing_util::Pattern;
using testing_util::RankState;
using internal_s3::FaultProxy;

constexpr char kBucket[] = "cairn-faults";

class S3FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CAIRN_MOTO_OR_SKIP(server);
    server_ = server;
    auto client = server->Client(kBucket);
    ASSERT_TRUE(client.ok()) << client.status();
    auto proxy = FaultProxy::Start(server->endpoint());
    ASSERT_TRUE(proxy.ok()) << proxy.status();
    proxy_ = *std::move(proxy);
    static std::atomic<int> counter{0};
    url_ = absl::StrFormat("s3://%s/%d-%d/ckpt", kBucket, ::getpid(),
                           counter.fetch_add(1));
    s3_ = server->Options();
    s3_.endpoint = proxy_->endpoint();
    s3_.max_attempts = 4;
    s3_.stall_timeout_ms = 1000;
    s3_.connect_timeout_ms = 1000;
  }

  std::vector<absl::Status> SaveRanks(int world) {
    return RunInProcess(world, [&](Communicator& comm) {
      RankState s = MakeRankState(Pattern::kRows, world, comm.rank(), 9, false);
      SaveOptions o;
      o.comm = &comm;
      o.s3 = s3_;
      return Save(s.sd, url_, o).status();
    });
  }

  std::vector<absl::Status> LoadRanks(int world, int saved_world) {
    return RunInProcess(world, [&](Communicator& comm) {
      const int r = comm.rank();
      RankState s = MakeRankState(Pattern::kCols, world, r, 9, true,
                                  r % saved_world);
      LoadOptions o;
      o.comm = &comm;
      o.s3 = s3_;
      CAIRN_RETURN_IF_ERROR(Load(s.sd, url_, o).status());
      if (std::string bad = CheckRankState(s, 9); !bad.empty()) {
        return absl::InternalError(absl::StrCat("rank ", r, ": ", bad));
      }
      return absl::OkStatus();
    });
  }

  // What the location holds, seen past the proxy.
  std::vector<std::string> Names() {
    StorageOptions o;
    o.s3 = s3_;
    o.s3.endpoint = server_->endpoint();
    auto storage = Storage::Open(url_, o);
    EXPECT_TRUE(storage.ok()) << storage.status();
    if (!storage.ok()) return {};
    auto names = (*storage)->List();
    EXPECT_TRUE(names.ok()) << names.status();
    return names.ok() ? *names : std::vector<std::string>{};
  }

  int Faults() {
    absl::StatusOr<int> n = proxy_->Faults();
    EXPECT_TRUE(n.ok()) << n.status();
    return n.ok() ? *n : -1;
  }

  const internal_s3::MotoServer* server_ = nullptr;
  std::unique_ptr<FaultProxy> proxy_;
  std::string url_;
  S3Options s3_;
};

void ExpectAllOk(const std::vector<absl::Status>& st) {
  for (size_t r = 0; r < st.size(); ++r) {
    EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r];
  }
}

TEST_F(S3FaultTest, SlowDownAndServerErrorsAreRetried) {
  ASSERT_TRUE(proxy_->Arm(R"({"fault": "status", "status": 503,
      "code": "SlowDown", "method": "PUT", "count": 3})").ok());
  ExpectAllOk(SaveRanks(2));
  EXPECT_EQ(Faults(), 3);
  ASSERT_TRUE(proxy_->Arm(R"({"fault": "status", "status": 500,
      "code": "InternalError", "method": "GET", "count": 3})").ok());
  ExpectAllOk(LoadRanks(3, 2));
  EXPECT_EQ(Faults(), 6);
}

TEST_F(S3FaultTest, TruncatedAndShortBodiesAreReadAgain) {
  ExpectAllOk(SaveRanks(2));
  ASSERT_TRUE(proxy_->Arm(R"({"fault": "truncate", "method": "GET",
      "path_contains": "data-", "count": 2})").ok());
  ExpectAllOk(LoadRanks(2, 2));
  EXPECT_EQ(Faults(), 2);
  ASSERT_TRUE(proxy_->Arm(R"({"fault": "short", "method": "GET",
      "path_contains": "data-", "count": 2})").ok());
  ExpectAllOk(LoadRanks(2, 2));
  EXPECT_EQ(Faults(), 4);
}

TEST_F(S3FaultTest, HungRequestTimesOutAndIsRetried) {
  ASSERT_TRUE(proxy_->Arm(R"({"fault": "hang", "seconds": 30,
      "method": "PUT", "path_contains": "data-", "count": 1})").ok());
  const auto start = std::chrono::steady_clock::now();
  ExpectAllOk(SaveRanks(2));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_EQ(Faults(), 1);
  ExpectAllOk(LoadRanks(1, 2));
}

TEST_F(S3FaultTest, ExhaustedRetriesFailEveryRankAndCommitNothing) {
  ASSERT_TRUE(proxy_->Arm(R"({"fault": "status", "status": 503,
      "code": "SlowDown", "method": "PUT", "path_contains": "data-",
      "count": -1})").ok());
  std::vector<absl::Status> st = SaveRanks(3);
  for (size_t r = 0; r < st.size(); ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    EXPECT_THAT(std::string(st[r].message()), HasSubstr("gave up after 4 attempts"))
        << "rank " << r;
    EXPECT_THAT(std::string(st[r].message()), HasSubstr("SlowDown"));
  }
  ASSERT_TRUE(proxy_->Arm(R"({"fault": "none"})").ok());
  const std::vector<std::string> names = Names();
  EXPECT_THAT(names, ::testing::Not(::testing::Contains("metadata.json")));
  EXPECT_THAT(names, ::testing::Not(::testing::Contains("save.lock")));
  for (const std::string& n : names) EXPECT_FALSE(n.starts_with("data-")) << n;
  // The location is usable again at once.
  ExpectAllOk(SaveRanks(3));
  ExpectAllOk(LoadRanks(2, 3));
}

TEST_F(S3FaultTest, CorruptedBytesFailTheirChecksum) {
  ExpectAllOk(SaveRanks(2));
  ASSERT_TRUE(proxy_->Arm(R"({"fault": "corrupt", "method": "GET",
      "path_contains": "data-", "count": -1})").ok());
  std::vector<absl::Status> st = LoadRanks(2, 2);
  for (size_t r = 0; r < st.size(); ++r) {
    EXPECT_EQ(st[r].code(), absl::StatusCode::kDataLoss) << st[r];
  }
}

TEST_F(S3FaultTest, DeadEndpointFailsEveryRankWithoutHanging) {
  s3_.endpoint =
      absl::StrCat("http://127.0.0.1:", internal_s3::FreeLocalPort());
  const auto start = std::chrono::steady_clock::now();
  std::vector<absl::Status> st = SaveRanks(2);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  for (size_t r = 0; r < st.size(); ++r) {
    EXPECT_FALSE(st[r].ok()) << "rank " << r;
    EXPECT_THAT(std::string(st[r].message()), HasSubstr("127.0.0.1"))
        << st[r];
  }
}

}  // namespace
}  // namespace cairn
