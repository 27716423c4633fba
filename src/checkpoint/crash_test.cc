// The commit protocol under SIGKILL. A child process saves in a loop and is
// killed at a random moment; then the parent checks what is on disk:
//
//  - overwrite mode (one directory saved over and over): until the first
//    commit the directory may hold no committed checkpoint; from then on it
//    always holds a complete one (the old or the new: an overwrite never
//    destroys the old checkpoint before the new one has committed) whose
//    every element matches the step it records, never older than the last
//    one seen, and at most two data files (the committed checkpoint's and
//    the killed save's: the next save removes leftovers);
//  - one directory per step (what a checkpoint manager does): every committed
//    directory loads bit-exact, and only the directory being written when the
//    kill landed may be uncommitted, so the previous checkpoint is intact.
//
// Runs for CAIRN_CRASH_TEST_SECONDS (default 12) seconds.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cairn/checkpoint.h"
#include "cairn/manager.h"
#include "checkpoint/test_util.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using testing_util::TempDir;

constexpr int kTensors = 4;
constexpr int64_t kElements = 512 * 1024;  // 2 MiB of U32 per tensor

uint32_t Value(int tensor, int64_t e, int64_t step) {
  uint64_t x = static_cast<uint64_t>(e) * 0x9E3779B97F4A7C15ull ^
               static_cast<uint64_t>(step) * 0xBF58476D1CE4E5B9ull ^
               static_cast<uint64_t>(tensor + 1) * 0x94D049BB133111EBull;
  x ^= x >> 29;
  x *= 0xD6E8FEB86659FD93ull;
  return static_cast<uint32_t>(x >> 32);
}

// The child: saves steps first_step, first_step + 1, ... until killed, or
// `saves` of them and exits 0 (saves < 0: forever).
[[noreturn]] void SaveForever(const std::string& root, bool overwrite,
                              int64_t first_step, int64_t saves = -1) {
  std::vector<std::vector<uint32_t>> data(kTensors,
                                          std::vector<uint32_t>(kElements));
  for (int64_t step = first_step;; ++step) {
    if (saves >= 0 && step - first_step == saves) _exit(0);
    StateDict sd;
    for (int t = 0; t < kTensors; ++t) {
      for (int64_t e = 0; e < kElements; ++e) data[t][e] = Value(t, e, step);
      sd["t" + std::to_string(t)] =
          TensorView(data[t].data(), DType::kU32, {kElements});
    }
    sd["step"] = step;
    SaveOptions options;
    options.overwrite = overwrite;
    options.write_buffer_bytes = 256 << 10;  // many blocks: kills land mid-file
    options.io_threads = 4;
    const std::string dir =
        overwrite ? root + "/ckpt" : root + "/step-" + std::to_string(step);
    if (!Save(sd, dir, options).ok()) _exit(3);
  }
}

// Loads the checkpoint at `dir` and checks every element against its step.
void ExpectIntact(const std::string& dir) {
  absl::StatusOr<StateDict> all = LoadAll(dir);
  ASSERT_TRUE(all.ok()) << dir << ": " << all.status();
  const Scalar* step = all->Find("step") ? all->Find("step")->scalar() : nullptr;
  ASSERT_NE(step, nullptr) << dir;
  const int64_t s = std::get<int64_t>(*step);
  for (int t = 0; t < kTensors; ++t) {
    const StateDict* leaf = all->Find("t" + std::to_string(t));
    ASSERT_NE(leaf, nullptr);
    const auto* p =
        static_cast<const uint32_t*>(leaf->tensor()->shards()[0].view.data());
    for (int64_t e = 0; e < kElements; ++e) {
      if (p[e] != Value(t, e, s)) {
        FAIL() << dir << ": t" << t << " element " << e << " is wrong for step "
               << s;
      }
    }
  }
}

// Microseconds from fork to exit of a child that fills the state and
// saves it once: the scale of the kill delays, so that kills land before,
// during and after commits however fast this build is (ASan, a loaded CI
// machine). Fails the test if that save fails.
int64_t OneSaveMicros(const std::string& root) {
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) SaveForever(root, /*overwrite=*/true, 1, /*saves=*/1);
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) ||
      WEXITSTATUS(status) != 0) {
    ADD_FAILURE() << "a single uninterrupted save failed";
    return 0;
  }
  std::filesystem::remove_all(root + "/ckpt");
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now() - start)
      .count();
}

int64_t StepOf(const std::string& dir) {
  absl::StatusOr<StateDict> all = LoadAll(dir);
  return all.ok() ? std::get<int64_t>(*all->Find("step")->scalar()) : -1;
}

