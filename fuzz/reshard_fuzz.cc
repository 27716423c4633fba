// Save a tensor cut one way by up to four ranks (globally, or rank-local
// and then merged; at once, or through an AsyncSaver whose caller
// overwrites the tensor as soon as Save() returns), load it cut any other way
// by up to four ranks (threads of this process, RunInProcess), with the
// checksums checked: every load must succeed (a wrong signature or CRC32C
// of a correct read would be a false alarm) and every loaded byte must be
// the saved one, as must the objects, scalar and second tensor the recipe
// may add beside it. The recipe picks the dtype, the shape, the save grid and
// which ranks hold each box (replicas included), each loading rank's
// boxes (overlapping and replicated ones allowed), and the load's buffer
// size, coalescing gap, IO threads and replica broadcast: the read modes
// (whole chunks, spans, runs, grouped reads) and the signing of rows,
// columns and blocks in slabs of any number of runs. It may also damage
// one byte of a stored chunk after the save: a chunk some rank loads
// whole must then fail every rank's load, one nobody loads must change
// nothing, and otherwise only that byte may go wrong. It may save through
// a SavePlanCache that saw a first save of the same or of other boxes (the
// same plans must hit on every rank, others miss), and request leaves the
// checkpoint does not hold, strictly (every rank fails with kNotFound) or
// not (they are listed as missing and left as they were). It may load with
// a memory budget (many waves) and into sinks, which must never get a
// damaged byte.
//
// Checkpoints go to a folder under $TMPDIR (/tmp by default; /dev/shm makes
// fuzzing faster), removed at exit.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "cairn/async_save.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/planner.h"
#include "cairn/state_dict.h"
#include "checkpoint/test_util.h"
#include "core/status.h"
#include "core/strided.h"
#include "fuzz/fuzz_target.h"

namespace cairn::fuzz {
namespace {

namespace fs = std::filesystem;

using testing_util::ByteAt;
using testing_util::ElementPtr;
using testing_util::ForEachIndex;
using testing_util::LinearIndex;

// Byte `b` of global element `index` of the saved tensor.
std::byte ByteOf(DType dtype, int64_t index, size_t b) {
  return ByteAt(dtype, index, b, /*seed=*/7);
}

// A box's elements in memory: dense, or strided with every dimension
// padded by one element (a view into a larger tensor).
struct Buffer {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> strides;  // elements

