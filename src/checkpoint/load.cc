// Load. The protocol, every rank in lockstep (rank 0 coordinates); each
// phase ends in a collective carrying every rank's status. This file holds
// the entry points (LoadFromStorage, LoadWithMetadata, LoadAllFromStorage,
// the rank-local load) and runs the steps in order; each step names the
// file that implements it, all in this folder, and load_internal.h declares
// what they share:
//
//  1. Metadata (this file): the coordinator reads metadata.json and
//     validates it as untrusted input (file names, dtypes, boxes inside
//     their tensors, sizes, chunk coverage), then broadcasts its text (or
//     the error); the other ranks decode the same text. In a job of at
//     most kSelfReadMaxRanks ranks every rank reads the text itself
//     instead (no broadcast), and step 2's gather carries a digest of the
//     bytes each read: the coordinator refuses the load when any differ.
//     Whether each rank could read and decode travels in step 2's gather
//     too (a rank that could not plans nothing), not in a collective of
//     its own.
//  2. Plan (load_plan.cc): SetUp and CreateLocalPlan on every rank (the
//     default planner matches every destination leaf to the checkpoint: a
//     missing leaf is an error in strict mode, dtype and global shape must
//     match, scalars are assigned, and every destination box is intersected
//     with every stored chunk). The coordinator combines them: with a
//     DefaultLoadPlanner (or subclass) each rank keeps its plan and sends a
//     summary (EncodeLocalLoadPlan: item count, a hash of what it reads, its
//     unexpected leaves as bits), the coordinator narrows the unexpected
//     leaves and groups replicas by hash (PlanLoadGlobally), and the groups'
//     members check their plans against their leader's exactly; any other
//     planner sends its whole plan for CreateGlobalPlan and gets its final
//     plan back. FinishPlan.
//  3. Read. First, with LoadOptions::share_node_reads, the chunks that
//     several ranks of a node need strided parts of (a column reshard) are
//     read once on the node, checked whole, and their parts handed out
//     (ReadOncePerNode, load_node.cc); then, on every rank, the rest of
//     its plan in waves (StagedLoad, load_staged.cc): each
//     wave resolves, reads, checks, places and commits its items before
//     the next (a replica group reads the next wave while it broadcasts
//     and places this one). Host memory destinations are read in place;
//     sinks, device destinations and what a replica group's members
//     receive by broadcast go through host staging, at most StagingLimit
//     bytes a wave (LoadOptions::memory_budget_bytes). The reads themselves are the
//     Loader's (load_slabs.cc, a and c; load_read.cc, b and d).
//     a. ResolveDestination for the wave's items; check each destination.
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
//     e. Place what was staged (host copies, device copies, and sinks,
//        which get only checked bytes), then commit (load_commit.cc,
//        Committer): CommitChunk for every item whose bytes this rank
//        checked whole (its chunk, or its object), in the wave that
//        checked them; the parts of chunks wait for step 6.
//  4. Agree (load_agree.cc; the collectives in this file): the coordinator
//     gathers every rank's status and the CRC32Cs and signatures of its
//     parts of chunks (3d), combines the parts of each chunk that they tile
//     and compares them with its CRC32C (CheckSharedPieces: contiguous
//     pieces in a chain, any chunk with a strided part as boxes whose
//     signatures XOR to it), and every rank learns the verdict, with the
//     chunks that parts were returned of but that no set of parts tiles (a
//     slice).
//  5. Only when there are such chunks (verify_parts.cc): the ranks that read
//     parts of them check them (VerifyUncheckedParts: the checksum blocks
//     around the parts, format version 3, or the whole chunk) and agree.
//  6. Commit the rest (load_commit.cc): the items that are parts of
//     chunks, whose checks steps 4 and 5 made, commit; when there were
//     such parts, the ranks agree on the commits. So a planner never acts
//     on bytes that then fail a check.
//  7. Key-value tables (kv_load.cc, kv_read.cc), when the checkpoint has
//     any: their rows into the requests' sinks, and one agreement.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/metadata.h"
#include "cairn/planner.h"
#include "cairn/state_dict.h"
#include "cairn/storage.h"
#include "cairn/tensor.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/hf_import.h"
#include "checkpoint/kv_load.h"
#include "checkpoint/kv_save.h"
#include "checkpoint/load_internal.h"
#include "checkpoint/referencing_storage.h"
#include "comm/collective.h"
#include "core/big_vector.h"
#include "core/byte_codec.h"
#include "core/flatten.h"
#include "core/status.h"
#include "format/chunk_digest.h"
#include "format/metadata_codec.h"
#include "format/names.h"
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

