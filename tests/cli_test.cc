// Drives the built `cairn` binary (CAIRN_BINARY) end to end: demo (several
// in-process ranks, resharding, separate save and load runs, rank-local
// saves with rank-local or merged loads, data-parallel replicas with
// broadcast load, MPI errors), inspect, verify (good, corrupted, truncated,
// missing files), help and usage errors. The demo under mpiexec is
// tests/demo_mpi_test.sh.
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/cairn.h"
#include "format/metadata_codec.h"
#include "gmock/gmock.h"
#include "cli_fixture.h"
#include "gtest/gtest.h"
#include "synthetic_model.h"

namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

using namespace cairn_cli_test;  // NOLINT

// The key-value demo saves on 4 ranks, loads on 3 twice (saved and other
// bucketing), every row checked, and a kept checkpoint that inspect and
// verify read.
TEST_F(CliTest, DemoKvSavesLoadsAndChecksEveryRow) {
  const fs::path dir = root_ / "kv";
  Result r = Run("demo -q --kv --kv-rows 20000 --kv-buckets 10 --json --dir '" +
                 dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["rows"], 20000);
  ASSERT_EQ(j["phases"].size(), 3u);
  for (const nlohmann::json& p : j["phases"]) {
    EXPECT_EQ(p["rows"], 20000) << p;
    EXPECT_GT(p["seconds"].get<double>(), 0) << p;
  }
  EXPECT_EQ(j["phases"][2]["buckets"], 16);
  r = Run("inspect '" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("emb.items"));
  EXPECT_THAT(r.out, HasSubstr("10 interleaved"));
  EXPECT_THAT(r.out, HasSubstr("1 key-value table (20000 rows)"));
  r = Run("verify '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 0) << r.all();
  r = Run("demo --kv --comm mpi");
  EXPECT_EQ(r.rc, 2) << r.all();
  EXPECT_THAT(r.err, HasSubstr("--kv runs its ranks in this process"));
}

TEST_F(CliTest, DemoJsonVerifiesEveryElement) {
  Result r = Run("demo --size 8MiB --json");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true);
  const double bytes = j["bytes"].get<double>();
  EXPECT_NEAR(bytes, 8.0 * (1 << 20), 0.02 * 8 * (1 << 20));
  for (const char* key :
       {"save_seconds", "load_seconds", "save_gbps", "load_gbps"}) {
    ASSERT_TRUE(j.contains(key)) << key;
    EXPECT_GT(j[key].get<double>(), 0) << key;
  }
  EXPECT_EQ(j["elements_verified"], j["elements"]);
  EXPECT_EQ(j["kept"], false);
  // The disk beside the checkpoint was probed (or the reason it was not is
  // given: a RAM filesystem, say).
  ASSERT_TRUE(j.contains("disk_probe"));
  const nlohmann::json& disk = j["disk_probe"];
  EXPECT_GE(disk["bytes"].get<double>(), 32.0 * (1 << 20));
  if (disk.contains("skipped")) {
    EXPECT_FALSE(disk["skipped"].get<std::string>().empty());
  } else {
    EXPECT_GT(disk["write_gbps"].get<double>(), 0);
    EXPECT_GT(disk["read_gbps"].get<double>(), 0);
  }
  // The default temporary directory is gone afterwards.
  EXPECT_FALSE(fs::exists(j["dir"].get<std::string>()));
  // Progress lines go to stderr.
  EXPECT_THAT(r.err, HasSubstr("cairn demo: "));
}

TEST_F(CliTest, DemoDiskProbeCanBeTurnedOff) {
  Result r = Run("demo -q --size 2MiB --layers 2 --no-disk-probe --json");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_FALSE(ParseJson(r).contains("disk_probe"));
  // The table has a disk line with the probe on, none without.
  r = Run("demo -q --size 2MiB --layers 2");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("disk: "));
  r = Run("demo -q --size 2MiB --layers 2 --no-disk-probe");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, Not(HasSubstr("disk: ")));
}

TEST_F(CliTest, DemoTableSaysVerified) {
  Result r = Run("demo -q --size 2MiB --layers 2");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("verified: yes"));
  EXPECT_THAT(r.out, HasSubstr("save"));
  EXPECT_THAT(r.out, HasSubstr("load"));
  EXPECT_EQ(r.err, "");
}

