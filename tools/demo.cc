// cairn demo: saves a synthetic training state (see synthetic_model.h) as N
// tensor-parallel ranks, optionally times R data-parallel replica groups,
// and loads it back as M ranks (times R) sharded differently, verifying
// every element; optionally rank-local (no collective in the save).
//
// The ranks are threads of this process (--comm inproc, RunInProcess) or one
// MPI process each (--comm mpi, under mpirun). Every rank runs the same
// steps; each step that can fail on one rank alone ends in a status exchange
// (AgreeOnStatus), so all ranks take the same branch and none is left
// waiting in a collective that another rank skipped.
//
// Layout: --replicas R (default 1) data-parallel replica groups, each
// holding the whole sharded model. The save has R x N ranks, the load R x M;
// rank g*N + t (g*M + t for the load) is tensor-parallel shard t of replica
// group g. Under MPI the world size must be R x N (N defaults to world / R).
//
//  save phase, on each of the R x N save ranks:
//   1. Choose the model for --size (a pure function: every rank gets the
//      same). Rank 0 checks that --dir holds no checkpoint (global or
//      rank-local; unless --overwrite, which also un-commits rank folders
//      that the new save will not rewrite) and that R copies of the state
//      fit in memory.
//   2. Fill only this rank's shards (tensor parallelism, TensorParallelBox
//      with even splits over N): column-parallel weights (wq, wk, wv, w1,
//      w3, embedding) split on dim 0, row-parallel ones (wo, w2) on dim 1,
//      norms replicated (every rank holds the whole norm); Adam moments
//      follow their weights. Every replica group holds the same shards.
//      Plus this rank's own RNG object `rng.rank<r>` (r over all R x N
//      ranks: real replicas have generators of their own) and the `step`
//      scalar.
//   3. Barrier, then Save (timed on every rank; the phase's time is the
//      slowest rank's). A global save writes a box that several ranks hold
//      (norms; with R > 1, every box) once, spread over its holders. With
//      --rank-local the save is SaveOptions::rank_local: no collective, each
//      rank writes its own rank-NNNNN/ folder with everything it holds (no
//      dedup). The user metadata (in the global metadata.json, or in every
//      rank folder's) records the model config, the step, N, R and
//      rank_local, so that a later `--phase load` with any rank count can
//      rebuild every expected value.
//   3b. --async: the save of step 3 goes to <dir>/sync (the synchronous
//      time to compare with); then an AsyncSaver on the same communicator
//      and --steps simulated training steps s = 1..N, each refilling this
//      rank's shards, `step` scalar and RNG object with the values of step
//      --step + s (in place, right after the previous Save() returned), and
//      every --save-every steps an async Save to <dir>/step-<s>, timed (the
//      time the loop was blocked; slowest rank per save). WaitAll at the
//      end; the load phase then reads the last step-<s>.
//  load phase, on each of the R x M load ranks (under MPI: the first R x M
//  ranks of the world, on a Split communicator; the others wait at the
//  final barrier):
//   4. Read the metadata (a rank-local checkpoint before Merge has no global
//      metadata.json: then rank-00000/metadata.json); rebuild the model, N,
//      R and the step (--step, else the stored `step` scalar). Choose how to
//      load (rank 0's choice is broadcast, so all ranks agree):
//        - rank-local: the checkpoint is rank-local and the load has the
//          save's layout (same R, M == N): LoadOptions::rank_local, every
//          rank reads only its own folder, no collective and no broadcast;
//        - merge, then global: rank-local but another layout, and not merged
//          yet: rank 0 runs Merge (timed), then a global load reshards;
//        - global: a global (or already merged) checkpoint.
//   5. Allocate this rank's destinations: for a global load the same
//      tensor-parallel rule over M ranks, but with uneven splits (SplitRange
//      2:3:4:...), so that shard boundaries do not line up with the save's
//      even ones and every load reshards, even when M == N; for a rank-local
//      load the save's own even boxes. Load shard t (in every replica
//      group) also asks for the RNG objects of save ranks t, t+M, t+2M, ...;
//      a rank-local load asks for its own rank's. Destinations are poisoned
//      with a NaN pattern (which the synthetic values never produce) before
//      the timed load, so an element the load never wrote cannot pass
//      verification, and the timing measures cairn rather than this VM's
//      slow first touch of fresh memory.
//   6. Barrier, then Load (timed like the save; broadcast load is on unless
//      --no-broadcast, so the R ranks holding shard t read each stored byte
//      once between them); check every element bit for bit, the `step`
//      scalar and this rank's RNG objects. Every replica checks its own
//      copy; only replica group 0 counts (rank 0 alone for replicated
//      tensors), so the sums over the ranks must be every element of every
//      tensor and every saved RNG object exactly once. Gather each rank's
//      storage bytes read and the slowest rank's load phase times.
//  7. Rank 0 prints the table or the JSON; under MPI it then broadcasts the
//     exit status, which is the final barrier.
#include <fcntl.h>
#include <linux/magic.h>
#include <stdlib.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "commands.h"
#include "demo_kv.h"
#include "core/parallel.h"
#include "rank_status.h"
#include "synthetic_model.h"

namespace cairn::tools {
namespace {

constexpr uint32_t kPoison = 0x7FC0DEADu;  // a quiet NaN
constexpr char kUserKey[] = "cairn_demo";
// Version 2 added "save_ranks" and per-rank RNG objects; version 3 added
// "replicas" (R x save_ranks RNG objects) and "rank_local". Version 1
// checkpoints (one "rng" object) and version 2 ones still load.
constexpr int kUserVersion = 3;
// In-process ranks are threads, each with its own IO threads.
constexpr int kMaxInProcessRanks = 256;
// More would be a damaged user metadata (and a huge list of RNG FQNs).
constexpr int64_t kMaxSaveRanks = int64_t{1} << 20;
constexpr int kUsageError = 2;

struct DemoOptions {
  std::string dir;
  CodecFlags codec;
  std::string size = "256MiB";
  std::string phase = "all";
  std::string comm = "inproc";
  int64_t step = 1000;
  bool step_given = false;
  int ranks = 4;
  bool ranks_given = false;
  int load_ranks = 3;
  bool load_ranks_given = false;
  int replicas = 1;
  bool rank_local = false;
  bool no_broadcast = false;
  // LoadOptions::share_node_reads (--node-reads sets it).
  bool node_reads = false;
  // LoadOptions::memory_budget_bytes (--memory-budget; "" = the default).
  std::string memory_budget;
  int layers = 0;
  bool json = false;
  bool no_disk_probe = false;
  bool keep = false;
  bool overwrite = false;
  bool quiet = false;
  int threads = 0;  // 0: the machine's cores
  // --async: a simulated training loop of `steps` steps with an AsyncSaver
  // save every `save_every` steps.
  bool async = false;
  int steps = 10;
  bool steps_given = false;
  int save_every = 5;
  bool save_every_given = false;
  // --kv: the key-value table demo instead (demo_kv.cc).
  bool kv = false;
  std::string kv_rows = "20000000";
  int64_t kv_buckets = 256;
};

// How the load phase reads the checkpoint.
enum class LoadMode {
  kGlobal,           // a global (or already merged) checkpoint
  kMergeThenGlobal,  // rank-local: Merge on rank 0, then a global load
  kRankLocal,        // rank-local, same layout: LoadOptions::rank_local
};

const char* LoadModeName(LoadMode mode) {
  switch (mode) {
    case LoadMode::kGlobal:
      return "global";
    case LoadMode::kMergeThenGlobal:
      return "merge_then_global";
    case LoadMode::kRankLocal:
      return "rank_local";
  }
  return "global";
}

// Filled by rank 0 (of the save, then of the load) and printed by it.
struct DemoResult {
  std::string dir;
  bool kept = true;
  std::optional<SyntheticModel> model;
  int64_t step = 0;
  uint64_t bytes = 0;  // every tensor once plus every rank's RNG object
  int save_ranks = 0;  // tensor-parallel; from the checkpoint for --phase load
  int save_replicas = 1;  // likewise
  bool rank_local = false;  // the checkpoint was saved rank-local
  int load_ranks = 0;  // tensor-parallel; 0: no load ran
  std::optional<double> save_seconds;
  std::optional<double> load_seconds;
  std::optional<double> verify_seconds;
  int save_files = 0;             // over all save ranks
  uint64_t checkpoint_bytes = 0;  // data files, headers included
  LoadMode load_mode = LoadMode::kGlobal;
  bool merged_earlier = false;  // rank-local, merged before this run
  std::optional<double> merge_seconds;
  int merged_ranks = 0;
  uint64_t merge_duplicates = 0;
  uint64_t load_bytes_read = 0;  // over all load ranks
  std::vector<uint64_t> load_bytes_read_per_rank;
  LoadPhaseTimes load_phases;  // each the slowest rank's
  int load_replica_group_size = 1;  // the largest
  int64_t elements_verified = 0;  // distinct elements, over all load ranks
  int64_t rng_verified = 0;
  bool verified = false;
  std::string mismatch;  // the first wrong element, when there is one
  // --async: the training steps that saved, the training loop's blocked
  // time in each Save() (slowest rank), and a synchronous save of the same
  // state (slowest rank; also save_seconds).
  std::vector<int> async_save_steps;
  std::vector<double> blocked_seconds;
  std::optional<double> sync_save_seconds;
  // What the checkpoint directory's disk does (ProbeDisk), beside the save.
  struct DiskProbe {
    uint64_t bytes = 0;
    double write_gbps = 0;  // direct writes, then fdatasync
    double read_gbps = 0;   // direct reads
    std::string skipped;    // why it was not measured, or ""
  };
  std::optional<DiskProbe> disk;
};

// A short sequential direct-I/O probe of `dir`'s disk: a file of up to
// 256 MiB (about the state's size) written by 4 threads in 8 MiB requests
// then fdatasync'd, then read back the same way, then removed. Direct I/O
// skips the page cache both ways, so these are the disk's speeds, as fio's
// direct jobs in bench/run.sh measure them (more thoroughly).
DemoResult::DiskProbe ProbeDisk(const std::string& dir, uint64_t state_bytes) {
  DemoResult::DiskProbe p;
  constexpr uint64_t kBlock = uint64_t{8} << 20;
  constexpr int kThreads = 4;
  const uint64_t blocks = std::clamp<uint64_t>(
      (state_bytes + kBlock - 1) / kBlock, kThreads, 32);
  p.bytes = blocks * kBlock;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    p.skipped = "the checkpoint is not in a local directory";
    return p;
  }
  struct statfs fs {};
  if (statfs(dir.c_str(), &fs) == 0 &&
      (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC)) {
    p.skipped = "the checkpoint is on a RAM filesystem (no disk to probe)";
    return p;
  }
  const std::string path = dir + "/.cairn-disk-probe";
  const int fd =
      open(path.c_str(), O_CREAT | O_TRUNC | O_RDWR | O_DIRECT | O_CLOEXEC,
           0600);
  if (fd < 0) {
    p.skipped = errno == EINVAL
                    ? "its filesystem refuses direct I/O (a RAM disk?)"
                    : absl::StrCat("cannot create ", path, ": ",
                                   std::strerror(errno));
    return p;
  }
  absl::Cleanup close_and_remove = [&] {
    close(fd);
    unlink(path.c_str());
  };
  // Allocated up front: ext4 runs direct writes past the end one at a time.
  if (posix_fallocate(fd, 0, static_cast<off_t>(p.bytes)) != 0) {
    p.skipped = absl::StrFormat("no room for a %s probe file",
                                HumanBytes(p.bytes));
    return p;
  }
  std::unique_ptr<std::byte, decltype(&std::free)> buffer(
      static_cast<std::byte*>(std::aligned_alloc(4096, kBlock * kThreads)),
      &std::free);
  if (buffer == nullptr) {
    p.skipped = "out of memory";
    return p;
  }
  std::memset(buffer.get(), 0x5a, kBlock * kThreads);
  // Seconds for every block written (or read) once; 0 on an I/O error.
  auto pass = [&](bool write) -> double {
    std::atomic<bool> failed{false};
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::byte* b = buffer.get() + static_cast<uint64_t>(t) * kBlock;
        for (uint64_t i = static_cast<uint64_t>(t); i < blocks;
             i += kThreads) {
          const off_t at = static_cast<off_t>(i * kBlock);
          const ssize_t n = write ? pwrite(fd, b, kBlock, at)
                                  : pread(fd, b, kBlock, at);
          if (n != static_cast<ssize_t>(kBlock)) failed = true;
        }
      });
    }
    for (std::thread& th : threads) th.join();
    if (write && fdatasync(fd) != 0) failed = true;
    if (failed) return 0;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         t0)
        .count();
  };
  const double w = pass(/*write=*/true);
  const double r = w > 0 ? pass(/*write=*/false) : 0;
  if (w <= 0 || r <= 0) {
    p.skipped = absl::StrCat("an I/O error in ", path);
    return p;
  }
  p.write_gbps = GigabytesPerSecond(p.bytes, w);
  p.read_gbps = GigabytesPerSecond(p.bytes, r);
  return p;
}

