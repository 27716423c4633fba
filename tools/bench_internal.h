// What the files of `cairn bench` share (see bench.cc for the protocol):
// its options, the layouts and timing spans the samples use, the child
// side's samples (bench_samples.cc), and the parent's Bench, which runs
// them (bench.cc) and reports them (bench_report.cc). The command line is
// in bench_cli.cc.
#ifndef CAIRN_TOOLS_BENCH_INTERNAL_H_
#define CAIRN_TOOLS_BENCH_INTERNAL_H_

#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_location.h"
#include "cairn/cairn.h"
#include "commands.h"
#include "synthetic_model.h"

namespace cairn::tools::internal_bench {

namespace fs = std::filesystem;
using nlohmann::json;

// In-process ranks are threads, each with its own IO threads.
inline constexpr int kMaxInProcessRanks = 256;
inline constexpr uint32_t kPoison = 0x7FC0DEADu;  // a quiet NaN
inline constexpr char kDropCaches[] = "/proc/sys/vm/drop_caches";
// The values are a function of (FQN, element index) only.
inline constexpr int64_t kValueStep = 0;
// A phase's peak RSS may exceed the tensor bytes it holds by this much
// (cairn's IO buffers, the binary) before the run says so.
inline constexpr uint64_t kRssSlack = uint64_t{256} << 20;
inline constexpr uint64_t kMemcpyMaxBytes = uint64_t{1} << 30;
inline constexpr int kMemcpyIterations = 5;

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
std::vector<LoadTarget> LoadTargets(int w);

// The box rank `rank` of `world` holds of `t` (torch_peer.py's part()), or
// nullopt when that part is empty.
std::optional<Box> PartBox(const SyntheticTensor& t, int rank, int world,
                           int split_dim);

// Tensor bytes all `world` ranks hold together (the state bytes, plus the
// copies of replicated 0-d tensors).
uint64_t HeldBytes(const std::vector<SyntheticTensor>& tensors, int world,
                   int split_dim);

// Seconds on CLOCK_MONOTONIC (steady_clock), which every rank reads alike.
double MonotonicSeconds();

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

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

inline double MiB(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// --- Child side (bench_samples.cc): runs in a forked child, ranks as
// threads of it.

// sync, then echo 3 > /proc/sys/vm/drop_caches: the next read of any file
// comes from the device.
absl::Status DropPageCache();

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
absl::Status Prewarm(const fs::path& dir, bool drop);

// save_sync: the W ranks fill their shards, then one timed Save.
absl::StatusOr<json> SaveSample(const std::vector<SyntheticTensor>& tensors,
                                int world, const std::string& url,
                                int threads, const BenchOptions& o);

// async_save: an AsyncSaver on the W ranks saves the state twice, each
// timed from a barrier to Save() returning (blocked) and to Wait()
// returning (total). The first save's stager allocates its host buffers;
// the second reuses them, as every save of a training loop after the first
// does, and is the one reported.
absl::StatusOr<json> AsyncSample(const std::vector<SyntheticTensor>& tensors,
                                 int world, const fs::path& first_dir,
                                 const fs::path& dir, int threads,
                                 const BenchOptions& o);

// load_*: the target's ranks allocate their destinations (NaN), rank 0
// drops the page cache (cold) or prepares it (warm: Prewarm, dropping it
// first when `can_drop`), then one timed Load; then every element is
// checked.
absl::StatusOr<json> LoadSample(const std::vector<SyntheticTensor>& tensors,
                                const LoadTarget& target, bool cold,
                                bool can_drop, const fs::path& dir,
                                int threads, const BenchOptions& o);

// load_sink: one rank loads every stored byte into a sink that discards it
// once checked, within --memory-budget: the row's peak RSS is what
// streaming holds, with no destination memory at all.
absl::StatusOr<json> LoadSinkSample(bool cold, bool can_drop,
                                    const fs::path& dir, const BenchOptions& o);

// memcpy: host memory bandwidth, the physical limit of a warm load (which
// copies from the page cache into the destinations). Two touched buffers
// of `bytes`; the best of kMemcpyIterations copies on one thread, then on
// `threads` threads each copying its own slice.
absl::StatusOr<json> MemcpySample(uint64_t bytes, int threads);

// --- Parent side (bench.cc, bench_report.cc) ---------------------------

// What a child sent, and its peak RSS.
struct ChildResult {
  json value;
  uint64_t peak_rss_bytes = 0;
};

// Runs `fn` in a forked child and returns what it computed, with the
// child's peak RSS. Must be called while this process has one thread.
absl::StatusOr<ChildResult> RunInChild(
    const std::function<absl::StatusOr<json>()>& fn);

inline double Num(const json& j, const char* key) {
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


}  // namespace cairn::tools::internal_bench

#endif  // CAIRN_TOOLS_BENCH_INTERNAL_H_
