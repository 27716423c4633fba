#include "synthetic_model.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/checked.h"
#include "core/parallel.h"

namespace cairn::tools {
namespace {

// splitmix64's finalizer: a cheap, well-mixing 64-bit hash.
inline uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

// The per-(tensor, step) stream seed; element i hashes base + i * golden.
inline uint64_t StreamBase(uint64_t fqn_seed, int64_t step) {
  return Mix64(fqn_seed ^ Mix64(static_cast<uint64_t>(step) + kGolden));
}

// k * 2^-24 with k the top 24 bits of the hash as a signed number, so
// |value| < 0.5 and every value is an exact F32.
inline float ValueOf(uint64_t base, int64_t index) {
  const uint64_t h = Mix64(base + static_cast<uint64_t>(index) * kGolden);
  const int32_t k = static_cast<int32_t>(static_cast<int64_t>(h) >> 40);
  return static_cast<float>(k) * 0x1p-24f;
}

inline uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }

// Elements per unit of parallel work.
constexpr int64_t kBlockElements = int64_t{1} << 18;

// Bytes of one transformer layer's weights (before optimizer moments).
int64_t LayerParams(int64_t h, int64_t ffn) {
  return 4 * h * h + 3 * h * ffn + 2 * h;
}

int64_t FfnFor(int64_t h) { return ((8 * h / 3) + 7) / 8 * 8; }

// Weight, exp_avg and exp_avg_sq, 4 bytes each.
constexpr uint64_t kBytesPerParam = 3 * 4;

uint64_t TotalBytes(const SyntheticConfig& c) {
  const int64_t params =
      c.layers * LayerParams(c.hidden, c.ffn) + c.hidden + c.vocab * c.hidden;
  return static_cast<uint64_t>(params) * kBytesPerParam +
         static_cast<uint64_t>(c.rng_bytes);
}

absl::Status CheckF32Box(const SyntheticTensor& t, const Box& box,
                         const TensorView& view) {
  if (t.dtype != DType::kF32 || view.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat(t.fqn, ": synthetic tensors are F32, got ",
                     std::string(DTypeName(view.dtype()))));
  }
  if (!view.device().is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat(t.fqn, ": synthetic fill needs host memory"));
  }
  if (absl::Status s = ValidateBox(box, t.shape); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(t.fqn, ": ", s.message()));
  }
  if (view.shape() != box.sizes) {
    return absl::InvalidArgumentError(
        absl::StrCat(t.fqn, ": view shape [", absl::StrJoin(view.shape(), ", "),
                     "] does not match box ", box.ToString()));
  }
  if (box.num_elements() > 0 && view.data() == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(t.fqn, ": null data"));
  }
  return absl::OkStatus();
}

// Walks the elements of `box` (inside a tensor of `shape`) whose box-linear
// index lies in [begin, end), one innermost-dimension run at a time:
// fn(global_index_of_first, element_pointer, count, element_stride).
template <typename Fn>
void WalkRuns(const Shape& shape, const Box& box, const TensorView& view,
              int64_t begin, int64_t end, Fn&& fn) {
  const int r = box.rank();
  float* base = static_cast<float*>(view.data());
  if (r == 0) {
    if (begin < end) fn(int64_t{0}, base, int64_t{1}, int64_t{1});
    return;
  }
  std::vector<int64_t> gstride(r);
  int64_t s = 1;
  for (int d = r - 1; d >= 0; --d) {
    gstride[d] = s;
    s *= shape[d];
  }
  const std::vector<int64_t>& vstride = view.strides();
  // Coordinates (relative to the box) of `begin`.
  std::vector<int64_t> c(r);
  int64_t rem = begin;
  for (int d = r - 1; d >= 0; --d) {
    c[d] = rem % box.sizes[d];
    rem /= box.sizes[d];
  }
  int64_t pos = begin;
  const int64_t inner = box.sizes[r - 1];
  while (pos < end) {
    int64_t gidx = 0;
    int64_t voff = 0;
    for (int d = 0; d < r; ++d) {
      gidx += (box.offsets[d] + c[d]) * gstride[d];
      voff += c[d] * vstride[d];
    }
    const int64_t count = std::min(inner - c[r - 1], end - pos);
    fn(gidx, base + voff, count, vstride[r - 1]);
    pos += count;
    // Advance to the start of the next row.
    c[r - 1] = 0;
    for (int d = r - 2; d >= 0; --d) {
      if (++c[d] < box.sizes[d]) break;
      c[d] = 0;
    }
  }
}

