// Load. The protocol, every rank in lockstep (rank 0 coordinates); each
// phase ends in a collective carrying every rank's status:
//
//  1. Metadata: the coordinator reads metadata.json and validates it as
//     untrusted input (file names, dtypes, boxes inside their tensors,
//     sizes, chunk coverage), then broadcasts its text (or the error); the
//     other ranks decode the same text.
//  2. Plan: SetUp and CreateLocalPlan on every rank (the default planner
//     matches every destination leaf to the checkpoint: a missing leaf is an
//     error in strict mode, dtype and global shape must match, scalars are
//     assigned, and every destination box is intersected with every stored
//     chunk). The coordinator combines them: with a DefaultLoadPlanner (or
//     subclass) each rank keeps its plan and sends a summary (EncodeLocalLoadPlan:
//     item count, a hash of what it reads, its unexpected leaves as bits),
//     the coordinator narrows the unexpected leaves and groups replicas by
//     hash (PlanLoadGlobally), and the groups' members check their plans
//     against their leader's exactly; any other planner sends its whole
//     plan for CreateGlobalPlan and gets its final plan back. FinishPlan.
//  3. Read (this file's Loader), on every rank:
//     a. ResolveDestination for every item; check each destination.
//     b. Open every data file that holds a needed byte, read and validate
//        its safetensors header (once per file), and check that each
//        needed chunk or object is an entry of it of its name, dtype and
//        shape (so offsets and sizes lie inside the real file, and a
//        metadata.json whose locations were swapped or dtypes relabelled,
//        checksums and all, is refused: EntryMismatch).
//     c. Cut each chunk's needed region into slabs whose file span fits one
//        bounce buffer. A slab contiguous in the file and in the
//        destination is read straight into the destination; otherwise the
//        slab's span (small gaps coalesced) or each of its runs (large
//        gaps) goes through a bounce buffer and a strided copy. Only bytes
//        of rows/runs that overlap are read. Several destination boxes in
//        one chunk share one read when that wastes at most half the bytes.
//     d. Run the reads on IO threads in file order, small direct reads
//        that lie back to back in a file as one read through a bounce
//        buffer (GroupSmallReads). A chunk read whole is
//        checksummed as its slabs land (pieces combined afterwards) and
//        compared with its CRC32C; so is a chunk read in contiguous pieces
//        over several Read calls (CheckAcrossReads), in the call that
//        completes it. A part of a chunk that is one contiguous run of it
//        (rows) and not read whole is checksummed too, for step 4; a part
//        that is not contiguous (columns, a 2-d block) is signed (SignRuns:
//        the linear CRC of the chunk with the bytes outside the part
//        zeroed, crc32c.h), from the bytes of its runs only.
//     e. CommitChunk for every item, in plan order.
//  4. Agree: the coordinator gathers every rank's status and the CRC32Cs
//     and signatures of its parts of chunks (3d), combines the parts of
//     each chunk that they tile and compares them with its CRC32C
//     (CheckSharedPieces: contiguous pieces in a chain, any chunk with a
//     strided part as boxes whose signatures XOR to it), and every rank
//     learns the verdict, with the chunks that parts were returned of but
//     that no set of parts tiles (a slice).
//  5. Only when there are such chunks: the ranks that read parts of them
//     check them (VerifyUncheckedParts: the checksum blocks around the
//     parts, format version 3, or the whole chunk) and agree.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/checkpoint.h"
#include "checkpoint/checkpoint_impl.h"
#include "comm/collective.h"
#include "core/big_vector.h"
#include "core/buffer_pool.h"
#include "core/byte_codec.h"
#include "core/checked.h"
#include "core/flatten.h"
#include "core/parallel.h"
#include "core/status.h"
#include "core/strided.h"
#include "cuda/device_runtime.h"
#include "format/crc32c.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "format/safetensors.h"
#include "plan/plan_codec.h"
#include "storage/read_all.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_comm::AgreeOnStatus;
using internal_comm::BroadcastOutcome;
using internal_comm::GatherOrError;
using internal_comm::kCoordinator;
using internal_comm::Ranks;
using internal_comm::ScatterOutcome;

using internal_core::Annotate;
using internal_core::BufferPool;
using internal_core::PooledBuffer;

struct DataFile {
  std::unique_ptr<ReadableFile> file;
  // Its safetensors header, parsed once: every needed location is checked
  // against it (Loader::CheckLocations), in this Read or a later one.
  internal_format::SafetensorsHeader header;
};

// A stored chunk (or object) whose CRC32C is checked:
//  - kWhole: read whole in one Read call, checked there;
//  - kCarried: read whole by this rank over several Read calls (see
//    Loader::CheckAcrossReads), checked when its last piece lands;
//  - kShared: one contiguous part of it (rows of a row reshard) read by this
//    rank, the rest by others: each rank checksums its parts and the
//    coordinator combines them (CheckSharedPieces) after the reads;
//  - kStrided: a part of it that is not contiguous (columns of a column
//    reshard, a block of a 2-d one), likewise, by its signature (crc32c.h).
struct Check {
  enum class Kind { kWhole, kCarried, kShared, kStrided };
  std::string what;  // "model.wq@1024,0" or the object's FQN
  const ByteLocation* location = nullptr;
  Kind kind = Kind::kWhole;
  const std::string* fqn = nullptr;  // kShared, kStrided: the tensor
  size_t chunk = 0;                  // kShared, kStrided: its chunk index
  Box region;                        // kStrided: the part
};

// kDataLoss: `what`'s bytes at `loc` have CRC32C `computed`, not the stored
// one. `note` follows the offset (", read in 3 pieces").
absl::Status CrcMismatch(std::string_view what, const ByteLocation& loc,
                         std::string_view note, uint32_t computed) {
  return absl::DataLossError(absl::StrFormat(
      "crc32c mismatch in %s (%s, offset %d%s): stored %s, computed %s", what,
      loc.file, loc.offset, note, internal_format::Crc32cToHex(loc.crc32c),
      internal_format::Crc32cToHex(computed)));
}

// ", read in parts by ranks 0, 2" (with `parts` > 0: "in 3 parts").
std::string ReadByRanks(const std::set<int>& ranks, size_t parts = 0) {
  return absl::StrFormat(", read in %sparts by rank%s %s",
                         parts > 0 ? absl::StrCat(parts, " ") : "",
                         ranks.size() > 1 ? "s" : "",
                         absl::StrJoin(ranks, ", "));
}

// OK when `pieces` (in any order) tile `loc`'s bytes and their combined
// CRC32C is its stored one; kDataLoss naming `what`, the file and offset
// when it is not; an internal error when they do not tile. `note` follows
// the offset in messages (", read in 3 pieces").
absl::Status CheckPieces(std::string_view what, const ByteLocation& loc,
                         std::vector<CrcPiece> pieces, std::string_view note) {
  std::sort(pieces.begin(), pieces.end(),
            [](const CrcPiece& a, const CrcPiece& b) {
              return a.offset < b.offset;
            });
  uint32_t crc = 0;
  uint64_t covered = 0;
  uint64_t total = 0;
  for (const CrcPiece& p : pieces) {
    total += p.bytes;
    if (p.offset != covered) continue;  // a gap or an overlap: no tiling
    crc = covered == 0 ? p.crc
                       : internal_format::Crc32cCombine(crc, p.crc, p.bytes);
    covered += p.bytes;
  }
  if (covered != loc.nbytes || total != loc.nbytes) {
    return absl::InternalError(absl::StrFormat(
        "%s (%s, offset %d%s): checksummed %d of its %d bytes in order, %d "
        "in all",
        what, loc.file, loc.offset, note, covered, loc.nbytes, total));
  }
  if (crc != loc.crc32c) return CrcMismatch(what, loc, note, crc);
  return absl::OkStatus();
}

// The checksummed pieces so far of a chunk read over several Read calls.
struct CarriedCheck {
  std::string what;  // "model.wq [0:1024, 0:512]"
  std::vector<CrcPiece> pieces;
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
  uint64_t copied = 0;  // bytes the copies take out of the span
  std::vector<int64_t> src_strides;  // bytes, shared by the copies
  size_t elem_size = 1;
  internal_core::RunPattern runs;  // kRuns: runs relative to file_offset
  std::string* object = nullptr;   // kObject: destination string
  int check = -1;                  // index into checks, or -1
  uint64_t check_offset = 0;       // offset of this piece within the chunk
  // A kStrided check's task (`sign`): the runs of its slab, at their
  // offsets in the chunk (of chunk_bytes bytes), which it signs (SignRuns)
  // instead of checksumming its span.
  bool sign = false;
  internal_core::RunPattern sign_runs;
  uint64_t chunk_bytes = 0;
  // The shift between two runs of a row (sign_runs.strides.back()), when
  // the slab has enough runs to be worth a table (shared by the loader).
  const internal_format::Crc32cShifter* sign_step = nullptr;
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

// Bytes from the first to the last byte of a block of `sizes` (none of
// them 0) laid out with `byte_strides`.
uint64_t SpanBytes(const std::vector<int64_t>& sizes,
                   const std::vector<int64_t>& byte_strides, size_t es) {
  uint64_t span = es;
  for (size_t d = 0; d < sizes.size(); ++d) {
    span += (sizes[d] - 1) * byte_strides[d];
  }
  return span;
}

// Cuts `region` into slabs whose span under `byte_strides` (the layout the
// bytes are in: a chunk's in its file, or the region's own when packed)
// fits `limit` bytes, and calls `fn` with each, in row-major order: one
// index along each dimension before k, runs of n indices along k,
// everything along the dimensions after k. k is the outermost dimension
// whose single slice fits (one element always does), and n as many slices
// as fit with it. The slabs of a region packed in its layout follow each
// other there.
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

// Opens `name` and checks its safetensors header.
absl::StatusOr<DataFile> OpenDataFile(Storage& storage,
                                      const std::string& name) {
  DataFile df;
  CAIRN_ASSIGN_OR_RETURN(df.file, storage.OpenForRead(name));
  CAIRN_ASSIGN_OR_RETURN(df.header,
                         internal_format::ReadSafetensorsHeader(*df.file, name));
  return df;
}

// A destination and the part of one stored chunk it needs.
struct Target {
  TensorView dst;  // shape overlap.sizes
  Box overlap;     // global coordinates
};

class Loader {
 public:
  Loader(Storage& storage, const Metadata& metadata, const LoadOptions& options)
      : storage_(storage), metadata_(metadata), options_(options) {}

  // Reads items[i] into dsts[i] (the planner's destinations of the items),
  // then commits every item with the planner.
  absl::StatusOr<LoadResult> Run(const std::vector<ReadItem>& items,
                                 const std::vector<Destination>& dsts,
                                 LoadPlanner& planner) {
    CAIRN_RETURN_IF_ERROR(Read(items, dsts));
    for (const ReadItem& item : items) {
      CAIRN_RETURN_IF_ERROR(planner.CommitChunk(item));
    }
    return TakeResult();
  }

  // Reads items[i] into dsts[i], for every i. May be called again (a staged
  // load's batches): the data files an earlier call opened, and checked the
  // headers of, stay open.
  absl::Status Read(const std::vector<ReadItem>& items,
                    const std::vector<Destination>& dsts) {
    tasks_.clear();
    checks_.clear();
    needed_.clear();
    // Items of one stored chunk are planned together, so several
    // destination boxes in one chunk can share a read.
    std::map<std::pair<const TensorMetadata*, size_t>, std::vector<Target>>
        by_chunk;
    std::vector<std::pair<const TensorMetadata*, size_t>> chunk_order;
    for (size_t i = 0; i < items.size(); ++i) {
      const ReadItem& item = items[i];
      if (item.kind == ItemKind::kObject) {
        CAIRN_RETURN_IF_ERROR(PlanObject(item, dsts[i]));
        continue;
      }
      CAIRN_ASSIGN_OR_RETURN(const TensorMetadata* tm,
                             CheckItem(item, dsts[i], /*allow_device=*/false));
      auto key = std::make_pair(tm, item.chunk);
      std::vector<Target>& targets = by_chunk[key];
      if (targets.empty()) chunk_order.push_back(key);
      targets.push_back(Target{dsts[i].view, item.overlap});
    }
    for (const auto& key : chunk_order) {
      const TensorMetadata& tm = *key.first;
      const std::string& fqn = *fqn_of_[key.first];
      CAIRN_RETURN_IF_ERROR(
          PlanChunk(fqn, tm, tm.chunks[key.second], by_chunk[key]));
    }
    CAIRN_RETURN_IF_ERROR(CheckLocations());
    return Execute();
  }

  // What the reads so far did; the next Read counts afresh.
  LoadResult TakeResult() { return std::exchange(result_, LoadResult{}); }

