// Hugging Face folders out (huggingface.h): SaveHuggingFace from a live
// state dict on any number of ranks, ExportToHuggingFace from a
// checkpoint, and ConvertToCheckpoint, a Hugging Face source saved as a
// checkpoint. The protocol of SaveHuggingFace, every rank in lockstep:
//  1. Every rank sends the coordinator its tensors (FQN, dtype, shape, the
//     boxes it holds). The coordinator checks that ranks agree and that
//     each tensor's distinct boxes cover it once, picks the lowest rank
//     holding each box to write it, lays the tensors out in files
//     (PlanHfLayout), and creates the files under temporary names at
//     their full size, headers written.
//  2. Each rank maps the files it writes into and copies (or casts) its
//     boxes into place, then syncs them.
//  3. When every rank succeeded, the coordinator makes the files durable,
//     renames them to their names and writes the index last; otherwise
//     it removes them. Every rank returns the same outcome.
#include "checkpoint/hf_export.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/huggingface.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/hf_import.h"
#include "comm/collective.h"
#include "core/byte_codec.h"
#include "core/cast.h"
#include "core/flatten.h"
#include "core/parallel.h"
#include "core/status.h"
#include "core/strided.h"
#include "format/metadata_codec.h"
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

using internal_comm::AgreeOnStatus;
using internal_comm::BroadcastOutcome;
using internal_comm::GatherOrError;
using internal_comm::Ranks;
using internal_comm::ScatterOutcome;
using internal_core::Annotate;
using internal_core::ByteReader;
using internal_core::ByteWriter;

constexpr char kOperation[] = "Hugging Face export";
constexpr char kPartialSuffix[] = ".cairn-partial";

absl::Status Errno(std::string_view what, const std::string& path) {
  return absl::InternalError(
      absl::StrFormat("%s %s: %s", what, path, std::strerror(errno)));
}

absl::Status CheckCast(std::optional<DType> cast) {
  if (cast.has_value() && !internal_core::IsCastableFloat(*cast)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot cast to ", std::string(DTypeName(*cast)),
        ": the export casts floating-point tensors to F64, F32, F16 or BF16"));
  }
  return absl::OkStatus();
}

absl::Status SyncPath(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) return Errno("cannot open", path);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Errno("cannot fsync", path);
  return absl::OkStatus();
}

// A file mapped for reading or writing, whole.
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(
      const std::string& path, bool write) {
    auto m = std::unique_ptr<MappedFile>(new MappedFile);
    m->path_ = path;
    m->fd_ = ::open(path.c_str(), write ? O_RDWR : O_RDONLY);
    if (m->fd_ < 0) return Errno("cannot open", path);
    struct stat st {};
    if (::fstat(m->fd_, &st) != 0) return Errno("cannot stat", path);
    m->size_ = static_cast<uint64_t>(st.st_size);
    if (m->size_ > 0) {
      void* p = ::mmap(nullptr, m->size_, write ? PROT_READ | PROT_WRITE : PROT_READ,
                       MAP_SHARED, m->fd_, 0);
      if (p == MAP_FAILED) return Errno("cannot map", path);
      m->data_ = static_cast<std::byte*>(p);
    }
    return m;
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(data_, size_);
    if (fd_ >= 0) ::close(fd_);
  }
  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  // Writes the mapped pages back and waits for the device.
  absl::Status Sync() const {
    if (data_ != nullptr && ::msync(data_, size_, MS_SYNC) != 0) {
      return Errno("cannot sync", path_);
    }
    if (::fsync(fd_) != 0) return Errno("cannot fsync", path_);
    return absl::OkStatus();
  }

 private:
  MappedFile() = default;
  std::string path_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

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

// The files named by a folder's index (or model.safetensors), for an
// overwrite to remove what the new model does not reuse.
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
  // Cast through packed buffers, a slab of rows at a time.
  CAIRN_ASSIGN_OR_RETURN(Tensor packed, Tensor::Empty(src.dtype(), box.sizes));
  internal_core::CopyView(src, packed.view());
  CAIRN_ASSIGN_OR_RETURN(Tensor cast, Tensor::Empty(to, box.sizes));
  CAIRN_RETURN_IF_ERROR(internal_core::Cast(
      src.dtype(), packed.view().data(), to, cast.view().data(),
      static_cast<uint64_t>(box.num_elements())));
  internal_core::CopyView(cast.view(), TensorView(at, to, box.sizes, strides));
  return absl::OkStatus();
}

