// cairn demo: saves a synthetic training state (see synthetic_model.h) with
// one sharding and loads it back under another, verifying every element.
//
//  save phase:
//   1. Choose a model for --size; fill each weight and both Adam moments as
//      4 simulated "save ranks" would hold them: column-parallel weights
//      (wq, wk, wv, w1, w3, embedding) split on dim 0, row-parallel ones
//      (wo, w2) on dim 1, norms whole; all 4 shards in one ShardedTensor.
//   2. Save (timed), with the model config in the user metadata so that a
//      later `--phase load` can rebuild the expected values.
//  load phase:
//   3. Read the metadata; rebuild the model (from the user metadata when the
//      save ran in another invocation) and the step (--step, else the stored
//      `step` scalar).
//   4. Allocate fresh destinations split the other way: 3 uneven shards on
//      dim 1 for column-parallel weights, on dim 0 for row-parallel weights
//      and norms. They are poisoned with a NaN pattern (which the synthetic
//      values never produce) before the timed load, so an element the load
//      never wrote cannot pass verification, and the timing measures cairn
//      rather than this VM's slow first touch of fresh memory.
//   5. Load (timed); check every element bit for bit, the `step` scalar and
//      the `rng` object.
#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "commands.h"
#include "core/parallel.h"
#include "synthetic_model.h"

namespace cairn::tools {
namespace {

constexpr int kSaveRanks = 4;
constexpr int kLoadShards = 3;
constexpr uint32_t kPoison = 0x7FC0DEADu;  // a quiet NaN
constexpr char kUserKey[] = "cairn_demo";

struct DemoOptions {
  std::string dir;
  std::string size = "256MiB";
  std::string phase = "all";
  int64_t step = 1000;
  bool step_given = false;
  int layers = 0;
  bool json = false;
  bool keep = false;
  bool overwrite = false;
  bool quiet = false;
  int threads = 0;  // 0: the machine's cores
};

struct DemoResult {
  std::string dir;
  bool kept = true;
  std::optional<SyntheticModel> model;
  int64_t step = 0;
  uint64_t bytes = 0;
  std::optional<double> save_seconds;
  std::optional<double> load_seconds;
  std::optional<double> verify_seconds;
  int save_files = 0;
  uint64_t load_bytes_read = 0;
  int64_t elements_verified = 0;
  bool verified = false;
  std::string mismatch;  // the first wrong element, when there is one
};

class Demo {
 public:
  explicit Demo(const DemoOptions& o) : o_(o) {
    threads_ = o.threads > 0 ? o.threads : DefaultThreads();
  }

  // 0, or the exit status after printing the error.
  int Run();

 private:
  template <typename... Args>
  void Log(const absl::FormatSpec<Args...>& format, const Args&... args) {
    if (!o_.quiet) {
      std::cerr << "cairn demo: " << absl::StrFormat(format, args...)
                << std::endl;
    }
  }

  absl::Status SavePhase();
  absl::Status LoadPhase();
  void Print() const;