// What a checkpoint's "cairn_demo" user metadata says.
struct SavedDemo {
  SyntheticConfig config;
  int64_t step = 0;
  int save_ranks = 1;  // tensor-parallel ranks of one replica group
  int replicas = 1;
  bool rank_local = false;
  std::vector<std::string> rng_fqns;  // by save rank, all R x N of them
};

// Collective: the largest of each of `seconds` over the ranks (in
// nanoseconds on the wire, since AllReduce is for integers).
absl::StatusOr<std::vector<double>> MaxSecondsEach(
    Communicator& comm, const std::vector<double>& seconds) {
  std::vector<int64_t> ns;
  for (double s : seconds) ns.push_back(static_cast<int64_t>(s * 1e9));
  if (absl::Status s = comm.AllReduce(ns, ReduceOp::kMax); !s.ok()) return s;
  std::vector<double> out;
  for (int64_t n : ns) out.push_back(static_cast<double>(n) / 1e9);
  return out;
}

absl::StatusOr<double> MaxSeconds(Communicator& comm, double seconds) {
  absl::StatusOr<std::vector<double>> max = MaxSecondsEach(comm, {seconds});
  if (!max.ok()) return max.status();
  return (*max)[0];
}

// "file:///ckpt/sync" from "file:///ckpt" and "sync".
std::string SubUrl(std::string url, const std::string& name) {
  while (url.size() > 1 && url.back() == '/') url.pop_back();
  return absl::StrCat(url, "/", name);
}

// "file:///ckpt/rank-00003" from "file:///ckpt" (what Storage::Open takes).
std::string RankFolderUrl(std::string url, int rank) {
  while (url.size() > 1 && url.back() == '/') url.pop_back();
  return absl::StrFormat("%s/rank-%05d", url, rank);
}

// The rank of a "rank-NNNNN/metadata.json" name, or -1.
int RankOfFolderMetadata(const std::string& name) {
  const std::string suffix = absl::StrCat("/", kMetadataFileName);
  if (!name.starts_with("rank-") || !name.ends_with(suffix)) return -1;
  const std::string digits = name.substr(5, name.size() - 5 - suffix.size());
  int rank = -1;
  if (digits.size() < 5 ||
      digits.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(digits, &rank)) {
    return -1;
  }
  return rank;
}

class Demo {
 public:
  explicit Demo(const DemoOptions& o) : o_(o) {}

  // 0, or the exit status after printing the error.
  int Run();
  int RunKv();

 private:
  template <typename... Args>
  void Log(const Communicator& comm, const absl::FormatSpec<Args...>& format,
           const Args&... args) {
    if (!o_.quiet && comm.rank() == 0) {
      std::cerr << "cairn demo: " << absl::StrFormat(format, args...)
                << std::endl;
    }
  }
  void UsageError(const std::string& message) const;
  absl::StatusOr<std::string> MakeTempDir() const;
  int RunInProcessRanks();
  int RunMpiRanks(Communicator& world);
  // One rank of the save (load); collective over `comm`, whose ranks are
  // --replicas groups of save_tp_ (load_tp_) tensor-parallel ranks. Rank 0
  // fills r_.
  absl::Status SaveAsRank(Communicator& comm, int threads);
  absl::Status LoadAsRank(Communicator& comm, int threads);
  // Prints the outcome; returns the exit status.
  int Finish(const absl::Status& status);
  void Print() const;
  void PrintJson() const;

  bool saves() const { return o_.phase == "save" || o_.phase == "all"; }
  // --async: the last training step that saved, and its checkpoint (what
  // the load phase reads).
  int LastAsyncSaveStep() const {
    return o_.steps / o_.save_every * o_.save_every;
  }
  std::string AsyncStepUrl(int s) const {
    return SubUrl(url_, absl::StrCat("step-", s));
  }
  // --async, on every save rank after the synchronous save: the training
  // loop (refills `fills` and the step and RNG leaves of `sd` every step)
  // with an async save every --save-every steps.
  struct Fill {
    const SyntheticTensor* tensor;
    Box box;
    TensorView view;
  };
  absl::Status AsyncTrainingLoop(Communicator& comm, int threads,
                                 const SyntheticModel& m,
                                 const std::vector<Fill>& fills, StateDict& sd,
                                 const SaveOptions& base, double sync_seconds);
  bool loads() const { return o_.phase == "load" || o_.phase == "all"; }

  const DemoOptions& o_;
  bool leader_ = true;  // prints: false on MPI ranks other than 0
  std::string url_;
  int save_tp_ = 1;  // tensor-parallel ranks of one replica group (save)
  int load_tp_ = 1;  // likewise for the load
  DemoResult r_;
};

nlohmann::json ConfigJson(const SyntheticConfig& c, int64_t step,
                          int save_ranks, int replicas, bool rank_local) {
  return {{"version", kUserVersion},
          {"layers", c.layers},
          {"hidden", c.hidden},
          {"ffn", c.ffn},
          {"vocab", c.vocab},
          {"rng_bytes", c.rng_bytes},
          {"step", step},
          {"save_ranks", save_ranks},
          {"replicas", replicas},
          {"rank_local", rank_local}};
}

// The demo description in `md`'s user metadata (a global metadata.json, or
// a rank folder's in a rank-local checkpoint); the step is --step when
// given, else the stored `step` scalar.
absl::StatusOr<SavedDemo> ReadSavedDemo(const Metadata& md,
                                        std::optional<int64_t> step) {
  nlohmann::json j = nlohmann::json::parse(md.user, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains(kUserKey) ||
      !j[kUserKey].is_object()) {
    return absl::FailedPreconditionError(
        "not a checkpoint written by `cairn demo` (no \"cairn_demo\" entry in "
        "its user metadata)");
  }
  const nlohmann::json& d = j[kUserKey];
  SavedDemo out;
  SyntheticConfig& c = out.config;
  try {
    c.layers = d.at("layers").get<int>();
    c.hidden = d.at("hidden").get<int64_t>();
    c.ffn = d.at("ffn").get<int64_t>();
    c.vocab = d.at("vocab").get<int64_t>();
    c.rng_bytes = d.at("rng_bytes").get<int64_t>();
    if (d.contains("replicas")) out.replicas = d.at("replicas").get<int>();
    if (d.contains("rank_local")) {
      out.rank_local = d.at("rank_local").get<bool>();
    }
    if (d.contains("save_ranks")) {
      out.save_ranks = d.at("save_ranks").get<int>();
      // Each save rank stored an RNG object (a rank-local folder only its
      // own, and says how many ranks saved); bounding by them also keeps a
      // damaged number from making this loop huge.
      const int64_t rngs =
          static_cast<int64_t>(out.save_ranks) * out.replicas;
      if (out.save_ranks < 1 || out.replicas < 1 || rngs > kMaxSaveRanks ||
          (md.rank >= 0 ? rngs != md.world_size
                        : static_cast<uint64_t>(rngs) > md.objects.size())) {
        return absl::FailedPreconditionError(
            md.rank >= 0
                ? absl::StrCat("bad \"cairn_demo\" user metadata: save_ranks ",
                               out.save_ranks, " x replicas ", out.replicas,
                               ", but rank folder ", md.rank, " says ",
                               md.world_size, " ranks saved")
                : absl::StrCat("bad \"cairn_demo\" user metadata: save_ranks ",
                               out.save_ranks, " x replicas ", out.replicas,
                               ", but the checkpoint holds ",
                               md.objects.size(),
                               " byte objects (one per save rank)"));
      }
      for (int r = 0; r < rngs; ++r) out.rng_fqns.push_back(RngFqn(r));
    } else {
      // Version 1: one process saved, with one object named "rng".
      out.rng_fqns.push_back(kRngFqn);
      out.replicas = 1;
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::FailedPreconditionError(
        absl::StrCat("bad \"cairn_demo\" user metadata: ", e.what()));
  }
  // A rank folder's metadata is rank-local whatever the user metadata says.
  if (md.rank >= 0) out.rank_local = true;
  // BuildModel makes 27 tensor descriptions per layer before anything
  // checks sizes; ChooseConfig never goes past 4096 layers.
  if (c.layers > 4096) {
    return absl::FailedPreconditionError(absl::StrCat(
        "bad \"cairn_demo\" user metadata: ", c.layers, " layers"));
  }
  if (step) {
    out.step = *step;
  } else {
    auto it = md.scalars.find(kStepFqn);
    if (it == md.scalars.end() ||
        !std::holds_alternative<int64_t>(it->second)) {
      return absl::FailedPreconditionError(
          "no int64 `step` scalar in the checkpoint; pass --step");
    }
    out.step = std::get<int64_t>(it->second);
  }
  return out;
}

// Refuses states the machine cannot hold instead of being killed by the
// OOM killer. `what` says what the bytes are.
absl::Status CheckFitsInMemory(uint64_t bytes, const std::string& what) {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return absl::OkStatus();
  const uint64_t physical =
      static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  if (bytes > physical / 10 * 9) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the demo state (", HumanBytes(bytes), what,
                     ") must fit in memory, and this machine has ",
                     HumanBytes(physical),
                     "; pass a smaller --size (or fewer --replicas)"));
  }
  return absl::OkStatus();
}

