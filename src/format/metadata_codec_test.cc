#include "format/metadata_codec.h"

#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "format/crc32c.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace cairn::internal_format {
namespace {

using ::nlohmann::json;
using ::testing::HasSubstr;

constexpr char kSource[] = "/ckpt/step-100/metadata.json";

// A tensor of `shape` split along dim 0 into `parts` chunks stored back to
// back in `file` from `offset`.
TensorMetadata RowSharded(DType dtype, Shape shape, int parts,
                          const std::string& file, uint64_t offset = 4096) {
  TensorMetadata t;
  t.dtype = dtype;
  t.shape = shape;
  const int64_t rows = shape[0];
  int64_t row = 0;
  for (int p = 0; p < parts; ++p) {
    const int64_t n = rows / parts + (p < rows % parts ? 1 : 0);
    ChunkMetadata c;
    c.box.offsets.assign(shape.size(), 0);
    c.box.offsets[0] = row;
    c.box.sizes = shape;
    c.box.sizes[0] = n;
    c.location.file = file;
    c.location.offset = offset;
    c.location.nbytes =
        static_cast<uint64_t>(c.box.num_elements()) * DTypeSize(dtype);
    c.location.crc32c = 0x1c291ca3u + static_cast<uint32_t>(p);
    offset += c.location.nbytes;
    t.chunks.push_back(c);
    row += n;
  }
  return t;
}

Metadata SampleMetadata() {
  Metadata md;
  md.created_by = "cairn 0.1.0";
  md.world_size = 4;
  int i = 0;
  for (DType dtype : AllDTypes()) {
    md.tensors["t." + std::string(DTypeName(dtype))] = RowSharded(
        dtype, {6, 5}, 2, "data-0000" + std::to_string(i % 4) + ".safetensors");
    ++i;
  }
  md.tensors["model.wq"] =
      RowSharded(DType::kBF16, {4096, 4096}, 4, "data-00000.safetensors", 8192);
  TensorMetadata rank0;
  rank0.dtype = DType::kF64;
  rank0.chunks.push_back(
      {Box{{}, {}}, ByteLocation{"data-00001.safetensors", 4096, 8, 7, {}}});
  md.tensors["lr_tensor"] = rank0;
  TensorMetadata empty;
  empty.dtype = DType::kF32;
  empty.shape = {0, 3};
  empty.chunks.push_back(
      {Box{{0, 0}, {0, 3}}, ByteLocation{"data-00001.safetensors", 0, 0, 0, {}}});
  md.tensors["empty"] = empty;
  md.tensors["ünïcode.ключ"] =
      RowSharded(DType::kF32, {3}, 1, "rank-00003/data-00000.safetensors");

  md.objects["rng.rank3"] = {"data-00003.safetensors", 0, 5000, 0xdeadbeef, {}};
  md.objects["opt.pickle"] = {"data-00000.safetensors", 123, 0, 0, {}};

  md.scalars["step"] = int64_t{100};
  md.scalars["int.min"] = std::numeric_limits<int64_t>::min();
  md.scalars["int.max"] = std::numeric_limits<int64_t>::max();
  md.scalars["int.neg"] = int64_t{-5};
  md.scalars["lr"] = 0.1;
  md.scalars["third"] = 1.0 / 3.0;
  md.scalars["tiny"] = std::numeric_limits<double>::denorm_min();
  md.scalars["huge"] = std::numeric_limits<double>::max();
  md.scalars["whole"] = 5.0;
  md.scalars["neg_zero"] = -0.0;
  md.scalars["inf"] = std::numeric_limits<double>::infinity();
  md.scalars["ninf"] = -std::numeric_limits<double>::infinity();
  md.scalars["flag"] = true;
  md.scalars["off"] = false;
  md.scalars["name"] = std::string("run \"7\"\n\t\\ ✓");
  md.scalars["empty_string"] = std::string();

  md.structure = R"({"model":{"layers":[{"wq":"model.layers.0.wq"}]}})";
  md.user = R"({"git":"abc123","n":3,"tags":["a","b"]})";  // canonical
  return md;
}

std::string Encoded(const Metadata& md) {
  auto text = EncodeMetadata(md);
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? *text : std::string();
}

// The sample's JSON, changed by `edit`, decoded. The edited text gets a
// fresh checksum (when it is still an object with members), so that what
// is tested is the check of the edited field, not the checksum's.
absl::StatusOr<Metadata> DecodeEdited(const std::function<void(json&)>& edit) {
  json j = json::parse(Encoded(SampleMetadata()));
  j.erase("checksum");
  edit(j);
  std::string text = j.dump();
  if (j.is_object() && !j.empty()) {
    absl::StatusOr<std::string> sealed = WithMetadataChecksum(text);
    EXPECT_TRUE(sealed.ok()) << sealed.status();
    if (sealed.ok()) text = *std::move(sealed);
  }
  return DecodeMetadata(text, kSource);
}

// `text` with its checksum recomputed when it opens with one (a damaged or
// truncated text keeps its damage, and the decoder behind the checksum is
// what a test of it sees), else as it is.
std::string Resealed(const std::string& text) {
  if (!text.starts_with(kChecksumKeyPrefix) ||
      text.size() < kChecksumPrefixBytes) {
    return text;
  }
  absl::StatusOr<std::string> sealed = WithMetadataChecksum(text);
  EXPECT_TRUE(sealed.ok()) << sealed.status();
  return sealed.ok() ? *sealed : text;
}

// `j` (an encoding of version 2) as version 1 text, with no checksum: for
// tests of other layouts of the text than cairn's (indented, reordered).
json AsVersion1(json j) {
  j.erase("checksum");
  j["version"] = 1;
  return j;
}

void ExpectRejected(const absl::Status& status, const std::string& mention,
                    absl::StatusCode code = absl::StatusCode::kDataLoss) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(kSource)) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(mention)) << status;
}

json& Chunk0(json& j) { return j["tensors"]["model.wq"]["chunks"][0]; }

// ------------------------------------------------------------ round trip

TEST(MetadataCodecTest, RoundTripEveryDTypeAndScalarType) {
  const Metadata md = SampleMetadata();
  auto decoded = DecodeMetadata(Encoded(md), kSource);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, md);
  // -0.0 == 0.0 for operator==; check the sign survived.
  EXPECT_TRUE(std::signbit(std::get<double>(decoded->scalars.at("neg_zero"))));
  EXPECT_EQ(std::get<double>(decoded->scalars.at("whole")), 5.0);
  for (DType dtype : AllDTypes()) {
    EXPECT_EQ(decoded->tensors.at("t." + std::string(DTypeName(dtype))).dtype,
              dtype);
  }
}

TEST(MetadataCodecTest, NanRoundTrips) {
  Metadata md;
  md.scalars["nan"] = std::numeric_limits<double>::quiet_NaN();
  const std::string text = Encoded(md);
  EXPECT_THAT(text, HasSubstr(R"("double":"nan")"));
  auto decoded = DecodeMetadata(text, kSource);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_TRUE(std::isnan(std::get<double>(decoded->scalars.at("nan"))));
}

TEST(MetadataCodecTest, ScalarsAreTyped) {
  const std::string text = Encoded(SampleMetadata());
  EXPECT_THAT(text, HasSubstr(R"("step":{"int64":100})"));
  EXPECT_THAT(text, HasSubstr(R"("lr":{"double":0.1})"));
  EXPECT_THAT(text, HasSubstr(R"("whole":{"double":5.0})"));
  EXPECT_THAT(text, HasSubstr(R"("inf":{"double":"inf"})"));
  EXPECT_THAT(text, HasSubstr(R"("ninf":{"double":"-inf"})"));
  EXPECT_THAT(text, HasSubstr(R"("flag":{"bool":true})"));
  EXPECT_THAT(text, HasSubstr(R"("empty_string":{"string":""})"));
}

TEST(MetadataCodecTest, EncodingIsDeterministicAndFollowsTheSchema) {
  const std::string a = Encoded(SampleMetadata());
  EXPECT_EQ(a, Encoded(SampleMetadata()));
  json j = json::parse(a);
  EXPECT_EQ(j["format"], "cairn");
  EXPECT_EQ(j["version"], kFormatVersion);
  EXPECT_EQ(j["created_by"], "cairn 0.1.0");
  EXPECT_EQ(j["world_size"], 4);
  const json& c = Chunk0(j);
  EXPECT_EQ(c["offsets"], json::parse("[0,0]"));
  EXPECT_EQ(c["sizes"], json::parse("[1024,4096]"));
  EXPECT_EQ(c["file"], "data-00000.safetensors");
  EXPECT_EQ(c["offset"], 8192);
  EXPECT_EQ(c["nbytes"], 8388608);
  EXPECT_EQ(c["crc32c"], "1c291ca3");
  EXPECT_EQ(j["tensors"]["model.wq"]["dtype"], "BF16");
  EXPECT_EQ(j["objects"]["rng.rank3"]["crc32c"], "deadbeef");
  EXPECT_EQ(j["structure"]["model"]["layers"][0]["wq"], "model.layers.0.wq");
  EXPECT_EQ(j["user"]["git"], "abc123");
}

TEST(MetadataCodecTest, DefaultMetadataRoundTrips) {
  Metadata md;
  auto decoded = DecodeMetadata(Encoded(md), kSource);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, md);
}

