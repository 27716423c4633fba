// metadata.json codec. docs/format.md is the normative spec; this file
// implements its "metadata.json" and "Untrusted input" sections.
//
// Decoding treats the text as untrusted: nlohmann::json is used without
// exceptions (parse with allow_exceptions=false, every type checked before
// get<>), nesting is bounded before parsing, and every integer is range- and
// overflow-checked. Any rejection is kDataLoss naming the source and the FQN,
// except an unsupported version (kFailedPrecondition).
#include "format/metadata_codec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "core/checked.h"
#include "core/flatten.h"
#include "core/parallel.h"
#include "core/status.h"
#include "format/chunk_digest.h"
#include "format/crc32c.h"
#include "format/frame_codec.h"
#include "format/json_util.h"
#include "format/kv_codec.h"
#include "format/names.h"
#include "format/plain_json.h"
#include "format/references.h"
#include "nlohmann/json.hpp"

namespace cairn::internal_format {
namespace {

using json_util::Describe;
using json_util::Find;
using json_util::GetInt64;
using json_util::GetUint;
using nlohmann::json;

constexpr char kFormatName[] = "cairn";
using internal_core::kInt64Max;

std::string Quote(std::string_view s_std) {
  const absl::string_view s = AsAbsl(s_std);
  constexpr size_t kMax = 256;
  if (s.size() > kMax) {
    return absl::StrCat("\"", absl::CHexEscape(s.substr(0, kMax)), "...\"");
  }
  return absl::StrCat("\"", absl::CHexEscape(s), "\"");
}

// ---------------------------------------------------------------- encoding

// metadata.json is written as text directly, byte for byte what
// nlohmann::json's dump() of the same document gives (compact, keys sorted,
// strings escaped by its rules): building that document first costs a heap
// node per value, gigabytes and seconds for the millions of chunks of a
// save at 16k ranks. The text is written twice through the same templates:
// first to count the bytes of its head, of each tensor and of its tail,
// then each part at its offset in a string of the whole size (the tensors
// on several threads when there are many chunks).

// Sink that counts the bytes it is given. (Each sink takes literals as
// arrays, so that their copies have a size known when compiling.)
class CountingSink {
 public:
  void Put(char) { ++size_; }
  void Put(std::string_view s) { size_ += s.size(); }
  template <size_t N>
  void Put(const char (&)[N]) {
    size_ += N - 1;
  }
  void Skip(size_t n) { size_ += n; }
  size_t size() const { return size_; }

 private:
  size_t size_ = 0;
};

template <typename Sink, typename Int>
void PutInt(Sink& sink, Int v) {
  char buf[24];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  sink.Put(std::string_view(buf, end - buf));
}
// Counting needs only the number of characters.
template <typename Int>
void PutInt(CountingSink& sink, Int v) {
  uint64_t u = static_cast<uint64_t>(v);
  size_t n = 1;
  if constexpr (std::is_signed_v<Int>) {
    if (v < 0) {
      u = uint64_t{0} - u;  // the magnitude, INT64_MIN included
      ++n;                  // '-'
    }
  }
  for (; u >= 10; u /= 10) ++n;
  sink.Skip(n);
}

// A JSON string as nlohmann's dump writes it. Printable ASCII other than
// '"' and '\\' (every FQN and file name cairn writes in practice) is copied
// as is; anything else is escaped by nlohmann itself, so its rules (control
// characters, UTF-8 passed through) and its error for invalid UTF-8 are
// exactly the same.
template <typename Sink>
absl::Status PutString(Sink& sink, std::string_view s) {
  const bool plain = std::all_of(s.begin(), s.end(), [](char c) {
    const unsigned char u = static_cast<unsigned char>(c);
    return u >= 0x20 && u < 0x80 && c != '"' && c != '\\';
  });
  if (plain) {
    sink.Put('"');
    sink.Put(s);
    sink.Put('"');
    return absl::OkStatus();
  }
  try {
    sink.Put(json(std::string(s)).dump(-1, ' ', false,
                                      json::error_handler_t::strict));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata contains a string that is not valid UTF-8: ", e.what()));
  }
  return absl::OkStatus();
}

// `"key":`; keys are literals here, plain ASCII.
template <typename Sink, size_t N>
void PutKey(Sink& sink, const char (&key)[N]) {
  sink.Put('"');
  sink.Put(key);
  sink.Put("\":");
}

template <typename Sink>
void PutDims(Sink& sink, std::span<const int64_t> dims) {
  sink.Put('[');
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) sink.Put(',');
    PutInt(sink, dims[i]);
  }
  sink.Put(']');
}

// The members of a location, without braces; ",offsets..." may follow.
// `put_file()` writes the file's name as a JSON string.
template <typename Sink, typename PutFile>
absl::Status PutLocationMembers(Sink& sink, uint32_t crc32c,
                                std::span<const uint32_t> blocks,
                                PutFile put_file, uint64_t nbytes,
                                uint64_t offset,
                                const Compression* compression = nullptr) {
  // Crc32cToHex's "%08x", without a format call per chunk.
  static constexpr char kHex[] = "0123456789abcdef";
  char crc[8];
  auto put_groups = [&](std::span<const uint32_t> values) {
    for (uint32_t b : values) {
      for (int i = 0; i < 8; ++i) crc[i] = kHex[(b >> (28 - 4 * i)) & 0xf];
      sink.Put(std::string_view(crc, sizeof crc));
    }
  };
  const bool compressed =
      compression != nullptr && compression->codec != Codec::kNone;
  if (compressed) {
    // Format version 5 (4.2.1); "stored_nbytes" follows "sizes".
    sink.Put("\"codec\":\"");
    sink.Put(CodecName(compression->codec));
    sink.Put("\",");
  }
  sink.Put("\"crc32c\":\"");
  for (int i = 0; i < 8; ++i) crc[i] = kHex[(crc32c >> (28 - 4 * i)) & 0xf];
  sink.Put(std::string_view(crc, sizeof crc));
  if (!blocks.empty()) {
    // Format version 3's block checksums, one 8-digit group each.
    sink.Put("\",\"crc32c_blocks\":\"");
    put_groups(blocks);
  }
  sink.Put("\",\"file\":");
  CAIRN_RETURN_IF_ERROR(put_file());
  if (compressed) {
    sink.Put(",\"frame_crc32c\":\"");
    put_groups(compression->frame_crc32c);
    sink.Put("\",\"frame_nbytes\":\"");
    put_groups(compression->frame_nbytes);
    sink.Put('"');
  }
  sink.Put(",\"nbytes\":");
  PutInt(sink, nbytes);
  sink.Put(",\"offset\":");
  PutInt(sink, offset);
  return absl::OkStatus();
}
// Sink that appends to a string.
class StringSink {
 public:
  void Put(char c) { text_.push_back(c); }
  void Put(std::string_view s) { text_.append(s); }
  std::string Take() { return std::move(text_); }

 private:
  std::string text_;
};
// PutString's text of `s`, or its error.
absl::StatusOr<std::string> Quoted(std::string_view s) {
  StringSink sink;
  CAIRN_RETURN_IF_ERROR(PutString(sink, s));
  return sink.Take();
}
template <typename Sink>
absl::Status PutLocationMembers(Sink& sink, const ByteLocation& loc) {
  return PutLocationMembers(
      sink, loc.crc32c, loc.block_crc32c,
      [&] { return PutString(sink, loc.file); }, loc.nbytes, loc.offset);
}

// metadata.tensors' entries in name order, for loops by index over them
// (on several threads), and their chunks in all.
using TensorEntry = std::pair<const std::string, TensorMetadata>;
std::vector<const TensorEntry*> TensorList(const Metadata& metadata,
                                           size_t* chunks) {
  std::vector<const TensorEntry*> tensors;
  tensors.reserve(metadata.tensors.size());
  *chunks = 0;
  for (const TensorEntry& entry : metadata.tensors) {
    tensors.push_back(&entry);
    *chunks += entry.second.chunks.size();
  }
  return tensors;
}

