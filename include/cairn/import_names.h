// Names for sources that are not cairn checkpoints: a Hugging Face model
// folder or a .safetensors file (include/cairn/huggingface.h). Their tensors
// are loaded as stored, one chunk each; these options rename them, and a
// hook may rename, drop, fuse or split them, before the load matches them to
// the destination state dict.
//
//   cairn::LoadOptions options;
//   options.import_names.strip_prefix = "model.";
//   options.import_names.map = [](std::vector<cairn::ImportedTensor> ts)
//       -> absl::StatusOr<std::vector<cairn::ImportedTensor>> {
//     // Three [h, d] projections become one [3h, d] tensor.
//     CAIRN_RETURN_IF_ERROR(cairn::FuseTensors(
//         ts, {"attn.q.weight", "attn.k.weight", "attn.v.weight"},
//         "attn.qkv.weight", /*dim=*/0));
//     return ts;
//   };
//
// Thread safety: the functions are pure; a hook is called on every rank of
// a load, once, from the thread that called Load.
#ifndef CAIRN_IMPORT_NAMES_H_
#define CAIRN_IMPORT_NAMES_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/box.h"
#include "cairn/dtype.h"

namespace cairn {

// Rows of a stored tensor that become a box of a loaded one.
struct ImportPart {
  std::string source;      // the stored tensor (its safetensors entry name)
  int64_t source_row = 0;  // first index along dim 0 of the source it takes
  // Where the rows land in the loaded tensor. box.sizes is the source's
  // shape, but for dim 0, which may be fewer (rows from source_row on):
  // only a run of leading-dimension rows is contiguous in the file.
  Box box;
  friend bool operator==(const ImportPart&, const ImportPart&) = default;
};

// A tensor as a load sees it, made of parts of stored tensors that tile
// its shape exactly once. All parts have the tensor's dtype (no cast).
struct ImportedTensor {
  std::string fqn;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<ImportPart> parts;
  friend bool operator==(const ImportedTensor&, const ImportedTensor&) =
      default;
};

// Gets the stored tensors, each whole under its name (after the prefixes
// below), sorted by name; returns the tensors to load. A tensor it leaves
// out is not loaded. What it returns is checked: FQNs unique and not empty,
// parts inside their tensor and their source, tiling the tensor once, no
// stored byte used twice; an error names the FQN.
using ImportMapFn = std::function<absl::StatusOr<std::vector<ImportedTensor>>(
    std::vector<ImportedTensor>)>;

struct ImportNames {
  // Removed from the front of every stored name that starts with it
  // (others are kept as they are). Default: none.
  std::string strip_prefix;
  // Then put in front of every name. Default: none.
  std::string add_prefix;
  // Then called (see ImportMapFn). Default: none.
  ImportMapFn map;
};

// Replaces the tensors named `sources` (each a whole tensor, in this
// order, of one dtype and equal sizes but along `dim`) in `tensors` with
// one named `fqn`, their concatenation along `dim`. kNotFound naming a
// missing source; kInvalidArgument when they do not fit together or one
// is not a single whole stored tensor (an earlier fuse or split).
absl::Status FuseTensors(std::vector<ImportedTensor>& tensors,
                         const std::vector<std::string>& sources,
                         const std::string& fqn, int dim = 0);

// Replaces the tensor `source` (whole) in `tensors` with tensors of its
// leading rows, `pieces` in order: (name, rows), rows adding up to its
// dim 0. kNotFound / kInvalidArgument naming `source` otherwise.
absl::Status SplitRows(
    std::vector<ImportedTensor>& tensors, const std::string& source,
    const std::vector<std::pair<std::string, int64_t>>& pieces);

}  // namespace cairn

#endif  // CAIRN_IMPORT_NAMES_H_
