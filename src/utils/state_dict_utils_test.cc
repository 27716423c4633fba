// The state-dict utilities, with in-process ranks for the collectives.
// Inside a rank's function, checks are EXPECTs and every rank always reaches
// every collective: an early return on one rank would hang the others.
#include "cairn/state_dict_utils.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cairn/communicator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "core/byte_codec.h"
#include "cuda/fake_device_runtime.h"
#include "comm/collective.h"
#include "utils/internal.h"
#include "utils/test_util.h"

namespace cairn {
namespace {

using ::testing::HasSubstr;
using testing_util::CountingCommunicator;
using testing_util::CountWrong;
using testing_util::FillBox;
using testing_util::MakePart;
using testing_util::PaddedBuffer;
using testing_util::PaddedView;

constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
constexpr auto kUnimplemented = absl::StatusCode::kUnimplemented;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// Runs fn on n in-process ranks; returns each rank's status.
std::vector<absl::Status> OnRanks(
    int n, const std::function<absl::Status(Communicator&)>& fn) {
  return RunInProcess(n, fn);
}

void ExpectAllOk(const std::vector<absl::Status>& st) {
  for (size_t r = 0; r < st.size(); ++r) EXPECT_TRUE(st[r].ok()) << st[r];
}

// Every rank failed with the same error; returns it.
absl::Status ExpectSameError(const std::vector<absl::Status>& st) {
  EXPECT_FALSE(st.empty());
  if (st.empty()) return absl::OkStatus();
  EXPECT_FALSE(st[0].ok());
  for (size_t r = 1; r < st.size(); ++r) {
    EXPECT_EQ(st[r], st[0]) << "rank " << r;
  }
  return st[0];
}

// Tensors and views that must outlive the rank threads that made them.
class Keeper {
 public:
  Tensor Keep(Tensor t) {
    std::lock_guard<std::mutex> lock(mu_);
    kept_.push_back(t);
    return t;
  }

 private:
  std::mutex mu_;
  std::vector<Tensor> kept_;
};

// ===========================================================================
// SplitIntoPieces (the piece cutting under GatherFull)

TEST(SplitIntoPiecesTest, PiecesTileTheBoxWithinBudget) {
  struct Case {
    Box box;
    size_t elem;
    uint64_t budget;
    size_t expected_pieces;
  };
  const std::vector<Case> cases = {
      {Box{{0, 0}, {4, 8}}, 4, 1024, 1},      // fits whole
      {Box{{2, 3}, {4, 8}}, 4, 64, 2},        // two rows per piece
      {Box{{0, 0}, {4, 8}}, 4, 40, 4},        // one row per piece
      {Box{{0, 0}, {4, 8}}, 4, 12, 12},       // 3 + 3 + 2 per row
      {Box{{0, 0, 0}, {2, 3, 5}}, 2, 1, 30},  // budget below one element
      {Box{{}, {}}, 8, 1, 1},                 // rank 0: one element
      {Box{{0, 0}, {0, 8}}, 4, 16, 0},        // empty
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.box.ToString() + " budget " + std::to_string(c.budget));
    std::vector<Box> pieces =
        internal_utils::SplitIntoPieces(c.box, c.elem, c.budget);
    EXPECT_EQ(pieces.size(), c.expected_pieces);
    int64_t total = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      EXPECT_TRUE(Contains(c.box, pieces[i])) << pieces[i].ToString();
      EXPECT_FALSE(pieces[i].empty());
      EXPECT_LE(static_cast<uint64_t>(pieces[i].num_elements()) * c.elem,
                std::max<uint64_t>(c.budget, c.elem));
      for (size_t j = 0; j < i; ++j) {
        EXPECT_FALSE(Intersect(pieces[i], pieces[j]).has_value());
      }
      total += pieces[i].num_elements();
    }
    EXPECT_EQ(total, c.box.empty() ? 0 : c.box.num_elements());
  }
}

// ===========================================================================
// AgreeOnStatus and the message codec (under both collectives)

TEST(AgreeOnStatusTest, OneRanksErrorReachesEveryRankNamed) {
  absl::Status s = ExpectSameError(OnRanks(3, [](Communicator& comm) {
    const absl::Status local = comm.rank() == 1
                                   ? absl::ResourceExhaustedError("no memory")
                                   : absl::OkStatus();
    return internal_comm::AgreeOnStatus(comm, local, "Op(x)");
  }));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(
      Msg(s),
      "Op(x) failed on 1 of 3 ranks: rank 1: RESOURCE_EXHAUSTED: no memory");
  ExpectAllOk(OnRanks(3, [](Communicator& comm) {
    return internal_comm::AgreeOnStatus(comm, absl::OkStatus(), "Op(x)");
  }));
}

TEST(CodecTest, MalformedMessagesAreDataLoss) {
  const std::string sealed = internal_comm::Seal(absl::NotFoundError("gone"));
  EXPECT_EQ(internal_comm::Unseal(sealed, "m").status(),
            absl::NotFoundError("gone"));
  EXPECT_EQ(
      *internal_comm::Unseal(internal_comm::Seal(absl::OkStatus(), "p"), "m"),
      "p");
  for (const std::string& bad :
       {std::string(), sealed.substr(0, sealed.size() - 1), sealed + "x",
        std::string("\x7f") + sealed.substr(1)}) {
    absl::StatusOr<std::string> got = internal_comm::Unseal(bad, "message m");
    EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(Msg(got.status()), HasSubstr("message m"));
  }
  // A count larger than the message cannot make the reader allocate.
  internal_core::ByteWriter w;
  w.U64(uint64_t{1} << 60);
  const std::string huge = w.Take();
  internal_core::ByteReader r(huge, "ints");
  EXPECT_TRUE(r.Ints().empty());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
}

// metadata.json and the ranks' plans pass through Seal/Unseal whole: at
// thousands of ranks, hundreds of MB each, so neither may copy them.
TEST(CodecTest, SealInPlaceAndUnsealKeepThePayloadsBuffer) {
  std::string payload(1 << 20, 'p');
  payload[12345] = 'q';
  const std::string expected = payload;
  payload.reserve(payload.size() + 64);  // room for the header
  const char* buffer = payload.data();
  std::string sealed =
      internal_comm::SealInPlace(absl::OkStatus(), std::move(payload));
  EXPECT_EQ(sealed, internal_comm::Seal(absl::OkStatus(), expected));
  EXPECT_EQ(sealed.size(), expected.size() + internal_comm::kSealHeaderBytes);
  EXPECT_EQ(sealed.data(), buffer);
  absl::StatusOr<std::string> got =
      internal_comm::Unseal(std::move(sealed), "message m");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, expected);
  EXPECT_EQ(got->data(), buffer);
  // An error replaces the payload.
  EXPECT_EQ(internal_comm::Unseal(internal_comm::SealInPlace(
                                      absl::AbortedError("no"), expected),
                                  "m")
                .status(),
            absl::AbortedError("no"));
}

