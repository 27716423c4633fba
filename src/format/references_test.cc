#include "format/references.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace cairn::internal_format {
namespace {

TEST(ReferencesTest, AcceptsSiblingsAndAbsoluteUrls) {
  for (const char* url : {"../step-0000000100", "/ckpt/run/step-1",
                          "file:///ckpt/step-1", "s3://bucket/run/step-1",
                          "s3://bucket"}) {
    EXPECT_TRUE(ValidateReferenceUrl(url).ok()) << url;
  }
}

TEST(ReferencesTest, RejectsOtherUrls) {
  for (const std::string& url :
       {std::string(""), std::string("step-1"), std::string("../a/b"),
        std::string("../.."), std::string("../"), std::string("/"),
        std::string("/a/../b"), std::string("/a//b"), std::string("/a/"),
        std::string("s3://b/x/./y"), std::string("1s3://b"),
        std::string("/a\nb"), std::string("/a\\b"), std::string(5000, 'x'),
        std::string("/a\0b", 4)}) {
    EXPECT_EQ(ValidateReferenceUrl(url).code(),
              absl::StatusCode::kInvalidArgument)
        << url;
  }
}

TEST(ReferencesTest, ReferencesAreDistinctAndNotNested) {
  using Refs = std::vector<CheckpointReference>;
  EXPECT_TRUE(ValidateReferences(Refs{{"../a", 1, "s1"}, {"/x/b", 2, "s2"}},
                                 "s0")
                  .ok());
  const Refs bad[] = {
      {{"../a", 1, "s1"}, {"../a", 2, "s2"}},          // same URL
      {{"/x/a", 1, "s1"}, {"/x/a/b", 2, "s2"}},        // nested
      {{"../a", 1, "s1"}, {"../b", 2, "s1"}},          // same save id
      {{"../a", 1, "s0"}},                              // own save id
      {{"../a", 1, "bad id!"}},                         // not a save id
      {{"a", 1, "s1"}},                                 // bad URL
  };
  for (const Refs& refs : bad) {
    EXPECT_EQ(ValidateReferences(refs, "s0").code(),
              absl::StatusCode::kInvalidArgument)
        << refs[0].url;
  }
}

TEST(ReferencesTest, FilesAreOwnOrInAReference) {
  const std::vector<CheckpointReference> refs = {
      {"../step-1", 1, "s1"}, {"s3://b/run/step-2", 2, "s2"}};
  std::string_view name;
  absl::StatusOr<int> k = ReferenceOf("data-00000-x.safetensors", refs, &name);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(*k, -1);
  EXPECT_EQ(name, "data-00000-x.safetensors");
  k = ReferenceOf("../step-1/data-00001-y.safetensors", refs, &name);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(*k, 0);
  EXPECT_EQ(name, "data-00001-y.safetensors");
  k = ReferenceOf("s3://b/run/step-2/rank-00001/data-00000.safetensors", refs,
                  &name);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(*k, 1);
  EXPECT_EQ(name, "rank-00001/data-00000.safetensors");
  for (const char* bad :
       {"../step-3/data.safetensors", "../step-1/../x", "../step-1/",
        "../step-1", "/etc/passwd", "s3://b/run/step-22/x"}) {
    EXPECT_EQ(ReferenceOf(bad, refs, &name).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  // Without references, a name of the checkpoint's own, with its error.
  EXPECT_EQ(ReferenceOf("../step-1/x", {}, &name).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReferencesTest, ResolvesAndNamesSiblings) {
  EXPECT_EQ(ResolveReference("/ckpt/step-3", "../step-1"), "/ckpt/step-1");
  EXPECT_EQ(ResolveReference("/ckpt/step-3/", "../step-1"), "/ckpt/step-1");
  EXPECT_EQ(ResolveReference("s3://b/run/step-3", "../step-1"),
            "s3://b/run/step-1");
  EXPECT_EQ(ResolveReference("/ckpt/step-3", "/else/step-1"), "/else/step-1");
  EXPECT_EQ(ReferenceFrom("/ckpt/step-3", "/ckpt/step-1"), "../step-1");
  EXPECT_EQ(ReferenceFrom("/ckpt/step-3", "/ckpt/step-1/"), "../step-1");
  EXPECT_EQ(ReferenceFrom("s3://b/run/step-3", "s3://b/run/step-1"),
            "../step-1");
  EXPECT_EQ(ReferenceFrom("/ckpt/step-3", "/other/step-1"), "/other/step-1");
  EXPECT_EQ(ReferenceFrom("s3://b/run/step-3", "/ckpt/step-1"),
            "/ckpt/step-1");
  // Round trip.
  for (const char* target : {"/ckpt/step-1", "/other/x", "s3://c/y"}) {
    EXPECT_EQ(ResolveReference("/ckpt/step-3",
                               ReferenceFrom("/ckpt/step-3", target)),
              target);
  }
}

}  // namespace
}  // namespace cairn::internal_format