bool IsNumber(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char ch) {
    return absl::ascii_isdigit(static_cast<unsigned char>(ch));
  });
}

}  // namespace

uint64_t SyntheticTensor::nbytes() const {
  return static_cast<uint64_t>(num_elements()) * DTypeSize(dtype);
}

uint64_t SyntheticModel::tensor_bytes() const {
  uint64_t total = 0;
  for (const SyntheticTensor& t : tensors) total += t.nbytes();
  return total;
}

uint64_t SyntheticModel::total_bytes() const {
  return tensor_bytes() + static_cast<uint64_t>(config.rng_bytes);
}

int64_t SyntheticModel::total_elements() const {
  int64_t total = 0;
  for (const SyntheticTensor& t : tensors) total += t.num_elements();
  return total;
}

const SyntheticTensor* SyntheticModel::Find(std::string_view fqn) const {
  for (const SyntheticTensor& t : tensors) {
    if (t.fqn == fqn) return &t;
  }
  return nullptr;
}

absl::StatusOr<SyntheticConfig> ChooseConfig(uint64_t target_bytes,
                                             int layers) {
  if (target_bytes == 0) {
    return absl::InvalidArgumentError("target size must be positive");
  }
  // Past this, TotalBytes of the next hidden size could wrap below the
  // target and the search below would never end.
  if (target_bytes > kMaxSyntheticBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target size ", target_bytes, " bytes is over the limit of ",
        kMaxSyntheticBytes, " bytes (1 PiB)"));
  }
  if (layers > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("too many layers: ", layers, " (at most 4096)"));
  }
  SyntheticConfig c;
  if (layers <= 0) {
    // 8 MiB -> 3 layers, 256 MiB -> 8, 2 GiB -> 11, 64 GiB -> 16.
    layers = std::clamp(
        static_cast<int>(std::bit_width(target_bytes >> 20)) - 1, 2, 48);
  }
  c.layers = layers;
  // The largest hidden size (a multiple of 8, at least 16) whose model with
  // the smallest embedding (vocab = 2 * hidden) fits the target; the
  // embedding's row count then absorbs the rest, so the total lands within
  // one embedding row of the target.
  auto with_hidden = [&](int64_t h) {
    SyntheticConfig x = c;
    x.hidden = h;
    x.ffn = FfnFor(h);
    x.vocab = 2 * h;
    return x;
  };
  int64_t h = 16;
  while (TotalBytes(with_hidden(h + 8)) <= target_bytes) h += 8;
  c = with_hidden(h);
  const uint64_t fixed = TotalBytes(c) - static_cast<uint64_t>(c.vocab) *
                                             static_cast<uint64_t>(h) *
                                             kBytesPerParam;
  if (target_bytes > fixed) {
    const uint64_t row = static_cast<uint64_t>(h) * kBytesPerParam;
    const int64_t vocab =
        static_cast<int64_t>((target_bytes - fixed + row / 2) / row);
    c.vocab = std::max<int64_t>(c.vocab, vocab);
  }
  return c;
}

absl::StatusOr<SyntheticModel> BuildModel(const SyntheticConfig& config) {
  if (config.layers < 0 || config.hidden <= 0 || config.ffn <= 0 ||
      config.vocab <= 0 || config.rng_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bad synthetic config: layers %d hidden %d ffn %d vocab %d",
        config.layers, config.hidden, config.ffn, config.vocab));
  }
  SyntheticModel m;
  m.config = config;
  const int64_t h = config.hidden;
  const int64_t f = config.ffn;
  std::vector<SyntheticTensor> weights;
  auto add = [&](std::string fqn, Shape shape, Parallelism p) {
    weights.push_back({std::move(fqn), DType::kF32, std::move(shape), p});
  };
  add("model.embed", {config.vocab, h}, Parallelism::kColumn);
  for (int i = 0; i < config.layers; ++i) {
    const std::string l = absl::StrCat("model.layers.", i, ".");
    add(l + "attn.wq", {h, h}, Parallelism::kColumn);
    add(l + "attn.wk", {h, h}, Parallelism::kColumn);
    add(l + "attn.wv", {h, h}, Parallelism::kColumn);
    add(l + "attn.wo", {h, h}, Parallelism::kRow);
    add(l + "mlp.w1", {f, h}, Parallelism::kColumn);
    add(l + "mlp.w2", {h, f}, Parallelism::kRow);
    add(l + "mlp.w3", {f, h}, Parallelism::kColumn);
    add(l + "attn_norm", {h}, Parallelism::kReplicated);
    add(l + "mlp_norm", {h}, Parallelism::kReplicated);
  }
  add("model.norm", {h}, Parallelism::kReplicated);
  m.tensors = weights;
  for (const char* moment : {"optim.exp_avg.", "optim.exp_avg_sq."}) {
    for (const SyntheticTensor& w : weights) {
      SyntheticTensor t = w;
      t.fqn = moment + w.fqn;
      m.tensors.push_back(std::move(t));
    }
  }
  return m;
}

