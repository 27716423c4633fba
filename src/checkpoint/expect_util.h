// gtest expectations shared by the checkpoint tests of several ranks.
#ifndef CAIRN_CHECKPOINT_EXPECT_UTIL_H_
#define CAIRN_CHECKPOINT_EXPECT_UTIL_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::testing_util {

// Every rank's status the same error (one combined error on every rank),
// and its message contains `must_contain`.
inline void ExpectSameError(const std::vector<absl::Status>& st,
                            const std::string& must_contain) {
  ASSERT_FALSE(st.empty());
  EXPECT_FALSE(st[0].ok());
  for (size_t r = 0; r < st.size(); ++r) {
    EXPECT_EQ(st[r], st[0]) << "rank " << r;
  }
  EXPECT_THAT(std::string(st[0].message()), ::testing::HasSubstr(must_contain));
}

}  // namespace cairn::testing_util

#endif  // CAIRN_CHECKPOINT_EXPECT_UTIL_H_