TEST_F(CliTest, DemoSaveThenLoadInSeparateInvocations) {
  const fs::path dir = SaveDemo();
  ASSERT_TRUE(fs::exists(dir / "metadata.json"));
  Result r = Run("demo -q --phase load --json --dir '" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true);
  EXPECT_EQ(j["step"], 42);
  // The checkpoint is the user's: kept.
  EXPECT_TRUE(fs::exists(dir / "metadata.json"));

  // Expecting another step: the first element is named as wrong.
  r = Run("demo -q --phase load --step 43 --dir '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.out, HasSubstr("verified: NO"));
  EXPECT_THAT(r.err, HasSubstr("cairn demo: DATA_LOSS: verification failed"));
  EXPECT_THAT(r.err, HasSubstr("expected"));
  EXPECT_THAT(r.err, HasSubstr("(element "));
}

TEST_F(CliTest, DemoRefusesToOverwriteUnlessAsked) {
  const fs::path dir = SaveDemo();
  Result r =
      Run("demo -q --size 4MiB --phase save --dir '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("already holds a checkpoint"));
  EXPECT_THAT(r.err, HasSubstr("--overwrite"));
  r = Run("demo -q --size 4MiB --overwrite --step 5 --dir '" + dir.string() +
          "'");
  EXPECT_EQ(r.rc, 0) << r.all();
  r = Run("demo -q --phase load --json --dir '" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_EQ(ParseJson(r)["step"], 5);
}

TEST_F(CliTest, DemoUsageErrors) {
  EXPECT_EQ(Run("demo --size lots").rc, 2);
  EXPECT_EQ(Run("demo --phase sideways").rc, 2);
  Result r = Run("demo --phase load");  // no --dir
  EXPECT_EQ(r.rc, 2);
  EXPECT_THAT(r.err, HasSubstr("--dir"));
  r = Run("demo -q --phase load --dir '" + (root_ / "nothing").string() + "'");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("cairn demo: NOT_FOUND"));
}

// Sizes and steps out of range are usage errors that say so, at once:
// --size 18446744073709551615 once spun forever choosing the model (its
// byte count wrapped below the target), and --step 99999999999999999999
// was stored as INT64_MAX. The largest step is kept exactly, and a step is
// read as decimal ("010" is ten, not octal eight).
TEST_F(CliTest, DemoRefusesSizesAndStepsOutOfRange) {
  const std::string dir = "'" + (root_ / "ckpt").string() + "'";
  for (const char* size : {"18446744073709551615", "2048TiB"}) {
    SCOPED_TRACE(size);
    Result r = Run(absl::StrCat("demo -q --phase save --dir ", dir, " --size ",
                                size));
    EXPECT_EQ(r.rc, 2) << r.all();
    EXPECT_THAT(r.err, HasSubstr("--size"));
    EXPECT_THAT(r.err, HasSubstr("at most 1125899906842624 bytes (1.00 PiB)"));
  }
  for (const char* step :
       {"99999999999999999999", "-99999999999999999999", "9223372036854775808",
        "1e3", "0x10", "ten"}) {
    SCOPED_TRACE(step);
    Result r = Run(absl::StrCat("demo -q --size 4MiB --phase save --dir ", dir,
                                " --step ", step));
    EXPECT_EQ(r.rc, 2) << r.all();
    EXPECT_THAT(r.err, HasSubstr("--step"));
    EXPECT_THAT(r.err, HasSubstr("a decimal integer in [-9223372036854775808, "
                                 "9223372036854775807]"));
  }
  EXPECT_FALSE(fs::exists(root_ / "ckpt" / "metadata.json"));
  // --async saves steps --step + 1 .. --step + --steps.
  Result r = Run("demo -q --size 4MiB --async --steps 10 --save-every 5 "
                 "--step 9223372036854775800");
  EXPECT_EQ(r.rc, 2) << r.all();
  EXPECT_THAT(r.err, HasSubstr("--step 9223372036854775800 + --steps 10"));

  for (const auto& [step, stored] :
       std::vector<std::pair<std::string, int64_t>>{
           {"9223372036854775807", INT64_MAX},
           {"-9223372036854775808", INT64_MIN},
           {"010", 10}}) {
    SCOPED_TRACE(step);
    r = Run(absl::StrCat("demo -q --size 4MiB --overwrite --json --phase save "
                         "--dir ", dir, " --step ", step));
    ASSERT_EQ(r.rc, 0) << r.all();
    EXPECT_EQ(ParseJson(r)["step"].get<int64_t>(), stored);
    r = Run(absl::StrCat("demo -q --phase load --json --dir ", dir));
    ASSERT_EQ(r.rc, 0) << r.all();
    EXPECT_EQ(ParseJson(r)["step"].get<int64_t>(), stored);
  }
}

// --async: a training loop with an async save every --save-every steps; the
// load checks the last one (values changed right after each Save() returned
// must not have reached it).
TEST_F(CliTest, DemoAsyncReportsBlockedTimeAndVerifiesLastSave) {
  Result r = Run("demo -q --async --steps 6 --save-every 3 --size 4MiB --json");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["async_steps"], 6);
  EXPECT_EQ(j["step"], 1000 + 6);  // the last async save's values
  ASSERT_TRUE(j["blocked_seconds"].is_array()) << r.out;
  ASSERT_EQ(j["blocked_seconds"].size(), 6u / 3u) << r.out;
  for (const nlohmann::json& b : j["blocked_seconds"]) {
    ASSERT_TRUE(b.is_number()) << r.out;
    EXPECT_GE(b.get<double>(), 0);
  }
  EXPECT_EQ(j["async_save_steps"], nlohmann::json({3, 6}));
  EXPECT_GT(j["sync_save_seconds"].get<double>(), 0);

  // The table: a line per save; the step folders and the sync one exist.
  const fs::path dir = root_ / "async";
  r = Run("demo -q --async --steps 4 --save-every 2 --size 2MiB --dir '" +
          dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("step 2: training blocked"));
  EXPECT_THAT(r.out, HasSubstr("step 4: training blocked"));
  EXPECT_THAT(r.out, HasSubstr("verified: yes"));
  EXPECT_TRUE(fs::exists(dir / "sync" / "metadata.json"));
  EXPECT_TRUE(fs::exists(dir / "step-2" / "metadata.json"));
  EXPECT_TRUE(fs::exists(dir / "step-4" / "metadata.json"));
  // A separate load of an async step checks that step's values.
  r = Run("demo -q --phase load --json --dir '" + (dir / "step-2").string() +
          "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_EQ(ParseJson(r)["step"], 1002);

  EXPECT_EQ(Run("demo --async --phase load --dir '" + dir.string() + "'").rc,
            2);
  EXPECT_EQ(Run("demo --steps 4").rc, 2);  // needs --async
  EXPECT_EQ(Run("demo --async --steps 2 --save-every 5").rc, 2);
}

TEST_F(CliTest, DemoSavesWithFourRanksAndLoadsWithThree) {
  Result r = Run("demo -q --size 4MiB --ranks 4 --load-ranks 3 --json");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["comm"], "inproc");
  EXPECT_EQ(j["ranks"], 4);
  EXPECT_EQ(j["load_ranks"], 3);
  EXPECT_EQ(j["save_shards"], 4);
  EXPECT_EQ(j["load_shards"], 3);
  EXPECT_EQ(j["save_files"], 4);  // one data file per rank
  EXPECT_EQ(j["elements_verified"], j["elements"]);
  EXPECT_EQ(j["rng_objects_verified"], 4);
  EXPECT_GE(j["checkpoint_bytes"].get<double>(), j["bytes"].get<double>());
  EXPECT_GT(j["load_bytes_read"].get<double>(), 0);
  EXPECT_EQ(r.err, "");
}

TEST_F(CliTest, DemoLoadsWithMoreRanksThanSaved) {
  Result r = Run("demo -q --size 2MiB --ranks 2 --load-ranks 5 --json");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["ranks"], 2);
  EXPECT_EQ(j["load_ranks"], 5);
  EXPECT_EQ(j["elements_verified"], j["elements"]);
  EXPECT_EQ(j["rng_objects_verified"], 2);
}