// CRC32C of `text`, in pieces of at least 16 MiB on up to CpuThreads()
// threads (a 16k-rank job's metadata.json is a GB), combined.
uint32_t TextCrc32c(std::string_view text) {
  constexpr size_t kMinPiece = size_t{16} << 20;
  const int pieces = static_cast<int>(std::clamp<size_t>(
      text.size() / kMinPiece, 1, internal_core::CpuThreads()));
  if (pieces == 1) return Crc32c(text.data(), text.size());
  const size_t step = text.size() / pieces;
  std::vector<uint32_t> crcs(pieces);
  // The lambda cannot fail.
  (void)internal_core::ParallelFor(pieces, pieces, [&](int64_t i) {
    const size_t begin = i * step;
    const size_t end = i + 1 == pieces ? text.size() : begin + step;
    crcs[i] = Crc32c(text.data() + begin, end - begin);
    return absl::OkStatus();
  });
  uint32_t crc = crcs[0];
  for (int i = 1; i < pieces; ++i) {
    const size_t size = i + 1 == pieces ? text.size() - i * step : step;
    crc = Crc32cCombine(crc, crcs[i], size);
  }
  return crc;
}

// The parts of the document that are already text.
struct Prepared {
  // In metadata.scalars order: the value's text, or why it has none.
  std::vector<absl::StatusOr<std::string>> scalars;
  std::string structure;
  std::string user;
  // The "kv_tables" value (EncodeKvTables), empty when there are none.
  std::string kv_tables;
};

// Sink that writes into memory sized beforehand (by a CountingSink).
class PointerSink {
 public:
  explicit PointerSink(char* at) : at_(at) {}
  void Put(char c) { *at_++ = c; }
  void Put(std::string_view s) {
    std::memcpy(at_, s.data(), s.size());
    at_ += s.size();
  }
  template <size_t N>
  void Put(const char (&s)[N]) {
    std::memcpy(at_, s, N - 1);
    at_ += N - 1;
  }

 private:
  char* at_;
};

// One member of "tensors": `"fqn":{...}`, with a leading ',' unless first;
// its chunks from `tensor`, or with `flat`, flat's chunks of tensor `t`
// (their files' names quoted in `flat_files`, one per flat->files).
template <typename Sink>
absl::Status PutTensor(
    Sink& sink, const std::string& fqn, const TensorMetadata& tensor,
    bool first, const FlatChunks* flat, size_t t,
    const std::vector<absl::StatusOr<std::string>>& flat_files) {
  if (!first) sink.Put(',');
  CAIRN_RETURN_IF_ERROR(PutString(sink, fqn));
  sink.Put(":{");
  PutKey(sink, "chunks");
  sink.Put('[');
  // One chunk: `{location,"offsets":[..],"sizes":[..]}`, after a ','
  // unless first.
  auto put_chunk = [&sink](bool first, uint32_t crc32c,
                           std::span<const uint32_t> blocks, auto put_file,
                           uint64_t nbytes, uint64_t offset,
                           std::span<const int64_t> offsets,
                           std::span<const int64_t> sizes,
                           const Compression* compression,
                           const ChunkDigest* digest) -> absl::Status {
    if (!first) sink.Put(',');
    sink.Put('{');
    CAIRN_RETURN_IF_ERROR(PutLocationMembers(sink, crc32c, blocks, put_file,
                                             nbytes, offset, compression));
    sink.Put(",\"offsets\":");
    PutDims(sink, offsets);
    sink.Put(",\"sizes\":");
    PutDims(sink, sizes);
    if (compression != nullptr && compression->codec != Codec::kNone) {
      sink.Put(",\"stored_nbytes\":");
      PutInt(sink, compression->stored_nbytes);
    }
    if (digest != nullptr) {
      // Format version 6 (4.2.2).
      sink.Put(",\"xxh3\":\"");
      sink.Put(std::string_view(DigestToHex(*digest)));
      sink.Put('"');
    }
    sink.Put('}');
    return absl::OkStatus();
  };
  if (flat == nullptr) {
    for (size_t c = 0; c < tensor.chunks.size(); ++c) {
      const ChunkMetadata& chunk = tensor.chunks[c];
      const ByteLocation& loc = chunk.location;
      CAIRN_RETURN_IF_ERROR(put_chunk(
          c == 0, loc.crc32c, loc.block_crc32c,
          [&] { return PutString(sink, loc.file); },
          loc.nbytes, loc.offset, chunk.box.offsets, chunk.box.sizes,
          &loc.compression, loc.xxh3 ? &*loc.xxh3 : nullptr));
    }
  } else {
    const size_t rank = tensor.shape.size();
    const int64_t* dims = flat->dims.data() + flat->dims_at[t];
    for (size_t c = flat->first[t]; c < flat->first[t + 1]; ++c) {
      const absl::StatusOr<std::string>& file = flat_files[flat->file[c]];
      CAIRN_RETURN_IF_ERROR(put_chunk(
          c == flat->first[t], flat->crc32c[c], flat->BlocksOf(c),
          [&] {
            if (file.ok()) sink.Put(std::string_view(*file));
            return file.status();
          },
          flat->nbytes[c], flat->offset[c],
          std::span<const int64_t>(dims, rank),
          std::span<const int64_t>(dims + rank, rank),
          flat->CompressionOf(c), flat->DigestOf(c)));
      dims += 2 * rank;
    }
  }
  sink.Put("],");
  PutKey(sink, "dtype");
  CAIRN_RETURN_IF_ERROR(PutString(sink, DTypeName(tensor.dtype)));
  sink.Put(',');
  PutKey(sink, "shape");
  PutDims(sink, tensor.shape);
  sink.Put('}');
  return absl::OkStatus();
}

// The document is its head, the members of "tensors" (PutTensor) and its
// tail. Members in key order: checksum (version 2), crc32c_block_bytes
// (version 3), created_by, format, kv_tables (version 4, when there are
// tables), objects, rank, references (version 6, when there are any),
// save_id, scalars, structure, tensors, user,
// version, world_size.
template <typename Sink>
absl::Status PutHead(Sink& sink, const Metadata& md, const Prepared& prepared) {
  // Version 2 opens with its checksum, written as zeros here and filled in
  // when the whole text is there (Encode).
  if (md.version >= 2) {
    sink.Put("{\"checksum\":\"00000000\",");
  } else {
    sink.Put('{');
  }
  if (md.version >= 3) {  // sorts after "checksum", before "created_by"
    PutKey(sink, "crc32c_block_bytes");
    PutInt(sink, md.crc32c_block_bytes);
    sink.Put(',');
  }
  PutKey(sink, "created_by");
  CAIRN_RETURN_IF_ERROR(PutString(sink, md.created_by));
  sink.Put(',');
  PutKey(sink, "format");
  CAIRN_RETURN_IF_ERROR(PutString(sink, kFormatName));
  sink.Put(',');
  if (!prepared.kv_tables.empty()) {
    PutKey(sink, "kv_tables");
    sink.Put(std::string_view(prepared.kv_tables));
    sink.Put(',');
  }
  PutKey(sink, "objects");
  sink.Put('{');
  bool first = true;
  for (const auto& [fqn, loc] : md.objects) {
    if (!first) sink.Put(',');
    first = false;
    CAIRN_RETURN_IF_ERROR(PutString(sink, fqn));
    sink.Put(":{");
    CAIRN_RETURN_IF_ERROR(PutLocationMembers(sink, loc));
    sink.Put('}');
  }
  sink.Put("},");
  if (md.rank >= 0) {
    PutKey(sink, "rank");
    PutInt(sink, md.rank);
    sink.Put(',');
  }
  if (!md.references.empty()) {
    // Format version 6 (4.2.2), in the order the save found them.
    PutKey(sink, "references");
    sink.Put('[');
    for (size_t i = 0; i < md.references.size(); ++i) {
      const CheckpointReference& r = md.references[i];
      if (i > 0) sink.Put(',');
      sink.Put("{\"checksum\":\"");
      sink.Put(std::string_view(Crc32cToHex(r.checksum)));
      sink.Put("\",\"save_id\":");
      CAIRN_RETURN_IF_ERROR(PutString(sink, r.save_id));
      sink.Put(",\"url\":");
      CAIRN_RETURN_IF_ERROR(PutString(sink, r.url));
      sink.Put('}');
    }
    sink.Put("],");
  }
  if (!md.save_id.empty()) {
    PutKey(sink, "save_id");
    CAIRN_RETURN_IF_ERROR(PutString(sink, md.save_id));
    sink.Put(',');
  }
  PutKey(sink, "scalars");
  sink.Put('{');
  first = true;
  size_t s = 0;
  for (const auto& [fqn, unused] : md.scalars) {
    if (!first) sink.Put(',');
    first = false;
    CAIRN_RETURN_IF_ERROR(PutString(sink, fqn));
    sink.Put(':');
    const absl::StatusOr<std::string>& value = prepared.scalars[s++];
    CAIRN_RETURN_IF_ERROR(value.status());
    sink.Put(*value);
  }
  sink.Put("},");
  PutKey(sink, "structure");
  sink.Put(prepared.structure);
  sink.Put(',');
  PutKey(sink, "tensors");
  sink.Put('{');
  return absl::OkStatus();
}

