// Chunks read once per node (load_node.cc): ranks of one host that need
// strided parts of the same stored chunk (a column reshard) read it once,
// whole and checked, and hand each other the parts.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/planner.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"
#include "checkpoint/load_internal.h"
#include "checkpoint/test_util.h"
#include "cuda/fake_device_runtime.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using testing::HasSubstr;
using testing_util::TempDir;

// The default planner, recording the items it commits.
class RecordingPlanner : public DefaultLoadPlanner {
 public:
  absl::Status CommitChunk(const ReadItem& item) override {
    committed.push_back(item);
    return DefaultLoadPlanner::CommitChunk(item);
  }
  std::vector<ReadItem> committed;
};

// Six [240, 96] F32 tensors (90 KiB each) saved by 4 ranks in row
// quarters, values 0, 1, 2, ... from one counter; and the step.
class NodeReadTest : public testing::Test {
 protected:
  static constexpr int kTensors = 6;
  static constexpr int kSavers = 4;
  static constexpr int64_t kRows = 240, kCols = 96;
  static constexpr uint64_t kStateBytes = kTensors * kRows * kCols * 4;

  void SetUp() override {
    float next = 0;
    for (int t = 0; t < kTensors; ++t) {
      std::vector<float>& v = src_[Name(t)];
      v.resize(kRows * kCols);
      for (float& x : v) x = next++;
    }
    std::vector<absl::Status> saved =
        RunInProcess(kSavers, [&](Communicator& comm) {
          StateDict sd;
          const int64_t r0 = comm.rank() * kRows / kSavers;
          for (auto& [name, v] : src_) {
            sd[name] = ShardedTensor(
                DType::kF32, {kRows, kCols},
                {{Box{{r0, 0}, {kRows / kSavers, kCols}},
                  TensorView(v.data() + r0 * kCols, DType::kF32,
                             {kRows / kSavers, kCols})}});
          }
          sd["step"] = int64_t{7};
          SaveOptions o;
          o.comm = &comm;
          return Save(sd, tmp_.path(), o).status();
        });
    for (const absl::Status& s : saved) ASSERT_TRUE(s.ok()) << s;
  }
  static std::string Name(int t) { return absl::StrCat("t", t); }

  // Columns [c0, c0 + n) of every tensor, in host memory (or in the fake
  // device's when `device` is set), filled with -1.
  struct Rank {
    std::vector<std::vector<float>> mem;
    StateDict sd;
    absl::StatusOr<LoadResult> result = absl::UnknownError("not run");
    std::vector<ReadItem> committed;
    Box box;
  };
  void MakeDestination(Rank& rank, const Box& box, bool device,
                       internal_cuda::FakeDeviceRuntime* runtime) {
    rank.box = box;
    rank.mem.assign(kTensors, std::vector<float>(box.num_elements(), -1.0f));
    for (int t = 0; t < kTensors; ++t) {
      float* data = rank.mem[t].data();
      if (device) {
        runtime->AddDeviceMemory(0, data, rank.mem[t].size() * sizeof(float));
      }
      rank.sd[Name(t)] = ShardedTensor(
          DType::kF32, {kRows, kCols},
          {{box, TensorView(data, DType::kF32, box.sizes,
                            device ? Device::Cuda(0) : Device::Cpu())}});
    }
    rank.sd["step"] = int64_t{0};
  }

  // LoadOptions with node reads on.
  static LoadOptions Shared() {
    LoadOptions o;
    o.share_node_reads = true;
    return o;
  }

  // Loads boxes[r] on rank r, each with options[r % options.size()].
  std::vector<Rank> LoadBoxes(const std::vector<Box>& boxes,
                              const std::vector<LoadOptions>& options,
                              internal_cuda::FakeDeviceRuntime* runtime =
                                  nullptr) {
    const int world = static_cast<int>(boxes.size());
    std::vector<Rank> ranks(world);
    for (int r = 0; r < world; ++r) {
      MakeDestination(ranks[r], boxes[r], runtime != nullptr, runtime);
    }
    RunInProcess(world, [&](Communicator& comm) -> absl::Status {
      Rank& rank = ranks[comm.rank()];
      RecordingPlanner planner;
      LoadOptions o = options[comm.rank() % options.size()];
      o.comm = &comm;
      o.planner = &planner;
      rank.result = Load(rank.sd, tmp_.path(), o);
      rank.committed = planner.committed;
      return rank.result.status();
    });
    return ranks;
  }

