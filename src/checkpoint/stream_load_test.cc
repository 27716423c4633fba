// Streaming loads: waves bounded by LoadOptions::memory_budget_bytes,
// destinations resolved a wave at a time, and sinks that receive only
// checked bytes (load_staged.cc).
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/planner.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"
#include "checkpoint/test_util.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cairn {
namespace {

using testing::HasSubstr;
using testing_util::TempDir;

// Rebuilds each tensor from the pieces it is given, and logs events.
class CollectingSink : public LoadSink {
 public:
  CollectingSink(std::vector<std::string>& log, const Metadata& md)
      : log_(log), md_(md) {}
  absl::Status Write(const ReadItem& item, const Box& box,
                     std::span<const std::byte> bytes) override {
    if (!fail_on.empty() && item.fqn == fail_on) {
      return absl::UnavailableError("the store is full");
    }
    const TensorMetadata& tm = md_.tensors.at(item.fqn);
    const size_t es = DTypeSize(tm.dtype);
    std::vector<std::byte>& full = values[item.fqn];
    full.resize(static_cast<size_t>(NumElements(tm.shape)) * es);
    EXPECT_EQ(bytes.size(), static_cast<size_t>(box.num_elements()) * es);
    // Row-major box of a row-major tensor (2-d or 1-d here).
    const int64_t cols = tm.shape.size() == 2 ? tm.shape[1] : 1;
    const int64_t bcols = box.rank() == 2 ? box.sizes[1] : 1;
    const int64_t c0 = box.rank() == 2 ? box.offsets[1] : 0;
    for (int64_t r = 0; r < box.sizes[0]; ++r) {
      const int64_t at = ((box.offsets[0] + r) * cols + c0) * es;
      std::memcpy(full.data() + at, bytes.data() + r * bcols * es, bcols * es);
      if (expect != nullptr &&
          std::memcmp(expect->at(item.fqn).data() + at / 4,
                      bytes.data() + r * bcols * es, bcols * es) != 0) {
        ++wrong;
      }
    }
    largest = std::max<uint64_t>(largest, bytes.size());
    log_.push_back(absl::StrCat("write ", item.fqn, "/", item.chunk));
    return absl::OkStatus();
  }
  absl::Status Complete(const std::string& fqn) override {
    log_.push_back(absl::StrCat("complete ", fqn));
    return absl::OkStatus();
  }
  std::map<std::string, std::vector<std::byte>> values;
  uint64_t largest = 0;
  std::string fail_on;
  // When set, the values expected (F32): Write counts rows that differ.
  const std::map<std::string, std::vector<float>>* expect = nullptr;
  int wrong = 0;

 private:
  std::vector<std::string>& log_;
  const Metadata& md_;
};

// The default planner, giving every tensor item `sink` instead of memory,
// logging ResolveDestination and CommitChunk.
class SinkPlanner : public DefaultLoadPlanner {
 public:
  SinkPlanner(std::vector<std::string>& log, std::shared_ptr<LoadSink> sink)
      : log_(log), sink_(std::move(sink)) {}
  absl::StatusOr<Destination> ResolveDestination(const ReadItem& item) override {
    log_.push_back(absl::StrCat("resolve ", item.fqn));
    CAIRN_ASSIGN_OR_RETURN(Destination d,
                           DefaultLoadPlanner::ResolveDestination(item));
    if (item.kind == ItemKind::kTensor) d = Destination{{}, nullptr, sink_};
    return d;
  }
  absl::Status CommitChunk(const ReadItem& item) override {
    log_.push_back(absl::StrCat("commit ", item.fqn, "/", item.chunk));
    return DefaultLoadPlanner::CommitChunk(item);
  }

