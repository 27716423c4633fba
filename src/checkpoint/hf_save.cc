// SaveHuggingFace (include/cairn/huggingface.h): a live state dict, sharded
// over any number of ranks, written into one Hugging Face folder.
// The protocol, every rank in lockstep:
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
#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/huggingface.h"
#include "checkpoint/hf_export.h"
#include "comm/collective.h"
#include "core/byte_codec.h"
#include "core/flatten.h"
#include "core/parallel.h"
#include "core/status.h"
#include "format/metadata_codec.h"
#include "storage/file_storage.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::Annotate;
using internal_core::ByteReader;
using internal_core::ByteWriter;

constexpr char kOperation[] = "Hugging Face export";

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
