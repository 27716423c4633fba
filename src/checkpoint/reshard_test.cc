// Resharding: save a tensor cut one way, load it cut another way, compare
// every byte. Shapes, cuts, dtypes, strides and IO buffer sizes are random
// (fixed seed), so every read mode (direct, coalesced span, per-run) and
// both contiguous and strided sources and destinations are exercised.
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cairn/checkpoint.h"
#include "cairn/dtype.h"
#include "cairn/planner.h"
#include "cairn/state_dict.h"
#include "cairn/tensor.h"
#include "cairn/storage.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/test_util.h"
#include "core/byte_codec.h"
#include "format/crc32c.h"
#include "gtest/gtest.h"
#include "storage/fault_injection.h"

namespace cairn {
namespace {

using testing_util::ByteAt;
using testing_util::ElementPtr;
using testing_util::ForEachIndex;
using testing_util::LinearIndex;
using testing_util::TempDir;

// A grid of boxes covering `shape`: each dimension cut at random points.
std::vector<Box> RandomGrid(const Shape& shape, std::mt19937& rng,
                            int max_pieces) {
  std::vector<std::vector<int64_t>> cuts(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    int pieces = std::uniform_int_distribution<int>(1, max_pieces)(rng);
    std::vector<int64_t> c = {0, shape[d]};
    for (int i = 1; i < pieces && shape[d] > 1; ++i) {
      c.push_back(std::uniform_int_distribution<int64_t>(1, shape[d] - 1)(rng));
    }
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
    cuts[d] = c;
  }
  std::vector<Box> boxes;
  std::vector<size_t> idx(shape.size(), 0);
  while (true) {
    Box b;
    for (size_t d = 0; d < shape.size(); ++d) {
      b.offsets.push_back(cuts[d][idx[d]]);
      b.sizes.push_back(cuts[d][idx[d] + 1] - cuts[d][idx[d]]);
    }
    boxes.push_back(b);
    int d = static_cast<int>(shape.size()) - 1;
    for (; d >= 0; --d) {
      if (++idx[d] + 1 < cuts[d].size()) break;
      idx[d] = 0;
    }
    if (d < 0) break;
  }
  return boxes;
}

// Memory for one shard: either a contiguous tensor, or a strided view into a
// larger padded buffer (so the view is not contiguous).
struct ShardMemory {
  std::vector<std::byte> storage;
  TensorView view;
};

std::unique_ptr<ShardMemory> MakeShardMemory(DType dtype, const Box& box,
                                             bool strided, std::mt19937& rng) {
  auto m = std::make_unique<ShardMemory>();
  const size_t es = DTypeSize(dtype);
  if (!strided || box.rank() == 0) {
    m->storage.resize(std::max<size_t>(1, box.num_elements() * es));
    m->view = TensorView(m->storage.data(), dtype, box.sizes);
    return m;
  }
  // Pad every dimension by 0..2 elements, then maybe transpose the two
  // innermost dimensions' memory order.
  Shape padded = box.sizes;
  for (int64_t& p : padded) p += std::uniform_int_distribution<int>(0, 2)(rng);
  std::vector<int64_t> strides = ContiguousStrides(padded);
  if (box.rank() >= 2 && rng() % 2 == 0) {
    // Memory order: outer dims row-major, then dim b, then dim a innermost
    // (the last two dimensions transposed in memory).
    const int a = box.rank() - 2, b = box.rank() - 1;
    strides[a] = 1;
    strides[b] = padded[a];
    int64_t acc = padded[a] * padded[b];
    for (int d = a - 1; d >= 0; --d) {
      strides[d] = acc;
      acc *= padded[d];
    }
  }
  m->storage.resize(NumElements(padded) * es + es);
  m->view = TensorView(m->storage.data(), dtype, box.sizes, strides);
  return m;
}

struct Case {
  DType dtype;
  Shape shape;
  std::vector<Box> saved, loaded;
  bool strided_src, strided_dst;
  SaveOptions save;
  LoadOptions load;
};

std::string Describe(const Case& c) {
  auto boxes = [](const std::vector<Box>& v) {
    std::vector<std::string> s;
    for (const Box& b : v) s.push_back(b.ToString());
    return absl::StrJoin(s, " ");
  };
  return absl::StrCat(std::string(DTypeName(c.dtype)), " shape [",
                      absl::StrJoin(c.shape, ","), "] saved {", boxes(c.saved),
                      "} loaded {", boxes(c.loaded), "} strided src/dst ",
                      c.strided_src, "/", c.strided_dst, " write buffer ",
                      c.save.write_buffer_bytes, " bounce ",
                      c.load.bounce_buffer_bytes, " gap ",
                      c.load.coalesce_gap_bytes);
}

void RunCase(const Case& c, const std::string& dir, std::mt19937& rng) {
  SCOPED_TRACE(Describe(c));
  const size_t es = DTypeSize(c.dtype);
  std::vector<std::unique_ptr<ShardMemory>> src, dst;
  std::vector<Shard> src_shards, dst_shards;
  for (const Box& b : c.saved) {
    src.push_back(MakeShardMemory(c.dtype, b, c.strided_src, rng));
    ForEachIndex(b, [&](const auto& local, const auto& global) {
      const int64_t li = LinearIndex(c.shape, global);
      for (size_t i = 0; i < es; ++i) {
        ElementPtr(src.back()->view, local)[i] = ByteAt(c.dtype, li, i, 7);
      }
    });
    src_shards.push_back({b, src.back()->view});
  }
  for (const Box& b : c.loaded) {
    dst.push_back(MakeShardMemory(c.dtype, b, c.strided_dst, rng));
    std::memset(dst.back()->storage.data(), 0xEE, dst.back()->storage.size());
    dst_shards.push_back({b, dst.back()->view});
  }
  StateDict save_sd;
  save_sd["t"] = ShardedTensor(c.dtype, c.shape, src_shards);
  SaveOptions so = c.save;
  so.overwrite = true;
  absl::StatusOr<SaveResult> saved = Save(save_sd, dir, so);
  ASSERT_TRUE(saved.ok()) << saved.status();

  StateDict load_sd;
  load_sd["t"] = ShardedTensor(c.dtype, c.shape, dst_shards);
  absl::StatusOr<LoadResult> loaded = Load(load_sd, dir, c.load);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  for (size_t s = 0; s < c.loaded.size(); ++s) {
    int64_t bad = 0;
    ForEachIndex(c.loaded[s], [&](const auto& local, const auto& global) {
      const int64_t li = LinearIndex(c.shape, global);
      for (size_t i = 0; i < es; ++i) {
        if (ElementPtr(dst[s]->view, local)[i] != ByteAt(c.dtype, li, i, 7) &&
            bad++ == 0) {
          ADD_FAILURE() << "wrong byte at global element " << li << " byte "
                        << i << " of destination " << c.loaded[s].ToString();
        }
      }
    });
    ASSERT_EQ(bad, 0);
  }
}

TEST(ReshardTest, RandomChunkingsRoundTripBitExact) {
  TempDir tmp;
  std::mt19937 rng(20261122);
  const std::span<const DType> dtypes = AllDTypes();
  for (int iter = 0; iter < 300; ++iter) {
    Case c;
    c.dtype = dtypes[rng() % dtypes.size()];
    const int rank = std::uniform_int_distribution<int>(1, 4)(rng);
    for (int d = 0; d < rank; ++d) {
      c.shape.push_back(std::uniform_int_distribution<int64_t>(1, rank <= 2 ? 40 : 9)(rng));
    }
    c.saved = RandomGrid(c.shape, rng, 4);
    c.loaded = RandomGrid(c.shape, rng, 4);
    c.strided_src = rng() % 2;
    c.strided_dst = rng() % 2;
    c.save.io_threads = 1 + rng() % 4;
    c.save.write_buffer_bytes = 4096;
    c.save.direct_io = rng() % 2;
    c.load.io_threads = 1 + rng() % 4;
    c.load.bounce_buffer_bytes = size_t{1} << std::uniform_int_distribution<int>(4, 16)(rng);
    c.load.coalesce_gap_bytes = rng() % 2 ? 0 : 65536;
    RunCase(c, tmp.path(), rng);
    if (HasFatalFailure()) return;
  }
}

TEST(ReshardTest, RankZeroAndEmptyDimensions) {
  TempDir tmp;
  std::mt19937 rng(1);
  for (DType dtype : {DType::kF32, DType::kBool, DType::kI64}) {
    Case scalar{dtype, {}, {Box{}}, {Box{}}, false, false, {}, {}};
    RunCase(scalar, tmp.path(), rng);
    Case empty{dtype, {4, 0}, {Box{{0, 0}, {4, 0}}}, {Box{{0, 0}, {4, 0}}},
               false, false, {}, {}};
    RunCase(empty, tmp.path(), rng);
  }
}

// 0, 1, ..., n - 1 as floats: every element tells where it belongs.
std::vector<float> Arange(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  return v;
}

// A destination that needs a few rows of a big stored chunk reads those rows,
// not the chunk; a narrow column reads its runs, not whole rows.
TEST(ReshardTest, ReadsOnlyTheNeededBytes) {
  TempDir tmp;
  constexpr int64_t kRows = 1024, kCols = 1024;
  std::vector<float> full = Arange(kRows * kCols);
  StateDict sd;
  sd["w"] = TensorView(full.data(), DType::kF32, {kRows, kCols});
  ASSERT_TRUE(Save(sd, tmp.path()).ok());

  uint64_t shared = 0;  // of the last load's bytes, read by ReadAtShared
  auto load_counting = [&](const Box& box, const LoadOptions& options,
                           std::vector<float>& out) -> uint64_t {
    out.assign(box.num_elements(), -1.0f);
    StateDict dst;
    dst["w"] = ShardedTensor(DType::kF32, {kRows, kCols},
                             {{box, TensorView(out.data(), DType::kF32, box.sizes)}});
    absl::StatusOr<std::unique_ptr<Storage>> base = Storage::Open(tmp.path());
    EXPECT_TRUE(base.ok());
    internal_storage::FaultInjectionStorage counting(*std::move(base));
    absl::StatusOr<LoadResult> r =
        internal_checkpoint::LoadFromStorage(dst, &counting, options);
    EXPECT_TRUE(r.ok()) << r.status();
    for (int64_t i = 0; i < box.sizes[0]; ++i) {
      for (int64_t j = 0; j < box.sizes[1]; ++j) {
        EXPECT_EQ(out[i * box.sizes[1] + j],
                  static_cast<float>((box.offsets[0] + i) * kCols +
                                     box.offsets[1] + j));
      }
    }
    shared = counting.shared_bytes_read();
    return counting.bytes_read();
  };

  std::vector<float> out;
  const uint64_t header_bytes = 8 * 4096;  // metadata.json + file header, generously
  // The reads of the slices themselves (checks off: a slice of a chunk is
  // checked after the load by reading the blocks around it, below).
  LoadOptions unchecked;
  unchecked.verify_checksums = false;
  // Rows 100..110: 10 rows of 4 KiB.
  uint64_t rows = load_counting(Box{{100, 0}, {10, kCols}}, unchecked, out);
  EXPECT_LE(rows, 10 * kCols * 4 + header_bytes);
  EXPECT_GE(rows, 10 * kCols * 4);
  EXPECT_EQ(shared, 0u);  // every byte read is copied: no other rank's
  // Checked, the rows' one 1 MiB checksum block (bytes [0, 1 MiB) of the
  // 4 MiB chunk) is read again, and nothing else.
  EXPECT_EQ(load_counting(Box{{100, 0}, {10, kCols}}, {}, out),
            rows + kDefaultCrc32cBlockBytes);
  // Two columns of every row, per-run reads (gap larger than the limit).
  LoadOptions no_coalesce = unchecked;
  no_coalesce.coalesce_gap_bytes = 0;
  uint64_t cols = load_counting(Box{{0, 500}, {kRows, 2}}, no_coalesce, out);
  EXPECT_LE(cols, kRows * 2 * 4 + header_bytes);
  EXPECT_EQ(shared, 0u);
  // With coalescing the gaps are read too, but never more than the chunk,
  // and as a shared read: the gaps are the other ranks' columns.
  uint64_t coalesced = load_counting(Box{{0, 500}, {kRows, 2}}, unchecked, out);
  EXPECT_LE(coalesced, kRows * kCols * 4 + header_bytes);
  EXPECT_GE(shared, (kRows - 1) * kCols * 4 + 2 * 4);
  EXPECT_LE(shared, coalesced);
  // Checked, a column has a byte in every block: the chunk is read again.
  no_coalesce.verify_checksums = true;
  EXPECT_EQ(load_counting(Box{{0, 500}, {kRows, 2}}, no_coalesce, out),
            cols + kRows * kCols * 4);
}

// A state dict holding `full` ([rows, cols] F32) as "w" in `chunks` row
// chunks of equal height.
StateDict RowChunked(std::vector<float>& full, int64_t rows, int64_t cols,
                     int chunks) {
  const int64_t height = rows / chunks;
  std::vector<Shard> shards;
  for (int r = 0; r < chunks; ++r) {
    shards.push_back({Box{{r * height, 0}, {height, cols}},
                      TensorView(full.data() + r * height * cols, DType::kF32,
                                 {height, cols})});
  }
  StateDict sd;
  sd["w"] = ShardedTensor(DType::kF32, {rows, cols}, shards);
  return sd;
}

// Regression: column shards of row-chunked tensors, all in one process, read
// each chunk once (not once per destination), and the chunks read whole are
// still checksummed.
TEST(ReshardTest, SeveralDestinationsInOneChunkReadItOnce) {
  TempDir tmp;
  constexpr int64_t kRows = 256, kCols = 384;
  std::vector<float> full = Arange(kRows * kCols);
  ASSERT_TRUE(Save(RowChunked(full, kRows, kCols, 4), tmp.path()).ok());

  std::vector<std::vector<float>> cols(3, std::vector<float>(kRows * 128));
  std::vector<Shard> dst;
  for (int c = 0; c < 3; ++c) {
    dst.push_back({Box{{0, c * 128}, {kRows, 128}},
                   TensorView(cols[c].data(), DType::kF32, {kRows, 128})});
  }
  StateDict load_sd;
  load_sd["w"] = ShardedTensor(DType::kF32, {kRows, kCols}, dst);
  internal_storage::FaultInjectionStorage counting(*Storage::Open(tmp.path()));
  LoadOptions small;
  small.bounce_buffer_bytes = 16384;  // many slabs per chunk
  absl::StatusOr<LoadResult> r =
      internal_checkpoint::LoadFromStorage(load_sd, &counting, small);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->bytes_read, kRows * kCols * 4);
  EXPECT_EQ(r->bytes_loaded, kRows * kCols * 4);
  EXPECT_EQ(r->chunks_verified, 4u);
  for (int c = 0; c < 3; ++c) {
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = 0; j < 128; ++j) {
        ASSERT_EQ(cols[c][i * 128 + j], full[i * kCols + c * 128 + j]);
      }
    }
  }
}