  // The pieces of chunks this rank read only parts of, over all its Reads
  // (adjacent pieces merged), for CheckSharedPieces; the next Read
  // collects afresh.
  std::vector<SharedPieces> TakeSharedPieces() {
    std::vector<SharedPieces> out;
    for (auto& [location, shared] : shared_) {
      std::vector<CrcPiece>& p = shared.pieces;
      std::sort(p.begin(), p.end(), [](const CrcPiece& a, const CrcPiece& b) {
        return std::pair(a.offset, a.bytes) < std::pair(b.offset, b.bytes);
      });
      std::vector<CrcPiece> merged;
      for (const CrcPiece& piece : p) {
        if (!merged.empty() &&
            merged.back().offset + merged.back().bytes == piece.offset) {
          CrcPiece& last = merged.back();
          last.crc = internal_format::Crc32cCombine(last.crc, piece.crc,
                                                    piece.bytes);
          last.bytes += piece.bytes;
        } else {
          merged.push_back(piece);
        }
      }
      p = std::move(merged);
      out.push_back(std::move(shared));
    }
    shared_.clear();
    return out;
  }

  // Declares every tensor item this reader will be given over its Read
  // calls (a staged load's batches). A stored chunk that these items tile
  // in contiguous pieces, none of them the whole chunk (a tensor split to
  // fit staging), is checksummed piece by piece as the pieces land, on the
  // IO threads, and compared with its CRC32C in the Read that completes
  // it. (A chunk whose items all fall in one Read is read as one region
  // and checked there, as always.)
  void CheckAcrossReads(std::span<const ReadItem> items) {
    if (!options_.verify_checksums) return;
    struct Ranges {
      uint64_t chunk_bytes = 0;
      // Bytes [start, start + n) of each of the chunk's items in the chunk;
      // {1, 0} for an item that is not contiguous there (never tiles).
      std::vector<std::pair<uint64_t, uint64_t>> parts;
      std::string what;
    };
    std::map<const ChunkMetadata*, Ranges> ranges;
    for (const ReadItem& item : items) {
      if (item.kind != ItemKind::kTensor) continue;
      auto it = metadata_.tensors.find(item.fqn);
      if (it == metadata_.tensors.end() ||
          item.chunk >= it->second.chunks.size()) {
        continue;  // Read reports it
      }
      const ChunkMetadata& chunk = it->second.chunks[item.chunk];
      if (!Contains(chunk.box, item.overlap) || item.overlap == chunk.box) {
        continue;
      }
      const size_t es = DTypeSize(it->second.dtype);
      const internal_core::RunPattern runs =
          internal_core::SubBoxRuns(chunk.box, item.overlap, es);
      Ranges& r = ranges[&chunk];
      if (r.what.empty()) {
        r.chunk_bytes = static_cast<uint64_t>(chunk.box.num_elements()) * es;
        r.what = absl::StrCat(item.fqn, " ", chunk.box.ToString());
      }
      r.parts.push_back(runs.num_runs() == 1
                            ? std::pair<uint64_t, uint64_t>(
                                  runs.first_offset, runs.run_bytes)
                            : std::pair<uint64_t, uint64_t>(1, 0));
    }
    for (auto& [chunk, r] : ranges) {
      std::sort(r.parts.begin(), r.parts.end());
      uint64_t covered = 0;
      for (const auto& [start, n] : r.parts) {
        if (start != covered || n == 0) break;
        covered += n;
      }
      if (covered == r.chunk_bytes) {
        carried_[&chunk->location].what = std::move(r.what);
      }
    }
  }

  // After the last Read: an error if a chunk declared to CheckAcrossReads
  // was not read whole (so not checked).
  absl::Status FinishAcrossReads() const {
    if (carried_.empty()) return absl::OkStatus();
    const auto& [location, carried] = *carried_.begin();
    uint64_t bytes = 0;
    for (const CrcPiece& p : carried.pieces) bytes += p.bytes;
    return absl::InternalError(absl::StrFormat(
        "%s (%s, offset %d): read in pieces, but only %d of its %d bytes "
        "were read and none checked",
        carried.what, location->file, location->offset, bytes,
        location->nbytes));
  }

