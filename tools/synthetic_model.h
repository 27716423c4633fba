// A synthetic training state for `cairn demo` and the CLI tests: a small
// transformer (token embedding, N layers of attention wq/wk/wv/wo and MLP
// w1/w2/w3 weights, RMS norms), Adam first and second moments for every
// weight (`optim.exp_avg.<fqn>`, `optim.exp_avg_sq.<fqn>`), a `step` int64
// scalar and one RNG byte object per saving rank (`rng.rank<r>`, since every
// rank of a real job has its own generator state).
//
// Every element is a pure function of (FQN, global element index, step), so
// any shard of any tensor can be filled, and a load under any sharding can be
// verified element by element, without holding the whole state anywhere.
// Values are F32 numbers k * 2^-24 with |k| < 2^23: exactly representable, and
// never NaN (so a NaN poison pattern marks elements a load did not write).
//
// Thread safety: everything here is a pure function or a value; FillBox and
// VerifyBox may run concurrently on different destinations.
#ifndef CAIRN_TOOLS_SYNTHETIC_MODEL_H_
#define CAIRN_TOOLS_SYNTHETIC_MODEL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"

namespace cairn::tools {

// How tensor parallelism splits a weight across ranks.
enum class Parallelism : uint8_t {
  kColumn,      // split on dim 0 (wq, wk, wv, w1, w3, embedding)
  kRow,         // split on dim 1 (wo, w2)
  kReplicated,  // every rank holds all of it (norms)
};

struct SyntheticTensor {
  std::string fqn;  // "model.layers.3.attn.wq", "optim.exp_avg.model.embed"
  DType dtype = DType::kF32;
  Shape shape;
  Parallelism parallelism = Parallelism::kReplicated;

  int64_t num_elements() const { return NumElements(shape); }
  uint64_t nbytes() const;
};

struct SyntheticConfig {
  int layers = 0;
  int64_t hidden = 0;
  int64_t ffn = 0;    // MLP inner size
  int64_t vocab = 0;  // embedding rows
  int64_t rng_bytes = 4096;
  friend bool operator==(const SyntheticConfig&,
                         const SyntheticConfig&) = default;
};

struct SyntheticModel {
  SyntheticConfig config;
  // Weights first, then their exp_avg and exp_avg_sq moments (same shapes
  // and parallelism), in a fixed order.
  std::vector<SyntheticTensor> tensors;

  // Bytes of every tensor, each counted once (replicas are saved once).
  uint64_t tensor_bytes() const;
  // tensor_bytes() plus one rng object (what ChooseConfig aims at).
  uint64_t total_bytes() const;
  int64_t total_elements() const;
  const SyntheticTensor* Find(std::string_view fqn) const;
};

// FQNs of the non-tensor leaves: the step scalar, and the parent of the
// per-rank rng objects (checkpoints of the single-process demo before
// `--ranks` hold one object under exactly this name).
inline constexpr char kStepFqn[] = "step";
inline constexpr char kRngFqn[] = "rng";

// The FQN of save rank `rank`'s rng object: "rng.rank3". A map key rather
// than a list index, so a checkpoint's ranks need not be contiguous to load.
std::string RngFqn(int rank);

// The largest target ChooseConfig takes: 1 PiB, far past any machine's
// memory (the demo and the bench hold the whole state), and small enough
// that no size of a model near it overflows 64 bits.
inline constexpr uint64_t kMaxSyntheticBytes = uint64_t{1} << 50;

// Chooses a config whose total_bytes() is as close to `target_bytes` as the
// shapes allow (within a fraction of a percent above a few MiB; tiny targets
// are rounded up to the smallest model: hidden 16, vocab 16). `layers` <= 0
// picks a layer count that grows with the size. kInvalidArgument for a zero
// target, one over kMaxSyntheticBytes, or absurd layer counts.
absl::StatusOr<SyntheticConfig> ChooseConfig(uint64_t target_bytes,
                                             int layers = 0);

// The tensors of `config`. kInvalidArgument for a config with non-positive
// sizes.
absl::StatusOr<SyntheticModel> BuildModel(const SyntheticConfig& config);

// The value of element `index` (row-major, global) of tensor `fqn` at
// `step`. FqnSeed(fqn) may be computed once and reused.
uint64_t FqnSeed(std::string_view fqn);
float ElementValue(uint64_t fqn_seed, int64_t index, int64_t step);

// The bytes of rng object `fqn` at `step` (each rank's differ).
std::string RngBytes(std::string_view fqn, int64_t step, int64_t size);

// Splits [0, n) into `parts` contiguous ranges: even (sizes differ by at most
// one) or deliberately uneven (roughly 1:2:3:... so that no boundary lines up
// with an even split). Parts may be empty when n < parts.
std::vector<std::pair<int64_t, int64_t>> SplitRange(int64_t n, int parts,
                                                    bool uneven);

// The boxes of tensor `t` when split into `parts` shards along `dim` (a dim
// the tensor lacks, e.g. dim 1 of a norm, falls back to dim 0). Empty boxes
// are dropped. parts == 1 gives the whole box.
std::vector<Box> ShardBoxes(const SyntheticTensor& t, int parts, int dim,
                            bool uneven);

// The dimension tensor parallelism splits: 0 for column-parallel, 1 for
// row-parallel, -1 for replicated tensors.
int TensorParallelDim(Parallelism p);

// The box rank `rank` of `ranks` holds of `t` under tensor parallelism:
// part `rank` of SplitRange(shape[TensorParallelDim], ranks, uneven) of the
// split dimension (dim 0 when the tensor has no such dimension), the whole
// tensor for a replicated one (every rank holds a copy). nullopt when the
// rank's part is empty (more ranks than rows) or `rank` is not in
// [0, ranks).
std::optional<Box> TensorParallelBox(const SyntheticTensor& t, int rank,
                                     int ranks, bool uneven);

// Fills `dst` (a view of shape box.sizes, any non-negative strides, host
// memory) with the values of `box` of `t` at `step`, on up to `threads`
// threads. kInvalidArgument for a dtype other than F32 or a shape mismatch.
absl::Status FillBox(const SyntheticTensor& t, const Box& box,
                     const TensorView& dst, int64_t step, int threads);

// The first wrong element found by VerifyBox.
struct Mismatch {
  std::string fqn;
  int64_t index = 0;            // global row-major element index
  std::vector<int64_t> coords;  // global coordinates
  float expected = 0;
  float got = 0;
  // "model.layers.0.attn.wq[3, 17] (element 1457): expected 0.25, got nan".
  std::string ToString() const;
};

// Checks every element of `view` (box `box` of `t`) bit for bit. Returns the
// wrong element with the lowest global index, nullopt when all match, or an
// error for a bad dtype/shape.
absl::StatusOr<std::optional<Mismatch>> VerifyBox(const SyntheticTensor& t,
                                                  const Box& box,
                                                  const TensorView& view,
                                                  int64_t step, int threads);

// Inserts `leaf` under the dotted `fqn`, creating maps on the way; numeric
// components index lists ("model.layers.3.wq" puts layer 3 in a list).
void InsertLeaf(StateDict& root, std::string_view fqn, StateDict leaf);

// The node at the dotted `fqn` (as InsertLeaf lays it out), or null.
const StateDict* FindLeaf(const StateDict& root, std::string_view fqn);

// Default thread count for fills and checks: the machine's cores.
int DefaultThreads();

}  // namespace cairn::tools

#endif  // CAIRN_TOOLS_SYNTHETIC_MODEL_H_