  const DemoOptions& o_;
  int threads_;
  std::string url_;
  DemoResult r_;
};

int ShardDim(Parallelism p, bool for_save) {
  switch (p) {
    case Parallelism::kColumn:
      return for_save ? 0 : 1;
    case Parallelism::kRow:
      return for_save ? 1 : 0;
    case Parallelism::kReplicated:
      return 0;
  }
  return 0;
}

nlohmann::json ConfigJson(const SyntheticConfig& c, int64_t step) {
  return {{"version", 1}, {"layers", c.layers}, {"hidden", c.hidden},
          {"ffn", c.ffn}, {"vocab", c.vocab},   {"rng_bytes", c.rng_bytes},
          {"step", step}};
}

absl::StatusOr<SyntheticConfig> ConfigFromUser(const std::string& user) {
  nlohmann::json j = nlohmann::json::parse(user, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains(kUserKey) ||
      !j[kUserKey].is_object()) {
    return absl::FailedPreconditionError(
        "not a checkpoint written by `cairn demo` (no \"cairn_demo\" entry in "
        "its user metadata)");
  }
  const nlohmann::json& d = j[kUserKey];
  SyntheticConfig c;
  try {
    c.layers = d.at("layers").get<int>();
    c.hidden = d.at("hidden").get<int64_t>();
    c.ffn = d.at("ffn").get<int64_t>();
    c.vocab = d.at("vocab").get<int64_t>();
    c.rng_bytes = d.at("rng_bytes").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    return absl::FailedPreconditionError(
        absl::StrCat("bad \"cairn_demo\" user metadata: ", e.what()));
  }
  return c;
}

// The demo holds the whole state in memory once (save, then load); refuse
// sizes the machine cannot hold instead of being killed by the OOM killer.
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

absl::Status Demo::SavePhase() {
  absl::StatusOr<uint64_t> target = ParseByteSize(o_.size);
  if (!target.ok()) return target.status();
  absl::StatusOr<SyntheticConfig> config = ChooseConfig(*target, o_.layers);
  if (!config.ok()) return config.status();
  absl::StatusOr<SyntheticModel> model = BuildModel(*config);
  if (!model.ok()) return model.status();
  r_.model = *std::move(model);
  r_.step = o_.step;
  const SyntheticModel& m = *r_.model;
  r_.bytes = m.total_bytes();
  if (absl::Status s = CheckFitsInMemory(r_.bytes); !s.ok()) return s;

  absl::StatusOr<std::unique_ptr<Storage>> storage = Storage::Open(url_);
  if (!storage.ok()) return storage.status();
  absl::StatusOr<bool> exists = (*storage)->Exists(kMetadataFileName);
  if (exists.ok() && *exists && !o_.overwrite) {
    return absl::AlreadyExistsError(absl::StrCat(
        url_, " already holds a checkpoint; pass --overwrite to replace it"));
  }

  Log("building %s of synthetic state: %d layers, hidden %d, ffn %d, vocab "
      "%d; %d tensors, step %d",
      HumanBytes(r_.bytes), m.config.layers, m.config.hidden, m.config.ffn,
      m.config.vocab, m.tensors.size(), r_.step);
  StateDict sd;
  for (const SyntheticTensor& t : m.tensors) {
    const bool whole = t.parallelism == Parallelism::kReplicated;
    auto owned = std::make_shared<std::vector<Tensor>>();
    std::vector<Shard> shards;
    for (const Box& box : ShardBoxes(t, whole ? 1 : kSaveRanks,
                                     ShardDim(t.parallelism, true), false)) {
      absl::StatusOr<Tensor> buf = Tensor::Empty(t.dtype, box.sizes);
      if (!buf.ok()) return buf.status();
      if (absl::Status s = FillBox(t, box, buf->view(), r_.step, threads_);
          !s.ok()) {
        return s;
      }
      shards.push_back({box, buf->view()});
      owned->push_back(*std::move(buf));
    }
    InsertLeaf(sd, t.fqn,
               ShardedTensor(t.dtype, t.shape, std::move(shards), owned));
  }
  InsertLeaf(sd, kStepFqn, StateDict(int64_t{r_.step}));
  InsertLeaf(sd, kRngFqn,
             StateDict(Object{RngBytes(r_.step, m.config.rng_bytes)}));

  Log("saving as %d shards per weight to %s", kSaveRanks, url_);
  SaveOptions options;
  options.overwrite = o_.overwrite;
  options.user_metadata =
      nlohmann::json{{kUserKey, ConfigJson(m.config, r_.step)}}.dump();
  Stopwatch clock;
  absl::StatusOr<SaveResult> saved = Save(sd, url_, options);
  const double seconds = clock.Seconds();
  if (!saved.ok()) return saved.status();
  r_.save_seconds = seconds;
  r_.save_files = saved->files;
  Log("saved %s in %.3f s (%.2f GB/s), %s", HumanBytes(r_.bytes), seconds,
      GigabytesPerSecond(r_.bytes, seconds),
      Plural(static_cast<uint64_t>(saved->files), "data file"));
  return absl::OkStatus();
}

absl::Status Demo::LoadPhase() {
  absl::StatusOr<Metadata> md = ReadMetadata(url_);
  if (!md.ok()) return md.status();
  if (!r_.model) {
    absl::StatusOr<SyntheticConfig> config = ConfigFromUser(md->user);
    if (!config.ok()) {
      return absl::Status(config.status().code(),
                          absl::StrCat(url_, ": ", config.status().message()));
    }
    absl::StatusOr<SyntheticModel> model = BuildModel(*config);
    if (!model.ok()) return model.status();
    r_.model = *std::move(model);
    r_.bytes = r_.model->total_bytes();
    if (absl::Status s = CheckFitsInMemory(r_.bytes); !s.ok()) return s;
    if (o_.step_given) {
      r_.step = o_.step;
    } else {
      auto it = md->scalars.find(kStepFqn);
      if (it == md->scalars.end() ||
          !std::holds_alternative<int64_t>(it->second)) {
        return absl::FailedPreconditionError(absl::StrCat(
            url_, ": no int64 `step` scalar in the checkpoint; pass --step"));
      }
      r_.step = std::get<int64_t>(it->second);
    }
  }
  const SyntheticModel& m = *r_.model;

  // Destinations: 3 uneven shards on the other dimension, poisoned.
  struct Dest {
    const SyntheticTensor* tensor;
    Box box;
    Tensor buffer;
  };
  std::vector<Dest> dests;
  StateDict sd;
  Log("allocating destinations: %d uneven shards per tensor, split the other "
      "way",
      kLoadShards);
  for (const SyntheticTensor& t : m.tensors) {
    std::vector<Shard> shards;
    for (const Box& box :
         ShardBoxes(t, kLoadShards, ShardDim(t.parallelism, false), true)) {
      absl::StatusOr<Tensor> buf = Tensor::Empty(t.dtype, box.sizes);
      if (!buf.ok()) return buf.status();
      shards.push_back({box, buf->view()});
      dests.push_back({&t, box, *std::move(buf)});
    }
    InsertLeaf(sd, t.fqn, ShardedTensor(t.dtype, t.shape, std::move(shards)));
  }
  InsertLeaf(sd, kStepFqn, StateDict(int64_t{-1}));
  InsertLeaf(sd, kRngFqn, StateDict(Object{}));
  if (absl::Status s = internal_core::ParallelFor(
          static_cast<int64_t>(dests.size()), threads_,
          [&](int64_t i) {
            const Tensor& b = dests[static_cast<size_t>(i)].buffer;
            uint32_t* p = static_cast<uint32_t*>(b.data());
            std::fill(p, p + b.nbytes() / sizeof(uint32_t), kPoison);
            return absl::OkStatus();
          });
      !s.ok()) {
    return s;
  }

  Log("loading %s from %s", HumanBytes(r_.bytes), url_);
  Stopwatch clock;
  absl::StatusOr<LoadResult> loaded = Load(sd, url_);
  const double seconds = clock.Seconds();
  if (!loaded.ok()) return loaded.status();
  r_.load_seconds = seconds;
  r_.load_bytes_read = loaded->bytes_read;
  Log("loaded %s in %.3f s (%.2f GB/s)", HumanBytes(r_.bytes), seconds,
      GigabytesPerSecond(r_.bytes, seconds));
  for (const std::string& fqn : loaded->unexpected) {
    Log("note: %s is in the checkpoint but not in the demo model", fqn);
  }

  Log("verifying every element");
  Stopwatch vclock;
  for (const Dest& d : dests) {
    absl::StatusOr<std::optional<Mismatch>> bad =
        VerifyBox(*d.tensor, d.box, d.buffer.view(), r_.step, threads_);
    if (!bad.ok()) return bad.status();
    if (bad->has_value()) {
      r_.mismatch = (*bad)->ToString();
      break;
    }
    r_.elements_verified += d.box.num_elements();
  }
  if (r_.mismatch.empty()) {
    const StateDict* step = sd.Find(kStepFqn);
    const Scalar* s = step ? step->scalar() : nullptr;
    if (s == nullptr || !std::holds_alternative<int64_t>(*s) ||
        std::get<int64_t>(*s) != r_.step) {
      r_.mismatch = absl::StrCat("step: expected int64 ", r_.step, ", got ",
                                 s && std::holds_alternative<int64_t>(*s)
                                     ? absl::StrCat(std::get<int64_t>(*s))
                                     : std::string("another kind of value"));
    }
  }
  if (r_.mismatch.empty()) {
    const StateDict* rng = sd.Find(kRngFqn);
    const Object* obj = rng ? rng->object() : nullptr;
    const std::string expected = RngBytes(r_.step, m.config.rng_bytes);
    if (obj == nullptr || obj->bytes != expected) {
      size_t at = 0;
      if (obj) {
        while (at < obj->bytes.size() && at < expected.size() &&
               obj->bytes[at] == expected[at]) {
          ++at;
        }
      }
      r_.mismatch = obj ? absl::StrFormat(
                              "rng: %d bytes differ from the expected %d "
                              "bytes from byte %d on",
                              obj->bytes.size(), expected.size(), at)
                        : "rng: not an object after load";
    }
  }
  r_.verify_seconds = vclock.Seconds();
  r_.verified =
      r_.mismatch.empty() && r_.elements_verified == m.total_elements();
  if (r_.mismatch.empty() && !r_.verified) {
    r_.mismatch = absl::StrFormat("only %d of %d elements were checked",
                                  r_.elements_verified, m.total_elements());
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
  if (o_.json) {
    nlohmann::json j;
    j["phase"] = o_.phase;
    j["dir"] = r_.dir;
    j["kept"] = r_.kept;
    j["bytes"] = r_.bytes;
    j["step"] = r_.step;
    j["save_seconds"] = opt(r_.save_seconds);
    j["load_seconds"] = opt(r_.load_seconds);
    j["save_gbps"] = gbps(r_.save_seconds);
    j["load_gbps"] = gbps(r_.load_seconds);
    j["verify_seconds"] = opt(r_.verify_seconds);
    j["verified"] = r_.verified;
    j["elements_verified"] = r_.elements_verified;
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
    j["save_shards"] = kSaveRanks;
    j["load_shards"] = kLoadShards;
    if (r_.save_seconds) j["save_files"] = r_.save_files;
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
  std::cout << absl::StrFormat("%-6s %14s %10s %8s\n", "phase", "bytes",
                               "seconds", "GB/s");
  if (r_.save_seconds) {
    std::cout << absl::StrFormat(
        "%-6s %14d %10.3f %8.2f\n", "save", r_.bytes, *r_.save_seconds,
        GigabytesPerSecond(r_.bytes, *r_.save_seconds));
  }
  if (r_.load_seconds) {
    std::cout << absl::StrFormat(
        "%-6s %14d %10.3f %8.2f\n", "load", r_.bytes, *r_.load_seconds,
        GigabytesPerSecond(r_.bytes, *r_.load_seconds));
  }
  if (r_.load_seconds) {
    if (r_.verified) {
      std::cout << absl::StrFormat(
          "verified: yes (%d elements bit-exact, saved as %d shards per "
          "weight, loaded as %d; step and rng match)\n",
          r_.elements_verified, kSaveRanks, kLoadShards);
    } else {
      std::cout << "verified: NO (" << r_.mismatch << ")\n";
    }
  } else {
    std::cout << "verified: not run (save phase only)\n";
  }
  std::cout << std::flush;
}

int Demo::Run() {
  if (o_.phase != "all" && o_.dir.empty()) {
    PrintError("demo", absl::InvalidArgumentError(absl::StrCat(
                           "--phase ", o_.phase,
                           " needs --dir (the default temporary directory "
                           "does not outlive one run)")));
    return 2;
  }
  std::optional<std::filesystem::path> temp;
  if (o_.dir.empty()) {
    const char* tmpdir = std::getenv("TMPDIR");
    std::string templ =
        absl::StrCat(tmpdir && *tmpdir ? tmpdir : "/tmp", "/cairn-demo-XXXXXX");
    if (mkdtemp(templ.data()) == nullptr) {
      PrintError("demo", absl::InternalError(absl::StrCat(
                             "cannot create a temporary directory ", templ,
                             ": ", std::strerror(errno))));
      return 1;
    }
    temp = templ;
    r_.dir = templ;
    r_.kept = o_.keep;
  } else {
    r_.dir = o_.dir;
  }
  url_ = NormalizeUrl(r_.dir);
  if (temp) r_.dir = url_;
  absl::Cleanup remove_temp = [&] {
    if (temp && !o_.keep) {
      std::error_code ec;
      std::filesystem::remove_all(*temp, ec);
    }
  };

  absl::Status status;
  if (o_.phase == "save" || o_.phase == "all") status = SavePhase();
  if (status.ok() && (o_.phase == "load" || o_.phase == "all")) {
    status = LoadPhase();
  }
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

}  // namespace

void RegisterDemo(CLI::App& app) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* cmd = app.add_subcommand(
      "demo",
      "Save and reload a synthetic training state; verify every element");
  cmd->add_option("--dir", o->dir,
                  "checkpoint directory (default: a fresh temporary directory "
                  "under $TMPDIR or /tmp, removed afterwards unless --keep)");
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
  cmd->add_option("--phase", o->phase, "save, load, or all (save then load)")
      ->capture_default_str()
      ->check(CLI::IsMember({"save", "load", "all"}));
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
                  "threads for filling and checking values (default: cores)")
      ->check(CLI::Range(1, 1024));
  cmd->add_flag("--json", o->json, "print one JSON object instead of a table");
  cmd->add_flag("--keep", o->keep, "keep the default temporary directory");
  cmd->add_flag("--overwrite", o->overwrite,
                "replace a checkpoint already in --dir");
  cmd->add_flag("-q,--quiet", o->quiet, "no progress lines on stderr");
  cmd->footer(
      "Saves a synthetic training state (embedding, transformer layers, Adam\n"
      "moments, a step scalar, an RNG object) as 4 simulated ranks' shards\n"
      "(column-parallel weights split on dim 0, row-parallel on dim 1),\n"
      "loads it back sharded another way (3 uneven shards on the other\n"
      "dimension), checks every element bit for bit, and reports save and\n"
      "load throughput. Every value derives from (FQN, element index, step),\n"
      "so --phase load in another process can check what --phase save "
      "wrote.\n\n"
      "Examples:\n"
      "  cairn demo                                 256 MiB, save + load\n"
      "  cairn demo --size 2GiB --json\n"
      "  cairn demo --dir /ckpt/demo --phase save --step 7\n"
      "  cairn demo --dir /ckpt/demo --phase load   (another process)");
  cmd->callback([o, step] {
    o->step_given = step->count() > 0;
    Demo demo(*o);
    if (int rc = demo.Run(); rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace cairn::tools