// One copy of the state: every tensor once, plus the RNG objects.
uint64_t StateBytes(const SyntheticModel& m, size_t rng_objects) {
  return m.tensor_bytes() +
         static_cast<uint64_t>(m.config.rng_bytes) * rng_objects;
}

// What the ranks of one phase hold together: every replica group a whole
// copy of the tensors (the replicated norms once per rank on top, which is
// small), every rank its RNG objects. Saves and loads run one after the
// other, each freeing its state before the next.
uint64_t JobBytes(const SyntheticModel& m, int replicas, size_t rng_objects) {
  return m.tensor_bytes() * static_cast<uint64_t>(replicas) +
         static_cast<uint64_t>(m.config.rng_bytes) * rng_objects;
}

// The MPI ranks on this machine, so that their fill threads share its
// cores: Open MPI tells each process; other launchers fall back to all of
// the world (too few threads on several machines rather than too many).
int MpiRanksOnThisMachine(int world_size) {
  int local = 0;
  const char* env = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (env != nullptr && absl::SimpleAtoi(env, &local) && local > 0) {
    return local;
  }
  return world_size;
}

// This process's rank and the world size when Open MPI's mpirun started it
// (it says so in the environment), without initializing MPI.
std::pair<int, int> MpirunRankAndSize() {
  int rank = 0, size = 1;
  const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* n = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (r == nullptr || n == nullptr || !absl::SimpleAtoi(r, &rank) ||
      !absl::SimpleAtoi(n, &size)) {
    return {0, 1};
  }
  return {rank, size};
}

// "4 ranks" or "4 ranks (2 replica groups x 2 tensor-parallel)".
std::string LayoutText(int replicas, int tp) {
  const int total = replicas * tp;
  std::string text = absl::StrCat(total, total == 1 ? " rank" : " ranks");
  if (replicas > 1) {
    absl::StrAppend(&text, " (", replicas, " replica groups x ", tp,
                    " tensor-parallel)");
  }
  return text;
}

// Rank 0 of the save, before it: refuses a --dir that holds a checkpoint
// (global, or the rank-00000 folder of a rank-local one) unless
// --overwrite. With --overwrite, un-commits the rank folders (their
// metadata.json) that this save will not rewrite: those of ranks >= `world`
// for a rank-local save, all of them for a global one. Otherwise they
// would outlive the checkpoint they belonged to, and a later Merge would
// find ranks of two saves.
absl::Status PrepareDir(const std::string& url, bool overwrite,
                        bool rank_local, int world) {
  absl::StatusOr<std::unique_ptr<Storage>> storage = Storage::Open(url);
  if (!storage.ok()) return storage.status();
  for (const std::string& name :
       {std::string(kMetadataFileName),
        absl::StrCat("rank-00000/", kMetadataFileName)}) {
    absl::StatusOr<bool> exists = (*storage)->Exists(name);
    if (exists.ok() && *exists && !overwrite) {
      return absl::AlreadyExistsError(absl::StrCat(
          url, " already holds a checkpoint (", name,
          "); pass --overwrite to replace it"));
    }
  }
  if (!overwrite) return absl::OkStatus();
  absl::StatusOr<std::vector<std::string>> names = (*storage)->List();
  if (absl::IsNotFound(names.status())) return absl::OkStatus();
  if (!names.ok()) return names.status();
  bool removed = false;
  for (const std::string& name : *names) {
    const int rank = RankOfFolderMetadata(name);
    if (rank < 0 || (rank_local && rank < world)) continue;
    if (absl::Status s = (*storage)->Remove(name); !s.ok()) return s;
    removed = true;
  }
  return removed ? (*storage)->Sync() : absl::OkStatus();
}

absl::Status Demo::SaveAsRank(Communicator& comm, int threads) {
  const int rank = comm.rank();
  const int ranks = comm.size();
  const int tp = save_tp_;
  const int replicas = ranks / tp;
  const int shard = rank % tp;

  // 1. The model (the same on every rank), checks on rank 0.
  std::optional<SyntheticModel> model;
  absl::Status status = [&]() -> absl::Status {
    if (tp < 1 || ranks % tp != 0) {
      return absl::InternalError(absl::StrCat(
          ranks, " save ranks are not replica groups of ", tp));
    }
    absl::StatusOr<uint64_t> target = ParseByteSize(o_.size);
    if (!target.ok()) return target.status();
    absl::StatusOr<SyntheticConfig> config = ChooseConfig(*target, o_.layers);
    if (!config.ok()) return config.status();
    absl::StatusOr<SyntheticModel> built = BuildModel(*config);
    if (!built.ok()) return built.status();
    model = *std::move(built);
    if (rank != 0) return absl::OkStatus();
    if (absl::Status s = CheckFitsInMemory(
            JobBytes(*model, replicas, static_cast<size_t>(ranks)) *
                (o_.async ? 2 : 1),
            absl::StrCat(replicas > 1 ? absl::StrCat(": ", replicas,
                                                     " replica groups, each "
                                                     "a copy")
                                      : std::string(),
                         o_.async ? ", twice for --async staging" : ""));
        !s.ok()) {
      return s;
    }
    return PrepareDir(url_, o_.overwrite, o_.rank_local, ranks);
  }();
  if (status = AgreeOnStatus(comm, status); !status.ok()) return status;
  const SyntheticModel& m = *model;
  const int64_t step = o_.step;
  const uint64_t bytes = StateBytes(m, static_cast<size_t>(ranks));
  if (rank == 0) {
    r_.model = m;
    r_.step = step;
    r_.bytes = bytes;
    r_.save_ranks = tp;
    r_.save_replicas = replicas;
    r_.rank_local = o_.rank_local;
  }
  Log(comm,
      "building %s of synthetic state on %s: %d layers, hidden %d, ffn "
      "%d, vocab %d; %d tensors, step %d",
      HumanBytes(bytes), LayoutText(replicas, tp), m.config.layers,
      m.config.hidden, m.config.ffn, m.config.vocab, m.tensors.size(), step);

  // 2. This rank's shards only (the same in every replica group).
  StateDict sd;
  std::vector<Fill> fills;  // for --async's training loop
  status = [&]() -> absl::Status {
    for (const SyntheticTensor& t : m.tensors) {
      std::optional<Box> box = TensorParallelBox(t, shard, tp, false);
      if (!box) continue;  // more ranks than rows: nothing of t here
      absl::StatusOr<Tensor> buf = Tensor::Empty(t.dtype, box->sizes);
      if (!buf.ok()) return buf.status();
      if (absl::Status s = FillBox(t, *box, buf->view(), step, threads);
          !s.ok()) {
        return s;
      }
      auto owned = std::make_shared<Tensor>(*std::move(buf));
      fills.push_back({&t, *box, owned->view()});
      InsertLeaf(
          sd, t.fqn,
          ShardedTensor(t.dtype, t.shape, {{*box, owned->view()}}, owned));
    }
    InsertLeaf(sd, kStepFqn, StateDict(int64_t{step}));
    InsertLeaf(
        sd, RngFqn(rank),
        StateDict(Object{RngBytes(RngFqn(rank), step, m.config.rng_bytes)}));
    return absl::OkStatus();
  }();
  if (status = AgreeOnStatus(comm, status); !status.ok()) return status;

  // 3. The timed save: collective, or rank-local. With --async it is the
  // synchronous save the async ones compare with, to <dir>/sync.
  const std::string save_url = o_.async ? SubUrl(url_, "sync") : url_;
  Log(comm, "saving as %s to %s%s", LayoutText(replicas, tp), save_url,
      o_.rank_local ? " (rank-local: each rank writes its own rank-NNNNN/ "
                      "folder, no collective)"
                    : "");
  SaveOptions options;
  options.overwrite = o_.overwrite;
  options.comm = &comm;
  options.rank_local = o_.rank_local;
  ApplyCodec(o_.codec, options);
  options.user_metadata =
      nlohmann::json{{kUserKey, ConfigJson(m.config, step, tp, replicas,
                                           o_.rank_local)}}
          .dump();
  if (absl::Status s = comm.Barrier(); !s.ok()) return s;
  Stopwatch clock;
  absl::StatusOr<SaveResult> saved = Save(sd, save_url, options);
  const double seconds = clock.Seconds();
  // A rank-local save has no collective: this exchange is where the ranks
  // learn whether all of them saved.
  if (status = AgreeOnStatus(comm, saved.status()); !status.ok()) {
    return status;
  }
  absl::StatusOr<double> wall = MaxSeconds(comm, seconds);
  if (!wall.ok()) return wall.status();
  int64_t sums[2] = {saved->files, static_cast<int64_t>(saved->bytes_written)};
  if (absl::Status s = comm.AllReduce(sums, ReduceOp::kSum); !s.ok()) {
    return s;
  }
  if (rank == 0) {
    r_.save_seconds = *wall;
    r_.save_files = static_cast<int>(sums[0]);
    // A rank-local save's checkpoint_bytes is its own folder's.
    r_.checkpoint_bytes = o_.rank_local ? static_cast<uint64_t>(sums[1])
                                        : saved->checkpoint_bytes;
  }
  const uint64_t on_disk = o_.rank_local ? static_cast<uint64_t>(sums[1])
                                         : saved->checkpoint_bytes;
  Log(comm, "saved %s in %.3f s (%.2f GB/s), %s, %s on disk%s",
      HumanBytes(bytes), *wall, GigabytesPerSecond(bytes, *wall),
      Plural(static_cast<uint64_t>(sums[0]), "data file"),
      HumanBytes(on_disk),
      options.codec == Codec::kNone || on_disk == 0
          ? std::string()
          : absl::StrFormat(" (%s: %.2fx smaller)", o_.codec.name,
                            static_cast<double>(bytes) /
                                static_cast<double>(on_disk)));
  if (o_.async) {
    return AsyncTrainingLoop(comm, threads, m, fills, sd, options, *wall);
  }
  return absl::OkStatus();
}

