#include "synthetic_model.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::tools {
namespace {

using ::testing::HasSubstr;

SyntheticTensor Matrix(std::string fqn, int64_t rows, int64_t cols) {
  return {std::move(fqn), DType::kF32, {rows, cols}, Parallelism::kColumn};
}

Tensor FillWhole(const SyntheticTensor& t, int64_t step, int threads = 2) {
  Tensor out = Tensor::Empty(t.dtype, t.shape).value();
  EXPECT_TRUE(FillBox(t, Box::Full(t.shape), out.view(), step, threads).ok());
  return out;
}

TEST(SyntheticModelTest, ValuesAreDeterministicExactAndVary) {
  const uint64_t seed = FqnSeed("model.embed");
  EXPECT_EQ(seed, FqnSeed("model.embed"));
  EXPECT_NE(seed, FqnSeed("model.norm"));
  std::set<uint32_t> distinct;
  for (int64_t i = 0; i < 10000; ++i) {
    const float v = ElementValue(seed, i, 7);
    EXPECT_EQ(std::bit_cast<uint32_t>(v),
              std::bit_cast<uint32_t>(ElementValue(seed, i, 7)));
    ASSERT_FALSE(std::isnan(v));
    ASSERT_LT(std::fabs(v), 0.5f);
    // k * 2^-24 with an integer k: exact in F32.
    const double k = static_cast<double>(v) * 16777216.0;
    ASSERT_EQ(k, std::floor(k));
    distinct.insert(std::bit_cast<uint32_t>(v));
  }
  EXPECT_GT(distinct.size(), 9900u);
  int same_across_steps = 0;
  for (int64_t i = 0; i < 1000; ++i) {
    same_across_steps += ElementValue(seed, i, 7) == ElementValue(seed, i, 8);
  }
  EXPECT_LT(same_across_steps, 5);
}

TEST(SyntheticModelTest, FillIsDeterministicAcrossThreadCounts) {
  const SyntheticTensor t = Matrix("w", 700, 513);  // > one block
  Tensor a = FillWhole(t, 3, 1);
  Tensor b = FillWhole(t, 3, 4);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
  const float* p = static_cast<const float*>(a.data());
  const uint64_t seed = FqnSeed("w");
  for (int64_t i : {int64_t{0}, int64_t{1}, int64_t{513}, int64_t{359099}}) {
    EXPECT_EQ(p[i], ElementValue(seed, i, 3)) << i;
  }
}

TEST(SyntheticModelTest, ShardFillMatchesWholeTensorAnySharding) {
  const SyntheticTensor t = Matrix("layers.0.w", 37, 29);
  Tensor whole = FillWhole(t, 5);
  for (int dim : {0, 1}) {
    for (bool uneven : {false, true}) {
      for (const Box& box : ShardBoxes(t, 3, dim, uneven)) {
        Tensor shard = Tensor::Empty(t.dtype, box.sizes).value();
        ASSERT_TRUE(FillBox(t, box, shard.view(), 5, 2).ok());
        auto sub = whole.view().Slice(box);
        ASSERT_TRUE(sub.ok());
        auto verdict = VerifyBox(t, box, *sub, 5, 2);
        ASSERT_TRUE(verdict.ok());
        EXPECT_FALSE(verdict->has_value()) << (*verdict)->ToString();
        verdict = VerifyBox(t, box, shard.view(), 5, 2);
        ASSERT_TRUE(verdict.ok());
        EXPECT_FALSE(verdict->has_value()) << (*verdict)->ToString();
      }
    }
  }
}

TEST(SyntheticModelTest, FillsStridedDestinations) {
  const SyntheticTensor t = Matrix("w", 8, 6);
  // A column-major 8x6 view over a 6x8 buffer.
  std::vector<float> buf(48, 0);
  TensorView view(buf.data(), DType::kF32, {8, 6}, {1, 8});
  ASSERT_TRUE(FillBox(t, Box::Full(t.shape), view, 1, 2).ok());
  const uint64_t seed = FqnSeed("w");
  for (int r = 0; r < 8; ++r) {
    for (int c = 0; c < 6; ++c) {
      EXPECT_EQ(buf[c * 8 + r], ElementValue(seed, r * 6 + c, 1));
    }
  }
  auto verdict = VerifyBox(t, Box::Full(t.shape), view, 1, 2);
  ASSERT_TRUE(verdict.ok());
  EXPECT_FALSE(verdict->has_value());
}

TEST(SyntheticModelTest, WrongElementIsDetectedAndNamed) {
  const SyntheticTensor t = Matrix("model.layers.2.mlp.w2", 40, 30);
  const Box box{{10, 0}, {20, 30}};
  Tensor shard = Tensor::Empty(t.dtype, box.sizes).value();
  ASSERT_TRUE(FillBox(t, box, shard.view(), 9, 2).ok());
  float* p = static_cast<float*>(shard.data());
  // Two wrong elements: the lower global index is reported.
  p[7 * 30 + 4] = 1.0f;        // global (17, 4)
  p[3 * 30 + 29] += 0x1p-24f;  // global (13, 29): one ulp-ish off
  auto verdict = VerifyBox(t, box, shard.view(), 9, 2);
  ASSERT_TRUE(verdict.ok());
  ASSERT_TRUE(verdict->has_value());
  const Mismatch& m = **verdict;
  EXPECT_EQ(m.fqn, "model.layers.2.mlp.w2");
  EXPECT_EQ(m.index, 13 * 30 + 29);
  EXPECT_EQ(m.coords, (std::vector<int64_t>{13, 29}));
  EXPECT_EQ(m.expected, ElementValue(FqnSeed(t.fqn), 13 * 30 + 29, 9));
  EXPECT_EQ(m.got, p[3 * 30 + 29]);
  EXPECT_THAT(m.ToString(), HasSubstr("model.layers.2.mlp.w2[13, 29]"));
  EXPECT_THAT(m.ToString(), HasSubstr("element 419"));

  // The wrong step is caught at the first element.
  verdict = VerifyBox(t, box, shard.view(), 10, 2);
  ASSERT_TRUE(verdict.ok());
  ASSERT_TRUE(verdict->has_value());
  EXPECT_EQ((*verdict)->index, 10 * 30);
}

TEST(SyntheticModelTest, NanPoisonIsNeverAValue) {
  const SyntheticTensor t = Matrix("w", 4, 4);
  std::vector<uint32_t> poison(16, 0x7FC0DEADu);
  TensorView view(poison.data(), DType::kF32, {4, 4});
  auto verdict = VerifyBox(t, Box::Full(t.shape), view, 0, 1);
  ASSERT_TRUE(verdict.ok());
  ASSERT_TRUE(verdict->has_value());
  EXPECT_EQ((*verdict)->index, 0);
  EXPECT_THAT((*verdict)->ToString(), HasSubstr("nan"));
}

TEST(SyntheticModelTest, RejectsBadDestinations) {
  const SyntheticTensor t = Matrix("w", 4, 4);
  std::vector<float> buf(16);
  TensorView wrong_shape(buf.data(), DType::kF32, {2, 8});
  EXPECT_FALSE(FillBox(t, Box::Full(t.shape), wrong_shape, 0, 1).ok());
  TensorView wrong_dtype(buf.data(), DType::kI32, {4, 4});
  EXPECT_FALSE(FillBox(t, Box::Full(t.shape), wrong_dtype, 0, 1).ok());
  TensorView view(buf.data(), DType::kF32, {4, 4});
  EXPECT_FALSE(FillBox(t, Box{{1, 0}, {4, 4}}, view, 0, 1).ok());
}

TEST(SyntheticModelTest, SizesHitTheTarget) {
  for (uint64_t target :
       {uint64_t{8} << 20, uint64_t{64} << 20, uint64_t{256} << 20,
        uint64_t{1} << 30, uint64_t{2} << 30, uint64_t{500} * 1000 * 1000}) {
    auto config = ChooseConfig(target);
    ASSERT_TRUE(config.ok());
    auto model = BuildModel(*config);
    ASSERT_TRUE(model.ok());
    const double ratio =
        static_cast<double>(model->total_bytes()) / static_cast<double>(target);
    EXPECT_NEAR(ratio, 1.0, 0.01) << target;
    EXPECT_GE(config->layers, 2);
    EXPECT_EQ(config->hidden % 8, 0);
    EXPECT_GE(config->vocab, 2 * config->hidden);
    // 3 copies (weight, exp_avg, exp_avg_sq) of embed, 9 per layer, norm.
    EXPECT_EQ(model->tensors.size(), 3u * (2 + 9 * config->layers));
  }
  auto layered = ChooseConfig(uint64_t{64} << 20, 5);
  ASSERT_TRUE(layered.ok());
  EXPECT_EQ(layered->layers, 5);
  EXPECT_NEAR(static_cast<double>(BuildModel(*layered)->total_bytes()),
              64.0 * (1 << 20), 0.01 * 64 * (1 << 20));
  // Tiny targets give the smallest model rather than failing.
  auto tiny = ChooseConfig(1000);
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(tiny->hidden, 16);
  EXPECT_FALSE(ChooseConfig(0).ok());
}

// Up to kMaxSyntheticBytes the search for the hidden size ends and hits
// the target, with one layer or the most; past it the target is refused (a
// target near 2^64 once made the next size's byte count wrap below it, and
// the search never ended).
TEST(SyntheticModelTest, TargetsUpToTheLimitEndAndPastItAreRefused) {
  for (int layers : {0, 1, 4096}) {
    SCOPED_TRACE(layers);
    auto config = ChooseConfig(kMaxSyntheticBytes, layers);
    ASSERT_TRUE(config.ok()) << config.status();
    auto model = BuildModel(*config);
    ASSERT_TRUE(model.ok());
    EXPECT_NEAR(static_cast<double>(model->total_bytes()) /
                    static_cast<double>(kMaxSyntheticBytes),
                1.0, 0.01);
  }
  for (uint64_t target :
       {kMaxSyntheticBytes + 1, std::numeric_limits<uint64_t>::max()}) {
    absl::StatusOr<SyntheticConfig> config = ChooseConfig(target);
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(config.status().message()),
                ::testing::HasSubstr("over the limit of 1125899906842624"));
  }
}