// Up to this many ranks, every rank of a load reads the metadata (or a
// Hugging Face folder's index and headers) itself, at the same time, and
// the planning gather compares their digests; no broadcast. Above it the
// coordinator reads it alone and broadcasts it: a metadata.json of many
// ranks is large (943 MiB for 16k), and each rank reading it would
// multiply the storage's load. Below, the broadcast is the costlier part:
// one collective fewer per load, and each waits for descheduled ranks on
// a node with more ranks than cores (4 ranks on 2 cores: bench/RESULTS.md,
// issue 37).
constexpr int kSelfReadMaxRanks = 8;

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

// Cuts each rank's digest of the metadata it read (step 1) off the end
// of its plan in `gathered`, leaving the plans: OK when every rank's is
// the coordinator's `mine`, else kAborted naming the first rank whose is
// not (the checkpoint at `url` changed between the ranks' reads, or they
// load different ones).
absl::Status TakeSourceDigests(std::vector<std::string>& gathered,
                               std::string_view mine, std::string_view url) {
  for (size_t r = 0; r < gathered.size(); ++r) {
    CAIRN_ASSIGN_OR_RETURN(
        const std::string digest,
        internal_core::TakeTrailer(gathered[r],
                                   absl::StrCat("load plan of rank ", r),
                                   "metadata digest"));
    if (digest != mine) {
      return absl::AbortedError(absl::StrFormat(
          "rank %d read other metadata than rank 0 did at %s (its %s or, "
          "for a Hugging Face folder, its index and headers): the "
          "checkpoint changed while the ranks read it, or they load "
          "different ones; nothing was loaded",
          r, url, kMetadataFileName));
    }
  }
  return absl::OkStatus();
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
// metadata, else a Hugging Face source (whose index and headers each rank
// then reads itself); no collective in any case.
absl::StatusOr<LoadResult> LoadRankLocal(StateDict& state,
                                         absl::StatusOr<Storage*> storage,
                                         const LoadOptions& options,
                                         std::string_view source_file) {
  const auto start = std::chrono::steady_clock::now();
  const Ranks ranks(options.comm);
  const int rank = ranks.rank();
  const std::string context = absl::StrCat("rank-local load of rank ", rank);
  CAIRN_RETURN_IF_ERROR(Annotate(storage.status(), context));
  Storage& st = **storage;
  const std::string folder = internal_format::RankFolderName(rank);
  const std::string local_name = absl::StrCat(folder, "/", kMetadataFileName);
  absl::StatusOr<Metadata> metadata =
      source_file.empty() ? ReadAndValidate(st, local_name)
                          : absl::NotFoundError("");
  bool imported = false;
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
    PrefixKvFiles(metadata->kv_tables, folder);
  } else if (absl::IsNotFound(metadata.status())) {
    metadata = source_file.empty() ? ReadAndValidate(st)
                                   : absl::NotFoundError("");
    if (absl::IsNotFound(metadata.status())) {
      absl::StatusOr<bool> source = HasImportSource(st, source_file);
      CAIRN_RETURN_IF_ERROR(Annotate(source.status(), context));
      imported = *source;
    }
    if (imported) {
      metadata = ReadAnyMetadata(st, source_file, options.import_names);
    } else if (absl::IsNotFound(metadata.status())) {
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

absl::StatusOr<Metadata> ReadMetadataFromStorage(Storage& storage) {
  return ReadAndValidate(storage);
}

absl::StatusOr<Metadata> ReadAnyMetadata(Storage& storage,
                                         std::string_view source_file,
                                         const ImportNames& names) {
  if (source_file.empty()) {
    absl::StatusOr<Metadata> md = ReadAndValidate(storage);
    if (!absl::IsNotFound(md.status())) return md;
    CAIRN_ASSIGN_OR_RETURN(bool source, HasImportSource(storage, source_file));
    if (!source) return NothingToLoad(md.status());
  }
  CAIRN_ASSIGN_OR_RETURN(ImportSource imported,
                         ReadImportSource(storage, source_file));
  return BuildImportedMetadata(imported, names);
}

absl::StatusOr<Metadata> ReadMetadataFile(Storage& storage,
                                          const std::string& name) {
  return ReadAndValidate(storage, name);
}

namespace {

// `prior`: this rank's outcome of the steps before (reading or decoding
// the metadata); when it failed, the rank only reports it in the planning
// gather, so every rank returns the same error. `source_digest`: the
// digest of the metadata bytes this rank read itself (DigestToHex), empty
// when every rank has the coordinator's (or the caller's); the
// coordinator compares them in the planning gather.
absl::StatusOr<LoadResult> LoadWithMetadataImpl(
    StateDict& state, absl::StatusOr<Storage*> storage,
    const Metadata& metadata, const LoadOptions& given,
    const absl::Status& prior, std::string_view source_digest);

absl::StatusOr<LoadResult> LoadWithMetadataAfter(
    StateDict& state, absl::StatusOr<Storage*> storage,
    const Metadata& metadata, const LoadOptions& given,
    const absl::Status& prior, std::string_view source_digest);

}  // namespace

absl::StatusOr<LoadResult> LoadWithMetadata(StateDict& state,
                                            absl::StatusOr<Storage*> storage,
                                            const Metadata& metadata,
                                            const LoadOptions& given) {
  return LoadWithMetadataAfter(state, storage, metadata, given,
                               absl::OkStatus(), /*source_digest=*/"");
}

namespace {

absl::StatusOr<LoadResult> LoadWithMetadataAfter(
    StateDict& state, absl::StatusOr<Storage*> storage,
    const Metadata& metadata, const LoadOptions& given,
    const absl::Status& prior, std::string_view source_digest) {
  // An incremental checkpoint's chunks in its references are read through
  // a ReferencingStorage (format version 6).
  if (!storage.ok() || !prior.ok() || metadata.references.empty() ||
      dynamic_cast<ReferencingStorage*>(*storage) != nullptr) {
    return LoadWithMetadataImpl(state, storage, metadata, given, prior,
                                source_digest);
  }
  ReferencingStorage referencing(**storage, metadata.references,
                                 StorageOptions{.s3 = given.s3});
  return LoadWithMetadataImpl(state, &referencing, metadata, given, prior,
                              source_digest);
}

absl::StatusOr<LoadResult> LoadWithMetadataImpl(
    StateDict& state, absl::StatusOr<Storage*> storage,
    const Metadata& metadata, const LoadOptions& given,
    const absl::Status& prior, std::string_view source_digest) {
  // Files cairn did not write have no checksums to check (and node reads
  // exist to check chunks whole).
  LoadOptions without_checks;
  if (!metadata.has_checksums) {
    without_checks = given;
    without_checks.verify_checksums = false;
    without_checks.share_node_reads = false;
  }
  const LoadOptions& options = metadata.has_checksums ? given : without_checks;
  const auto start = std::chrono::steady_clock::now();
  const Ranks ranks(options.comm);
  Communicator* comm = &ranks.comm();
  const int rank = ranks.rank();
  const int world = ranks.size();
  const bool coordinator = ranks.coordinator();
  DefaultLoadPlanner default_planner(options.strict);
  LoadPlanner& planner =
      options.planner != nullptr ? *options.planner : default_planner;

  // 2. Plan (a rank that failed before only reports that).
  absl::Status local = storage.status();
  if (local.ok()) local = prior;
  LoadPlan local_plan;
  if (local.ok()) local = planner.SetUp(state, metadata, coordinator, rank, world);
  if (local.ok()) {
    absl::StatusOr<LoadPlan> p = planner.CreateLocalPlan();
    local = p.status();
    if (p.ok()) local_plan = *std::move(p);
  }
  std::string message;
  // The key-value tables this rank asks for (step 7).
  std::vector<KvRequest> kv_requests;
  std::vector<std::string> kv_missing;
  if (local.ok()) {
    absl::StatusOr<std::vector<KvRequest>> k =
        PlanKvLoads(metadata, options, world, rank, kv_missing);
    local = k.status();
    if (k.ok()) kv_requests = *std::move(k);
  }
  if (local.ok()) {
    absl::StatusOr<std::string> m =
        EncodeLocalLoadPlan(planner, local_plan, metadata,
                            options.share_node_reads);
    local = m.status();
    if (m.ok()) message = *std::move(m);
  }
  // The gather carries the digest of the metadata this rank read (step 1)
  // behind its plan.
  if (local.ok()) internal_core::AppendTrailer(message, source_digest);
  absl::StatusOr<std::vector<std::string>> gathered =
      GatherOrError(*comm, local, message, kOperation, "planning");
  message = std::string();
  absl::Status global = gathered.status();
  std::vector<std::string> finals;
  if (coordinator && global.ok()) {
    const absl::Status same = TakeSourceDigests(
        *gathered, source_digest, storage.ok() ? (*storage)->url() : "");
    absl::StatusOr<std::vector<std::string>> planned =
        same.ok() ? PlanLoadGlobally(planner, metadata, *gathered,
                                     options.broadcast_replicas)
                  : absl::StatusOr<std::vector<std::string>>(same);
    global = planned.status();
    if (planned.ok()) finals = *std::move(planned);
  }
  gathered = std::vector<std::string>();
  CAIRN_ASSIGN_OR_RETURN(std::string mine,
                         ScatterOutcome(*comm, global, std::move(finals)));
  internal_core::ByteReader header(mine, "load plan from the coordinator");
  const uint8_t kind = header.U8();
  const bool any_group = header.U8() != 0;
  const bool node_reads = header.U8() != 0;
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
  // Commits items as their checks pass (steps 3e and 4).
  std::optional<Committer> committer;
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
    committer.emplace(planner,
                      plan.ok() ? std::span<const ReadItem>(plan->items)
                                : std::span<const ReadItem>(),
                      options.verify_checksums);
    // One loader: the data files and IO threads stay from wave to wave.
    Loader reader(**storage, metadata, options);
    reader.StaggerFor(rank, world);
    const bool grouped = group_comm != nullptr && group_comm->size() > 1;
    // 3, first: when any rank asked for node reads, chunks that ranks of a
    // node need strided parts of are read once on the node (load_node.cc;
    // every rank takes part); the rest of the plan goes on.
    LoadResult node_result;
    if (node_reads) {
      absl::StatusOr<std::vector<ReadItem>> rest = ReadOncePerNode(
          *comm, plan.ok() ? *plan : LoadPlan{}, grouped, planner, reader,
          metadata, options, phases, *committer, node_result);
      CAIRN_RETURN_IF_ERROR(rest.status());
      if (plan.ok()) plan->items = *std::move(rest);
    }
    absl::StatusOr<LoadResult> r;
    if (grouped) {
      r = StagedLoad(*group_comm, plan, planner, reader, **storage, metadata,
                     options, options.broadcast_batch_bytes, phases, shared,
                     *committer);
    } else {
      CAIRN_RETURN_IF_ERROR(plan.status());
      // A group of one: no broadcast, only waves (and staging for sinks
      // and device destinations).
      std::unique_ptr<Communicator> alone = LocalCommunicator();
      r = StagedLoad(*alone, plan, planner, reader, **storage, metadata,
                     options, options.device_batch_bytes, phases, shared,
                     *committer);
      if (r.ok()) r->replica_group_size = 1;
    }
    if (r.ok()) {
      r->bytes_read += node_result.bytes_read;
      r->bytes_loaded += node_result.bytes_loaded;
      r->chunks_verified += node_result.chunks_verified;
      r->device_bytes += node_result.device_bytes;
      r->io_threads = std::max(r->io_threads, node_result.io_threads);
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
  uint64_t shared_checked = 0;
  std::vector<std::pair<uint32_t, uint64_t>> unchecked;
  bool parts = false;
  if (!metadata.has_checksums) {
    // A source without checksums (a Hugging Face folder) has no parts
    // to combine: the ranks only agree on their reads, with one
    // AllReduce instead of a gather and a broadcast. Every rank has the
    // same metadata, so every rank takes this branch.
    CAIRN_RETURN_IF_ERROR(AgreeOnStatus(*comm, read, kOperation, "reading"));
  } else {
    std::string mine_pieces;
    if (read.ok()) {
      absl::StatusOr<std::string> encoded = EncodeSharedPieces(metadata, shared);
      read = encoded.status();
      if (encoded.ok()) mine_pieces = *std::move(encoded);
    }
    absl::StatusOr<std::vector<std::string>> pieces =
        GatherOrError(*comm, read, mine_pieces, kOperation, "reading");
    absl::Status verdict = pieces.status();
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
        // Whether any rank read parts of chunks (so holds items that wait).
        w.U8(shared_checked > 0 || !unchecked.empty() ? 1 : 0);
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
    {
      internal_core::ByteReader in(unchecked_message,
                                   "unchecked chunks from the coordinator");
      parts = in.U8() != 0;
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
  }
  // 6. The items that are parts of chunks commit now that the checks of
  // their bytes passed; where there were parts, the ranks agree on their
  // commits, so that every rank returns the same verdict.
  absl::Status committed =
      committer ? committer->CommitRest() : absl::OkStatus();
  if (parts) {
    CAIRN_RETURN_IF_ERROR(AgreeOnStatus(*comm, committed, kOperation,
                                        "committing the parts of chunks"));
  }
  CAIRN_RETURN_IF_ERROR(committed);
  // 7. The key-value tables, when the checkpoint has any (every rank).
  if (!metadata.kv_tables.empty()) {
    CAIRN_RETURN_IF_ERROR(LoadKvTables(**storage, metadata, kv_requests,
                                       options, *comm, *result));
  }
  result->missing.insert(result->missing.end(), kv_missing.begin(),
                         kv_missing.end());
  // Every byte returned passed a check unless checks are off.
  (options.verify_checksums ? result->bytes_verified
                            : result->bytes_unverified) = result->bytes_loaded;
  result->chunks_verified += shared_checked;
  result->source_has_checksums = metadata.has_checksums;
  result->world_size = world;
  result->phases = phases;
  result->phases.planning = planning_done;
  result->seconds = Since(start);
  return result;
}

}  // namespace

absl::StatusOr<LoadResult> LoadFromStorage(StateDict& state,
                                           absl::StatusOr<Storage*> storage,
                                           const LoadOptions& options,
                                           std::string_view source_file) {
  if (options.rank_local) {
    return LoadRankLocal(state, storage, options, source_file);
  }
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
  // A folder without metadata.json may be a Hugging Face folder (or the
  // URL a .safetensors file): the coordinator sends its index and headers
  // instead (hf_import.h), and every rank builds the same metadata.
  // In a job of at most kSelfReadMaxRanks ranks every rank reads either
  // itself instead, and the planning gather compares the digests of what
  // they read (TakeSourceDigests).
  const bool self_read = comm.size() > 1 && comm.size() <= kSelfReadMaxRanks;
  std::string text;
  absl::Status read = storage.status();
  if ((self_read || comm.rank() == kCoordinator) && read.ok()) {
    absl::StatusOr<std::string> bytes =
        source_file.empty() ? ReadMetadataText(**storage, kMetadataFileName)
                            : absl::NotFoundError("");
    if (absl::IsNotFound(bytes.status())) {
      absl::StatusOr<bool> source = HasImportSource(**storage, source_file);
      if (source.ok() && !*source) bytes = NothingToLoad(bytes.status());
      if (!source.ok() || *source) {
        absl::StatusOr<ImportSource> imported =
            source.ok() ? ReadImportSource(**storage, source_file)
                        : absl::StatusOr<ImportSource>(source.status());
        bytes = imported.ok() ? EncodeImportSource(*imported)
                              : absl::StatusOr<std::string>(imported.status());
      }
    }
    read = bytes.status();
    if (bytes.ok()) text = *std::move(bytes);
  }
  std::string shared;
  std::string digest;  // of what this rank read itself
  if (self_read) {
    shared = std::move(text);
    if (read.ok()) {
      digest = internal_format::DigestToHex(internal_format::BlockDigest(
          reinterpret_cast<const std::byte*>(shared.data()), shared.size()));
    }
  } else {
    CAIRN_ASSIGN_OR_RETURN(shared,
                           BroadcastOutcome(comm, read, std::move(text)));
  }
  absl::StatusOr<Metadata> metadata =
      self_read && !read.ok() ? absl::StatusOr<Metadata>(read)
      : !shared.empty() && shared[0] == kImportSourceMarker
          ? [&]() -> absl::StatusOr<Metadata> {
              CAIRN_ASSIGN_OR_RETURN(ImportSource source,
                                     DecodeImportSource(shared));
              return BuildImportedMetadata(source, options.import_names);
            }()
          : DecodeAndValidate(
                shared,
                storage.ok()
                    ? absl::StrCat((*storage)->url(), "/", kMetadataFileName)
                    : absl::StrCat(kMetadataFileName, " from the coordinator"),
                /*coverage=*/comm.rank() == kCoordinator);
  internal_core::ReleaseStorage(shared);
  // No agreement of its own: a rank that could not read or decode the
  // metadata says so in the planning gather, which every rank takes part
  // in and whose answer carries the combined error to all (one collective
  // fewer per load: each waits for descheduled ranks where a node has
  // more ranks than cores).
  const absl::Status decoded =
      Annotate(metadata.status(), "reading metadata");
  const double metadata_seconds = Since(start);
  const Metadata none;  // what a rank that could not decode plans with
  absl::StatusOr<LoadResult> result = LoadWithMetadataAfter(
      state, storage, metadata.ok() ? *metadata : none, opts, decoded, digest);
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
    // Absent from the map: ValidateAgainstFileSizes names it; but a file
    // in a reference (format version 6) has the reason it is missing (the
    // referenced checkpoint gone, or another one there).
    if (absl::IsNotFound(f.status()) &&
        internal_format::ValidateRelativeName(loc.file).ok()) {
      return absl::OkStatus();
    }
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
  for (const auto& [fqn, table] : metadata.kv_tables) {
    for (const KvChunkMetadata& c : table.chunks) {
      CAIRN_RETURN_IF_ERROR(note_file(c.ids));
      for (const ByteLocation& loc : c.columns) {
        CAIRN_RETURN_IF_ERROR(note_file(loc));
      }
    }
  }
  CAIRN_RETURN_IF_ERROR(
      internal_format::ValidateAgainstFileSizes(metadata, file_sizes));
  // Inside real files and sharing no bytes: the total a caller allocates
  // from these locations is at most the files' total size.
  return internal_format::ValidateDisjointLocations(metadata);
}

absl::StatusOr<StateDict> LoadAllFromStorage(Storage& own_storage,
                                             const LoadOptions& options,
                                             std::string_view source_file) {
  CAIRN_ASSIGN_OR_RETURN(
      Metadata metadata,
      ReadAnyMetadata(own_storage, source_file, options.import_names));
  // Chunks kept in references (format version 6) are read there.
  ReferencingStorage storage(own_storage, metadata.references,
                             StorageOptions{.s3 = options.s3});
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
