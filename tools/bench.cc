// cairn bench: measures cairn's save and load on the user's storage, the
// cairn half of the benchmark harness. bench/peers/torch_peer.py measures
// PyTorch on the same tensors (the model JSON that --model-out writes), and
// the result rows of the two pair by name: torch_peer's dcp_load_4to2_rows
// is load_4to2_rows here, with the same "kind" and "cache".
//
// Protocol:
//  1. The parent chooses the synthetic model for --size (synthetic_model.h:
//     float32 tensors only, the same every time for a given size), checks
//     that twice the state fits in memory and on the disk under --dir,
//     creates --dir if missing and a fresh work folder in it, finds out
//     whether the page cache can be dropped (--cold), and writes
//     --model-out.
//  2. Every sample of every phase runs in a child process forked from the
//     parent. The parent never starts a thread (no cairn save or load, no
//     ParallelFor, no ProgressLine), so fork() is safe, and the child's own
//     ru_maxrss (from wait4) is the phase's peak RSS, not the sum of all
//     phases so far. The child runs the ranks as threads of itself
//     (RunInProcess, like `cairn demo --comm inproc`), writes one JSON
//     object to a pipe and leaves with _exit. A child that fails or dies
//     fails the run, naming the phase and the child's exit status or
//     signal. The parent calls sync() before each fork, so no dirty data
//     from earlier is flushed inside a timer.
//  3. Sharding, as torch_peer.py's build_sharded_state and part(): a tensor
//     of rank >= 1 is split on one dimension into W parts, rank k holding
//     [n*k/W, n*(k+1)/W) (integer division; a rank whose part is empty
//     holds no shard of it); 0-d tensors are replicated on every rank.
//     Saves split dim 0; loads split dim 0 ("rows") or dim 1 ("cols"; 1-D
//     tensors fall back to dim 0). Element i of tensor `fqn` holds
//     ElementValue(FqnSeed(fqn), i, 0), so any rank builds its own part and
//     every loaded element is checked bit for bit.
//  4. Timing: every rank waits at a barrier, reads CLOCK_MONOTONIC, runs
//     the collective operation and reads the clock again; a sample's time
//     is the last end minus the first start over the ranks (the whole
//     collective's wall time). --repeat N reports the median of N samples,
//     each in a fresh child.
//  5. Phases, in order (see the --help footer for what each measures):
//     save_sync, async_save, the loads (load_same, load_WtoW/2_rows/_cols,
//     load_WtoW-1_rows/_cols; each cold, then warm), load_sink (one rank
//     streams every stored byte into a sink that drops it once checked,
//     within --memory-budget; its peak RSS must stay within the budget +
//     128 MiB), memcpy.
//  6. The parent prints the table or the JSON object and removes the work
//     folder unless --keep.
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

namespace cairn::tools {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using internal_core::Annotate;
using internal_core::StatusFromErrno;

// In-process ranks are threads, each with its own IO threads.
constexpr int kMaxInProcessRanks = 256;
constexpr uint32_t kPoison = 0x7FC0DEADu;  // a quiet NaN
constexpr char kDropCaches[] = "/proc/sys/vm/drop_caches";
// The values are a function of (FQN, element index) only.
constexpr int64_t kValueStep = 0;
// A phase's peak RSS may exceed the tensor bytes it holds by this much
// (cairn's IO buffers, the binary) before the run says so.
constexpr uint64_t kRssSlack = uint64_t{256} << 20;
constexpr uint64_t kMemcpyMaxBytes = uint64_t{1} << 30;
constexpr int kMemcpyIterations = 5;

struct BenchOptions {
  std::string dir;
  CodecFlags codec;  // every save's (the load rows read save_sync's)
  std::string size = "256MiB";
  int ranks = 4;
  bool json = false;
  std::string cold = "auto";
  std::string model_out;
  // Which phases run: save, async, load (needs save's checkpoint, so it
  // implies save), memcpy.
  std::vector<std::string> phases = {"save", "async", "load", "sink", "memcpy"};
  int repeat = 1;
  int io_threads = SaveOptions{}.io_threads;             // per rank
  std::string buffer = absl::StrCat(SaveOptions{}.write_buffer_bytes);
  uint64_t buffer_bytes = SaveOptions{}.write_buffer_bytes;  // parsed
  bool keep = false;
  bool quiet = false;
  // LoadOptions::verify_checksums (--no-verify clears it).
  bool verify_checksums = LoadOptions{}.verify_checksums;
  // LoadOptions::share_node_reads (--node-reads sets it).
  bool node_reads = LoadOptions{}.share_node_reads;
  // LoadOptions::memory_budget_bytes of every load row; the load_sink row
  // checks its peak RSS against it.
  std::string memory_budget = "256MiB";
  uint64_t memory_budget_bytes = uint64_t{256} << 20;  // parsed
};

// A load layout: `ranks` ranks, each holding part k of `split_dim`.
struct LoadTarget {
  std::string name;  // "load_same", "load_4to2_rows", ...
  int ranks = 1;
  int split_dim = 0;
};

// torch_peer.py's targets: the save layout, then W/2 and W-1 ranks (when
// they differ from 0 and W, each once, ascending), rows then columns.
std::vector<LoadTarget> LoadTargets(int w) {
  std::vector<LoadTarget> out = {{"load_same", w, 0}};
  std::set<int> others = {w / 2, w - 1};
  others.erase(0);
  others.erase(w);
  for (int w2 : others) {
    out.push_back({absl::StrCat("load_", w, "to", w2, "_rows"), w2, 0});
    out.push_back({absl::StrCat("load_", w, "to", w2, "_cols"), w2, 1});
  }
  return out;
}

// The box rank `rank` of `world` holds of `t` (torch_peer.py's part()), or
// nullopt when that part is empty.
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

// Tensor bytes all `world` ranks hold together (the state bytes, plus the
// copies of replicated 0-d tensors).
uint64_t HeldBytes(const std::vector<SyntheticTensor>& tensors, int world,
                   int split_dim) {
  uint64_t total = 0;
  for (int r = 0; r < world; ++r) {
    for (const SyntheticTensor& t : tensors) {
      if (std::optional<Box> box = PartBox(t, r, world, split_dim)) {
        total += static_cast<uint64_t>(box->num_elements()) *
                 DTypeSize(t.dtype);
      }
    }
  }
  return total;
}

double MonotonicSeconds() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Start and end of one collective operation on each rank.
struct Span {
  explicit Span(int ranks)
      : start(static_cast<size_t>(ranks)), end(static_cast<size_t>(ranks)) {}
  // The last end minus the first start.
  double Wall() const {
    return *std::max_element(end.begin(), end.end()) -
           *std::min_element(start.begin(), start.end());
  }
  json RankSeconds() const {
    json out = json::array();
    for (size_t r = 0; r < start.size(); ++r) out.push_back(end[r] - start[r]);
    return out;
  }
  // CPU seconds (user + system, and system alone) the whole process spent
  // between MarkCpuStart and MarkCpuEnd (rank 0 calls them at the barriers
  // around the timed call): a figure other load on the machine disturbs
  // far less than wall time, for comparing two builds of cairn.
  // Also the bytes the process made the block layer read from the device
  // (ru_inblock, 512-byte units on Linux; O_DIRECT and page-cache misses
  // alike, page-cache hits not): what the storage served, where
  // storage_bytes_read is what the ranks asked for.
  // And the object storage requests the process sent meanwhile.
  void MarkCpuStart() {
    cpu_start = ProcessCpu();
    requests_start = ObjectStoreRequests();
  }
  void MarkCpuEnd() {
    cpu_end = ProcessCpu();
    requests_end = ObjectStoreRequests();
  }
  json Cpu() const {
    return json{{"cpu_seconds", cpu_end.cpu - cpu_start.cpu},
                {"requests", requests_end - requests_start},
                {"sys_seconds", cpu_end.sys - cpu_start.sys},
                {"device_bytes_read",
                 (cpu_end.inblock - cpu_start.inblock) * uint64_t{512}}};
  }
  std::vector<double> start, end;
  uint64_t requests_start = 0, requests_end = 0;
  struct Usage {
    double cpu = 0, sys = 0;
    uint64_t inblock = 0;
  };
  Usage cpu_start, cpu_end;

