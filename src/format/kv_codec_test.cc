// Key-value tables in metadata.json (format version 4): their text, their
// decoding as untrusted input by both decoders, and the checks that look
// across the metadata (one leaf or table per FQN, file sizes, shared
// bytes).
#include "format/kv_codec.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/kv_table.h"
#include "cairn/metadata.h"
#include "format/crc32c.h"
#include "format/metadata_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace cairn::internal_format {
namespace {

using ::nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kSource[] = "/ckpt/step-7/metadata.json";
constexpr char kFile[] = "data-00000-abc.safetensors";

// A BF16 and an F32 column of `width` elements, and an I64 one.
std::vector<KvColumn> Columns(int64_t width) {
  return {{"weight", DType::kBF16, width},
          {"adam.m", DType::kF32, width},
          {"step", DType::kI64, 1}};
}

// A table holding buckets `held` of `num_buckets`, with rows_per_bucket
// given, stored in chunks of at most `chunk_rows` rows back to back in
// `file` from `offset` (ids, then each column), with block checksums of
// `block_bytes` (0: none) for locations longer than one block.
KvTableMetadata Table(KvBucketing bucketing, int64_t num_buckets,
                      KvBucketRange held, std::vector<uint64_t> rows_per_bucket,
                      uint64_t chunk_rows, int64_t width = 4,
                      uint64_t block_bytes = 0,
                      const std::string& file = kFile, uint64_t offset = 4096) {
  KvTableMetadata t;
  t.spec.num_buckets = num_buckets;
  t.spec.bucketing = bucketing;
  t.spec.bucket_size = bucketing == KvBucketing::kChunked ? 1000 : 0;
  t.spec.columns = Columns(width);
  t.buckets = held;
  t.rows_per_bucket = std::move(rows_per_bucket);
  uint32_t crc = 0x10203040;
  auto location = [&](uint64_t nbytes) {
    ByteLocation loc{file, offset, nbytes, crc++, {}};
    if (block_bytes > 0 && nbytes > block_bytes) {
      for (uint64_t b = 0; b < Crc32cBlockCount(nbytes, block_bytes); ++b) {
        loc.block_crc32c.push_back(crc++);
      }
    }
    offset += nbytes;
    return loc;
  };
  const uint64_t rows = t.rows();
  for (uint64_t begin = 0; begin < rows; begin += chunk_rows) {
    KvChunkMetadata c;
    c.rows = {begin, std::min(rows, begin + chunk_rows)};
    const uint64_t n = c.rows.size();
    c.ids = location(n * 8);
    for (const KvColumn& col : t.spec.columns) {
      c.columns.push_back(
          location(n * static_cast<uint64_t>(col.width) * DTypeSize(col.dtype)));
    }
    t.chunks.push_back(std::move(c));
  }
  return t;
}

// A tensor, an object, a scalar and the table "emb" (8 chunked buckets, all
// held, 13 rows in chunks of 5) in one metadata.
Metadata Sample() {
  Metadata md;
  md.created_by = "cairn 0.1.0";
  md.world_size = 2;
  TensorMetadata w;
  w.dtype = DType::kF32;
  w.shape = {2, 2};
  w.chunks.push_back({Box::Full(w.shape),
                      ByteLocation{"data-00001-abc.safetensors", 4096, 16, 9}});
  md.tensors["model.w"] = w;
  md.objects["rng"] = {"data-00001-abc.safetensors", 4112, 5, 7, {}};
  md.scalars["step"] = int64_t{7};
  md.kv_tables["emb"] = Table(KvBucketing::kChunked, 8, {0, 8},
                              {2, 0, 3, 1, 0, 4, 2, 1}, 5);
  return md;
}

std::string Encoded(const Metadata& md) {
  absl::StatusOr<std::string> text = EncodeMetadata(md);
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? *text : std::string();
}

std::string Resealed(const std::string& text) {
  if (!text.starts_with(kChecksumKeyPrefix) ||
      text.size() < kChecksumPrefixBytes) {
    return text;
  }
  return WithMetadataChecksum(text).value_or(text);
}

// Both decoders give the same Metadata or the same error.
void ExpectSameAsTree(const std::string& damaged) {
  const std::string text = Resealed(damaged);
  absl::StatusOr<Metadata> fast = DecodeMetadata(text, kSource);
  absl::StatusOr<Metadata> tree =
      DecodeMetadataWithTreeForTesting(text, kSource);
  ASSERT_EQ(fast.ok(), tree.ok()) << text << "\nfast: " << fast.status()
                                  << "\ntree: " << tree.status();
  if (fast.ok()) {
    EXPECT_TRUE(*fast == *tree) << text;
  } else {
    EXPECT_EQ(fast.status(), tree.status()) << text;
  }
}

// Encodes, decodes with both decoders, and checks the bytes are nlohmann's
// dump of the document.
void ExpectRoundTrip(const Metadata& md) {
  const std::string text = Encoded(md);
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(json::parse(text).dump() + "\n", text);
  absl::StatusOr<Metadata> back = DecodeMetadata(text, kSource);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, md);
  absl::StatusOr<Metadata> tree =
      DecodeMetadataWithTreeForTesting(text, kSource);
  ASSERT_TRUE(tree.ok()) << tree.status();
  EXPECT_EQ(*tree, md);
  // Its locations pass the checks a load makes of them.
  EXPECT_TRUE(ValidateDisjointLocations(md).ok()) << ValidateDisjointLocations(md);
}

