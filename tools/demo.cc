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
//
// This file checks the options, runs the ranks (threads or MPI processes)
// through the phases and registers the subcommand; the save phase is in
// demo_save.cc, the load phase in demo_load.cc, the report in
// demo_report.cc, and their shared declarations in demo_internal.h.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "commands.h"
#include "demo_internal.h"
#include "demo_kv.h"
#include "core/parallel.h"
#include "rank_status.h"
#include "synthetic_model.h"

namespace cairn::tools {
namespace {

// In-process ranks are threads, each with its own IO threads.
constexpr int kMaxInProcessRanks = 256;
constexpr int kUsageError = 2;

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

}  // namespace

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

std::string SubUrl(std::string url, const std::string& name) {
  while (url.size() > 1 && url.back() == '/') url.pop_back();
  return absl::StrCat(url, "/", name);
}

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

uint64_t StateBytes(const SyntheticModel& m, size_t rng_objects) {
  return m.tensor_bytes() +
         static_cast<uint64_t>(m.config.rng_bytes) * rng_objects;
}

uint64_t JobBytes(const SyntheticModel& m, int replicas, size_t rng_objects) {
  return m.tensor_bytes() * static_cast<uint64_t>(replicas) +
         static_cast<uint64_t>(m.config.rng_bytes) * rng_objects;
}

std::string LayoutText(int replicas, int tp) {
  const int total = replicas * tp;
  std::string text = absl::StrCat(total, total == 1 ? " rank" : " ranks");
  if (replicas > 1) {
    absl::StrAppend(&text, " (", replicas, " replica groups x ", tp,
                    " tensor-parallel)");
  }
  return text;
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