TEST(MetadataCodecTest, StructureAndUserAreStoredCanonically) {
  Metadata md;
  md.structure = R"( {"b": "b", "a": ["a.0"]} )";
  md.user = R"({"z": 1, "a": {"y": 2, "x": 1}})";
  auto decoded = DecodeMetadata(Encoded(md), kSource);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->structure, R"({"a":["a.0"],"b":"b"})");
  EXPECT_EQ(decoded->user, R"({"a":{"x":1,"y":2},"z":1})");
}

// The example of docs/format.md section 8, verbatim (wrapped there; the
// file is the one line it wraps, which is byte for byte what cairn writes,
// checksum included).
TEST(MetadataCodecTest, DocsExampleDecodes) {
  const std::string wrapped = R"json(
{"checksum":"5d15454e","created_by":"cairn 0.1.0","format":"cairn",
 "objects":{"rng":{"crc32c":"5f0a33c1","file":"data-00001.safetensors","nbytes":16,"offset":4104}},
 "scalars":{"step":{"int64":100}},
 "structure":{"model":{"wq":"model.wq"},"rng":"rng","step":"step"},
 "tensors":{"model.wq":{"chunks":[
   {"crc32c":"1c291ca3","file":"data-00000.safetensors","nbytes":8,"offset":4096,"offsets":[0,0],"sizes":[1,4]},
   {"crc32c":"09a1f4e2","file":"data-00001.safetensors","nbytes":8,"offset":4096,"offsets":[1,0],"sizes":[1,4]}],
   "dtype":"BF16","shape":[2,4]}},
 "user":{},"version":2,"world_size":2}
)json";
  // Unwrapped: each line break and the indent after it removed.
  std::string example;
  for (size_t i = 0; i < wrapped.size(); ++i) {
    if (wrapped[i] != '\n') {
      example += wrapped[i];
      continue;
    }
    while (i + 1 < wrapped.size() && wrapped[i + 1] == ' ') ++i;
  }
  example += '\n';
  auto decoded = DecodeMetadata(example, kSource);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->world_size, 2);
  const TensorMetadata& wq = decoded->tensors.at("model.wq");
  EXPECT_TRUE(ValidateCoverage("model.wq", wq).ok());
  EXPECT_EQ(wq.chunks[1].location.crc32c, 0x09a1f4e2u);
  EXPECT_EQ(decoded->objects.at("rng").offset, 4104u);
  EXPECT_EQ(decoded->scalars.at("step"), Scalar(int64_t{100}));
  EXPECT_TRUE(
      ValidateAgainstFileSizes(*decoded, {{"data-00000.safetensors", 4104},
                                          {"data-00001.safetensors", 4120}})
          .ok());
  // Re-encoding gives the same bytes, checksum included.
  EXPECT_EQ(Encoded(*decoded), example);
}

TEST(MetadataCodecTest, EncodeRejectsBadInput) {
  Metadata md;
  md.structure = "{not json";
  EXPECT_EQ(EncodeMetadata(md).status().code(),
            absl::StatusCode::kInvalidArgument);
  md = Metadata();
  md.user = "[1, 2]";
  EXPECT_EQ(EncodeMetadata(md).status().code(),
            absl::StatusCode::kInvalidArgument);
  md = Metadata();
  md.scalars["bad\xff"] = int64_t{1};
  EXPECT_EQ(EncodeMetadata(md).status().code(),
            absl::StatusCode::kInvalidArgument);
  md = Metadata();
  md.version = kFormatVersion + 1;
  EXPECT_EQ(EncodeMetadata(md).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A metadata.json longer than a load accepts is never written: the save
// fails at commit instead of committing a checkpoint nobody can open.
TEST(MetadataCodecTest, EncodeRefusesTextLongerThanTheLimit) {
  const Metadata md = SampleMetadata();
  absl::StatusOr<std::string> text = EncodeMetadata(md);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_TRUE(EncodeMetadata(md, text->size()).ok());
  absl::StatusOr<std::string> over = EncodeMetadata(md, text->size() - 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(),
              HasSubstr(absl::StrCat("would be ", text->size(), " bytes")));
  EXPECT_THAT(over.status().message(), HasSubstr("a load accepts"));
}

// CheckEncodable refuses what EncodeMetadata refuses among the version,
// the structure, the user object and the names, and accepts what it
// encodes.
TEST(MetadataCodecTest, CheckEncodableAgreesWithEncode) {
  EXPECT_TRUE(CheckEncodable(SampleMetadata()).ok());
  std::vector<std::function<void(Metadata&)>> breaks = {
      [](Metadata& md) { md.version = kFormatVersion + 1; },
      [](Metadata& md) { md.structure = "{not json"; },
      [](Metadata& md) { md.user = "[1, 2]"; },
      [](Metadata& md) { md.created_by = "cairn \xff"; },
      [](Metadata& md) { md.tensors["w\xff"] = md.tensors.begin()->second; },
      [](Metadata& md) { md.objects["o\xc3"] = ByteLocation{}; },
      [](Metadata& md) { md.scalars["s\xfe"] = int64_t{1}; },
  };
  for (size_t i = 0; i < breaks.size(); ++i) {
    Metadata md = SampleMetadata();
    breaks[i](md);
    EXPECT_EQ(EncodeMetadata(md).status().code(),
              absl::StatusCode::kInvalidArgument) << i;
    EXPECT_EQ(CheckEncodable(md).code(), absl::StatusCode::kInvalidArgument)
        << i;
  }
}

TEST(MetadataCodecTest, UnknownFieldsAreIgnored) {
  auto decoded = DecodeEdited([](json& j) {
    j["future_top_level"] = {{"x", 1}};
    j["tensors"]["model.wq"]["layout"] = "tiled";
    Chunk0(j)["compression"] = "none";
    j["objects"]["rng.rank3"]["codec"] = 5;
  });
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, SampleMetadata());
}

// ------------------------------------------------------------ malformed JSON

TEST(MetadataCodecTest, MalformedJson) {
  for (const std::string& bad : std::vector<std::string>{
           "", "{", "{\"format\":\"cairn\",", "nope", "{}}", "[1,2",
           "{\"format\":\"cairn\" \"version\":1}", std::string("{\0}", 3),
           "\xff"}) {
    ExpectRejected(DecodeMetadata(bad, kSource).status(), "malformed");
  }
}

TEST(MetadataCodecTest, EveryTruncationIsRejected) {
  const std::string text = Encoded(SampleMetadata());
  // Stop before the closing brace; the trailing "}\n" cut still parses.
  for (size_t cut = 0; cut + 2 < text.size(); cut += 7) {
    auto status = DecodeMetadata(text.substr(0, cut), kSource).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << cut;
  }
}

TEST(MetadataCodecTest, DeepNestingIsRejectedWithoutCrashing) {
  const std::string deep = R"({"format":"cairn","version":1,"structure":)" +
                           std::string(200000, '[') + std::string(200000, ']') +
                           "}";
  ExpectRejected(DecodeMetadata(deep, kSource).status(), "malformed");
}

TEST(MetadataCodecTest, NotAnObject) {
  ExpectRejected(DecodeMetadata("[]", kSource).status(), "object");
  ExpectRejected(DecodeMetadata("\"cairn\"", kSource).status(), "object");
}

// ------------------------------------------------------------ checksum

void ExpectSameAsTree(const std::string& damaged);

// Version 2 opens with {"checksum":"xxxxxxxx", and the 8 hex digits are the
// CRC32C of every byte after them; version 1 has none.
TEST(MetadataCodecTest, ChecksumOpensTheTextAndCoversTheRest) {
  const std::string text = Encoded(SampleMetadata());
  ASSERT_TRUE(text.starts_with(kChecksumKeyPrefix)) << text.substr(0, 40);
  ASSERT_EQ(text.substr(kChecksumPrefixBytes - 2, 23),
            "\",\"crc32c_block_bytes\":");
  const std::string rest = text.substr(kChecksumPrefixBytes);
  EXPECT_EQ(text.substr(kChecksumKeyPrefix.size(), 8),
            Crc32cToHex(Crc32c(rest.data(), rest.size())));
  // Resealing a sealed text changes nothing.
  EXPECT_EQ(WithMetadataChecksum(text).value_or(""), text);
  // Version 1 is written without one, and decodes as version 1.
  Metadata v1 = SampleMetadata();
  v1.version = 1;
  const std::string old = Encoded(v1);
  EXPECT_TRUE(old.starts_with("{\"created_by\":")) << old.substr(0, 40);
  absl::StatusOr<Metadata> back = DecodeMetadata(old, kSource);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, v1);
  // A sealed text decodes to what was encoded, by both decoders.
  back = DecodeMetadata(text, kSource);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, SampleMetadata());
  ExpectSameAsTree(text);
}