 private:
  std::vector<std::string>& log_;
  std::shared_ptr<LoadSink> sink_;
};

// Eight [256, 64] F32 tensors (64 KiB each), each saved in two row chunks,
// values 0, 1, 2, ... from one counter.
class StreamLoadTest : public testing::Test {
 protected:
  static constexpr int kTensors = 8;
  static constexpr int64_t kRows = 256, kCols = 64;
  void SetUp() override {
    float next = 0;
    for (int t = 0; t < kTensors; ++t) {
      std::vector<float>& v = src_[Name(t)];
      v.resize(kRows * kCols);
      for (float& x : v) x = next++;
    }
    // Two ranks, each holding half the rows of every tensor.
    std::vector<absl::Status> saved = RunInProcess(2, [&](Communicator& comm) {
      StateDict sd;
      const int64_t r0 = comm.rank() * kRows / 2;
      for (auto& [name, v] : src_) {
        sd[name] = ShardedTensor(
            DType::kF32, {kRows, kCols},
            {{Box{{r0, 0}, {kRows / 2, kCols}},
              TensorView(v.data() + r0 * kCols, DType::kF32,
                         {kRows / 2, kCols})}});
      }
      sd["step"] = int64_t{7};
      SaveOptions o;
      o.comm = &comm;
      return Save(sd, tmp_.path(), o).status();
    });
    for (const absl::Status& s : saved) ASSERT_TRUE(s.ok()) << s;
    absl::StatusOr<Metadata> md = ReadMetadata(tmp_.path());
    ASSERT_TRUE(md.ok()) << md.status();
    md_ = *std::move(md);
  }
  static std::string Name(int t) { return absl::StrCat("t", t); }

  // A destination state dict of `box` of every tensor (memory the sink
  // planner never uses), and the step.
  StateDict Destinations(const Box& box, std::vector<std::vector<float>>& mem) {
    StateDict sd;
    mem.assign(kTensors, std::vector<float>(box.num_elements(), -1.0f));
    for (int t = 0; t < kTensors; ++t) {
      sd[Name(t)] = ShardedTensor(
          DType::kF32, {kRows, kCols},
          {{box, TensorView(mem[t].data(), DType::kF32, box.sizes)}});
    }
    sd["step"] = int64_t{0};
    return sd;
  }

  // Expects the sink to hold `box` of every tensor exactly.
  void ExpectBox(const CollectingSink& sink, const Box& box) {
    for (int t = 0; t < kTensors; ++t) {
      const std::vector<float>& want = src_.at(Name(t));
      ASSERT_TRUE(sink.values.contains(Name(t))) << Name(t);
      const auto* got =
          reinterpret_cast<const float*>(sink.values.at(Name(t)).data());
      for (int64_t r = box.offsets[0]; r < box.offsets[0] + box.sizes[0]; ++r) {
        for (int64_t c = box.offsets[1]; c < box.offsets[1] + box.sizes[1];
             ++c) {
          ASSERT_EQ(got[r * kCols + c], want[r * kCols + c])
              << Name(t) << " " << r << "," << c;
        }
      }
    }
  }

