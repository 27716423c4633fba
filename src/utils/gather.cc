// GatherFull. The protocol:
//
//  1. Each rank checks its own arguments and shards, and describes them
//     (dtype, global shape, boxes, to_ranks, piece size) in one message
//     sealed with its local status.
//  2. AllGather of the messages. Every rank now holds the same inputs and
//     computes the same verdict and the same plan from them: a rank's local
//     error, a disagreement between ranks or a coverage gap is the same
//     error everywhere, and no rank has sent any tensor bytes yet.
//  3. The plan: the box boundaries of all shards cut the tensor into a grid
//     of cells; each cell is taken from the first (rank, shard) holding it,
//     so replicas are read once, and cut into pieces of at most
//     piece_bytes.
//  4. Receivers allocate the result, ranks that must stage allocate one
//     piece; the ranks agree on those allocations (AgreeOnStatus).
//  5. Each piece travels with one BroadcastBytes from its holder when every
//     rank receives, or one Gather to each receiving rank otherwise (so
//     ranks that do not want the tensor never receive its bytes).
#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/state_dict_utils.h"
#include "core/aligned_buffer.h"
#include "core/checked.h"
#include "core/status.h"
#include "core/strided.h"
#include "core/byte_codec.h"
#include "comm/collective.h"
#include "utils/internal.h"

namespace cairn {
namespace {

using internal_utils::ShapeString;

// Beyond this many grid cells the shards are too fragmented to plan (the
// owner table alone would take 16 MiB); real shardings have a few per rank.
constexpr uint64_t kMaxCells = uint64_t{1} << 22;
// Holders listed in a coverage error.
constexpr int kMaxListedHolders = 8;

struct RankInfo {
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<Box> boxes;
  std::vector<int64_t> to_ranks;  // sorted, unique
  uint64_t piece_bytes = 0;
};

std::string Describe(const ShardedTensor& t, const std::vector<int64_t>& to,
                     uint64_t piece_bytes) {
  internal_core::ByteWriter w;
  w.U8(static_cast<uint8_t>(t.dtype()));
  w.Ints(t.global_shape());
  w.U64(t.shards().size());
  for (const Shard& s : t.shards()) {
    w.Ints(s.box.offsets);
    w.Ints(s.box.sizes);
  }
  w.Ints(to);
  w.U64(piece_bytes);
  return w.Take();
}

absl::StatusOr<RankInfo> Decode(std::string_view message, int rank) {
  internal_core::ByteReader r(message,
                           absl::StrCat("description from rank ", rank));
  RankInfo info;
  const uint8_t dtype = r.U8();
  if (dtype >= AllDTypes().size()) r.Fail("unknown dtype");
  info.dtype = static_cast<DType>(dtype);
  info.shape = r.Ints();
  const uint64_t n = r.Count(16);
  for (uint64_t i = 0; i < n; ++i) {
    Box b;
    b.offsets = r.Ints();
    b.sizes = r.Ints();
    info.boxes.push_back(std::move(b));
  }
  info.to_ranks = r.Ints();
  info.piece_bytes = r.U64();
  CAIRN_RETURN_IF_ERROR(r.status());
  return info;
}

// One piece of the plan: `box` (global coordinates) read from shard `shard`
// of rank `src`.
struct Piece {
  int src;
  int shard;
  Box box;
};

struct Plan {
  DType dtype;
  Shape shape;
  std::vector<int> dests;  // sorted
  bool to_all;
  std::vector<Piece> pieces;