template <typename Sink>
void PutTail(Sink& sink, const Metadata& md, const Prepared& prepared) {
  sink.Put("},");
  PutKey(sink, "user");
  sink.Put(prepared.user);
  sink.Put(',');
  PutKey(sink, "version");
  PutInt(sink, md.version);
  sink.Put(',');
  PutKey(sink, "world_size");
  PutInt(sink, md.world_size);
  sink.Put('}');
}

json EncodeScalar(const Scalar& scalar) {
  json j = json::object();
  std::visit(
      [&j](const auto& v) {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          j["int64"] = v;
        } else if constexpr (std::is_same_v<T, double>) {
          if (std::isnan(v)) {
            j["double"] = "nan";
          } else if (std::isinf(v)) {
            j["double"] = v > 0 ? "inf" : "-inf";
          } else {
            j["double"] = v;
          }
        } else if constexpr (std::is_same_v<T, bool>) {
          j["bool"] = v;
        } else {
          j["string"] = v;
        }
      },
      scalar);
  return j;
}

// ---------------------------------------------------------------- decoding

// OK when `loc`'s block checksums are as many as version 3 records for its
// size under `block_bytes` (none for one block or less); with
// `block_bytes` 0 (versions 1 and 2), when it has none.
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

// ------------------------------------------------------ decoding, fast path

// Decodes metadata.json as EncodeMetadata writes it straight into Metadata,
// with no JSON tree: the tree costs a heap node per value (about ten times
// the text in memory) and most of the time, and every rank of a load decodes
// the whole file. It accepts a strict subset of what Decoder accepts (any
// member order and JSON whitespace, strings of printable ASCII without
// escapes, plain non-negative integers) and for it yields what Decoder
// yields: the same checks are made, and any value it does not take apart
// itself (structure, user, scalars) goes through nlohmann and Decoder as
// before. On anything else (escapes, non-ASCII, unknown or repeated
// members, other number forms, any error) it gives up, and Decoder decodes
// the text, giving the result or the error it always gave.
class FastDecoder : private PlainJsonCursor {
 public:
  FastDecoder(std::string_view text, std::string_view source,
              DecodeThreads threads = {})
      : PlainJsonCursor(text), source_(source), threads_(threads) {}

  std::optional<Metadata> Decode();

 private:
  // Root members, by bit.
  enum Member : uint32_t {
    kFormat = 1,
    kVersion = 2,
    kCreatedBy = 4,
    kWorldSize = 8,
    kRank = 16,
    kTensors = 32,
    kObjects = 64,
    kScalars = 128,
    kStructure = 256,
    kUser = 512,
    kChecksum = 1024,
    kSaveId = 2048,
    kBlockBytes = 4096,
    kKvTables = 8192,
    kReferences = 16384,
  };
  static constexpr uint32_t kRequired = kFormat | kVersion | kCreatedBy |
                                        kWorldSize | kTensors | kObjects |
                                        kScalars | kStructure | kUser;

  // The text of any JSON value, found by matching brackets outside strings;
  // nlohmann checks it when it parses it.
  bool RawValue(std::string_view* out) {
    SkipSpace();
    const char* start = p_;
    int depth = 0;
    while (p_ < end_) {
      const char c = *p_;
      if (c == '"') {
        for (++p_; p_ < end_ && *p_ != '"'; ++p_) {
          if (*p_ == '\\') ++p_;
        }
        if (p_ >= end_) return false;
        ++p_;
      } else if (c == '{' || c == '[') {
        ++depth;
        ++p_;
      } else if (c == '}' || c == ']') {
        if (depth == 0) break;  // the end of the enclosing object
        --depth;
        ++p_;
      } else if (depth == 0 && (c == ',' || c == ' ' || c == '\n' ||
                                c == '\r' || c == '\t')) {
        break;
      } else {
        ++p_;
      }
      // A string or container at the top ends the value.
      if (depth == 0 && (c == '"' || c == '}' || c == ']')) break;
    }
    if (depth != 0 || p_ == start) return false;
    *out = std::string_view(start, p_ - start);
    // Decoder refuses text nested deeper than kMaxJsonDepth; this value
    // sits one level inside the root.
    return json_util::NestingDepth(*out, json_util::kMaxJsonDepth) + 1 <=
           json_util::kMaxJsonDepth;
  }
  // A JSON value's text re-serialized as Decoder stores structure and user.
  bool Dumped(bool object, std::string* out) {
    std::string_view raw;
    if (!RawValue(&raw)) return false;
    std::optional<json> value = json_util::Parse(raw);
    if (!value || (object && !value->is_object())) return false;
    try {
      *out = value->dump();
    } catch (const std::exception&) {
      return false;
    }
    return true;
  }

  // A location's members as they are read, checked once all are in.
  struct PendingLocation {
    PendingLocation(ByteLocation* l, bool c) : location(l), chunk(c) {}
    ByteLocation* location;
    bool chunk;  // a tensor chunk's (else an object's)
    std::string_view file;
    std::string_view xxh3;  // version 6: checked as it is read
    std::string_view crc;
    std::string_view blocks;  // crc32c_blocks, checked after the root
    // Format version 5's compression members (4.2.1), checked after the
    // root too (CheckCompression).
    std::string_view codec;
    std::string_view frame_crc32c;
    std::string_view frame_nbytes;
    uint32_t seen = 0;
  };
  bool LocationMember(std::string_view key, PendingLocation* pending);
  bool FinishLocation(const PendingLocation& pending);
  bool Location(ByteLocation* loc);
  bool Chunk(ChunkMetadata* chunk);
  bool Tensor(TensorMetadata* tensor);
  bool Tensors(std::map<std::string, TensorMetadata>* tensors);
  bool TensorsInParallel(std::map<std::string, TensorMetadata>* tensors);
  bool Scalars(std::map<std::string, Scalar>* scalars);

  std::string_view source_;
  DecodeThreads threads_;
  // The previous tensor's chunk count, reserved for the next one's (every
  // tensor usually has as many chunks as ranks saved it).
  size_t chunks_hint_ = 0;
};

bool FastDecoder::LocationMember(std::string_view key, PendingLocation* pending) {
  uint32_t bit = 0;
  bool ok = false;
  if (key == "file") {
    bit = 1, ok = String(&pending->file);
  } else if (key == "offset") {
    bit = 2, ok = Uint(&pending->location->offset);
  } else if (key == "nbytes") {
    bit = 4, ok = Uint(&pending->location->nbytes);
  } else if (key == "crc32c") {
    bit = 8, ok = String(&pending->crc);
  } else if (key == "crc32c_blocks") {
    bit = 16, ok = String(&pending->blocks);
  } else if (key == "codec") {
    bit = 32, ok = String(&pending->codec);
  } else if (key == "frame_crc32c") {
    bit = 64, ok = String(&pending->frame_crc32c);
  } else if (key == "frame_nbytes") {
    bit = 128, ok = String(&pending->frame_nbytes);
  } else if (key == "stored_nbytes") {
    bit = 256, ok = Uint(&pending->location->compression.stored_nbytes);
  } else if (key == "xxh3") {
    bit = 512, ok = String(&pending->xxh3);
  }
  if (!ok || (pending->seen & bit)) return false;
  pending->seen |= bit;
  return true;
}

