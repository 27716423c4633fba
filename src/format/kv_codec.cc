// metadata.json's "kv_tables" member (docs/format.md 4.7): the text of
// Metadata::kv_tables and its decoding as untrusted input (section 7).
//
// A table's value, keys sorted as everywhere in metadata.json:
//
//   {"bucket_size":N,            (chunked bucketing only)
//    "bucketing":"chunked"|"interleaved",
//    "buckets":[begin,end],
//    "chunks":[{"columns":[{location},...],"ids":{location},
//               "rows":[begin,end]},...],
//    "columns":[{"dtype":"BF16","name":"weight","width":128},...],
//    "key_dtype":"I64","num_buckets":B,"rows_per_bucket":[...]}
//
// where a location has exactly a tensor chunk's location members. Tables
// are few and small next to the tensors, so the text is written in one
// piece and decoded from nlohmann's tree (the fast decoder hands the
// member's value to DecodeKvTables too).
#include "format/kv_codec.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "core/checked.h"
#include "core/status.h"
#include "format/json_util.h"
#include "kv/kv_metadata.h"

namespace cairn::internal_format {
namespace {

using json_util::Describe;
using json_util::Find;
using json_util::GetUint;
using nlohmann::json;

constexpr char kChunked[] = "chunked";
constexpr char kInterleaved[] = "interleaved";
constexpr char kKeyDType[] = "I64";
// A chunk's ids are its entries' "ids": no column may take the name.
constexpr std::string_view kIdsName = "ids";

absl::Status IdsColumnError(std::string_view fqn) {
  return absl::InvalidArgumentError(absl::StrCat(
      "key-value table ", QuoteForMessage(fqn),
      ": a column is named \"ids\", the name of its chunks' ids entries"));
}

// ---------------------------------------------------------------- encoding

void AppendRange(std::string& out, auto begin, auto end) {
  absl::StrAppend(&out, "[", begin, ",", end, "]");
}

absl::Status AppendTable(std::string& out, const KvTableMetadata& table) {
  const KvTableSpec& spec = table.spec;
  out += '{';
  if (spec.bucketing == KvBucketing::kChunked) {
    absl::StrAppend(&out, "\"bucket_size\":", spec.bucket_size, ",");
  }
  absl::StrAppend(&out, "\"bucketing\":\"",
                  spec.bucketing == KvBucketing::kChunked ? kChunked
                                                          : kInterleaved,
                  "\",\"buckets\":");
  AppendRange(out, table.buckets.begin, table.buckets.end);
  out += ",\"chunks\":[";
  for (size_t k = 0; k < table.chunks.size(); ++k) {
    const KvChunkMetadata& chunk = table.chunks[k];
    if (k > 0) out += ',';
    out += "{\"columns\":[";
    for (size_t j = 0; j < chunk.columns.size(); ++j) {
      if (j > 0) out += ',';
      CAIRN_RETURN_IF_ERROR(AppendLocation(out, chunk.columns[j]));
    }
    out += "],\"ids\":";
    CAIRN_RETURN_IF_ERROR(AppendLocation(out, chunk.ids));
    out += ",\"rows\":";
    AppendRange(out, chunk.rows.begin, chunk.rows.end);
    out += '}';
  }
  out += "],\"columns\":[";
  for (size_t j = 0; j < spec.columns.size(); ++j) {
    const KvColumn& column = spec.columns[j];
    if (j > 0) out += ',';
    CAIRN_ASSIGN_OR_RETURN(std::string name, JsonString(column.name));
    absl::StrAppend(&out, "{\"dtype\":\"", AsAbsl(DTypeName(column.dtype)),
                    "\",\"name\":", name, ",\"width\":", column.width, "}");
  }
  absl::StrAppend(&out, "],\"key_dtype\":\"", kKeyDType,
                  "\",\"num_buckets\":", spec.num_buckets,
                  ",\"rows_per_bucket\":[");
  for (size_t b = 0; b < table.rows_per_bucket.size(); ++b) {
    if (b > 0) out += ',';
    absl::StrAppend(&out, table.rows_per_bucket[b]);
  }
  out += "]}";
  return absl::OkStatus();
}

// ---------------------------------------------------------------- decoding

// One table's decoding: errors are kDataLoss "<source>: <where>: <what>".
class TableDecoder {
 public:
  TableDecoder(std::string_view source, const std::string& fqn,
               uint64_t block_bytes)
      : source_(source),
        fqn_(fqn),
        where_(absl::StrCat("key-value table ", QuoteForMessage(fqn))),
        block_bytes_(block_bytes) {}