  // Whether a rank other than the piece's holder receives it, i.e. whether
  // it must travel at all.
  bool Travels(const Piece& p) const {
    return std::any_of(dests.begin(), dests.end(),
                       [&](int d) { return d != p.src; });
  }
};

// "rank 0 holds [0:2, 0:4]; rank 1 holds nothing; ..."
std::string ListHolders(const std::vector<RankInfo>& infos) {
  std::string out;
  const int n = static_cast<int>(infos.size());
  for (int r = 0; r < std::min(n, kMaxListedHolders); ++r) {
    std::vector<std::string> boxes;
    for (const Box& b : infos[r].boxes) {
      if (!b.empty()) boxes.push_back(b.ToString());
    }
    absl::StrAppend(&out, r == 0 ? "" : "; ", "rank ", r, " holds ",
                    boxes.empty() ? "nothing" : absl::StrJoin(boxes, " "));
  }
  if (n > kMaxListedHolders) {
    absl::StrAppend(&out, "; and ", n - kMaxListedHolders, " more ranks");
  }
  return out;
}

// Step 3, on the inputs every rank received; errors are the same on every
// rank because the inputs are.
absl::StatusOr<Plan> MakePlan(const std::vector<RankInfo>& infos,
                              const std::string& op, int world) {
  const RankInfo& first = infos[0];
  for (size_t r = 1; r < infos.size(); ++r) {
    if (infos[r].to_ranks != first.to_ranks) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: ranks disagree on to_ranks: rank 0 passes {%s}, rank %d "
          "passes {%s}",
          op, absl::StrJoin(first.to_ranks, ", "), r,
          absl::StrJoin(infos[r].to_ranks, ", ")));
    }
  }
  // Group the ranks by what they say the tensor is, to name every side.
  std::map<std::pair<DType, Shape>, std::vector<int>> kinds;
  for (size_t r = 0; r < infos.size(); ++r) {
    kinds[{infos[r].dtype, infos[r].shape}].push_back(static_cast<int>(r));
  }
  if (kinds.size() > 1) {
    std::vector<std::string> sides;
    for (const auto& [kind, ranks] : kinds) {
      sides.push_back(absl::StrFormat(
          "%s %s on rank%s %s", DTypeName(kind.first), ShapeString(kind.second),
          ranks.size() > 1 ? "s" : "", absl::StrJoin(ranks, ", ")));
    }
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: ranks disagree on the dtype or shape: %s", op,
                        absl::StrJoin(sides, "; ")));
  }

  Plan plan;
  plan.dtype = first.dtype;
  plan.shape = first.shape;
  plan.to_all = first.to_ranks.empty();
  for (int r = 0; r < world; ++r) {
    if (plan.to_all ||
        std::binary_search(first.to_ranks.begin(), first.to_ranks.end(), r)) {
      plan.dests.push_back(r);
    }
  }
  // The smallest piece size of all ranks, so that no rank stages more than
  // it asked for.
  uint64_t piece_bytes = UINT64_MAX;
  for (const RankInfo& info : infos) {
    piece_bytes = std::min(piece_bytes, info.piece_bytes);
  }
  if (NumElements(plan.shape) == 0) return plan;

  // The grid: every box boundary along each dimension.
  const int nd = static_cast<int>(plan.shape.size());
  std::vector<std::vector<int64_t>> bounds(nd);
  for (int d = 0; d < nd; ++d) bounds[d] = {0, plan.shape[d]};
  struct Holder {
    int rank;
    int shard;
  };
  std::vector<Holder> holders;
  for (size_t r = 0; r < infos.size(); ++r) {
    for (size_t i = 0; i < infos[r].boxes.size(); ++i) {
      const Box& b = infos[r].boxes[i];
      if (b.empty()) continue;
      holders.push_back({static_cast<int>(r), static_cast<int>(i)});
      for (int d = 0; d < nd; ++d) {
        bounds[d].push_back(b.offsets[d]);
        bounds[d].push_back(b.offsets[d] + b.sizes[d]);
      }
    }
  }
  uint64_t cells = 1;
  std::vector<int64_t> cell_dims(nd);
  for (int d = 0; d < nd; ++d) {
    std::sort(bounds[d].begin(), bounds[d].end());
    bounds[d].erase(std::unique(bounds[d].begin(), bounds[d].end()),
                    bounds[d].end());
    cell_dims[d] = static_cast<int64_t>(bounds[d].size()) - 1;
    if (__builtin_mul_overflow(cells, static_cast<uint64_t>(cell_dims[d]),
                               &cells) ||
        cells > kMaxCells) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s %s: the shards of all ranks are too fragmented to gather (more "
          "than %d distinct blocks)",
          op, ShapeString(plan.shape), kMaxCells));
    }
  }
  const std::vector<int64_t> cell_strides = ContiguousStrides(cell_dims);
  std::vector<int32_t> owner(cells, -1);
  for (size_t h = 0; h < holders.size(); ++h) {
    const Box& b = infos[holders[h].rank].boxes[holders[h].shard];
    std::vector<int64_t> lo(nd), hi(nd);
    for (int d = 0; d < nd; ++d) {
      lo[d] =
          std::lower_bound(bounds[d].begin(), bounds[d].end(), b.offsets[d]) -
          bounds[d].begin();
      hi[d] = std::lower_bound(bounds[d].begin(), bounds[d].end(),
                               b.offsets[d] + b.sizes[d]) -
              bounds[d].begin();
    }
    // Odometer over the box's cells; a rank-0 tensor has its one cell.
    std::vector<int64_t> idx = lo;
    while (true) {
      int64_t flat = 0;
      for (int d = 0; d < nd; ++d) flat += idx[d] * cell_strides[d];
      if (owner[flat] < 0) owner[flat] = static_cast<int32_t>(h);
      int d = nd - 1;
      for (; d >= 0; --d) {
        if (++idx[d] < hi[d]) break;
        idx[d] = lo[d];
      }
      if (d < 0) break;
    }
  }
  auto cell_box = [&](uint64_t flat) {
    Box b;
    b.offsets.resize(nd);
    b.sizes.resize(nd);
    for (int d = 0; d < nd; ++d) {
      const int64_t i = static_cast<int64_t>(flat) / cell_strides[d] %
                        std::max<int64_t>(cell_dims[d], 1);
      b.offsets[d] = bounds[d][i];
      b.sizes[d] = bounds[d][i + 1] - bounds[d][i];
    }
    return b;
  };
  int64_t covered = 0;
  std::optional<Box> gap;
  for (uint64_t c = 0; c < cells; ++c) {
    if (owner[c] >= 0) {
      covered += NumElements(cell_box(c).sizes);
    } else if (!gap) {
      gap = cell_box(c);
    }
  }
  if (gap) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s %s: no rank holds %s; the shards of all ranks cover %d of %d "
        "elements (%s)",
        op, ShapeString(plan.shape), gap->ToString(), covered,
        NumElements(plan.shape), ListHolders(infos)));
  }
  const size_t elem = DTypeSize(plan.dtype);
  for (uint64_t c = 0; c < cells; ++c) {
    const Holder& h = holders[owner[c]];
    for (Box& b :
         internal_utils::SplitIntoPieces(cell_box(c), elem, piece_bytes)) {
      plan.pieces.push_back({h.rank, h.shard, std::move(b)});
    }
  }
  return plan;
}

