// metadata.json codec, validation: the checks of decoded metadata that
// DecodeMetadata leaves to its callers (docs/format.md): every tensor's
// chunks cover it exactly once (ValidateCoverage), locations lie inside
// their files (ValidateAgainstFileSizes) and share no byte
// (ValidateDisjointLocations), and the structure names the stored leaves
// (ValidateStructure).
#include "format/metadata_codec.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "core/checked.h"
#include "core/flatten.h"
#include "core/parallel.h"
#include "core/status.h"
#include "format/kv_codec.h"
#include "format/metadata_codec_internal.h"
#include "format/names.h"

namespace cairn::internal_format {

// Plan: every chunk inside the shape; no two non-empty chunks overlap; the
// volumes sum to the tensor's. Inside + disjoint + equal volume == exact
// tiling. The overlap test sweeps along the dimension with the most distinct
// chunk offsets, comparing each chunk only with the chunks still "open" at
// its start along that dimension: for the usual row, column and grid
// shardings that is a handful, so thousands of chunks cost O(n log n).
// (Adversarial layouts can still make it quadratic; it stays correct.)
absl::Status ValidateCoverage(std::string_view fqn,
                              const TensorMetadata& tensor) {
  std::vector<const Box*> boxes;
  boxes.reserve(tensor.chunks.size());
  for (const ChunkMetadata& chunk : tensor.chunks) boxes.push_back(&chunk.box);
  return ValidateCoverage(fqn, tensor.shape, boxes);
}

absl::Status ValidateAllCoverage(const Metadata& metadata) {
  size_t chunks = 0;
  const std::vector<const TensorEntry*> tensors = TensorList(metadata, &chunks);
  return internal_core::ParallelFor(
      static_cast<int64_t>(tensors.size()), internal_core::ThreadsFor(chunks),
      [&](int64_t t) {
        return ValidateCoverage(tensors[t]->first, tensors[t]->second);
      });
}

namespace {

// Half-open overlap of two boxes of the same rank that lie inside one shape
// (so the ends cannot overflow).
template <typename B>  // Box or FlatBox
bool Overlaps(const B& a, const B& b) {
  for (size_t d = 0; d < a.sizes.size(); ++d) {
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] ||
        b.offsets[d] >= a.offsets[d] + a.sizes[d]) {
      return false;
    }
  }
  return true;
}

std::string ChunkName(std::string_view fqn, const Shape& shape,
                      const Box& box) {
  return EntryName(fqn, box, box == Box::Full(shape));
}

// A box of FlatChunks, in place: what Coverage reads of a Box.
struct FlatBox {
  std::span<const int64_t> offsets;
  std::span<const int64_t> sizes;
  bool empty() const {
    return std::find(sizes.begin(), sizes.end(), 0) != sizes.end();
  }
};
const Box& AsBox(const Box& box) { return box; }
Box AsBox(const FlatBox& box) {
  return Box{std::vector<int64_t>(box.offsets.begin(), box.offsets.end()),
             std::vector<int64_t>(box.sizes.begin(), box.sizes.end())};
}
absl::Status CheckBox(const Box& box, const Shape& shape) {
  return ValidateBox(box, shape);
}
// Whether the box lies inside the shape, without a Box; ValidateBox's
// message (from a Box made only then) when not. ValidateBox also refuses a
// shape whose element count overflows, which Coverage refuses right after
// ("shape overflows"): same verdict, another message.
absl::Status CheckBox(const FlatBox& box, const Shape& shape) {
  bool inside = box.sizes.size() == shape.size();
  for (size_t d = 0; inside && d < shape.size(); ++d) {
    int64_t end = 0;
    inside = box.offsets[d] >= 0 && box.sizes[d] >= 0 &&
             !__builtin_add_overflow(box.offsets[d], box.sizes[d], &end) &&
             end <= shape[d];
  }
  if (inside) return absl::OkStatus();
  absl::Status s = ValidateBox(AsBox(box), shape);
  return s.ok() ? absl::InvalidArgumentError("box lies outside the shape") : s;
}
// Elements of a box that lies inside a shape whose elements do not
// overflow (so neither do its).
uint64_t Volume(const Box& box) {
  return internal_core::CheckedBytes(box.sizes, DType::kU8).value_or(0);
}
uint64_t Volume(const FlatBox& box) {
  uint64_t v = 1;
  for (int64_t s : box.sizes) v *= static_cast<uint64_t>(s);
  return v;
}

