// What a save must never do to what is already on disk, and what a reader
// must never do with what it finds there: write through or follow a planted
// link, run beside another save into the same folder, destroy the
// checkpoint it overwrites before the new one has committed, block on a
// FIFO, or die of SIGXFSZ.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/storage.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/dist_test_util.h"
#include "checkpoint/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "storage/fault_injection.h"

namespace cairn {
namespace {

namespace fs = std::filesystem;
using internal_storage::FaultInjectionStorage;
using internal_storage::StorageOp;
using testing::HasSubstr;
using testing_util::ByteAt;
using testing_util::ReadFile;
using testing_util::TempDir;
using testing_util::WriteFile;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

constexpr int64_t kRows = 64;
constexpr int64_t kCols = 1024;  // 256 KiB of F32

// One tensor and a scalar, filled from `seed`.
struct State {
  std::vector<float> data = std::vector<float>(kRows * kCols);
  StateDict sd;
  explicit State(uint64_t seed) {
    auto* p = reinterpret_cast<std::byte*>(data.data());
    for (int64_t e = 0; e < kRows * kCols; ++e) {
      for (size_t i = 0; i < 4; ++i) p[e * 4 + i] = ByteAt(DType::kF32, e, i, seed);
    }
    sd["w"] = TensorView(data.data(), DType::kF32, {kRows, kCols});
    sd["seed"] = static_cast<int64_t>(seed);
  }
};

// Loads `dir` and says which seed's state it holds (-1: a load error; -2:
// bytes that match no seed's state, i.e. a torn checkpoint).
int64_t SeedIn(const std::string& dir, absl::Status* error = nullptr) {
  State got(0);
  std::memset(got.data.data(), 0, got.data.size() * sizeof(float));
  got.sd["seed"] = int64_t{-1};
  absl::StatusOr<LoadResult> loaded = Load(got.sd, dir);
  if (!loaded.ok()) {
    if (error != nullptr) *error = loaded.status();
    return -1;
  }
  const int64_t seed = std::get<int64_t>(*got.sd.Find("seed")->scalar());
  State want(static_cast<uint64_t>(seed));
  return std::memcmp(got.data.data(), want.data.data(),
                     want.data.size() * sizeof(float)) == 0
             ? seed
             : -2;
}

std::vector<std::string> DataFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("data-")) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// --- 1. Links in the target folder are never written through ---

TEST(SaveSafetyTest, ALinkAtADataFileNameIsNeverWrittenThrough) {
  TempDir tmp, outside;
  const std::string victim = outside.Sub("victim");
  WriteFile(victim, "precious");
  fs::create_directories(tmp.Sub("ckpt"));
  // The name earlier builds gave rank 0's data file, and any name a save
  // might pick: none of them is followed.
  fs::create_symlink(victim, tmp.Sub("ckpt/data-00000.safetensors"));
  State a(1);
  ASSERT_TRUE(Save(a.sd, tmp.Sub("ckpt")).ok());
  EXPECT_EQ(ReadFile(victim), "precious");
  EXPECT_EQ(SeedIn(tmp.Sub("ckpt")), 1);
}

TEST(SaveSafetyTest, SavingIntoALinkedCopyLeavesTheOriginalIntact) {
  TempDir tmp;
  State a(1);
  ASSERT_TRUE(Save(a.sd, tmp.Sub("a")).ok());
  const std::string a_files = ReadFile(tmp.Sub("a/metadata.json"));
  // `cp -rs a b`: a folder of links to a's files.
  fs::create_directories(tmp.Sub("b"));
  for (const auto& e : fs::directory_iterator(tmp.Sub("a"))) {
    fs::create_symlink(e.path(), tmp.Sub("b") + "/" +
                                     e.path().filename().string());
  }
  State b(2);
  SaveOptions overwrite;
  overwrite.overwrite = true;
  absl::StatusOr<SaveResult> saved = Save(b.sd, tmp.Sub("b"), overwrite);
  // Refused (b's metadata.json is a link, so b holds no checkpoint of its
  // own to replace), and nothing of a's changed.
  ASSERT_FALSE(saved.ok());
  EXPECT_EQ(saved.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Msg(saved.status()), HasSubstr("symbolic link"));
  EXPECT_EQ(ReadFile(tmp.Sub("a/metadata.json")), a_files);
  EXPECT_EQ(SeedIn(tmp.Sub("a")), 1);
  // Loading through the links is refused too: no reader follows them.
  absl::Status error;
  EXPECT_EQ(SeedIn(tmp.Sub("b"), &error), -1);
  EXPECT_THAT(Msg(error), HasSubstr("symbolic link"));
}

// --- 2. One save into a folder at a time ---

TEST(SaveSafetyTest, AHeldLockFailsTheSaveOnEveryRank) {
  TempDir tmp;
  fs::create_directories(tmp.path());
  absl::StatusOr<std::unique_ptr<Storage>> other = Storage::Open(tmp.path());
  ASSERT_TRUE(other.ok());
  absl::StatusOr<std::unique_ptr<Storage::Lock>> held =
      (*other)->TryLock("save.lock");
  ASSERT_TRUE(held.ok()) << held.status();
  std::vector<absl::Status> st = RunInProcess(
      4, [&](Communicator& comm) -> absl::Status {
        State s(comm.rank() + 10);
        StateDict sd;
        sd["w"] = ShardedTensor(
            DType::kF32, {4 * kRows, kCols},
            {{Box{{comm.rank() * kRows, 0}, {kRows, kCols}},
              TensorView(s.data.data(), DType::kF32, {kRows, kCols})}});
        SaveOptions o;
        o.comm = &comm;
        return Save(sd, tmp.path(), o).status();
      });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(st[r].code(), absl::StatusCode::kAborted) << r << ": " << st[r];
    EXPECT_THAT(Msg(st[r]), HasSubstr("locked by another save")) << r;
  }
  EXPECT_TRUE(DataFiles(tmp.path()).empty());
  EXPECT_FALSE(fs::exists(tmp.Sub("metadata.json")));
}