TEST_F(CliTest, DemoTableShowsRanksAndThroughput) {
  Result r = Run("demo -q --size 2MiB --ranks 3 --load-ranks 2");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("ranks"));
  EXPECT_THAT(r.out, HasSubstr("GB/s"));
  EXPECT_THAT(r.out, HasSubstr("saved by 3 ranks, loaded by 2"));
  EXPECT_THAT(r.out, HasSubstr("3 rng objects match"));
}

TEST_F(CliTest, DemoSaveAndLoadWithDifferentRankCountsInSeparateRuns) {
  const fs::path dir = root_ / "ranks";
  Result r =
      Run("demo -q --size 4MiB --phase save --ranks 4 --step 9 --json "
          "--dir '" +
          dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["ranks"], 4);
  EXPECT_TRUE(j["load_ranks"].is_null());
  auto md = cairn::ReadMetadata(dir.string());
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->world_size, 4);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(md->objects.contains("rng.rank" + std::to_string(rank)));
  }
  // The rank count is in the user metadata, for the load's RNG checks.
  EXPECT_EQ(nlohmann::json::parse(md->user)["cairn_demo"]["save_ranks"], 4);

  r = Run("demo -q --phase load --load-ranks 2 --json --dir '" + dir.string() +
          "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["ranks"], 4);
  EXPECT_EQ(j["load_ranks"], 2);
  EXPECT_EQ(j["step"], 9);
  EXPECT_EQ(j["elements_verified"], j["elements"]);
  EXPECT_EQ(j["rng_objects_verified"], 4);
  EXPECT_TRUE(j["save_seconds"].is_null());
}

// A checkpoint as the demo wrote it before --ranks: whole tensors from one
// process, one "rng" object, version 1 user metadata without save_ranks.
TEST_F(CliTest, DemoLoadsACheckpointOfTheSingleProcessDemo) {
  namespace t = cairn::tools;
  const fs::path dir = root_ / "v1";
  auto model = t::BuildModel(t::ChooseConfig(uint64_t{1} << 20, 2).value());
  ASSERT_TRUE(model.ok());
  const int64_t step = 3;
  cairn::StateDict sd;
  for (const t::SyntheticTensor& tensor : model->tensors) {
    cairn::Tensor buf =
        cairn::Tensor::Empty(tensor.dtype, tensor.shape).value();
    ASSERT_TRUE(
        t::FillBox(tensor, cairn::Box::Full(tensor.shape), buf.view(), step, 2)
            .ok());
    t::InsertLeaf(sd, tensor.fqn, cairn::StateDict(buf));
  }
  t::InsertLeaf(sd, "step", cairn::StateDict(int64_t{step}));
  t::InsertLeaf(sd, "rng",
                cairn::StateDict(cairn::Object{
                    t::RngBytes("rng", step, model->config.rng_bytes)}));
  cairn::SaveOptions options;
  const t::SyntheticConfig& c = model->config;
  options.user_metadata = nlohmann::json{
      {"cairn_demo",
       {{"version", 1},
        {"layers", c.layers},
        {"hidden", c.hidden},
        {"ffn", c.ffn},
        {"vocab", c.vocab},
        {"rng_bytes", c.rng_bytes},
        {"step", step}}}}.dump();
  auto saved = cairn::Save(sd, dir.string(), options);
  ASSERT_TRUE(saved.ok()) << saved.status();

  Result r = Run("demo -q --phase load --load-ranks 2 --json --dir '" +
                 dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["ranks"], 1);
  EXPECT_EQ(j["rng_objects_verified"], 1);
  EXPECT_EQ(j["step"], step);
}

// The sum of a JSON list of numbers.
double Sum(const nlohmann::json& list) {
  double sum = 0;
  for (const auto& v : list) sum += v.get<double>();
  return sum;
}

