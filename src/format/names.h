// Names inside a checkpoint: data files and safetensors entries.
#ifndef CAIRN_FORMAT_NAMES_H_
#define CAIRN_FORMAT_NAMES_H_

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

// "data-00003.safetensors".
std::string DataFileName(int index);

// "rank-00003": the folder of rank 3 in a rank-local checkpoint.
std::string RankFolderName(int rank);

// The rank r of "rank-NNNNN/metadata.json" (exactly RankFolderName(r) +
// "/metadata.json"), or -1 for any other name.
int RankOfMetadataName(std::string_view name);

// The safetensors entry name of a stored box: `fqn` when the box covers the
// whole tensor, else "fqn@o0,o1,..." with the box offsets.
std::string EntryName(std::string_view fqn, const Box& box, bool whole);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_NAMES_H_
