// Load, steps 3a and 3c (see load.cc): the Loader's checks of the
// planner's items and destinations against the metadata, and the cutting of
// each stored chunk's needed region into slabs that fit a bounce buffer, one
// read task each (ForEachSlab, Loader::PlanRegion, Loader::AddSlabTask).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "cairn/metadata.h"
#include "cairn/planner.h"
#include "cairn/tensor.h"
#include "checkpoint/load_internal.h"
#include "core/aligned_buffer.h"
#include "core/status.h"
#include "core/strided.h"
#include "format/crc32c.h"
#include "format/names.h"

namespace cairn::internal_checkpoint {

std::vector<int64_t> RowMajorByteStrides(const Shape& sizes, size_t es) {
  std::vector<int64_t> s(sizes.size());
  int64_t acc = static_cast<int64_t>(es);
  for (int d = static_cast<int>(sizes.size()) - 1; d >= 0; --d) {
    s[d] = acc;
    acc *= sizes[d];
  }
  return s;
}

uint64_t SpanBytes(const std::vector<int64_t>& sizes,
                   const std::vector<int64_t>& byte_strides, size_t es) {
  uint64_t span = es;
  for (size_t d = 0; d < sizes.size(); ++d) {
    span += (sizes[d] - 1) * byte_strides[d];
  }
  return span;
}

absl::Status ForEachSlab(const Box& region,
                         const std::vector<int64_t>& byte_strides, size_t es,
                         uint64_t limit,
                         absl::FunctionRef<absl::Status(const Box&)> fn) {
  const int rank = region.rank();
  int k = 0;
  int64_t n = 1;
  if (rank > 0) {
    std::vector<int64_t> slice = region.sizes;
    for (k = 0; k < rank; ++k) {
      slice[k] = 1;  // dims <= k now have size 1
      const uint64_t slice_span = SpanBytes(slice, byte_strides, es);
      // The innermost slice is one element, which always fits.
      if (slice_span <= limit || k == rank - 1) {
        // n slices along dim k span slice_span + (n - 1) * stride bytes.
        n = slice_span >= limit
                ? 1
                : static_cast<int64_t>((limit - slice_span) /
                                       byte_strides[k]) + 1;
        n = std::min(n, region.sizes[k]);
        break;
      }
    }
  }
  // Odometer over dims < k, and steps of n along dim k.
  Box slab = region;
  for (int d = 0; d < k; ++d) slab.sizes[d] = 1;
  std::vector<int64_t> idx(k, 0);
  while (true) {
    for (int d = 0; d < k; ++d) slab.offsets[d] = region.offsets[d] + idx[d];
    const int64_t k_end = rank > 0 ? region.offsets[k] + region.sizes[k] : 1;
    for (int64_t pos = rank > 0 ? region.offsets[k] : 0; pos < k_end;
         pos += n) {
      if (rank > 0) {
        slab.offsets[k] = pos;
        slab.sizes[k] = std::min(n, k_end - pos);
      }
      CAIRN_RETURN_IF_ERROR(fn(slab));
    }
    int d = k - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < region.sizes[d]) break;
      idx[d] = 0;
    }
    if (d < 0) break;
  }
  return absl::OkStatus();
}

absl::StatusOr<Destination>
Loader::CheckDestination(const ReadItem& item, const Destination& dst) {
  if (item.kind == ItemKind::kObject) {
    if (dst.object == nullptr || !metadata_.objects.contains(item.fqn)) {
      return absl::InternalError(absl::StrFormat(
          "read item for object %s has no destination string or no "
          "stored object",
          item.fqn));
    }
    return dst;
  }
  CAIRN_RETURN_IF_ERROR(CheckItem(item, dst, /*allow_device=*/true).status());
  return dst;
}

absl::Status Loader::PlanObject(const ReadItem& item, const Destination& dst) {
  auto it = metadata_.objects.find(item.fqn);
  if (it == metadata_.objects.end() || dst.object == nullptr) {
    return absl::InternalError(absl::StrFormat(
        "read item for object %s: %s", item.fqn,
        dst.object == nullptr ? "the planner gave no destination string"
                              : "the checkpoint has no such object"));
  }
  ReadTask task;
  task.mode = ReadTask::Mode::kObject;
  task.file = FileIndex(it->second.file);
  task.file_offset = it->second.offset;
  task.span = it->second.nbytes;
  task.what = item.fqn;
  task.object = dst.object;
  result_.bytes_loaded += it->second.nbytes;
  task.check = AddCheck(item.fqn, &it->second);
  needed_.push_back({task.file, &it->second, item.fqn, DType::kU8, nullptr});
  tasks_.push_back(std::move(task));
  return absl::OkStatus();
}