  absl::StatusOr<KvTableMetadata> Decode(const json& j) const;

 private:
  absl::Status Error(std::string_view where, std::string_view what) const {
    return absl::DataLossError(
        absl::StrCat(AsAbsl(source_), ": ", AsAbsl(where), ": ", AsAbsl(what)));
  }
  absl::StatusOr<const json*> Member(const json& object, const char* key,
                                     std::string_view where) const {
    const json* value = Find(object, key);
    if (value == nullptr) {
      return Error(where, absl::StrCat("missing \"", key, "\""));
    }
    return value;
  }
  absl::StatusOr<std::string> String(const json& object, const char* key,
                                     std::string_view where) const {
    CAIRN_ASSIGN_OR_RETURN(const json* value, Member(object, key, where));
    if (!value->is_string()) {
      return Error(where, absl::StrCat("\"", key, "\" must be a string, got ",
                                       Describe(*value)));
    }
    return value->get<std::string>();
  }
  // An integer in [0, 2^63).
  absl::StatusOr<uint64_t> Count(const json& value, const char* key,
                                 std::string_view where) const {
    std::optional<uint64_t> v = GetUint(value, internal_core::kInt64Max);
    if (!v) {
      return Error(where, absl::StrCat("\"", key,
                                       "\" must be an integer in [0, 2^63), "
                                       "got ",
                                       Describe(value)));
    }
    return *v;
  }
  absl::StatusOr<uint64_t> CountMember(const json& object, const char* key,
                                       std::string_view where) const {
    CAIRN_ASSIGN_OR_RETURN(const json* value, Member(object, key, where));
    return Count(*value, key, where);
  }
  absl::StatusOr<const json*> Array(const json& object, const char* key,
                                    std::string_view where) const {
    CAIRN_ASSIGN_OR_RETURN(const json* value, Member(object, key, where));
    if (!value->is_array()) {
      return Error(where, absl::StrCat("\"", key, "\" must be an array, got ",
                                       Describe(*value)));
    }
    return value;
  }
  // `[begin, end]`, each an integer in [0, 2^63).
  absl::StatusOr<std::pair<uint64_t, uint64_t>> Range(
      const json& object, const char* key, std::string_view where) const {
    CAIRN_ASSIGN_OR_RETURN(const json* value, Array(object, key, where));
    if (value->size() != 2) {
      return Error(where, absl::StrCat("\"", key,
                                       "\" must be [begin, end], got ",
                                       value->size(), " entries"));
    }
    CAIRN_ASSIGN_OR_RETURN(uint64_t begin, Count((*value)[0], key, where));
    CAIRN_ASSIGN_OR_RETURN(uint64_t end, Count((*value)[1], key, where));
    return std::pair(begin, end);
  }
  absl::Status Spec(const json& j, KvTableSpec& spec) const;
  absl::StatusOr<KvChunkMetadata> Chunk(const json& c, size_t k,
                                        const KvTableSpec& spec) const;

