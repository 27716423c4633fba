// cairn demo: saves a synthetic training state (see synthetic_model.h) as N
// tensor-parallel ranks and loads it back as M ranks sharded differently,
// verifying every element.
//
// The ranks are threads of this process (--comm inproc, RunInProcess) or one
// MPI process each (--comm mpi, under mpirun). Every rank runs the same
// steps; each step that can fail on one rank alone ends in a status exchange
// (AgreeOnStatus), so all ranks take the same branch and none is left
// waiting in a collective that another rank skipped.
//
//  save phase, on each of the N save ranks:
//   1. Choose the model for --size (a pure function: every rank gets the
//      same). Rank 0 checks that --dir holds no checkpoint (unless
//      --overwrite) and that the state fits in memory.
//   2. Fill only this rank's shards (tensor parallelism, TensorParallelBox
//      with even splits): column-parallel weights (wq, wk, wv, w1, w3,
//      embedding) split on dim 0, row-parallel ones (wo, w2) on dim 1, norms
//      replicated (every rank holds the whole norm; cairn writes such a box
//      once); Adam moments follow their weights. Plus this rank's own RNG
//      object `rng.rank<r>` and the `step` scalar.
//   3. Barrier, then Save (timed on every rank; the phase's time is the
//      slowest rank's). The user metadata records the model config, the
//      step and N, so that a later `--phase load` with any rank count can
//      rebuild every expected value.
//  load phase, on each of the M load ranks (under MPI: the first M ranks of
//  the world, on a Split communicator; the others wait at the final
//  barrier):
//   4. Read the metadata; rebuild the model, N and the step (--step, else
//      the stored `step` scalar).
//   5. Allocate this rank's destinations: the same tensor-parallel rule over
//      M ranks, but with uneven splits (SplitRange 2:3:4:...), so that shard
//      boundaries do not line up with the save's even ones and every load
//      reshards, even when M == N. Load rank r also asks for the RNG objects
//      of save ranks r, r+M, r+2M, ... (each object once across the load).
//      Destinations are poisoned with a NaN pattern (which the synthetic
//      values never produce) before the timed load, so an element the load
//      never wrote cannot pass verification, and the timing measures cairn
//      rather than this VM's slow first touch of fresh memory.
//   6. Barrier, then Load (timed like the save); check every element bit for
//      bit, the `step` scalar and this rank's RNG objects; sum the counts
//      over the ranks: the load passes only if every element of every
//      tensor and all N RNG objects were checked.
//  7. Rank 0 prints the table or the JSON; under MPI it then broadcasts the
//     exit status, which is the final barrier.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
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
#include "core/parallel.h"
#include "rank_status.h"
#include "synthetic_model.h"

namespace cairn::tools {
namespace {

constexpr uint32_t kPoison = 0x7FC0DEADu;  // a quiet NaN
constexpr char kUserKey[] = "cairn_demo";
// Version 2 added "save_ranks" and per-rank RNG objects; version 1
// checkpoints (one "rng" object) still load.
constexpr int kUserVersion = 2;
// In-process ranks are threads, each with its own IO threads.
constexpr int kMaxInProcessRanks = 256;
constexpr int kUsageError = 2;

struct DemoOptions {
  std::string dir;
  std::string size = "256MiB";
  std::string phase = "all";
  std::string comm = "inproc";
  int64_t step = 1000;
  bool step_given = false;
  int ranks = 4;
  bool ranks_given = false;
  int load_ranks = 3;
  bool load_ranks_given = false;
  int layers = 0;
  bool json = false;
  bool keep = false;
  bool overwrite = false;
  bool quiet = false;
  int threads = 0;  // 0: the machine's cores
};

// Filled by rank 0 (of the save, then of the load) and printed by it.
struct DemoResult {
  std::string dir;
  bool kept = true;
  std::optional<SyntheticModel> model;
  int64_t step = 0;
  uint64_t bytes = 0;  // every tensor once plus every rank's RNG object
  int save_ranks = 0;  // from the checkpoint for --phase load
  int load_ranks = 0;  // 0: no load ran
  std::optional<double> save_seconds;
  std::optional<double> load_seconds;
  std::optional<double> verify_seconds;
  int save_files = 0;             // over all save ranks
  uint64_t checkpoint_bytes = 0;  // data files, headers included
  uint64_t load_bytes_read = 0;   // over all load ranks
  int64_t elements_verified = 0;  // distinct elements, over all load ranks
  int64_t rng_verified = 0;
  bool verified = false;
  std::string mismatch;  // the first wrong element, when there is one
};

// What a checkpoint's "cairn_demo" user metadata says.
struct SavedDemo {
  SyntheticConfig config;
  int64_t step = 0;
  int save_ranks = 1;
  std::vector<std::string> rng_fqns;  // by save rank
};

// Collective: the largest `seconds` over the ranks (in nanoseconds on the
// wire, since AllReduce is for integers).
absl::StatusOr<double> MaxSeconds(Communicator& comm, double seconds) {
  int64_t ns[1] = {static_cast<int64_t>(seconds * 1e9)};
  if (absl::Status s = comm.AllReduce(ns, ReduceOp::kMax); !s.ok()) return s;
  return static_cast<double>(ns[0]) / 1e9;
}

class Demo {
 public:
  explicit Demo(const DemoOptions& o) : o_(o) {}