  // `dst` when it fits `item` (see CheckItem; a device view is allowed:
  // StagedLoad reads it through host staging, after looking up its device's
  // runtime), else the error.
  absl::StatusOr<Destination> CheckDestination(const ReadItem& item,
                                               const Destination& dst) {
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

 private:
  absl::Status PlanObject(const ReadItem& item, const Destination& dst) {
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
  absl::StatusOr<const TensorMetadata*> CheckItem(const ReadItem& item,
                                                  const Destination& dst,
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
  absl::Status PlanChunk(const std::string& fqn, const TensorMetadata& tm,
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

  int FileIndex(const std::string& name) {
    auto [it, inserted] =
        file_index_.try_emplace(name, static_cast<int>(file_names_.size()));
    if (inserted) file_names_.push_back(name);
    return it->second;
  }

  int AddCheck(std::string what, const ByteLocation* location,
               Check::Kind kind = Check::Kind::kWhole,
               const std::string* fqn = nullptr, size_t chunk = 0,
               const Box& region = {}) {
    if (!options_.verify_checksums) return -1;
    checks_.push_back(
        Check{std::move(what), location, kind, fqn, chunk, region});
    return static_cast<int>(checks_.size()) - 1;
  }

  // Cuts `overlap` (a region of `chunk` holding what `targets` need) into
  // slabs whose file span fits a bounce buffer (ForEachSlab); one read task
  // per slab.
  absl::Status PlanRegion(const std::string& fqn, const TensorMetadata& tm,
                          const ChunkMetadata& chunk, const Box& overlap,
                          std::span<const Target> targets) {
    const size_t es = DTypeSize(tm.dtype);
    const bool whole_chunk = overlap == chunk.box;
    const std::string what = internal_format::EntryName(
        fqn, chunk.box, chunk.box == Box::Full(tm.shape));
    const int file = FileIndex(chunk.location.file);
    needed_.push_back({file, &chunk.location, what, tm.dtype, &chunk.box.sizes});
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

  absl::Status AddSlabTask(const ChunkMetadata& chunk,
                           std::span<const Target> targets, const Box& slab,
                           int file, int check, const std::string& what,
                           size_t es, const std::vector<int64_t>& cs) {
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
    for (const Target& tg : targets) {
      std::optional<Box> part =
          rank == 0 ? std::optional<Box>(slab) : Intersect(slab, tg.overlap);
      if (!part) continue;
      Box local = *part;  // relative to the target's destination
      for (int d = 0; d < rank; ++d) local.offsets[d] -= tg.overlap.offsets[d];
      CAIRN_ASSIGN_OR_RETURN(TensorView dst, tg.dst.Slice(local));
      ReadTask::Copy copy;
      std::vector<int64_t>& at = within.emplace_back(rank);
      for (int d = 0; d < rank; ++d) {
        at[d] = part->offsets[d] - slab.offsets[d];
        copy.src_offset += at[d] * cs[d];
      }
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
  bool Coalesced(const internal_core::RunPattern& runs) const {
    return runs.strides.empty() ||
           runs.strides.back() - runs.run_bytes <=
               static_cast<int64_t>(options_.coalesce_gap_bytes);
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

  // Step 3: every needed byte range is an entry of its file's header, of
  // the chunk's name, dtype and shape (an object's: U8 [nbytes]).
  absl::Status CheckLocations() {
    // Files an earlier Read opened are open already.
    const size_t opened = files_.size();
    files_.resize(file_names_.size());
    absl::Status open = pool_.ParallelFor(
        static_cast<int64_t>(file_names_.size() - opened), options_.io_threads,
        [&](int64_t k) -> absl::Status {
          const size_t i = opened + static_cast<size_t>(k);
          absl::StatusOr<DataFile> df = OpenDataFile(storage_, file_names_[i]);
          if (!df.ok()) {
            return Annotate(df.status(),
                            absl::StrCat("checkpoint ", storage_.url()));
          }
          files_[i] = *std::move(df);
          return absl::OkStatus();
        });
    if (!open.ok()) {
      files_.resize(opened);  // a later Read opens them again
      return open;
    }
    // Entries tile their file, so two needed locations that are both
    // entries share a byte only when they are the same entry: a second
    // chunk or object at an entry another one claims would load the other
    // one's bytes, its CRC32C matching (LoadAll, Merge and verify check every
    // pair of the checkpoint, ValidateDisjointLocations; this checks the
    // pairs this Read needs). Each location's entry name is checked first,
    // so only two locations of one entry name get that far: tensor "w@0"
    // whole and tensor "w"'s chunk at offset 0, say.
    absl::flat_hash_map<std::pair<int, uint64_t>, const Needed*> claimed;
    for (const Needed& n : needed_) {
      const ByteLocation& loc = *n.location;
      const int64_t object_shape = static_cast<int64_t>(loc.nbytes);
      const std::string wrong = internal_format::EntryMismatch(
          files_[n.file].header,
          {n.what, n.dtype,
           n.shape != nullptr ? std::span<const int64_t>(*n.shape)
                              : std::span<const int64_t>(&object_shape, 1),
           loc.offset, loc.nbytes});
      if (!wrong.empty()) {
        return absl::DataLossError(absl::StrFormat(
            "header mismatch for %s (%s, offset %d, %d bytes): %s; "
            "metadata.json and the data file disagree",
            n.what, loc.file, loc.offset, loc.nbytes, wrong));
      }
      if (loc.nbytes == 0) continue;
      auto [it, inserted] = claimed.try_emplace({n.file, loc.offset}, &n);
      if (!inserted && it->second->location != n.location) {
        return absl::DataLossError(absl::StrFormat(
            "%s and %s are both stored at %s, offset %d (%d bytes): no two "
            "chunks or objects may share bytes",
            it->second->what, n.what, loc.file, loc.offset, loc.nbytes));
      }
    }
    return absl::OkStatus();
  }

  // Whether every byte the tasks read is in memory already (the page
  // cache). Asked per file, of the span from its first task to its last.
  bool AllInMemory() const {
    std::vector<std::pair<uint64_t, uint64_t>> span(
        files_.size(), {std::numeric_limits<uint64_t>::max(), 0});
    for (const ReadTask& t : tasks_) {
      auto& [begin, end] = span[t.file];
      begin = std::min(begin, t.file_offset);
      end = std::max(end, t.file_offset + t.span);
    }
    for (size_t f = 0; f < span.size(); ++f) {
      const auto& [begin, end] = span[f];
      if (end > begin && !files_[f].file->InMemory(begin, end - begin)) {
        return false;
      }
    }
    return true;
  }

  // LoadOptions::io_threads, or one per core (when fewer) when everything
  // is `in_memory`: such reads are copies, and threads beyond the cores
  // only take turns (on a 2-core VM, 4 in-process ranks of 8 threads each
  // loaded a cached 256 MiB checkpoint's same-split rows 10-20% slower
  // than of 2 each).
  int ReadThreads(bool in_memory) const {
    const int threads = std::max(1, options_.io_threads);
    return in_memory ? std::min(threads, internal_core::CpuThreads(threads))
                     : threads;
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
      if (t.check >= 0) *crc = Checksum(t, static_cast<const std::byte*>(bytes));
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
    // A span the storage holds in memory already (page-cached) is copied
    // from in place: only the bytes the copies need are touched, where a
    // read into the bounce buffer would copy the whole span first.
    std::unique_ptr<ReadableFile::View> view;
    if (t.mode == ReadTask::Mode::kSpan) {
      view = file.ViewIfInMemory(t.file_offset, t.span);
    }
    if (view != nullptr) {
      if (view->bytes().size() != t.span) {
        return absl::InternalError(absl::StrFormat(
            "%s: the storage's in-memory view has %d bytes, %d asked",
            context(), view->bytes().size(), t.span));
      }
      // Copy first, then checksum: memcpy takes the first touch of the
      // page cache's lines better than the CRC loop does, which then reads
      // them from cache (column reshards' process CPU about 5% lower;
      // bench/RESULTS.md, fifteenth session). The same bytes either way.
      CopyOut(t, view->bytes().data());
      checksum(view->bytes().data());
      return absl::OkStatus();
    }
    CAIRN_ASSIGN_OR_RETURN(PooledBuffer buf, pool.Acquire());
    if (t.mode == ReadTask::Mode::kSpan) {
      // A span with bytes this rank does not copy (the other columns of a
      // column reshard) is most likely read by other ranks too: through
      // the page cache, so the device serves it once.
      const std::span<std::byte> into(buf.data(), t.span);
      CAIRN_RETURN_IF_ERROR(Annotate(
          t.copied < t.span ? file.ReadAtShared(t.file_offset, into)
                            : file.ReadAtIntoReusedBuffer(t.file_offset, into),
          context()));
      checksum(buf.data());
    } else {
      // Far-apart runs, packed one after another (never a whole chunk).
      absl::Status status;
      int64_t packed = 0;
      internal_core::ForEachRun(t.runs, [&](int64_t offset) {
        if (status.ok()) {
          status = file.ReadAtIntoReusedBuffer(
              t.file_offset + offset,
              std::span<std::byte>(buf.data() + packed, t.runs.run_bytes));
        }
        packed += t.runs.run_bytes;
      });
      CAIRN_RETURN_IF_ERROR(Annotate(status, context()));
      checksum(buf.data());
    }
    CopyOut(t, buf.data());
    return absl::OkStatus();
  }

  // Smaller groups are not formed: reads that small gain little from
  // being one request, and a group reads the bytes between its tasks too.
  static constexpr uint64_t kMinGroupBytes = uint64_t{256} << 10;

  // order[first, last): tasks read together with one request for file
  // bytes [begin, end).
  struct Group {
    size_t first = 0;
    size_t last = 0;
    uint64_t begin = 0;
    uint64_t end = 0;
    bool single() const { return last - first == 1; }
  };

  // The reads in `order` (file order), each in a group of its own, except
  // runs of direct reads (whole chunks, or their slabs, straight into the
  // destination) of one file with gaps of at most coalesce_gap_bytes
  // between them (the padding before an aligned chunk, small entries no one
  // needs) that fit one bounce buffer together, span kMinGroupBytes or
  // more, and that the storage does not hold in memory: those go to the
  // storage as one read into a bounce buffer, and are copied out. A chunk
  // under a few MiB is then not a device request of its own: on the VM we
  // benchmark on, a cold 256 MiB load_same (chunks of 0.2 MiB) took
  // 0.17-0.18 s with one direct read per chunk and 0.10 s grouped, and at
  // 2 GiB 0.96-0.99 s against 0.65-0.69 s. Buffered reads (whose readahead
  // makes the requests large) took 0.70 s there, but filled the page cache
  // at a cost in system CPU that varied from 0.5 to 2.9 s. With `group`
  // false (a load that found everything in memory), every read is a group
  // of its own and nothing more is asked.
  std::vector<Group> GroupSmallReads(const std::vector<size_t>& order,
                                     uint64_t buffer_bytes, bool group) const {
    std::vector<Group> groups;
    auto groupable = [&](const ReadTask& t) {
      return group && t.mode == ReadTask::Mode::kDirect && t.span > 0 &&
             t.span <= buffer_bytes / 2;
    };
    for (size_t i = 0; i < order.size();) {
      const ReadTask& first = tasks_[order[i]];
      Group g{i, i + 1, first.file_offset, first.file_offset + first.span};
      if (groupable(first)) {
        // From the page the first read starts in, so that the bounce
        // buffer (page-aligned) and the file offset agree on alignment.
        const uint64_t begin = internal_core::RoundDown(
            first.file_offset, internal_core::kIoAlignment);
        size_t j = i + 1;
        uint64_t end = g.end;
        while (j < order.size()) {
          const ReadTask& t = tasks_[order[j]];
          if (!groupable(t) || t.file != first.file || t.file_offset < end ||
              t.file_offset - end > options_.coalesce_gap_bytes ||
              t.file_offset + t.span - begin > buffer_bytes) {
            break;
          }
          end = t.file_offset + t.span;
          ++j;
        }
        if (j - i > 1 && end - begin >= kMinGroupBytes &&
            !files_[first.file].file->InMemory(begin, end - begin)) {
          g = Group{i, j, begin, end};
        }
      }
      groups.push_back(g);
      i = g.last;
    }
    return groups;
  }

  // Reads group `g` into a bounce buffer and copies each of its tasks'
  // bytes to their destination (checksumming the checked ones).
  absl::Status RunGroup(const Group& g, const std::vector<size_t>& order,
                        BufferPool& pool, std::vector<uint32_t>& crcs) {
    const ReadTask& first = tasks_[order[g.first]];
    const ReadableFile& file = *files_[first.file].file;
    CAIRN_ASSIGN_OR_RETURN(PooledBuffer buf, pool.Acquire());
    CAIRN_RETURN_IF_ERROR(Annotate(
        file.ReadAtIntoReusedBuffer(
            g.begin, std::span<std::byte>(buf.data(), g.end - g.begin)),
        absl::StrFormat("reading %d chunks from %s (offset %d, %d bytes; "
                        "the first %s)",
                        g.last - g.first, file_names_[first.file], g.begin,
                        g.end - g.begin, first.what)));
    for (size_t i = g.first; i < g.last; ++i) {
      const ReadTask& t = tasks_[order[i]];
      const std::byte* src = buf.data() + (t.file_offset - g.begin);
      std::memcpy(t.dst, src, t.span);
      if (t.check >= 0) crcs[order[i]] = Checksum(t, src);
    }
    return absl::OkStatus();
  }

  // What a checked task computes of the bytes it read, at `src`: their
  // CRC32C, or for a part of a kStrided check its signature.
  static uint32_t Checksum(const ReadTask& t, const std::byte* src) {
    return t.sign ? SignRuns(t, src, t.mode == ReadTask::Mode::kRuns)
                  : internal_format::Crc32c(src, t.span);
  }

  // The signature (crc32c.h) of the bytes of a kStrided check's slab, its
  // runs t.sign_runs at their offsets in the chunk: `src` holds the task's
  // span, which starts at the slab's first byte (t.check_offset in the
  // chunk), or with `packed` its runs one after another (kRuns). Horner's
  // rule over the runs: shift what came before by the distance from the
  // last run's end to this one's, XOR in this run's linear CRC; the shift
  // between the runs of a row, which most runs are apart, by table.
  static uint32_t SignRuns(const ReadTask& t, const std::byte* src,
                           bool packed) {
    const internal_core::RunPattern& runs = t.sign_runs;
    const int64_t rb = runs.run_bytes;
    const internal_format::Crc32cShifter* shift_step = t.sign_step;
    const int64_t step =
        shift_step != nullptr ? static_cast<int64_t>(shift_step->zero_bytes())
                              : -1;
    uint32_t acc = 0;
    int64_t end = -1;  // of the last run so far, in the chunk
    int64_t k = 0;
    internal_core::ForEachRun(runs, [&](int64_t offset) {
      const std::byte* p =
          packed ? src + k * rb
                 : src + (offset - static_cast<int64_t>(t.check_offset));
      const uint32_t raw = internal_format::Crc32cRaw(p, static_cast<size_t>(rb));
      if (end < 0) {
        acc = raw;
      } else {
        const int64_t distance = offset + rb - end;
        acc = (distance == step
                   ? (*shift_step)(acc)
                   : internal_format::Crc32cShift(
                         acc, static_cast<uint64_t>(distance))) ^
              raw;
      }
      end = offset + rb;
      ++k;
    });
    return internal_format::Crc32cShift(
        acc, t.chunk_bytes - static_cast<uint64_t>(end));
  }

  // The strided copies of a kSpan or kRuns task out of `src`, which holds
  // its bytes (the span, or the runs packed).
  static void CopyOut(const ReadTask& t, const std::byte* src) {
    for (const ReadTask::Copy& c : t.copies) {
      internal_core::CopyStrided(src + c.src_offset, t.src_strides.data(),
                                 c.dst, c.dst_strides.data(), c.shape.data(),
                                 static_cast<int>(c.shape.size()), t.elem_size);
    }
  }

  absl::Status Execute() {
    // Reads in file order, so the disk sees mostly sequential requests.
    std::vector<size_t> order(tasks_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return std::pair(tasks_[a].file, tasks_[a].file_offset) <
             std::pair(tasks_[b].file, tasks_[b].file_offset);
    });
    const bool in_memory = !tasks_.empty() && AllInMemory();
    const int threads = ReadThreads(in_memory);
    result_.io_threads = threads;
    const uint64_t buffer_bytes = std::max<uint64_t>(
        options_.bounce_buffer_bytes, internal_core::kIoAlignment);
    BufferPool pool(buffer_bytes, threads);
    std::vector<uint32_t> crcs(tasks_.size(), 0);
    const std::vector<Group> groups =
        GroupSmallReads(order, buffer_bytes, /*group=*/!in_memory);
    CAIRN_RETURN_IF_ERROR(pool_.ParallelFor(
        static_cast<int64_t>(groups.size()), threads,
        [&](int64_t i) -> absl::Status {
          const Group& g = groups[i];
          if (g.single()) {
            const size_t t = order[g.first];
            return RunTask(tasks_[t], pool, &crcs[t]);
          }
          return RunGroup(g, order, pool, crcs);
        }));
    // A group reads its whole range: the gaps between its tasks (padding,
    // entries no one needs) and its start rounded down to a page too.
    for (const Group& g : groups) {
      if (!g.single()) {
        result_.bytes_read += g.end - g.begin;
        continue;
      }
      const ReadTask& t = tasks_[order[g.first]];
      result_.bytes_read +=
          t.mode == ReadTask::Mode::kRuns ? t.runs.total_bytes() : t.span;
    }

    // Combine each checked chunk's pieces in chunk order and compare. The
    // pieces of a chunk read over several Reads wait for the rest of it.
    std::vector<std::vector<size_t>> pieces(checks_.size());
    for (size_t i = 0; i < tasks_.size(); ++i) {
      if (tasks_[i].check >= 0) pieces[tasks_[i].check].push_back(i);
    }
    std::vector<const ByteLocation*> carried;
    for (size_t c = 0; c < checks_.size(); ++c) {
      if (checks_[c].kind == Check::Kind::kShared ||
          checks_[c].kind == Check::Kind::kStrided) {
        auto [it, inserted] = shared_.try_emplace(checks_[c].location);
        if (inserted) {
          it->second.fqn = *checks_[c].fqn;
          it->second.chunk = checks_[c].chunk;
        }
        if (checks_[c].kind == Check::Kind::kStrided) {
          // The part's signature: its slabs' XORed.
          uint32_t signature = 0;
          for (size_t i : pieces[c]) signature ^= crcs[i];
          it->second.strided.push_back({checks_[c].region, signature});
          continue;
        }
        for (size_t i : pieces[c]) {
          it->second.pieces.push_back(
              {tasks_[i].check_offset, tasks_[i].span, crcs[i]});
        }
        continue;
      }
      if (checks_[c].kind != Check::Kind::kCarried) continue;
      const ByteLocation* loc = checks_[c].location;
      if (carried.empty() || carried.back() != loc) carried.push_back(loc);
      for (size_t i : pieces[c]) {
        carried_[loc].pieces.push_back(
            {tasks_[i].check_offset, tasks_[i].span, crcs[i]});
      }
    }
    for (const ByteLocation* loc : carried) {
      CAIRN_RETURN_IF_ERROR(CheckCarried(loc));
    }
    for (size_t c = 0; c < checks_.size(); ++c) {
      if (checks_[c].kind != Check::Kind::kWhole) continue;
      std::vector<CrcPiece> p;
      for (size_t i : pieces[c]) {
        p.push_back({tasks_[i].check_offset, tasks_[i].span, crcs[i]});
      }
      CAIRN_RETURN_IF_ERROR(
          CheckPieces(checks_[c].what, *checks_[c].location, std::move(p), ""));
      ++result_.chunks_verified;
    }
    return absl::OkStatus();
  }

  // Compares the CRC32C of a chunk read in pieces over several Reads with
  // its stored one, once the pieces so far cover it.
  absl::Status CheckCarried(const ByteLocation* loc) {
    auto it = carried_.find(loc);
    if (it == carried_.end()) return absl::OkStatus();
    uint64_t bytes = 0;
    for (const CrcPiece& p : it->second.pieces) bytes += p.bytes;
    if (bytes < loc->nbytes) return absl::OkStatus();  // more to come
    const CarriedCheck done = std::move(it->second);
    carried_.erase(it);
    CAIRN_RETURN_IF_ERROR(CheckPieces(
        done.what, *loc, done.pieces,
        absl::StrFormat(", read in %d pieces", done.pieces.size())));
    ++result_.chunks_verified;
    return absl::OkStatus();
  }

  // A location a Read needs, and the header entry it must be.
  struct Needed {
    int file;
    const ByteLocation* location;
    std::string what;  // the entry's name: EntryName, or an object's FQN
    DType dtype;
    const Shape* shape;  // the chunk's box sizes; null for an object
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
  // Each stored tensor's FQN: its key in metadata_.tensors, which
  // outlives this loader.
  std::map<const TensorMetadata*, const std::string*> fqn_of_;
  // Chunks read in pieces over several Reads, until checked.
  std::map<const ByteLocation*, CarriedCheck> carried_;
  // Chunks this rank read parts of, the rest read by other ranks.
  std::map<const ByteLocation*, SharedPieces> shared_;
  // SignRuns' tables, by the row stride they shift by (AddSlabTask).
  static constexpr int64_t kMinRunsForShifter = 32;
  std::map<int64_t, std::unique_ptr<internal_format::Crc32cShifter>> shifters_;
  // The IO threads, kept from Read to Read: a staged load reads batch by
  // batch, and starting the threads for every batch cost 0.34-0.47 ms a
  // batch on the 2-core VM.
  internal_core::WorkerPool pool_;
};

}  // namespace

namespace {

constexpr char kOperation[] = "load";

double Since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

absl::StatusOr<std::string> ReadMetadataText(Storage& storage,
                                             const std::string& name) {
  absl::StatusOr<std::string> bytes = internal_storage::ReadAllWithRoom(
      storage, name, internal_format::kMaxMetadataBytes,
      internal_comm::kSealHeaderBytes);
  if (absl::IsNotFound(bytes.status())) {
    return absl::NotFoundError(absl::StrFormat(
        "no committed checkpoint at %s (%s is missing)", storage.url(), name));
  }
  return bytes;
}

namespace {

// Decodes metadata `text`, which came from `source` (named in errors).
// Chunk coverage is checked when `coverage` is set, for global metadata
// only: rank-local metadata lists one rank's part.
absl::StatusOr<Metadata> DecodeAndValidate(std::string_view text,
                                           const std::string& source,
                                           bool coverage) {
  CAIRN_ASSIGN_OR_RETURN(Metadata metadata,
                         internal_format::DecodeMetadata(text, source));
  if (coverage && metadata.rank < 0) {
    CAIRN_RETURN_IF_ERROR(
        Annotate(internal_format::ValidateAllCoverage(metadata), source));
  }
  return metadata;
}

// Reads and decodes the metadata file `name`, checking coverage.
absl::StatusOr<Metadata> ReadAndValidate(Storage& storage,
                                         const std::string& name =
                                             kMetadataFileName) {
  CAIRN_ASSIGN_OR_RETURN(std::string text, ReadMetadataText(storage, name));
  return DecodeAndValidate(text, absl::StrCat(storage.url(), "/", name),
                           /*coverage=*/true);
}

// A rank-local load reads one folder, but the folders must come from one
// save: after a crash, or a smaller later save, folders of two saves can
// lie side by side. Rank r compares its folder's save id and world size
// with rank 0's folder (rank 0 with rank 1's), so a stale folder is
// refused by its own rank at least. One small extra read, no collective.
absl::Status CheckSameSave(Storage& storage, const Metadata& mine, int rank,
                           const std::string& context) {
  if (mine.world_size < 2) return absl::OkStatus();
  const int other = rank == 0 ? 1 : 0;
  const std::string name = absl::StrCat(
      internal_format::RankFolderName(other), "/", kMetadataFileName);
  absl::StatusOr<std::string> text = ReadMetadataText(storage, name);
  if (absl::IsNotFound(text.status())) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: %s/%s is missing, so this rank's folder cannot be shown to "
        "belong to a complete save of %d ranks",
        context, storage.url(), name, mine.world_size));
  }
  CAIRN_RETURN_IF_ERROR(Annotate(text.status(), context));
  absl::StatusOr<Metadata> decoded = internal_format::DecodeMetadata(
      *text, absl::StrCat(storage.url(), "/", name));
  CAIRN_RETURN_IF_ERROR(Annotate(decoded.status(), context));
  const Metadata& theirs = *decoded;
  if (theirs.save_id != mine.save_id ||
      theirs.world_size != mine.world_size) {
    auto describe = [](const Metadata& m) {
      return absl::StrFormat(
          "%s, %d ranks",
          m.save_id.empty() ? "no save id" : absl::StrCat("save ", m.save_id),
          m.world_size);
    };
    return absl::DataLossError(absl::StrFormat(
        "%s: the folders of rank %d (%s) and rank %d (%s) in %s come from "
        "different saves; a rank-local checkpoint is loaded only when every "
        "folder is from the same save",
        context, rank, describe(mine), other, describe(theirs), storage.url()));
  }
  return absl::OkStatus();
}

// Rank-local load: this rank's folder when it has one, else the global
// metadata; no collective either way.
absl::StatusOr<LoadResult> LoadRankLocal(StateDict& state,
                                         absl::StatusOr<Storage*> storage,
                                         const LoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const Ranks ranks(options.comm);
  const int rank = ranks.rank();
  const std::string context = absl::StrCat("rank-local load of rank ", rank);
  CAIRN_RETURN_IF_ERROR(Annotate(storage.status(), context));
  Storage& st = **storage;
  const std::string folder = internal_format::RankFolderName(rank);
  const std::string local_name = absl::StrCat(folder, "/", kMetadataFileName);
  absl::StatusOr<Metadata> metadata = ReadAndValidate(st, local_name);
  if (metadata.ok()) {
    if (metadata->rank != rank) {
      return absl::DataLossError(absl::StrFormat(
          "%s/%s says it was written by rank %d, not %d", st.url(), local_name,
          metadata->rank, rank));
    }
    CAIRN_RETURN_IF_ERROR(CheckSameSave(st, *metadata, rank, context));
    // Its file names are relative to the rank's folder.
    auto relocate = [&](ByteLocation& loc) {
      loc.file = absl::StrCat(folder, "/", loc.file);
    };
    for (auto& [fqn, tensor] : metadata->tensors) {
      for (ChunkMetadata& chunk : tensor.chunks) relocate(chunk.location);
    }
    for (auto& [fqn, loc] : metadata->objects) relocate(loc);
  } else if (absl::IsNotFound(metadata.status())) {
    metadata = ReadAndValidate(st);
    if (absl::IsNotFound(metadata.status())) {
      return absl::NotFoundError(absl::StrFormat(
          "%s: neither %s/%s nor a global %s exists (was the checkpoint "
          "saved by fewer ranks, or not committed?)",
          context, st.url(), local_name, kMetadataFileName));
    }
  }
  CAIRN_RETURN_IF_ERROR(Annotate(metadata.status(), context));
  const double metadata_seconds = Since(start);
  LoadOptions local = options;
  local.comm = nullptr;
  local.rank_local = false;
  absl::StatusOr<LoadResult> result =
      LoadWithMetadata(state, storage, *metadata, local);
  if (result.ok()) {
    result->phases.metadata = metadata_seconds;
    result->seconds += metadata_seconds;
  }
  return result;
}

}  // namespace

namespace {

// What a rank's plan reads, for finding replicas: each item's FQN, kind,
// chunk and overlap (local_index is the planner's own reference, not what
// is read).
std::string ReplicaKey(const LoadPlan& plan) {
  internal_core::ByteWriter key;
  for (const ReadItem& item : plan.items) {
    key.Str(item.fqn);
    key.U8(static_cast<uint8_t>(item.kind));
    key.U64(item.chunk);
    key.Ints(item.overlap.offsets);
    key.Ints(item.overlap.sizes);
  }
  return key.Take();
}

// Replica groups: ranks whose final plans read exactly the same items
// (data-parallel replicas). groups[r] is the lowest rank of r's group.
std::vector<int> ReplicaGroups(const std::vector<LoadPlan>& plans) {
  std::map<std::string, int> first;
  std::vector<int> groups(plans.size());
  for (size_t r = 0; r < plans.size(); ++r) {
    groups[r] = plans[r].items.empty()
                    ? static_cast<int>(r)
                    : first.try_emplace(ReplicaKey(plans[r]),
                                        static_cast<int>(r))
                          .first->second;
  }
  return groups;
}

// A rank's planning message, and the coordinator's answer, start with one
// of these: the whole plan (a planner whose CreateGlobalPlan may change
// plans), or a summary of it (DefaultLoadPlanner and its subclasses, whose
// global plan is the local plans unchanged: each rank keeps its own).
enum PlanMessage : uint8_t { kFullPlan = 1, kPlanSummary = 2 };

// True for cairn's DefaultLoadPlanner and its subclasses (its
// CreateGlobalPlan, which returns the local plans, is final).
bool KeepsLocalPlans(const LoadPlanner& planner) {
  return dynamic_cast<const DefaultLoadPlanner*>(&planner) != nullptr;
}

// The stored leaves in an order every rank derives from the same metadata:
// tensors, objects, scalars, each by name.
std::vector<const std::string*> StoredLeaves(const Metadata& metadata) {
  std::vector<const std::string*> leaves;
  leaves.reserve(metadata.tensors.size() + metadata.objects.size() +
                 metadata.scalars.size());
  for (const auto& [name, unused] : metadata.tensors) leaves.push_back(&name);
  for (const auto& [name, unused] : metadata.objects) leaves.push_back(&name);
  for (const auto& [name, unused] : metadata.scalars) leaves.push_back(&name);
  return leaves;
}

// `names` (stored leaves) as a bit set over StoredLeaves: bit i of byte
// i / 8 for leaf i. A name the metadata lacks is an internal error. (Each
// name is counted once, where it is first found: decoding refuses an FQN
// in two of tensors, objects and scalars, and a name counted twice would
// make the count of those not found wrap.)
absl::StatusOr<std::string> LeafBits(const Metadata& metadata,
                                     const std::vector<std::string>& names) {
  const std::vector<const std::string*> leaves = StoredLeaves(metadata);
  absl::flat_hash_set<std::string_view> wanted(names.begin(), names.end());
  const size_t asked = wanted.size();
  std::string bits((leaves.size() + 7) / 8, '\0');
  for (size_t i = 0; i < leaves.size() && !wanted.empty(); ++i) {
    if (wanted.erase(*leaves[i]) > 0) {
      bits[i / 8] = static_cast<char>(bits[i / 8] | (1 << (i % 8)));
    }
  }
  if (!wanted.empty()) {
    return absl::InternalError(absl::StrFormat(
        "%d of the planner's %d unexpected leaves are not in the checkpoint",
        wanted.size(), asked));
  }
  return bits;
}

// The names of the leaves set in `bits` (LeafBits), sorted.
absl::StatusOr<std::vector<std::string>> LeafNames(const Metadata& metadata,
                                                   std::string_view bits) {
  const std::vector<const std::string*> leaves = StoredLeaves(metadata);
  if (bits.size() != (leaves.size() + 7) / 8) {
    return absl::DataLossError(absl::StrFormat(
        "load plan from the coordinator: %d bytes of unexpected leaves for "
        "%d stored leaves",
        bits.size(), leaves.size()));
  }
  std::vector<std::string> names;
  for (size_t i = 0; i < leaves.size(); ++i) {
    if ((static_cast<uint8_t>(bits[i / 8]) >> (i % 8)) & 1) {
      names.push_back(*leaves[i]);
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

uint64_t MixBits(uint64_t h) {  // splitmix64's finalizer
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

// A 64-bit hash of a ReplicaKey, the same in every process. The groups it
// suggests are checked byte for byte afterwards (KeepVerifiedGroup), so a
// collision costs the broadcast, never a wrong byte.
uint64_t HashReplicaKey(std::string_view key) {
  uint64_t h = MixBits(0x9e3779b97f4a7c15ULL ^ key.size());
  size_t i = 0;
  for (; i + 8 <= key.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, key.data() + i, 8);
    h = MixBits(h ^ word) + 0x9e3779b97f4a7c15ULL;
  }
  uint64_t tail = 0;
  std::memcpy(&tail, key.data() + i, key.size() - i);
  return MixBits(h ^ tail);
}

std::atomic<uint64_t (*)(std::string_view)> replica_hash{&HashReplicaKey};

// Collective over `comm` (every rank, when any group has several members):
// the coordinator grouped ranks by a hash of what their plans read, so each
// member checks `plan` against its group leader's, byte for byte; if any
// rank's differs, every rank drops its group (`group` reset: the load reads
// everything itself instead of broadcasting).
absl::Status KeepVerifiedGroup(Communicator& comm, const LoadPlan& plan,
                               std::unique_ptr<Communicator>& group) {
  int64_t same = 1;
  if (group->size() > 1) {
    const std::string key = ReplicaKey(plan);
    std::string leader = key;
    CAIRN_RETURN_IF_ERROR(group->Broadcast(leader, 0));
    same = leader == key ? 1 : 0;
  }
  CAIRN_RETURN_IF_ERROR(
      comm.AllReduce(std::span<int64_t>(&same, 1), ReduceOp::kMin));
  if (same == 0) group.reset();
  return absl::OkStatus();
}

bool HasGroups(const std::vector<int>& groups) {
  for (size_t r = 0; r < groups.size(); ++r) {
    if (groups[r] != static_cast<int>(r)) return true;
  }
  return false;
}

// A device destination's runtime, looked up once per device.
class DeviceRuntimes {
 public:
  absl::StatusOr<internal_cuda::DeviceRuntime*> For(Device device) {
    for (const auto& [d, runtime] : runtimes_) {
      if (d == device) return runtime;
    }
    CAIRN_ASSIGN_OR_RETURN(internal_cuda::DeviceRuntime * runtime,
                           internal_cuda::RuntimeFor(device));
    runtimes_.emplace_back(device, runtime);
    return runtime;
  }
  bool empty() const { return runtimes_.empty(); }
  internal_cuda::DeviceRuntime* first() const { return runtimes_[0].second; }

  // Waits for every copy queued so far on every device; the first error.
  absl::Status SynchronizeAll() {
    absl::Status status;
    for (const auto& [device, runtime] : runtimes_) {
      status.Update(runtime->Synchronize(device));
    }
    return status;
  }
  // Waits for the application's queued work on every device (kernels that
  // may still read the destinations about to be overwritten).
  absl::Status WaitForAll() {
    for (const auto& [device, runtime] : runtimes_) {
      CAIRN_RETURN_IF_ERROR(runtime->WaitForDevice(device));
    }
    return absl::OkStatus();
  }

 private:
  std::vector<std::pair<Device, internal_cuda::DeviceRuntime*>> runtimes_;
};

// Splits every tensor item with a device destination larger than `limit`
// bytes into pieces of at most `limit` bytes (or one element, if larger):
// ForEachSlab over the item packed as it is staged. The pieces of an item
// contiguous in its chunk (the whole chunk, or whole rows of it) are
// contiguous too and follow each other in its file, so
// Loader::CheckAcrossReads checks them. Items and destinations stay
// parallel.
absl::Status SplitForStaging(const Metadata& metadata, uint64_t limit,
                             std::vector<ReadItem>& items,
                             std::vector<Destination>& dsts) {
  std::vector<ReadItem> out_items;
  std::vector<Destination> out_dsts;
  for (size_t i = 0; i < items.size(); ++i) {
    const ReadItem& item = items[i];
    const TensorMetadata* tm = nullptr;
    if (item.kind == ItemKind::kTensor) {
      auto it = metadata.tensors.find(item.fqn);
      if (it != metadata.tensors.end()) tm = &it->second;
    }
    const uint64_t es = tm != nullptr ? DTypeSize(tm->dtype) : 0;
    if (tm == nullptr || dsts[i].view.device().is_cpu() ||
        static_cast<uint64_t>(item.overlap.num_elements()) * es <= limit) {
      out_items.push_back(item);
      out_dsts.push_back(dsts[i]);
      continue;
    }
    CAIRN_RETURN_IF_ERROR(ForEachSlab(
        item.overlap, RowMajorByteStrides(item.overlap.sizes, es), es, limit,
        [&](const Box& slab) -> absl::Status {
          Box local = slab;  // in the destination view's coordinates
          for (int d = 0; d < slab.rank(); ++d) {
            local.offsets[d] -= item.overlap.offsets[d];
          }
          CAIRN_ASSIGN_OR_RETURN(TensorView view, dsts[i].view.Slice(local));
          ReadItem piece = item;
          piece.overlap = slab;
          out_items.push_back(std::move(piece));
          out_dsts.push_back(Destination{view, nullptr});
          return absl::OkStatus();
        }));
  }
  items = std::move(out_items);
  dsts = std::move(out_dsts);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> EncodeSharedPieces(
    const Metadata& metadata, const std::vector<SharedPieces>& shared) {
  internal_core::ByteWriter w;
  uint64_t n = 0;
  uint64_t strided = 0;
  uint64_t strided_bytes = 0;
  for (const SharedPieces& s : shared) {
    n += s.pieces.size();
    strided += s.strided.size();
    for (const SignedPart& part : s.strided) {
      strided_bytes += 16 + 16 * part.box.offsets.size();
    }
  }
  w.Reserve(16 + n * kSharedPieceBytes + strided_bytes);
  w.U64(n);
  if (n == 0 && strided == 0) {
    w.U64(0);
    return w.Take();
  }
  // Tensors by their index in metadata.tensors (the same on every rank).
  absl::flat_hash_map<std::string_view, uint32_t> index;
  index.reserve(metadata.tensors.size());
  for (const auto& [fqn, unused] : metadata.tensors) {
    index.emplace(fqn, static_cast<uint32_t>(index.size()));
  }
  std::vector<uint32_t> tensor_of;  // of each shared[i]
  tensor_of.reserve(shared.size());
  for (const SharedPieces& s : shared) {
    auto it = index.find(s.fqn);
    if (it == index.end()) {
      return absl::InternalError(absl::StrCat(
          "checksummed parts of ", s.fqn, ", which the checkpoint lacks"));
    }
    tensor_of.push_back(it->second);
    for (const CrcPiece& p : s.pieces) {
      w.U32(it->second);
      w.U64(s.chunk);
      w.U64(p.offset);
      w.U64(p.bytes);
      w.U32(p.crc);
    }
  }
  w.U64(strided);
  for (size_t i = 0; i < shared.size(); ++i) {
    const SharedPieces& s = shared[i];
    for (const SignedPart& part : s.strided) {
      w.U32(tensor_of[i]);
      w.U64(s.chunk);
      w.U32(part.signature);
      for (int64_t o : part.box.offsets) w.U64(static_cast<uint64_t>(o));
      for (int64_t z : part.box.sizes) w.U64(static_cast<uint64_t>(z));
    }
  }
  return w.Take();
}

namespace {

// The box that bytes [offset, offset + bytes) of a chunk (row-major,
// elements of `es` bytes) are, in global coordinates, or nullopt when they
// are not one (they start or end inside an element, or cross a row without
// taking whole rows).
std::optional<Box> PieceBox(const Box& chunk, size_t es, uint64_t offset,
                            uint64_t bytes) {
  if (offset % es != 0 || bytes % es != 0 || bytes == 0) return std::nullopt;
  const uint64_t e0 = offset / es;
  const uint64_t e1 = (offset + bytes) / es;
  const int rank = chunk.rank();
  if (rank == 0) {
    if (e0 == 0 && e1 == 1) return chunk;
    return std::nullopt;
  }
  // The outermost dimension d such that the range is whole blocks of the
  // dimensions after d, all within one index of the dimensions before d.
  uint64_t inner = 1;  // elements of one index of dimension d
  std::vector<uint64_t> inners(rank);
  for (int d = rank - 1; d >= 0; --d) {
    inners[d] = inner;
    inner *= static_cast<uint64_t>(chunk.sizes[d]);
  }
  for (int d = 0; d < rank; ++d) {
    const uint64_t block = inners[d];
    const uint64_t size = static_cast<uint64_t>(chunk.sizes[d]);
    if (e0 % block != 0 || e1 % block != 0) continue;
    const uint64_t i0 = e0 / block;
    const uint64_t i1 = e1 / block;  // exclusive, along dims 0..d flattened
    if (i0 / size != (i1 - 1) / size) continue;
    Box box = chunk;
    uint64_t prefix = i0 / size;  // the index over dims before d
    for (int k = d - 1; k >= 0; --k) {
      const uint64_t n = static_cast<uint64_t>(chunk.sizes[k]);
      box.offsets[k] += static_cast<int64_t>(prefix % n);
      box.sizes[k] = 1;
      prefix /= n;
    }
    box.offsets[d] += static_cast<int64_t>(i0 % size);
    box.sizes[d] = static_cast<int64_t>(i1 - i0);
    return box;
  }
  return std::nullopt;
}

// One part of a chunk for the strided check: a contiguous piece as a box
// (its CRC32C made a signature), or a strided part.
struct BoxPart {
  Box box;
  uint32_t signature;
  int rank;
};

// The strided check of one chunk (CheckSharedPieces): true when its parts
// tile it and their signatures sum to its CRC32C, false when they do not
// tile it (unchecked), kDataLoss when they tile it with other bytes or two
// ranks read one box differently.
absl::StatusOr<bool> CheckBoxParts(std::string_view fqn,
                                   const TensorMetadata& tm,
                                   const ChunkMetadata& chunk,
                                   std::vector<BoxPart>& parts) {
  auto entry = [&] {
    return internal_format::EntryName(fqn, chunk.box,
                                      chunk.box == Box::Full(tm.shape));
  };
  std::sort(parts.begin(), parts.end(), [](const BoxPart& a, const BoxPart& b) {
    return std::tie(a.box.offsets, a.box.sizes, a.rank) <
           std::tie(b.box.offsets, b.box.sizes, b.rank);
  });
  // The same box read by two ranks (replicated destinations) once.
  std::vector<const BoxPart*> kept;
  const int64_t whole = chunk.box.num_elements();
  int64_t volume = 0;
  for (const BoxPart& part : parts) {
    const BoxPart* last = kept.empty() ? nullptr : kept.back();
    if (last != nullptr && last->box == part.box) {
      if (last->signature != part.signature) {
        return absl::DataLossError(absl::StrFormat(
            "%s (%s, offset %d): ranks %d and %d read different bytes in %s "
            "of it (signatures %s and %s); was the file changed during the "
            "load?",
            entry(), chunk.location.file, chunk.location.offset, last->rank,
            part.rank, part.box.ToString(),
            internal_format::Crc32cToHex(last->signature),
            internal_format::Crc32cToHex(part.signature)));
      }
      continue;
    }
    // Each part lies inside the chunk, so whole - volume cannot overflow.
    const int64_t n = part.box.num_elements();
    if (n > whole - volume) return false;  // an overlap
    volume += n;
    kept.push_back(&part);
  }
  if (volume != whole) return false;  // a gap (or an overlap and a gap)
  // Disjoint (so, with the volumes, a tiling): sorted by their first
  // dimension's offsets, a part can only meet the parts after it that start
  // before it ends there.
  for (size_t i = 0; i < kept.size(); ++i) {
    const Box& a = kept[i]->box;
    for (size_t j = i + 1; j < kept.size(); ++j) {
      const Box& b = kept[j]->box;
      if (b.offsets[0] >= a.offsets[0] + a.sizes[0]) break;
      if (Intersect(a, b)) return false;
    }
  }
  uint32_t sum = 0;
  std::set<int> ranks;
  for (const BoxPart* part : kept) {
    sum ^= part->signature;
    ranks.insert(part->rank);
  }
  const uint32_t crc = sum ^ internal_format::Crc32cOfZeros(chunk.location.nbytes);
  if (crc != chunk.location.crc32c) {
    return CrcMismatch(entry(), chunk.location, ReadByRanks(ranks, kept.size()),
                       crc);
  }
  return true;
}

}  // namespace

absl::StatusOr<uint64_t> CheckSharedPieces(
    const Metadata& metadata, const std::vector<std::string>& payloads,
    std::vector<std::pair<uint32_t, uint64_t>>* unchecked) {
  // Every chunk of the checkpoint by a number: its tensor's first chunk's
  // number plus its index in the tensor.
  using Stored = decltype(metadata.tensors)::value_type;
  std::vector<const Stored*> tensors;
  std::vector<uint64_t> first_chunk;
  tensors.reserve(metadata.tensors.size());
  first_chunk.reserve(metadata.tensors.size() + 1);
  uint64_t chunks = 0;
  for (const Stored& t : metadata.tensors) {
    tensors.push_back(&t);
    first_chunk.push_back(chunks);
    chunks += t.second.chunks.size();
  }
  first_chunk.push_back(chunks);
  // Every rank's pieces, read as untrusted bytes.
  struct Part {
    uint64_t chunk;  // its number
    CrcPiece piece;
    int rank;
  };
  auto what = [](size_t r) {
    return absl::StrCat("chunk checksums from rank ", r);
  };
  struct Strided {
    uint64_t chunk;  // its number
    SignedPart part;
    int rank;
  };
  uint64_t payload_bytes = 0;
  for (const std::string& p : payloads) payload_bytes += p.size();
  std::vector<Part> parts;
  parts.reserve(payload_bytes / kSharedPieceBytes);
  std::vector<Strided> strided;
  for (size_t r = 0; r < payloads.size(); ++r) {
    internal_core::ByteReader in(payloads[r], what(r));
    // The tensor and chunk of a piece or part, or an error.
    auto locate = [&](uint32_t t, uint64_t c)
        -> absl::StatusOr<const ChunkMetadata*> {
      if (t >= tensors.size()) {
        return absl::InternalError(absl::StrFormat(
            "%s: tensor %d of a checkpoint with %d", what(r), t,
            tensors.size()));
      }
      const auto& [fqn, tm] = *tensors[t];
      if (c >= tm.chunks.size()) {
        return absl::InternalError(absl::StrFormat(
            "%s: chunk %d of %s, which the checkpoint does not hold", what(r),
            c, fqn));
      }
      return &tm.chunks[c];
    };
    const uint64_t count = in.Count(kSharedPieceBytes);
    for (uint64_t i = 0; i < count; ++i) {
      const uint32_t t = in.U32();
      const uint64_t c = in.U64();
      const CrcPiece p{in.U64(), in.U64(), in.U32()};
      if (in.failed()) break;
      CAIRN_ASSIGN_OR_RETURN(const ChunkMetadata* chunk, locate(t, c));
      const uint64_t nbytes = chunk->location.nbytes;
      if (p.offset > nbytes || p.bytes > nbytes - p.offset) {
        return absl::InternalError(absl::StrFormat(
            "%s: bytes [%d, +%d) of chunk %d of %s, which has %d", what(r),
            p.offset, p.bytes, c, tensors[t]->first, nbytes));
      }
      parts.push_back({first_chunk[t] + c, p, static_cast<int>(r)});
    }
    // Strided parts: at least a tensor, chunk, signature and one
    // dimension's offset and size.
    const uint64_t count_strided = in.failed() ? 0 : in.Count(32);
    for (uint64_t i = 0; i < count_strided; ++i) {
      const uint32_t t = in.U32();
      const uint64_t c = in.U64();
      const uint32_t signature = in.U32();
      if (in.failed()) break;
      CAIRN_ASSIGN_OR_RETURN(const ChunkMetadata* chunk, locate(t, c));
      const Box& cb = chunk->box;
      const int rank = cb.rank();
      Strided s{first_chunk[t] + c, {Box{}, signature}, static_cast<int>(r)};
      std::vector<uint64_t> dims(2 * rank);
      for (uint64_t& v : dims) v = in.U64();
      if (in.failed()) break;
      bool inside = rank > 0;
      for (int d = 0; d < rank && inside; ++d) {
        // Inside the chunk's box and not empty, without overflow.
        const uint64_t o = dims[d], z = dims[rank + d];
        const uint64_t co = static_cast<uint64_t>(cb.offsets[d]);
        const uint64_t cz = static_cast<uint64_t>(cb.sizes[d]);
        inside = o >= co && o - co < cz && z >= 1 && z <= cz - (o - co);
      }
      if (!inside) {
        return absl::InternalError(absl::StrFormat(
            "%s: a part [%s] of chunk %d of %s, which is %s", what(r),
            absl::StrJoin(dims, ", "), c, tensors[t]->first, cb.ToString()));
      }
      s.part.box.offsets.assign(dims.begin(), dims.begin() + rank);
      s.part.box.sizes.assign(dims.begin() + rank, dims.end());
      strided.push_back(std::move(s));
    }
    CAIRN_RETURN_IF_ERROR(in.status());
  }
  // Chunks with strided parts are checked on boxes, after the others.
  std::sort(strided.begin(), strided.end(),
            [](const Strided& a, const Strided& b) { return a.chunk < b.chunk; });
  auto has_strided = [&](uint64_t c) {
    auto it = std::lower_bound(
        strided.begin(), strided.end(), c,
        [](const Strided& s, uint64_t n) { return s.chunk < n; });
    return it != strided.end() && it->chunk == c;
  };
  if (parts.empty() && strided.empty()) return 0;  // most loads
  // The parts of each chunk together (a counting sort by chunk number: the
  // parts run to millions at thousands of ranks), then by offset.
  std::vector<uint64_t> begin(chunks + 1, 0);
  for (const Part& part : parts) ++begin[part.chunk + 1];
  for (uint64_t c = 0; c < chunks; ++c) begin[c + 1] += begin[c];
  std::vector<const Part*> by_chunk(parts.size());
  {
    std::vector<uint64_t> next(begin.begin(), begin.end() - 1);
    for (const Part& part : parts) by_chunk[next[part.chunk]++] = &part;
  }
  uint64_t checked = 0;
  std::vector<const Part*> tiling;
  // Chunk numbers with parts that no set of parts tiles (for `unchecked`).
  std::vector<uint64_t> untiled;
  size_t t = 0;  // the tensor of chunk number c
  for (uint64_t c = 0; c < chunks; ++c) {
    if (begin[c] == begin[c + 1]) continue;
    if (!strided.empty() && has_strided(c)) continue;
    while (first_chunk[t + 1] <= c) ++t;
    // Not a structured binding: lambdas may capture those only since
    // C++20, which clang 14 (the fuzz build's compiler) lacks.
    const std::string& fqn = tensors[t]->first;
    const TensorMetadata& tm = tensors[t]->second;
    const ChunkMetadata& chunk = tm.chunks[c - first_chunk[t]];
    auto entry = [&] {
      return internal_format::EntryName(fqn, chunk.box,
                                        chunk.box == Box::Full(tm.shape));
    };
    const auto mine = std::span(by_chunk).subspan(begin[c], begin[c + 1] - begin[c]);
    std::sort(mine.begin(), mine.end(), [](const Part* a, const Part* b) {
      return std::tuple(a->piece.offset, a->piece.bytes, a->rank) <
             std::tuple(b->piece.offset, b->piece.bytes, b->rank);
    });
    tiling.clear();
    uint32_t crc = 0;
    uint64_t covered = 0;
    bool tiles = true;
    for (const Part* part : mine) {
      const CrcPiece& p = part->piece;
      const Part* last = tiling.empty() ? nullptr : tiling.back();
      if (last != nullptr && p.offset == last->piece.offset &&
          p.bytes == last->piece.bytes) {
        // The same bytes read by two ranks (replicated destinations).
        if (p.crc != last->piece.crc) {
          return absl::DataLossError(absl::StrFormat(
              "%s (%s, offset %d): ranks %d and %d read different bytes at "
              "[%d, +%d) of it (CRC32C %s and %s); was the file changed "
              "during the load?",
              entry(), chunk.location.file, chunk.location.offset, last->rank,
              part->rank, p.offset, p.bytes,
              internal_format::Crc32cToHex(last->piece.crc),
              internal_format::Crc32cToHex(p.crc)));
        }
        continue;
      }
      if (p.offset != covered) {  // a gap, or an uneven overlap
        tiles = false;
        break;
      }
      crc = covered == 0 ? p.crc
                         : internal_format::Crc32cCombine(crc, p.crc, p.bytes);
      covered += p.bytes;
      tiling.push_back(part);
    }
    if (!tiles || covered != chunk.location.nbytes) {
      untiled.push_back(c);
      continue;
    }
    if (crc != chunk.location.crc32c) {
      std::vector<CrcPiece> pieces;
      std::set<int> ranks;
      for (const Part* part : tiling) {
        pieces.push_back(part->piece);
        ranks.insert(part->rank);
      }
      return CheckPieces(entry(), chunk.location, std::move(pieces),
                         ReadByRanks(ranks));
    }
    ++checked;
  }
  // Chunks with strided parts, each with its contiguous pieces as boxes.
  std::vector<BoxPart> box_parts;
  for (size_t i = 0; i < strided.size();) {
    const uint64_t c = strided[i].chunk;
    const size_t tensor =
        static_cast<size_t>(std::upper_bound(first_chunk.begin(),
                                             first_chunk.end(), c) -
                            first_chunk.begin()) - 1;
    const auto& [fqn, tm] = *tensors[tensor];
    const ChunkMetadata& chunk = tm.chunks[c - first_chunk[tensor]];
    box_parts.clear();
    bool boxes = true;
    for (uint64_t k = begin[c]; k < begin[c + 1] && boxes; ++k) {
      const Part& part = *by_chunk[k];
      std::optional<Box> box = PieceBox(chunk.box, DTypeSize(tm.dtype),
                                        part.piece.offset, part.piece.bytes);
      if (!box) {
        boxes = false;  // not a box: this chunk stays unchecked
        break;
      }
      box_parts.push_back({*std::move(box),
                           internal_format::Crc32cPieceSignature(
                               part.piece.crc, part.piece.offset,
                               part.piece.bytes, chunk.location.nbytes),
                           part.rank});
    }
    for (; i < strided.size() && strided[i].chunk == c; ++i) {
      box_parts.push_back(
          {strided[i].part.box, strided[i].part.signature, strided[i].rank});
    }
    if (!boxes) {
      untiled.push_back(c);
      continue;
    }
    CAIRN_ASSIGN_OR_RETURN(bool tiled, CheckBoxParts(fqn, tm, chunk, box_parts));
    checked += tiled ? 1 : 0;
    if (!tiled) untiled.push_back(c);
  }
  if (unchecked != nullptr) {
    std::sort(untiled.begin(), untiled.end());
    for (uint64_t c : untiled) {
      const size_t tensor =
          static_cast<size_t>(std::upper_bound(first_chunk.begin(),
                                               first_chunk.end(), c) -
                              first_chunk.begin()) - 1;
      unchecked->emplace_back(static_cast<uint32_t>(tensor),
                              c - first_chunk[tensor]);
    }
  }
  return checked;
}

namespace {

// Staged load: the items are read in batches of about `batch_bytes` through
// host staging, for two reasons, either or both:
//  - a replica group (`group` of several members, which all have the same
//    items in the same order): each item is read by one member (largest
//    items first, each to the member with the fewest bytes so far), the
//    group agrees that the batch's reads succeeded, and the owners
//    broadcast;
//  - device destinations: bytes are read into pinned host staging, checked,
//    then copied to the device on the runtime's stream. Two staging buffers
//    alternate, so one batch's device copies run while the next batch is
//    read; a batch's copies are waited for before its buffer is reused.
// A tensor item whose destination is contiguous host memory skips staging.
absl::StatusOr<LoadResult> StagedLoad(Communicator& group,
                                      const absl::StatusOr<LoadPlan>& plan,
                                      LoadPlanner& planner, Storage& storage,
                                      const Metadata& metadata,
                                      const LoadOptions& options,
                                      uint64_t batch_bytes,
                                      LoadPhaseTimes& phases,
                                      std::vector<SharedPieces>& shared,
                                      std::vector<Destination> resolved = {}) {
  // A group of one has nobody to agree with: its own status is the verdict
  // (LoadWithMetadata's final agreement names the rank).
  auto agree = [&group](const absl::Status& local) {
    return group.size() > 1 ? AgreeOnStatus(group, local, kOperation,
                                            "reading (replica group)")
                            : local;
  };
  // Each item's destination, resolved here unless the caller passed them
  // (ResolveDestination is asked once per item).
  std::vector<Destination> dsts;
  absl::Status ready = plan.status();
  // Checks every destination, then reads every batch this member owns (one
  // loader: the data files stay open from batch to batch).
  Loader reader(storage, metadata, options);
  const bool given = ready.ok() && resolved.size() == plan->items.size();
  if (ready.ok()) {
    for (size_t i = 0; i < plan->items.size(); ++i) {
      const ReadItem& item = plan->items[i];
      absl::StatusOr<Destination> d =
          given ? std::move(resolved[i]) : planner.ResolveDestination(item);
      if (d.ok()) {
        // Owners check their destinations as they read; here every member
        // checks its own, since it copies into them without reading.
        d = reader.CheckDestination(item, *d);
      }
      if (!d.ok()) {
        ready = d.status();
        break;
      }
      dsts.push_back(*d);
    }
  }
  // The devices written to, each waited for before its first copy.
  DeviceRuntimes devices;
  if (ready.ok()) {
    for (size_t i = 0; i < dsts.size() && ready.ok(); ++i) {
      const ReadItem& item = plan->items[i];
      if (item.kind == ItemKind::kTensor && !dsts[i].view.device().is_cpu()) {
        ready = internal_core::Annotate(
            devices.For(dsts[i].view.device()).status(),
            absl::StrCat(item.fqn, " ", item.overlap.ToString()));
      }
    }
  }
  if (ready.ok()) ready = devices.WaitForAll();
  CAIRN_RETURN_IF_ERROR(agree(ready));
  constexpr uint64_t kSlot = 64;  // staging offsets aligned for copies
  const uint64_t batch_limit = std::max<uint64_t>(batch_bytes, kSlot);
  // A device load of one rank splits items larger than a batch, so that
  // its pinned staging stays two batches however large a tensor is. (In a
  // replica group every member must batch the same items, and members may
  // differ in which destinations are on a device: no split there.)
  std::vector<ReadItem> split_items;
  const bool split = group.size() == 1 && !devices.empty();
  if (split) {
    split_items = plan->items;
    CAIRN_RETURN_IF_ERROR(
        SplitForStaging(metadata, batch_limit, split_items, dsts));
  }
  const std::vector<ReadItem>& items = split ? split_items : plan->items;

  // Bytes of each item, its stored tensor (tensor items), the owner of each.
  std::vector<uint64_t> bytes(items.size());
  std::vector<const TensorMetadata*> stored(items.size(), nullptr);
  for (size_t i = 0; i < items.size(); ++i) {
    const ReadItem& item = items[i];
    if (item.kind == ItemKind::kObject) {
      auto it = metadata.objects.find(item.fqn);
      bytes[i] = it == metadata.objects.end() ? 0 : it->second.nbytes;
    } else {
      auto it = metadata.tensors.find(item.fqn);
      if (it == metadata.tensors.end()) continue;
      stored[i] = &it->second;
      bytes[i] = static_cast<uint64_t>(item.overlap.num_elements()) *
                 DTypeSize(it->second.dtype);
    }
  }
  const int members = group.size();
  const int me = group.rank();
  // Largest items first, each to the member with the fewest bytes so far
  // (as dedup balances writers): in plan order, one large item late in the
  // plan could land on an already loaded member. Every member computes the
  // same assignment from the same sizes.
  std::vector<size_t> by_size(items.size());
  for (size_t i = 0; i < by_size.size(); ++i) by_size[i] = i;
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  std::vector<int> owner(items.size());
  std::vector<uint64_t> assigned(members, 0);
  for (size_t i : by_size) {
    owner[i] = static_cast<int>(
        std::min_element(assigned.begin(), assigned.end()) - assigned.begin());
    assigned[owner[i]] += bytes[i];
  }

  LoadResult result;
  result.replica_group_size = members;
  // A member whose destination of an item is contiguous host memory reads
  // (as owner) or receives it right there; the others go through staging
  // and a strided or device copy.
  std::vector<bool> direct(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const TensorView& v = dsts[i].view;
    direct[i] = items[i].kind == ItemKind::kTensor && v.device().is_cpu() &&
                v.is_contiguous();
  }
  // Batches: items [begin, end) of at most `batch_limit` bytes (at least one
  // item, however large). Boundaries depend only on item sizes, which every
  // member shares, so the members' collectives line up; `used` is this
  // member's staging.
  auto slot_of = [&](size_t i) {
    return internal_core::RoundUp(bytes[i], kSlot);
  };
  // Where a large tensor item's first byte sits in its staging slot, modulo
  // a page: the same as in its file, so that a cold read of it can go
  // O_DIRECT (the file backend reads a page-aligned middle straight from
  // the device only into an address with the file offset's alignment).
  // Staging buffers start on a page. Costs under a page per large item.
  constexpr uint64_t kPage = 4096;
  constexpr uint64_t kAlignFrom = uint64_t{64} << 10;
  auto slot_offset = [&](size_t i, uint64_t used) -> uint64_t {
    used = internal_core::RoundUp(used, kSlot);
    if (bytes[i] < kAlignFrom) return used;
    const TensorMetadata& tm = *stored[i];
    const ChunkMetadata& chunk = tm.chunks[items[i].chunk];
    const uint64_t want =
        (chunk.location.offset +
         internal_core::SubBoxRuns(chunk.box, items[i].overlap,
                                   DTypeSize(tm.dtype))
             .first_offset) %
        kPage;
    return used + (want + kPage - used % kPage) % kPage;
  };
  struct Batch {
    size_t begin, end;
    uint64_t used;
  };
  std::vector<Batch> batches;
  std::vector<uint64_t> offset(items.size(), 0);
  for (size_t begin = 0; begin < items.size();) {
    size_t end = begin;
    uint64_t batch = 0;
    uint64_t used = 0;
    while (end < items.size()) {
      if (end > begin && batch + slot_of(end) > batch_limit) break;
      batch += slot_of(end);
      if (items[end].kind == ItemKind::kTensor && !direct[end]) {
        offset[end] = slot_offset(end, used);
        used = offset[end] + bytes[end];
      }
      ++end;
    }
    batches.push_back({begin, end, used});
    begin = end;
  }
  // Staging: with device destinations, two pinned buffers used in turn
  // (each as large as the largest batch that uses it); else one pageable.
  // (Pinning is slow: 0.03-0.06 s for 2 x 64 MiB on an H200 machine. Pinning
  // the second buffer on another thread during the first batch's reads
  // slowed those reads by as much and was dropped: bench/RESULTS.md.)
  const int buffers = devices.empty() ? 1 : 2;
  uint64_t need[2] = {0, 0};
  for (size_t b = 0; b < batches.size(); ++b) {
    need[b % buffers] = std::max(need[b % buffers], batches[b].used);
  }
  std::shared_ptr<void> pinned[2];
  Tensor pageable;
  std::byte* staging[2] = {nullptr, nullptr};
  auto allocate = [&](int k) -> absl::Status {
    if (devices.empty()) {
      absl::StatusOr<Tensor> t =
          Tensor::Empty(DType::kU8, {static_cast<int64_t>(need[k])});
      if (!t.ok()) return t.status();
      pageable = *std::move(t);
      staging[k] = static_cast<std::byte*>(pageable.data());
      return absl::OkStatus();
    }
    absl::StatusOr<std::shared_ptr<void>> p =
        devices.first()->AllocatePinned(need[k]);
    if (!p.ok()) {
      return internal_core::Annotate(
          p.status(), absl::StrFormat("pinned staging of %d bytes", need[k]));
    }
    pinned[k] = *std::move(p);
    staging[k] = static_cast<std::byte*>(pinned[k].get());
    return absl::OkStatus();
  };
  auto t_staging = std::chrono::steady_clock::now();
  absl::Status allocated;
  for (int k = 0; k < buffers && allocated.ok(); ++k) {
    if (need[k] > 0) allocated = allocate(k);
  }
  phases.staging += Since(t_staging);
  CAIRN_RETURN_IF_ERROR(agree(allocated));
  // Declared after the staging it reads from, so on every way out the
  // device copies have finished before the staging is freed.
  struct SyncOnExit {
    DeviceRuntimes& devices;
    ~SyncOnExit() { devices.SynchronizeAll().IgnoreError(); }
  } sync_on_exit{devices};

  // A chunk this member reads in pieces over several batches (a split
  // tensor) is checked by the reader as its last piece lands.
  {
    std::vector<ReadItem> mine;
    for (size_t i = 0; i < items.size(); ++i) {
      if (owner[i] == me) mine.push_back(items[i]);
    }
    reader.CheckAcrossReads(mine);
  }
  // A device copy's error is kept (later copies skipped) and agreed on with
  // the next batch's reads, so every member stays in the collectives.
  absl::Status placed;
  for (size_t b = 0; b < batches.size(); ++b) {
    const size_t begin = batches[b].begin;
    const size_t end = batches[b].end;
    std::byte* base = staging[b % buffers];
    auto buffer = [&](size_t i) {
      return direct[i] ? static_cast<std::byte*>(dsts[i].view.data())
                       : base + offset[i];
    };
    std::vector<std::string> objects(end - begin);

    // Read what this member owns.
    auto t0 = std::chrono::steady_clock::now();
    std::vector<ReadItem> mine;
    std::vector<Destination> mine_dsts;
    for (size_t i = begin; i < end; ++i) {
      if (owner[i] != me) continue;
      mine.push_back(items[i]);
      Destination d;
      if (items[i].kind == ItemKind::kObject) {
        d.object = &objects[i - begin];
      } else {
        d.view = TensorView(buffer(i), dsts[i].view.dtype(),
                            items[i].overlap.sizes);
      }
      mine_dsts.push_back(d);
    }
    absl::Status read = absl::OkStatus();
    if (!mine.empty()) {
      read = reader.Read(mine, mine_dsts);
      const LoadResult part = reader.TakeResult();
      result.bytes_read += part.bytes_read;
      result.chunks_verified += part.chunks_verified;
      result.io_threads = std::max(result.io_threads, part.io_threads);
    }
    phases.read += Since(t0);
    CAIRN_RETURN_IF_ERROR(agree(read.ok() ? placed : read));

    // Share, then place what went through staging.
    t0 = std::chrono::steady_clock::now();
    if (members > 1) {
      for (size_t i = begin; i < end; ++i) {
        absl::Status s =
            items[i].kind == ItemKind::kObject
                ? group.Broadcast(objects[i - begin], owner[i])
                : group.BroadcastBytes(
                      std::span<std::byte>(buffer(i), bytes[i]), owner[i]);
        CAIRN_RETURN_IF_ERROR(
            Annotate(s, "communicator failed in broadcast load"));
      }
    }
    phases.broadcast += Since(t0);
    t0 = std::chrono::steady_clock::now();
    // The previous batch's device copies (which ran during this batch's
    // reads) are done before this batch's are queued; the buffer they read
    // from is the next batch's.
    if (!devices.empty() && placed.ok()) placed = devices.SynchronizeAll();
    for (size_t i = begin; i < end; ++i) {
      result.bytes_loaded += bytes[i];
      if (items[i].kind == ItemKind::kObject) {
        *dsts[i].object = std::move(objects[i - begin]);
        continue;
      }
      if (direct[i]) continue;
      const TensorView& dst = dsts[i].view;
      if (dst.device().is_cpu()) {
        internal_core::CopyView(
            TensorView(base + offset[i], dst.dtype(), dst.shape()), dst);
        continue;
      }
      if (!placed.ok()) continue;
      absl::StatusOr<internal_cuda::DeviceRuntime*> runtime =
          devices.For(dst.device());
      placed = runtime.status();
      if (placed.ok()) {
        placed = internal_cuda::QueueCopyToDeviceView(
            **runtime,
            absl::StrCat(items[i].fqn, " ", items[i].overlap.ToString()),
            base + offset[i], dst);
      }
      if (placed.ok()) result.device_bytes += bytes[i];
    }
    phases.copy += Since(t0);
  }
  auto t0 = std::chrono::steady_clock::now();
  if (placed.ok()) placed = devices.SynchronizeAll();
  if (placed.ok()) placed = reader.FinishAcrossReads();
  shared = reader.TakeSharedPieces();
  phases.copy += Since(t0);
  CAIRN_RETURN_IF_ERROR(agree(placed));
  // Every copy out of the staging has finished.
  t0 = std::chrono::steady_clock::now();
  pinned[0].reset();
  pinned[1].reset();
  pageable = Tensor();
  phases.staging += Since(t0);
  for (const ReadItem& item : plan->items) {
    CAIRN_RETURN_IF_ERROR(planner.CommitChunk(item));
  }
  return result;
}

}  // namespace

absl::StatusOr<Metadata> ReadMetadataFromStorage(Storage& storage) {
  return ReadAndValidate(storage);
}

absl::StatusOr<Metadata> ReadMetadataFile(Storage& storage,
                                          const std::string& name) {
  return ReadAndValidate(storage, name);
}

void SetReplicaHashForTesting(uint64_t (*hash)(std::string_view)) {
  replica_hash.store(hash != nullptr ? hash : &HashReplicaKey);
}

absl::StatusOr<std::string> EncodeLocalLoadPlan(const LoadPlanner& planner,
                                                const LoadPlan& plan,
                                                const Metadata& metadata) {
  internal_core::ByteWriter w;
  if (!KeepsLocalPlans(planner)) {
    w.U8(kFullPlan);
    w.Str(internal_plan::EncodeLoadPlan(plan));
    return w.Take();
  }
  CAIRN_ASSIGN_OR_RETURN(std::string bits, LeafBits(metadata, plan.unexpected));
  w.U8(kPlanSummary);
  w.U64(plan.items.size());
  w.U64(plan.items.empty() ? 0 : replica_hash.load()(ReplicaKey(plan)));
  w.Str(bits);
  return w.Take();
}

absl::StatusOr<std::vector<std::string>> PlanLoadGlobally(
    LoadPlanner& planner, const Metadata& metadata,
    const std::vector<std::string>& gathered, bool broadcast_replicas) {
  const size_t world = gathered.size();
  const uint8_t kind = KeepsLocalPlans(planner) ? kPlanSummary : kFullPlan;
  std::vector<internal_core::ByteReader> readers;
  readers.reserve(world);
  for (size_t r = 0; r < world; ++r) {
    internal_core::ByteReader& reader = readers.emplace_back(
        gathered[r], absl::StrCat("load plan of rank ", r));
    const uint8_t got = reader.U8();
    if (reader.failed()) return reader.status();
    if (got != kind) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "rank %d planned its load with %s, the coordinator with %s: every "
          "rank must pass the same kind of LoadOptions::planner",
          r, got == kPlanSummary ? "cairn's default planner" : "its own planner",
          kind == kPlanSummary ? "cairn's default planner"
                               : "its own planner"));
    }
  }
  // Each rank's unexpected leaves (as a bit set over StoredLeaves), what
  // its plan reads (the number of items, and a hash of them, or the whole
  // plan), for the replica groups.
  std::string unexpected_bits;
  std::vector<int> groups;
  std::vector<LoadPlan> plans;
  if (kind == kPlanSummary) {
    const size_t leaves = StoredLeaves(metadata).size();
    const size_t bytes = (leaves + 7) / 8;
    unexpected_bits.assign(bytes, static_cast<char>(0xff));
    std::map<std::pair<uint64_t, uint64_t>, int> first;
    groups.resize(world);
    for (size_t r = 0; r < world; ++r) {
      internal_core::ByteReader& reader = readers[r];
      const uint64_t items = reader.U64();
      const uint64_t hash = reader.U64();
      const std::string_view bits = reader.StrView();
      CAIRN_RETURN_IF_ERROR(reader.status());
      if (bits.size() != bytes) {
        return absl::DataLossError(absl::StrFormat(
            "load plan of rank %d: %d bytes of unexpected leaves for %d "
            "stored leaves",
            r, bits.size(), leaves));
      }
      // A stored leaf is unexpected only when no rank asked for it.
      for (size_t i = 0; i < bytes; ++i) unexpected_bits[i] &= bits[i];
      groups[r] = items == 0 ? static_cast<int>(r)
                             : first.try_emplace({items, hash},
                                                 static_cast<int>(r))
                                   .first->second;
    }
    if (!broadcast_replicas) groups.clear();
  } else {
    std::vector<LoadPlan> locals;
    locals.reserve(world);
    for (size_t r = 0; r < world; ++r) {
      const std::string_view bytes = readers[r].StrView();
      CAIRN_RETURN_IF_ERROR(readers[r].status());
      CAIRN_ASSIGN_OR_RETURN(
          LoadPlan p, internal_plan::DecodeLoadPlan(
                          bytes, absl::StrCat("load plan of rank ", r)));
      locals.push_back(std::move(p));
    }
    // A stored leaf is unexpected only when no rank asked for it.
    std::vector<std::string> unexpected;
    if (!locals.empty()) {
      unexpected = locals[0].unexpected;
      for (size_t r = 1; r < locals.size(); ++r) {
        std::vector<std::string> both;
        std::set_intersection(unexpected.begin(), unexpected.end(),
                              locals[r].unexpected.begin(),
                              locals[r].unexpected.end(),
                              std::back_inserter(both));
        unexpected = std::move(both);
      }
    }
    CAIRN_ASSIGN_OR_RETURN(plans, planner.CreateGlobalPlan(std::move(locals)));
    if (plans.size() != world) {
      return absl::InternalError(
          absl::StrFormat("CreateGlobalPlan returned %d plans for %d ranks",
                          plans.size(), world));
    }
    for (LoadPlan& p : plans) p.unexpected = unexpected;
    if (broadcast_replicas) groups = ReplicaGroups(plans);
  }
  const bool any_group = HasGroups(groups);
  std::vector<std::string> finals;
  finals.reserve(world);
  for (size_t r = 0; r < world; ++r) {
    internal_core::ByteWriter w;
    w.U8(kind);
    w.U8(any_group ? 1 : 0);
    w.I64(any_group ? groups[r] : static_cast<int64_t>(r));
    w.Str(kind == kPlanSummary ? unexpected_bits
                               : internal_plan::EncodeLoadPlan(plans[r]));
    finals.push_back(w.Take());
  }
  return finals;
}

absl::StatusOr<LoadResult> LoadWithMetadata(StateDict& state,
                                            absl::StatusOr<Storage*> storage,
                                            const Metadata& metadata,
                                            const LoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const Ranks ranks(options.comm);
  Communicator* comm = &ranks.comm();
  const int rank = ranks.rank();
  const int world = ranks.size();
  const bool coordinator = ranks.coordinator();
  DefaultLoadPlanner default_planner(options.strict);
  LoadPlanner& planner =
      options.planner != nullptr ? *options.planner : default_planner;

  // 2. Plan.
  absl::Status local = storage.status();
  LoadPlan local_plan;
  if (local.ok()) local = planner.SetUp(state, metadata, coordinator, rank, world);
  if (local.ok()) {
    absl::StatusOr<LoadPlan> p = planner.CreateLocalPlan();
    local = p.status();
    if (p.ok()) local_plan = *std::move(p);
  }
  std::string message;
  if (local.ok()) {
    absl::StatusOr<std::string> m =
        EncodeLocalLoadPlan(planner, local_plan, metadata);
    local = m.status();
    if (m.ok()) message = *std::move(m);
  }
  absl::StatusOr<std::vector<std::string>> gathered =
      GatherOrError(*comm, local, message, kOperation, "planning");
  message = std::string();
  absl::Status global = gathered.status();
  std::vector<std::string> finals;
  if (coordinator && global.ok()) {
    absl::StatusOr<std::vector<std::string>> planned = PlanLoadGlobally(
        planner, metadata, *gathered, options.broadcast_replicas);
    global = planned.status();
    if (planned.ok()) finals = *std::move(planned);
  }
  gathered = std::vector<std::string>();
  CAIRN_ASSIGN_OR_RETURN(std::string mine,
                         ScatterOutcome(*comm, global, std::move(finals)));
  internal_core::ByteReader header(mine, "load plan from the coordinator");
  const uint8_t kind = header.U8();
  const bool any_group = header.U8() != 0;
  const int64_t group = header.I64();
  const std::string body = header.Str();
  CAIRN_RETURN_IF_ERROR(header.status());
  if (kind != kFullPlan && kind != kPlanSummary) {
    return absl::DataLossError(absl::StrFormat(
        "load plan from the coordinator: unknown kind %d", kind));
  }
  // Every rank takes part in the Split when any group has several members.
  std::unique_ptr<Communicator> group_comm;
  if (any_group) {
    CAIRN_ASSIGN_OR_RETURN(group_comm,
                           comm->Split(static_cast<int>(group), rank));
    // Groups from summaries were found by hash: check them exactly.
    if (kind == kPlanSummary) {
      CAIRN_RETURN_IF_ERROR(KeepVerifiedGroup(*comm, local_plan, group_comm));
    }
  }
  const double planning_done = Since(start);

  // 3. Read.
  LoadPhaseTimes phases;
  std::vector<SharedPieces> shared;
  absl::StatusOr<LoadResult> result = [&]() -> absl::StatusOr<LoadResult> {
    absl::StatusOr<LoadPlan> plan;
    if (kind == kFullPlan) {
      plan = internal_plan::DecodeLoadPlan(body,
                                           "load plan from the coordinator");
    } else {
      absl::StatusOr<std::vector<std::string>> unexpected =
          LeafNames(metadata, body);
      if (unexpected.ok()) {
        local_plan.unexpected = *std::move(unexpected);
        plan = std::move(local_plan);
      } else {
        plan = unexpected.status();
      }
    }
    if (plan.ok()) plan = planner.FinishPlan(*std::move(plan));
    absl::StatusOr<LoadResult> r;
    if (group_comm != nullptr && group_comm->size() > 1) {
      r = StagedLoad(*group_comm, plan, planner, **storage, metadata, options,
                     options.broadcast_batch_bytes, phases, shared);
    } else {
      CAIRN_RETURN_IF_ERROR(plan.status());
      const auto read_start = std::chrono::steady_clock::now();
      std::vector<Destination> dsts;
      dsts.reserve(plan->items.size());
      bool to_device = false;
      for (const ReadItem& item : plan->items) {
        CAIRN_ASSIGN_OR_RETURN(Destination d, planner.ResolveDestination(item));
        to_device |=
            item.kind == ItemKind::kTensor && !d.view.device().is_cpu();
        dsts.push_back(std::move(d));
      }
      if (to_device) {
        // A group of one: no broadcast, only the staging.
        std::unique_ptr<Communicator> alone = LocalCommunicator();
        r = StagedLoad(*alone, plan, planner, **storage, metadata, options,
                       options.device_batch_bytes, phases, shared,
                       std::move(dsts));
      } else {
        Loader loader(**storage, metadata, options);
        r = loader.Run(plan->items, dsts, planner);
        shared = loader.TakeSharedPieces();
        phases.read = Since(read_start);
      }
      if (r.ok()) r->replica_group_size = 1;
    }
    if (r.ok() && plan.ok()) {
      r->missing = plan->missing;
      r->unexpected = plan->unexpected;
    }
    return r;
  }();

  // 4. Agree, and check the chunks that ranks read parts of: the
  // coordinator combines the CRC32Cs of their parts (one gather of a few
  // bytes per part, and the verdict to every rank).
  absl::Status read = result.status();
  std::string mine_pieces;
  if (read.ok()) {
    absl::StatusOr<std::string> encoded = EncodeSharedPieces(metadata, shared);
    read = encoded.status();
    if (encoded.ok()) mine_pieces = *std::move(encoded);
  }
  absl::StatusOr<std::vector<std::string>> pieces =
      GatherOrError(*comm, read, mine_pieces, kOperation, "reading");
  absl::Status verdict = pieces.status();
  uint64_t shared_checked = 0;
  // The chunks that ranks returned parts of and that the parts do not
  // tile (a slice of a chunk), which the coordinator could not check: the
  // verdict carries them to every rank (the tensor's index, chunk index).
  std::string unchecked_message;
  if (coordinator && verdict.ok()) {
    std::vector<std::pair<uint32_t, uint64_t>> unchecked;
    absl::StatusOr<uint64_t> checked =
        CheckSharedPieces(metadata, *pieces, &unchecked);
    verdict = Annotate(checked.status(),
                       absl::StrCat(kOperation, " failed in checking the "
                                                "chunks ranks read parts of"));
    if (checked.ok()) {
      shared_checked = *checked;
      internal_core::ByteWriter w;
      w.U64(unchecked.size());
      for (const auto& [t, c] : unchecked) {
        w.U32(t);
        w.U64(c);
      }
      unchecked_message = w.Take();
    }
  }
  pieces = std::vector<std::string>();
  CAIRN_ASSIGN_OR_RETURN(
      unchecked_message,
      BroadcastOutcome(*comm, verdict, std::move(unchecked_message)));
  std::vector<std::pair<uint32_t, uint64_t>> unchecked;
  {
    internal_core::ByteReader in(unchecked_message,
                                 "unchecked chunks from the coordinator");
    const uint64_t n = in.Count(12);
    for (uint64_t i = 0; i < n && !in.failed(); ++i) {
      const uint32_t t = in.U32();
      const uint64_t c = in.U64();
      unchecked.emplace_back(t, c);
    }
    CAIRN_RETURN_IF_ERROR(in.status());
  }
  // 5. Only when some chunk was returned in part and stayed unchecked:
  // every rank that read parts of such a chunk checks them itself (the
  // blocks around them, or, without block checksums, the whole chunk),
  // and the ranks agree, so that every rank returns the same verdict. A
  // load whose parts tile every chunk they touch skips this.
  if (!unchecked.empty()) {
    uint64_t extra = 0;
    absl::Status mine =
        VerifyUncheckedParts(**storage, metadata, shared, unchecked, &extra);
    CAIRN_RETURN_IF_ERROR(AgreeOnStatus(
        *comm, mine, kOperation,
        "checking the parts of chunks that were not read whole"));
    result->bytes_read += extra;
    result->chunks_verified += unchecked.size();
  }
  // Every byte returned passed a check unless checks are off.
  (options.verify_checksums ? result->bytes_verified
                            : result->bytes_unverified) = result->bytes_loaded;
  result->chunks_verified += shared_checked;
  result->world_size = world;
  result->phases = phases;
  result->phases.planning = planning_done;
  result->seconds = Since(start);
  return result;
}

absl::StatusOr<LoadResult> LoadFromStorage(StateDict& state,
                                           absl::StatusOr<Storage*> storage,
                                           const LoadOptions& options) {
  if (options.rank_local) return LoadRankLocal(state, storage, options);
  const auto start = std::chrono::steady_clock::now();
  const Ranks ranks(options.comm);
  LoadOptions opts = options;
  opts.comm = &ranks.comm();
  Communicator& comm = ranks.comm();
  // 1. Metadata: read once, by the coordinator, whose bytes every rank then
  // decodes at the same time (decoding first and sending the verdict would
  // make the others wait for a decode of their own after it: 4.6 s each
  // for a 943 MiB metadata.json of 16k ranks). The coordinator also checks
  // chunk coverage, and the ranks agree on the outcome. The text is moved
  // into the broadcast and out again, and read with room for the message
  // header in front, so the coordinator never holds a second copy.
  std::string text;
  absl::Status read = storage.status();
  if (comm.rank() == kCoordinator && read.ok()) {
    absl::StatusOr<std::string> bytes =
        ReadMetadataText(**storage, kMetadataFileName);
    read = bytes.status();
    if (bytes.ok()) text = *std::move(bytes);
  }
  CAIRN_ASSIGN_OR_RETURN(std::string shared,
                         BroadcastOutcome(comm, read, std::move(text)));
  absl::StatusOr<Metadata> metadata = DecodeAndValidate(
      shared,
      storage.ok() ? absl::StrCat((*storage)->url(), "/", kMetadataFileName)
                   : absl::StrCat(kMetadataFileName, " from the coordinator"),
      /*coverage=*/comm.rank() == kCoordinator);
  internal_core::ReleaseStorage(shared);
  absl::Status decoded = metadata.status();
  CAIRN_RETURN_IF_ERROR(
      AgreeOnStatus(comm, decoded, kOperation, "reading metadata"));
  const double metadata_seconds = Since(start);
  absl::StatusOr<LoadResult> result =
      LoadWithMetadata(state, storage, *metadata, opts);
  if (result.ok()) {
    result->phases.metadata = metadata_seconds;
    result->seconds += metadata_seconds;
  }
  return result;
}

absl::Status CheckLocationsAgainstFiles(Storage& storage,
                                        const Metadata& metadata) {
  std::map<std::string, uint64_t> file_sizes;
  auto note_file = [&](const ByteLocation& loc) -> absl::Status {
    if (file_sizes.contains(loc.file)) return absl::OkStatus();
    absl::StatusOr<std::unique_ptr<ReadableFile>> f =
        storage.OpenForRead(loc.file);
    // Absent from the map: ValidateAgainstFileSizes names it.
    if (absl::IsNotFound(f.status())) return absl::OkStatus();
    CAIRN_RETURN_IF_ERROR(f.status());
    file_sizes[loc.file] = (*f)->size();
    return absl::OkStatus();
  };
  for (const auto& [fqn, tensor] : metadata.tensors) {
    for (const ChunkMetadata& c : tensor.chunks) {
      CAIRN_RETURN_IF_ERROR(note_file(c.location));
    }
  }
  for (const auto& [fqn, loc] : metadata.objects) {
    CAIRN_RETURN_IF_ERROR(note_file(loc));
  }
  CAIRN_RETURN_IF_ERROR(
      internal_format::ValidateAgainstFileSizes(metadata, file_sizes));
  // Inside real files and sharing no bytes: the total a caller allocates
  // from these locations is at most the files' total size.
  return internal_format::ValidateDisjointLocations(metadata);
}

absl::StatusOr<StateDict> LoadAllFromStorage(Storage& storage,
                                             const LoadOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(Metadata metadata, ReadMetadataFromStorage(storage));
  // Before any tensor is allocated at its declared shape: chunks that cover
  // the shape, lie inside real files and share no bytes bound what a
  // hostile metadata.json can make this allocate by the files' total size.
  CAIRN_RETURN_IF_ERROR(Annotate(CheckLocationsAgainstFiles(storage, metadata),
                                 absl::StrCat("checkpoint ", storage.url())));
  // The structure names stored leaves only, each once (kDataLoss, as cairn
  // verify reports it; a name twice would otherwise be Unflatten's
  // kInvalidArgument).
  CAIRN_RETURN_IF_ERROR(
      Annotate(internal_format::ValidateStructure(metadata),
               absl::StrCat(storage.url(), "/", kMetadataFileName)));
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
  strict.comm = nullptr;
  strict.planner = nullptr;
  CAIRN_RETURN_IF_ERROR(
      LoadWithMetadata(state, &storage, metadata, strict).status());
  return state;
}

}  // namespace cairn::internal_checkpoint