TEST(SyntheticModelTest, ModelHasWeightsMomentsAndParallelism) {
  auto model = BuildModel(ChooseConfig(uint64_t{4} << 20, 2).value());
  ASSERT_TRUE(model.ok());
  const SyntheticTensor* wq = model->Find("model.layers.1.attn.wq");
  const SyntheticTensor* wo = model->Find("model.layers.1.attn.wo");
  const SyntheticTensor* w2 =
      model->Find("optim.exp_avg_sq.model.layers.0.mlp.w2");
  const SyntheticTensor* norm = model->Find("optim.exp_avg.model.norm");
  ASSERT_TRUE(wq && wo && w2 && norm);
  EXPECT_EQ(wq->parallelism, Parallelism::kColumn);
  EXPECT_EQ(wo->parallelism, Parallelism::kRow);
  EXPECT_EQ(w2->parallelism, Parallelism::kRow);
  EXPECT_EQ(norm->parallelism, Parallelism::kReplicated);
  EXPECT_EQ(w2->shape, (Shape{model->config.hidden, model->config.ffn}));
  EXPECT_NE(model->Find("optim.exp_avg.model.embed"), nullptr);
}

TEST(SyntheticModelTest, SplitsCoverTheRange) {
  for (int64_t n : {0, 1, 2, 3, 10, 1001}) {
    for (int parts : {1, 3, 4}) {
      for (bool uneven : {false, true}) {
        auto ranges = SplitRange(n, parts, uneven);
        ASSERT_EQ(ranges.size(), static_cast<size_t>(parts));
        int64_t at = 0;
        for (auto [b, e] : ranges) {
          EXPECT_EQ(b, at);
          EXPECT_LE(b, e);
          at = e;
        }
        EXPECT_EQ(at, n);
      }
    }
  }
  auto even = SplitRange(90, 3, false);
  auto uneven = SplitRange(90, 3, true);
  EXPECT_EQ(even[0], (std::pair<int64_t, int64_t>{0, 30}));
  EXPECT_EQ(uneven[0], (std::pair<int64_t, int64_t>{0, 20}));
  EXPECT_EQ(uneven[1], (std::pair<int64_t, int64_t>{20, 50}));
}

