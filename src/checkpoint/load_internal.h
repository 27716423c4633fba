// What the files of the load (load*.cc in this folder) share: the load
// protocol, and which file implements each step, is load.cc's top comment.
// What only one file uses stays in that file's anonymous namespace. Each
// declaration here carries the comment that stood on its definition; the
// Loader's private members, declared here only because the class needs
// them, keep theirs where they are defined (load_slabs.cc, load_read.cc).
#ifndef CAIRN_CHECKPOINT_LOAD_INTERNAL_H_
#define CAIRN_CHECKPOINT_LOAD_INTERNAL_H_

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/box.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/dtype.h"
#include "cairn/metadata.h"
#include "cairn/planner.h"
#include "cairn/storage.h"
#include "cairn/tensor.h"
#include "checkpoint/checkpoint_impl.h"
#include "core/buffer_pool.h"
#include "core/parallel.h"
#include "core/scratch_bytes.h"
#include "core/status.h"
#include "core/strided.h"
#include "cuda/device_runtime.h"
#include "format/crc32c.h"
#include "format/frame_codec.h"
#include "format/safetensors.h"

namespace cairn::internal_checkpoint {

// The operation named in the load's collective errors.
inline constexpr char kOperation[] = "load";

// Seconds since `start`, for LoadResult::phases.
inline double Since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

// ---------------------------------------------------------------------------
// Step 2, plan (load_plan.cc).

// A rank's planning message, and the coordinator's answer, start with one
// of these: the whole plan (a planner whose CreateGlobalPlan may change
// plans), or a summary of it (DefaultLoadPlanner and its subclasses, whose
// global plan is the local plans unchanged: each rank keeps its own).
enum PlanMessage : uint8_t { kFullPlan = 1, kPlanSummary = 2 };

// The names of the leaves set in `bits` (LeafBits), sorted.
absl::StatusOr<std::vector<std::string>> LeafNames(const Metadata& metadata,
                                                   std::string_view bits);

// Collective over `comm` (every rank, when any group has several members):
// the coordinator grouped ranks by a hash of what their plans read, so each
// member checks `plan` against its group leader's, byte for byte; if any
// rank's differs, every rank drops its group (`group` reset: the load reads
// everything itself instead of broadcasting).
absl::Status KeepVerifiedGroup(Communicator& comm, const LoadPlan& plan,
                               std::unique_ptr<Communicator>& group);

// ---------------------------------------------------------------------------
// Step 3, read (load_slabs.cc, load_read.cc).

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
                         std::string_view note, uint32_t computed);

// OK when `pieces` (in any order) tile `loc`'s bytes and their combined
// CRC32C is its stored one; kDataLoss naming `what`, the file and offset
// when it is not; an internal error when they do not tile. `note` follows
// the offset in messages (", read in 3 pieces").
absl::Status CheckPieces(std::string_view what, const ByteLocation& loc,
                         std::vector<CrcPiece> pieces, std::string_view note);

// The checksummed pieces so far of a chunk read over several Read calls.
struct CarriedCheck {
  std::string what;  // "model.wq [0:1024, 0:512]"
  std::vector<CrcPiece> pieces;
};

struct ReadTask {
  enum class Mode : uint8_t { kDirect, kSpan, kRuns, kObject, kFrames };
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
  // kFrames (a compressed chunk, load_frames.cc): frames [first_frame,
  // first_frame + frame_count) of `frames_of`, whose stored bytes `span`
  // bytes from file_offset hold; each is checked, decompressed into a
  // buffer and checked again, then the copies are made from the slab's
  // first raw byte (check_offset bytes into the chunk), which lies
  // check_offset - first_frame * frame_bytes bytes into that buffer.
  // With `dst` set (and no copies), the slab is raw_bytes contiguous raw
  // bytes of the chunk going to dst.
  const ByteLocation* frames_of = nullptr;
  uint64_t first_frame = 0;
  uint64_t frame_count = 0;
  uint64_t frame_bytes = 0;
  uint64_t raw_bytes = 0;
};

// The byte strides of a row-major block of `sizes`, elements of `es` bytes.
std::vector<int64_t> RowMajorByteStrides(const Shape& sizes, size_t es);

// Bytes from the first to the last byte of a block of `sizes` (none of
// them 0) laid out with `byte_strides`.
uint64_t SpanBytes(const std::vector<int64_t>& sizes,
                   const std::vector<int64_t>& byte_strides, size_t es);

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
                         absl::FunctionRef<absl::Status(const Box&)> fn);

// Where `item`'s stored bytes are: its chunk's location, or its object's;
// null when the metadata has no such tensor, chunk or object.
const ByteLocation* LocationOf(const Metadata& metadata, const ReadItem& item);

