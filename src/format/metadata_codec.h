// metadata.json <-> Metadata. docs/format.md is the normative spec.
#ifndef CAIRN_FORMAT_METADATA_CODEC_H_
#define CAIRN_FORMAT_METADATA_CODEC_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "cairn/metadata.h"

namespace cairn::internal_format {

// Largest metadata.json accepted (untrusted input), and so the largest a
// save writes. 4 GiB: a 16k-rank FSDP job's is about 1 GB (see
// bench/scale/README.md).
inline constexpr uint64_t kMaxMetadataBytes = uint64_t{4} << 30;

// Deterministic JSON text (keys sorted). `metadata.structure` and
// `metadata.user` must hold valid JSON (they are embedded as JSON values).
// kResourceExhausted when the text would be longer than `max_bytes` (a load
// would refuse it), before it is built.
absl::StatusOr<std::string> EncodeMetadata(
    const Metadata& metadata, uint64_t max_bytes = kMaxMetadataBytes);

// OK when EncodeMetadata(metadata) would succeed as far as the version,
// `structure`, `user` and the names (FQNs, created_by) go, without building
// the text: a save's coordinator checks its metadata skeleton this way
// before any data is written. Not checked: locations (the skeleton's are
// empty, and cairn names the data files) and scalar values (they arrive at
// commit).
absl::Status CheckEncodable(const Metadata& metadata);

// Parses and validates untrusted text. `source` (e.g. the file path) prefixes
// every error. Rejects: malformed JSON; "format" != "cairn"; a major
// version other than kFormatVersion (kFailedPrecondition, "unsupported
// format version"); unsafe file names (ValidateRelativeName); unknown
// dtypes; negative or overflowing shapes; boxes outside their tensor; nbytes
// != elements * dtype size; offset + nbytes overflow; bad crc32c hex.
// Ignores unknown fields. Coverage of each tensor by its chunks is checked
// by ValidateCoverage, not here.
absl::StatusOr<Metadata> DecodeMetadata(std::string_view json,
                                        std::string_view source);

// OK when the chunks of `tensor` cover its shape exactly once (no gap, no
// overlap). kDataLoss naming `fqn` and the offending boxes otherwise.
// Tests only: DecodeMetadata without its fast path (the nlohmann tree
// decoder every other input falls back to), so tests can check that both
// give the same result or the same error on every input.
absl::StatusOr<Metadata> DecodeMetadataWithTreeForTesting(
    std::string_view json, std::string_view source);

absl::Status ValidateCoverage(std::string_view fqn,
                              const TensorMetadata& tensor);
// The same check of the boxes of a tensor of `shape` (same errors), for
// callers that hold boxes and not chunks: the save coordinator checks the
// final plans' boxes in place instead of copying millions of them.
absl::Status ValidateCoverage(std::string_view fqn, const Shape& shape,
                              std::span<const Box* const> boxes);

// OK when every chunk and object lies inside its file, given the real file
// sizes by name. kDataLoss naming FQN, file, offset and size otherwise;
// kNotFound when a referenced file is absent from `file_sizes`.
absl::Status ValidateAgainstFileSizes(
    const Metadata& metadata, const std::map<std::string, uint64_t>& file_sizes);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_METADATA_CODEC_H_
