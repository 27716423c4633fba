// Every CLI command that takes a checkpoint folder, on an s3:// URL: demo
// (global and rank-local), inspect, verify, merge, convert both ways and
// bench, against a real S3-compatible server (moto), reached through the
// AWS_* environment variables as a user would.
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/s3/moto_test_util.h"

namespace cairn_cli_test {
namespace {

using ::testing::HasSubstr;

class CliS3Test : public CliTest {
 protected:
  void SetUp() override {
    CliTest::SetUp();
    CAIRN_MOTO_OR_SKIP(server);
    auto client = server->Client("cairn-cli");
    ASSERT_TRUE(client.ok()) << client.status();
    setenv("AWS_ENDPOINT_URL", server->endpoint().c_str(), 1);
    setenv("AWS_ACCESS_KEY_ID", "testing", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "testing", 1);
    setenv("AWS_REGION", "us-east-1", 1);
    url_ = absl::StrFormat("s3://cairn-cli/%d-%s", ::getpid(),
                           ::testing::UnitTest::GetInstance()
                               ->current_test_info()
                               ->name());
  }
  std::string url_;
};

TEST_F(CliS3Test, DemoInspectVerifyAndConvertOnS3) {
  const std::string ckpt = url_ + "/ckpt";
  Result demo = Run("demo --dir " + ckpt + " --size 4MiB --phase save");
  ASSERT_EQ(demo.rc, 0) << demo.all();
  Result load = Run("demo --dir " + ckpt + " --phase load --load-ranks 3");
  ASSERT_EQ(load.rc, 0) << load.all();
  EXPECT_THAT(load.out, HasSubstr("verified: yes"));
  Result inspect = Run("inspect " + ckpt);
  ASSERT_EQ(inspect.rc, 0) << inspect.all();
  EXPECT_THAT(inspect.out, HasSubstr(ckpt));
  Result verify = Run("verify " + ckpt);
  ASSERT_EQ(verify.rc, 0) << verify.all();
  EXPECT_THAT(verify.out, HasSubstr("OK"));
  // Out to a local Hugging Face folder, and back in as a checkpoint on S3.
  const std::string hf = (root_ / "hf").string();
  Result out = Run("convert " + ckpt + " " + hf);
  ASSERT_EQ(out.rc, 0) << out.all();
  Result in = Run("convert " + hf + " " + url_ + "/back");
  ASSERT_EQ(in.rc, 0) << in.all();
  Result verify_back = Run("verify " + url_ + "/back");
  EXPECT_EQ(verify_back.rc, 0) << verify_back.all();
  // Hugging Face export onto object storage is refused by name.
  Result refused = Run("convert " + ckpt + " " + url_ + "/hf");
  EXPECT_NE(refused.rc, 0);
  EXPECT_THAT(refused.all(), HasSubstr("local folders only"));
}

TEST_F(CliS3Test, RankLocalDemoMergesOnS3) {
  const std::string ckpt = url_ + "/rl";
  Result save =
      Run("demo --dir " + ckpt + " --size 4MiB --rank-local --phase save");
  ASSERT_EQ(save.rc, 0) << save.all();
  Result merge = Run("merge " + ckpt);
  ASSERT_EQ(merge.rc, 0) << merge.all();
  EXPECT_THAT(merge.all(), HasSubstr("wrote metadata.json"));
  Result verify = Run("verify " + ckpt);
  EXPECT_EQ(verify.rc, 0) << verify.all();
}

TEST_F(CliS3Test, BenchCountsRequests) {
  Result bench = Run("bench --dir " + url_ +
                     "/bench --size 4MiB --phases save,load --json -q");
  ASSERT_EQ(bench.rc, 0) << bench.all();
  EXPECT_THAT(bench.out, HasSubstr("\"requests_per_gib\""));
  EXPECT_THAT(bench.out, HasSubstr("load_4to3_cols"));
}

TEST_F(CliS3Test, DamagedObjectFailsVerify) {
  const std::string ckpt = url_ + "/damaged";
  ASSERT_EQ(Run("demo --dir " + ckpt + " --size 4MiB --phase save").rc, 0);
  auto server = cairn::internal_s3::MotoServer::Shared();
  ASSERT_TRUE(server.ok());
  auto client = (*server)->Client("cairn-cli");
  ASSERT_TRUE(client.ok());
  const std::string prefix = ckpt.substr(std::string("s3://cairn-cli/").size());
  auto objects = client->List(prefix + "/data-");
  ASSERT_TRUE(objects.ok() && !objects->empty()) << objects.status();
  const auto& victim = objects->front();
  std::string bytes(victim.size, '\0');
  ASSERT_TRUE(client
                  ->GetRange(victim.key, 0,
                             std::as_writable_bytes(std::span(bytes)), "")
                  .ok());
  bytes[bytes.size() - 100] ^= 0x10;
  ASSERT_TRUE(
      client->Put(victim.key, std::as_bytes(std::span(bytes)), false).ok());
  Result verify = Run("verify " + ckpt);
  EXPECT_NE(verify.rc, 0) << verify.all();
  EXPECT_THAT(verify.all(), HasSubstr("crc32c"));
}

}  // namespace
}  // namespace cairn_cli_test
