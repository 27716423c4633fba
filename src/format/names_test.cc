#include "format/names.h"

#include <string>

#include "gtest/gtest.h"

namespace cairn::internal_format {
namespace {

TEST(NamesTest, AcceptsSafeRelativeNames) {
  for (const char* name :
       {"metadata.json", "data-00000.safetensors", "rank-00003/metadata.json",
        "a/b/c", "..hidden", "x..y"}) {
    EXPECT_TRUE(ValidateRelativeName(name).ok()) << name;
  }
}

struct BadName {
  std::string name;
  const char* why;
};

TEST(NamesTest, RejectsUnsafeNames) {
  const BadName cases[] = {
      {"", "empty"},
      {"/etc/passwd", "absolute path"},
      {"../outside", "'.' or '..'"},
      {"a/../../b", "'.' or '..'"},
      {"a/./b", "'.' or '..'"},
      {".", "'.' or '..'"},
      {"a//b", "empty path component"},
      {"a/", "empty path component"},
      {std::string("a\0b", 3), "control character"},
      {"a\nb", "control character"},
      {"a\\b", "backslash"},
      {std::string(5000, 'x'), "too long"},
  };
  for (const BadName& c : cases) {
    absl::Status s = ValidateRelativeName(c.name);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(s.message().find(c.why), std::string_view::npos) << s;
  }
}

TEST(NamesTest, PlainNamesHaveNoSlash) {
  EXPECT_TRUE(ValidatePlainName("data-00001.safetensors").ok());
  EXPECT_EQ(ValidatePlainName("sub/data.safetensors").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidatePlainName("..").code(), absl::StatusCode::kInvalidArgument);
}

TEST(NamesTest, DataFileAndEntryNames) {
  EXPECT_EQ(DataFileName(0), "data-00000.safetensors");
  EXPECT_EQ(DataFileName(123), "data-00123.safetensors");
  Box box{{1024, 0}, {512, 4096}};
  EXPECT_EQ(EntryName("model.wq", box, /*whole=*/false), "model.wq@1024,0");
  EXPECT_EQ(EntryName("model.wq", box, /*whole=*/true), "model.wq");
  EXPECT_EQ(KvEntryName("emb.user", 3, 0, "ids"), "emb.user@kv3+0.ids");
  EXPECT_EQ(KvEntryName("emb.user", 12, 4096, "adam.m"),
            "emb.user@kv12+4096.adam.m");
  EXPECT_EQ(KvFileName(3, 2, "ab12"), "data-00003-kv0002-ab12.safetensors");
}

TEST(NamesTest, RankFolders) {
  EXPECT_EQ(RankFolderName(3), "rank-00003");
  EXPECT_EQ(RankFolderName(123456), "rank-123456");
  EXPECT_EQ(RankOfMetadataName("rank-00003/metadata.json"), 3);
  EXPECT_EQ(RankOfMetadataName("rank-123456/metadata.json"), 123456);
  for (const char* bad :
       {"rank-0003/metadata.json", "rank-000003/metadata.json",
        "rank-0000x/metadata.json", "rank-00003/data-00000.safetensors",
        "rank-00003/metadata.json.tmp", "metadata.json", "rank-/metadata.json",
        "rank-9999999999/metadata.json", "x/rank-00003/metadata.json"}) {
    EXPECT_EQ(RankOfMetadataName(bad), -1) << bad;
  }
}

}  // namespace
}  // namespace cairn::internal_format
