// `cairn convert` both ways, and `cairn inspect` / `cairn verify` on the
// Hugging Face folders it writes: bytes survive the round trip, shard sizes
// and casts apply, damage and usage errors are reported.
#include <filesystem>
#include <string>
#include <vector>

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

// --codec: the demo saves compressed, convert recompresses a checkpoint
// or stores it raw, inspect shows the frames, and the bytes never change.
TEST_F(CliTest, CodecsCompressRecompressAndDecompress) {
  const fs::path z = root_ / "z";
  Result r = Run("demo -q --size 4MiB --phase all --codec grouped-zstd "
                 "--codec-level 5 --dir '" + z.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.all(), HasSubstr("verified: yes"));
  r = Run("inspect --json '" + z.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["version"], 6);
  EXPECT_GT(j["totals"]["compressed_chunks"].get<int>(), 0);
  EXPECT_LT(j["totals"]["tensor_stored_bytes"].get<uint64_t>(),
            j["totals"]["tensor_bytes"].get<uint64_t>());
  const auto bytes = TensorBytes(z.string());

  const fs::path plain = root_ / "plain";
  r = Run("convert --json --codec none '" + z.string() + "' '" +
          plain.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_EQ(ParseJson(r)["direction"], "cairn_to_cairn");
  r = Run("inspect --json '" + plain.string() + "'");
  EXPECT_EQ(ParseJson(r)["totals"]["compressed_chunks"], 0);
  EXPECT_EQ(TensorBytes(plain.string()), bytes);

  const fs::path again = root_ / "again";
  r = Run("convert --codec zstd '" + plain.string() + "' '" + again.string() +
          "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("codec zstd"));
  r = Run("inspect --chunks '" + again.string() + "'");
  EXPECT_THAT(r.out, HasSubstr("zstd, "));
  EXPECT_THAT(r.out, HasSubstr("compressed: "));
  EXPECT_EQ(TensorBytes(again.string()), bytes);
  r = Run("verify '" + again.string() + "'");
  EXPECT_EQ(r.rc, 0) << r.all();

  r = Run("convert --codec lz4 '" + plain.string() + "' '" +
          (root_ / "x").string() + "'");
  EXPECT_EQ(r.rc, 2) << r.all();
  EXPECT_THAT(r.err, HasSubstr("--codec"));
  r = Run("convert --codec zstd --dtype BF16 '" + plain.string() + "' '" +
          (root_ / "x").string() + "'");
  EXPECT_EQ(r.rc, 2) << r.all();
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

// An incremental checkpoint (saved through the library against a base):
// inspect shows its references, verify checks through them, and convert
// --flatten writes a standalone copy that outlives the base.
TEST_F(CliTest, IncrementalCheckpointsInspectVerifyAndFlatten) {
  std::vector<float> frozen(50000), trained(50000);
  for (size_t i = 0; i < frozen.size(); ++i) frozen[i] = 0.25f * i;
  auto state = [&](float step) {
    for (size_t i = 0; i < trained.size(); ++i) trained[i] = step + i;
    cairn::StateDict sd;
    const int64_t n = static_cast<int64_t>(frozen.size());
    sd["frozen"] = cairn::ShardedTensor(
        cairn::DType::kF32, {n},
        {{cairn::Box{{0}, {n}},
          cairn::TensorView(frozen.data(), cairn::DType::kF32, {n})}});
    sd["trained"] = cairn::ShardedTensor(
        cairn::DType::kF32, {n},
        {{cairn::Box{{0}, {n}},
          cairn::TensorView(trained.data(), cairn::DType::kF32, {n})}});
    return sd;
  };
  const fs::path one = root_ / "step-1", two = root_ / "step-2";
  ASSERT_TRUE(cairn::Save(state(1), one.string()).ok());
  cairn::SaveOptions o;
  o.base = one.string();
  absl::StatusOr<cairn::SaveResult> saved = cairn::Save(state(2), two.string(), o);
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_EQ(saved->chunks_reused, 1);

  Result r = Run("inspect '" + two.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("incremental: 1 chunk of 2 chunks"));
  EXPECT_THAT(r.out, HasSubstr("../step-1 (save "));
  r = Run("inspect --json '" + two.string() + "'");
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["version"], 6);
  EXPECT_EQ(j["references"][0]["url"], "../step-1");
  EXPECT_EQ(j["totals"]["referenced_bytes"], 200000);
  r = Run("verify '" + two.string() + "'");
  EXPECT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("1 earlier checkpoint it keeps chunks in"));
  const auto bytes = TensorBytes(two.string());

  const fs::path flat = root_ / "flat";
  r = Run("convert --json --flatten '" + two.string() + "' '" +
          flat.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_EQ(ParseJson(r)["direction"], "cairn_to_cairn");
  fs::remove_all(one);
  r = Run("verify '" + two.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.out, HasSubstr("was it deleted?"));
  r = Run("inspect --json '" + flat.string() + "'");
  EXPECT_TRUE(ParseJson(r)["references"].empty());
  EXPECT_EQ(TensorBytes(flat.string()), bytes);
  r = Run("verify '" + flat.string() + "'");
  EXPECT_EQ(r.rc, 0) << r.all();
  r = Run("convert --flatten '" + flat.string() + "' '" +
          (root_ / "again").string() + "' --dtype BF16");
  EXPECT_EQ(r.rc, 2) << r.all();
}
