// BroadcastFromRoot. The protocol:
//
//  1. The root flattens and checks its state dict and broadcasts one header
//     sealed with its status: the piece size, the nesting (Flatten's
//     structure JSON) and each leaf's FQN and kind, with the dtype and shape
//     of tensors, the size of objects and the value of scalars. A bad state
//     dict on the root is thus the same error on every rank, before any
//     allocation.
//  2. The other ranks allocate every tensor and object; the root allocates
//     one staging piece if it has leaves it cannot send in place. The ranks
//     agree on those allocations (AgreeOnStatus).
//  3. Leaves travel one at a time in FQN order, in pieces of at most
//     piece_bytes, each piece with one BroadcastBytes straight into the
//     receivers' memory. The root sends contiguous tensors from their own
//     memory and stages the rest (strided tensors, objects) piece by piece.
//  4. Every rank rebuilds the nesting with Unflatten.
#include <algorithm>
#include <cstring>
#include <map>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/state_dict_utils.h"
#include "core/aligned_buffer.h"
#include "core/checked.h"
#include "core/flatten.h"
#include "core/status.h"
#include "core/strided.h"
#include "core/byte_codec.h"
#include "comm/collective.h"
#include "utils/internal.h"

namespace cairn {
namespace {

enum ScalarTag : uint8_t { kInt = 0, kDouble = 1, kBool = 2, kString = 3 };

void WriteScalar(internal_core::ByteWriter& w, const Scalar& s) {
  if (const int64_t* i = std::get_if<int64_t>(&s)) {
    w.U8(kInt);
    w.I64(*i);
  } else if (const double* d = std::get_if<double>(&s)) {
    w.U8(kDouble);
    uint64_t bits;
    std::memcpy(&bits, d, sizeof bits);
    w.U64(bits);
  } else if (const bool* b = std::get_if<bool>(&s)) {
    w.U8(kBool);
    w.U8(*b ? 1 : 0);
  } else {
    w.U8(kString);
    w.Str(std::get<std::string>(s));
  }
}

Scalar ReadScalar(internal_core::ByteReader& r) {
  switch (r.U8()) {
    case kInt:
      return r.I64();
    case kDouble: {
      const uint64_t bits = r.U64();
      double d;
      std::memcpy(&d, &bits, sizeof d);
      return d;
    }
    case kBool:
      return r.U8() != 0;
    case kString:
      return r.Str();
    default:
      r.Fail("unknown scalar type");
      return int64_t{0};
  }
}

// A leaf as the header describes it, and on receivers its new value.
struct Leaf {
  std::string fqn;
  StateDict::Kind kind = StateDict::Kind::kScalar;
  DType dtype = DType::kU8;  // tensors
  Shape shape;               // tensors
  uint64_t nbytes = 0;       // tensors and objects
  Scalar scalar;             // scalars
  Tensor tensor;             // receivers: the allocated tensor
  Object object;             // receivers: the allocated object
};

struct Header {
  uint64_t piece_bytes = 0;
  std::string structure;
  std::vector<Leaf> leaves;
};

// Step 1 on the root: the header, or the error every rank will return.
absl::StatusOr<std::string> MakeHeader(const internal_core::Flattened& flat,
                                       uint64_t piece_bytes,
                                       const std::string& op) {
  internal_core::ByteWriter w;
  w.U64(piece_bytes);
  w.Str(flat.structure);
  w.U64(flat.leaves.size());
  for (const internal_core::FlatLeaf& leaf : flat.leaves) {
    const StateDict& node = *leaf.node;
    const std::string where = absl::StrCat(op, ": ", leaf.fqn);
    w.Str(leaf.fqn);
    w.U8(static_cast<uint8_t>(node.kind()));
    if (const ShardedTensor* t = node.tensor()) {
      CAIRN_RETURN_IF_ERROR(
          internal_utils::ValidateShape(where, t->global_shape(), t->dtype()));
      if (t->shards().size() != 1 ||
          t->shards()[0].box != Box::Full(t->global_shape())) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: the root must hold every tensor whole (one shard covering "
            "%s); it holds %s",
            where, internal_utils::ShapeString(t->global_shape()),
            t->shards().size() == 1
                ? absl::StrCat("one shard of box ",
                               t->shards()[0].box.ToString())
                : absl::StrCat(t->shards().size(), " shards")));
      }
      CAIRN_RETURN_IF_ERROR(internal_utils::ValidateHostView(
          where, t->shards()[0].view, t->dtype(), t->global_shape()));
      w.U8(static_cast<uint8_t>(t->dtype()));
      w.Ints(t->global_shape());
    } else if (const Object* o = node.object()) {
      w.U64(o->bytes.size());
    } else if (const Scalar* s = node.scalar()) {
      WriteScalar(w, *s);
    }
  }
  return w.Take();
}

