#include "plan/columnar_plan.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "core/big_vector.h"
#include "core/byte_codec.h"
#include "core/checked.h"
#include "core/parallel.h"
#include "core/status.h"
#include "format/metadata_codec.h"

namespace cairn::internal_plan {
namespace {

using internal_core::AsAbsl;
using internal_core::ByteReader;
using internal_core::ByteWriter;

using internal_core::BigVector;

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
// A plan's encoding starts with the scalar-values flag and the item count.
constexpr size_t kHeader = 1 + 8;

// Fields of a message the ByteReader has already bounds-checked, read
// again in place: little-endian, as ByteWriter wrote them.
inline uint64_t LoadU64(const char* p) {
  return internal_core::LoadLittleU64(p);
}
// An encoded Ints list (count, then values) at `p`.
inline void LoadInts(const char* p, std::vector<int64_t>& out) {
  out.resize(LoadU64(p));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<int64_t>(LoadU64(p + 8 + 8 * i));
  }
}
// `box` points at an encoded box (offsets, then sizes).
inline size_t BoxRank(const char* box) { return LoadU64(box); }
// Its `rank` offsets, then its `rank` sizes, into out[0, 2 * rank).
inline void LoadBoxDims(const char* box, size_t rank, int64_t* out) {
  for (size_t i = 0; i < rank; ++i) {
    out[i] = static_cast<int64_t>(LoadU64(box + 8 + 8 * i));
    out[rank + i] = static_cast<int64_t>(LoadU64(box + 16 + 8 * rank + 8 * i));
  }
}
// Box::offsets' operator<, on encoded boxes.
bool OffsetsLess(const char* a, const char* b) {
  const size_t na = BoxRank(a);
  const size_t nb = BoxRank(b);
  for (size_t i = 0; i < na && i < nb; ++i) {
    const int64_t x = static_cast<int64_t>(LoadU64(a + 8 + 8 * i));
    const int64_t y = static_cast<int64_t>(LoadU64(b + 8 + 8 * i));
    if (x != y) return x < y;
  }
  return na < nb;
}

// Not an error of the save: the columnar path does not plan this input,
// and PlanGlobalSave (which does, or names what is wrong) must.
absl::Status Unsupported(std::string_view why) {
  return absl::FailedPreconditionError(
      absl::StrCat("columnar global planning: ", AsAbsl(why)));
}

// One item of a local plan: where its fields are in its rank's message.
// A final item's encoding is its local item's bytes [begin, end).
struct Item {
  uint32_t begin;  // its FQN
  uint32_t box;    // its box: offsets, then sizes
  uint32_t end;    // one past it; nbytes and local_index are the last 16
  uint32_t fqn;    // index into State::fqns
};

// What every item of one FQN agrees on (checked as items are read).
struct Fqn {
  std::string_view name;
  ItemKind kind = ItemKind::kTensor;
  DType dtype = DType::kU8;
  std::string_view shape_bytes;  // its global shape as encoded
  Shape shape;
  uint64_t object_bytes = 0;  // objects: the size of every copy
  bool has_bytes = false;     // a tensor item of it holds bytes
  uint32_t kept = 0;          // its final items (after Dedup)
};

}  // namespace

struct ColumnarPlans::State {
  std::vector<std::string_view> messages;  // the encoded local plans
  std::vector<size_t> base;  // rank r's items: [base[r], base[r + 1])
  std::vector<uint32_t> tails;  // where rank r's scalars begin
  std::vector<absl::string_view> structures;
  BigVector<Item> items;
  std::vector<Fqn> fqns;
  // After Dedup: each item's index in its rank's final plan, or kNone.
  BigVector<uint32_t> final_index;
  std::vector<uint32_t> kept;  // per rank: final items

  size_t world() const { return messages.size(); }
  // Item i's encoded box (offsets, then sizes), in rank r's message.
  std::string_view BoxBytes(size_t i, size_t r) const {
    const Item& item = items[i];
    return std::string_view(messages[r].data() + item.box,
                            item.end - 16 - item.box);
  }
};

ColumnarPlans::ColumnarPlans(std::unique_ptr<State> state)
    : s_(std::move(state)) {}
ColumnarPlans::ColumnarPlans(ColumnarPlans&&) noexcept = default;
ColumnarPlans& ColumnarPlans::operator=(ColumnarPlans&&) noexcept = default;
ColumnarPlans::~ColumnarPlans() = default;