// The sample's JSON, changed by `edit`, resealed, decoded (both decoders
// must agree).
absl::StatusOr<Metadata> DecodeEdited(const std::function<void(json&)>& edit,
                                      const Metadata& md = Sample()) {
  json j = json::parse(Encoded(md));
  j.erase("checksum");
  edit(j);
  const std::string text = WithMetadataChecksum(j.dump()).value();
  ExpectSameAsTree(text);
  return DecodeMetadata(text, kSource);
}

json& Emb(json& j) { return j["kv_tables"]["emb"]; }
json& Chunk(json& j, size_t k) { return Emb(j)["chunks"][k]; }

// ------------------------------------------------------------ the text

// The exact text of a small table: keys sorted, the columns in spec order,
// each location as a tensor chunk's, "kv_tables" between "format" and
// "objects".
TEST(KvCodecTest, TextOfATable) {
  Metadata md;
  md.crc32c_block_bytes = 4096;
  KvTableMetadata t;
  t.spec = {4, KvBucketing::kChunked, 100, {{"w", DType::kBF16, 2}}};
  t.buckets = {1, 3};
  t.rows_per_bucket = {2, 1};
  KvChunkMetadata c;
  c.rows = {0, 3};
  c.ids = {"d.safetensors", 4096, 24, 0xabcdef01, {}};
  c.columns = {{"d.safetensors", 4120, 12, 0x12, {}}};
  t.chunks = {c};
  md.kv_tables["e"] = t;
  const std::string text = Encoded(md);
  EXPECT_THAT(
      text,
      HasSubstr(
          R"("format":"cairn","kv_tables":{"e":{"bucket_size":100,)"
          R"("bucketing":"chunked","buckets":[1,3],"chunks":[{"columns":[)"
          R"({"crc32c":"00000012","file":"d.safetensors","nbytes":12,)"
          R"("offset":4120}],"ids":{"crc32c":"abcdef01","file":"d.safetensors",)"
          R"("nbytes":24,"offset":4096},"rows":[0,3]}],"columns":[{"dtype":)"
          R"("BF16","name":"w","width":2}],"key_dtype":"I64","num_buckets":4,)"
          R"("rows_per_bucket":[2,1]}},"objects":{})"));
  // Interleaved bucketing has no bucket size.
  md.kv_tables["e"].spec.bucketing = KvBucketing::kInterleaved;
  md.kv_tables["e"].spec.bucket_size = 0;
  EXPECT_THAT(Encoded(md),
              HasSubstr(R"("kv_tables":{"e":{"bucketing":"interleaved",)"));
  ExpectRoundTrip(md);
  // No tables: no member (and a version 3 text is as before).
  md.kv_tables.clear();
  EXPECT_THAT(Encoded(md), Not(HasSubstr("kv_tables")));
  md.version = 3;
  EXPECT_THAT(Encoded(md), Not(HasSubstr("kv_tables")));
  ExpectRoundTrip(md);
}

