// Load, one process. The protocol, in order:
//
//  1. Read metadata.json; decode and validate it as untrusted input (file
//     names, dtypes, boxes inside their tensors, sizes, chunk coverage).
//  2. Flatten the destination state dict and match every leaf to the
//     checkpoint: a missing leaf is an error in strict mode; a tensor's dtype
//     and global shape must match; scalars and objects are replaced.
//  3. Open every data file that holds a needed byte, read and validate its
//     safetensors header, and check that each needed chunk is an entry of it
//     (so offsets and sizes are known to lie inside the real file).
//  4. Plan reads: intersect every destination box with every stored chunk,
//     and cut each overlap into slabs whose file span fits one bounce buffer.
//     A slab contiguous in the file and in the destination is read straight
//     into the destination; otherwise the slab's span (small gaps coalesced)
//     or each of its runs (large gaps) goes through a bounce buffer and a
//     strided copy. Only bytes of rows/runs that overlap are read.
//  5. Run the reads on IO threads. A chunk read whole is checksummed as its
//     slabs land (pieces combined afterwards) and compared with its CRC32C.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/checkpoint.h"
#include "checkpoint/checkpoint_impl.h"
#include "core/buffer_pool.h"
#include "core/flatten.h"
#include "core/parallel.h"
#include "core/status.h"
#include "core/strided.h"
#include "format/crc32c.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "format/safetensors.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::Annotate;
using internal_core::BufferPool;
using internal_core::PooledBuffer;

struct DataFile {
  std::unique_ptr<ReadableFile> file;
  // Absolute [begin, end) of every entry in the file's safetensors header.
  absl::flat_hash_set<std::pair<uint64_t, uint64_t>> entries;
};

// A stored chunk (or object) that is read whole, so its CRC32C is checked.
struct Check {
  std::string what;  // "model.wq@1024,0" or the object's FQN
  const ByteLocation* location = nullptr;
};

struct ReadTask {
  enum class Mode : uint8_t { kDirect, kSpan, kRuns, kObject };
  Mode mode = Mode::kDirect;
  int file = 0;              // index into the data files
  uint64_t file_offset = 0;  // absolute offset of the first byte to read
  uint64_t span = 0;         // bytes from file_offset to the last byte needed
  std::string what;          // for errors: entry name
  // kDirect: read `span` bytes into dst.
  std::byte* dst = nullptr;
  // kSpan / kRuns: read into a bounce buffer, then make each copy out of it.
  // Several copies when several destination boxes share the slab.
  struct Copy {
    uint64_t src_offset = 0;  // bytes into the bounce buffer
    std::byte* dst = nullptr;
    std::vector<int64_t> shape;
    std::vector<int64_t> dst_strides;  // bytes
  };
  std::vector<Copy> copies;
  std::vector<int64_t> src_strides;  // bytes, shared by the copies
  size_t elem_size = 1;
  internal_core::RunPattern runs;  // kRuns: runs relative to file_offset
  std::string* object = nullptr;   // kObject: destination string
  int check = -1;                  // index into checks, or -1
  uint64_t check_offset = 0;       // offset of this piece within the chunk
};

std::vector<int64_t> RowMajorByteStrides(const Shape& sizes, size_t es) {
  std::vector<int64_t> s(sizes.size());
  int64_t acc = static_cast<int64_t>(es);
  for (int d = static_cast<int>(sizes.size()) - 1; d >= 0; --d) {
    s[d] = acc;
    acc *= sizes[d];
  }
  return s;
}

absl::Status ValidateDestination(const std::string& fqn,
                                 const ShardedTensor& t,
                                 const TensorMetadata& stored) {
  if (t.dtype() != stored.dtype) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: dtype mismatch: checkpoint has %s, destination is %s", fqn,
        DTypeName(stored.dtype), DTypeName(t.dtype())));
  }
  if (t.global_shape() != stored.shape) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: shape mismatch: checkpoint has [%s], destination is [%s]", fqn,
        absl::StrJoin(stored.shape, ", "),
        absl::StrJoin(t.global_shape(), ", ")));
  }
  for (const Shard& s : t.shards()) {
    CAIRN_RETURN_IF_ERROR(ValidateShard(fqn, t, s));
  }
  return absl::OkStatus();
}