  TempDir tmp_;
  std::map<std::string, std::vector<float>> src_;
  Metadata md_;
};

// With a budget that leaves 16 KiB of staging a wave (after two 16 KiB
// bounce buffers), a load into sinks runs in many waves: destinations are
// resolved a wave at a time (later items after earlier ones were written),
// no piece is larger than a wave (the 32 KiB chunks arrive in pieces), every byte arrives, each item commits
// after all its pieces, and each tensor completes once, after its last
// commit. Objects and scalars load as usual.
TEST_F(StreamLoadTest, SinksGetEveryByteInWavesWithinTheBudget) {
  std::vector<std::string> log;
  auto sink = std::make_shared<CollectingSink>(log, md_);
  SinkPlanner planner(log, sink);
  std::vector<std::vector<float>> mem;
  StateDict dst = Destinations(Box{{0, 0}, {kRows, kCols}}, mem);
  LoadOptions o;
  o.planner = &planner;
  o.io_threads = 2;
  o.bounce_buffer_bytes = 16 << 10;
  o.memory_budget_bytes = 2 * (16 << 10) + 2 * (16 << 10);
  absl::StatusOr<LoadResult> r = Load(dst, tmp_.path(), o);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectBox(*sink, Box{{0, 0}, {kRows, kCols}});
  EXPECT_LE(sink->largest, uint64_t{16} << 10);
  EXPECT_EQ(std::get<int64_t>(*dst["step"].scalar()), 7);
  EXPECT_EQ(r->bytes_unverified, 0u);
  for (const auto& m : mem) {
    EXPECT_TRUE(std::all_of(m.begin(), m.end(), [](float x) { return x == -1; }))
        << "the planner's memory was written";
  }
  // Lazy: the last tensor's items resolve after the first tensor's bytes
  // were written.
  auto first = [&](const std::string& e) {
    return std::find(log.begin(), log.end(), e) - log.begin();
  };
  auto last = [&](const std::string& e) {
    return log.rend() - std::find(log.rbegin(), log.rend(), e) - 1;
  };
  EXPECT_LT(first("write t0/0"),
            first(absl::StrCat("resolve ", Name(kTensors - 1))));
  for (int t = 0; t < kTensors; ++t) {
    const std::string n = Name(t);
    for (const std::string& item : {n + "/0", n + "/1"}) {
      EXPECT_GE(std::count(log.begin(), log.end(), "write " + item), 2)
          << item << " in pieces";
      EXPECT_LT(last("write " + item), first("commit " + item)) << item;
      EXPECT_EQ(std::count(log.begin(), log.end(), "commit " + item), 1)
          << item;
      EXPECT_LT(last("commit " + item), first("complete " + n)) << item;
    }
    EXPECT_EQ(std::count(log.begin(), log.end(), "complete " + n), 1) << n;
  }
}

// Sinks on a column reshard of 2 ranks and on a row slice: the pieces are
// parts of chunks, which the sinks get only after the checksum blocks
// around them were checked; with one bit changed the load fails on every
// rank and no sink received a byte of the damaged chunk.
TEST_F(StreamLoadTest, SinksNeverSeeDamagedBytes) {
  const std::vector<std::vector<Box>> layouts = {
      {Box{{0, 0}, {kRows, kCols / 2}}, Box{{0, kCols / 2}, {kRows, kCols / 2}}},
      {Box{{100, 0}, {40, kCols}}}};
  // Column halves are read once and handed out (node reads: checked whole
  // by their reader), or each rank reads its own columns (checked by the
  // blocks around them): both ways.
  bool node_reads = true;
  auto run = [&](const std::vector<Box>& boxes,
                 std::vector<std::shared_ptr<CollectingSink>>& sinks) {
    const int world = static_cast<int>(boxes.size());
    std::vector<std::vector<std::string>> logs(world);
    sinks.clear();
    for (int r = 0; r < world; ++r) {
      sinks.push_back(std::make_shared<CollectingSink>(logs[r], md_));
      sinks.back()->expect = &src_;
    }
    return RunInProcess(world, [&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      SinkPlanner planner(logs[r], sinks[r]);
      std::vector<std::vector<float>> mem;
      StateDict dst = Destinations(boxes[r], mem);
      LoadOptions o;
      o.comm = &comm;
      o.planner = &planner;
      o.share_node_reads = node_reads;
      return Load(dst, tmp_.path(), o).status();
    });
  };
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  for (bool node : {true, false}) {
    node_reads = node;
    for (const auto& boxes : layouts) {
      for (const absl::Status& s : run(boxes, sinks)) ASSERT_TRUE(s.ok()) << s;
      for (size_t r = 0; r < boxes.size(); ++r) ExpectBox(*sinks[r], boxes[r]);
    }
  }
  // One bit of t3 at row 120, column 40: in the second column half, and in
  // the slice.
  const ChunkMetadata& chunk = md_.tensors.at("t3").chunks.at(0);
  ASSERT_EQ(chunk.box.offsets[0], 0);
  const std::string path = tmp_.path() + "/" + chunk.location.file;
  const uint64_t at = chunk.location.offset + (120 * kCols + 40) * 4 + 2;
  ASSERT_TRUE(testing_util::FlipBits(path, at, 0x10).ok());
  for (bool node : {true, false}) {
    node_reads = node;
    for (const auto& boxes : layouts) {
      for (const absl::Status& s : run(boxes, sinks)) {
        EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
        EXPECT_THAT(std::string(s.message()), HasSubstr("t3")) << s;
      }
      for (const auto& sink : sinks) {
        EXPECT_EQ(sink->wrong, 0) << "a sink got a damaged row";
      }
    }
  }
  ASSERT_TRUE(testing_util::FlipBits(path, at, 0x10).ok());
}

// A chunk larger than a wave streams into a sink in pieces, each checked
// before the sink gets it. With block checksums (4 KiB blocks here) a piece
// is checked from its own bytes where it covers whole blocks, and only the
// blocks its ends cut into are read again: pieces of 16 KiB read nothing
// twice, pieces of 10 KiB one block per cut. A changed byte fails the load
// naming its block, and the sink never gets it.
TEST(StreamLoadBlocksTest, PiecesAreCheckedFromTheirOwnBlocks) {
  TempDir tmp;
  constexpr int64_t kRows = 256, kCols = 64;  // 64 KiB a tensor
  std::map<std::string, std::vector<float>> src;
  StateDict sd;
  float next = 0;
  for (const char* name : {"a", "b"}) {
    std::vector<float>& v = src[name];
    v.resize(kRows * kCols);
    for (float& x : v) x = next++;
    sd[name] = TensorView(v.data(), DType::kF32, {kRows, kCols});
  }
  SaveOptions so;
  so.crc32c_block_bytes = 4096;
  ASSERT_TRUE(Save(sd, tmp.path(), so).ok());
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok()) << md.status();
  ASSERT_EQ(md->tensors.at("a").chunks.at(0).location.block_crc32c.size(), 16u);
  constexpr uint64_t kState = 2 * kRows * kCols * 4;
  std::vector<std::string> log;
  std::shared_ptr<CollectingSink> sink;
  auto load = [&](uint64_t wave) {
    log.clear();
    sink = std::make_shared<CollectingSink>(log, *md);
    sink->expect = &src;
    SinkPlanner planner(log, sink);
    std::vector<float> ma(kRows * kCols), mb(kRows * kCols);
    StateDict dst;
    dst["a"] = TensorView(ma.data(), DType::kF32, {kRows, kCols});
    dst["b"] = TensorView(mb.data(), DType::kF32, {kRows, kCols});
    LoadOptions o;
    o.planner = &planner;
    o.io_threads = 1;
    o.bounce_buffer_bytes = 16 << 10;
    o.memory_budget_bytes = (16 << 10) + 2 * wave;
    return Load(dst, tmp.path(), o);
  };
  absl::StatusOr<LoadResult> aligned = load(16 << 10);
  ASSERT_TRUE(aligned.ok()) << aligned.status();
  EXPECT_EQ(sink->wrong, 0);
  EXPECT_LE(sink->largest, uint64_t{16} << 10);
  EXPECT_EQ(aligned->bytes_read, kState) << "a block was read twice";
  absl::StatusOr<LoadResult> cut = load(10 << 10);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(sink->wrong, 0);
  // Per tensor, 7 pieces (6 of 40 rows, 10 KiB, and one of 16): of the 6
  // cuts, 3 fall inside a block, which each piece beside it reads again.
  EXPECT_EQ(cut->bytes_read, kState + 2 * 6 * 4096);