TEST(KvCodecTest, RoundTrips) {
  for (KvBucketing bucketing :
       {KvBucketing::kChunked, KvBucketing::kInterleaved}) {
    for (uint64_t block_bytes : {uint64_t{0}, uint64_t{4096}}) {
      SCOPED_TRACE(absl::StrCat(static_cast<int>(bucketing), " ", block_bytes));
      Metadata md = Sample();
      md.crc32c_block_bytes = block_bytes == 0 ? kDefaultCrc32cBlockBytes
                                               : block_bytes;
      // Global: every bucket, rows in chunks of 100 (columns of 100 x 128 x
      // 4 bytes: several blocks of 4096).
      md.kv_tables["emb"] = Table(bucketing, 8, {0, 8},
                                  {30, 0, 50, 10, 0, 40, 70, 20}, 100, 128,
                                  block_bytes);
      // Rank-local-style: buckets [3, 6) of 7, in one chunk, in another
      // file; and a table with no rows (and so no chunks).
      md.kv_tables["emb.item"] =
          Table(bucketing, 7, {3, 6}, {4, 0, 9}, 1000, 8, block_bytes,
                "rank-00001/data-00001-abc.safetensors", 1 << 20);
      md.kv_tables["empty"] = Table(bucketing, 3, {0, 3}, {0, 0, 0}, 10);
      md.kv_tables["none held"] = Table(bucketing, 3, {2, 2}, {}, 10);
      ASSERT_EQ(md.kv_tables["empty"].chunks.size(), 0u);
      bool blocks = false;
      for (const KvChunkMetadata& c : md.kv_tables["emb"].chunks) {
        blocks |= !c.columns[1].block_crc32c.empty();
      }
      EXPECT_EQ(blocks, block_bytes != 0);
      ExpectRoundTrip(md);
      md.rank = 1;
      ExpectRoundTrip(md);
    }
  }
}

// Names that need escaping, or that are not ASCII, are written as nlohmann
// writes them; the fast decoder leaves such text to the tree decoder.
TEST(KvCodecTest, NamesThatNeedEscapingRoundTrip) {
  Metadata md = Sample();
  KvTableMetadata t = Table(KvBucketing::kInterleaved, 2, {0, 2}, {3, 4}, 4,
                            2, 0, "data-00002-abc.safetensors");
  t.spec.columns[0].name = "wéight \"q\"\t\\";
  md.kv_tables["caf\xc3\xa9 \"tab\"\n"] = t;
  ExpectRoundTrip(md);
  ExpectSameAsTree(Encoded(md));
}

// The member may come anywhere, with any whitespace (the tree decoder
// decides, with the same result).
TEST(KvCodecTest, OtherLayoutsDecodeTheSame) {
  const Metadata md = Sample();
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(Encoded(md));
  j.erase("checksum");
  nlohmann::ordered_json moved;
  moved["kv_tables"] = j["kv_tables"];
  for (auto& [key, value] : j.items()) {
    if (key != "kv_tables") moved[key] = value;
  }
  for (const std::string& text : {moved.dump(), moved.dump(2)}) {
    const std::string sealed = WithMetadataChecksum(text).value();
    ExpectSameAsTree(sealed);
    absl::StatusOr<Metadata> back = DecodeMetadata(sealed, kSource);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, md);
  }
}

// ------------------------------------------------------------ bad input