absl::StatusOr<Header> ReadHeader(std::string_view message) {
  internal_core::ByteReader r(message, "BroadcastFromRoot header");
  Header h;
  h.piece_bytes = r.U64();
  h.structure = r.Str();
  const uint64_t n = r.Count(10);
  h.leaves.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    Leaf leaf;
    leaf.fqn = r.Str();
    leaf.kind = static_cast<StateDict::Kind>(r.U8());
    switch (leaf.kind) {
      case StateDict::Kind::kTensor: {
        const uint8_t dtype = r.U8();
        if (dtype >= AllDTypes().size()) r.Fail("unknown dtype");
        leaf.dtype = static_cast<DType>(dtype);
        leaf.shape = r.Ints();
        const std::optional<uint64_t> bytes =
            internal_core::CheckedBytes(leaf.shape, leaf.dtype);
        if (!bytes) r.Fail("bad tensor shape");
        leaf.nbytes = bytes.value_or(0);
        break;
      }
      case StateDict::Kind::kObject:
        leaf.nbytes = r.U64();
        break;
      case StateDict::Kind::kScalar:
        leaf.scalar = ReadScalar(r);
        break;
      default:
        r.Fail("unknown leaf kind");
    }
    h.leaves.push_back(std::move(leaf));
  }
  CAIRN_RETURN_IF_ERROR(r.status());
  return h;
}