// Any one flipped bit, anywhere in the file, is caught, whatever the byte
// it lands in (a digit of a scalar, a name, the checksum itself, the
// version, a brace): decoding fails with kDataLoss. Without the checksum a
// flip in a scalar's digits or in the user object loads silently.
TEST(MetadataCodecTest, EveryFlippedBitIsCaught) {
  Metadata md;
  md.world_size = 2;
  md.tensors["w"] = RowSharded(DType::kF32, {4, 3}, 2, "data-00000.safetensors");
  md.objects["o"] = {"data-00001.safetensors", 0, 3, 1, {}};
  md.scalars["step"] = int64_t{100};
  md.scalars["lr"] = 0.25;
  md.scalars["name"] = std::string("run-7");
  md.user = R"({"note":"x"})";
  const std::string text = Encoded(md);
  ASSERT_TRUE(DecodeMetadata(text, kSource).ok());
  int silent_without_checksum = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string t = text;
      t[i] = static_cast<char>(t[i] ^ (1 << bit));
      absl::StatusOr<Metadata> decoded = DecodeMetadata(t, kSource);
      ASSERT_EQ(decoded.status().code(), absl::StatusCode::kDataLoss)
          << "byte " << i << " ('" << text[i] << "') bit " << bit;
      EXPECT_THAT(std::string(decoded.status().message()), HasSubstr(kSource));
      // The same flip behind a fresh checksum: what version 1 would do.
      if (i >= kChecksumPrefixBytes && DecodeMetadata(Resealed(t), kSource).ok()) {
        ++silent_without_checksum;
      }
    }
  }
  // The test has teeth: many of those flips decode to other values.
  EXPECT_GT(silent_without_checksum, 20);
}

TEST(MetadataCodecTest, ChecksumMismatchNamesTheFileAndBothValues) {
  std::string text = Encoded(SampleMetadata());
  const size_t at = text.find(R"("step":{"int64":100})");
  ASSERT_NE(at, std::string::npos);
  text[at + 18] = '1';  // step 100 -> 101
  const absl::Status status = DecodeMetadata(text, kSource).status();
  ExpectRejected(status, "metadata checksum mismatch");
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("stored " + text.substr(kChecksumKeyPrefix.size(), 8)));
  EXPECT_THAT(std::string(status.message()), HasSubstr("changed after it was written"));
  ExpectRejected(DecodeMetadataWithTreeForTesting(text, kSource).status(),
                 "metadata checksum mismatch");
}

TEST(MetadataCodecTest, Version2NeedsItsChecksumFirst) {
  json j = json::parse(Encoded(SampleMetadata()));
  j.erase("checksum");
  ExpectRejected(DecodeMetadata(j.dump(), kSource).status(),
                 "must begin with its checksum");
  // Anywhere else it does not count (and whitespace inside the opening
  // member is not the form the spec gives).
  nlohmann::ordered_json moved = nlohmann::ordered_json::parse(j.dump());
  moved["checksum"] = "00000000";
  ExpectRejected(DecodeMetadata(moved.dump(), kSource).status(),
                 "must begin with its checksum");
  const std::string sealed = Encoded(SampleMetadata());
  ExpectRejected(
      DecodeMetadata("{ " + sealed.substr(1), kSource).status(),
      "must begin with its checksum");
  // Malformed opening members.
  for (const std::string& head :
       {std::string(R"({"checksum":"1c291ca",)"),
        std::string(R"({"checksum":"1c291cag",)"),
        std::string(R"({"checksum":"1C291CA3",)"),
        std::string(R"({"checksum":"1c291ca3" ,)"),
        std::string(R"({"checksum":5,)")}) {
    SCOPED_TRACE(head);
    ExpectRejected(
        DecodeMetadata(head + sealed.substr(kChecksumPrefixBytes), kSource)
            .status(),
        "malformed checksum");
  }
  // Every text cut short inside the opening member (found by
  // fuzz/checkpoint_dir: a 12-byte one read past its end).
  for (size_t n = 12; n < kChecksumPrefixBytes; ++n) {
    SCOPED_TRACE(n);
    ExpectRejected(DecodeMetadata(sealed.substr(0, n), kSource).status(),
                   "malformed checksum");
    ExpectRejected(
        DecodeMetadataWithTreeForTesting(sealed.substr(0, n), kSource).status(),
        "malformed checksum");
  }
}

// Version 1 (no checksum) still loads; one that opens with a checksum has
// it checked all the same.
TEST(MetadataCodecTest, Version1WithoutChecksumStillDecodes) {
  const std::string v1 = AsVersion1(json::parse(Encoded(SampleMetadata()))).dump();
  absl::StatusOr<Metadata> back = DecodeMetadata(v1, kSource);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->version, 1);
  Metadata expected = SampleMetadata();
  expected.version = 1;
  EXPECT_EQ(*back, expected);
  std::string sealed = WithMetadataChecksum(v1).value();
  ASSERT_TRUE(DecodeMetadata(sealed, kSource).ok());
  sealed[sealed.size() - 3] ^= 1;  // the world size's digit
  ExpectRejected(DecodeMetadata(sealed, kSource).status(),
                 "metadata checksum mismatch");
}

// ------------------------------------------------------------ format/version

TEST(MetadataCodecTest, WrongFormat) {
  ExpectRejected(DecodeEdited([](json& j) { j["format"] = "dcp"; }).status(),
                 "not cairn metadata");
  ExpectRejected(DecodeEdited([](json& j) { j.erase("format"); }).status(),
                 "not cairn metadata");
  ExpectRejected(DecodeEdited([](json& j) { j["format"] = 1; }).status(),
                 "not cairn metadata");
}

// ------------------------------------------------------------ block checksums

// A version 3 metadata whose chunk and object span several blocks of 4096
// bytes, with their block checksums.
Metadata WithBlocks() {
  Metadata md;
  md.crc32c_block_bytes = 4096;
  TensorMetadata t;
  t.dtype = DType::kU8;
  t.shape = {3 * 4096 + 5};
  ChunkMetadata c;
  c.box = Box::Full(t.shape);
  c.location = {"data-00000.safetensors", 4096, 3 * 4096 + 5, 0x11,
                {0xa, 0xb, 0xc, 0xd}};
  t.chunks.push_back(c);
  md.tensors["w"] = t;
  md.objects["o"] = {"data-00000.safetensors", 20480, 8193, 0x22,
                     {1, 2, 0xdeadbeef}};
  md.objects["small"] = {"data-00000.safetensors", 40960, 4096, 0x33, {}};
  return md;
}

// WithBlocks' JSON, changed by `edit`, resealed and decoded; the fast
// decoder and the tree decoder must agree.
absl::StatusOr<Metadata> DecodeBlocksEdited(
    const std::function<void(json&)>& edit) {
  json j = json::parse(Encoded(WithBlocks()));
  j.erase("checksum");
  edit(j);
  const std::string text = WithMetadataChecksum(j.dump()).value();
  ExpectSameAsTree(text);
  return DecodeMetadata(text, kSource);
}

TEST(MetadataCodecTest, BlockChecksumsRoundTrip) {
  const std::string text = Encoded(WithBlocks());
  EXPECT_THAT(text, HasSubstr("\"crc32c_block_bytes\":4096,"));
  EXPECT_THAT(text, HasSubstr("\"crc32c\":\"00000011\",\"crc32c_blocks\":"
                              "\"0000000a0000000b0000000c0000000d\","));
  EXPECT_THAT(text, HasSubstr("\"crc32c_blocks\":\"0000000100000002deadbeef\""));
  absl::StatusOr<Metadata> back = DecodeMetadata(text, kSource);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, WithBlocks());
  ExpectSameAsTree(text);
  // Upper-case digits are accepted, as for crc32c.
  back = DecodeBlocksEdited([](json& j) {
    j["objects"]["o"]["crc32c_blocks"] = "0000000100000002DEADBEEF";
  });
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->objects.at("o").block_crc32c.back(), 0xdeadbeefu);
  // A location may go without them (it is then checked whole).
  back = DecodeBlocksEdited(
      [](json& j) { j["objects"]["o"].erase("crc32c_blocks"); });
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->objects.at("o").block_crc32c.empty());
}

