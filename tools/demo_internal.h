// The `cairn demo` subcommand's shared declarations: its options, the
// result that rank 0 fills and prints, the Demo class whose phases live in
// one file each (demo.cc runs the ranks and registers the subcommand,
// demo_save.cc is the save phase, demo_load.cc the load phase and
// demo_report.cc prints the outcome), and the helpers several of them use
// (defined in demo.cc). The protocol is described at the top of demo.cc.
#ifndef CAIRN_TOOLS_DEMO_INTERNAL_H_
#define CAIRN_TOOLS_DEMO_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/cairn.h"
#include "commands.h"
#include "synthetic_model.h"

namespace cairn::tools {

constexpr char kUserKey[] = "cairn_demo";

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

// Collective: the largest of each of `seconds` over the ranks (in
// nanoseconds on the wire, since AllReduce is for integers).
absl::StatusOr<std::vector<double>> MaxSecondsEach(
    Communicator& comm, const std::vector<double>& seconds);
absl::StatusOr<double> MaxSeconds(Communicator& comm, double seconds);

// "file:///ckpt/sync" from "file:///ckpt" and "sync".
std::string SubUrl(std::string url, const std::string& name);

// Refuses states the machine cannot hold instead of being killed by the
// OOM killer. `what` says what the bytes are.
absl::Status CheckFitsInMemory(uint64_t bytes, const std::string& what);

// One copy of the state: every tensor once, plus the RNG objects.
uint64_t StateBytes(const SyntheticModel& m, size_t rng_objects);

// What the ranks of one phase hold together: every replica group a whole
// copy of the tensors (the replicated norms once per rank on top, which is
// small), every rank its RNG objects. Saves and loads run one after the
// other, each freeing its state before the next.
uint64_t JobBytes(const SyntheticModel& m, int replicas, size_t rng_objects);

// "4 ranks" or "4 ranks (2 replica groups x 2 tensor-parallel)".
std::string LayoutText(int replicas, int tp);

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

}  // namespace cairn::tools

#endif  // CAIRN_TOOLS_DEMO_INTERNAL_H_
