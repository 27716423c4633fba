// Save and load checkpoints.
//
//   cairn::StateDict sd = ...;                    // views of your tensors
//   CAIRN_ASSIGN_OR_RETURN(auto saved, cairn::Save(sd, "/ckpt/step-100"));
//   ...
//   cairn::StateDict dst = ...;                   // views of destinations,
//   auto loaded = cairn::Load(dst, "/ckpt/step-100");  // any sharding
//
// A checkpoint is committed when its metadata.json exists: Save writes every
// data file durably first and the metadata last (temp file, fsync, rename,
// fsync directory), so a crash at any point leaves either the previous state
// or a complete checkpoint, never a half-written one that loads.
//
// Load fills the caller's destination views in place. Destinations may be
// sharded differently from the saved chunks (resharding): each destination
// box reads only the byte ranges that overlap it. Chunks read whole are
// checked against their CRC32C. Destinations may be device (CUDA) memory:
// Load waits for the device's queued work, reads through pinned host
// staging and has copied every byte to the device when it returns (on an
// error, device destinations may be partly written).
//
// Load, LoadAll and ReadMetadata also read a Hugging Face model folder
// (model.safetensors, or the files of model.safetensors.index.json) or a
// single .safetensors file as a checkpoint of one chunk per tensor: see
// include/cairn/huggingface.h; names: LoadOptions::import_names.
//
// Distributed: with SaveOptions::comm / LoadOptions::comm set, every rank of
// the communicator calls Save (or Load) with the same URL and its own part
// of the state; rank 0 coordinates. A save writes one data file per rank
// that has bytes to write; replicated boxes are written once; the
// coordinator writes metadata.json after every rank reports its data
// durable. If any rank fails in any phase, every rank returns the same error
// naming each failed rank, and nothing is committed. A checkpoint saved by
// W ranks loads into any number of ranks with any sharding.
//
// Thread safety: Save and Load may run concurrently on different URLs (with
// different communicators). The tensors being saved must not change until
// Save returns; destinations must not be touched until Load returns.
#ifndef CAIRN_CHECKPOINT_H_
#define CAIRN_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/communicator.h"
#include "cairn/import_names.h"
#include "cairn/kv_table.h"
#include "cairn/metadata.h"
#include "cairn/planner.h"
#include "cairn/state_dict.h"
#include "cairn/storage.h"

namespace cairn {

// Remembers the plan of the previous save made with it, so that a save
// whose every rank has the same local plan (FQNs, dtypes, shapes, boxes,
// object sizes, world size, planner) skips global planning: one small
// AllReduce confirms that nothing changed on any rank. Any difference on
// any rank means full planning; a stale plan is never reused. Each rank
// keeps its own cache object; use one per kind of save (e.g. one for the
// model checkpoints of a training loop).
class SavePlanCache {
 public:
  SavePlanCache();
  ~SavePlanCache();
  SavePlanCache(const SavePlanCache&) = delete;
  SavePlanCache& operator=(const SavePlanCache&) = delete;
  // Forgets the cached plan.
  void Clear();

  struct State;  // internal