// Decoder::Location's checks.
bool FastDecoder::FinishLocation(const PendingLocation& pending) {
  ByteLocation& loc = *pending.location;
  uint64_t end = 0;
  // A chunk's file may lie in a reference (version 6), which Decode checks
  // once the references and the version are known.
  if ((pending.seen & 15) != 15 ||
      (!pending.chunk && !ValidateRelativeName(pending.file).ok()) ||
      __builtin_add_overflow(loc.offset, loc.nbytes, &end)) {
    return false;
  }
  if (pending.seen & 512) {
    // Version 6's digest; an object's makes this text Decoder's.
    absl::StatusOr<ChunkDigest> digest = DigestFromHex(pending.xxh3);
    if (!pending.chunk || !digest.ok()) return false;
    loc.xxh3 = *digest;
  }
  absl::StatusOr<uint32_t> crc = Crc32cFromHex(pending.crc);
  if (!crc.ok()) return false;
  loc.file = std::string(pending.file);
  loc.crc32c = *crc;
  if (pending.seen & 16) {
    // Their count is checked once the block size is known (Decode).
    absl::StatusOr<std::vector<uint32_t>> blocks =
        Crc32cBlocksFromHex(pending.blocks);
    if (!blocks.ok()) return false;
    loc.block_crc32c = *std::move(blocks);
  }
  // Compression: all four members or none. Decode checks them once the
  // version and block size are known; an object's make this text Decoder's.
  constexpr uint32_t kCompressed = 32 | 64 | 128 | 256;
  if (pending.seen & kCompressed) {
    if ((pending.seen & kCompressed) != kCompressed) return false;
    absl::StatusOr<Codec> codec = CodecFromName(pending.codec);
    absl::StatusOr<std::vector<uint32_t>> crcs =
        Crc32cBlocksFromHex(pending.frame_crc32c);
    absl::StatusOr<std::vector<uint32_t>> sizes =
        Crc32cBlocksFromHex(pending.frame_nbytes);
    if (!codec.ok() || *codec == Codec::kNone || !crcs.ok() || !sizes.ok()) {
      return false;
    }
    loc.compression.codec = *codec;
    loc.compression.frame_crc32c = *std::move(crcs);
    loc.compression.frame_nbytes = *std::move(sizes);
  }
  return true;
}

bool FastDecoder::Location(ByteLocation* loc) {
  PendingLocation pending{loc, /*chunk=*/false};
  return Members([&](std::string_view key) {
           return LocationMember(key, &pending);
         }) &&
         FinishLocation(pending) && !loc->compressed();
}

bool FastDecoder::Chunk(ChunkMetadata* chunk) {
  PendingLocation pending{&chunk->location, /*chunk=*/true};
  bool offsets = false;
  bool sizes = false;
  return Members([&](std::string_view key) {
           if (key == "offsets") {
             return !std::exchange(offsets, true) && Dims(&chunk->box.offsets);
           }
           if (key == "sizes") {
             return !std::exchange(sizes, true) && Dims(&chunk->box.sizes);
           }
           return LocationMember(key, &pending);
         }) &&
         offsets && sizes && FinishLocation(pending);
}

bool FastDecoder::Tensor(TensorMetadata* tensor) {
  bool chunks = false;
  bool shape = false;
  std::optional<std::string_view> dtype_name;
  const bool parsed = Members([&](std::string_view key) {
    if (key == "dtype") {
      std::string_view name;
      if (dtype_name || !String(&name)) return false;
      dtype_name = name;
      return true;
    }
    if (key == "shape") {
      return !std::exchange(shape, true) && Dims(&tensor->shape);
    }
    if (key == "chunks") {
      if (std::exchange(chunks, true) || !Take('[')) return false;
      if (Take(']')) return true;
      do {
        if (tensor->chunks.empty()) tensor->chunks.reserve(chunks_hint_);
        if (!Chunk(&tensor->chunks.emplace_back())) return false;
      } while (Take(','));
      return Take(']');
    }
    return false;
  });
  if (!parsed || !dtype_name || !shape || !chunks) return false;
  chunks_hint_ = tensor->chunks.size();
  // Decoder::Tensor's checks, once dtype and shape are known (the members
  // may come in any order).
  absl::StatusOr<DType> dtype = DTypeFromName(*dtype_name);
  if (!dtype.ok()) return false;
  tensor->dtype = *dtype;
  if (!internal_core::CheckedBytes(tensor->shape, tensor->dtype)) return false;
  for (const ChunkMetadata& c : tensor->chunks) {
    if (!ValidateBox(c.box, tensor->shape).ok() ||
        c.location.nbytes !=
            internal_core::CheckedBytes(c.box.sizes, tensor->dtype)
                .value_or(0)) {
      return false;
    }
  }
  return true;
}

bool FastDecoder::Tensors(std::map<std::string, TensorMetadata>* tensors) {
  if (threads_.threads > 1 &&
      static_cast<size_t>(end_ - p_) >= threads_.min_bytes) {
    const char* const start = p_;
    if (TensorsInParallel(tensors)) return true;
    // Not split (or not plain where it was split): the whole member again,
    // in one pass, which decides.
    tensors->clear();
    p_ = start;
  }
  if (threads_.parts_used != nullptr) *threads_.parts_used = 1;
  return Members([&](std::string_view fqn) {
    auto [it, inserted] = tensors->try_emplace(std::string(fqn));
    return inserted && Tensor(&it->second);
  });
}

// The members of "tensors" decoded in parts, one per thread, then put in
// the map in text order: the same map, or false. The text is split where
// a tensor's member seems to end and the next one's to begin: after `]},`
// and before `"` (EncodeMetadata ends every tensor with its "shape" array),
// guesses taken at even steps through the text. Each part decodes members
// from its start until it has passed the next part's start, and a guess is
// only trusted when the part before it (itself starting at a trusted
// place, the first at the object's start) ended a member exactly there.
// So a `]},"` inside a name, or a text written with other member orders,
// makes this return false, never a different result. Tensors are not
// split, so a text with few tensors gets few parts.
bool FastDecoder::TensorsInParallel(
    std::map<std::string, TensorMetadata>* tensors) {
  if (!Take('{')) return false;
  SkipSpace();
  const char* const first = p_;
  const size_t bytes = static_cast<size_t>(end_ - first);
  const size_t max_parts = std::clamp<size_t>(
      bytes / std::max<size_t>(threads_.min_part_bytes, 1), 1,
      static_cast<size_t>(threads_.threads));
  constexpr std::string_view kBoundary = "]},\"";
  std::vector<const char*> starts = {first};
  for (size_t k = 1; k < max_parts; ++k) {
    const char* from = first + bytes / max_parts * k;
    if (from <= starts.back()) continue;
    const void* hit = memmem(from, static_cast<size_t>(end_ - from),
                             kBoundary.data(), kBoundary.size());
    if (hit == nullptr) break;
    const char* start = static_cast<const char*>(hit) + kBoundary.size() - 1;
    if (start > starts.back()) starts.push_back(start);
  }
  if (starts.size() < 2) return false;

  struct Part {
    std::vector<std::pair<std::string_view, TensorMetadata>> members;
    const char* end = nullptr;  // after the object's '}' (the last part)
    bool ok = false;
  };
  std::vector<Part> parts(starts.size());
  const std::string_view text(first, bytes);
  (void)internal_core::ParallelFor(
      static_cast<int64_t>(parts.size()), static_cast<int>(parts.size()),
      [&](int64_t k) {
        Part& part = parts[k];
        const bool last = static_cast<size_t>(k) + 1 == starts.size();
        const char* const stop = last ? nullptr : starts[k + 1];
        FastDecoder decoder(text, source_);
        decoder.p_ = starts[k];
        while (true) {
          std::string_view fqn;
          auto& member = part.members.emplace_back();
          if (!decoder.String(&fqn) || !decoder.Take(':') ||
              !decoder.Tensor(&member.second)) {
            break;
          }
          member.first = fqn;
          if (decoder.Take(',')) {
            decoder.SkipSpace();
            if (stop != nullptr && decoder.p_ >= stop) {
              part.ok = decoder.p_ == stop;
              break;
            }
            continue;
          }
          if (last && decoder.Take('}')) {
            part.end = decoder.p_;
            part.ok = true;
          }
          break;
        }
        return absl::OkStatus();
      });
  for (const Part& part : parts) {
    if (!part.ok) return false;
  }
  // In text order, as the one-pass decode inserts them; a repeated name is
  // refused as there.
  for (Part& part : parts) {
    for (auto& [fqn, tensor] : part.members) {
      const size_t before = tensors->size();
      tensors->try_emplace(tensors->end(), std::string(fqn), std::move(tensor));
      if (tensors->size() == before) return false;
    }
  }
  p_ = parts.back().end;
  if (threads_.parts_used != nullptr) *threads_.parts_used = parts.size();
  return true;
}

bool FastDecoder::Scalars(std::map<std::string, Scalar>* scalars) {
  std::string_view raw;
  if (!RawValue(&raw)) return false;
  std::optional<json> value = json_util::Parse(raw);
  if (!value || !value->is_object()) return false;
  const Decoder decoder(source_);
  for (const auto& [fqn, v] : value->items()) {
    absl::StatusOr<Scalar> scalar = decoder.ScalarValue(v, "");
    if (!scalar.ok()) return false;
    scalars->emplace(fqn, *std::move(scalar));
  }
  return true;
}

