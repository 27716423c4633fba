// metadata.json codec, decoding's fast path: FastDecoder, which decodes the
// text EncodeMetadata writes without a JSON tree, and gives up on anything
// else (DecodeMetadata then decodes with Decoder, metadata_decode.cc).
// docs/format.md is the normative spec; this file implements its
// "metadata.json" and "Untrusted input" sections.
//
// Decoding treats the text as untrusted: nlohmann::json is used without
// exceptions (parse with allow_exceptions=false, every type checked before
// get<>), nesting is bounded before parsing, and every integer is range- and
// overflow-checked. Any rejection is kDataLoss naming the source and the FQN,
// except an unsupported version (kFailedPrecondition).
#include "format/metadata_codec_internal.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "cairn/box.h"
#include "cairn/dtype.h"
#include "core/checked.h"
#include "core/parallel.h"
#include "format/chunk_digest.h"
#include "format/crc32c.h"
#include "format/frame_codec.h"
#include "format/json_util.h"
#include "format/kv_codec.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "format/plain_json.h"
#include "format/references.h"
#include "nlohmann/json.hpp"

namespace cairn::internal_format {
namespace {

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

}  // namespace

std::optional<Metadata> FastDecodeMetadata(std::string_view text,
                                           std::string_view source,
                                           DecodeThreads threads) {
  return FastDecoder(text, source, threads).Decode();
}

}  // namespace cairn::internal_format
