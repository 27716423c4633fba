// State-dict utilities: moving whole tensors and state dicts between ranks
// (GatherFull, BroadcastFromRoot), cutting a full tensor into the shard a
// rank of a device mesh holds (LocalBox, Distribute), and comparing, copying
// and offloading state dicts (CheckSimilar, CopyInto, OffloadToHost).
//
//   // Every rank holds shards of "model.wq"; ranks 0 and 1 want all of it:
//   cairn::GatherOptions options;
//   options.to_ranks = {0, 1};
//   options.name = "model.wq";
//   CAIRN_ASSIGN_OR_RETURN(cairn::Tensor full,
//       cairn::GatherFull(comm, *sd["model"]["wq"].tensor(), options));
//
//   // Rank 0 loaded a checkpoint alone; give every rank a copy:
//   cairn::StateDict loaded;
//   if (comm.rank() == 0) CAIRN_ASSIGN_OR_RETURN(loaded, cairn::LoadAll(url));
//   CAIRN_ASSIGN_OR_RETURN(cairn::StateDict sd,
//                          cairn::BroadcastFromRoot(comm, loaded));
//
//   // Keep this rank's part of a full tensor, for a 2 x 4 mesh that
//   // replicates over mesh dim 0 and splits tensor dim 1 over mesh dim 1:
//   CAIRN_ASSIGN_OR_RETURN(cairn::LocalShard mine,
//       cairn::Distribute(full.view(), {2, 4},
//                         {cairn::Placement::Replicate(),
//                          cairn::Placement::Shard(1)},
//                         /*coord=*/{rank / 4, rank % 4}));
//   sd["model"]["wq"] = mine.AsShardedTensor();
//
//   // Overwrite a training state with a loaded one of the same layout:
//   CAIRN_RETURN_IF_ERROR(cairn::CopyInto(loaded, train_state));
//
// Collectives (GatherFull, BroadcastFromRoot) must be called by every rank
// of the communicator, in the same order, like the communicator's own
// collectives. Their argument and data errors are agreed between the ranks:
// every rank returns the same error (naming the ranks at fault) rather than
// some ranks hanging. Only a failure of the communicator itself midway
// through a transfer can leave ranks with different errors.
//
// Memory: these functions work on host memory. Tensors on a device give
// kUnimplemented naming the FQN and the device, in every build, with CUDA
// or without; OffloadToHost (below) is the one that copies device tensors
// to the host, where the build has CUDA and the machine a usable GPU.
//
// Thread safety: every function here may be called from several threads at
// once on different data (and, for collectives, different communicators).
#ifndef CAIRN_STATE_DICT_UTILS_H_
#define CAIRN_STATE_DICT_UTILS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/box.h"
#include "cairn/communicator.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"

namespace cairn {

// ---------------------------------------------------------------------------
// GatherFull

struct GatherOptions {
  // Ranks that receive the full tensor; empty: every rank. Every rank must
  // pass the same set. Default: {} (all ranks).
  std::vector<int> to_ranks;
  // Largest piece of the tensor moved by one collective; also bounds the
  // staging buffer each rank allocates (at least one element is always
  // moved). The smallest value of all ranks is used. Default: 64 MiB.
  size_t piece_bytes = size_t{64} << 20;
  // What to call the tensor in error messages (its FQN). Default: "tensor".
  std::string name = "tensor";
};

// Collective. Every rank passes its part of the same tensor (its shards;
// shards that overlap, within a rank or across ranks, are replicas: each
// element is moved once, from the lowest rank holding it). The ranks in
// options.to_ranks return the full tensor as a new contiguous host Tensor;
// the others return an empty Tensor().
//
// Every rank returns the same error when a rank's shards are invalid (box
// outside the tensor, view of the wrong shape or dtype, device memory), when
// ranks disagree on the dtype, the global shape or to_ranks (naming the
// ranks), or when the shards of all ranks together leave an element
// uncovered (naming the missing box): kInvalidArgument, or the code of the
// lowest failing rank's local error.
//
// Memory: each receiving rank holds the result plus at most one piece; a
// sending rank stages at most one piece when its shard is not contiguous.
// With every rank receiving, each piece is one BroadcastBytes from its
// holder; with to_ranks set, one Gather to each receiving rank, so the other
// ranks never receive the bytes.
absl::StatusOr<Tensor> GatherFull(Communicator& comm,
                                  const ShardedTensor& tensor,
                                  const GatherOptions& options = {});

// ---------------------------------------------------------------------------
// BroadcastFromRoot

struct BroadcastOptions {
  // The rank holding the state dict in full. Default: 0.
  int root = 0;
  // Largest piece of a tensor or object moved by one collective, and the
  // size of the root's staging buffer for what it cannot send in place
  // (tensors that are not contiguous, objects). The root's value is used.
  // Default: 64 MiB.
  size_t piece_bytes = size_t{64} << 20;
};

// Collective. The root's `state` holds every tensor whole (one shard
// covering its global shape, in host memory, any strides); the other ranks'
// `state` is ignored. Every rank returns a StateDict of the root's nesting
// (maps, lists, empty ones included) with its objects and scalars. On the
// other ranks every tensor is newly allocated, contiguous host memory; the
// root gets its own leaves back (the same views: no copy).
//
// Leaves travel one at a time in pieces of at most options.piece_bytes,
// straight into the receivers' new tensors and objects, so the extra memory
// is one staging piece on the root, never a second copy of the state dict.
//
// Errors: the root's invalid state (a tensor that is not whole, not on the
// host, or whose view disagrees with its dtype or shape; duplicate FQNs)
// reaches every rank as the same error naming the FQN; an allocation failure
// on some rank reaches every rank naming that rank. kInvalidArgument for a
// root outside [0, comm.size()).
absl::StatusOr<StateDict> BroadcastFromRoot(
    Communicator& comm, const StateDict& state,
    const BroadcastOptions& options = {});

// ---------------------------------------------------------------------------
// LocalBox / Distribute

// How one dimension of a device mesh lays out a tensor (like DTensor's).
struct Placement {
  enum class Kind : uint8_t { kShard, kReplicate };
  Kind kind = Kind::kReplicate;
  int dim = 0;  // the tensor dimension split (kShard only); not negative

