// Save. The protocol, every rank in lockstep (rank 0 coordinates); each
// numbered phase ends in a collective that carries every rank's status, so a
// failure anywhere reaches every rank as the same error and nothing is
// committed:
//
//  1. Plan locally: SetUp, CreateLocalPlan, and the key-value tables'
//     declarations (kv_save.h), sent behind the local plan. With a plan
//     cache, one AllReduce
//     (of a status flag, a "my local plan equals the cached one" flag and
//     the cached plan's id) decides whether the cached final plan is reused;
//     without one, the same AllReduce only carries the status.
//  2. Unless reused: gather the local plans at the coordinator, which runs
//     CreateGlobalPlan (dedup), checks the result (every tensor covered
//     exactly once, one dtype and shape per FQN, nothing written twice; the
//     tables' specs agree and their buckets are each saved once) and
//     builds the metadata skeleton; then scatter each rank's final plan (or
//     the error). FinishPlan on every rank.
//  3. Prepare the location (coordinator): take the location's save lock
//     (a second save into the same folder fails here, on every rank, with
//     kAborted), refuse a committed checkpoint unless `overwrite` (which
//     leaves it in place, committed), remove data files of interrupted
//     saves that the committed metadata does not name, and pick the save
//     id, a fresh random name part; read the base's metadata.json (an
//     incremental save). Broadcast of the outcome, the id and the base:
//     no rank creates a file before this is done.
//  4. Write (every rank with items; save_write.cc): against a base
//     (SaveOptions::base), first the items the base holds unchanged are
//     found by their CRC32C and digest and left out (save_reuse.cc). One
//     data file, a safetensors header
//     padded to 4096 bytes, then the items back to back, streamed in blocks
//     of `write_buffer_bytes` by IO threads that resolve each item's bytes
//     when its first block is filled (ResolveData), checksum and digest
//     them as they pass, and release them after its last block; O_DIRECT
//     where allowed;
//     fdatasync, then the directory is synced. Then the rank's key-value
//     table rows, pulled from their sources into files of their own
//     (kv_write.cc).
//  5. Commit: gather the write results (locations, CRC32Cs, scalar values)
//     at the coordinator, which fills in the metadata and writes
//     metadata.json atomically (temp file, fsync, rename, fsync directory:
//     that rename is the commit, and it switches an overwritten checkpoint
//     to the new one in one step), then removes the data files of every
//     other save (the overwritten checkpoint's), releases the lock and
//     broadcasts the outcome. Data files carry the save id in their names
//     (data-<rank>-<save id>.safetensors), so nothing before the rename
//     touches a byte the old checkpoint uses: a crash at any point leaves
//     the old checkpoint or the new one.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <typeinfo>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/checkpoint.h"
#include "cairn/version.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/kv_save.h"
#include "checkpoint/save_reuse.h"
#include "checkpoint/save_write.h"
#include "checkpoint/write_report.h"
#include "comm/collective.h"
#include "core/big_vector.h"
#include "core/byte_codec.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/frame_codec.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "plan/columnar_plan.h"
#include "plan/global_plan.h"
#include "plan/plan_codec.h"

namespace cairn {

struct SavePlanCache::State {
  bool valid = false;
  int rank = -1;
  int world_size = 0;
  std::string key;  // encoded local plan (no scalar values) + planner
  int64_t plan_id = 0;
  SavePlan final_plan;
  // Coordinator only.
  internal_plan::MetadataSkeleton skeleton;
};

SavePlanCache::State& CacheState(SavePlanCache& cache) { return *cache.state_; }

SavePlanCache::SavePlanCache() : state_(std::make_unique<State>()) {}
SavePlanCache::~SavePlanCache() = default;
void SavePlanCache::Clear() { *state_ = State{}; }

}  // namespace cairn

