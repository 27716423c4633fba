// metadata.json, the one file every rank of a load reads and trusts to
// place every byte: the fast decoder (and its split over threads) must give
// what the nlohmann tree decoder gives, the same Metadata or the same
// error, on any text; and what decodes must encode and decode back to
// itself. A text that opens with a checksum is also decoded with the
// checksum recomputed, so that mutations reach the decoders behind it;
// as it is, a version 2 text decodes only with its checksum matching.
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/metadata.h"
#include "format/metadata_codec.h"
#include "fuzz/fuzz_target.h"

namespace cairn::fuzz {
namespace {

using internal_format::DecodeMetadata;
using internal_format::DecodeMetadataWithTreeForTesting;
using internal_format::DecodeThreads;
using internal_format::EncodeMetadata;

constexpr char kSource[] = "fuzz/metadata.json";

// Same metadata, comparing through the encoder when operator== cannot
// (a NaN scalar is not equal to itself).
bool Same(const Metadata& a, const Metadata& b) {
  if (a == b) return true;
  absl::StatusOr<std::string> ea = EncodeMetadata(a);
  absl::StatusOr<std::string> eb = EncodeMetadata(b);
  return ea.ok() && eb.ok() && *ea == *eb;
}

void ExpectSameResult(const absl::StatusOr<Metadata>& got,
                      const absl::StatusOr<Metadata>& want, const char* what) {
  CAIRN_FUZZ_CHECK(got.ok() == want.ok(),
                   absl::StrCat(what, ": ", got.status().ToString(),
                                "\ntree: ", want.status().ToString()));
  if (got.ok()) {
    CAIRN_FUZZ_CHECK(Same(*got, *want), absl::StrCat(what, ": other metadata"));
  } else {
    CAIRN_FUZZ_CHECK(got.status() == want.status(),
                     absl::StrCat(what, ": ", got.status().ToString(),
                                  "\ntree: ", want.status().ToString()));
  }
}

std::vector<std::string> Seeds() {
  Metadata md;
  md.created_by = "cairn 0.1.0";
  md.world_size = 2;
  TensorMetadata rows;
  rows.dtype = DType::kF32;
  rows.shape = {4, 3};
  rows.chunks.push_back({Box{{0, 0}, {2, 3}},
                         ByteLocation{"data-00000.safetensors", 64, 24, 7, {}}});
  rows.chunks.push_back({Box{{2, 0}, {2, 3}},
                         ByteLocation{"data-00001.safetensors", 64, 24, 9, {}}});
  md.tensors["model.w"] = rows;
  TensorMetadata scalar;
  scalar.dtype = DType::kBF16;
  scalar.chunks.push_back(
      {Box{{}, {}}, ByteLocation{"data-00000.safetensors", 88, 2, 3, {}}});
  md.tensors["model.s"] = scalar;
  TensorMetadata empty;
  empty.dtype = DType::kI64;
  empty.shape = {0, 5};
  empty.chunks.push_back(
      {Box{{0, 0}, {0, 5}}, ByteLocation{"data-00001.safetensors", 0, 0, 0, {}}});
  md.tensors["empty"] = empty;
  md.objects["rng"] = {"data-00001.safetensors", 88, 16, 0xdeadbeef, {}};
  md.scalars["step"] = int64_t{100};
  md.scalars["lr"] = 0.5;
  md.scalars["flag"] = true;
  md.scalars["name"] = std::string("run \"7\"\n");
  md.structure = R"({"model":{"w":"T","s":"T"},"step":"S"})";
  md.user = R"({"note":[1,2.5,null]})";
  std::vector<std::string> seeds;
  seeds.push_back(*EncodeMetadata(md));
  Metadata local = md;
  local.rank = 1;
  local.tensors.erase("model.s");
  seeds.push_back(*EncodeMetadata(local));
  Metadata v1 = md;
  v1.version = 1;  // no checksum
  seeds.push_back(*EncodeMetadata(v1));
  // Version 4: a key-value table of 3 interleaved buckets, 3 rows in two
  // chunks of ids and one F32 [2] column each.
  Metadata kv = md;
  KvTableMetadata& table = kv.kv_tables["emb"];
  table.spec.num_buckets = 3;
  table.spec.bucketing = KvBucketing::kInterleaved;
  table.spec.columns = {{"w", DType::kF32, 2}};
  table.buckets = {0, 3};
  table.rows_per_bucket = {2, 0, 1};
  table.chunks.push_back(
      {{0, 2},
       ByteLocation{"data-00000.safetensors", 200, 16, 1, {}},
       {ByteLocation{"data-00000.safetensors", 216, 16, 2, {}}}});
  table.chunks.push_back(
      {{2, 3},
       ByteLocation{"data-00001.safetensors", 200, 8, 3, {}},
       {ByteLocation{"data-00001.safetensors", 208, 8, 4, {}}}});
  seeds.push_back(*EncodeMetadata(kv));
  // Version 6: chunk digests, and a chunk kept in a referenced checkpoint.
  Metadata incremental = md;
  incremental.save_id = "s2";
  incremental.references.push_back({"../step-1", 0x1234abcd, "s1"});
  incremental.references.push_back({"s3://bucket/run/step-0", 7, "s0"});
  incremental.tensors["model.w"].chunks[0].location.file =
      "../step-1/data-00000-s1.safetensors";
  incremental.tensors["model.w"].chunks[1].location.file =
      "s3://bucket/run/step-0/data-00001-s0.safetensors";
  for (auto& [fqn, t] : incremental.tensors) {
    for (ChunkMetadata& c : t.chunks) {
      c.location.xxh3 = ChunkDigest{0x0123456789abcdefULL, 42};
    }
  }
  seeds.push_back(*EncodeMetadata(incremental));
  return seeds;
}

void DecodeAndCompare(std::string_view data) {
  const absl::StatusOr<Metadata> tree =
      DecodeMetadataWithTreeForTesting(data, kSource);
  ExpectSameResult(DecodeMetadata(data, kSource, DecodeThreads{}), tree,
                   "fast decoder");
  // Split between tensors into parts as small as 64 bytes, on two threads.
  ExpectSameResult(
      DecodeMetadata(data, kSource,
                     DecodeThreads{.threads = 2, .min_bytes = 0,
                                   .min_part_bytes = 64}),
      tree, "split decoder");
  if (!tree.ok()) return;
  CAIRN_FUZZ_CHECK(tree->version < 2 ||
                       data.starts_with(internal_format::kChecksumKeyPrefix),
                   "version 2 metadata decoded without its checksum");
  (void)internal_format::ValidateAllCoverage(*tree);
  absl::StatusOr<std::string> text = EncodeMetadata(*tree);
  CAIRN_FUZZ_CHECK(text.ok(), absl::StrCat("decoded metadata does not encode: ",
                                           text.status().ToString()));
  absl::StatusOr<Metadata> again = DecodeMetadata(*text, kSource);
  CAIRN_FUZZ_CHECK(again.ok(), absl::StrCat("encoded metadata does not decode: ",
                                            again.status().ToString()));
  CAIRN_FUZZ_CHECK(Same(*again, *tree), "round trip changed the metadata");
}

}  // namespace

CAIRN_FUZZ_TARGET(metadata, &Seeds) {
  DecodeAndCompare(data);
  if (data.starts_with(internal_format::kChecksumKeyPrefix) &&
      data.size() >= internal_format::kChecksumPrefixBytes) {
    absl::StatusOr<std::string> sealed =
        internal_format::WithMetadataChecksum(data);
    CAIRN_FUZZ_CHECK(sealed.ok(), sealed.status().ToString());
    DecodeAndCompare(*sealed);
  }
}

}  // namespace cairn::fuzz