// Two destination boxes of one rank in one chunk, close enough that the
// region they span is read once, far enough apart that a slab meeting only
// the second is read as packed runs: its copy must start where the box
// starts in the packed slab (measured in the slab's strides, not the
// chunk's). Found by fuzz/reshard_fuzz.cc: the second box got rows of
// never-written bytes. With and without checksums, alone and beside a
// second rank (whose load made the parts checked from signatures).
TEST(ReshardTest, ARegionReadAsRunsCopiesEachBoxFromItsPlace) {
  TempDir tmp;
  constexpr int64_t kRows = 256, kCols = 16;
  std::vector<float> full = Arange(kRows * kCols);
  StateDict sd;
  sd["w"] = TensorView(full.data(), DType::kF32, {kRows, kCols});
  ASSERT_TRUE(Save(sd, tmp.path()).ok());
  // Spanning [0:256, 0:6]: 1536 elements for 946 needed. Slabs hold 64
  // rows (a 4 KiB span, the least a slab may be): the first meets only the
  // first box, the others only the second, which starts at row 6, column
  // 1 of the second slab.
  const std::vector<Box> boxes = {Box{{0, 0}, {8, 2}},
                                  Box{{70, 1}, {186, 5}}};
  for (bool verify : {true, false}) {
    for (int world : {1, 2}) {
      SCOPED_TRACE(absl::StrCat("verify ", verify, ", ", world, " ranks"));
      std::vector<absl::Status> statuses =
          RunInProcess(world, [&](Communicator& comm) -> absl::Status {
            // Rank 1 loads one element.
            const std::vector<Box> mine =
                comm.rank() == 0 ? boxes
                                 : std::vector<Box>{Box{{5, 5}, {1, 1}}};
            std::vector<std::vector<float>> out;
            std::vector<Shard> shards;
            for (const Box& b : mine) out.emplace_back(b.num_elements(), -1.0f);
            for (size_t k = 0; k < mine.size(); ++k) {
              shards.push_back({mine[k], TensorView(out[k].data(), DType::kF32,
                                                    mine[k].sizes)});
            }
            StateDict dst;
            dst["w"] = ShardedTensor(DType::kF32, {kRows, kCols}, shards);
            LoadOptions o;
            o.comm = &comm;
            o.verify_checksums = verify;
            o.coalesce_gap_bytes = 0;     // runs, not spans
            o.bounce_buffer_bytes = 4096;
            absl::StatusOr<LoadResult> r = Load(dst, tmp.path(), o);
            if (!r.ok()) return r.status();
            for (size_t k = 0; k < mine.size(); ++k) {
              const Box& b = mine[k];
              for (int64_t i = 0; i < b.sizes[0]; ++i) {
                for (int64_t j = 0; j < b.sizes[1]; ++j) {
                  const float want =
                      full[(b.offsets[0] + i) * kCols + b.offsets[1] + j];
                  if (out[k][i * b.sizes[1] + j] != want) {
                    return absl::InternalError(absl::StrCat(
                        "box ", b.ToString(), " element ", i, ",", j, ": ",
                        out[k][i * b.sizes[1] + j], ", not ", want));
                  }
                }
              }
            }
            return absl::OkStatus();
          });
      for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
    }
  }
}