  Buffer(const Box& box, size_t es, bool padded, uint8_t fill) {
    strides.assign(box.sizes.size(), 1);
    int64_t extent = 1;
    for (size_t d = box.sizes.size(); d-- > 0;) {
      strides[d] = extent;
      extent *= box.sizes[d] + (padded ? 1 : 0);
    }
    bytes.assign(static_cast<size_t>(extent) * es, fill);
  }
  TensorView View(DType dtype, const Box& box) {
    return TensorView(bytes.data(), dtype, box.sizes, strides);
  }
  // Element pointer at `local` (relative to the box).
  std::byte* At(DType dtype, const Box& box, const std::vector<int64_t>& local) {
    return ElementPtr(View(dtype, box), local);
  }
};

// Cuts of [0, n): sorted, from 0 to n, without repeats.
std::vector<int64_t> Cuts(Recipe& in, int64_t n) {
  std::vector<int64_t> cuts = {0, n};
  const int extra = static_cast<int>(in.In(0, 3));
  for (int k = 0; k < extra; ++k) cuts.push_back(in.In(0, n));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

std::string Describe(DType dtype, const Shape& shape,
                     const std::vector<std::vector<Box>>& saved,
                     const std::vector<std::vector<Box>>& loaded,
                     const LoadOptions& o) {
  auto ranks = [](const std::vector<std::vector<Box>>& boxes) {
    std::vector<std::string> out;
    for (const auto& r : boxes) {
      std::vector<std::string> b;
      for (const Box& box : r) b.push_back(box.ToString());
      out.push_back(absl::StrCat("{", absl::StrJoin(b, " "), "}"));
    }
    return absl::StrJoin(out, " ");
  };
  return absl::StrCat(std::string(DTypeName(dtype)), " [", absl::StrJoin(shape, ","),
                      "] saved ", ranks(saved), " loaded ", ranks(loaded),
                      " bounce ", o.bounce_buffer_bytes, " gap ",
                      o.coalesce_gap_bytes, " io_threads ", o.io_threads,
                      " broadcast ", o.broadcast_replicas, " batch ",
                      o.broadcast_batch_bytes);
}

// A sink that copies each piece of one item into `view` (the item's
// destination as the default planner gives it).
class CopyingSink : public LoadSink {
 public:
  CopyingSink(TensorView view, Shape shape, int* wrong)
      : view_(std::move(view)), shape_(std::move(shape)), wrong_(wrong) {}
  absl::Status Write(const ReadItem& item, const Box& box,
                     std::span<const std::byte> bytes) override {
    // Every byte a sink gets must be the saved one, damaged checkpoint or
    // not: it gets only checked bytes.
    const DType dtype = view_.dtype();
    const size_t es = DTypeSize(dtype);
    int64_t k = 0;
    ForEachIndex(box, [&](const auto&, const auto& global) {
      const int64_t li = LinearIndex(shape_, global);
      for (size_t b = 0; b < es; ++b) {
        if (static_cast<size_t>(k) * es + b < bytes.size() &&
            bytes[k * es + b] != ByteOf(dtype, li, b)) {
          ++*wrong_;
        }
      }
      ++k;
    });
    Box local = box;
    for (int d = 0; d < box.rank(); ++d) {
      local.offsets[d] -= item.overlap.offsets[d];
    }
    CAIRN_ASSIGN_OR_RETURN(TensorView dst, view_.Slice(local));
    if (bytes.size() != static_cast<size_t>(box.num_elements()) *
                            DTypeSize(view_.dtype())) {
      return absl::InternalError(absl::StrCat("a piece of ", bytes.size(),
                                              " bytes for ", box.ToString()));
    }
    internal_core::CopyView(
        TensorView(const_cast<std::byte*>(bytes.data()), view_.dtype(),
                   box.sizes),
        dst);
    return absl::OkStatus();
  }

 private:
  TensorView view_;
  Shape shape_;
  int* wrong_;
};

// The default planner, with the items of "t" (of `shape`) going to
// CopyingSinks; `wrong` counts wrong bytes they were given.
class SinkPlanner : public DefaultLoadPlanner {
 public:
  SinkPlanner(bool strict, Shape shape)
      : DefaultLoadPlanner(strict), shape_(std::move(shape)) {}
  absl::StatusOr<Destination> ResolveDestination(const ReadItem& item) override {
    CAIRN_ASSIGN_OR_RETURN(Destination d,
                           DefaultLoadPlanner::ResolveDestination(item));
    if (item.fqn != "t") return d;
    return Destination{
        {}, nullptr, std::make_shared<CopyingSink>(d.view, shape_, &wrong)};
  }
  int wrong = 0;

 private:
  Shape shape_;
};

// The extra leaves' values.
std::vector<uint8_t> UBytes(int64_t n) {
  std::vector<uint8_t> u(static_cast<size_t>(n));
  for (size_t i = 0; i < u.size(); ++i) u[i] = static_cast<uint8_t>(i * 29 + 3);
  return u;
}
std::string ObjectBytes(int r) {
  std::string bytes(static_cast<size_t>(1 + (r * 37) % 300), '\0');
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = static_cast<char>(i * 13 + static_cast<size_t>(r));
  }
  return bytes;
}
constexpr int64_t kStep = 1234;

// Adds the extra leaves to `sd`: for saving rank `r` with their values,
// for a load (r < 0) as placeholders (every object, an empty string; the
// scalar, 0; "u" over `u`, whatever it holds).
void AddExtras(StateDict& sd, bool with_objects, std::vector<uint8_t>& u,
               int save_world, int r) {
  if (with_objects) {
    for (int k = 0; k < save_world; ++k) {
      if (r < 0 || k == r) {
        sd[absl::StrCat("obj", k)] = Object{r < 0 ? "" : ObjectBytes(k)};
      }
    }
    sd["shared"] = Object{r < 0 ? "" : ObjectBytes(1000)};
    sd["step"] = r < 0 ? int64_t{0} : kStep;
  }
  if (!u.empty()) {
    sd["u"] = TensorView(u.data(), DType::kU8, {static_cast<int64_t>(u.size())});
  }
}

// Whether a load filled the extra leaves with the saved values.
absl::Status CheckExtras(StateDict& sd, bool with_objects,
                         const std::vector<uint8_t>& u, int save_world) {
  if (with_objects) {
    for (int k = 0; k <= save_world; ++k) {
      const std::string name = k < save_world ? absl::StrCat("obj", k) : "shared";
      const Object* o = sd[name].object();
      if (o == nullptr || o->bytes != ObjectBytes(k < save_world ? k : 1000)) {
        return absl::DataLossError(absl::StrCat("object ", name, " not loaded"));
      }
    }
    const Scalar* step = sd["step"].scalar();
    if (step == nullptr || *step != Scalar(kStep)) {
      return absl::DataLossError("scalar step not loaded");
    }
  }
  if (u != UBytes(static_cast<int64_t>(u.size()))) {
    return absl::DataLossError("tensor u not loaded");
  }
  return absl::OkStatus();
}

// Writes recipes for seeds: each value as the byte In() maps to it.
struct RecipeWriter {
  std::string out;
  RecipeWriter& In(int64_t lo, int64_t value) {
    out += static_cast<char>(value - lo);
    return *this;
  }
};

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  {
    // f32 [64, 12] saved as two row blocks by two ranks, loaded as two
    // column halves by two ranks: 32 runs of 24 bytes a chunk, checked
    // from signatures.
    RecipeWriter w;
    w.In(0, 0).In(1, 2).In(1, 64).In(1, 12);   // f32, 2-d, 64 x 12
    w.In(1, 2);                                // 2 saving ranks
    w.In(0, 1).In(0, 32).In(0, 0);             // rows cut at 32, no column cut
    w.In(0, 0).In(0, 0).In(0, 1).In(0, 0);     // box 0 on rank 0, box 1 on 1
    w.In(1, 2);                                // 2 loading ranks
    w.In(1, 1).In(0, 0).In(1, 64).In(0, 0).In(1, 6);
    w.In(1, 1).In(0, 0).In(1, 64).In(0, 6).In(1, 6);
    w.In(4, 10).In(0, 0).In(1, 2).In(0, 0);    // 1 KiB buffer, no gap
    seeds.push_back(w.out);
  }
  {
    // u8 [96, 5], one chunk replicated on two ranks, loaded by three ranks
    // as 2-d blocks through 16-byte buffers: slabs of many short runs.
    RecipeWriter w;
    w.In(0, 2).In(1, 2).In(1, 96).In(1, 5);
    w.In(1, 2);
    w.In(0, 0).In(0, 0);                       // no cuts: one box
    w.In(0, 0).In(0, 1);                       // rank 0, and rank 1 too
    w.In(1, 3);
    w.In(1, 1).In(0, 0).In(1, 48).In(0, 0).In(1, 3);
    w.In(1, 1).In(0, 48).In(1, 48).In(0, 0).In(1, 3);
    w.In(1, 2).In(0, 0).In(1, 96).In(0, 3).In(1, 2)
        .In(0, 10).In(1, 40).In(0, 1).In(1, 4);
    w.In(4, 4).In(0, 1).In(1, 3).In(0, 1);     // 16 B, 64 KiB gap, no broadcast
    seeds.push_back(w.out);
  }
  {
    // bf16 [4, 6, 5] saved on a 2 x 2 grid by four ranks, loaded whole
    // by one rank and as a block by another.
    RecipeWriter w;
    w.In(0, 1).In(1, 3).In(1, 4).In(1, 6).In(1, 5);
    w.In(1, 4);
    w.In(0, 1).In(0, 2).In(0, 1).In(0, 3).In(0, 0);
    for (int b = 0; b < 4; ++b) w.In(0, b).In(0, 0);
    w.In(1, 2);
    w.In(1, 1).In(0, 0).In(1, 4).In(0, 0).In(1, 6).In(0, 0).In(1, 5);
    w.In(1, 1).In(0, 1).In(1, 2).In(0, 2).In(1, 3).In(0, 1).In(1, 3);
    w.In(4, 16).In(0, 1).In(1, 3).In(0, 0);
    seeds.push_back(w.out);
  }
  {
    // f32 [64, 12] saved as two row blocks; ranks 0 and 1 load the same
    // left half (a replica group: one reads, broadcast in 256-byte batches,
    // so chunks are read in pieces over several batches), rank 2 the right
    // half; sources and destinations strided.
    RecipeWriter w;
    w.In(0, 0).In(1, 2).In(1, 64).In(1, 12);
    w.In(1, 2);
    w.In(0, 1).In(0, 32).In(0, 0);
    w.In(0, 0).In(0, 0).In(0, 1).In(0, 0);
    w.In(1, 3);
    w.In(1, 1).In(0, 0).In(1, 64).In(0, 0).In(1, 6);
    w.In(1, 1).In(0, 0).In(1, 64).In(0, 0).In(1, 6);
    w.In(1, 1).In(0, 0).In(1, 64).In(0, 6).In(1, 6);
    w.In(4, 10).In(0, 0).In(1, 2).In(0, 0);
    w.In(0, 13).In(0, 3);                      // 256-byte batches, strided
    seeds.push_back(w.out);
  }
  // Damaged copies: byte 100 of the first chunk of the column reshard
  // (its parts tile it: caught or harmless), and of the 3-d grid, whose
  // rank 0 loads every chunk whole (the load must fail).
  for (size_t k : {size_t{0}, size_t{2}}) {
    RecipeWriter w{seeds[k]};
    w.In(0, 0).In(0, 0);                       // default batch, dense
    w.In(0, 1).In(0, 100).In(0, 0).In(0, 0x10);
    seeds.push_back(w.out);
  }
  {
    // The 3-d grid with objects, a scalar and a 100-byte tensor "u".
    RecipeWriter w{seeds[2]};
    w.In(0, 0).In(0, 0).In(0, 0).In(0, 0).In(0, 0).In(0, 0).In(0, 0);
    w.In(0, 3).In(1, 100);
    seeds.push_back(w.out);
  }
  for (int mode : {1, 2, 3}) {
    // The column reshard saved rank-local and merged, async, and both.
    RecipeWriter w{seeds[0]};
    w.In(0, 0).In(0, 0).In(0, 0).In(0, 0).In(0, 0).In(0, 0).In(0, mode);
    seeds.push_back(w.out);
  }
  for (int cache : {1, 3}) {
    // The 3-d grid with its extras through a plan cache, after a first
    // save of rotated boxes (a miss) and of the same boxes (a hit).
    RecipeWriter w{seeds[6]};
    w.In(0, cache);
    seeds.push_back(w.out);
  }
  for (int mode : {1, 3}) {
    // The 3-d grid with its extras, absent leaves requested, strict (every
    // rank fails) and not (they are listed as missing, left untouched).
    RecipeWriter w{seeds[6]};
    w.In(0, 0).In(0, mode);
    seeds.push_back(w.out);
  }
  // The column reshard with the recipe's middle bytes at their defaults
  // (default batch, dense layout, no save mode, extras, cache or load
  // mode), byte 100 of its first chunk damaged when `damaged`; the later
  // bytes are the caller's.
  auto column_reshard = [&](bool damaged) {
    RecipeWriter w{seeds[0]};
    w.In(0, 0).In(0, 0);
    w.In(0, damaged).In(0, damaged ? 100 : 0).In(0, 0).In(0, damaged ? 0x10 : 0);
    w.In(0, 0).In(0, 0).In(0, 0).In(0, 0);
    return w;
  };
  // Streaming: the column reshard into sinks with a 1 KiB budget (many
  // waves, chunks in pieces, each part checked before its sink gets it),
  // then with byte 100 of its first chunk damaged (no sink may get it).
  for (bool damaged : {false, true}) {
    RecipeWriter w = column_reshard(damaged);
    w.In(0, 3).In(6, 10);                      // sinks, 1 KiB budget
    seeds.push_back(w.out);
  }
  {
    // The replica group (one member reads, broadcast in 256-byte batches)
    // into sinks with a 4 KiB budget.
    RecipeWriter w{seeds[3]};
    w.In(0, 0).In(0, 0).In(0, 0).In(0, 0);     // no damage
    w.In(0, 0).In(0, 0).In(0, 0).In(0, 0);
    w.In(0, 3).In(6, 12);
    seeds.push_back(w.out);
  }
  {
    // The 3-d grid with its extras into sinks, no budget beyond the
    // default.
    RecipeWriter w{seeds[6]};
    w.In(0, 0).In(0, 0).In(0, 2);
    seeds.push_back(w.out);
  }
  // Node reads: the column reshard with each chunk read once by one rank
  // (checked whole) and the other's columns handed to it, clean and with
  // byte 100 of its first chunk damaged; and into sinks, damaged: no sink
  // may get it.
  for (bool damaged : {false, true}) {
    RecipeWriter w = column_reshard(damaged);
    w.In(0, 0);                                // no streaming
    w.In(0, 1);                                // node reads
    seeds.push_back(w.out);
  }
  {
    RecipeWriter w = column_reshard(true);
    w.In(0, 2);                                // sinks, default budget
    w.In(0, 1);                                // node reads
    seeds.push_back(w.out);
  }
  return seeds;
}

}  // namespace

