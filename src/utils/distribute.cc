// LocalBox and Distribute: DTensor-style placements over a device mesh.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/state_dict_utils.h"
#include "core/checked.h"
#include "core/status.h"
#include "utils/internal.h"

namespace cairn {
namespace {

using internal_utils::ShapeString;

std::string PlacementsString(const std::vector<Placement>& placements) {
  std::vector<std::string> parts;
  for (const Placement& p : placements) parts.push_back(p.ToString());
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

// Part `i` of `k` of [0, n) in parts of ceil(n / k): [begin, begin + size).
// Written so nothing overflows for any n <= INT64_MAX and k <= INT_MAX.
std::pair<int64_t, int64_t> Chunk(int64_t n, int64_t k, int64_t i) {
  const int64_t chunk = n / k + (n % k != 0 ? 1 : 0);
  int64_t begin;
  if (__builtin_mul_overflow(chunk, i, &begin) || begin > n) begin = n;
  const int64_t size = std::min(chunk, n - begin);
  return {begin, size};
}

}  // namespace

std::string Placement::ToString() const {
  switch (kind) {
    case Kind::kShard:
      return absl::StrCat("Shard(", dim, ")");
    case Kind::kReplicate:
      return "Replicate()";
  }
  return absl::StrCat("Placement(kind ", static_cast<int>(kind), ")");
}

absl::StatusOr<Box> LocalBox(const Shape& global_shape,
                             const std::vector<int>& mesh_shape,
                             const std::vector<Placement>& placements,
                             const std::vector<int>& coord) {
  const std::string where = absl::StrFormat(
      "LocalBox(shape %s, mesh [%s], placements %s, coord [%s])",
      ShapeString(global_shape), absl::StrJoin(mesh_shape, ", "),
      PlacementsString(placements), absl::StrJoin(coord, ", "));
  // The element count must fit int64 like any tensor's (dtype size 1).
  CAIRN_RETURN_IF_ERROR(
      internal_utils::ValidateShape(where, global_shape, DType::kU8));
  if (mesh_shape.size() != placements.size() ||
      coord.size() != placements.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the mesh has %d dimensions, the placements %d and the "
        "coordinate %d; they must be equal",
        where, mesh_shape.size(), placements.size(), coord.size()));
  }
  Box box = Box::Full(global_shape);
  for (size_t i = 0; i < placements.size(); ++i) {
    if (mesh_shape[i] < 1) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: mesh dimension %d has size %d; it must be at least 1", where, i,
          mesh_shape[i]));
    }
    if (coord[i] < 0 || coord[i] >= mesh_shape[i]) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: coordinate %d along mesh dimension %d is outside [0, %d)", where,
          coord[i], i, mesh_shape[i]));
    }
    const Placement& p = placements[i];
    if (p.kind == Placement::Kind::kReplicate) continue;
    if (p.kind != Placement::Kind::kShard) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: placement %d has an unknown kind", where, i));
    }
    if (p.dim < 0 || p.dim >= box.rank()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: placement %d shards dimension %d of a tensor with %d "
          "dimensions (dimensions count from 0; negative ones are not "
          "accepted)",
          where, i, p.dim, box.rank()));
    }
    // Split what earlier mesh dimensions left of this tensor dimension, so
    // that two mesh dimensions on one tensor dimension nest.
    const auto [begin, size] = Chunk(box.sizes[p.dim], mesh_shape[i], coord[i]);
    box.offsets[p.dim] += begin;
    box.sizes[p.dim] = size;
  }
  return box;
}

ShardedTensor LocalShard::AsShardedTensor() const {
  return ShardedTensor(tensor.dtype(), global_shape,
                       {Shard{box, tensor.view()}}, tensor.buffer());
}

absl::StatusOr<LocalShard> Distribute(const TensorView& full,
                                      const std::vector<int>& mesh_shape,
                                      const std::vector<Placement>& placements,
                                      const std::vector<int>& coord) {
  CAIRN_ASSIGN_OR_RETURN(Box box,
                         LocalBox(full.shape(), mesh_shape, placements, coord));
  CAIRN_RETURN_IF_ERROR(internal_utils::ValidateHostView(
      "Distribute", full, full.dtype(), full.shape()));
  CAIRN_ASSIGN_OR_RETURN(TensorView part, full.Slice(box));
  CAIRN_ASSIGN_OR_RETURN(Tensor copy, Tensor::CopyOf(part));
  return LocalShard{full.shape(), std::move(box), std::move(copy)};
}

}  // namespace cairn