 private:
  friend State& CacheState(SavePlanCache&);
  std::unique_ptr<State> state_;
};

struct SaveOptions {
  // Replace a committed checkpoint at the URL; otherwise that is
  // kAlreadyExists. The old checkpoint stays committed and loadable until
  // the new one commits (the new data files have names of their own and
  // metadata.json is replaced in one rename); its files are removed after.
  // Default: false.
  //
  // Only one save into a location runs at a time: a save that finds
  // another holding the location's lock (save.lock) fails on every rank
  // with kAborted, touching nothing.
  bool overwrite = false;
  // The save's id, recorded in metadata.json and in its data files' names:
  // 1 to 64 characters of [0-9A-Za-z_-], the same on every rank, never
  // reused for the same location. Empty (the default): a fresh random id
  // from the coordinator (rank 0 in rank-local mode, whose broadcast of it
  // is then that mode's one collective; pass an id, e.g. made of the job's
  // id and the step, to save rank-locally with no collective at all).
  std::string save_id = "";
  // Concurrent writes in flight per process. Default: 8.
  int io_threads = 8;
  // Write data files with O_DIRECT through aligned buffers where the
  // filesystem allows it; else buffered writes and fdatasync. Default: true.
  bool direct_io = true;
  // How to reach an s3:// URL (endpoint, credentials, part size, retries);
  // empty fields come from the AWS_* environment variables.
  S3Options s3{};
  // Bytes per aligned write buffer; one buffer per IO thread. Default: 8 MiB.
  size_t write_buffer_bytes = size_t{8} << 20;
  // Block checksums: besides each chunk's (and object's) CRC32C, the
  // CRC32C of each block of this many bytes of it (the last block
  // shorter), recorded in metadata.json for every one longer than a block
  // (docs/format.md 4.2). A load that returns part of a chunk then checks
  // it by reading the blocks around that part, not the whole chunk. A
  // power of two in [4096, 2^30]; else kInvalidArgument. Costs 8 bytes of
  // metadata.json per block and no extra pass over the data. Default:
  // 1 MiB.
  uint64_t crc32c_block_bytes = kDefaultCrc32cBlockBytes;
  // Compress tensor chunks (docs/format.md 4.2.1): each chunk of 4 KiB or
  // more is cut into frames of crc32c_block_bytes, compressed on all cores
  // while earlier frames are written, and stored as a U8 entry; a chunk
  // whose first 64 MiB do not shrink below 0.95 of their size is stored
  // raw. kGroupedZstd suits floating-point weights and optimizer state
  // best; kZstd, other data. Loads of any part of a chunk read and
  // decompress only the frames that hold it. Objects and key-value tables
  // stay raw. Default: kNone.
  Codec codec = Codec::kNone;
  // zstd's level for `codec`: from its negative fast levels to 22 (else
  // kInvalidArgument). Default: 1, zstd's fastest regular level: on
  // fine-tuned MiniLM weights and AdamW state (bench/RESULTS.md) it saved
  // faster than level 3 and grouped-zstd stored them smaller. kGroupedZstd
  // frames hold Huffman-coded literals alone, whatever the level; the
  // level applies to those that shrink past a third of their size that
  // way, where zstd's matches are tried too (docs/format.md 4.2.1).
  int codec_level = 1;
  // Incremental checkpoint: the URL of an earlier committed checkpoint (a
  // global one, saved with the same crc32c_block_bytes). A tensor chunk
  // the base stores with the same FQN, box, dtype and shape, and with the
  // same CRC32C and XXH3-128 digest (ChunkDigest) as the bytes being
  // saved, is not written again: metadata.json lists the base among its
  // `references` and names the chunk's file there (docs/format.md
  // 4.2.2). A chunk the base itself keeps in an earlier checkpoint is
  // referenced there, so references never chain: a load opens each
  // referenced checkpoint once, checks that it is the one recorded (its
  // metadata checksum), and reads from it. Before writing, every rank
  // digests the items the base may hold (one pass over their bytes on all
  // cores); every other chunk is digested as it is written, with or
  // without a base, so the next save can reuse it. The base must
  // stay as it is while this checkpoint is kept (CheckpointManager keeps
  // every step a kept step references). Objects and key-value tables are
  // always written. Not with rank_local. Empty (the default): a
  // standalone checkpoint. Every rank passes the same.
  std::string base = "";
  // A JSON object stored in metadata.json under "user". Default: "{}".
  // Only the coordinator's is used.
  std::string user_metadata = "{}";
  // The ranks saving together; null: this process alone (one rank).
  Communicator* comm = nullptr;
  // Null: a DefaultSavePlanner with `dedup`.
  SavePlanner* planner = nullptr;
  // Who writes a box several ranks hold (default planner only).
  DedupPolicy dedup = DedupPolicy::kBalanceBytes;
  // Null: plan every save in full.
  SavePlanCache* plan_cache = nullptr;
  // Key-value tables to save beside the state dict (include/cairn/
  // kv_table.h). Their FQNs share the state dict's name space. Every rank
  // passes the same tables.
  std::vector<KvTableToSave> kv_tables = {};
  // Largest chunk of a table's rows (ids and every column): a rank holds
  // two while it saves (one filling, one being written). Chunks end at a
  // bucket boundary when one falls in their second half. Default: 64 MiB.
  uint64_t kv_chunk_bytes = uint64_t{64} << 20;
  // Rank-local mode: no collective but the save id's broadcast (none when
  // `save_id` is given). Each rank writes its own folder rank-NNNNN/ (its
  // rank in `comm`) with its own data and metadata.json, holding
  // everything it holds (no dedup, no coverage check across ranks), and
  // the save id, which Merge and rank-local loads compare across folders.
  // Loading it back needs the same ranks (LoadOptions::rank_local) until
  // `Merge` turns it into a global checkpoint. With `overwrite`, a global
  // metadata.json at the URL (e.g. from an earlier Merge, which points into
  // the rank folders) is un-committed first. Default: false.
  bool rank_local = false;
};

// Where a save's time went, in seconds, on this rank (phases of
// src/checkpoint/save.cc).
struct SavePhaseTimes {
  double planning = 0;  // local and global plans (or the cache check)
  double prepare = 0;   // the location's lock and the save id (coordinator);
                        // waiting for them elsewhere
  double digest = 0;    // against a base (SaveOptions::base): digests and
                        // CRC32Cs of the items it may hold, one pass over
                        // their bytes before the write (other digests are
                        // taken as the bytes are written)
  double write = 0;     // this rank's data file, written and synced
  double commit = 0;    // gathering results, metadata.json (coordinator);
                        // waiting for the outcome elsewhere
};

struct SaveResult {
  // This rank's part.
  uint64_t bytes_written = 0;  // data file bytes, headers included
  uint64_t data_bytes = 0;     // tensor, object and table bytes this rank
                               // wrote
  uint64_t kv_rows = 0;        // key-value table rows this rank wrote
  int files = 0;               // data files this rank wrote
  // Against a base (SaveOptions::base): this rank's tensor chunks that the
  // base held unchanged, and their bytes, referenced instead of written.
  int chunks_reused = 0;
  uint64_t bytes_reused = 0;
  // The whole checkpoint.
  uint64_t checkpoint_bytes = 0;  // data file bytes of all ranks
  int world_size = 1;
  bool plan_cache_hit = false;  // global planning was skipped
  SavePhaseTimes phases;
  double seconds = 0;           // wall time of the whole save
};

// Saves `state` to `url`. Fails before writing anything on a bad state dict
// (duplicate FQN, a shard outside its tensor, shards of all ranks together
// that do not cover a tensor exactly once, ranks that disagree on a
// tensor's dtype or shape, a device tensor in a build or on a machine
// without CUDA), naming the FQN and the ranks.
absl::StatusOr<SaveResult> Save(const StateDict& state, std::string_view url,
                                const SaveOptions& options = {});

struct LoadOptions {
  // Every leaf of the destination state dict must be in the checkpoint
  // (kNotFound naming the FQN otherwise). When false, missing leaves are left
  // untouched and listed in LoadResult::missing. Default: true.
  bool strict = true;
  // Concurrent reads in flight per process. Default: 8.
  int io_threads = 8;
  // How to reach an s3:// URL, as SaveOptions::s3.
  S3Options s3{};
  // Check every byte the load returns. A chunk or object read whole has
  // its CRC32C checked. A part of a chunk of any shape (rows, columns, a
  // 2-d block) is checksummed or signed as it is read, from its own bytes,
  // and the coordinator combines the parts that together cover a chunk,
  // from any ranks, and compares them with the chunk's CRC32C: no byte is
  // read only for the check. A chunk of which the job returns only parts
  // (a slice: an inference worker's shard) is checked after the reads by
  // the ranks that read them: they read the blocks of the chunk around
  // their parts and check the blocks' CRC32Cs (format version 3), or, for
  // a checkpoint without block checksums (versions 1 and 2), read the rest
  // of the chunk and check its CRC32C. False: nothing is checked, and
  // LoadResult::bytes_unverified says so. Default: true.
  bool verify_checksums = true;
  // Needed byte runs of one file closer than this are read with one request.
  // Default: 64 KiB.
  uint64_t coalesce_gap_bytes = uint64_t{64} << 10;
  // Largest single read through a bounce buffer (one per IO thread).
  // Default: 8 MiB.
  uint64_t bounce_buffer_bytes = uint64_t{8} << 20;
  // The ranks loading together; null: this process alone.
  Communicator* comm = nullptr;
  // Null: a DefaultLoadPlanner with `strict`.
  LoadPlanner* planner = nullptr;
  // Broadcast load: ranks whose load plans are identical (data-parallel
  // replicas holding the same boxes) form a replica group; each needed
  // stored byte is read from storage by one member of the group (spreading
  // the bytes evenly over the members) and broadcast to the others,
  // `broadcast_batch_bytes` at a time, so storage serves one copy per group
  // instead of one per replica. It pays where storage is the bottleneck
  // (cold reads, network filesystems); on page-cached local files a read is
  // about as cheap as the broadcast that replaces it. Default: true.
  bool broadcast_replicas = true;
  // Read once per node: when ranks on one host (outside replica groups)
  // need strided parts of the same stored chunk, such as its columns in a
  // column reshard, each of them reads nearly the whole chunk's span.
  // With this set, one of them reads the chunk whole, checks its CRC32C,
  // and hands every other its parts through the communicator (only the
  // bytes each needs travel). It pays where the ranks of a node do not
  // share a cache of what they read (storage read past the page cache,
  // object stores); on local page-cached files the kernel already reads
  // each byte from the device once, and the hand-out costs as many copies
  // as it saves (bench/RESULTS.md, 2026-11-27 fifth). Chunks larger than a
  // wave of staging (see memory_budget_bytes) are read by each rank as
  // before. Default: false.
  bool share_node_reads = false;
  // Staging memory per rank for broadcast load (an item larger than this
  // gets a buffer of its own size). Default: 64 MiB.
  uint64_t broadcast_batch_bytes = uint64_t{64} << 20;
  // Device (GPU) destinations are filled through pinned host staging, a
  // batch of about this many bytes at a time: read, checked, then copied to
  // the device on cairn's stream while the next batch is read. Two buffers
  // of this size per rank; a larger tensor is read in pieces that fit, its
  // chunk's CRC32C checked across them. (In a replica group,
  // broadcast_batch_bytes instead, and an item larger than that gets a
  // buffer of its own size.) Default: 64 MiB.
  uint64_t device_batch_bytes = uint64_t{64} << 20;
  // Host memory a load may hold at once for its reads, staging and
  // broadcast together, per rank. The load proceeds in waves: each
  // resolves its items' destinations, reads, checks, places and commits
  // them before the next, and reuses the wave's buffers. Destinations in
  // host memory are read in place and take none of it (a load into host
  // memory only is one wave); sinks, device destinations and what a
  // replica group's members receive are staged in it. Of the budget, the
  // reads' bounce buffers (io_threads x bounce_buffer_bytes) come first;
  // staging gets half the rest a wave (so two waves' can alternate),
  // at most broadcast_batch_bytes (a group) or device_batch_bytes, and at
  // least one item: an item larger than that is read in pieces when the
  // rank loads alone, or staged whole in a group. 0: no limit beyond
  // those batch sizes. Default: 1 GiB.
  uint64_t memory_budget_bytes = uint64_t{1} << 30;
  // Key-value tables to load (include/cairn/kv_table.h). A table missing
  // from the checkpoint is kNotFound in strict mode, else listed in
  // LoadResult::missing. Each rank's sink gets the rows of its buckets, in
  // batches of at most a quarter of memory_budget_bytes (0: 64 MiB), each
  // checked (its checksum blocks, its ids in their buckets) before it is
  // applied. A sink that fails fails the load on every rank.
  std::vector<KvTableToLoad> kv_tables = {};
  // Rank-local mode: no collective at all. Each rank reads its own
  // rank-NNNNN/metadata.json when it exists, else the global metadata.json,
  // else a Hugging Face source's index and headers (huggingface.h): an
  // inference worker's load with no coordinator and no collective.
  // A destination box that the rank's own folder does not fully hold is an
  // error (merge the checkpoint to reshard it). Default: false.
  bool rank_local = false;
  // Names for a source that is not a cairn checkpoint (a Hugging Face
  // folder or .safetensors file): prefixes and a mapping hook
  // (import_names.h). Ignored for checkpoints. Default: names as stored.
  ImportNames import_names = {};
};

// Where a load's time went, in seconds, on this rank.
struct LoadPhaseTimes {
  double metadata = 0;   // read (coordinator) and exchange metadata.json
  double planning = 0;   // local plans, global plan, exchange
  double read = 0;       // storage reads (and copies straight from them)
  double broadcast = 0;  // broadcast load: moving bytes inside the group
  double copy = 0;       // staged loads (broadcast, device destinations):
                         // staging to destinations, device copies waited for
  double staging = 0;    // staged loads: allocating and freeing the staging
                         // buffers (pinned for device destinations, which
                         // is slow: the driver locks every page)
};

struct LoadResult {
  std::vector<std::string> missing;     // requested but absent (non-strict)
  std::vector<std::string> unexpected;  // in the checkpoint, requested by no rank
  uint64_t bytes_loaded = 0;     // bytes placed into destinations
  uint64_t bytes_read = 0;       // bytes this rank read from storage
  // Chunks and objects whose CRC32C matched: read whole by this rank, or
  // (on the coordinator) read in parts by several ranks; on every rank,
  // the chunks returned only in part whose parts were checked after the
  // load (see verify_checksums).
  uint64_t chunks_verified = 0;
  // Of bytes_loaded, the bytes a checksum covered (their chunk's CRC32C,
  // or the block checksums of the blocks around them), and those it did
  // not. With verify_checksums a load that succeeds returned every byte
  // verified (bytes_unverified is 0); without it, none.
  uint64_t bytes_verified = 0;
  uint64_t bytes_unverified = 0;
  // False when the source holds no checksums (a Hugging Face folder or a
  // .safetensors file that cairn did not write): then nothing could be
  // checked, whatever verify_checksums says, and bytes_unverified is every
  // byte loaded. `cairn convert` makes a checkpoint with CRC32Cs of it
  // (ConvertToCheckpoint, huggingface.h).
  bool source_has_checksums = true;
  uint64_t device_bytes = 0;     // of bytes_loaded, copied into device memory
  uint64_t kv_rows = 0;          // key-value table rows applied to this
                                 // rank's sinks
  int world_size = 1;
  // Ranks in this rank's replica group (1: it read everything itself).
  int replica_group_size = 1;
  // Threads this rank's reads ran on: LoadOptions::io_threads, or if
  // everything it read was in memory already (the page cache) its share
  // of the cores when fewer: the cores it may run on divided by the ranks
  // on its node (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE or
  // MPI_LOCALNRANKS, as the launcher sets them), where more threads than
  // cores only take turns.
  int io_threads = 0;
  LoadPhaseTimes phases;
  double seconds = 0;            // wall time of the whole load
};

// Loads the checkpoint at `url` into `state`: tensor leaves are filled in
// place (their dtype and global shape must match the checkpoint: else
// kFailedPrecondition naming the FQN), object and scalar leaves are replaced
// by the stored values (either kind by either: a scalar leaf whose FQN holds
// an object becomes that object, and the other way round; a tensor leaf
// whose FQN holds no tensor is kFailedPrecondition). In a job of at most 8
// ranks every rank reads the metadata itself; ranks that read different
// metadata (each given another checkpoint, or another save committed in
// between) get kAborted on every rank, naming one, before any byte is read.
absl::StatusOr<LoadResult> Load(StateDict& state, std::string_view url,
                                const LoadOptions& options = {});

// Loads everything into newly allocated whole host tensors and rebuilds the
// saved nesting of maps and lists. One process (options.comm is ignored).
// Every chunk and object is checked against its data file's size, and
// against every other (no two may share a byte), before anything is
// allocated: a damaged metadata.json cannot make it allocate more than the
// data files hold, or for compressed chunks (format version 5) more than
// the most their stored bytes can expand to (a zstd frame takes at least
// 6 bytes and 4 per 128 KiB of content: at most about 27,000 times).
absl::StatusOr<StateDict> LoadAll(std::string_view url,
                                  const LoadOptions& options = {});

// Writes the checkpoint at `src` again at `dst` with `options` (one
// process; options.comm is ignored): to recompress it under another codec
// or level, or to store it raw (Codec::kNone). Every tensor, object and
// scalar is read (and checked) into memory whole, then saved with the
// structure and the user metadata of `src`, unless options.user_metadata
// says otherwise (anything but "{}"). Holds the whole state in host
// memory. A checkpoint with key-value tables is kUnimplemented.
absl::StatusOr<SaveResult> RewriteCheckpoint(std::string_view src,
                                             std::string_view dst,
                                             const SaveOptions& options = {});

// Reads and validates metadata.json (its checksum, docs/format.md 4.0;
// every field; chunk coverage). kNotFound when there is no committed
// checkpoint at `url`; kDataLoss naming the file when it is damaged. A
// Hugging Face folder or .safetensors file gives the metadata of its
// tensors as stored (has_checksums false; ReadImportedMetadata maps names).
absl::StatusOr<Metadata> ReadMetadata(std::string_view url);

struct MergeOptions {
  // Replace a global metadata.json already at the URL. Default: false.
  bool overwrite = false;
};

struct MergeResult {
  int ranks = 0;              // rank folders merged
  uint64_t data_bytes = 0;    // tensor and object bytes indexed
  uint64_t duplicates = 0;    // replicated chunks dropped (stored twice)
  Metadata metadata;          // what was written
};

// Turns a rank-local checkpoint at `url` into a global one, offline and
// without copying data: reads every rank-NNNNN/metadata.json, checks that
// ranks 0..world_size-1 are all there, that each tensor is covered exactly
// once (replicated boxes kept once) and that objects and scalars agree,
// then writes a global metadata.json whose chunks point into the rank
// folders' files. Any number of ranks can then load it. Errors name the
// rank folder, FQN and boxes.
absl::StatusOr<MergeResult> Merge(std::string_view url,
                                  const MergeOptions& options = {});

}  // namespace cairn

#endif  // CAIRN_CHECKPOINT_H_
