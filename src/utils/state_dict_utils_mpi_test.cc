// GatherFull and BroadcastFromRoot over 4 MPI processes (mpiexec -n 4):
// the same code paths as the in-process tests, over a real transport.
#include <mpi.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cairn/communicator.h"
#include "cairn/state_dict_utils.h"
#include "comm/mpi/mpi_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
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

Communicator* g_world = nullptr;

// Uneven 2-D blocks (a 2 x 2 mesh over 7 x 5), strided on odd ranks, to all
// ranks and then to rank 2 alone, in small pieces.
TEST(UtilsMpiTest, GatherFull) {
  Communicator& comm = *g_world;
  ASSERT_EQ(comm.size(), 4);
  const int r = comm.rank();
  const Shape shape = {7, 5};
  Box box = *LocalBox(shape, {2, 2}, {Placement::Shard(0), Placement::Shard(1)},
                      {r / 2, r % 2});
  Tensor buf = PaddedBuffer(DType::kF32, box, r % 2);
  TensorView view = PaddedView(buf, box, r % 2);
  FillBox(view, shape, box, 31);
  ShardedTensor t(DType::kF32, shape, {Shard{box, view}});

  GatherOptions options;
  options.piece_bytes = 24;
  absl::StatusOr<Tensor> all = GatherFull(comm, t, options);
  ASSERT_TRUE(all.ok()) << all.status();
  CountWrong(all->view(), shape, Box::Full(shape), 31);

  CountingCommunicator counting(comm);
  options.to_ranks = {2};
  absl::StatusOr<Tensor> one = GatherFull(counting, t, options);
  ASSERT_TRUE(one.ok()) << one.status();
  if (r == 2) {
    CountWrong(one->view(), shape, Box::Full(shape), 31);
  } else {
    EXPECT_EQ(one->data(), nullptr);
  }
  EXPECT_EQ(counting.broadcasts, 0);
  EXPECT_LE(counting.max_gather_bytes, 24u);
}

// A gap (rank 3 holds nothing) is the same error on every process.
TEST(UtilsMpiTest, GatherFullGapIsTheSameErrorEverywhere) {
  Communicator& comm = *g_world;
  const Shape shape = {8, 2};
  Box box = *LocalBox(shape, {4}, {Placement::Shard(0)}, {comm.rank()});
  Tensor part = MakePart(DType::kI32, shape, box, 1);
  std::vector<Shard> shards;
  if (comm.rank() != 3) shards.push_back(Shard{box, part.view()});
  GatherOptions options;
  options.name = "w";
  absl::Status s =
      GatherFull(comm, ShardedTensor(DType::kI32, shape, shards), options)
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("no rank holds [6:8, 0:2]"));
  // Every process got the same message.
  std::string mine(s.message());
  absl::StatusOr<std::vector<std::string>> all = comm.AllGather(mine);
  ASSERT_TRUE(all.ok());
  for (const std::string& m : *all) EXPECT_EQ(m, mine);
}

// Nested state from rank 1 (the root), with a strided tensor, an object and
// scalars; the tensor is split into pieces.
TEST(UtilsMpiTest, BroadcastFromRoot) {
  Communicator& comm = *g_world;
  const Shape shape = {300, 200};
  Tensor padded = PaddedBuffer(DType::kF64, Box::Full(shape), 7);
  StateDict sd;
  if (comm.rank() == 1) {
    TensorView v = PaddedView(padded, Box::Full(shape), 7);
    FillBox(v, shape, Box::Full(shape), 5);
    sd["model"]["w"] = v;
    StateDict list = StateDict::List();
    list.Append(Object{"opaque"});
    list.Append(2.5);
    sd["extra"] = list;
    sd["step"] = 12;
  }
  CountingCommunicator counting(comm);
  BroadcastOptions options;
  options.root = 1;
  options.piece_bytes = 64 << 10;
  absl::StatusOr<StateDict> got = BroadcastFromRoot(counting, sd, options);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_NE(got->Find("model"), nullptr);
  CountWrong(got->Find("model")->Find("w")->tensor()->shards()[0].view, shape,
             Box::Full(shape), 5);
  EXPECT_EQ(got->Find("extra")->At(0)->object()->bytes, "opaque");
  EXPECT_EQ(*got->Find("extra")->At(1)->scalar(), Scalar(2.5));
  EXPECT_EQ(*got->Find("step")->scalar(), Scalar(int64_t{12}));
  EXPECT_LE(counting.max_broadcast_bytes, size_t{64} << 10);
  EXPECT_EQ(counting.broadcasts, 8 + 1);  // 480,000 bytes; the object
}

}  // namespace
}  // namespace cairn

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  absl::StatusOr<std::unique_ptr<cairn::Communicator>> world =
      cairn::MpiWorldCommunicator();
  if (!world.ok()) {
    std::fprintf(stderr, "MpiWorldCommunicator: %s\n",
                 world.status().ToString().c_str());
    return 1;
  }
  cairn::g_world = world->get();
  const int failed = cairn::internal_comm::RunMpiTests();
  // Freed before the MPI_Finalize that cairn runs at exit.
  world->reset();
  return failed;
}
