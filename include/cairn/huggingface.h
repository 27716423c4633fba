// Hugging Face interop: model folders of safetensors files in, and out.
//
// In: Load, LoadAll and ReadMetadata (checkpoint.h) take a Hugging Face
// folder (model.safetensors alone, or model.safetensors.index.json and the
// files its weight_map names) or one .safetensors file where they take a
// checkpoint. Each stored tensor is one chunk: any number of ranks load it
// with any sharding, each reading only the byte runs its boxes need. Every
// header is validated as untrusted input (size cap, entries that tile the
// file, sizes that match shape and dtype, dtypes cairn knows: an unknown or
// sub-byte dtype is an error naming the tensor and file, never a cast). Such
// files carry no checksums: LoadResult::source_has_checksums is false and
// every byte counts as unverified. LoadOptions::import_names renames, fuses
// and splits tensors (import_names.h).
//
// Out: SaveHuggingFace writes a live state dict, sharded over any number of
// ranks, straight into a Hugging Face folder; ExportToHuggingFace does the
// same from a checkpoint. The coordinator assigns tensors to files in key
// order, greedily, under max_shard_size, and computes every header and
// offset; each rank writes its boxes in place in the final files (no
// per-rank files, no second pass). The files are written under temporary
// names, made durable, then renamed; model.safetensors.index.json comes
// last (one file: model.safetensors, no index). Headers hold
// {"format": "pt"} as __metadata__, as transformers expects.
//
//   // 4 ranks, each with its shards of the model:
//   cairn::HfExportOptions options;
//   options.comm = comm;
//   options.dtype = cairn::DType::kBF16;   // cast F32 on the way
//   CAIRN_RETURN_IF_ERROR(
//       cairn::SaveHuggingFace(sd, "/models/mine", options).status());
//
// The export writes local folders (it maps the files it writes).
//
// Thread safety: as Save and Load (checkpoint.h).
#ifndef CAIRN_HUGGINGFACE_H_
#define CAIRN_HUGGINGFACE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/dtype.h"
#include "cairn/import_names.h"
#include "cairn/metadata.h"
#include "cairn/state_dict.h"

namespace cairn {

inline constexpr char kHfSingleFileName[] = "model.safetensors";
inline constexpr char kHfIndexFileName[] = "model.safetensors.index.json";

// Whether `url` holds a Hugging Face folder or is a .safetensors file (and
// no cairn checkpoint: a folder with metadata.json is a checkpoint).
absl::StatusOr<bool> IsSafetensorsSource(std::string_view url);

// The metadata of the tensors at a Hugging Face folder or .safetensors
// file, named by `names` (has_checksums false, one chunk per part).
// Errors name the file and tensor.
absl::StatusOr<Metadata> ReadImportedMetadata(std::string_view url,
                                              const ImportNames& names = {});

struct HfExportOptions {
  // Most tensor bytes in one file; a tensor larger than this gets a file
  // of its own. Default: 5 GB (huggingface_hub's "5GB").
  uint64_t max_shard_size = 5'000'000'000;
  // Cast every floating-point tensor (F64, F32, F16, BF16) to this
  // floating-point dtype, rounding to nearest even; other tensors keep
  // theirs. Default: none.
  std::optional<DType> dtype;
  // Replace the files of a Hugging Face folder already at the URL (else
  // kAlreadyExists). Default: false.
  bool overwrite = false;
  // The ranks exporting together (SaveHuggingFace); null: this process.
  Communicator* comm = nullptr;
  // Called as tensors are written, on the coordinator (SaveHuggingFace) or
  // the one process (ExportToHuggingFace), from its writing threads, one
  // call at a time: tensor bytes it has written so far, and the total it
  // writes. Default: none.
  std::function<void(uint64_t done, uint64_t total)> progress;
  // ExportToHuggingFace: how the checkpoint is read.
  LoadOptions load = {};
};

struct HfExportResult {
  std::vector<std::string> files;  // data files, in order (names only)
  uint64_t total_size = 0;         // tensor bytes in all files (index.json's
                                   // metadata.total_size)
  uint64_t bytes_written = 0;      // tensor bytes this rank wrote
  int tensors = 0;                 // tensors in the folder
  // Leaves that are not tensors (objects, scalars): a Hugging Face folder
  // holds tensors only. Their FQNs, sorted.
  std::vector<std::string> skipped;
  double seconds = 0;
};

// Writes `state` (every rank its shards; a box several ranks hold is
// written by the lowest of them) to a Hugging Face folder at `dir`.
// Tensors are named by their FQN. Collective over options.comm.
absl::StatusOr<HfExportResult> SaveHuggingFace(
    const StateDict& state, std::string_view dir,
    const HfExportOptions& options = {});

// Writes every tensor of the checkpoint at `checkpoint_url` (CRC32Cs
// checked as it reads) to a Hugging Face folder at `dir`. One process.
absl::StatusOr<HfExportResult> ExportToHuggingFace(
    std::string_view checkpoint_url, std::string_view dir,
    const HfExportOptions& options = {});

struct ConvertOptions {
  // Names of the imported tensors.
  ImportNames names = {};
  // Cast floating-point tensors (see HfExportOptions::dtype).
  std::optional<DType> dtype;
  // How the checkpoint is written (comm is ignored: one process).
  SaveOptions save = {};
};

// Saves the tensors of a Hugging Face folder or .safetensors file as a
// cairn checkpoint at `dst`, with CRC32Cs and block checksums, reading the
// source once. Without a cast, the source files are mapped, not copied
// into memory.
absl::StatusOr<SaveResult> ConvertToCheckpoint(
    std::string_view source_url, std::string_view dst,
    const ConvertOptions& options = {});

}  // namespace cairn

#endif  // CAIRN_HUGGINGFACE_H_