std::optional<Metadata> FastDecoder::Decode() {
  Metadata md;
  uint32_t seen = 0;
  uint64_t version = 0;
  uint64_t world_size = 0;
  uint64_t rank = 0;
  uint64_t block_bytes = 0;
  std::string_view kv_tables;  // decoded once the version is known
  std::string_view references;  // likewise
  auto once = [&seen](uint32_t bit) {
    if (seen & bit) return false;
    seen |= bit;
    return true;
  };
  const bool parsed = Members([&](std::string_view key) {
    if (key == "format") {
      std::string_view format;
      return once(kFormat) && String(&format) && format == kFormatName;
    }
    if (key == "version") return once(kVersion) && Uint(&version);
    if (key == "checksum") {
      // Checked against the text before decoding (CheckChecksum).
      std::string_view checksum;
      return once(kChecksum) && String(&checksum);
    }
    if (key == "created_by") {
      std::string_view created_by;
      if (!once(kCreatedBy) || !String(&created_by)) return false;
      md.created_by = std::string(created_by);
      return true;
    }
    if (key == "world_size") return once(kWorldSize) && Uint(&world_size);
    if (key == "rank") return once(kRank) && Uint(&rank);
    if (key == "crc32c_block_bytes") {
      return once(kBlockBytes) && Uint(&block_bytes);
    }
    if (key == "save_id") {
      std::string_view id;
      if (!once(kSaveId) || !String(&id) || !IsSaveId(id)) return false;
      md.save_id = std::string(id);
      return true;
    }
    if (key == "tensors") return once(kTensors) && Tensors(&md.tensors);
    if (key == "objects") {
      return once(kObjects) && Members([&](std::string_view fqn) {
               auto [it, inserted] =
                   md.objects.try_emplace(std::string(fqn));
               return inserted && Location(&it->second);
             });
    }
    if (key == "scalars") return once(kScalars) && Scalars(&md.scalars);
    if (key == "kv_tables") return once(kKvTables) && RawValue(&kv_tables);
    if (key == "references") {
      return once(kReferences) && RawValue(&references);
    }
    if (key == "structure") {
      return once(kStructure) && Dumped(false, &md.structure);
    }
    if (key == "user") return once(kUser) && Dumped(true, &md.user);
    return false;
  });
  SkipSpace();
  if (!parsed || p_ != end_ || (seen & kRequired) != kRequired ||
      version < static_cast<uint64_t>(kOldestReadableFormatVersion) ||
      version > static_cast<uint64_t>(kFormatVersion) || world_size == 0 ||
      world_size > static_cast<uint64_t>(std::numeric_limits<int>::max()) ||
      ((seen & kRank) && rank >= world_size)) {
    return std::nullopt;
  }
  md.version = static_cast<int>(version);
  md.world_size = static_cast<int>(world_size);
  if (seen & kRank) md.rank = static_cast<int>(rank);
  // Block checksums: version 3 requires the block size and checks every
  // location's count; before version 3 they are unknown members, which
  // Decoder ignores (so it decodes such a text).
  if (md.version >= 3) {
    if (!(seen & kBlockBytes) || !ValidCrc32cBlockBytes(block_bytes)) {
      return std::nullopt;
    }
    md.crc32c_block_bytes = block_bytes;
  } else if (seen & kBlockBytes) {
    return std::nullopt;
  }
  const uint64_t b = md.version >= 3 ? block_bytes : 0;
  // Version 6: references, each exactly the three members a writer gives.
  if (seen & kReferences) {
    if (md.version < kReferencesFormatVersion) return std::nullopt;
    std::optional<json> value = json_util::Parse(references);
    if (!value || !value->is_array()) return std::nullopt;
    for (const json& r : *value) {
      if (!r.is_object() || r.size() != 3) return std::nullopt;
      const json* url = Find(r, "url");
      const json* id = Find(r, "save_id");
      const json* checksum = Find(r, "checksum");
      if (url == nullptr || id == nullptr || checksum == nullptr ||
          !url->is_string() || !id->is_string() || !checksum->is_string()) {
        return std::nullopt;
      }
      absl::StatusOr<uint32_t> crc =
          Crc32cFromHex(checksum->get_ref<const std::string&>());
      if (!crc.ok()) return std::nullopt;
      md.references.push_back({url->get<std::string>(),
                               *crc, id->get<std::string>()});
    }
  }
  const bool digests = md.version >= kReferencesFormatVersion;
  for (auto& [fqn, tensor] : md.tensors) {
    for (ChunkMetadata& c : tensor.chunks) {
      // Before version 6 a digest is an unknown member, which Decoder
      // ignores; a file name of a reference is refused.
      if (!digests) {
        c.location.xxh3.reset();
        if (!ValidateRelativeName(c.location.file).ok()) return std::nullopt;
      }
      if (!CheckBlockCount(c.location, b).ok()) return std::nullopt;
      // Compression members before version 5 are unknown ones, which
      // Decoder ignores.
      if (c.location.compressed() &&
          (md.version < kCompressionFormatVersion ||
           !CheckCompression(c.location, b).ok())) {
        return std::nullopt;
      }
    }
  }
  for (const auto& [fqn, loc] : md.objects) {
    if (!CheckBlockCount(loc, b).ok()) return std::nullopt;
  }
  // Key-value tables (version 4): small, decoded from nlohmann's tree as
  // Decoder decodes them.
  if (seen & kKvTables) {
    if (md.version < kKvTablesFormatVersion) return std::nullopt;
    std::optional<json> value = json_util::Parse(kv_tables);
    if (!value) return std::nullopt;
    absl::StatusOr<KvTables> tables = DecodeKvTables(*value, source_, b);
    if (!tables.ok()) return std::nullopt;
    md.kv_tables = *std::move(tables);
  }
  if (digests && !CheckReferencedFiles(md, source_).ok()) return std::nullopt;
  return md;
}

// Half-open overlap of two boxes of the same rank that lie inside one shape
// (so the ends cannot overflow).
template <typename B>  // Box or FlatBox
bool Overlaps(const B& a, const B& b) {
  for (size_t d = 0; d < a.sizes.size(); ++d) {
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] ||
        b.offsets[d] >= a.offsets[d] + a.sizes[d]) {
      return false;
    }
  }
  return true;
}

std::string ChunkName(std::string_view fqn, const Shape& shape,
                      const Box& box) {
  return EntryName(fqn, box, box == Box::Full(shape));
}

}  // namespace

// The helpers kv_codec.cc shares (format/kv_codec.h).

std::string QuoteForMessage(std::string_view s) { return Quote(s); }

absl::StatusOr<std::string> JsonString(std::string_view s) { return Quoted(s); }

absl::Status AppendLocation(std::string& out, const ByteLocation& location) {
  StringSink sink;
  sink.Put('{');
  CAIRN_RETURN_IF_ERROR(PutLocationMembers(sink, location));
  sink.Put('}');
  out += sink.Take();
  return absl::OkStatus();
}

absl::StatusOr<ByteLocation> DecodeLocation(const json& j,
                                            std::string_view source,
                                            std::string_view where,
                                            uint64_t block_bytes) {
  return Decoder(source).Location(j, AsAbsl(where), block_bytes);
}

