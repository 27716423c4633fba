// RewriteCheckpoint (cairn/checkpoint.h): a checkpoint saved again under
// other options (another codec, or raw), through LoadAll and Save.
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/metadata.h"
#include "cairn/state_dict.h"
#include "core/status.h"

namespace cairn {

absl::StatusOr<SaveResult> RewriteCheckpoint(std::string_view src,
                                             std::string_view dst,
                                             const SaveOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(const Metadata md, ReadMetadata(src));
  if (!md.kv_tables.empty()) {
    return absl::UnimplementedError(absl::StrCat(
        "rewriting ", std::string(src), ": its ", md.kv_tables.size(),
        " key-value table(s) cannot be rewritten yet (tables are stored "
        "raw; copy the checkpoint instead)"));
  }
  CAIRN_ASSIGN_OR_RETURN(StateDict state, LoadAll(src));
  SaveOptions o = options;
  o.comm = nullptr;
  if (o.user_metadata == "{}") o.user_metadata = md.user;
  absl::StatusOr<SaveResult> saved = Save(state, dst, o);
  if (!saved.ok()) {
    return internal_core::Annotate(
        saved.status(),
        absl::StrCat("rewriting ", std::string(src), " to ", std::string(dst)));
  }
  return saved;
}

}  // namespace cairn