// Opens `name` and checks its safetensors header.
absl::StatusOr<DataFile> OpenDataFile(Storage& storage,
                                      const std::string& name) {
  DataFile df;
  CAIRN_ASSIGN_OR_RETURN(df.file, storage.OpenForRead(name));
  CAIRN_ASSIGN_OR_RETURN(internal_format::SafetensorsHeader header,
                         internal_format::ReadSafetensorsHeader(*df.file, name));
  for (const internal_format::SafetensorsEntry& e : header.entries) {
    df.entries.insert({header.data_start + e.begin, header.data_start + e.end});
  }
  return df;
}

// A destination box and the part of one stored chunk it needs.
struct Target {
  const Shard* shard;
  Box overlap;
};

class Loader {
 public:
  Loader(Storage& storage, const Metadata& metadata, const LoadOptions& options)
      : storage_(storage), metadata_(metadata), options_(options) {}

  absl::StatusOr<LoadResult> Run(StateDict& state) {
    const auto start = std::chrono::steady_clock::now();
    CAIRN_ASSIGN_OR_RETURN(internal_core::MutableFlattened flat,
                           internal_core::FlattenMutable(state));
    std::set<std::string> requested;
    for (internal_core::MutableFlatLeaf& leaf : flat.leaves) {
      requested.insert(leaf.fqn);
      CAIRN_RETURN_IF_ERROR(PlanLeaf(leaf.fqn, *leaf.node));
    }
    auto note_unexpected = [&](const auto& map) {
      for (const auto& [fqn, unused] : map) {
        if (!requested.contains(fqn)) result_.unexpected.push_back(fqn);
      }
    };
    note_unexpected(metadata_.tensors);
    note_unexpected(metadata_.objects);
    note_unexpected(metadata_.scalars);
    std::sort(result_.unexpected.begin(), result_.unexpected.end());

    CAIRN_RETURN_IF_ERROR(CheckLocations());
    CAIRN_RETURN_IF_ERROR(Execute());
    result_.seconds = std::chrono::duration<double>(
                          std::chrono::steady_clock::now() - start)
                          .count();
    return std::move(result_);
  }

 private:
  absl::Status Missing(const std::string& fqn, std::string_view kind) {
    if (options_.strict) {
      return absl::NotFoundError(absl::StrFormat(
          "%s '%s' is not in the checkpoint at %s (load with strict = false "
          "to skip it)",
          kind, fqn, storage_.url()));
    }
    result_.missing.push_back(fqn);
    return absl::OkStatus();
  }