// ===========================================================================
// GatherFull

class GatherFullTest : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Ranks, GatherFullTest, ::testing::Values(1, 2, 3, 4));

// Uneven row shards (ceil split: 10 rows over 4 ranks is 3, 3, 3, 1), some
// held as strided views, gathered onto every rank.
TEST_P(GatherFullTest, UnevenRowShardsToAllRanks) {
  const int n = GetParam();
  const Shape shape = {10, 7};
  ExpectAllOk(OnRanks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    absl::StatusOr<Box> box = LocalBox(shape, {n}, {Placement::Shard(0)}, {r});
    EXPECT_TRUE(box.ok()) << box.status();
    // Odd ranks hold their rows inside a padded (non-contiguous) buffer.
    Tensor buf = r % 2 == 1 ? PaddedBuffer(DType::kF32, *box, 3)
                            : *Tensor::Empty(DType::kF32, box->sizes);
    TensorView view = r % 2 == 1 ? PaddedView(buf, *box, 3) : buf.view();
    FillBox(view, shape, *box, 1);
    ShardedTensor t(DType::kF32, shape, {Shard{*box, view}});
    CountingCommunicator counting(comm);
    absl::StatusOr<Tensor> full = GatherFull(counting, t);
    if (!full.ok()) return full.status();
    EXPECT_EQ(full->shape(), shape);
    EXPECT_EQ(full->dtype(), DType::kF32);
    EXPECT_TRUE(full->view().is_contiguous());
    CountWrong(full->view(), shape, Box::Full(shape), 1);
    // Every rank receives: one BroadcastBytes per shard that has rows (the
    // whole 280 bytes fit in one piece), and no Gather.
    EXPECT_EQ(counting.gathers, 0);
    EXPECT_EQ(counting.total_broadcast_bytes,
              n == 1 ? 0u : 10u * 7 * sizeof(float));
    return absl::OkStatus();
  }));
}

// Replicas: every rank holds a 2-D block (a 2 x 2 grid, repeated on ranks
// beyond 4) and rank 0 also holds the whole tensor; each element is moved
// once, from the lowest rank holding it.
TEST_P(GatherFullTest, ReplicatedShardsAreTakenOnce) {
  const int n = GetParam();
  const Shape shape = {5, 9};
  Keeper keep;
  ExpectAllOk(OnRanks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    std::vector<Shard> shards;
    Box block =
        *LocalBox(shape, {2, 2}, {Placement::Shard(0), Placement::Shard(1)},
                  {(r / 2) % 2, r % 2});
    Tensor part = keep.Keep(MakePart(DType::kI16, shape, block, 7));
    shards.push_back(Shard{block, part.view()});
    if (r == 0) {
      Tensor whole =
          keep.Keep(MakePart(DType::kI16, shape, Box::Full(shape), 7));
      shards.push_back(Shard{Box::Full(shape), whole.view()});
    }
    CountingCommunicator counting(comm);
    absl::StatusOr<Tensor> full =
        GatherFull(counting, ShardedTensor(DType::kI16, shape, shards));
    if (!full.ok()) return full.status();
    CountWrong(full->view(), shape, Box::Full(shape), 7);
    // Rank 0 holds everything, so only rank 0 sends, each element once.
    EXPECT_EQ(counting.total_broadcast_bytes,
              n == 1 ? 0u : 5u * 9 * sizeof(int16_t));
    for (int root : counting.broadcast_roots) EXPECT_EQ(root, 0);
    return absl::OkStatus();
  }));
}

// Chosen ranks receive; the others get an empty tensor and never receive
// the tensor's bytes (pieces go by Gather to each receiver).
TEST_P(GatherFullTest, ChosenRanksOnly) {
  const int n = GetParam();
  const Shape shape = {6, 33};
  for (const std::vector<int>& to :
       std::vector<std::vector<int>>{{0}, {n - 1}, {n - 1, 0, 0}}) {
    SCOPED_TRACE("to_ranks " + absl::StrJoin(to, ","));
    ExpectAllOk(OnRanks(n, [&](Communicator& comm) {
      const int r = comm.rank();
      Box box = *LocalBox(shape, {n}, {Placement::Shard(1)}, {r});
      // Odd ranks hold a transposed view (column-major), so their pieces
      // are staged before they are sent.
      Tensor buf = *Tensor::Empty(DType::kF64, {box.sizes[1], box.sizes[0]});
      TensorView view = r % 2 == 1
                            ? TensorView(buf.data(), DType::kF64, box.sizes,
                                         {1, box.sizes[0]})
                            : TensorView(buf.data(), DType::kF64, box.sizes);
      FillBox(view, shape, box, 3);
      CountingCommunicator counting(comm);
      GatherOptions options;
      options.to_ranks = to;
      options.piece_bytes = 40;  // five elements: many pieces
      absl::StatusOr<Tensor> full = GatherFull(
          counting, ShardedTensor(DType::kF64, shape, {Shard{box, view}}),
          options);
      if (!full.ok()) return full.status();
      const bool receives = std::count(to.begin(), to.end(), r) > 0;
      if (receives) {
        EXPECT_EQ(full->shape(), shape);
        CountWrong(full->view(), shape, Box::Full(shape), 3);
      } else {
        EXPECT_EQ(full->data(), nullptr);
        EXPECT_TRUE(full->shape().empty());
      }
      EXPECT_EQ(counting.broadcasts, 0);
      EXPECT_LE(counting.max_gather_bytes, 40u);
      return absl::OkStatus();
    }));
  }
}

// A small piece size splits the transfer into many bounded BroadcastBytes.
TEST_P(GatherFullTest, PiecesAreBounded) {
  const int n = GetParam();
  const Shape shape = {64, 100};
  ExpectAllOk(OnRanks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    Box box = *LocalBox(shape, {n}, {Placement::Shard(0)}, {r});
    Tensor buf = PaddedBuffer(DType::kF32, box, 1);
    TensorView view = PaddedView(buf, box, 1);
    FillBox(view, shape, box, 9);
    CountingCommunicator counting(comm);
    GatherOptions options;
    options.piece_bytes = 1000;  // 2.5 rows
    absl::StatusOr<Tensor> full = GatherFull(
        counting, ShardedTensor(DType::kF32, shape, {Shard{box, view}}),
        options);
    if (!full.ok()) return full.status();
    CountWrong(full->view(), shape, Box::Full(shape), 9);
    if (n > 1) {
      EXPECT_LE(counting.max_broadcast_bytes, 1000u);
      EXPECT_GE(counting.broadcasts, 64 * 100 * 4 / 1000);
      EXPECT_EQ(counting.total_broadcast_bytes, 64u * 100 * 4);
    }
    return absl::OkStatus();
  }));
}