// Rank-local save and load on the same ranks: every rank writes and reads
// only its own folder; nothing is merged.
TEST_F(CliTest, DemoRankLocalWithTheSameRanksLoadsRankLocal) {
  const fs::path dir = root_ / "local44";
  Result r = Run("demo -q --size 4MiB --rank-local --ranks 4 --load-ranks 4 "
                 "--json --dir '" +
                 dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["rank_local"], true);
  EXPECT_EQ(j["load_mode"], "rank_local");
  EXPECT_TRUE(j["merge_seconds"].is_null());
  EXPECT_EQ(j["ranks"], 4);
  EXPECT_EQ(j["load_ranks"], 4);
  EXPECT_EQ(j["save_files"], 4);
  EXPECT_EQ(j["elements_verified"], j["elements"]);
  EXPECT_EQ(j["rng_objects_verified"], 4);
  EXPECT_EQ(j["load_replica_group_size"], 1);
  ASSERT_EQ(j["load_bytes_read_per_rank"].size(), 4u);
  EXPECT_EQ(Sum(j["load_bytes_read_per_rank"]),
            j["load_bytes_read"].get<double>());
  for (const char* phase : {"metadata", "planning", "read", "broadcast",
                            "copy"}) {
    EXPECT_TRUE(j["load_phases"][phase].is_number()) << phase;
  }
  // One folder per rank, no global metadata (nothing was merged).
  EXPECT_FALSE(fs::exists(dir / "metadata.json"));
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(fs::exists(dir / ("rank-0000" + std::to_string(rank)) /
                           "metadata.json"))
        << rank;
  }

  r = Run("demo -q --size 4MiB --rank-local --ranks 4 --load-ranks 4 "
          "--overwrite --dir '" +
          dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("save: rank-local"));
  EXPECT_THAT(r.out, HasSubstr("load: rank-local"));
  EXPECT_THAT(r.out, HasSubstr("verified: yes"));
}

// Rank-local save with 4 ranks, load with 3: merge (timed), then reshard.
TEST_F(CliTest, DemoRankLocalWithOtherRanksMergesThenReshards) {
  const fs::path dir = root_ / "local43";
  Result r = Run("demo -q --size 4MiB --rank-local --json --dir '" +
                 dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["rank_local"], true);
  EXPECT_EQ(j["ranks"], 4);
  EXPECT_EQ(j["load_ranks"], 3);
  EXPECT_EQ(j["load_mode"], "merge_then_global");
  ASSERT_TRUE(j["merge_seconds"].is_number()) << r.out;
  EXPECT_GE(j["merge_seconds"].get<double>(), 0);
  EXPECT_EQ(j["elements_verified"], j["elements"]);
  EXPECT_EQ(j["rng_objects_verified"], 4);
  // Rank-local saves do not dedup: the replicated norms are on disk 4 times.
  EXPECT_GT(j["checkpoint_bytes"].get<double>(), j["bytes"].get<double>());
  // The merge committed a global checkpoint pointing into the rank folders.
  auto md = cairn::ReadMetadata(dir.string());
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->world_size, 4);
  EXPECT_EQ(nlohmann::json::parse(md->user)["cairn_demo"]["rank_local"], true);

  r = Run("demo -q --size 2MiB --rank-local --ranks 2 --load-ranks 3");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("load: merged the 2 rank folders"));
  EXPECT_THAT(r.out, HasSubstr("resharding 2 -> 3"));
  EXPECT_THAT(r.out, HasSubstr("verified: yes"));
}

// A rank-local save in one run, loads in others: the demo config comes from
// rank-00000/metadata.json until the checkpoint is merged.
TEST_F(CliTest, DemoRankLocalSaveThenLoadInSeparateInvocations) {
  const fs::path dir = root_ / "local";
  const std::string at = " --dir '" + dir.string() + "'";
  Result r = Run("demo -q --size 4MiB --phase save --rank-local --ranks 4 "
                 "--step 9 --json" +
                 at);
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["rank_local"], true);
  EXPECT_EQ(j["save_files"], 4);
  EXPECT_FALSE(fs::exists(dir / "metadata.json"));
  auto md = cairn::ReadMetadata((dir / "rank-00002").string());
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->rank, 2);
  EXPECT_EQ(md->world_size, 4);
  const nlohmann::json user = nlohmann::json::parse(md->user)["cairn_demo"];
  EXPECT_EQ(user["save_ranks"], 4);
  EXPECT_EQ(user["replicas"], 1);
  EXPECT_EQ(user["rank_local"], true);

  // Not over a rank-local checkpoint either, unless asked.
  r = Run("demo -q --size 4MiB --phase save --ranks 2" + at);
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.err, HasSubstr("already holds a checkpoint"));

  // 2 ranks: merge first.
  r = Run("demo -q --phase load --load-ranks 2 --json" + at);
  ASSERT_EQ(r.rc, 0) << r.all();
  j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["load_mode"], "merge_then_global");
  EXPECT_TRUE(j["merge_seconds"].is_number());
  EXPECT_EQ(j["ranks"], 4);
  EXPECT_EQ(j["load_ranks"], 2);
  EXPECT_EQ(j["step"], 9);
  EXPECT_EQ(j["rng_objects_verified"], 4);
  EXPECT_TRUE(fs::exists(dir / "metadata.json"));

  // 4 ranks, the save's layout: rank-local, from the rank folders.
  r = Run("demo -q --phase load --load-ranks 4 --json" + at);
  ASSERT_EQ(r.rc, 0) << r.all();
  j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["load_mode"], "rank_local");
  EXPECT_EQ(j["rng_objects_verified"], 4);

  // 3 ranks: already merged, so a plain global load.
  r = Run("demo -q --phase load --load-ranks 3" + at);
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("merged earlier"));
  EXPECT_THAT(r.out, HasSubstr("verified: yes"));

  // A smaller rank-local save over it un-commits the extra rank folders, so
  // that the next merge sees only the new save's ranks.
  r = Run("demo -q --size 2MiB --phase save --rank-local --ranks 2 --step 3 "
          "--overwrite" +
          at);
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_FALSE(fs::exists(dir / "metadata.json"));
  EXPECT_FALSE(fs::exists(dir / "rank-00003" / "metadata.json"));
  r = Run("demo -q --phase load --load-ranks 3 --json" + at);
  ASSERT_EQ(r.rc, 0) << r.all();
  j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["load_mode"], "merge_then_global");
  EXPECT_EQ(j["step"], 3);
  EXPECT_EQ(j["rng_objects_verified"], 2);
}