// Column shards of row chunks whose file is in the page cache: each span is
// copied from in place (the storage's view, no bounce buffer), bit-exact,
// and a chunk read whole is still checksummed: a byte changed in the cached
// file is a crc32c mismatch naming the chunk.
TEST(ReshardTest, CachedSpansAreCopiedInPlaceAndChecked) {
  TempDir tmp;
  constexpr int64_t kRows = 512, kCols = 1024;
  std::vector<float> full = Arange(kRows * kCols);
  SaveOptions buffered;
  buffered.direct_io = false;  // the data file stays in the page cache
  ASSERT_TRUE(
      Save(RowChunked(full, kRows, kCols, 4), tmp.path(), buffered).ok());
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok()) << md.status();
  const std::string file = md->tensors.at("w").chunks.at(0).location.file;
  const std::string path = tmp.path() + "/" + file;

  auto load = [&](std::vector<std::vector<float>>& cols) {
    const int64_t widths[3] = {300, 212, 512};  // 1200 B, 848 B, 2 KiB runs
    std::vector<Shard> dst;
    int64_t at = 0;
    cols.assign(3, {});
    for (int c = 0; c < 3; ++c) {
      cols[c].assign(kRows * widths[c], -1.0f);
      dst.push_back({Box{{0, at}, {kRows, widths[c]}},
                     TensorView(cols[c].data(), DType::kF32,
                                {kRows, widths[c]})});
      at += widths[c];
    }
    StateDict load_sd;
    load_sd["w"] = ShardedTensor(DType::kF32, {kRows, kCols}, dst);
    // Make sure the whole file is cached, and that the storage offers views.
    absl::StatusOr<std::unique_ptr<Storage>> storage = Storage::Open(tmp.path());
    EXPECT_TRUE(storage.ok());
    absl::StatusOr<std::unique_ptr<ReadableFile>> f = (*storage)->OpenForRead(file);
    EXPECT_TRUE(f.ok());
    std::vector<std::byte> all((*f)->size());
    EXPECT_TRUE((*f)->ReadAtIntoReusedBuffer(0, std::span(all)).ok());
    EXPECT_NE((*f)->ViewIfInMemory(0, all.size()), nullptr)
        << "the data file is not in the page cache";
    LoadOptions options;
    options.bounce_buffer_bytes = 256 << 10;  // several spans per chunk
    return internal_checkpoint::LoadFromStorage(load_sd, storage->get(),
                                                options);
  };

  std::vector<std::vector<float>> cols;
  absl::StatusOr<LoadResult> r = load(cols);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->chunks_verified, 4u);
  int64_t at = 0;
  for (int c = 0; c < 3; ++c) {
    const int64_t width = static_cast<int64_t>(cols[c].size()) / kRows;
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = 0; j < width; ++j) {
        ASSERT_EQ(cols[c][i * width + j], full[i * kCols + at + j])
            << "column shard " << c << " row " << i << " column " << j;
      }
    }
    at += width;
  }

  // One byte of the third chunk changed through the page cache.
  const ByteLocation& third = md->tensors.at("w").chunks.at(2).location;
  {
    std::FILE* f = std::fopen(path.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fseek(f, static_cast<long>(third.offset + 1000), SEEK_SET), 0);
    ASSERT_EQ(std::fputc(0x7f, f), 0x7f);
    ASSERT_EQ(std::fclose(f), 0);
  }
  r = load(cols);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("crc32c mismatch"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find(file), std::string::npos) << r.status();
}