TEST(MetadataCodecTest, BadBlockChecksumsAreDataLoss) {
  auto chunk = [](json& j) -> json& { return j["tensors"]["w"]["chunks"][0]; };
  struct Case {
    const char* name;
    std::function<void(json&)> edit;
    const char* mention;
  };
  const std::vector<Case> cases = {
      {"not hex", [&](json& j) {
         chunk(j)["crc32c_blocks"] = "0000000a0000000b0000000c0000000g";
       }, "hex digit"},
      {"not groups of 8", [&](json& j) {
         chunk(j)["crc32c_blocks"] = "0000000a0000000b0000000c000000d";
       }, "groups of 8"},
      {"empty", [&](json& j) { chunk(j)["crc32c_blocks"] = ""; },
       "groups of 8"},
      {"one too few", [&](json& j) {
         chunk(j)["crc32c_blocks"] = "0000000a0000000b0000000c";
       }, "has 3 checksums"},
      {"one too many", [&](json& j) {
         chunk(j)["crc32c_blocks"] = "0000000a0000000b0000000c0000000d00000000";
       }, "has 5 checksums"},
      {"on one block", [&](json& j) {
         j["objects"]["small"]["crc32c_blocks"] = "00000033";
       }, "one block or less"},
      {"not a string", [&](json& j) {
         chunk(j)["crc32c_blocks"] = json::array({10, 11, 12, 13});
       }, "must be a string"},
      {"block size missing",
       [&](json& j) { j.erase("crc32c_block_bytes"); }, "crc32c_block_bytes"},
      {"block size not a power of two",
       [&](json& j) { j["crc32c_block_bytes"] = 6144; }, "power of two"},
      {"block size too small",
       [&](json& j) { j["crc32c_block_bytes"] = 2048; }, "power of two"},
      {"block size changed under the counts",
       [&](json& j) { j["crc32c_block_bytes"] = 8192; }, "checksums"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ExpectRejected(DecodeBlocksEdited(c.edit).status(), c.mention);
  }
}

// Before version 3 the block members are unknown fields, ignored; an
// encoder refuses to write block checksums into an older version.
TEST(MetadataCodecTest, BlockChecksumsBelongToVersion3) {
  absl::StatusOr<Metadata> back =
      DecodeBlocksEdited([](json& j) { j["version"] = 2; });
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->version, 2);
  EXPECT_TRUE(back->tensors.at("w").chunks[0].location.block_crc32c.empty());
  EXPECT_TRUE(back->objects.at("o").block_crc32c.empty());
  Metadata v2 = WithBlocks();
  v2.version = 2;
  EXPECT_EQ(EncodeMetadata(v2).status().code(),
            absl::StatusCode::kInvalidArgument);
  Metadata bad = WithBlocks();
  bad.crc32c_block_bytes = 1000;
  EXPECT_EQ(EncodeMetadata(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetadataCodecTest, UnknownVersion) {
  for (int v : {0, kFormatVersion + 1, 100, -1}) {
    auto status = DecodeEdited([v](json& j) {
                    j["version"] = v;
                    // A future version may change everything else too.
                    j["tensors"] = "something new";
                  }).status();
    ExpectRejected(status, "unsupported format version " + std::to_string(v),
                   absl::StatusCode::kFailedPrecondition);
  }
}

TEST(MetadataCodecTest, VersionOfWrongType) {
  ExpectRejected(DecodeEdited([](json& j) { j["version"] = "1"; }).status(),
                 "version");
  ExpectRejected(DecodeEdited([](json& j) { j["version"] = 1.0; }).status(),
                 "version");
  ExpectRejected(DecodeEdited([](json& j) { j.erase("version"); }).status(),
                 "version");
}

// ------------------------------------------------------------ top level

TEST(MetadataCodecTest, MissingOrMistypedTopLevelFields) {
  for (const char* field : {"created_by", "world_size", "tensors", "objects",
                            "scalars", "structure", "user"}) {
    SCOPED_TRACE(field);
    ExpectRejected(DecodeEdited([field](json& j) { j.erase(field); }).status(),
                   std::string("missing \"") + field + "\"");
  }
  ExpectRejected(DecodeEdited([](json& j) { j["created_by"] = 1; }).status(),
                 "created_by");
  ExpectRejected(
      DecodeEdited([](json& j) { j["tensors"] = json::array(); }).status(),
      "tensors");
  ExpectRejected(DecodeEdited([](json& j) { j["objects"] = 3; }).status(),
                 "objects");
  ExpectRejected(DecodeEdited([](json& j) { j["scalars"] = nullptr; }).status(),
                 "scalars");
  ExpectRejected(DecodeEdited([](json& j) { j["user"] = "x"; }).status(),
                 "user");
}

TEST(MetadataCodecTest, BadWorldSize) {
  for (json bad :
       {json(0), json(-1), json(2147483648LL), json(1.5), json("4")}) {
    ExpectRejected(
        DecodeEdited([&bad](json& j) { j["world_size"] = bad; }).status(),
        "world_size");
  }
}

// Rank-local metadata carries the rank that wrote it, below world_size.
TEST(MetadataCodecTest, RankLocalRank) {
  Metadata md = SampleMetadata();
  md.rank = 3;
  absl::StatusOr<std::string> text = EncodeMetadata(md);
  ASSERT_TRUE(text.ok());
  absl::StatusOr<Metadata> back = DecodeMetadata(*text, "m.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->rank, 3);
  EXPECT_EQ(*back, md);
  // Absent means global.
  absl::StatusOr<Metadata> global = DecodeEdited([](json&) {});
  ASSERT_TRUE(global.ok());
  EXPECT_EQ(global->rank, -1);
  for (json bad : {json(-1), json(4), json(1000), json(1.5), json("0")}) {
    ExpectRejected(DecodeEdited([&bad](json& j) { j["rank"] = bad; }).status(),
                   "rank");
  }
}

// ------------------------------------------------------------ file names

TEST(MetadataCodecTest, UnsafeFileNames) {
  for (const char* name : {"/etc/passwd", "../secret", "a/../b", "..", ".", "",
                           "a//b", "./a", "a\\b", "a\nb"}) {
    SCOPED_TRACE(name);
    auto status =
        DecodeEdited([name](json& j) { Chunk0(j)["file"] = name; }).status();
    ExpectRejected(status, "\"model.wq\" chunk 0");
    EXPECT_THAT(std::string(status.message()), HasSubstr("unsafe file name"));
    // After chunks naming a good file (which the fast decoder checks once).
    status = DecodeEdited([name](json& j) {
               j["tensors"]["model.wq"]["chunks"][2]["file"] = name;
             }).status();
    ExpectRejected(status, "\"model.wq\" chunk 2");
    EXPECT_THAT(std::string(status.message()), HasSubstr("unsafe file name"));
    ExpectRejected(DecodeEdited([name](json& j) {
                     j["objects"]["rng.rank3"]["file"] = name;
                   }).status(),
                   "object \"rng.rank3\"");
  }
}

TEST(MetadataCodecTest, RelativeSubdirectoryNamesAreAllowed) {
  auto decoded = DecodeEdited(
      [](json& j) { Chunk0(j)["file"] = "rank-00003/data-00000.safetensors"; });
  EXPECT_TRUE(decoded.ok()) << decoded.status();
}

// ------------------------------------------------------------ tensors

TEST(MetadataCodecTest, BadTensorFields) {
  struct Case {
    std::function<void(json&)> edit;
    std::string mention;
  };
  const std::vector<Case> cases = {
      {[](json& j) { j["tensors"]["model.wq"] = 5; }, "must be an object"},
      {[](json& j) { j["tensors"]["model.wq"]["dtype"] = "F128"; },
       "unknown dtype \"F128\""},
      {[](json& j) { j["tensors"]["model.wq"]["dtype"] = "bf16"; },
       "unknown dtype"},
      {[](json& j) { j["tensors"]["model.wq"].erase("dtype"); },
       "missing \"dtype\""},
      {[](json& j) {
         j["tensors"]["model.wq"]["shape"] = {4096, -1};
       },
       "\"shape\""},
      {[](json& j) {
         j["tensors"]["model.wq"]["shape"] = {4096, 1.5};
       },
       "\"shape\""},
      {[](json& j) { j["tensors"]["model.wq"]["shape"] = "4096"; },
       "\"shape\" must be an array"},
      {[](json& j) {
         j["tensors"]["model.wq"]["shape"] =
             json::parse("[4096, 9223372036854775808]");
       },
       "\"shape\""},
      {[](json& j) {
         j["tensors"]["model.wq"]["shape"] =
             json::parse("[4096, 99999999999999999999999]");
       },
       "\"shape\""},
      {[](json& j) {
         j["tensors"]["model.wq"]["shape"] = {4294967296LL, 4294967296LL};
       },
       "overflows"},
      {[](json& j) {
         // 2^62 elements fit int64; their 2^63 bytes do not.
         j["tensors"]["model.wq"]["shape"] = json::array({1LL << 62});
       },
       "overflows"},
      {[](json& j) { j["tensors"]["model.wq"]["chunks"] = json::object(); },
       "\"chunks\" must be an array"},
      {[](json& j) { j["tensors"]["model.wq"]["chunks"][1] = "x"; },
       "chunk 1: must be an object"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    auto status = DecodeEdited(cases[i].edit).status();
    ExpectRejected(status, cases[i].mention);
    EXPECT_THAT(std::string(status.message()), HasSubstr("\"model.wq\""));
  }
}

TEST(MetadataCodecTest, BadChunks) {
  struct Case {
    std::function<void(json&)> edit;
    std::string mention;
  };
  const std::vector<Case> cases = {
      // Boxes outside the tensor.
      {[](json& j) {
         Chunk0(j)["offsets"] = {4000, 0};
       },
       "does not fit"},
      {[](json& j) {
         Chunk0(j)["sizes"] = {1024, 4097};
       },
       "does not fit"},
      {[](json& j) { Chunk0(j)["offsets"] = json::array({0}); },
       "does not fit"},
      {[](json& j) {
         Chunk0(j)["offsets"] = {9223372036854775807LL, 0};
       },
       "does not fit"},
      {[](json& j) {
         Chunk0(j)["offsets"] = {-1, 0};
       },
       "\"offsets\""},
      {[](json& j) {
         Chunk0(j)["sizes"] = {1024, "4096"};
       },
       "\"sizes\""},
      {[](json& j) { Chunk0(j).erase("sizes"); }, "missing \"sizes\""},
      // nbytes mismatch.
      {[](json& j) { Chunk0(j)["nbytes"] = 8388607; },
       "nbytes 8388607 != 8388608"},
      {[](json& j) { Chunk0(j)["nbytes"] = -1; }, "\"nbytes\""},
      {[](json& j) { Chunk0(j)["nbytes"] = 1e6; }, "\"nbytes\""},
      {[](json& j) { Chunk0(j).erase("nbytes"); }, "missing \"nbytes\""},
      // Offsets.
      {[](json& j) { Chunk0(j)["offset"] = -8; }, "\"offset\""},
      {[](json& j) {
         Chunk0(j)["offset"] = json::parse("18446744073709551616");
       },
       "\"offset\""},
      {[](json& j) {
         Chunk0(j)["offset"] = json::parse("18446744073709551615");
       },
       "overflows"},
      {[](json& j) { Chunk0(j)["file"] = 3; }, "\"file\" must be a string"},
      // CRC.
      {[](json& j) { Chunk0(j)["crc32c"] = "1c291ca"; }, "8 hex digits"},
      {[](json& j) { Chunk0(j)["crc32c"] = "1c291cax"; }, "8 hex digits"},
      {[](json& j) { Chunk0(j)["crc32c"] = 471276707; }, "\"crc32c\""},
      {[](json& j) { Chunk0(j).erase("crc32c"); }, "missing \"crc32c\""},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    auto status = DecodeEdited(cases[i].edit).status();
    ExpectRejected(status, cases[i].mention);
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("tensor \"model.wq\" chunk 0"));
  }
}

TEST(MetadataCodecTest, BadObjects) {
  ExpectRejected(
      DecodeEdited([](json& j) { j["objects"]["rng.rank3"] = "x"; }).status(),
      "object \"rng.rank3\"");
  ExpectRejected(DecodeEdited([](json& j) {
                   j["objects"]["rng.rank3"]["nbytes"] = -1;
                 }).status(),
                 "object \"rng.rank3\": \"nbytes\"");
  ExpectRejected(DecodeEdited([](json& j) {
                   j["objects"]["rng.rank3"]["offset"] = 1;
                   j["objects"]["rng.rank3"]["nbytes"] =
                       json::parse("18446744073709551615");
                 }).status(),
                 "overflows");
  ExpectRejected(DecodeEdited([](json& j) {
                   j["objects"]["rng.rank3"]["crc32c"] = "DEADBEEF0";
                 }).status(),
                 "object \"rng.rank3\"");
}

TEST(MetadataCodecTest, BadScalars) {
  const std::vector<json> bad = {
      json(5),
      json::parse(R"({})"),
      json::parse(R"({"int64": 1, "bool": true})"),
      json::parse(R"({"int64": 1.5})"),
      json::parse(R"({"int64": 9223372036854775808})"),
      json::parse(R"({"int64": "5"})"),
      json::parse(R"({"double": "NaN"})"),
      json::parse(R"({"double": true})"),
      json::parse(R"({"bool": 1})"),
      json::parse(R"({"string": 1})"),
      json::parse(R"({"float32": 1.0})"),
  };
  for (const json& b : bad) {
    SCOPED_TRACE(b.dump());
    ExpectRejected(
        DecodeEdited([&b](json& j) { j["scalars"]["step"] = b; }).status(),
        "scalar \"step\"");
  }
}

TEST(MetadataCodecTest, LenientNumberFormsForDoubles) {
  auto decoded = DecodeEdited([](json& j) {
    j["scalars"]["a"] = json::parse(R"({"double": 3})");
    j["scalars"]["b"] = json::parse(R"({"double": -3})");
    j["scalars"]["c"] = json::parse(R"({"int64": -9223372036854775808})");
  });
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->scalars.at("a"), Scalar(3.0));
  EXPECT_EQ(decoded->scalars.at("b"), Scalar(-3.0));
  EXPECT_EQ(decoded->scalars.at("c"),
            Scalar(std::numeric_limits<int64_t>::min()));
}

TEST(MetadataCodecTest, TooLargeIsRejectedBeforeParsing) {
  // A view that claims to be larger than the cap; the decoder must not touch
  // its bytes.
  static const char kByte = '{';
  std::string_view huge(&kByte, kMaxMetadataBytes + 1);
  ExpectRejected(DecodeMetadata(huge, kSource).status(), "exceeds the limit");
}

// Single-byte corruptions anywhere in a real encoding: OK or a status, never
// a crash (this is what the ASan build is for).
TEST(MetadataCodecTest, CorruptionNeverCrashes) {
  Metadata md;
  md.world_size = 2;
  md.tensors["w"] =
      RowSharded(DType::kF32, {4, 3}, 2, "data-00000.safetensors");
  md.objects["o"] = {"data-00001.safetensors", 0, 3, 1, {}};
  md.scalars["s"] = int64_t{1};
  md.scalars["d"] = 0.5;
  const std::string text = Encoded(md);
  const char kBytes[] = {'\0', '"', '{', '}', '[',  ']',    ',',
                         ':',  '9', '-', '.', '\\', '\xff', 'e'};
  for (size_t i = 0; i < text.size(); ++i) {
    for (char b : kBytes) {
      std::string t = text;
      t[i] = b;
      // As damaged (the checksum's verdict), and behind a fresh checksum.
      for (const std::string& damaged : {t, Resealed(t)}) {
        auto decoded = DecodeMetadata(damaged, kSource);
        if (!decoded.ok()) {
          EXPECT_THAT(std::string(decoded.status().message()),
                      HasSubstr(kSource));
        }
      }
    }
  }
}

// The fast decoder (no JSON tree) must give exactly what the tree decoder
// gives: the same Metadata, or the same error, on good and damaged input.
// A text that opens with a checksum is resealed first (Resealed).
void ExpectSameAsTree(const std::string& damaged) {
  const std::string text = Resealed(damaged);
  absl::StatusOr<Metadata> fast = DecodeMetadata(text, kSource);
  absl::StatusOr<Metadata> tree = DecodeMetadataWithTreeForTesting(text, kSource);
  ASSERT_EQ(fast.ok(), tree.ok()) << text << "\nfast: " << fast.status()
                                  << "\ntree: " << tree.status();
  if (fast.ok()) {
    EXPECT_TRUE(*fast == *tree) << text;
  } else {
    EXPECT_EQ(fast.status(), tree.status()) << text;
  }
}

TEST(MetadataCodecTest, FastDecoderMatchesTheTreeDecoder) {
  Metadata md = SampleMetadata();
  // Names the fast path leaves to the tree decoder: escapes, non-ASCII.
  md.tensors["caf\xc3\xa9.w"] = md.tensors.begin()->second;
  md.tensors["quote\"d"] = md.tensors.begin()->second;
  const std::string text = Encoded(md);
  ExpectSameAsTree(text);
  ExpectSameAsTree(Encoded(SampleMetadata()));
  // Re-indented (any JSON whitespace) and reordered members.
  ExpectSameAsTree(AsVersion1(json::parse(text)).dump(2));
  // Every truncation and a set of single-byte corruptions.
  const std::string plain = Encoded(SampleMetadata());
  for (size_t n = 0; n < plain.size(); n += 7) {
    ExpectSameAsTree(plain.substr(0, n));
  }
  const char kBytes[] = {'\0', '"', '{', '}', ',', ':', '9', '-', ' ', 'x'};
  for (size_t i = 0; i < plain.size(); i += 3) {
    for (char b : kBytes) {
      std::string t = plain;
      t[i] = b;
      ExpectSameAsTree(t);
    }
  }
}

// A key twice in one object, at any level: nlohmann's tree keeps the last
// one (a second "step" would silently win), so both decoders refuse it,
// naming the key and where its object is. The same text with the key once
// decodes (so the refusal is the repetition's).
TEST(MetadataCodecTest, DuplicateKeysAreRejectedAtEveryLevel) {
  Metadata md = SampleMetadata();
  md.tensors.erase("ünïcode.ключ");  // plain ASCII: the fast decoder's
  const std::string text = Encoded(md);
  const json tree = json::parse(text);
  const std::string lr_tensor =
      "\"lr_tensor\":" + tree["tensors"]["lr_tensor"].dump();
  const std::string rng = "\"rng.rank3\":" + tree["objects"]["rng.rank3"].dump();
  struct Case {
    std::string from, to, key, where;
  };
  const std::vector<Case> cases = {
      {R"("step":{"int64":100})", R"("step":{"int64":100},"step":{"int64":7})",
       "step", "at \"/scalars\""},
      {R"("step":{"int64":100})", R"("step":{"int64":100,"int64":7})",
       "int64", "at \"/scalars/step\""},
      {R"("world_size":4)", R"("world_size":4,"world_size":4)", "world_size",
       "the top level"},
      {R"("tensors":{)", "\"tensors\":{" + lr_tensor + ",", "lr_tensor",
       "at \"/tensors\""},
      {R"("objects":{)", "\"objects\":{" + rng + ",", "rng.rank3",
       "at \"/objects\""},
      {R"("dtype":"BF16")", R"("dtype":"BF16","dtype":"BF16")", "dtype",
       "at \"/tensors/model.wq\""},
      {R"("offset":8192,)", R"("offset":8192,"offset":8192,)", "offset",
       "at \"/tensors/model.wq/chunks/0\""},
      {R"("wq":"model.layers.0.wq")",
       R"("wq":"model.layers.0.wq","wq":"model.layers.0.wq")", "wq",
       "at \"/structure/model/layers/0\""},
      {R"("git":"abc123")", R"("git":"abc123","git":"def456")", "git",
       "at \"/user\""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.to);
    const size_t at = text.find(c.from);
    ASSERT_NE(at, std::string::npos);
    std::string edited = text;
    edited.replace(at, c.from.size(), c.to);
    edited = Resealed(edited);
    for (bool tree_only : {false, true}) {
      absl::Status s =
          tree_only ? DecodeMetadataWithTreeForTesting(edited, kSource).status()
                    : DecodeMetadata(edited, kSource).status();
      ExpectRejected(s, "the key \"" + c.key + "\" appears twice");
      EXPECT_THAT(std::string(s.message()), HasSubstr(c.where));
    }
    ExpectSameAsTree(edited);
  }
  ASSERT_TRUE(DecodeMetadata(text, kSource).ok());
}

// An FQN in two of tensors, objects and scalars: each decodes alone, but
// the leaf would be two things (and a multi-rank load counted it twice).
// Refused by both decoders, and by the encoder.
TEST(MetadataCodecTest, AnFqnInTwoKindsOfLeafIsRejected) {
  const std::vector<std::pair<std::function<void(json&)>, std::string>> edits =
      {{[](json& j) { j["scalars"]["rng.rank3"] = {{"int64", 1}}; },
        R"("rng.rank3" is in both "objects" and "scalars")"},
       {[](json& j) { j["scalars"]["lr_tensor"] = {{"bool", true}}; },
        R"("lr_tensor" is in both "tensors" and "scalars")"},
       {[](json& j) {
          j["objects"]["lr_tensor"] = j["objects"]["rng.rank3"];
        },
        R"("lr_tensor" is in both "tensors" and "objects")"}};
  for (const auto& [edit, message] : edits) {
    SCOPED_TRACE(message);
    json j = json::parse(Encoded(SampleMetadata()));
    j.erase("checksum");
    edit(j);
    const std::string text = *WithMetadataChecksum(j.dump());
    ExpectRejected(DecodeMetadata(text, kSource).status(), message);
    ExpectRejected(DecodeMetadataWithTreeForTesting(text, kSource).status(),
                   message);
  }
  Metadata md = SampleMetadata();
  md.scalars["rng.rank3"] = int64_t{1};
  absl::StatusOr<std::string> encoded = EncodeMetadata(md);
  EXPECT_EQ(encoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(encoded.status().message()),
              HasSubstr(R"("rng.rank3" is in both "objects" and "scalars")"));
}

// The structure: a skeleton of stored leaves, each once. Unknown or
// repeated FQNs, and leaves that are not their place's FQN, are refused.
TEST(MetadataCodecTest, ValidateStructure) {
  Metadata md;
  md.tensors["model.w"] = RowSharded(DType::kF32, {4, 3}, 2, "data-00000.safetensors");
  md.objects["rng"] = {"data-00000.safetensors", 0, 3, 1};
  md.scalars["step"] = int64_t{1};
  md.scalars["a.b"] = int64_t{2};
  for (const char* good : {R"({"model":{"w":"model.w"},"rng":"rng","step":"step"})",
                           R"({"step":"step"})", R"({})",
                           R"({"a":{"b":"a.b"},"model":{"w":"model.w"}})"}) {
    md.structure = good;
    EXPECT_TRUE(ValidateStructure(md).ok()) << good << ValidateStructure(md);
  }
  for (const auto& [bad, message] : std::vector<std::pair<std::string, std::string>>{
           {R"({"model":{"w":"model.w","v":"model.v"}})",
            R"(structure names "model.v", which is not a tensor, object or scalar)"},
           {R"({"a.b":"a.b","a":{"b":"a.b"}})", R"(duplicate FQN "a.b")"},
           {R"({"model":{"w":"rng"}})", R"(names FQN "rng")"},
           {R"({"step":5})", "is a JSON number"},
           {R"([1])", "not an object"}}) {
    SCOPED_TRACE(bad);
    md.structure = bad;
    absl::Status s = ValidateStructure(md);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(message));
  }
}

// ------------------------------------------------- decoding in parts

// Every part of a split decode starts where the part before it ended a
// tensor, so splitting never changes the result: the same Metadata, or the
// same error, as the one-pass decode (and hence as the tree decoder).
// Returns the parts used. A text that opens with a checksum is resealed
// first (Resealed).
size_t ExpectSameInParts(const std::string& damaged, int threads = 4) {
  const std::string text = Resealed(damaged);
  size_t parts = 0;
  absl::StatusOr<Metadata> split = DecodeMetadata(
      text, kSource, DecodeThreads{threads, 0, 1, &parts});
  size_t one_parts = 0;
  absl::StatusOr<Metadata> one =
      DecodeMetadata(text, kSource, DecodeThreads{1, 0, 1, &one_parts});
  EXPECT_LE(one_parts, 1u);
  EXPECT_EQ(split.ok(), one.ok())
      << "split: " << split.status() << "\none: " << one.status();
  if (split.ok() && one.ok()) {
    EXPECT_TRUE(*split == *one);
  } else {
    EXPECT_EQ(split.status(), one.status());
  }
  return parts;
}

// Tensors with a few row chunks each, named `prefix` + index + `suffix`,
// beside the sample's plain-ASCII ones (the fast decoder leaves other names
// to the tree decoder).
Metadata ManyTensors(int tensors, const std::string& prefix = "layer.",
                     const std::string& suffix = "") {
  Metadata md = SampleMetadata();
  EXPECT_EQ(md.tensors.erase("ünïcode.ключ"), 1u);
  for (int t = 0; t < tensors; ++t) {
    md.tensors[prefix + std::to_string(1000 + t) + suffix] = RowSharded(
        DType::kF32, {8 + t % 5, 3}, 1 + t % 4,
        "data-0000" + std::to_string(t % 4) + ".safetensors");
  }
  return md;
}

TEST(MetadataCodecTest, TensorsDecodeTheSameInParts) {
  const Metadata md = ManyTensors(300);
  const std::string text = Encoded(md);
  for (int threads : {2, 3, 4, 16}) {
    size_t parts = 0;
    absl::StatusOr<Metadata> back =
        DecodeMetadata(text, kSource, DecodeThreads{threads, 0, 1, &parts});
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, md);
    // It did split: as many parts as threads (300 tensors to split at).
    EXPECT_EQ(parts, static_cast<size_t>(threads)) << threads;
  }
  // Below the size bound, or with parts of at least the whole text: one.
  size_t parts = 0;
  ASSERT_TRUE(DecodeMetadata(text, kSource,
                             DecodeThreads{4, text.size() + 1, 1, &parts})
                  .ok());
  EXPECT_EQ(parts, 1u);
  ASSERT_TRUE(
      DecodeMetadata(text, kSource, DecodeThreads{4, 0, text.size(), &parts})
          .ok());
  EXPECT_EQ(parts, 1u);
  // The default: the machine's cores, from 16 MiB of text.
  absl::StatusOr<Metadata> plain = DecodeMetadata(text, kSource);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(*plain, md);
}