namespace {

// kDataLoss naming an FQN that is in two of tensors, objects, scalars and
// kv_tables (docs/format.md 4.1: each FQN names one leaf or table; a load
// that counts leaves by name would miscount). Decoding checks it, and so
// does encoding, so that a writer never commits what a reader refuses.
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

// The version check and the parts of the text EncodeMetadata embeds as
// JSON values, normalised; with `scalars`, each scalar's text as well.
absl::StatusOr<Prepared> Prepare(const Metadata& metadata, bool scalars) {
  if (metadata.version < kOldestReadableFormatVersion ||
      metadata.version > kFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot encode metadata version ", metadata.version,
        "; this writer writes versions ", kOldestReadableFormatVersion, " to ",
        kFormatVersion));
  }
  if (!metadata.kv_tables.empty() &&
      metadata.version < kKvTablesFormatVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key-value tables need format version ", kKvTablesFormatVersion,
        "; the metadata is version ", metadata.version));
  }
  if (!metadata.references.empty()) {
    if (metadata.version < kReferencesFormatVersion) {
      return absl::InvalidArgumentError(absl::StrCat(
          "references need format version ", kReferencesFormatVersion,
          "; the metadata is version ", metadata.version));
    }
    CAIRN_RETURN_IF_ERROR(
        ValidateReferences(metadata.references, metadata.save_id));
  }
  if (absl::Status s = CheckOneLeafPerFqn(metadata, "metadata"); !s.ok()) {
    return absl::InvalidArgumentError(s.message());
  }
  std::string why;
  std::optional<json> structure = json_util::Parse(metadata.structure, &why);
  if (!structure) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata.structure is not valid JSON: ", why));
  }
  std::optional<json> user = json_util::Parse(metadata.user, &why);
  if (!user || !user->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata.user must be the text of a JSON object",
        user ? "" : absl::StrCat(": ", why)));
  }
  Prepared prepared;
  try {
    // Parsed from valid UTF-8 and depth-bounded: these cannot throw.
    prepared.structure =
        structure->dump(-1, ' ', false, json::error_handler_t::strict);
    prepared.user = user->dump(-1, ' ', false, json::error_handler_t::strict);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata contains a string that is not valid UTF-8: ", e.what()));
  }
  if (!scalars) return prepared;
  if (!metadata.kv_tables.empty()) {
    CAIRN_ASSIGN_OR_RETURN(prepared.kv_tables,
                           EncodeKvTables(metadata.kv_tables));
  }
  // A scalar's text, or (a string scalar that is not UTF-8) the error
  // dump() gives, reported when the text reaches it.
  prepared.scalars.reserve(metadata.scalars.size());
  for (const auto& [fqn, scalar] : metadata.scalars) {
    try {
      prepared.scalars.push_back(EncodeScalar(scalar).dump(
          -1, ' ', false, json::error_handler_t::strict));
    } catch (const json::exception& e) {
      prepared.scalars.push_back(absl::InvalidArgumentError(absl::StrCat(
          "metadata contains a string that is not valid UTF-8: ", e.what())));
    }
  }
  return prepared;
}

}  // namespace

absl::Status CheckEncodable(const Metadata& metadata) {
  CAIRN_RETURN_IF_ERROR(Prepare(metadata, /*scalars=*/false).status());
  CountingSink sink;
  CAIRN_RETURN_IF_ERROR(PutString(sink, metadata.created_by));
  for (const auto& [fqn, unused] : metadata.objects) {
    CAIRN_RETURN_IF_ERROR(PutString(sink, fqn));
  }
  for (const auto& [fqn, unused] : metadata.tensors) {
    CAIRN_RETURN_IF_ERROR(PutString(sink, fqn));
  }
  for (const auto& [fqn, unused] : metadata.scalars) {
    CAIRN_RETURN_IF_ERROR(PutString(sink, fqn));
  }
  return CheckKvTablesEncodable(metadata.kv_tables);
}

namespace {

absl::StatusOr<std::string> Encode(const Metadata& metadata,
                                   const FlatChunks* flat, uint64_t max_bytes) {
  CAIRN_ASSIGN_OR_RETURN(Prepared prepared, Prepare(metadata, /*scalars=*/true));
  // Block checksums exist from version 3 on, in blocks of a valid size.
  if (metadata.version >= 3 &&
      !ValidCrc32cBlockBytes(metadata.crc32c_block_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "crc32c_block_bytes ", metadata.crc32c_block_bytes,
        " is not a power of two in [", kMinCrc32cBlockBytes, ", ",
        kMaxCrc32cBlockBytes, "]"));
  }
  if (metadata.version < 3) {
    bool blocks = flat != nullptr && flat->block_bytes != 0;
    for (const auto& [fqn, tensor] : metadata.tensors) {
      for (const ChunkMetadata& c : tensor.chunks) {
        blocks |= !c.location.block_crc32c.empty();
      }
    }
    for (const auto& [fqn, loc] : metadata.objects) {
      blocks |= !loc.block_crc32c.empty();
    }
    if (blocks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block checksums need format version 3; the metadata is version ",
          metadata.version));
    }
  }
  if (flat != nullptr &&
      (flat->num_tensors() != metadata.tensors.size() ||
       flat->dims_at.size() != flat->num_tensors() ||
       flat->file.size() != flat->num_chunks() ||
       flat->offset.size() != flat->num_chunks() ||
       flat->nbytes.size() != flat->num_chunks() ||
       flat->crc32c.size() != flat->num_chunks())) {
    return absl::InternalError(absl::StrFormat(
        "flat chunks of %d tensors (%d chunks, %d locations) for metadata of "
        "%d tensors",
        flat->num_tensors(), flat->num_chunks(), flat->file.size(),
        metadata.tensors.size()));
  }
  if (flat != nullptr) {
    size_t t = 0;
    for (const auto& [fqn, tensor] : metadata.tensors) {
      const size_t need = flat->dims_at[t] + 2 * tensor.shape.size() *
                                                 (flat->first[t + 1] -
                                                  flat->first[t]);
      if (flat->first[t + 1] < flat->first[t] || need > flat->dims.size()) {
        return absl::InternalError(
            absl::StrCat("flat chunks of tensor ", fqn, " out of range"));
      }
      ++t;
    }
    for (uint32_t f : flat->file) {
      if (f >= flat->files.size()) {
        return absl::InternalError("flat chunk location with no file");
      }
    }
  }
  // Each tensor's text is counted, then written at its offset, on several
  // threads when there are many chunks (a 16k-rank job's metadata.json is
  // a GB): errors are the first in document order either way.
  size_t chunks = 0;
  const std::vector<const TensorEntry*> tensors = TensorList(metadata, &chunks);
  if (flat != nullptr) chunks = flat->num_chunks();
  const int threads = internal_core::ThreadsFor(chunks);
  // Each data file's name quoted once, not once per chunk and pass.
  std::vector<absl::StatusOr<std::string>> flat_files;
  if (flat != nullptr) {
    flat_files.reserve(flat->files.size());
    for (const std::string& file : flat->files) {
      flat_files.push_back(Quoted(file));
    }
  }
  CountingSink head_counter;
  CAIRN_RETURN_IF_ERROR(PutHead(head_counter, metadata, prepared));
  std::vector<size_t> at(tensors.size() + 1, 0);
  CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
      static_cast<int64_t>(tensors.size()), threads, [&](int64_t t) {
        CountingSink c;
        CAIRN_RETURN_IF_ERROR(PutTensor(c, tensors[t]->first,
                                        tensors[t]->second, t == 0, flat,
                                        static_cast<size_t>(t), flat_files));
        at[t + 1] = c.size();
        return absl::OkStatus();
      }));
  at[0] = head_counter.size();
  for (size_t t = 0; t < tensors.size(); ++t) at[t + 1] += at[t];
  CountingSink tail_counter;
  PutTail(tail_counter, metadata, prepared);
  const size_t size = at.back() + tail_counter.size();
  if (size + 1 > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "metadata.json would be %d bytes (%d tensors, %d chunks), more than "
        "the %d bytes a load accepts: save with fewer, larger chunks (fewer "
        "ranks per tensor) or save rank-local checkpoints",
        size + 1, metadata.tensors.size(), chunks, max_bytes));
  }
  std::string text(size + 1, '\n');
  PointerSink head(text.data());
  CAIRN_RETURN_IF_ERROR(PutHead(head, metadata, prepared));
  CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
      static_cast<int64_t>(tensors.size()), threads, [&](int64_t t) {
        PointerSink sink(text.data() + at[t]);
        return PutTensor(sink, tensors[t]->first, tensors[t]->second, t == 0,
                         flat, static_cast<size_t>(t), flat_files);
      }));
  PointerSink tail(text.data() + at.back());
  PutTail(tail, metadata, prepared);
  if (metadata.version >= 2) {
    const std::string hex =
        Crc32cToHex(TextCrc32c(std::string_view(text).substr(kChecksumPrefixBytes)));
    text.replace(kChecksumKeyPrefix.size(), hex.size(), hex);
  }
  return text;
}

}  // namespace

namespace {

// Metadata made from files cairn did not write never becomes a
// metadata.json: the file would claim checksums it does not have.
absl::Status CheckNotImported(const Metadata& metadata) {
  if (metadata.has_checksums) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "metadata of files without checksums (", metadata.created_by,
      ") cannot be written as metadata.json; save the tensors instead"));
}

}  // namespace

absl::StatusOr<std::string> EncodeMetadata(const Metadata& metadata,
                                           uint64_t max_bytes) {
  CAIRN_RETURN_IF_ERROR(CheckNotImported(metadata));
  return Encode(metadata, nullptr, max_bytes);
}

