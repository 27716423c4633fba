// cairn: inspect, verify and exercise cairn checkpoints from a shell.
//
// Exit status: 0 success, 1 a command failed (its error is printed as
// "cairn <cmd>: <status>"), 2 a usage error.
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>
#include <string>

#include "cairn/cairn.h"
#include "commands.h"

namespace {

constexpr int kUsageError = 2;

// The name of the deepest subcommand the parser selected, or "" for the
// top-level app.
std::string SelectedCommand(const CLI::App& app) {
  const CLI::App* node = &app;
  std::string name;
  while (true) {
    auto subs = node->get_subcommands();
    if (subs.empty()) break;
    node = subs.front();
    name = node->get_name();
  }
  return name;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "cairn " CAIRN_VERSION_STRING
      ": distributed checkpoints of sharded tensor state.\n"
      "Inspect, verify, merge and convert checkpoints (and Hugging Face\n"
      "folders), run a synthetic save/load "
      "demo, or benchmark save and load on your storage.",
      "cairn"};
  app.set_version_flag("--version", "cairn " CAIRN_VERSION_STRING);
  app.require_subcommand(1);
  app.footer(
      "Examples:\n"
      "  cairn demo                         save and reload a 256 MiB state\n"
      "  cairn demo --size 2GiB --json      the same at 2 GiB, as JSON\n"
      "  cairn inspect /ckpt/step-100       list tensors, objects, scalars\n"
      "  cairn verify /ckpt/step-100        recompute every checksum\n"
      "  cairn merge /ckpt/step-100         rank-local folders -> global\n"
      "  cairn bench --dir /mnt/nvme/tmp    time save, async save and loads\n"
      "  cairn convert ~/models/x /ckpt/x   Hugging Face folder <-> checkpoint\n"
      "Run 'cairn <command> --help' for a command's options.");

  cairn::tools::RegisterInspect(app);
  cairn::tools::RegisterVerify(app);
  cairn::tools::RegisterDemo(app);
  cairn::tools::RegisterMerge(app);
  cairn::tools::RegisterBench(app);
  cairn::tools::RegisterConvert(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();  // the command already said why
  } catch (const CLI::Success& e) {
    return app.exit(e);  // --help, --version
  } catch (const CLI::ParseError& e) {
    const std::string cmd = SelectedCommand(app);
    std::cerr << "cairn" << (cmd.empty() ? "" : " " + cmd) << ": " << e.what()
              << "\nRun 'cairn" << (cmd.empty() ? "" : " " + cmd)
              << " --help' for usage." << std::endl;
    return kUsageError;
  } catch (const std::exception& e) {
    const std::string cmd = SelectedCommand(app);
    std::cerr << "cairn" << (cmd.empty() ? "" : " " + cmd)
              << ": internal error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
