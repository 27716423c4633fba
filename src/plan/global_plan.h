// Global save planning as pure functions of the ranks' plans: dedup of
// replicated boxes, the coordinator's checks, and the metadata skeleton the
// commit fills in. No communicator here, so tests and the scale benchmark
// can run thousands of simulated ranks in one process.
#ifndef CAIRN_PLAN_GLOBAL_PLAN_H_
#define CAIRN_PLAN_GLOBAL_PLAN_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "cairn/metadata.h"
#include "cairn/planner.h"
#include "format/metadata_codec.h"

namespace cairn::internal_plan {

// What the local plans agree on for one FQN: its kind, and for tensors its
// dtype and global shape. The coordinator keeps one per FQN (thousands),
// not the plans' items (ranks x tensors), to check the global plan.
struct FqnInfo {
  ItemKind kind = ItemKind::kTensor;
  DType dtype = DType::kU8;
  Shape global_shape;
};
using LocalSummary = absl::flat_hash_map<std::string, FqnInfo>;

// OK when the local plans describe one consistent state: every FQN has one
// kind, one dtype and one global shape on every rank that holds it, boxes
// lie inside their shapes, nbytes match, objects of one FQN have one size.
// kInvalidArgument naming the FQN, the ranks and what differs. Returns what
// the plans agree on per FQN, so that the plans themselves can be handed on
// (moved) to CreateGlobalPlan.
absl::StatusOr<LocalSummary> ValidateLocalPlans(
    const std::vector<SavePlan>& local_plans);

// OK when `final_plans` write every FQN of `local` (the summary of the
// local plans), each in the form the local plans agree on: every tensor
// exactly once (the written boxes cover the shape with no gap and no
// overlap) and every object exactly once. kInvalidArgument naming the FQN,
// the ranks and the boxes otherwise.
// Without `require_coverage` (rank-local checkpoints, which hold one rank's
// part), gaps are allowed; everything else is still checked.
absl::Status ValidateFinalPlans(const LocalSummary& local,
                                const std::vector<SavePlan>& final_plans,
                                bool require_coverage = true);

// One structure JSON from every rank's (identical ones are the common case;
// otherwise maps are merged key by key and lists element by element).
// kInvalidArgument when two ranks disagree on what a path is.
absl::StatusOr<std::string> MergeStructures(
    const std::vector<std::string>& structures);
// The same on views (the columnar coordinator's are views into the encoded
// local plans). Each distinct text is parsed once.
absl::StatusOr<std::string> MergeStructureViews(
    const std::vector<absl::string_view>& structures);

// The metadata of a checkpoint written by `final_plans` with every location
// still empty (tensors, chunks in box order, objects, merged structure,
// world size), and for each rank and final item where its location goes:
// a pointer into `metadata` (a chunk's or an object's location), so the
// commit fills millions of locations without a lookup. Move-only: moving
// keeps the pointers valid (map nodes and vector buffers move), a copy
// would not.
struct MetadataSkeleton {
  MetadataSkeleton() = default;
  MetadataSkeleton(MetadataSkeleton&&) = default;
  MetadataSkeleton& operator=(MetadataSkeleton&&) = default;
  MetadataSkeleton(const MetadataSkeleton&) = delete;
  MetadataSkeleton& operator=(const MetadataSkeleton&) = delete;

  Metadata metadata;
  std::vector<std::vector<ByteLocation*>> refs;  // [rank][item]
  // Set by the columnar coordinator: the tensors' chunks are in `flat`
  // (the metadata's tensors have none, so millions of chunks cost no heap
  // vectors), and a tensor item's location is flat's chunk
  // chunk_refs[rank][item] (its `refs` entry is null). flat.files[0] is
  // "", flat.files[1 + r] rank r's data file.
  bool uses_flat = false;
  internal_format::FlatChunks flat;
  std::vector<std::vector<uint32_t>> chunk_refs;  // [rank][item]
};
// The skeleton's metadata with every chunk in its tensor's `chunks`
// (WithFlatChunks when uses_flat): for tests and tools, not the save path.
Metadata SkeletonMetadata(const MetadataSkeleton& skeleton);
// metadata.json of the (assembled) skeleton: EncodeMetadata of its
// metadata, with its flat chunks when uses_flat.
absl::StatusOr<std::string> EncodeSkeleton(const MetadataSkeleton& skeleton);
absl::StatusOr<MetadataSkeleton> BuildMetadataSkeleton(
    const std::vector<SavePlan>& final_plans);

// What the save coordinator's global planning hands on: each rank's final
// plan as the scatter sends it, and the skeleton the commit fills in.
struct EncodedGlobalPlan {
  // payloads[r]: `prefix` + EncodeSavePlan(rank r's final plan, without
  // scalar values), or `prefix` alone when that encoding is rank r's local
  // plan as gathered, byte for byte: a rank none of whose items was dropped
  // (every rank of a job with nothing replicated) is sent only the prefix
  // and decodes its own local plan (DecodeFinalPlan), so the coordinator
  // neither copies nor sends the plan back.
  std::vector<std::string> payloads;
  MetadataSkeleton skeleton;
};

// The coordinator's global planning on the gathered encoded local plans
// (`encoded[r]` is rank r's), for any planner: the plans decoded,
// ValidateLocalPlans, the planner's CreateGlobalPlan (the local plans moved
// in), ValidateFinalPlans, BuildMetadataSkeleton, the final plans encoded.
// Errors name the rank, the FQN and the boxes. See also
// PlanGlobalSaveColumnar (columnar_plan.h), the same for the default
// planner without a WriteItem per item.
absl::StatusOr<EncodedGlobalPlan> PlanGlobalSave(
    SavePlanner& planner, const std::vector<std::string>& encoded,
    bool require_coverage, std::string_view prefix);

// A rank's final plan from its payload without the prefix (`rest`): the
// plan it encodes, or, when `rest` is empty, the rank's own local plan as it
// sent it (`encoded_local`, encoded without scalar values). Errors name
// `what`.
absl::StatusOr<SavePlan> DecodeFinalPlan(std::string_view rest,
                                         std::string_view encoded_local,
                                         std::string_view what);

}  // namespace cairn::internal_plan

#endif  // CAIRN_PLAN_GLOBAL_PLAN_H_