absl::Status Demo::AsyncTrainingLoop(Communicator& comm, int threads,
                                     const SyntheticModel& m,
                                     const std::vector<Fill>& fills,
                                     StateDict& sd, const SaveOptions& base,
                                     double sync_seconds) {
  const int rank = comm.rank();
  const int tp = save_tp_;
  const int replicas = comm.size() / tp;
  absl::StatusOr<std::unique_ptr<AsyncSaver>> created =
      AsyncSaver::Create(&comm);
  if (absl::Status s = AgreeOnStatus(comm, created.status()); !s.ok()) {
    return s;
  }
  std::unique_ptr<AsyncSaver> saver = *std::move(created);
  Log(comm,
      "training %d steps from step %d, an async save every %d steps to "
      "%s/step-<s>",
      o_.steps, o_.step, o_.save_every, url_);
  std::vector<int> save_steps;
  std::vector<double> blocked;
  for (int s = 1; s <= o_.steps; ++s) {
    // "Train": this step's values, in place (the state of a save in flight
    // was staged, so this must not reach its checkpoint).
    const int64_t value_step = o_.step + s;
    absl::Status status = [&]() -> absl::Status {
      for (const Fill& f : fills) {
        if (absl::Status st =
                FillBox(*f.tensor, f.box, f.view, value_step, threads);
            !st.ok()) {
          return st;
        }
      }
      return absl::OkStatus();
    }();
    InsertLeaf(sd, kStepFqn, StateDict(int64_t{value_step}));
    InsertLeaf(sd, RngFqn(rank),
               StateDict(Object{RngBytes(RngFqn(rank), value_step,
                                         m.config.rng_bytes)}));
    if (status = AgreeOnStatus(comm, status); !status.ok()) return status;
    if (s % o_.save_every != 0) continue;
    SaveOptions options = base;
    options.user_metadata =
        nlohmann::json{{kUserKey, ConfigJson(m.config, value_step, tp,
                                             replicas, o_.rank_local)}}
            .dump();
    Stopwatch clock;
    absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> handle =
        saver->Save(sd, AsyncStepUrl(s), options);
    const double seconds = clock.Seconds();
    if (status = AgreeOnStatus(comm, handle.status()); !status.ok()) {
      return status;
    }
    absl::StatusOr<double> max = MaxSeconds(comm, seconds);
    if (!max.ok()) return max.status();
    save_steps.push_back(s);
    blocked.push_back(*max);
    Log(comm, "step %d: training blocked %.3f s (sync save %.3f s)", s, *max,
        sync_seconds);
  }
  if (absl::Status s = AgreeOnStatus(comm, saver->WaitAll()); !s.ok()) {
    return s;
  }
  if (rank == 0) {
    r_.async_save_steps = save_steps;
    r_.blocked_seconds = blocked;
    r_.sync_save_seconds = sync_seconds;
    r_.step = o_.step + LastAsyncSaveStep();
  }
  return absl::OkStatus();
}