  absl::Status WrongKind(const std::string& fqn, std::string_view want) {
    std::string_view have = metadata_.tensors.contains(fqn)   ? "a tensor"
                            : metadata_.objects.contains(fqn) ? "an object"
                                                              : "a scalar";
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: the destination is %s but the checkpoint holds %s", fqn, want,
        have));
  }

  bool Stored(const std::string& fqn) const {
    return metadata_.tensors.contains(fqn) || metadata_.objects.contains(fqn) ||
           metadata_.scalars.contains(fqn);
  }

  absl::Status PlanLeaf(const std::string& fqn, StateDict& node) {
    if (Scalar* s = node.scalar()) {
      auto it = metadata_.scalars.find(fqn);
      if (it == metadata_.scalars.end()) {
        return Stored(fqn) ? WrongKind(fqn, "a scalar") : Missing(fqn, "scalar");
      }
      *s = it->second;
      return absl::OkStatus();
    }
    if (Object* o = node.object()) {
      auto it = metadata_.objects.find(fqn);
      if (it == metadata_.objects.end()) {
        return Stored(fqn) ? WrongKind(fqn, "an object") : Missing(fqn, "object");
      }
      ReadTask task;
      task.mode = ReadTask::Mode::kObject;
      task.file = FileIndex(it->second.file);
      task.file_offset = it->second.offset;
      task.span = it->second.nbytes;
      task.what = fqn;
      task.object = &o->bytes;
      result_.bytes_loaded += it->second.nbytes;
      task.check = AddCheck(fqn, &it->second);
      needed_.push_back({task.file, &it->second, fqn});
      tasks_.push_back(std::move(task));
      return absl::OkStatus();
    }
    if (ShardedTensor* t = node.tensor()) {
      auto it = metadata_.tensors.find(fqn);
      if (it == metadata_.tensors.end()) {
        return Stored(fqn) ? WrongKind(fqn, "a tensor") : Missing(fqn, "tensor");
      }
      CAIRN_RETURN_IF_ERROR(ValidateDestination(fqn, *t, it->second));
      for (const ChunkMetadata& chunk : it->second.chunks) {
        std::vector<Target> targets;
        for (const Shard& shard : t->shards()) {
          if (shard.box.empty()) continue;
          if (std::optional<Box> o = Intersect(shard.box, chunk.box)) {
            targets.push_back(Target{&shard, *o});
          }
        }
        if (targets.empty()) continue;
        // Several destination boxes of this process in one chunk (e.g.
        // column shards of a row chunk): read the chunk region they span
        // once and copy to each, when that wastes at most half the bytes.
        Box region = targets[0].overlap;
        int64_t needed = 0;
        for (const Target& tg : targets) {
          needed += tg.overlap.num_elements();
          for (int d = 0; d < region.rank(); ++d) {
            const int64_t end =
                std::max(region.offsets[d] + region.sizes[d],
                         tg.overlap.offsets[d] + tg.overlap.sizes[d]);
            region.offsets[d] = std::min(region.offsets[d], tg.overlap.offsets[d]);
            region.sizes[d] = end - region.offsets[d];
          }
        }
        if (targets.size() > 1 && 2 * needed >= region.num_elements()) {
          CAIRN_RETURN_IF_ERROR(
              PlanRegion(fqn, it->second, chunk, region, targets));
        } else {
          for (const Target& tg : targets) {
            CAIRN_RETURN_IF_ERROR(
                PlanRegion(fqn, it->second, chunk, tg.overlap, {tg}));
          }
        }
      }
      return absl::OkStatus();
    }
    return absl::InternalError(absl::StrCat("non-leaf at ", fqn));
  }

  int FileIndex(const std::string& name) {
    auto [it, inserted] =
        file_index_.try_emplace(name, static_cast<int>(file_names_.size()));
    if (inserted) file_names_.push_back(name);
    return it->second;
  }

  int AddCheck(std::string what, const ByteLocation* location) {
    if (!options_.verify_checksums) return -1;
    checks_.push_back(Check{std::move(what), location});
    return static_cast<int>(checks_.size()) - 1;
  }

  // Cuts `overlap` (a region of `chunk` holding what `targets` need) into
  // slabs whose file span fits a bounce buffer; one read task per slab.
  absl::Status PlanRegion(const std::string& fqn, const TensorMetadata& tm,
                          const ChunkMetadata& chunk, const Box& overlap,
                          const std::vector<Target>& targets) {
    const size_t es = DTypeSize(tm.dtype);
    const int rank = overlap.rank();
    const bool whole_chunk = overlap == chunk.box;
    const std::string what = internal_format::EntryName(
        fqn, chunk.box, chunk.box == Box::Full(tm.shape));
    const int file = FileIndex(chunk.location.file);
    needed_.push_back({file, &chunk.location, what});
    const int check = whole_chunk ? AddCheck(what, &chunk.location) : -1;

    const std::vector<int64_t> cs = RowMajorByteStrides(chunk.box.sizes, es);
    const uint64_t bounce = std::max<uint64_t>(options_.bounce_buffer_bytes,
                                               internal_core::kIoAlignment);
    // Span in the chunk of a box with `sizes`, from its first to last byte.
    auto span_of = [&](const std::vector<int64_t>& sizes) {
      uint64_t span = es;
      for (int d = 0; d < rank; ++d) span += (sizes[d] - 1) * cs[d];
      return span;
    };
    // Slabs: single index along dims < k, runs of n indices along dim k,
    // everything along dims > k. k is the outermost dim whose single slice
    // fits the bounce buffer.
    int k = 0;
    int64_t n = 1;
    if (rank > 0) {
      std::vector<int64_t> slice = overlap.sizes;
      for (k = 0; k < rank; ++k) {
        slice[k] = 1;  // dims <= k now have size 1
        const uint64_t slice_span = span_of(slice);
        // The innermost slice is one element, which always fits.
        if (slice_span <= bounce || k == rank - 1) {
          // n slices along dim k span slice_span + (n - 1) * cs[k] bytes.
          n = slice_span >= bounce
                  ? 1
                  : static_cast<int64_t>((bounce - slice_span) / cs[k]) + 1;
          n = std::min(n, overlap.sizes[k]);
          break;
        }
      }
    }
    // Odometer over dims < k, and steps of n along dim k.
    Box slab = overlap;
    for (int d = 0; d < k; ++d) slab.sizes[d] = 1;
    std::vector<int64_t> idx(k, 0);
    while (true) {
      for (int d = 0; d < k; ++d) slab.offsets[d] = overlap.offsets[d] + idx[d];
      const int64_t k_end =
          rank > 0 ? overlap.offsets[k] + overlap.sizes[k] : 1;
      for (int64_t pos = rank > 0 ? overlap.offsets[k] : 0; pos < k_end;
           pos += n) {
        if (rank > 0) {
          slab.offsets[k] = pos;
          slab.sizes[k] = std::min(n, k_end - pos);
        }
        CAIRN_RETURN_IF_ERROR(
            AddSlabTask(chunk, targets, slab, file, check, what, es, cs));
      }
      int d = k - 1;
      for (; d >= 0; --d) {
        if (++idx[d] < overlap.sizes[d]) break;
        idx[d] = 0;
      }
      if (d < 0) break;
    }
    return absl::OkStatus();
  }

  absl::Status AddSlabTask(const ChunkMetadata& chunk,
                           const std::vector<Target>& targets, const Box& slab,
                           int file, int check, const std::string& what,
                           size_t es, const std::vector<int64_t>& cs) {
    const int rank = slab.rank();
    internal_core::RunPattern runs =
        internal_core::SubBoxRuns(chunk.box, slab, es);
    uint64_t in_chunk = 0;
    uint64_t span = es;
    for (int d = 0; d < rank; ++d) {
      in_chunk += (slab.offsets[d] - chunk.box.offsets[d]) * cs[d];
      span += (slab.sizes[d] - 1) * cs[d];
    }
    ReadTask task;
    task.file = file;
    task.file_offset = chunk.location.offset + in_chunk;
    task.span = span;
    task.what = what;
    task.elem_size = es;
    task.check = check;
    task.check_offset = in_chunk;
    task.src_strides = cs;
    // One copy per destination box that meets the slab.
    for (const Target& tg : targets) {
      std::optional<Box> part =
          rank == 0 ? std::optional<Box>(slab) : Intersect(slab, tg.overlap);
      if (!part) continue;
      Box local = *part;  // relative to the destination shard
      for (int d = 0; d < rank; ++d) local.offsets[d] -= tg.shard->box.offsets[d];
      CAIRN_ASSIGN_OR_RETURN(TensorView dst, tg.shard->view.Slice(local));
      ReadTask::Copy copy;
      for (int d = 0; d < rank; ++d) {
        copy.src_offset += (part->offsets[d] - slab.offsets[d]) * cs[d];
      }
      copy.dst = static_cast<std::byte*>(dst.data());
      copy.shape = part->sizes;
      for (int64_t st : dst.strides()) {
        copy.dst_strides.push_back(st * static_cast<int64_t>(es));
      }
      result_.bytes_loaded += static_cast<uint64_t>(part->num_elements()) * es;
      task.copies.push_back(std::move(copy));
    }
    if (task.copies.empty()) return absl::OkStatus();
    if (task.copies.size() == 1 && runs.num_runs() == 1 &&
        task.copies[0].shape == slab.sizes &&
        IsDense(task.copies[0].shape, task.copies[0].dst_strides, es)) {
      // Contiguous in the file and in the destination: no bounce buffer.
      task.mode = ReadTask::Mode::kDirect;
      task.dst = task.copies[0].dst;
      task.copies.clear();
    } else {
      const int64_t gap = runs.strides.empty()
                              ? 0
                              : runs.strides.back() - runs.run_bytes;
      if (task.copies.size() > 1 ||
          gap <= static_cast<int64_t>(options_.coalesce_gap_bytes)) {
        task.mode = ReadTask::Mode::kSpan;
      } else {
        // Far-apart runs of one destination: read each run, packed.
        task.mode = ReadTask::Mode::kRuns;
        task.runs = runs;
        task.runs.first_offset -= static_cast<int64_t>(in_chunk);
        task.src_strides = RowMajorByteStrides(slab.sizes, es);
      }
    }
    tasks_.push_back(std::move(task));
    return absl::OkStatus();
  }

  // True when a block of `shape` with byte `strides` is row-major dense.
  static bool IsDense(const std::vector<int64_t>& shape,
                      const std::vector<int64_t>& strides, size_t es) {
    int64_t expect = static_cast<int64_t>(es);
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      if (shape[d] != 1 && strides[d] != expect) return false;
      expect *= shape[d];
    }
    return true;
  }

  // Step 3: every needed byte range is an entry of its file's header.
  absl::Status CheckLocations() {
    files_.resize(file_names_.size());
    CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
        static_cast<int64_t>(file_names_.size()), options_.io_threads,
        [&](int64_t i) -> absl::Status {
          absl::StatusOr<DataFile> df = OpenDataFile(storage_, file_names_[i]);
          if (!df.ok()) {
            return Annotate(df.status(),
                            absl::StrCat("checkpoint ", storage_.url()));
          }
          files_[i] = *std::move(df);
          return absl::OkStatus();
        }));
    for (const Needed& n : needed_) {
      const ByteLocation& loc = *n.location;
      if (!files_[n.file].entries.contains(
              {loc.offset, loc.offset + loc.nbytes})) {
        return absl::DataLossError(absl::StrFormat(
            "%s (%s, offset %d, %d bytes) is not an entry of that file's "
            "safetensors header: metadata.json and the data file disagree",
            n.what, loc.file, loc.offset, loc.nbytes));
      }
    }
    return absl::OkStatus();
  }

  // Runs one read task; sets *crc to the CRC32C of the bytes read when the
  // task is a piece of a checked chunk.
  absl::Status RunTask(const ReadTask& t, BufferPool& pool, uint32_t* crc) {
    const ReadableFile& file = *files_[t.file].file;
    auto context = [&] {
      return absl::StrFormat("reading %s (%s, offset %d)", t.what,
                             file_names_[t.file], t.file_offset);
    };
    auto checksum = [&](const void* bytes) {
      if (t.check >= 0) *crc = internal_format::Crc32c(bytes, t.span);
    };
    switch (t.mode) {
      case ReadTask::Mode::kObject:
        t.object->resize(t.span);
        CAIRN_RETURN_IF_ERROR(Annotate(
            file.ReadAt(t.file_offset,
                        std::as_writable_bytes(
                            std::span<char>(t.object->data(), t.span))),
            context()));
        checksum(t.object->data());
        return absl::OkStatus();
      case ReadTask::Mode::kDirect:
        CAIRN_RETURN_IF_ERROR(Annotate(
            file.ReadAt(t.file_offset, std::span<std::byte>(t.dst, t.span)),
            context()));
        checksum(t.dst);
        return absl::OkStatus();
      case ReadTask::Mode::kSpan:
      case ReadTask::Mode::kRuns:
        break;
    }
    CAIRN_ASSIGN_OR_RETURN(PooledBuffer buf, pool.Acquire());
    if (t.mode == ReadTask::Mode::kSpan) {
      CAIRN_RETURN_IF_ERROR(Annotate(
          file.ReadAt(t.file_offset, std::span<std::byte>(buf.data(), t.span)),
          context()));
      checksum(buf.data());  // a checked chunk is contiguous: span == bytes
    } else {
      // Far-apart runs, packed one after another (never a whole chunk).
      absl::Status status;
      int64_t packed = 0;
      internal_core::ForEachRun(t.runs, [&](int64_t offset) {
        if (status.ok()) {
          status = file.ReadAt(
              t.file_offset + offset,
              std::span<std::byte>(buf.data() + packed, t.runs.run_bytes));
        }
        packed += t.runs.run_bytes;
      });
      CAIRN_RETURN_IF_ERROR(Annotate(status, context()));
    }
    for (const ReadTask::Copy& c : t.copies) {
      internal_core::CopyStrided(buf.data() + c.src_offset,
                                 t.src_strides.data(), c.dst,
                                 c.dst_strides.data(), c.shape.data(),
                                 static_cast<int>(c.shape.size()), t.elem_size);
    }
    return absl::OkStatus();
  }

  absl::Status Execute() {
    // Reads in file order, so the disk sees mostly sequential requests.
    std::vector<size_t> order(tasks_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return std::pair(tasks_[a].file, tasks_[a].file_offset) <
             std::pair(tasks_[b].file, tasks_[b].file_offset);
    });
    const int threads = std::max(1, options_.io_threads);
    BufferPool pool(std::max<uint64_t>(options_.bounce_buffer_bytes,
                                       internal_core::kIoAlignment),
                    threads);
    std::vector<uint32_t> crcs(tasks_.size(), 0);
    CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
        static_cast<int64_t>(order.size()), threads,
        [&](int64_t i) -> absl::Status {
          const size_t t = order[i];
          return RunTask(tasks_[t], pool, &crcs[t]);
        }));
    for (const ReadTask& t : tasks_) {
      result_.bytes_read +=
          t.mode == ReadTask::Mode::kRuns ? t.runs.total_bytes() : t.span;
    }

    // Combine each checked chunk's pieces in chunk order and compare.
    std::vector<std::vector<size_t>> pieces(checks_.size());
    for (size_t i = 0; i < tasks_.size(); ++i) {
      if (tasks_[i].check >= 0) pieces[tasks_[i].check].push_back(i);
    }
    for (size_t c = 0; c < checks_.size(); ++c) {
      std::vector<size_t>& p = pieces[c];
      std::sort(p.begin(), p.end(), [&](size_t a, size_t b) {
        return tasks_[a].check_offset < tasks_[b].check_offset;
      });
      uint32_t crc = 0;
      uint64_t covered = 0;
      for (size_t i : p) {
        crc = covered == 0 ? crcs[i]
                           : internal_format::Crc32cCombine(crc, crcs[i],
                                                            tasks_[i].span);
        covered += tasks_[i].span;
      }
      const ByteLocation& loc = *checks_[c].location;
      if (covered != loc.nbytes) {
        return absl::InternalError(absl::StrFormat(
            "%s: checksummed %d of %d bytes", checks_[c].what, covered,
            loc.nbytes));
      }
      if (crc != loc.crc32c) {
        return absl::DataLossError(absl::StrFormat(
            "crc32c mismatch in %s (%s, offset %d): stored %s, computed %s",
            checks_[c].what, loc.file, loc.offset,
            internal_format::Crc32cToHex(loc.crc32c),
            internal_format::Crc32cToHex(crc)));
      }
      ++result_.chunks_verified;
    }
    return absl::OkStatus();
  }

  struct Needed {
    int file;
    const ByteLocation* location;
    std::string what;
  };

  Storage& storage_;
  const Metadata& metadata_;
  const LoadOptions& options_;
  LoadResult result_;
  std::vector<ReadTask> tasks_;
  std::vector<Check> checks_;
  std::vector<Needed> needed_;
  std::map<std::string, int> file_index_;
  std::vector<std::string> file_names_;
  std::vector<DataFile> files_;
};

}  // namespace