// Reads what DecodeSavePlan reads, with the same ByteReader, so a message
// is accepted here only when DecodeSavePlan accepts it; and checks what
// ValidateLocalPlans checks (only whether it passes: on a failure the
// caller runs the classic path for the message).
absl::StatusOr<ColumnarPlans> ColumnarPlans::Decode(
    const std::vector<std::string>& encoded) {
  auto state = std::make_unique<State>();
  State& s = *state;
  const size_t world = encoded.size();
  s.messages.assign(encoded.begin(), encoded.end());
  s.tails.resize(world);
  s.structures.resize(world);
  // Each rank's items' place, from the messages' item counts (checked
  // against their sizes).
  s.base.assign(world + 1, 0);
  for (size_t r = 0; r < world; ++r) {
    if (encoded[r].size() >= kNone) return Unsupported("a local plan of 4 GiB");
    ByteReader rd(encoded[r], std::string());
    rd.U8();
    s.base[r + 1] = s.base[r] + rd.Count(32);
  }
  if (s.base[world] >= kNone) return Unsupported("4G items");
  s.items.resize(s.base[world]);

  // 1. Each rank's message on its own (ranks on threads): every field read
  // with the ByteReader's checks, each tensor item's box checked against
  // the global shape the item states and its byte count against the box.
  CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
      static_cast<int64_t>(world), internal_core::ThreadsFor(s.base[world]),
      [&](int64_t r) -> absl::Status {
        const std::string_view m = s.messages[r];
        ByteReader rd(m, std::string());
        // The final plans are encoded without values; a plan with them
        // would re-encode to other bytes.
        if (rd.U8() != 0) return Unsupported("a local plan with scalar values");
        const uint64_t n = rd.Count(32);
        Shape shape;
        Box box;  // reused, so no allocation per item
        for (uint64_t i = 0; i < n; ++i) {
          Item& item = s.items[s.base[r] + i];
          item.begin = static_cast<uint32_t>(rd.position());
          rd.StrView();
          const uint8_t kind = rd.U8();
          const uint8_t dtype = rd.U8();
          const size_t shape_at = rd.position();
          rd.SkipInts();
          item.box = static_cast<uint32_t>(rd.position());
          const uint64_t num_offsets = rd.SkipInts();
          const uint64_t num_sizes = rd.SkipInts();
          const uint64_t nbytes = rd.U64();
          rd.I64();
          if (rd.failed() || kind > static_cast<uint8_t>(ItemKind::kObject) ||
              dtype >= AllDTypes().size() ||
              num_offsets != num_sizes) {
            return Unsupported("a malformed local plan");
          }
          item.end = static_cast<uint32_t>(rd.position());
          item.fqn = kNone;
          if (kind == static_cast<uint8_t>(ItemKind::kObject)) continue;
          LoadInts(m.data() + shape_at, shape);
          LoadInts(m.data() + item.box, box.offsets);
          LoadInts(m.data() + item.box + 8 + 8 * num_offsets, box.sizes);
          if (!ValidateBox(box, shape).ok()) return Unsupported("a box");
          const std::optional<uint64_t> bytes = internal_core::CheckedBytes(
              box.sizes, static_cast<DType>(dtype));
          if (!bytes || *bytes != nbytes) return Unsupported("item sizes");
        }
        s.tails[r] = static_cast<uint32_t>(rd.position());
        // The final plan carries these bytes as they are, so they must be
        // what EncodeSavePlan writes: names in map order, each once.
        const uint64_t num_scalars = rd.Count(9);
        std::string_view last;
        for (uint64_t i = 0; i < num_scalars; ++i) {
          const std::string_view name = rd.StrView();
          if (rd.U8() > 3) return Unsupported("a malformed local plan");
          if (i > 0 && !(last < name)) return Unsupported("unsorted scalars");
          last = name;
        }
        s.structures[r] = AsAbsl(rd.StrView());
        rd.StrView();  // planner_data
        rd.StrView();  // storage_data
        if (!rd.status().ok()) return Unsupported("a malformed local plan");
        return absl::OkStatus();
      }));

  // 2. The FQNs, in order of first appearance (rank by rank): one kind,
  // dtype and shape per FQN (objects too: other shapes would not change
  // the result, but are nothing a planner makes), one size per object.
  // The fields were checked above and are read again in place.
  absl::flat_hash_map<absl::string_view, uint32_t> ids;
  absl::flat_hash_set<absl::string_view> scalar_names;
  for (size_t r = 0; r < world; ++r) {
    const std::string_view m = s.messages[r];
    // Ranks of one pipeline stage list the same FQNs in the same order:
    // the previous rank's item at the same position is the first guess.
    const size_t prev = r > 0 ? s.base[r - 1] : 0;
    const size_t prev_n = r > 0 ? s.base[r] - s.base[r - 1] : 0;
    for (size_t i = 0; i < s.base[r + 1] - s.base[r]; ++i) {
      Item& item = s.items[s.base[r] + i];
      const size_t name_length = LoadU64(m.data() + item.begin);
      const size_t kind_at = item.begin + 8 + name_length;
      const std::string_view name = m.substr(item.begin + 8, name_length);
      const uint8_t kind = static_cast<uint8_t>(m[kind_at]);
      const uint8_t dtype = static_cast<uint8_t>(m[kind_at + 1]);
      const std::string_view shape_bytes =
          m.substr(kind_at + 2, item.box - (kind_at + 2));
      const uint64_t nbytes = LoadU64(m.data() + item.end - 16);
      if (i < prev_n && s.fqns[s.items[prev + i].fqn].name == name) {
        item.fqn = s.items[prev + i].fqn;
      } else {
        auto [it, inserted] = ids.try_emplace(
            AsAbsl(name), static_cast<uint32_t>(s.fqns.size()));
        item.fqn = it->second;
        if (inserted) {
          Fqn f;
          f.name = name;
          f.kind = static_cast<ItemKind>(kind);
          f.dtype = static_cast<DType>(dtype);
          f.shape_bytes = shape_bytes;
          LoadInts(shape_bytes.data(), f.shape);
          f.object_bytes = nbytes;
          s.fqns.push_back(std::move(f));
        }
      }
      Fqn& f = s.fqns[item.fqn];
      if (static_cast<uint8_t>(f.kind) != kind ||
          static_cast<uint8_t>(f.dtype) != dtype ||
          f.shape_bytes != shape_bytes) {
        return Unsupported("FQNs of several forms");
      }
      if (f.kind == ItemKind::kObject) {
        if (nbytes != f.object_bytes) return Unsupported("object sizes");
      } else {
        f.has_bytes |= nbytes > 0;
      }
    }
    ByteReader rd(m.substr(s.tails[r]), std::string());
    const uint64_t num_scalars = rd.Count(9);
    for (uint64_t i = 0; i < num_scalars; ++i) {
      scalar_names.insert(AsAbsl(rd.StrView()));
      rd.U8();
    }
  }
  for (const Fqn& f : s.fqns) {
    if (scalar_names.contains(AsAbsl(f.name))) {
      return Unsupported("an FQN that is also a scalar");
    }
  }
  return ColumnarPlans(std::move(state));
}