// A [256, 1024] F32 tensor "w" (`full`, 0, 1, 2, ...) saved in four chunks
// of 64 rows, and its metadata (`md`).
class FourRowChunksTest : public testing::Test {
 protected:
  static constexpr int64_t kRows = 256, kCols = 1024;
  void SetUp() override {
    full = Arange(kRows * kCols);
    ASSERT_TRUE(Save(RowChunked(full, kRows, kCols, 4), tmp.path()).ok());
    absl::StatusOr<Metadata> read = ReadMetadata(tmp.path());
    ASSERT_TRUE(read.ok()) << read.status();
    md = *std::move(read);
  }
  TempDir tmp;
  std::vector<float> full;
  std::optional<Metadata> md;

  struct Outcome {
    std::vector<absl::Status> statuses;  // each rank's
    uint64_t verified = 0;               // chunks, over the ranks
    uint64_t read = 0;                   // bytes, over the ranks
  };
  // Loads boxes[r % boxes.size()] of "w" on rank r of `world` (in-process
  // ranks) and compares every element with `full`.
  Outcome LoadBoxes(const std::vector<Box>& boxes, int world,
                    const LoadOptions& options) {
    std::vector<uint64_t> verified(world, 0), read(world, 0);
    Outcome out;
    out.statuses = RunInProcess(world, [&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      const Box& box = boxes[r % boxes.size()];
      std::vector<float> part(box.num_elements(), -1.0f);
      StateDict dst;
      dst["w"] = ShardedTensor(
          DType::kF32, {kRows, kCols},
          {{box, TensorView(part.data(), DType::kF32, box.sizes)}});
      LoadOptions o = options;
      o.comm = &comm;
      absl::StatusOr<LoadResult> loaded = Load(dst, tmp.path(), o);
      if (!loaded.ok()) return loaded.status();
      verified[r] = loaded->chunks_verified;
      read[r] = loaded->bytes_read;
      for (int64_t i = 0; i < box.sizes[0]; ++i) {
        for (int64_t j = 0; j < box.sizes[1]; ++j) {
          if (part[i * box.sizes[1] + j] !=
              full[(box.offsets[0] + i) * kCols + box.offsets[1] + j]) {
            return absl::InternalError(
                absl::StrCat("wrong element ", i, ",", j));
          }
        }
      }
      return absl::OkStatus();
    });
    for (int r = 0; r < world; ++r) {
      out.verified += verified[r];
      out.read += read[r];
    }
    return out;
  }
  // Every status is kDataLoss for a CRC32C mismatch in chunk 1 (rows
  // 64..128), naming its file and offset.
  void ExpectChunk1Mismatch(const std::vector<absl::Status>& statuses) {
    const ByteLocation& at = md->tensors.at("w").chunks.at(1).location;
    for (const absl::Status& s : statuses) {
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_NE(s.message().find("crc32c mismatch in w@64,0"),
                std::string::npos) << s;
      EXPECT_NE(s.message().find(absl::StrCat(at.file, ", offset ", at.offset)),
                std::string::npos) << s;
    }
  }
  // How many chunks CheckSharedPieces checks from `payloads` (rank r's at
  // r), expecting it to succeed.
  uint64_t Checked(const std::vector<std::string>& payloads) {
    absl::StatusOr<uint64_t> checked =
        internal_checkpoint::CheckSharedPieces(*md, payloads);
    EXPECT_TRUE(checked.ok()) << checked.status();
    return checked.value_or(0);
  }
  // CheckSharedPieces' error on `payloads`, expected to have `code` and to
  // contain `text`.
  void ExpectError(const std::vector<std::string>& payloads,
                   absl::StatusCode code, const std::string& text) {
    const absl::Status s =
        internal_checkpoint::CheckSharedPieces(*md, payloads).status();
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_NE(s.message().find(text), std::string::npos) << s;
  }
};