// The stored tensor of a tensor item, after checking the item against the
// metadata and the destination against the item (a planner's mistake is
// an error here, never a write outside a buffer). The destination must be
// host memory unless `allow_device`.
absl::StatusOr<const TensorMetadata*>
Loader::CheckItem(const ReadItem& item, const Destination& dst,
                  bool allow_device) {
  auto it = metadata_.tensors.find(item.fqn);
  if (it == metadata_.tensors.end()) {
    return absl::InternalError(absl::StrFormat(
        "read item for tensor %s, which the checkpoint does not hold",
        item.fqn));
  }
  const TensorMetadata& tm = it->second;
  fqn_of_[&tm] = &it->first;
  if (item.chunk >= tm.chunks.size() ||
      !Contains(tm.chunks[item.chunk].box, item.overlap) ||
      item.overlap.empty()) {
    return absl::InternalError(absl::StrFormat(
        "%s: read item %s is not a non-empty part of chunk %d", item.fqn,
        item.overlap.ToString(), item.chunk));
  }
  if (dst.sink != nullptr) {
    // A sink takes staged bytes (StagedLoad); the reads themselves always
    // go to memory.
    if (allow_device) return &tm;
    return absl::InternalError(absl::StrFormat(
        "%s %s: a sink destination reached the reads unstaged", item.fqn,
        item.overlap.ToString()));
  }
  const TensorView& v = dst.view;
  if ((!allow_device && !v.device().is_cpu()) || v.dtype() != tm.dtype ||
      v.shape() != item.overlap.sizes || v.data() == nullptr) {
    return absl::InternalError(absl::StrFormat(
        "%s %s: the planner's destination is a %s [%s] view on %s; "
        "expected %s of the stored dtype %s and the item's shape",
        item.fqn, item.overlap.ToString(), DTypeName(v.dtype()),
        absl::StrJoin(v.shape(), ", "), v.device().ToString(),
        allow_device ? "memory" : "host memory", DTypeName(tm.dtype)));
  }
  return &tm;
}

// Plans the reads of one stored chunk for all `targets` in it.
absl::Status Loader::PlanChunk(const std::string& fqn, const TensorMetadata& tm,
                               const ChunkMetadata& chunk,
                               const std::vector<Target>& targets) {
  // Several destination boxes of this process in one chunk (e.g. column
  // shards of a row chunk): read the chunk region they span once and copy
  // to each, when that wastes at most half the bytes.
  Box region = targets[0].overlap;
  int64_t needed = 0;
  for (const Target& tg : targets) {
    needed += tg.overlap.num_elements();
    for (int d = 0; d < region.rank(); ++d) {
      const int64_t end = std::max(region.offsets[d] + region.sizes[d],
                                   tg.overlap.offsets[d] + tg.overlap.sizes[d]);
      region.offsets[d] = std::min(region.offsets[d], tg.overlap.offsets[d]);
      region.sizes[d] = end - region.offsets[d];
    }
  }
  // (Not for a chunk read in pieces over several Reads unless this Read
  // has all of it: its pieces must stay contiguous, see CheckAcrossReads.)
  if (targets.size() == 1 ||
      (2 * needed >= region.num_elements() &&
       (region == chunk.box || !carried_.contains(&chunk.location)))) {
    return PlanRegion(fqn, tm, chunk, region, targets);
  }
  for (const Target& tg : targets) {
    CAIRN_RETURN_IF_ERROR(PlanRegion(fqn, tm, chunk, tg.overlap,
                                     std::span<const Target>(&tg, 1)));
  }
  return absl::OkStatus();
}

int Loader::FileIndex(const std::string& name) {
  auto [it, inserted] =
      file_index_.try_emplace(name, static_cast<int>(file_names_.size()));
  if (inserted) file_names_.push_back(name);
  return it->second;
}

int Loader::AddCheck(std::string what, const ByteLocation* location,
                     Check::Kind kind, const std::string* fqn, size_t chunk,
                     const Box& region) {
  if (!options_.verify_checksums) return -1;
  checks_.push_back(
      Check{std::move(what), location, kind, fqn, chunk, region});
  return static_cast<int>(checks_.size()) - 1;
}

