// cairn demo, the load phase (steps 4 to 6 of the protocol at the top of
// demo.cc): Demo::LoadAsRank reads what was saved and chooses how to load
// it (rank-local, merge then global, or global), merges a rank-local
// checkpoint when it must, allocates and poisons this rank's destinations,
// times the load, then verifies every element, the `step` scalar and the
// RNG objects and gathers the counts and phase times.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "demo_internal.h"
#include "core/parallel.h"
#include "rank_status.h"
#include "synthetic_model.h"

namespace cairn::tools {
namespace {

constexpr uint32_t kPoison = 0x7FC0DEADu;  // a quiet NaN
// More would be a damaged user metadata (and a huge list of RNG FQNs).
constexpr int64_t kMaxSaveRanks = int64_t{1} << 20;

// What a checkpoint's "cairn_demo" user metadata says.
struct SavedDemo {
  SyntheticConfig config;
  int64_t step = 0;
  int save_ranks = 1;  // tensor-parallel ranks of one replica group
  int replicas = 1;
  bool rank_local = false;
  std::vector<std::string> rng_fqns;  // by save rank, all R x N of them
};

// "file:///ckpt/rank-00003" from "file:///ckpt" (what Storage::Open takes).
std::string RankFolderUrl(std::string url, int rank) {
  while (url.size() > 1 && url.back() == '/') url.pop_back();
  return absl::StrFormat("%s/rank-%05d", url, rank);
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

}  // namespace

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

}  // namespace cairn::tools
