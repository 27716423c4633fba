// The fixture of the tests that drive the built `cairn` binary
// (CAIRN_BINARY): runs it with output captured, in a temporary root.
#ifndef CAIRN_TESTS_CLI_FIXTURE_H_
#define CAIRN_TESTS_CLI_FIXTURE_H_

#include <stdlib.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

#ifndef CAIRN_BINARY
#error "CAIRN_BINARY must name the cairn executable"
#endif

namespace cairn_cli_test {

namespace fs = std::filesystem;

struct Result {
  int rc = -1;
  std::string out;
  std::string err;
  std::string all() const { return out + err; }
};

inline std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ =
        std::string(tmp && *tmp ? tmp : "/tmp") + "/cairn-cli-test-XXXXXX";
    ASSERT_NE(mkdtemp(templ.data()), nullptr);
    root_ = templ;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // Runs `cairn args` with stdout and stderr captured separately. The
  // demo's temporary directories go under this test's root.
  Result Run(const std::string& args) {
    const fs::path out = root_ / "stdout", err = root_ / "stderr";
    // Open MPI leaks at exit in ways LeakSanitizer cannot attribute (see
    // cairn_add_mpi_test), so sanitized runs that start MPI skip leak checks.
    const std::string env =
        args.find("--comm mpi") != std::string::npos
            ? "ASAN_OPTIONS=\"${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0\" "
            : "";
    const std::string cmd = env + "TMPDIR='" + root_.string() +
                            "' '" CAIRN_BINARY "' " + args + " >'" +
                            out.string() + "' 2>'" + err.string() + "'";
    const int status = std::system(cmd.c_str());
    Result r;
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    r.out = ReadFile(out);
    r.err = ReadFile(err);
    return r;
  }

  // A small demo checkpoint at root_/ckpt, saved at step 42.
  fs::path SaveDemo() {
    const fs::path dir = root_ / "ckpt";
    Result r = Run("demo -q --size 4MiB --phase save --step 42 --dir '" +
                   dir.string() + "'");
    EXPECT_EQ(r.rc, 0) << r.all();
    return dir;
  }

  fs::path root_;
};

inline nlohmann::json ParseJson(const Result& r) {
  nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON: " << r.out;
  return j;
}

}  // namespace cairn_cli_test

#endif  // CAIRN_TESTS_CLI_FIXTURE_H_
