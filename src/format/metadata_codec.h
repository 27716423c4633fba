// metadata.json <-> Metadata. docs/format.md is the normative spec.
#ifndef CAIRN_FORMAT_METADATA_CODEC_H_
#define CAIRN_FORMAT_METADATA_CODEC_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/metadata.h"
#include "core/big_vector.h"

namespace cairn::internal_format {

// metadata.json's own checksum (format version 2, docs/format.md 4.1): the
// text opens with the kChecksumPrefixBytes bytes {"checksum":"xxxxxxxx",
// whose 8 hex digits are the CRC32C of every byte after them. Decoding
// checks it whenever the text opens with kChecksumKeyPrefix, and requires
// it of version 2.
inline constexpr std::string_view kChecksumKeyPrefix = "{\"checksum\":\"";
inline constexpr size_t kChecksumPrefixBytes = 23;

// Largest metadata.json accepted (untrusted input), and so the largest a
// save writes. 4 GiB: a 16k-rank FSDP job's is about 1 GB (see
// bench/scale/README.md).
inline constexpr uint64_t kMaxMetadataBytes = uint64_t{4} << 30;

// The chunks of a save coordinator's metadata, flat: per chunk its box and
// location in a few arrays (huge-page backed), where a ChunkMetadata holds
// two heap vectors and a string. At 16k ranks x 500 tensors that is 8M
// chunks: by count some 1.4 GB of small allocations as ChunkMetadata, which
// the kernel faults in one page at a time, against 56 bytes a chunk here
// for 2-D boxes (about 460 MB, in 2 MiB pages). A Metadata whose
// tensors' `chunks` are empty plus these is what EncodeMetadata(metadata,
// flat) writes; WithFlatChunks builds the ordinary Metadata.
struct FlatChunks {
  // Tensor t (the t-th of metadata.tensors, in map order) has the chunks
  // [first[t], first[t + 1]); the k-th of them has its box's offsets at
  // dims[dims_at[t] + 2 * rank * k] and its sizes right after (rank: the
  // tensor's shape's).
  std::vector<size_t> first = {0};
  std::vector<size_t> dims_at;
  internal_core::BigVector<int64_t> dims;
  // Locations, per chunk (filled at commit): its file (an index into
  // `files`), offset, size and CRC32C.
  internal_core::BigVector<uint32_t> file;
  internal_core::BigVector<uint64_t> offset;
  internal_core::BigVector<uint64_t> nbytes;
  internal_core::BigVector<uint32_t> crc32c;
  std::vector<std::string> files;
  // Block checksums (format version 3): chunk c's are
  // Crc32cBlockCount(nbytes[c], block_bytes) CRC32Cs from
  // blocks[file[c]][block_at[c]] on (each file's in one array, filled by
  // the rank that wrote it), or none when block_at[c] is kNoBlocks.
  static constexpr uint64_t kNoBlocks = ~uint64_t{0};
  uint64_t block_bytes = 0;
  internal_core::BigVector<uint64_t> block_at;
  std::vector<std::vector<uint32_t>> blocks;  // by file index
  // Chunk c's block checksums (empty when it has none, or they are out of
  // range).
  std::span<const uint32_t> BlocksOf(size_t c) const;
  // Compressed chunks' compression (format version 5), by chunk: only
  // compressed chunks have one (filled at commit, by the rank that wrote
  // the chunk).
  std::map<size_t, Compression> compression;
  const Compression* CompressionOf(size_t c) const;  // null: stored raw
  // Chunk digests (format version 6), by chunk (filled at commit); a
  // chunk has one when xxh3 reaches it (every chunk a save writes does).
  internal_core::BigVector<ChunkDigest> xxh3;
  const ChunkDigest* DigestOf(size_t c) const;  // null: none