TEST_P(GatherFullTest, RankZeroAndEmptyTensors) {
  const int n = GetParam();
  ExpectAllOk(OnRanks(n, [&](Communicator& comm) {
    // A scalar tensor held by the last rank only.
    const bool holds = comm.rank() == n - 1;
    Tensor one = MakePart(DType::kI64, {}, Box::Full({}), 5);
    std::vector<Shard> shards;
    if (holds) shards.push_back(Shard{Box::Full({}), one.view()});
    absl::StatusOr<Tensor> s =
        GatherFull(comm, ShardedTensor(DType::kI64, {}, shards));
    if (!s.ok()) return s.status();
    EXPECT_EQ(s->shape(), Shape{});
    CountWrong(s->view(), {}, Box::Full({}), 5);
    // A tensor with no elements needs no shards at all.
    absl::StatusOr<Tensor> e =
        GatherFull(comm, ShardedTensor(DType::kF32, {3, 0}, {}));
    if (!e.ok()) return e.status();
    EXPECT_EQ(e->shape(), (Shape{3, 0}));
    return absl::OkStatus();
  }));
}

// A gap is the same error on every rank, naming the missing box and who
// holds what.
TEST_P(GatherFullTest, CoverageGapFailsOnEveryRank) {
  const int n = GetParam();
  const Shape shape = {8, 4};
  absl::Status s = ExpectSameError(OnRanks(n, [&](Communicator& comm) {
    const int r = comm.rank();
    Box box = *LocalBox(shape, {n}, {Placement::Shard(0)}, {r});
    Tensor part = MakePart(DType::kF32, shape, box, 1);
    std::vector<Shard> shards;
    if (r != n - 1) shards.push_back(Shard{box, part.view()});  // last: none
    GatherOptions options;
    options.name = "model.wq";
    return GatherFull(comm, ShardedTensor(DType::kF32, shape, shards), options)
        .status();
  }));
  Box missing = *LocalBox(shape, {n}, {Placement::Shard(0)}, {n - 1});
  EXPECT_EQ(s.code(), kInvalid);
  EXPECT_THAT(Msg(s), HasSubstr("GatherFull(model.wq)"));
  EXPECT_THAT(Msg(s), HasSubstr("no rank holds " + missing.ToString()));
  EXPECT_THAT(Msg(s),
              HasSubstr(absl::StrCat("rank ", n - 1, " holds nothing")));
  EXPECT_THAT(Msg(s),
              HasSubstr(absl::StrCat("cover ", 32 - missing.num_elements(),
                                     " of 32 elements")));
}