// Cuts `overlap` (a region of `chunk` holding what `targets` need) into
// slabs whose file span fits a bounce buffer (ForEachSlab); one read task
// per slab.
absl::Status Loader::PlanRegion(const std::string& fqn,
                                const TensorMetadata& tm,
                                const ChunkMetadata& chunk, const Box& overlap,
                                std::span<const Target> targets) {
  const size_t es = DTypeSize(tm.dtype);
  const bool whole_chunk = overlap == chunk.box;
  // A chunk of a Hugging Face file is named by the entry that holds it.
  const bool source = !tm.source_entries.empty();
  const std::string what =
      source ? tm.source_entries[static_cast<size_t>(&chunk - tm.chunks.data())]
             : internal_format::EntryName(fqn, chunk.box,
                                          chunk.box == Box::Full(tm.shape));
  const int file = FileIndex(chunk.location.file);
  if (chunk.location.compressed()) {
    return PlanFrames(what, tm, chunk, overlap, targets, file);
  }
  needed_.push_back(
      {file, &chunk.location, what, tm.dtype, &chunk.box.sizes, source});
  if (whole_chunk) carried_.erase(&chunk.location);  // checked here
  // A part of a chunk read in pieces over several Reads (every slab of
  // such a part is contiguous in the file, as a whole chunk's are); else
  // a part that is one contiguous run of the chunk (rows), whose CRC32C
  // the coordinator combines with the other ranks' parts of the chunk;
  // else a strided part, whose signature it combines likewise.
  const size_t index = static_cast<size_t>(&chunk - tm.chunks.data());
  const int check =
      whole_chunk ? AddCheck(what, &chunk.location)
      : carried_.contains(&chunk.location)
          ? AddCheck(what, &chunk.location, Check::Kind::kCarried)
      : internal_core::SubBoxRuns(chunk.box, overlap, es).num_runs() == 1
          ? AddCheck(what, &chunk.location, Check::Kind::kShared, &fqn,
                     index)
          : AddCheck(what, &chunk.location, Check::Kind::kStrided, &fqn,
                     index, overlap);

  const std::vector<int64_t> cs = RowMajorByteStrides(chunk.box.sizes, es);
  const uint64_t bounce = std::max<uint64_t>(options_.bounce_buffer_bytes,
                                             internal_core::kIoAlignment);
  return ForEachSlab(overlap, cs, es, bounce, [&](const Box& slab) {
    return AddSlabTask(chunk, targets, slab, file, check, what, es, cs);
  });
}

// Adds to `task` one copy per target that meets `slab` (a box of a chunk
// whose bytes lie with strides `cs`), its source offset measured from the
// slab's first byte; `within`, when not null, gets where each copy's part
// starts in the slab, per dimension.
absl::Status Loader::AddCopies(ReadTask& task, std::span<const Target> targets,
                               const Box& slab, const std::vector<int64_t>& cs,
                               size_t es,
                               std::vector<std::vector<int64_t>>* within) {
  const int rank = slab.rank();
  std::vector<int64_t> at(rank);
  for (const Target& tg : targets) {
    std::optional<Box> part =
        rank == 0 ? std::optional<Box>(slab) : Intersect(slab, tg.overlap);
    if (!part) continue;
    Box local = *part;  // relative to the target's destination
    for (int d = 0; d < rank; ++d) local.offsets[d] -= tg.overlap.offsets[d];
    CAIRN_ASSIGN_OR_RETURN(TensorView dst, tg.dst.Slice(local));
    ReadTask::Copy copy;
    for (int d = 0; d < rank; ++d) {
      at[d] = part->offsets[d] - slab.offsets[d];
      copy.src_offset += at[d] * cs[d];
    }
    if (within != nullptr) within->push_back(at);
    copy.dst = static_cast<std::byte*>(dst.data());
    copy.shape = part->sizes;
    for (int64_t st : dst.strides()) {
      copy.dst_strides.push_back(st * static_cast<int64_t>(es));
    }
    const uint64_t bytes = static_cast<uint64_t>(part->num_elements()) * es;
    result_.bytes_loaded += bytes;
    task.copied += bytes;
    task.copies.push_back(std::move(copy));
  }
  return absl::OkStatus();
}