// The rows of a row reshard cut chunks into parts that no one rank reads
// whole (4 chunks of 64 rows loaded as rows 0..85, 85..170 and 170..256):
// each rank checksums its parts and the coordinator combines the parts of
// every chunk and compares them with its CRC32C, so every chunk is checked
// although two are read in parts, and a changed byte in either part fails
// the load on every rank, naming the chunk, its file and the ranks. Also
// with replicas (the same rows on two ranks), read once per replica group
// and broadcast, or read by both replicas.
TEST_F(FourRowChunksTest, RowPartsReadByDifferentRanksAreCheckedTogether) {

  // Loads rows [cuts[r % n], cuts[r % n + 1]) on rank r of `world` (n the
  // number of row ranges).
  auto load = [&](const std::vector<int64_t>& cuts, int world,
                  const LoadOptions& options) {
    std::vector<Box> boxes;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      boxes.push_back(Box{{cuts[i], 0}, {cuts[i + 1] - cuts[i], kCols}});
    }
    return LoadBoxes(boxes, world, options);
  };
  LoadOptions no_broadcast;
  no_broadcast.broadcast_replicas = false;
  LoadOptions unchecked;
  unchecked.verify_checksums = false;
  struct Case {
    std::string name;
    std::vector<int64_t> cuts;
    int world;
    LoadOptions options;
    uint64_t verified;  // checks, over the ranks
  };
  const std::vector<Case> cases = {
      {"4 to 3 rows", {0, 85, 170, 256}, 3, {}, 4},
      {"4 to 2 rows, each on two replicas, broadcast", {0, 100, 256}, 4, {},
       4},
      // Chunks 0, 2 and 3 are read whole by both replicas, and checked by
      // each; chunk 1 in parts, checked once.
      {"4 to 2 rows, each on two replicas, both read",
       {0, 100, 256},
       4,
       no_broadcast,
       7},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Outcome ok = load(c.cuts, c.world, c.options);
    for (const absl::Status& s : ok.statuses) ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(ok.verified, c.verified);
  }
  Outcome none = load({0, 85, 170, 256}, 3, unchecked);
  for (const absl::Status& s : none.statuses) ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(none.verified, 0u);

  // One bit changed in chunk 1 (rows 64..128) at row 70 (the first rank's
  // part in every case), then at row 120 (the second's).
  const ByteLocation& at = md->tensors.at("w").chunks.at(1).location;
  const std::string path = tmp.path() + "/" + at.file;
  for (const int64_t row : {70, 120}) {
    SCOPED_TRACE(absl::StrCat("row ", row));
    const long offset = static_cast<long>(at.offset + (row - 64) * kCols * 4 + 5);
    auto flip = [&] {
      ASSERT_TRUE(testing_util::FlipBits(path, offset, 0x40).ok());
    };
    flip();
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      Outcome bad = load(c.cuts, c.world, c.options);
      ExpectChunk1Mismatch(bad.statuses);
      for (const absl::Status& s : bad.statuses) {
        EXPECT_NE(s.message().find("read in parts by ranks"), std::string::npos)
            << s;
      }
    }
    // Unchecked, the changed value loads (the only thing that would tell).
    Outcome blind = load({0, 85, 170, 256}, 3, unchecked);
    EXPECT_FALSE(blind.statuses[row < 85 ? 0 : 1].ok());  // a wrong element
    flip();  // back as it was
  }
}

// The coordinator's check of the parts ranks read (CheckSharedPieces) on
// good and bad messages: parts that tile a chunk are checked; a wrong CRC32C,
// or two ranks that read the same bytes differently, is kDataLoss naming the
// chunk and the ranks; parts that leave a gap or overlap unevenly leave the
// chunk unchecked; a truncated message is kDataLoss naming the rank, and a
// piece of a chunk the checkpoint lacks is an internal error.
TEST_F(FourRowChunksTest, CoordinatorChecksPartsFromMessages) {
  using internal_checkpoint::CrcPiece;
  using internal_checkpoint::EncodeSharedPieces;
  // Bytes [offset, offset + bytes) of chunk 1 (rows 64..128) as a piece.
  constexpr uint64_t kChunk = 64 * kCols * 4;
  const char* chunk1 = reinterpret_cast<const char*>(full.data() + 64 * kCols);
  auto piece = [&](uint64_t offset, uint64_t bytes) {
    return CrcPiece{offset, bytes,
                    internal_format::Crc32c(chunk1 + offset, bytes)};
  };
  auto encode = [&](const std::vector<internal_checkpoint::SharedPieces>& s) {
    absl::StatusOr<std::string> m = EncodeSharedPieces(*md, s);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.value_or("");
  };
  auto message = [&](std::vector<CrcPiece> pieces, uint64_t chunk = 1) {
    return encode({{"w", chunk, std::move(pieces), {}}});
  };
  const uint64_t third = kChunk / 3 / 4096 * 4096;
  const std::string first = message({piece(0, third)});
  const std::string rest = message({piece(third, kChunk - third)});

  // Tiled by ranks 0 and 2 (rank 1 read nothing of it), in either order,
  // and with rank 3 a replica of rank 0; whole from one rank, in two pieces.
  EXPECT_EQ(Checked({first, encode({}), rest}), 1u);
  EXPECT_EQ(Checked({rest, first, first}), 1u);
  EXPECT_EQ(Checked({message({piece(0, third), piece(third, kChunk - third)})}),
            1u);

  // A changed byte: the combined CRC32C differs from the stored one.
  CrcPiece wrong = piece(third, kChunk - third);
  wrong.crc ^= 1;
  const ByteLocation& at = md->tensors.at("w").chunks.at(1).location;
  ExpectError({first, message({wrong})}, absl::StatusCode::kDataLoss,
              absl::StrCat("crc32c mismatch in w@64,0 (", at.file, ", offset ",
                           at.offset, ", read in parts by ranks 0, 1)"));
  // Replicas that read the same bytes differently.
  ExpectError({first, rest, message({wrong})}, absl::StatusCode::kDataLoss,
              "ranks 1 and 2 read different bytes");

  // A gap (nobody read the last page) and an uneven overlap: unchecked.
  EXPECT_EQ(Checked({first, message({piece(third, kChunk - third - 4096)})}),
            0u);
  EXPECT_EQ(
      Checked({first, message({piece(third - 4096, kChunk - third + 4096)})}),
      0u);

  // Malformed messages.
  ExpectError({first, rest.substr(0, rest.size() - 3)},
              absl::StatusCode::kDataLoss, "chunk checksums from rank 1");
  ExpectError({first + "x"}, absl::StatusCode::kDataLoss,
              "chunk checksums from rank 0");
  // A tensor the checkpoint lacks cannot be encoded; as bytes, its index
  // is past the checkpoint's tensors.
  EXPECT_EQ(EncodeSharedPieces(*md, {{"v", 1, {piece(0, third)}, {}}})
                .status()
                .code(),
            absl::StatusCode::kInternal);
  internal_core::ByteWriter past;
  past.U64(1);
  past.U32(static_cast<uint32_t>(md->tensors.size()));
  past.U64(1);
  past.U64(0);
  past.U64(third);
  past.U32(0);
  past.U64(0);  // no strided parts
  for (const std::string& bad :
       {past.Take(), message({piece(0, third)}, 4),
        message({CrcPiece{kChunk - 4, 8, 0}})}) {
    ExpectError({first, bad}, absl::StatusCode::kInternal,
                "chunk checksums from rank 1");
  }
}