TEST(GatherFullErrorsTest, DisagreementsNameTheRanks) {
  const Shape shape = {8, 4};
  struct Case {
    std::string name;
    std::function<absl::StatusOr<Tensor>(Communicator&, const Tensor&,
                                         const Box&)>
        call;
    absl::StatusCode code;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"dtype",
       [&](Communicator& c, const Tensor& part, const Box& box) {
         const DType dt = c.rank() == 2 ? DType::kBF16 : DType::kF32;
         // (The F32 buffer is big enough for BF16 elements.)
         return GatherFull(
             c, ShardedTensor(
                    dt, shape,
                    {Shard{box, TensorView(part.data(), dt, box.sizes)}}));
       },
       kInvalid,
       {"ranks disagree on the dtype or shape", "F32 [8, 4] on ranks 0, 1, 3",
        "BF16 [8, 4] on rank 2"}},
      {"shape",
       [&](Communicator& c, const Tensor& part, const Box& box) {
         return GatherFull(
             c, ShardedTensor(DType::kF32, c.rank() == 1 ? Shape{9, 4} : shape,
                              {Shard{box, part.view()}}));
       },
       kInvalid,
       {"F32 [9, 4] on rank 1", "F32 [8, 4] on ranks 0, 2, 3"}},
      {"to_ranks",
       [&](Communicator& c, const Tensor& part, const Box& box) {
         GatherOptions o;
         o.to_ranks = {c.rank() == 3 ? 1 : 0};
         return GatherFull(
             c, ShardedTensor(DType::kF32, shape, {Shard{box, part.view()}}),
             o);
       },
       kInvalid,
       {"ranks disagree on to_ranks", "rank 0 passes {0}",
        "rank 3 passes {1}"}},
      {"to_ranks out of range",
       [&](Communicator& c, const Tensor& part, const Box& box) {
         GatherOptions o;
         o.to_ranks = {4};
         return GatherFull(
             c, ShardedTensor(DType::kF32, shape, {Shard{box, part.view()}}),
             o);
       },
       kInvalid,
       {"failed on 4 of 4 ranks", "to_ranks holds 4, outside [0, 4)"}},
      {"box outside",
       [&](Communicator& c, const Tensor& part, const Box& box) {
         Box b = box;
         if (c.rank() == 2) b.offsets[0] = 7;
         return GatherFull(
             c, ShardedTensor(DType::kF32, shape, {Shard{b, part.view()}}));
       },
       kInvalid,
       {"failed on 1 of 4 ranks", "rank 2: INVALID_ARGUMENT", "[7:9, 0:4]"}},
      {"view shape",
       [&](Communicator& c, const Tensor& part, const Box& box) {
         TensorView v = part.view();
         if (c.rank() == 1) v = TensorView(part.data(), DType::kF32, {1, 4});
         return GatherFull(c,
                           ShardedTensor(DType::kF32, shape, {Shard{box, v}}));
       },
       kInvalid,
       {"rank 1", "view shape [1, 4] differs"}},
      {"device",
       [&](Communicator& c, const Tensor& part, const Box& box) {
         TensorView v = part.view();
         if (c.rank() == 3) {
           v = TensorView(part.data(), DType::kF32, box.sizes, Device::Cuda(1));
         }
         return GatherFull(c,
                           ShardedTensor(DType::kF32, shape, {Shard{box, v}}));
       },
       kUnimplemented,
       {"rank 3: UNIMPLEMENTED", "cuda:1"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::Status s = ExpectSameError(OnRanks(4, [&](Communicator& comm) {
      Box box = *LocalBox(shape, {4}, {Placement::Shard(0)}, {comm.rank()});
      Tensor part = MakePart(DType::kF32, shape, box, 1);
      return c.call(comm, part, box).status();
    }));
    EXPECT_EQ(s.code(), c.code) << s;
    for (const std::string& e : c.expect) EXPECT_THAT(Msg(s), HasSubstr(e));
  }
}

// ===========================================================================
// BroadcastFromRoot

// Object bytes with a NUL and a byte above 0x7f.
std::string RngBytes() { return std::string{'\0', '\x01', 's', '\xff'}; }

// A state dict with every kind of node, values tagged by `salt`, some
// tensors strided. Its tensors' memory lives in `keep`.
StateDict RichState(Keeper& keep, uint64_t salt) {
  StateDict sd;
  Tensor wq = keep.Keep(MakePart(DType::kF32, {6, 5}, Box::Full({6, 5}), salt));
  sd["model"]["wq"] = wq;
  // A column slice of a wider buffer: not contiguous.
  Tensor wide = keep.Keep(PaddedBuffer(DType::kBF16, Box::Full({4, 3}), 5));
  TensorView strided = PaddedView(wide, Box::Full({4, 3}), 5);
  FillBox(strided, {4, 3}, Box::Full({4, 3}), salt + 1);
  sd["model"]["strided"] = strided;
  // A transposed view: strides (1, 4) over a 4 x 3 buffer.
  Tensor base = keep.Keep(*Tensor::Empty(DType::kI32, {4, 3}));
  TensorView transposed(base.data(), DType::kI32, {3, 4}, {1, 3});
  FillBox(transposed, {3, 4}, Box::Full({3, 4}), salt + 2);
  sd["model"]["transposed"] = transposed;
  StateDict layers = StateDict::List();
  for (int i = 0; i < 3; ++i) {
    StateDict layer;
    Tensor b =
        keep.Keep(MakePart(DType::kU8, {7}, Box::Full({7}), salt + 10 + i));
    layer["bias"] = b;
    layer["index"] = i;
    layers.Append(layer);
  }
  layers.Append(StateDict::List());  // an empty list inside a list
  sd["model"]["layers"] = layers;
  sd["scalar_tensor"] =
      keep.Keep(MakePart(DType::kF64, {}, Box::Full({}), salt));
  sd["empty_tensor"] = keep.Keep(*Tensor::Empty(DType::kI64, {0, 4}));
  sd["empty_map"] = StateDict::Map();
  sd["rng"] = Object{RngBytes()};
  sd["no_bytes"] = Object{};
  sd["step"] = int64_t{100};
  sd["lr"] = std::nan("");
  sd["neg"] = -0.0;
  sd["flag"] = true;
  sd["name"] = "run-7";
  return sd;
}

// Every tensor of `got` has the values RichState(salt) has.
void ExpectRichValues(const StateDict& got, uint64_t salt) {
  auto view = [&](std::vector<std::string> path) -> const TensorView* {
    const StateDict* node = &got;
    for (const std::string& p : path) {
      if (node->is_list()) {
        node = node->At(std::stoul(p));
      } else {
        node = node->Find(p);
      }
      if (node == nullptr) return nullptr;
    }
    const ShardedTensor* t = node->tensor();
    if (t == nullptr || t->shards().size() != 1) return nullptr;
    return &t->shards()[0].view;
  };
  const TensorView* wq = view({"model", "wq"});
  ASSERT_NE(wq, nullptr);
  CountWrong(*wq, {6, 5}, Box::Full({6, 5}), salt);
  const TensorView* strided = view({"model", "strided"});
  ASSERT_NE(strided, nullptr);
  CountWrong(*strided, {4, 3}, Box::Full({4, 3}), salt + 1);
  const TensorView* transposed = view({"model", "transposed"});
  ASSERT_NE(transposed, nullptr);
  CountWrong(*transposed, {3, 4}, Box::Full({3, 4}), salt + 2);
  for (int i = 0; i < 3; ++i) {
    const TensorView* b = view({"model", "layers", std::to_string(i), "bias"});
    ASSERT_NE(b, nullptr);
    CountWrong(*b, {7}, Box::Full({7}), salt + 10 + i);
    EXPECT_EQ(
        *got.Find("model")->Find("layers")->At(i)->Find("index")->scalar(),
        Scalar(int64_t{i}));
  }
  const TensorView* s = view({"scalar_tensor"});
  ASSERT_NE(s, nullptr);
  CountWrong(*s, {}, Box::Full({}), salt);
  EXPECT_EQ(got.Find("rng")->object()->bytes, RngBytes());
  EXPECT_EQ(got.Find("no_bytes")->object()->bytes, "");
  EXPECT_EQ(*got.Find("step")->scalar(), Scalar(int64_t{100}));
  EXPECT_TRUE(std::isnan(std::get<double>(*got.Find("lr")->scalar())));
  EXPECT_TRUE(std::signbit(std::get<double>(*got.Find("neg")->scalar())));
  EXPECT_EQ(*got.Find("flag")->scalar(), Scalar(true));
  EXPECT_EQ(*got.Find("name")->scalar(), Scalar(std::string("run-7")));
}

class BroadcastFromRootTest : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Ranks, BroadcastFromRootTest,
                         ::testing::Values(1, 2, 3, 4));

TEST_P(BroadcastFromRootTest, EveryRankGetsTheRootsState) {
  const int n = GetParam();
  for (int root : {0, n - 1}) {
    SCOPED_TRACE("root " + std::to_string(root));
    Keeper keep;
    ExpectAllOk(OnRanks(n, [&](Communicator& comm) {
      const bool is_root = comm.rank() == root;
      // Other ranks pass something else entirely; it is ignored.
      StateDict mine;
      if (is_root) {
        mine = RichState(keep, 40);
      } else {
        mine["junk"] = int64_t{1};
      }
      BroadcastOptions options;
      options.root = root;
      options.piece_bytes = 16;  // tensors and objects in several pieces
      absl::StatusOr<StateDict> got = BroadcastFromRoot(comm, mine, options);
      if (!got.ok()) return got.status();
      ExpectRichValues(*got, 40);
      StateDict shape_only = RichState(keep, 0);
      Similarity sim = CheckSimilar(shape_only, *got);
      EXPECT_TRUE(sim.similar) << sim.first_difference;
      const TensorView& strided =
          got->Find("model")->Find("strided")->tensor()->shards()[0].view;
      const TensorView& root_strided =
          mine.Find("model") != nullptr
              ? mine.Find("model")->Find("strided")->tensor()->shards()[0].view
              : strided;
      if (is_root) {
        // The root's own views come back (no copy).
        EXPECT_EQ(strided.data(), root_strided.data());
      } else {
        EXPECT_TRUE(strided.is_contiguous());
        EXPECT_EQ(got->Find("model")->Find("layers")->At(3)->size(), 0u);
        EXPECT_TRUE(got->Find("model")->Find("layers")->At(3)->is_list());
        EXPECT_TRUE(got->Find("empty_map")->is_map());
        EXPECT_EQ(got->Find("junk"), nullptr);
      }
      return absl::OkStatus();
    }));
  }
}