template <typename B>
absl::Status Coverage(std::string_view fqn, const Shape& shape,
                      std::span<const B* const> all_boxes) {
  const std::string where = absl::StrCat("tensor ", Quote(fqn));
  for (const B* box : all_boxes) {
    if (absl::Status s = CheckBox(*box, shape); !s.ok()) {
      return absl::DataLossError(absl::StrCat(
          where, ": chunk ", ChunkName(fqn, shape, AsBox(*box)), " ",
          AsBox(*box).ToString(), " lies outside the shape: ", s.message()));
    }
  }
  std::optional<uint64_t> total_opt = internal_core::CheckedBytes(shape, DType::kU8);
  if (!total_opt) {
    return absl::DataLossError(absl::StrCat(where, ": shape overflows"));
  }
  const uint64_t total = *total_opt;

  std::vector<const B*> boxes;
  boxes.reserve(all_boxes.size());
  for (const B* box : all_boxes) {
    if (!box->empty()) boxes.push_back(box);
  }
  auto overlap_error = [&](const B& a, const B& b) {
    return absl::DataLossError(absl::StrCat(where, ": chunks ",
                                            AsBox(a).ToString(), " and ",
                                            AsBox(b).ToString(), " overlap"));
  };
  const size_t rank = shape.size();
  if (rank == 0) {
    if (boxes.size() > 1) return overlap_error(*boxes[0], *boxes[1]);
  } else if (boxes.size() > 1) {
    size_t sweep_dim = 0;
    size_t most_distinct = 0;
    std::vector<int64_t> starts(boxes.size());
    for (size_t d = 0; d < rank; ++d) {
      for (size_t i = 0; i < boxes.size(); ++i)
        starts[i] = boxes[i]->offsets[d];
      std::sort(starts.begin(), starts.end());
      const size_t distinct = static_cast<size_t>(
          std::unique(starts.begin(), starts.end()) - starts.begin());
      if (distinct > most_distinct) {
        most_distinct = distinct;
        sweep_dim = d;
      }
    }
    std::sort(boxes.begin(), boxes.end(),
              [sweep_dim](const B* a, const B* b) {
                return a->offsets[sweep_dim] < b->offsets[sweep_dim];
              });
    std::vector<const B*> open;
    for (const B* box : boxes) {
      const int64_t start = box->offsets[sweep_dim];
      // Drop chunks that end at or before this one starts.
      size_t kept = 0;
      for (const B* o : open) {
        if (o->offsets[sweep_dim] + o->sizes[sweep_dim] > start)
          open[kept++] = o;
      }
      open.resize(kept);
      for (const B* o : open) {
        if (Overlaps(*o, *box)) return overlap_error(*o, *box);
      }
      open.push_back(box);
    }
  }

  // Disjoint boxes inside the shape: the sum cannot exceed `total`.
  uint64_t covered = 0;
  for (const B* box : boxes) covered += Volume(*box);
  if (covered != total) {
    return absl::DataLossError(absl::StrCat(
        where, ": chunks cover ", covered, " of ", total, " elements; ",
        total - covered, " elements are in no chunk"));
  }
  return absl::OkStatus();
}


}  // namespace

absl::Status ValidateCoverage(std::string_view fqn, const Shape& shape,
                              const FlatChunks& flat, size_t t) {
  const size_t rank = shape.size();
  std::vector<FlatBox> boxes;
  std::vector<const FlatBox*> pointers;
  boxes.reserve(flat.first[t + 1] - flat.first[t]);
  pointers.reserve(boxes.capacity());
  const int64_t* d = flat.dims.data() + flat.dims_at[t];
  for (size_t c = flat.first[t]; c < flat.first[t + 1]; ++c, d += 2 * rank) {
    boxes.push_back(FlatBox{std::span<const int64_t>(d, rank),
                            std::span<const int64_t>(d + rank, rank)});
    pointers.push_back(&boxes.back());
  }
  return Coverage<FlatBox>(fqn, shape, pointers);
}

absl::Status ValidateCoverage(std::string_view fqn, const Shape& shape,
                              std::span<const Box* const> boxes) {
  return Coverage<Box>(fqn, shape, boxes);
}

absl::Status ValidateAgainstFileSizes(
    const Metadata& metadata,
    const std::map<std::string, uint64_t>& file_sizes) {
  auto check = [&file_sizes](const std::string& what,
                             const ByteLocation& loc) -> absl::Status {
    auto it = file_sizes.find(loc.file);
    if (it == file_sizes.end()) {
      return absl::NotFoundError(
          absl::StrCat(what, ": data file ", Quote(loc.file), " not found"));
    }
    uint64_t end = 0;
    if (__builtin_add_overflow(loc.offset, loc.stored_nbytes(), &end) ||
        end > it->second) {
      return absl::DataLossError(absl::StrCat(
          what, " (", loc.file, ", offset ", loc.offset, ", nbytes ",
          loc.stored_nbytes(), ") runs past the end of the file (size ", it->second,
          ")"));
    }
    return absl::OkStatus();
  };
  for (const auto& [fqn, tensor] : metadata.tensors) {
    for (const ChunkMetadata& chunk : tensor.chunks) {
      CAIRN_RETURN_IF_ERROR(
          check(absl::StrCat("chunk ",
                             Quote(ChunkName(fqn, tensor.shape, chunk.box))),
                chunk.location));
    }
  }
  for (const auto& [fqn, loc] : metadata.objects) {
    CAIRN_RETURN_IF_ERROR(check(absl::StrCat("object ", Quote(fqn)), loc));
  }
  absl::Status status;
  ForEachKvLocation(metadata.kv_tables,
                    [&](const ByteLocation& loc, const std::string& fqn,
                        const KvTableMetadata& table, size_t k, int column) {
                      if (status.ok()) {
                        status = check(KvLocationName(fqn, table, k, column),
                                       loc);
                      }
                    });
  return status;
}