TEST(CrashTest, KilledSavesNeverLeaveABadCommittedCheckpoint) {
  const char* env = std::getenv("CAIRN_CRASH_TEST_SECONDS");
  const double seconds = env != nullptr ? std::atof(env) : 12.0;
  TempDir tmp;
  std::mt19937 rng(std::random_device{}());
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(seconds);
  int iterations = 0, committed = 0, uncommitted = 0;
  int64_t next_step = 1;
  int64_t overwrite_step = -1;  // the step last seen committed there
  // Kill anywhere from before the first save starts to a few saves in.
  std::filesystem::create_directories(tmp.Sub("timing"));
  const int64_t one_save = OneSaveMicros(tmp.Sub("timing"));
  if (HasFatalFailure() || one_save == 0) return;
  const int max_delay = static_cast<int>(
      std::clamp<int64_t>(3 * one_save, 150000, 5000000));
  while (std::chrono::steady_clock::now() < deadline || iterations < 4) {
    const bool overwrite = iterations % 2 == 0;
    const std::string root = tmp.Sub(overwrite ? "overwrite" : "per-step");
    std::filesystem::create_directories(root);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) SaveForever(root, overwrite, next_step);
    std::this_thread::sleep_for(std::chrono::microseconds(
        std::uniform_int_distribution<int>(0, max_delay)(rng)));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status))
        << "the saving child exited on its own (code "
        << (WIFEXITED(status) ? WEXITSTATUS(status) : -1) << "): a save failed";
    ++iterations;

    if (overwrite) {
      const std::string dir = root + "/ckpt";
      absl::StatusOr<Metadata> md = ReadMetadata(dir);
      if (absl::IsNotFound(md.status())) {
        ASSERT_LT(overwrite_step, 0)
            << "a killed overwrite left no committed checkpoint, where step "
            << overwrite_step << " was committed before it started";
        ++uncommitted;
      } else {
        ASSERT_TRUE(md.ok()) << md.status();
        ExpectIntact(dir);
        if (HasFatalFailure()) return;
        const int64_t step = StepOf(dir);
        ASSERT_GE(step, overwrite_step) << "an older checkpoint came back";
        overwrite_step = step;
        ++committed;
        next_step = std::max(next_step, step + 1);
      }
      int data_files = 0;
      std::error_code ec;  // the kill may land before the folder exists
      for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
        if (entry.path().extension() == ".safetensors") ++data_files;
      }
      EXPECT_LE(data_files, 2) << "leftovers of killed saves pile up in " << dir;
    } else {
      // Every committed step directory must load; at most one (the newest)
      // may be uncommitted.
      int64_t newest_committed = -1, uncommitted_dirs = 0, newest_dir = -1;
      for (const auto& entry : std::filesystem::directory_iterator(root)) {
        const std::string dir = entry.path().string();
        const int64_t step = std::stoll(entry.path().filename().string().substr(5));
        newest_dir = std::max(newest_dir, step);
        if (absl::IsNotFound(ReadMetadata(dir).status())) {
          ++uncommitted_dirs;
          std::filesystem::remove_all(dir);  // what a manager's cleanup does
          continue;
        }
        ExpectIntact(dir);
        if (HasFatalFailure()) return;
        newest_committed = std::max(newest_committed, step);
      }
      EXPECT_LE(uncommitted_dirs, 1);
      if (newest_committed >= 0) ++committed; else ++uncommitted;
      next_step = std::max(next_step, newest_dir + 1);
      // Keep the newest committed directory only, to bound disk use.
      for (const auto& entry : std::filesystem::directory_iterator(root)) {
        if (std::stoll(entry.path().filename().string().substr(5)) !=
            newest_committed) {
          std::filesystem::remove_all(entry.path());
        }
      }
    }
    if (HasFatalFailure()) return;
  }
  std::printf("crash test: %d kills, %d left a committed checkpoint, %d none\n",
              iterations, committed, uncommitted);
  EXPECT_GT(committed, 0) << "no kill landed after a commit: the test did not "
                             "exercise the committed case";
}

