// Writing Hugging Face folders (hf_export.h): the layout, the folder, the
// files written in place, the commit. The entry points that use them are
// hf_save.cc (live ranks) and hf_convert.cc (a checkpoint or a folder).
#include "checkpoint/hf_export.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/huggingface.h"
#include "checkpoint/hf_import.h"
#include "core/cast.h"
#include "core/status.h"
#include "core/strided.h"
#include "format/names.h"
#include "nlohmann/json.hpp"
#include "storage/file_storage.h"

namespace cairn::internal_checkpoint {

absl::StatusOr<HfLayout> PlanHfLayout(
    const std::vector<HfLayoutTensor>& tensors, uint64_t max_shard_size) {
  if (max_shard_size == 0) {
    return absl::InvalidArgumentError("max_shard_size must be positive");
  }
  std::vector<std::vector<const HfLayoutTensor*>> groups;
  uint64_t in_group = 0;
  for (const HfLayoutTensor& t : tensors) {
    const uint64_t n =
        static_cast<uint64_t>(NumElements(t.shape)) * DTypeSize(t.dtype);
    if (groups.empty() || (!groups.back().empty() && in_group + n > max_shard_size)) {
      groups.emplace_back();
      in_group = 0;
    }
    groups.back().push_back(&t);
    in_group += n;
  }
  if (groups.empty()) groups.emplace_back();  // an empty model: one file
  HfLayout layout;
  const size_t nfiles = groups.size();
  for (size_t f = 0; f < nfiles; ++f) {
    HfLayoutFile file;
    file.name = nfiles == 1 ? std::string(kHfSingleFileName)
                            : absl::StrFormat("model-%05d-of-%05d.safetensors",
                                              f + 1, nfiles);
    uint64_t at = 0;
    for (const HfLayoutTensor* t : groups[f]) {
      const uint64_t n =
          static_cast<uint64_t>(NumElements(t->shape)) * DTypeSize(t->dtype);
      file.entries.push_back({t->fqn, t->dtype, t->shape, at, at + n});
      at += n;
    }
    file.header = internal_format::EncodeSafetensorsHeader(
        file.entries, {{"format", "pt"}}, /*alignment=*/8);
    file.size = file.header.size() + at;
    for (const auto& e : file.entries) {
      layout.where[e.name] = {f, file.header.size() + e.begin};
    }
    layout.total_size += at;
    layout.files.push_back(std::move(file));
  }
  return layout;
}

DType ExportedDType(DType dtype, std::optional<DType> cast) {
  return cast.has_value() && internal_core::IsCastableFloat(dtype) ? *cast
                                                                    : dtype;
}

namespace {

absl::Status Errno(std::string_view what, const std::string& path) {
  return absl::InternalError(
      absl::StrFormat("%s %s: %s", what, path, std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(
    const std::string& path, bool write) {
  auto m = std::unique_ptr<MappedFile>(new MappedFile);
  m->path_ = path;
  m->fd_ = ::open(path.c_str(), write ? O_RDWR : O_RDONLY);
  if (m->fd_ < 0) return Errno("cannot open", path);
  struct stat st {};
  if (::fstat(m->fd_, &st) != 0) return Errno("cannot stat", path);
  m->size_ = static_cast<uint64_t>(st.st_size);
  if (m->size_ > 0) {
    void* p = ::mmap(nullptr, m->size_,
                     write ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED,
                     m->fd_, 0);
    if (p == MAP_FAILED) return Errno("cannot map", path);
    m->data_ = static_cast<std::byte*>(p);
  }
  return m;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
}

absl::Status MappedFile::Sync() const {
  if (data_ != nullptr && ::msync(data_, size_, MS_SYNC) != 0) {
    return Errno("cannot sync", path_);
  }
  if (::fsync(fd_) != 0) return Errno("cannot fsync", path_);
  return absl::OkStatus();
}

absl::Status CheckCast(std::optional<DType> cast) {
  if (cast.has_value() && !internal_core::IsCastableFloat(*cast)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot cast to ", std::string(DTypeName(*cast)),
        ": the export casts floating-point tensors to F64, F32, F16 or BF16"));
  }
  return absl::OkStatus();
}

namespace {

absl::Status SyncPath(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return Errno("cannot open", path);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Errno("cannot fsync", path);
  return absl::OkStatus();
}

}  // namespace

// The folder: local, created, and not holding a model or checkpoint that
// `overwrite` does not allow replacing.
absl::StatusOr<std::string> PrepareFolder(std::string_view dir, bool overwrite) {
  absl::StatusOr<std::string> path = internal_storage::LocalPathOf(dir);
  if (!path.ok()) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: Hugging Face export writes local folders only (%s)", dir,
        std::string(path.status().message())));
  }
  std::error_code ec;
  std::filesystem::create_directories(*path, ec);
  if (ec) {
    return absl::InternalError(absl::StrFormat("cannot create %s: %s", *path,
                                               ec.message()));
  }
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(*path) / kMetadataFileName)) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s holds a cairn checkpoint (%s); export into another folder", *path,
        kMetadataFileName));
  }
  if (!overwrite) {
    for (const char* name : {kHfIndexFileName, kHfSingleFileName}) {
      if (fs::exists(fs::path(*path) / name)) {
        return absl::AlreadyExistsError(absl::StrFormat(
            "%s/%s exists (overwrite to replace the model)", *path, name));
      }
    }
  }
  return *path;
}