  size_t num_tensors() const { return first.size() - 1; }
  size_t num_chunks() const { return first.back(); }
  // Chunk c's box (c in tensor t's range, rank `rank`).
  Box BoxOf(size_t t, size_t c, size_t rank) const;
  // A location for each chunk, empty and unset, without block checksums:
  // sized to num_chunks() (and `blocks` to files.size()).
  void ResizeLocations();
};

// `metadata` (whose tensors, in map order, are flat's) with each tensor's
// chunks taken from `flat`.
Metadata WithFlatChunks(Metadata metadata, const FlatChunks& flat);

// Deterministic JSON text (keys sorted). `metadata.structure` and
// `metadata.user` must hold valid JSON (they are embedded as JSON values).
// kResourceExhausted when the text would be longer than `max_bytes` (a load
// would refuse it), before it is built.
absl::StatusOr<std::string> EncodeMetadata(
    const Metadata& metadata, uint64_t max_bytes = kMaxMetadataBytes);
// The same text for `metadata` with its tensors' chunks in `flat` (the
// tensors' own `chunks` are not read): EncodeMetadata(WithFlatChunks(...))
// byte for byte. kInternal when flat's tensors are not metadata's.
absl::StatusOr<std::string> EncodeMetadata(
    const Metadata& metadata, const FlatChunks& flat,
    uint64_t max_bytes = kMaxMetadataBytes);

// OK when EncodeMetadata(metadata) would succeed as far as the version,
// `structure`, `user` and the names (FQNs, created_by, key-value tables'
// column names) go, without building the text: a save's coordinator checks its metadata skeleton this way
// before any data is written. Not checked: locations (the skeleton's are
// empty, and cairn names the data files), scalar values (they arrive at
// commit) and the consistency of key-value tables (their rows and chunks
// arrive at commit; EncodeMetadata refuses an inconsistent table).
absl::Status CheckEncodable(const Metadata& metadata);

// `json_text` (the text of a JSON object of at least one member, as any
// writer gives it) with a checksum member opening it, computed for the rest:
// an existing one is replaced. For tests and tools that edit a
// metadata.json on purpose. kInvalidArgument if the text does not begin
// with '{'.
absl::StatusOr<std::string> WithMetadataChecksum(std::string_view json_text);

// Parses and validates untrusted text. `source` (e.g. the file path) prefixes
// every error. Rejects: a checksum that does not match (or a version 2
// text without one); malformed JSON; "format" != "cairn"; a major
// version outside kOldestReadableFormatVersion..kFormatVersion
// (kFailedPrecondition, "unsupported format version"); unsafe file names (ValidateRelativeName); unknown
// dtypes; negative or overflowing shapes; boxes outside their tensor; nbytes
// != elements * dtype size; offset + nbytes overflow; bad crc32c hex; an
// FQN in two of tensors, objects, scalars and kv_tables; key-value tables
// (version 4) that are not consistent (format/kv_codec.h). Ignores unknown
// fields. Coverage of each tensor by its chunks is checked
// by ValidateCoverage, not here.
absl::StatusOr<Metadata> DecodeMetadata(std::string_view json,
                                        std::string_view source);

// How DecodeMetadata shares out its work. Every rank of a load decodes the
// whole text (943 MiB, 8.2 million chunks, for 16k ranks x 500 tensors);
// the tensors of a text of at least `min_bytes` are decoded in parts of at
// least `min_part_bytes` on up to `threads` threads (the caller's among
// them). The result, or the error, is the same for any setting.
struct DecodeThreads {
  int threads = 1;
  size_t min_bytes = size_t{16} << 20;
  size_t min_part_bytes = size_t{4} << 20;
  // Tests: set to the number of parts the tensors were decoded in (1: in
  // one pass, also after a split that was not trusted).
  size_t* parts_used = nullptr;
};
// DecodeMetadata above uses the machine's cores (CpuThreads()).
absl::StatusOr<Metadata> DecodeMetadata(std::string_view json,
                                        std::string_view source,
                                        DecodeThreads threads);

// OK when the chunks of `tensor` cover its shape exactly once (no gap, no
// overlap). kDataLoss naming `fqn` and the offending boxes otherwise.
// Tests only: DecodeMetadata without its fast path (the nlohmann tree
// decoder every other input falls back to), so tests can check that both
// give the same result or the same error on every input.
absl::StatusOr<Metadata> DecodeMetadataWithTreeForTesting(
    std::string_view json, std::string_view source);

absl::Status ValidateCoverage(std::string_view fqn,
                              const TensorMetadata& tensor);
// ValidateCoverage of every tensor of `metadata`, on several threads when
// there are many chunks (ThreadsFor); the error is the first failing
// tensor's in name order, as a loop over the tensors would give.
absl::Status ValidateAllCoverage(const Metadata& metadata);
// The same check of the boxes of a tensor of `shape` (same errors), for
// callers that hold boxes and not chunks: the save coordinator checks the
// final plans' boxes in place instead of copying millions of them.
absl::Status ValidateCoverage(std::string_view fqn, const Shape& shape,
                              std::span<const Box* const> boxes);
// The same verdict for the chunks of tensor t of `flat`, read in place (no
// Box per chunk); the message may differ for a shape whose element count
// overflows.
absl::Status ValidateCoverage(std::string_view fqn, const Shape& shape,
                              const FlatChunks& flat, size_t t);

// OK when every chunk, object and key-value table entry (ids and columns)
// lies inside its file, given the real file sizes by name. kDataLoss naming FQN, file, offset and size otherwise;
// kNotFound when a referenced file is absent from `file_sizes`.
absl::Status ValidateAgainstFileSizes(
    const Metadata& metadata, const std::map<std::string, uint64_t>& file_sizes);

// OK when no two chunks, objects or key-value table entries share a byte
// of a file, as in everything cairn writes (zero-byte ones share none). kDataLoss
// naming both otherwise. Offsets and sizes must already be known not to
// overflow (DecodeMetadata checks offset + nbytes < 2^64). Sorts every
// location: for LoadAll, Merge and verify, which touch every byte anyway,
// not for every load.
absl::Status ValidateDisjointLocations(const Metadata& metadata);

// OK when `metadata.structure` is a skeleton of the stored leaves
// (docs/format.md 4.5, core/flatten.h): objects, arrays and leaves, each
// leaf the string of the FQN its place gives, naming a tensor, object or
// scalar the metadata holds, and no FQN twice. kDataLoss naming the leaf
// otherwise. Decoding stores the structure without interpreting it; this
// is for LoadAll, which builds the state dict from it, and `cairn verify`.
absl::Status ValidateStructure(const Metadata& metadata);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_METADATA_CODEC_H_
