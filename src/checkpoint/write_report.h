// A rank's write report: what it tells the coordinator at commit (its data
// file, the file's size, where each item of its final plan landed, and the
// scalars its plan left out), and the commit step that fills the metadata
// skeleton from every rank's report. save.cc sends and reads it; the scale
// simulator (bench/scale) runs the same functions.
#ifndef CAIRN_CHECKPOINT_WRITE_REPORT_H_
#define CAIRN_CHECKPOINT_WRITE_REPORT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/metadata.h"
#include "cairn/state_dict.h"
#include "plan/global_plan.h"

namespace cairn::internal_checkpoint {

struct WriteReport {
  std::string file;  // empty: no file
  uint64_t file_size = 0;
  struct Loc {
    uint64_t offset;
    uint64_t nbytes;
    uint32_t crc32c;
    // Its block checksums (format version 3): none, or as many as the
    // metadata's crc32c_block_bytes gives it.
    std::vector<uint32_t> blocks = {};
    // Format version 5: a compressed chunk's frames (codec kNone: raw).
    Compression compression = {};
    // Format version 6: a chunk kept in a referenced checkpoint (SaveOptions
    // ::base) has its file named here ("<reference url>/<file>"); empty:
    // the rank's own file.
    std::string file = {};
    // Format version 6: a tensor chunk's digest.
    std::optional<ChunkDigest> xxh3 = std::nullopt;
  };
  std::vector<Loc> items;  // in final-plan order
  std::map<std::string, Scalar> scalars;
};

std::string EncodeReport(const WriteReport& r);

// Bounds-checked; errors name "write report of rank <rank>".
absl::StatusOr<WriteReport> DecodeReport(std::string_view data, int rank);

// The coordinator's commit step: fills `skeleton`'s metadata in place from
// every rank's encoded report (rank r's report fills the locations of
// skeleton.refs[r], or of its flat chunks, skeleton.chunk_refs[r]) and
// returns it (encode it with EncodeSkeleton, which reads the flat chunks), with the scalars, created_by and
// `user_metadata` set. Every location and scalar is set anew, so a cached
// skeleton is reused from save to save without a copy. *checkpoint_bytes:
// the sum of the reported file sizes. kInvalidArgument when two ranks hold
// one scalar with different values; kInternal when a report does not
// match its plan.
//
// `references`: where reported files outside the ranks' own may lie (the
// candidates of a save against a base, save_reuse.h); the metadata lists
// those that some chunk's file lies in, in their order, and a reported
// file in none of them is kInternal.
absl::StatusOr<const Metadata*> AssembleMetadata(
    internal_plan::MetadataSkeleton& skeleton,
    const std::vector<std::string>& encoded_reports,
    std::string_view user_metadata, uint64_t* checkpoint_bytes,
    std::span<const CheckpointReference> references = {});

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_WRITE_REPORT_H_
