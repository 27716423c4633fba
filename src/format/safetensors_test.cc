#include "format/safetensors.h"

#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

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

// ------------------------------------------ the parse without a JSON tree

void ExpectSameHeader(const SafetensorsHeader& a, const SafetensorsHeader& b) {
  EXPECT_EQ(a.entries, b.entries);
  EXPECT_EQ(a.metadata, b.metadata);
  EXPECT_EQ(a.data_start, b.data_start);
}

// For one header text: when the fast parse gives a header, the tree parse
// gives the same one; ParseSafetensorsHeader's result, error included, is
// the tree's. True when the fast parse gave a header.
bool CheckAgainstTree(std::string_view text, uint64_t file_size) {
  std::optional<SafetensorsHeader> fast =
      ParseSafetensorsHeaderFast(text, file_size);
  absl::StatusOr<SafetensorsHeader> tree =
      ParseSafetensorsHeaderTree(text, file_size, kFile);
  absl::StatusOr<SafetensorsHeader> both =
      ParseSafetensorsHeader(text, file_size, kFile);
  EXPECT_EQ(both.status(), tree.status()) << text;
  if (both.ok() && tree.ok()) ExpectSameHeader(*both, *tree);
  if (fast) {
    EXPECT_TRUE(tree.ok()) << tree.status() << "\n" << text;
    if (tree.ok()) ExpectSameHeader(*fast, *tree);
  }
  return fast.has_value();
}

// Random headers as cairn writes them (plain ASCII names): the fast parse
// takes every one of them, also re-serialized with other whitespace and
// member order; and for thousands of corruptions of them it either gives
// up or agrees with the tree parse.
TEST(SafetensorsTest, FastParseAgreesWithTheTreeParse) {
  std::mt19937_64 rng(20261124);
  auto pick = [&](uint64_t n) { return static_cast<size_t>(rng() % n); };
  const std::vector<std::string> names = {
      "a", "model.wq", "model.layers.3.mlp.w@0,512", "opt.state.7.exp_avg",
      "rng.rank0", "x y", "b@2"};
  const std::vector<DType> dtypes(AllDTypes().begin(), AllDTypes().end());
  const std::string interesting = "\"\\{}[],:09-+.eE \t\nxA\x7f\x80\xc3";
  int accepted_mutations = 0;
  for (int round = 0; round < 150; ++round) {
    std::vector<SafetensorsEntry> entries;
    uint64_t pos = 0;
    const size_t n = pick(8);
    for (size_t i = 0; i < n; ++i) {
      SafetensorsEntry e;
      e.name = names[pick(names.size())] + "." + std::to_string(i);
      e.dtype = dtypes[pick(dtypes.size())];
      for (size_t d = pick(4); d > 0; --d) {
        e.shape.push_back(static_cast<int64_t>(pick(6)));
      }
      e.begin = pos;
      e.end = pos + static_cast<uint64_t>(NumElements(e.shape)) *
                        DTypeSize(e.dtype);
      pos = e.end;
      entries.push_back(e);
    }
    std::map<std::string, std::string> meta;
    if (pick(2) == 0) meta = kCairnMeta;
    const uint64_t alignments[] = {1, 8, 4096};
    const std::string file =
        EncodeSafetensorsHeader(entries, meta, alignments[pick(3)]);
    const std::string text = file.substr(8);
    const uint64_t size = file.size() + pos;
    ASSERT_TRUE(CheckAgainstTree(text, size)) << text;
    // The same JSON with sorted members, indented or not.
    const nlohmann::json tree = nlohmann::json::parse(text);
    for (int indent : {-1, 0, 3}) {
      const std::string other = tree.dump(indent);
      EXPECT_TRUE(CheckAgainstTree(other, 8 + other.size() + pos)) << other;
    }
    // The byte buffer a byte too short or too long.
    EXPECT_FALSE(CheckAgainstTree(text, size + 1));
    if (pos > 0) {
      EXPECT_FALSE(CheckAgainstTree(text, size - 1));
    }
    // Corruptions: a byte replaced, removed or inserted, or a piece
    // repeated.
    for (int m = 0; m < 40; ++m) {
      std::string bad = text;
      const size_t at = pick(bad.size());
      switch (pick(4)) {
        case 0:
          bad[at] = interesting[pick(interesting.size())];
          break;
        case 1:
          bad.erase(at, 1);
          break;
        case 2:
          bad.insert(at, 1, interesting[pick(interesting.size())]);
          break;
        default:
          bad.insert(at, bad.substr(pick(bad.size()), 1 + pick(40)));
          break;
      }
      const uint64_t bad_size = 8 + bad.size() + pos;
      if (CheckAgainstTree(bad, bad_size)) ++accepted_mutations;
    }
  }
  // Whitespace moved or digits that keep the tiling: some corruptions
  // stay valid, and the fast parse takes them.
  EXPECT_GT(accepted_mutations, 0);
}