absl::Status Demo::LoadAsRank(Communicator& comm, int threads) {
  const int rank = comm.rank();
  const int ranks = comm.size();
  const int replicas = o_.replicas;
  const int tp = load_tp_;
  const int shard = rank % tp;
  const int group = rank / tp;

  // 4. What was saved, and how to load it.
  std::optional<SyntheticModel> model;
  SavedDemo saved;
  LoadMode mode = LoadMode::kGlobal;
  bool merged_earlier = false;
  absl::Status status = [&]() -> absl::Status {
    if (tp < 1 || ranks != replicas * tp) {
      return absl::InternalError(absl::StrCat(
          ranks, " load ranks are not ", replicas, " replica groups of ", tp));
    }
    absl::StatusOr<Metadata> md = ReadMetadata(url_);
    bool global = md.ok();
    if (absl::IsNotFound(md.status())) {
      // A rank-local checkpoint before Merge: no global metadata.json, but
      // every rank folder's has the user metadata.
      absl::StatusOr<Metadata> local = ReadMetadata(RankFolderUrl(url_, 0));
      if (local.ok()) md = *std::move(local);
      // Else keep the first NotFound, which names the global metadata.json.
    }
    if (!md.ok()) return md.status();
    absl::StatusOr<SavedDemo> info = ReadSavedDemo(
        *md, o_.step_given && !o_.async ? std::optional<int64_t>(o_.step)
                                        : std::nullopt);
    if (!info.ok()) {
      return absl::Status(info.status().code(),
                          absl::StrCat(url_, ": ", info.status().message()));
    }
    saved = *std::move(info);
    if (saved.rank_local && saved.replicas == replicas &&
        saved.save_ranks == tp) {
      mode = LoadMode::kRankLocal;  // each rank finds its own folder
    } else if (saved.rank_local && !global) {
      mode = LoadMode::kMergeThenGlobal;
    } else {
      mode = LoadMode::kGlobal;
      merged_earlier = saved.rank_local;
    }
    absl::StatusOr<SyntheticModel> built = BuildModel(saved.config);
    if (!built.ok()) return built.status();
    model = *std::move(built);
    if (rank != 0) return absl::OkStatus();
    // Broadcast load stages up to broadcast_batch_bytes per rank.
    const uint64_t staging =
        replicas > 1 && !o_.no_broadcast && mode != LoadMode::kRankLocal
            ? std::min(LoadOptions().broadcast_batch_bytes *
                           static_cast<uint64_t>(ranks),
                       model->tensor_bytes() * static_cast<uint64_t>(replicas))
            : 0;
    return CheckFitsInMemory(
        JobBytes(*model, replicas, saved.rng_fqns.size()) + staging,
        replicas > 1 ? absl::StrCat(": ", replicas,
                                    " replica groups, each a copy, and "
                                    "broadcast staging")
                     : std::string());
  }();
  if (status = AgreeOnStatus(comm, status); !status.ok()) return status;
  // Every rank read the same files; rank 0's choice is everyone's, so that a
  // checkpoint changing underneath cannot split the ranks between a
  // collective load and a rank-local one.
  {
    std::string text = absl::StrCat(static_cast<int>(mode), merged_earlier);
    if (absl::Status s = comm.Broadcast(text, 0); !s.ok()) return s;
    int code = 0;
    if (text.size() != 2 || !absl::SimpleAtoi(text.substr(0, 1), &code) ||
        code < 0 || code > 2) {
      return absl::InternalError(
          absl::StrCat("bad load mode from rank 0: ", text));
    }
    mode = static_cast<LoadMode>(code);
    merged_earlier = text[1] == '1';
  }
  const SyntheticModel& m = *model;
  const uint64_t bytes = StateBytes(m, saved.rng_fqns.size());
  if (rank == 0) {
    r_.model = m;
    r_.step = saved.step;
    r_.bytes = bytes;
    r_.save_ranks = saved.save_ranks;
    r_.save_replicas = saved.replicas;
    r_.rank_local = saved.rank_local;
    r_.load_ranks = tp;
    r_.load_mode = mode;
    r_.merged_earlier = merged_earlier;
  }
  if (o_.rank_local && !saved.rank_local) {
    Log(comm,
        "note: %s is a global checkpoint; --rank-local changes only how a "
        "save writes, so this load is a global one",
        url_);
  }

  // 4b. A rank-local checkpoint loaded with another layout: rank 0 merges
  // it into a global one first (no data copied), timed.
  if (mode == LoadMode::kMergeThenGlobal) {
    Log(comm,
        "the checkpoint is rank-local, saved by %s; this load is %s: merging "
        "it into a global checkpoint first (rank 0)",
        LayoutText(saved.replicas, saved.save_ranks),
        LayoutText(replicas, tp));
    absl::Status merged;
    if (rank == 0) {
      Stopwatch clock;
      absl::StatusOr<MergeResult> result = Merge(url_);
      const double seconds = clock.Seconds();
      merged = result.status();
      if (result.ok()) {
        r_.merge_seconds = seconds;
        r_.merged_ranks = result->ranks;
        r_.merge_duplicates = result->duplicates;
        Log(comm,
            "merged %d rank folders in %.3f s (%d replicated chunks kept "
            "once)",
            result->ranks, seconds, result->duplicates);
      }
    }
    if (status = AgreeOnStatus(comm, merged); !status.ok()) return status;
  } else if (mode == LoadMode::kRankLocal) {
    Log(comm,
        "the checkpoint is rank-local and this load has the save's layout "
        "(%s): rank-local load, each rank reads only its own folder (no "
        "collective, no broadcast)",
        LayoutText(replicas, tp));
  }

  // 5. This rank's destinations, poisoned.
  struct Dest {
    const SyntheticTensor* tensor;
    Box box;
    Tensor buffer;
  };
  std::vector<Dest> dests;
  std::vector<std::string> my_rngs;
  // Replica group 0 counts what it checks (rank 0 alone for replicated
  // tensors); the other groups check their copies without counting, so the
  // sums over the ranks are each element and RNG object once. A rank-local
  // load checks (and counts) its own rank's RNG object.
  const bool counts_rngs = mode == LoadMode::kRankLocal || group == 0;
  StateDict sd;
  const bool uneven = mode != LoadMode::kRankLocal;
  Log(comm, "allocating destinations on %s: %s", LayoutText(replicas, tp),
      uneven ? "uneven tensor-parallel shards, boundaries off the save's"
             : "the save's own even tensor-parallel shards (a rank-local "
               "load reads only what the rank saved)");
  status = [&]() -> absl::Status {
    for (const SyntheticTensor& t : m.tensors) {
      std::optional<Box> box = TensorParallelBox(t, shard, tp, uneven);
      if (!box) continue;
      absl::StatusOr<Tensor> buf = Tensor::Empty(t.dtype, box->sizes);
      if (!buf.ok()) return buf.status();
      InsertLeaf(sd, t.fqn,
                 ShardedTensor(t.dtype, t.shape, {{*box, buf->view()}}));
      dests.push_back({&t, *box, *std::move(buf)});
    }
    if (mode == LoadMode::kRankLocal) {
      if (static_cast<size_t>(rank) < saved.rng_fqns.size()) {
        my_rngs.push_back(saved.rng_fqns[static_cast<size_t>(rank)]);
      }
    } else {
      // The same objects in every replica group, so that the replicas'
      // load plans are identical (what makes them a broadcast group).
      for (size_t i = static_cast<size_t>(shard); i < saved.rng_fqns.size();
           i += static_cast<size_t>(tp)) {
        my_rngs.push_back(saved.rng_fqns[i]);
      }
    }
    for (const std::string& fqn : my_rngs) {
      InsertLeaf(sd, fqn, StateDict(Object{}));
    }
    InsertLeaf(sd, kStepFqn, StateDict(int64_t{-1}));
    return internal_core::ParallelFor(
        static_cast<int64_t>(dests.size()), threads, [&](int64_t i) {
          const Tensor& b = dests[static_cast<size_t>(i)].buffer;
          uint32_t* p = static_cast<uint32_t*>(b.data());
          std::fill(p, p + b.nbytes() / sizeof(uint32_t), kPoison);
          return absl::OkStatus();
        });
  }();
  if (status = AgreeOnStatus(comm, status); !status.ok()) return status;

  // 6. The timed load, then the checks.
  Log(comm, "loading %s from %s%s", HumanBytes(bytes), url_,
      mode == LoadMode::kRankLocal ? " (rank-local)"
      : replicas > 1 && !o_.no_broadcast
          ? absl::StrFormat(" (broadcast load: each group of %d replicas "
                            "reads a byte once)",
                            replicas)
          : std::string());
  LoadOptions options;
  options.comm = &comm;
  options.rank_local = mode == LoadMode::kRankLocal;
  options.broadcast_replicas = !o_.no_broadcast;
  options.share_node_reads = o_.node_reads;
  if (!o_.memory_budget.empty()) {
    options.memory_budget_bytes = *ParseByteSize(o_.memory_budget);  // checked
  }
  if (absl::Status s = comm.Barrier(); !s.ok()) return s;
  Stopwatch clock;
  absl::StatusOr<LoadResult> loaded = Load(sd, url_, options);
  const double seconds = clock.Seconds();
  // A rank-local load has no collective: this exchange is where the ranks
  // learn whether all of them loaded.
  if (status = AgreeOnStatus(comm, loaded.status()); !status.ok()) {
    return status;
  }
  const LoadPhaseTimes& ph = loaded->phases;
  absl::StatusOr<std::vector<double>> walls =
      MaxSecondsEach(comm, {seconds, ph.metadata, ph.planning, ph.read,
                            ph.broadcast, ph.copy, ph.staging});
  if (!walls.ok()) return walls.status();
  const double wall = (*walls)[0];
  Log(comm, "loaded %s in %.3f s (%.2f GB/s)", HumanBytes(bytes), wall,
      GigabytesPerSecond(bytes, wall));
  for (const std::string& fqn : loaded->unexpected) {
    // Other ranks' RNG objects and tensors this rank holds nothing of are
    // unexpected here by design.
    if (m.Find(fqn) == nullptr && !fqn.starts_with(kRngFqn)) {
      Log(comm, "note: %s is in the checkpoint but not in the demo model", fqn);
    }
  }

  Log(comm, "verifying every element");
  Stopwatch vclock;
  std::string mismatch;
  int64_t counts[3] = {0, 0, 0};  // elements, rng objects, bytes read
  status = [&]() -> absl::Status {
    for (const Dest& d : dests) {
      absl::StatusOr<std::optional<Mismatch>> bad =
          VerifyBox(*d.tensor, d.box, d.buffer.view(), saved.step, threads);
      if (!bad.ok()) return bad.status();
      if (bad->has_value()) {
        mismatch = (*bad)->ToString();
        return absl::OkStatus();
      }
      if (d.tensor->parallelism != Parallelism::kReplicated
              ? group == 0
              : rank == 0) {
        counts[0] += d.box.num_elements();
      }
    }
    const StateDict* step = sd.Find(kStepFqn);
    const Scalar* s = step ? step->scalar() : nullptr;
    if (s == nullptr || !std::holds_alternative<int64_t>(*s) ||
        std::get<int64_t>(*s) != saved.step) {
      mismatch = absl::StrCat("step: expected int64 ", saved.step, ", got ",
                              s && std::holds_alternative<int64_t>(*s)
                                  ? absl::StrCat(std::get<int64_t>(*s))
                                  : std::string("another kind of value"));
      return absl::OkStatus();
    }
    for (const std::string& fqn : my_rngs) {
      const StateDict* rng = FindLeaf(sd, fqn);
      const Object* obj = rng ? rng->object() : nullptr;
      const std::string expected =
          RngBytes(fqn, saved.step, m.config.rng_bytes);
      if (obj == nullptr || obj->bytes != expected) {
        size_t at = 0;
        if (obj) {
          while (at < obj->bytes.size() && at < expected.size() &&
                 obj->bytes[at] == expected[at]) {
            ++at;
          }
        }
        mismatch = obj ? absl::StrFormat(
                             "%s: %d bytes differ from the expected %d bytes "
                             "from byte %d on",
                             fqn, obj->bytes.size(), expected.size(), at)
                       : absl::StrCat(fqn, ": not an object after load");
        return absl::OkStatus();
      }
      if (counts_rngs) ++counts[1];
    }
    return absl::OkStatus();
  }();
  if (status = AgreeOnStatus(comm, status); !status.ok()) return status;
  absl::StatusOr<double> verify_wall = MaxSeconds(comm, vclock.Seconds());
  if (!verify_wall.ok()) return verify_wall.status();
  counts[2] = static_cast<int64_t>(loaded->bytes_read);
  if (absl::Status s = comm.AllReduce(counts, ReduceOp::kSum); !s.ok()) {
    return s;
  }
  // Each rank's storage bytes (a sum where only the rank's own slot is
  // non-zero), and the largest replica group.
  std::vector<int64_t> per_rank(static_cast<size_t>(ranks), 0);
  per_rank[static_cast<size_t>(rank)] =
      static_cast<int64_t>(loaded->bytes_read);
  if (absl::Status s = comm.AllReduce(per_rank, ReduceOp::kSum); !s.ok()) {
    return s;
  }
  int64_t group_size[1] = {loaded->replica_group_size};
  if (absl::Status s = comm.AllReduce(group_size, ReduceOp::kMax); !s.ok()) {
    return s;
  }
  absl::StatusOr<std::vector<std::string>> mismatches =
      comm.AllGather(mismatch);
  if (!mismatches.ok()) return mismatches.status();
  if (rank != 0) return absl::OkStatus();

  r_.load_seconds = wall;
  r_.load_phases = {(*walls)[1], (*walls)[2], (*walls)[3],
                    (*walls)[4], (*walls)[5], (*walls)[6]};
  r_.load_replica_group_size = static_cast<int>(group_size[0]);
  r_.verify_seconds = *verify_wall;
  r_.load_bytes_read = static_cast<uint64_t>(counts[2]);
  r_.load_bytes_read_per_rank.clear();
  for (int r = 0; r < ranks; ++r) {
    r_.load_bytes_read_per_rank.push_back(
        static_cast<uint64_t>(per_rank[static_cast<size_t>(r)]));
  }
  r_.elements_verified = counts[0];
  r_.rng_verified = counts[1];
  for (size_t r = 0; r < mismatches->size() && r_.mismatch.empty(); ++r) {
    if ((*mismatches)[r].empty()) continue;
    r_.mismatch = ranks == 1
                      ? (*mismatches)[r]
                      : absl::StrCat("load rank ", r, ": ", (*mismatches)[r]);
  }
  r_.verified = r_.mismatch.empty() &&
                r_.elements_verified == m.total_elements() &&
                r_.rng_verified == static_cast<int64_t>(saved.rng_fqns.size());
  if (r_.mismatch.empty() && !r_.verified) {
    r_.mismatch = absl::StrFormat(
        "only %d of %d elements and %d of %d rng objects were checked",
        r_.elements_verified, m.total_elements(), r_.rng_verified,
        saved.rng_fqns.size());
  }
  return absl::OkStatus();
}

void Demo::PrintJson() const {
  const SyntheticModel* m = r_.model ? &*r_.model : nullptr;
  auto opt = [](const std::optional<double>& v) {
    return v ? nlohmann::json(*v) : nlohmann::json();
  };
  auto gbps = [&](const std::optional<double>& s) {
    return s ? nlohmann::json(GigabytesPerSecond(r_.bytes, *s))
             : nlohmann::json();
  };
  const nlohmann::json load_ranks =
      r_.load_seconds ? nlohmann::json(r_.load_ranks) : nlohmann::json();
  nlohmann::json j;
  j["phase"] = o_.phase;
  j["comm"] = o_.comm;
  j["dir"] = r_.dir;
  j["kept"] = r_.kept;
  j["bytes"] = r_.bytes;
  j["step"] = r_.step;
  j["ranks"] = r_.save_ranks;
  j["load_ranks"] = load_ranks;
  if (r_.disk) {
    j["disk_probe"] = {{"bytes", r_.disk->bytes}};
    if (r_.disk->skipped.empty()) {
      j["disk_probe"]["write_gbps"] = r_.disk->write_gbps;
      j["disk_probe"]["read_gbps"] = r_.disk->read_gbps;
    } else {
      j["disk_probe"]["skipped"] = r_.disk->skipped;
    }
  }
  j["save_seconds"] = opt(r_.save_seconds);
  j["load_seconds"] = opt(r_.load_seconds);
  j["save_gbps"] = gbps(r_.save_seconds);
  j["load_gbps"] = gbps(r_.load_seconds);
  j["verify_seconds"] = opt(r_.verify_seconds);
  j["verified"] = r_.verified;
  j["elements_verified"] = r_.elements_verified;
  j["rng_objects_verified"] = r_.rng_verified;
  j["mismatch"] =
      r_.mismatch.empty() ? nlohmann::json() : nlohmann::json(r_.mismatch);
  if (m) {
    j["tensors"] = m->tensors.size();
    j["elements"] = m->total_elements();
    j["layers"] = m->config.layers;
    j["hidden"] = m->config.hidden;
    j["ffn"] = m->config.ffn;
    j["vocab"] = m->config.vocab;
  }
  // Older names of "ranks" and "load_ranks": shards per sharded weight.
  j["save_shards"] = r_.save_ranks;
  j["load_shards"] = load_ranks;
  // Data-parallel replica groups of this run (--replicas) and of the save
  // (read from the checkpoint by --phase load); "ranks" and "load_ranks"
  // are per group, "save_world" and "load_world" all the ranks.
  j["replicas"] = o_.replicas;
  j["save_replicas"] = r_.save_replicas;
  j["save_world"] = r_.save_ranks * r_.save_replicas;
  j["load_world"] = r_.load_seconds
                        ? nlohmann::json(r_.load_ranks * o_.replicas)
                        : nlohmann::json();
  j["rank_local"] = r_.rank_local;  // the checkpoint was saved rank-local
  j["broadcast"] = !o_.no_broadcast;
  if (r_.save_seconds) {
    j["save_files"] = r_.save_files;
    j["checkpoint_bytes"] = r_.checkpoint_bytes;
  }
  j["merge_seconds"] = opt(r_.merge_seconds);
  if (r_.load_seconds) {
    j["load_mode"] = LoadModeName(r_.load_mode);
    j["load_bytes_read"] = r_.load_bytes_read;
    j["load_bytes_read_per_rank"] = r_.load_bytes_read_per_rank;
    j["load_replica_group_size"] = r_.load_replica_group_size;
    j["load_phases"] = {{"metadata", r_.load_phases.metadata},
                        {"planning", r_.load_phases.planning},
                        {"read", r_.load_phases.read},
                        {"broadcast", r_.load_phases.broadcast},
                        {"copy", r_.load_phases.copy},
                        {"staging", r_.load_phases.staging}};
  }
  if (o_.async) {
    j["async_steps"] = o_.steps;
    j["save_every"] = o_.save_every;
    j["async_save_steps"] = r_.async_save_steps;
    j["blocked_seconds"] = r_.blocked_seconds;
    j["sync_save_seconds"] = opt(r_.sync_save_seconds);
  }
  std::cout << j.dump() << std::endl;
}

