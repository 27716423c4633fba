// Planners decide what a save writes and what a load reads. cairn calls them
// in a fixed sequence on every rank; the defaults cover ordinary state
// dicts, and a job plugs its own by subclassing (usually the default) and
// passing it in SaveOptions::planner / LoadOptions::planner.
//
// Save, on every rank (rank 0 is the coordinator):
//   SetUp(state, is_coordinator, rank, world_size)
//   CreateLocalPlan()                      -> this rank's SavePlan
//   coordinator: CreateGlobalPlan(all)     -> one final plan per rank
//   FinishPlan(my final plan)              -> the plan this rank writes
//   ResolveData(item), lazily, from IO threads, once per item written
// Load, on every rank:
//   SetUp(state, metadata, is_coordinator, rank, world_size)
//   CreateLocalPlan()                      -> this rank's LoadPlan
//   coordinator: CreateGlobalPlan(all)     -> one final plan per rank
//   FinishPlan(my final plan)
//   then, a wave at a time (LoadOptions::memory_budget_bytes):
//   ResolveDestination(item), once per item, before the item's reads
//     (lazily: the wave's items only)
//   CommitChunk(item), once per item, after its bytes landed and passed
//     every check that covers them, the combined checks of parts read by
//     several ranks included; so a planner never acts on bytes that then
//     fail a check. Items commit as their checks pass: most in the wave
//     that read them, the parts of chunks checked across ranks after the
//     last wave. A load that fails may have written unchecked bytes into
//     memory destinations, but commits none of them.
//
// CreateGlobalPlan must be a pure function of the local plans: the save plan
// cache reuses its result whenever every rank's local plan is unchanged.
// After CreateGlobalPlan, cairn itself checks that the final save plans
// write every tensor exactly once (no gap, no overlap, one dtype and shape
// per FQN) before any byte is written, so a planner cannot commit a
// checkpoint that does not load.
//
// Example: store every key under a prefix.
//
//   class PrefixPlanner : public cairn::DefaultSavePlanner {
//     absl::StatusOr<cairn::SavePlan> CreateLocalPlan() override {
//       CAIRN_ASSIGN_OR_RETURN(auto plan, DefaultSavePlanner::CreateLocalPlan());
//       for (auto& item : plan.items) item.fqn = "model." + item.fqn;
//       return plan;   // ResolveData still finds the source: by local_index
//     }
//   };
//
// Thread safety: ResolveData may be called from several IO threads at once;
// the other methods are called from the thread that called Save or Load.
#ifndef CAIRN_PLANNER_H_
#define CAIRN_PLANNER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "cairn/metadata.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"

namespace cairn {

enum class ItemKind : uint8_t { kTensor, kObject };

// One piece a save writes: a box of a tensor, or a whole byte object.
struct WriteItem {
  std::string fqn;  // the name it is stored under
  ItemKind kind = ItemKind::kTensor;
  DType dtype = DType::kU8;  // tensors: element type; objects: U8
  Shape global_shape;        // tensors: the whole tensor's shape
  Box box;                   // tensors: the stored box
  uint64_t nbytes = 0;       // bytes of the box, or of the object
  // The planner's reference to the item's source on this rank (the default
  // planner: an index into its flattened leaves). Carried through global
  // planning unchanged; cairn never interprets it.
  int64_t local_index = -1;
  friend bool operator==(const WriteItem&, const WriteItem&) = default;
};

struct SavePlan {
  std::vector<WriteItem> items;
  // Scalar leaves by FQN (their values are sent at commit, so a plan stays
  // reusable when only values change).
  std::map<std::string, Scalar> scalars;
  // JSON skeleton of this rank's nesting (see docs/format.md, "structure").
  std::string structure = "{}";
  // Opaque slots a planner and a storage backend may fill, carried through
  // global planning and compared by the plan cache.
  std::string planner_data;
  std::string storage_data;
};

// The bytes of one write item, ready to copy: a host view with the box's
// shape (any strides), or an object's bytes. `keep_alive` holds whatever
// backs them and is released after the item's last byte is written.
struct ResolvedData {
  TensorView view;
  std::span<const std::byte> bytes;
  std::shared_ptr<const void> keep_alive;
};

class SavePlanner {
 public:
  virtual ~SavePlanner() = default;
  virtual absl::Status SetUp(const StateDict& state, bool is_coordinator,
                             int rank, int world_size) = 0;
  virtual absl::StatusOr<SavePlan> CreateLocalPlan() = 0;
  // Coordinator only. `local_plans[r]` is rank r's; returns one plan per
  // rank holding only the items that rank writes.
  virtual absl::StatusOr<std::vector<SavePlan>> CreateGlobalPlan(
      std::vector<SavePlan> local_plans) = 0;
  virtual absl::StatusOr<SavePlan> FinishPlan(SavePlan plan) = 0;
  virtual absl::StatusOr<ResolvedData> ResolveData(const WriteItem& item) = 0;
};

// Who writes a box that several ranks hold (a replicated box).
enum class DedupPolicy : uint8_t {
  // Spread written bytes evenly over the holders (default).
  kBalanceBytes,
  // The lowest holding rank writes it, so the files a rank writes hold
  // everything it owns first (for node-local disks).
  kLowestRank,
};

// Returns, for every rank, the items of `local_plans` it writes: each
// distinct (fqn, box) once, by the holder `policy` picks; ties broken by
// rank so the result is deterministic. Pure; exposed for custom planners.
std::vector<SavePlan> DedupSavePlans(std::vector<SavePlan> local_plans,
                                     DedupPolicy policy);

// The default save planner: every tensor shard, object and scalar of the
// state dict, host memory read in place. Tensors for which NeedsMaterialize
// is true (by default: those with a shard in device memory) are copied
// (Materialize) once per tensor, the first time one of their items is
// written, and the copy is released after the tensor's last item is
// written. Device shards need a CUDA build and a GPU; without them the plan
// fails before any byte is written, naming the FQN and the device.
class DefaultSavePlanner : public SavePlanner {
 public:
  explicit DefaultSavePlanner(DedupPolicy dedup = DedupPolicy::kBalanceBytes);
  ~DefaultSavePlanner() override;