// Names holding the text the split looks for (`]},"` cannot be inside a
// plain name, which has no quote, but a name can end in `]},`, so that the
// name's closing quote completes it), and texts written with other
// layouts: the guesses that land there are not trusted, and the result is
// the one-pass result.
TEST(MetadataCodecTest, MisleadingSplitPlacesDoNotChangeTheResult) {
  // Long names ending in `]},`: most guesses land inside one.
  const std::string misleading = std::string(300, 'n') + "]},";
  size_t fell_back = 0;
  for (const auto& [prefix, suffix] :
       std::vector<std::pair<std::string, std::string>>{
           {"x]},", ""}, {"a]}", "]},"}, {"q.", misleading}}) {
    Metadata md = ManyTensors(200, prefix, suffix);
    const std::string text = Encoded(md);
    for (int threads : {2, 4, 7}) {
      if (ExpectSameInParts(text, threads) == 1) ++fell_back;
    }
    absl::StatusOr<Metadata> back =
        DecodeMetadata(text, kSource, DecodeThreads{4, 0, 1});
    ASSERT_TRUE(back.ok()) << prefix << suffix << ": " << back.status();
    EXPECT_EQ(*back, md) << prefix << suffix;
  }
  // The names ending in `]},` did mislead some splits into one pass.
  EXPECT_GT(fell_back, 0u);
  const std::string text = Encoded(ManyTensors(200));
  // Indented: `]},"` is never found, and the text is decoded in one pass.
  json j = AsVersion1(json::parse(text));
  EXPECT_EQ(ExpectSameInParts(j.dump(1)), 1u);
  // Members in another order (chunks last, so a tensor ends in `]}]}`):
  // still split at tensor ends.
  nlohmann::ordered_json reordered = nlohmann::ordered_json::parse(text);
  for (auto& [fqn, t] : reordered["tensors"].items()) {
    nlohmann::ordered_json moved;
    moved["shape"] = t["shape"];
    moved["dtype"] = t["dtype"];
    moved["chunks"] = t["chunks"];
    t = moved;
  }
  EXPECT_GT(ExpectSameInParts(reordered.dump()), 1u);
  // A user object after the tensors that holds the boundary text many
  // times: guesses that land in it are after the tensors' end.
  Metadata md = ManyTensors(20);
  json user = json::object();
  for (int i = 0; i < 2000; ++i) {
    user["k" + std::to_string(i)] = json::array({json::object({{"a", 1}}), "s"});
  }
  md.user = user.dump();
  const std::string with_user = Encoded(md);
  ASSERT_NE(with_user.find("]},\"", with_user.find("\"user\"")),
            std::string::npos);
  ExpectSameInParts(with_user, 8);
  absl::StatusOr<Metadata> back = DecodeMetadata(
      with_user, kSource, DecodeThreads{8, 0, 1});
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, md);
}