void Demo::Print() const {
  if (o_.json) {
    PrintJson();
    return;
  }
  const SyntheticModel* m = r_.model ? &*r_.model : nullptr;
  if (m) {
    std::cout << absl::StrFormat(
        "model: %d tensors, %d layers, hidden %d, ffn %d, vocab %d, step %d\n",
        m->tensors.size(), m->config.layers, m->config.hidden, m->config.ffn,
        m->config.vocab, r_.step);
  }
  std::cout << absl::StrFormat("checkpoint: %s%s\n", r_.dir,
                               r_.kept ? "" : " (removed)");
  std::cout << absl::StrFormat(
      "ranks: %s\n", o_.comm == "mpi" ? "MPI processes (--comm mpi)"
                                      : "threads of this process (--comm "
                                        "inproc)");
  std::cout << absl::StrFormat("%-6s %5s %14s %10s %8s\n", "phase", "ranks",
                               "bytes", "seconds", "GB/s");
  const int save_world = r_.save_ranks * r_.save_replicas;
  const int load_world = r_.load_ranks * o_.replicas;
  if (r_.save_seconds) {
    std::cout << absl::StrFormat(
        "%-6s %5d %14d %10.3f %8.2f\n", "save", save_world, r_.bytes,
        *r_.save_seconds, GigabytesPerSecond(r_.bytes, *r_.save_seconds));
  }
  if (r_.load_seconds) {
    std::cout << absl::StrFormat(
        "%-6s %5d %14d %10.3f %8.2f\n", "load", load_world, r_.bytes,
        *r_.load_seconds, GigabytesPerSecond(r_.bytes, *r_.load_seconds));
  }
  if (r_.disk && r_.disk->skipped.empty()) {
    std::cout << absl::StrFormat(
        "disk: a %s direct-I/O probe beside the checkpoint (4 threads, 8 MiB "
        "requests) wrote %.2f GB/s with fdatasync and read %.2f GB/s\n",
        HumanBytes(r_.disk->bytes), r_.disk->write_gbps, r_.disk->read_gbps);
    // cairn writes data files with direct I/O, so they are not in the page
    // cache when the load runs (fincore shows none of their pages).
    std::cout << absl::StrFormat(
        "disk: the save ran at %.2fx the probe's write",
        GigabytesPerSecond(r_.bytes, *r_.save_seconds) / r_.disk->write_gbps);
    if (r_.load_seconds) {
      std::cout << absl::StrFormat(
          ", the load at %.2fx its read (from the disk: the save writes with "
          "direct I/O; with more threads and the kernel's readahead)",
          GigabytesPerSecond(r_.bytes, *r_.load_seconds) /
              r_.disk->read_gbps);
    }
    std::cout << "; bench/run.sh measures the disk with fio\n";
  } else if (r_.disk) {
    std::cout << "disk: not probed: " << r_.disk->skipped << "\n";
  }
  if (r_.save_replicas > 1 || o_.replicas > 1) {
    std::cout << absl::StrFormat(
        "replicas: save %s; load %s\n",
        LayoutText(r_.save_replicas, r_.save_ranks),
        r_.load_seconds ? LayoutText(o_.replicas, r_.load_ranks)
                        : std::string("not run"));
  }
  if (r_.save_seconds) {
    if (r_.rank_local) {
      std::cout << absl::StrFormat(
          "save: rank-local: each rank wrote its own rank-NNNNN/ folder, no "
          "collective, no dedup (replicated boxes written by every holder): "
          "%s, %s on disk\n",
          Plural(static_cast<uint64_t>(r_.save_files), "data file"),
          HumanBytes(r_.checkpoint_bytes));
    } else {
      std::cout << absl::StrFormat(
          "save: global: each replicated box written once, spread over its "
          "holders: %s, %s on disk\n",
          Plural(static_cast<uint64_t>(r_.save_files), "data file"),
          HumanBytes(r_.checkpoint_bytes));
    }
  }
  if (o_.async && r_.sync_save_seconds) {
    std::cout << absl::StrFormat(
        "async: %d training steps, a save every %d (to %s/step-<s>; the "
        "synchronous save above went to %s/sync)\n",
        o_.steps, o_.save_every, r_.dir, r_.dir);
    double total = 0;
    for (size_t i = 0; i < r_.blocked_seconds.size(); ++i) {
      total += r_.blocked_seconds[i];
      std::cout << absl::StrFormat(
          "step %d: training blocked %.3f s (sync save %.3f s)\n",
          i < r_.async_save_steps.size() ? r_.async_save_steps[i] : 0,
          r_.blocked_seconds[i], *r_.sync_save_seconds);
    }
    if (!r_.blocked_seconds.empty()) {
      const double mean =
          total / static_cast<double>(r_.blocked_seconds.size());
      std::cout << absl::StrFormat(
          "async: blocked %.3f s per save on average, %.1fx less than a "
          "synchronous save\n",
          mean, mean > 0 ? *r_.sync_save_seconds / mean : 0.0);
    }
  }
  if (r_.load_seconds) {
    switch (r_.load_mode) {
      case LoadMode::kRankLocal:
        std::cout << absl::StrFormat(
            "load: rank-local: same ranks and shards as the save; each rank "
            "read only its own rank-NNNNN/ folder (no collective, no "
            "broadcast)\n");
        break;
      case LoadMode::kMergeThenGlobal:
        std::cout << absl::StrFormat(
            "load: merged the %d rank folders into a global checkpoint in "
            "%.3f s (rank 0; %d replicated chunks kept once), then a global "
            "load resharding %d -> %d tensor-parallel ranks\n",
            r_.merged_ranks, r_.merge_seconds.value_or(0),
            r_.merge_duplicates, r_.save_ranks, r_.load_ranks);
        break;
      case LoadMode::kGlobal:
        std::cout << absl::StrFormat(
            "load: global%s, resharding %d -> %d tensor-parallel ranks\n",
            r_.merged_earlier ? " (the rank-local checkpoint was merged "
                                "earlier)"
                              : "",
            r_.save_ranks, r_.load_ranks);
        break;
    }
    const double ratio =
        r_.bytes > 0 ? static_cast<double>(r_.load_bytes_read) /
                           static_cast<double>(r_.bytes)
                     : 0;
    std::string how;
    if (r_.load_replica_group_size > 1) {
      how = absl::StrFormat(
          "; broadcast load in replica groups of %d: about %.2fx without",
          r_.load_replica_group_size, ratio * r_.load_replica_group_size);
    } else if (o_.replicas > 1) {
      how = r_.load_mode == LoadMode::kRankLocal
                ? "; rank-local: every replica read its own folder"
                : "; --no-broadcast: every replica read its own copy";
    }
    std::cout << absl::StrFormat(
        "storage read: %s by %d %s, %.2fx one copy of the state%s\n",
        HumanBytes(r_.load_bytes_read), load_world,
        load_world == 1 ? "rank" : "ranks", ratio, how);
    if (r_.load_bytes_read_per_rank.size() > 1) {
      constexpr size_t kShown = 16;
      std::vector<std::string> per;
      for (size_t i = 0;
           i < r_.load_bytes_read_per_rank.size() && i < kShown; ++i) {
        per.push_back(HumanBytes(r_.load_bytes_read_per_rank[i]));
      }
      if (r_.load_bytes_read_per_rank.size() > kShown) per.push_back("...");
      std::cout << "storage read per rank: " << absl::StrJoin(per, ", ")
                << "\n";
    }
    std::cout << absl::StrFormat(
        "load phases (slowest rank): metadata %.3f s, planning %.3f s, read "
        "%.3f s, broadcast %.3f s, copy %.3f s, staging %.3f s\n",
        r_.load_phases.metadata, r_.load_phases.planning, r_.load_phases.read,
        r_.load_phases.broadcast, r_.load_phases.copy,
        r_.load_phases.staging);
    if (r_.verified) {
      const int saved_world = r_.save_ranks * r_.save_replicas;
      std::cout << absl::StrFormat(
          "verified: yes (%d elements bit-exact, saved by %d %s, loaded by "
          "%d%s; step and %s match)\n",
          r_.elements_verified, saved_world,
          saved_world == 1 ? "rank" : "ranks", load_world,
          o_.replicas > 1 ? "; every replica checked its own copy" : "",
          Plural(static_cast<uint64_t>(r_.rng_verified), "rng object"));
    } else {
      std::cout << "verified: NO (" << r_.mismatch << ")\n";
    }
  } else {
    std::cout << "verified: not run (save phase only)\n";
  }
  std::cout << std::flush;
}

int Demo::Finish(const absl::Status& status) {
  if (!status.ok()) {
    PrintError("demo", status);
    return 1;
  }
  // The disk's own speed beside the save's (with the checkpoint still
  // there, so the probe's file sits on the same disk).
  if (r_.save_seconds && !o_.no_disk_probe) {
    if (!o_.quiet) {
      std::cerr << "cairn demo: probing the disk of " << r_.dir
                << " (direct I/O)" << std::endl;
    }
    r_.disk = ProbeDisk(r_.dir, r_.bytes);
  }
  Print();
  if (r_.load_seconds && !r_.verified) {
    PrintError("demo", absl::DataLossError(
                           absl::StrCat("verification failed: ", r_.mismatch)));
    return 1;
  }
  return 0;
}

void Demo::UsageError(const std::string& message) const {
  if (!leader_) return;  // every rank found the same; one says it
  std::cerr << "cairn demo: " << message << "\nRun 'cairn demo --help' for "
            << "usage." << std::endl;
}