// Parts of chunks that are not contiguous in them (the columns of a column
// reshard, the blocks of a 2-d one) are signed by their readers (the linear
// CRC of the chunk with the bytes outside the part zeroed, crc32c.h) and the
// coordinator sums the signatures of parts that tile a chunk, so every chunk
// is checked without a byte read beyond what the ranks need, whether a
// rank's columns are read as a span (coalesced) or as runs, with contiguous
// parts (rows) in the same chunk, and with replicas. A changed byte fails
// the load on every rank, naming the chunk and its file.
TEST_F(FourRowChunksTest, BlockPartsReadByDifferentRanksAreCheckedTogether) {
  LoadOptions small;
  small.bounce_buffer_bytes = 16384;  // 4 rows per slab: many per chunk
  LoadOptions runs = small;
  runs.coalesce_gap_bytes = 0;  // each row's columns read on their own
  LoadOptions no_broadcast = small;
  no_broadcast.broadcast_replicas = false;
  std::vector<Box> quarters, halves;
  for (int r = 0; r < 4; ++r) quarters.push_back(Box{{0, 256 * r}, {kRows, 256}});
  for (int r = 0; r < 2; ++r) halves.push_back(Box{{0, 512 * r}, {kRows, 512}});
  struct Case {
    std::string name;
    std::vector<Box> boxes;
    int world;
    LoadOptions options;
  };
  const std::vector<Case> cases = {
      {"column quarters, spans", quarters, 4, small},
      {"column quarters, runs", quarters, 4, runs},
      // A slab a chunk: 64 runs each, shifted by table (Crc32cShifter).
      {"column quarters, one slab a chunk", quarters, 4, LoadOptions{}},
      {"2-d blocks",
       {Box{{0, 0}, {128, 512}}, Box{{0, 512}, {128, 512}},
        Box{{128, 0}, {128, 512}}, Box{{128, 512}, {128, 512}}},
       4,
       small},
      // Chunk 1 (rows 64..128): rows 64..96 whole-width from rank 0 (a
      // contiguous piece), the rest in two blocks from ranks 1 and 2.
      {"rows and blocks in one chunk",
       {Box{{0, 0}, {96, kCols}}, Box{{96, 0}, {160, 512}},
        Box{{96, 512}, {160, 512}}},
       3,
       small},
      {"column halves on two replicas, broadcast", halves, 4, small},
      {"column halves on two replicas, both read", halves, 4, no_broadcast},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Outcome ok = LoadBoxes(c.boxes, c.world, c.options);
    for (const absl::Status& s : ok.statuses) ASSERT_TRUE(s.ok()) << s;
    // Every chunk checked once: by the coordinator, or (chunk 0 in the
    // mixed case) by the one rank that read it whole.
    EXPECT_EQ(ok.verified, 4u);
  }
  // The quarters read only their spans (16 slabs of 4 rows a chunk, each
  // from its first row's needed bytes to its last row's) or runs: nothing
  // more for the checks.
  constexpr uint64_t kSpans = 16 * (3 * kCols * 4 + 256 * 4);
  EXPECT_EQ(LoadBoxes(quarters, 4, small).read, 4 * 4 * kSpans);
  EXPECT_EQ(LoadBoxes(quarters, 4, runs).read, kRows * kCols * 4);
  LoadOptions unchecked = small;
  unchecked.verify_checksums = false;
  Outcome none = LoadBoxes(quarters, 4, unchecked);
  for (const absl::Status& s : none.statuses) ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(none.verified, 0u);
  EXPECT_EQ(none.read, 4 * 4 * kSpans);

  // One bit changed in chunk 1 at row 100, column 700 (inside one part in
  // every case, and not in rank 0's in most).
  const ByteLocation& at = md->tensors.at("w").chunks.at(1).location;
  const std::string path = tmp.path() + "/" + at.file;
  const long offset =
      static_cast<long>(at.offset + ((100 - 64) * kCols + 700) * 4 + 1);
  auto flip = [&] {
    ASSERT_TRUE(testing_util::FlipBits(path, offset, 0x40).ok());
  };
  flip();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ExpectChunk1Mismatch(LoadBoxes(c.boxes, c.world, c.options).statuses);
  }
  // Unchecked, the changed value loads (the only thing that would tell).
  Outcome blind = LoadBoxes(quarters, 4, unchecked);
  EXPECT_FALSE(blind.statuses[2].ok());  // columns 512..768: a wrong element
  flip();  // back as it was

  // A part that no other rank's parts complete (rows 0..60 of the 64-row
  // chunk 0, loaded alone) is checked by its reader after the load: the
  // chunk (256 KiB) is one checksum block, so it reads the chunk again.
  Outcome alone = LoadBoxes({Box{{0, 0}, {60, kCols}}}, 1, small);
  ASSERT_TRUE(alone.statuses[0].ok()) << alone.statuses[0];
  EXPECT_EQ(alone.verified, 1u);
  EXPECT_EQ(alone.read, (60 + 64) * kCols * 4);
}

// A planner that checks, at each CommitChunk, the bytes of the committed
// item in its destination against `full`, and counts what it saw.
class CheckingPlanner : public DefaultLoadPlanner {
 public:
  CheckingPlanner(const std::vector<float>& full, int64_t cols, const Box& box,
                  const std::vector<float>& part)
      : full_(full), cols_(cols), box_(box), part_(part) {}
  absl::Status CommitChunk(const ReadItem& item) override {
    ++commits;
    const Box& o = item.overlap;
    for (int64_t i = o.offsets[0]; i < o.offsets[0] + o.sizes[0]; ++i) {
      for (int64_t j = o.offsets[1]; j < o.offsets[1] + o.sizes[1]; ++j) {
        const float got = part_[(i - box_.offsets[0]) * box_.sizes[1] +
                                (j - box_.offsets[1])];
        if (got != full_[i * cols_ + j]) ++wrong;
      }
    }
    return DefaultLoadPlanner::CommitChunk(item);
  }
  absl::Status OnTensorLoaded(const std::string&) override {
    ++tensors_loaded;
    return absl::OkStatus();
  }
  int commits = 0;
  int64_t wrong = 0;  // wrong elements in committed items
  int tensors_loaded = 0;

