// `cairn convert` both ways, and `cairn inspect` / `cairn verify` on the
// Hugging Face folders it writes: bytes survive the round trip, shard sizes
// and casts apply, damage and usage errors are reported.
#include <filesystem>
#include <string>

#include "cairn/cairn.h"
#include "cli_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::HasSubstr;
using namespace cairn_cli_test;  // NOLINT

// The bytes of every tensor of the checkpoint or folder at `url`.
std::map<std::string, std::string> TensorBytes(const std::string& url) {
  std::map<std::string, std::string> out;
  absl::StatusOr<cairn::StateDict> all = cairn::LoadAll(url);
  EXPECT_TRUE(all.ok()) << all.status();
  if (!all.ok()) return out;
  std::function<void(const cairn::StateDict&, const std::string&)> walk =
      [&](const cairn::StateDict& sd, const std::string& prefix) {
        if (const cairn::ShardedTensor* t = sd.tensor()) {
          const cairn::TensorView& v = t->shards()[0].view;
          out[prefix] = std::string(static_cast<const char*>(v.data()), v.nbytes());
          return;
        }
        if (sd.kind() == cairn::StateDict::Kind::kMap) {
          for (const auto& [k, child] : sd.items()) {
            walk(child, prefix.empty() ? k : prefix + "." + k);
          }
        }
        if (sd.kind() == cairn::StateDict::Kind::kList) {
          for (size_t i = 0; i < sd.size(); ++i) {
            walk(*sd.At(i), prefix + "." + std::to_string(i));
          }
        }
      };
  walk(*all, "");
  return out;
}

TEST_F(CliTest, ConvertRoundTripsThroughAHuggingFaceFolder) {
  const fs::path ckpt = SaveDemo();
  const fs::path hf = root_ / "hf";
  Result r = Run("convert --json --max-shard-size 1MiB '" + ckpt.string() +
                 "' '" + hf.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["direction"], "cairn_to_huggingface");
  EXPECT_GT(j["files"].get<int>(), 2);
  EXPECT_FALSE(j["skipped"].empty());  // the step and RNG leaves
  EXPECT_TRUE(fs::exists(hf / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(hf / "model.safetensors"));

  r = Run("inspect '" + hf.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("Hugging Face model"));
  EXPECT_THAT(r.out, HasSubstr("model.layers.0.attn.wq"));
  r = Run("verify '" + hf.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("OK (structure only)"));
  r = Run("verify --json '" + hf.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json report = ParseJson(r);
  EXPECT_EQ(report["has_checksums"], false);
  EXPECT_EQ(report["format_version"], 0);
  EXPECT_EQ(report["ok"], true);

  const fs::path back = root_ / "back";
  r = Run("convert '" + hf.string() + "' '" + back.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("CRC32C per chunk"));
  EXPECT_THAT(r.err, HasSubstr("saving"));
  r = Run("verify '" + back.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("OK: metadata.json"));

  // Every tensor's bytes came through both conversions.
  const auto want = TensorBytes(ckpt.string());
  const auto got = TensorBytes(back.string());
  size_t tensors = 0;
  for (const auto& [fqn, bytes] : want) {
    if (fqn.starts_with("rng.") || fqn == "step") continue;
    ++tensors;
    ASSERT_TRUE(got.contains(fqn)) << fqn;
    EXPECT_EQ(got.at(fqn), bytes) << fqn;
  }
  EXPECT_GT(tensors, 10u);

  // Again into the same folder: refused, then replaced.
  r = Run("convert '" + ckpt.string() + "' '" + hf.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.err, HasSubstr("ALREADY_EXISTS"));
  r = Run("convert --overwrite --dtype BF16 '" + ckpt.string() + "' '" +
          hf.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_TRUE(fs::exists(hf / "model.safetensors"));
  EXPECT_FALSE(fs::exists(hf / "model.safetensors.index.json"));
  absl::StatusOr<cairn::Metadata> md = cairn::ReadMetadata(hf.string());
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->tensors.at("model.layers.0.attn.wq").dtype, cairn::DType::kBF16);
}

TEST_F(CliTest, ConvertAndVerifyReportBadInput) {
  const fs::path ckpt = SaveDemo();
  const fs::path hf = root_ / "hf";
  Result r = Run("convert --dtype F7 '" + ckpt.string() + "' '" +
                 hf.string() + "'");
  EXPECT_EQ(r.rc, 2) << r.all();
  r = Run("convert --dtype I32 '" + ckpt.string() + "' '" + hf.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.err, HasSubstr("cannot cast to I32"));
  r = Run("convert --strip-prefix x '" + ckpt.string() + "' '" + hf.string() +
          "'");
  EXPECT_EQ(r.rc, 2) << r.all();
  r = Run("convert '" + (root_ / "nothing").string() + "' '" + hf.string() +
          "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.err, HasSubstr("NOT_FOUND"));
  // A truncated model file: verify names it.
  r = Run("convert '" + ckpt.string() + "' '" + hf.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  const fs::path file = hf / "model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 100);
  r = Run("verify '" + hf.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.err, HasSubstr("model.safetensors"));
  r = Run("convert --help");
  EXPECT_EQ(r.rc, 0);
  for (const char* s : {"--max-shard-size", "--dtype", "--strip-prefix",
                        "Examples", "CRC32C"}) {
    EXPECT_THAT(r.out, HasSubstr(s));
  }
}

}  // namespace