uint64_t FqnSeed(std::string_view fqn) {
  uint64_t h = 0xCBF29CE484222325ULL;  // FNV-1a
  for (char ch : fqn) {
    h ^= static_cast<unsigned char>(ch);
    h *= 0x100000001B3ULL;
  }
  return Mix64(h);
}

float ElementValue(uint64_t fqn_seed, int64_t index, int64_t step) {
  return ValueOf(StreamBase(fqn_seed, step), index);
}

std::string RngFqn(int rank) { return absl::StrCat(kRngFqn, ".rank", rank); }

std::string RngBytes(std::string_view fqn, int64_t step, int64_t size) {
  std::string out(static_cast<size_t>(std::max<int64_t>(size, 0)), '\0');
  const uint64_t base = StreamBase(FqnSeed(fqn), step);
  for (int64_t i = 0; i < size; i += 8) {
    const uint64_t h = Mix64(base + static_cast<uint64_t>(i) * kGolden);
    std::memcpy(out.data() + i, &h,
                static_cast<size_t>(std::min<int64_t>(8, size - i)));
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> SplitRange(int64_t n, int parts,
                                                    bool uneven) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (parts <= 0) return out;
  // Uneven: weights 2, 3, 4, ... so boundaries fall at 2/9 and 5/9 for three
  // parts, far from any even split's.
  int64_t total_weight = 0;
  for (int k = 0; k < parts; ++k) total_weight += uneven ? k + 2 : 1;
  int64_t acc = 0;
  int64_t begin = 0;
  for (int k = 0; k < parts; ++k) {
    acc += uneven ? k + 2 : 1;
    const int64_t end = k + 1 == parts ? n : n * acc / total_weight;
    out.emplace_back(begin, end);
    begin = end;
  }
  return out;
}

std::vector<Box> ShardBoxes(const SyntheticTensor& t, int parts, int dim,
                            bool uneven) {
  const Box full = Box::Full(t.shape);
  if (t.shape.empty() || parts <= 1) return {full};
  if (dim < 0 || dim >= static_cast<int>(t.shape.size())) dim = 0;
  std::vector<Box> boxes;
  for (auto [b, e] : SplitRange(t.shape[dim], parts, uneven)) {
    if (e <= b) continue;
    Box box = full;
    box.offsets[dim] = b;
    box.sizes[dim] = e - b;
    boxes.push_back(std::move(box));
  }
  if (boxes.empty()) boxes.push_back(full);  // a dim of size 0
  return boxes;
}

int TensorParallelDim(Parallelism p) {
  switch (p) {
    case Parallelism::kColumn:
      return 0;
    case Parallelism::kRow:
      return 1;
    case Parallelism::kReplicated:
      return -1;
  }
  return -1;
}

std::optional<Box> TensorParallelBox(const SyntheticTensor& t, int rank,
                                     int ranks, bool uneven) {
  if (ranks <= 0 || rank < 0 || rank >= ranks) return std::nullopt;
  Box box = Box::Full(t.shape);
  int dim = TensorParallelDim(t.parallelism);
  if (dim < 0 || t.shape.empty()) return box;
  if (dim >= static_cast<int>(t.shape.size())) dim = 0;
  const auto [begin, end] =
      SplitRange(t.shape[dim], ranks, uneven)[static_cast<size_t>(rank)];
  if (end <= begin) return std::nullopt;
  box.offsets[dim] = begin;
  box.sizes[dim] = end - begin;
  return box;
}

absl::Status FillBox(const SyntheticTensor& t, const Box& box,
                     const TensorView& dst, int64_t step, int threads) {
  if (absl::Status s = CheckF32Box(t, box, dst); !s.ok()) return s;
  const int64_t n = box.num_elements();
  const uint64_t base = StreamBase(FqnSeed(t.fqn), step);
  const int64_t blocks = (n + kBlockElements - 1) / kBlockElements;
  return internal_core::ParallelFor(
      blocks, std::max(1, threads), [&](int64_t b) -> absl::Status {
        const int64_t begin = b * kBlockElements;
        const int64_t end = std::min(n, begin + kBlockElements);
        WalkRuns(t.shape, box, dst, begin, end,
                 [&](int64_t g, float* p, int64_t count, int64_t stride) {
                   if (stride == 1) {
                     for (int64_t i = 0; i < count; ++i) {
                       p[i] = ValueOf(base, g + i);
                     }
                   } else {
                     for (int64_t i = 0; i < count; ++i) {
                       p[i * stride] = ValueOf(base, g + i);
                     }
                   }
                 });
        return absl::OkStatus();
      });
}

std::string Mismatch::ToString() const {
  return absl::StrFormat(
      "%s[%s] (element %d): expected %.9g (0x%08x), got %.9g (0x%08x)", fqn,
      absl::StrJoin(coords, ", "), index, expected, Bits(expected), got,
      Bits(got));
}

absl::StatusOr<std::optional<Mismatch>> VerifyBox(const SyntheticTensor& t,
                                                  const Box& box,
                                                  const TensorView& view,
                                                  int64_t step, int threads) {
  if (absl::Status s = CheckF32Box(t, box, view); !s.ok()) return s;
  const int64_t n = box.num_elements();
  const uint64_t base = StreamBase(FqnSeed(t.fqn), step);
  const int64_t blocks = (n + kBlockElements - 1) / kBlockElements;
  // The first wrong global index of each block (-1: none). Blocks follow the
  // box's row-major order, which is also increasing global index order.
  std::vector<int64_t> first_bad(static_cast<size_t>(blocks), -1);
  absl::Status s = internal_core::ParallelFor(
      blocks, std::max(1, threads), [&](int64_t b) -> absl::Status {
        const int64_t begin = b * kBlockElements;
        const int64_t end = std::min(n, begin + kBlockElements);
        int64_t bad = -1;
        WalkRuns(t.shape, box, view, begin, end,
                 [&](int64_t g, float* p, int64_t count, int64_t stride) {
                   if (bad >= 0) return;
                   for (int64_t i = 0; i < count; ++i) {
                     if (Bits(p[i * stride]) != Bits(ValueOf(base, g + i))) {
                       bad = g + i;
                       return;
                     }
                   }
                 });
        first_bad[static_cast<size_t>(b)] = bad;
        return absl::OkStatus();
      });
  if (!s.ok()) return s;
  for (int64_t bad : first_bad) {
    if (bad < 0) continue;
    Mismatch m;
    m.fqn = t.fqn;
    m.index = bad;
    m.coords.resize(t.shape.size());
    int64_t rem = bad;
    for (int d = static_cast<int>(t.shape.size()) - 1; d >= 0; --d) {
      m.coords[d] = rem % t.shape[d];
      rem /= t.shape[d];
    }
    int64_t voff = 0;
    for (size_t d = 0; d < m.coords.size(); ++d) {
      voff += (m.coords[d] - box.offsets[d]) * view.strides()[d];
    }
    m.expected = ValueOf(base, bad);
    m.got = static_cast<const float*>(view.data())[voff];
    return std::optional<Mismatch>(std::move(m));
  }
  return std::optional<Mismatch>();
}

void InsertLeaf(StateDict& root, std::string_view fqn, StateDict leaf) {
  const std::string path(fqn);
  std::vector<std::string> parts = absl::StrSplit(path, '.');
  StateDict* node = &root;
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool last = i + 1 == parts.size();
    if (IsNumber(parts[i])) {
      size_t index = 0;
      (void)absl::SimpleAtoi(parts[i], &index);
      if (!node->is_list()) *node = StateDict::List();
      while (node->size() <= index) node->Append(StateDict::Map());
      node = node->At(index);
    } else {
      node = &(*node)[std::string(parts[i])];
    }
    if (last) *node = std::move(leaf);
  }
}

const StateDict* FindLeaf(const StateDict& root, std::string_view fqn) {
  const StateDict* node = &root;
  for (absl::string_view part :
       absl::StrSplit(internal_core::AsAbsl(fqn), '.')) {
    if (node->is_list()) {
      size_t index = 0;
      if (!absl::SimpleAtoi(part, &index) || index >= node->size()) {
        return nullptr;
      }
      node = node->At(index);
    } else if (node->is_map()) {
      node = node->Find(std::string(part));
    } else {
      return nullptr;
    }
    if (node == nullptr) return nullptr;
  }
  return node;
}

int DefaultThreads() {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace cairn::tools