// DedupImpl on ids instead of WriteItems: each rank's first copy of a piece
// its holder, the same greedy order and tie-breaking, zero-byte
// declarations dropped where the tensor has bytes. A piece is found within
// its FQN (DedupImpl's pieces are (FQN, kind, box), and an FQN has one
// kind), and only pieces with several holders keep a list of them: where
// no box is replicated (FSDP), the flat arrays are an item's hash, its
// place in its FQN's list and its verdict, so little new memory is touched.
void ColumnarPlans::Dedup(DedupPolicy policy) {
  State& s = *s_;
  const size_t world = s.world();
  const size_t n = s.items.size();
  const size_t num_fqns = s.fqns.size();
  const int threads = internal_core::ThreadsFor(n);
  // Each item's encoded box's hash, rank by rank (each message read in
  // order). 32 bits place a piece among its FQN's; equal boxes are then
  // compared byte for byte.
  BigVector<uint32_t> hash(n);
  (void)internal_core::ParallelFor(
      static_cast<int64_t>(world), threads, [&](int64_t r) {
        for (size_t i = s.base[r]; i < s.base[r + 1]; ++i) {
          hash[i] = static_cast<uint32_t>(
              absl::HashOf(AsAbsl(s.BoxBytes(i, static_cast<size_t>(r)))));
        }
        return absl::OkStatus();
      });
  // The items of each FQN, in (rank, item) order: a stable counting sort.
  std::vector<size_t> fqn_start(num_fqns + 1, 0);
  for (size_t i = 0; i < n; ++i) ++fqn_start[s.items[i].fqn + 1];
  for (size_t f = 0; f < num_fqns; ++f) fqn_start[f + 1] += fqn_start[f];
  BigVector<uint32_t> by_fqn(n);
  {
    std::vector<size_t> next(fqn_start.begin(), fqn_start.end() - 1);
    for (size_t i = 0; i < n; ++i) {
      by_fqn[next[s.items[i].fqn]++] = static_cast<uint32_t>(i);
    }
  }
  // An FQN's distinct pieces, in the order first seen, each with its first
  // item (on its lowest rank, which orders pieces as DedupImpl's
  // first-seen ids do); `more` lists the other holders (ranks: a second
  // copy on one rank is not one) of pieces with several, piece by piece in
  // rank order, from more_at[piece].
  struct Holder {
    uint32_t item;
    uint32_t rank;
  };
  struct FqnPieces {
    std::vector<Holder> first;
    std::vector<Holder> more;
    std::vector<uint32_t> more_at;  // empty when `more` is
    uint32_t Holders(size_t piece) const {
      return more_at.empty() ? 1 : 1 + more_at[piece + 1] - more_at[piece];
    }
  };
  std::vector<FqnPieces> pieces(num_fqns);
  // The hash set holds a piece's index in `first`, and is searched with an
  // item.
  struct ItemKey {
    uint32_t item;
    uint32_t rank;
  };
  struct Lookup {
    const State* s;
    const BigVector<uint32_t>* hash;
    const std::vector<Holder>* first;  // the current FQN's
  };
  struct PieceHash {
    using is_transparent = void;
    const Lookup* l;
    size_t operator()(uint32_t piece) const {
      return (*l->hash)[(*l->first)[piece].item];
    }
    size_t operator()(ItemKey k) const { return (*l->hash)[k.item]; }
  };
  struct PieceEq {
    using is_transparent = void;
    const Lookup* l;
    bool Same(ItemKey k, uint32_t piece) const {
      const Holder& h = (*l->first)[piece];
      return (*l->hash)[k.item] == (*l->hash)[h.item] &&
             l->s->BoxBytes(k.item, k.rank) == l->s->BoxBytes(h.item, h.rank);
    }
    bool operator()(uint32_t a, uint32_t b) const { return a == b; }
    bool operator()(ItemKey a, uint32_t b) const { return Same(a, b); }
    bool operator()(uint32_t a, ItemKey b) const { return Same(b, a); }
  };
  (void)internal_core::ParallelFor(
      static_cast<int64_t>(num_fqns), threads, [&](int64_t f) {
        FqnPieces& p = pieces[f];
        std::vector<uint32_t> last_rank;  // each piece's last holder
        const Lookup lookup{&s, &hash, &p.first};
        absl::flat_hash_set<uint32_t, PieceHash, PieceEq> ids(
            0, PieceHash{&lookup}, PieceEq{&lookup});
        ids.reserve(fqn_start[f + 1] - fqn_start[f]);
        std::vector<uint32_t> more_piece;  // the piece of each `more` entry
        size_t r = 0;  // the rank of item by_fqn[k]: they come in rank order
        for (size_t k = fqn_start[f]; k < fqn_start[f + 1]; ++k) {
          const uint32_t i = by_fqn[k];
          while (s.base[r + 1] <= i) ++r;
          const ItemKey key{i, static_cast<uint32_t>(r)};
          bool inserted = false;
          const uint32_t piece =
              *ids.lazy_emplace(key, [&](const auto& ctor) {
                inserted = true;
                p.first.push_back(Holder{i, key.rank});
                ctor(static_cast<uint32_t>(p.first.size() - 1));
              });
          if (inserted) {
            last_rank.push_back(key.rank);
          } else if (last_rank[piece] != key.rank) {
            last_rank[piece] = key.rank;
            p.more.push_back(Holder{i, key.rank});
            more_piece.push_back(piece);
          }
        }
        if (p.more.empty()) return absl::OkStatus();
        // Group `more` by piece, keeping rank order: a stable counting sort.
        p.more_at.assign(p.first.size() + 1, 0);
        for (uint32_t piece : more_piece) ++p.more_at[piece + 1];
        for (size_t q = 0; q < p.first.size(); ++q) {
          p.more_at[q + 1] += p.more_at[q];
        }
        std::vector<Holder> grouped(p.more.size());
        std::vector<uint32_t> next(p.more_at.begin(), p.more_at.end() - 1);
        for (size_t e = 0; e < p.more.size(); ++e) {
          grouped[next[more_piece[e]]++] = p.more[e];
        }
        p.more.swap(grouped);
        return absl::OkStatus();
      });
  internal_core::ReleaseStorage(hash);
  internal_core::ReleaseStorage(by_fqn);

  auto nbytes = [&](const Holder& h) {
    return LoadU64(s.messages[h.rank].data() + s.items[h.item].end - 16);
  };
  BigVector<uint8_t> keep(n, 0);
  std::vector<uint64_t> load(world, 0);
  // The replicated pieces in DedupImpl's greedy order: fewest holders
  // first, larger before smaller, then first seen (its stable sort's ties).
  struct Replicated {
    uint32_t holders;
    uint32_t fqn;
    uint32_t piece;  // in the FQN's
    uint64_t bytes;
    uint32_t first_item;  // DedupImpl's ids are in first-seen order
  };
  std::vector<Replicated> replicated;
  for (size_t f = 0; f < num_fqns; ++f) {
    const FqnPieces& p = pieces[f];
    for (size_t q = 0; q < p.first.size(); ++q) {
      const Holder& h = p.first[q];  // the lowest rank
      const uint32_t holders = p.Holders(q);
      if (holders == 1 || policy == DedupPolicy::kLowestRank) {
        keep[h.item] = 1;
        load[h.rank] += nbytes(h);
      } else {
        replicated.push_back(Replicated{holders, static_cast<uint32_t>(f),
                                        static_cast<uint32_t>(q), nbytes(h),
                                        h.item});
      }
    }
  }
  std::sort(replicated.begin(), replicated.end(),
            [](const Replicated& a, const Replicated& b) {
              if (a.holders != b.holders) return a.holders < b.holders;
              if (a.bytes != b.bytes) return a.bytes > b.bytes;
              return a.first_item < b.first_item;
            });
  for (const Replicated& rp : replicated) {
    const FqnPieces& p = pieces[rp.fqn];
    const Holder* best = &p.first[rp.piece];
    for (size_t e = p.more_at[rp.piece]; e < p.more_at[rp.piece + 1]; ++e) {
      if (load[p.more[e].rank] < load[best->rank]) best = &p.more[e];
    }
    keep[best->item] = 1;
    load[best->rank] += rp.bytes;
  }
  internal_core::ReleaseStorage(replicated);
  internal_core::ReleaseStorage(pieces);

  // Zero-byte tensor items only declare a tensor: kept only for a tensor no
  // rank writes bytes of.
  s.final_index.assign(n, kNone);
  s.kept.assign(world, 0);
  for (Fqn& f : s.fqns) f.kept = 0;
  for (size_t r = 0; r < world; ++r) {
    const char* m = s.messages[r].data();
    for (size_t i = s.base[r]; i < s.base[r + 1]; ++i) {
      if (!keep[i]) continue;
      Fqn& f = s.fqns[s.items[i].fqn];
      if (f.kind == ItemKind::kTensor && f.has_bytes &&
          LoadU64(m + s.items[i].end - 16) == 0) {
        continue;
      }
      s.final_index[i] = s.kept[r]++;
      ++f.kept;
    }
  }
}

