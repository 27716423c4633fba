#include "format/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::internal_format {
namespace {

using ::testing::HasSubstr;

constexpr char kFile[] = "data-00007.safetensors";

std::string LengthPrefix(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// Parses a whole in-memory file the way a reader would.
absl::StatusOr<SafetensorsHeader> ParseFile(const std::string& file) {
  auto n = ParseSafetensorsHeaderLength(std::string_view(file).substr(0, 8),
                                        file.size(), kFile);
  if (!n.ok()) return n.status();
  return ParseSafetensorsHeader(std::string_view(file).substr(8, *n),
                                file.size(), kFile);
}

// Parses the header text of a file whose buffer has `buffer` bytes.
absl::StatusOr<SafetensorsHeader> ParseHeaderText(const std::string& header,
                                                  uint64_t buffer) {
  return ParseSafetensorsHeader(header, 8 + header.size() + buffer, kFile);
}

void ExpectDataLoss(const absl::Status& status,
                    const std::string& must_mention = "") {
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(kFile)) << status;
  if (!must_mention.empty()) {
    EXPECT_THAT(std::string(status.message()), HasSubstr(must_mention))
        << status;
  }
}

std::vector<SafetensorsEntry> SampleEntries() {
  return {
      {"model.wq", DType::kBF16, {4, 8}, 0, 64},
      {"model.bias@2", DType::kF32, {3}, 64, 76},
      {"scalar", DType::kI64, {}, 76, 84},
      {"empty", DType::kF16, {0, 5}, 84, 84},
      {"rng.rank0", DType::kU8, {5}, 84, 89},
  };
}

const std::map<std::string, std::string> kCairnMeta = {{"format", "cairn"},
                                                       {"version", "1"}};

TEST(SafetensorsTest, RoundTripAligned) {
  auto entries = SampleEntries();
  std::string header = EncodeSafetensorsHeader(entries, kCairnMeta, 4096);
  ASSERT_EQ(header.size() % 4096, 0u);
  std::string file = header + std::string(89, 'x');
  auto parsed = ParseFile(file);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->data_start, header.size());
  EXPECT_EQ(parsed->metadata, kCairnMeta);
  // Sorted by begin, ties by end: the order they were written in.
  EXPECT_EQ(parsed->entries, entries);
  // Padding is spaces after the JSON.
  EXPECT_EQ(header.back(), ' ');
}

TEST(SafetensorsTest, RoundTripEveryDType) {
  std::vector<SafetensorsEntry> entries;
  uint64_t pos = 0;
  for (DType dtype : AllDTypes()) {
    const uint64_t bytes = 6 * DTypeSize(dtype);
    entries.push_back({std::string(DTypeName(dtype)) + ".t",
                       dtype,
                       {2, 3},
                       pos,
                       pos + bytes});
    pos += bytes;
  }
  std::string header = EncodeSafetensorsHeader(entries, {}, 8);
  EXPECT_EQ(header.size() % 8, 0u);
  auto parsed = ParseFile(header + std::string(pos, '\0'));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->entries, entries);
  EXPECT_TRUE(parsed->metadata.empty());
}

TEST(SafetensorsTest, NoAlignmentMeansNoPadding) {
  std::string header = EncodeSafetensorsHeader(SampleEntries(), {}, 1);
  EXPECT_NE(header.back(), ' ');
  EXPECT_EQ(EncodeSafetensorsHeader(SampleEntries(), {}, 0), header);
  auto parsed = ParseFile(header + std::string(89, '\0'));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
}

TEST(SafetensorsTest, EmptyFile) {
  std::string header = EncodeSafetensorsHeader({}, kCairnMeta, 4096);
  auto parsed = ParseFile(header);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->entries.empty());
  EXPECT_EQ(parsed->metadata, kCairnMeta);
}

// A header as the reference Python/Rust writer produces it: __metadata__
// anywhere, entries in any order, padded with spaces.
TEST(SafetensorsTest, ParsesForeignHeader) {
  std::string header =
      R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
      R"("__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"I8","shape":[2,4],"data_offsets":[0,8]}}    )";
  auto parsed = ParseHeaderText(header, 16);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->entries.size(), 2u);
  EXPECT_EQ(parsed->entries[0].name, "a");
  EXPECT_EQ(parsed->entries[1].name, "b");
  EXPECT_EQ(parsed->metadata.at("format"), "pt");
}

