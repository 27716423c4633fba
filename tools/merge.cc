// cairn merge: turns a rank-local checkpoint (rank-NNNNN/ folders, each with
// its own metadata.json) into a global one that any number of ranks can
// load. No data is copied: the global metadata.json points into the rank
// folders' files (see Merge in include/cairn/checkpoint.h).
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "absl/strings/str_format.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "commands.h"

namespace cairn::tools {
namespace {

struct MergeCliOptions {
  std::string url;
  bool overwrite = false;
  bool json = false;
};

int RunMerge(const MergeCliOptions& o) {
  MergeOptions options;
  options.overwrite = o.overwrite;
  absl::StatusOr<MergeResult> result = Merge(o.url, options);
  if (!result.ok()) {
    PrintError("merge", result.status());
    return 1;
  }
  if (o.json) {
    nlohmann::json j = {{"url", o.url},
                        {"ranks", result->ranks},
                        {"tensors", result->metadata.tensors.size()},
                        {"objects", result->metadata.objects.size()},
                        {"scalars", result->metadata.scalars.size()},
                        {"data_bytes", result->data_bytes},
                        {"duplicates_dropped", result->duplicates}};
    std::cout << j.dump() << std::endl;
  } else {
    std::cout << absl::StrFormat(
                     "merged %d rank folders of %s: %d tensors, %d objects, "
                     "%d scalars, %s of data (%d replicated chunks kept "
                     "once); wrote %s\n",
                     result->ranks, o.url, result->metadata.tensors.size(),
                     result->metadata.objects.size(),
                     result->metadata.scalars.size(),
                     HumanBytes(result->data_bytes), result->duplicates,
                     kMetadataFileName);
  }
  return 0;
}

}  // namespace

void RegisterMerge(CLI::App& app) {
  auto o = std::make_shared<MergeCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "merge", "Turn a rank-local checkpoint into a global one (no data copied)");
  cmd->add_option("CKPT", o->url, "checkpoint directory or URL (file:///...)")
      ->required();
  cmd->add_flag("--overwrite", o->overwrite,
                "replace a global metadata.json already in CKPT");
  cmd->add_flag("--json", o->json, "print one JSON object instead of text");
  cmd->footer(
      "A rank-local save (SaveOptions::rank_local, `cairn demo --rank-local`)\n"
      "writes one folder per rank with its own metadata and no collective;\n"
      "it loads back only with the same ranks and sharding. merge reads\n"
      "every rank-NNNNN/metadata.json, checks that all ranks are there, that\n"
      "each tensor is covered exactly once (replicas kept once, and they\n"
      "must agree) and that every chunk lies inside its file, then writes a\n"
      "global metadata.json pointing into the rank folders. After that any\n"
      "number of ranks can load the checkpoint with any sharding.\n\n"
      "Examples:\n"
      "  cairn merge /ckpt/step-100\n"
      "  cairn merge --json --overwrite /ckpt/step-100");
  cmd->callback([o] {
    if (int rc = RunMerge(*o); rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace cairn::tools