  // 0, or the exit status after printing the error.
  int Run();

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
  // One rank of the save (load); collective over `comm`. Rank 0 fills r_.
  absl::Status SaveAsRank(Communicator& comm, int threads);
  absl::Status LoadAsRank(Communicator& comm, int threads);
  // Prints the outcome; returns the exit status.
  int Finish(const absl::Status& status);
  void Print() const;

  bool saves() const { return o_.phase == "save" || o_.phase == "all"; }
  bool loads() const { return o_.phase == "load" || o_.phase == "all"; }

  const DemoOptions& o_;
  bool leader_ = true;  // prints: false on MPI ranks other than 0
  std::string url_;
  DemoResult r_;
};

nlohmann::json ConfigJson(const SyntheticConfig& c, int64_t step,
                          int save_ranks) {
  return {{"version", kUserVersion},
          {"layers", c.layers},
          {"hidden", c.hidden},
          {"ffn", c.ffn},
          {"vocab", c.vocab},
          {"rng_bytes", c.rng_bytes},
          {"step", step},
          {"save_ranks", save_ranks}};
}

// The demo description in `md`'s user metadata; the step is --step when
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
    if (d.contains("save_ranks")) {
      out.save_ranks = d.at("save_ranks").get<int>();
      // Each save rank stored an RNG object; bounding by them also keeps a
      // damaged number from making this loop huge.
      if (out.save_ranks < 1 ||
          static_cast<size_t>(out.save_ranks) > md.objects.size()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "bad \"cairn_demo\" user metadata: save_ranks ", out.save_ranks,
            ", but the checkpoint holds ", md.objects.size(),
            " byte objects (one per save rank)"));
      }
      for (int r = 0; r < out.save_ranks; ++r) {
        out.rng_fqns.push_back(RngFqn(r));
      }
    } else {
      // Version 1: one process saved, with one object named "rng".
      out.rng_fqns.push_back(kRngFqn);
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::FailedPreconditionError(
        absl::StrCat("bad \"cairn_demo\" user metadata: ", e.what()));
  }
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

// The ranks hold about one copy of the state in total (save, then load);
// refuse sizes the machine cannot hold instead of being killed by the OOM
// killer.
absl::Status CheckFitsInMemory(uint64_t bytes) {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return absl::OkStatus();
  const uint64_t physical =
      static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
  if (bytes > physical / 10 * 9) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the demo state (", HumanBytes(bytes),
                     ") must fit in memory, and this machine has ",
                     HumanBytes(physical), "; pass a smaller --size"));
  }
  return absl::OkStatus();
}

