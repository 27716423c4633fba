// Load, step 3's first part (see load.cc): chunks read once per node.
//
// In a column reshard every rank needs a strided part of each stored chunk
// (its columns, a run out of every row), and the span of that part is
// nearly the whole chunk: each rank reading its own part reads the chunk's
// span, so the node reads every byte once per rank. Here the ranks of a
// node (same host name) pool those parts instead:
//
//  a. Only when some rank asked for node reads (its planning message said
//     so, and the coordinator told every rank): every rank takes part.
//  b. Split by host (a rank that did not ask, or holds no strided parts
//     outside a replica group, joins color 0 and stops there), and an
//     AllGather inside each node of every member's strided parts (tensor,
//     chunk, box) and its wave limit.
//  c. Every member computes the same thing from the same messages: the
//     chunks that several members need strided parts of and whose parts'
//     spans add up to more than the chunk (so one whole read is less than
//     theirs), each no larger than a wave; an owner for each (largest
//     first, to the member with the fewest bytes so far); waves in file
//     order, each at most the smallest member's StagingLimit.
//  d. Per wave: members resolve their parts' destinations; owners read
//     their chunks whole into staging (the Loader checks each one's
//     CRC32C as it lands); each owner Scatters every member's parts to it,
//     packed row-major (only the bytes each member needs travel), behind a
//     flag saying whether its reads and checks passed; members place them
//     (host copies, device copies, sinks) and commit them: a whole-chunk
//     check covered them. A member that fails goes on taking part in the
//     Scatters and returns its error; the others return OK, with the
//     failed owner's parts unplaced and uncommitted, and step 4 fails the
//     load on every rank, naming the member that failed.
//
// Chunks larger than a wave, and parts nobody else needs, stay in the
// rank's own plan for StagedLoad.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
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
#include "cairn/tensor.h"
#include "checkpoint/load_internal.h"
#include "core/byte_codec.h"
#include "core/checked.h"
#include "core/status.h"
#include "core/strided.h"
#include "cuda/device_runtime.h"
#include "format/crc32c.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::Annotate;

std::atomic<std::string (*)(int)> node_name_for_testing{nullptr};

// The name of the node `rank` runs on: its host name.
std::string NodeName(int rank) {
  if (auto* name = node_name_for_testing.load()) return name(rank);
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return std::string();
  return host;
}

// A stored tensor by index (its place in metadata.tensors, the same on
// every rank), and each tensor's index.
struct TensorIndex {
  explicit TensorIndex(const Metadata& metadata) {
    for (const auto& [fqn, tm] : metadata.tensors) {
      index.emplace(&tm, static_cast<uint32_t>(entries.size()));
      entries.emplace_back(&fqn, &tm);
    }
  }
  std::vector<std::pair<const std::string*, const TensorMetadata*>> entries;
  absl::flat_hash_map<const TensorMetadata*, uint32_t> index;
};

// One rank's strided part of a stored chunk.
struct Part {
  uint32_t tensor = 0;
  uint64_t chunk = 0;
  Box box;
  uint64_t span = 0;  // bytes from its first to its last byte in the chunk
  size_t item = 0;    // this rank's own parts: index into the plan's items
};

// Bytes from the first to the last byte of `runs`.
uint64_t RunsSpan(const internal_core::RunPattern& runs) {
  uint64_t span = static_cast<uint64_t>(runs.run_bytes);
  for (size_t i = 0; i < runs.counts.size(); ++i) {
    span += static_cast<uint64_t>(runs.counts[i] - 1) *
            static_cast<uint64_t>(runs.strides[i]);
  }
  return span;
}