 private:
  const std::vector<float>& full_;
  int64_t cols_;
  Box box_;
  const std::vector<float>& part_;
};

// CommitChunk (and OnTensorLoaded) come only after every check covering an
// item's bytes passed, including the coordinator's combined check of parts
// read by several ranks: with one bit changed in a part of a chunk, in
// column and row reshards, a replica group's broadcast, and a slice that
// only its reader's later check covers (step 5), the load fails and no
// planner ever committed a wrong byte; on the good checkpoint every item
// commits once, and every tensor completes.
TEST_F(FourRowChunksTest, PlannersSeeOnlyCheckedBytes) {
  LoadOptions small;
  small.bounce_buffer_bytes = 16384;
  struct Case {
    std::string name;
    std::vector<Box> boxes;
    int world;
  };
  const std::vector<Case> cases = {
      {"column halves", {Box{{0, 0}, {kRows, 512}}, Box{{0, 512}, {kRows, 512}}},
       2},
      {"column halves on two replicas, broadcast",
       {Box{{0, 0}, {kRows, 512}}, Box{{0, 512}, {kRows, 512}}},
       4},
      {"4 to 3 rows",
       {Box{{0, 0}, {85, kCols}}, Box{{85, 0}, {85, kCols}},
        Box{{170, 0}, {86, kCols}}},
       3},
      {"a slice", {Box{{60, 0}, {60, kCols}}}, 1},
  };
  auto run = [&](const Case& c, std::vector<int>& commits,
                 std::vector<int64_t>& wrong, std::vector<int>& tensors) {
    commits.assign(c.world, 0);
    wrong.assign(c.world, 0);
    tensors.assign(c.world, 0);
    return RunInProcess(c.world, [&](Communicator& comm) -> absl::Status {
      const int r = comm.rank();
      const Box& box = c.boxes[r % c.boxes.size()];
      std::vector<float> part(box.num_elements(), -1.0f);
      StateDict dst;
      dst["w"] = ShardedTensor(
          DType::kF32, {kRows, kCols},
          {{box, TensorView(part.data(), DType::kF32, box.sizes)}});
      CheckingPlanner planner(full, kCols, box, part);
      LoadOptions o = small;
      o.comm = &comm;
      o.planner = &planner;
      absl::StatusOr<LoadResult> loaded = Load(dst, tmp.path(), o);
      commits[r] = planner.commits;
      wrong[r] = planner.wrong;
      tensors[r] = planner.tensors_loaded;
      return loaded.status();
    });
  };
  std::vector<int> commits, tensors;
  std::vector<int64_t> wrong;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    for (const absl::Status& s : run(c, commits, wrong, tensors)) {
      ASSERT_TRUE(s.ok()) << s;
    }
    for (int r = 0; r < c.world; ++r) {
      const Box& box = c.boxes[r % c.boxes.size()];
      const int64_t first = box.offsets[0] / 64;
      const int64_t last = (box.offsets[0] + box.sizes[0] - 1) / 64;
      EXPECT_EQ(commits[r], last - first + 1) << "rank " << r;
      EXPECT_EQ(wrong[r], 0) << "rank " << r;
      EXPECT_EQ(tensors[r], 1) << "rank " << r;
    }
  }
  // One bit changed in chunk 1 (rows 64..128) at row 100, column 700: in
  // the second column half, the second row third, and the slice.
  const ByteLocation& at = md->tensors.at("w").chunks.at(1).location;
  const std::string path = tmp.path() + "/" + at.file;
  const long offset =
      static_cast<long>(at.offset + ((100 - 64) * kCols + 700) * 4 + 1);
  ASSERT_TRUE(testing_util::FlipBits(path, offset, 0x40).ok());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<absl::Status> statuses = run(c, commits, wrong, tensors);
    ExpectChunk1Mismatch(statuses);
    for (int r = 0; r < c.world; ++r) {
      EXPECT_EQ(wrong[r], 0) << "rank " << r << " committed a wrong byte";
      EXPECT_EQ(tensors[r], 0) << "rank " << r;
    }
  }
  ASSERT_TRUE(testing_util::FlipBits(path, offset, 0x40).ok());
}

