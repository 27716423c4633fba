// Reading a Hugging Face folder (or one .safetensors file) as a checkpoint:
// its safetensors headers become metadata of one chunk per stored tensor,
// named by ImportNames (include/cairn/huggingface.h, import_names.h).
//
// A load's coordinator reads the index and the headers (ReadImportSource)
// and broadcasts their bytes (EncodeImportSource) in place of metadata.json;
// every rank builds the same metadata from them (BuildImportedMetadata),
// running the caller's name hook itself.
#ifndef CAIRN_CHECKPOINT_HF_IMPORT_H_
#define CAIRN_CHECKPOINT_HF_IMPORT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/import_names.h"
#include "cairn/metadata.h"
#include "cairn/storage.h"

namespace cairn::internal_checkpoint {

// Largest model.safetensors.index.json read.
inline constexpr uint64_t kMaxIndexBytes = uint64_t{64} << 20;

// The first byte of a load's metadata broadcast that carries an
// ImportSource: metadata.json, JSON, never starts with it.
inline constexpr char kImportSourceMarker = '\x01';

// One data file of the source: its name, size and header's JSON bytes.
struct SourceFile {
  std::string name;
  uint64_t size = 0;
  std::string header;
};

struct ImportSource {
  std::string url;  // for errors and created_by
  // The index file's name, or empty for a single file.
  std::string index;
  // Tensor name -> index into files: every tensor the source holds
  // (the index's weight_map; a single file's every entry).
  std::map<std::string, size_t> tensors;
  std::vector<SourceFile> files;
};

// A storage opened for a source URL: a folder, or the folder of a file
// named by the URL (`file`: "x.safetensors" or "x.safetensors.index.json";
// empty for a folder).
struct OpenedSource {
  std::unique_ptr<Storage> storage;
  std::string file;
};

// Opens `url` (a checkpoint or source folder, or a .safetensors or
// .safetensors.index.json file).
absl::StatusOr<OpenedSource> OpenSourceUrl(std::string_view url,
                                           const StorageOptions& options = {});

// Whether `storage` (with `file`, see OpenedSource) holds a source: `file`
// is set, or model.safetensors.index.json or model.safetensors exists.
absl::StatusOr<bool> HasImportSource(Storage& storage, std::string_view file);

// `not_found` (no metadata.json) with the Hugging Face files that were
// looked for too.
absl::Status NothingToLoad(const absl::Status& not_found);

// Reads the index (if any) and every data file's header, validating them
// as untrusted input: kNotFound when there is no source, kDataLoss /
// kInvalidArgument naming the file (and tensor) when one is damaged.
absl::StatusOr<ImportSource> ReadImportSource(Storage& storage,
                                              std::string_view file);

// With kImportSourceMarker in front.
std::string EncodeImportSource(const ImportSource& source);
absl::StatusOr<ImportSource> DecodeImportSource(std::string_view bytes);

// The stored tensors, each whole under its name after the prefixes, then
// mapped by names.map; checked (see ImportMapFn); has_checksums false.
absl::StatusOr<Metadata> BuildImportedMetadata(const ImportSource& source,
                                               const ImportNames& names);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_HF_IMPORT_H_