// Creates every file of `layout` under its temporary name, at its full
// size, with its header.
absl::Status CreateFiles(const std::string& dir, const HfLayout& layout) {
  for (const HfLayoutFile& f : layout.files) {
    const std::string path = absl::StrCat(dir, "/", f.name, kPartialSuffix);
    const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
    if (fd < 0) return Errno("cannot create", path);
    absl::Status s;
    if (::ftruncate(fd, static_cast<off_t>(f.size)) != 0) {
      s = Errno("cannot size", path);
    } else if (::pwrite(fd, f.header.data(), f.header.size(), 0) !=
               static_cast<ssize_t>(f.header.size())) {
      s = Errno("cannot write the header of", path);
    }
    ::close(fd);
    CAIRN_RETURN_IF_ERROR(s);
  }
  return absl::OkStatus();
}

void RemovePartials(const std::string& dir, const HfLayout& layout) {
  for (const HfLayoutFile& f : layout.files) {
    std::error_code ec;
    std::filesystem::remove(absl::StrCat(dir, "/", f.name, kPartialSuffix), ec);
  }
}

namespace {

std::string IndexJson(const HfLayout& layout) {
  nlohmann::ordered_json j;
  j["metadata"]["total_size"] = layout.total_size;
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  for (const auto& [fqn, where] : layout.where) {
    map[fqn] = layout.files[where.first].name;
  }
  j["weight_map"] = std::move(map);
  return j.dump(2) + "\n";
}

}  // namespace

// The files named by a folder's index (or model.safetensors), for an
// overwrite to remove what the new model does not reuse.
namespace {

std::vector<std::string> OldFiles(const std::string& dir) {
  std::vector<std::string> out;
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(fs::path(dir) / kHfSingleFileName, ec)) {
    out.push_back(kHfSingleFileName);
  }
  auto storage = Storage::Open(dir);
  if (!storage.ok()) return out;
  absl::StatusOr<ImportSource> source = ReadImportSource(**storage, kHfIndexFileName);
  if (!source.ok()) {
    // A damaged index: its own name at least goes.
    return out;
  }
  for (const SourceFile& f : source->files) out.push_back(f.name);
  return out;
}

}  // namespace

// Makes the files durable under their names and writes the index last.
absl::Status CommitFolder(const std::string& dir, const HfLayout& layout) {
  for (const HfLayoutFile& f : layout.files) {
    CAIRN_RETURN_IF_ERROR(
        SyncPath(absl::StrCat(dir, "/", f.name, kPartialSuffix), false));
  }
  const std::vector<std::string> old = OldFiles(dir);
  // Un-commit an old sharded model first: its index must never name a file
  // that has been replaced.
  const std::string index = absl::StrCat(dir, "/", kHfIndexFileName);
  if (::unlink(index.c_str()) != 0 && errno != ENOENT) {
    return Errno("cannot remove", index);
  }
  std::set<std::string> names;
  for (const HfLayoutFile& f : layout.files) {
    const std::string to = absl::StrCat(dir, "/", f.name);
    if (::rename(absl::StrCat(to, kPartialSuffix).c_str(), to.c_str()) != 0) {
      return Errno("cannot rename into place", to);
    }
    names.insert(f.name);
  }
  for (const std::string& name : old) {
    if (names.contains(name)) continue;
    if (internal_format::ValidateRelativeName(name).ok() &&
        name.find('/') == std::string::npos) {
      ::unlink(absl::StrCat(dir, "/", name).c_str());
    }
  }
  CAIRN_RETURN_IF_ERROR(SyncPath(dir, true));
  if (layout.files.size() > 1) {
    CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, Storage::Open(dir));
    CAIRN_RETURN_IF_ERROR(
        storage->WriteAtomically(kHfIndexFileName, IndexJson(layout)));
  }
  return absl::OkStatus();
}

// Copies (casting when the dtypes differ) `src` into the box `box` of the
// row-major tensor of `shape` and dtype `to` at `base`.
absl::Status WriteBox(const TensorView& src, const Box& box, const Shape& shape,
                      DType to, std::byte* base) {
  const size_t es = DTypeSize(to);
  const std::vector<int64_t> strides = ContiguousStrides(shape);
  int64_t first = 0;
  for (size_t d = 0; d < shape.size(); ++d) first += box.offsets[d] * strides[d];
  std::byte* at = base + static_cast<uint64_t>(first) * es;
  if (box.num_elements() == 0) return absl::OkStatus();
  if (src.dtype() == to) {
    internal_core::CopyView(src, TensorView(at, to, box.sizes, strides));
    return absl::OkStatus();
  }
  // Cast through a packed buffer of the whole box (and a packed copy of
  // the source first, when it is strided).
  Tensor packed;
  const void* from = src.data();
  if (!src.is_contiguous()) {
    CAIRN_ASSIGN_OR_RETURN(packed, Tensor::Empty(src.dtype(), box.sizes));
    internal_core::CopyView(src, packed.view());
    from = packed.view().data();
  }
  CAIRN_ASSIGN_OR_RETURN(Tensor cast, Tensor::Empty(to, box.sizes));
  CAIRN_RETURN_IF_ERROR(internal_core::Cast(
      src.dtype(), from, to, cast.view().data(),
      static_cast<uint64_t>(box.num_elements())));
  internal_core::CopyView(cast.view(), TensorView(at, to, box.sizes, strides));
  return absl::OkStatus();
}

}  // namespace cairn::internal_checkpoint