// Two data-parallel replica groups of 2 tensor-parallel ranks: the save
// writes one copy, and broadcast load reads one copy from storage (the
// replicas of a shard split the reads); without broadcast, two copies.
TEST_F(CliTest, DemoReplicasReadOneCopyWithBroadcastLoad) {
  Result r = Run("demo -q --size 8MiB --replicas 2 --ranks 2 --load-ranks 2 "
                 "--json");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["replicas"], 2);
  EXPECT_EQ(j["save_replicas"], 2);
  EXPECT_EQ(j["ranks"], 2);
  EXPECT_EQ(j["load_ranks"], 2);
  EXPECT_EQ(j["save_world"], 4);
  EXPECT_EQ(j["load_world"], 4);
  EXPECT_EQ(j["rank_local"], false);
  EXPECT_EQ(j["load_mode"], "global");
  EXPECT_TRUE(j["merge_seconds"].is_null());
  EXPECT_EQ(j["elements_verified"], j["elements"]);
  EXPECT_EQ(j["rng_objects_verified"], 4);  // one per save rank
  EXPECT_EQ(j["load_replica_group_size"], 2);
  EXPECT_GT(j["load_phases"]["broadcast"].get<double>(), 0);
  // Replicated boxes written once: one copy on disk.
  const double bytes = j["bytes"].get<double>();
  const double on_disk = j["checkpoint_bytes"].get<double>();
  EXPECT_LT(on_disk, 1.05 * bytes);
  ASSERT_EQ(j["load_bytes_read_per_rank"].size(), 4u);
  for (const auto& v : j["load_bytes_read_per_rank"]) {
    EXPECT_GT(v.get<double>(), 0);  // every replica did its share
  }
  const double with = Sum(j["load_bytes_read_per_rank"]);
  EXPECT_EQ(with, j["load_bytes_read"].get<double>());
  // One copy: the uneven (resharding) load reads a little more than the
  // bytes it needs (nearby runs coalesced), ~1.15x; two copies would be
  // over 2x.
  EXPECT_GE(with, bytes);
  EXPECT_LE(with, 1.3 * on_disk) << r.out;

  r = Run("demo -q --size 8MiB --replicas 2 --ranks 2 --load-ranks 2 "
          "--no-broadcast --json");
  ASSERT_EQ(r.rc, 0) << r.all();
  j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["broadcast"], false);
  EXPECT_EQ(j["load_replica_group_size"], 1);
  const double without = Sum(j["load_bytes_read_per_rank"]);
  EXPECT_NEAR(without / with, 2.0, 0.1) << with << " vs " << without;

  r = Run("demo -q --size 2MiB --replicas 2 --ranks 2 --load-ranks 3");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("2 replica groups x 2 tensor-parallel"));
  EXPECT_THAT(r.out, HasSubstr("broadcast load in replica groups of 2"));
  EXPECT_THAT(r.out, HasSubstr("storage read per rank: "));
  EXPECT_THAT(r.out, HasSubstr("load phases (slowest rank): "));
  EXPECT_THAT(r.out, HasSubstr("saved by 4 ranks, loaded by 6"));
  EXPECT_THAT(r.out, HasSubstr("every replica checked its own copy"));
}

// Rank-local with replicas: every replica writes its shards, and the
// rank-local load reads each rank's own folder (no broadcast).
TEST_F(CliTest, DemoRankLocalWithReplicas) {
  Result r = Run("demo -q --size 4MiB --rank-local --replicas 2 --ranks 2 "
                 "--load-ranks 2 --json");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["load_mode"], "rank_local");
  EXPECT_EQ(j["load_replica_group_size"], 1);
  EXPECT_EQ(j["rng_objects_verified"], 4);
  EXPECT_EQ(j["elements_verified"], j["elements"]);
  const double bytes = j["bytes"].get<double>();
  EXPECT_GT(j["checkpoint_bytes"].get<double>(), 1.9 * bytes);  // 2 copies
  EXPECT_GT(Sum(j["load_bytes_read_per_rank"]), 1.9 * bytes);

  // Another layout: merged (replicas kept once), then broadcast load.
  r = Run("demo -q --size 4MiB --rank-local --replicas 2 --ranks 2 "
          "--load-ranks 1 --json");
  ASSERT_EQ(r.rc, 0) << r.all();
  j = ParseJson(r);
  EXPECT_EQ(j["verified"], true) << r.out;
  EXPECT_EQ(j["load_mode"], "merge_then_global");
  EXPECT_EQ(j["load_replica_group_size"], 2);
  EXPECT_LE(Sum(j["load_bytes_read_per_rank"]),
            1.05 * j["bytes"].get<double>());
}

TEST_F(CliTest, DemoRankUsageErrors) {
  EXPECT_EQ(Run("demo --ranks 0").rc, 2);
  EXPECT_EQ(Run("demo --load-ranks 0").rc, 2);
  EXPECT_EQ(Run("demo --ranks many").rc, 2);
  EXPECT_EQ(Run("demo --comm carrier-pigeon").rc, 2);
  Result r = Run("demo --size 1MiB --ranks 1000");
  EXPECT_EQ(r.rc, 2);
  EXPECT_THAT(r.err, HasSubstr("at most 256 with --comm inproc"));
  EXPECT_EQ(Run("demo --replicas 0").rc, 2);
  r = Run("demo --size 1MiB --replicas 100 --ranks 3");
  EXPECT_EQ(r.rc, 2);
  EXPECT_THAT(r.err, HasSubstr("--replicas x --ranks"));
  EXPECT_THAT(r.err, HasSubstr("at most 256 with --comm inproc"));
}