TEST(KvCodecTest, BadTablesAreDataLossNamingTheTable) {
  struct Case {
    const char* name;
    std::function<void(json&)> edit;
    std::string mention;
  };
  const std::vector<Case> cases = {
      {"not an object", [](json& j) { Emb(j) = json::array(); },
       "must be an object"},
      {"key_dtype missing", [](json& j) { Emb(j).erase("key_dtype"); },
       "missing \"key_dtype\""},
      {"key_dtype I32", [](json& j) { Emb(j)["key_dtype"] = "I32"; },
       "\"key_dtype\" must be \"I64\", got \"I32\""},
      {"key_dtype a number", [](json& j) { Emb(j)["key_dtype"] = 8; },
       "\"key_dtype\" must be a string"},
      {"num_buckets a string", [](json& j) { Emb(j)["num_buckets"] = "8"; },
       "\"num_buckets\" must be an integer"},
      {"num_buckets negative", [](json& j) { Emb(j)["num_buckets"] = -8; },
       "\"num_buckets\" must be an integer"},
      {"num_buckets a fraction", [](json& j) { Emb(j)["num_buckets"] = 8.5; },
       "\"num_buckets\" must be an integer"},
      {"num_buckets 2^63",
       [](json& j) {
         Emb(j)["num_buckets"] = json::parse("9223372036854775808");
       },
       "\"num_buckets\" must be an integer in [0, 2^63)"},
      {"num_buckets 2^64",
       [](json& j) {
         Emb(j)["num_buckets"] = json::parse("18446744073709551616");
       },
       "\"num_buckets\""},
      {"no buckets", [](json& j) { Emb(j)["num_buckets"] = 0; },
       "0 buckets"},
      {"unknown bucketing", [](json& j) { Emb(j)["bucketing"] = "hashed"; },
       "unknown bucketing \"hashed\""},
      {"bucketing a number", [](json& j) { Emb(j)["bucketing"] = 0; },
       "\"bucketing\" must be a string"},
      {"bucket_size missing", [](json& j) { Emb(j).erase("bucket_size"); },
       "missing \"bucket_size\""},
      {"bucket_size negative", [](json& j) { Emb(j)["bucket_size"] = -1; },
       "\"bucket_size\""},
      {"bucket_size zero", [](json& j) { Emb(j)["bucket_size"] = 0; },
       "positive bucket size"},
      {"bucket_size overflowing the ids",
       [](json& j) { Emb(j)["bucket_size"] = int64_t{1} << 62; },
       "overflow the id space"},
      {"bucket_size on interleaved",
       [](json& j) { Emb(j)["bucketing"] = "interleaved"; },
       "\"bucket_size\" is only for chunked bucketing"},
      {"buckets one number", [](json& j) { Emb(j)["buckets"] = {0}; },
       "\"buckets\" must be [begin, end]"},
      {"buckets a string", [](json& j) { Emb(j)["buckets"] = "0-8"; },
       "\"buckets\" must be an array"},
      {"buckets negative", [](json& j) { Emb(j)["buckets"] = {-1, 8}; },
       "\"buckets\" must be an integer"},
      {"buckets past B", [](json& j) { Emb(j)["buckets"] = {0, 9}; },
       "holds buckets [0, 9), not a range of the 8 buckets"},
      {"buckets reversed", [](json& j) { Emb(j)["buckets"] = {5, 4}; },
       "holds buckets [5, 4)"},
      {"a row count missing",
       [](json& j) { Emb(j)["rows_per_bucket"].erase(7); },
       "7 row counts for the 8 buckets [0, 8)"},
      {"a row count too many",
       [](json& j) { Emb(j)["rows_per_bucket"].push_back(0); },
       "9 row counts for the 8 buckets"},
      {"a row count negative",
       [](json& j) { Emb(j)["rows_per_bucket"][1] = -1; },
       "\"rows_per_bucket\" must be an integer"},
      {"a row count huge",
       [](json& j) {
         Emb(j)["rows_per_bucket"][1] = json::parse("18446744073709551615");
       },
       "\"rows_per_bucket\" must be an integer"},
      {"row counts overflowing",
       [](json& j) {
         Emb(j)["rows_per_bucket"][1] = json::parse("9223372036854775807");
       },
       "the row counts overflow"},
      {"rows_per_bucket an object",
       [](json& j) { Emb(j)["rows_per_bucket"] = json::object(); },
       "\"rows_per_bucket\" must be an array"},
      {"columns missing", [](json& j) { Emb(j).erase("columns"); },
       "missing \"columns\""},
      {"no columns", [](json& j) { Emb(j)["columns"] = json::array(); },
       "columns"},
      {"a column not an object",
       [](json& j) { Emb(j)["columns"][1] = "adam.m"; },
       "column 1: must be an object"},
      {"unknown column dtype",
       [](json& j) { Emb(j)["columns"][0]["dtype"] = "F128"; },
       "column 0: unknown dtype \"F128\""},
      {"column dtype in lower case",
       [](json& j) { Emb(j)["columns"][0]["dtype"] = "bf16"; },
       "unknown dtype \"bf16\""},
      {"column width zero",
       [](json& j) { Emb(j)["columns"][2]["width"] = 0; },
       "column \"step\" has width 0"},
      {"column width negative",
       [](json& j) { Emb(j)["columns"][2]["width"] = -1; },
       "column 2: \"width\" must be an integer"},
      {"column width huge",
       [](json& j) { Emb(j)["columns"][2]["width"] = int64_t{1} << 40; },
       "has width 1099511627776"},
      {"column without a name",
       [](json& j) { Emb(j)["columns"][0].erase("name"); },
       "column 0: missing \"name\""},
      {"two columns of one name",
       [](json& j) { Emb(j)["columns"][1]["name"] = "weight"; },
       "two columns named \"weight\""},
      {"a column named ids",
       [](json& j) { Emb(j)["columns"][1]["name"] = "ids"; },
       "column 1: a column may not be named \"ids\""},
      {"chunks missing", [](json& j) { Emb(j).erase("chunks"); },
       "missing \"chunks\""},
      {"a chunk not an object", [](json& j) { Chunk(j, 1) = 5; },
       "chunk 1: must be an object"},
      {"chunk rows one number", [](json& j) { Chunk(j, 1)["rows"] = {5}; },
       "chunk 1: \"rows\" must be [begin, end]"},
      {"chunk rows negative", [](json& j) { Chunk(j, 0)["rows"] = {-1, 5}; },
       "chunk 0: \"rows\" must be an integer"},
      {"chunk tiling gap", [](json& j) { Chunk(j, 1)["rows"] = {6, 10}; },
       "chunk 1 (rows [6, 10)): starts at row 6, but the chunks before end "
       "at row 5"},
      {"chunk tiling overlap", [](json& j) { Chunk(j, 1)["rows"] = {4, 10}; },
       "chunk 1 (rows [4, 10)): starts at row 4"},
      {"chunks short of the rows",
       [](json& j) { Emb(j)["chunks"].erase(2); },
       "the chunks hold rows [0, 10) of 13"},
      {"chunks past the rows",
       [](json& j) { Emb(j)["rows_per_bucket"][0] = 1; },
       "not a non-empty range of the 12 rows"},
      {"a chunk's column missing",
       [](json& j) { Chunk(j, 2)["columns"].erase(1); },
       "chunk 2: 2 column locations, the table has 3 columns"},
      {"a chunk's columns not an array",
       [](json& j) { Chunk(j, 2)["columns"] = json::object(); },
       "chunk 2: \"columns\" must be an array"},
      {"ids missing", [](json& j) { Chunk(j, 0).erase("ids"); },
       "chunk 0: missing \"ids\""},
      {"ids not an object", [](json& j) { Chunk(j, 0)["ids"] = 1; },
       "chunk 0 ids: must be an object"},
      {"ids nbytes off", [](json& j) { Chunk(j, 0)["ids"]["nbytes"] = 32; },
       "chunk 0 (rows [0, 5)): its ids take 32 bytes, not 40"},
      {"column nbytes off",
       [](json& j) { Chunk(j, 2)["columns"][0]["nbytes"] = 1; },
       "column \"weight\" takes 1 bytes, not 24"},
      {"ids file with ..",
       [](json& j) { Chunk(j, 1)["ids"]["file"] = "../secret"; },
       "chunk 1 ids: unsafe file name \"../secret\""},
      {"column file absolute",
       [](json& j) { Chunk(j, 1)["columns"][2]["file"] = "/etc/passwd"; },
       "chunk 1 column \"step\": unsafe file name"},
      {"a column in another file",
       [](json& j) { Chunk(j, 1)["columns"][2]["file"] = "other"; },
       "column \"step\" is in other"},
      {"a bad crc32c",
       [](json& j) { Chunk(j, 0)["columns"][1]["crc32c"] = "xyz"; },
       "chunk 0 column \"adam.m\""},
      {"offset + nbytes overflowing",
       [](json& j) {
         Chunk(j, 0)["ids"]["offset"] = json::parse("18446744073709551615");
       },
       "chunk 0 ids: offset 18446744073709551615 + nbytes 40 overflows"},
      {"nbytes negative",
       [](json& j) { Chunk(j, 0)["ids"]["nbytes"] = -40; },
       "chunk 0 ids: \"nbytes\""},
      {"block checksums on one block",
       [](json& j) { Chunk(j, 0)["ids"]["crc32c_blocks"] = "00000001"; },
       "chunk 0 ids: \"crc32c_blocks\" has 1 checksums"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::Status s = DecodeEdited(c.edit).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(kSource));
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("key-value table \"emb\""));
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.mention));
  }
}