// Recipe, each value taken modulo its range: dtype (f32, bf16, u8, i64);
// dimensions - 1 (up to 3); each dimension's size - 1 (up to 96 for the
// first, 12 for the others); saving ranks - 1; per dimension, up to 3
// extra cuts of the save grid; per box of the grid, its rank and whether
// the next rank holds it too; loading ranks - 1; per loading rank, its
// boxes - 1 (up to 2) and each box's offset and size - 1 per dimension;
// then log2 of the bounce buffer - 4 (16 B to 64 KiB), the coalescing gap
// (0 or 64 KiB), IO threads - 1 (up to 3), replica broadcast, the
// broadcast batch (0: the default, else 2^(8 + b % 13) bytes: 256 B to
// 1 MiB, so that a group's chunks are read in pieces over several batches)
// and the layout (bit 0: sources, bit 1: destinations are strided views,
// each dimension padded by one element); last, the damage: a chunk
// number + 1 (0: none), a 16-bit byte offset in it (modulo its size) and
// the value XORed into that byte (0 counts as 1); and the save's mode
// (bit 0: rank-local, then Merge; bit 1: through an AsyncSaver, the
// sources overwritten as soon as Save() returns); the extra leaves (bit 0:
// objects and a scalar; bit 1: a u8 tensor "u", whose size - 1 follows);
// the plan cache (bit 0: on, after a first save; bit 1: of the same boxes,
// else of each rank's boxes moved to the next rank); the load's mode (bit
// 0: request leaves the checkpoint does not hold; bit 1: non-strict).
CAIRN_FUZZ_TARGET(reshard, &Seeds) {
  // The folder this process saves into, removed at exit.
  static const testing_util::TempDir work;
  Recipe in(data);
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kU8, DType::kI64};
  const DType dtype = dtypes[in.In(0, 3)];
  const size_t es = DTypeSize(dtype);
  Shape shape(static_cast<size_t>(in.In(1, 3)));
  for (size_t d = 0; d < shape.size(); ++d) {
    shape[d] = in.In(1, d == 0 ? 96 : 12);
  }
  const int save_world = static_cast<int>(in.In(1, 4));
  std::vector<std::vector<int64_t>> cuts;
  for (int64_t n : shape) cuts.push_back(Cuts(in, n));
  std::vector<std::vector<Box>> saved(save_world);
  {
    size_t box_count = 1;
    for (const auto& c : cuts) box_count *= c.size() - 1;
    for (size_t b = 0; b < box_count; ++b) {
      Box box;
      size_t rest = b;
      for (size_t d = shape.size(); d-- > 0;) {
        const size_t i = rest % (cuts[d].size() - 1);
        rest /= cuts[d].size() - 1;
        box.offsets.insert(box.offsets.begin(), cuts[d][i]);
        box.sizes.insert(box.sizes.begin(), cuts[d][i + 1] - cuts[d][i]);
      }
      const int r = static_cast<int>(in.In(0, save_world - 1));
      saved[r].push_back(box);
      if (in.Byte() & 1) saved[(r + 1) % save_world].push_back(box);
    }
  }
  const int load_world = static_cast<int>(in.In(1, 4));
  std::vector<std::vector<Box>> loaded(load_world);
  for (auto& boxes : loaded) {
    const int n = static_cast<int>(in.In(1, 2));
    for (int k = 0; k < n; ++k) {
      Box box;
      for (int64_t size : shape) {
        const int64_t o = in.In(0, size - 1);
        box.offsets.push_back(o);
        box.sizes.push_back(in.In(1, size - o));
      }
      boxes.push_back(box);
    }
  }
  LoadOptions options;
  options.bounce_buffer_bytes = size_t{1} << in.In(4, 16);
  options.coalesce_gap_bytes = in.Byte() & 1 ? 65536 : 0;
  options.io_threads = static_cast<int>(in.In(1, 3));
  options.broadcast_replicas = (in.Byte() & 1) == 0;
  if (const uint8_t b = in.Byte(); b != 0) {
    options.broadcast_batch_bytes = uint64_t{1} << (8 + b % 13);
  }
  const uint8_t layout = in.Byte();
  const bool padded_src = (layout & 1) != 0, padded_dst = (layout & 2) != 0;
  // A byte of the data files to damage after the save: which chunk (0:
  // none), which byte of it, and the nonzero value XORed into it.
  const uint8_t damage_chunk = in.Byte();
  const uint16_t damage_at = static_cast<uint16_t>(in.Byte() | in.Byte() << 8);
  const uint8_t damage_xor = std::max<uint8_t>(in.Byte(), 1);
  // Save rank-local (each rank its own folder, no collective), then Merge.
  const uint8_t save_mode = in.Byte();
  const bool rank_local = (save_mode & 1) != 0;
  // Save through an AsyncSaver, overwriting the sources as soon as Save()
  // returns: what lands must be the values at the call.
  const bool async = (save_mode & 2) != 0;
  // Other leaves beside "t": objects (one per saving rank, and one every
  // rank holds) and a scalar; a small u8 tensor every rank holds whole.
  const uint8_t extras = in.Byte();
  const bool with_objects = (extras & 1) != 0;
  const int64_t u_size = (extras & 2) != 0 ? in.In(1, 255) : 0;
  // Save with a SavePlanCache per rank that saw a first save (into another
  // folder) of the same boxes, or of each rank's boxes moved to the next
  // rank: the same local plans on every rank must hit, and a hit must mean
  // every rank's boxes are the ones of the first save (a stale plan would
  // store the wrong boxes, which the load below would also catch). Global
  // saves only (a rank-local save plans nothing globally).
  const uint8_t cache_mode = in.Byte();
  const bool cached = (cache_mode & 1) != 0 && !rank_local;
  std::vector<std::vector<Box>> first_saved = saved;
  if (cached && (cache_mode & 2) == 0) {
    std::rotate(first_saved.begin(), first_saved.begin() + 1,
                first_saved.end());
  }
  // Destinations the checkpoint does not hold (a tensor, an object and a
  // scalar under "absent"): a strict load must fail on every rank with
  // kNotFound; a non-strict one must list them as missing and leave them
  // as they were.
  const uint8_t load_mode = in.Byte();
  const bool absent = (load_mode & 1) != 0;
  options.strict = (load_mode & 2) == 0;
  // Streaming (the recipe's last bytes, so older inputs keep their
  // meaning): a memory budget, whose small values cut a group's load into
  // many waves; and sinks: every item of "t" goes to a sink that copies
  // each piece into the destination the default planner would have filled
  // (small budgets then cut items into pieces too). A sink gets only
  // checked bytes, so a damaged byte must never reach one.
  const uint8_t stream_mode = in.Byte();
  if ((stream_mode & 1) != 0) {
    options.memory_budget_bytes = uint64_t{1} << in.In(6, 20);
  }
  const bool sinks = (stream_mode & 2) != 0;
  // Node reads (a later byte, so older inputs keep their meaning: 0 has
  // every rank read its own parts, the default; 1 reads each chunk that
  // several ranks need strided parts of once and hands the parts out).
  options.share_node_reads = (in.Byte() & 1) != 0;
  const std::string what =
      absl::StrCat(Describe(dtype, shape, saved, loaded, options),
                   absent ? " absent leaves requested" : "",
                   options.strict ? "" : " non-strict",
                   padded_src ? " padded sources" : "",
                   padded_dst ? " padded destinations" : "",
                   rank_local ? " rank-local save, merged" : "",
                   async ? " async save, sources overwritten" : "",
                   with_objects ? " with objects and a scalar" : "",
                   u_size > 0 ? absl::StrCat(" with u8 [", u_size, "]") : "",
                   cached ? ((cache_mode & 2) != 0
                                 ? " plan cache after a save of the same boxes"
                                 : " plan cache after a save of rotated boxes")
                          : "",
                   (stream_mode & 1) != 0
                       ? absl::StrCat(" memory budget ",
                                      options.memory_budget_bytes)
                       : "",
                   sinks ? " into sinks" : "",
                   options.share_node_reads ? " with node reads" : "");

  // Save.
  std::vector<std::vector<Buffer>> src(save_world);
  for (int r = 0; r < save_world; ++r) {
    for (const Box& box : saved[r]) {
      Buffer& buffer = src[r].emplace_back(box, es, padded_src, 0x5A);
      ForEachIndex(box, [&](const auto& local, const auto& global) {
        std::byte* p = buffer.At(dtype, box, local);
        const int64_t li = LinearIndex(shape, global);
        for (size_t b = 0; b < es; ++b) p[b] = ByteOf(dtype, li, b);
      });
    }
  }
  const std::string dir = work.Sub("ckpt");
  {
    // A fresh folder: a rank-local save leaves rank folders behind that a
    // later merge with fewer ranks must not see.
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::vector<std::unique_ptr<SavePlanCache>> caches(save_world);
  for (auto& cache : caches) cache = std::make_unique<SavePlanCache>();
  std::vector<int> hits(save_world, 0);
  // Saves `boxes` (rank r's backed by bufs[r]) to `to`; with `overwrite`
  // (an asynchronous save) the sources are overwritten as soon as Save()
  // returns.
  auto save = [&](const std::vector<std::vector<Box>>& boxes,
                  std::vector<std::vector<Buffer>>& bufs, const std::string& to,
                  bool overwrite) {
    return RunInProcess(save_world, [&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      std::vector<Shard> shards;
      for (size_t k = 0; k < boxes[r].size(); ++k) {
        shards.push_back({boxes[r][k], bufs[r][k].View(dtype, boxes[r][k])});
      }
      StateDict sd;
      sd["t"] = ShardedTensor(dtype, shape, std::move(shards));
      std::vector<uint8_t> u = UBytes(u_size);
      AddExtras(sd, with_objects, u, save_world, r);
      SaveOptions o;
      o.comm = &comm;
      o.overwrite = true;
      o.rank_local = rank_local;
      o.io_threads = 2;
      o.write_buffer_bytes = 4096;
      if (cached) o.plan_cache = caches[r].get();
      absl::StatusOr<SaveResult> result;
      if (!async) {
        result = Save(sd, to, o);
      } else {
        absl::StatusOr<std::unique_ptr<AsyncSaver>> saver =
            AsyncSaver::Create(&comm);
        if (!saver.ok()) return saver.status();
        absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> handle =
            (*saver)->Save(sd, to, o);
        if (!handle.ok()) return handle.status();
        if (overwrite) {
          for (Buffer& b : bufs[r]) std::fill(b.bytes.begin(), b.bytes.end(), 0xA5);
        }
        result = (*handle)->Wait();
      }
      if (result.ok()) hits[r] = result->plan_cache_hit ? 1 : 0;
      return result.status();
    });
  };
  std::vector<absl::Status> statuses;
  if (cached) {
    std::vector<std::vector<Buffer>> first_src(save_world);
    for (int r = 0; r < save_world; ++r) {
      for (const Box& box : first_saved[r]) {
        first_src[r].emplace_back(box, es, padded_src, 0x33);
      }
    }
    statuses = save(first_saved, first_src, work.Sub("first"), false);
    for (int r = 0; r < save_world; ++r) {
      CAIRN_FUZZ_CHECK(statuses[r].ok(),
                       absl::StrCat("first save, rank ", r, ": ",
                                    statuses[r].ToString(), "\n", what));
    }
  }
  statuses = save(saved, src, dir, true);
  for (int r = 0; r < save_world; ++r) {
    CAIRN_FUZZ_CHECK(statuses[r].ok(),
                     absl::StrCat("save, rank ", r, ": ",
                                  statuses[r].ToString(), "\n", what));
  }
  if (cached) {
    // The local plans are the same on every rank iff every rank's boxes
    // are (the other leaves are the same in both saves).
    const bool same = first_saved == saved;
    for (int r = 0; r < save_world; ++r) {
      CAIRN_FUZZ_CHECK(hits[r] == hits[0],
                       absl::StrCat("ranks disagree on the plan cache\n", what));
      CAIRN_FUZZ_CHECK(hits[r] == (same ? 1 : 0),
                       absl::StrCat(same ? "the same plans missed the cache"
                                         : "other plans hit the cache",
                                    "\n", what));
    }
  }

  if (rank_local) {
    absl::StatusOr<MergeResult> merged = Merge(dir);
    CAIRN_FUZZ_CHECK(merged.ok(), absl::StrCat("merge: ",
                                               merged.status().ToString(),
                                               "\n", what));
  }

  // Damage a byte of a stored chunk (global element `damaged`, byte
  // `damaged_byte` of it).
  std::optional<Box> damaged_chunk;
  int64_t damaged = -1;
  size_t damaged_byte = 0;
  if (damage_chunk != 0) {
    absl::StatusOr<Metadata> md = ReadMetadata(dir);
    CAIRN_FUZZ_CHECK(md.ok(), md.status().ToString());
    const TensorMetadata& tm = md->tensors.at("t");
    const ChunkMetadata& chunk = tm.chunks[(damage_chunk - 1) % tm.chunks.size()];
    // (Every box of the grid has elements, so every chunk has bytes.)
    CAIRN_FUZZ_CHECK(chunk.location.nbytes > 0,
                     absl::StrCat("a chunk of no bytes, ", chunk.box.ToString(),
                                  ", in a tensor with elements\n", what));
    const uint64_t at = damage_at % chunk.location.nbytes;
    damaged_chunk = chunk.box;
    damaged_byte = at % es;
    int64_t e = 0;  // the element's index in the chunk
    ForEachIndex(chunk.box, [&](const auto&, const auto& global) {
      if (e++ == static_cast<int64_t>(at / es)) {
        damaged = LinearIndex(shape, global);
      }
    });
    const absl::Status flipped = testing_util::FlipBits(
        (fs::path(dir) / chunk.location.file).string(),
        chunk.location.offset + at, damage_xor);
    CAIRN_FUZZ_CHECK(flipped.ok(), flipped.ToString());
  }

  // Load, and compare every byte but a damaged one.
  statuses = RunInProcess(load_world, [&](Communicator& comm) -> absl::Status {
    const int r = comm.rank();
    std::vector<Buffer> dst;
    std::vector<Shard> shards;
    for (const Box& box : loaded[r]) dst.emplace_back(box, es, padded_dst, 0xEE);
    for (size_t k = 0; k < loaded[r].size(); ++k) {
      shards.push_back({loaded[r][k], dst[k].View(dtype, loaded[r][k])});
    }
    StateDict sd;
    sd["t"] = ShardedTensor(dtype, shape, std::move(shards));
    std::vector<uint8_t> u(static_cast<size_t>(u_size), 0xEE);
    AddExtras(sd, with_objects, u, save_world, -1);
    float untouched[3] = {1.5f, -2.5f, 3.5f};
    if (absent) {
      sd["absent"]["t"] = TensorView(untouched, DType::kF32, {3});
      sd["absent"]["o"] = Object{"kept"};
      sd["absent"]["s"] = int64_t{-9};
    }
    LoadOptions o = options;
    o.comm = &comm;
    SinkPlanner sink_planner(options.strict, shape);
    if (sinks) o.planner = &sink_planner;
    absl::StatusOr<LoadResult> result = Load(sd, dir, o);
    if (sink_planner.wrong > 0) {
      return absl::InternalError(absl::StrCat(
          "sinks got ", sink_planner.wrong, " wrong bytes (",
          result.ok() ? "the load succeeded" : result.status().ToString(),
          ")"));
    }
    if (!result.ok()) return result.status();
    std::vector<std::string> missing = result->missing;
    std::sort(missing.begin(), missing.end());
    const std::vector<std::string> expected_missing =
        absent ? std::vector<std::string>{"absent.o", "absent.s", "absent.t"}
               : std::vector<std::string>{};
    if (missing != expected_missing) {
      return absl::InternalError(absl::StrCat(
          "missing: ", absl::StrJoin(result->missing, ", "), "; expected ",
          absl::StrJoin(expected_missing, ", ")));
    }
    if (absent &&
        (untouched[0] != 1.5f || untouched[1] != -2.5f ||
         untouched[2] != 3.5f || sd["absent"]["o"].object()->bytes != "kept" ||
         *sd["absent"]["s"].scalar() != Scalar(int64_t{-9}))) {
      return absl::InternalError("a missing leaf was changed");
    }
    for (size_t k = 0; k < loaded[r].size(); ++k) {
      absl::Status wrong;
      ForEachIndex(loaded[r][k], [&](const auto& local, const auto& global) {
        const std::byte* p = dst[k].At(dtype, loaded[r][k], local);
        const int64_t li = LinearIndex(shape, global);
        for (size_t b = 0; b < es && wrong.ok(); ++b) {
          if (!sinks && li == damaged && b == damaged_byte) continue;
          if (p[b] != ByteOf(dtype, li, b)) {
            wrong = absl::DataLossError(absl::StrCat(
                "wrong byte ", b, " of element ", li, " in box ",
                loaded[r][k].ToString(), ": ", std::to_integer<int>(p[b]),
                ", not ", std::to_integer<int>(ByteOf(dtype, li, b)),
                " (238, 0xEE, is what the destination held before)"));
          }
        }
      });
      if (!wrong.ok()) return wrong;
    }
    return CheckExtras(sd, with_objects, u, save_world);
  });
  // What a damaged byte must do: fail every rank's load when some rank
  // loads its whole chunk into one box (that rank reads and checks the
  // chunk whole); change nothing when no rank loads any of its chunk;
  // otherwise (parts of the chunk, checked when they tile it) fail the
  // load or reach only the destinations of that one byte.
  bool whole = false, touched = false;
  if (damaged_chunk) {
    for (const auto& boxes : loaded) {
      for (const Box& box : boxes) {
        whole |= Contains(box, *damaged_chunk);
        touched |= Intersect(box, *damaged_chunk).has_value();
      }
    }
  }
  if (absent && options.strict) {
    for (int r = 0; r < load_world; ++r) {
      CAIRN_FUZZ_CHECK(
          statuses[r].code() == absl::StatusCode::kNotFound &&
              absl::StrContains(statuses[r].message(), "absent."),
          absl::StrCat("load, rank ", r, ": ", statuses[r].ToString(),
                       " (a strict load of leaves the checkpoint does not "
                       "hold must fail with kNotFound naming one)\n", what));
    }
    return;
  }
  const std::string damage =
      damaged_chunk ? absl::StrCat("\ndamaged byte ", damaged_byte,
                                   " of element ", damaged, " in chunk ",
                                   damaged_chunk->ToString())
                    : "";
  for (int r = 0; r < load_world; ++r) {
    if (whole) {
      CAIRN_FUZZ_CHECK(statuses[r].code() == absl::StatusCode::kDataLoss,
                       absl::StrCat("load, rank ", r, ": ",
                                    statuses[r].ToString(), " (a damaged "
                                    "chunk read whole must fail the load)\n",
                                    what, damage));
    } else if (!touched || statuses[r].code() != absl::StatusCode::kDataLoss) {
      CAIRN_FUZZ_CHECK(statuses[r].ok(),
                       absl::StrCat("load, rank ", r, ": ",
                                    statuses[r].ToString(), "\n", what,
                                    damage));
    }
  }
}

}  // namespace cairn::fuzz