// A 3 MiB tensor (strided on the root) and a contiguous one with a 256 KiB
// piece size: every BroadcastBytes stays within the piece.
TEST_P(BroadcastFromRootTest, LargeTensorsTravelInBoundedPieces) {
  const int n = GetParam();
  const Shape big = {768, 1024};  // 3 MiB of F32
  const uint64_t piece = 256 << 10;
  Tensor padded = PaddedBuffer(DType::kF32, Box::Full(big), 3);
  TensorView strided = PaddedView(padded, Box::Full(big), 3);
  FillBox(strided, big, Box::Full(big), 77);
  Tensor contiguous =
      MakePart(DType::kF32, {1000, 300}, Box::Full({1000, 300}), 78);
  ExpectAllOk(OnRanks(n, [&](Communicator& comm) {
    StateDict sd;
    if (comm.rank() == 0) {
      sd["big"] = strided;
      sd["c"] = contiguous;
    }
    CountingCommunicator counting(comm);
    BroadcastOptions options;
    options.piece_bytes = piece;
    absl::StatusOr<StateDict> got = BroadcastFromRoot(counting, sd, options);
    if (!got.ok()) return got.status();
    CountWrong(got->Find("big")->tensor()->shards()[0].view, big,
               Box::Full(big), 77);
    CountWrong(got->Find("c")->tensor()->shards()[0].view, {1000, 300},
               Box::Full({1000, 300}), 78);
    EXPECT_LE(counting.max_broadcast_bytes, piece);
    EXPECT_EQ(counting.broadcasts, 12 + 5);  // ceil(3 MiB / piece), ceil(1.14)
    return absl::OkStatus();
  }));
}

TEST(BroadcastFromRootErrorsTest, RootErrorsReachEveryRank) {
  struct Case {
    std::string name;
    std::function<StateDict(Keeper&)> state;
    absl::StatusCode code;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"sharded",
       [](Keeper& k) {
         Tensor t = k.Keep(*Tensor::Zeros(DType::kF32, {2, 4}));
         StateDict sd;
         sd["model"]["wq"] = ShardedTensor(
             DType::kF32, {4, 4}, {Shard{Box{{0, 0}, {2, 4}}, t.view()}});
         return sd;
       },
       kInvalid,
       {"BroadcastFromRoot(root 0): model.wq", "whole", "[0:2, 0:4]"}},
      {"device",
       [](Keeper& k) {
         Tensor t = k.Keep(*Tensor::Zeros(DType::kF32, {4}));
         StateDict sd;
         sd["opt"]["m"] =
             TensorView(t.data(), DType::kF32, {4}, Device::Cuda(0));
         return sd;
       },
       kUnimplemented,
       {"opt.m", "cuda:0"}},
      {"view dtype",
       [](Keeper& k) {
         Tensor t = k.Keep(*Tensor::Zeros(DType::kF32, {4}));
         StateDict sd;
         sd["w"] =
             ShardedTensor(DType::kF64, {4}, {Shard{Box::Full({4}), t.view()}});
         return sd;
       },
       kInvalid,
       {"w", "view dtype F32 differs from tensor dtype F64"}},
      {"duplicate fqn",
       [](Keeper&) {
         StateDict sd;
         sd["a.b"] = 1;
         sd["a"]["b"] = 2;
         return sd;
       },
       kInvalid,
       {"a.b"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Keeper keep;
    absl::Status s = ExpectSameError(OnRanks(3, [&](Communicator& comm) {
      StateDict sd = comm.rank() == 0 ? c.state(keep) : StateDict();
      return BroadcastFromRoot(comm, sd).status();
    }));
    EXPECT_EQ(s.code(), c.code) << s;
    for (const std::string& e : c.expect) EXPECT_THAT(Msg(s), HasSubstr(e));
  }
  absl::Status s = ExpectSameError(OnRanks(2, [&](Communicator& comm) {
    BroadcastOptions o;
    o.root = 2;
    return BroadcastFromRoot(comm, StateDict(), o).status();
  }));
  EXPECT_EQ(s.code(), kInvalid);
  EXPECT_THAT(Msg(s), HasSubstr("root 2 is outside [0, 2)"));
}

// ===========================================================================
// LocalBox / Distribute

TEST(LocalBoxTest, Table) {
  const auto S = Placement::Shard;
  const auto R = Placement::Replicate;
  struct Case {
    Shape shape;
    std::vector<int> mesh;
    std::vector<Placement> placements;
    std::vector<int> coord;
    Box expected;
  };
  const std::vector<Case> cases = {
      // Even.
      {{8, 6}, {4}, {S(0)}, {1}, Box{{2, 0}, {2, 6}}},
      {{8, 6}, {3}, {S(1)}, {2}, Box{{0, 4}, {8, 2}}},
      // 10 over 4: 3, 3, 3, 1.
      {{10}, {4}, {S(0)}, {0}, Box{{0}, {3}}},
      {{10}, {4}, {S(0)}, {2}, Box{{6}, {3}}},
      {{10}, {4}, {S(0)}, {3}, Box{{9}, {1}}},
      // 5 over 4: 2, 2, 1, 0.
      {{5}, {4}, {S(0)}, {2}, Box{{4}, {1}}},
      {{5}, {4}, {S(0)}, {3}, Box{{5}, {0}}},
      // 2 over 4: 1, 1, 0, 0.
      {{2, 3}, {4}, {S(0)}, {2}, Box{{2, 0}, {0, 3}}},
      // 2-D mesh, one tensor dim each.
      {{10, 7}, {2, 3}, {S(0), S(1)}, {1, 2}, Box{{5, 6}, {5, 1}}},
      {{10, 7}, {2, 3}, {S(1), S(0)}, {1, 2}, Box{{8, 4}, {2, 3}}},
      // Replicate.
      {{10, 7}, {2, 3}, {R(), S(0)}, {1, 1}, Box{{4, 0}, {4, 7}}},
      {{10, 7}, {2}, {R()}, {1}, Box{{0, 0}, {10, 7}}},
      // Nested on one dim: 10 -> 5, 5 -> 3, 2.
      {{10}, {2, 2}, {S(0), S(0)}, {0, 1}, Box{{3}, {2}}},
      {{10}, {2, 2}, {S(0), S(0)}, {1, 0}, Box{{5}, {3}}},
      {{10}, {2, 2}, {S(0), S(0)}, {1, 1}, Box{{8}, {2}}},
      // No mesh dims: the whole tensor; a rank-0 tensor.
      {{4}, {}, {}, {}, Box{{0}, {4}}},
      {{}, {3}, {R()}, {2}, Box{{}, {}}},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Box> got = LocalBox(c.shape, c.mesh, c.placements, c.coord);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, c.expected)
        << "shape [" << absl::StrJoin(c.shape, ",") << "] coord ["
        << absl::StrJoin(c.coord, ",") << "]: got " << got->ToString();
  }
}