// Steps 1 and 2 and the local checks: the plan, the same on every rank.
absl::StatusOr<Plan> AgreeOnPlan(Communicator& comm, const ShardedTensor& t,
                                 const GatherOptions& options,
                                 const std::string& op) {
  std::vector<int64_t> to(options.to_ranks.begin(), options.to_ranks.end());
  std::sort(to.begin(), to.end());
  to.erase(std::unique(to.begin(), to.end()), to.end());
  // Local errors reach every rank through CombineStatuses, which names the
  // operation and the rank.
  absl::Status local;
  for (int64_t r : to) {
    if (r < 0 || r >= comm.size()) {
      local = absl::InvalidArgumentError(absl::StrFormat(
          "to_ranks holds %d, outside [0, %d)", r, comm.size()));
      break;
    }
  }
  if (local.ok()) {
    local = internal_utils::ValidateShape("global shape", t.global_shape(),
                                          t.dtype());
  }
  for (size_t i = 0; local.ok() && i < t.shards().size(); ++i) {
    const Shard& s = t.shards()[i];
    const std::string where = absl::StrCat("shard ", s.box.ToString());
    local =
        internal_core::Annotate(ValidateBox(s.box, t.global_shape()), where);
    if (local.ok()) {
      local = internal_utils::ValidateHostView(where, s.view, t.dtype(),
                                               s.box.sizes);
    }
  }
  const std::string description =
      local.ok() ? Describe(t, to, options.piece_bytes) : std::string();
  absl::StatusOr<std::vector<std::string>> all =
      comm.AllGather(internal_comm::Seal(local, description));
  CAIRN_RETURN_IF_ERROR(internal_core::Annotate(all.status(), op));

  std::vector<absl::Status> statuses;
  std::vector<RankInfo> infos;
  bool failed = false;
  for (size_t r = 0; r < all->size(); ++r) {
    absl::StatusOr<std::string> body = internal_comm::Unseal(
        (*all)[r], absl::StrCat("message from rank ", r));
    absl::StatusOr<RankInfo> info =
        body.ok() ? Decode(*body, static_cast<int>(r)) : body.status();
    failed |= !info.ok();
    statuses.push_back(info.status());
    infos.push_back(info.ok() ? *std::move(info) : RankInfo());
  }
  if (failed) return internal_comm::CombineStatuses(statuses, op);
  return MakePlan(infos, op, comm.size());
}

}  // namespace

