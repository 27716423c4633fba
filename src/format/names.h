// Names inside a checkpoint: data files and safetensors entries.
#ifndef CAIRN_FORMAT_NAMES_H_
#define CAIRN_FORMAT_NAMES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "cairn/box.h"

namespace cairn::internal_format {

// OK when `name` is a safe relative file name: one or more components joined
// by '/', none empty, "." or "..", no NUL or control characters, no leading
// '/', at most 4096 bytes. kInvalidArgument naming it otherwise. Metadata
// from disk is untrusted: every file name in it passes through here.
absl::Status ValidateRelativeName(std::string_view name);

// Stricter: a single component (no '/').
absl::Status ValidatePlainName(std::string_view name);

// "data-00003.safetensors": the name earlier cairn builds gave rank 3's
// data file.
std::string DataFileName(int index);

// "data-00003-<save_id>.safetensors": rank 3's data file of the save
// `save_id`. Every save writes names of its own, so a save never creates
// or truncates a file that an earlier checkpoint (or another save) uses.
std::string DataFileName(int index, std::string_view save_id);

// Whether `id` is a save id: 1 to 64 characters of [0-9A-Za-z_-] (safe in
// a file name).
bool IsSaveId(std::string_view id);

// A fresh save id: 16 lower-case hex digits, random.
std::string NewSaveId();

// The lock a save of the folder `prefix` ("" or "rank-00003/") holds.
std::string SaveLockName(std::string_view prefix);

// "rank-00003": the folder of rank 3 in a rank-local checkpoint.
std::string RankFolderName(int rank);

// The rank r of "rank-NNNNN/metadata.json" (exactly RankFolderName(r) +
// "/metadata.json"), or -1 for any other name.
int RankOfMetadataName(std::string_view name);

// The safetensors entry name of a stored box: `fqn` when the box covers the
// whole tensor, else "fqn@o0,o1,..." with the box offsets.
std::string EntryName(std::string_view fqn, const Box& box, bool whole);

// The safetensors entries of a chunk of the key-value table `fqn` that
// starts at row `row` of bucket `bucket` (a bucket's rows counted from 0;
// docs/format.md 4.7): "fqn@kv<bucket>+<row>.ids" for its ids, and
// "fqn@kv<bucket>+<row>.<column>" for each column (so no column is named
// "ids"). A writer knows these without knowing other ranks' chunks.
std::string KvEntryName(std::string_view fqn, int64_t bucket, uint64_t row,
                        std::string_view what);

// "data-00003-kv0002-<save id>.safetensors": the third file of key-value
// table chunks that rank 3 wrote in the save `save_id`.
std::string KvFileName(int index, int n, std::string_view save_id);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_NAMES_H_