absl::StatusOr<Metadata> ReadMetadataFromStorage(Storage& storage) {
  absl::StatusOr<std::string> text =
      storage.ReadAll(kMetadataFileName, internal_format::kMaxMetadataBytes);
  if (absl::IsNotFound(text.status())) {
    return absl::NotFoundError(absl::StrFormat(
        "no committed checkpoint at %s (%s is missing)", storage.url(),
        kMetadataFileName));
  }
  CAIRN_RETURN_IF_ERROR(text.status());
  const std::string source = absl::StrCat(storage.url(), "/", kMetadataFileName);
  CAIRN_ASSIGN_OR_RETURN(Metadata metadata,
                         internal_format::DecodeMetadata(*text, source));
  for (const auto& [fqn, tensor] : metadata.tensors) {
    CAIRN_RETURN_IF_ERROR(
        Annotate(internal_format::ValidateCoverage(fqn, tensor), source));
  }
  return metadata;
}

absl::StatusOr<LoadResult> LoadWithMetadata(StateDict& state, Storage& storage,
                                            const Metadata& metadata,
                                            const LoadOptions& options) {
  Loader loader(storage, metadata, options);
  return loader.Run(state);
}

absl::StatusOr<LoadResult> LoadFromStorage(StateDict& state, Storage& storage,
                                           const LoadOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(Metadata metadata, ReadMetadataFromStorage(storage));
  return LoadWithMetadata(state, storage, metadata, options);
}