// Damage anywhere gives the one-pass error: a bad value in the first or
// last part, a name repeated across parts, every truncation and single-byte
// corruptions of the tensors member.
TEST(MetadataCodecTest, DamageInAnyPartGivesTheOnePassError) {
  const std::string text = Encoded(ManyTensors(120));
  const size_t tensors_at = text.find("\"tensors\"");
  const size_t user_at = text.find("\"user\"");
  ASSERT_NE(tensors_at, std::string::npos);
  ASSERT_NE(user_at, std::string::npos);
  // A bad CRC in the first tensor and in the last one.
  for (size_t at : {text.find("\"crc32c\":\"", tensors_at),
                    text.rfind("\"crc32c\":\"", user_at)}) {
    std::string bad = text;
    bad[at + 10] = 'g';
    ExpectSameInParts(bad);
    EXPECT_FALSE(DecodeMetadata(bad, kSource).ok());
  }
  // A name that repeats one of another part (layer.1119 renamed
  // layer.1000): the fast decoders refuse it, and the tree decoder's rule
  // (the last value wins) decides, whether or not the text was split.
  std::string repeated = text;
  const size_t name_at = repeated.find("\"layer.1119\"");
  ASSERT_NE(name_at, std::string::npos);
  repeated.replace(name_at, 12, "\"layer.1000\"");
  ExpectSameInParts(repeated);
  const size_t step = (user_at - tensors_at) / 50;
  for (size_t n = tensors_at; n < user_at; n += step) {
    ExpectSameInParts(text.substr(0, n));
  }
  const char kBytes[] = {'"', '{', '}', ',', ']', '9', ' ', 'x'};
  for (size_t i = tensors_at; i < user_at; i += step + 1) {
    for (char b : kBytes) {
      std::string t = text;
      t[i] = b;
      ExpectSameInParts(t);
    }
  }
}