TEST(SaveSafetyTest, OfTwoConcurrentSavesExactlyOneWins) {
  // Two jobs saving the same step into one folder (a restarted job beside
  // its old instance): one commits, the other fails, and the checkpoint is
  // the winner's, whole. Repeated, as the race lands differently each time.
  TempDir tmp;
  for (int trial = 0; trial < 8; ++trial) {
    const std::string dir = tmp.Sub(absl::StrCat("t", trial));
    State a(100 + 2 * trial), b(101 + 2 * trial);
    absl::Status sa, sb;
    std::thread ta([&] { sa = Save(a.sd, dir).status(); });
    std::thread tb([&] { sb = Save(b.sd, dir).status(); });
    ta.join();
    tb.join();
    ASSERT_NE(sa.ok(), sb.ok()) << "trial " << trial << ": " << sa << " / "
                                << sb;
    const absl::Status& lost = sa.ok() ? sb : sa;
    EXPECT_TRUE(absl::IsAborted(lost) || absl::IsAlreadyExists(lost)) << lost;
    EXPECT_EQ(SeedIn(dir), sa.ok() ? 100 + 2 * trial : 101 + 2 * trial)
        << "trial " << trial;
  }
}

// --- 3. Overwrite keeps the old checkpoint until the new one commits ---

TEST(SaveSafetyTest, AFailedOverwriteLeavesTheOldCheckpointLoadable) {
  TempDir tmp;
  State a(1), b(2);
  ASSERT_TRUE(Save(a.sd, tmp.path()).ok());
  for (StorageOp op : {StorageOp::kCreate, StorageOp::kWriteAt,
                       StorageOp::kWriteAtomically}) {
    auto base = Storage::Open(tmp.path());
    ASSERT_TRUE(base.ok());
    FaultInjectionStorage faulty(*std::move(base));
    faulty.FailAlways(op, absl::ResourceExhaustedError("disk full (injected)"));
    SaveOptions o;
    o.overwrite = true;
    absl::StatusOr<SaveResult> saved =
        internal_checkpoint::SaveToStorage(b.sd, &faulty, o);
    ASSERT_FALSE(saved.ok());
    EXPECT_EQ(saved.status().code(), absl::StatusCode::kResourceExhausted);
    // The old checkpoint is still committed, whole.
    EXPECT_EQ(SeedIn(tmp.path()), 1) << "after a failure of op "
                                     << static_cast<int>(op);
  }
  // The next save cleans up what the failed ones left.
  SaveOptions o;
  o.overwrite = true;
  ASSERT_TRUE(Save(b.sd, tmp.path(), o).ok());
  EXPECT_EQ(SeedIn(tmp.path()), 2);
  EXPECT_EQ(DataFiles(tmp.path()).size(), 1u);
}