TEST(KvCodecTest, BadKvTablesMember) {
  absl::Status s =
      DecodeEdited([](json& j) { j["kv_tables"] = json::array(); }).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("\"kv_tables\" must be an object"));
  // Tables need version 4; a version 3 text with the member (even empty)
  // is damaged or not cairn's.
  for (bool empty : {false, true}) {
    s = DecodeEdited([&](json& j) {
          j["version"] = 3;
          if (empty) j["kv_tables"] = json::object();
        }).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(kSource));
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("\"kv_tables\" needs format version 4 or later; "
                          "this metadata is version 3"));
  }
  // An empty member in version 4 is no table.
  absl::StatusOr<Metadata> back = DecodeEdited(
      [](json& j) { j["kv_tables"] = json::object(); });
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->kv_tables.empty());
}

// An FQN names one tensor, object, scalar or table.
TEST(KvCodecTest, ATableFqnOfAnotherLeafIsRejected) {
  for (const char* member : {"tensors", "objects", "scalars"}) {
    SCOPED_TRACE(member);
    const std::string fqn = std::string(member) == "tensors" ? "model.w"
                            : std::string(member) == "objects" ? "rng"
                                                               : "step";
    absl::Status s = DecodeEdited([&](json& j) {
                       j["kv_tables"][fqn] = j["kv_tables"]["emb"];
                     }).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(kSource));
    EXPECT_THAT(std::string(s.message()),
                HasSubstr(absl::StrCat("\"", fqn, "\" is in both \"", member,
                                       "\" and \"kv_tables\"")));
    // The encoder refuses to write it.
    Metadata md = Sample();
    md.kv_tables[fqn] = md.kv_tables["emb"];
    EXPECT_EQ(EncodeMetadata(md).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(CheckEncodable(md).code(), absl::StatusCode::kInvalidArgument);
  }
}