// The items of `items` that are strided parts of a chunk (not whole, not one
// contiguous run of it). Items the metadata lacks, or that leave their
// chunk, are not: the reader reports those.
std::vector<Part> StridedParts(const Metadata& metadata,
                               const TensorIndex& tensors,
                               const std::vector<ReadItem>& items) {
  std::vector<Part> parts;
  for (size_t i = 0; i < items.size(); ++i) {
    const ReadItem& item = items[i];
    if (item.kind != ItemKind::kTensor) continue;
    auto it = metadata.tensors.find(item.fqn);
    if (it == metadata.tensors.end()) continue;
    const TensorMetadata& tm = it->second;
    if (item.chunk >= tm.chunks.size()) continue;
    const Box& box = tm.chunks[item.chunk].box;
    // (A compressed chunk's reader decompresses only the frames its part
    // needs, and checks each: nothing to gain from reading it once.)
    if (tm.chunks[item.chunk].location.compressed()) continue;
    if (item.overlap.rank() != box.rank() || item.overlap.empty() ||
        !Contains(box, item.overlap) || item.overlap == box) {
      continue;
    }
    const internal_core::RunPattern runs =
        internal_core::SubBoxRuns(box, item.overlap, DTypeSize(tm.dtype));
    if (runs.num_runs() < 2) continue;
    parts.push_back(
        Part{tensors.index.at(&tm), item.chunk, item.overlap, RunsSpan(runs), i});
  }
  return parts;
}

std::string EncodeParts(uint64_t limit, const std::vector<Part>& parts) {
  internal_core::ByteWriter w;
  w.U64(limit);
  w.U64(parts.size());
  for (const Part& p : parts) {
    w.U32(p.tensor);
    w.U64(p.chunk);
    w.Ints(p.box.offsets);
    w.Ints(p.box.sizes);
  }
  return w.Take();
}

// A member's message, checked against the metadata (every member decodes
// the same messages, so every member reaches the same verdict).
absl::Status DecodeParts(std::string_view message, int member,
                         const Metadata& metadata, const TensorIndex& tensors,
                         uint64_t& limit, std::vector<Part>& parts) {
  const std::string what =
      absl::StrCat("node read plan of node member ", member);
  internal_core::ByteReader in(message, what);
  limit = in.U64();
  const uint64_t n = in.Count(20);
  for (uint64_t i = 0; i < n && !in.failed(); ++i) {
    Part p;
    p.tensor = in.U32();
    p.chunk = in.U64();
    p.box.offsets = in.Ints();
    p.box.sizes = in.Ints();
    if (in.failed()) break;
    if (p.tensor >= tensors.entries.size()) {
      return absl::DataLossError(
          absl::StrFormat("%s: tensor index %d of %d", what, p.tensor,
                          tensors.entries.size()));
    }
    const TensorMetadata& tm = *tensors.entries[p.tensor].second;
    if (p.chunk >= tm.chunks.size() ||
        p.box.offsets.size() != p.box.sizes.size() ||
        p.box.rank() != tm.chunks[p.chunk].box.rank() || p.box.empty() ||
        !Contains(tm.chunks[p.chunk].box, p.box)) {
      return absl::DataLossError(absl::StrFormat(
          "%s: %s is not a part of chunk %d of %s", what, p.box.ToString(),
          p.chunk, *tensors.entries[p.tensor].first));
    }
    p.span = RunsSpan(internal_core::SubBoxRuns(tm.chunks[p.chunk].box, p.box,
                                                DTypeSize(tm.dtype)));
    parts.push_back(std::move(p));
  }
  return in.status();
}

// A chunk read once on the node, and the parts members need of it.
struct SharedChunk {
  uint32_t tensor = 0;
  uint64_t chunk = 0;
  uint64_t bytes = 0;
  int owner = 0;
  // (member, index into that member's parts), members in order.
  std::vector<std::pair<int, size_t>> parts;
};

// Appends the bytes of `box` (inside chunk `outer`, whose row-major bytes
// start at `chunk`) to `out`, row-major.
void Pack(const std::byte* chunk, const Box& outer, const Box& box, size_t es,
          std::string& out) {
  const internal_core::RunPattern runs =
      internal_core::SubBoxRuns(outer, box, es);
  internal_core::ForEachRun(runs, [&](int64_t offset) {
    out.append(reinterpret_cast<const char*>(chunk + offset),
               static_cast<size_t>(runs.run_bytes));
  });
}

}  // namespace

