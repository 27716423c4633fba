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
#include <cmath>
#include <limits>
#include <optional>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "core/checked.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/json_util.h"
#include "format/names.h"
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

json EncodeLocation(const ByteLocation& loc) {
  json j = json::object();
  j["file"] = loc.file;
  j["offset"] = loc.offset;
  j["nbytes"] = loc.nbytes;
  j["crc32c"] = Crc32cToHex(loc.crc32c);
  return j;
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

  absl::StatusOr<ByteLocation> Location(const json& j,
                                        absl::string_view where) const;
  absl::StatusOr<TensorMetadata> Tensor(const json& j,
                                        const std::string& fqn) const;
  absl::StatusOr<Scalar> ScalarValue(const json& j,
                                     absl::string_view where) const;

  absl::string_view source_;
};

absl::StatusOr<ByteLocation> Decoder::Location(const json& j,
                                               absl::string_view where) const {
  if (!j.is_object()) {
    return Error(where, absl::StrCat("must be an object, got ", Describe(j)));
  }
  ByteLocation loc;
  CAIRN_ASSIGN_OR_RETURN(loc.file, String(j, "file", where));
  if (absl::Status s = ValidateRelativeName(loc.file); !s.ok()) {
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
  return loc;
}

absl::StatusOr<TensorMetadata> Decoder::Tensor(const json& j,
                                               const std::string& fqn) const {
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
    CAIRN_ASSIGN_OR_RETURN(chunk.location, Location(c, chunk_where));
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
  std::optional<json> parsed = json_util::Parse(text);
  if (!parsed) {
    return Error(
        "", absl::StrCat("malformed metadata: not well-formed UTF-8 JSON, or "
                         "nested deeper than ",
                         json_util::kMaxJsonDepth));
  }
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
  if (*v != kFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat(source_, ": unsupported format version ", *v,
                     " (this reader supports version ", kFormatVersion, ")"));
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

  CAIRN_ASSIGN_OR_RETURN(const json* tensors, Object(root, "tensors", ""));
  for (const auto& [fqn, value] : tensors->items()) {
    CAIRN_ASSIGN_OR_RETURN(TensorMetadata tensor, Tensor(value, fqn));
    md.tensors.emplace(fqn, std::move(tensor));
  }

  CAIRN_ASSIGN_OR_RETURN(const json* objects, Object(root, "objects", ""));
  for (const auto& [fqn, value] : objects->items()) {
    CAIRN_ASSIGN_OR_RETURN(
        ByteLocation loc, Location(value, absl::StrCat("object ", Quote(fqn))));
    md.objects.emplace(fqn, std::move(loc));
  }

  CAIRN_ASSIGN_OR_RETURN(const json* scalars, Object(root, "scalars", ""));
  for (const auto& [fqn, value] : scalars->items()) {
    CAIRN_ASSIGN_OR_RETURN(
        Scalar scalar, ScalarValue(value, absl::StrCat("scalar ", Quote(fqn))));
    md.scalars.emplace(fqn, std::move(scalar));
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
  return md;
}

// Half-open overlap of two boxes of the same rank that lie inside one shape
// (so the ends cannot overflow).
bool Overlaps(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.sizes.size(); ++d) {
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] ||
        b.offsets[d] >= a.offsets[d] + a.sizes[d]) {
      return false;
    }
  }
  return true;
}

std::string ChunkName(std::string_view fqn, const TensorMetadata& tensor,
                      const ChunkMetadata& chunk) {
  return EntryName(fqn, chunk.box, chunk.box == Box::Full(tensor.shape));
}

}  // namespace

