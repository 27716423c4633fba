// Writing Hugging Face folders (include/cairn/huggingface.h): the layout of
// tensors in files, the files written in place through mappings, and the
// commit (renames, then the index), in hf_export.cc. SaveHuggingFace (live
// ranks) is hf_save.cc; ExportToHuggingFace and ConvertToCheckpoint are
// hf_convert.cc.
#ifndef CAIRN_CHECKPOINT_HF_EXPORT_H_
#define CAIRN_CHECKPOINT_HF_EXPORT_H_

#include <cstdint>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/tensor.h"
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

// The suffix of a file being written, until the commit renames it.
inline constexpr char kPartialSuffix[] = ".cairn-partial";

// kInvalidArgument unless `cast` is none or a castable float dtype.
absl::Status CheckCast(std::optional<DType> cast);

// A file mapped for reading or writing, whole (MAP_SHARED: writes go to
// the file).
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(
      const std::string& path, bool write);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  // Writes the mapped pages back and waits for the device.
  absl::Status Sync() const;

 private:
  MappedFile() = default;
  std::string path_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

// The folder `dir` (a local path or file URL): created, and not holding
// a cairn checkpoint, nor a model unless `overwrite`. Its local path.
absl::StatusOr<std::string> PrepareFolder(std::string_view dir, bool overwrite);

// Creates every file of `layout` in `dir` under its temporary name, at its
// full size, with its header.
absl::Status CreateFiles(const std::string& dir, const HfLayout& layout);

// Removes the temporary files of `layout` (a failed export).
void RemovePartials(const std::string& dir, const HfLayout& layout);

// Makes the files durable under their names, removes an old model's
// files the new one does not reuse, and writes the index last.
absl::Status CommitFolder(const std::string& dir, const HfLayout& layout);

// Copies (casting when the dtypes differ) `src` into the box `box` of the
// row-major tensor of `shape` and dtype `to` at `base`.
absl::Status WriteBox(const TensorView& src, const Box& box, const Shape& shape,
                      DType to, std::byte* base);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_HF_EXPORT_H_