uint64_t StateBytes(const SyntheticModel& m, size_t rng_objects) {
  return m.tensor_bytes() +
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

absl::Status Demo::SaveAsRank(Communicator& comm, int threads) {
  const int rank = comm.rank();
  const int ranks = comm.size();

  // 1. The model (the same on every rank), checks on rank 0.
  std::optional<SyntheticModel> model;
  absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<uint64_t> target = ParseByteSize(o_.size);
    if (!target.ok()) return target.status();
    absl::StatusOr<SyntheticConfig> config = ChooseConfig(*target, o_.layers);
    if (!config.ok()) return config.status();
    absl::StatusOr<SyntheticModel> built = BuildModel(*config);
    if (!built.ok()) return built.status();
    model = *std::move(built);
    if (rank != 0) return absl::OkStatus();
    if (absl::Status s =
            CheckFitsInMemory(StateBytes(*model, static_cast<size_t>(ranks)));
        !s.ok()) {
      return s;
    }
    absl::StatusOr<std::unique_ptr<Storage>> storage = Storage::Open(url_);
    if (!storage.ok()) return storage.status();
    absl::StatusOr<bool> exists = (*storage)->Exists(kMetadataFileName);
    if (exists.ok() && *exists && !o_.overwrite) {
      return absl::AlreadyExistsError(absl::StrCat(
          url_, " already holds a checkpoint; pass --overwrite to replace it"));
    }
    return absl::OkStatus();
  }();
  if (status = AgreeOnStatus(comm, status); !status.ok()) return status;
  const SyntheticModel& m = *model;
  const int64_t step = o_.step;
  const uint64_t bytes = StateBytes(m, static_cast<size_t>(ranks));
  if (rank == 0) {
    r_.model = m;
    r_.step = step;
    r_.bytes = bytes;
    r_.save_ranks = ranks;
  }
  Log(comm,
      "building %s of synthetic state on %d %s: %d layers, hidden %d, ffn "
      "%d, vocab %d; %d tensors, step %d",
      HumanBytes(bytes), ranks, ranks == 1 ? "rank" : "ranks", m.config.layers,
      m.config.hidden, m.config.ffn, m.config.vocab, m.tensors.size(), step);

  // 2. This rank's shards only.
  StateDict sd;
  status = [&]() -> absl::Status {
    for (const SyntheticTensor& t : m.tensors) {
      std::optional<Box> box = TensorParallelBox(t, rank, ranks, false);
      if (!box) continue;  // more ranks than rows: nothing of t here
      absl::StatusOr<Tensor> buf = Tensor::Empty(t.dtype, box->sizes);
      if (!buf.ok()) return buf.status();
      if (absl::Status s = FillBox(t, *box, buf->view(), step, threads);
          !s.ok()) {
        return s;
      }
      auto owned = std::make_shared<Tensor>(*std::move(buf));
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

  // 3. The timed, collective save.
  Log(comm, "saving as %d tensor-parallel %s to %s", ranks,
      ranks == 1 ? "rank" : "ranks", url_);
  SaveOptions options;
  options.overwrite = o_.overwrite;
  options.comm = &comm;
  options.user_metadata =
      nlohmann::json{{kUserKey, ConfigJson(m.config, step, ranks)}}.dump();
  if (absl::Status s = comm.Barrier(); !s.ok()) return s;
  Stopwatch clock;
  absl::StatusOr<SaveResult> saved = Save(sd, url_, options);
  const double seconds = clock.Seconds();
  if (status = AgreeOnStatus(comm, saved.status()); !status.ok()) {
    return status;
  }
  absl::StatusOr<double> wall = MaxSeconds(comm, seconds);
  if (!wall.ok()) return wall.status();
  int64_t files[1] = {saved->files};
  if (absl::Status s = comm.AllReduce(files, ReduceOp::kSum); !s.ok()) {
    return s;
  }
  if (rank == 0) {
    r_.save_seconds = *wall;
    r_.save_files = static_cast<int>(files[0]);
    r_.checkpoint_bytes = saved->checkpoint_bytes;
  }
  Log(comm, "saved %s in %.3f s (%.2f GB/s), %s", HumanBytes(bytes), *wall,
      GigabytesPerSecond(bytes, *wall),
      Plural(static_cast<uint64_t>(files[0]), "data file"));
  return absl::OkStatus();
}

absl::Status Demo::LoadAsRank(Communicator& comm, int threads) {
  const int rank = comm.rank();
  const int ranks = comm.size();

  // 4. What was saved.
  std::optional<SyntheticModel> model;
  SavedDemo saved;
  absl::Status status = [&]() -> absl::Status {
    absl::StatusOr<Metadata> md = ReadMetadata(url_);
    if (!md.ok()) return md.status();
    absl::StatusOr<SavedDemo> info = ReadSavedDemo(
        *md, o_.step_given ? std::optional<int64_t>(o_.step) : std::nullopt);
    if (!info.ok()) {
      return absl::Status(info.status().code(),
                          absl::StrCat(url_, ": ", info.status().message()));
    }
    saved = *std::move(info);
    absl::StatusOr<SyntheticModel> built = BuildModel(saved.config);
    if (!built.ok()) return built.status();
    model = *std::move(built);
    if (rank == 0) {
      return CheckFitsInMemory(StateBytes(*model, saved.rng_fqns.size()));
    }
    return absl::OkStatus();
  }();
  if (status = AgreeOnStatus(comm, status); !status.ok()) return status;
  const SyntheticModel& m = *model;
  const uint64_t bytes = StateBytes(m, saved.rng_fqns.size());
  if (rank == 0) {
    r_.model = m;
    r_.step = saved.step;
    r_.bytes = bytes;
    r_.save_ranks = saved.save_ranks;
    r_.load_ranks = ranks;
  }

  // 5. This rank's destinations, poisoned.
  struct Dest {
    const SyntheticTensor* tensor;
    Box box;
    Tensor buffer;
  };
  std::vector<Dest> dests;
  std::vector<std::string> my_rngs;
  StateDict sd;
  Log(comm,
      "allocating destinations on %d %s: uneven tensor-parallel shards, "
      "boundaries off the save's",
      ranks, ranks == 1 ? "rank" : "ranks");
  status = [&]() -> absl::Status {
    for (const SyntheticTensor& t : m.tensors) {
      std::optional<Box> box = TensorParallelBox(t, rank, ranks, true);
      if (!box) continue;
      absl::StatusOr<Tensor> buf = Tensor::Empty(t.dtype, box->sizes);
      if (!buf.ok()) return buf.status();
      InsertLeaf(sd, t.fqn,
                 ShardedTensor(t.dtype, t.shape, {{*box, buf->view()}}));
      dests.push_back({&t, *box, *std::move(buf)});
    }
    for (size_t i = static_cast<size_t>(rank); i < saved.rng_fqns.size();
         i += static_cast<size_t>(ranks)) {
      my_rngs.push_back(saved.rng_fqns[i]);
      InsertLeaf(sd, saved.rng_fqns[i], StateDict(Object{}));
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

  // 6. The timed, collective load, then the checks.
  Log(comm, "loading %s from %s", HumanBytes(bytes), url_);
  LoadOptions options;
  options.comm = &comm;
  if (absl::Status s = comm.Barrier(); !s.ok()) return s;
  Stopwatch clock;
  absl::StatusOr<LoadResult> loaded = Load(sd, url_, options);
  const double seconds = clock.Seconds();
  if (status = AgreeOnStatus(comm, loaded.status()); !status.ok()) {
    return status;
  }
  absl::StatusOr<double> wall = MaxSeconds(comm, seconds);
  if (!wall.ok()) return wall.status();
  Log(comm, "loaded %s in %.3f s (%.2f GB/s)", HumanBytes(bytes), *wall,
      GigabytesPerSecond(bytes, *wall));
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
  // Elements of replicated tensors are counted by rank 0 only (every rank
  // still checks its copy), so the sum over ranks is the tensors' total.
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
      if (d.tensor->parallelism != Parallelism::kReplicated || rank == 0) {
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
      ++counts[1];
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
  absl::StatusOr<std::vector<std::string>> mismatches =
      comm.AllGather(mismatch);
  if (!mismatches.ok()) return mismatches.status();
  if (rank != 0) return absl::OkStatus();

  r_.load_seconds = *wall;
  r_.verify_seconds = *verify_wall;
  r_.load_bytes_read = static_cast<uint64_t>(counts[2]);
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

void Demo::Print() const {
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
  if (o_.json) {
    nlohmann::json j;
    j["phase"] = o_.phase;
    j["comm"] = o_.comm;
    j["dir"] = r_.dir;
    j["kept"] = r_.kept;
    j["bytes"] = r_.bytes;
    j["step"] = r_.step;
    j["ranks"] = r_.save_ranks;
    j["load_ranks"] = load_ranks;
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
    if (r_.save_seconds) {
      j["save_files"] = r_.save_files;
      j["checkpoint_bytes"] = r_.checkpoint_bytes;
    }
    if (r_.load_seconds) j["load_bytes_read"] = r_.load_bytes_read;
    std::cout << j.dump() << std::endl;
    return;
  }
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
  if (r_.save_seconds) {
    std::cout << absl::StrFormat(
        "%-6s %5d %14d %10.3f %8.2f\n", "save", r_.save_ranks, r_.bytes,
        *r_.save_seconds, GigabytesPerSecond(r_.bytes, *r_.save_seconds));
  }
  if (r_.load_seconds) {
    std::cout << absl::StrFormat(
        "%-6s %5d %14d %10.3f %8.2f\n", "load", r_.load_ranks, r_.bytes,
        *r_.load_seconds, GigabytesPerSecond(r_.bytes, *r_.load_seconds));
  }
  if (r_.load_seconds) {
    if (r_.verified) {
      std::cout << absl::StrFormat(
          "verified: yes (%d elements bit-exact, saved by %d %s, loaded by "
          "%d; step and %s match)\n",
          r_.elements_verified, r_.save_ranks,
          r_.save_ranks == 1 ? "rank" : "ranks", r_.load_ranks,
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
    const int per_rank = std::max(1, threads / o_.ranks);
    status =
        CombineRankStatuses(RunInProcess(o_.ranks, [&](Communicator& comm) {
          return SaveAsRank(comm, per_rank);
        }));
  }
  if (status.ok() && loads()) {
    const int per_rank = std::max(1, threads / o_.load_ranks);
    status = CombineRankStatuses(RunInProcess(
        o_.load_ranks,
        [&](Communicator& comm) { return LoadAsRank(comm, per_rank); }));
  }
  return Finish(status);
}

int Demo::RunMpiRanks(Communicator& world) {
  const int me = world.rank();
  const int load_ranks = o_.load_ranks_given ? o_.load_ranks : world.size();
  const int threads =
      o_.threads > 0
          ? o_.threads
          : std::max(1, DefaultThreads() / MpiRanksOnThisMachine(world.size()));
  absl::Status status;
  if (saves()) status = SaveAsRank(world, threads);
  if (status.ok() && loads()) {
    // The first load_ranks ranks load; Split is collective over the world.
    absl::StatusOr<std::unique_ptr<Communicator>> group =
        world.Split(me < load_ranks ? 0 : 1, me);
    status = AgreeOnStatus(world, group.status());
    if (status.ok() && me < load_ranks) status = LoadAsRank(**group, threads);
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
  std::unique_ptr<Communicator> world;
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
    // Checks every rank makes alike, so all exit together.
    if (o_.ranks_given && o_.ranks != world->size()) {
      UsageError(absl::StrFormat(
          "--ranks %d does not match the MPI world size %d: under --comm mpi "
          "every MPI process is one save rank (run `mpirun -np %d ...`, or "
          "leave out --ranks)",
          o_.ranks, world->size(), o_.ranks));
      return kUsageError;
    }
    if (o_.load_ranks_given && o_.load_ranks > world->size()) {
      UsageError(absl::StrFormat(
          "--load-ranks %d is more than the MPI world size %d: under --comm "
          "mpi the load runs on the first M MPI processes",
          o_.load_ranks, world->size()));
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
    if (o_.ranks > kMaxInProcessRanks || o_.load_ranks > kMaxInProcessRanks) {
      UsageError(absl::StrFormat(
          "--ranks and --load-ranks are at most %d with --comm inproc (each "
          "rank is a thread with its own IO threads)",
          kMaxInProcessRanks));
      return kUsageError;
    }
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
                  "checkpoint)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            absl::StatusOr<uint64_t> n = ParseByteSize(v);
            return n.ok() ? std::string() : std::string(n.status().message());
          },
          "SIZE", "byte size"));
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
             "ranks that save, each holding its tensor-parallel shard "
             "(column-parallel weights split on dim 0, row-parallel on dim "
             "1, norms replicated, Adam moments like their weights) and its "
             "own RNG object rng.rank<r>. Default 4 with --comm inproc; "
             "with --comm mpi it is the MPI world size and, if given, must "
             "equal it. --phase load reads it from the checkpoint")
          ->type_name("N")
          ->check(CLI::PositiveNumber);
  CLI::Option* load_ranks =
      cmd->add_option(
             "--load-ranks", o->load_ranks,
             "ranks that load, with the same tensor-parallel rule but uneven "
             "2:3:4:... splits, so that shard boundaries fall off the save's "
             "and the load reshards even when it equals --ranks. Default 3 "
             "with --comm inproc; with --comm mpi the world size, at most "
             "the world size (the first M processes load, the others wait)")
          ->type_name("M")
          ->check(CLI::PositiveNumber);
  CLI::Option* step =
      cmd->add_option(
             "--step", o->step,
             "training step the values derive from (load: default is the "
             "checkpoint's `step` scalar)")
          ->capture_default_str();
  cmd->add_option("--layers", o->layers,
                  "transformer layers (default: grows with --size)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--threads", o->threads,
                  "threads per process for filling and checking values, "
                  "shared by its in-process ranks (default: the cores, "
                  "divided among the MPI processes on this machine)")
      ->check(CLI::Range(1, 1024));
  cmd->add_flag("--json", o->json, "print one JSON object instead of a table");
  cmd->add_flag("--keep", o->keep, "keep the default temporary directory");
  cmd->add_flag("--overwrite", o->overwrite,
                "replace a checkpoint already in --dir");
  cmd->add_flag("-q,--quiet", o->quiet, "no progress lines on stderr");
  cmd->footer(
      "Saves a synthetic training state (embedding, transformer layers, Adam\n"
      "moments, a step scalar, one RNG object per rank) as --ranks tensor-\n"
      "parallel ranks, each building only its own shards; loads it back as\n"
      "--load-ranks ranks sharded unevenly (resharding); checks every element\n"
      "bit for bit across the load ranks, the step and every RNG object; and\n"
      "reports save and load throughput (checkpoint bytes over the wall time\n"
      "of the whole collective save or load, slowest rank). Every value\n"
      "derives from (FQN, element index, step), and the model config and\n"
      "rank count are in the checkpoint's user metadata, so --phase load in\n"
      "another process, with another rank count, can check what --phase save\n"
      "wrote. Only rank 0 prints; any rank's error is printed with its rank\n"
      "and every process exits non-zero.\n\n"
      "Examples:\n"
      "  cairn demo                           256 MiB, 4 ranks save, 3 load\n"
      "  cairn demo --size 2GiB --ranks 8 --load-ranks 5 --json\n"
      "  cairn demo --dir /ckpt/demo --phase save --ranks 4 --step 7\n"
      "  cairn demo --dir /ckpt/demo --phase load --load-ranks 2\n"
      "  mpirun -np 4 cairn demo --comm mpi --load-ranks 3");
  cmd->callback([o, step, ranks, load_ranks] {
    o->step_given = step->count() > 0;
    o->ranks_given = ranks->count() > 0;
    o->load_ranks_given = load_ranks->count() > 0;
    Demo demo(*o);
    if (int rc = demo.Run(); rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace cairn::tools