absl::StatusOr<std::string> EncodeMetadata(const Metadata& metadata) {
  if (metadata.version != kFormatVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot encode metadata version ", metadata.version,
                     "; this writer writes version ", kFormatVersion));
  }
  json root = json::object();
  root["format"] = kFormatName;
  root["version"] = metadata.version;
  root["created_by"] = metadata.created_by;
  root["world_size"] = metadata.world_size;
  if (metadata.rank >= 0) root["rank"] = metadata.rank;

  json tensors = json::object();
  for (const auto& [fqn, tensor] : metadata.tensors) {
    json t = json::object();
    t["dtype"] = std::string(DTypeName(tensor.dtype));
    t["shape"] = tensor.shape;
    json chunks = json::array();
    for (const ChunkMetadata& chunk : tensor.chunks) {
      json c = EncodeLocation(chunk.location);
      c["offsets"] = chunk.box.offsets;
      c["sizes"] = chunk.box.sizes;
      chunks.push_back(std::move(c));
    }
    t["chunks"] = std::move(chunks);
    tensors[fqn] = std::move(t);
  }
  root["tensors"] = std::move(tensors);

  json objects = json::object();
  for (const auto& [fqn, loc] : metadata.objects) {
    objects[fqn] = EncodeLocation(loc);
  }
  root["objects"] = std::move(objects);

  json scalars = json::object();
  for (const auto& [fqn, scalar] : metadata.scalars) {
    scalars[fqn] = EncodeScalar(scalar);
  }
  root["scalars"] = std::move(scalars);

  std::optional<json> structure = json_util::Parse(metadata.structure);
  if (!structure) {
    return absl::InvalidArgumentError(
        "metadata.structure is not valid JSON (or nests too deeply)");
  }
  root["structure"] = std::move(*structure);
  std::optional<json> user = json_util::Parse(metadata.user);
  if (!user || !user->is_object()) {
    return absl::InvalidArgumentError(
        "metadata.user must be the text of a JSON object");
  }
  root["user"] = std::move(*user);

  try {
    std::string text = root.dump(-1, ' ', false, json::error_handler_t::strict);
    text += '\n';
    return text;
  } catch (const json::exception& e) {
    // An FQN, file name or string scalar that is not valid UTF-8.
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata contains a string that is not valid UTF-8: ", e.what()));
  }
}

absl::StatusOr<Metadata> DecodeMetadata(std::string_view json_text,
                                        std::string_view source) {
  return Decoder(source).Decode(json_text);
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
  const Shape& shape = tensor.shape;
  const std::string where = absl::StrCat("tensor ", Quote(fqn));
  for (size_t i = 0; i < tensor.chunks.size(); ++i) {
    const Box& box = tensor.chunks[i].box;
    if (absl::Status s = ValidateBox(box, shape); !s.ok()) {
      return absl::DataLossError(absl::StrCat(
          where, ": chunk ", ChunkName(fqn, tensor, tensor.chunks[i]), " ",
          box.ToString(), " lies outside the shape: ", s.message()));
    }
  }
  std::optional<uint64_t> total_opt = internal_core::CheckedBytes(shape, DType::kU8);
  if (!total_opt) {
    return absl::DataLossError(absl::StrCat(where, ": shape overflows"));
  }
  const uint64_t total = *total_opt;

  std::vector<const Box*> boxes;
  boxes.reserve(tensor.chunks.size());
  for (const ChunkMetadata& chunk : tensor.chunks) {
    if (!chunk.box.empty()) boxes.push_back(&chunk.box);
  }
  auto overlap_error = [&](const Box& a, const Box& b) {
    return absl::DataLossError(absl::StrCat(where, ": chunks ", a.ToString(),
                                            " and ", b.ToString(), " overlap"));
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
              [sweep_dim](const Box* a, const Box* b) {
                return a->offsets[sweep_dim] < b->offsets[sweep_dim];
              });
    std::vector<const Box*> open;
    for (const Box* box : boxes) {
      const int64_t start = box->offsets[sweep_dim];
      // Drop chunks that end at or before this one starts.
      size_t kept = 0;
      for (const Box* o : open) {
        if (o->offsets[sweep_dim] + o->sizes[sweep_dim] > start)
          open[kept++] = o;
      }
      open.resize(kept);
      for (const Box* o : open) {
        if (Overlaps(*o, *box)) return overlap_error(*o, *box);
      }
      open.push_back(box);
    }
  }

  // Disjoint boxes inside the shape: the sum cannot exceed `total`.
  uint64_t covered = 0;
  for (const Box* box : boxes)
    covered += internal_core::CheckedBytes(box->sizes, DType::kU8).value_or(0);
  if (covered != total) {
    return absl::DataLossError(absl::StrCat(
        where, ": chunks cover ", covered, " of ", total, " elements; ",
        total - covered, " elements are in no chunk"));
  }
  return absl::OkStatus();
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
    if (__builtin_add_overflow(loc.offset, loc.nbytes, &end) ||
        end > it->second) {
      return absl::DataLossError(absl::StrCat(
          what, " (", loc.file, ", offset ", loc.offset, ", nbytes ",
          loc.nbytes, ") runs past the end of the file (size ", it->second,
          ")"));
    }
    return absl::OkStatus();
  };
  for (const auto& [fqn, tensor] : metadata.tensors) {
    for (const ChunkMetadata& chunk : tensor.chunks) {
      CAIRN_RETURN_IF_ERROR(
          check(absl::StrCat("chunk ", Quote(ChunkName(fqn, tensor, chunk))),
                chunk.location));
    }
  }
  for (const auto& [fqn, loc] : metadata.objects) {
    CAIRN_RETURN_IF_ERROR(check(absl::StrCat("object ", Quote(fqn)), loc));
  }
  return absl::OkStatus();
}

}  // namespace cairn::internal_format
