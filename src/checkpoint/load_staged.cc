// Load, step 3 through host staging (see load.cc): StagedLoad, which reads
// a plan in batches, for a replica group (each item read by one member,
// then broadcast) and for device destinations (read into pinned host
// staging, checked, then copied to the device while the next batch is
// read).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/box.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/dtype.h"
#include "cairn/metadata.h"
#include "cairn/planner.h"
#include "cairn/storage.h"
#include "cairn/tensor.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/load_internal.h"
#include "comm/collective.h"
#include "core/checked.h"
#include "core/status.h"
#include "core/strided.h"
#include "cuda/device_runtime.h"
#include "format/crc32c.h"
#include "format/names.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_comm::AgreeOnStatus;
using internal_core::Annotate;

constexpr uint64_t kSlot = 64;  // staging offsets aligned for copies
constexpr uint64_t kPage = 4096;
constexpr uint64_t kAlignFrom = uint64_t{64} << 10;

// True when `item`'s reader checks every byte it reads of it: a whole
// stored chunk, or any part of a compressed one (frame by frame).
bool CheckedByReader(const Metadata& metadata, const ReadItem& item) {
  auto it = metadata.tensors.find(item.fqn);
  if (it == metadata.tensors.end() || item.chunk >= it->second.chunks.size()) {
    return false;
  }
  const ChunkMetadata& chunk = it->second.chunks[item.chunk];
  return chunk.box == item.overlap || chunk.location.compressed();
}

// Hands an item whose pieces are all placed to the committer, as checked
// when a check covering all its bytes passed: a sink's pieces were checked
// before their Write; in a group, objects and whole chunks were checked
// whole by their owners (and the group agreed). Alone, the reader knows
// (CommitChecked asks it).
void AddPlaced(Committer& committer, const ReadItem& item,
               const std::shared_ptr<LoadSink>& sink, bool alone,
               const Metadata& metadata) {
  const bool checked =
      sink != nullptr ||
      (!alone &&
       (item.kind == ItemKind::kObject || CheckedByReader(metadata, item)));
  committer.Add(item, sink, checked);
}

// One piece of a plan item as a wave handles it: the item itself, or a
// slab of it (alone, a staged item larger than a wave).
struct Piece {
  size_t origin = 0;    // the item's index in the plan
  ReadItem item;        // the piece (its overlap a slab of the item's)
  Destination dst;      // its destination (a view sliced to the slab)
  uint64_t bytes = 0;   // stored bytes
  bool staged = false;  // read (or received) into staging, then placed
  uint64_t offset = 0;  // staged: where it lies in the wave's staging
};

// Whether a tensor piece goes through staging (objects never do: alone
// they are read into their strings, in a group received as strings).
bool Staged(const Destination& dst, bool alone, ItemKind kind) {
  if (kind == ItemKind::kObject) return false;
  if (dst.sink != nullptr) return true;
  const TensorView& v = dst.view;
  if (!v.device().is_cpu()) return true;
  // Alone, the reader fills any host view itself (strided ones through its
  // bounce buffers); a group member receives into contiguous memory only.
  return !alone && !v.is_contiguous();
}

// The stored bytes `item` reads (0 for one the metadata lacks: the reader
// reports it).
uint64_t ItemBytes(const Metadata& metadata, const ReadItem& item) {
  if (item.kind == ItemKind::kObject) {
    auto it = metadata.objects.find(item.fqn);
    return it == metadata.objects.end() ? 0 : it->second.nbytes;
  }
  auto it = metadata.tensors.find(item.fqn);
  if (it == metadata.tensors.end()) return 0;
  return static_cast<uint64_t>(item.overlap.num_elements()) *
         DTypeSize(it->second.dtype);
}

