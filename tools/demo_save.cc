// cairn demo, the save phase (steps 1 to 3b of the protocol at the top of
// demo.cc): Demo::SaveAsRank chooses the model, checks --dir and memory,
// fills this rank's shards and times the save, global or rank-local; with
// --async, Demo::AsyncTrainingLoop then runs the simulated training steps
// with an AsyncSaver save every --save-every steps.
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "demo_internal.h"
#include "rank_status.h"
#include "synthetic_model.h"

namespace cairn::tools {
namespace {

// Version 2 added "save_ranks" and per-rank RNG objects; version 3 added
// "replicas" (R x save_ranks RNG objects) and "rank_local". Version 1
// checkpoints (one "rng" object) and version 2 ones still load.
constexpr int kUserVersion = 3;

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

}  // namespace

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

}  // namespace cairn::tools