absl::StatusOr<MetadataSkeleton> ColumnarPlans::BuildSkeleton() const {
  const State& s = *s_;
  const size_t world = s.world();
  MetadataSkeleton out;
  Metadata& md = out.metadata;
  md.world_size = static_cast<int>(world);
  out.refs.resize(world);
  // Each FQN's final tensor items: start[f + 1] - start[f] of them.
  std::vector<size_t> start(s.fqns.size() + 1, 0);
  for (size_t f = 0; f < s.fqns.size(); ++f) {
    const bool tensor = s.fqns[f].kind == ItemKind::kTensor;
    start[f + 1] = start[f] + (tensor ? s.fqns[f].kept : 0);
  }
  // The tensors' map entries (the map is not thread-safe); the chunks go
  // flat, tensor by tensor in the map's (name) order.
  // fqn_of[t]: the FQN of tensor t, in name order (the map's: names are
  // distinct, and std::string orders as string_view does); tensor_of[f]:
  // the other way.
  std::vector<size_t> fqn_of;
  for (size_t f = 0; f < s.fqns.size(); ++f) {
    if (start[f] != start[f + 1]) fqn_of.push_back(f);
  }
  std::sort(fqn_of.begin(), fqn_of.end(), [&](size_t a, size_t b) {
    return s.fqns[a].name < s.fqns[b].name;
  });
  std::vector<size_t> tensor_of(s.fqns.size(), 0);
  internal_format::FlatChunks& flat = out.flat;
  out.uses_flat = true;
  size_t dims = 0;
  for (size_t t = 0; t < fqn_of.size(); ++t) {
    const size_t f = fqn_of[t];
    tensor_of[f] = t;
    TensorMetadata& tm =
        md.tensors.emplace_hint(md.tensors.end(), std::string(s.fqns[f].name),
                                TensorMetadata{})
            ->second;
    tm.dtype = s.fqns[f].dtype;
    tm.shape = s.fqns[f].shape;
    const size_t count = start[f + 1] - start[f];
    flat.dims_at.push_back(dims);
    dims += 2 * tm.shape.size() * count;
    flat.first.push_back(flat.first.back() + count);
  }
  flat.dims.resize(dims);
  flat.files.assign(world + 1, std::string());
  flat.ResizeLocations();
  out.chunk_refs.resize(world);

  // BuildMetadataSkeleton lists each FQN's items in (rank, item) order and
  // sorts them by box (offsets). Listed in rank order they are often in
  // order already (a dimension split over consecutive ranks), and a
  // strictly increasing sequence is what any sort returns. So one pass in
  // rank order, reading the plans front to back, puts every item at its
  // place in that order (its box's dimensions, its chunk ref) and notes
  // each FQN whose items are not strictly increasing; only those are
  // gathered again and sorted, on the same sequence with the same
  // comparisons' outcomes (equal offsets included) as there.
  struct Chunk {
    int64_t first_offset;  // the sort key, but for ties
    const char* box;
    uint32_t rank;
    uint32_t index;  // in the rank's final plan
  };
  const auto less = [](const Chunk& a, const Chunk& b) {
    if (a.first_offset != b.first_offset) {
      return a.first_offset < b.first_offset;
    }
    return OffsetsLess(a.box, b.box);
  };
  auto chunk_at = [](const char* box, size_t r, uint32_t index) {
    return Chunk{BoxRank(box) > 0 ? static_cast<int64_t>(LoadU64(box + 8)) : 0,
                 box, static_cast<uint32_t>(r), index};
  };
  std::vector<size_t> next(start.begin(), start.end() - 1);
  std::vector<Chunk> last(s.fqns.size(), Chunk{0, nullptr, 0, 0});
  std::vector<uint8_t> unsorted(s.fqns.size(), 0);
  std::vector<ByteLocation*> object_location(s.fqns.size(), nullptr);
  for (size_t r = 0; r < world; ++r) {
    out.chunk_refs[r].resize(s.kept[r]);
    out.refs[r].resize(s.kept[r]);
    uint32_t* refs = out.chunk_refs[r].data();
    const char* m = s.messages[r].data();
    for (size_t i = s.base[r]; i < s.base[r + 1]; ++i) {
      const uint32_t index = s.final_index[i];
      if (index == kNone) continue;
      const Item& item = s.items[i];
      const Fqn& f = s.fqns[item.fqn];
      if (f.kind == ItemKind::kObject) {
        ByteLocation*& loc = object_location[item.fqn];
        if (loc == nullptr) loc = &md.objects[std::string(f.name)];
        out.refs[r][index] = loc;
        continue;
      }
      const char* box = m + item.box;
      const Chunk chunk = chunk_at(box, r, index);
      Chunk& before = last[item.fqn];
      if (before.box != nullptr && !less(before, chunk)) unsorted[item.fqn] = 1;
      before = chunk;
      const size_t t = tensor_of[item.fqn];
      const size_t k = next[item.fqn]++ - start[item.fqn];
      const size_t rank = f.shape.size();
      LoadBoxDims(box, rank, flat.dims.data() + flat.dims_at[t] + 2 * rank * k);
      refs[index] = static_cast<uint32_t>(flat.first[t] + k);
    }
  }
  // The FQNs out of order: their items gathered again, sorted, and their
  // dimensions and refs written again in that order.
  std::vector<size_t> sort_fqns;
  for (size_t f = 0; f < s.fqns.size(); ++f) {
    if (unsorted[f]) sort_fqns.push_back(f);
  }
  if (!sort_fqns.empty()) {
    std::vector<size_t> at(s.fqns.size() + 1, 0);  // in `chunks`
    for (size_t f = 0; f < s.fqns.size(); ++f) {
      at[f + 1] = at[f] + (unsorted[f] ? start[f + 1] - start[f] : 0);
    }
    BigVector<Chunk> chunks(at.back());
    std::vector<size_t> put(at.begin(), at.end() - 1);
    for (size_t r = 0; r < world; ++r) {
      const char* m = s.messages[r].data();
      for (size_t i = s.base[r]; i < s.base[r + 1]; ++i) {
        const uint32_t index = s.final_index[i];
        if (index == kNone || !unsorted[s.items[i].fqn]) continue;
        chunks[put[s.items[i].fqn]++] = chunk_at(m + s.items[i].box, r, index);
      }
    }
    CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
        static_cast<int64_t>(sort_fqns.size()),
        internal_core::ThreadsFor(at.back()), [&](int64_t j) {
          const size_t f = sort_fqns[j];
          const size_t t = tensor_of[f];
          const size_t rank = s.fqns[f].shape.size();
          const auto begin = chunks.begin() + at[f];
          const auto end = chunks.begin() + at[f + 1];
          std::sort(begin, end, less);
          int64_t* d = flat.dims.data() + flat.dims_at[t];
          size_t c = flat.first[t];
          for (auto it = begin; it != end; ++it, ++c, d += 2 * rank) {
            LoadBoxDims(it->box, rank, d);
            out.chunk_refs[it->rank][it->index] = static_cast<uint32_t>(c);
          }
          return absl::OkStatus();
        }));
  }
  CAIRN_ASSIGN_OR_RETURN(md.structure, MergeStructureViews(s.structures));
  return out;
}

