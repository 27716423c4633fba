// metadata.json codec, decoding: metadata.json text -> Metadata by the tree
// decoder (Decoder), and DecodeMetadata, which checks the text's checksum,
// tries the fast path (metadata_fast_decode.cc) and falls back to Decoder.
// docs/format.md is the normative spec; this file implements its
// "metadata.json" and "Untrusted input" sections.
//
// Decoding treats the text as untrusted: nlohmann::json is used without
// exceptions (parse with allow_exceptions=false, every type checked before
// get<>), nesting is bounded before parsing, and every integer is range- and
// overflow-checked. Any rejection is kDataLoss naming the source and the FQN,
// except an unsupported version (kFailedPrecondition).
#include "format/metadata_codec.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "core/checked.h"
#include "core/parallel.h"
#include "core/status.h"
#include "format/chunk_digest.h"
#include "format/crc32c.h"
#include "format/frame_codec.h"
#include "format/json_util.h"
#include "format/kv_codec.h"
#include "format/metadata_codec_internal.h"
#include "format/names.h"
#include "format/references.h"
#include "nlohmann/json.hpp"

namespace cairn::internal_format {
namespace {

using json_util::GetInt64;

}  // namespace

std::string Quote(std::string_view s_std) {
  const absl::string_view s = AsAbsl(s_std);
  constexpr size_t kMax = 256;
  if (s.size() > kMax) {
    return absl::StrCat("\"", absl::CHexEscape(s.substr(0, kMax)), "...\"");
  }
  return absl::StrCat("\"", absl::CHexEscape(s), "\"");
}

absl::Status CheckBlockCount(const ByteLocation& loc, uint64_t block_bytes) {
  if (loc.block_crc32c.empty()) return absl::OkStatus();
  const uint64_t want =
      block_bytes == 0 ? 0 : Crc32cBlockCount(loc.nbytes, block_bytes);
  if (loc.block_crc32c.size() == want) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "\"crc32c_blocks\" has ", loc.block_crc32c.size(), " checksums; ",
      loc.nbytes, " bytes in blocks of ", block_bytes, " have ",
      want == 0 ? "none (one block or less: its crc32c is the block's)"
                : absl::StrCat(want)));
}