absl::StatusOr<Tensor> GatherFull(Communicator& comm,
                                  const ShardedTensor& tensor,
                                  const GatherOptions& options) {
  const std::string op = absl::StrCat("GatherFull(", options.name, ")");
  CAIRN_ASSIGN_OR_RETURN(Plan plan, AgreeOnPlan(comm, tensor, options, op));
  const int me = comm.rank();
  const bool receiving =
      std::binary_search(plan.dests.begin(), plan.dests.end(), me);
  const size_t elem = DTypeSize(plan.dtype);

  // Step 4: the result, the views each piece is read from and written to,
  // and one staging piece where a piece is not contiguous on this rank.
  absl::Status local;
  Tensor out;
  if (receiving) {
    absl::StatusOr<Tensor> t = Tensor::Empty(plan.dtype, plan.shape);
    if (t.ok()) {
      out = *std::move(t);
    } else {
      local = t.status();
    }
  }
  std::vector<TensorView> src_views(plan.pieces.size());
  std::vector<TensorView> out_views(plan.pieces.size());
  uint64_t staging_bytes = 0;
  for (size_t i = 0; local.ok() && i < plan.pieces.size(); ++i) {
    const Piece& p = plan.pieces[i];
    const uint64_t bytes = static_cast<uint64_t>(p.box.num_elements()) * elem;
    if (p.src == me) {
      const Shard& shard = tensor.shards()[p.shard];
      Box rel = p.box;
      for (int d = 0; d < rel.rank(); ++d) {
        rel.offsets[d] -= shard.box.offsets[d];
      }
      absl::StatusOr<TensorView> v = shard.view.Slice(rel);
      if (!v.ok()) {
        local = v.status();
        break;
      }
      src_views[i] = *v;
      if (!v->is_contiguous() && plan.Travels(p)) {
        staging_bytes = std::max(staging_bytes, bytes);
      }
    }
    if (receiving) {
      absl::StatusOr<TensorView> v = out.view().Slice(p.box);
      if (!v.ok()) {
        local = v.status();
        break;
      }
      out_views[i] = *v;
      if (plan.to_all && p.src != me && !v->is_contiguous()) {
        staging_bytes = std::max(staging_bytes, bytes);
      }
    }
  }
  internal_core::UniqueAligned staging;
  if (local.ok() && staging_bytes > 0) {
    absl::StatusOr<internal_core::UniqueAligned> s =
        internal_core::AllocateAlignedUnique(staging_bytes);
    if (s.ok()) {
      staging = *std::move(s);
    } else {
      local = s.status();
    }
  }
  CAIRN_RETURN_IF_ERROR(internal_comm::AgreeOnStatus(comm, local, op));

  // Step 5. A piece that arrives damaged (a communicator bug) is recorded
  // but the loop goes on, so that this rank still joins every collective.
  absl::Status damaged;
  for (size_t i = 0; i < plan.pieces.size(); ++i) {
    const Piece& p = plan.pieces[i];
    const uint64_t bytes = static_cast<uint64_t>(p.box.num_elements()) * elem;
    const bool sending = p.src == me;
    // What the holder sends: its view's memory when contiguous, else the
    // piece staged in row-major order.
    std::byte* send = nullptr;
    const bool someone_else_receives = plan.Travels(p);
    if (sending && someone_else_receives) {
      if (src_views[i].is_contiguous()) {
        send = static_cast<std::byte*>(src_views[i].data());
      } else {
        internal_core::CopyRowMajorBytes(src_views[i], 0, bytes, staging.get());
        send = staging.get();
      }
    }
    // The holder copies into its own result directly from its shard.
    if (sending && receiving) {
      internal_core::CopyView(src_views[i], out_views[i]);
    }
    if (!someone_else_receives) continue;
    if (plan.to_all) {
      std::byte* buf = send;
      if (!sending) {
        buf = out_views[i].is_contiguous()
                  ? static_cast<std::byte*>(out_views[i].data())
                  : staging.get();
      }
      CAIRN_RETURN_IF_ERROR(internal_core::Annotate(
          comm.BroadcastBytes(std::span<std::byte>(buf, bytes), p.src), op));
      if (!sending && buf != out_views[i].data()) {
        internal_core::CopyView(TensorView(buf, plan.dtype, p.box.sizes),
                                 out_views[i]);
      }
      continue;
    }
    for (int dest : plan.dests) {
      if (dest == p.src) continue;
      const std::string_view payload =
          sending ? std::string_view(reinterpret_cast<const char*>(send), bytes)
                  : std::string_view();
      absl::StatusOr<std::vector<std::string>> got = comm.Gather(payload, dest);
      CAIRN_RETURN_IF_ERROR(internal_core::Annotate(got.status(), op));
      if (me != dest) continue;
      if (static_cast<size_t>(p.src) >= got->size() ||
          (*got)[p.src].size() != bytes) {
        damaged = absl::InternalError(absl::StrFormat(
            "%s: piece %s from rank %d arrived with the wrong size", op,
            p.box.ToString(), p.src));
        continue;
      }
      // The view only reads the received bytes.
      internal_core::CopyView(
          TensorView(const_cast<char*>((*got)[p.src].data()), plan.dtype,
                     p.box.sizes),
          out_views[i]);
    }
  }
  CAIRN_RETURN_IF_ERROR(damaged);
  return out;
}

}  // namespace cairn