// What a rank holds of one tensor.
struct HeldTensor {
  std::string fqn;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<Box> boxes;
};

std::string EncodeHeld(const std::vector<HeldTensor>& held) {
  ByteWriter w;
  w.U64(held.size());
  for (const HeldTensor& t : held) {
    w.Str(t.fqn);
    w.U8(static_cast<uint8_t>(t.dtype));
    w.Ints(t.shape);
    w.U64(t.boxes.size());
    for (const Box& b : t.boxes) {
      w.Ints(b.offsets);
      w.Ints(b.sizes);
    }
  }
  return w.Take();
}

absl::StatusOr<std::vector<HeldTensor>> DecodeHeld(std::string_view bytes,
                                                   int rank) {
  ByteReader r(bytes, absl::StrCat("tensors of rank ", rank));
  std::vector<HeldTensor> out;
  const uint64_t n = r.Count(10);
  for (uint64_t i = 0; i < n && !r.failed(); ++i) {
    HeldTensor t;
    t.fqn = r.Str();
    const uint8_t d = r.U8();
    if (d >= AllDTypes().size()) {
      return absl::DataLossError(absl::StrCat("rank ", rank, ": bad dtype"));
    }
    t.dtype = static_cast<DType>(d);
    t.shape = r.Ints();
    const uint64_t boxes = r.Count(16);
    for (uint64_t b = 0; b < boxes && !r.failed(); ++b) {
      Box box;
      box.offsets = r.Ints();
      box.sizes = r.Ints();
      t.boxes.push_back(std::move(box));
    }
    out.push_back(std::move(t));
  }
  CAIRN_RETURN_IF_ERROR(r.status());
  return out;
}

// The layout, as the coordinator sends it to a rank: every tensor's file
// and offset, the files' names and sizes, and which of the rank's boxes it
// writes (in the order it sent them).
struct RankAssignment {
  std::vector<std::string> files;
  std::map<std::string, std::pair<size_t, uint64_t>> where;
  std::vector<bool> writes;  // per box, over the rank's tensors in order
  uint64_t total_size = 0;
};

std::string EncodeAssignment(const HfLayout& layout,
                             const std::vector<bool>& writes) {
  ByteWriter w;
  w.U64(layout.files.size());
  for (const HfLayoutFile& f : layout.files) w.Str(f.name);
  w.U64(layout.where.size());
  for (const auto& [fqn, where] : layout.where) {
    w.Str(fqn);
    w.U64(where.first);
    w.U64(where.second);
  }
  w.U64(writes.size());
  for (bool b : writes) w.U8(b ? 1 : 0);
  w.U64(layout.total_size);
  return w.Take();
}

absl::StatusOr<RankAssignment> DecodeAssignment(std::string_view bytes) {
  ByteReader r(bytes, "export layout from the coordinator");
  RankAssignment a;
  const uint64_t nf = r.Count(8);
  for (uint64_t i = 0; i < nf && !r.failed(); ++i) a.files.push_back(r.Str());
  const uint64_t nt = r.Count(24);
  for (uint64_t i = 0; i < nt && !r.failed(); ++i) {
    std::string fqn = r.Str();
    const uint64_t file = r.U64();
    const uint64_t offset = r.U64();
    if (file >= a.files.size()) {
      return absl::DataLossError("export layout: file index out of range");
    }
    a.where[std::move(fqn)] = {file, offset};
  }
  const uint64_t nw = r.Count(1);
  for (uint64_t i = 0; i < nw && !r.failed(); ++i) a.writes.push_back(r.U8() != 0);
  a.total_size = r.U64();
  CAIRN_RETURN_IF_ERROR(r.status());
  return a;
}