absl::StatusOr<std::string> Demo::MakeTempDir() const {
  const char* tmpdir = std::getenv("TMPDIR");
  std::string templ =
      absl::StrCat(tmpdir && *tmpdir ? tmpdir : "/tmp", "/cairn-demo-XXXXXX");
  if (mkdtemp(templ.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("cannot create a temporary directory ", templ, ": ",
                     std::strerror(errno)));
  }
  return templ;
}

int Demo::RunInProcessRanks() {
  // The ranks share this machine's cores for filling and checking.
  const int threads = o_.threads > 0 ? o_.threads : DefaultThreads();
  absl::Status status;
  if (saves()) {
    const int n = o_.replicas * save_tp_;
    const int per_rank = std::max(1, threads / n);
    status = CombineRankStatuses(RunInProcess(n, [&](Communicator& comm) {
      return SaveAsRank(comm, per_rank);
    }));
    // --async: the load checks the last async checkpoint.
    if (o_.async) url_ = AsyncStepUrl(LastAsyncSaveStep());
  }
  if (status.ok() && loads()) {
    const int n = o_.replicas * load_tp_;
    const int per_rank = std::max(1, threads / n);
    status = CombineRankStatuses(RunInProcess(
        n, [&](Communicator& comm) { return LoadAsRank(comm, per_rank); }));
  }
  return Finish(status);
}

int Demo::RunMpiRanks(Communicator& world) {
  const int me = world.rank();
  const int load_world = o_.replicas * load_tp_;
  const int threads =
      o_.threads > 0
          ? o_.threads
          : std::max(1, DefaultThreads() / MpiRanksOnThisMachine(world.size()));
  absl::Status status;
  if (saves()) {
    status = SaveAsRank(world, threads);
    // --async: the load checks the last async checkpoint.
    if (o_.async) url_ = AsyncStepUrl(LastAsyncSaveStep());
  }
  if (status.ok() && loads()) {
    // The first R x M ranks load; Split is collective over the world.
    absl::StatusOr<std::unique_ptr<Communicator>> group =
        world.Split(me < load_world ? 0 : 1, me);
    status = AgreeOnStatus(world, group.status());
    if (status.ok() && me < load_world) status = LoadAsRank(**group, threads);
  }
  // The final barrier: rank 0 (a rank of every phase, so it knows the
  // outcome) prints it and sends its exit status to the others.
  int rc = leader_ ? Finish(status) : 0;
  std::string rc_text = absl::StrCat(rc);
  if (absl::Status s = world.Broadcast(rc_text, 0); !s.ok()) {
    PrintError("demo", absl::Status(s.code(), absl::StrCat("rank ", me, ": ",
                                                           s.message())));
    return 1;
  }
  if (!leader_ && !absl::SimpleAtoi(rc_text, &rc)) rc = 1;
  if (!status.ok() && rc == 0) {
    // Cannot happen while statuses are agreed; never exit 0 on an error.
    PrintError("demo",
               absl::Status(status.code(),
                            absl::StrCat("rank ", me, ": ", status.message())));
    return 1;
  }
  return rc;
}

int Demo::Run() {
  if (o_.kv) return RunKv();
  std::unique_ptr<Communicator> world;
  const int replicas = o_.replicas;
  if (o_.comm == "mpi") {
    absl::StatusOr<std::unique_ptr<Communicator>> w = MpiWorldCommunicator();
    if (!w.ok()) {
      PrintError(
          "demo",
          absl::Status(w.status().code(),
                       absl::StrCat("--comm mpi: ", w.status().message(),
                                    HasMpi() ? "" : "; use --comm inproc")));
      return 1;
    }
    world = *std::move(w);
    leader_ = world->rank() == 0;
    const int size = world->size();
    // Checks every rank makes alike, so all exit together.
    if (o_.ranks_given && static_cast<int64_t>(o_.ranks) * replicas != size) {
      UsageError(
          replicas == 1
              ? absl::StrFormat(
                    "--ranks %d does not match the MPI world size %d: under "
                    "--comm mpi every MPI process is one save rank (run "
                    "`mpirun -np %d ...`, or leave out --ranks)",
                    o_.ranks, size, o_.ranks)
              : absl::StrFormat(
                    "--ranks %d with --replicas %d needs %d MPI processes, "
                    "but the MPI world size is %d: under --comm mpi every "
                    "MPI process is one save rank (run `mpirun -np %d ...`, "
                    "or leave out --ranks: it defaults to the world size "
                    "divided by --replicas)",
                    o_.ranks, replicas,
                    static_cast<int64_t>(o_.ranks) * replicas, size,
                    static_cast<int64_t>(o_.ranks) * replicas));
      return kUsageError;
    }
    if (saves() && size % replicas != 0) {
      UsageError(absl::StrFormat(
          "the MPI world size %d is not a multiple of --replicas %d: under "
          "--comm mpi the save runs on --replicas x --ranks MPI processes "
          "(run `mpirun -np %d ...`, say)",
          size, replicas, (size + replicas - 1) / replicas * replicas));
      return kUsageError;
    }
    save_tp_ = o_.ranks_given ? o_.ranks : std::max(1, size / replicas);
    load_tp_ = o_.load_ranks_given ? o_.load_ranks : size / replicas;
    if (loads() && o_.load_ranks_given &&
        static_cast<int64_t>(o_.load_ranks) * replicas > size) {
      UsageError(
          replicas == 1
              ? absl::StrFormat(
                    "--load-ranks %d is more than the MPI world size %d: "
                    "under --comm mpi the load runs on the first M MPI "
                    "processes",
                    o_.load_ranks, size)
              : absl::StrFormat(
                    "--load-ranks %d with --replicas %d needs %d MPI "
                    "processes, more than the MPI world size %d: under "
                    "--comm mpi the load runs on the first --replicas x "
                    "--load-ranks MPI processes",
                    o_.load_ranks, replicas,
                    static_cast<int64_t>(o_.load_ranks) * replicas, size));
      return kUsageError;
    }
    if (loads() && load_tp_ < 1) {
      UsageError(absl::StrFormat(
          "--replicas %d is more than the MPI world size %d", replicas, size));
      return kUsageError;
    }
  } else {
    if (auto [rank, size] = MpirunRankAndSize(); size > 1) {
      leader_ = rank == 0;
      UsageError(
          "started by mpirun with several processes but --comm inproc: each "
          "process would run a whole demo of its own; pass --comm mpi");
      return kUsageError;
    }
    save_tp_ = o_.ranks;
    load_tp_ = o_.load_ranks;
    if (static_cast<int64_t>(o_.ranks) * replicas > kMaxInProcessRanks ||
        static_cast<int64_t>(o_.load_ranks) * replicas > kMaxInProcessRanks) {
      UsageError(
          replicas == 1
              ? absl::StrFormat(
                    "--ranks and --load-ranks are at most %d with --comm "
                    "inproc (each rank is a thread with its own IO threads)",
                    kMaxInProcessRanks)
              : absl::StrFormat(
                    "--replicas x --ranks and --replicas x --load-ranks are "
                    "at most %d with --comm inproc (each rank is a thread "
                    "with its own IO threads)",
                    kMaxInProcessRanks));
      return kUsageError;
    }
  }
  if (o_.async && o_.phase == "load") {
    UsageError("--async runs a training loop that saves; it cannot go with "
               "--phase load (load a step-<s> folder it wrote instead)");
    return kUsageError;
  }
  if (!o_.async && (o_.steps_given || o_.save_every_given)) {
    UsageError("--steps and --save-every need --async");
    return kUsageError;
  }
  if (o_.async && o_.step > std::numeric_limits<int64_t>::max() - o_.steps) {
    UsageError(absl::StrFormat(
        "--step %d + --steps %d is past the largest step, %d: --async saves "
        "steps --step + 1 to --step + --steps",
        o_.step, o_.steps, std::numeric_limits<int64_t>::max()));
    return kUsageError;
  }
  if (o_.async && o_.steps < o_.save_every) {
    UsageError(absl::StrFormat(
        "--steps %d is less than --save-every %d: the loop would never save",
        o_.steps, o_.save_every));
    return kUsageError;
  }
  if (o_.phase != "all" && o_.dir.empty()) {
    UsageError(absl::StrCat("--phase ", o_.phase,
                            " needs --dir (the default temporary directory "
                            "does not outlive one run)"));
    return kUsageError;
  }

  // The checkpoint directory; under MPI rank 0 makes the temporary one and
  // tells the others (so it must be on a filesystem they all see).
  std::optional<std::filesystem::path> temp;
  if (o_.dir.empty()) {
    absl::StatusOr<std::string> made =
        leader_ ? MakeTempDir() : absl::StatusOr<std::string>(std::string());
    if (world) {
      std::string text =
          made.ok() ? "+" + *made : "-" + EncodeStatus(made.status());
      if (absl::Status s = world->Broadcast(text, 0); !s.ok()) {
        made = s;
      } else if (!text.empty() && text[0] == '+') {
        made = text.substr(1);
      } else {
        made = DecodeStatus(text.substr(1));
      }
    }
    if (!made.ok()) {
      if (leader_) PrintError("demo", made.status());
      return 1;
    }
    if (leader_) temp = *made;
    r_.dir = *made;
    r_.kept = o_.keep;
  } else {
    r_.dir = o_.dir;
  }
  url_ = NormalizeUrl(r_.dir);
  if (o_.dir.empty()) r_.dir = url_;
  absl::Cleanup remove_temp = [&] {
    if (temp && !o_.keep) {
      std::error_code ec;
      std::filesystem::remove_all(*temp, ec);
    }
  };
  return world ? RunMpiRanks(*world) : RunInProcessRanks();
}

}  // namespace

// --kv: the key-value table demo, in-process ranks only.
int Demo::RunKv() {
  if (o_.comm != "inproc") {
    UsageError("--kv runs its ranks in this process: leave out --comm mpi");
    return 2;
  }
  KvDemoOptions k;
  k.dir = o_.dir;
  k.ranks = o_.ranks;
  k.load_ranks = o_.load_ranks;
  k.buckets = o_.kv_buckets;
  k.json = o_.json;
  k.keep = o_.keep;
  k.quiet = o_.quiet;
  absl::StatusOr<uint64_t> rows = ParseByteSize(o_.kv_rows);
  if (!rows.ok() || *rows == 0) {
    UsageError(absl::StrCat("--kv-rows ", o_.kv_rows,
                            ": expected a positive count, e.g. 1000000 or 10M"));
    return 2;
  }
  k.rows = *rows;
  if (!o_.memory_budget.empty()) {
    absl::StatusOr<uint64_t> budget = ParseByteSize(o_.memory_budget);
    if (!budget.ok()) {
      UsageError(absl::StrCat("--memory-budget ", o_.memory_budget, ": ",
                              budget.status().message()));
      return 2;
    }
    k.memory_budget = *budget;
  }
  return RunKvDemo(k);
}