  // One bit of b in block 5 (bytes [20480, 24576) of its chunk).
  const ByteLocation& loc = md->tensors.at("b").chunks.at(0).location;
  const std::string path = tmp.path() + "/" + loc.file;
  ASSERT_TRUE(testing_util::FlipBits(path, loc.offset + 21000, 0x08).ok());
  for (uint64_t wave : {uint64_t{16} << 10, uint64_t{10} << 10}) {
    absl::StatusOr<LoadResult> bad = load(wave);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << bad.status();
    EXPECT_THAT(std::string(bad.status().message()), HasSubstr("block 5"));
    EXPECT_EQ(sink->wrong, 0) << "the sink got a damaged row";
  }
}

// A sink that fails: the load fails naming the sink's tensor and box and
// keeping the sink's message; nothing of that tensor is committed.
TEST_F(StreamLoadTest, ASinkErrorFailsTheLoadNamingTheTensor) {
  std::vector<std::string> log;
  auto sink = std::make_shared<CollectingSink>(log, md_);
  sink->fail_on = "t5";
  SinkPlanner planner(log, sink);
  std::vector<std::vector<float>> mem;
  StateDict dst = Destinations(Box{{0, 0}, {kRows, kCols}}, mem);
  LoadOptions o;
  o.planner = &planner;
  absl::Status s = Load(dst, tmp_.path(), o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("sink of t5"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("the store is full"));
  EXPECT_EQ(std::count(log.begin(), log.end(), "commit t5"), 0);
}

// Memory destinations with a small budget: a load into host memory is
// read in place and needs no staging, so it stays one wave and loads
// bit-exact; every budget loads the same bytes.
TEST_F(StreamLoadTest, BudgetsDoNotChangeWhatMemoryDestinationsGet) {
  for (uint64_t budget : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 20}) {
    SCOPED_TRACE(budget);
    std::vector<std::vector<float>> mem;
    StateDict dst = Destinations(Box{{64, 16}, {150, 40}}, mem);
    LoadOptions o;
    o.memory_budget_bytes = budget;
    absl::StatusOr<LoadResult> r = Load(dst, tmp_.path(), o);
    ASSERT_TRUE(r.ok()) << r.status();
    for (int t = 0; t < kTensors; ++t) {
      const std::vector<float>& want = src_.at(Name(t));
      for (int64_t i = 0; i < 150; ++i) {
        for (int64_t j = 0; j < 40; ++j) {
          ASSERT_EQ(mem[t][i * 40 + j], want[(64 + i) * kCols + 16 + j]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace cairn

namespace cairn {
namespace {

// Two replicas of the same box form a broadcast group; one loads into
// contiguous memory (read or received in place, no staging), the other
// into a strided view (staged, then copied): the members' waves differ in
// staging but not in their collectives, and both load bit-exact.
TEST_F(StreamLoadTest, ReplicasWithAndWithoutStagingLoadTogether) {
  for (uint64_t budget : {uint64_t{0}, uint64_t{1}}) {
    SCOPED_TRACE(budget);
    std::vector<std::vector<float>> padded(2);
    std::vector<absl::Status> st = RunInProcess(2, [&](Communicator& comm) {
      const int r = comm.rank();
      StateDict dst;
      std::vector<float>& mem = padded[r];
      const int64_t stride = r == 0 ? kCols : kCols + 3;
      mem.assign(kTensors * kRows * stride, -1.0f);
      for (int t = 0; t < kTensors; ++t) {
        TensorView view(mem.data() + t * kRows * stride, DType::kF32,
                        {kRows, kCols}, {stride, 1});
        dst[Name(t)] = ShardedTensor(DType::kF32, {kRows, kCols},
                                     {{Box{{0, 0}, {kRows, kCols}}, view}});
      }
      dst["step"] = int64_t{0};
      LoadOptions o;
      o.comm = &comm;
      o.memory_budget_bytes = budget;
      absl::StatusOr<LoadResult> loaded = Load(dst, tmp_.path(), o);
      if (loaded.ok() && loaded->replica_group_size != 2) {
        return absl::InternalError("no replica group");
      }
      return loaded.status();
    });
    for (const absl::Status& s : st) ASSERT_TRUE(s.ok()) << s;
    for (int r = 0; r < 2; ++r) {
      const int64_t stride = r == 0 ? kCols : kCols + 3;
      for (int t = 0; t < kTensors; ++t) {
        const std::vector<float>& want = src_.at(Name(t));
        for (int64_t i = 0; i < kRows; ++i) {
          for (int64_t j = 0; j < kCols; ++j) {
            ASSERT_EQ(padded[r][t * kRows * stride + i * stride + j],
                      want[i * kCols + j])
                << "rank " << r << " " << Name(t) << " " << i << "," << j;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace cairn