  absl::Status SetUp(const StateDict& state, bool is_coordinator, int rank,
                     int world_size) override;
  absl::StatusOr<SavePlan> CreateLocalPlan() override;
  absl::StatusOr<std::vector<SavePlan>> CreateGlobalPlan(
      std::vector<SavePlan> local_plans) override;
  absl::StatusOr<SavePlan> FinishPlan(SavePlan plan) override;
  absl::StatusOr<ResolvedData> ResolveData(const WriteItem& item) override;

  // The policy CreateGlobalPlan dedups with.
  DedupPolicy dedup_policy() const { return dedup_; }

 protected:
  // True when `tensor`'s bytes cannot be read in place (e.g. device memory,
  // or values the planner transforms). Default: true when a shard is in
  // device memory. When false, every shard must be host memory.
  virtual bool NeedsMaterialize(const std::string& fqn,
                                const ShardedTensor& tensor) const;
  // Host copies of `tensor`'s shards, in shards() order, each with its
  // box's shape and the tensor's dtype. Called at most once per tensor per
  // save, from an IO thread. Default: device shards copied to the host
  // (after the device's queued work is done), host shards copied.
  virtual absl::StatusOr<std::vector<Tensor>> Materialize(
      const std::string& fqn, const ShardedTensor& tensor);