// The child of the manager test: async saves of steps first_step, ... with
// retention (keep the last 2), until killed.
[[noreturn]] void ManageForever(const std::string& root, int64_t first_step) {
  ManagerOptions options;
  options.keep_last = 2;
  options.save_options.write_buffer_bytes = 256 << 10;
  options.save_options.io_threads = 4;
  absl::StatusOr<std::unique_ptr<CheckpointManager>> manager =
      CheckpointManager::Create(root, nullptr, options);
  if (!manager.ok()) _exit(3);
  std::vector<std::vector<uint32_t>> data(kTensors,
                                          std::vector<uint32_t>(kElements));
  StateDict sd;
  for (int t = 0; t < kTensors; ++t) {
    sd["t" + std::to_string(t)] =
        TensorView(data[t].data(), DType::kU32, {kElements});
  }
  for (int64_t step = first_step;; ++step) {
    for (int t = 0; t < kTensors; ++t) {
      for (int64_t e = 0; e < kElements; ++e) data[t][e] = Value(t, e, step);
    }
    sd["step"] = step;
    if (!(*manager)->Save(step, sd).ok()) _exit(3);
  }
}

// The manager under SIGKILL: after every kill, a new process (this one)
// finds the newest committed step and restores it bit-exact; every
// committed step is intact; once any step has committed there is always
// one (retention never deleted the only good checkpoint); the leftovers of
// the killed save are cleaned.
TEST(CrashTest, ManagerAlwaysResumesFromAGoodCheckpoint) {
  const char* env = std::getenv("CAIRN_CRASH_TEST_SECONDS");
  const double seconds = (env != nullptr ? std::atof(env) : 12.0) / 2;
  TempDir tmp;
  const std::string root = tmp.Sub("managed");
  std::mt19937 rng(std::random_device{}());
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration<double>(seconds);
  int iterations = 0, restored = 0;
  bool ever_committed = false;
  int64_t next_step = 1;
  // An async save with retention takes about as long as a sync one; kill
  // anywhere up to a few of them in.
  std::filesystem::create_directories(tmp.Sub("timing"));
  const int64_t one_save = OneSaveMicros(tmp.Sub("timing"));
  if (HasFatalFailure() || one_save == 0) return;
  const int max_delay = static_cast<int>(
      std::clamp<int64_t>(4 * one_save, 200000, 5000000));
  while (std::chrono::steady_clock::now() < deadline || iterations < 4) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) ManageForever(root, next_step);
    std::this_thread::sleep_for(std::chrono::microseconds(
        std::uniform_int_distribution<int>(0, max_delay)(rng)));
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status))
        << "the saving child exited on its own (code "
        << (WIFEXITED(status) ? WEXITSTATUS(status) : -1) << ")";
    ++iterations;

    absl::StatusOr<std::unique_ptr<CheckpointManager>> manager =
        CheckpointManager::Create(root, nullptr);
    ASSERT_TRUE(manager.ok()) << manager.status();
    absl::StatusOr<std::vector<int64_t>> steps = (*manager)->Steps();
    ASSERT_TRUE(steps.ok());
    for (int64_t step : *steps) {
      ExpectIntact((*manager)->StepDir(step));
      if (HasFatalFailure()) return;
    }
    absl::StatusOr<std::optional<int64_t>> latest = (*manager)->LatestStep();
    ASSERT_TRUE(latest.ok());
    if (ever_committed) {
      ASSERT_TRUE(latest->has_value())
          << "retention deleted the only committed checkpoint";
    }
    if (latest->has_value()) {
      ever_committed = true;
      std::vector<uint32_t> t0(kElements);
      StateDict dst;
      dst["t0"] = TensorView(t0.data(), DType::kU32, {kElements});
      LoadOptions lenient;
      lenient.strict = false;
      ManagerOptions options;
      options.load_options = lenient;
      absl::StatusOr<std::unique_ptr<CheckpointManager>> reader =
          CheckpointManager::Create(root, nullptr, options);
      ASSERT_TRUE(reader.ok());
      ASSERT_TRUE((*reader)->Restore(dst).ok());
      for (int64_t e = 0; e < kElements; e += 997) {
        ASSERT_EQ(t0[e], Value(0, e, **latest)) << "element " << e;
      }
      ++restored;
    }
    // Clean what the kill left (retention), then resume after the newest
    // folder the child reached.
    ASSERT_TRUE((*manager)->Wait().ok());
    for (const auto& entry : std::filesystem::directory_iterator(root)) {
      ASSERT_TRUE(std::filesystem::exists(entry.path() / "metadata.json"))
          << entry.path() << " was left uncommitted after cleanup";
      next_step = std::max(
          next_step, static_cast<int64_t>(
                         std::stoll(entry.path().filename().string().substr(5))) + 1);
    }
    if (latest->has_value()) next_step = std::max(next_step, **latest + 1);
  }
  std::printf("manager crash test: %d kills, %d restores\n", iterations,
              restored);
  EXPECT_GT(restored, 0) << "no kill landed after a commit";
}

}  // namespace
}  // namespace cairn
