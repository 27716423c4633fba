// Metadata: the in-memory form of a checkpoint's metadata.json, the index of
// every tensor chunk, object and scalar in the checkpoint. The normative
// on-disk spec is docs/format.md.
#ifndef CAIRN_METADATA_H_
#define CAIRN_METADATA_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cairn/box.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "cairn/state_dict.h"

namespace cairn {

// The format version cairn writes. Version 2 is version 1 with the
// metadata file's own checksum (docs/format.md 4.0); version 3 adds block
// checksums (CRC32Cs of fixed-size blocks of each chunk, 4.2), so a part
// of a chunk is checked by reading the blocks that enclose it; version 4
// adds key-value tables (4.7); version 5 compressed chunks (4.2.1);
// version 6 chunk digests and references to earlier checkpoints
// (incremental checkpoints, 4.2.2). Readers accept versions 1 to 6.
inline constexpr int kFormatVersion = 6;
inline constexpr int kOldestReadableFormatVersion = 1;
inline constexpr char kMetadataFileName[] = "metadata.json";
// The block size of the block checksums a save writes by default
// (SaveOptions::crc32c_block_bytes).
inline constexpr uint64_t kDefaultCrc32cBlockBytes = uint64_t{1} << 20;

// How a chunk's bytes are stored (SaveOptions::codec; docs/format.md
// 4.2.1). Names in metadata.json: "zstd", "grouped-zstd".
enum class Codec : uint8_t {
  kNone = 0,  // the raw bytes
  kZstd = 1,  // zstd frames
  // zstd frames of the bytes regrouped by their position in the element
  // (for BF16: every element's low byte, then every high byte), which
  // compresses floating-point numbers better.
  kGroupedZstd = 2,
};

// A compressed chunk's stored form (format version 5, ByteLocation::
// compression). Its raw bytes (the box's elements, row-major: what a load
// returns) are cut into frames of Metadata::crc32c_block_bytes, the last
// one shorter, each compressed on its own and stored one after another in
// a U8 entry of stored_nbytes bytes at the location's offset. The
// location's nbytes, crc32c and block_crc32c describe the raw bytes, so
// block_crc32c (or crc32c, for one frame) checks each frame once
// decompressed; frame_crc32c checks its stored bytes before that.
struct Compression {
  Codec codec = Codec::kNone;  // kNone: stored raw, the rest unused
  uint64_t stored_nbytes = 0;
  std::vector<uint32_t> frame_nbytes = {};  // stored bytes of each frame
  std::vector<uint32_t> frame_crc32c = {};  // CRC32C of each stored frame
  friend bool operator==(const Compression&, const Compression&) = default;
};

// A tensor chunk's strong digest (format version 6, docs/format.md 4.2.2):
// XXH3-128 of the XXH3-128 digests of its checksum blocks (the raw bytes,
// Metadata::crc32c_block_bytes each), so writers compute it block by
// block on any number of threads. An incremental save reuses a chunk of
// its base only when box, dtype, CRC32C and this digest all match.
struct ChunkDigest {
  uint64_t high = 0;
  uint64_t low = 0;
  friend bool operator==(const ChunkDigest&, const ChunkDigest&) = default;
};

// Where a run of bytes lives: a data file of the checkpoint, the absolute
// offset of its first byte in that file, its length and its CRC32C.
struct ByteLocation {
  std::string file;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  uint32_t crc32c = 0;
  // Format version 3: the CRC32Cs of its consecutive blocks of
  // Metadata::crc32c_block_bytes bytes (the last one shorter), when it is
  // longer than one block; empty otherwise, and in versions 1 and 2.
  std::vector<uint32_t> block_crc32c = {};
  // Format version 5: how a tensor chunk's bytes are stored (never set
  // for objects and key-value table entries).
  Compression compression = {};
  // Format version 6: a tensor chunk's digest (ChunkDigest); absent for
  // objects, key-value table entries and chunks of older versions.
  std::optional<ChunkDigest> xxh3 = std::nullopt;
  bool compressed() const { return compression.codec != Codec::kNone; }
  // The bytes it takes in its file: nbytes, or stored_nbytes compressed.
  uint64_t stored_nbytes() const {
    return compressed() ? compression.stored_nbytes : nbytes;
  }
  friend bool operator==(const ByteLocation&, const ByteLocation&) = default;
};

// One stored box of a tensor, row-major and contiguous in its file.
struct ChunkMetadata {
  Box box;
  ByteLocation location;
  friend bool operator==(const ChunkMetadata&, const ChunkMetadata&) = default;
};

struct TensorMetadata {
  DType dtype = DType::kF32;
  Shape shape;
  // Stored boxes; together they cover the shape exactly once.
  std::vector<ChunkMetadata> chunks;
  // Metadata made from safetensors files cairn did not write (a Hugging
  // Face folder, include/cairn/huggingface.h): for each chunk, the name of
  // the file's entry that holds it, whole or a run of its leading rows (a
  // chunk's bytes are contiguous in the entry). Empty for checkpoints,
  // whose entry names follow from the FQN and box (docs/format.md 3.1).
  std::vector<std::string> source_entries = {};
  uint64_t nbytes() const;  // bytes of the whole tensor
  friend bool operator==(const TensorMetadata&, const TensorMetadata&) =
      default;
};

// Key-value tables (format version 4, docs/format.md 4.7). A table's rows
// are stored in (bucket, id) order; row r is the r-th row of the buckets
// the metadata holds, counted from the first of them.
//
// Rows [rows.begin, rows.end): their ids (an I64 [n] entry) and each
// column (a [n, width] entry of its dtype), n = rows.size(), side by side
// in one data file.
struct KvChunkMetadata {
  KvRowRange rows;
  ByteLocation ids;
  std::vector<ByteLocation> columns;  // one per spec column, in order
  friend bool operator==(const KvChunkMetadata&, const KvChunkMetadata&) =
      default;
};

struct KvTableMetadata {
  KvTableSpec spec;
  // The buckets whose rows this metadata holds: all of [0, B) in a global
  // checkpoint, the rank's own in a rank-local one.
  KvBucketRange buckets;
  // The row count of each held bucket, in bucket order (buckets.size()).
  std::vector<uint64_t> rows_per_bucket;
  std::vector<KvChunkMetadata> chunks;  // in row order, tiling the rows
  uint64_t rows() const;    // sum of rows_per_bucket
  uint64_t nbytes() const;  // bytes of every chunk's ids and columns
  friend bool operator==(const KvTableMetadata&, const KvTableMetadata&) =
      default;
};

// An earlier checkpoint whose chunks this one reads in place of writing
// them again (an incremental checkpoint, SaveOptions::base; format version
// 6, docs/format.md 4.2.2). A chunk stored there has the file name
// `url + "/" + <the file's name in that checkpoint>`.
struct CheckpointReference {
  // "../<name>": a sibling of this checkpoint (the manager's steps), so a
  // folder of steps may be moved as a whole; else an absolute URL
  // ("/abs/path", "file:///abs/path", "s3://bucket/prefix").
  std::string url;
  // That checkpoint's metadata.json checksum (4.0) and save id when this
  // one was saved: a load refuses it when either differs, as it would
  // after that checkpoint was overwritten.
  uint32_t checksum = 0;
  std::string save_id;
  friend bool operator==(const CheckpointReference&,
                         const CheckpointReference&) = default;
};

struct Metadata {
  // The format version of the file it came from; what an encoder writes
  // (version 1 has no checksum of its own). Default: kFormatVersion.
  int version = kFormatVersion;
  std::string created_by;  // "cairn 0.1.0"
  int world_size = 1;      // ranks that saved the checkpoint
  // Rank-local metadata (rank-NNNNN/metadata.json): the rank that wrote it,
  // whose chunks alone it lists. -1 for a global checkpoint.
  int rank = -1;
  // The save that wrote it (SaveOptions::save_id): 1 to 64 characters of
  // [0-9A-Za-z_-], new for every save and the same in every rank folder of
  // one rank-local save (so folders of different saves are never mixed).
  // Empty in checkpoints written before cairn recorded it.
  std::string save_id;
  // Version 6: the checkpoints whose chunks this one reads (each holding
  // the chunks' bytes itself: references are never chained), in the order
  // a save found them. Empty for a standalone checkpoint.
  std::vector<CheckpointReference> references = {};
  // The block size of the locations' block_crc32c (a power of two, at
  // least 4096). Written in version 3 only; a version 1 or 2 file decodes
  // with the default, and no location has block checksums.
  uint64_t crc32c_block_bytes = kDefaultCrc32cBlockBytes;
  std::map<std::string, TensorMetadata> tensors;  // by FQN
  std::map<std::string, ByteLocation> objects;    // by FQN
  std::map<std::string, Scalar> scalars;          // by FQN
  // Key-value tables (version 4), by FQN: an FQN names one leaf or table.
  std::map<std::string, KvTableMetadata> kv_tables;
  // JSON text of the nesting (see docs/format.md), enough to rebuild the
  // state dict's maps and lists.
  std::string structure = "{}";
  // JSON text of a user-supplied object, stored as given. Default "{}".
  std::string user = "{}";
  // False for metadata made from safetensors files that cairn did not
  // write (a Hugging Face folder): no location has a CRC32C, a load
  // returns every byte unverified and says so (LoadResult::
  // source_has_checksums), and no encoder writes it to metadata.json.
  bool has_checksums = true;

  // Bytes of all tensors, objects and key-value tables.
  uint64_t total_bytes() const;
  friend bool operator==(const Metadata&, const Metadata&) = default;
};

}  // namespace cairn

#endif  // CAIRN_METADATA_H_
