// Load, step 3 (see load.cc): the Loader's Read, which runs the steps
// below on the read tasks that load_slabs.cc cuts, and Run, which then
// commits:
//  b. open the data files and check their headers (CheckLocations);
//  d. run the reads on IO threads, small direct ones grouped
//     (GroupSmallReads), and check what they read: CRC32Cs of whole chunks,
//     of chunks read over several Reads (CheckAcrossReads), of contiguous
//     parts, and signatures of strided parts (SignRuns), the parts for
//     step 4 (TakeSharedPieces);
//  e. CommitChunk for every item (Run).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/box.h"
#include "cairn/checkpoint.h"
#include "cairn/dtype.h"
#include "cairn/metadata.h"
#include "cairn/planner.h"
#include "cairn/storage.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/load_internal.h"
#include "core/aligned_buffer.h"
#include "core/buffer_pool.h"
#include "core/checked.h"
#include "core/parallel.h"
#include "core/status.h"
#include "core/strided.h"
#include "format/crc32c.h"
#include "format/names.h"
#include "format/safetensors.h"
#include "storage/known_cached.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::Annotate;
using internal_core::BufferPool;
using internal_core::PooledBuffer;

// Opens `name` and checks its safetensors header.
absl::StatusOr<DataFile> OpenDataFile(Storage& storage,
                                      const std::string& name) {
  DataFile df;
  CAIRN_ASSIGN_OR_RETURN(df.file, storage.OpenForRead(name));
  CAIRN_ASSIGN_OR_RETURN(df.header,
                         internal_format::ReadSafetensorsHeader(*df.file, name));
  return df;
}

}  // namespace

absl::Status CrcMismatch(std::string_view what, const ByteLocation& loc,
                         std::string_view note, uint32_t computed) {
  return absl::DataLossError(absl::StrFormat(
      "crc32c mismatch in %s (%s, offset %d%s): stored %s, computed %s", what,
      loc.file, loc.offset, note, internal_format::Crc32cToHex(loc.crc32c),
      internal_format::Crc32cToHex(computed)));
}

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

absl::Status Loader::CheckEntries(std::span<const ReadItem> items) {
  needed_.clear();
  for (const ReadItem& item : items) {
    if (item.kind == ItemKind::kObject) {
      auto it = metadata_.objects.find(item.fqn);
      if (it == metadata_.objects.end()) continue;
      needed_.push_back({FileIndex(it->second.file), &it->second, item.fqn,
                         DType::kU8, nullptr});
      continue;
    }
    auto it = metadata_.tensors.find(item.fqn);
    if (it == metadata_.tensors.end()) continue;
    const TensorMetadata& tm = it->second;
    if (item.chunk >= tm.chunks.size()) continue;
    const ChunkMetadata& chunk = tm.chunks[item.chunk];
    needed_.push_back({FileIndex(chunk.location.file), &chunk.location,
                       internal_format::EntryName(
                           item.fqn, chunk.box, chunk.box == Box::Full(tm.shape)),
                       tm.dtype, &chunk.box.sizes});
  }
  absl::Status s = CheckLocations();
  needed_.clear();
  return s;
}