// The direct text encoder writes what nlohmann's dump writes of the same
// document (compact, keys sorted, its escaping).
TEST(MetadataCodecTest, EncoderWritesCanonicalJson) {
  Metadata md = SampleMetadata();
  md.tensors["caf\xc3\xa9 \"x\"\t"] = md.tensors.begin()->second;
  md.objects["o\\bj"] = md.objects.empty() ? ByteLocation{"data-00000.safetensors", 0, 1, 2, {}}
                                            : md.objects.begin()->second;
  const std::string text = Encoded(md);
  // The file ends with a newline after the document.
  ASSERT_TRUE(text.ends_with("\n"));
  EXPECT_EQ(json::parse(text).dump() + "\n", text);
}

// With many chunks the tensors are encoded on several threads, each at its
// counted offset: the text is still nlohmann's dump of the document, and
// of two bad names the first in document order is the one reported.
TEST(MetadataCodecTest, ManyChunksEncodeTheSameOnSeveralThreads) {
  Metadata md;
  md.world_size = 4096;
  // x 5 tensors: just past the threaded bound (65536 chunks), small chunks
  // so that the nlohmann comparison stays quick under ASan.
  const int64_t kChunks = 13200;
  for (const char* fqn : {"a.w", "b \"q\"", "c\tx", "d.\xc3\xa9", "e"}) {
    TensorMetadata& t = md.tensors[fqn];
    t.dtype = DType::kBF16;
    t.shape = {kChunks * 3};
    for (int64_t c = 0; c < kChunks; ++c) {
      ChunkMetadata chunk;
      chunk.box = Box{{c * 3}, {3}};
      chunk.location = ByteLocation{
          absl::StrCat("d", c % 64), static_cast<uint64_t>(c) * 4099 * 1000003,
          6, static_cast<uint32_t>(c * 2654435761u), {}};
      t.chunks.push_back(std::move(chunk));
    }
  }
  absl::StatusOr<std::string> text = EncodeMetadata(md);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(json::parse(*text).dump() + "\n", *text);
  absl::StatusOr<Metadata> back = DecodeMetadata(*text, "many.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, md);

  md.tensors["z\xff"] = md.tensors["e"];
  md.tensors["m\xfe"] = md.tensors["e"];
  absl::StatusOr<std::string> bad = EncodeMetadata(md);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("FE")) << bad.status();
}

// The flat chunks' text is the text of the same chunks in the tensors,
// byte for byte, for plain file names and ones that need escaping; a file
// name that cannot be written fails both alike, and only when a chunk
// names it.
TEST(MetadataCodecTest, FlatChunksEncodeLikeTheirTensors) {
  for (int64_t chunks : {int64_t{7}, int64_t{70000}}) {  // inline, threaded
    Metadata md;
    md.world_size = 3;
    md.tensors["a"].dtype = DType::kF32;
    md.tensors["a"].shape = {chunks, 2};
    md.tensors["b \"x\""].dtype = DType::kI64;
    md.tensors["b \"x\""].shape = {chunks};
    FlatChunks flat;
    flat.files = {"data-00000.safetensors", "we\"ird\\name",
                  "caf\xc3\xa9.st", "bad\xff"};
    flat.dims_at = {0, static_cast<size_t>(4 * chunks)};
    for (int64_t c = 0; c < chunks; ++c) {
      flat.dims.insert(flat.dims.end(), {c, 0, 1, 2});
    }
    for (int64_t c = 0; c < chunks; ++c) {
      flat.dims.insert(flat.dims.end(), {c, 1});
    }
    flat.first = {0, static_cast<size_t>(chunks),
                  static_cast<size_t>(2 * chunks)};
    flat.ResizeLocations();
    for (size_t c = 0; c < flat.num_chunks(); ++c) {
      flat.file[c] = static_cast<uint32_t>(c % 3);
      flat.offset[c] = 4096 + 977 * c;
      flat.nbytes[c] = 8;
      flat.crc32c[c] = static_cast<uint32_t>(c * 2654435761u);
    }
    absl::StatusOr<std::string> from_flat = EncodeMetadata(md, flat);
    absl::StatusOr<std::string> from_tensors =
        EncodeMetadata(WithFlatChunks(md, flat));
    ASSERT_TRUE(from_flat.ok()) << from_flat.status();
    ASSERT_TRUE(from_tensors.ok()) << from_tensors.status();
    EXPECT_EQ(*from_flat, *from_tensors);
    // The unwritable name, once a chunk of the second tensor names it.
    flat.file[chunks + 5] = 3;
    from_flat = EncodeMetadata(md, flat);
    from_tensors = EncodeMetadata(WithFlatChunks(md, flat));
    EXPECT_EQ(from_flat.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(from_flat.status(), from_tensors.status());
  }
}

// ------------------------------------------------------------ coverage

// The flat form of one tensor's boxes gives the same verdicts and, but for
// an overflowing shape, the same messages as the chunks' form.
TEST(MetadataCodecTest, FlatCoverageAgreesWithChunkCoverage) {
  const Shape shape = {6, 4};
  auto check = [&](const std::vector<Box>& boxes, bool ok) {
    Metadata md;
    md.tensors["w"].shape = shape;
    FlatChunks flat;
    flat.dims_at = {0};
    for (const Box& b : boxes) {
      flat.dims.insert(flat.dims.end(), b.offsets.begin(), b.offsets.end());
      flat.dims.insert(flat.dims.end(), b.sizes.begin(), b.sizes.end());
    }
    flat.first = {0, boxes.size()};
    flat.ResizeLocations();
    const Metadata full = WithFlatChunks(md, flat);
    absl::Status a = ValidateCoverage("w", full.tensors.at("w"));
    absl::Status b = ValidateCoverage("w", shape, flat, 0);
    EXPECT_EQ(a.ok(), ok) << a;
    EXPECT_EQ(a, b);
  };
  check({Box{{0, 0}, {3, 4}}, Box{{3, 0}, {3, 4}}}, true);
  check({Box{{0, 0}, {6, 2}}, Box{{0, 2}, {6, 2}}, Box{{2, 2}, {0, 2}}}, true);
  check({Box{{0, 0}, {3, 4}}}, false);                        // a gap
  check({Box{{0, 0}, {4, 4}}, Box{{3, 0}, {3, 4}}}, false);   // overlap
  check({Box{{0, 0}, {3, 4}}, Box{{3, 0}, {4, 4}}}, false);   // outside
  check({Box{{0, 0}, {6, 4}}, Box{{-1, 0}, {1, 4}}}, false);  // negative
}

// Every tensor's coverage, on several threads past 65536 chunks: the error
// is the first failing tensor's in name order, as a loop would give.
TEST(MetadataCodecTest, AllCoverageReportsTheFirstFailingTensor) {
  for (int64_t chunks : {int64_t{10}, int64_t{1000}}) {  // inline, threaded
    Metadata md;
    for (int t = 0; t < 70; ++t) {
      TensorMetadata& tm = md.tensors[absl::StrCat("t.", 10 + t)];
      tm.dtype = DType::kF32;
      tm.shape = {chunks * 2};
      for (int64_t c = 0; c < chunks; ++c) {
        tm.chunks.push_back({Box{{c * 2}, {2}},
                             ByteLocation{"data-00000.safetensors", 0, 8, 0, {}}});
      }
    }
    EXPECT_TRUE(ValidateAllCoverage(md).ok()) << chunks;
    md.tensors["t.70"].chunks.pop_back();  // a gap at its end
    md.tensors["t.30"].chunks[3].box.offsets[0] = 5;  // overlaps the next
    md.tensors["t.75"].chunks.pop_back();
    absl::Status s = ValidateAllCoverage(md);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("t.30")) << s;
    EXPECT_EQ(s, ValidateCoverage("t.30", md.tensors["t.30"]));
  }
}