absl::StatusOr<ByteLocation> Decoder::Location(const json& j,
                                               absl::string_view where,
                                               uint64_t block_bytes,
                                               bool chunk) const {
  if (!j.is_object()) {
    return Error(where, absl::StrCat("must be an object, got ", Describe(j)));
  }
  ByteLocation loc;
  CAIRN_ASSIGN_OR_RETURN(loc.file, String(j, "file", where));
  // Version 6: a chunk's file may lie in a reference (4.2.2), which
  // CheckReferencedFiles checks once the references are known.
  if (absl::Status s = ValidateRelativeName(loc.file);
      !s.ok() && !(chunk && version_ >= kReferencesFormatVersion)) {
    return Error(where, s.message());
  }
  CAIRN_ASSIGN_OR_RETURN(loc.offset, Uint(j, "offset", where));
  CAIRN_ASSIGN_OR_RETURN(loc.nbytes, Uint(j, "nbytes", where));
  uint64_t end = 0;
  if (__builtin_add_overflow(loc.offset, loc.nbytes, &end)) {
    return Error(where, absl::StrCat("offset ", loc.offset, " + nbytes ",
                                     loc.nbytes, " overflows"));
  }
  CAIRN_ASSIGN_OR_RETURN(std::string hex, String(j, "crc32c", where));
  auto crc = Crc32cFromHex(hex);
  if (!crc.ok()) return Error(where, crc.status().message());
  loc.crc32c = *crc;
  const json* blocks = block_bytes > 0 ? Find(j, "crc32c_blocks") : nullptr;
  if (blocks != nullptr) {
    if (!blocks->is_string()) {
      return Error(where, absl::StrCat("\"crc32c_blocks\" must be a string, "
                                       "got ",
                                       Describe(*blocks)));
    }
    absl::StatusOr<std::vector<uint32_t>> crcs =
        Crc32cBlocksFromHex(blocks->get_ref<const std::string&>());
    if (!crcs.ok()) return Error(where, crcs.status().message());
    loc.block_crc32c = *std::move(crcs);
  }
  if (absl::Status s = CheckBlockCount(loc, block_bytes); !s.ok()) {
    return Error(where, s.message());
  }
  if (chunk && version_ >= kReferencesFormatVersion) {
    if (const json* digest = Find(j, "xxh3"); digest != nullptr) {
      CAIRN_ASSIGN_OR_RETURN(std::string hex, String(j, "xxh3", where));
      absl::StatusOr<ChunkDigest> d = DigestFromHex(hex);
      if (!d.ok()) {
        return Error(where, absl::StrCat("\"xxh3\": ", d.status().message()));
      }
      loc.xxh3 = *d;
    }
  }
  if (!chunk || version_ < kCompressionFormatVersion) return loc;
  // Format version 5: a compressed chunk (4.2.1).
  const json* codec = Find(j, "codec");
  if (codec == nullptr) return loc;
  CAIRN_ASSIGN_OR_RETURN(std::string name, String(j, "codec", where));
  absl::StatusOr<Codec> c = CodecFromName(name);
  if (!c.ok() || *c == Codec::kNone) {
    return Error(where, absl::StrCat("\"codec\" must be \"zstd\" or "
                                     "\"grouped-zstd\", got ",
                                     Describe(*codec)));
  }
  loc.compression.codec = *c;
  CAIRN_ASSIGN_OR_RETURN(loc.compression.stored_nbytes,
                         Uint(j, "stored_nbytes", where));
  for (auto [key, out] :
       {std::pair{"frame_nbytes", &loc.compression.frame_nbytes},
        std::pair{"frame_crc32c", &loc.compression.frame_crc32c}}) {
    CAIRN_ASSIGN_OR_RETURN(std::string hex, String(j, key, where));
    absl::StatusOr<std::vector<uint32_t>> groups = Crc32cBlocksFromHex(hex);
    if (!groups.ok()) {
      return Error(where, absl::StrCat("\"", key, "\": ",
                                       groups.status().message()));
    }
    *out = *std::move(groups);
  }
  if (absl::Status s = CheckCompression(loc, block_bytes); !s.ok()) {
    return Error(where, s.message());
  }
  return loc;
}

absl::StatusOr<TensorMetadata> Decoder::Tensor(const json& j,
                                               const std::string& fqn,
                                               uint64_t block_bytes) const {
  const std::string where = absl::StrCat("tensor ", Quote(fqn));
  if (!j.is_object()) {
    return Error(where, absl::StrCat("must be an object, got ", Describe(j)));
  }
  TensorMetadata tensor;
  CAIRN_ASSIGN_OR_RETURN(std::string dtype_name, String(j, "dtype", where));
  auto dtype = DTypeFromName(dtype_name);
  if (!dtype.ok()) {
    return Error(where, absl::StrCat("unknown dtype ", Quote(dtype_name)));
  }
  tensor.dtype = *dtype;
  CAIRN_ASSIGN_OR_RETURN(tensor.shape, Dims(j, "shape", where));
  if (!internal_core::CheckedBytes(tensor.shape, tensor.dtype)) {
    return Error(where, absl::StrCat("shape of ", tensor.shape.size(),
                                     " dimensions overflows"));
  }

  CAIRN_ASSIGN_OR_RETURN(const json* chunks, Member(j, "chunks", where));
  if (!chunks->is_array()) {
    return Error(where, absl::StrCat("\"chunks\" must be an array, got ",
                                     Describe(*chunks)));
  }
  tensor.chunks.reserve(chunks->size());
  for (size_t i = 0; i < chunks->size(); ++i) {
    const json& c = (*chunks)[i];
    const std::string chunk_where = absl::StrCat(where, " chunk ", i);
    if (!c.is_object()) {
      return Error(chunk_where,
                   absl::StrCat("must be an object, got ", Describe(c)));
    }
    ChunkMetadata chunk;
    CAIRN_ASSIGN_OR_RETURN(chunk.box.offsets, Dims(c, "offsets", chunk_where));
    CAIRN_ASSIGN_OR_RETURN(chunk.box.sizes, Dims(c, "sizes", chunk_where));
    if (absl::Status s = ValidateBox(chunk.box, tensor.shape); !s.ok()) {
      return Error(chunk_where,
                   absl::StrCat("box ", chunk.box.ToString(),
                                " does not fit the shape: ", s.message()));
    }
    CAIRN_ASSIGN_OR_RETURN(chunk.location,
                           Location(c, chunk_where, block_bytes,
                                    /*chunk=*/true));
    // Inside the shape, so the box's bytes cannot exceed the tensor's.
    const uint64_t expected =
        internal_core::CheckedBytes(chunk.box.sizes, tensor.dtype).value_or(0);
    if (chunk.location.nbytes != expected) {
      return Error(chunk_where,
                   absl::StrCat("nbytes ", chunk.location.nbytes, " != ",
                                expected, " (box ", chunk.box.ToString(),
                                " of ", AsAbsl(DTypeName(tensor.dtype)), ")"));
    }
    tensor.chunks.push_back(std::move(chunk));
  }
  return tensor;
}