  // Every element of every rank's box is the saved value.
  void ExpectLoaded(const std::vector<Rank>& ranks) {
    for (size_t r = 0; r < ranks.size(); ++r) {
      ASSERT_TRUE(ranks[r].result.ok()) << "rank " << r << ": "
                                        << ranks[r].result.status();
      const Box& b = ranks[r].box;
      for (int t = 0; t < kTensors; ++t) {
        const std::vector<float>& want = src_.at(Name(t));
        for (int64_t i = 0; i < b.sizes[0]; ++i) {
          for (int64_t j = 0; j < b.sizes[1]; ++j) {
            ASSERT_EQ(ranks[r].mem[t][i * b.sizes[1] + j],
                      want[(b.offsets[0] + i) * kCols + b.offsets[1] + j])
                << "rank " << r << " " << Name(t) << " " << i << "," << j;
          }
        }
      }
      EXPECT_EQ(std::get<int64_t>(*ranks[r].sd.Find("step")->scalar()), 7);
      EXPECT_EQ(ranks[r].result->bytes_unverified, 0u);
    }
  }

  static uint64_t BytesRead(const std::vector<Rank>& ranks) {
    uint64_t n = 0;
    for (const Rank& r : ranks) n += r.result.ok() ? r.result->bytes_read : 0;
    return n;
  }
  static uint64_t Verified(const std::vector<Rank>& ranks) {
    uint64_t n = 0;
    for (const Rank& r : ranks) n += r.result.ok() ? r.result->chunks_verified : 0;
    return n;
  }

  static std::vector<Box> Columns(int parts) {
    std::vector<Box> boxes;
    for (int k = 0; k < parts; ++k) {
      const int64_t c0 = kCols * k / parts, c1 = kCols * (k + 1) / parts;
      boxes.push_back(Box{{0, c0}, {kRows, c1 - c0}});
    }
    return boxes;
  }

  TempDir tmp_;
  std::map<std::string, std::vector<float>> src_;
};

// Column halves and uneven thirds: every chunk is read once (the ranks are
// threads of one host), checked whole by the rank that read it, and every
// item commits; each rank reading its own parts reads each chunk's span
// once per rank.
TEST_F(NodeReadTest, ColumnReshardReadsEachChunkOncePerNode) {
  for (int world : {2, 3}) {
    SCOPED_TRACE(absl::StrCat(world, " ranks"));
    LoadOptions shared = Shared();
    std::vector<Rank> once = LoadBoxes(Columns(world), {shared});
    ExpectLoaded(once);
    // Tensor bytes once, and the step's scalar (in metadata.json).
    EXPECT_EQ(BytesRead(once), kStateBytes);
    EXPECT_EQ(Verified(once), uint64_t{kTensors * kSavers});
    for (const Rank& r : once) {
      // One item per stored chunk, all committed.
      EXPECT_EQ(r.committed.size(), static_cast<size_t>(kTensors * kSavers));
      EXPECT_GT(r.result->phases.broadcast, 0.0);
    }
    LoadOptions own;  // the default: each rank its own parts
    std::vector<Rank> each = LoadBoxes(Columns(world), {own});
    ExpectLoaded(each);
    EXPECT_GT(BytesRead(each), (world - 1) * kStateBytes);
    for (const Rank& r : each) EXPECT_EQ(r.result->phases.broadcast, 0.0);
  }
}

// Two simulated nodes of two ranks each, column quarters: each node reads
// every chunk once, so storage serves two copies.
TEST_F(NodeReadTest, EachNodeReadsItsOwnCopy) {
  internal_checkpoint::SetNodeNameForTesting(
      [](int rank) { return std::string(rank < 2 ? "node-a" : "node-b"); });
  struct Restore {
    ~Restore() { internal_checkpoint::SetNodeNameForTesting(nullptr); }
  } restore;
  std::vector<Rank> ranks = LoadBoxes(Columns(4), {Shared()});
  ExpectLoaded(ranks);
  EXPECT_EQ(BytesRead(ranks), 2 * kStateBytes);
  EXPECT_EQ(ranks[0].result->bytes_read + ranks[1].result->bytes_read,
            kStateBytes);
}