absl::Status ColumnarPlans::ValidateFinal(const MetadataSkeleton& skeleton,
                                          bool require_coverage) const {
  for (const Fqn& f : s_->fqns) {
    if (f.kept == 0) return Unsupported("an FQN no rank writes");
    if (f.kind == ItemKind::kObject && f.kept > 1) {
      return Unsupported("an object written twice");
    }
  }
  if (!require_coverage) return absl::OkStatus();
  if (!skeleton.uses_flat) return Unsupported("a skeleton not built here");
  std::vector<const std::pair<const std::string, TensorMetadata>*> tensors;
  tensors.reserve(skeleton.metadata.tensors.size());
  for (const auto& entry : skeleton.metadata.tensors) tensors.push_back(&entry);
  // Whether the boxes cover the shape exactly once does not depend on
  // their order: the same verdict as ValidateFinalPlans' call.
  return internal_core::ParallelFor(
      static_cast<int64_t>(tensors.size()),
      internal_core::ThreadsFor(skeleton.flat.num_chunks()),
      [&](int64_t t) {
        return internal_format::ValidateCoverage(
                   tensors[t]->first, tensors[t]->second.shape, skeleton.flat,
                   static_cast<size_t>(t))
                       .ok()
                   ? absl::OkStatus()
                   : Unsupported("a tensor not covered exactly once");
      });
}

