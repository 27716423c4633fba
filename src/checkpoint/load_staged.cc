// Load, step 3 through host staging (see load.cc): StagedLoad, which reads
// a plan in batches, for a replica group (each item read by one member,
// then broadcast) and for device destinations (read into pinned host
// staging, checked, then copied to the device while the next batch is
// read).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
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

namespace cairn::internal_checkpoint {
namespace {

using internal_comm::AgreeOnStatus;
using internal_core::Annotate;

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
          out_dsts.push_back(Destination{view, nullptr, nullptr});
          return absl::OkStatus();
        }));
  }
  items = std::move(out_items);
  dsts = std::move(out_dsts);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LoadResult> StagedLoad(Communicator& group,
                                      const absl::StatusOr<LoadPlan>& plan,
                                      LoadPlanner& planner, Storage& storage,
                                      const Metadata& metadata,
                                      const LoadOptions& options,
                                      uint64_t batch_bytes,
                                      LoadPhaseTimes& phases,
                                      std::vector<SharedPieces>& shared,
                                      Committer& committer,
                                      std::vector<Destination> resolved) {
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
  // Commit what passed its checks. In a group, a member other than an
  // item's owner read nothing of it: an item that is a whole chunk (or an
  // object) was checked whole by its owner, and the group agreed on that.
  const bool alone = members == 1;
  for (size_t i = 0; i < plan->items.size(); ++i) {
    const ReadItem& item = plan->items[i];
    bool whole = item.kind == ItemKind::kObject;
    if (!whole && !alone) {
      auto it = metadata.tensors.find(item.fqn);
      whole = it != metadata.tensors.end() &&
              item.chunk < it->second.chunks.size() &&
              it->second.chunks[item.chunk].box == item.overlap;
    }
    committer.Add(item, nullptr, /*checked=*/!alone && whole);
  }
  CAIRN_RETURN_IF_ERROR(committer.CommitChecked([&](const ReadItem& item) {
    return alone && reader.Verified(LocationOf(metadata, item));
  }));
  return result;
}

}  // namespace cairn::internal_checkpoint
