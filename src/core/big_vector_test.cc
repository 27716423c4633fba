#include "core/big_vector.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace cairn::internal_core {
namespace {

// Memory the coordinator means to free (hundreds of MB at 16k ranks) must
// be freed: assigning an empty value keeps the capacity.
TEST(ReleaseStorageTest, FreesWhatAssigningEmptyKeeps) {
  std::vector<int> v(1 << 16);
  ReleaseStorage(v);
  EXPECT_EQ(v.capacity(), 0u);
  std::string s(1 << 16, 'x');
  ReleaseStorage(s);
  EXPECT_LT(s.capacity(), 64u);
  BigVector<uint32_t> big(1 << 20);
  ReleaseStorage(big);
  EXPECT_EQ(big.capacity(), 0u);
}

}  // namespace
}  // namespace cairn::internal_core