absl::Status Loader::AddSlabTask(const ChunkMetadata& chunk,
                                 std::span<const Target> targets,
                                 const Box& slab, int file, int check,
                                 const std::string& what, size_t es,
                                 const std::vector<int64_t>& cs) {
  const int rank = slab.rank();
  internal_core::RunPattern runs =
      internal_core::SubBoxRuns(chunk.box, slab, es);
  uint64_t in_chunk = 0;
  for (int d = 0; d < rank; ++d) {
    in_chunk += (slab.offsets[d] - chunk.box.offsets[d]) * cs[d];
  }
  ReadTask task;
  task.file = file;
  task.file_offset = chunk.location.offset + in_chunk;
  task.span = SpanBytes(slab.sizes, cs, es);
  task.what = what;
  task.elem_size = es;
  task.check = check;
  task.check_offset = in_chunk;
  task.src_strides = cs;
  const bool strided_check =
      check >= 0 && checks_[check].kind == Check::Kind::kStrided;
  if (strided_check) {
    task.sign = true;
    task.sign_runs = runs;
    task.chunk_bytes = chunk.location.nbytes;
    if (runs.num_runs() > kMinRunsForShifter) {
      // One table per row stride, for every slab and every Read (a
      // table costs about as much as signing a hundred runs without).
      std::unique_ptr<internal_format::Crc32cShifter>& shifter =
          shifters_[runs.strides.back()];
      if (shifter == nullptr) {
        shifter = std::make_unique<internal_format::Crc32cShifter>(
            static_cast<uint64_t>(runs.strides.back()));
      }
      task.sign_step = shifter.get();
    }
  }
  // One copy per destination box that meets the slab; `within`: where
  // each copy's part starts in the slab, per dimension.
  std::vector<std::vector<int64_t>> within;
  CAIRN_RETURN_IF_ERROR(AddCopies(task, targets, slab, cs, es, &within));
  // (A slab of a checked chunk or part that no target needs is still
  // read: its bytes are part of the chunk's CRC32C or the part's
  // signature.)
  if (task.copies.empty() && task.check < 0) return absl::OkStatus();
  if (task.copies.size() == 1 && runs.num_runs() == 1 &&
      task.copies[0].shape == slab.sizes &&
      IsDense(task.copies[0].shape, task.copies[0].dst_strides, es)) {
    // Contiguous in the file and in the destination: no bounce buffer.
    task.mode = ReadTask::Mode::kDirect;
    task.dst = task.copies[0].dst;
    task.copies.clear();
  } else {
    // (A checked slab of a contiguous part is one run: its span is all
    // it reads. A strided part's slab signs its runs only, whichever way
    // they are read.)
    if (task.copies.size() > 1 || (task.check >= 0 && !strided_check) ||
        Coalesced(runs)) {
      task.mode = ReadTask::Mode::kSpan;
    } else {
      // Far-apart runs of one destination: read each run, packed. The
      // copy's source is then the packed slab, so its offset is measured
      // in the slab's strides, not the chunk's (the destination may
      // start inside the slab: a region read for several targets).
      task.mode = ReadTask::Mode::kRuns;
      task.runs = runs;
      task.runs.first_offset -= static_cast<int64_t>(in_chunk);
      task.src_strides = RowMajorByteStrides(slab.sizes, es);
      for (size_t i = 0; i < task.copies.size(); ++i) {
        task.copies[i].src_offset = 0;
        for (int d = 0; d < rank; ++d) {
          task.copies[i].src_offset += within[i][d] * task.src_strides[d];
        }
      }
    }
  }
  tasks_.push_back(std::move(task));
  return absl::OkStatus();
}

// True when the gaps between the runs are small enough to read the span
// they lie in with one request (LoadOptions::coalesce_gap_bytes).
bool Loader::Coalesced(const internal_core::RunPattern& runs) const {
  return runs.strides.empty() ||
         runs.strides.back() - runs.run_bytes <=
             static_cast<int64_t>(options_.coalesce_gap_bytes);
}

// True when a block of `shape` with byte `strides` is row-major dense.
bool Loader::IsDense(const std::vector<int64_t>& shape,
                     const std::vector<int64_t>& strides, size_t es) {
  int64_t expect = static_cast<int64_t>(es);
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expect) return false;
    expect *= shape[d];
  }
  return true;
}

}  // namespace cairn::internal_checkpoint