absl::Status ValidateDisjointLocations(const Metadata& metadata) {
  // What the sort compares, and nothing else, held in place (a 16k-rank
  // checkpoint has millions of chunks in thousands of files): the file as
  // an index in order of first appearance, the range, and the location's
  // number in the order for_each_location visits them, which breaks ties
  // the same way whatever the sort does and finds the names for a message.
  struct Span {
    uint32_t file;
    uint32_t index;
    uint64_t offset;
    uint64_t nbytes;
    bool operator<(const Span& o) const {
      return std::tie(file, offset, nbytes, index) <
             std::tie(o.file, o.offset, o.nbytes, o.index);
    }
  };
  // Every location of a byte or more, in a fixed order: `fn(location,
  // name)`, where `name()` gives its chunk's or object's name.
  auto for_each_location = [&metadata](auto&& fn) {
    // (Not structured bindings: clang 14 cannot capture them.)
    for (const auto& entry : metadata.tensors) {
      const std::string& fqn = entry.first;
      const TensorMetadata& tensor = entry.second;
      for (const ChunkMetadata& chunk : tensor.chunks) {
        if (chunk.location.nbytes == 0) continue;  // shares no byte
        fn(chunk.location, [&] {
          return absl::StrCat(
              "chunk ", Quote(ChunkName(fqn, tensor.shape, chunk.box)));
        });
      }
    }
    for (const auto& entry : metadata.objects) {
      const std::string& fqn = entry.first;
      if (entry.second.nbytes == 0) continue;
      fn(entry.second, [&] { return absl::StrCat("object ", Quote(fqn)); });
    }
    ForEachKvLocation(metadata.kv_tables, [&](const ByteLocation& loc,
                                              const std::string& fqn,
                                              const KvTableMetadata& table,
                                              size_t k, int column) {
      if (loc.nbytes == 0) return;
      fn(loc, [&] { return KvLocationName(fqn, table, k, column); });
    });
  };
  absl::flat_hash_map<std::string_view, uint32_t> files;
  std::vector<Span> spans;
  for_each_location([&](const ByteLocation& loc, auto&&) {
    const uint32_t file =
        files.try_emplace(loc.file, static_cast<uint32_t>(files.size()))
            .first->second;
    // (A compressed chunk takes its stored bytes.)
    spans.push_back({file, static_cast<uint32_t>(spans.size()), loc.offset,
                     loc.stored_nbytes()});
  });
  // (A metadata.json is at most 4 GiB, so far fewer locations than this;
  // the numbers above would have wrapped.)
  if (spans.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::ResourceExhaustedError(
        "more than 2^32 - 1 chunks, objects and table entries to check for "
        "shared bytes");
  }
  std::sort(spans.begin(), spans.end());
  // Sorted by offset, and disjoint up to the first overlap: so a span
  // overlaps an earlier one of its file exactly when it starts before the
  // previous one ends.
  for (size_t i = 1; i < spans.size(); ++i) {
    const Span& prev = spans[i - 1];
    const Span& s = spans[i];
    if (prev.file != s.file || s.offset >= prev.offset + prev.nbytes) continue;
    std::string names[2], file;
    uint32_t seen = 0;
    for_each_location([&](const ByteLocation& loc, auto&& name) {
      if (seen == s.index) {
        names[0] = name();
        file = loc.file;
      }
      if (seen == prev.index) names[1] = name();
      ++seen;
    });
    return absl::DataLossError(absl::StrCat(
        names[0], " (", file, ", offset ", s.offset, ", nbytes ", s.nbytes,
        ") shares bytes with ", names[1], " (offset ", prev.offset,
        ", nbytes ", prev.nbytes,
        "): no two chunks, objects or table entries may overlap in their "
        "files"));
  }
  return absl::OkStatus();
}

absl::Status ValidateStructure(const Metadata& metadata) {
  absl::Status unknown;
  absl::StatusOr<StateDict> skeleton = internal_core::Unflatten(
      metadata.structure, [&](const std::string& fqn) -> absl::StatusOr<StateDict> {
        if (metadata.tensors.contains(fqn) || metadata.objects.contains(fqn) ||
            metadata.scalars.contains(fqn)) {
          return StateDict(int64_t{0});
        }
        unknown = absl::DataLossError(absl::StrCat(
            "structure names ", Quote(fqn),
            ", which is not a tensor, object or scalar of the checkpoint"));
        return unknown;
      });
  if (!unknown.ok()) return unknown;
  if (!skeleton.ok()) {
    return absl::DataLossError(absl::StrCat("structure: ", skeleton.status().message()));
  }
  return absl::OkStatus();
}

}  // namespace cairn::internal_format
