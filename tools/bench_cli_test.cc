// Drives `cairn bench` (CAIRN_BINARY) end to end on a 4 MiB state: the JSON
// object has the headline figures and a row for every phase and load
// variant, named as bench/peers/torch_peer.py names its rows; the model file
// is what the peer reads; the work folder is removed (or kept with --keep);
// usage errors exit 2 and an unwritable --dir exits 1.
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#ifndef CAIRN_BINARY
#error "CAIRN_BINARY must name the cairn executable"
#endif

namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

struct Result {
  int rc = -1;
  std::string out;
  std::string err;
  std::string all() const { return out + err; }
};

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class BenchCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ =
        std::string(tmp && *tmp ? tmp : "/tmp") + "/cairn-bench-test-XXXXXX";
    ASSERT_NE(mkdtemp(templ.data()), nullptr);
    root_ = templ;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // Runs `cairn args` with stdout and stderr captured separately.
  Result Run(const std::string& args) {
    const fs::path out = root_ / "stdout", err = root_ / "stderr";
    const std::string cmd = "'" CAIRN_BINARY "' " + args + " >'" +
                            out.string() + "' 2>'" + err.string() + "'";
    const int status = std::system(cmd.c_str());
    Result r;
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    r.out = ReadFile(out);
    r.err = ReadFile(err);
    return r;
  }

  std::string Dir() const { return "'" + (root_ / "bench").string() + "'"; }

  fs::path root_;
};

std::vector<std::string> Names(const nlohmann::json& results) {
  std::vector<std::string> out;
  for (const nlohmann::json& row : results) {
    out.push_back(row["name"].get<std::string>() + "/" +
                  (row["cache"].is_null() ? std::string("-")
                                          : row["cache"].get<std::string>()));
  }
  return out;
}