void SetNodeNameForTesting(std::string (*name)(int rank)) {
  node_name_for_testing.store(name);
}

absl::StatusOr<std::vector<ReadItem>> ReadOncePerNode(
    Communicator& comm, const LoadPlan& plan, bool grouped,
    LoadPlanner& planner, Loader& reader, const Metadata& metadata,
    const LoadOptions& options, LoadPhaseTimes& phases, Committer& committer,
    LoadResult& result) {
  if (comm.size() == 1) return plan.items;
  auto t0 = std::chrono::steady_clock::now();
  // a. This rank's strided parts.
  const TensorIndex tensors(metadata);
  std::vector<Part> mine;
  if (options.share_node_reads && !grouped) {
    mine = StridedParts(metadata, tensors, plan.items);
  }
  // b. The node's members and their parts. A rank without parts joins the
  // others without (color 0), which then stop.
  int color = 0;
  if (!mine.empty()) {
    const std::string host = NodeName(comm.rank());
    color = static_cast<int>(internal_format::Crc32c(host.data(), host.size()) &
                             0x3fffffff) +
            1;
  }
  absl::StatusOr<std::unique_ptr<Communicator>> split =
      comm.Split(color, comm.rank());
  CAIRN_RETURN_IF_ERROR(
      Annotate(split.status(), "load: communicator failed in Split by node"));
  if (mine.empty()) {
    phases.read += Since(t0);
    return plan.items;
  }
  Communicator& node = **split;
  const int members = node.size();
  const int me = node.rank();
  const uint64_t my_limit = StagingLimit(options, options.broadcast_batch_bytes);
  absl::StatusOr<std::vector<std::string>> gathered =
      node.AllGather(EncodeParts(my_limit, mine));
  CAIRN_RETURN_IF_ERROR(Annotate(
      gathered.status(), "load: communicator failed in gathering strided parts"));
  std::vector<std::vector<Part>> parts(members);
  uint64_t limit = my_limit;
  for (int m = 0; m < members; ++m) {
    uint64_t theirs = 0;
    if (m == me) {
      parts[m] = mine;
      continue;
    }
    CAIRN_RETURN_IF_ERROR(DecodeParts((*gathered)[m], m, metadata, tensors,
                                      theirs, parts[m]));
    limit = std::min(limit, theirs);
  }
  gathered = std::vector<std::string>();

  // c. The chunks worth reading once, their owners and the waves.
  std::map<std::pair<uint32_t, uint64_t>, SharedChunk> by_chunk;
  for (int m = 0; m < members; ++m) {
    for (size_t i = 0; i < parts[m].size(); ++i) {
      SharedChunk& c = by_chunk[{parts[m][i].tensor, parts[m][i].chunk}];
      c.parts.emplace_back(m, i);
    }
  }
  std::vector<SharedChunk> chunks;
  for (auto& [key, c] : by_chunk) {
    const TensorMetadata& tm = *tensors.entries[key.first].second;
    c.tensor = key.first;
    c.chunk = key.second;
    c.bytes = static_cast<uint64_t>(tm.chunks[c.chunk].box.num_elements()) *
              DTypeSize(tm.dtype);
    uint64_t spans = 0;
    for (const auto& [m, i] : c.parts) spans += parts[m][i].span;
    const bool several = c.parts.front().first != c.parts.back().first;
    if (several && c.bytes <= limit && spans > c.bytes) {
      chunks.push_back(std::move(c));
    }
  }
  by_chunk.clear();
  if (chunks.empty()) {
    phases.read += Since(t0);
    return plan.items;
  }
  // Waves in file order; in each, the owners balanced by bytes (largest
  // chunks first, each to the member needing it that has the fewest bytes
  // in this wave, then overall), so that every member reads in every wave.
  auto location = [&](const SharedChunk& c) -> const ByteLocation& {
    return tensors.entries[c.tensor].second->chunks[c.chunk].location;
  };
  std::stable_sort(chunks.begin(), chunks.end(),
                   [&](const SharedChunk& a, const SharedChunk& b) {
                     const ByteLocation& x = location(a);
                     const ByteLocation& y = location(b);
                     return std::tie(x.file, x.offset) < std::tie(y.file, y.offset);
                   });
  std::vector<size_t> bounds{0};
  {
    uint64_t wave = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (i > bounds.back() && wave + chunks[i].bytes > limit) {
        bounds.push_back(i);
        wave = 0;
      }
      wave += chunks[i].bytes;
    }
    bounds.push_back(chunks.size());
  }
  {
    std::vector<uint64_t> total(members, 0);
    for (size_t w = 0; w + 1 < bounds.size(); ++w) {
      std::vector<size_t> by_size;
      for (size_t i = bounds[w]; i < bounds[w + 1]; ++i) by_size.push_back(i);
      std::stable_sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) {
        return chunks[a].bytes > chunks[b].bytes;
      });
      std::vector<uint64_t> in_wave(members, 0);
      for (size_t i : by_size) {
        int best = -1;
        for (const auto& [m, p] : chunks[i].parts) {
          if (best < 0 || std::pair(in_wave[m], total[m]) <
                              std::pair(in_wave[best], total[best])) {
            best = m;
          }
        }
        chunks[i].owner = best;
        in_wave[best] += chunks[i].bytes;
        total[best] += chunks[i].bytes;
      }
    }
  }
  // What stays for StagedLoad: the items not in a shared chunk.
  std::vector<bool> taken(plan.items.size(), false);
  for (const SharedChunk& c : chunks) {
    for (const auto& [m, i] : c.parts) {
      if (m == me) taken[parts[me][i].item] = true;
    }
  }
  std::vector<ReadItem> rest;
  for (size_t i = 0; i < plan.items.size(); ++i) {
    if (!taken[i]) rest.push_back(plan.items[i]);
  }
  phases.read += Since(t0);

  // d. The waves. No member waits on another's verdict here: an owner
  // that failed hands out a "failed" flag instead of parts, the members
  // leave those parts unplaced and uncommitted, and only the member that
  // failed returns an error (step 4 then fails the load on every rank,
  // naming it). Every member takes part in every Scatter regardless.
  Tensor staging;
  uint64_t capacity = 0;
  DeviceRuntimes devices;
  // This member's first error; later work is skipped.
  absl::Status local;
  // Every location of this rank's whole plan is checked against its file's
  // header before the first byte lands, as a single Read would: a
  // metadata.json that disagrees with a data file leaves every destination
  // untouched.
  t0 = std::chrono::steady_clock::now();
  local = reader.CheckEntries(plan.items);
  phases.read += Since(t0);
  const std::byte* base = nullptr;  // staging.data() of the current wave
  std::vector<std::string> out(members);  // this member's packs, as owner
  const std::vector<std::string> none;    // what a non-root passes Scatter
  for (size_t w = 0; w + 1 < bounds.size(); ++w) {
    const size_t first = bounds[w], last = bounds[w + 1];
    t0 = std::chrono::steady_clock::now();
    // Resolve this member's parts of the wave's chunks.
    absl::flat_hash_map<size_t, Destination> dsts;  // by index into `mine`
    for (size_t c = first; c < last && local.ok(); ++c) {
      for (const auto& [m, i] : chunks[c].parts) {
        if (m != me || !local.ok()) continue;
        const ReadItem& item = plan.items[mine[i].item];
        absl::StatusOr<Destination> d = planner.ResolveDestination(item);
        if (d.ok()) d = reader.CheckDestination(item, *d);
        local = d.status();
        if (!local.ok()) break;
        if (d->sink == nullptr && !d->view.device().is_cpu()) {
          const Device device = d->view.device();
          const bool known = devices.Has(device);
          absl::StatusOr<internal_cuda::DeviceRuntime*> runtime =
              devices.For(device);
          local = Annotate(runtime.status(),
                           absl::StrCat(item.fqn, " ", item.overlap.ToString()));
          // The application's queued work that may still read the
          // destination is done before the first copy into the device.
          if (local.ok() && !known) local = (*runtime)->WaitForDevice(device);
          if (!local.ok()) break;
        }
        dsts.emplace(i, *std::move(d));
      }
    }
    // The owner reads its chunks whole into staging; the Loader checks each
    // one's CRC32C as it lands.
    std::vector<uint64_t> at(last - first, 0);
    std::vector<ReadItem> reads;
    std::vector<Destination> views;
    uint64_t used = 0;
    for (size_t c = first; c < last && local.ok(); ++c) {
      if (chunks[c].owner != me) continue;
      const auto& [fqn, tm] = tensors.entries[chunks[c].tensor];
      const ChunkMetadata& chunk = tm->chunks[chunks[c].chunk];
      at[c - first] = used =
          StagingSlot(used, chunks[c].bytes, chunk.location.offset);
      used += chunks[c].bytes;
      reads.push_back(
          ReadItem{*fqn, ItemKind::kTensor, -1, chunks[c].chunk, chunk.box});
    }
    if (local.ok() && used > capacity) {
      staging = Tensor();
      absl::StatusOr<Tensor> t =
          Tensor::Empty(DType::kU8, {static_cast<int64_t>(used)});
      local = Annotate(t.status(), "staging of the chunks read once per node");
      if (t.ok()) {
        staging = *std::move(t);
        capacity = used;
      }
    }
    base = static_cast<const std::byte*>(staging.data());
    if (local.ok() && !reads.empty()) {
      size_t k = 0;
      for (size_t c = first; c < last; ++c) {
        if (chunks[c].owner != me) continue;
        Destination d;
        d.view = TensorView(const_cast<std::byte*>(base) + at[c - first],
                            tensors.entries[chunks[c].tensor].second->dtype,
                            reads[k++].overlap.sizes);
        views.push_back(std::move(d));
      }
      local = reader.Read(reads, views);
      reader.TakeReadsInto(result);
    }
    phases.read += Since(t0);

    // This member's packs for the others (all owners pack at once): a flag
    // (1: its reads and checks passed), then each member's parts of its
    // chunks, packed row-major, in chunk order, each member's parts in
    // order. The strings keep their memory from wave to wave.
    t0 = std::chrono::steady_clock::now();
    bool owns_any = false;
    for (size_t c = first; c < last; ++c) owns_any |= chunks[c].owner == me;
    if (owns_any) {
      for (int m = 0; m < members; ++m) {
        out[m].assign(1, local.ok() ? '\1' : '\0');
      }
      for (size_t c = first; c < last && local.ok(); ++c) {
        if (chunks[c].owner != me) continue;
        const TensorMetadata& tm = *tensors.entries[chunks[c].tensor].second;
        for (const auto& [m, i] : chunks[c].parts) {
          if (m == me) continue;
          Pack(base + at[c - first], tm.chunks[chunks[c].chunk].box,
               parts[m][i].box, DTypeSize(tm.dtype), out[m]);
        }
      }
    }
    phases.copy += Since(t0);
    // One Scatter per owner of the wave's chunks.
    t0 = std::chrono::steady_clock::now();
    std::vector<std::string> got(members);
    for (int o = 0; o < members; ++o) {
      bool owns = false;
      for (size_t c = first; c < last; ++c) owns |= chunks[c].owner == o;
      if (!owns) continue;
      absl::StatusOr<std::string> g = node.Scatter(o == me ? out : none, o);
      CAIRN_RETURN_IF_ERROR(Annotate(
          g.status(), "load: communicator failed in handing out parts"));
      got[o] = *std::move(g);
    }
    phases.broadcast += Since(t0);

    // Place this member's parts: from its own staging, or as received. An
    // owner that failed (and says so itself) leaves its parts unplaced and
    // uncommitted here.
    t0 = std::chrono::steady_clock::now();
    std::vector<uint64_t> offset(members, 1);  // into got[o], past the flag
    std::string own_pack;  // an own part, packed for a sink or a device
    for (size_t c = first; c < last && local.ok(); ++c) {
      const int o = chunks[c].owner;
      if (o != me && (got[o].empty() || got[o][0] != '\1')) continue;
      const TensorMetadata& tm = *tensors.entries[chunks[c].tensor].second;
      const size_t es = DTypeSize(tm.dtype);
      const Box& chunk_box = tm.chunks[chunks[c].chunk].box;
      for (const auto& [m, i] : chunks[c].parts) {
        if (m != me) continue;
        const ReadItem& item = plan.items[mine[i].item];
        const std::string where =
            absl::StrCat(item.fqn, " ", item.overlap.ToString());
        const uint64_t n =
            static_cast<uint64_t>(item.overlap.num_elements()) * es;
        const Destination& d = dsts.at(i);
        // The part's bytes, packed: received, or (an own part for a sink or
        // a device) packed here.
        const std::byte* packed = nullptr;
        if (o != me) {
          if (offset[o] + n > got[o].size()) {
            local = absl::InternalError(absl::StrFormat(
                "%s: node member %d handed out %d bytes, fewer than the parts "
                "need",
                where, o, got[o].size()));
            break;
          }
          packed = reinterpret_cast<const std::byte*>(got[o].data()) + offset[o];
          offset[o] += n;
        } else if (d.sink != nullptr || !d.view.device().is_cpu()) {
          own_pack.clear();
          Pack(base + at[c - first], chunk_box, item.overlap, es, own_pack);
          packed = reinterpret_cast<const std::byte*>(own_pack.data());
        }
        absl::Status s;
        if (d.sink != nullptr) {
          s = d.sink->Write(item, item.overlap,
                            std::span<const std::byte>(packed, n));
          if (!s.ok()) s = Annotate(s, absl::StrCat("sink of ", where));
        } else if (!d.view.device().is_cpu()) {
          absl::StatusOr<internal_cuda::DeviceRuntime*> runtime =
              devices.For(d.view.device());
          s = runtime.status();
          if (s.ok()) {
            s = internal_cuda::QueueCopyToDeviceView(**runtime, where, packed,
                                                     d.view);
          }
          // The packed bytes may be reused by the next part: wait now.
          if (s.ok()) s = (*runtime)->Synchronize(d.view.device());
          if (s.ok()) result.device_bytes += n;
        } else if (packed != nullptr) {
          internal_core::CopyView(
              TensorView(const_cast<std::byte*>(packed), tm.dtype,
                         item.overlap.sizes),
              d.view);
        } else {
          Box local_box = item.overlap;
          for (int k = 0; k < local_box.rank(); ++k) {
            local_box.offsets[k] -= chunk_box.offsets[k];
          }
          absl::StatusOr<TensorView> src =
              TensorView(const_cast<std::byte*>(base) + at[c - first],
                         tm.dtype, chunk_box.sizes)
                  .Slice(local_box);
          s = src.status();
          if (s.ok()) internal_core::CopyView(*src, d.view);
        }
        if (!s.ok()) {
          local = s;
          break;
        }
        result.bytes_loaded += n;
        // Its chunk passed its CRC32C whole on its owner (when checks are
        // on): the owner's flag says so.
        committer.Add(item, d.sink, /*checked=*/true);
      }
    }
    for (int o = 0; o < members && local.ok(); ++o) {
      if (o != me && !got[o].empty() && got[o][0] == '\1' &&
          offset[o] != got[o].size()) {
        local = absl::InternalError(absl::StrFormat(
            "node member %d handed out %d bytes, more than the parts need (%d)",
            o, got[o].size(), offset[o]));
      }
    }
    if (local.ok()) {
      local = committer.CommitChecked([](const ReadItem&) { return false; });
    }
    phases.copy += Since(t0);
  }
  CAIRN_RETURN_IF_ERROR(local);
  return rest;
}

}  // namespace cairn::internal_checkpoint