// Step 1 on the coordinator: checks, assigns boxes, plans, creates files.
absl::StatusOr<std::pair<HfLayout, std::vector<std::string>>> PlanExport(
    const std::vector<std::string>& gathered, std::string_view dir,
    const HfExportOptions& options, std::string& path) {
  const int world = static_cast<int>(gathered.size());
  std::vector<std::vector<HeldTensor>> held(world);
  for (int r = 0; r < world; ++r) {
    CAIRN_ASSIGN_OR_RETURN(held[r], DecodeHeld(gathered[r], r));
  }
  struct Global {
    DType dtype;
    Shape shape;
    int first_rank;
    std::map<std::pair<std::vector<int64_t>, std::vector<int64_t>>, int> boxes;
  };
  std::map<std::string, Global> tensors;
  std::vector<std::vector<bool>> writes(world);
  for (int r = 0; r < world; ++r) {
    for (const HeldTensor& t : held[r]) {
      auto [it, fresh] =
          tensors.try_emplace(t.fqn, Global{t.dtype, t.shape, r, {}});
      if (it->second.dtype != t.dtype || it->second.shape != t.shape) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "'%s' is %s [%s] on rank %d but %s [%s] on rank %d", t.fqn,
            DTypeName(it->second.dtype), absl::StrJoin(it->second.shape, ", "),
            it->second.first_rank, DTypeName(t.dtype),
            absl::StrJoin(t.shape, ", "), r));
      }
      for (const Box& b : t.boxes) {
        auto [bit, first] =
            it->second.boxes.try_emplace({b.offsets, b.sizes}, r);
        writes[r].push_back(first);  // the lowest rank holding it writes it
      }
    }
  }
  std::vector<HfLayoutTensor> layout_tensors;
  for (const auto& [fqn, g] : tensors) {
    std::vector<Box> boxes;
    for (const auto& [key, r] : g.boxes) boxes.push_back(Box{key.first, key.second});
    std::vector<const Box*> ptrs;
    for (const Box& b : boxes) ptrs.push_back(&b);
    absl::Status covered = internal_format::ValidateCoverage(fqn, g.shape, ptrs);
    if (!covered.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "the boxes ranks hold of '%s' do not cover it exactly once: %s", fqn,
          std::string(covered.message())));
    }
    layout_tensors.push_back({fqn, ExportedDType(g.dtype, options.dtype), g.shape});
  }
  CAIRN_ASSIGN_OR_RETURN(HfLayout layout,
                         PlanHfLayout(layout_tensors, options.max_shard_size));
  CAIRN_ASSIGN_OR_RETURN(path, PrepareFolder(dir, options.overwrite));
  absl::Status created = CreateFiles(path, layout);
  if (!created.ok()) {
    RemovePartials(path, layout);
    return created;
  }
  std::vector<std::string> payloads;
  for (int r = 0; r < world; ++r) payloads.push_back(EncodeAssignment(layout, writes[r]));
  return std::make_pair(std::move(layout), std::move(payloads));
}