// A destination and the part of one stored chunk it needs.
struct Target {
  TensorView dst;  // shape overlap.sizes
  Box overlap;     // global coordinates
};

// Step 3 on one rank: checks the planner's items and destinations, opens
// the data files and checks their headers, cuts what the items need into
// read tasks, runs them on IO threads and checks what they read.
class Loader {
 public:
  Loader(Storage& storage, const Metadata& metadata, const LoadOptions& options)
      : storage_(storage), metadata_(metadata), options_(options) {}

  // True when the chunk or object at `loc` passed its CRC32C on this
  // rank: read whole, in one Read or over several (CheckAcrossReads). A
  // part of a chunk never does here: the coordinator checks parts (step 4).
  bool Verified(const ByteLocation* loc) const {
    return verified_.contains(loc);
  }

  // Reads items[i] into dsts[i], for every i. May be called again (a staged
  // load's batches): the data files an earlier call opened, and checked the
  // headers of, stay open.
  absl::Status Read(const std::vector<ReadItem>& items,
                    const std::vector<Destination>& dsts);

  // This loader's rank of `world` ranks that read the same files at the
  // same time: each Read starts its tasks rank/world of the way into them,
  // in file order, and wraps around. So each rank reads a region of a
  // cold file first that no other rank reads at the same moment, which
  // the page cache then holds in large folios (mapping a cached 91 MB
  // model whole cost 0.1-0.5 ms of system time afterwards, against
  // 2.9-5.4 ms after four ranks read it from the start together; issue
  // 37).
  void StaggerFor(int rank, int world) {
    stagger_rank_ = rank;
    stagger_world_ = world;
  }

  // What the reads so far did; the next Read counts afresh.
  LoadResult TakeResult() { return std::exchange(result_, LoadResult{}); }

  // Adds what the reads so far did to `into` (bytes read, chunks checked,
  // IO threads; not bytes_loaded, which callers that stage count
  // themselves) and starts counting afresh.
  void TakeReadsInto(LoadResult& into) {
    const LoadResult r = TakeResult();
    into.bytes_read += r.bytes_read;
    into.chunks_verified += r.chunks_verified;
    into.io_threads = std::max(into.io_threads, r.io_threads);
  }

  // The pieces of chunks this rank read only parts of, over all its Reads
  // (adjacent pieces merged), for CheckSharedPieces; the next Read
  // collects afresh.
  std::vector<SharedPieces> TakeSharedPieces();

  // Declares every tensor item this reader will be given over its Read
  // calls (a staged load's batches). A stored chunk that these items tile
  // in contiguous pieces, none of them the whole chunk (a tensor split to
  // fit staging), is checksummed piece by piece as the pieces land, on the
  // IO threads, and compared with its CRC32C in the Read that completes
  // it. (A chunk whose items all fall in one Read is read as one region
  // and checked there, as always.)
  void CheckAcrossReads(std::span<const ReadItem> items);

  // Opens the data files that hold `items`' bytes and checks each needed
  // location against its file's header (as a Read does, without reading),
  // so that a mismatch anywhere in a plan read over several Reads is found
  // before the first byte lands. Items the metadata lacks are left to the
  // Read that gets them.
  absl::Status CheckEntries(std::span<const ReadItem> items);

  // After the last Read: an error if a chunk declared to CheckAcrossReads
  // was not read whole (so not checked).
  absl::Status FinishAcrossReads() const;

  // `dst` when it fits `item` (see CheckItem; a device view or a sink is
  // allowed: StagedLoad reads them through host staging), else the error.
  absl::StatusOr<Destination> CheckDestination(const ReadItem& item,
                                               const Destination& dst);

 private:
  // Checking items and destinations, and cutting what they need into read
  // tasks (load_slabs.cc).
  absl::Status PlanObject(const ReadItem& item, const Destination& dst);
  absl::StatusOr<const TensorMetadata*> CheckItem(const ReadItem& item,
                                                  const Destination& dst,
                                                  bool allow_device);
  absl::Status PlanChunk(const std::string& fqn, const TensorMetadata& tm,
                         const ChunkMetadata& chunk,
                         const std::vector<Target>& targets);
  int FileIndex(const std::string& name);
  int AddCheck(std::string what, const ByteLocation* location,
               Check::Kind kind = Check::Kind::kWhole,
               const std::string* fqn = nullptr, size_t chunk = 0,
               const Box& region = {});
  absl::Status PlanRegion(const std::string& fqn, const TensorMetadata& tm,
                          const ChunkMetadata& chunk, const Box& overlap,
                          std::span<const Target> targets);
  absl::Status AddCopies(ReadTask& task, std::span<const Target> targets,
                        const Box& slab, const std::vector<int64_t>& cs,
                        size_t es, std::vector<std::vector<int64_t>>* within);
  absl::Status PlanFrames(const std::string& what, const TensorMetadata& tm,
                          const ChunkMetadata& chunk, const Box& overlap,
                          std::span<const Target> targets, int file);
  absl::Status AddSlabTask(const ChunkMetadata& chunk,
                           std::span<const Target> targets, const Box& slab,
                           int file, int check, const std::string& what,
                           size_t es, const std::vector<int64_t>& cs);
  bool Coalesced(const internal_core::RunPattern& runs) const;
  static bool IsDense(const std::vector<int64_t>& shape,
                      const std::vector<int64_t>& strides, size_t es);

