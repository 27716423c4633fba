// cairn verify CKPT: proves that a checkpoint's bytes are what its metadata
// says, without loading any tensor. The checks are cairn::Verify's
// (src/checkpoint/verify.cc); this file parses the options, draws the
// progress line and prints the report as text or JSON.
//
// Every problem is reported (not only the first); any problem exits 1.
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "commands.h"

namespace cairn::tools {
namespace {

struct VerifyFlags {
  std::string url;
  bool json = false;
  int threads = 8;
  std::string buffer = "8MiB";
};

void PrintJson(const std::string& url, const VerifyReport& r, double gbps) {
  nlohmann::json j;
  j["url"] = url;
  j["ok"] = r.ok();
  j["tensors"] = r.tensors;
  j["chunks"] = r.chunks;
  j["objects"] = r.objects;
  j["format_version"] = r.format_version;
  j["metadata_checksum"] = r.metadata_checksum;
  j["has_checksums"] = r.has_checksums;
  j["files"] = r.files;
  j["references"] = r.references;
  j["bytes"] = r.bytes_checked;
  j["seconds"] = r.seconds;
  j["gbps"] = gbps;
  nlohmann::json list = nlohmann::json::array();
  for (const VerifyProblem& p : r.problems) {
    nlohmann::json e = {{"kind", p.kind},
                        {"fqn", p.fqn},
                        {"file", p.file},
                        {"message", p.message}};
    e["offset"] = p.offset ? nlohmann::json(*p.offset) : nlohmann::json();
    list.push_back(std::move(e));
  }
  j["problems"] = std::move(list);
  std::cout << j.dump() << std::endl;
}

void PrintText(const VerifyReport& r, double gbps) {
  for (const VerifyProblem& p : r.problems) std::cout << p.message << "\n";
  if (r.ok() && !r.has_checksums) {
    std::cout << absl::StrFormat(
        "OK (structure only): a Hugging Face model, %s in %s, index and "
        "headers consistent; it holds no checksums to check (cairn convert "
        "makes a checkpoint with them)\n",
        Plural(r.tensors, "tensor"),
        Plural(static_cast<uint64_t>(r.files), "file"));
  } else if (r.ok()) {
    std::cout << absl::StrFormat(
        "OK: metadata.json (%s), %s and %s in %s%s, %s (%d bytes) checked "
        "in %.3f s (%.2f GB/s)\n",
        r.metadata_checksum ? "its checksum matched"
                            : "format version 1: it has no checksum of its own",
        Plural(r.chunks, "chunk"), Plural(r.objects, "object"),
        Plural(static_cast<uint64_t>(r.files), "data file"),
        r.references > 0
            ? absl::StrFormat(
                  " (of this checkpoint and %s it keeps chunks in, each "
                  "checked to be the one recorded)",
                  Plural(static_cast<uint64_t>(r.references),
                         "earlier checkpoint"))
            : std::string(),
        HumanBytes(r.bytes_checked), r.bytes_checked, r.seconds, gbps);
  }
  std::cout << std::flush;
}

int RunVerify(const VerifyFlags& o) {
  absl::StatusOr<uint64_t> buffer_bytes = ParseByteSize(o.buffer);
  if (!buffer_bytes.ok()) {
    PrintError("verify", buffer_bytes.status());
    return 2;
  }
  if (o.threads < 1) {
    PrintError("verify", absl::InvalidArgumentError("--threads must be >= 1"));
    return 2;
  }
  VerifyOptions options;
  options.io_threads = o.threads;
  options.buffer_bytes = *buffer_bytes;
  // Made on the first call, when the total is known; the calls never
  // overlap.
  std::optional<ProgressLine> line;
  uint64_t shown = 0;
  options.progress = [&](uint64_t done, uint64_t total) {
    if (!line) line.emplace("verify", total);
    line->Add(done - shown);
    shown = done;
  };
  absl::StatusOr<VerifyReport> report = Verify(NormalizeUrl(o.url), options);
  if (line) line->Done();
  if (!report.ok()) {
    PrintError("verify", report.status());
    return 1;
  }
  const double gbps =
      GigabytesPerSecond(report->bytes_checked, report->seconds);
  if (o.json) {
    PrintJson(o.url, *report, gbps);
  } else {
    PrintText(*report, gbps);
  }
  if (!report->ok()) {
    std::map<std::string, int> kinds;
    for (const VerifyProblem& p : report->problems) ++kinds[p.kind];
    std::string summary;
    for (const auto& [kind, n] : kinds) {
      absl::StrAppend(&summary, summary.empty() ? "" : ", ", n, " ", kind);
    }
    const size_t n = report->problems.size();
    PrintError("verify", absl::DataLossError(absl::StrFormat(
                             "%s: %d problem%s (%s)", o.url, n,
                             n == 1 ? "" : "s", summary)));
    return 1;
  }
  return 0;
}

}  // namespace

void RegisterVerify(CLI::App& app) {
  auto o = std::make_shared<VerifyFlags>();
  CLI::App* cmd = app.add_subcommand(
      "verify",
      "Check every chunk's checksum, the data files' headers and sizes");
  cmd->add_option("CKPT", o->url, "checkpoint directory or URL (file:///...)")
      ->required();
  cmd->add_flag("--json", o->json, "print one JSON object instead of text");
  cmd->add_option("--threads", o->threads, "concurrent reads")
      ->capture_default_str();
  cmd->add_option("--buffer", o->buffer,
                  "bytes per read (one buffer per thread), e.g. 8MiB")
      ->capture_default_str();
  cmd->footer(
      "Checks metadata.json (its own checksum, every field, that each\n"
      "tensor's chunks cover it once, that its structure names only stored\n"
      "FQNs, each once, and that no two chunks or objects share bytes),\n"
      "recomputes the CRC32C of every chunk and object from the data\n"
      "files, checks that each data file's safetensors header lists every\n"
      "chunk and object at the metadata's offset with its name, dtype and\n"
      "shape, and reports missing or truncated files. An incremental\n"
      "checkpoint's chunks in earlier checkpoints are checked there, after\n"
      "each of those is shown to be the checkpoint it was saved against.\n"
      "A Hugging Face folder or .safetensors file gets every check but the\n"
      "checksums, which it does not have: its index and headers (entries\n"
      "tiling each file, sizes matching shapes and dtypes).\n"
      "Reports every problem (FQN, file, offset) and exits 1 if there is\n"
      "any; otherwise prints a one-line summary and exits 0.\n\n"
      "Examples:\n"
      "  cairn verify /ckpt/step-100\n"
      "  cairn verify --json --threads 16 file:///ckpt/step-100");
  cmd->callback([o] {
    if (int rc = RunVerify(*o); rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace cairn::tools