// The coordinator's check of strided parts (CheckSharedPieces on boxes and
// signatures): parts that tile a chunk, alone or with contiguous pieces,
// are checked; a wrong signature, or two ranks that read one box
// differently, is kDataLoss naming the chunk and ranks; gaps, overlaps and
// contiguous pieces that are not boxes leave the chunk unchecked; a box
// outside its chunk is an internal error, a truncated part kDataLoss.
TEST_F(FourRowChunksTest, CoordinatorChecksStridedPartsFromMessages) {
  using internal_checkpoint::CrcPiece;
  using internal_checkpoint::EncodeSharedPieces;
  using internal_checkpoint::SignedPart;
  // Chunk 1 is rows 64..128; a box of it signed the slow way: the linear
  // CRC of the chunk with everything outside the box zeroed.
  constexpr uint64_t kChunk = 64 * kCols * 4;
  auto sign = [&](const Box& box) {
    std::vector<float> masked(64 * kCols, 0.0f);
    for (int64_t i = 0; i < box.sizes[0]; ++i) {
      for (int64_t j = 0; j < box.sizes[1]; ++j) {
        const int64_t row = box.offsets[0] + i, col = box.offsets[1] + j;
        masked[(row - 64) * kCols + col] = full[row * kCols + col];
      }
    }
    return SignedPart{box, internal_format::Crc32cRaw(masked.data(), kChunk)};
  };
  auto message = [&](std::vector<SignedPart> parts,
                     std::vector<CrcPiece> pieces = {}) {
    absl::StatusOr<std::string> m =
        EncodeSharedPieces(*md, {{"w", 1, std::move(pieces), std::move(parts)}});
    EXPECT_TRUE(m.ok()) << m.status();
    return m.value_or("");
  };
  const Box left{{64, 0}, {64, 300}}, right{{64, 300}, {64, kCols - 300}};
  const std::string l = message({sign(left)}), r = message({sign(right)});
  // Tiled by two ranks, with a replica of the left part, or by one rank.
  EXPECT_EQ(Checked({l, r}), 1u);
  EXPECT_EQ(Checked({r, l, l}), 1u);
  EXPECT_EQ(Checked({message({sign(left), sign(right)})}), 1u);
  // Rows 64..80 as a contiguous piece, the rest as two blocks.
  const char* chunk1 = reinterpret_cast<const char*>(full.data() + 64 * kCols);
  const uint64_t top = 16 * kCols * 4;
  const CrcPiece rows{0, top, internal_format::Crc32c(chunk1, top)};
  const Box bl{{80, 0}, {48, 512}}, br{{80, 512}, {48, 512}};
  EXPECT_EQ(Checked({message({}, {rows}), message({sign(bl)}),
                     message({sign(br)})}),
            1u);

  // A wrong signature.
  SignedPart wrong = sign(right);
  wrong.signature ^= 0x100;
  const ByteLocation& at = md->tensors.at("w").chunks.at(1).location;
  ExpectError({l, message({wrong})}, absl::StatusCode::kDataLoss,
              absl::StrCat("crc32c mismatch in w@64,0 (", at.file, ", offset ",
                           at.offset, ", read in 2 parts by ranks 0, 1)"));
  // Replicas that read the same box differently.
  ExpectError({l, r, message({wrong})}, absl::StatusCode::kDataLoss,
              "ranks 1 and 2 read different bytes in");

  // Unchecked: a gap, an overlap (the volumes add up), and a contiguous
  // piece that is not a box (rows 64..80 and half of row 80).
  const Box narrow{{64, 300}, {64, kCols - 301}};
  const Box shifted{{64, 299}, {64, kCols - 300}};
  const Box wide{{64, 0}, {64, 301}};
  const CrcPiece ragged{0, top + 2048,
                        internal_format::Crc32c(chunk1, top + 2048)};
  EXPECT_EQ(Checked({l, message({sign(narrow)})}), 0u);
  EXPECT_EQ(Checked({message({sign(wide)}), message({sign(shifted)})}), 0u);
  EXPECT_EQ(Checked({message({}, {ragged}), message({sign(bl)}),
                     message({sign(br)})}),
            0u);

  // Malformed: truncated, a box outside the chunk or empty.
  ExpectError({l, r.substr(0, r.size() - 5)}, absl::StatusCode::kDataLoss,
              "chunk checksums from rank 1");
  for (const Box& outside : {Box{{0, 0}, {64, 300}}, Box{{64, 1000}, {64, 300}},
                             Box{{64, 0}, {0, 300}}}) {
    ExpectError({l, message({SignedPart{outside, 0}})},
                absl::StatusCode::kInternal, "chunk checksums from rank 1");
  }
}

// A load whose bytes are all in the page cache reads on one thread per core
// of its affinity mask, shared among the ranks the launcher says its node
// runs (copies gain nothing from more); one that needs the device reads on
// LoadOptions::io_threads, its queue depth. All bit-exact.
TEST(ReshardTest, CachedLoadsReadOnOneThreadPerCore) {
  TempDir tmp;
  constexpr int64_t kRows = 256, kCols = 1024;
  std::vector<float> full = Arange(kRows * kCols);
  ASSERT_TRUE(Save(RowChunked(full, kRows, kCols, 4), tmp.path()).ok());
  absl::StatusOr<Metadata> md = ReadMetadata(tmp.path());
  ASSERT_TRUE(md.ok()) << md.status();
  const std::string file = md->tensors.at("w").chunks.at(0).location.file;
  absl::StatusOr<std::unique_ptr<Storage>> storage = Storage::Open(tmp.path());
  ASSERT_TRUE(storage.ok()) << storage.status();
  absl::StatusOr<std::unique_ptr<ReadableFile>> f = (*storage)->OpenForRead(file);
  ASSERT_TRUE(f.ok()) << f.status();
  const uint64_t size = (*f)->size();
  constexpr int kThreads = 64;
  const char* const kLaunchers[] = {"LOCAL_WORLD_SIZE",
                                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                                    "MPI_LOCALNRANKS"};
  for (const char* name : kLaunchers) ::unsetenv(name);
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int cores = std::max(1, std::min<int>(kThreads, CPU_COUNT(&set)));
  auto load = [&]() -> absl::StatusOr<LoadResult> {
    std::vector<float> out(full.size(), -1.0f);
    StateDict sd;
    sd["w"] = TensorView(out.data(), DType::kF32, {kRows, kCols});
    LoadOptions options;
    options.io_threads = kThreads;
    absl::StatusOr<LoadResult> r = Load(sd, tmp.path(), options);
    if (r.ok() && out != full) return absl::InternalError("wrong bytes");
    return r;
  };
  // Out of the cache, where the filesystem lets it go (not tmpfs).
  const std::string path = tmp.path() + "/" + file;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (!(*f)->InMemory(0, size)) {
    absl::StatusOr<LoadResult> cold = load();
    ASSERT_TRUE(cold.ok()) << cold.status();
    EXPECT_EQ(cold->io_threads, kThreads);
  }
  // Cached.
  std::vector<std::byte> all(size);
  ASSERT_TRUE((*f)->ReadAtShared(0, std::span(all)).ok());
  ASSERT_TRUE((*f)->InMemory(0, size)) << "the data file is not cached";
  absl::StatusOr<LoadResult> warm = load();
  ASSERT_TRUE(warm.ok()) << warm.status();
  EXPECT_EQ(warm->io_threads, cores);
  // Ranks sharing the node share its cores; a value that is no count is
  // ignored.
  const struct {
    const char* name;
    const char* value;
    int want;
  } launchers[] = {
      {"LOCAL_WORLD_SIZE", "2", std::max(1, cores / 2)},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "4096", 1},
      {"MPI_LOCALNRANKS", "3", std::max(1, cores / 3)},
      {"LOCAL_WORLD_SIZE", "two", cores},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "0", cores},
  };
  for (const auto& l : launchers) {
    ::setenv(l.name, l.value, 1);
    absl::StatusOr<LoadResult> shared = load();
    ::unsetenv(l.name);
    ASSERT_TRUE(shared.ok()) << shared.status();
    EXPECT_EQ(shared->io_threads, l.want) << l.name << "=" << l.value;
  }
}

}  // namespace
}  // namespace cairn
