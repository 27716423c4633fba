// A small sharded model for the distributed tests (in-process and MPI):
// tensors of several ranks and dtypes, cut into per-rank boxes by named
// sharding patterns, filled with deterministic bytes, and checked byte by
// byte after a load.
#ifndef CAIRN_CHECKPOINT_DIST_TEST_UTIL_H_
#define CAIRN_CHECKPOINT_DIST_TEST_UTIL_H_

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/box.h"
#include "cairn/state_dict.h"
#include "cairn/storage.h"
#include "core/status.h"
#include "cairn/tensor.h"
#include "checkpoint/test_util.h"

namespace cairn::testing_util {

enum class Pattern {
  kRows,        // even split on dim 0
  kCols,        // even split on the last dim
  kBlocks,      // a 2-D grid of ranks over dims 0 and 1
  kUneven,      // 1:2:3:... split on dim 0 (some ranks may get nothing)
  kReplicated,  // every rank holds everything
  kCyclic,      // row blocks of 3 dealt round-robin: several boxes per rank
};
inline constexpr Pattern kAllPatterns[] = {Pattern::kRows,   Pattern::kCols,
                                           Pattern::kBlocks, Pattern::kUneven,
                                           Pattern::kReplicated,
                                           Pattern::kCyclic};

inline const char* PatternName(Pattern p) {
  switch (p) {
    case Pattern::kRows: return "rows";
    case Pattern::kCols: return "cols";
    case Pattern::kBlocks: return "blocks";
    case Pattern::kUneven: return "uneven";
    case Pattern::kReplicated: return "replicated";
    case Pattern::kCyclic: return "cyclic";
  }
  return "?";
}

struct TestTensor {
  std::string fqn;
  DType dtype;
  Shape shape;
};

inline std::vector<TestTensor> TestModel() {
  return {{"model.wq", DType::kF32, {37, 53}},
          {"model.layers.0.w3", DType::kI16, {6, 10, 7}},
          {"model.embed", DType::kBF16, {101}},
          {"optim.exp_avg.wq", DType::kF64, {8, 12}},
          {"model.tiny", DType::kU8, {2, 3}}};
}

// [begin, end) of part `i` of `parts` of [0, n), even or 1:2:3:...
inline std::pair<int64_t, int64_t> Part(int64_t n, int parts, int i,
                                        bool uneven) {
  if (!uneven) {
    const int64_t base = n / parts, extra = n % parts;
    const int64_t b = i * base + std::min<int64_t>(i, extra);
    return {b, b + base + (i < extra ? 1 : 0)};
  }
  const int64_t total = static_cast<int64_t>(parts) * (parts + 1) / 2;
  auto edge = [&](int k) { return n * (static_cast<int64_t>(k) * (k + 1) / 2) / total; };
  return {edge(i), edge(i + 1)};
}

// The boxes rank `r` of `world` holds of a tensor of `shape`.
inline std::vector<Box> BoxesFor(Pattern p, const Shape& shape, int world,
                                 int r) {
  Box full = Box::Full(shape);
  std::vector<Box> out;
  auto split = [&](int dim, int parts, int i, bool uneven) {
    Box b = full;
    auto [lo, hi] = Part(shape[dim], parts, i, uneven);
    b.offsets[dim] = lo;
    b.sizes[dim] = hi - lo;
    return b;
  };
  switch (p) {
    case Pattern::kReplicated:
      out.push_back(full);
      break;
    case Pattern::kRows:
      out.push_back(split(0, world, r, false));
      break;
    case Pattern::kUneven:
      out.push_back(split(0, world, r, true));
      break;
    case Pattern::kCols:
      out.push_back(split(static_cast<int>(shape.size()) - 1, world, r, false));
      break;
    case Pattern::kBlocks: {
      if (shape.size() < 2) {
        out.push_back(split(0, world, r, false));
        break;
      }
      int rows = 1;
      for (int f = 1; f * f <= world; ++f) {
        if (world % f == 0) rows = f;
      }
      const int cols = world / rows;
      Box b = split(0, rows, r / cols, false);
      auto [lo, hi] = Part(shape[1], cols, r % cols, false);
      b.offsets[1] = lo;
      b.sizes[1] = hi - lo;
      out.push_back(b);
      break;
    }
    case Pattern::kCyclic: {
      const int64_t n = shape[0];
      for (int64_t start = 3 * r; start < n; start += 3 * world) {
        Box b = full;
        b.offsets[0] = start;
        b.sizes[0] = std::min<int64_t>(3, n - start);
        out.push_back(b);
      }
      break;
    }
  }
  std::vector<Box> nonempty;
  for (Box& b : out) {
    if (!b.empty()) nonempty.push_back(std::move(b));
  }
  return nonempty;
}

inline uint64_t SeedOf(const std::string& fqn, int64_t step) {
  uint64_t h = 1469598103934665603ull ^ static_cast<uint64_t>(step);
  for (char c : fqn) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

// Global row-major index of element `local` (row-major within `box`).
inline int64_t GlobalIndex(const Shape& shape, const Box& box, int64_t local) {
  int64_t g = 0;
  std::vector<int64_t> coord(box.rank());
  for (int d = box.rank() - 1; d >= 0; --d) {
    coord[d] = local % box.sizes[d] + box.offsets[d];
    local /= box.sizes[d];
  }
  for (int d = 0; d < box.rank(); ++d) g = g * shape[d] + coord[d];
  return g;
}

// Puts `leaf` at dotted `fqn`; numeric components index lists.
inline void InsertAt(StateDict& root, const std::string& fqn, StateDict leaf) {
  StateDict* node = &root;
  size_t start = 0;
  while (true) {
    size_t dot = fqn.find('.', start);
    const std::string key =
        fqn.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!key.empty() && key.find_first_not_of("0123456789") == std::string::npos) {
      const size_t index = std::stoul(key);
      if (!node->is_list()) *node = StateDict::List();
      while (node->size() <= index) node->Append(StateDict::Map());
      node = node->At(index);
    } else {
      node = &(*node)[key];
    }
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  *node = std::move(leaf);
}

// Holds the memory of a rank's shards.
struct RankState {
  StateDict sd;
  std::vector<Tensor> buffers;
};

// Rank r's part of the model under pattern `p` at `step`: tensors filled
// with their values, a per-rank object "rng.rank<r>", a replicated object
// "config" and a scalar "step". With `poison`, tensors are filled with 0xA5
// bytes and objects and scalars are left empty/zero (load destinations).
inline RankState MakeRankState(Pattern p, int world, int r, int64_t step,
                               bool poison, int rng_rank = -1) {
  RankState st;
  for (const TestTensor& t : TestModel()) {
    std::vector<Shard> shards;
    const size_t es = DTypeSize(t.dtype);
    for (const Box& box : BoxesFor(p, t.shape, world, r)) {
      Tensor buf = *Tensor::Empty(t.dtype, box.sizes);
      auto* bytes = static_cast<std::byte*>(buf.data());
      for (int64_t e = 0; e < box.num_elements(); ++e) {
        const int64_t g = GlobalIndex(t.shape, box, e);
        for (size_t i = 0; i < es; ++i) {
          bytes[e * es + i] = poison ? std::byte{0xA5}
                                     : ByteAt(t.dtype, g, i, SeedOf(t.fqn, step));
        }
      }
      shards.push_back(Shard{box, buf.view()});
      st.buffers.push_back(buf);
    }
    InsertAt(st.sd, t.fqn, ShardedTensor(t.dtype, t.shape, std::move(shards)));
  }
  const int rng = rng_rank >= 0 ? rng_rank : r;
  st.sd["rng"][absl::StrCat("rank", rng)] =
      Object{poison ? "" : absl::StrCat("rng state of rank ", rng, " at ", step)};
  st.sd["config"] = Object{poison ? "" : absl::StrCat("config at ", step)};
  st.sd["step"] = poison ? int64_t{0} : step;
  return st;
}

// Empty string when every byte of every tensor in `st` holds the value of
// `step`; else the first wrong byte, described.
inline std::string CheckRankState(const RankState& st, int64_t step) {
  for (const TestTensor& t : TestModel()) {
    const StateDict* node = &st.sd;
    size_t start = 0;
    while (node != nullptr && start <= t.fqn.size()) {
      size_t dot = t.fqn.find('.', start);
      if (dot == std::string::npos) dot = t.fqn.size();
      const std::string key = t.fqn.substr(start, dot - start);
      node = node->is_list() ? node->At(std::stoul(key)) : node->Find(key);
      start = dot + 1;
    }
    if (node == nullptr || node->tensor() == nullptr) return t.fqn + " missing";
    const size_t es = DTypeSize(t.dtype);
    for (const Shard& s : node->tensor()->shards()) {
      const auto* bytes = static_cast<const std::byte*>(s.view.data());
      for (int64_t e = 0; e < s.box.num_elements(); ++e) {
        const int64_t g = GlobalIndex(t.shape, s.box, e);
        for (size_t i = 0; i < es; ++i) {
          if (bytes[e * es + i] != ByteAt(t.dtype, g, i, SeedOf(t.fqn, step))) {
            return absl::StrFormat("%s %s: element %d byte %d wrong", t.fqn,
                                   s.box.ToString(), g, i);
          }
        }
      }
    }
  }
  return "";
}

// Counts the tensor and object bytes read from data files: reads past the
// 4096-byte safetensors header region (cairn pads headers to 4096 bytes),
// so header and metadata.json reads, which every rank that opens a file
// makes, do not blur "one copy of the data".
class DataByteCounter : public Storage {
 public:
  explicit DataByteCounter(Storage& base) : base_(base) {}
  uint64_t data_bytes() const { return bytes_->load(); }

  std::string url() const override { return base_.url(); }
  absl::Status CreateLocation() override { return base_.CreateLocation(); }
  absl::StatusOr<std::unique_ptr<WritableFile>> Create(std::string_view n) override {
    return base_.Create(n);
  }
  absl::Status WriteAtomically(std::string_view n, std::string_view c) override {
    return base_.WriteAtomically(n, c);
  }
  absl::Status Remove(std::string_view n) override { return base_.Remove(n); }
  absl::Status Sync() override { return base_.Sync(); }
  absl::StatusOr<std::vector<std::string>> List() override { return base_.List(); }
  absl::StatusOr<bool> Exists(std::string_view n) override { return base_.Exists(n); }
  absl::StatusOr<std::unique_ptr<Lock>> TryLock(std::string_view n) override {
    return base_.TryLock(n);
  }
  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(std::string_view n) override {
    CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> f, base_.OpenForRead(n));
    if (!n.ends_with(".safetensors")) return f;
    return std::unique_ptr<ReadableFile>(new Counted(std::move(f), bytes_));
  }

 private:
  class Counted : public ReadableFile {
   public:
    Counted(std::unique_ptr<ReadableFile> f, std::shared_ptr<std::atomic<uint64_t>> n)
        : f_(std::move(f)), n_(std::move(n)) {}
    uint64_t size() const override { return f_->size(); }
    absl::Status ReadAt(uint64_t offset, std::span<std::byte> data) const override {
      if (offset >= 4096) *n_ += data.size();
      return f_->ReadAt(offset, data);
    }

   private:
    std::unique_ptr<ReadableFile> f_;
    std::shared_ptr<std::atomic<uint64_t>> n_;
  };
  Storage& base_;
  std::shared_ptr<std::atomic<uint64_t>> bytes_ =
      std::make_shared<std::atomic<uint64_t>>(0);
};

}  // namespace cairn::testing_util

#endif  // CAIRN_CHECKPOINT_DIST_TEST_UTIL_H_