// What the fast parse leaves to the tree: each of these gives up, and the
// result (a header or the error) is the tree's.
TEST(SafetensorsTest, FastParseGivesUpOnWhatItDoesNotTake) {
  const std::string entry_a =
      R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]})";
  // Zero bytes: two of them may share an offset, so only the name tells.
  const std::string zero =
      R"("z":{"dtype":"U8","shape":[0],"data_offsets":[2,2]})";
  const std::vector<std::string> texts = {
      R"({"\u0061":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
      "{\"\xc3\xa9\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}",
      R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":1}})",
      R"({"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,2],)"
      R"("data_offsets":[0,2]}})",
      R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2.0]}})",
      R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,02]}})",
      R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2e0]}})",
      R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[-0,2]}})",
      R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2,2]}})",
      R"({"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
      R"({"a":{"dtype":"Q8","shape":[2],"data_offsets":[0,2]}})",
      R"({"a":{"dtype":"U8","shape":[99999999999999999999],)"
      R"("data_offsets":[0,2]}})",
      "{" + entry_a + "," + entry_a + "}",
      "{" + entry_a + "," + zero + "," + zero + "}",
      "{" + entry_a + R"(,"__metadata__":{"k":"v"},"__metadata__":{}})",
      "{" + entry_a + R"(,"__metadata__":{"k":1}})",
      "{" + entry_a + R"(,"__metadata__":{"k":"v","k":"w"}})",
      "{" + entry_a + ",}",
      "{" + entry_a + "}x",
      "[" + entry_a + "]",
      "",
  };
  for (const std::string& text : texts) {
    SCOPED_TRACE(text);
    EXPECT_FALSE(CheckAgainstTree(text, 8 + text.size() + 2));
  }
  // The first four are valid headers (an escape, a non-ASCII name, an
  // unknown member, nine dimensions), which the tree parse takes.
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(ParseSafetensorsHeader(texts[i], 8 + texts[i].size() + 2,
                                       kFile)
                    .ok());
  }
}

// ------------------------------------------------------------ header length

TEST(SafetensorsTest, FileShorterThanLengthPrefix) {
  ExpectDataLoss(ParseSafetensorsHeaderLength("abc", 3, kFile).status(),
                 "too short");
  ExpectDataLoss(ParseSafetensorsHeaderLength("", 0, kFile).status());
}

// A file that is no safetensors file at all (a password file reached by a
// link, say): the error must not show its first 8 bytes as a number.
TEST(SafetensorsTest, HeaderLengthErrorsDoNotPrintTheFilesBytes) {
  const std::string first8 = "root:x:0";
  uint64_t as_number = 0;
  for (int i = 7; i >= 0; --i) {
    as_number = (as_number << 8) | static_cast<unsigned char>(first8[i]);
  }
  absl::Status over = ParseSafetensorsHeaderLength(first8, 2000, kFile).status();
  ExpectDataLoss(over, "not a safetensors file");
  EXPECT_THAT(over.message(),
              testing::Not(testing::HasSubstr(absl::StrCat(as_number))));
  const std::string short_file = LengthPrefix(5000);
  absl::Status past =
      ParseSafetensorsHeaderLength(short_file, 100, kFile).status();
  ExpectDataLoss(past, "runs past the end of the file (size 100)");
  EXPECT_THAT(past.message(), testing::Not(testing::HasSubstr("5000")));
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

// Dtypes safetensors defines with elements of fewer than 8 bits are held
// packed: the entry's shape counts values, cairn's counts whole elements.
TEST(SafetensorsTest, SubByteDTypesAreHeldPacked) {
  struct Case {
    const char* dtype;
    DType packed;
    const char* shape;  // values
    uint64_t bytes;
    Shape held;
  };
  for (const Case& c :
       {Case{"F4", DType::kF4_X2, "[3,8]", 12, {3, 4}},
        Case{"F6_E2M3", DType::kF6_E2M3_X4, "[2,8]", 12, {2, 2}},
        Case{"F6_E3M2", DType::kF6_E3M2_X4, "[4]", 3, {1}}}) {
    SCOPED_TRACE(c.dtype);
    const std::string text = absl::StrCat(
        R"({"w":{"dtype":")", c.dtype, R"(","shape":)", c.shape,
        R"(,"data_offsets":[0,)", c.bytes, "]}}");
    absl::StatusOr<SafetensorsHeader> header = ParseHeaderText(text, c.bytes);
    ASSERT_TRUE(header.ok()) << header.status();
    ASSERT_EQ(header->entries.size(), 1u);
    EXPECT_EQ(header->entries[0].dtype, c.packed);
    EXPECT_EQ(header->entries[0].shape, c.held);
    // The tree parse agrees, and encoding gives safetensors' form back.
    absl::StatusOr<SafetensorsHeader> tree =
        ParseSafetensorsHeaderTree(text, 8 + text.size() + c.bytes, "f");
    ASSERT_TRUE(tree.ok()) << tree.status();
    EXPECT_EQ(tree->entries, header->entries);
    const std::string encoded = EncodeSafetensorsHeader(header->entries, {}, 1);
    EXPECT_THAT(encoded, HasSubstr(absl::StrCat(R"("dtype":")", c.dtype,
                                                R"(","shape":)", c.shape)));
  }
}

// A packed entry whose last dimension does not split into whole elements
// (or that has none): valid safetensors cairn cannot hold, so
// kUnimplemented naming the entry and the packed dtype, not kDataLoss.
TEST(SafetensorsTest, SubByteEntriesThatDoNotPackAreUnimplemented) {
  struct Case {
    const char* dtype;
    const char* shape;
    uint64_t bytes;
    const char* packed;
  };
  for (const Case& c : {Case{"F4", "[3]", 2, "F4_X2"},
                        Case{"F4", "[]", 1, "F4_X2"},
                        Case{"F6_E2M3", "[2,6]", 9, "F6_E2M3_X4"},
                        Case{"F6_E3M2", "[2]", 2, "F6_E3M2_X4"}}) {
    SCOPED_TRACE(absl::StrCat(c.dtype, c.shape));
    auto status = ParseHeaderText(
                      absl::StrCat(R"({"w":{"dtype":")", c.dtype,
                                   R"(","shape":)", c.shape,
                                   R"(,"data_offsets":[0,)", c.bytes, "]}}"),
                      c.bytes)
                      .status();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("\"w\""));
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.packed));
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