  // Opening the data files, running the read tasks and checking what they
  // read (load_read.cc).
  absl::Status CheckLocations();
  bool AllInMemory() const;
  int ReadThreads(bool in_memory) const;
  // `in_memory`: AllInMemory held for this Execute's tasks.
  absl::Status RunTask(const ReadTask& t, internal_core::BufferPool& pool,
                       uint32_t* crc, bool in_memory);
  absl::Status RunFramesTask(const ReadTask& t);
  // A kFrames task's buffers and decompressor, kept from task to task
  // (buffers only grow, so they are not cleared again).
  struct FrameScratch {
    internal_core::ScratchBytes stored;
    internal_core::ScratchBytes raw;
    internal_format::FrameDecompressor decompressor;
  };
  std::unique_ptr<FrameScratch> TakeFrameScratch();
  void GiveFrameScratch(std::unique_ptr<FrameScratch> scratch);

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

  std::vector<Group> GroupSmallReads(const std::vector<size_t>& order,
                                     uint64_t buffer_bytes, bool group) const;
  absl::Status RunGroup(const Group& g, const std::vector<size_t>& order,
                        internal_core::BufferPool& pool,
                        std::vector<uint32_t>& crcs);
  static uint32_t Checksum(const ReadTask& t, const std::byte* src);
  static uint32_t SignRuns(const ReadTask& t, const std::byte* src,
                           bool packed);
  static void CopyOut(const ReadTask& t, const std::byte* src);
  absl::Status Execute();
  absl::Status CheckCarried(const ByteLocation* loc);

  // A location a Read needs, and the header entry it must be.
  struct Needed {
    int file;
    const ByteLocation* location;
    std::string what;  // the entry's name: EntryName, or an object's FQN
    DType dtype;
    const Shape* shape;  // the chunk's box sizes; null for an object
    // `what` is a source entry that holds the chunk (Metadata::
    // source_entries): SourceEntryMismatch checks it.
    bool source = false;
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
  int stagger_rank_ = 0;
  int stagger_world_ = 1;
  // Each stored tensor's FQN: its key in metadata_.tensors, which
  // outlives this loader.
  std::map<const TensorMetadata*, const std::string*> fqn_of_;
  // Chunks read in pieces over several Reads, until checked.
  std::map<const ByteLocation*, CarriedCheck> carried_;
  // Chunks this rank read parts of, the rest read by other ranks.
  std::map<const ByteLocation*, SharedPieces> shared_;
  // Chunks and objects whose CRC32C matched (see Verified).
  absl::flat_hash_set<const ByteLocation*> verified_;
  // SignRuns' tables, by the row stride they shift by (AddSlabTask).
  static constexpr int64_t kMinRunsForShifter = 32;
  std::map<int64_t, std::unique_ptr<internal_format::Crc32cShifter>> shifters_;
  // The IO threads, kept from Read to Read: a staged load reads batch by
  // batch, and starting the threads for every batch cost 0.34-0.47 ms a
  // batch on the 2-core VM.
  internal_core::WorkerPool pool_;
  std::mutex frame_scratch_mu_;
  std::vector<std::unique_ptr<FrameScratch>> frame_scratch_;
};

// ---------------------------------------------------------------------------
// Steps 3e and 4, commit (load_commit.cc).

// Commits read items with the planner only once every check that covers
// their bytes has passed: an item whose chunk (or object) this rank
// checked whole commits in the wave that read it; an item that is a part
// of a chunk waits for the coordinator's combined check of the parts
// (step 4) and, for slices, step 5, and commits in CommitRest. Sinks hear
// Complete(fqn) once the last of this rank's items of the tensor committed.
class Committer {
 public:
  // `items`: this rank's whole plan (for counting each tensor's items).
  // `verify`: LoadOptions::verify_checksums; without it nothing is checked
  // and every item commits as soon as it is in.
  Committer(LoadPlanner& planner, std::span<const ReadItem> items, bool verify);

  // `item`'s bytes are in its destination (`sink`: the item's sink, if it
  // has one); `checked`: they passed a check that covers them all.
  void Add(const ReadItem& item, const std::shared_ptr<LoadSink>& sink,
           bool checked);