// Step 2 on a rank: writes its assigned boxes.
absl::Status WriteAssigned(const std::string& dir,
                           const std::vector<internal_core::FlatLeaf>& leaves,
                           const RankAssignment& a,
                           const HfExportOptions& options, uint64_t& written,
                           bool report) {
  // (leaf, shard) pairs to write, in order.
  std::vector<std::pair<const ShardedTensor*, size_t>> jobs;
  std::vector<std::string> fqns;
  size_t k = 0;
  for (const internal_core::FlatLeaf& leaf : leaves) {
    const ShardedTensor* t = leaf.node->tensor();
    if (t == nullptr) continue;
    for (size_t s = 0; s < t->shards().size(); ++s, ++k) {
      if (k >= a.writes.size()) {
        return absl::DataLossError("export layout: fewer boxes than held");
      }
      if (a.writes[k]) {
        jobs.emplace_back(t, s);
        fqns.push_back(leaf.fqn);
      }
    }
  }
  std::map<size_t, std::unique_ptr<MappedFile>> mapped;
  for (const std::string& fqn : fqns) {
    auto it = a.where.find(fqn);
    if (it == a.where.end()) {
      return absl::DataLossError(absl::StrCat("export layout lacks ", fqn));
    }
    const size_t f = it->second.first;
    if (mapped.contains(f)) continue;
    CAIRN_ASSIGN_OR_RETURN(
        mapped[f], MappedFile::Open(absl::StrCat(dir, "/", a.files[f], kPartialSuffix),
                                    /*write=*/true));
  }
  // Bytes written (in the folder's dtypes), and the calls of `progress`,
  // one at a time.
  auto out_bytes = [&](const ShardedTensor& t, const Shard& s) {
    return static_cast<uint64_t>(s.box.num_elements()) *
           DTypeSize(ExportedDType(t.dtype(), options.dtype));
  };
  std::mutex progress_mu;
  uint64_t done = 0;
  uint64_t mine = 0;
  for (const auto& [t, s] : jobs) mine += out_bytes(*t, t->shards()[s]);
  CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
      static_cast<int64_t>(jobs.size()), std::max(1, options.load.io_threads / 2),
      [&](int64_t j) -> absl::Status {
        const auto& [t, s] = jobs[static_cast<size_t>(j)];
        const Shard& shard = t->shards()[s];
        const auto& [f, offset] = a.where.at(fqns[static_cast<size_t>(j)]);
        const DType to = ExportedDType(t->dtype(), options.dtype);
        const uint64_t n = static_cast<uint64_t>(NumElements(t->global_shape())) *
                           DTypeSize(to);
        if (offset + n > mapped.at(f)->size()) {
          return absl::DataLossError(absl::StrCat(
              "export layout places ", fqns[static_cast<size_t>(j)],
              " past the end of ", a.files[f]));
        }
        CAIRN_RETURN_IF_ERROR(
            Annotate(WriteBox(shard.view, shard.box, t->global_shape(), to,
                              mapped.at(f)->data() + offset),
                     fqns[static_cast<size_t>(j)]));
        std::lock_guard<std::mutex> lock(progress_mu);
        done += out_bytes(*t, shard);
        if (report && options.progress) options.progress(done, mine);
        return absl::OkStatus();
      }));
  for (auto& [f, m] : mapped) CAIRN_RETURN_IF_ERROR(m->Sync());
  written = done;
  return absl::OkStatus();
}

}  // namespace
}  // namespace cairn::internal_checkpoint

