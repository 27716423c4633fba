#include "core/status.h"

#include <cerrno>

#include "gtest/gtest.h"

namespace cairn::internal_core {
namespace {

TEST(StatusTest, ErrnoMapsToMeaningfulCodes) {
  struct Case {
    int err;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {ENOENT, absl::StatusCode::kNotFound},
      {EEXIST, absl::StatusCode::kAlreadyExists},
      {EACCES, absl::StatusCode::kPermissionDenied},
      {ENOSPC, absl::StatusCode::kResourceExhausted},
      {EINVAL, absl::StatusCode::kInvalidArgument},
      {EIO, absl::StatusCode::kDataLoss},
      {EXDEV, absl::StatusCode::kInternal},
  };
  for (const Case& c : cases) {
    absl::Status s = StatusFromErrno(c.err, "open", "/ckpt/x");
    EXPECT_EQ(s.code(), c.code) << c.err;
    EXPECT_EQ(s.message().rfind("open /ckpt/x: ", 0), 0u) << s;
  }
}

TEST(StatusTest, AnnotateKeepsCodeAndPrefixesContext) {
  absl::Status s = Annotate(absl::DataLossError("crc mismatch"), "model.wq");
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "model.wq: crc mismatch");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "ctx").ok());
}

absl::StatusOr<int> Half(int x) {
  if (x % 2) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status UseMacros(int x, int* out) {
  CAIRN_ASSIGN_OR_RETURN(int h, Half(x));
  CAIRN_RETURN_IF_ERROR(h > 10 ? absl::OutOfRangeError("big") : absl::OkStatus());
  *out = h;
  return absl::OkStatus();
}

TEST(StatusTest, MacrosPropagate) {
  int out = 0;
  EXPECT_TRUE(UseMacros(8, &out).ok());
  EXPECT_EQ(out, 4);
  EXPECT_EQ(UseMacros(3, &out).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UseMacros(40, &out).code(), absl::StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace cairn::internal_core