  std::string_view source_;
  const std::string& fqn_;
  std::string where_;
  uint64_t block_bytes_;
};

absl::Status TableDecoder::Spec(const json& j, KvTableSpec& spec) const {
  CAIRN_ASSIGN_OR_RETURN(std::string key_dtype,
                         String(j, "key_dtype", where_));
  if (key_dtype != kKeyDType) {
    return Error(where_, absl::StrCat("\"key_dtype\" must be \"", kKeyDType,
                                      "\", got ", QuoteForMessage(key_dtype)));
  }
  CAIRN_ASSIGN_OR_RETURN(uint64_t buckets,
                         CountMember(j, "num_buckets", where_));
  spec.num_buckets = static_cast<int64_t>(buckets);
  CAIRN_ASSIGN_OR_RETURN(std::string bucketing,
                         String(j, "bucketing", where_));
  const json* bucket_size = Find(j, "bucket_size");
  if (bucketing == kChunked) {
    spec.bucketing = KvBucketing::kChunked;
    CAIRN_ASSIGN_OR_RETURN(uint64_t size,
                           CountMember(j, "bucket_size", where_));
    spec.bucket_size = static_cast<int64_t>(size);
  } else if (bucketing == kInterleaved) {
    spec.bucketing = KvBucketing::kInterleaved;
    if (bucket_size != nullptr) {
      return Error(where_, "\"bucket_size\" is only for chunked bucketing");
    }
  } else {
    return Error(where_, absl::StrCat("unknown bucketing ",
                                      QuoteForMessage(bucketing),
                                      " (\"chunked\" or \"interleaved\")"));
  }
  CAIRN_ASSIGN_OR_RETURN(const json* columns, Array(j, "columns", where_));
  spec.columns.reserve(columns->size());
  for (size_t i = 0; i < columns->size(); ++i) {
    const json& c = (*columns)[i];
    const std::string where = absl::StrCat(where_, " column ", i);
    if (!c.is_object()) {
      return Error(where, absl::StrCat("must be an object, got ", Describe(c)));
    }
    KvColumn& column = spec.columns.emplace_back();
    CAIRN_ASSIGN_OR_RETURN(column.name, String(c, "name", where));
    if (column.name == kIdsName) {
      return Error(where, "a column may not be named \"ids\" (the name of "
                          "its chunks' ids entries)");
    }
    CAIRN_ASSIGN_OR_RETURN(std::string dtype_name, String(c, "dtype", where));
    absl::StatusOr<DType> dtype = DTypeFromName(dtype_name);
    if (!dtype.ok()) {
      return Error(where,
                   absl::StrCat("unknown dtype ", QuoteForMessage(dtype_name)));
    }
    column.dtype = *dtype;
    CAIRN_ASSIGN_OR_RETURN(uint64_t width, CountMember(c, "width", where));
    column.width = static_cast<int64_t>(width);
  }
  return absl::OkStatus();
}

absl::StatusOr<KvChunkMetadata> TableDecoder::Chunk(
    const json& c, size_t k, const KvTableSpec& spec) const {
  const std::string where = absl::StrCat(where_, " chunk ", k);
  if (!c.is_object()) {
    return Error(where, absl::StrCat("must be an object, got ", Describe(c)));
  }
  KvChunkMetadata chunk;
  CAIRN_ASSIGN_OR_RETURN(auto rows, Range(c, "rows", where));
  chunk.rows = {rows.first, rows.second};
  CAIRN_ASSIGN_OR_RETURN(const json* ids, Member(c, "ids", where));
  CAIRN_ASSIGN_OR_RETURN(
      chunk.ids,
      DecodeLocation(*ids, source_, absl::StrCat(where, " ids"), block_bytes_));
  CAIRN_ASSIGN_OR_RETURN(const json* columns, Array(c, "columns", where));
  if (columns->size() != spec.columns.size()) {
    return Error(where, absl::StrCat(columns->size(),
                                     " column locations, the table has ",
                                     spec.columns.size(), " columns"));
  }
  chunk.columns.reserve(columns->size());
  for (size_t j = 0; j < columns->size(); ++j) {
    CAIRN_ASSIGN_OR_RETURN(
        ByteLocation loc,
        DecodeLocation((*columns)[j], source_,
                       absl::StrCat(where, " column ",
                                    QuoteForMessage(spec.columns[j].name)),
                       block_bytes_));
    chunk.columns.push_back(std::move(loc));
  }
  return chunk;
}

absl::StatusOr<KvTableMetadata> TableDecoder::Decode(const json& j) const {
  if (!j.is_object()) {
    return Error(where_, absl::StrCat("must be an object, got ", Describe(j)));
  }
  KvTableMetadata table;
  CAIRN_RETURN_IF_ERROR(Spec(j, table.spec));
  CAIRN_ASSIGN_OR_RETURN(auto buckets, Range(j, "buckets", where_));
  table.buckets = {static_cast<int64_t>(buckets.first),
                   static_cast<int64_t>(buckets.second)};
  CAIRN_ASSIGN_OR_RETURN(const json* rows, Array(j, "rows_per_bucket", where_));
  table.rows_per_bucket.reserve(rows->size());
  for (const json& n : *rows) {
    CAIRN_ASSIGN_OR_RETURN(uint64_t count, Count(n, "rows_per_bucket", where_));
    table.rows_per_bucket.push_back(count);
  }
  CAIRN_ASSIGN_OR_RETURN(const json* chunks, Array(j, "chunks", where_));
  table.chunks.reserve(chunks->size());
  for (size_t k = 0; k < chunks->size(); ++k) {
    CAIRN_ASSIGN_OR_RETURN(KvChunkMetadata chunk,
                           Chunk((*chunks)[k], k, table.spec));
    table.chunks.push_back(std::move(chunk));
  }
  // The table as a whole: spec, held buckets and their row counts, chunks
  // tiling the rows, sizes and files.
  if (absl::Status s =
          internal_kv::ValidateKvTableMetadata(QuoteForMessage(fqn_), table);
      !s.ok()) {
    return absl::DataLossError(
        absl::StrCat(AsAbsl(source_), ": ", s.message()));
  }
  return table;
}

}  // namespace

absl::Status CheckKvTablesEncodable(const KvTables& tables) {
  for (const auto& [fqn, table] : tables) {
    CAIRN_RETURN_IF_ERROR(JsonString(fqn).status());
    for (const KvColumn& column : table.spec.columns) {
      CAIRN_RETURN_IF_ERROR(JsonString(column.name).status());
      if (column.name == kIdsName) return IdsColumnError(fqn);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> EncodeKvTables(const KvTables& tables) {
  CAIRN_RETURN_IF_ERROR(CheckKvTablesEncodable(tables));
  std::string out = "{";
  bool first = true;
  for (const auto& [fqn, table] : tables) {
    // A writer never commits a table a reader refuses.
    if (absl::Status s =
            internal_kv::ValidateKvTableMetadata(QuoteForMessage(fqn), table);
        !s.ok()) {
      return absl::InvalidArgumentError(s.message());
    }
    if (!first) out += ',';
    first = false;
    CAIRN_ASSIGN_OR_RETURN(std::string name, JsonString(fqn));
    out += name;
    out += ':';
    CAIRN_RETURN_IF_ERROR(AppendTable(out, table));
  }
  out += '}';
  return out;
}

absl::StatusOr<KvTables> DecodeKvTables(const json& value,
                                        std::string_view source,
                                        uint64_t block_bytes) {
  if (!value.is_object()) {
    return absl::DataLossError(
        absl::StrCat(AsAbsl(source), ": \"kv_tables\" must be an object, got ",
                     Describe(value)));
  }
  KvTables tables;
  for (const auto& [fqn, j] : value.items()) {
    CAIRN_ASSIGN_OR_RETURN(KvTableMetadata table,
                           TableDecoder(source, fqn, block_bytes).Decode(j));
    tables.emplace(fqn, std::move(table));
  }
  return tables;
}

std::string KvLocationName(std::string_view fqn, const KvTableMetadata& table,
                           size_t chunk, int column) {
  std::string name =
      absl::StrCat("key-value table ", QuoteForMessage(fqn), " chunk ", chunk);
  if (column < 0) return absl::StrCat(name, " ids");
  const size_t j = static_cast<size_t>(column);
  if (j < table.spec.columns.size()) {
    return absl::StrCat(name, " column ",
                        QuoteForMessage(table.spec.columns[j].name));
  }
  return absl::StrCat(name, " column ", j);
}

}  // namespace cairn::internal_format