TEST(SafetensorsTest, UnknownEntryFieldsAreIgnored) {
  auto parsed = ParseHeaderText(
      R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":[1]}})",
      1);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
}

// ------------------------------------------------------------ header length

TEST(SafetensorsTest, FileShorterThanLengthPrefix) {
  ExpectDataLoss(ParseSafetensorsHeaderLength("abc", 3, kFile).status(),
                 "too short");
  ExpectDataLoss(ParseSafetensorsHeaderLength("", 0, kFile).status());
}

TEST(SafetensorsTest, HeaderLengthOverCap) {
  std::string prefix = LengthPrefix(kMaxSafetensorsHeaderBytes + 1);
  ExpectDataLoss(
      ParseSafetensorsHeaderLength(prefix, uint64_t{1} << 40, kFile).status(),
      "exceeds the limit");
  ExpectDataLoss(ParseSafetensorsHeaderLength(LengthPrefix(~uint64_t{0}),
                                              ~uint64_t{0}, kFile)
                     .status(),
                 "exceeds the limit");
  // Exactly the cap is fine when the file is big enough.
  auto n =
      ParseSafetensorsHeaderLength(LengthPrefix(kMaxSafetensorsHeaderBytes),
                                   8 + kMaxSafetensorsHeaderBytes, kFile);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, kMaxSafetensorsHeaderBytes);
}

TEST(SafetensorsTest, HeaderPastEndOfFile) {
  ExpectDataLoss(
      ParseSafetensorsHeaderLength(LengthPrefix(100), 107, kFile).status(),
      "past the end");
  auto n = ParseSafetensorsHeaderLength(LengthPrefix(100), 108, kFile);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 100u);
  // ParseSafetensorsHeader checks it again.
  ExpectDataLoss(ParseSafetensorsHeader("{}", 9, kFile).status(),
                 "past the end");
}

// ------------------------------------------------------------ JSON

TEST(SafetensorsTest, MalformedJson) {
  for (const std::string& bad : std::vector<std::string>{
           "", "{", "{\"a\":", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],",
           "not json", "{}}", "{\"a\" 1}", std::string("{\0}", 3),
           "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}"
           ","}) {
    ExpectDataLoss(ParseHeaderText(bad, 0).status(), "JSON");
  }
}

TEST(SafetensorsTest, TruncatedHeaderOfRealFile) {
  std::string header = EncodeSafetensorsHeader(SampleEntries(), kCairnMeta, 1);
  std::string json = header.substr(8);
  for (size_t cut : {size_t{1}, json.size() / 2, json.size() - 1}) {
    ExpectDataLoss(ParseHeaderText(json.substr(0, cut), 89).status());
  }
}

TEST(SafetensorsTest, InvalidUtf8) {
  std::string header =
      "{\"a\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
  ExpectDataLoss(ParseHeaderText(header, 1).status());
}

TEST(SafetensorsTest, DeepNestingIsRejectedWithoutCrashing) {
  std::string deep = "{\"__metadata__\":" + std::string(100000, '[') +
                     std::string(100000, ']') + "}";
  ExpectDataLoss(ParseHeaderText(deep, 0).status());
}

TEST(SafetensorsTest, HeaderNotAnObject) {
  ExpectDataLoss(ParseHeaderText("[]", 0).status(), "object");
  ExpectDataLoss(ParseHeaderText("3", 0).status(), "object");
}

TEST(SafetensorsTest, BadMetadataSection) {
  ExpectDataLoss(ParseHeaderText(R"({"__metadata__":[1]})", 0).status(),
                 "__metadata__");
  ExpectDataLoss(ParseHeaderText(R"({"__metadata__":{"a":1}})", 0).status(),
                 "__metadata__");
  ExpectDataLoss(ParseHeaderText(R"({"__metadata__":{"a":null}})", 0).status(),
                 "__metadata__");
}

// ------------------------------------------------------------ entries

struct BadEntryCase {
  std::string entry;  // JSON of the entry named "w"
  uint64_t buffer;
  std::string mention;
};