// Without mpirun, MPI starts this process as a world of one (a singleton),
// so --ranks 2 cannot match; without MPI in the build, --comm mpi says so.
TEST_F(CliTest, DemoCommMpiErrorsAreClear) {
  Result r = Run("demo -q --comm mpi --size 1MiB --ranks 2");
  if (cairn::HasMpi()) {
    EXPECT_EQ(r.rc, 2) << r.all();
    EXPECT_THAT(r.err,
                HasSubstr("--ranks 2 does not match the MPI world size 1"));
    r = Run("demo -q --comm mpi --size 1MiB --load-ranks 2");
    EXPECT_EQ(r.rc, 2) << r.all();
    EXPECT_THAT(r.err, HasSubstr("--load-ranks 2 is more than the MPI world "
                                 "size 1"));
    r = Run("demo -q --comm mpi --size 1MiB --replicas 2");
    EXPECT_EQ(r.rc, 2) << r.all();
    EXPECT_THAT(r.err, HasSubstr("the MPI world size 1 is not a multiple of "
                                 "--replicas 2"));
  } else {
    EXPECT_EQ(r.rc, 1) << r.all();
    EXPECT_THAT(r.err, HasSubstr("cairn demo: UNIMPLEMENTED: --comm mpi"));
    EXPECT_THAT(r.err, HasSubstr("without MPI"));
  }
  EXPECT_EQ(r.out, "");
}

TEST_F(CliTest, InspectListsTensorsObjectsAndScalars) {
  const fs::path dir = SaveDemo();
  Result r = Run("inspect --json '" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  bool found = false;
  for (const auto& t : j["tensors"]) {
    if (t["fqn"] == "model.layers.0.attn.wq") {
      found = true;
      EXPECT_EQ(t["dtype"], "F32");
      EXPECT_EQ(t["chunks"], 4);
      EXPECT_EQ(t["shape"].size(), 2u);
    }
    if (t["fqn"] == "optim.exp_avg.model.norm") {
      // Held whole by all 4 ranks, written once.
      EXPECT_EQ(t["chunks"], 1);
    }
  }
  EXPECT_TRUE(found) << r.out;
  EXPECT_EQ(j["scalars"]["step"], 42);
  ASSERT_EQ(j["objects"].size(), 4u);  // one RNG object per save rank
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(j["objects"][rank]["fqn"], "rng.rank" + std::to_string(rank));
  }
  EXPECT_GT(j["totals"]["bytes"].get<double>(), 3.0 * (1 << 20));
  EXPECT_EQ(j["totals"]["tensors"], j["tensors"].size());

  r = Run("inspect '" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("model.layers.0.mlp.w2"));
  EXPECT_THAT(r.out, HasSubstr("step"));
  EXPECT_THAT(r.out, HasSubstr("total:"));

  r = Run("inspect '" + (root_ / "nothing").string() + "'");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("cairn inspect: NOT_FOUND"));
}

TEST_F(CliTest, VerifyPassesOnAGoodCheckpoint) {
  const fs::path dir = SaveDemo();
  Result r = Run("verify '" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("OK: metadata.json (its checksum matched)"));
  EXPECT_THAT(r.out, HasSubstr("GB/s"));
  r = Run("verify --json 'file://" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["ok"], true);
  EXPECT_EQ(j["format_version"], cairn::kFormatVersion);
  EXPECT_EQ(j["metadata_checksum"], true);
  EXPECT_EQ(j["objects"], 4);  // one RNG object per save rank
  EXPECT_TRUE(j["problems"].empty());
}

// Flips one byte in the middle of a chunk of `fqn` (chunk `index`).
cairn::ByteLocation FlipByteIn(const fs::path& dir, const std::string& fqn,
                               size_t index) {
  auto md = cairn::ReadMetadata(dir.string());
  EXPECT_TRUE(md.ok()) << md.status();
  const cairn::ByteLocation loc = md->tensors.at(fqn).chunks.at(index).location;
  std::fstream f(dir / loc.file,
                 std::ios::in | std::ios::out | std::ios::binary);
  const auto at = static_cast<std::streamoff>(loc.offset + loc.nbytes / 2);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(at);
  f.write(&c, 1);
  return loc;
}