// For every coordinate of several meshes, the boxes of coordinates that
// differ only along replicated mesh dims are equal, and the others tile the
// tensor: every element is in exactly one of them.
TEST(LocalBoxTest, BoxesOfAllCoordinatesTileTheTensor) {
  const auto S = Placement::Shard;
  const auto R = Placement::Replicate;
  struct Case {
    Shape shape;
    std::vector<int> mesh;
    std::vector<Placement> placements;
  };
  const std::vector<Case> cases = {
      {{10, 7}, {4}, {S(0)}},
      {{5, 3}, {4}, {S(0)}},
      {{10, 7}, {3, 2}, {S(0), S(1)}},
      {{7, 5, 3}, {2, 3, 2}, {S(2), R(), S(0)}},
      {{13}, {2, 3}, {S(0), S(0)}},
      {{11, 4}, {3, 2, 2}, {S(0), S(1), S(0)}},
      {{3, 2}, {5, 3}, {S(1), S(0)}},  // more parts than elements
      {{0, 4}, {2}, {S(0)}},
      {{6}, {2, 2}, {R(), R()}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("shape [" + absl::StrJoin(c.shape, ",") + "] mesh [" +
                 absl::StrJoin(c.mesh, ",") + "]");
    std::map<std::vector<int>, Box> by_shard_coord;
    std::vector<int> coord(c.mesh.size(), 0);
    while (true) {
      absl::StatusOr<Box> box = LocalBox(c.shape, c.mesh, c.placements, coord);
      ASSERT_TRUE(box.ok()) << box.status();
      ASSERT_TRUE(ValidateBox(*box, c.shape).ok()) << box->ToString();
      std::vector<int> key = coord;
      for (size_t i = 0; i < key.size(); ++i) {
        if (c.placements[i].kind == Placement::Kind::kReplicate) key[i] = 0;
      }
      auto [it, inserted] = by_shard_coord.emplace(key, *box);
      if (!inserted) {
        EXPECT_EQ(it->second, *box) << "replicas differ";
      }
      // Next coordinate (odometer); done when every digit wrapped.
      bool wrapped = true;
      for (size_t d = coord.size(); d-- > 0;) {
        if (++coord[d] < c.mesh[d]) {
          wrapped = false;
          break;
        }
        coord[d] = 0;
      }
      if (wrapped) break;
    }
    std::vector<int> count(NumElements(c.shape), 0);
    const std::vector<int64_t> strides = ContiguousStrides(c.shape);
    for (const auto& [key, box] : by_shard_coord) {
      if (box.empty()) continue;
      std::vector<int64_t> idx(box.rank(), 0);
      while (true) {
        int64_t flat = 0;
        for (int d = 0; d < box.rank(); ++d) {
          flat += (box.offsets[d] + idx[d]) * strides[d];
        }
        ++count[flat];
        int d = box.rank() - 1;
        for (; d >= 0; --d) {
          if (++idx[d] < box.sizes[d]) break;
          idx[d] = 0;
        }
        if (d < 0) break;
      }
    }
    for (size_t i = 0; i < count.size(); ++i) {
      EXPECT_EQ(count[i], 1) << "element " << i;
    }
  }
}

TEST(LocalBoxTest, BadArguments) {
  const auto S = Placement::Shard;
  struct Case {
    Shape shape;
    std::vector<int> mesh;
    std::vector<Placement> placements;
    std::vector<int> coord;
    std::string expect;
  };
  const int64_t big = std::numeric_limits<int64_t>::max() / 2;
  const std::vector<Case> cases = {
      {{4, -1}, {2}, {S(0)}, {0}, "negative size"},
      {{big, 3}, {2}, {S(0)}, {0}, "too large"},
      {{4}, {2, 2}, {S(0)}, {0}, "the mesh has 2 dimensions, the placements 1"},
      {{4}, {2}, {S(0)}, {0, 0}, "the coordinate 2"},
      {{4},
       {2},
       {S(0)},
       {2},
       "coordinate 2 along mesh dimension 0 is outside [0, 2)"},
      {{4}, {2}, {S(0)}, {-1}, "coordinate -1"},
      {{4}, {0}, {S(0)}, {0}, "mesh dimension 0 has size 0"},
      {{4, 4}, {2}, {S(2)}, {0}, "shards dimension 2 of a tensor with 2"},
      {{4, 4}, {2}, {S(-1)}, {0}, "shards dimension -1"},
      {{4},
       {2},
       {Placement{static_cast<Placement::Kind>(7), 0}},
       {0},
       "unknown kind"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Box> got = LocalBox(c.shape, c.mesh, c.placements, c.coord);
    EXPECT_EQ(got.status().code(), kInvalid) << c.expect;
    EXPECT_THAT(Msg(got.status()), HasSubstr(c.expect));
    EXPECT_THAT(Msg(got.status()), HasSubstr("LocalBox(shape ["));
  }
  // Huge sizes over many parts: no overflow.
  absl::StatusOr<Box> huge = LocalBox({std::numeric_limits<int64_t>::max()},
                                      {1 << 30}, {S(0)}, {(1 << 30) - 1});
  ASSERT_TRUE(huge.ok()) << huge.status();
  EXPECT_TRUE(ValidateBox(*huge, {std::numeric_limits<int64_t>::max()}).ok());
}

TEST(DistributeTest, CopiesTheLocalBoxOfAStridedView) {
  // A transposed 9 x 4 view of a 4 x 9 buffer.
  Tensor base = *Tensor::Empty(DType::kI32, {4, 9});
  TensorView full(base.data(), DType::kI32, {9, 4}, {1, 9});
  FillBox(full, {9, 4}, Box::Full({9, 4}), 11);
  absl::StatusOr<LocalShard> mine = Distribute(
      full, {2, 2}, {Placement::Shard(0), Placement::Shard(1)}, {1, 0});
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->box, (Box{{5, 0}, {4, 2}}));
  EXPECT_EQ(mine->global_shape, (Shape{9, 4}));
  EXPECT_TRUE(mine->tensor.view().is_contiguous());
  CountWrong(mine->tensor.view(), {9, 4}, mine->box, 11);
  ShardedTensor st = mine->AsShardedTensor();
  EXPECT_EQ(st.global_shape(), (Shape{9, 4}));
  ASSERT_EQ(st.shards().size(), 1u);
  EXPECT_EQ(st.shards()[0].box, mine->box);
  EXPECT_EQ(st.owner(), mine->tensor.buffer());

  absl::StatusOr<LocalShard> last =
      Distribute(full, {4}, {Placement::Shard(1)}, {3});  // 4 over 4: 1 each
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->box, (Box{{0, 3}, {9, 1}}));
  CountWrong(last->tensor.view(), {9, 4}, last->box, 11);
}