TEST(SyntheticModelTest, InsertLeafBuildsMapsAndLists) {
  StateDict sd;
  InsertLeaf(sd, "model.layers.1.attn.wq", StateDict(int64_t{1}));
  InsertLeaf(sd, "model.layers.0.attn.wq", StateDict(int64_t{0}));
  InsertLeaf(sd, "step", StateDict(int64_t{5}));
  const StateDict* layers = sd.Find("model")->Find("layers");
  ASSERT_NE(layers, nullptr);
  ASSERT_TRUE(layers->is_list());
  ASSERT_EQ(layers->size(), 2u);
  const Scalar* s = layers->At(1)->Find("attn")->Find("wq")->scalar();
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(std::get<int64_t>(*s), 1);
  EXPECT_EQ(std::get<int64_t>(*sd.Find("step")->scalar()), 5);

  // FindLeaf walks the same path back.
  InsertLeaf(sd, "rng.rank3", StateDict(Object{"abc"}));
  const StateDict* rng = FindLeaf(sd, "rng.rank3");
  ASSERT_NE(rng, nullptr);
  ASSERT_NE(rng->object(), nullptr);
  EXPECT_EQ(rng->object()->bytes, "abc");
  ASSERT_NE(FindLeaf(sd, "model.layers.1.attn.wq"), nullptr);
  EXPECT_EQ(
      std::get<int64_t>(*FindLeaf(sd, "model.layers.1.attn.wq")->scalar()), 1);
  EXPECT_EQ(FindLeaf(sd, "model.layers.2.attn.wq"), nullptr);
  EXPECT_EQ(FindLeaf(sd, "rng.rank4"), nullptr);
  EXPECT_EQ(FindLeaf(sd, "step.x"), nullptr);
}

