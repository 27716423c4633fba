#include "storage/s3/xml.h"

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::internal_s3 {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr std::string_view kList = R"(<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">
  <Name>bkt</Name><Prefix>p/</Prefix><KeyCount>2</KeyCount>
  <IsTruncated>true</IsTruncated>
  <Contents><Key>p/a&amp;b.safetensors</Key><Size>10</Size></Contents>
  <Contents><Key>p/&#233;&#x4E2D;</Key><Size>0</Size></Contents>
  <NextContinuationToken>tok/+=</NextContinuationToken>
  <StartAfter/>
</ListBucketResult>)";

TEST(XmlTest, ElementsSkipLongerNamesAndUnescape) {
  auto keys = XmlElements(kList, "Key");
  ASSERT_TRUE(keys.ok()) << keys.status();
  ASSERT_EQ(keys->size(), 2);  // not <KeyCount>
  EXPECT_EQ(*XmlUnescape((*keys)[0]), "p/a&b.safetensors");
  EXPECT_EQ(*XmlUnescape((*keys)[1]), "p/\xC3\xA9\xE4\xB8\xAD");
  EXPECT_THAT(*XmlElements(kList, "StartAfter"), ElementsAre(""));
  EXPECT_EQ(**XmlFirstText(kList, "NextContinuationToken"), "tok/+=");
  EXPECT_EQ(*XmlFirstText(kList, "UploadId"), std::nullopt);
  auto contents = XmlElements(kList, "Contents");
  ASSERT_TRUE(contents.ok());
  ASSERT_EQ(contents->size(), 2);
  EXPECT_EQ(**XmlFirstText((*contents)[0], "Size"), "10");
}

TEST(XmlTest, MalformedInputIsAnErrorNotAnOverread) {
  for (std::string_view bad :
       {"<Key>abc", "<Key", "<Key attr=\"x\"", "<a><Key>x</Ke"}) {
    auto r = XmlElements(bad, "Key");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  for (std::string_view bad : {"a&b", "&unknown;", "&#0;", "&#xD800;",
                               "&#99999999;", "&#x;", "&#12a;"}) {
    auto r = XmlUnescape(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_THAT(XmlUnescape("x&bogus;").status().message(),
              HasSubstr("&bogus;"));
}

TEST(XmlTest, EscapeRoundTrips) {
  const std::string text = "a<b>&\"c'";
  EXPECT_EQ(XmlEscape(text), "a&lt;b&gt;&amp;&quot;c&apos;");
  EXPECT_EQ(*XmlUnescape(XmlEscape(text)), text);
}

}  // namespace
}  // namespace cairn::internal_s3