absl::StatusOr<Scalar> Decoder::ScalarValue(const json& j,
                                            absl::string_view where) const {
  if (!j.is_object() || j.size() != 1) {
    return Error(
        where, absl::StrCat("must be an object with exactly one of \"int64\", "
                            "\"double\", \"bool\", \"string\"; got ",
                            Describe(j)));
  }
  const auto it = j.begin();
  const std::string& type = it.key();
  const json& value = it.value();
  if (type == "int64") {
    auto v = GetInt64(value);
    if (!v) {
      return Error(where,
                   absl::StrCat("\"int64\" must be a 64-bit integer, got ",
                                Describe(value)));
    }
    return Scalar(*v);
  }
  if (type == "double") {
    if (value.is_number()) return Scalar(value.get<double>());
    if (value.is_string()) {
      const std::string& s = value.get_ref<const std::string&>();
      if (s == "nan") return Scalar(std::numeric_limits<double>::quiet_NaN());
      if (s == "inf") return Scalar(std::numeric_limits<double>::infinity());
      if (s == "-inf") return Scalar(-std::numeric_limits<double>::infinity());
    }
    return Error(where, absl::StrCat("\"double\" must be a number, \"nan\", "
                                     "\"inf\" or \"-inf\", got ",
                                     Describe(value)));
  }
  if (type == "bool") {
    if (!value.is_boolean()) {
      return Error(where, absl::StrCat("\"bool\" must be true or false, got ",
                                       Describe(value)));
    }
    return Scalar(value.get<bool>());
  }
  if (type == "string") {
    if (!value.is_string()) {
      return Error(where, absl::StrCat("\"string\" must be a string, got ",
                                       Describe(value)));
    }
    return Scalar(value.get<std::string>());
  }
  return Error(where, absl::StrCat("unknown scalar type ", Quote(type)));
}