TEST(SyntheticModelTest, RngBytesAreDeterministicAndPerRank) {
  EXPECT_EQ(RngFqn(0), "rng.rank0");
  EXPECT_EQ(RngFqn(12), "rng.rank12");
  EXPECT_EQ(RngBytes("rng.rank1", 3, 4099), RngBytes("rng.rank1", 3, 4099));
  EXPECT_EQ(RngBytes("rng.rank1", 3, 4099).size(), 4099u);
  EXPECT_NE(RngBytes("rng.rank1", 3, 64), RngBytes("rng.rank1", 4, 64));
  EXPECT_NE(RngBytes(RngFqn(0), 3, 64), RngBytes(RngFqn(1), 3, 64));
  EXPECT_EQ(RngBytes("rng", 3, 0), "");
}

// Every element of `t` is held by exactly one of `ranks` ranks, or by all
// of them for a replicated tensor.
void ExpectTensorParallelCover(const SyntheticTensor& t, int ranks,
                               bool uneven) {
  SCOPED_TRACE(absl::StrCat(t.fqn, " over ", ranks, uneven ? " uneven" : ""));
  std::vector<int> holders(static_cast<size_t>(t.num_elements()), 0);
  for (int r = 0; r < ranks; ++r) {
    std::optional<Box> box = TensorParallelBox(t, r, ranks, uneven);
    if (!box) continue;
    ASSERT_TRUE(ValidateBox(*box, t.shape).ok()) << box->ToString();
    ASSERT_GT(box->num_elements(), 0);
    for (int64_t i = 0; i < t.num_elements(); ++i) {
      int64_t rem = i;
      bool inside = true;
      for (int d = static_cast<int>(t.shape.size()) - 1; d >= 0; --d) {
        const int64_t c = rem % t.shape[d];
        rem /= t.shape[d];
        inside &= c >= box->offsets[d] && c < box->offsets[d] + box->sizes[d];
      }
      holders[static_cast<size_t>(i)] += inside;
    }
  }
  const int want = t.parallelism == Parallelism::kReplicated ? ranks : 1;
  for (size_t i = 0; i < holders.size(); ++i) {
    ASSERT_EQ(holders[i], want) << "element " << i;
  }
}