void RegisterDemo(CLI::App& app) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* cmd = app.add_subcommand(
      "demo",
      "Save and reload a synthetic training state as several ranks; verify "
      "every element");
  cmd->add_option("--dir", o->dir,
                  "checkpoint directory (default: a fresh temporary directory "
                  "under $TMPDIR or /tmp, removed afterwards unless --keep; "
                  "with --comm mpi on several machines, pass a directory "
                  "they all see)");
  cmd->add_option("--size", o->size,
                  "bytes of state, e.g. 256MiB, 2GiB, 1G, 500M or plain bytes "
                  "(ignored by --phase load, which reads the model from the "
                  "checkpoint); with --replicas R the job holds R copies")
      ->capture_default_str()
      ->check(ByteSizeValidator(1, kMaxSyntheticBytes));
  cmd->add_option("--phase", o->phase,
                  "save, load, or all (save then load); save and load may run "
                  "as separate invocations on the same --dir, with different "
                  "rank counts")
      ->capture_default_str()
      ->check(CLI::IsMember({"save", "load", "all"}));
  cmd->add_option("--comm", o->comm,
                  "how the ranks run: inproc (threads of this process) or mpi "
                  "(one rank per MPI process: start it with `mpirun -np N "
                  "cairn demo --comm mpi`; needs cairn built with "
                  "CAIRN_WITH_MPI)")
      ->capture_default_str()
      ->check(CLI::IsMember({"inproc", "mpi"}));
  CLI::Option* ranks =
      cmd->add_option(
             "--ranks", o->ranks,
             "tensor-parallel ranks that save (per replica group), each "
             "holding its tensor-parallel shard (column-parallel weights "
             "split on dim 0, row-parallel on dim 1, norms replicated, Adam "
             "moments like their weights) and its own RNG object "
             "rng.rank<r>. Default 4 with --comm inproc; with --comm mpi it "
             "is the MPI world size divided by --replicas and, if given, "
             "--replicas x N must equal the world size. --phase load reads "
             "it from the checkpoint")
          ->type_name("N")
          ->check(CLI::PositiveNumber);
  CLI::Option* load_ranks =
      cmd->add_option(
             "--load-ranks", o->load_ranks,
             "tensor-parallel ranks that load (per replica group), with the "
             "same tensor-parallel rule but uneven 2:3:4:... splits, so that "
             "shard boundaries fall off the save's and the load reshards "
             "even when it equals --ranks (except a rank-local load, which "
             "keeps the save's shards). Default 3 with --comm inproc; with "
             "--comm mpi the world size divided by --replicas, and "
             "--replicas x M at most the world size (the first R x M "
             "processes load, the others wait)")
          ->type_name("M")
          ->check(CLI::PositiveNumber);
  cmd->add_option(
         "--replicas", o->replicas,
         "data-parallel replica groups, each holding the whole sharded "
         "model: the save runs on R x --ranks ranks and the load on R x "
         "--load-ranks, rank g*N+t holding tensor-parallel shard t. The save "
         "writes each box once however many ranks hold it (spread over the "
         "holders); the load is a broadcast load: the R ranks holding the "
         "same shard read each stored byte once between them and broadcast "
         "it, so storage serves one copy instead of R (the summary shows the "
         "storage bytes each rank read). With --comm mpi the world size "
         "must be a multiple of R")
      ->type_name("R")
      ->capture_default_str()
      ->check(CLI::Range(1, kMaxInProcessRanks));
  cmd->add_flag(
      "--rank-local", o->rank_local,
      "save rank-local (SaveOptions::rank_local): no collective, each rank "
      "writes its own rank-NNNNN/ folder under --dir with its own "
      "metadata.json and everything it holds (no dedup: replicated boxes are "
      "written by every holder). The load then reads rank-locally (each rank "
      "only its own folder, no collective, no broadcast) when it has the "
      "save's layout (--load-ranks equal to --ranks, same --replicas), and "
      "otherwise first merges the folders into a global checkpoint (rank 0, "
      "timed; like `cairn merge`) and reshards. --phase load recognizes a "
      "rank-local checkpoint without this flag");
  AddCodecOptions(cmd, &o->codec, "the saved tensors");
  cmd->add_flag("--no-broadcast", o->no_broadcast,
                "load without broadcast (LoadOptions::broadcast_replicas = "
                "false): every replica reads its own copy from storage, to "
                "compare the storage bytes read with --replicas");
  cmd->add_flag("--node-reads", o->node_reads,
                "ranks of one host that need columns of the same chunk read it "
                "once and hand each other the parts (LoadOptions::"
                "share_node_reads); off by default: on page-cached local files "
                "it costs as many copies as it saves");
  cmd->add_option("--memory-budget", o->memory_budget,
                  "host memory each loading rank may hold for reads, staging "
                  "and broadcast (LoadOptions::memory_budget_bytes; default "
                  "1GiB, 0: no limit)")
      ->type_name("SIZE")
      ->check(ByteSizeValidator(0));
  CLI::Option* step =
      cmd->add_option(
             "--step", o->step,
             "training step the values derive from (load: default is the "
             "checkpoint's `step` scalar)")
          ->capture_default_str()
          ->transform(Int64Validator());
  cmd->add_option("--layers", o->layers,
                  "transformer layers (default: grows with --size)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--threads", o->threads,
                  "threads per process for filling and checking values, "
                  "shared by its in-process ranks (default: the cores, "
                  "divided among the MPI processes on this machine)")
      ->check(CLI::Range(1, 1024));
  cmd->add_flag(
      "--async", o->async,
      "after the save (then synchronous, to <dir>/sync), run --steps "
      "simulated training steps (each refills the state with that step's "
      "values) with an AsyncSaver save every --save-every steps to "
      "<dir>/step-<s>; print per save the time the training loop was "
      "blocked next to the synchronous save's time. The load phase then "
      "checks the last async checkpoint");
  CLI::Option* steps =
      cmd->add_option("--steps", o->steps, "training steps with --async")
          ->type_name("N")
          ->capture_default_str()
          ->check(CLI::Range(1, 1000000));
  CLI::Option* save_every =
      cmd->add_option("--save-every", o->save_every,
                      "with --async, save at steps K, 2K, ...")
          ->type_name("K")
          ->capture_default_str()
          ->check(CLI::Range(1, 1000000));
  cmd->add_flag("--kv", o->kv,
                "instead: a key-value embedding table (--kv-rows ids over a "
                "2^40 id space, bf16 rows of width 128 and two optimizer "
                "columns) saved by --ranks ranks and loaded by --load-ranks, "
                "in the saved bucketing and in another, every row checked");
  cmd->add_option("--kv-rows", o->kv_rows,
                  "rows of the --kv table, e.g. 1000000 or 10M (M = 2^20); "
                  "276 bytes each with its id: the default writes 5.5 GB")
      ->capture_default_str();
  cmd->add_option("--kv-buckets", o->kv_buckets,
                  "buckets of the --kv table (the loads' own bucket count is "
                  "1.5x this, plus 1)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--json", o->json, "print one JSON object instead of a table");
  cmd->add_flag("--no-disk-probe", o->no_disk_probe,
                "after a save, do not probe the disk beside the checkpoint "
                "(by default a direct-I/O write and read of up to 256 MiB, "
                "shown next to the save's throughput)");
  cmd->add_flag("--keep", o->keep, "keep the default temporary directory");
  cmd->add_flag("--overwrite", o->overwrite,
                "replace a checkpoint already in --dir (global or "
                "rank-local; rank folders the new save does not rewrite are "
                "un-committed)");
  cmd->add_flag("-q,--quiet", o->quiet, "no progress lines on stderr");
  cmd->footer(
      "Saves a synthetic training state (embedding, transformer layers, Adam\n"
      "moments, a step scalar, one RNG object per rank) as --ranks tensor-\n"
      "parallel ranks (times --replicas data-parallel replica groups), each\n"
      "building only its own shards; loads it back as --load-ranks ranks\n"
      "(times --replicas) sharded unevenly (resharding); checks every\n"
      "element bit for bit on every rank (each replica its own copy), the\n"
      "step and every RNG object; and reports save and load throughput\n"
      "(state bytes over the wall time of the whole save or load, slowest\n"
      "rank), the storage bytes each load rank read, and the load's phase\n"
      "times. Every value derives from (FQN, element index, step), and the\n"
      "model config, rank counts and mode are in the checkpoint's user\n"
      "metadata, so --phase load in another process, with another rank\n"
      "count, can check what --phase save wrote. Only rank 0 prints; any\n"
      "rank's error is printed with its rank and every process exits\n"
      "non-zero.\n\n"
      "Examples:\n"
      "  cairn demo                           256 MiB, 4 ranks save, 3 load\n"
      "  cairn demo --size 2GiB --ranks 8 --load-ranks 5 --json\n"
      "  cairn demo --dir /ckpt/demo --phase save --ranks 4 --step 7\n"
      "  cairn demo --dir /ckpt/demo --phase load --load-ranks 2\n"
      "  cairn demo --replicas 2 --ranks 2 --load-ranks 2\n"
      "                                       2 replica groups of 2 ranks;\n"
      "                                       storage serves one copy\n"
      "  cairn demo --replicas 2 --ranks 2 --load-ranks 2 --no-broadcast\n"
      "                                       the same, each replica reads\n"
      "  cairn demo --async --steps 10 --size 64MiB\n"
      "                                       training blocked per async save\n"
      "                                       vs a synchronous save\n"
      "  cairn demo --rank-local              rank-local save; 4 -> 3 ranks:\n"
      "                                       merge, then a resharding load\n"
      "  cairn demo --rank-local --load-ranks 4\n"
      "                                       rank-local save and load\n"
      "  mpirun -np 4 cairn demo --comm mpi --load-ranks 3\n"
      "  mpirun -np 8 cairn demo --comm mpi --replicas 2   (2 x 4 ranks)");
  cmd->callback([o, step, ranks, load_ranks, steps, save_every] {
    o->step_given = step->count() > 0;
    o->steps_given = steps->count() > 0;
    o->save_every_given = save_every->count() > 0;
    o->ranks_given = ranks->count() > 0;
    o->load_ranks_given = load_ranks->count() > 0;
    Demo demo(*o);
    if (int rc = demo.Run(); rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace cairn::tools
