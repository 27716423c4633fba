#include "storage/fault_injection.h"

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "cairn/storage.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::internal_storage {
namespace {

using ::testing::ElementsAre;

class FaultInjectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = "/tmp/cairn-fault-test-XXXXXX";
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    temp_ = templ;
    auto base = Storage::Open(temp_, StorageOptions{.direct_io = false});
    ASSERT_TRUE(base.ok()) << base.status();
    storage_ = std::make_unique<FaultInjectionStorage>(*std::move(base));
  }
  void TearDown() override {
    storage_.reset();
    std::error_code ec;
    std::filesystem::remove_all(temp_, ec);
  }

  // Writes `n` bytes in one WriteAt, or returns the first error.
  absl::Status WriteBytes(const std::string& name, size_t n) {
    auto file = storage_->Create(name);
    if (!file.ok()) return file.status();
    std::vector<std::byte> data(n, std::byte{0x5a});
    if (absl::Status s = (*file)->WriteAt(0, data); !s.ok()) return s;
    return (*file)->Finish(n);
  }

  std::string temp_;
  std::unique_ptr<FaultInjectionStorage> storage_;
};

TEST_F(FaultInjectionTest, ForwardsEverything) {
  EXPECT_EQ(storage_->url(), temp_);
  ASSERT_TRUE(storage_->CreateLocation().ok());
  ASSERT_TRUE(WriteBytes("a/b", 10).ok());
  ASSERT_TRUE(storage_->WriteAtomically("m", "meta").ok());
  auto names = storage_->List();
  ASSERT_TRUE(names.ok());
  EXPECT_THAT(*names, ElementsAre("a/b", "m"));
  auto meta = storage_->ReadAll("m", 100);
  ASSERT_TRUE(meta.ok());
  EXPECT_EQ(*meta, "meta");
  EXPECT_TRUE(storage_->Remove("m").ok());
  EXPECT_TRUE(storage_->Sync().ok());
  auto exists = storage_->Exists("m");
  ASSERT_TRUE(exists.ok());
  EXPECT_FALSE(*exists);
  EXPECT_EQ(storage_->calls(StorageOp::kCreate), 1);
  EXPECT_EQ(storage_->calls(StorageOp::kWriteAt), 1);
  EXPECT_EQ(storage_->calls(StorageOp::kFinish), 1);
  EXPECT_EQ(storage_->calls(StorageOp::kWriteAtomically), 1);
  EXPECT_EQ(storage_->calls(StorageOp::kList), 1);
  EXPECT_EQ(storage_->calls(StorageOp::kOpenForRead), 1);  // by ReadAll
  EXPECT_EQ(storage_->calls(StorageOp::kReadAt), 1);
  EXPECT_EQ(storage_->calls(StorageOp::kRemove), 1);
  EXPECT_EQ(storage_->calls(StorageOp::kSync), 1);
  EXPECT_EQ(storage_->calls(StorageOp::kExists), 1);
  EXPECT_EQ(storage_->calls(StorageOp::kCreateLocation), 1);
}

TEST_F(FaultInjectionTest, FailsExactlyTheNthCall) {
  const absl::Status injected = absl::UnavailableError("injected: disk gone");
  storage_->FailNthCall(StorageOp::kWriteAt, 2, injected);
  EXPECT_TRUE(WriteBytes("f1", 100).ok());
  EXPECT_EQ(WriteBytes("f2", 100), injected);
  EXPECT_TRUE(WriteBytes("f3", 100).ok());
  EXPECT_EQ(storage_->calls(StorageOp::kWriteAt), 3);
  // Failed calls are counted but their bytes are not.
  EXPECT_EQ(storage_->bytes_written(), 200u);
}

TEST_F(FaultInjectionTest, NthIsCountedFromWhenTheFaultIsSet) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(storage_->Sync().ok());
  storage_->FailNthCall(StorageOp::kSync, 1, absl::InternalError("now"));
  EXPECT_EQ(storage_->Sync().code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(storage_->Sync().ok());
  EXPECT_EQ(storage_->calls(StorageOp::kSync), 5);
}

TEST_F(FaultInjectionTest, NewFaultReplacesThePendingOne) {
  storage_->FailNthCall(StorageOp::kList, 1, absl::InternalError("first"));
  storage_->FailNthCall(StorageOp::kList, 2, absl::DataLossError("second"));
  EXPECT_TRUE(storage_->List().ok());
  EXPECT_EQ(storage_->List().status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(storage_->List().ok());
}

TEST_F(FaultInjectionTest, FailAlwaysUntilClear) {
  storage_->FailAlways(StorageOp::kFinish,
                       absl::ResourceExhaustedError("full"));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(WriteBytes("f" + std::to_string(i), 10).code(),
              absl::StatusCode::kResourceExhausted);
  }
  storage_->Clear();
  EXPECT_TRUE(WriteBytes("f", 10).ok());
  EXPECT_EQ(storage_->calls(StorageOp::kFinish), 4);
}