namespace cairn {

using internal_checkpoint::HfLayout;

absl::StatusOr<HfExportResult> SaveHuggingFace(const StateDict& state,
                                               std::string_view dir,
                                               const HfExportOptions& options) {
  using namespace internal_checkpoint;  // NOLINT
  const auto start = std::chrono::steady_clock::now();
  const internal_comm::Ranks ranks(options.comm);
  Communicator& comm = ranks.comm();
  HfExportResult result;
  // 1. What each rank holds.
  absl::StatusOr<internal_core::Flattened> flat = internal_core::Flatten(state);
  absl::Status local = flat.status();
  local.Update(CheckCast(options.dtype));
  std::vector<HeldTensor> held;
  if (local.ok()) {
    for (const internal_core::FlatLeaf& leaf : flat->leaves) {
      const ShardedTensor* t = leaf.node->tensor();
      if (t == nullptr) {
        result.skipped.push_back(leaf.fqn);
        continue;
      }
      HeldTensor h{leaf.fqn, t->dtype(), t->global_shape(), {}};
      for (const Shard& s : t->shards()) {
        if (!s.view.device().is_cpu()) {
          local = absl::UnimplementedError(absl::StrFormat(
              "%s: the Hugging Face export takes host tensors; this one is "
              "on a device",
              leaf.fqn));
        }
        h.boxes.push_back(s.box);
      }
      held.push_back(std::move(h));
    }
  }
  absl::StatusOr<std::vector<std::string>> gathered = internal_comm::GatherOrError(
      comm, local, local.ok() ? EncodeHeld(held) : "", kOperation, "planning");
  std::string path;
  HfLayout layout;
  absl::Status planned = gathered.status();
  std::vector<std::string> payloads;
  if (ranks.coordinator() && planned.ok()) {
    auto p = PlanExport(*gathered, dir, options, path);
    planned = p.status();
    if (p.ok()) {
      layout = std::move(p->first);
      payloads = std::move(p->second);
    }
  }
  CAIRN_ASSIGN_OR_RETURN(std::string mine,
                         internal_comm::ScatterOutcome(comm, planned, std::move(payloads)));
  // 2. Write.
  absl::StatusOr<RankAssignment> a = DecodeAssignment(mine);
  absl::Status wrote = a.status();
  std::string dir_path;
  if (wrote.ok()) {
    absl::StatusOr<std::string> p = internal_storage::LocalPathOf(dir);
    wrote = p.status();
    if (p.ok()) dir_path = *p;
  }
  if (wrote.ok()) {
    wrote = WriteAssigned(dir_path, flat->leaves, *a, options,
                          result.bytes_written, ranks.coordinator());
  }
  absl::Status all = internal_comm::AgreeOnStatus(comm, wrote, kOperation, "writing");
  // 3. Commit.
  absl::Status committed = all;
  if (ranks.coordinator()) {
    if (committed.ok()) committed = CommitFolder(path, layout);
    if (!committed.ok()) RemovePartials(path, layout);
  }
  CAIRN_RETURN_IF_ERROR(
      internal_comm::BroadcastOutcome(comm, committed, "").status());
  result.files = a->files;
  result.total_size = a->total_size;
  result.tensors = static_cast<int>(a->where.size());
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace cairn

namespace cairn {

absl::StatusOr<HfExportResult> ExportToHuggingFace(
    std::string_view checkpoint_url, std::string_view dir,
    const HfExportOptions& options) {
  using namespace internal_checkpoint;  // NOLINT
  const auto start = std::chrono::steady_clock::now();
  CAIRN_RETURN_IF_ERROR(CheckCast(options.dtype));
  CAIRN_ASSIGN_OR_RETURN(OpenedSource opened, OpenSourceUrl(checkpoint_url));
  CAIRN_ASSIGN_OR_RETURN(
      Metadata md, ReadAnyMetadata(*opened.storage, opened.file,
                                   options.load.import_names));
  HfExportResult result;
  std::vector<HfLayoutTensor> tensors;
  for (const auto& [fqn, t] : md.tensors) {
    tensors.push_back({fqn, ExportedDType(t.dtype, options.dtype), t.shape});
  }
  for (const auto& [fqn, unused] : md.objects) result.skipped.push_back(fqn);
  for (const auto& [fqn, unused] : md.scalars) result.skipped.push_back(fqn);
  for (const auto& [fqn, unused] : md.kv_tables) result.skipped.push_back(fqn);
  std::sort(result.skipped.begin(), result.skipped.end());
  CAIRN_ASSIGN_OR_RETURN(HfLayout layout,
                         PlanHfLayout(tensors, options.max_shard_size));
  CAIRN_ASSIGN_OR_RETURN(std::string path,
                         PrepareFolder(dir, options.overwrite));
  absl::Status s = [&]() -> absl::Status {
    CAIRN_RETURN_IF_ERROR(CreateFiles(path, layout));
    std::vector<std::unique_ptr<MappedFile>> mapped;
    for (const HfLayoutFile& f : layout.files) {
      CAIRN_ASSIGN_OR_RETURN(
          mapped.emplace_back(),
          MappedFile::Open(absl::StrCat(path, "/", f.name, kPartialSuffix),
                           /*write=*/true));
    }
    // Batches of about this many bytes: each one Load, into the mapped
    // files in place, or, to be cast, into buffers first.
    const uint64_t batch_bytes =
        std::max<uint64_t>(options.load.memory_budget_bytes / 2, 64 << 20);
    LoadOptions load = options.load;
    load.comm = nullptr;
    load.strict = true;
    load.planner = nullptr;
    load.kv_tables.clear();
    uint64_t done = 0;
    auto it = md.tensors.begin();
    while (it != md.tensors.end()) {
      StateDict batch;
      std::vector<std::pair<std::string, Tensor>> to_cast;
      uint64_t bytes = 0;
      for (; it != md.tensors.end() && (bytes == 0 || bytes < batch_bytes); ++it) {
        const auto& [fqn, t] = *it;
        const auto& [f, offset] = layout.where.at(fqn);
        const DType to = ExportedDType(t.dtype, options.dtype);
        if (to == t.dtype) {
          batch[fqn] = TensorView(mapped[f]->data() + offset, t.dtype, t.shape);
        } else {
          CAIRN_ASSIGN_OR_RETURN(Tensor buffer, Tensor::Empty(t.dtype, t.shape));
          batch[fqn] = buffer.view();
          to_cast.emplace_back(fqn, std::move(buffer));
        }
        bytes += t.nbytes();
      }
      // Keys with dots are leaves of the flat batch: a map by FQN.
      CAIRN_RETURN_IF_ERROR(
          LoadWithMetadata(batch, opened.storage.get(), md, load).status());
      for (auto& [fqn, buffer] : to_cast) {
        const auto& [f, offset] = layout.where.at(fqn);
        const TensorMetadata& t = md.tensors.at(fqn);
        CAIRN_RETURN_IF_ERROR(internal_core::Cast(
            t.dtype, buffer.view().data(), ExportedDType(t.dtype, options.dtype),
            mapped[f]->data() + offset,
            static_cast<uint64_t>(NumElements(t.shape))));
      }
      done += bytes;
      if (options.progress) options.progress(done, md.total_bytes());
    }
    for (const auto& m : mapped) CAIRN_RETURN_IF_ERROR(m->Sync());
    result.bytes_written = layout.total_size;
    return CommitFolder(path, layout);
  }();
  if (!s.ok()) {
    RemovePartials(path, layout);
    return Annotate(s, absl::StrFormat("exporting %s to %s", checkpoint_url, dir));
  }
  for (const HfLayoutFile& f : layout.files) result.files.push_back(f.name);
  result.total_size = layout.total_size;
  result.tensors = static_cast<int>(layout.where.size());
  result.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

absl::StatusOr<SaveResult> ConvertToCheckpoint(std::string_view source_url,
                                               std::string_view dst,
                                               const ConvertOptions& options) {
  using namespace internal_checkpoint;  // NOLINT
  CAIRN_RETURN_IF_ERROR(CheckCast(options.dtype));
  CAIRN_ASSIGN_OR_RETURN(OpenedSource opened, OpenSourceUrl(source_url));
  CAIRN_ASSIGN_OR_RETURN(
      Metadata md, ReadAnyMetadata(*opened.storage, opened.file, options.names));
  if (md.has_checksums) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s is a cairn checkpoint already; ExportToHuggingFace writes a "
        "Hugging Face folder of one",
        source_url));
  }
  absl::StatusOr<std::string> folder = internal_storage::LocalPathOf(
      opened.storage->url());
  if (!folder.ok()) {
    return absl::UnimplementedError(absl::StrFormat(
        "%s: conversion maps local files only (%s)", source_url,
        std::string(folder.status().message())));
  }
  // The source files, mapped: a save reads each chunk straight from them.
  std::map<std::string, std::shared_ptr<MappedFile>> files;
  for (const auto& [fqn, t] : md.tensors) {
    for (const ChunkMetadata& c : t.chunks) {
      if (files.contains(c.location.file)) continue;
      CAIRN_ASSIGN_OR_RETURN(
          std::unique_ptr<MappedFile> m,
          MappedFile::Open(absl::StrCat(*folder, "/", c.location.file),
                           /*write=*/false));
      files[c.location.file] = std::move(m);
    }
  }
  StateDict state;
  for (const auto& [fqn, t] : md.tensors) {
    const DType to = ExportedDType(t.dtype, options.dtype);
    std::vector<Shard> shards;
    std::vector<Tensor> owned;
    for (const ChunkMetadata& c : t.chunks) {
      const MappedFile& m = *files.at(c.location.file);
      if (c.location.offset + c.location.nbytes > m.size()) {
        return absl::DataLossError(absl::StrFormat(
            "%s/%s is shorter than its header says (tensor '%s')", *folder,
            c.location.file, fqn));
      }
      std::byte* at = m.data() + c.location.offset;
      if (to == t.dtype) {
        shards.push_back({c.box, TensorView(at, t.dtype, c.box.sizes)});
      } else {
        CAIRN_ASSIGN_OR_RETURN(Tensor cast, Tensor::Empty(to, c.box.sizes));
        CAIRN_RETURN_IF_ERROR(internal_core::Cast(
            t.dtype, at, to, cast.view().data(),
            static_cast<uint64_t>(c.box.num_elements())));
        shards.push_back({c.box, cast.view()});
        owned.push_back(std::move(cast));
      }
    }
    // The shards' memory: the mappings (shared), or the cast buffers.
    auto keep = std::make_shared<std::pair<decltype(files), std::vector<Tensor>>>(
        files, std::move(owned));
    state[fqn] = ShardedTensor(to, t.shape, std::move(shards), keep);
  }
  SaveOptions save = options.save;
  save.comm = nullptr;
  return Save(state, dst, save);
}

}  // namespace cairn