absl::StatusOr<std::string> EncodeMetadata(const Metadata& metadata,
                                           const FlatChunks& flat,
                                           uint64_t max_bytes) {
  CAIRN_RETURN_IF_ERROR(CheckNotImported(metadata));
  return Encode(metadata, &flat, max_bytes);
}

Box FlatChunks::BoxOf(size_t t, size_t c, size_t rank) const {
  const int64_t* d = dims.data() + dims_at[t] + 2 * rank * (c - first[t]);
  return Box{std::vector<int64_t>(d, d + rank),
             std::vector<int64_t>(d + rank, d + 2 * rank)};
}

void FlatChunks::ResizeLocations() {
  const size_t n = num_chunks();
  file.assign(n, 0);
  offset.assign(n, 0);
  nbytes.assign(n, 0);
  crc32c.assign(n, 0);
  xxh3.clear();  // none until a commit fills them (AssembleMetadata)
  block_at.assign(n, kNoBlocks);
  if (files.empty()) files.emplace_back();
  blocks.assign(files.size(), {});
}

const ChunkDigest* FlatChunks::DigestOf(size_t c) const {
  return c < xxh3.size() ? &xxh3[c] : nullptr;
}

const Compression* FlatChunks::CompressionOf(size_t c) const {
  auto it = compression.find(c);
  return it == compression.end() ? nullptr : &it->second;
}

std::span<const uint32_t> FlatChunks::BlocksOf(size_t c) const {
  if (block_bytes == 0 || c >= block_at.size() || block_at[c] == kNoBlocks ||
      file[c] >= blocks.size()) {
    return {};
  }
  const std::vector<uint32_t>& all = blocks[file[c]];
  const uint64_t n = Crc32cBlockCount(nbytes[c], block_bytes);
  if (block_at[c] > all.size() || n > all.size() - block_at[c]) return {};
  return std::span<const uint32_t>(all.data() + block_at[c], n);
}

