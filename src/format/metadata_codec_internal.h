// What the files of the metadata.json codec (metadata_*.cc in this folder)
// share. The codec's interface is metadata_codec.h, and the helpers
// kv_codec.h declares for kv_codec.cc; its stages are one file each:
//  - metadata_encode.cc: Metadata -> text (EncodeMetadata, CheckEncodable,
//    FlatChunks);
//  - metadata_decode.cc: text -> Metadata, the tree decoder (Decoder) and
//    DecodeMetadata around both decoders (checksum, fallback);
//  - metadata_fast_decode.cc: the fast path, without a JSON tree;
//  - metadata_validate.cc: the checks of decoded metadata left to callers.
// What only one file uses stays in that file's anonymous namespace. Each
// declaration here carries the comment that stood on its definition.
#ifndef CAIRN_FORMAT_METADATA_CODEC_INTERNAL_H_
#define CAIRN_FORMAT_METADATA_CODEC_INTERNAL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cairn/metadata.h"
#include "core/checked.h"
#include "core/status.h"
#include "format/json_util.h"
#include "format/metadata_codec.h"
#include "nlohmann/json.hpp"

namespace cairn::internal_format {

// What Decoder's inline members read (and the .cc files with them).
using json_util::Describe;
using json_util::Find;
using json_util::GetUint;
using nlohmann::json;

inline constexpr char kFormatName[] = "cairn";
using internal_core::kInt64Max;

// `s` quoted for a message (escaped, cut after 256 bytes).
std::string Quote(std::string_view s);

// ---------------------------------------------------------------------------
// Encoding (metadata_encode.cc).

// metadata.tensors' entries in name order, for loops by index over them
// (on several threads), and their chunks in all.
using TensorEntry = std::pair<const std::string, TensorMetadata>;
std::vector<const TensorEntry*> TensorList(const Metadata& metadata,
                                           size_t* chunks);

// CRC32C of `text`, in pieces of at least 16 MiB on up to CpuThreads()
// threads (a 16k-rank job's metadata.json is a GB), combined.
uint32_t TextCrc32c(std::string_view text);

// ---------------------------------------------------------------------------
// Decoding (metadata_decode.cc).

// OK when `loc`'s block checksums are as many as version 3 records for its
// size under `block_bytes` (none for one block or less); with
// `block_bytes` 0 (versions 1 and 2), when it has none.
absl::Status CheckBlockCount(const ByteLocation& loc, uint64_t block_bytes);

// kDataLoss naming an FQN that is in two of tensors, objects, scalars and
// kv_tables (docs/format.md 4.1: each FQN names one leaf or table; a load
// that counts leaves by name would miscount). Decoding checks it, and so
// does encoding, so that a writer never commits what a reader refuses.
absl::Status CheckOneLeafPerFqn(const Metadata& md, std::string_view source);

// The tree decoder: nlohmann::json's tree of the text, every member
// checked. DecodeMetadata falls back to it; FastDecoder decodes scalars
// with it.
class Decoder {
 public:
  explicit Decoder(std::string_view source) : source_(AsAbsl(source)) {}

  absl::Status Error(absl::string_view where, absl::string_view what) const {
    if (where.empty()) {
      return absl::DataLossError(absl::StrCat(source_, ": ", what));
    }
    return absl::DataLossError(absl::StrCat(source_, ": ", where, ": ", what));
  }

  absl::StatusOr<Metadata> Decode(std::string_view text) const;
  absl::StatusOr<Scalar> ScalarValue(const json& j,
                                     absl::string_view where) const;
  // `block_bytes`: the metadata's crc32c_block_bytes from version 3 on
  // (block checksums are read and checked), 0 before (they are ignored).
  // Also kv_codec.cc's (DecodeLocation).
  // `chunk`: a tensor chunk's, which may be compressed (format version
  // 5); an object's or table entry's compression members are unknown ones.
  absl::StatusOr<ByteLocation> Location(const json& j, absl::string_view where,
                                        uint64_t block_bytes,
                                        bool chunk = false) const;

  // The format version being decoded (Decode sets it first): from
  // kCompressionFormatVersion on, a chunk's compression members are read.
  mutable int version_ = 0;

 private:
  // The member `key` of `object`, required.
  absl::StatusOr<const json*> Member(const json& object, const char* key,
                                     absl::string_view where) const {
    const json* value = Find(object, key);
    if (value == nullptr) {
      return Error(where, absl::StrCat("missing \"", key, "\""));
    }
    return value;
  }
  absl::StatusOr<const json*> Object(const json& object, const char* key,
                                     absl::string_view where) const {
    CAIRN_ASSIGN_OR_RETURN(const json* value, Member(object, key, where));
    if (!value->is_object()) {
      return Error(where, absl::StrCat("\"", key, "\" must be an object, got ",
                                       Describe(*value)));
    }
    return value;
  }
  absl::StatusOr<std::string> String(const json& object, const char* key,
                                     absl::string_view where) const {
    CAIRN_ASSIGN_OR_RETURN(const json* value, Member(object, key, where));
    if (!value->is_string()) {
      return Error(where, absl::StrCat("\"", key, "\" must be a string, got ",
                                       Describe(*value)));
    }
    return value->get<std::string>();
  }
  absl::StatusOr<uint64_t> Uint(const json& object, const char* key,
                                absl::string_view where) const {
    CAIRN_ASSIGN_OR_RETURN(const json* value, Member(object, key, where));
    auto v = GetUint(*value);
    if (!v) {
      return Error(
          where,
          absl::StrCat("\"", key, "\" must be an integer in [0, 2^64), got ",
                       Describe(*value)));
    }
    return *v;
  }
  // An array of integers in [0, 2^63).
  absl::StatusOr<std::vector<int64_t>> Dims(const json& object, const char* key,
                                            absl::string_view where) const {
    CAIRN_ASSIGN_OR_RETURN(const json* value, Member(object, key, where));
    if (!value->is_array()) {
      return Error(where, absl::StrCat("\"", key, "\" must be an array, got ",
                                       Describe(*value)));
    }
    std::vector<int64_t> dims;
    dims.reserve(value->size());
    for (const json& d : *value) {
      auto v = GetUint(d, kInt64Max);
      if (!v) {
        return Error(where, absl::StrCat("\"", key,
                                         "\" entries must be integers in "
                                         "[0, 2^63), got ",
                                         Describe(d)));
      }
      dims.push_back(static_cast<int64_t>(*v));
    }
    return dims;
  }

  absl::StatusOr<TensorMetadata> Tensor(const json& j, const std::string& fqn,
                                        uint64_t block_bytes) const;
  // Version 6's "references" (checked with the files, after decoding).
  absl::StatusOr<std::vector<CheckpointReference>> References(
      const json& j) const;

  absl::string_view source_;
};

// ---------------------------------------------------------------------------
// Decoding, fast path (metadata_fast_decode.cc).

// The text decoded by FastDecoder (see there), or nullopt where it gives up
// and Decoder must decode it.
std::optional<Metadata> FastDecodeMetadata(std::string_view text,
                                           std::string_view source,
                                           DecodeThreads threads);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_METADATA_CODEC_INTERNAL_H_