absl::Status Loader::Read(const std::vector<ReadItem>& items,
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

std::vector<SharedPieces> Loader::TakeSharedPieces() {
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

void Loader::CheckAcrossReads(std::span<const ReadItem> items) {
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
    // (Every frame of a compressed chunk is checked as it is read.)
    if (!Contains(chunk.box, item.overlap) || item.overlap == chunk.box ||
        chunk.location.compressed()) {
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

absl::Status Loader::FinishAcrossReads() const {
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

// Step 3: every needed byte range is an entry of its file's header, of
// the chunk's name, dtype and shape (an object's: U8 [nbytes]).
absl::Status Loader::CheckLocations() {
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
    // An object, or a compressed chunk: a U8 entry of its stored bytes.
    const uint64_t stored = loc.stored_nbytes();
    const int64_t object_shape = static_cast<int64_t>(stored);
    const internal_format::ExpectedEntry expected{
        n.what, n.dtype,
        n.shape != nullptr ? std::span<const int64_t>(*n.shape)
                           : std::span<const int64_t>(&object_shape, 1),
        loc.offset, stored};
    const std::string wrong =
        n.source
            ? internal_format::SourceEntryMismatch(files_[n.file].header,
                                                   expected)
            : internal_format::EntryMismatch(files_[n.file].header, expected);
    if (!wrong.empty()) {
      return absl::DataLossError(absl::StrFormat(
          "header mismatch for %s (%s, offset %d, %d bytes): %s; "
          "%s and the data file disagree",
          n.what, loc.file, loc.offset, stored, wrong,
          n.source ? "the file's header as first read" : "metadata.json"));
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
bool Loader::AllInMemory() const {
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

// LoadOptions::io_threads, or when everything is `in_memory` this rank's
// share of the cores (when fewer; SharedCpuThreads: the ranks the
// launcher says share the node split them): such reads are copies, and
// threads beyond the cores only take turns (on a 2-core VM, 4 in-process
// ranks of 8 threads each loaded a cached 256 MiB checkpoint's same-split
// rows 10-20% slower than of 2 each).
int Loader::ReadThreads(bool in_memory) const {
  const int threads = std::max(1, options_.io_threads);
  return in_memory ? internal_core::SharedCpuThreads(threads) : threads;
}

// Runs one read task; sets *crc to the CRC32C of the bytes read when the
// task is a piece of a checked chunk.
absl::Status Loader::RunTask(const ReadTask& t, BufferPool& pool,
                             uint32_t* crc, bool in_memory) {
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
    case ReadTask::Mode::kFrames:
      return RunFramesTask(t);
    case ReadTask::Mode::kSpan:
    case ReadTask::Mode::kRuns:
      break;
  }
  // A span the storage holds in memory already (page-cached) is copied
  // from in place: only the bytes the copies need are touched, where a
  // read into the bounce buffer would copy the whole span first.
  // (When every file's span was found in memory just before, the file is
  // not asked again: known_cached.h.)
  std::unique_ptr<ReadableFile::View> view;
  if (t.mode == ReadTask::Mode::kSpan) {
    view = internal_storage::ViewOf(file, t.file_offset, t.span, in_memory);
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
std::vector<Loader::Group>
Loader::GroupSmallReads(const std::vector<size_t>& order, uint64_t buffer_bytes,
                        bool group) const {
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
absl::Status Loader::RunGroup(const Group& g, const std::vector<size_t>& order,
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
uint32_t Loader::Checksum(const ReadTask& t, const std::byte* src) {
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
uint32_t Loader::SignRuns(const ReadTask& t, const std::byte* src,
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
void Loader::CopyOut(const ReadTask& t, const std::byte* src) {
  for (const ReadTask::Copy& c : t.copies) {
    internal_core::CopyStrided(src + c.src_offset, t.src_strides.data(),
                               c.dst, c.dst_strides.data(), c.shape.data(),
                               static_cast<int>(c.shape.size()), t.elem_size);
  }
}

absl::Status Loader::Execute() {
  // Reads in file order, so the disk sees mostly sequential requests.
  std::vector<size_t> order(tasks_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::pair(tasks_[a].file, tasks_[a].file_offset) <
           std::pair(tasks_[b].file, tasks_[b].file_offset);
  });
  const bool in_memory = !tasks_.empty() && AllInMemory();
  // Ranks reading the same cold files start apart (StaggerFor).
  if (!in_memory && stagger_world_ > 1 && !order.empty()) {
    const size_t first = order.size() * static_cast<size_t>(stagger_rank_) /
                         static_cast<size_t>(stagger_world_);
    std::rotate(order.begin(), order.begin() + first, order.end());
  }
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
          return RunTask(tasks_[t], pool, &crcs[t], in_memory);
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
  // Compressed chunks: every frame read was checked as it was read.
  for (const ReadTask& t : tasks_) {
    if (t.mode == ReadTask::Mode::kFrames && options_.verify_checksums &&
        verified_.insert(t.frames_of).second) {
      ++result_.chunks_verified;
    }
  }
  for (size_t c = 0; c < checks_.size(); ++c) {
    if (checks_[c].kind != Check::Kind::kWhole) continue;
    std::vector<CrcPiece> p;
    for (size_t i : pieces[c]) {
      p.push_back({tasks_[i].check_offset, tasks_[i].span, crcs[i]});
    }
    CAIRN_RETURN_IF_ERROR(
        CheckPieces(checks_[c].what, *checks_[c].location, std::move(p), ""));
    verified_.insert(checks_[c].location);
    ++result_.chunks_verified;
  }
  return absl::OkStatus();
}

// Compares the CRC32C of a chunk read in pieces over several Reads with
// its stored one, once the pieces so far cover it.
absl::Status Loader::CheckCarried(const ByteLocation* loc) {
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
  verified_.insert(loc);
  ++result_.chunks_verified;
  return absl::OkStatus();
}

}  // namespace cairn::internal_checkpoint