namespace cairn::internal_checkpoint {
namespace {

using internal_comm::AgreeOnStatus;
using internal_comm::BroadcastOutcome;
using internal_comm::GatherOrError;
using internal_comm::kCoordinator;
using internal_comm::Ranks;
using internal_comm::ScatterOutcome;

using internal_core::Annotate;
using internal_core::ByteReader;
using internal_core::ByteWriter;

constexpr char kOperation[] = "save";

bool IsOurFile(std::string_view name) {
  return (name.starts_with("data-") && name.ends_with(".safetensors") &&
          name.find('/') == std::string_view::npos) ||
         name.starts_with(std::string(kMetadataFileName) + ".tmp");
}

// Where this save writes: a global checkpoint (every rank's file at the
// top, metadata.json by the coordinator) or one rank's folder of a
// rank-local checkpoint.
struct Where {
  std::string prefix;  // "" or "rank-00003/"
  int rank = -1;       // rank-local: the rank; -1: global
  int world = 1;       // rank-local: the ranks of the job
  std::string save_id;  // rank-local: the job's, from rank 0; else fresh
  bool rank_local() const { return rank >= 0; }
  std::string metadata_name() const { return prefix + kMetadataFileName; }
};

// Coordinator, step 2: each rank's final plan, encoded after `header` for
// the scatter, and the metadata skeleton. The default planner (exactly:
// a subclass may override CreateGlobalPlan) is planned on flat arrays
// (plan/columnar_plan.h), which falls back to the classic path on anything
// it does not plan, so errors are the classic path's.
absl::StatusOr<internal_plan::EncodedGlobalPlan> PlanGlobally(
    SavePlanner& planner, std::optional<DedupPolicy> default_policy,
    std::vector<std::string>& encoded, const SaveOptions& options,
    const Where& where, std::string_view header) {
  CAIRN_ASSIGN_OR_RETURN(
      internal_plan::EncodedGlobalPlan g,
      internal_plan::PlanGlobalSaveDispatch(
          planner, default_policy, encoded,
          /*require_coverage=*/!where.rank_local(), header));
  // Every FQN and the structure must encode (valid UTF-8, ...) before any
  // data is written, not at commit.
  g.skeleton.metadata.user = options.user_metadata;
  CAIRN_RETURN_IF_ERROR(internal_format::CheckEncodable(g.skeleton.metadata));
  return g;
}

// Un-commits `name` (a metadata.json) when it exists and `overwrite`
// allows; kAlreadyExists otherwise. NotFound on removal is fine: in
// rank-local mode several ranks may race to un-commit the global one.
absl::Status Uncommit(Storage& storage, const std::string& name,
                      const SaveOptions& options, std::string_view what) {
  CAIRN_ASSIGN_OR_RETURN(bool committed, storage.Exists(name));
  if (!committed) return absl::OkStatus();
  if (!options.overwrite) {
    return absl::AlreadyExistsError(absl::StrFormat(
        "%s already holds %s (%s); pass overwrite to replace it",
        storage.url(), what, name));
  }
  absl::Status removed = storage.Remove(name);
  if (!removed.ok() && !absl::IsNotFound(removed)) return removed;
  return storage.Sync();
}

// The data files (relative to the location) that the committed metadata
// file `name` names; nullopt when it cannot be read or decoded (then no
// file is known to be unused).
std::optional<std::set<std::string, std::less<>>> FilesOf(Storage& storage,
                                             const std::string& name,
                                             std::string_view prefix) {
  absl::StatusOr<std::string> text = ReadMetadataText(storage, name);
  if (!text.ok()) return std::nullopt;
  absl::StatusOr<Metadata> md = internal_format::DecodeMetadata(*text, name);
  if (!md.ok()) return std::nullopt;
  std::set<std::string, std::less<>> files;
  for (const auto& [fqn, tensor] : md->tensors) {
    for (const ChunkMetadata& chunk : tensor.chunks) {
      files.insert(std::string(prefix) + chunk.location.file);
    }
  }
  for (const auto& [fqn, loc] : md->objects) {
    files.insert(std::string(prefix) + loc.file);
  }
  for (const auto& [fqn, table] : md->kv_tables) {
    for (const KvChunkMetadata& chunk : table.chunks) {
      files.insert(std::string(prefix) + chunk.ids.file);
    }
  }
  return files;
}

// Removes cairn's data and temporary files in the folder `where.prefix`
// (names relative to the location) for which `keep` is false.
absl::Status RemoveOurFilesExcept(
    Storage& storage, const Where& where,
    const std::function<bool(std::string_view)>& keep) {
  CAIRN_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.List());
  bool removed = false;
  for (const std::string& name : names) {
    if (name.starts_with(where.prefix) &&
        IsOurFile(std::string_view(name).substr(where.prefix.size())) &&
        !keep(name)) {
      CAIRN_RETURN_IF_ERROR(storage.Remove(name));
      removed = true;
    }
  }
  return removed ? storage.Sync() : absl::OkStatus();
}

// Step 3 on the coordinator: the lock, then the checks. The lock is held
// until the save has committed and cleaned up (or failed).
absl::StatusOr<std::unique_ptr<Storage::Lock>> PrepareLocation(
    Storage& storage, const SaveOptions& options, const Where& where) {
  CAIRN_RETURN_IF_ERROR(storage.CreateLocation());
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage::Lock> lock,
                         storage.TryLock(internal_format::SaveLockName(
                             where.prefix)));
  if (where.rank_local()) {
    // A global metadata.json (e.g. from Merge) points into this rank's
    // folder, whose old files this save removes once it commits.
    CAIRN_RETURN_IF_ERROR(Uncommit(storage, kMetadataFileName, options,
                                   "a committed global checkpoint"));
    // Folders of ranks beyond this job's world size, left by an earlier,
    // larger save, are un-committed by rank 0 (the only writer of names no
    // other rank of this job touches); Merge would refuse them anyway, as
    // their save id differs.
    if (where.rank == 0) {
      CAIRN_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.List());
      for (const std::string& name : names) {
        const int other = internal_format::RankOfMetadataName(name);
        if (other >= where.world) {
          CAIRN_RETURN_IF_ERROR(Uncommit(
              storage, name, options,
              absl::StrCat("a rank-local folder of rank ", other,
                           " from a save with more ranks")));
        }
      }
    }
  }
  // A committed checkpoint stays committed, and its files stay, until this
  // save commits over it.
  CAIRN_ASSIGN_OR_RETURN(bool committed,
                         storage.Exists(where.metadata_name()));
  if (committed && !options.overwrite) {
    return absl::AlreadyExistsError(absl::StrFormat(
        "%s already holds a committed checkpoint (%s); pass overwrite to "
        "replace it",
        storage.url(), where.metadata_name()));
  }
  // Files of interrupted saves (no other save runs: we hold the lock).
  // When the committed metadata cannot be read, nothing is removed now;
  // the commit removes what the new metadata does not name.
  std::optional<std::set<std::string, std::less<>>> keep;
  keep.emplace();
  if (committed) keep = FilesOf(storage, where.metadata_name(), where.prefix);
  if (keep) {
    CAIRN_RETURN_IF_ERROR(RemoveOurFilesExcept(
        storage, where,
        [&](std::string_view name) { return keep->contains(name); }));
  }
  return lock;
}