absl::StatusOr<Metadata> Decoder::Decode(std::string_view text) const {
  if (text.size() > kMaxMetadataBytes) {
    return Error(
        "", absl::StrCat("metadata of ", text.size(),
                         " bytes exceeds the limit of ", kMaxMetadataBytes));
  }
  std::string why;
  std::optional<json> parsed = json_util::Parse(text, &why);
  if (!parsed) return Error("", absl::StrCat("malformed metadata: ", why));
  const json& root = *parsed;
  if (!root.is_object()) {
    return Error("", absl::StrCat("metadata must be a JSON object, got ",
                                  Describe(root)));
  }

  // "format" and "version" first: a later version may change anything else.
  const json* format = Find(root, "format");
  if (format == nullptr || !format->is_string() ||
      format->get_ref<const std::string&>() != kFormatName) {
    return Error("", absl::StrCat("not cairn metadata (\"format\" must be \"",
                                  kFormatName, "\", got ",
                                  format ? Describe(*format) : "nothing", ")"));
  }
  const json* version = Find(root, "version");
  if (version == nullptr) return Error("", "missing \"version\"");
  auto v = GetInt64(*version);
  if (!v) {
    return Error("", absl::StrCat("\"version\" must be an integer, got ",
                                  Describe(*version)));
  }
  if (*v < kOldestReadableFormatVersion || *v > kFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        source_, ": unsupported format version ", *v,
        " (this reader supports versions ", kOldestReadableFormatVersion,
        " to ", kFormatVersion, ")"));
  }

  Metadata md;
  md.version = static_cast<int>(*v);
  CAIRN_ASSIGN_OR_RETURN(md.created_by, String(root, "created_by", ""));
  CAIRN_ASSIGN_OR_RETURN(const json* world_size,
                         Member(root, "world_size", ""));
  auto ws = GetUint(*world_size, std::numeric_limits<int>::max());
  if (!ws || *ws == 0) {
    return Error("", absl::StrCat("\"world_size\" must be an integer in "
                                  "[1, 2^31), got ",
                                  Describe(*world_size)));
  }
  md.world_size = static_cast<int>(*ws);
  if (const json* rank = Find(root, "rank"); rank != nullptr) {
    auto r = GetUint(*rank, std::numeric_limits<int>::max());
    if (!r || *r >= *ws) {
      return Error("", absl::StrCat("\"rank\" must be an integer in [0, "
                                    "world_size), got ",
                                    Describe(*rank)));
    }
    md.rank = static_cast<int>(*r);
  }
  if (const json* id = Find(root, "save_id"); id != nullptr) {
    if (!id->is_string() || !IsSaveId(id->get_ref<const std::string&>())) {
      return Error("", absl::StrCat("\"save_id\" must be a string of 1 to 64 "
                                    "characters of [0-9A-Za-z_-], got ",
                                    Describe(*id)));
    }
    md.save_id = id->get<std::string>();
  }
  version_ = md.version;
  uint64_t block_bytes = 0;  // version 3: block checksums
  if (md.version >= 3) {
    CAIRN_ASSIGN_OR_RETURN(const json* b,
                           Member(root, "crc32c_block_bytes", ""));
    auto bytes = GetUint(*b);
    if (!bytes || !ValidCrc32cBlockBytes(*bytes)) {
      return Error("", absl::StrCat("\"crc32c_block_bytes\" must be a power "
                                    "of two in [",
                                    kMinCrc32cBlockBytes, ", ",
                                    kMaxCrc32cBlockBytes, "], got ",
                                    Describe(*b)));
    }
    block_bytes = *bytes;
    md.crc32c_block_bytes = block_bytes;
  }

  if (const json* refs = Find(root, "references"); refs != nullptr) {
    if (md.version < kReferencesFormatVersion) {
      return Error("", absl::StrCat("\"references\" needs format version ",
                                    kReferencesFormatVersion,
                                    " or later; this metadata is version ",
                                    md.version));
    }
    CAIRN_ASSIGN_OR_RETURN(md.references, References(*refs));
  }

  CAIRN_ASSIGN_OR_RETURN(const json* tensors, Object(root, "tensors", ""));
  for (const auto& [fqn, value] : tensors->items()) {
    CAIRN_ASSIGN_OR_RETURN(TensorMetadata tensor,
                           Tensor(value, fqn, block_bytes));
    md.tensors.emplace(fqn, std::move(tensor));
  }

  CAIRN_ASSIGN_OR_RETURN(const json* objects, Object(root, "objects", ""));
  for (const auto& [fqn, value] : objects->items()) {
    CAIRN_ASSIGN_OR_RETURN(
        ByteLocation loc,
        Location(value, absl::StrCat("object ", Quote(fqn)), block_bytes));
    md.objects.emplace(fqn, std::move(loc));
  }

  CAIRN_ASSIGN_OR_RETURN(const json* scalars, Object(root, "scalars", ""));
  for (const auto& [fqn, value] : scalars->items()) {
    CAIRN_ASSIGN_OR_RETURN(
        Scalar scalar, ScalarValue(value, absl::StrCat("scalar ", Quote(fqn))));
    md.scalars.emplace(fqn, std::move(scalar));
  }

  if (const json* kv = Find(root, "kv_tables"); kv != nullptr) {
    if (md.version < kKvTablesFormatVersion) {
      return Error("", absl::StrCat("\"kv_tables\" needs format version ",
                                    kKvTablesFormatVersion,
                                    " or later; this metadata is version ",
                                    md.version));
    }
    CAIRN_ASSIGN_OR_RETURN(md.kv_tables,
                           DecodeKvTables(*kv, AsStd(source_), block_bytes));
  }

  CAIRN_ASSIGN_OR_RETURN(const json* structure, Member(root, "structure", ""));
  CAIRN_ASSIGN_OR_RETURN(const json* user, Object(root, "user", ""));
  try {
    // Parsed from valid UTF-8 and depth-bounded: cannot throw in practice.
    md.structure = structure->dump();
    md.user = user->dump();
  } catch (const std::exception& e) {
    return Error(
        "", absl::StrCat("cannot re-serialize structure/user: ", e.what()));
  }
  if (md.version >= kReferencesFormatVersion) {
    CAIRN_RETURN_IF_ERROR(CheckReferencedFiles(md, AsStd(source_)));
  }
  return md;
}

