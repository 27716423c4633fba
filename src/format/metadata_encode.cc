// metadata.json codec, encoding: Metadata -> metadata.json text
// (EncodeMetadata, CheckEncodable, FlatChunks and WithFlatChunks), and the
// writing helpers kv_codec.cc shares. docs/format.md is the normative spec,
// its "metadata.json" section the text written here. The codec's other
// stages, and what they share, are listed in metadata_codec_internal.h.
#include "format/metadata_codec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "core/parallel.h"
#include "core/status.h"
#include "format/chunk_digest.h"
#include "format/crc32c.h"
#include "format/frame_codec.h"
#include "format/json_util.h"
#include "format/kv_codec.h"
#include "format/metadata_codec_internal.h"
#include "format/references.h"
#include "nlohmann/json.hpp"

namespace cairn::internal_format {
namespace {

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

}  // namespace

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

namespace {

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

}  // namespace cairn::internal_format