absl::StatusOr<StateDict> LoadAllFromStorage(Storage& storage,
                                             const LoadOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(Metadata metadata, ReadMetadataFromStorage(storage));
  std::set<std::string> placed;
  auto make_leaf = [&](const std::string& fqn) -> absl::StatusOr<StateDict> {
    placed.insert(fqn);
    if (auto it = metadata.tensors.find(fqn); it != metadata.tensors.end()) {
      CAIRN_ASSIGN_OR_RETURN(Tensor t,
                             Tensor::Empty(it->second.dtype, it->second.shape));
      return StateDict(t);
    }
    if (metadata.objects.contains(fqn)) return StateDict(Object{});
    if (auto it = metadata.scalars.find(fqn); it != metadata.scalars.end()) {
      return StateDict(it->second);
    }
    return absl::DataLossError(absl::StrFormat(
        "%s/%s: structure names '%s', which the checkpoint does not hold",
        storage.url(), kMetadataFileName, fqn));
  };
  CAIRN_ASSIGN_OR_RETURN(StateDict state,
                         internal_core::Unflatten(metadata.structure, make_leaf));
  // Leaves the structure does not place (e.g. written by another tool) go at
  // the top level under their FQN.
  auto place_rest = [&](const auto& map) -> absl::Status {
    for (const auto& [fqn, unused] : map) {
      if (placed.contains(fqn)) continue;
      CAIRN_ASSIGN_OR_RETURN(StateDict leaf, make_leaf(fqn));
      state[fqn] = std::move(leaf);
    }
    return absl::OkStatus();
  };
  CAIRN_RETURN_IF_ERROR(place_rest(metadata.tensors));
  CAIRN_RETURN_IF_ERROR(place_rest(metadata.objects));
  CAIRN_RETURN_IF_ERROR(place_rest(metadata.scalars));
  LoadOptions strict = options;
  strict.strict = true;
  CAIRN_RETURN_IF_ERROR(LoadWithMetadata(state, storage, metadata, strict).status());
  return state;
}

}  // namespace cairn::internal_checkpoint