absl::StatusOr<std::vector<CheckpointReference>> Decoder::References(
    const json& j) const {
  if (!j.is_array()) {
    return Error("", absl::StrCat("\"references\" must be an array, got ",
                                  Describe(j)));
  }
  std::vector<CheckpointReference> refs;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string where = absl::StrCat("references[", i, "]");
    const json& r = j[i];
    if (!r.is_object()) {
      return Error(where,
                   absl::StrCat("must be an object, got ", Describe(r)));
    }
    CheckpointReference ref;
    CAIRN_ASSIGN_OR_RETURN(ref.url, String(r, "url", where));
    CAIRN_ASSIGN_OR_RETURN(ref.save_id, String(r, "save_id", where));
    CAIRN_ASSIGN_OR_RETURN(std::string hex, String(r, "checksum", where));
    absl::StatusOr<uint32_t> crc = Crc32cFromHex(hex);
    if (!crc.ok()) return Error(where, crc.status().message());
    ref.checksum = *crc;
    refs.push_back(std::move(ref));
  }
  return refs;
}

// The helper kv_codec.cc shares (format/kv_codec.h).

absl::StatusOr<ByteLocation> DecodeLocation(const json& j,
                                            std::string_view source,
                                            std::string_view where,
                                            uint64_t block_bytes) {
  return Decoder(source).Location(j, AsAbsl(where), block_bytes);
}

absl::Status CheckOneLeafPerFqn(const Metadata& md, std::string_view source) {
  auto both = [&](const std::string& fqn, const char* a, const char* b) {
    return absl::DataLossError(absl::StrCat(
        AsAbsl(source), ": ", Quote(fqn), " is in both \"", a, "\" and \"",
        b, "\" (an FQN names one leaf)"));
  };
  for (const auto& [fqn, unused] : md.objects) {
    if (md.tensors.contains(fqn)) return both(fqn, "tensors", "objects");
  }
  for (const auto& [fqn, unused] : md.scalars) {
    if (md.tensors.contains(fqn)) return both(fqn, "tensors", "scalars");
    if (md.objects.contains(fqn)) return both(fqn, "objects", "scalars");
  }
  for (const auto& [fqn, unused] : md.kv_tables) {
    if (md.tensors.contains(fqn)) return both(fqn, "tensors", "kv_tables");
    if (md.objects.contains(fqn)) return both(fqn, "objects", "kv_tables");
    if (md.scalars.contains(fqn)) return both(fqn, "scalars", "kv_tables");
  }
  return absl::OkStatus();
}

absl::StatusOr<Metadata> DecodeMetadata(std::string_view json_text,
                                        std::string_view source) {
  return DecodeMetadata(json_text, source,
                        DecodeThreads{internal_core::CpuThreads()});
}