TEST(DistributeTest, Errors) {
  Tensor base = *Tensor::Zeros(DType::kF32, {4, 4});
  TensorView device(base.data(), DType::kF32, {4, 4}, Device::Cuda(2));
  absl::StatusOr<LocalShard> d =
      Distribute(device, {2}, {Placement::Shard(0)}, {0});
  EXPECT_EQ(d.status().code(), kUnimplemented);
  EXPECT_THAT(Msg(d.status()), HasSubstr("cuda:2"));
  TensorView null(nullptr, DType::kF32, {4, 4});
  EXPECT_EQ(Distribute(null, {2}, {Placement::Shard(0)}, {0}).status().code(),
            kInvalid);
  EXPECT_EQ(
      Distribute(base.view(), {2}, {Placement::Shard(3)}, {0}).status().code(),
      kInvalid);
}

// Distribute on each rank of a mesh, then GatherFull: the original back.
TEST(DistributeTest, RoundTripThroughGatherFull) {
  const Shape shape = {11, 6};
  Tensor full = MakePart(DType::kU16, shape, Box::Full(shape), 21);
  ExpectAllOk(OnRanks(4, [&](Communicator& comm) {
    const int r = comm.rank();
    // Mesh 2 x 2: dim 0 replicates, dim 1 splits rows.
    absl::StatusOr<LocalShard> mine = Distribute(
        full.view(), {2, 2}, {Placement::Replicate(), Placement::Shard(0)},
        {r / 2, r % 2});
    if (!mine.ok()) return mine.status();
    absl::StatusOr<Tensor> back = GatherFull(comm, mine->AsShardedTensor());
    if (!back.ok()) return back.status();
    EXPECT_EQ(std::memcmp(back->data(), full.data(), full.nbytes()), 0);
    return absl::OkStatus();
  }));
}

// ===========================================================================
// CheckSimilar / CopyInto

// The layout both sides start from, values tagged by `salt`.
StateDict Layout(Keeper& keep, uint64_t salt) {
  StateDict sd;
  Tensor wq =
      keep.Keep(MakePart(DType::kF32, {4, 4}, Box{{0, 0}, {2, 4}}, salt));
  sd["model"]["wq"] = ShardedTensor(DType::kF32, {4, 4},
                                    {Shard{Box{{0, 0}, {2, 4}}, wq.view()}});
  sd["model"]["norm"] =
      keep.Keep(MakePart(DType::kBF16, {8}, Box::Full({8}), salt));
  StateDict layers = StateDict::List();
  layers.Append(keep.Keep(MakePart(DType::kI8, {3}, Box::Full({3}), salt + 1)));
  layers.Append(keep.Keep(MakePart(DType::kI8, {3}, Box::Full({3}), salt + 2)));
  sd["layers"] = layers;
  sd["rng"] = Object{"rng-" + std::to_string(salt)};
  sd["step"] = static_cast<int64_t>(salt);
  return sd;
}

TEST(CheckSimilarTest, SameLayoutIsSimilarWhateverTheValues) {
  Keeper keep;
  Similarity s = CheckSimilar(Layout(keep, 1), Layout(keep, 2));
  EXPECT_TRUE(s.similar);
  EXPECT_EQ(s.first_difference, "");
  EXPECT_TRUE(CheckSimilar(StateDict(), StateDict()).similar);
}

TEST(CheckSimilarTest, EachKindOfDifferenceNamesTheFqn) {
  Keeper keep;
  struct Case {
    std::string name;
    std::function<void(StateDict&)> change;  // applied to b
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"missing key",
       [](StateDict& b) {
         StateDict model = *b.Find("model");
         StateDict fresh;
         fresh["wq"] = *model.Find("wq");
         b["model"] = fresh;
       },
       "model.norm: only in a"},
      {"extra key", [](StateDict& b) { b["model"]["zz"] = 1; },
       "model.zz: only in b"},
      {"extra list element",
       [&](StateDict& b) {
         b["layers"].Append(keep.Keep(*Tensor::Zeros(DType::kI8, {3})));
       },
       "layers.2: only in b"},
      {"kind", [](StateDict& b) { b["model"]["norm"] = Object{"x"}; },
       "model.norm: tensor vs object"},
      {"map vs list", [](StateDict& b) { b["layers"] = StateDict::Map(); },
       "layers: list vs map"},
      {"dtype",
       [&](StateDict& b) {
         b["model"]["norm"] = keep.Keep(*Tensor::Zeros(DType::kF32, {8}));
       },
       "model.norm: dtype BF16 vs F32"},
      {"shape",
       [&](StateDict& b) {
         *b["layers"].At(1) = keep.Keep(*Tensor::Zeros(DType::kI8, {4}));
       },
       "layers.1: shape [3] vs [4]"},
      {"box",
       [&](StateDict& b) {
         Tensor t = keep.Keep(*Tensor::Zeros(DType::kF32, {2, 4}));
         b["model"]["wq"] = ShardedTensor(
             DType::kF32, {4, 4}, {Shard{Box{{2, 0}, {2, 4}}, t.view()}});
       },
       "model.wq: shard 0 box [0:2, 0:4] vs [2:4, 0:4]"},
      {"shard count",
       [&](StateDict& b) {
         b["model"]["wq"] = ShardedTensor(DType::kF32, {4, 4}, {});
       },
       "model.wq: 1 vs 0 shards"},
      {"scalar type", [](StateDict& b) { b["step"] = 1.5; },
       "step: scalar type int vs double"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    StateDict a = Layout(keep, 1);
    StateDict b = Layout(keep, 1);
    c.change(b);
    Similarity s = CheckSimilar(a, b);
    EXPECT_FALSE(s.similar);
    EXPECT_EQ(s.first_difference, c.expect);
  }
}

TEST(CopyIntoTest, CopiesValuesObjectsAndScalars) {
  Keeper keep;
  StateDict src = Layout(keep, 5);
  StateDict dst = Layout(keep, 6);
  // A strided destination view for model.norm.
  Tensor padded = keep.Keep(*Tensor::Zeros(DType::kBF16, {8, 2}));
  dst["model"]["norm"] = TensorView(padded.data(), DType::kBF16, {8}, {2});
  ASSERT_TRUE(CopyInto(src, dst).ok());
  const auto view = [](const StateDict& sd) -> const TensorView& {
    return sd.Find("model")->Find("wq")->tensor()->shards()[0].view;
  };
  CountWrong(view(dst), {4, 4}, Box{{0, 0}, {2, 4}}, 5);
  CountWrong(dst.Find("model")->Find("norm")->tensor()->shards()[0].view, {8},
             Box::Full({8}), 5);
  CountWrong(dst.Find("layers")->At(1)->tensor()->shards()[0].view, {3},
             Box::Full({3}), 7);
  EXPECT_EQ(dst.Find("rng")->object()->bytes, "rng-5");
  EXPECT_EQ(*dst.Find("step")->scalar(), Scalar(int64_t{5}));
  // The destination's views are written in place, not replaced.
  EXPECT_NE(view(dst).data(), view(src).data());
  // Copying a state dict onto itself is a no-op.
  EXPECT_TRUE(CopyInto(src, src).ok());
  CountWrong(view(src), {4, 4}, Box{{0, 0}, {2, 4}}, 5);
}