TEST(SaveSafetyTest, OverwriteWritesNewNamesAndRemovesTheOldFilesAfter) {
  TempDir tmp;
  State a(1), b(2);
  ASSERT_TRUE(Save(a.sd, tmp.path()).ok());
  const std::vector<std::string> old_files = DataFiles(tmp.path());
  ASSERT_EQ(old_files.size(), 1u);
  SaveOptions o;
  o.overwrite = true;
  ASSERT_TRUE(Save(b.sd, tmp.path(), o).ok());
  const std::vector<std::string> new_files = DataFiles(tmp.path());
  ASSERT_EQ(new_files.size(), 1u);
  EXPECT_NE(new_files[0], old_files[0]);
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok());
  EXPECT_FALSE(md->save_id.empty());
  EXPECT_THAT(new_files[0], HasSubstr(md->save_id));
  EXPECT_EQ(SeedIn(tmp.path()), 2);
  // Without overwrite the committed checkpoint is refused, and kept.
  State c(3);
  EXPECT_EQ(Save(c.sd, tmp.path()).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(SeedIn(tmp.path()), 2);
}

TEST(SaveSafetyTest, AGivenSaveIdNamesTheFilesAndIsChecked) {
  TempDir tmp;
  State a(1);
  SaveOptions o;
  o.save_id = "job7-step100";
  ASSERT_TRUE(Save(a.sd, tmp.path(), o).ok());
  EXPECT_EQ(DataFiles(tmp.path()),
            std::vector<std::string>{"data-00000-job7-step100.safetensors"});
  EXPECT_EQ(ReadMetadata(tmp.path())->save_id, "job7-step100");
  o.save_id = "../x";
  o.overwrite = true;
  absl::StatusOr<SaveResult> bad = Save(a.sd, tmp.Sub("other"), o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(bad.status()), HasSubstr("save id"));
}

// --- 6, 7. Readers never block on a FIFO or follow a link ---

TEST(SaveSafetyTest, AFifoInTheCheckpointIsRefusedNotWaitedOn) {
  TempDir tmp;
  State a(1);
  ASSERT_TRUE(Save(a.sd, tmp.Sub("data")).ok());
  ASSERT_TRUE(Save(a.sd, tmp.Sub("meta")).ok());
  const std::string data_file = tmp.Sub("data/" + DataFiles(tmp.Sub("data"))[0]);
  fs::remove(data_file);
  ASSERT_EQ(::mkfifo(data_file.c_str(), 0644), 0);
  fs::remove(tmp.Sub("meta/metadata.json"));
  ASSERT_EQ(::mkfifo(tmp.Sub("meta/metadata.json").c_str(), 0644), 0);
  absl::Status error;
  EXPECT_EQ(SeedIn(tmp.Sub("data"), &error), -1);
  EXPECT_EQ(error.code(), absl::StatusCode::kFailedPrecondition) << error;
  EXPECT_THAT(Msg(error), HasSubstr("is a FIFO"));
  EXPECT_EQ(LoadAll(tmp.Sub("data")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ReadMetadata(tmp.Sub("meta")).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(SeedIn(tmp.Sub("meta"), &error), -1);
  EXPECT_THAT(Msg(error), HasSubstr("is a FIFO"));
}

TEST(SaveSafetyTest, ADataFileLinkedOutOfTheFolderIsRefused) {
  TempDir tmp;
  State a(1);
  ASSERT_TRUE(Save(a.sd, tmp.Sub("ckpt")).ok());
  const std::string name = DataFiles(tmp.Sub("ckpt"))[0];
  // The very same bytes, but outside the checkpoint, reached by a link.
  fs::rename(tmp.Sub("ckpt/" + name), tmp.Sub("elsewhere"));
  fs::create_symlink(tmp.Sub("elsewhere"), tmp.Sub("ckpt/" + name));
  absl::Status error;
  EXPECT_EQ(SeedIn(tmp.Sub("ckpt"), &error), -1);
  EXPECT_EQ(error.code(), absl::StatusCode::kFailedPrecondition) << error;
  EXPECT_THAT(Msg(error), HasSubstr(name + " is a symbolic link"));
  EXPECT_EQ(LoadAll(tmp.Sub("ckpt")).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// --- 13. A file size limit is an error, not SIGXFSZ ---

TEST(SaveSafetyTest, AFileSizeLimitFailsTheSaveAndKeepsTheOldCheckpoint) {
  TempDir tmp;
  State a(1), b(2);
  ASSERT_TRUE(Save(a.sd, tmp.path()).ok());
  struct rlimit old;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  struct rlimit lower = old;
  lower.rlim_cur = 64 << 10;  // below the 256 KiB data file
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lower), 0);
  SaveOptions o;
  o.overwrite = true;
  absl::StatusOr<SaveResult> saved = Save(b.sd, tmp.path(), o);
  ::setrlimit(RLIMIT_FSIZE, &old);
  ASSERT_FALSE(saved.ok());
  EXPECT_EQ(saved.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(saved.status()), HasSubstr("RLIMIT_FSIZE"));
  EXPECT_EQ(SeedIn(tmp.path()), 1);
}

}  // namespace
}  // namespace cairn