  bool is_coordinator() const { return is_coordinator_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  struct Leaf;
  struct Materialized;
  DedupPolicy dedup_;
  bool is_coordinator_ = false;
  int rank_ = 0;
  int world_size_ = 1;
  std::vector<Leaf> leaves_;
  std::vector<std::pair<size_t, size_t>> sources_;  // (leaf, shard) by index
  std::string structure_;
  std::mutex mu_;  // guards materialized_
  std::map<int64_t, std::shared_ptr<Materialized>> materialized_;
};

// One piece a load reads: the part of one stored chunk (or an object) that
// one destination box needs.
struct ReadItem {
  std::string fqn;  // the stored name
  ItemKind kind = ItemKind::kTensor;
  // The planner's reference to the destination (the default planner: an
  // index into its destination boxes). cairn never interprets it.
  int64_t local_index = -1;
  size_t chunk = 0;  // tensors: index into the stored tensor's chunks
  Box overlap;       // tensors: global coordinates of the bytes to read
  friend bool operator==(const ReadItem&, const ReadItem&) = default;
};

struct LoadPlan {
  std::vector<ReadItem> items;
  // Leaves of the destination absent from the checkpoint (non-strict
  // loads), and stored leaves this rank's destination did not ask for
  // (sorted). Reported in LoadResult; the coordinator narrows `unexpected`
  // to the leaves no rank asked for.
  std::vector<std::string> missing;
  std::vector<std::string> unexpected;
  std::string planner_data;
  std::string storage_data;
};

// A destination that is not memory: it takes a tensor item's bytes as
// pieces (a key-value store, a file, a device with little room). The load
// reads them into host staging within LoadOptions::memory_budget_bytes,
// checks them, and only then hands them over, so a sink never sees a byte
// that failed its checksum; the staging is then reused.
class LoadSink {
 public:
  virtual ~LoadSink() = default;
  // The values of `box` (global coordinates, inside item.overlap) in
  // row-major order, of the stored dtype, valid during the call. An item's
  // pieces tile its overlap and arrive in any order (a large item comes in
  // pieces that fit the budget); all of them arrive before
  // CommitChunk(item). Called from the thread that called Load.
  virtual absl::Status Write(const ReadItem& item, const Box& box,
                             std::span<const std::byte> bytes) = 0;
  // Called once per stored tensor (FQN) that this sink received items of,
  // after the last of this rank's items of it was committed. Default:
  // nothing.
  virtual absl::Status Complete(const std::string& fqn);
};

// Where a read item's bytes go: a view of shape overlap.sizes and the
// stored dtype (any non-negative strides; host memory, or device memory,
// which the load fills through host staging); or a sink (then `view` is
// unused; tensor items only); or, for an object, a string to replace.
struct Destination {
  TensorView view;
  std::string* object = nullptr;
  std::shared_ptr<LoadSink> sink;
};

class LoadPlanner {
 public:
  virtual ~LoadPlanner() = default;
  virtual absl::Status SetUp(StateDict& state, const Metadata& metadata,
                             bool is_coordinator, int rank,
                             int world_size) = 0;
  virtual absl::StatusOr<LoadPlan> CreateLocalPlan() = 0;
  virtual absl::StatusOr<std::vector<LoadPlan>> CreateGlobalPlan(
      std::vector<LoadPlan> local_plans) = 0;
  virtual absl::StatusOr<LoadPlan> FinishPlan(LoadPlan plan) = 0;
  virtual absl::StatusOr<Destination> ResolveDestination(
      const ReadItem& item) = 0;
  virtual absl::Status CommitChunk(const ReadItem& item) = 0;
};

// The default load planner: fills the destination state dict in place.
// Scalars are assigned in SetUp. With `strict`, a destination leaf missing
// from the checkpoint is kNotFound; dtype or shape differences are
// kFailedPrecondition, naming the FQN. It counts committed items per tensor
// and calls OnTensorLoaded once all of a tensor's items are in. Subclass it
// to rename leaves (StoredName), hear of finished tensors, or change local
// plans and destinations. Its global plan is the local plans unchanged
// (CreateGlobalPlan is final), so a load with it or any subclass sends the
// coordinator a few bytes per rank instead of each plan, and never calls
// CreateGlobalPlan; to change plans globally, derive from LoadPlanner.
class DefaultLoadPlanner : public LoadPlanner {
 public:
  explicit DefaultLoadPlanner(bool strict = true);
  ~DefaultLoadPlanner() override;

  absl::Status SetUp(StateDict& state, const Metadata& metadata,
                     bool is_coordinator, int rank, int world_size) override;
  absl::StatusOr<LoadPlan> CreateLocalPlan() override;
  absl::StatusOr<std::vector<LoadPlan>> CreateGlobalPlan(
      std::vector<LoadPlan> local_plans) final;
  absl::StatusOr<LoadPlan> FinishPlan(LoadPlan plan) override;
  absl::StatusOr<Destination> ResolveDestination(const ReadItem& item) override;
  absl::Status CommitChunk(const ReadItem& item) override;

 protected:
  // The name under which destination leaf `fqn` is stored (to load a
  // checkpoint saved with other key names). Default: `fqn`.
  virtual std::string StoredName(const std::string& fqn) const;
  // Called once per destination tensor or object, when the last of its
  // items has been committed (never for a tensor with no bytes to read).
  // Default: nothing.
  virtual absl::Status OnTensorLoaded(const std::string& fqn);

  const Metadata* metadata() const { return metadata_; }

 private:
  struct Target;
  bool strict_;
  const Metadata* metadata_ = nullptr;
  std::vector<Target> targets_;
  std::map<std::string, int64_t> remaining_;  // items left per FQN
  std::vector<std::string> missing_;
  std::vector<std::string> unexpected_;
};

}  // namespace cairn

#endif  // CAIRN_PLANNER_H_