// EncodeSavePlan's layout: without scalar values, the item count, the
// items, then the scalars, structure and opaque slots (the local plan's own
// bytes from its scalars on).
std::string ColumnarPlans::CopyFinal(size_t r, std::string_view prefix) const {
  const State& s = *s_;
  const std::string_view m = s.messages[r];
  size_t bytes = prefix.size() + kHeader + (m.size() - s.tails[r]);
  for (size_t i = s.base[r]; i < s.base[r + 1]; ++i) {
    if (s.final_index[i] != kNone) bytes += s.items[i].end - s.items[i].begin;
  }
  ByteWriter w;
  w.Reserve(bytes);
  w.Raw(prefix);
  w.U8(0);
  w.U64(s.kept[r]);
  for (size_t i = s.base[r]; i < s.base[r + 1]; ++i) {
    if (s.final_index[i] == kNone) continue;
    w.Raw(m.substr(s.items[i].begin, s.items[i].end - s.items[i].begin));
  }
  w.Raw(m.substr(s.tails[r]));
  return w.Take();
}

std::vector<std::string> ColumnarPlans::EncodeFinals(
    std::vector<std::string>& encoded, std::string_view prefix) {
  const State& s = *s_;
  std::vector<std::string> payloads;
  payloads.reserve(s.world());
  const size_t p = prefix.size();
  for (size_t r = 0; r < s.world(); ++r) {
    // The final plan is the local one with its dropped items cut out and
    // `prefix` in front: built in place, in memory already faulted in (a
    // new string per rank is as much fresh memory as all final plans).
    // That needs a dropped item at least as long as the prefix, whose
    // bytes the kept items before it move over; later items only move
    // towards the front.
    size_t first_dropped = s.base[r];
    while (first_dropped < s.base[r + 1] &&
           s.final_index[first_dropped] != kNone) {
      ++first_dropped;
    }
    // Nothing dropped: the final plan is the local one (the header, the
    // scalar-values flag 0 and the item count, is the same too), which the
    // rank has; it gets the prefix alone.
    if (first_dropped == s.base[r + 1]) {
      payloads.emplace_back(prefix);
      continue;
    }
    const bool in_place =
        r < encoded.size() && encoded[r].data() == s.messages[r].data() &&
        encoded[r].size() == s.messages[r].size() &&
        first_dropped < s.base[r + 1] &&
        s.items[first_dropped].end - s.items[first_dropped].begin >= p;
    if (!in_place) {
      payloads.push_back(CopyFinal(r, prefix));
      continue;
    }
    std::string& m = encoded[r];
    char* d = m.data();
    const size_t lead = s.items[first_dropped].begin;
    std::memmove(d + kHeader + p, d + kHeader, lead - kHeader);
    size_t out = lead + p;
    for (size_t i = first_dropped + 1; i < s.base[r + 1]; ++i) {
      if (s.final_index[i] == kNone) continue;
      const size_t len = s.items[i].end - s.items[i].begin;
      std::memmove(d + out, d + s.items[i].begin, len);
      out += len;
    }
    const size_t tail = m.size() - s.tails[r];
    std::memmove(d + out, d + s.tails[r], tail);
    out += tail;
    std::memcpy(d, prefix.data(), p);
    ByteWriter header;
    header.U8(0);  // without scalar values
    header.U64(s.kept[r]);
    std::memcpy(d + p, header.data().data(), kHeader);
    m.resize(out);
    payloads.push_back(std::move(m));
  }
  s_ = nullptr;  // its views into `encoded` are stale
  return payloads;
}