  // Commits every item added as checked, and every waiting item whose
  // location `checked_now` now says is checked (a chunk read in pieces
  // over several waves completes in a later one).
  absl::Status CommitChecked(
      absl::FunctionRef<bool(const ReadItem&)> checked_now);

  // After step 4 (and 5) passed: commits the items that waited for them.
  absl::Status CommitRest();

  // Items added and not committed yet.
  size_t waiting() const { return waiting_.size(); }

 private:
  absl::Status Commit(const ReadItem& item);

  LoadPlanner& planner_;
  const bool verify_;
  std::vector<ReadItem> ready_;    // added as checked, to commit
  std::vector<ReadItem> waiting_;  // parts: wait for step 4
  // Items of each stored tensor or object this rank has not committed
  // yet, and the sinks its committed items went to.
  absl::flat_hash_map<std::string, size_t> left_;
  absl::flat_hash_map<std::string, std::vector<std::shared_ptr<LoadSink>>>
      sinks_;
};

// ---------------------------------------------------------------------------
// Step 3 through host staging (load_staged.cc).

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
  bool Has(Device device) const {
    for (const auto& [d, runtime] : runtimes_) {
      if (d == device) return true;
    }
    return false;
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


// Step 3 in waves (load_staged.cc), for every load but the rank-local
// one: the plan's items are resolved (ResolveDestination), read, checked,
// placed and committed a wave at a time. Host memory destinations are read
// in place and cost no staging; sinks, device destinations and (in a
// replica group) what members receive go through host staging, and a wave
// holds at most StagingLimit bytes of it. Alone (`group` of one), waves
// are cut as items resolve, and a staged item larger than a wave is read
// in pieces; a load into host memory only is one wave. In a replica group
// (`group` of several members, which all have the same items in the same
// order), wave boundaries depend on item sizes only, each item is read by
// one member (largest items first, each to the member with the fewest
// bytes so far), the group agrees that the wave's reads succeeded, and the
// owners broadcast; the next wave's reads run (on a thread of their own)
// while a wave is broadcast and placed. Device copies of one wave run
// while the next is read (two pinned staging buffers alternate). A sink
// gets an item's bytes only once a check covers them: its chunk read
// whole, or its whole blocks checked from the staged bytes, or else the
// checksum blocks around the piece read again (VerifyChunkParts).
absl::StatusOr<LoadResult> StagedLoad(Communicator& group,
                                      const absl::StatusOr<LoadPlan>& plan,
                                      LoadPlanner& planner, Loader& reader,
                                      Storage& storage,
                                      const Metadata& metadata,
                                      const LoadOptions& options,
                                      uint64_t batch_bytes,
                                      LoadPhaseTimes& phases,
                                      std::vector<SharedPieces>& shared,
                                      Committer& committer);

// Where a staged piece of `bytes` goes in staging that has `used` bytes
// taken: aligned for copies, and a large piece's first byte sits, modulo a
// page, where it does in its file (`file_offset`), so that a cold read of
// it can go O_DIRECT (the file backend reads a page-aligned middle straight
// from the device only into an address with the file offset's alignment).
// Costs under a page per large piece.
uint64_t StagingSlot(uint64_t used, uint64_t bytes, uint64_t file_offset);

// The staged bytes a wave may hold: `batch_bytes`, within half of what
// LoadOptions::memory_budget_bytes leaves after the reads' bounce buffers
// (io_threads of bounce_buffer_bytes; two staging buffers alternate when
// devices are written). At least 64 bytes: one item a wave, however large.
uint64_t StagingLimit(const LoadOptions& options, uint64_t batch_bytes);

// ---------------------------------------------------------------------------
// Step 3, first part: chunks read once per node (load_node.cc).

// Collective over `comm`, called by every rank when any rank asked for
// node reads (the planning step tells them all), with its final plan;
// `grouped`: the rank reads in a replica group of several members and
// takes no part beyond the Split.
// When ranks of one node (same host name) need strided parts of the same
// stored chunks (a column reshard), each such chunk that fits a wave is
// read whole once on the node, by one of them, checked whole, and every
// member is handed its parts (Scatter), places them and commits them.
// Returns the items of `plan` left for StagedLoad; a rank that failed
// returns its own error (the others theirs, or OK: step 4 agrees).
absl::StatusOr<std::vector<ReadItem>> ReadOncePerNode(
    Communicator& comm, const LoadPlan& plan, bool grouped,
    LoadPlanner& planner, Loader& reader, const Metadata& metadata,
    const LoadOptions& options, LoadPhaseTimes& phases, Committer& committer,
    LoadResult& result);

// Tests: the node each rank runs on is name(rank) instead of the host name
// (nullptr restores it), so that one host can play several nodes.
void SetNodeNameForTesting(std::string (*name)(int rank));

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_LOAD_INTERNAL_H_