int64_t NewPlanId() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const uint64_t id = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                      (counter.fetch_add(1) << 1) ^
                      static_cast<uint64_t>(std::chrono::steady_clock::now()
                                                .time_since_epoch()
                                                .count());
  return static_cast<int64_t>(id >> 1) + 1;  // positive, never 0
}

}  // namespace

absl::StatusOr<SaveResult> SaveImpl(const StateDict& state,
                                    absl::StatusOr<Storage*> storage,
                                    const SaveOptions& options,
                                    const Where& where) {
  const auto start = std::chrono::steady_clock::now();
  // Seconds since the previous call (phase boundaries).
  auto lap = [last = start]() mutable {
    const auto now = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(now - last).count();
    last = now;
    return s;
  };
  const Ranks ranks(options.comm);
  Communicator* comm = &ranks.comm();
  const int rank = ranks.rank();
  const int world = ranks.size();
  const bool coordinator = ranks.coordinator();
  DefaultSavePlanner default_planner(options.dedup);
  SavePlanner& planner =
      options.planner != nullptr ? *options.planner : default_planner;
  SaveResult result;
  result.world_size = world;

  // 1. Local planning, and the plan cache check.
  absl::Status local = storage.status();
  SavePlan local_plan;
  if (local.ok() &&
      !internal_format::ValidCrc32cBlockBytes(options.crc32c_block_bytes)) {
    local = absl::InvalidArgumentError(absl::StrCat(
        "save: crc32c_block_bytes ", options.crc32c_block_bytes,
        " is not a power of two in [", internal_format::kMinCrc32cBlockBytes,
        ", ", internal_format::kMaxCrc32cBlockBytes, "]"));
  }
  if (local.ok() && options.codec != Codec::kNone) {
    local = internal_core::Annotate(
        internal_format::CheckCodecLevel(options.codec_level), "save");
  }
  if (local.ok()) local = planner.SetUp(state, coordinator, rank, world);
  if (local.ok()) {
    absl::StatusOr<SavePlan> p = planner.CreateLocalPlan();
    local = p.status();
    if (p.ok()) local_plan = *std::move(p);
  }
  // The key-value tables: in rank-local mode their default buckets are
  // the job's rank's.
  std::vector<KvDeclaration> kv_declared;
  if (local.ok()) {
    absl::StatusOr<std::vector<KvDeclaration>> d = DeclareKvTables(
        options, where.rank_local() ? where.world : world,
        where.rank_local() ? where.rank : rank);
    local = d.status();
    if (d.ok()) kv_declared = *std::move(d);
  }
  std::string encoded_local;
  std::string encoded_kv;
  std::string cache_key;
  SavePlanCache::State* cache =
      options.plan_cache != nullptr ? &CacheState(*options.plan_cache) : nullptr;
  if (local.ok()) {
    encoded_local =
        internal_plan::EncodeSavePlan(local_plan, /*with_scalar_values=*/false);
    encoded_kv = EncodeKvDeclarations(kv_declared);
    cache_key = absl::StrCat(encoded_local, "\n", typeid(planner).name(), "\n",
                             static_cast<int>(options.dedup), "\n", encoded_kv);
  }
  const bool my_cache_valid = local.ok() && cache != nullptr && cache->valid &&
                              cache->rank == rank &&
                              cache->world_size == world &&
                              cache->key == cache_key;
  const int64_t my_id = my_cache_valid ? cache->plan_id : 0;
  int64_t vote[4] = {local.ok() ? 1 : 0, my_cache_valid ? 1 : 0, my_id, -my_id};
  {
    absl::Status s = comm->AllReduce(vote, ReduceOp::kMin);
    if (!s.ok()) return Annotate(s, "communicator failed in planning");
  }
  if (vote[0] == 0) {
    return AgreeOnStatus(*comm, local, kOperation, "planning");
  }
  const bool hit = vote[1] == 1 && vote[2] == -vote[3] && vote[2] != 0;
  result.plan_cache_hit = hit;

  // 2. Global planning (skipped on a cache hit).
  SavePlan final_plan;
  internal_plan::MetadataSkeleton fresh_skeleton;
  internal_plan::MetadataSkeleton* skeleton = nullptr;
  if (hit) {
    final_plan = cache->final_plan;
    skeleton = &cache->skeleton;
  } else {
    std::string message = encoded_local;
    internal_core::AppendTrailer(message, encoded_kv);
    absl::StatusOr<std::vector<std::string>> gathered = GatherOrError(
        *comm, absl::OkStatus(), message, kOperation, "planning");
    message.clear();
    absl::Status global = gathered.status();
    std::vector<std::string> payloads;
    // Each rank's table declarations, cut off the end of its plan.
    std::vector<std::vector<KvDeclaration>> kv_per_rank;
    for (size_t r = 0; coordinator && global.ok() && r < gathered->size();
         ++r) {
      const std::string what = absl::StrCat("rank ", r, "'s local plan");
      absl::StatusOr<std::string> kv = internal_core::TakeTrailer((*gathered)[r], what,
                                   "key-value table part");
      absl::StatusOr<std::vector<KvDeclaration>> d =
          kv.ok() ? DecodeKvDeclarations(*kv, what)
                  : absl::StatusOr<std::vector<KvDeclaration>>(kv.status());
      global = d.status();
      if (d.ok()) kv_per_rank.push_back(*std::move(d));
    }
    if (coordinator && global.ok()) {
      // The columnar path plans exactly a DefaultSavePlanner (a subclass
      // may override CreateGlobalPlan), with the policy it was made with:
      // the one made here or one passed in.
      std::optional<DedupPolicy> default_policy;
      if (typeid(planner) == typeid(DefaultSavePlanner)) {
        default_policy =
            static_cast<const DefaultSavePlanner&>(planner).dedup_policy();
      }
      ByteWriter header;
      header.I64(NewPlanId());
      absl::StatusOr<internal_plan::EncodedGlobalPlan> g = PlanGlobally(
          planner, default_policy, *gathered, options, where, header.data());
      if (!g.ok()) {
        global = Annotate(g.status(),
                          "save failed in global planning (coordinator)");
      } else {
        global = CheckKvDeclarations(kv_per_rank, g->skeleton.metadata,
                                     !where.rank_local());
        payloads = std::move(g->payloads);
        fresh_skeleton = std::move(g->skeleton);
      }
    }
    CAIRN_ASSIGN_OR_RETURN(std::string mine,
                           ScatterOutcome(*comm, global, std::move(payloads)));
    ByteReader r(mine, "final plan from the coordinator");
    const int64_t id = r.I64();
    const std::string_view plan_bytes = r.Rest();
    CAIRN_RETURN_IF_ERROR(r.status());
    CAIRN_ASSIGN_OR_RETURN(
        final_plan,
        internal_plan::DecodeFinalPlan(plan_bytes, encoded_local,
                                       "final plan from the coordinator"));
    skeleton = &fresh_skeleton;
    if (cache != nullptr) {
      cache->valid = true;
      cache->rank = rank;
      cache->world_size = world;
      cache->key = cache_key;
      cache->plan_id = id;
      cache->final_plan = final_plan;
      // Moved, not copied: the skeleton's location pointers stay valid.
      cache->skeleton = std::move(fresh_skeleton);
      skeleton = &cache->skeleton;
    }
  }
  absl::StatusOr<SavePlan> finished = planner.FinishPlan(final_plan);
  absl::Status write_status = finished.status();

  result.phases.planning = lap();

  // 3. Prepare the location; the coordinator holds its lock from here on.
  std::unique_ptr<Storage::Lock> lock;
  std::string save_id;
  std::string base_text;  // SaveOptions::base's metadata.json
  {
    absl::Status prepared = absl::OkStatus();
    std::string id;
    if (coordinator) {
      absl::StatusOr<std::unique_ptr<Storage::Lock>> locked =
          PrepareLocation(**storage, options, where);
      prepared = Annotate(locked.status(),
                          where.rank_local()
                              ? "preparing the rank's folder"
                              : "preparing the location (coordinator)");
      if (locked.ok()) lock = *std::move(locked);
      id = !where.save_id.empty()   ? where.save_id
           : !options.save_id.empty() ? options.save_id
                                      : internal_format::NewSaveId();
      // An incremental save: the base's metadata goes out with the id.
      if (prepared.ok() && !options.base.empty()) {
        absl::StatusOr<std::string> text = ReadBase((*storage)->url(), options);
        prepared = text.status();
        if (text.ok()) base_text = *std::move(text);
      }
    }
    ByteWriter w;
    w.Str(id);
    w.Str(base_text);
    CAIRN_ASSIGN_OR_RETURN(std::string outcome,
                           BroadcastOutcome(*comm, prepared, w.Take()));
    ByteReader r(outcome, "save id and base from the coordinator");
    save_id = r.Str();
    base_text = r.Str();
    CAIRN_RETURN_IF_ERROR(r.status());
    if (!internal_format::IsSaveId(save_id)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "save: the save id \"", absl::CEscape(save_id),
          "\" is not 1 to 64 characters of [0-9A-Za-z_-]"));
    }
  }

  result.phases.prepare = lap();

  // 4. Write this rank's data file; against a base, first find the items
  // it holds unchanged (save_reuse.h), which the file leaves out.
  WriteReport report;
  std::optional<BaseChunks> base;
  if (write_status.ok() && !base_text.empty()) {
    absl::StatusOr<BaseChunks> b =
        IndexBase(base_text, (*storage)->url(), options.base);
    write_status = b.status();
    if (b.ok()) base = *std::move(b);
  }
  internal_core::ReleaseStorage(base_text);
  std::vector<ItemDigest> digests;
  SavePlan reduced;  // the items written, when some are reused
  const SavePlan* to_write = write_status.ok() ? &*finished : nullptr;
  if (write_status.ok() && !finished->items.empty()) {
    absl::StatusOr<std::vector<ItemDigest>> d =
        DigestItems(*finished, planner, base ? &*base : nullptr,
                    options.crc32c_block_bytes);
    write_status = d.status();
    if (d.ok()) digests = *std::move(d);
    for (const ItemDigest& d : digests) {
      if (d.reuse == nullptr) continue;
      result.bytes_reused += d.reuse->nbytes;
      ++result.chunks_reused;
    }
    if (result.chunks_reused > 0) {
      for (size_t i = 0; i < digests.size(); ++i) {
        if (digests[i].reuse == nullptr) {
          reduced.items.push_back(finished->items[i]);
        }
      }
      to_write = &reduced;
    }
  }
  if (!write_status.ok()) to_write = nullptr;
  result.phases.digest = lap();
  if (write_status.ok() && !to_write->items.empty()) {
    // Rank-local: the name is relative to the rank's folder.
    report.file = internal_format::DataFileName(where.rank_local() ? 0 : rank,
                                                save_id);
    absl::StatusOr<FileLayout> layout = LayOut(*to_write, report.file);
    write_status = layout.status();
    // What the digest pass took already: digests, and data held for the
    // writer (each item is resolved once).
    for (size_t i = 0, next = 0; write_status.ok() && i < digests.size();
         ++i) {
      if (digests[i].reuse != nullptr) continue;
      Entry& e = *layout->entries[next++];
      e.xxh3 = digests[i].xxh3;
      if (digests[i].held) {
        e.resolved_once = true;
        e.data = *std::move(digests[i].held);
        digests[i].held.reset();
      }
    }
    if (write_status.ok()) {
      write_status = WriteDataFile(*layout, planner, **storage,
                                   where.prefix + report.file, options);
    }
    if (write_status.ok()) write_status = (*storage)->Sync();
    if (write_status.ok()) {
      report.file_size = layout->file_size;
      // In final-plan order: the written entries (in the same order) and
      // the reused chunks' base locations.
      size_t next = 0;
      for (size_t i = 0; i < finished->items.size(); ++i) {
        if (const ByteLocation* reused = digests[i].reuse) {
          report.items.push_back(ReusedLocation(*reused));
          continue;
        }
        Entry& e = *layout->entries[next++];
        // A compressed entry's location describes its raw bytes; its
        // stored size is in `compression`.
        const bool compressed = e.compression.codec != Codec::kNone;
        const uint64_t nbytes =
            compressed ? e.item->nbytes : e.st.end - e.st.begin;
        report.items.push_back({layout->data_start + e.st.begin, nbytes,
                                e.crc32c, std::move(e.block_crc32c),
                                std::move(e.compression), "", e.xxh3});
        result.data_bytes += nbytes;
      }
      result.bytes_written = layout->file_size;
      result.files = 1;
    }
  } else if (write_status.ok()) {
    // Every item reused: no data file.
    for (const ItemDigest& d : digests) {
      report.items.push_back(ReusedLocation(*d.reuse));
    }
  }
  // Then its key-value tables' rows.
  KvWritten kv_written;
  if (write_status.ok() && !kv_declared.empty()) {
    absl::StatusOr<KvWritten> w = WriteKvTables(
        **storage, where.prefix, where.rank_local() ? 0 : rank,
        where.rank_local() ? where.rank : rank, save_id, kv_declared, options);
    write_status = w.status();
    if (w.ok()) {
      kv_written = *std::move(w);
      result.bytes_written += kv_written.bytes_written;
      result.data_bytes += kv_written.data_bytes;
      result.kv_rows = kv_written.rows;
      result.files += kv_written.files;
    }
  }
  report.scalars = local_plan.scalars;
  result.phases.write = lap();

  // 5. Commit.
  // The coordinator always reaches the broadcast below, error or not, so no
  // rank is left waiting.
  std::string encoded_report = EncodeReport(report);
  internal_core::AppendTrailer(encoded_report, EncodeKvWritten(kv_written));
  absl::StatusOr<std::vector<std::string>> reports = GatherOrError(
      *comm, write_status, encoded_report, kOperation, "writing");
  encoded_report.clear();
  absl::Status committed = reports.status();
  std::string summary;
  // Each rank's key-value table parts, cut off the end of its report, and
  // the bytes of their files.
  std::vector<std::vector<KvTablePart>> kv_parts;
  uint64_t kv_file_bytes = 0;
  for (size_t r = 0; coordinator && committed.ok() && r < reports->size();
       ++r) {
    const std::string what = absl::StrCat("rank ", r, "'s write report");
    absl::StatusOr<std::string> kv = internal_core::TakeTrailer((*reports)[r], what,
                                   "key-value table part");
    absl::StatusOr<KvWritten> written =
        kv.ok() ? DecodeKvWritten(*kv, what)
                : absl::StatusOr<KvWritten>(kv.status());
    committed = written.status();
    if (written.ok()) {
      kv_parts.push_back(std::move(written->parts));
      kv_file_bytes += written->bytes_written;
    }
  }
  if (coordinator && committed.ok()) {
    uint64_t total = 0;
    // The block size the reports' block checksums were taken in (a cached
    // skeleton may come from a save with another).
    skeleton->metadata.crc32c_block_bytes = options.crc32c_block_bytes;
    skeleton->flat.block_bytes = options.crc32c_block_bytes;
    absl::StatusOr<const Metadata*> md = AssembleMetadata(
        *skeleton, *reports, options.user_metadata, &total,
        base ? std::span<const CheckpointReference>(base->candidates)
             : std::span<const CheckpointReference>());
    total += kv_file_bytes;
    committed = md.status();
    if (committed.ok()) {
      absl::StatusOr<std::map<std::string, KvTableMetadata>> tables =
          AssembleKvTables(kv_parts, where.rank_local());
      committed = tables.status();
      if (tables.ok()) skeleton->metadata.kv_tables = *std::move(tables);
    }
    if (committed.ok() && where.rank_local()) {
      skeleton->metadata.rank = where.rank;
      skeleton->metadata.world_size = where.world;
    }
    if (committed.ok()) {
      skeleton->metadata.save_id = save_id;
      absl::StatusOr<std::string> json =
          internal_plan::EncodeSkeleton(*skeleton);
      committed = json.status();
      if (committed.ok()) {
        // An overwrite replaces the committed checkpoint in one step (it
        // stays committed until then); any other save commits only if no
        // metadata.json appeared since step 3 (a conditional PUT on object
        // storage), so a committed checkpoint is never replaced by accident.
        committed =
            options.overwrite
                ? (*storage)->WriteAtomically(where.metadata_name(), *json)
                : (*storage)->CreateAtomically(where.metadata_name(), *json);
      }
    }
    if (!committed.ok()) {
      committed =
          Annotate(committed, "save failed at commit (coordinator)");
    }
    // With the commit, no file of any other save is needed (the lock kept
    // other saves out): the overwritten checkpoint's files and leftovers
    // go. Best effort: a file left here is removed by the next save into
    // the location. After a failed commit nothing is removed: the rename
    // may have happened all the same (a failed fsync of the directory).
    if (committed.ok()) {
      const std::string suffix = absl::StrCat("-", save_id, ".safetensors");
      (void)RemoveOurFilesExcept(**storage, where, [&](std::string_view name) {
        return name.ends_with(suffix);
      });
    }
    lock.reset();
    ByteWriter w;
    w.U64(total);
    summary = w.Take();
  }
  if (!committed.ok()) summary.clear();
  CAIRN_ASSIGN_OR_RETURN(std::string outcome,
                         BroadcastOutcome(*comm, committed, summary));
  ByteReader r(outcome, "commit summary");
  result.checkpoint_bytes = r.U64();
  CAIRN_RETURN_IF_ERROR(r.status());
  result.phases.commit = lap();
  result.seconds = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - start)
                       .count();
  return result;
}

