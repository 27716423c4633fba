#include "cairn/state_dict.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace cairn {
namespace {

TEST(StateDictTest, DefaultIsEmptyMap) {
  StateDict sd;
  EXPECT_TRUE(sd.is_map());
  EXPECT_FALSE(sd.is_leaf());
  EXPECT_EQ(sd.size(), 0u);
  EXPECT_TRUE(sd.items().empty());
  EXPECT_EQ(sd.Find("x"), nullptr);
}

TEST(StateDictTest, NestedMapsAndLeaves) {
  float w[4] = {1, 2, 3, 4};
  StateDict sd;
  sd["model"]["w"] = TensorView(w, DType::kF32, {2, 2});
  sd["step"] = int64_t{100};
  sd["lr"] = 0.5;
  sd["name"] = "run-1";
  sd["flag"] = true;
  sd["rng"] = Object{"\x01\x02"};
  EXPECT_EQ(sd.size(), 6u);

  const StateDict* model = sd.Find("model");
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(model->kind(), StateDict::Kind::kMap);
  const ShardedTensor* t = model->Find("w")->tensor();
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype(), DType::kF32);
  EXPECT_EQ(t->global_shape(), (Shape{2, 2}));
  ASSERT_EQ(t->shards().size(), 1u);
  EXPECT_EQ(t->shards()[0].box, Box::Full({2, 2}));
  EXPECT_EQ(t->shards()[0].view.data(), w);
  EXPECT_EQ(t->owner(), nullptr);

  EXPECT_EQ(std::get<int64_t>(*sd.Find("step")->scalar()), 100);
  EXPECT_EQ(std::get<double>(*sd.Find("lr")->scalar()), 0.5);
  EXPECT_EQ(std::get<std::string>(*sd.Find("name")->scalar()), "run-1");
  EXPECT_EQ(std::get<bool>(*sd.Find("flag")->scalar()), true);
  EXPECT_EQ(sd.Find("rng")->object()->bytes, "\x01\x02");
  EXPECT_EQ(sd.Find("rng")->kind(), StateDict::Kind::kObject);
  EXPECT_EQ(sd.Find("step")->kind(), StateDict::Kind::kScalar);
  EXPECT_EQ(model->Find("w")->kind(), StateDict::Kind::kTensor);
  // Wrong-kind accessors return null.
  EXPECT_EQ(sd.Find("step")->tensor(), nullptr);
  EXPECT_EQ(sd.Find("step")->object(), nullptr);
  EXPECT_EQ(sd.Find("rng")->scalar(), nullptr);
  EXPECT_EQ(sd.Find("step")->Find("x"), nullptr);
  EXPECT_TRUE(sd.Find("step")->items().empty());
  EXPECT_EQ(sd.Find("step")->size(), 0u);

  // Items come in key order.
  std::vector<std::string> keys;
  for (const auto& [k, v] : sd.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"flag", "lr", "model", "name",
                                            "rng", "step"}));
}

TEST(StateDictTest, IntLiteralIsInt64Scalar) {
  StateDict sd;
  sd["a"] = 7;
  EXPECT_EQ(std::get<int64_t>(*sd.Find("a")->scalar()), 7);
}

TEST(StateDictTest, Lists) {
  StateDict sd;
  sd["layers"] = StateDict::List();
  StateDict& layers = sd["layers"];
  EXPECT_TRUE(layers.is_list());
  layers.Append(int64_t{1});
  StateDict& second = layers.Append(StateDict::Map());
  second["bias"] = 2.0;
  EXPECT_EQ(layers.size(), 2u);
  EXPECT_EQ(std::get<int64_t>(*layers.At(0)->scalar()), 1);
  EXPECT_EQ(std::get<double>(*layers.At(1)->Find("bias")->scalar()), 2.0);
  EXPECT_EQ(layers.At(2), nullptr);
  EXPECT_EQ(layers.elements().size(), 2u);
  EXPECT_EQ(sd.At(0), nullptr) << "a map is not a list";
  EXPECT_TRUE(sd.elements().empty());
}

TEST(StateDictTest, OperatorBracketTurnsLeafIntoMap) {
  StateDict sd;
  sd["x"] = int64_t{1};
  sd["x"]["y"] = int64_t{2};
  EXPECT_TRUE(sd.Find("x")->is_map());
  EXPECT_EQ(std::get<int64_t>(*sd.Find("x")->Find("y")->scalar()), 2);
}

TEST(StateDictTest, AppendTurnsMapIntoList) {
  StateDict sd;
  sd["k"] = 1;
  sd.Append(2);
  EXPECT_TRUE(sd.is_list());
  EXPECT_EQ(sd.size(), 1u);
}

TEST(StateDictTest, MutableAccess) {
  StateDict sd;
  sd["s"] = int64_t{1};
  *sd.Find("s")->scalar() = int64_t{5};
  EXPECT_EQ(std::get<int64_t>(*sd.Find("s")->scalar()), 5);
  sd["o"] = Object{"a"};
  sd.Find("o")->object()->bytes = "b";
  EXPECT_EQ(sd.Find("o")->object()->bytes, "b");
  sd["l"] = StateDict::List();
  sd.Find("l")->Append(1);
  *sd.Find("l")->At(0) = 3;
  EXPECT_EQ(std::get<int64_t>(*sd.Find("l")->At(0)->scalar()), 3);
}

TEST(StateDictTest, TensorLeafKeepsOwnerAlive) {
  auto tensor = Tensor::Zeros(DType::kU8, {16});
  ASSERT_TRUE(tensor.ok());
  std::weak_ptr<void> weak = tensor->buffer();
  StateDict sd;
  sd["t"] = *tensor;
  *tensor = Tensor();
  EXPECT_FALSE(weak.expired());
  EXPECT_NE(sd.Find("t")->tensor()->owner(), nullptr);
  sd = StateDict();
  EXPECT_TRUE(weak.expired());
}

TEST(StateDictTest, ShardedTensorKeepsShards) {
  float a[2], b[2];
  ShardedTensor t(
      DType::kF32, {2, 4},
      {Shard{Box{{0, 0}, {2, 1}}, TensorView(a, DType::kF32, {2, 1})},
       Shard{Box{{0, 2}, {2, 1}}, TensorView(b, DType::kF32, {2, 1})}});
  StateDict sd;
  sd["wq"] = t;
  const ShardedTensor* got = sd.Find("wq")->tensor();
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->global_shape(), (Shape{2, 4}));
  ASSERT_EQ(got->shards().size(), 2u);
  EXPECT_EQ(got->shards()[1].box, (Box{{0, 2}, {2, 1}}));
  EXPECT_EQ(got->shards()[1].view.data(), b);
}

TEST(StateDictTest, CopyIsDeepForStructureShallowForData) {
  float w[1] = {1};
  StateDict a;
  a["w"] = TensorView(w, DType::kF32, {1});
  a["n"] = 1;
  StateDict b = a;
  b["n"] = 2;
  EXPECT_EQ(std::get<int64_t>(*a.Find("n")->scalar()), 1);
  EXPECT_EQ(b.Find("w")->tensor()->shards()[0].view.data(), w);
}

}  // namespace
}  // namespace cairn