TEST(SyntheticModelTest, TensorParallelBoxesCoverEveryTensorOnce) {
  auto model = BuildModel(ChooseConfig(uint64_t{64} << 10, 1).value());
  ASSERT_TRUE(model.ok());
  for (const SyntheticTensor& t : model->tensors) {
    for (int ranks : {1, 2, 3, 4, 5, 7}) {
      for (bool uneven : {false, true}) {
        ExpectTensorParallelCover(t, ranks, uneven);
      }
    }
  }
  // More ranks than rows: the surplus ranks hold nothing, the rest cover.
  const SyntheticTensor small = Matrix("w", 3, 5);
  ExpectTensorParallelCover(small, 8, false);
  ExpectTensorParallelCover(small, 8, true);
  int holding = 0;
  for (int r = 0; r < 8; ++r)
    holding += TensorParallelBox(small, r, 8, false).has_value();
  EXPECT_EQ(holding, 3);
  EXPECT_FALSE(TensorParallelBox(small, 0, 8, false).has_value());
  EXPECT_FALSE(TensorParallelBox(small, 8, 8, false).has_value());
  EXPECT_FALSE(TensorParallelBox(small, -1, 8, false).has_value());
}

TEST(SyntheticModelTest, TensorParallelSplitsColumnsRowsAndReplicates) {
  EXPECT_EQ(TensorParallelDim(Parallelism::kColumn), 0);
  EXPECT_EQ(TensorParallelDim(Parallelism::kRow), 1);
  EXPECT_EQ(TensorParallelDim(Parallelism::kReplicated), -1);
  const SyntheticTensor column = Matrix("wq", 8, 6);
  SyntheticTensor row = column;
  row.parallelism = Parallelism::kRow;
  const SyntheticTensor norm{
      "norm", DType::kF32, {6}, Parallelism::kReplicated};
  EXPECT_EQ(TensorParallelBox(column, 1, 4, false), (Box{{2, 0}, {2, 6}}));
  EXPECT_EQ(TensorParallelBox(row, 1, 2, false), (Box{{0, 3}, {8, 3}}));
  EXPECT_EQ(TensorParallelBox(norm, 2, 3, true), Box::Full({6}));
  // Uneven: 2:3:4 of 9 rows.
  EXPECT_EQ(TensorParallelBox(Matrix("w", 9, 2), 1, 3, true),
            (Box{{2, 0}, {3, 2}}));
  // A 1-D tensor marked row-parallel splits its only dimension.
  SyntheticTensor vec{"v", DType::kF32, {10}, Parallelism::kRow};
  EXPECT_EQ(TensorParallelBox(vec, 1, 2, false), (Box{{5}, {5}}));
}

// The demo saves with even splits and loads with uneven ones so that the
// load reshards; check that no interior boundary coincides for the rank
// counts the tests and the default demo use, at the sizes they use.
TEST(SyntheticModelTest, UnevenLoadBoundariesMissEvenSaveBoundaries) {
  for (uint64_t size :
       {uint64_t{4} << 20, uint64_t{8} << 20, uint64_t{256} << 20}) {
    auto model = BuildModel(ChooseConfig(size).value());
    ASSERT_TRUE(model.ok());
    for (auto [save, load] :
         {std::pair{4, 3}, std::pair{4, 4}, std::pair{2, 5}, std::pair{4, 2}}) {
      for (const SyntheticTensor& t : model->tensors) {
        const int dim = TensorParallelDim(t.parallelism);
        if (dim < 0) continue;
        std::set<int64_t> saved;
        for (auto [b, e] : SplitRange(t.shape[dim], save, false)) {
          if (b > 0) saved.insert(b);
        }
        for (auto [b, e] : SplitRange(t.shape[dim], load, true)) {
          EXPECT_TRUE(b == 0 || !saved.contains(b))
              << t.fqn << " " << save << "->" << load << " at " << b;
        }
      }
    }
  }
}

TEST(SyntheticModelTest, TensorBytesLeaveOutTheRngObject) {
  auto model = BuildModel(ChooseConfig(uint64_t{4} << 20).value());
  ASSERT_TRUE(model.ok());
  EXPECT_EQ(
      model->total_bytes(),
      model->tensor_bytes() + static_cast<uint64_t>(model->config.rng_bytes));
}

}  // namespace
}  // namespace cairn::tools