TEST_F(BenchCliTest, JsonHasEveryPhaseAndLoadVariant) {
  const fs::path model = root_ / "model.json";
  Result r = Run("bench --dir " + Dir() +
                 " --size 4MiB --json --cold none -q --model-out '" +
                 model.string() + "'");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_EQ(r.err, "");  // -q
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << "not one JSON object: " << r.out;

  EXPECT_EQ(j["tool"], "cairn");
  EXPECT_TRUE(j["version"].is_string());
  const double bytes = j["bytes"].get<double>();
  EXPECT_NEAR(bytes, 4.0 * (1 << 20), 0.02 * 4 * (1 << 20));
  EXPECT_EQ(j["ranks"], 4);
  EXPECT_EQ(j["cold_method"], "unavailable");
  for (const char* key :
       {"save_seconds", "load_seconds", "async_blocked_seconds",
        "async_total_seconds", "memcpy_gb_per_s"}) {
    ASSERT_TRUE(j.contains(key) && j[key].is_number()) << key << ": " << j;
    EXPECT_GT(j[key].get<double>(), 0) << key;
  }
  EXPECT_LE(j["async_blocked_seconds"].get<double>(),
            j["async_total_seconds"].get<double>());
  bool said_why = false;
  for (const auto& note : j["notes"]) {
    said_why |= note.get<std::string>().find("--cold none") !=
                std::string::npos;
  }
  EXPECT_TRUE(said_why) << j["notes"];

  // torch_peer.py's rows, in its order; warm only under --cold none.
  const nlohmann::json& results = j["results"];
  EXPECT_THAT(Names(results),
              ElementsAreArray({"save_sync/-", "async_save/-",
                                "load_same/warm", "load_4to2_rows/warm",
                                "load_4to2_cols/warm", "load_4to3_rows/warm",
                                "load_4to3_cols/warm", "load_sink/warm"}));
  const int ranks[] = {4, 4, 4, 2, 2, 3, 3};
  const char* kinds[] = {"save", "async", "load", "load",
                         "load", "load",  "load"};
  // load_sink: one rank streamed every stored tensor byte into a sink,
  // within the budget (the default, 256 MiB, reported).
  const nlohmann::json& sink = results.back();
  EXPECT_EQ(sink["ranks"], 1);
  EXPECT_EQ(sink["sink_bytes"].get<double>(), bytes);
  EXPECT_EQ(sink["memory_budget_bytes"].get<double>(), 256.0 * (1 << 20));
  EXPECT_GT(sink["peak_rss_bytes"].get<double>(), 0);
  for (size_t i = 0; i < results.size() && i < 7; ++i) {
    const nlohmann::json& row = results[i];
    SCOPED_TRACE(row.dump());
    EXPECT_EQ(row["kind"], kinds[i]);
    EXPECT_EQ(row["ranks"], ranks[i]);
    EXPECT_GT(row["seconds"].get<double>(), 0);
    EXPECT_NEAR(row["gb_per_s"].get<double>(),
                bytes / row["seconds"].get<double>() / 1e9, 1e-6);
    EXPECT_GT(row["peak_rss_bytes"].get<double>(), 0);
    if (row["kind"] == "load") {
      EXPECT_EQ(row["dest_bytes"].get<double>(), bytes);
      EXPECT_EQ(row["verified"], true);
      EXPECT_EQ(row["save_ranks"], 4);
      EXPECT_TRUE(row.contains("memcpy_fraction"));
      for (const char* phase : {"metadata", "planning", "read"}) {
        ASSERT_TRUE(row["phase_seconds"][phase].is_number()) << phase;
        EXPECT_LE(row["phase_seconds"][phase].get<double>(),
                  row["seconds"].get<double>())
            << phase;
      }
      EXPECT_GT(row["phase_seconds"]["read"].get<double>(), 0);
      // At least the destination's bytes were asked of the storage; what
      // the device read depends on the page cache, but is counted.
      EXPECT_GE(row["storage_bytes_read"].get<double>(), bytes);
      EXPECT_TRUE(row["device_bytes_read"].is_number_unsigned());
    }
    if (row["kind"] == "async") {
      EXPECT_LE(row["blocked_seconds"].get<double>(),
                row["seconds"].get<double>());
    }
  }
  EXPECT_EQ(j["load_seconds"], results[2]["seconds"]);
  EXPECT_EQ(j["save_seconds"], results[0]["seconds"]);

  // The work folder is gone; --dir itself stays.
  ASSERT_TRUE(fs::is_directory(root_ / "bench"));
  EXPECT_TRUE(fs::is_empty(root_ / "bench"));

  // The model file, as torch_peer.py's load_model() checks it.
  nlohmann::json m = nlohmann::json::parse(ReadFile(model), nullptr, false);
  ASSERT_TRUE(m.is_object()) << ReadFile(model);
  double total = 0;
  for (const auto& t : m["tensors"]) {
    EXPECT_EQ(t["dtype"], "float32");
    double n = 1;
    for (const auto& d : t["shape"]) n *= d.get<double>();
    EXPECT_GT(n, 0) << t;
    total += 4 * n;
  }
  EXPECT_EQ(m["tensors"].size(), j["tensors"].get<size_t>());
  EXPECT_EQ(m["bytes"].get<double>(), total);
  EXPECT_EQ(m["bytes"].get<double>(), bytes);
}

TEST_F(BenchCliTest, TwoRanksHaveOneReshardedLayoutAndKeepKeepsIt) {
  Result r =
      Run("bench --dir " + Dir() + " --size 1MiB --ranks 2 --cold none "
          "--keep --repeat 2 --json");
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_THAT(r.err, HasSubstr("cairn bench: "));  // progress lines
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  // W/2 == W-1 == 1: one resharded layout, not two.
  EXPECT_THAT(Names(j["results"]),
              ElementsAreArray({"save_sync/-", "async_save/-",
                                "load_same/warm", "load_2to1_rows/warm",
                                "load_2to1_cols/warm", "load_sink/warm"}));
  for (const auto& row : j["results"]) {
    EXPECT_EQ(row["samples"].size(), 2u) << row;
  }
  // memcpy: a sample after each warm load_same sample, the median of the
  // two reported (their mean) and both listed.
  const nlohmann::json& m = j["memcpy"];
  ASSERT_EQ(m["samples"].size(), 2u) << m;
  EXPECT_THAT(r.err, HasSubstr("memcpy after load_same (warm) sample 2 of 2"));
  for (const char* key : {"gb_per_s", "parallel_gb_per_s"}) {
    if (m[key].is_null()) continue;  // one core: no parallel figure
    const double mid = (m["samples"][0][key].get<double>() +
                        m["samples"][1][key].get<double>()) / 2;
    EXPECT_DOUBLE_EQ(m[key].get<double>(), mid) << key << ": " << m;
  }
  EXPECT_DOUBLE_EQ(j["memcpy_gb_per_s"].get<double>(),
                   m["gb_per_s"].get<double>());
  // The reported seconds go with the reported GB/s.
  EXPECT_NEAR(m["seconds"].get<double>() * m["gb_per_s"].get<double>() * 1e9,
              m["bytes"].get<double>(), 1e-6 * m["bytes"].get<double>());
  const fs::path work = j["work_dir"].get<std::string>();
  EXPECT_TRUE(fs::exists(work / "sync" / "metadata.json"));
  EXPECT_TRUE(fs::exists(work / "async" / "metadata.json"));
}