// A key twice in one object, anywhere in the header: nlohmann's tree keeps
// the last, so the tree parse (which the fast one leaves such text to)
// refuses it, naming the key.
TEST(SafetensorsTest, DuplicateKeysAreRejected) {
  const std::string a = R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]})";
  for (const auto& [text, key] : std::vector<std::pair<std::string, std::string>>{
           {"{" + a + "," + a + "}", "a"},
           {R"({"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
            "dtype"},
           {"{" + a + R"(,"__metadata__":{"k":"v","k":"w"}})", "k"}}) {
    SCOPED_TRACE(text);
    ExpectDataLoss(ParseHeaderText(text, 2).status(),
                   "the key \"" + key + "\" appears twice");
  }
}

// EntryMismatch: what metadata.json says lies at an offset against the
// entry the header lists there (the load's and verify's check).
TEST(SafetensorsTest, EntryMismatchComparesNameDTypeShapeAndBytes) {
  absl::StatusOr<SafetensorsHeader> header = ParseHeaderText(
      R"({"w@0,0":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      R"("empty":{"dtype":"F32","shape":[0,3],"data_offsets":[24,24]},)"
      R"("rng":{"dtype":"U8","shape":[5],"data_offsets":[24,29]}})",
      29);
  ASSERT_TRUE(header.ok()) << header.status();
  const uint64_t start = header->data_start;
  const std::vector<int64_t> box = {2, 3}, empty = {0, 3}, rng = {5};
  EXPECT_EQ(EntryMismatch(*header, {"w@0,0", DType::kF32, box, start, 24}), "");
  EXPECT_EQ(EntryMismatch(*header, {"rng", DType::kU8, rng, start + 24, 5}), "");
  // A zero-length entry shares its offset with the next one: found by name.
  EXPECT_EQ(
      EntryMismatch(*header, {"empty", DType::kF32, empty, start + 24, 0}), "");
  EXPECT_EQ(EntryMismatch(*header, {"v@0,0", DType::kF32, box, start, 24}),
            "its safetensors entry there is named 'w@0,0', expected 'v@0,0'");
  EXPECT_EQ(EntryMismatch(*header, {"w@0,0", DType::kI32, box, start, 24}),
            "its safetensors entry 'w@0,0' is F32 [2, 3], expected I32 [2, 3]");
  const std::vector<int64_t> other = {3, 2};
  EXPECT_EQ(EntryMismatch(*header, {"w@0,0", DType::kF32, other, start, 24}),
            "its safetensors entry 'w@0,0' is F32 [2, 3], expected F32 [3, 2]");
  const std::vector<int64_t> row = {1, 3};
  EXPECT_EQ(EntryMismatch(*header, {"w@0,0", DType::kF32, row, start, 12}),
            "its safetensors entry 'w@0,0' there is 24 bytes");
  EXPECT_EQ(EntryMismatch(*header, {"w@0,0", DType::kF32, box, start + 4, 24}),
            "its safetensors header lists no entry at that offset");
  EXPECT_THAT(EntryMismatch(*header, {"w@0,0", DType::kF32, box, 8, 24}),
              HasSubstr("lies in the safetensors header"));
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