// Appends `item`'s pieces to `out`: the item itself, or, when it is staged
// and larger than `limit` bytes (alone only), pieces of at most `limit`
// bytes (or one element, if larger): ForEachSlab over the item packed as it
// is staged. The pieces of an item that is a whole chunk are contiguous
// too and follow each other in its file, so Loader::CheckAcrossReads
// checks the chunk as its last piece lands.
absl::Status AddPieces(const Metadata& metadata, uint64_t limit, bool alone,
                       size_t origin, const ReadItem& item, Destination dst,
                       std::vector<Piece>& out, Loader& reader) {
  Piece whole{origin, item, std::move(dst), ItemBytes(metadata, item), false,
              0};
  whole.staged = Staged(whole.dst, alone, item.kind);
  if (item.kind == ItemKind::kObject || !alone || !whole.staged ||
      whole.bytes <= limit) {
    out.push_back(std::move(whole));
    return absl::OkStatus();
  }
  const uint64_t es = DTypeSize(metadata.tensors.at(item.fqn).dtype);
  std::vector<ReadItem> slabs;
  CAIRN_RETURN_IF_ERROR(ForEachSlab(
      item.overlap, RowMajorByteStrides(item.overlap.sizes, es), es, limit,
      [&](const Box& slab) -> absl::Status {
        Piece piece{origin, item, Destination{}, 0, true, 0};
        piece.item.overlap = slab;
        piece.bytes = static_cast<uint64_t>(slab.num_elements()) * es;
        if (whole.dst.sink != nullptr) {
          piece.dst.sink = whole.dst.sink;
        } else {
          Box local = slab;  // in the destination view's coordinates
          for (int d = 0; d < slab.rank(); ++d) {
            local.offsets[d] -= item.overlap.offsets[d];
          }
          CAIRN_ASSIGN_OR_RETURN(piece.dst.view, whole.dst.view.Slice(local));
        }
        slabs.push_back(piece.item);
        out.push_back(std::move(piece));
        return absl::OkStatus();
      }));
  reader.CheckAcrossReads(slabs);
  return absl::OkStatus();
}

// Host staging: two buffers used by alternate waves (alone, one until a
// device destination shows up, then two pinned ones), so that one wave's
// device copies, or a group's broadcast of it, run while the next is
// read. Each grows to the largest wave that uses it.
class Staging {
 public:
  // Buffer `k` with room for `used` bytes, pinned when `devices` is not
  // empty. A buffer (re)allocated gets room for max(used, room) bytes;
  // pinned ones come in pairs, both pinned before the first wave that needs
  // one, so that a failure to pin comes before any copy, unless
  // `other_busy`: a replica group's next wave is read into buffer k while
  // the wave before is still broadcast from the other, which then stays as
  // it is (and is pinned when its own turn comes).
  absl::StatusOr<std::byte*> Get(int k, uint64_t used, uint64_t room,
                                 DeviceRuntimes& devices, bool other_busy) {
    const bool pin = !devices.empty();
    Buffer& b = buffers_[k];
    if (b.data != nullptr && b.capacity >= used && b.pinned == pin) {
      return b.data;
    }
    // Copies may still read the old buffers.
    CAIRN_RETURN_IF_ERROR(devices.SynchronizeAll());
    const uint64_t n = std::max({used, room, uint64_t{64}});
    for (int j : {k, 1 - k}) {
      Buffer& x = buffers_[j];
      if (j != k &&
          (other_busy || !pin || (x.pinned && x.capacity >= n))) {
        continue;
      }
      x = Buffer();
      if (pin) {
        absl::StatusOr<std::shared_ptr<void>> p =
            devices.first()->AllocatePinned(n);
        if (!p.ok()) {
          return internal_core::Annotate(
              p.status(), absl::StrFormat("pinned staging of %d bytes", n));
        }
        x.pinned_memory = *std::move(p);
        x.data = static_cast<std::byte*>(x.pinned_memory.get());
      } else {
        CAIRN_ASSIGN_OR_RETURN(
            x.pageable, Tensor::Empty(DType::kU8, {static_cast<int64_t>(n)}));
        x.data = static_cast<std::byte*>(x.pageable.data());
      }
      x.capacity = n;
      x.pinned = pin;
    }
    return b.data;
  }
  void Free() {
    for (Buffer& b : buffers_) b = Buffer();
  }

 private:
  struct Buffer {
    std::shared_ptr<void> pinned_memory;
    Tensor pageable;
    std::byte* data = nullptr;
    uint64_t capacity = 0;
    bool pinned = false;
  };
  Buffer buffers_[2];
};