 private:
  static Usage ProcessCpu() {
    struct rusage u {};
    getrusage(RUSAGE_SELF, &u);
    auto sec = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
    return {sec(u.ru_utime) + sec(u.ru_stime), sec(u.ru_stime),
            static_cast<uint64_t>(u.ru_inblock)};
  }
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double MiB(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// --- Child side: runs in a forked child, ranks as threads ---------------

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

// sync, then echo 3 > /proc/sys/vm/drop_caches: the next read of any file
// comes from the device.
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

// The page cache of a warm load: every file under `dir` cached as after two
// earlier reads, whatever the load before did. With `drop` the cache is
// emptied first. Two reads, because the kernel moves a file page to its
// active list on its second read (LRU locking per folio), work that would
// otherwise fall inside whichever timed load happens to read the page
// second: a cold load that read through the page cache (the peer's, and
// cairn's column reshards) leaves it to the prewarm, one that read O_DIRECT
// (cairn's row loads) to the warm load (a 2 GiB load_same here: 0.146-0.203
// s in four runs after an O_DIRECT cold load, 0.115-0.118 s with --cold
// none, where every page had been read more than once). The drop also
// discards the small folios that concurrent buffered reads leave
// (readahead sees them as random), which make every later mapping of the
// file cost per 4 KiB page.
absl::Status Prewarm(const fs::path& dir, bool drop) {
  // Object storage: no page cache on this side to prepare.
  if (IsObjectStoreUrl(dir.string())) return absl::OkStatus();
  if (drop) CAIRN_RETURN_IF_ERROR(DropPageCache());
  CAIRN_RETURN_IF_ERROR(ReadEveryFile(dir));
  return ReadEveryFile(dir);
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

// save_sync: the W ranks fill their shards, then one timed Save.
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

// async_save: an AsyncSaver on the W ranks saves the state twice, each
// timed from a barrier to Save() returning (blocked) and to Wait()
// returning (total). The first save's stager allocates its host buffers;
// the second reuses them, as every save of a training loop after the first
// does, and is the one reported.
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

// load_*: the target's ranks allocate their destinations (NaN), rank 0
// drops the page cache (cold) or prepares it (warm: Prewarm, dropping it
// first when `can_drop`), then one timed Load; then every element is
// checked.
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

// load_sink: one rank loads every stored byte into a sink that discards it
// once checked, within --memory-budget: the row's peak RSS is what
// streaming holds, with no destination memory at all.
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

// memcpy: host memory bandwidth, the physical limit of a warm load (which
// copies from the page cache into the destinations). Two touched buffers
// of `bytes`; the best of kMemcpyIterations copies on one thread, then on
// `threads` threads each copying its own slice.
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

// --- Parent side ------------------------------------------------------------

// What a child sent, and its peak RSS.
struct ChildResult {
  json value;
  uint64_t peak_rss_bytes = 0;
};

absl::Status WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return StatusFromErrno(n < 0 ? errno : EIO, "write", "pipe");
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Runs `fn` in a forked child and returns what it computed, with the
// child's peak RSS. Must be called while this process has one thread.
absl::StatusOr<ChildResult> RunInChild(
    const std::function<absl::StatusOr<json>()>& fn) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return StatusFromErrno(errno, "pipe", "");
  // Buffered output would otherwise be written twice, once by the child.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(fds[0]);
    close(fds[1]);
    return StatusFromErrno(err, "fork", "");
  }
  if (pid == 0) {
    close(fds[0]);
    json reply;
    int code = 0;
    try {
      absl::StatusOr<json> result = fn();
      if (result.ok()) {
        reply = {{"ok", *std::move(result)}};
      } else {
        reply = {{"code", static_cast<int>(result.status().code())},
                 {"message", std::string(result.status().message())}};
        code = 1;
      }
    } catch (const std::exception& e) {
      reply = {{"code", static_cast<int>(absl::StatusCode::kInternal)},
               {"message", absl::StrCat("internal error: ", e.what())}};
      code = 1;
    }
    // An error message may hold bytes that are not UTF-8 (a file name).
    (void)WriteAll(fds[1], reply.dump(-1, ' ', false,
                                      json::error_handler_t::replace));
    close(fds[1]);
    _exit(code);  // no atexit handlers, no second flush of the parent's
  }
  close(fds[1]);
  std::string text;
  char buffer[65536];
  while (true) {
    const ssize_t n = read(fds[0], buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  close(fds[0]);
  int wstatus = 0;
  struct rusage usage = {};
  while (wait4(pid, &wstatus, 0, &usage) < 0) {
    if (errno != EINTR) return StatusFromErrno(errno, "wait4", "");
  }
  ChildResult out;
  out.peak_rss_bytes = static_cast<uint64_t>(usage.ru_maxrss) * 1024;  // KiB
  const json reply = json::parse(text, nullptr, false);
  const bool has_error = reply.is_object() && reply.contains("message") &&
                         reply["message"].is_string() &&
                         reply.contains("code") &&
                         reply["code"].is_number_integer();
  if (WIFSIGNALED(wstatus)) {
    const int sig = WTERMSIG(wstatus);
    return absl::AbortedError(absl::StrFormat(
        "the phase's child process was killed by signal %d (%s)%s", sig,
        strsignal(sig),
        sig == SIGKILL ? "; out of memory? try a smaller --size" : ""));
  }
  const int exit_status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1;
  if (has_error) {
    return absl::Status(
        static_cast<absl::StatusCode>(reply["code"].get<int>()),
        absl::StrCat(reply["message"].get<std::string>(),
                     " (child process exit status ", exit_status, ")"));
  }
  if (exit_status != 0 || !reply.is_object() || !reply.contains("ok")) {
    return absl::InternalError(absl::StrCat(
        "the phase's child process exited with status ", exit_status,
        " without a result"));
  }
  out.value = reply["ok"];
  return out;
}

double Num(const json& j, const char* key) {
  return j.is_object() && j.contains(key) && j[key].is_number()
             ? j[key].get<double>()
             : 0.0;
}

// One result row, as torch_peer.py's record() makes them.
struct Row {
  Row(std::string name_in, std::string kind_in,
      std::optional<std::string> cache_in, int ranks_in)
      : name(std::move(name_in)),
        kind(std::move(kind_in)),
        cache(std::move(cache_in)),
        ranks(ranks_in) {}
  std::string name;
  std::string kind;                  // "save", "async", "load"
  std::optional<std::string> cache;  // "cold", "warm"; none for saves
  int ranks = 0;
  std::vector<double> samples;       // seconds
  std::vector<double> blocked;       // async: seconds until Save() returned
  std::vector<json> rank_seconds;    // per sample
  std::vector<double> cpu, sys;      // save, load: process CPU seconds
  std::vector<double> requests;      // save, load: object storage requests
  uint64_t peak_rss_bytes = 0;       // the largest over the samples
  uint64_t dest_bytes = 0;
  json extra = json::object();       // kind-specific fields
  double seconds() const { return Median(samples); }
};

class Bench {
 public:
  explicit Bench(const BenchOptions& o) : o_(o) {}
  // 0, or the exit status after printing the error.
  int Run();

 private:
  template <typename... Args>
  void Log(const absl::FormatSpec<Args...>& format, const Args&... args) {
    if (!o_.quiet) {
      std::cerr << "cairn bench: " << absl::StrFormat(format, args...)
                << std::endl;
    }
  }
  absl::Status Prepare();
  absl::Status WriteModel() const;
  // One child per sample; logs it. `what` names it in errors.
  absl::StatusOr<ChildResult> Sample(
      const std::string& what, const std::function<absl::StatusOr<json>()>& fn);
  absl::Status RunSave();
  absl::Status RunAsync();
  absl::Status RunLoads();
  absl::Status RunMemcpy();
  // The key-value table rows (bench_kv.cc).
  absl::Status RunKv();
  // One memcpy sample, kept in memcpy_samples_.
  absl::Status TakeMemcpySample(const std::string& what);
  bool Wanted(const char* phase) const {
    return std::find(o_.phases.begin(), o_.phases.end(), phase) !=
           o_.phases.end();
  }
  void CheckRss();
  int FillThreads(int ranks) const {
    return std::max(1, DefaultThreads() / ranks);
  }
  const Row* FindRow(const std::string& name,
                     std::optional<std::string> cache) const;
  // Parallel memcpy when there is more than one core, else single.
  double MemcpyLimit() const;
  json ToJson() const;
  void PrintTable() const;

  const BenchOptions& o_;
  SyntheticModel model_;
  std::vector<SyntheticTensor> tensors_;  // the non-empty ones
  uint64_t bytes_ = 0;                    // float32 bytes of tensors_
  std::string dir_;                       // absolute --dir
  fs::path work_;                         // dir_/cairn_bench_<pid>_<time>
  bool can_drop_ = false;
  std::vector<std::string> notes_;     // methodology, in the JSON
  std::vector<std::string> findings_;  // in the JSON notes and the table
  std::vector<Row> rows_;
  json memcpy_;                       // the median of memcpy_samples_
  std::vector<json> memcpy_samples_;  // each a MemcpySample
};

absl::Status Bench::Prepare() {
  // 1. The model.
  CAIRN_ASSIGN_OR_RETURN(uint64_t target, ParseByteSize(o_.size));
  CAIRN_ASSIGN_OR_RETURN(SyntheticConfig config, ChooseConfig(target));
  CAIRN_ASSIGN_OR_RETURN(model_, BuildModel(config));
  std::vector<std::string> empty;
  for (const SyntheticTensor& t : model_.tensors) {
    if (t.dtype != DType::kF32) {
      return absl::InternalError(absl::StrCat(
          t.fqn, ": the benchmark model must be float32 (torch_peer.py "
                 "reads only float32)"));
    }
    if (t.num_elements() == 0) {
      empty.push_back(t.fqn);
      continue;
    }
    tensors_.push_back(t);
    bytes_ += t.nbytes();
  }
  if (!empty.empty()) {
    // torch_peer.py rejects empty tensors; leave them out on both sides.
    findings_.push_back(absl::StrCat(
        "left out ", Plural(empty.size(), "tensor"),
        " with no elements (torch_peer.py rejects them): ", empty.front(),
        empty.size() > 1 ? ", ..." : ""));
  }

  // 2. Memory: the async phase holds the state and its staged copy.
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0) {
    const uint64_t physical =
        static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
    const uint64_t need = 2 * bytes_ + kRssSlack;
    if (need > physical / 10 * 9) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the benchmark needs about ", HumanBytes(need),
          " of memory (the async save holds the state, ", HumanBytes(bytes_),
          ", and a staged copy of it), and this machine has ",
          HumanBytes(physical), "; pass a smaller --size"));
    }
  }