TEST(CopyIntoTest, DifferencesAreErrorsAndLeaveTheDestinationAlone) {
  Keeper keep;
  StateDict src = Layout(keep, 5);
  {
    StateDict dst = Layout(keep, 6);
    dst["model"]["extra"] = 1;
    absl::Status s = CopyInto(src, dst);
    EXPECT_EQ(s.code(), kInvalid);
    EXPECT_EQ(Msg(s), "CopyInto: model.extra: only in the destination");
    CountWrong(dst.Find("model")->Find("wq")->tensor()->shards()[0].view,
               {4, 4}, Box{{0, 0}, {2, 4}}, 6);
    EXPECT_EQ(*dst.Find("step")->scalar(), Scalar(int64_t{6}));
  }
  {
    StateDict dst = Layout(keep, 6);
    dst["model"]["norm"] = keep.Keep(*Tensor::Zeros(DType::kBF16, {9}));
    absl::Status s = CopyInto(src, dst);
    EXPECT_EQ(s.code(), kInvalid);
    EXPECT_EQ(Msg(s), "CopyInto: model.norm: shape [8] vs [9]");
  }
  {
    StateDict dst = Layout(keep, 6);
    StateDict shorter = StateDict::List();
    shorter.Append(*dst.Find("layers")->At(0));
    dst["layers"] = shorter;
    EXPECT_EQ(Msg(CopyInto(src, dst)),
              "CopyInto: layers.1: only in the source");
  }
  {
    // Checked before anything is written: the last leaf's bad view stops
    // the copy of the earlier ones.
    StateDict dst = Layout(keep, 6);
    Tensor t = keep.Keep(*Tensor::Zeros(DType::kF32, {2, 4}));
    dst["model"]["wq"] = ShardedTensor(
        DType::kF32, {4, 4},
        {Shard{Box{{0, 0}, {2, 4}},
               TensorView(t.data(), DType::kF32, {2, 4}, Device::Cuda(0))}});
    absl::Status s = CopyInto(src, dst);
    EXPECT_EQ(s.code(), kUnimplemented);
    EXPECT_THAT(Msg(s), HasSubstr("model.wq shard [0:2, 0:4] (destination)"));
    EXPECT_EQ(dst.Find("rng")->object()->bytes, "rng-6");
    CountWrong(dst.Find("layers")->At(0)->tensor()->shards()[0].view, {3},
               Box::Full({3}), 7);
  }
}

// ===========================================================================
// OffloadToHost

TEST(OffloadToHostTest, HostViewsAreKeptOrCopied) {
  Keeper keep;
  StateDict sd = Layout(keep, 3);
  const void* original =
      sd.Find("model")->Find("wq")->tensor()->shards()[0].view.data();
  absl::StatusOr<StateDict> same = OffloadToHost(sd);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(CheckSimilar(sd, *same).similar);
  EXPECT_EQ(same->Find("model")->Find("wq")->tensor()->shards()[0].view.data(),
            original);
  EXPECT_EQ(same->Find("rng")->object()->bytes, "rng-3");

  // A strided host view, copied into contiguous memory that outlives it.
  StateDict strided;
  absl::StatusOr<StateDict> copied;
  {
    Tensor padded = PaddedBuffer(DType::kF64, Box::Full({3, 4}), 2);
    TensorView v = PaddedView(padded, Box::Full({3, 4}), 2);
    FillBox(v, {3, 4}, Box::Full({3, 4}), 8);
    strided["m"]["v"] = v;
    strided["step"] = 9;
    copied = OffloadToHost(strided, /*copy_host=*/true);
    ASSERT_TRUE(copied.ok()) << copied.status();
    EXPECT_NE(copied->Find("m")->Find("v")->tensor()->shards()[0].view.data(),
              padded.data());
  }  // `padded` is freed here; the copy must not depend on it.
  const ShardedTensor& t = *copied->Find("m")->Find("v")->tensor();
  EXPECT_TRUE(t.shards()[0].view.is_contiguous());
  EXPECT_NE(t.owner(), nullptr);
  CountWrong(t.shards()[0].view, {3, 4}, Box::Full({3, 4}), 8);
  EXPECT_EQ(*copied->Find("step")->scalar(), Scalar(int64_t{9}));
}

TEST(OffloadToHostTest, DeviceShardsAreCopiedThroughTheRuntime) {
  // Host memory registered as cuda:1 with the fake runtime: the copy goes
  // through it (the fake lands copies only at Synchronize).
  internal_cuda::FakeDeviceRuntime runtime(/*num_devices=*/2);
  internal_cuda::ScopedRuntimeForTesting scope(&runtime);
  std::vector<float> device = {1, 2, 3, 4, 5, 6};
  runtime.AddDeviceMemory(1, device.data(), device.size() * sizeof(float));
  StateDict sd;
  sd["opt"]["state"]["m"] =
      TensorView(device.data(), DType::kF32, {2, 3}, Device::Cuda(1));
  sd["step"] = int64_t{3};
  for (bool copy : {false, true}) {
    absl::StatusOr<StateDict> got = OffloadToHost(sd, copy);
    ASSERT_TRUE(got.ok()) << got.status();
    const StateDict* m = got->Find("opt")->Find("state")->Find("m");
    ASSERT_NE(m, nullptr);
    const TensorView& v = m->tensor()->shards()[0].view;
    EXPECT_TRUE(v.device().is_cpu());
    EXPECT_NE(v.data(), device.data());
    const float* f = static_cast<const float*>(v.data());
    EXPECT_EQ(std::vector<float>(f, f + 6), device);
    EXPECT_EQ(*got->Find("step")->scalar(), Scalar(int64_t{3}));
  }
  EXPECT_EQ(runtime.copies(), 2);
  EXPECT_EQ(runtime.pending(), 0);
}

TEST(OffloadToHostTest, DeviceShardsWithoutAUsableDeviceNameTheTensor) {
  // A device the fake runtime does not have.
  internal_cuda::FakeDeviceRuntime runtime(/*num_devices=*/1);
  internal_cuda::ScopedRuntimeForTesting scope(&runtime);
  Tensor t = *Tensor::Zeros(DType::kF32, {4});
  StateDict sd;
  sd["opt"]["state"]["m"] =
      TensorView(t.data(), DType::kF32, {4}, Device::Cuda(1));
  for (bool copy : {false, true}) {
    absl::StatusOr<StateDict> got = OffloadToHost(sd, copy);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(Msg(got.status()), HasSubstr("opt.state.m"));
    EXPECT_THAT(Msg(got.status()), HasSubstr("cuda:1"));
  }
}

}  // namespace
}  // namespace cairn