// Step 2 on a receiver: memory for every tensor and object.
absl::Status Allocate(Header& h) {
  for (Leaf& leaf : h.leaves) {
    if (leaf.kind == StateDict::Kind::kTensor) {
      CAIRN_ASSIGN_OR_RETURN(leaf.tensor,
                             Tensor::Empty(leaf.dtype, leaf.shape));
    } else if (leaf.kind == StateDict::Kind::kObject) {
      try {
        leaf.object.bytes.resize(leaf.nbytes);
      } catch (const std::exception&) {  // bad_alloc, length_error
        return absl::ResourceExhaustedError(absl::StrFormat(
            "cannot allocate %d bytes for object %s", leaf.nbytes, leaf.fqn));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StateDict> BroadcastFromRoot(Communicator& comm,
                                            const StateDict& state,
                                            const BroadcastOptions& options) {
  const int root = options.root;
  const std::string op = absl::StrCat("BroadcastFromRoot(root ", root, ")");
  if (root < 0 || root >= comm.size()) {
    // Every rank passes the same root, so every rank returns here.
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: root %d is outside [0, %d)", op, root, comm.size()));
  }
  const bool is_root = comm.rank() == root;

  // Step 1.
  internal_core::Flattened flat;
  std::string message;
  if (is_root) {
    absl::StatusOr<std::string> header = [&]() -> absl::StatusOr<std::string> {
      absl::StatusOr<internal_core::Flattened> f =
          internal_core::Flatten(state);
      CAIRN_RETURN_IF_ERROR(internal_core::Annotate(f.status(), op));
      flat = *std::move(f);
      return MakeHeader(flat, options.piece_bytes, op);
    }();
    message = internal_comm::Seal(header.status(),
                                   header.ok() ? *header : std::string());
  }
  CAIRN_RETURN_IF_ERROR(
      internal_core::Annotate(comm.Broadcast(message, root), op));
  CAIRN_ASSIGN_OR_RETURN(std::string body,
                         internal_comm::Unseal(message, "header"));

  // Step 2. The root decodes its own header too: one description of the
  // leaves for every rank.
  absl::StatusOr<Header> header = ReadHeader(body);
  absl::Status local = header.status();
  internal_core::UniqueAligned staging;
  if (header.ok() && !is_root) local = Allocate(*header);
  if (header.ok() && is_root) {
    uint64_t staging_bytes = 0;
    for (size_t i = 0; i < flat.leaves.size(); ++i) {
      const ShardedTensor* t = flat.leaves[i].node->tensor();
      const bool in_place = t != nullptr && t->shards()[0].view.is_contiguous();
      if (!in_place) {
        staging_bytes =
            std::max(staging_bytes,
                     std::min(header->leaves[i].nbytes,
                              std::max<uint64_t>(header->piece_bytes, 1)));
      }
    }
    if (staging_bytes > 0) {
      absl::StatusOr<internal_core::UniqueAligned> s =
          internal_core::AllocateAlignedUnique(staging_bytes);
      if (s.ok()) {
        staging = *std::move(s);
      } else {
        local = s.status();
      }
    }
  }
  CAIRN_RETURN_IF_ERROR(internal_comm::AgreeOnStatus(comm, local, op));

  // Step 3.
  const uint64_t piece = std::max<uint64_t>(header->piece_bytes, 1);
  for (size_t i = 0; i < header->leaves.size(); ++i) {
    Leaf& leaf = header->leaves[i];
    if (leaf.kind != StateDict::Kind::kTensor &&
        leaf.kind != StateDict::Kind::kObject) {
      continue;
    }
    const StateDict* mine = is_root ? flat.leaves[i].node : nullptr;
    for (uint64_t begin = 0; begin < leaf.nbytes; begin += piece) {
      const uint64_t end = std::min(leaf.nbytes, begin + piece);
      std::byte* buf = nullptr;
      if (!is_root) {
        buf = leaf.kind == StateDict::Kind::kTensor
                  ? static_cast<std::byte*>(leaf.tensor.data())
                  : reinterpret_cast<std::byte*>(leaf.object.bytes.data());
        buf += begin;
      } else if (const ShardedTensor* t = mine->tensor()) {
        const TensorView& v = t->shards()[0].view;
        if (v.is_contiguous()) {
          buf = static_cast<std::byte*>(v.data()) + begin;
        } else {
          internal_core::CopyRowMajorBytes(v, begin, end, staging.get());
          buf = staging.get();
        }
      } else {
        std::memcpy(staging.get(), mine->object()->bytes.data() + begin,
                    end - begin);
        buf = staging.get();
      }
      CAIRN_RETURN_IF_ERROR(internal_core::Annotate(
          comm.BroadcastBytes(std::span<std::byte>(buf, end - begin), root),
          absl::StrCat(op, ": ", leaf.fqn)));
    }
  }

  // Step 4.
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < header->leaves.size(); ++i) {
    index[header->leaves[i].fqn] = i;
  }
  return internal_core::Unflatten(
      header->structure,
      [&](const std::string& fqn) -> absl::StatusOr<StateDict> {
        auto it = index.find(fqn);
        if (it == index.end()) {
          return absl::DataLossError(
              absl::StrCat(op, ": the header's structure names ", fqn,
                           " but lists no such leaf"));
        }
        if (is_root) return *flat.leaves[it->second].node;
        Leaf& leaf = header->leaves[it->second];
        switch (leaf.kind) {
          case StateDict::Kind::kTensor:
            return StateDict(leaf.tensor);
          case StateDict::Kind::kObject:
            return StateDict(std::move(leaf.object));
          default:
            return StateDict(leaf.scalar);
        }
      });
}

}  // namespace cairn