// The check of a staged piece that is not a whole chunk read whole, for
// sinks, which must never see an unchecked byte. A piece that is one
// contiguous range of a chunk with block checksums (format version 3) is
// checked from its staged bytes where it covers whole blocks; only the
// blocks its two ends cut into are read again. Any other piece: the
// checksum blocks around it (or its whole chunk) are read again and
// checked, and the piece's bytes must be the bytes read again
// (VerifyChunkParts, as for a slice). `files` keeps the files opened for
// these checks from piece to piece.
absl::Status CheckStagedPart(Storage& storage, const Metadata& metadata,
                             const ReadItem& item, const std::byte* bytes,
                             OpenFiles& files, uint64_t* bytes_read) {
  auto it = metadata.tensors.find(item.fqn);
  if (it == metadata.tensors.end() || item.chunk >= it->second.chunks.size()) {
    return absl::InternalError(absl::StrCat("no chunk ", item.chunk, " of ",
                                            item.fqn));
  }
  const TensorMetadata& tm = it->second;
  const ChunkMetadata& chunk = tm.chunks[item.chunk];
  const size_t es = DTypeSize(tm.dtype);
  const internal_core::RunPattern runs =
      internal_core::SubBoxRuns(chunk.box, item.overlap, es);
  const ByteLocation& loc = chunk.location;
  const uint64_t block = metadata.crc32c_block_bytes;
  SharedPieces part;
  part.fqn = item.fqn;
  part.chunk = item.chunk;
  if (runs.num_runs() == 1 && !loc.block_crc32c.empty() && block > 0) {
    const uint64_t begin = static_cast<uint64_t>(runs.first_offset);
    const uint64_t end = begin + static_cast<uint64_t>(runs.run_bytes);
    // Whole blocks: from the first block boundary at or after `begin` to
    // the last one at or before `end` (the chunk's end closes its last,
    // shorter block), checked here.
    const uint64_t first = internal_core::RoundUp(begin, block);
    const uint64_t last = end == loc.nbytes ? end : end / block * block;
    for (uint64_t at = first; at < last;) {
      const uint64_t k = at / block;
      const uint64_t n = std::min(block, loc.nbytes - at);
      if (k >= loc.block_crc32c.size() || at + n > last) break;
      const uint32_t crc = internal_format::Crc32c(bytes + (at - begin), n);
      if (crc != loc.block_crc32c[k]) {
        return absl::DataLossError(absl::StrFormat(
            "crc32c mismatch in %s (%s, offset %d), block %d (bytes [%d, %d) "
            "of it), checked as the piece holding it arrived: stored %s, "
            "computed %s",
            internal_format::EntryName(item.fqn, chunk.box,
                                       chunk.box == Box::Full(tm.shape)),
            loc.file, loc.offset, k, at, at + n,
            internal_format::Crc32cToHex(loc.block_crc32c[k]),
            internal_format::Crc32cToHex(crc)));
      }
      at += n;
    }
    // The ends not in whole blocks (or all of the piece) are read again.
    auto piece = [&](uint64_t lo, uint64_t hi) {
      part.pieces.push_back(
          {lo, hi - lo, internal_format::Crc32c(bytes + (lo - begin), hi - lo)});
    };
    if (first >= last) {
      piece(begin, end);
    } else {
      if (begin < first) piece(begin, first);
      if (last < end) piece(last, end);
    }
    if (part.pieces.empty()) return absl::OkStatus();
  } else {
    // Each run (a row of the part) as a contiguous piece, its CRC32C from
    // the staged bytes, which hold the runs one after another.
    int64_t at = 0;
    internal_core::ForEachRun(runs, [&](int64_t offset) {
      const uint32_t crc = internal_format::Crc32c(
          bytes + at, static_cast<size_t>(runs.run_bytes));
      if (!part.pieces.empty() &&
          part.pieces.back().offset + part.pieces.back().bytes ==
              static_cast<uint64_t>(offset)) {
        CrcPiece& prev = part.pieces.back();
        prev.crc = internal_format::Crc32cCombine(prev.crc, crc, runs.run_bytes);
        prev.bytes += runs.run_bytes;
      } else {
        part.pieces.push_back({static_cast<uint64_t>(offset),
                               static_cast<uint64_t>(runs.run_bytes), crc});
      }
      at += runs.run_bytes;
    });
  }
  return VerifyChunkParts(storage, item.fqn, tm, chunk, block, part, files,
                          bytes_read);
}

}  // namespace

uint64_t StagingSlot(uint64_t used, uint64_t bytes, uint64_t file_offset) {
  used = internal_core::RoundUp(used, kSlot);
  if (bytes >= kAlignFrom) {
    used += (file_offset % kPage + kPage - used % kPage) % kPage;
  }
  return used;
}