// A file:// --dir is percent-decoded as Storage::Open decodes it: the
// work folder lands in "a b" and is removed from there at the end, and a
// folder spelled as the undecoded URL is never touched.
TEST_F(BenchCliTest, FileUrlDirIsPercentDecoded) {
  fs::create_directories(root_ / "a b");
  fs::create_directories(root_ / "a%20b" / "keep");
  Result r = Run("bench --dir 'file://" + root_.string() +
                 "/a%20b' --size 1MiB --ranks 2 --cold none --phases save "
                 "--json -q");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_TRUE(fs::is_empty(root_ / "a b")) << "the work folder was left";
  EXPECT_TRUE(fs::exists(root_ / "a%20b" / "keep"));
}

TEST_F(BenchCliTest, PhasesAndIoSettingsChooseWhatRuns) {
  // load runs save too (it reads save's checkpoint); async and memcpy not.
  Result r = Run("bench --dir " + Dir() + " --size 1MiB --cold none -q "
                 "--json --phases load --io-threads 2 --buffer 64KiB");
  ASSERT_EQ(r.rc, 0) << r.all();
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_THAT(Names(j["results"]),
              ElementsAreArray({"save_sync/-", "load_same/warm",
                                "load_4to2_rows/warm", "load_4to2_cols/warm",
                                "load_4to3_rows/warm",
                                "load_4to3_cols/warm"}));
  EXPECT_TRUE(j["async_blocked_seconds"].is_null());
  EXPECT_TRUE(j["memcpy_gb_per_s"].is_null());

  r = Run("bench --dir " + Dir() + " --size 1MiB --cold none -q --json "
          "--phases memcpy,async");
  ASSERT_EQ(r.rc, 0) << r.all();
  j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_THAT(Names(j["results"]), ElementsAreArray({"async_save/-"}));
  EXPECT_TRUE(j["memcpy_gb_per_s"].is_number());
}

// --no-verify turns the loads' CRC32C checks off, and the JSON says so: by
// default every load row checked chunks, with it none did.
TEST_F(BenchCliTest, NoVerifySkipsTheChecksumsAndSaysSo) {
  for (const bool verify : {true, false}) {
    SCOPED_TRACE(verify);
    Result r = Run("bench --dir " + Dir() +
                   " --size 1MiB --cold none -q --json --phases load" +
                   (verify ? "" : " --no-verify"));
    ASSERT_EQ(r.rc, 0) << r.all();
    nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r.out;
    EXPECT_EQ(j["verify_checksums"], verify);
    int loads = 0;
    for (const nlohmann::json& row : j["results"]) {
      if (row["kind"] != "load") continue;
      ++loads;
      ASSERT_TRUE(row["chunks_crc_checked"].is_number()) << row.dump();
      if (verify) {
        EXPECT_GT(row["chunks_crc_checked"].get<int64_t>(), 0) << row.dump();
      } else {
        EXPECT_EQ(row["chunks_crc_checked"].get<int64_t>(), 0) << row.dump();
      }
    }
    EXPECT_EQ(loads, 5);
  }
  Result table = Run("bench --dir " + Dir() +
                     " --size 1MiB --cold none -q --phases load --no-verify");
  ASSERT_EQ(table.rc, 0) << table.all();
  EXPECT_THAT(table.out, HasSubstr("--no-verify"));
}

TEST_F(BenchCliTest, TableNamesEveryPhase) {
  Result r = Run("bench --dir " + Dir() + " --size 2MiB --cold none -q");
  ASSERT_EQ(r.rc, 0) << r.all();
  for (const char* s : {"save_sync", "async_save", "load_same",
                        "load_4to2_rows", "load_4to3_cols", "memcpy:",
                        "blocked/sync", "cold rows skipped"}) {
    EXPECT_THAT(r.out, HasSubstr(s));
  }
}