TEST(MetadataCodecTest, CoverageAcceptsExactTilings) {
  EXPECT_TRUE(
      ValidateCoverage("w", RowSharded(DType::kF32, {10, 3}, 1, "f")).ok());
  EXPECT_TRUE(
      ValidateCoverage("w", RowSharded(DType::kF32, {10, 3}, 3, "f")).ok());
  const Metadata md = SampleMetadata();
  for (const auto& [fqn, t] : md.tensors) {
    EXPECT_TRUE(ValidateCoverage(fqn, t).ok()) << fqn;
  }
  // A zero-size tensor needs no chunk.
  TensorMetadata empty;
  empty.shape = {0, 4};
  EXPECT_TRUE(ValidateCoverage("e", empty).ok());
}

TensorMetadata Grid(int64_t rows, int64_t cols, int64_t br, int64_t bc) {
  TensorMetadata t;
  t.dtype = DType::kU8;
  t.shape = {rows, cols};
  for (int64_t r = 0; r < rows; r += br) {
    for (int64_t c = 0; c < cols; c += bc) {
      ChunkMetadata chunk;
      chunk.box = {{r, c}, {std::min(br, rows - r), std::min(bc, cols - c)}};
      chunk.location = {"f", 0, static_cast<uint64_t>(chunk.box.num_elements()),
                        0, {}};
      t.chunks.push_back(chunk);
    }
  }
  return t;
}

TEST(MetadataCodecTest, CoverageGrid) {
  TensorMetadata t = Grid(100, 90, 7, 11);
  EXPECT_TRUE(ValidateCoverage("g", t).ok());
  // Shuffled order does not matter.
  std::mt19937 rng(1);
  std::shuffle(t.chunks.begin(), t.chunks.end(), rng);
  EXPECT_TRUE(ValidateCoverage("g", t).ok());
}

TEST(MetadataCodecTest, CoverageGap) {
  TensorMetadata t = RowSharded(DType::kF32, {10, 3}, 3, "f");
  t.chunks.erase(t.chunks.begin() + 1);
  auto status = ValidateCoverage("model.w", t);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("model.w"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("in no chunk"));
  TensorMetadata none;
  none.shape = {2};
  EXPECT_EQ(ValidateCoverage("n", none).code(), absl::StatusCode::kDataLoss);
}

TEST(MetadataCodecTest, CoverageOverlap) {
  TensorMetadata t = RowSharded(DType::kF32, {10, 3}, 2, "f");
  t.chunks[1].box.offsets[0] -= 1;  // rows 4..8 overlap row 4 of chunk 0
  auto status = ValidateCoverage("model.w", t);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("overlap"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("model.w"));

  // Same volume as the tensor, yet a duplicate chunk and a gap.
  TensorMetadata dup = RowSharded(DType::kF32, {4}, 2, "f");
  dup.chunks[1] = dup.chunks[0];
  EXPECT_THAT(std::string(ValidateCoverage("d", dup).message()),
              HasSubstr("overlap"));

  // Rank 0: two chunks.
  TensorMetadata r0;
  r0.chunks.push_back({Box{}, {}});
  EXPECT_TRUE(ValidateCoverage("r", r0).ok());
  r0.chunks.push_back({Box{}, {}});
  EXPECT_THAT(std::string(ValidateCoverage("r", r0).message()),
              HasSubstr("overlap"));
}

TEST(MetadataCodecTest, CoverageOverlapInGrid) {
  TensorMetadata t = Grid(64, 64, 8, 8);
  // Grow one chunk into its right neighbour and drop a far one so the
  // volumes still add up.
  t.chunks[9].box.sizes[1] += 1;
  t.chunks.back().box.sizes[1] -= 1;
  EXPECT_THAT(std::string(ValidateCoverage("g", t).message()),
              HasSubstr("overlap"));
}

TEST(MetadataCodecTest, CoverageChunkOutsideShape) {
  TensorMetadata t = RowSharded(DType::kF32, {10, 3}, 2, "f");
  t.chunks[1].box.sizes[0] += 1;
  auto status = ValidateCoverage("model.w", t);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("outside"));
  t = RowSharded(DType::kF32, {10, 3}, 2, "f");
  t.chunks[0].box.offsets = {0};
  EXPECT_EQ(ValidateCoverage("model.w", t).code(), absl::StatusCode::kDataLoss);
}

TEST(MetadataCodecTest, CoverageIsFastForThousandsOfChunks) {
  const auto start = std::chrono::steady_clock::now();
  // 16384 row shards, a 128 x 128 grid and 8192 column shards.
  TensorMetadata rows = RowSharded(DType::kU8, {16384, 4}, 16384, "f");
  EXPECT_TRUE(ValidateCoverage("rows", rows).ok());
  TensorMetadata grid = Grid(1280, 1280, 10, 10);
  EXPECT_TRUE(ValidateCoverage("grid", grid).ok());
  TensorMetadata cols = Grid(4, 8192, 4, 1);
  EXPECT_TRUE(ValidateCoverage("cols", cols).ok());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_LT(seconds, 5.0);  // quadratic would be ~10^8+ box compares
}

// ------------------------------------------------------------ file sizes

TEST(MetadataCodecTest, AgainstFileSizes) {
  Metadata md;
  md.tensors["w"] = RowSharded(DType::kF32, {4, 2}, 2, "data-00000.safetensors",
                               4096);  // [4096, 4112), [4112, 4128)
  md.objects["o"] = {"data-00001.safetensors", 100, 50, 0, {}};
  std::map<std::string, uint64_t> sizes = {{"data-00000.safetensors", 4128},
                                           {"data-00001.safetensors", 150}};
  EXPECT_TRUE(ValidateAgainstFileSizes(md, sizes).ok());

  auto short_sizes = sizes;
  short_sizes["data-00000.safetensors"] = 4127;
  auto status = ValidateAgainstFileSizes(md, short_sizes);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("w@2,0"));
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("data-00000.safetensors"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("offset 4112"));

  short_sizes = sizes;
  short_sizes["data-00001.safetensors"] = 149;
  status = ValidateAgainstFileSizes(md, short_sizes);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("object \"o\""));

  auto missing = sizes;
  missing.erase("data-00001.safetensors");
  status = ValidateAgainstFileSizes(md, missing);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("data-00001.safetensors"));

  // Offsets that would overflow (never produced by DecodeMetadata, but the
  // check must not wrap).
  md.objects["o"].offset = ~uint64_t{0};
  EXPECT_EQ(ValidateAgainstFileSizes(md, sizes).code(),
            absl::StatusCode::kDataLoss);
}

TEST(MetadataCodecTest, DisjointLocations) {
  Metadata md;
  md.tensors["w"] = RowSharded(DType::kF32, {4, 2}, 2, "data-00000.safetensors",
                               4096);  // [4096, 4112), [4112, 4128)
  md.tensors["v"] = RowSharded(DType::kF32, {2, 2}, 1, "data-00000.safetensors",
                               4128);  // [4128, 4144): adjacent is fine
  md.tensors["x"] = RowSharded(DType::kF32, {2, 2}, 1, "data-00001.safetensors",
                               4096);  // same offsets, other file
  md.objects["o"] = {"data-00000.safetensors", 100, 50, 0, {}};
  // Zero-byte chunks and objects share no byte, wherever they point.
  md.tensors["e"] = RowSharded(DType::kF32, {0, 2}, 1, "data-00000.safetensors",
                               4100);
  md.objects["empty"] = {"data-00000.safetensors", 4100, 0, 0, {}};
  EXPECT_TRUE(ValidateDisjointLocations(md).ok());

  // A chunk that reads another tensor's bytes: both named.
  Metadata shared = md;
  shared.tensors["v"].chunks[0].location.offset = 4112;
  absl::Status status = ValidateDisjointLocations(shared);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("\"w@2,0\""));
  EXPECT_THAT(std::string(status.message()), HasSubstr("chunk \"v\""));
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("data-00000.safetensors"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("offset 4112"));

  // One byte of overlap is enough.
  shared = md;
  shared.tensors["v"].chunks[0].location.offset = 4127;
  EXPECT_EQ(ValidateDisjointLocations(shared).code(),
            absl::StatusCode::kDataLoss);

  // An object inside a chunk.
  shared = md;
  shared.objects["o"].offset = 4100;
  shared.objects["o"].nbytes = 4;
  status = ValidateDisjointLocations(shared);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("object \"o\""));
  EXPECT_THAT(std::string(status.message()), HasSubstr("w@0,0"));

  // A long object spanning w's first chunk: the pair is named whichever
  // starts first.
  shared = md;
  shared.objects["o"].offset = 4000;
  shared.objects["o"].nbytes = 120;  // [4000, 4120)
  status = ValidateDisjointLocations(shared);
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()), HasSubstr("w@0,0"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("object \"o\""));
}

// ------------------------------------------------------------ metadata.cc

TEST(MetadataTest, NBytesAndTotalBytes) {
  TensorMetadata t;
  t.dtype = DType::kBF16;
  t.shape = {4096, 4096};
  EXPECT_EQ(t.nbytes(), uint64_t{4096} * 4096 * 2);
  t.shape = {};
  EXPECT_EQ(t.nbytes(), 2u);
  t.shape = {3, 0};
  EXPECT_EQ(t.nbytes(), 0u);
  t.shape = {int64_t{1} << 62, 8};
  EXPECT_EQ(t.nbytes(), ~uint64_t{0});  // saturates

  const Metadata md = SampleMetadata();
  uint64_t expected = 0;
  for (const auto& [fqn, tensor] : md.tensors) expected += tensor.nbytes();
  for (const auto& [fqn, object] : md.objects) expected += object.nbytes;
  EXPECT_EQ(md.total_bytes(), expected);
}

}  // namespace
}  // namespace cairn::internal_format