TEST(SafetensorsTest, BadEntriesNameFileAndEntry) {
  const std::vector<BadEntryCase> cases = {
      {R"(5)", 0, "object"},
      {R"({"shape":[1],"data_offsets":[0,4]})", 4, "dtype"},
      {R"({"dtype":7,"shape":[1],"data_offsets":[0,4]})", 4, "dtype"},
      {R"({"dtype":"F33","shape":[1],"data_offsets":[0,4]})", 4,
       "unknown dtype"},
      {R"({"dtype":"f32","shape":[1],"data_offsets":[0,4]})", 4,
       "unknown dtype"},
      {R"({"dtype":"F32","data_offsets":[0,4]})", 4, "shape"},
      {R"({"dtype":"F32","shape":5,"data_offsets":[0,4]})", 4, "shape"},
      {R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})", 4, "shape"},
      {R"({"dtype":"F32","shape":[1.5],"data_offsets":[0,4]})", 4, "shape"},
      {R"({"dtype":"F32","shape":["1"],"data_offsets":[0,4]})", 4, "shape"},
      {R"({"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,4]})",
       4, "shape"},
      {R"({"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,4]})",
       4, "shape"},
      {R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]})",
       4, "overflow"},
      {R"({"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,4]})",
       4, "overflow"},
      {R"({"dtype":"F32","shape":[1]})", 4, "data_offsets"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[0]})", 4, "data_offsets"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[0,4,8]})", 4,
       "data_offsets"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":{"a":1}})", 4,
       "data_offsets"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[-4,0]})", 4,
       "data_offsets"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551616]})",
       4, "data_offsets"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[4,0]})", 4,
       "end before begin"},
      {R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})", 4,
       "shape needs 8"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[0,8]})", 8,
       "shape needs 4"},
      {R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})", 4,
       "past the end"},
      {R"({"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]})",
       4, "past the end"},
  };
  for (const BadEntryCase& c : cases) {
    SCOPED_TRACE(c.entry);
    auto status = ParseHeaderText("{\"w\":" + c.entry + "}", c.buffer).status();
    ExpectDataLoss(status, c.mention);
    EXPECT_THAT(std::string(status.message()), HasSubstr("\"w\""));
  }
}

TEST(SafetensorsTest, HoleInBuffer) {
  auto status = ParseHeaderText(
                    R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                    R"("b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})",
                    12)
                    .status();
  ExpectDataLoss(status, "hole");
  EXPECT_THAT(std::string(status.message()), HasSubstr("\"b\""));
  // A buffer that does not start at 0.
  ExpectDataLoss(
      ParseHeaderText(
          R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[1,5]}})", 5)
          .status(),
      "hole");
}

TEST(SafetensorsTest, OverlappingEntries) {
  ExpectDataLoss(
      ParseHeaderText(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
                      8)
          .status(),
      "overlap");
  // Two entries on the same bytes.
  ExpectDataLoss(
      ParseHeaderText(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                      8)
          .status(),
      "overlap");
}

TEST(SafetensorsTest, TrailingBytes) {
  ExpectDataLoss(
      ParseHeaderText(
          R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 5)
          .status(),
      "trailing");
  ExpectDataLoss(ParseHeaderText("{}", 1).status(), "trailing");
}

TEST(SafetensorsTest, ZeroLengthEntriesMayShareAnOffset) {
  auto parsed = ParseHeaderText(
      R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},)"
      R"("b":{"dtype":"F32","shape":[2,0],"data_offsets":[4,4]},)"
      R"("c":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
      4);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->entries.size(), 3u);
  EXPECT_EQ(parsed->entries[0].name, "c");
}

// Every truncation and every single-byte corruption of a valid header is
// either accepted or rejected with a status: never a crash (ASan build).
TEST(SafetensorsTest, CorruptionNeverCrashes) {
  std::string header = EncodeSafetensorsHeader(SampleEntries(), kCairnMeta, 1);
  std::string file = header + std::string(89, '\0');
  for (size_t cut = 0; cut <= file.size(); ++cut) {
    std::string f = file.substr(0, cut);
    (void)ParseFile(f);
  }
  const char kBytes[] = {'\0', '"', '{', '}', '[',  ']',    ',', ':',
                         '9',  '-', 'e', '.', '\\', '\xff', ' '};
  for (size_t i = 0; i < header.size(); ++i) {
    for (char b : kBytes) {
      std::string f = file;
      f[i] = b;
      auto parsed = ParseFile(f);
      if (!parsed.ok()) {
        EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(kFile));
      }
    }
  }
}

}  // namespace
}  // namespace cairn::internal_format