namespace {

// Whether `text` opens with a checksum member (`{"checksum":`), after
// checking it: kDataLoss when that member is malformed or its CRC32C is not
// the rest of the text's.
absl::StatusOr<bool> CheckChecksum(std::string_view text,
                                   std::string_view source) {
  // `{"checksum":` (the prefix without its opening quote) claims one; the
  // rest of the member must be exactly as written.
  if (!text.starts_with(
          kChecksumKeyPrefix.substr(0, kChecksumKeyPrefix.size() - 1))) {
    return false;
  }
  const auto lower_hex = [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  };
  const std::string_view hex = text.substr(
      std::min(text.size(), kChecksumKeyPrefix.size()), 8);
  if (text.size() < kChecksumPrefixBytes ||
      !text.starts_with(kChecksumKeyPrefix) ||
      !std::all_of(hex.begin(), hex.end(), lower_hex) ||
      text.substr(kChecksumPrefixBytes - 2, 2) != "\",") {
    return absl::DataLossError(absl::StrCat(
        AsAbsl(source), ": malformed checksum member at the start of the metadata "
                "(expected {\"checksum\":\"<8 lower-case hex digits>\", got ",
        Quote(text.substr(0, kChecksumPrefixBytes)), ")"));
  }
  // Eight lower-case hex digits always parse.
  const uint32_t stored = *Crc32cFromHex(hex);
  const uint32_t computed = TextCrc32c(text.substr(kChecksumPrefixBytes));
  if (computed != stored) {
    return absl::DataLossError(absl::StrCat(
        AsAbsl(source), ": metadata checksum mismatch: stored ", Crc32cToHex(stored),
        ", computed ", Crc32cToHex(computed), " over bytes ",
        kChecksumPrefixBytes, "..", text.size(),
        ": the file changed after it was written (damaged, truncated or "
        "edited)"));
  }
  return true;
}

// The checksum check around a decoder: the checksum first (a damaged text is
// reported as damaged, whatever else it breaks), and version 2 must have
// one. Then the checks that look across the decoded fields.
template <typename Decode>
absl::StatusOr<Metadata> Checked(std::string_view text, std::string_view source,
                                 Decode decode) {
  // Too long to look at: the decoder's own size error, before any CRC.
  if (text.size() > kMaxMetadataBytes) return Decoder(source).Decode(text);
  CAIRN_ASSIGN_OR_RETURN(const bool sealed, CheckChecksum(text, source));
  CAIRN_ASSIGN_OR_RETURN(Metadata md, decode());
  if (md.version >= 2 && !sealed) {
    return absl::DataLossError(absl::StrCat(
        AsAbsl(source), ": metadata of format version ", md.version,
        " must begin with its checksum ({\"checksum\":\"<8 lower-case hex "
        "digits>\",): "
        "the file is damaged or was not written by cairn"));
  }
  CAIRN_RETURN_IF_ERROR(CheckOneLeafPerFqn(md, source));
  return md;
}

}  // namespace

absl::StatusOr<Metadata> DecodeMetadata(std::string_view json_text,
                                        std::string_view source,
                                        DecodeThreads threads) {
  return Checked(json_text, source, [&]() -> absl::StatusOr<Metadata> {
    if (std::optional<Metadata> md =
            FastDecodeMetadata(json_text, source, threads)) {
      return *std::move(md);
    }
    return Decoder(source).Decode(json_text);
  });
}

absl::StatusOr<Metadata> DecodeMetadataWithTreeForTesting(
    std::string_view json_text, std::string_view source) {
  return Checked(json_text, source,
                 [&] { return Decoder(source).Decode(json_text); });
}

absl::StatusOr<std::string> WithMetadataChecksum(std::string_view json_text) {
  std::string_view rest = json_text;
  if (rest.starts_with(kChecksumKeyPrefix) &&
      rest.size() >= kChecksumPrefixBytes) {
    rest.remove_prefix(kChecksumPrefixBytes);
  } else if (rest.starts_with('{')) {
    rest.remove_prefix(1);
  } else {
    return absl::InvalidArgumentError(
        "metadata text must begin with '{' to take a checksum");
  }
  std::string text(kChecksumKeyPrefix);
  text += Crc32cToHex(TextCrc32c(rest));
  text += "\",";
  text += rest;
  return text;
}

}  // namespace cairn::internal_format
