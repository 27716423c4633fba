// metadata.json's "kv_tables" member (format version 4, docs/format.md
// 4.7) <-> Metadata::kv_tables. Internal to src/format: the metadata.json
// codec (metadata_*.cc) calls these from its encoder, its two decoders and
// its validators.
#ifndef CAIRN_FORMAT_KV_CODEC_H_
#define CAIRN_FORMAT_KV_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/metadata.h"
#include "nlohmann/json.hpp"

namespace cairn::internal_format {

// The first format version with key-value tables.
inline constexpr int kKvTablesFormatVersion = 4;

using KvTables = std::map<std::string, KvTableMetadata>;

// The text of the "kv_tables" value: a JSON object, byte for byte what
// nlohmann's dump() of it gives (compact, keys sorted). kInvalidArgument
// when a table is not consistent (ValidateKvTableMetadata's message), a
// column is named "ids" (its entries' names would collide with the ids',
// docs/format.md 4.7), or a name or file is not valid UTF-8.
absl::StatusOr<std::string> EncodeKvTables(const KvTables& tables);

// CheckEncodable's part: the table FQNs and column names can be written
// (valid UTF-8, no column named "ids"). kInvalidArgument otherwise.
absl::Status CheckKvTablesEncodable(const KvTables& tables);

// Decodes the "kv_tables" value of untrusted metadata: every member type-
// and range-checked, then ValidateKvTableMetadata. `block_bytes`: the
// metadata's crc32c_block_bytes (locations' block checksums are checked
// as a chunk's are). kDataLoss "<source>: key-value table "<fqn>"...",
// naming the chunk where there is one.
absl::StatusOr<KvTables> DecodeKvTables(const nlohmann::json& value,
                                        std::string_view source,
                                        uint64_t block_bytes);

// The name of a table's location in messages: `key-value table "<fqn>"
// chunk <k> ids`, or `... chunk <k> column "<name>"` for column `column`
// (an index into the spec's columns; -1 for the ids).
std::string KvLocationName(std::string_view fqn, const KvTableMetadata& table,
                           size_t chunk, int column);

// Calls fn(location, fqn, table, chunk, column) for the ids (column -1) and
// then every column of every chunk of every table, in map and chunk order.
template <typename Fn>
void ForEachKvLocation(const KvTables& tables, Fn&& fn) {
  for (const auto& entry : tables) {
    const KvTableMetadata& table = entry.second;
    for (size_t k = 0; k < table.chunks.size(); ++k) {
      const KvChunkMetadata& chunk = table.chunks[k];
      fn(chunk.ids, entry.first, table, k, -1);
      for (size_t j = 0; j < chunk.columns.size(); ++j) {
        fn(chunk.columns[j], entry.first, table, k, static_cast<int>(j));
      }
    }
  }
}

// ---- Defined in metadata_encode.cc (DecodeLocation in metadata_decode.cc),
// shared with the code above.

// `s` quoted for a message (escaped, shortened).
std::string QuoteForMessage(std::string_view s);
// `s` as a JSON string, as nlohmann's dump() writes it; kInvalidArgument
// when it is not valid UTF-8.
absl::StatusOr<std::string> JsonString(std::string_view s);
// `{"crc32c":...,"offset":N}`: a location as a tensor chunk's or an
// object's members write it, appended to `out`.
absl::Status AppendLocation(std::string& out, const ByteLocation& location);
// A location read as a chunk's or an object's is, with the same checks
// (safe file name, offset + nbytes < 2^64, crc32c, block checksums by
// `block_bytes`, 0 before version 3). kDataLoss "<source>: <where>: ...".
absl::StatusOr<ByteLocation> DecodeLocation(const nlohmann::json& j,
                                            std::string_view source,
                                            std::string_view where,
                                            uint64_t block_bytes);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_KV_CODEC_H_