// Sizes that only match modulo 2^64 (2^61 + 1 rows in 8 bytes) are caught.
TEST(KvCodecTest, WrappedSizesAreRejected) {
  absl::Status s = DecodeEdited([](json& j) {
                     const uint64_t n = (uint64_t{1} << 61) + 1;
                     Emb(j)["rows_per_bucket"] = {n, 0, 0, 0, 0, 0, 0, 0};
                     Emb(j)["chunks"].erase(1);
                     Emb(j)["chunks"].erase(1);
                     Chunk(j, 0)["rows"] = {0, n};
                     Chunk(j, 0)["ids"]["nbytes"] = 8;
                   }).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("key-value table \"emb\""));
  EXPECT_THAT(std::string(s.message()), HasSubstr("overflow"));
}

// Damaged text gives the same verdict from both decoders, never a crash.
TEST(KvCodecTest, CorruptionsDecodeAlikeInBothDecoders) {
  Metadata md;
  md.kv_tables["e"] = Table(KvBucketing::kInterleaved, 3, {0, 3}, {1, 2, 1}, 2,
                            1);
  const std::string text = Encoded(md);
  const size_t from = text.find("\"kv_tables\"");
  const size_t to = text.find("\"objects\"");
  ASSERT_NE(from, std::string::npos);
  const char kBytes[] = {'\0', '"', '{', '}', '[', ']', ',', ':', '9', '-',
                         ' ',  'x'};
  for (size_t i = from; i < to; ++i) {
    for (char b : kBytes) {
      std::string t = text;
      t[i] = b;
      ExpectSameAsTree(t);
    }
  }
  for (size_t n = from; n < to; n += 3) ExpectSameAsTree(text.substr(0, n));
}

// ------------------------------------------------------------ encoding