TEST_F(CliTest, VerifyNamesEveryCorruptChunk) {
  const fs::path dir = SaveDemo();
  const cairn::ByteLocation a = FlipByteIn(dir, "model.layers.1.mlp.w2", 1);
  const cairn::ByteLocation b =
      FlipByteIn(dir, "optim.exp_avg_sq.model.embed", 3);
  Result r = Run("verify '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  for (const auto& [fqn, loc] :
       {std::pair{std::string("model.layers.1.mlp.w2"), a},
        std::pair{std::string("optim.exp_avg_sq.model.embed"), b}}) {
    EXPECT_THAT(r.out, HasSubstr("crc32c mismatch in " + fqn)) << r.out;
    EXPECT_THAT(r.out, HasSubstr(loc.file));
    EXPECT_THAT(r.out, HasSubstr("offset " + std::to_string(loc.offset)));
  }
  EXPECT_THAT(r.out, Not(HasSubstr("OK: ")));
  EXPECT_THAT(r.err, HasSubstr("cairn verify: DATA_LOSS"));
  EXPECT_THAT(r.err, HasSubstr("2 problems"));

  r = Run("verify --json '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1);
  nlohmann::json j = ParseJson(r);
  EXPECT_EQ(j["ok"], false);
  ASSERT_EQ(j["problems"].size(), 2u);
  for (const auto& p : j["problems"]) {
    EXPECT_EQ(p["kind"], "crc32c");
    EXPECT_TRUE(p["offset"].is_number());
  }
}

void WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// The metadata.json of `dir` without its checksum and as version 1 (which
// needs none), for a test to edit and write back without resealing.
nlohmann::json Version1Metadata(const fs::path& dir) {
  nlohmann::json j = nlohmann::json::parse(ReadFile(dir / "metadata.json"));
  j.erase("checksum");
  j["version"] = 1;
  return j;
}

// One changed digit in metadata.json (the step counter, which nothing
// else checks): verify and inspect refuse it, naming the file.
TEST_F(CliTest, VerifyRefusesAChangedMetadataFile) {
  const fs::path dir = SaveDemo();
  const fs::path path = dir / "metadata.json";
  std::string text = ReadFile(path);
  const size_t at = text.find("\"step\":{\"int64\":");
  ASSERT_NE(at, std::string::npos);
  char& digit = text[at + 16];
  ASSERT_TRUE(digit >= '0' && digit <= '9') << text.substr(at, 24);
  digit = digit == '9' ? '8' : static_cast<char>(digit + 1);
  WriteText(path, text);
  for (const char* cmd : {"verify", "inspect"}) {
    Result r = Run(std::string(cmd) + " '" + dir.string() + "'");
    EXPECT_EQ(r.rc, 1) << r.all();
    EXPECT_THAT(r.err, HasSubstr(std::string("cairn ") + cmd + ": DATA_LOSS"));
    EXPECT_THAT(r.err, HasSubstr(path.string() + ": metadata checksum mismatch"));
  }
}

// A version 1 checkpoint (no metadata checksum, as earlier builds wrote it)
// still verifies, and verify says its metadata is unprotected; sealed, it
// says the checksum matched.
TEST_F(CliTest, VerifySaysAVersion1MetadataHasNoChecksum) {
  const fs::path dir = SaveDemo();
  const fs::path path = dir / "metadata.json";
  const nlohmann::json j = Version1Metadata(dir);
  WriteText(path, j.dump());
  Result r = Run("verify '" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("OK: metadata.json (format version 1: it has "
                               "no checksum of its own)"));
  r = Run("verify --json '" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json v = ParseJson(r);
  EXPECT_EQ(v["format_version"], 1);
  EXPECT_EQ(v["metadata_checksum"], false);

  // The same version 1 text sealed (by a tool that edits metadata on
  // purpose): readers check it, and verify says so.
  absl::StatusOr<std::string> sealed =
      cairn::internal_format::WithMetadataChecksum(j.dump());
  ASSERT_TRUE(sealed.ok()) << sealed.status();
  WriteText(path, *sealed);
  r = Run("verify --json '" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  v = ParseJson(r);
  EXPECT_EQ(v["format_version"], 1);
  EXPECT_EQ(v["metadata_checksum"], true);
  r = Run("verify '" + dir.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.out, HasSubstr("OK: metadata.json (its checksum matched)"));
}

// Two chunks at the same bytes (each CRC32C then matches): verify names the
// pair. Written as version 1, which has no checksum to reseal.
TEST_F(CliTest, VerifyNamesChunksThatShareBytes) {
  const fs::path dir = SaveDemo();
  nlohmann::json j = Version1Metadata(dir);
  nlohmann::json& chunks = j["tensors"]["model.layers.1.mlp.w2"]["chunks"];
  ASSERT_GE(chunks.size(), 2u);
  const uint64_t offset = chunks[0]["offset"];
  const std::string file = chunks[0]["file"];
  for (const char* key : {"file", "offset", "nbytes", "crc32c"}) {
    chunks[1][key] = chunks[0][key];
  }
  WriteText(dir / "metadata.json", j.dump());
  Result r = Run("verify '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.out, HasSubstr("shares bytes with"));
  EXPECT_THAT(r.out, HasSubstr(file));
  EXPECT_THAT(r.out, HasSubstr("offset " + std::to_string(offset)));
  r = Run("verify --json '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1);
  nlohmann::json v = ParseJson(r);
  bool overlap = false;
  for (const auto& p : v["problems"]) overlap |= p["kind"] == "overlap";
  EXPECT_TRUE(overlap) << v.dump();
}

// Two same-size chunks of different tensors swapped in metadata.json, and
// a dtype relabelled F32 -> I32 (written as version 1, which has no
// checksum to reseal): every CRC32C and size still matches, and verify
// names both from the safetensors headers.
TEST_F(CliTest, VerifyNamesSwappedChunksAndARelabelledDType) {
  const fs::path dir = SaveDemo();
  nlohmann::json j = Version1Metadata(dir);
  nlohmann::json& a = j["tensors"]["model.layers.0.attn.wq"]["chunks"][0];
  nlohmann::json& b = j["tensors"]["model.layers.1.attn.wq"]["chunks"][0];
  ASSERT_EQ(a["nbytes"], b["nbytes"]);
  for (const char* key : {"file", "offset", "crc32c"}) std::swap(a[key], b[key]);
  const std::string file = a["file"];
  const uint64_t offset = a["offset"];
  j["tensors"]["model.norm"]["dtype"] = "I32";
  WriteText(dir / "metadata.json", j.dump());
  Result r = Run("verify --json '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  nlohmann::json v = ParseJson(r);
  std::string messages;
  for (const auto& p : v["problems"]) {
    EXPECT_EQ(p["kind"], "header") << p.dump();
    messages += p["message"].get<std::string>() + "\n";
  }
  EXPECT_EQ(v["problems"].size(), 3u) << messages;
  EXPECT_THAT(messages, HasSubstr("header mismatch for model.layers.0.attn.wq@"));
  EXPECT_THAT(messages, HasSubstr(file + ", offset " + std::to_string(offset)));
  EXPECT_THAT(messages, HasSubstr("safetensors entry there is named "
                                  "'model.layers.1.attn.wq"));
  EXPECT_THAT(messages, HasSubstr("header mismatch for model.norm"));
  EXPECT_THAT(messages, HasSubstr("is F32 ["));
  EXPECT_THAT(messages, HasSubstr("expected I32 ["));
}

// metadata.json with a second "step" (nlohmann's tree kept the last one),
// or with an FQN that is both an object and a scalar: verify refuses
// either as damage, naming the key or the FQN.
TEST_F(CliTest, VerifyRefusesARepeatedKeyAndAnFqnOfTwoKinds) {
  const fs::path dir = SaveDemo();
  const nlohmann::json original = Version1Metadata(dir);
  std::string text = original.dump();
  const std::string step = R"("step":{"int64":42})";
  const size_t at = text.find(step);
  ASSERT_NE(at, std::string::npos);
  text.replace(at, step.size(), step + R"(,"step":{"int64":43})");
  WriteText(dir / "metadata.json", text);
  Result r = Run("verify '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.err, HasSubstr("cairn verify: DATA_LOSS"));
  EXPECT_THAT(r.err, HasSubstr(R"(the key "step" appears twice in one object)"));

  nlohmann::json j = original;
  j["scalars"]["rng.rank0"] = {{"int64", 1}};
  WriteText(dir / "metadata.json", j.dump());
  r = Run("verify '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.err, HasSubstr("cairn verify: DATA_LOSS"));
  EXPECT_THAT(r.err,
              HasSubstr(R"("rng.rank0" is in both "objects" and "scalars")"));
}

// metadata.json whose structure names an FQN the checkpoint does not hold,
// or one FQN twice ("model.norm" at the top level and under "model"):
// LoadAll could not rebuild the state dict, and verify says so.
TEST_F(CliTest, VerifyRefusesAStructureOfUnknownOrRepeatedFqns) {
  const fs::path dir = SaveDemo();
  const nlohmann::json original = Version1Metadata(dir);
  ASSERT_EQ(original["structure"]["model"]["norm"], "model.norm");
  for (const auto& [key, message] :
       {std::pair{std::string("ghost"),
                  std::string("structure names \"ghost\", which is not a "
                              "tensor, object or scalar")},
        std::pair{std::string("model.norm"),
                  std::string("duplicate FQN \"model.norm\"")}}) {
    SCOPED_TRACE(key);
    nlohmann::json j = original;
    j["structure"][key] = key;
    WriteText(dir / "metadata.json", j.dump());
    Result r = Run("verify --json '" + dir.string() + "'");
    EXPECT_EQ(r.rc, 1) << r.all();
    nlohmann::json v = ParseJson(r);
    ASSERT_EQ(v["problems"].size(), 1u) << v.dump();
    EXPECT_EQ(v["problems"][0]["kind"], "structure");
    EXPECT_THAT(v["problems"][0]["message"].get<std::string>(),
                HasSubstr(message));
  }
}

TEST_F(CliTest, VerifyNamesATruncatedFile) {
  const fs::path dir = SaveDemo();
  auto md = cairn::ReadMetadata(dir.string());
  ASSERT_TRUE(md.ok());
  const std::string file =
      md->tensors.at("model.layers.0.attn.wq").chunks.at(0).location.file;
  fs::resize_file(dir / file, fs::file_size(dir / file) / 2);
  Result r = Run("verify '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.out, HasSubstr(file));
  EXPECT_THAT(r.out, HasSubstr("truncated"));
}

TEST_F(CliTest, VerifyNamesAMissingFile) {
  const fs::path dir = SaveDemo();
  auto md = cairn::ReadMetadata(dir.string());
  ASSERT_TRUE(md.ok());
  const std::string file = md->objects.at("rng.rank0").file;
  fs::remove(dir / file);
  Result r = Run("verify '" + dir.string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.out, HasSubstr(file));
  EXPECT_THAT(r.out, HasSubstr("cannot open data file"));
}

TEST_F(CliTest, HelpWorksForEveryCommand) {
  Result r = Run("--help");
  EXPECT_EQ(r.rc, 0);
  for (const char* cmd : {"inspect", "verify", "demo", "Examples"}) {
    EXPECT_THAT(r.out, HasSubstr(cmd));
  }
  for (const char* cmd : {"inspect", "verify", "demo"}) {
    r = Run(std::string(cmd) + " --help");
    EXPECT_EQ(r.rc, 0) << cmd;
    EXPECT_THAT(r.out, HasSubstr("Examples")) << cmd;
    EXPECT_THAT(r.out, HasSubstr("--json")) << cmd;
  }
  r = Run("demo --help");
  for (const char* flag :
       {"--ranks", "--load-ranks", "--comm", "inproc", "mpirun -np",
        "rng.rank<r>", "uneven", "--replicas", "--rank-local",
        "--no-broadcast", "broadcast load", "rank-NNNNN/", "cairn merge",
        "cairn demo --replicas 2 --ranks 2 --load-ranks 2",
        "cairn demo --rank-local"}) {
    EXPECT_THAT(r.out, HasSubstr(flag));
  }
  r = Run("--version");
  EXPECT_EQ(r.rc, 0);
  EXPECT_THAT(r.out, HasSubstr(CAIRN_VERSION_STRING));
}

TEST_F(CliTest, UsageErrorsExitTwo) {
  Result r = Run("");
  EXPECT_EQ(r.rc, 2);
  r = Run("frobnicate");
  EXPECT_EQ(r.rc, 2);
  r = Run("verify");  // CKPT is required
  EXPECT_EQ(r.rc, 2);
  EXPECT_THAT(r.err, HasSubstr("cairn verify:"));
  r = Run("inspect --bogus x");
  EXPECT_EQ(r.rc, 2);
}

}  // namespace