  // Splits tensor dimension `dim` over this mesh dimension.
  static Placement Shard(int dim) { return {Kind::kShard, dim}; }
  // Every rank along this mesh dimension holds the same data.
  static Placement Replicate() { return {Kind::kReplicate, 0}; }
  // "Shard(1)", "Replicate()".
  std::string ToString() const;
  friend bool operator==(const Placement&, const Placement&) = default;
};

// The box of a tensor of `global_shape` held by the rank at `coord` of a
// mesh of `mesh_shape`, under `placements` (one per mesh dimension). Pure.
//
// A dimension of size n split into k parts uses parts of ceil(n / k)
// elements, like torch.chunk and DTensor: the last parts are smaller and
// trailing ones may be empty (10 over 4: 3, 3, 3, 1; 5 over 4: 2, 2, 1, 0).
// Mesh dimensions that split the same tensor dimension nest, in mesh order:
// the second splits the first's part.
//
// kInvalidArgument for a negative size in global_shape, mesh_shape or
// coord lengths that differ from placements', a mesh dimension below 1, a
// coordinate outside the mesh, or a Shard dimension outside the tensor.
absl::StatusOr<Box> LocalBox(const Shape& global_shape,
                             const std::vector<int>& mesh_shape,
                             const std::vector<Placement>& placements,
                             const std::vector<int>& coord);

// A rank's part of a full tensor.
struct LocalShard {
  Shape global_shape;
  Box box;        // global offsets and local sizes
  Tensor tensor;  // a contiguous copy of the elements in `box`

  // A one-shard ShardedTensor that keeps `tensor` alive.
  ShardedTensor AsShardedTensor() const;
};

// Copies the LocalBox of `full` (a host view of the whole tensor, any
// strides) into a new contiguous tensor. Errors as LocalBox, plus
// kUnimplemented for device memory and kInvalidArgument for a view with
// elements but no data.
absl::StatusOr<LocalShard> Distribute(const TensorView& full,
                                      const std::vector<int>& mesh_shape,
                                      const std::vector<Placement>& placements,
                                      const std::vector<int>& coord);

// ---------------------------------------------------------------------------
// CheckSimilar / CopyInto / OffloadToHost

// Whether two state dicts have the same layout: the same nesting (map keys,
// list lengths), the same kind of leaf at each place, and for tensors the
// same dtype, global shape and shard boxes (in order); scalars of the same
// type. Values are not compared (tensor elements, object bytes, scalar
// values).
struct Similarity {
  bool similar = true;
  // Empty when similar; else the first difference in key order, named by
  // FQN: "model.wq: dtype F32 vs BF16", "step: only in b".
  std::string first_difference;
};
Similarity CheckSimilar(const StateDict& a, const StateDict& b);

// Copies `src` into `dst`, which must have the layout of `src` (as
// CheckSimilar): tensor elements are copied into dst's views in place (any
// strides), objects and scalars are replaced by src's. Everything is checked
// before anything is written, so on error `dst` is unchanged:
// kInvalidArgument naming the FQN and what differs ("CopyInto: model.wq:
// shape [4, 4] vs [4, 8]"), or a view that does not match its shard;
// kUnimplemented for device memory. Source and destination views must not
// partly overlap (a view copied onto itself is left alone).
absl::Status CopyInto(const StateDict& src, StateDict& dst);

// A StateDict of the nesting of `state` whose tensors live in host memory:
// host shards are kept as the same views (no copy) unless `copy_host`, in
// which case they are copied into new contiguous tensors; objects and
// scalars are copied. Device shards are copied to new host tensors (after
// the device's queued work); in a build without CUDA, or on a machine
// without a usable GPU, that is an error (kUnimplemented,
// kFailedPrecondition) naming the FQN and the device.
absl::StatusOr<StateDict> OffloadToHost(const StateDict& state,
                                        bool copy_host = false);

}  // namespace cairn

#endif  // CAIRN_STATE_DICT_UTILS_H_