TEST(KvCodecTest, EncodeRefusesWhatAReaderRefuses) {
  struct Case {
    const char* name;
    std::function<void(Metadata&)> edit;
    std::string mention;
    bool check_encodable;  // CheckEncodable (names only) refuses it too
  };
  const std::vector<Case> cases = {
      {"version 3", [](Metadata& md) { md.version = 3; },
       "key-value tables need format version 4", true},
      {"a gap",
       [](Metadata& md) { md.kv_tables["emb"].chunks[1].rows.begin = 6; },
       "starts at row 6", false},
      {"a column named ids",
       [](Metadata& md) { md.kv_tables["emb"].spec.columns[2].name = "ids"; },
       "a column is named \"ids\"", true},
      {"a column name not UTF-8",
       [](Metadata& md) {
         md.kv_tables["emb"].spec.columns[2].name = "st\xffp";
       },
       "not valid UTF-8", true},
      {"a table name not UTF-8",
       [](Metadata& md) { md.kv_tables["e\xfe"] = md.kv_tables["emb"]; },
       "not valid UTF-8", true},
      {"a file name not UTF-8",
       [](Metadata& md) {
         for (ByteLocation& c : md.kv_tables["emb"].chunks[1].columns) {
           c.file = "d\xff";
         }
         md.kv_tables["emb"].chunks[1].ids.file = "d\xff";
       },
       "not valid UTF-8", false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Metadata md = Sample();
    c.edit(md);
    absl::StatusOr<std::string> text = EncodeMetadata(md);
    EXPECT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(text.status().message()), HasSubstr(c.mention));
    EXPECT_EQ(CheckEncodable(md).code(),
              c.check_encodable ? absl::StatusCode::kInvalidArgument
                                : absl::StatusCode::kOk);
  }
  EXPECT_TRUE(CheckEncodable(Sample()).ok());
}

// ------------------------------------------------------------ validators

TEST(KvCodecTest, AgainstFileSizes) {
  const Metadata md = Sample();
  const KvChunkMetadata& last = md.kv_tables.at("emb").chunks.back();
  const uint64_t end = last.columns.back().offset + last.columns.back().nbytes;
  std::map<std::string, uint64_t> sizes = {
      {"data-00001-abc.safetensors", 4117}, {kFile, end}};
  EXPECT_TRUE(ValidateAgainstFileSizes(md, sizes).ok());
  sizes[kFile] = end - 1;
  absl::Status s = ValidateAgainstFileSizes(md, sizes);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("key-value table \"emb\" chunk 2 column \"step\" (" +
                        std::string(kFile) + ", offset"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("runs past the end"));
  // The ids too.
  Metadata ids = md;
  ids.kv_tables["emb"].chunks[0].ids.offset = end;
  sizes[kFile] = end;
  s = ValidateAgainstFileSizes(ids, sizes);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("key-value table \"emb\" chunk 0 ids"));
  // A file the metadata names but storage does not have.
  sizes.erase(kFile);
  s = ValidateAgainstFileSizes(md, sizes);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("key-value table \"emb\""));
}

TEST(KvCodecTest, DisjointLocations) {
  Metadata md = Sample();
  EXPECT_TRUE(ValidateDisjointLocations(md).ok());
  // Two entries of one table sharing a byte.
  Metadata shared = md;
  KvChunkMetadata& c = shared.kv_tables["emb"].chunks[1];
  c.columns[0].offset = c.ids.offset + c.ids.nbytes - 1;
  absl::Status s = ValidateDisjointLocations(shared);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("key-value table \"emb\" chunk 1 column \"weight\""));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("key-value table \"emb\" chunk 1 ids"));
  // A table's entry over a tensor's chunk.
  shared = md;
  shared.kv_tables["emb"].chunks[0].ids.file = "data-00001-abc.safetensors";
  for (ByteLocation& col : shared.kv_tables["emb"].chunks[0].columns) {
    col.file = "data-00001-abc.safetensors";
  }
  s = ValidateDisjointLocations(shared);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("chunk \"model.w\""));
  EXPECT_THAT(std::string(s.message()), HasSubstr("key-value table \"emb\""));
  // Two tables in one place.
  shared = md;
  shared.kv_tables["emb2"] = md.kv_tables["emb"];
  s = ValidateDisjointLocations(shared);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("\"emb2\""));
}

TEST(KvCodecTest, TotalBytesCountTables) {
  const Metadata md = Sample();
  const KvTableMetadata& t = md.kv_tables.at("emb");
  EXPECT_EQ(t.rows(), 13u);
  EXPECT_EQ(t.nbytes(), 13u * (8 + 4 * 2 + 4 * 4 + 8));
  EXPECT_EQ(md.total_bytes(), 16u + 5u + t.nbytes());
}

}  // namespace
}  // namespace cairn::internal_format
