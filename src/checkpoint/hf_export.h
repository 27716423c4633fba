// Writing Hugging Face folders (include/cairn/huggingface.h): the layout of
// tensors in files, the files written in place through mappings, and the
// commit (renames, then the index). SaveHuggingFace, ExportToHuggingFace
// and ConvertToCheckpoint are in hf_export.cc.
#ifndef CAIRN_CHECKPOINT_HF_EXPORT_H_
#define CAIRN_CHECKPOINT_HF_EXPORT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "format/safetensors.h"

namespace cairn::internal_checkpoint {

// A tensor to export: its name, dtype in the folder, and shape.
struct HfLayoutTensor {
  std::string fqn;
  DType dtype = DType::kF32;
  Shape shape;
};

struct HfLayoutFile {
  std::string name;  // "model.safetensors", "model-00002-of-00003.safetensors"
  std::vector<internal_format::SafetensorsEntry> entries;
  std::string header;  // the first data_start bytes
  uint64_t size = 0;   // of the whole file
};

struct HfLayout {
  std::vector<HfLayoutFile> files;
  // FQN -> (file index, absolute offset of its first byte).
  std::map<std::string, std::pair<size_t, uint64_t>> where;
  uint64_t total_size = 0;  // tensor bytes
};

// Assigns `tensors` (sorted by FQN) to files in that order: a file takes
// the next tensor while its tensor bytes stay within `max_shard_size` (a
// file's first tensor always). One file: model.safetensors.
absl::StatusOr<HfLayout> PlanHfLayout(const std::vector<HfLayoutTensor>& tensors,
                                      uint64_t max_shard_size);

// The dtype `dtype` is written as with the cast `cast`.
DType ExportedDType(DType dtype, std::optional<DType> cast);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_HF_EXPORT_H_