// A changed bit in one chunk: its owner's CRC32C check fails, every rank
// fails naming the chunk and its file, and no rank commits an item of that
// chunk. (Items of chunks before it may commit: they were checked.)
TEST_F(NodeReadTest, ADamagedChunkFailsEveryRankAndCommitsNothingOfIt) {
  absl::StatusOr<Metadata> md = ReadMetadata(tmp_.path());
  ASSERT_TRUE(md.ok()) << md.status();
  const ChunkMetadata& chunk = md->tensors.at("t2").chunks.at(1);
  const std::string path = tmp_.path() + "/" + chunk.location.file;
  const uint64_t at = chunk.location.offset + (10 * kCols + 70) * 4 + 1;
  ASSERT_TRUE(testing_util::FlipBits(path, at, 0x04).ok());
  std::vector<Rank> ranks = LoadBoxes(Columns(2), {Shared()});
  for (const Rank& r : ranks) {
    EXPECT_EQ(r.result.status().code(), absl::StatusCode::kDataLoss)
        << r.result.status();
    EXPECT_THAT(std::string(r.result.status().message()),
                HasSubstr("t2@60,0"));
    EXPECT_THAT(std::string(r.result.status().message()),
                HasSubstr(chunk.location.file));
    for (const ReadItem& item : r.committed) {
      EXPECT_FALSE(item.fqn == "t2" && item.chunk == 1)
          << "committed a part of the damaged chunk";
    }
  }
}

// Ranks with different budgets agree on the smallest wave; a budget too
// small for any chunk leaves every rank reading its own parts; both load
// bit-exact.
TEST_F(NodeReadTest, WavesFollowTheSmallestBudget) {
  LoadOptions roomy = Shared();
  roomy.io_threads = 1;
  roomy.bounce_buffer_bytes = 16 << 10;
  LoadOptions tight = roomy;
  // 16 KiB of bounce buffer, then 2 x 40 KiB: two 22.5 KiB chunks a wave.
  tight.memory_budget_bytes = (16 << 10) + 2 * (40 << 10);
  std::vector<Rank> waves = LoadBoxes(Columns(2), {roomy, tight});
  ExpectLoaded(waves);
  EXPECT_EQ(BytesRead(waves), kStateBytes);
  LoadOptions tiny = roomy;
  tiny.memory_budget_bytes = (16 << 10) + 2 * (8 << 10);  // no chunk fits
  std::vector<Rank> own = LoadBoxes(Columns(2), {roomy, tiny});
  ExpectLoaded(own);
  EXPECT_GT(BytesRead(own), kStateBytes);
}

// Only one rank needs strided parts (the other loads whole rows): nothing
// is shared, and both load bit-exact.
TEST_F(NodeReadTest, OneRankWithColumnsReadsAlone) {
  std::vector<Rank> ranks = LoadBoxes(
      {Box{{0, 0}, {kRows, kCols / 2}}, Box{{0, 0}, {kRows, kCols}}},
      {Shared()});
  ExpectLoaded(ranks);
  for (const Rank& r : ranks) EXPECT_EQ(r.result->phases.broadcast, 0.0);
}

// Device destinations (the fake runtime: copies land at Synchronize, from
// host memory that must still hold the bytes then): parts handed out land
// on the device bit-exact.
TEST_F(NodeReadTest, PartsLandOnDevices) {
  internal_cuda::FakeDeviceRuntime runtime(1);
  internal_cuda::ScopedRuntimeForTesting scope(&runtime);
  std::vector<Rank> ranks = LoadBoxes(Columns(2), {Shared()}, &runtime);
  ExpectLoaded(ranks);
  EXPECT_EQ(BytesRead(ranks), kStateBytes);
  EXPECT_EQ(runtime.pending(), 0);
  for (const Rank& r : ranks) {
    EXPECT_EQ(r.result->device_bytes, r.result->bytes_loaded);
  }
}

}  // namespace
}  // namespace cairn