  // 3. --dir and the work folder in it.
  dir_ = NormalizeUrl(o_.dir);
  if (IsObjectStoreUrl(dir_)) {
    work_ = JoinLocation(dir_, absl::StrFormat(
                                   "cairn_bench_%d_%d", getpid(),
                                   static_cast<int64_t>(time(nullptr))));
    CAIRN_RETURN_IF_ERROR(
        Annotate(Storage::Open(work_.string()).status(), "--dir"));
    findings_.push_back(
        "object storage: every load reads from the store (there is no "
        "page cache on this side to drop or warm), so there are no cold "
        "rows and the warm rows are reads from the store; requests are "
        "counted per GiB of state");
    return absl::OkStatus();
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    return Annotate(StatusFromErrno(ec.value(), "create directory", dir_),
                    "--dir");
  }
  work_ = fs::path(dir_) / absl::StrFormat("cairn_bench_%d_%d", getpid(),
                                           static_cast<int64_t>(time(nullptr)));
  if (mkdir(work_.c_str(), 0755) != 0) {
    return Annotate(StatusFromErrno(errno, "create directory", work_.string()),
                    "--dir is not writable");
  }
  // Disk: the sync checkpoint and one async checkpoint at a time.
  struct statvfs vfs = {};
  if (statvfs(work_.c_str(), &vfs) == 0) {
    const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    const uint64_t need = 2 * (bytes_ + bytes_ / 100) + (uint64_t{64} << 20);
    if (avail < need) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the benchmark writes two checkpoints of about ", HumanBytes(bytes_),
          " under ", dir_, ", which has ", HumanBytes(avail),
          " free; pass a smaller --size or another --dir"));
    }
  }

  // 4. Cold reads: drop the page cache once now, to prove it works (a
  // container may refuse it even to root).
  if (o_.cold == "none") {
    findings_.push_back("cold rows skipped: --cold none");
  } else {
    absl::Status can;
    if (geteuid() != 0) {
      can = absl::PermissionDeniedError(
          absl::StrCat("not running as root, so ", kDropCaches,
                       " cannot be written"));
    } else {
      can = DropPageCache();
    }
    can_drop_ = can.ok();
    if (!can.ok()) {
      if (o_.cold == "drop") {
        return absl::FailedPreconditionError(absl::StrCat(
            "--cold drop: cannot drop the page cache: ", can.message()));
      }
      findings_.push_back(
          absl::StrCat("cold rows skipped: ", can.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Bench::WriteModel() const {
  json tensors = json::array();
  for (const SyntheticTensor& t : tensors_) {
    tensors.push_back(
        {{"fqn", t.fqn}, {"shape", t.shape}, {"dtype", "float32"}});
  }
  const json j = {{"bytes", bytes_}, {"tensors", std::move(tensors)}};
  const std::string tmp = o_.model_out + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << j.dump(1) << "\n";
    out.close();
    if (!out) {
      return absl::UnavailableError(
          absl::StrCat("--model-out: cannot write ", tmp));
    }
  }
  std::error_code ec;
  fs::rename(tmp, o_.model_out, ec);
  if (ec) {
    return Annotate(StatusFromErrno(ec.value(), "rename", tmp), "--model-out");
  }
  return absl::OkStatus();
}

absl::StatusOr<ChildResult> Bench::Sample(
    const std::string& what, const std::function<absl::StatusOr<json>()>& fn) {
  sync();  // no earlier dirty data is flushed inside a timer
  absl::StatusOr<ChildResult> result = RunInChild(fn);
  if (!result.ok()) return Annotate(result.status(), what);
  return result;
}

absl::Status Bench::RunSave() {
  const int w = o_.ranks;
  const fs::path dir = work_ / "sync";
  Row row("save_sync", "save", std::nullopt, w);
  row.dest_bytes = HeldBytes(tensors_, w, 0);
  for (int i = 0; i < o_.repeat; ++i) {
    // Every sample saves afresh.
    CAIRN_RETURN_IF_ERROR(RemoveLocation(dir.string()));
    const std::string what =
        absl::StrFormat("save_sync, sample %d of %d", i + 1, o_.repeat);
    CAIRN_ASSIGN_OR_RETURN(ChildResult r, Sample(what, [&] {
                             return SaveSample(tensors_, w, dir.string(),
                                               FillThreads(w), o_);
                           }));
    const double s = Num(r.value, "seconds");
    row.samples.push_back(s);
    row.rank_seconds.push_back(r.value["rank_seconds"]);
    row.cpu.push_back(Num(r.value, "cpu_seconds"));
    row.sys.push_back(Num(r.value, "sys_seconds"));
    row.requests.push_back(Num(r.value, "requests"));
    row.peak_rss_bytes = std::max(row.peak_rss_bytes, r.peak_rss_bytes);
    Log("save_sync %d/%d: %.3f s, %.3f GB/s, peak RSS %.1f MiB", i + 1,
        o_.repeat, s, GigabytesPerSecond(bytes_, s), MiB(r.peak_rss_bytes));
  }
  CAIRN_ASSIGN_OR_RETURN(LocationSize size, SizeOfLocation(dir.string()));
  row.extra = {{"disk_bytes", size.bytes},
               {"files", size.files},
               {"codec", o_.codec.name}};
  rows_.push_back(std::move(row));
  return absl::OkStatus();
}

absl::Status Bench::RunAsync() {
  const int w = o_.ranks;
  const fs::path first = work_ / "async-first";
  const fs::path dir = work_ / "async";
  // The state and its staged copy.
  Row row("async_save", "async", std::nullopt, w);
  row.dest_bytes = 2 * HeldBytes(tensors_, w, 0);
  std::vector<double> first_blocked, first_total;
  int64_t allocations = 0;
  for (int i = 0; i < o_.repeat; ++i) {
    CAIRN_RETURN_IF_ERROR(RemoveLocation(first.string()));
    CAIRN_RETURN_IF_ERROR(RemoveLocation(dir.string()));
    const std::string what =
        absl::StrFormat("async_save, sample %d of %d", i + 1, o_.repeat);
    CAIRN_ASSIGN_OR_RETURN(ChildResult r, Sample(what, [&] {
                             return AsyncSample(tensors_, w, first, dir,
                                                FillThreads(w), o_);
                           }));
    const double s = Num(r.value, "seconds");
    const double b = Num(r.value, "blocked_seconds");
    row.samples.push_back(s);
    row.blocked.push_back(b);
    row.rank_seconds.push_back(r.value["rank_seconds"]);
    row.peak_rss_bytes = std::max(row.peak_rss_bytes, r.peak_rss_bytes);
    first_blocked.push_back(Num(r.value, "first_blocked_seconds"));
    first_total.push_back(Num(r.value, "first_seconds"));
    allocations = static_cast<int64_t>(Num(r.value, "staging_allocations"));
    Log("async_save %d/%d: blocked %.3f s, committed after %.3f s (first "
        "save, allocating staging buffers: blocked %.3f s of %.3f s), peak "
        "RSS %.1f MiB",
        i + 1, o_.repeat, b, s, first_blocked.back(), first_total.back(),
        MiB(r.peak_rss_bytes));
  }
  row.extra = {{"blocked_seconds", Median(row.blocked)},
               {"blocked_samples", row.blocked},
               {"first_blocked_seconds", Median(first_blocked)},
               {"first_seconds", Median(first_total)},
               {"staging_allocations", allocations}};
  rows_.push_back(std::move(row));
  if (!o_.keep) {
    // The loads read the sync checkpoint; give the disk space back now.
    (void)RemoveLocation(dir.string());
  }
  return absl::OkStatus();
}

absl::Status Bench::RunLoads() {
  const int w = o_.ranks;
  const fs::path dir = work_ / "sync";
  std::vector<std::string> caches;
  if (can_drop_) caches.push_back("cold");
  caches.push_back("warm");
  for (const LoadTarget& target : LoadTargets(w)) {
    if (!Wanted("load")) break;
    std::vector<Row> rows;
    for (const std::string& cache : caches) {
      Row row(target.name, "load", cache, target.ranks);
      row.dest_bytes = HeldBytes(tensors_, target.ranks, target.split_dim);
      rows.push_back(std::move(row));
    }
    // Cold, then warm right after, per repetition (as torch_peer.py).
    for (int i = 0; i < o_.repeat; ++i) {
      for (Row& row : rows) {
        const bool cold = *row.cache == "cold";
        const std::string what =
            absl::StrFormat("%s (%s), sample %d of %d", target.name,
                            *row.cache, i + 1, o_.repeat);
        CAIRN_ASSIGN_OR_RETURN(ChildResult r, Sample(what, [&] {
                                 return LoadSample(tensors_, target, cold,
                                                   can_drop_, dir,
                                                   FillThreads(target.ranks),
                                                   o_);
                               }));
        if (static_cast<uint64_t>(Num(r.value, "verified_bytes")) !=
            row.dest_bytes) {
          return absl::InternalError(absl::StrFormat(
              "%s: verified %d bytes, expected %d", what,
              static_cast<uint64_t>(Num(r.value, "verified_bytes")),
              row.dest_bytes));
        }
        const double s = Num(r.value, "seconds");
        row.samples.push_back(s);
        row.rank_seconds.push_back(r.value["rank_seconds"]);
        row.cpu.push_back(Num(r.value, "cpu_seconds"));
        row.sys.push_back(Num(r.value, "sys_seconds"));
        row.requests.push_back(Num(r.value, "requests"));
        row.peak_rss_bytes = std::max(row.peak_rss_bytes, r.peak_rss_bytes);
        row.extra["storage_bytes_read"] =
            static_cast<uint64_t>(Num(r.value, "storage_bytes_read"));
        row.extra["device_bytes_read"] =
            static_cast<uint64_t>(Num(r.value, "device_bytes_read"));
        row.extra["phase_seconds"] = r.value["phase_seconds"];
        row.extra["chunks_crc_checked"] =
            static_cast<uint64_t>(Num(r.value, "chunks_crc_checked"));
        const json& ph = r.value["phase_seconds"];
        Log("%s %s %d/%d: %.3f s, %.3f GB/s (metadata %.3f, planning %.3f, "
            "read %.3f s), peak RSS %.1f MiB, verified",
            target.name, *row.cache, i + 1, o_.repeat, s,
            GigabytesPerSecond(bytes_, s), Num(ph, "metadata"),
            Num(ph, "planning"), Num(ph, "read"), MiB(r.peak_rss_bytes));
        // The warm limit, measured next to the row it bounds: host memory
        // bandwidth moves between minutes on a shared machine.
        if (!cold && target.name == "load_same" && Wanted("memcpy")) {
          CAIRN_RETURN_IF_ERROR(TakeMemcpySample(absl::StrFormat(
              "memcpy after load_same (warm) sample %d of %d", i + 1,
              o_.repeat)));
        }
      }
    }
    for (Row& row : rows) {
      row.extra["save_ranks"] = w;
      row.extra["split"] = target.split_dim == 0 ? "rows" : "cols";
      row.extra["verified"] = true;
      rows_.push_back(std::move(row));
    }
  }
  // load_sink: streaming's memory bound (one rank, every byte, no
  // destination memory).
  if (!Wanted("sink")) return absl::OkStatus();
  const std::string cache = can_drop_ ? "cold" : "warm";
  Row row("load_sink", "load", cache, 1);
  row.dest_bytes = 0;
  for (int i = 0; i < o_.repeat; ++i) {
    const std::string what = absl::StrFormat("load_sink (%s), sample %d of %d",
                                             cache, i + 1, o_.repeat);
    CAIRN_ASSIGN_OR_RETURN(ChildResult r, Sample(what, [&] {
                             return LoadSinkSample(can_drop_, can_drop_, dir,
                                                   o_);
                           }));
    const double s = Num(r.value, "seconds");
    row.samples.push_back(s);
    row.peak_rss_bytes = std::max(row.peak_rss_bytes, r.peak_rss_bytes);
    row.extra["sink_bytes"] = static_cast<uint64_t>(Num(r.value, "sink_bytes"));
    row.extra["storage_bytes_read"] =
        static_cast<uint64_t>(Num(r.value, "storage_bytes_read"));
    row.extra["chunks_crc_checked"] =
        static_cast<uint64_t>(Num(r.value, "chunks_crc_checked"));
    if (Num(r.value, "bytes_unverified") != 0) {
      return absl::InternalError(what + ": bytes reached the sink unchecked");
    }
    Log("load_sink %s %d/%d: %.3f s, %.3f GB/s, peak RSS %.1f MiB (budget "
        "%.1f MiB)",
        cache, i + 1, o_.repeat, s, GigabytesPerSecond(bytes_, s),
        MiB(r.peak_rss_bytes), MiB(o_.memory_budget_bytes));
  }
  row.extra["memory_budget_bytes"] = o_.memory_budget_bytes;
  rows_.push_back(std::move(row));
  return absl::OkStatus();
}

absl::Status Bench::TakeMemcpySample(const std::string& what) {
  const uint64_t bytes = std::min(bytes_, kMemcpyMaxBytes);
  const int threads = DefaultThreads();
  CAIRN_ASSIGN_OR_RETURN(
      ChildResult r, Sample(what, [&] { return MemcpySample(bytes, threads); }));
  r.value["peak_rss_bytes"] = r.peak_rss_bytes;
  if (threads > 1) {
    Log("%s: %.2f GB/s on 1 thread, %.2f GB/s on %d threads (%s buffer)", what,
        Num(r.value, "gb_per_s"), Num(r.value, "parallel_gb_per_s"), threads,
        HumanBytes(bytes));
  } else {
    Log("%s: %.2f GB/s (%s buffer)", what, Num(r.value, "gb_per_s"),
        HumanBytes(bytes));
  }
  memcpy_samples_.push_back(std::move(r.value));
  return absl::OkStatus();
}

// --repeat samples in all: those RunLoads took after its warm load_same
// samples, and the rest now. The reported figures are their medians, as a
// row's seconds are the median of its samples.
absl::Status Bench::RunMemcpy() {
  for (int i = static_cast<int>(memcpy_samples_.size()); i < o_.repeat; ++i) {
    CAIRN_RETURN_IF_ERROR(TakeMemcpySample(
        absl::StrFormat("memcpy sample %d of %d", i + 1, o_.repeat)));
  }
  memcpy_ = memcpy_samples_.front();
  json samples = json::array();
  std::vector<double> single, parallel;
  uint64_t peak = 0;
  for (const json& m : memcpy_samples_) {
    samples.push_back({{"gb_per_s", m["gb_per_s"]},
                       {"parallel_gb_per_s", m["parallel_gb_per_s"]}});
    single.push_back(Num(m, "gb_per_s"));
    if (m["parallel_gb_per_s"].is_number()) {
      parallel.push_back(Num(m, "parallel_gb_per_s"));
    }
    peak = std::max(peak, static_cast<uint64_t>(Num(m, "peak_rss_bytes")));
  }
  // The seconds that go with the median GB/s (bytes / GB/s).
  const double bytes = Num(memcpy_, "bytes");
  memcpy_["gb_per_s"] = Median(single);
  memcpy_["seconds"] = bytes / (Median(single) * 1e9);
  if (!parallel.empty()) {
    memcpy_["parallel_gb_per_s"] = Median(parallel);
    memcpy_["parallel_seconds"] = bytes / (Median(parallel) * 1e9);
  }
  memcpy_["peak_rss_bytes"] = peak;
  memcpy_["samples"] = std::move(samples);
  if (memcpy_samples_.size() > 1) {
    Log("memcpy: median of %d samples %.2f GB/s on 1 thread, %.2f GB/s on "
        "all cores",
        memcpy_samples_.size(), Num(memcpy_, "gb_per_s"),
        Num(memcpy_, "parallel_gb_per_s"));
  }
  return absl::OkStatus();
}

void Bench::CheckRss() {
  for (const Row& row : rows_) {
    // The kv save holds its chunk and write buffers; the cache-all load is
    // FBGEMM's way, there to be compared with.
    if (row.name == "kv_save" || row.name.ends_with("_cache_all")) continue;
    if (row.name == "load_sink" || row.name.starts_with("kv_load")) {
      // Streaming's bound: what the sinks keep (the kv rows: the table's
      // rows, in memory touched before the load), each rank's budget
      // (the ranks are threads of this process) and 128 MiB (the process
      // itself, metadata), whatever the state's size.
      const uint64_t limit = row.dest_bytes +
                             o_.memory_budget_bytes * row.ranks +
                             (uint64_t{128} << 20);
      if (o_.memory_budget_bytes != 0 && row.peak_rss_bytes > limit) {
        findings_.push_back(absl::StrFormat(
            "%s: peak RSS %.1f MiB is more than the rows kept + %d x "
            "--memory-budget + 128 MiB (%.1f MiB)",
            row.name, MiB(row.peak_rss_bytes), row.ranks, MiB(limit)));
      }
      continue;
    }
    if (row.peak_rss_bytes > row.dest_bytes + kRssSlack) {
      findings_.push_back(absl::StrFormat(
          "%s%s: peak RSS %.1f MiB is more than its tensor bytes + 256 MiB "
          "(%.1f MiB)",
          row.name, row.cache ? absl::StrCat(" (", *row.cache, ")") : "",
          MiB(row.peak_rss_bytes), MiB(row.dest_bytes + kRssSlack)));
    }
  }
}

absl::Status Bench::RunKv() {
  const std::string dir = (work_ / "kv").string();
  const uint64_t rows = KvRowsFor(bytes_);
  const int w = o_.ranks;
  const int lw = std::max(1, w - 1);
  Log("kv: a table of %d rows (%s) saved by %d ranks, loaded by %d", rows,
      HumanBytes(rows * (8 + SyntheticKvSpec(1).row_bytes())), w, lw);
  Row save("kv_save", "save", std::nullopt, w);
  for (int i = 0; i < o_.repeat; ++i) {
    // Every sample saves afresh, as save_sync's.
    CAIRN_RETURN_IF_ERROR(RemoveLocation(dir));
    const std::string what =
        absl::StrFormat("kv_save, sample %d of %d", i + 1, o_.repeat);
    CAIRN_ASSIGN_OR_RETURN(ChildResult r, Sample(what, [&] {
                             return KvSaveSample(dir, rows, w);
                           }));
    save.samples.push_back(Num(r.value, "seconds"));
    save.peak_rss_bytes = std::max(save.peak_rss_bytes, r.peak_rss_bytes);
    save.extra["table_bytes"] = r.value["bytes"];
    save.dest_bytes = static_cast<uint64_t>(Num(r.value, "bytes"));
    save.extra["files"] = r.value["files"];
    Log("%s: %.3f s, %.3f GB/s, peak RSS %.1f MiB", what,
        save.samples.back(), GigabytesPerSecond(bytes_, save.samples.back()),
        MiB(r.peak_rss_bytes));
  }
  save.extra["rows"] = rows;
  rows_.push_back(std::move(save));
  const std::string cache = can_drop_ ? "cold" : "warm";
  struct Kind {
    const char* suffix;
    bool rebucket;
    bool cache_all;
  };
  for (const Kind& k : {Kind{"", false, false}, Kind{"_rebucket", true, false},
                        Kind{"_cache_all", false, true}}) {
    Row row(absl::StrFormat("kv_load_%dto%d%s", w, lw, k.suffix), "load",
            cache, lw);
    for (int i = 0; i < o_.repeat; ++i) {
      const std::string what = absl::StrFormat("%s (%s), sample %d of %d",
                                               row.name, cache, i + 1,
                                               o_.repeat);
      CAIRN_ASSIGN_OR_RETURN(
          ChildResult r, Sample(what, [&] {
            return KvLoadSample(dir, rows, lw, k.rebucket, k.cache_all,
                                o_.memory_budget_bytes, [&] {
                                  return can_drop_ ? DropPageCache()
                                                   : Prewarm(dir, false);
                                });
          }));
      row.samples.push_back(Num(r.value, "seconds"));
      row.peak_rss_bytes = std::max(row.peak_rss_bytes, r.peak_rss_bytes);
      row.extra["storage_bytes_read"] = r.value["storage_bytes_read"];
      row.dest_bytes = static_cast<uint64_t>(Num(r.value, "kept_bytes"));
      Log("%s: %.3f s, %.3f GB/s, peak RSS %.1f MiB, every row checked", what,
          row.samples.back(), GigabytesPerSecond(bytes_, row.samples.back()),
          MiB(r.peak_rss_bytes));
    }
    row.extra["rows"] = rows;
    row.extra["memory_budget_bytes"] = o_.memory_budget_bytes;
    row.extra["verified"] = true;
    rows_.push_back(std::move(row));
  }
  // Against the targets: throughput beside a dense state of the same
  // bytes (the load row of the same ranks and split), and the memory of
  // the cache-all way.
  const Row* load = FindRow(absl::StrFormat("kv_load_%dto%d", w, lw), cache);
  const Row* all =
      FindRow(absl::StrFormat("kv_load_%dto%d_cache_all", w, lw), cache);
  const Row* dense =
      FindRow(absl::StrFormat("load_%dto%d_rows", w, lw), cache);
  const Row* dense_save = FindRow("save_sync", std::nullopt);
  const Row* kv_save = FindRow("kv_save", std::nullopt);
  if (dense != nullptr && load != nullptr) {
    findings_.push_back(absl::StrFormat(
        "kv: %s at %.2fx the throughput of the dense %s (target >= 0.8x)",
        load->name, dense->seconds() / load->seconds(), dense->name));
  }
  if (dense_save != nullptr && kv_save != nullptr) {
    findings_.push_back(absl::StrFormat(
        "kv: kv_save at %.2fx the throughput of the dense save_sync "
        "(target >= 0.8x)",
        dense_save->seconds() / kv_save->seconds()));
  }
  if (load != nullptr && all != nullptr) {
    findings_.push_back(absl::StrFormat(
        "kv: peak RSS %.1f MiB streaming (%.1f MiB of rows kept by the "
        "sinks, %d ranks of budget %.1f MiB each) vs %.1f MiB caching every "
        "row first (FBGEMM's way); %.2fx its speed",
        MiB(load->peak_rss_bytes), MiB(load->dest_bytes), load->ranks,
        MiB(o_.memory_budget_bytes), MiB(all->peak_rss_bytes),
        all->seconds() / load->seconds()));
  }
  return absl::OkStatus();
}

const Row* Bench::FindRow(const std::string& name,
                          std::optional<std::string> cache) const {
  for (const Row& row : rows_) {
    if (row.name == name && row.cache == cache) return &row;
  }
  return nullptr;
}

double Bench::MemcpyLimit() const {
  const double parallel = Num(memcpy_, "parallel_gb_per_s");
  return parallel > 0 ? parallel : Num(memcpy_, "gb_per_s");
}

json Bench::ToJson() const {
  json results = json::array();
  for (const Row& row : rows_) {
    const double s = row.seconds();
    json j = {{"name", row.name},
              {"kind", row.kind},
              {"cache", row.cache ? json(*row.cache) : json()},
              {"ranks", row.ranks},
              {"seconds", s},
              {"gb_per_s", s > 0 ? json(GigabytesPerSecond(bytes_, s))
                                 : json()},
              {"peak_rss_bytes", row.peak_rss_bytes},
              {"dest_bytes", row.dest_bytes},
              {"samples", row.samples},
              {"rank_seconds", row.rank_seconds}};
    if (!row.cpu.empty()) {
      j["cpu_seconds"] = Median(row.cpu);
      j["sys_seconds"] = Median(row.sys);
    }
    if (!row.requests.empty() && IsObjectStoreUrl(dir_)) {
      const double n = Median(row.requests);
      j["requests"] = n;
      j["requests_per_gib"] =
          bytes_ > 0 ? n / (static_cast<double>(bytes_) / (1 << 30)) : 0.0;
    }
    j.update(row.extra);
    if (row.kind == "load" && row.cache == "warm" && MemcpyLimit() > 0 &&
        s > 0) {
      j["memcpy_fraction"] = GigabytesPerSecond(bytes_, s) / MemcpyLimit();
    }
    results.push_back(std::move(j));
  }
  const Row* save = FindRow("save_sync", std::nullopt);
  const Row* async = FindRow("async_save", std::nullopt);
  const Row* load = FindRow("load_same", "cold");
  if (load == nullptr) load = FindRow("load_same", "warm");
  auto seconds = [](const Row* r) { return r ? json(r->seconds()) : json(); };
  std::vector<std::string> notes = findings_;
  notes.insert(notes.end(), notes_.begin(), notes_.end());
  json j;
  j["tool"] = "cairn";
  j["version"] = CAIRN_VERSION_STRING;
  j["bytes"] = bytes_;
  j["tensors"] = tensors_.size();
  j["ranks"] = o_.ranks;
  j["repeat"] = o_.repeat;
  j["dir"] = dir_;
  j["work_dir"] = work_.string();
  j["kept"] = o_.keep;
  j["verify_checksums"] = o_.verify_checksums;
  j["share_node_reads"] = o_.node_reads;
  j["cold_method"] = can_drop_ ? "drop_caches" : "unavailable";
  j["cpus"] = DefaultThreads();
  j["model"] = {{"layers", model_.config.layers},
                {"hidden", model_.config.hidden},
                {"ffn", model_.config.ffn},
                {"vocab", model_.config.vocab}};
  j["model_out"] = o_.model_out.empty() ? json() : json(o_.model_out);
  j["save_seconds"] = seconds(save);
  j["load_seconds"] = seconds(load);
  j["load_cache"] = load ? json(*load->cache) : json();
  j["async_blocked_seconds"] =
      async ? json(Median(async->blocked)) : json();
  j["async_total_seconds"] = seconds(async);
  j["memcpy_gb_per_s"] = memcpy_.is_object() ? memcpy_["gb_per_s"] : json();
  j["memcpy_parallel_gb_per_s"] =
      memcpy_.is_object() ? memcpy_["parallel_gb_per_s"] : json();
  j["memcpy"] = memcpy_;
  j["results"] = std::move(results);
  j["notes"] = std::move(notes);
  return j;
}

void Bench::PrintTable() const {
  std::cout << absl::StrFormat(
      "cairn %s bench: %d bytes (%s) of float32 state, %d tensors, %d save "
      "ranks (threads of one process), cold=%s, repeat=%d\n",
      CAIRN_VERSION_STRING, bytes_, HumanBytes(bytes_), tensors_.size(),
      o_.ranks, can_drop_ ? "drop_caches" : "unavailable", o_.repeat);
  std::cout << absl::StrFormat("dir: %s (work folder %s%s)\n", dir_,
                               work_.filename().string(),
                               o_.keep ? ", kept" : ", removed");
  if (!o_.verify_checksums) {
    std::cout << "loads without the CRC32C check of each chunk (--no-verify)\n";
  }
  const std::string header = absl::StrFormat(
      "%-20s %-5s %-5s %5s %9s %8s %8s %9s %9s", "phase", "kind", "cache",
      "ranks", "seconds", "GB/s", "memcpy", "RSS MiB", "held MiB");
  std::cout << header << "\n" << std::string(header.size(), '-') << "\n";
  for (const Row& row : rows_) {
    const double s = row.seconds();
    const double gbps = GigabytesPerSecond(bytes_, s);
    std::string vs = "-";
    if (row.kind == "load" && row.cache == "warm" && MemcpyLimit() > 0) {
      vs = absl::StrFormat("%.0f%%", 100 * gbps / MemcpyLimit());
    }
    std::cout << absl::StrFormat(
        "%-20s %-5s %-5s %5d %9.3f %8.3f %8s %9.1f %9.1f\n", row.name,
        row.kind, row.cache.value_or("-"), row.ranks, s, gbps, vs,
        MiB(row.peak_rss_bytes), MiB(row.dest_bytes));
  }
  const int threads = static_cast<int>(Num(memcpy_, "threads"));
  if (memcpy_.is_object()) {
    std::cout << absl::StrFormat(
        "memcpy: %.2f GB/s on 1 thread%s (%s the best of %d copies of a %s "
        "buffer); the \"memcpy\" column is a warm load's GB/s relative to "
        "%s\n",
        Num(memcpy_, "gb_per_s"),
        threads > 1 ? absl::StrFormat(", %.2f GB/s on %d threads",
                                      Num(memcpy_, "parallel_gb_per_s"),
                                      threads)
                    : "",
        memcpy_samples_.size() > 1
            ? absl::StrFormat("the median of %d samples, each",
                              memcpy_samples_.size())
            : "one sample,",
        kMemcpyIterations, HumanBytes(static_cast<uint64_t>(
                               Num(memcpy_, "bytes"))),
        threads > 1 ? "the parallel figure" : "it");
  }
  const Row* save = FindRow("save_sync", std::nullopt);
  const Row* async = FindRow("async_save", std::nullopt);
  if (save && async) {
    const double blocked = Median(async->blocked);
    std::cout << absl::StrFormat(
        "async: Save() blocked %.3f s and the checkpoint committed after "
        "%.3f s; save_sync took %.3f s: blocked/sync = %.3f (%.1fx less "
        "time blocked)\n",
        blocked, async->seconds(), save->seconds(),
        save->seconds() > 0 ? blocked / save->seconds() : 0.0,
        blocked > 0 ? save->seconds() / blocked : 0.0);
  }
  for (const std::string& f : findings_) std::cout << "note: " << f << "\n";
  std::cout << std::flush;
}

int Bench::Run() {
  absl::Status status = Prepare();
  absl::Cleanup remove_work = [&] {
    if (!work_.empty() && !o_.keep) (void)RemoveLocation(work_.string());
  };
  if (status.ok() && !o_.model_out.empty()) status = WriteModel();
  if (status.ok()) {
    Log("%d bytes (%s) of float32 state in %d tensors (%d layers, hidden "
        "%d); %d save ranks as threads; cold=%s; work folder %s",
        bytes_, HumanBytes(bytes_), tensors_.size(), model_.config.layers,
        model_.config.hidden, o_.ranks,
        can_drop_ ? "drop_caches" : "unavailable", work_.string());
  }
  if (status.ok() && (Wanted("save") || Wanted("load") || Wanted("sink"))) {
    status = RunSave();
  }
  if (status.ok() && Wanted("async")) status = RunAsync();
  if (status.ok() && (Wanted("load") || Wanted("sink"))) status = RunLoads();
  if (status.ok() && Wanted("memcpy")) status = RunMemcpy();
  if (status.ok() && Wanted("kv")) status = RunKv();
  if (!status.ok()) {
    PrintError("bench", status);
    if (o_.keep && !work_.empty()) Log("kept %s", work_.string());
    return 1;
  }
  CheckRss();
  notes_ = {
      "GB/s = state bytes / seconds / 1e9 for every row, resharded loads "
      "included (each reads the whole state across its ranks).",
      "seconds = wall time from a common barrier to the last rank finishing "
      "(max end - min start over the ranks, CLOCK_MONOTONIC); per-rank "
      "durations in rank_seconds; the median of --repeat samples.",
      "cpu_seconds, sys_seconds (save and load rows): CPU time (user + "
      "system, and system alone) of the whole process, all its ranks, from "
      "the barrier before the timed call to the barrier after it (getrusage); "
      "the median of the samples. Less disturbed than wall time by other "
      "load on the machine: the figure to compare two builds of cairn by.",
      "storage_bytes_read (load rows): bytes the ranks read from storage, "
      "gaps of coalesced spans included; device_bytes_read: bytes the "
      "process made the block device read over the same interval "
      "(getrusage ru_inblock x 512: O_DIRECT and page-cache misses, not "
      "hits), the last sample's. Several ranks reading one span through "
      "the page cache make the device read it once.",
      "Ranks are threads of one process with the in-process communicator. "
      "Every sample runs in a fresh child process; peak_rss_bytes is the "
      "child's ru_maxrss (wait4), the largest over the samples. dest_bytes "
      "is the tensor bytes that process holds by design: the destinations "
      "for a load, the source shards for a save, the source shards and "
      "their staged copy for async_save.",
      "save_sync: cairn::Save with default options (O_DIRECT where the "
      "filesystem allows, every data file fdatasync'ed, metadata.json "
      "written last by temp file, fsync, rename, fsync of the directory), "
      "inside the timer.",
      "async_save: cairn::AsyncSaver, two saves in a row; the second (its "
      "stager reusing the host buffers of the first, as in a training loop) "
      "is reported: blocked_seconds until Save() returned, seconds until "
      "Wait() returned with the checkpoint committed. first_* are the first "
      "save's, which allocates the staging buffers.",
      "load_*: destinations allocated and filled with NaN before the timer; "
      "every element checked bit for bit after it. Loads read the save_sync "
      "checkpoint, saved by --ranks ranks split on dim 0 (rank k of W holds "
      "[n*k//W, n*(k+1)//W)); _rows split dim 0, _cols dim 1 (1-D tensors "
      "dim 0), as torch_peer.py.",
      "cold: sync + echo 3 > /proc/sys/vm/drop_caches after the "
      "destinations are allocated, outside the timer; warm: the page cache "
      "dropped (where cold rows run) and every file of the checkpoint read "
      "twice before the timer, so its pages are cached and on the kernel's "
      "active list whatever the cold load before did (as torch_peer.py).",
      absl::StrFormat(
          "memcpy: the best of %d copies of a touched %s buffer, on one "
          "thread and on all %d cores (each a slice), in a fresh child; "
          "--repeat such samples, one right after each warm load_same "
          "sample when loads run, and the median of each figure reported "
          "(every sample in memcpy.samples): the limit for a warm load, "
          "which copies from the page cache.",
          kMemcpyIterations,
          HumanBytes(std::min(bytes_, kMemcpyMaxBytes)), DefaultThreads()),
  };
  if (o_.keep) notes_.push_back(absl::StrCat("kept ", work_.string()));
  if (!o_.verify_checksums) {
    notes_.push_back(
        "--no-verify: the loads did not check the chunks' CRC32C "
        "(cairn checks them by default); elements were still compared "
        "after each load.");
  }
  if (o_.json) {
    std::cout << ToJson().dump() << std::endl;
  } else {
    PrintTable();
  }
  return 0;
}

}  // namespace

void RegisterBench(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Measure cairn's save, async save and (resharded) loads on your "
      "storage, cold and warm, with peak memory");
  cmd->add_option("--dir", o->dir,
                  "directory on the storage to measure (created if missing); "
                  "the benchmark writes its checkpoints in a fresh folder "
                  "cairn_bench_<pid>_<time> inside it, removed at the end "
                  "unless --keep")
      ->required();
  cmd->add_option("--size", o->size,
                  "bytes of float32 state, e.g. 256MiB, 2GiB, 1G, 500M or "
                  "plain bytes; the synthetic model for a size is the same "
                  "every time (`cairn demo`'s model: embedding, transformer "
                  "layers, Adam moments)")
      ->capture_default_str()
      ->check(ByteSizeValidator(1, kMaxSyntheticBytes));
  cmd->add_option("--ranks", o->ranks,
                  "W, the ranks that save (threads of one process): every "
                  "tensor is split on dim 0, rank k holding rows "
                  "[n*k/W, n*(k+1)/W). Loads run on W, W/2 and W-1 ranks")
      ->type_name("W")
      ->capture_default_str()
      ->check(CLI::Range(1, kMaxInProcessRanks));
  cmd->add_flag("--json", o->json,
                "print one JSON object on stdout instead of the table");
  cmd->add_option("--cold", o->cold,
                  "how loads are made cold: auto (drop the page cache when "
                  "running as root and /proc/sys/vm/drop_caches can be "
                  "written, else skip the cold rows and say why), drop "
                  "(the same, but fail when it cannot), none (warm rows "
                  "only)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "drop", "none"}));
  cmd->add_option("--model-out", o->model_out,
                  "also write the model as JSON for the PyTorch peer "
                  "(bench/peers/torch_peer.py --model FILE): {\"bytes\": N, "
                  "\"tensors\": [{\"fqn\", \"shape\", \"dtype\": "
                  "\"float32\"}, ...]}")
      ->type_name("FILE");
  cmd->add_option("--repeat", o->repeat,
                  "samples of every timed phase, each in a fresh process; "
                  "the median is reported")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--io-threads", o->io_threads,
                  "IO threads per rank (SaveOptions/LoadOptions::io_threads)")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  AddCodecOptions(cmd, &o->codec,
                  "every save (the load rows then read compressed chunks)");
  cmd->add_option("--buffer", o->buffer,
                  "bytes per IO buffer: SaveOptions::write_buffer_bytes and "
                  "LoadOptions::bounce_buffer_bytes")
      ->type_name("SIZE")
      ->capture_default_str()
      ->check(ByteSizeValidator(4096));
  cmd->add_option("--memory-budget", o->memory_budget,
                  "LoadOptions::memory_budget_bytes of every load row (0: no "
                  "limit); the load_sink row (one rank loading every byte "
                  "into a sink that drops it once checked) reports its peak "
                  "RSS against it")
      ->type_name("SIZE")
      ->capture_default_str()
      ->check(ByteSizeValidator(0));
  cmd->add_option("--phases", o->phases,
                  "comma-separated phases to run: save, async, load (also "
                  "runs save, whose checkpoint it reads), sink (load_sink: "
                  "one rank streams every byte into a sink, within "
                  "--memory-budget; also runs save), memcpy, kv (not by "
                  "default: a key-value table of the state's bytes saved by "
                  "--ranks ranks and loaded by one fewer, in its bucketing, "
                  "into another, and by caching every row first as "
                  "FBGEMM does; as for the dense rows, the saved rows exist "
                  "before the timer, and loaded rows land in memory touched "
                  "before it and are checked after it)")
      ->delimiter(',')
      ->type_name("LIST")
      ->check(CLI::IsMember({"save", "async", "load", "sink", "memcpy", "kv"}));
  cmd->add_flag("--keep", o->keep,
                "keep the checkpoints (the sync one, and the last async one) "
                "in the work folder");
  cmd->add_flag("--node-reads", o->node_reads,
                "ranks of one host that need columns of the same chunk read it "
                "once and hand each other the parts (LoadOptions::"
                "share_node_reads); off by default: on page-cached local files "
                "it costs as many copies as it saves");
  cmd->add_flag("--no-verify{false}", o->verify_checksums,
                "loads skip the CRC32C check of the chunks they read "
                "(LoadOptions::verify_checksums = false), to see what the "
                "check costs; the elements are still compared afterwards");
  cmd->add_flag("-q,--quiet", o->quiet, "no progress lines on stderr");
  cmd->footer(absl::StrCat(
      "Phases, each sample in a fresh child process (ranks as its threads,\n"
      "its own peak RSS), timed as the wall time of the whole collective\n"
      "operation from a barrier to the last rank done:\n"
      "  save_sync    W ranks fill their shards, then cairn::Save to a fresh\n"
      "               folder: data fsynced, metadata committed last.\n"
      "  async_save   an AsyncSaver saves the same state twice; the second\n"
      "               (staging buffers reused, as in a training loop) is\n"
      "               reported: seconds Save() blocked the caller, and\n"
      "               seconds until Wait() saw the checkpoint committed.\n"
      "  load_same    W ranks load the save_sync checkpoint into the same\n"
      "               boxes;\n"
      "  load_WtoM_rows, load_WtoM_cols\n"
      "               M = W/2 and W-1 ranks load it split on dim 0 (rows)\n"
      "               or dim 1 (cols; 1-D tensors on dim 0): resharding.\n"
      "               Every load runs cold (page cache dropped) and warm\n"
      "               (cache dropped, then the checkpoint read twice\n"
      "               before: cached and on the active list), into\n"
      "               destinations allocated and filled with NaN before\n"
      "               the timer, and every element is checked bit for bit\n"
      "               afterwards (a wrong one is an error naming the\n"
      "               tensor and index).\n"
      "  memcpy       host memory bandwidth, one thread and all cores: the\n"
      "               limit for a warm load. --repeat samples, each the\n"
      "               best of ", kMemcpyIterations,
      " copies, one right after each warm\n"
      "               load_same sample when loads run; the median.\n"
      "GB/s is state bytes / seconds / 1e9 for every row. The rows pair by\n"
      "name with bench/peers/torch_peer.py's (dcp_load_4to2_rows there is\n"
      "load_4to2_rows here); --model-out gives the peer the same tensors.\n"
      "Exit status: 0, 1 a phase failed (its error names it), 2 usage.\n\n"
      "Examples:\n"
      "  cairn bench --dir /mnt/nvme/tmp                   256 MiB, 4 ranks\n"
      "  cairn bench --dir /mnt/nvme/tmp --size 4GiB --repeat 3 --json\n"
      "  cairn bench --dir /ckpt --size 1GiB --ranks 8 --cold none\n"
      "  cairn bench --dir /ckpt --size 5GB --model-out model.json --json \\\n"
      "      > cairn.json && python3 bench/peers/torch_peer.py \\\n"
      "      --model model.json --dir /ckpt --out torch.json"));
  cmd->callback([o] {
    o->buffer_bytes = *ParseByteSize(o->buffer);  // checked above
    o->memory_budget_bytes = *ParseByteSize(o->memory_budget);
    Bench bench(*o);
    if (int rc = bench.Run(); rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace cairn::tools
