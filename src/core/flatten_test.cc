#include "core/flatten.h"

#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn::internal_core {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> Fqns(const Flattened& flat) {
  std::vector<std::string> out;
  for (const FlatLeaf& leaf : flat.leaves) out.push_back(leaf.fqn);
  return out;
}

// make_leaf that returns the FQN as a string scalar.
absl::StatusOr<StateDict> FqnLeaf(const std::string& fqn) {
  return StateDict(fqn);
}

StateDict Example() {
  StateDict sd;
  sd["model"]["layers"] = StateDict::List();
  StateDict& layer0 = sd["model"]["layers"].Append(StateDict::Map());
  layer0["wq"] = int64_t{1};
  layer0["bias"] = int64_t{2};
  sd["model"]["layers"].Append(int64_t{3});
  sd["step"] = int64_t{100};
  sd["empty_map"] = StateDict::Map();
  sd["empty_list"] = StateDict::List();
  return sd;
}

TEST(FlattenTest, FqnsAndStructure) {
  const StateDict sd = Example();
  auto flat = Flatten(sd);
  ASSERT_TRUE(flat.ok()) << flat.status();
  EXPECT_EQ(Fqns(*flat), (std::vector<std::string>{"model.layers.0.bias",
                                                   "model.layers.0.wq",
                                                   "model.layers.1", "step"}));
  EXPECT_EQ(flat->structure,
            R"({"empty_list":[],"empty_map":{},"model":{"layers":[)"
            R"({"bias":"model.layers.0.bias","wq":"model.layers.0.wq"},)"
            R"("model.layers.1"]},"step":"step"})");
  // Leaves point into the state dict.
  EXPECT_EQ(flat->leaves.back().node, sd.Find("step"));
}

TEST(FlattenTest, RoundTrip) {
  const StateDict sd = Example();
  auto flat = Flatten(sd);
  ASSERT_TRUE(flat.ok());
  auto rebuilt = Unflatten(flat->structure, FqnLeaf);
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
  auto again = Flatten(*rebuilt);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->structure, flat->structure);
  EXPECT_EQ(Fqns(*again), Fqns(*flat));
  EXPECT_TRUE(rebuilt->Find("empty_map")->is_map());
  EXPECT_TRUE(rebuilt->Find("empty_list")->is_list());
  EXPECT_EQ(std::get<std::string>(
                *rebuilt->Find("model")->Find("layers")->At(1)->scalar()),
            "model.layers.1");
}

TEST(FlattenTest, EmptyStateDict) {
  auto flat = Flatten(StateDict());
  ASSERT_TRUE(flat.ok());
  EXPECT_TRUE(flat->leaves.empty());
  EXPECT_EQ(flat->structure, "{}");
  auto rebuilt = Unflatten("{}", FqnLeaf);
  ASSERT_TRUE(rebuilt.ok());
  EXPECT_TRUE(rebuilt->is_map());
  EXPECT_EQ(rebuilt->size(), 0u);
}

TEST(FlattenTest, DuplicateFqnIsInvalidArgument) {
  StateDict sd;
  sd["a.b"] = 1;
  sd["a"]["b"] = 2;
  auto flat = Flatten(sd);
  EXPECT_EQ(flat.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(flat.status().message()), HasSubstr("\"a.b\""));
}

TEST(FlattenTest, DuplicateFqnFromListIndexIsInvalidArgument) {
  StateDict sd;
  sd["l"] = StateDict::List();
  sd["l"].Append(1);
  sd["l.0"] = 2;
  EXPECT_EQ(Flatten(sd).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FlattenTest, RootLeafIsInvalidArgument) {
  EXPECT_EQ(Flatten(StateDict(int64_t{1})).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Flatten(StateDict::List()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FlattenTest, InvalidUtf8KeyIsInvalidArgument) {
  StateDict sd;
  sd[std::string("bad\xff")] = 1;
  EXPECT_EQ(Flatten(sd).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(FlattenTest, KeysWithDotsRoundTripThroughStructure) {
  StateDict sd;
  sd["a.b"]["c"] = 1;
  auto flat = Flatten(sd);
  ASSERT_TRUE(flat.ok());
  EXPECT_EQ(Fqns(*flat), (std::vector<std::string>{"a.b.c"}));
  auto rebuilt = Unflatten(flat->structure, FqnLeaf);
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status();
  ASSERT_NE(rebuilt->Find("a.b"), nullptr);
  EXPECT_NE(rebuilt->Find("a.b")->Find("c"), nullptr);
}

TEST(FlattenTest, FlattenMutableGivesWritableLeaves) {
  StateDict sd = Example();
  auto flat = FlattenMutable(sd);
  ASSERT_TRUE(flat.ok());
  for (MutableFlatLeaf& leaf : flat->leaves) *leaf.node = StateDict(leaf.fqn);
  EXPECT_EQ(std::get<std::string>(*sd.Find("step")->scalar()), "step");
  EXPECT_EQ(flat->structure, Flatten(sd)->structure);
}

TEST(FlattenTest, UnflattenPassesMakeLeafErrorThrough) {
  auto result = Unflatten(
      R"({"a": "a"})", [](const std::string& fqn) -> absl::StatusOr<StateDict> {
        return absl::NotFoundError("no " + fqn);
      });
  EXPECT_EQ(result.status(), absl::NotFoundError("no a"));
}

TEST(FlattenTest, UnflattenRejectsMalformedStructure) {
  const char* cases[] = {
      "",                         // not JSON
      "{",                        // truncated
      "{\"a\": \"a\"} trailing",  // trailing garbage
      "[]",                       // root not an object
      "\"x\"",                    // root a leaf
      "42",
      "null",
      R"({"a": 1})",  // leaf not a string
      R"({"a": null})",
      R"({"a": true})",
      R"({"a": [1.5]})",
      R"({"a": "b"})",  // leaf FQN does not match its place
      R"({"a": {"b": "a"}})",
      R"({"l": ["l.1"]})",
      R"({"a.b": "a.b", "a": {"b": "a.b"}})",  // duplicate FQN
      "{\"a\xff\": \"a\xff\"}",                // invalid UTF-8
  };
  for (const char* json : cases) {
    auto result = Unflatten(json, FqnLeaf);
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument)
        << json;
  }
}

TEST(FlattenTest, UnflattenRejectsDeepNesting) {
  std::string json = "{\"a\":";
  for (int i = 0; i < 100000; ++i) json += "[";
  for (int i = 0; i < 100000; ++i) json += "]";
  json += "}";
  EXPECT_EQ(Unflatten(json, FqnLeaf).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cairn::internal_core