Metadata WithFlatChunks(Metadata metadata, const FlatChunks& flat) {
  size_t t = 0;
  for (auto& [fqn, tensor] : metadata.tensors) {
    if (t >= flat.num_tensors()) break;
    tensor.chunks.clear();
    tensor.chunks.reserve(flat.first[t + 1] - flat.first[t]);
    for (size_t c = flat.first[t]; c < flat.first[t + 1]; ++c) {
      ChunkMetadata chunk;
      chunk.box = flat.BoxOf(t, c, tensor.shape.size());
      if (c < flat.file.size() && flat.file[c] < flat.files.size()) {
        const std::span<const uint32_t> b = flat.BlocksOf(c);
        chunk.location =
            ByteLocation{flat.files[flat.file[c]], flat.offset[c],
                         flat.nbytes[c], flat.crc32c[c],
                         std::vector<uint32_t>(b.begin(), b.end())};
        if (const Compression* z = flat.CompressionOf(c); z != nullptr) {
          chunk.location.compression = *z;
        }
        if (const ChunkDigest* d = flat.DigestOf(c); d != nullptr) {
          chunk.location.xxh3 = *d;
        }
      }
      tensor.chunks.push_back(std::move(chunk));
    }
    ++t;
  }
  return metadata;
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
            FastDecoder(json_text, source, threads).Decode()) {
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

// Plan: every chunk inside the shape; no two non-empty chunks overlap; the
// volumes sum to the tensor's. Inside + disjoint + equal volume == exact
// tiling. The overlap test sweeps along the dimension with the most distinct
// chunk offsets, comparing each chunk only with the chunks still "open" at
// its start along that dimension: for the usual row, column and grid
// shardings that is a handful, so thousands of chunks cost O(n log n).
// (Adversarial layouts can still make it quadratic; it stays correct.)
absl::Status ValidateCoverage(std::string_view fqn,
                              const TensorMetadata& tensor) {
  std::vector<const Box*> boxes;
  boxes.reserve(tensor.chunks.size());
  for (const ChunkMetadata& chunk : tensor.chunks) boxes.push_back(&chunk.box);
  return ValidateCoverage(fqn, tensor.shape, boxes);
}

absl::Status ValidateAllCoverage(const Metadata& metadata) {
  size_t chunks = 0;
  const std::vector<const TensorEntry*> tensors = TensorList(metadata, &chunks);
  return internal_core::ParallelFor(
      static_cast<int64_t>(tensors.size()), internal_core::ThreadsFor(chunks),
      [&](int64_t t) {
        return ValidateCoverage(tensors[t]->first, tensors[t]->second);
      });
}

namespace {

// A box of FlatChunks, in place: what Coverage reads of a Box.
struct FlatBox {
  std::span<const int64_t> offsets;
  std::span<const int64_t> sizes;
  bool empty() const {
    return std::find(sizes.begin(), sizes.end(), 0) != sizes.end();
  }
};
const Box& AsBox(const Box& box) { return box; }
Box AsBox(const FlatBox& box) {
  return Box{std::vector<int64_t>(box.offsets.begin(), box.offsets.end()),
             std::vector<int64_t>(box.sizes.begin(), box.sizes.end())};
}
absl::Status CheckBox(const Box& box, const Shape& shape) {
  return ValidateBox(box, shape);
}
// Whether the box lies inside the shape, without a Box; ValidateBox's
// message (from a Box made only then) when not. ValidateBox also refuses a
// shape whose element count overflows, which Coverage refuses right after
// ("shape overflows"): same verdict, another message.
absl::Status CheckBox(const FlatBox& box, const Shape& shape) {
  bool inside = box.sizes.size() == shape.size();
  for (size_t d = 0; inside && d < shape.size(); ++d) {
    int64_t end = 0;
    inside = box.offsets[d] >= 0 && box.sizes[d] >= 0 &&
             !__builtin_add_overflow(box.offsets[d], box.sizes[d], &end) &&
             end <= shape[d];
  }
  if (inside) return absl::OkStatus();
  absl::Status s = ValidateBox(AsBox(box), shape);
  return s.ok() ? absl::InvalidArgumentError("box lies outside the shape") : s;
}
// Elements of a box that lies inside a shape whose elements do not
// overflow (so neither do its).
uint64_t Volume(const Box& box) {
  return internal_core::CheckedBytes(box.sizes, DType::kU8).value_or(0);
}
uint64_t Volume(const FlatBox& box) {
  uint64_t v = 1;
  for (int64_t s : box.sizes) v *= static_cast<uint64_t>(s);
  return v;
}

template <typename B>
absl::Status Coverage(std::string_view fqn, const Shape& shape,
                      std::span<const B* const> all_boxes) {
  const std::string where = absl::StrCat("tensor ", Quote(fqn));
  for (const B* box : all_boxes) {
    if (absl::Status s = CheckBox(*box, shape); !s.ok()) {
      return absl::DataLossError(absl::StrCat(
          where, ": chunk ", ChunkName(fqn, shape, AsBox(*box)), " ",
          AsBox(*box).ToString(), " lies outside the shape: ", s.message()));
    }
  }
  std::optional<uint64_t> total_opt = internal_core::CheckedBytes(shape, DType::kU8);
  if (!total_opt) {
    return absl::DataLossError(absl::StrCat(where, ": shape overflows"));
  }
  const uint64_t total = *total_opt;

  std::vector<const B*> boxes;
  boxes.reserve(all_boxes.size());
  for (const B* box : all_boxes) {
    if (!box->empty()) boxes.push_back(box);
  }
  auto overlap_error = [&](const B& a, const B& b) {
    return absl::DataLossError(absl::StrCat(where, ": chunks ",
                                            AsBox(a).ToString(), " and ",
                                            AsBox(b).ToString(), " overlap"));
  };
  const size_t rank = shape.size();
  if (rank == 0) {
    if (boxes.size() > 1) return overlap_error(*boxes[0], *boxes[1]);
  } else if (boxes.size() > 1) {
    size_t sweep_dim = 0;
    size_t most_distinct = 0;
    std::vector<int64_t> starts(boxes.size());
    for (size_t d = 0; d < rank; ++d) {
      for (size_t i = 0; i < boxes.size(); ++i)
        starts[i] = boxes[i]->offsets[d];
      std::sort(starts.begin(), starts.end());
      const size_t distinct = static_cast<size_t>(
          std::unique(starts.begin(), starts.end()) - starts.begin());
      if (distinct > most_distinct) {
        most_distinct = distinct;
        sweep_dim = d;
      }
    }
    std::sort(boxes.begin(), boxes.end(),
              [sweep_dim](const B* a, const B* b) {
                return a->offsets[sweep_dim] < b->offsets[sweep_dim];
              });
    std::vector<const B*> open;
    for (const B* box : boxes) {
      const int64_t start = box->offsets[sweep_dim];
      // Drop chunks that end at or before this one starts.
      size_t kept = 0;
      for (const B* o : open) {
        if (o->offsets[sweep_dim] + o->sizes[sweep_dim] > start)
          open[kept++] = o;
      }
      open.resize(kept);
      for (const B* o : open) {
        if (Overlaps(*o, *box)) return overlap_error(*o, *box);
      }
      open.push_back(box);
    }
  }

  // Disjoint boxes inside the shape: the sum cannot exceed `total`.
  uint64_t covered = 0;
  for (const B* box : boxes) covered += Volume(*box);
  if (covered != total) {
    return absl::DataLossError(absl::StrCat(
        where, ": chunks cover ", covered, " of ", total, " elements; ",
        total - covered, " elements are in no chunk"));
  }
  return absl::OkStatus();
}


}  // namespace

absl::Status ValidateCoverage(std::string_view fqn, const Shape& shape,
                              const FlatChunks& flat, size_t t) {
  const size_t rank = shape.size();
  std::vector<FlatBox> boxes;
  std::vector<const FlatBox*> pointers;
  boxes.reserve(flat.first[t + 1] - flat.first[t]);
  pointers.reserve(boxes.capacity());
  const int64_t* d = flat.dims.data() + flat.dims_at[t];
  for (size_t c = flat.first[t]; c < flat.first[t + 1]; ++c, d += 2 * rank) {
    boxes.push_back(FlatBox{std::span<const int64_t>(d, rank),
                            std::span<const int64_t>(d + rank, rank)});
    pointers.push_back(&boxes.back());
  }
  return Coverage<FlatBox>(fqn, shape, pointers);
}

absl::Status ValidateCoverage(std::string_view fqn, const Shape& shape,
                              std::span<const Box* const> boxes) {
  return Coverage<Box>(fqn, shape, boxes);
}

absl::Status ValidateAgainstFileSizes(
    const Metadata& metadata,
    const std::map<std::string, uint64_t>& file_sizes) {
  auto check = [&file_sizes](const std::string& what,
                             const ByteLocation& loc) -> absl::Status {
    auto it = file_sizes.find(loc.file);
    if (it == file_sizes.end()) {
      return absl::NotFoundError(
          absl::StrCat(what, ": data file ", Quote(loc.file), " not found"));
    }
    uint64_t end = 0;
    if (__builtin_add_overflow(loc.offset, loc.stored_nbytes(), &end) ||
        end > it->second) {
      return absl::DataLossError(absl::StrCat(
          what, " (", loc.file, ", offset ", loc.offset, ", nbytes ",
          loc.stored_nbytes(), ") runs past the end of the file (size ", it->second,
          ")"));
    }
    return absl::OkStatus();
  };
  for (const auto& [fqn, tensor] : metadata.tensors) {
    for (const ChunkMetadata& chunk : tensor.chunks) {
      CAIRN_RETURN_IF_ERROR(
          check(absl::StrCat("chunk ",
                             Quote(ChunkName(fqn, tensor.shape, chunk.box))),
                chunk.location));
    }
  }
  for (const auto& [fqn, loc] : metadata.objects) {
    CAIRN_RETURN_IF_ERROR(check(absl::StrCat("object ", Quote(fqn)), loc));
  }
  absl::Status status;
  ForEachKvLocation(metadata.kv_tables,
                    [&](const ByteLocation& loc, const std::string& fqn,
                        const KvTableMetadata& table, size_t k, int column) {
                      if (status.ok()) {
                        status = check(KvLocationName(fqn, table, k, column),
                                       loc);
                      }
                    });
  return status;
}

absl::Status ValidateDisjointLocations(const Metadata& metadata) {
  // What the sort compares, and nothing else, held in place (a 16k-rank
  // checkpoint has millions of chunks in thousands of files): the file as
  // an index in order of first appearance, the range, and the location's
  // number in the order for_each_location visits them, which breaks ties
  // the same way whatever the sort does and finds the names for a message.
  struct Span {
    uint32_t file;
    uint32_t index;
    uint64_t offset;
    uint64_t nbytes;
    bool operator<(const Span& o) const {
      return std::tie(file, offset, nbytes, index) <
             std::tie(o.file, o.offset, o.nbytes, o.index);
    }
  };
  // Every location of a byte or more, in a fixed order: `fn(location,
  // name)`, where `name()` gives its chunk's or object's name.
  auto for_each_location = [&metadata](auto&& fn) {
    // (Not structured bindings: clang 14 cannot capture them.)
    for (const auto& entry : metadata.tensors) {
      const std::string& fqn = entry.first;
      const TensorMetadata& tensor = entry.second;
      for (const ChunkMetadata& chunk : tensor.chunks) {
        if (chunk.location.nbytes == 0) continue;  // shares no byte
        fn(chunk.location, [&] {
          return absl::StrCat(
              "chunk ", Quote(ChunkName(fqn, tensor.shape, chunk.box)));
        });
      }
    }
    for (const auto& entry : metadata.objects) {
      const std::string& fqn = entry.first;
      if (entry.second.nbytes == 0) continue;
      fn(entry.second, [&] { return absl::StrCat("object ", Quote(fqn)); });
    }
    ForEachKvLocation(metadata.kv_tables, [&](const ByteLocation& loc,
                                              const std::string& fqn,
                                              const KvTableMetadata& table,
                                              size_t k, int column) {
      if (loc.nbytes == 0) return;
      fn(loc, [&] { return KvLocationName(fqn, table, k, column); });
    });
  };
  absl::flat_hash_map<std::string_view, uint32_t> files;
  std::vector<Span> spans;
  for_each_location([&](const ByteLocation& loc, auto&&) {
    const uint32_t file =
        files.try_emplace(loc.file, static_cast<uint32_t>(files.size()))
            .first->second;
    // (A compressed chunk takes its stored bytes.)
    spans.push_back({file, static_cast<uint32_t>(spans.size()), loc.offset,
                     loc.stored_nbytes()});
  });
  // (A metadata.json is at most 4 GiB, so far fewer locations than this;
  // the numbers above would have wrapped.)
  if (spans.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::ResourceExhaustedError(
        "more than 2^32 - 1 chunks, objects and table entries to check for "
        "shared bytes");
  }
  std::sort(spans.begin(), spans.end());
  // Sorted by offset, and disjoint up to the first overlap: so a span
  // overlaps an earlier one of its file exactly when it starts before the
  // previous one ends.
  for (size_t i = 1; i < spans.size(); ++i) {
    const Span& prev = spans[i - 1];
    const Span& s = spans[i];
    if (prev.file != s.file || s.offset >= prev.offset + prev.nbytes) continue;
    std::string names[2], file;
    uint32_t seen = 0;
    for_each_location([&](const ByteLocation& loc, auto&& name) {
      if (seen == s.index) {
        names[0] = name();
        file = loc.file;
      }
      if (seen == prev.index) names[1] = name();
      ++seen;
    });
    return absl::DataLossError(absl::StrCat(
        names[0], " (", file, ", offset ", s.offset, ", nbytes ", s.nbytes,
        ") shares bytes with ", names[1], " (offset ", prev.offset,
        ", nbytes ", prev.nbytes,
        "): no two chunks, objects or table entries may overlap in their "
        "files"));
  }
  return absl::OkStatus();
}

absl::Status ValidateStructure(const Metadata& metadata) {
  absl::Status unknown;
  absl::StatusOr<StateDict> skeleton = internal_core::Unflatten(
      metadata.structure, [&](const std::string& fqn) -> absl::StatusOr<StateDict> {
        if (metadata.tensors.contains(fqn) || metadata.objects.contains(fqn) ||
            metadata.scalars.contains(fqn)) {
          return StateDict(int64_t{0});
        }
        unknown = absl::DataLossError(absl::StrCat(
            "structure names ", Quote(fqn),
            ", which is not a tensor, object or scalar of the checkpoint"));
        return unknown;
      });
  if (!unknown.ok()) return unknown;
  if (!skeleton.ok()) {
    return absl::DataLossError(absl::StrCat("structure: ", skeleton.status().message()));
  }
  return absl::OkStatus();
}

}  // namespace cairn::internal_format