uint64_t StagingLimit(const LoadOptions& options, uint64_t batch_bytes) {
  constexpr uint64_t kMin = 64;
  uint64_t limit = batch_bytes;
  if (options.memory_budget_bytes != 0) {
    // The reads' bounce buffers come first; the rest is two buffers' worth.
    const uint64_t reads = static_cast<uint64_t>(std::max(options.io_threads, 1)) *
                           options.bounce_buffer_bytes;
    const uint64_t left = options.memory_budget_bytes > reads
                              ? options.memory_budget_bytes - reads
                              : 0;
    limit = std::min(limit, left / 2);
  }
  return std::max(limit, kMin);
}

absl::StatusOr<LoadResult> StagedLoad(Communicator& group,
                                      const absl::StatusOr<LoadPlan>& plan,
                                      LoadPlanner& planner, Loader& reader,
                                      Storage& storage,
                                      const Metadata& metadata,
                                      const LoadOptions& options,
                                      uint64_t batch_bytes,
                                      LoadPhaseTimes& phases,
                                      std::vector<SharedPieces>& shared,
                                      Committer& committer) {
  const int members = group.size();
  const int me = group.rank();
  const bool alone = members == 1;
  // A group of one has nobody to agree with: its own status is the verdict
  // (LoadWithMetadata's final agreement names the rank).
  auto agree = [&group, alone](const absl::Status& local) {
    return alone ? local
                 : AgreeOnStatus(group, local, kOperation,
                                 "reading (replica group)");
  };
  CAIRN_RETURN_IF_ERROR(agree(plan.status()));
  const std::vector<ReadItem>& items = plan->items;
  const uint64_t limit = StagingLimit(options, batch_bytes);
  DeviceRuntimes devices;
  Staging staging;
  // Data files a sink's pieces are checked against (CheckStagedPart),
  // opened once.
  OpenFiles check_files;
  // Declared after the staging it reads from, so on every way out the
  // device copies have finished before the staging is freed.
  struct SyncOnExit {
    DeviceRuntimes& devices;
    ~SyncOnExit() { devices.SynchronizeAll().IgnoreError(); }
  } sync_on_exit{devices};

  // A group: items in the same waves on every member (the boundaries
  // depend only on item sizes), each read by one member (largest items
  // first, each to the member with the fewest bytes so far, as dedup
  // balances writers; every member computes the same from the same sizes).
  std::vector<int> owner(items.size(), 0);
  std::vector<size_t> bounds;  // waves [bounds[w], bounds[w + 1])
  std::vector<uint64_t> bytes(items.size(), 0);
  uint64_t unplaced_bytes = 0;  // of the items not placed yet
  for (size_t i = 0; i < items.size(); ++i) {
    bytes[i] = ItemBytes(metadata, items[i]);
    unplaced_bytes += bytes[i];
  }
  if (alone) {
    // Items of this rank that tile a chunk in contiguous pieces (and any
    // item split into pieces, declared as it is split) are checked as the
    // chunk's last piece lands, whichever waves they fall in.
    reader.CheckAcrossReads(items);
  } else {
    std::vector<size_t> by_size(items.size());
    for (size_t i = 0; i < by_size.size(); ++i) by_size[i] = i;
    std::stable_sort(by_size.begin(), by_size.end(),
                     [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
    std::vector<uint64_t> assigned(members, 0);
    for (size_t i : by_size) {
      owner[i] = static_cast<int>(
          std::min_element(assigned.begin(), assigned.end()) -
          assigned.begin());
      assigned[owner[i]] += bytes[i];
    }
    bounds.push_back(0);
    uint64_t wave = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      const uint64_t slot = internal_core::RoundUp(bytes[i], kSlot);
      if (i > bounds.back() && wave + slot > limit) {
        bounds.push_back(i);
        wave = 0;
      }
      wave += slot;
    }
    bounds.push_back(items.size());
    // A chunk this member reads in pieces over several waves is checked
    // by the reader as its last piece lands.
    std::vector<ReadItem> mine;
    for (size_t i = 0; i < items.size(); ++i) {
      if (owner[i] == me) mine.push_back(items[i]);
    }
    reader.CheckAcrossReads(mine);
  }

  // Alone, an item its reader checked (its chunk read whole, in one wave
  // or across waves) commits; in a group, AddPlaced decides.
  auto checked_by_reader = [&](const ReadItem& item) {
    return alone && reader.Verified(LocationOf(metadata, item));
  };
  LoadResult result;
  result.replica_group_size = members;
  // Pieces of each item not yet placed; items whose device copies are
  // queued, committed once those are waited for.
  std::vector<uint32_t> unplaced(items.size(), 0);
  std::vector<size_t> after_sync;
  // A placement error (a device copy, a sink) is kept, later placements
  // skipped, and agreed on with the next wave's reads, so every member
  // stays in the collectives.
  absl::Status placed;
  // Alone: resolved pieces that did not fit the last wave (from `taken`).
  std::vector<Piece> carry;
  size_t taken = 0;
  size_t next = 0;  // the next item to resolve
  // A wave from its destinations to its placement: resolved, staged and
  // read by `prepare`, then (after the reads are agreed on) broadcast,
  // placed and committed by the loop below.
  struct Wave {
    int number = 0;
    std::vector<Piece> pieces;
    std::vector<std::string> objects;  // a group's objects, as received
    std::byte* base = nullptr;         // its staging
    std::vector<ReadItem> mine;        // what this member reads
    std::vector<Destination> mine_dsts;
    absl::Status read;                       // alone: the reads' outcome
    std::future<absl::Status> reading;       // a group: the reads running
  };
  // Waits for the queued device copies; then the items they complete can
  // commit. Always waits (an earlier failure keeps its error).
  auto sync_devices = [&]() {
    if (devices.empty()) return;
    absl::Status s = devices.SynchronizeAll();
    if (!placed.ok()) return;
    placed = s;
    if (!placed.ok()) return;
    for (size_t i : after_sync) {
      AddPlaced(committer, items[i], nullptr, alone, metadata);
    }
    after_sync.clear();
  };
  // Steps 1-3 for wave `wave`: `out` stays null when there is none. Alone
  // the reads run here; in a group they are started on their own thread.
  auto prepare = [&](int wave, std::unique_ptr<Wave>& out) -> absl::Status {
    auto w = std::make_unique<Wave>();
    w->number = wave;
    // 1. The wave's pieces, their destinations resolved now.
    auto t0 = std::chrono::steady_clock::now();
    std::vector<Piece>& pieces = w->pieces;
    absl::Status ready;
    auto resolve = [&](size_t i, std::vector<Piece>& out) -> absl::Status {
      CAIRN_ASSIGN_OR_RETURN(Destination d,
                             planner.ResolveDestination(items[i]));
      // Host memory a rank reads itself is checked by its read; the rest
      // here (a group member places what others read; sinks and devices
      // are read into staging).
      if (!alone || d.sink != nullptr || d.object != nullptr ||
          !d.view.device().is_cpu()) {
        CAIRN_ASSIGN_OR_RETURN(d, reader.CheckDestination(items[i], d));
      }
      if (items[i].kind == ItemKind::kTensor && d.sink == nullptr &&
          !d.view.device().is_cpu()) {
        const bool known = devices.Has(d.view.device());
        absl::StatusOr<internal_cuda::DeviceRuntime*> runtime =
            devices.For(d.view.device());
        CAIRN_RETURN_IF_ERROR(internal_core::Annotate(
            runtime.status(),
            absl::StrCat(items[i].fqn, " ", items[i].overlap.ToString())));
        // The application's queued work that may still read the
        // destination is done before the first copy into the device.
        if (!known) {
          CAIRN_RETURN_IF_ERROR((*runtime)->WaitForDevice(d.view.device()));
        }
      }
      const size_t before = out.size();
      CAIRN_RETURN_IF_ERROR(AddPieces(metadata, limit, alone, i, items[i],
                                      std::move(d), out, reader));
      unplaced[i] = static_cast<uint32_t>(out.size() - before);
      return absl::OkStatus();
    };
    if (alone) {
      uint64_t used = 0;
      while (ready.ok()) {
        if (taken == carry.size()) {
          carry.clear();
          taken = 0;
          if (next == items.size()) break;
          ready = resolve(next++, carry);
          continue;
        }
        Piece& p = carry[taken];
        const uint64_t slot = p.staged ? internal_core::RoundUp(p.bytes, kSlot) : 0;
        if (!pieces.empty() && used + slot > limit) break;
        used += slot;
        pieces.push_back(std::move(p));
        ++taken;
      }
    } else {
      if (wave + 1 >= static_cast<int>(bounds.size())) return absl::OkStatus();
      for (size_t i = bounds[wave]; i < bounds[wave + 1] && ready.ok(); ++i) {
        ready = resolve(i, pieces);
      }
    }
    phases.read += Since(t0);

    // 2. Staging: each staged piece's slot (StagingSlot).
    uint64_t used = 0;
    for (Piece& p : pieces) {
      if (!ready.ok()) break;
      if (!p.staged) continue;
      const TensorMetadata& tm = metadata.tensors.at(p.item.fqn);
      const ChunkMetadata& chunk = tm.chunks[p.item.chunk];
      used = p.offset = StagingSlot(
          used, p.bytes,
          chunk.location.offset +
              internal_core::SubBoxRuns(chunk.box, p.item.overlap,
                                        DTypeSize(tm.dtype))
                  .first_offset);
      used += p.bytes;
    }
    // A group alternates always (the next wave is read while this one is
    // broadcast); alone, once devices are written.
    const int k = devices.empty() && alone ? 0 : wave % 2;
    std::byte*& base = w->base;
    absl::Status allocated;
    if (!alone) {
      // The copies out of buffer k (two waves back) are done before it is
      // read into again.
      sync_devices();
    }
    if (ready.ok() && used > 0) {
      t0 = std::chrono::steady_clock::now();
      // Room for a whole wave, unless what is left to load is less.
      absl::StatusOr<std::byte*> got =
          staging.Get(k, used, std::min(limit, unplaced_bytes), devices,
                      /*other_busy=*/!alone && wave > 0);
      phases.staging += Since(t0);
      allocated = got.status();
      if (got.ok()) base = *got;
    }
    // Every member agrees on its destinations and its staging at once,
    // staged bytes or not (members differ in which destinations need
    // staging): one agreement before the reads.
    CAIRN_RETURN_IF_ERROR(agree(ready.ok() ? allocated : ready));
    if (pieces.empty()) return absl::OkStatus();

    // 3. Read what this member owns.
    std::vector<std::string>& objects = w->objects;
    objects.resize(pieces.size());
    std::vector<ReadItem>& mine = w->mine;
    std::vector<Destination>& mine_dsts = w->mine_dsts;
    for (size_t j = 0; j < pieces.size(); ++j) {
      const Piece& p = pieces[j];
      if (owner[p.origin] != me) continue;
      mine.push_back(p.item);
      Destination d;
      if (p.item.kind == ItemKind::kObject) {
        d.object = alone ? p.dst.object : &objects[j];
      } else if (p.staged) {
        const TensorMetadata& tm = metadata.tensors.at(p.item.fqn);
        d.view = TensorView(base + p.offset, tm.dtype, p.item.overlap.sizes);
      } else {
        d.view = p.dst.view;
      }
      mine_dsts.push_back(std::move(d));
    }
    if (!mine.empty()) {
      Wave* self = w.get();
      if (alone) {
        t0 = std::chrono::steady_clock::now();
        self->read = reader.Read(mine, mine_dsts);
        phases.read += Since(t0);
      } else {
        // On a thread of its own, while the caller broadcasts and places
        // the wave before (the group's collectives stay on this thread).
        self->reading = std::async(std::launch::async, [&reader, self] {
          return reader.Read(self->mine, self->mine_dsts);
        });
      }
    }
    out = std::move(w);
    return absl::OkStatus();
  };

  std::unique_ptr<Wave> cur;
  CAIRN_RETURN_IF_ERROR(prepare(0, cur));
  while (cur != nullptr) {
    std::vector<Piece>& pieces = cur->pieces;
    std::vector<std::string>& objects = cur->objects;
    std::byte* const base = cur->base;
    auto buffer = [&](const Piece& p) {
      return p.staged ? base + p.offset
                      : static_cast<std::byte*>(p.dst.view.data());
    };
    // 3, the end: the reads' outcome, agreed on (with the last wave's
    // placements) before anything is broadcast.
    auto t0 = std::chrono::steady_clock::now();
    absl::Status read = cur->reading.valid() ? cur->reading.get() : cur->read;
    if (!cur->mine.empty()) reader.TakeReadsInto(result);
    phases.read += Since(t0);
    CAIRN_RETURN_IF_ERROR(agree(read.ok() ? placed : read));
    // A group starts the next wave's reads now, to run while this one is
    // broadcast and placed.
    std::unique_ptr<Wave> following;
    if (!alone) CAIRN_RETURN_IF_ERROR(prepare(cur->number + 1, following));

    // 4. Share (a group): each owner broadcasts what it read.
    if (!alone) {
      t0 = std::chrono::steady_clock::now();
      for (size_t j = 0; j < pieces.size(); ++j) {
        const Piece& p = pieces[j];
        absl::Status s =
            p.item.kind == ItemKind::kObject
                ? group.Broadcast(objects[j], owner[p.origin])
                : group.BroadcastBytes(std::span<std::byte>(buffer(p), p.bytes),
                                       owner[p.origin]);
        CAIRN_RETURN_IF_ERROR(
            Annotate(s, "communicator failed in broadcast load"));
      }
      phases.broadcast += Since(t0);
    }

    // 5. Place what went through staging: host copies, device copies
    // (queued; the previous wave's, which ran during this wave's reads, are
    // waited for first: the buffer they read from is the next wave's), and
    // sinks, which get only checked bytes.
    t0 = std::chrono::steady_clock::now();
    if (alone) sync_devices();
    // Items whose last piece is placed, with their sinks.
    std::vector<std::pair<size_t, std::shared_ptr<LoadSink>>> done;
    for (size_t j = 0; j < pieces.size(); ++j) {
      Piece& p = pieces[j];
      result.bytes_loaded += p.bytes;
      unplaced_bytes -= std::min(unplaced_bytes, p.bytes);
      if (p.item.kind == ItemKind::kObject) {
        if (!alone) *p.dst.object = std::move(objects[j]);
      } else if (p.dst.sink != nullptr) {
        if (!placed.ok()) continue;
        const bool checked =
            !options.verify_checksums ||
            (alone ? reader.Verified(LocationOf(metadata, p.item))
                   : CheckedByReader(metadata, p.item));
        if (!checked) {
          uint64_t extra = 0;
          placed = CheckStagedPart(storage, metadata, p.item, base + p.offset,
                                   check_files, &extra);
          result.bytes_read += extra;
          if (!placed.ok()) continue;
        }
        placed = items[p.origin].kind == ItemKind::kTensor
                     ? p.dst.sink->Write(items[p.origin], p.item.overlap,
                                         std::span<const std::byte>(
                                             base + p.offset, p.bytes))
                     : absl::OkStatus();
        if (!placed.ok()) {
          placed = Annotate(placed, absl::StrCat("sink of ", p.item.fqn, " ",
                                                 p.item.overlap.ToString()));
          continue;
        }
      } else if (p.staged) {
        const TensorView& dst = p.dst.view;
        if (dst.device().is_cpu()) {
          internal_core::CopyView(
              TensorView(base + p.offset, dst.dtype(), dst.shape()), dst);
        } else if (placed.ok()) {
          absl::StatusOr<internal_cuda::DeviceRuntime*> runtime =
              devices.For(dst.device());
          placed = runtime.status();
          if (placed.ok()) {
            placed = internal_cuda::QueueCopyToDeviceView(
                **runtime,
                absl::StrCat(p.item.fqn, " ", p.item.overlap.ToString()),
                base + p.offset, dst);
          }
          if (placed.ok()) result.device_bytes += p.bytes;
          if (placed.ok() && --unplaced[p.origin] == 0) {
            after_sync.push_back(p.origin);
          }
          continue;
        }
      }
      if (--unplaced[p.origin] == 0) done.emplace_back(p.origin, p.dst.sink);
    }
    // 6. Commit the items this wave completed whose checks passed.
    if (placed.ok()) {
      for (const auto& [i, sink] : done) {
        AddPlaced(committer, items[i], sink, alone, metadata);
      }
      placed = committer.CommitChecked(checked_by_reader);
    }
    phases.copy += Since(t0);
    if (alone) CAIRN_RETURN_IF_ERROR(prepare(cur->number + 1, following));
    cur = std::move(following);
  }
  auto t0 = std::chrono::steady_clock::now();
  sync_devices();
  if (placed.ok()) placed = committer.CommitChecked(checked_by_reader);
  if (placed.ok()) placed = reader.FinishAcrossReads();
  shared = reader.TakeSharedPieces();
  phases.copy += Since(t0);
  CAIRN_RETURN_IF_ERROR(agree(placed));
  // Every copy out of the staging has finished.
  t0 = std::chrono::steady_clock::now();
  staging.Free();
  phases.staging += Since(t0);
  return result;
}

}  // namespace cairn::internal_checkpoint