TEST_F(FaultInjectionTest, EveryOperationCanFail) {
  ASSERT_TRUE(WriteBytes("f", 10).ok());
  auto writer = storage_->Create("g");
  ASSERT_TRUE(writer.ok());
  auto reader = storage_->OpenForRead("f");
  ASSERT_TRUE(reader.ok());
  std::vector<std::byte> buf(10);
  const absl::Status injected = absl::AbortedError("injected");
  for (int op = 0; op < static_cast<int>(StorageOp::kNumOps); ++op) {
    SCOPED_TRACE(op);
    storage_->FailAlways(static_cast<StorageOp>(op), injected);
    absl::Status got;
    switch (static_cast<StorageOp>(op)) {
      case StorageOp::kCreateLocation:
        got = storage_->CreateLocation();
        break;
      case StorageOp::kCreate:
        got = storage_->Create("h").status();
        break;
      case StorageOp::kWriteAt:
        got = (*writer)->WriteAt(0, buf);
        break;
      case StorageOp::kReserve:
        got = (*writer)->Reserve(4096);
        break;
      case StorageOp::kFinish:
        got = (*writer)->Finish(0);
        break;
      case StorageOp::kWriteAtomically:
        got = storage_->WriteAtomically("m", "x");
        break;
      case StorageOp::kRemove:
        got = storage_->Remove("f");
        break;
      case StorageOp::kSync:
        got = storage_->Sync();
        break;
      case StorageOp::kList:
        got = storage_->List().status();
        break;
      case StorageOp::kOpenForRead:
        got = storage_->OpenForRead("f").status();
        break;
      case StorageOp::kReadAt:
        got = (*reader)->ReadAt(0, buf);
        break;
      case StorageOp::kExists:
        got = storage_->Exists("f").status();
        break;
      case StorageOp::kNumOps:
        break;
    }
    EXPECT_EQ(got, injected);
    storage_->Clear();
  }
  // The injected failures ran nothing: "f" is still there, "m" never was.
  auto names = storage_->List();
  ASSERT_TRUE(names.ok());
  EXPECT_THAT(*names, ElementsAre("f", "g"));
}

TEST_F(FaultInjectionTest, CountsBytesOfSuccessfulReads) {
  ASSERT_TRUE(WriteBytes("f", 1000).ok());
  auto reader = storage_->OpenForRead("f");
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->size(), 1000u);
  std::vector<std::byte> buf(400);
  EXPECT_TRUE((*reader)->ReadAt(0, buf).ok());
  EXPECT_TRUE((*reader)->ReadAt(600, buf).ok());
  EXPECT_EQ((*reader)->ReadAt(700, buf).code(), absl::StatusCode::kDataLoss);
  storage_->FailNthCall(StorageOp::kReadAt, 1, absl::DataLossError("short"));
  EXPECT_FALSE((*reader)->ReadAt(0, buf).ok());
  EXPECT_EQ(storage_->bytes_read(), 800u);
  EXPECT_EQ(storage_->calls(StorageOp::kReadAt), 4);
  EXPECT_EQ(storage_->bytes_written(), 1000u);
}

TEST_F(FaultInjectionTest, CorruptNthReadFlipsOneByte) {
  ASSERT_TRUE(WriteBytes("f", 100).ok());
  auto reader = storage_->OpenForRead("f");
  ASSERT_TRUE(reader.ok());
  storage_->CorruptNthRead(2);
  std::vector<std::byte> buf(100);
  const std::vector<std::byte> clean(100, std::byte{0x5a});
  ASSERT_TRUE((*reader)->ReadAt(0, buf).ok());
  EXPECT_EQ(buf, clean);
  ASSERT_TRUE((*reader)->ReadAt(0, buf).ok());
  int differing = 0;
  for (size_t i = 0; i < buf.size(); ++i) differing += buf[i] != clean[i];
  EXPECT_EQ(differing, 1);
  ASSERT_TRUE((*reader)->ReadAt(0, buf).ok());
  EXPECT_EQ(buf, clean);
}

TEST_F(FaultInjectionTest, CountersAreThreadSafe) {
  ASSERT_TRUE(storage_->CreateLocation().ok());
  auto file = storage_->Create("f");
  ASSERT_TRUE(file.ok());
  storage_->FailNthCall(StorageOp::kWriteAt, 50, absl::InternalError("x"));
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::byte> block(100);
      for (int i = 0; i < 25; ++i) {
        if (!(*file)->WriteAt((t * 25 + i) * 100, block).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 1);
  EXPECT_EQ(storage_->calls(StorageOp::kWriteAt), 100);
  EXPECT_EQ(storage_->bytes_written(), 99u * 100u);
  EXPECT_TRUE((*file)->Finish(10000).ok());
}

}  // namespace
}  // namespace cairn::internal_storage