TEST_F(BenchCliTest, UsageErrorsExitTwo) {
  for (const std::string args :
       {"--size 0", "--size 12XB", "--size -5", "--ranks 0", "--ranks x",
        "--cold maybe", "--repeat 0", "--phases save,bogus",
        "--io-threads 0", "--buffer 100", "--buffer lots"}) {
    Result r = Run("bench -q --dir " + Dir() + " " + args);
    EXPECT_EQ(r.rc, 2) << args << ": " << r.all();
    EXPECT_THAT(r.err, HasSubstr("cairn bench")) << args;
    EXPECT_EQ(r.out, "") << args;
  }
  Result r = Run("bench --size 1MiB");  // --dir is required
  EXPECT_EQ(r.rc, 2) << r.all();
  EXPECT_THAT(r.err, HasSubstr("--dir"));
}

TEST_F(BenchCliTest, UnwritableDirExitsOne) {
  const fs::path file = root_ / "file";
  std::ofstream(file) << "not a directory";
  Result r = Run("bench -q --size 1MiB --cold none --dir '" +
                 (file / "sub").string() + "'");
  EXPECT_EQ(r.rc, 1) << r.all();
  EXPECT_THAT(r.err, HasSubstr("cairn bench: "));
  EXPECT_THAT(r.err, HasSubstr("--dir"));
  EXPECT_EQ(r.out, "");
}

TEST_F(BenchCliTest, HelpExplainsPhases) {
  Result r = Run("bench --help");
  EXPECT_EQ(r.rc, 0) << r.all();
  for (const char* s : {"--dir", "--size", "--ranks", "--json", "--cold",
                        "--model-out", "--repeat", "--keep", "--phases",
                        "--io-threads", "--buffer", "save_sync",
                        "async_save", "load_same", "memcpy", "Examples"}) {
    EXPECT_THAT(r.out, HasSubstr(s));
  }
}

// CAIRN_BENCH_PERF_CTL / _ACK / _KIND drive `perf record --control`: a
// stand-in for perf reads the commands and acknowledges each one. Only the
// asked row's samples switch sampling, on then off, and the benchmark
// waits for (and gets past) each acknowledgement.
TEST_F(BenchCliTest, PerfControlSwitchesTheAskedRowAndWaitsForPerf) {
  const fs::path ctl = root_ / "ctl", ack = root_ / "ack";
  ASSERT_EQ(mkfifo(ctl.c_str(), 0600), 0);
  ASSERT_EQ(mkfifo(ack.c_str(), 0600), 0);
  // Both ends held open here, as perf does, so that neither side blocks
  // in open().
  const int ctl_fd = open(ctl.c_str(), O_RDWR | O_CLOEXEC);
  const int ack_fd = open(ack.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(ctl_fd, 0);
  ASSERT_GE(ack_fd, 0);
  int stop_pipe[2];
  ASSERT_EQ(pipe(stop_pipe), 0);
  std::string commands;
  std::thread perf([&] {
    std::string pending;
    for (;;) {
      pollfd fds[2] = {{ctl_fd, POLLIN, 0}, {stop_pipe[0], POLLIN, 0}};
      if (poll(fds, 2, -1) <= 0 || (fds[1].revents & POLLIN)) return;
      char buf[64];
      const ssize_t n = read(ctl_fd, buf, sizeof(buf));
      if (n <= 0) return;
      pending.append(buf, static_cast<size_t>(n));
      for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
        commands += pending.substr(0, nl) + ";";
        pending.erase(0, nl + 1);
        (void)!write(ack_fd, "ack\n", 4);
      }
    }
  });
  setenv("CAIRN_BENCH_PERF_CTL", ctl.c_str(), 1);
  setenv("CAIRN_BENCH_PERF_ACK", ack.c_str(), 1);
  setenv("CAIRN_BENCH_PERF_KIND", "load_4to2_rows", 1);
  Result r = Run("bench --dir " + Dir() +
                 " --size 1MiB --cold none -q --json --phases load "
                 "--repeat 2");
  unsetenv("CAIRN_BENCH_PERF_CTL");
  unsetenv("CAIRN_BENCH_PERF_ACK");
  unsetenv("CAIRN_BENCH_PERF_KIND");
  (void)!write(stop_pipe[1], "x", 1);
  perf.join();
  close(stop_pipe[0]);
  close(stop_pipe[1]);
  close(ctl_fd);
  close(ack_fd);
  ASSERT_EQ(r.rc, 0) << r.all();
  EXPECT_EQ(commands, "enable;disable;enable;disable;");
}

}  // namespace
