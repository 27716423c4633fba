// References to earlier checkpoints (format version 6, docs/format.md
// 4.2.2): the URLs an incremental checkpoint records, and the names of the
// chunks it keeps there ("<reference url>/<file name there>").
#ifndef CAIRN_FORMAT_REFERENCES_H_
#define CAIRN_FORMAT_REFERENCES_H_

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/metadata.h"

namespace cairn::internal_format {

// OK when `url` may be a reference's: "../<name>" (a sibling; <name> a
// single safe component), or an absolute URL: "/path" or "scheme://rest",
// with no empty, "." or ".." component in the path, no control character
// or backslash, no trailing '/', at most 4096 bytes. kInvalidArgument
// naming it otherwise.
absl::Status ValidateReferenceUrl(std::string_view url);

// OK when every reference's URL is valid and none equals another or holds
// another below it (so every referenced file name has one reference), and
// their save ids are valid, distinct and not `own_save_id`. kInvalidArgument
// naming the reference otherwise.
absl::Status ValidateReferences(std::span<const CheckpointReference> refs,
                                std::string_view own_save_id);

// The reference holding the chunk file `file`: its index, with *name set to
// the file's name in that checkpoint; -1 when `file` is a safe name of the
// checkpoint's own (*name = file). kInvalidArgument when it is neither.
absl::StatusOr<int> ReferenceOf(std::string_view file,
                                std::span<const CheckpointReference> refs,
                                std::string_view* name);

// After decoding: every tensor chunk's file is the checkpoint's own or in
// one of its references (ReferenceOf), and the references are valid
// (ValidateReferences). Objects and key-value tables are always the
// checkpoint's own (the decoders check those names as they read them).
// kDataLoss naming `source`, the tensor and the file otherwise.
absl::Status CheckReferencedFiles(const Metadata& metadata,
                                  std::string_view source);

// `checkpoint_url` without trailing '/'s.
std::string_view TrimUrl(std::string_view checkpoint_url);

// The URL a reference names, seen from the checkpoint at `checkpoint_url`:
// a sibling's "../<name>" is the checkpoint's parent + "/<name>".
std::string ResolveReference(std::string_view checkpoint_url,
                             std::string_view reference_url);

// How the checkpoint at `checkpoint_url` names the one at `target_url`:
// "../<name>" when both lie in one parent, else `target_url` as it is.
std::string ReferenceFrom(std::string_view checkpoint_url,
                          std::string_view target_url);

}  // namespace cairn::internal_format

#endif  // CAIRN_FORMAT_REFERENCES_H_
