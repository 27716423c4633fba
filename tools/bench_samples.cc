// cairn bench, the child side: every sample runs in a child process that
// the parent forked (bench.cc, protocol step 2), the ranks as threads of
// it; each returns one JSON object for the parent.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_kv.h"
#include "bench_location.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "commands.h"
#include "core/parallel.h"
#include "core/status.h"
#include "synthetic_kv.h"
#include "rank_status.h"
#include "synthetic_model.h"
#include "bench_internal.h"

namespace cairn::tools::internal_bench {

using internal_core::Annotate;
using internal_core::StatusFromErrno;

namespace {

// One rank's part of one tensor, owned here.
struct Piece {
  const SyntheticTensor* tensor;
  Box box;
  Tensor buffer;
};

// Allocates this rank's part of every tensor and inserts a view of it into
// `sd`; fills it with the values (a save) or with NaN (a load destination:
// an element the load misses cannot pass verification, and the timed load
// does not pay the first touch of fresh memory, which is slow on VMs).
absl::Status BuildShards(const std::vector<SyntheticTensor>& tensors,
                         int rank, int world, int split_dim, bool values,
                         int threads, StateDict& sd,
                         std::vector<Piece>& pieces) {
  for (const SyntheticTensor& t : tensors) {
    std::optional<Box> box = PartBox(t, rank, world, split_dim);
    if (!box) continue;
    CAIRN_ASSIGN_OR_RETURN(Tensor buffer, Tensor::Empty(t.dtype, box->sizes));
    InsertLeaf(sd, t.fqn,
               ShardedTensor(t.dtype, t.shape, {{*box, buffer.view()}}));
    pieces.push_back({&t, *box, std::move(buffer)});
  }
  if (values) {
    for (const Piece& p : pieces) {
      CAIRN_RETURN_IF_ERROR(FillBox(*p.tensor, p.box, p.buffer.view(),
                                    kValueStep, threads));
    }
    return absl::OkStatus();
  }
  return internal_core::ParallelFor(
      static_cast<int64_t>(pieces.size()), threads, [&](int64_t i) {
        const Tensor& b = pieces[static_cast<size_t>(i)].buffer;
        uint32_t* p = static_cast<uint32_t*>(b.data());
        std::fill(p, p + b.nbytes() / sizeof(uint32_t), kPoison);
        return absl::OkStatus();
      });
}

// kDataLoss naming the FQN and element index of the first wrong element.
absl::Status VerifyPieces(const std::vector<Piece>& pieces, int threads) {
  for (const Piece& p : pieces) {
    CAIRN_ASSIGN_OR_RETURN(
        std::optional<Mismatch> bad,
        VerifyBox(*p.tensor, p.box, p.buffer.view(), kValueStep, threads));
    if (bad) {
      return absl::DataLossError(
          absl::StrCat("verification failed: ", bad->ToString()));
    }
  }
  return absl::OkStatus();
}

uint64_t PieceBytes(const std::vector<Piece>& pieces) {
  uint64_t total = 0;
  for (const Piece& p : pieces) total += p.buffer.nbytes();
  return total;
}

// Reads every file under `dir` once, so that a following read finds it in
// the page cache.
absl::Status ReadEveryFile(const fs::path& dir) {
  std::vector<char> buffer(size_t{8} << 20);
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    const std::string path = it->path().string();
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return StatusFromErrno(errno, "open", path);
    ssize_t n;
    while ((n = read(fd, buffer.data(), buffer.size())) != 0) {
      if (n < 0 && errno != EINTR) {
        const int err = errno;
        close(fd);
        return StatusFromErrno(err, "read", path);
      }
    }
    close(fd);
  }
  if (ec) return StatusFromErrno(ec.value(), "list", dir.string());
  return absl::OkStatus();
}

// Profiling only the timed operations: with CAIRN_BENCH_PERF_CTL naming
// the control FIFO of `perf record --control fifo:CTL[,ACK] -D -1`, rank 0
// turns perf's sampling on at the start of each timed operation and off
// after it; CAIRN_BENCH_PERF_KIND=save|async|load, or a row's name
// (load_same, load_4to2_cols, ...), limits that to one kind of phase or one
// row. With CAIRN_BENCH_PERF_ACK naming perf's ACK FIFO, each switch waits
// (up to 2 s) for perf to acknowledge it, and the load rows hold every rank
// until sampling is off before they check the elements, so the profile
// holds the timed operation alone. Unset (the normal case), this does
// nothing.
//
// The control FIFO CAIRN_BENCH_PERF_CTL names, or null when unset or empty.
const char* PerfControlPath() {
  static const char* path = [] {
    const char* p = std::getenv("CAIRN_BENCH_PERF_CTL");
    return p != nullptr && *p != '\0' ? p : nullptr;
  }();
  return path;
}

bool PerfControlled() { return PerfControlPath() != nullptr; }

void PerfControl(const char* kind, const std::string& row,
                 const char* command) {
  static const char* ack = std::getenv("CAIRN_BENCH_PERF_ACK");
  static const char* only = std::getenv("CAIRN_BENCH_PERF_KIND");
  const char* path = PerfControlPath();
  if (path == nullptr) return;
  if (only != nullptr && *only != '\0' && only != std::string_view(kind) &&
      only != row) {
    return;
  }
  const int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return;
  (void)!write(fd, command, strlen(command));
  close(fd);
  if (ack == nullptr || *ack == '\0') return;
  // perf holds its end of the FIFO open, so this open does not block.
  const int ack_fd = open(ack, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (ack_fd < 0) return;
  std::string got;
  pollfd p = {ack_fd, POLLIN, 0};
  while (got.find("ack\n") == std::string::npos && poll(&p, 1, 2000) > 0) {
    char buf[16];
    const ssize_t n = read(ack_fd, buf, sizeof(buf));
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  close(ack_fd);
}

// The load rows' LoadOptions from the command line (comm and planner
// left to the row).
LoadOptions BenchLoadOptions(const BenchOptions& o) {
  LoadOptions options;
  options.io_threads = o.io_threads;
  options.bounce_buffer_bytes = o.buffer_bytes;
  options.verify_checksums = o.verify_checksums;
  options.share_node_reads = o.node_reads;
  options.memory_budget_bytes = o.memory_budget_bytes;
  return options;
}

// load_sink's planner: every stored chunk, whole, into one sink; objects
// and scalars are left out. (A planner of its own: the default one needs
// destination memory, which this row must not hold.)
class AllChunksToSink : public LoadPlanner {
 public:
  explicit AllChunksToSink(std::shared_ptr<LoadSink> sink)
      : sink_(std::move(sink)) {}
  absl::Status SetUp(StateDict&, const Metadata& metadata, bool, int,
                     int) override {
    metadata_ = &metadata;
    return absl::OkStatus();
  }
  absl::StatusOr<LoadPlan> CreateLocalPlan() override {
    LoadPlan plan;
    for (const auto& [fqn, tm] : metadata_->tensors) {
      for (size_t c = 0; c < tm.chunks.size(); ++c) {
        if (tm.chunks[c].box.empty()) continue;
        plan.items.push_back(
            ReadItem{fqn, ItemKind::kTensor, -1, c, tm.chunks[c].box});
      }
    }
    return plan;
  }
  absl::StatusOr<std::vector<LoadPlan>> CreateGlobalPlan(
      std::vector<LoadPlan> plans) override {
    return plans;
  }
  absl::StatusOr<LoadPlan> FinishPlan(LoadPlan plan) override { return plan; }
  absl::StatusOr<Destination> ResolveDestination(const ReadItem&) override {
    return Destination{{}, nullptr, sink_};
  }
  absl::Status CommitChunk(const ReadItem&) override { return absl::OkStatus(); }

 private:
  const Metadata* metadata_ = nullptr;
  std::shared_ptr<LoadSink> sink_;
};

// Takes checked bytes and drops them, keeping one byte of each piece (so
// that nothing is optimized away) and the bytes it was given.
class DiscardingSink : public LoadSink {
 public:
  absl::Status Write(const ReadItem&, const Box&,
                     std::span<const std::byte> bytes) override {
    taken += bytes.size();
    if (!bytes.empty()) mix ^= static_cast<uint8_t>(bytes[bytes.size() / 2]);
    return absl::OkStatus();
  }
  uint64_t taken = 0;
  uint8_t mix = 0;
};

}  // namespace

std::optional<Box> PartBox(const SyntheticTensor& t, int rank, int world,
                           int split_dim) {
  Box box = Box::Full(t.shape);
  if (t.shape.empty()) return box;  // 0-d: every rank holds it
  const size_t d = t.shape.size() > 1 ? static_cast<size_t>(split_dim) : 0;
  const int64_t n = t.shape[d];
  const int64_t lo = n * rank / world;
  const int64_t hi = n * (rank + 1) / world;
  if (hi <= lo) return std::nullopt;
  box.offsets[d] = lo;
  box.sizes[d] = hi - lo;
  return box;
}

double MonotonicSeconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::Status DropPageCache() {
  sync();
  const int fd = open(kDropCaches, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return StatusFromErrno(errno, "open", kDropCaches);
  const ssize_t n = write(fd, "3\n", 2);
  const int err = errno;
  close(fd);
  if (n != 2) return StatusFromErrno(n < 0 ? err : EIO, "write", kDropCaches);
  return absl::OkStatus();
}

absl::Status Prewarm(const fs::path& dir, bool drop) {
  // Object storage: no page cache on this side to prepare.
  if (IsObjectStoreUrl(dir.string())) return absl::OkStatus();
  if (drop) CAIRN_RETURN_IF_ERROR(DropPageCache());
  CAIRN_RETURN_IF_ERROR(ReadEveryFile(dir));
  return ReadEveryFile(dir);
}

absl::StatusOr<json> SaveSample(const std::vector<SyntheticTensor>& tensors,
                                int world, const std::string& url,
                                int threads, const BenchOptions& o) {
  Span span(world);
  std::vector<uint64_t> held(static_cast<size_t>(world));
  absl::Status status = CombineRankStatuses(
      RunInProcess(world, [&](Communicator& comm) -> absl::Status {
        const int rank = comm.rank();
        StateDict sd;
        std::vector<Piece> pieces;
        absl::Status s = BuildShards(tensors, rank, world, 0, true, threads,
                                     sd, pieces);
        CAIRN_RETURN_IF_ERROR(AgreeOnStatus(comm, s));
        held[static_cast<size_t>(rank)] = PieceBytes(pieces);
        SaveOptions options;
        options.comm = &comm;
        options.io_threads = o.io_threads;
        options.write_buffer_bytes = o.buffer_bytes;
        ApplyCodec(o.codec, options);
        CAIRN_RETURN_IF_ERROR(comm.Barrier());
        if (rank == 0) {
          PerfControl("save", "save_sync", "enable\n");
          span.MarkCpuStart();
        }
        span.start[static_cast<size_t>(rank)] = MonotonicSeconds();
        absl::StatusOr<SaveResult> saved = Save(sd, url, options);
        span.end[static_cast<size_t>(rank)] = MonotonicSeconds();
        CAIRN_RETURN_IF_ERROR(comm.Barrier());
        if (rank == 0) {
          span.MarkCpuEnd();
          PerfControl("save", "save_sync", "disable\n");
        }
        return saved.status();  // Save agreed on it across the ranks
      }));
  if (!status.ok()) return status;
  uint64_t total = 0;
  for (uint64_t h : held) total += h;
  json out = {{"seconds", span.Wall()},
              {"rank_seconds", span.RankSeconds()},
              {"held_bytes", total}};
  out.update(span.Cpu());
  return out;
}

absl::StatusOr<json> AsyncSample(const std::vector<SyntheticTensor>& tensors,
                                 int world, const fs::path& first_dir,
                                 const fs::path& dir, int threads,
                                 const BenchOptions& o) {
  SaveOptions save_options;
  save_options.io_threads = o.io_threads;
  save_options.write_buffer_bytes = o.buffer_bytes;
  ApplyCodec(o.codec, save_options);
  const std::string urls[2] = {first_dir.string(), dir.string()};
  Span blocked[2] = {Span(world), Span(world)};
  Span total[2] = {Span(world), Span(world)};
  std::vector<int64_t> allocations(static_cast<size_t>(world));
  absl::Status status = CombineRankStatuses(
      RunInProcess(world, [&](Communicator& comm) -> absl::Status {
        const int rank = comm.rank();
        const size_t r = static_cast<size_t>(rank);
        StateDict sd;
        std::vector<Piece> pieces;
        absl::Status s = BuildShards(tensors, rank, world, 0, true, threads,
                                     sd, pieces);
        CAIRN_RETURN_IF_ERROR(AgreeOnStatus(comm, s));
        absl::StatusOr<std::unique_ptr<AsyncSaver>> saver =
            AsyncSaver::Create(&comm);
        CAIRN_RETURN_IF_ERROR(AgreeOnStatus(comm, saver.status()));
        for (int i = 0; i < 2; ++i) {
          CAIRN_RETURN_IF_ERROR(comm.Barrier());
          const double start = MonotonicSeconds();
          blocked[i].start[r] = total[i].start[r] = start;
          if (rank == 0 && i == 1) {
            PerfControl("async", "async_save", "enable\n");
          }
          absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> handle =
              (*saver)->Save(sd, urls[i], save_options);
          blocked[i].end[r] = MonotonicSeconds();
          if (rank == 0 && i == 1) {
            PerfControl("async", "async_save", "disable\n");
          }
          // A staging failure is this rank's alone; agree before waiting.
          CAIRN_RETURN_IF_ERROR(AgreeOnStatus(comm, handle.status()));
          absl::StatusOr<SaveResult> saved = (*handle)->Wait();
          total[i].end[r] = MonotonicSeconds();
          CAIRN_RETURN_IF_ERROR(AgreeOnStatus(comm, saved.status()));
          if (i == 0) {
            // Only the second save is kept: free the disk space now.
            CAIRN_RETURN_IF_ERROR(AgreeOnStatus(
                comm, rank == 0 ? RemoveLocation(first_dir.string())
                                : absl::OkStatus()));
          }
        }
        // Wait() said it succeeded; make sure it really committed.
        CAIRN_RETURN_IF_ERROR(AgreeOnStatus(
            comm, rank == 0 ? ReadMetadata(urls[1]).status()
                            : absl::OkStatus()));
        allocations[r] = (*saver)->staging_allocations();
        return absl::OkStatus();
      }));
  if (!status.ok()) return status;
  int64_t allocs = 0;
  for (int64_t a : allocations) allocs += a;
  return json{{"blocked_seconds", blocked[1].Wall()},
              {"seconds", total[1].Wall()},
              {"rank_seconds", total[1].RankSeconds()},
              {"rank_blocked_seconds", blocked[1].RankSeconds()},
              {"first_blocked_seconds", blocked[0].Wall()},
              {"first_seconds", total[0].Wall()},
              {"staging_allocations", allocs}};
}

absl::StatusOr<json> LoadSample(const std::vector<SyntheticTensor>& tensors,
                                const LoadTarget& target, bool cold,
                                bool can_drop, const fs::path& dir,
                                int threads, const BenchOptions& o) {
  const int world = target.ranks;
  Span span(world);
  std::vector<LoadResult> results(static_cast<size_t>(world));
  std::vector<uint64_t> verified(static_cast<size_t>(world));
  absl::Status status = CombineRankStatuses(
      RunInProcess(world, [&](Communicator& comm) -> absl::Status {
        const int rank = comm.rank();
        const size_t r = static_cast<size_t>(rank);
        StateDict sd;
        std::vector<Piece> pieces;
        absl::Status s = BuildShards(tensors, rank, world, target.split_dim,
                                     false, threads, sd, pieces);
        CAIRN_RETURN_IF_ERROR(AgreeOnStatus(comm, s));
        if (rank == 0) s = cold ? DropPageCache() : Prewarm(dir, can_drop);
        CAIRN_RETURN_IF_ERROR(AgreeOnStatus(comm, s));
        LoadOptions options = BenchLoadOptions(o);
        options.comm = &comm;
        CAIRN_RETURN_IF_ERROR(comm.Barrier());
        if (rank == 0) {
          PerfControl("load", target.name, "enable\n");
          span.MarkCpuStart();
        }
        span.start[r] = MonotonicSeconds();
        absl::StatusOr<LoadResult> loaded = Load(sd, dir.string(), options);
        span.end[r] = MonotonicSeconds();
        CAIRN_RETURN_IF_ERROR(comm.Barrier());
        if (rank == 0) {
          span.MarkCpuEnd();
          PerfControl("load", target.name, "disable\n");
        }
        // The same on every rank (an environment variable).
        if (PerfControlled()) CAIRN_RETURN_IF_ERROR(comm.Barrier());
        if (!loaded.ok()) return loaded.status();
        results[r] = *std::move(loaded);
        CAIRN_RETURN_IF_ERROR(VerifyPieces(pieces, threads));
        verified[r] = PieceBytes(pieces);
        return absl::OkStatus();
      }));
  if (!status.ok()) return status;
  uint64_t bytes_read = 0, bytes_verified = 0, chunks_checked = 0;
  for (uint64_t v : verified) bytes_verified += v;
  // Bytes and chunks over the ranks; the slowest rank's time in each phase.
  LoadPhaseTimes slowest;
  for (const LoadResult& result : results) {
    bytes_read += result.bytes_read;
    chunks_checked += result.chunks_verified;
    const LoadPhaseTimes& p = result.phases;
    slowest.metadata = std::max(slowest.metadata, p.metadata);
    slowest.planning = std::max(slowest.planning, p.planning);
    slowest.read = std::max(slowest.read, p.read);
    slowest.broadcast = std::max(slowest.broadcast, p.broadcast);
    slowest.copy = std::max(slowest.copy, p.copy);
    slowest.staging = std::max(slowest.staging, p.staging);
  }
  json out = {{"seconds", span.Wall()},
              {"rank_seconds", span.RankSeconds()},
              {"phase_seconds",
               {{"metadata", slowest.metadata},
                {"planning", slowest.planning},
                {"read", slowest.read},
                {"broadcast", slowest.broadcast},
                {"copy", slowest.copy},
                {"staging", slowest.staging}}},
              {"storage_bytes_read", bytes_read},
              {"verified_bytes", bytes_verified},
              {"chunks_crc_checked", chunks_checked}};
  out.update(span.Cpu());
  return out;
}

absl::StatusOr<json> LoadSinkSample(bool cold, bool can_drop,
                                    const fs::path& dir, const BenchOptions& o) {
  CAIRN_RETURN_IF_ERROR(cold ? DropPageCache() : Prewarm(dir, can_drop));
  auto sink = std::make_shared<DiscardingSink>();
  AllChunksToSink planner(sink);
  StateDict none;
  LoadOptions options = BenchLoadOptions(o);
  options.planner = &planner;
  const double t0 = MonotonicSeconds();
  CAIRN_ASSIGN_OR_RETURN(LoadResult r, Load(none, dir.string(), options));
  const double seconds = MonotonicSeconds() - t0;
  return json{{"seconds", seconds},
              {"sink_bytes", sink->taken},
              {"storage_bytes_read", r.bytes_read},
              {"bytes_unverified", r.bytes_unverified},
              {"chunks_crc_checked", r.chunks_verified}};
}

absl::StatusOr<json> MemcpySample(uint64_t bytes, int threads) {
  const Shape shape = {static_cast<int64_t>(bytes)};
  CAIRN_ASSIGN_OR_RETURN(Tensor src, Tensor::Empty(DType::kU8, shape));
  CAIRN_ASSIGN_OR_RETURN(Tensor dst, Tensor::Empty(DType::kU8, shape));
  char* s = static_cast<char*>(src.data());
  char* d = static_cast<char*>(dst.data());
  std::memset(s, 0x5A, bytes);
  std::memset(d, 0, bytes);
  double single = 0;
  for (int i = 0; i < kMemcpyIterations; ++i) {
    const double t0 = MonotonicSeconds();
    std::memcpy(d, s, bytes);
    const double t = MonotonicSeconds() - t0;
    if (i == 0 || t < single) single = t;
  }
  if (std::memcmp(s, d, bytes) != 0) {
    return absl::InternalError("memcpy produced a wrong copy");
  }
  json out = {{"bytes", bytes},
              {"iterations", kMemcpyIterations},
              {"seconds", single},
              {"gb_per_s", GigabytesPerSecond(bytes, single)},
              {"threads", threads},
              {"parallel_seconds", nullptr},
              {"parallel_gb_per_s", nullptr}};
  if (threads <= 1) return out;
  // Slices on 4 KiB boundaries. Each iteration starts `threads` threads,
  // each copying its slice, and times from before the first starts to after
  // the last is joined (thread start-up, tens of microseconds, included).
  const uint64_t slice = (bytes / static_cast<uint64_t>(threads) + 4095) /
                         4096 * 4096;
  double parallel = 0;
  for (int i = 0; i < kMemcpyIterations; ++i) {
    std::memset(d, 0, bytes);  // no copy can find the previous one's bytes
    const double t0 = MonotonicSeconds();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      const uint64_t begin =
          std::min(bytes, slice * static_cast<uint64_t>(t));
      const uint64_t end = std::min(bytes, begin + slice);
      workers.emplace_back(
          [=] { std::memcpy(d + begin, s + begin, end - begin); });
    }
    for (std::thread& w : workers) w.join();
    const double t = MonotonicSeconds() - t0;
    if (i == 0 || t < parallel) parallel = t;
  }
  if (std::memcmp(s, d, bytes) != 0) {
    return absl::InternalError("parallel memcpy produced a wrong copy");
  }
  out["parallel_seconds"] = parallel;
  out["parallel_gb_per_s"] = GigabytesPerSecond(bytes, parallel);
  return out;
}

}  // namespace cairn::tools::internal_bench