absl::StatusOr<EncodedGlobalPlan> PlanGlobalSaveColumnar(
    std::vector<std::string>& encoded, DedupPolicy policy,
    bool require_coverage, std::string_view prefix) {
  CAIRN_ASSIGN_OR_RETURN(ColumnarPlans plans, ColumnarPlans::Decode(encoded));
  plans.Dedup(policy);
  EncodedGlobalPlan g;
  CAIRN_ASSIGN_OR_RETURN(g.skeleton, plans.BuildSkeleton());
  CAIRN_RETURN_IF_ERROR(plans.ValidateFinal(g.skeleton, require_coverage));
  g.payloads = plans.EncodeFinals(encoded, prefix);
  return g;
}

absl::StatusOr<EncodedGlobalPlan> PlanGlobalSaveDispatch(
    SavePlanner& planner, std::optional<DedupPolicy> default_policy,
    std::vector<std::string>& encoded, bool require_coverage,
    std::string_view prefix) {
  if (default_policy.has_value()) {
    absl::StatusOr<EncodedGlobalPlan> g = PlanGlobalSaveColumnar(
        encoded, *default_policy, require_coverage, prefix);
    if (g.ok()) return g;
    // Not the save's error: the classic path below plans what the columnar
    // one does not, or fails with the error naming the FQN, ranks and boxes.
  }
  return PlanGlobalSave(planner, encoded, require_coverage, prefix);
}

}  // namespace cairn::internal_plan