absl::StatusOr<SaveResult> SaveToStorage(const StateDict& state,
                                         absl::StatusOr<Storage*> storage,
                                         const SaveOptions& options) {
  if (!options.rank_local) return SaveImpl(state, storage, options, Where{});
  // Rank-local: the save is a one-rank save into the rank's folder. Its one
  // collective is the broadcast of rank 0's save id, which every rank
  // folder records so that folders of different saves are never taken for
  // one checkpoint (Merge and rank-local loads compare them).
  const Ranks ranks(options.comm);
  Where where;
  where.prefix = internal_format::RankFolderName(ranks.rank()) + "/";
  where.rank = ranks.rank();
  where.world = ranks.size();
  where.save_id = !options.save_id.empty() ? options.save_id
                  : ranks.rank() == 0        ? internal_format::NewSaveId()
                                             : "";
  if (ranks.size() > 1 && options.save_id.empty()) {
    absl::Status sent = ranks.comm().Broadcast(where.save_id, 0);
    if (!sent.ok()) {
      return Annotate(sent, absl::StrCat("rank-local save of rank ",
                                         ranks.rank(),
                                         ": broadcasting the save id"));
    }
  }
  if (!internal_format::IsSaveId(where.save_id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank-local save of rank ", ranks.rank(), ": the save id \"",
        absl::CEscape(where.save_id),
        "\" is not 1 to 64 characters of [0-9A-Za-z_-]"));
  }
  SaveOptions local = options;
  local.comm = nullptr;
  absl::StatusOr<SaveResult> result = SaveImpl(state, storage, local, where);
  if (!result.ok()) {
    return Annotate(result.status(),
                    absl::StrCat("rank-local save of rank ", ranks.rank()));
  }
  result->world_size = ranks.size();
  return result;
}

}  // namespace cairn::internal_checkpoint
