// The subcommands of the `cairn` tool. Each Register* adds one subcommand
// (its options, help text and callback) to the top-level app. A callback
// prints its own errors as "cairn <cmd>: <status>" on stderr and reports a
// non-zero exit status by throwing CLI::RuntimeError(code), which main()
// turns into the process exit status without printing anything more.
#ifndef CAIRN_TOOLS_COMMANDS_H_
#define CAIRN_TOOLS_COMMANDS_H_

#include <CLI/CLI.hpp>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

#include "cairn/checkpoint.h"

namespace cairn::tools {

// Checks an option's value with ParseByteSize (cli_util.h) and requires at
// least `min_bytes` and at most `max_bytes`: a bad size is a usage error
// (exit 2) naming the option.
CLI::Validator ByteSizeValidator(
    uint64_t min_bytes = 1,
    uint64_t max_bytes = std::numeric_limits<uint64_t>::max());

// For an int64_t option: the value must be a decimal integer in
// [-2^63, 2^63), and is passed on in canonical form. (CLI11 2.1 reads
// integers with strtoll, which clamps 99999999999999999999 to INT64_MAX
// without a word, and reads "010" as octal 8 and "0x10" as 16.)
CLI::Validator Int64Validator();

// --codec NAME and --codec-level N on `cmd` (SaveOptions::codec and
// codec_level, for the saves `what` describes); ApplyCodec copies them.
struct CodecFlags {
  std::string name = "none";
  int level = 1;  // SaveOptions::codec_level's default
};
void AddCodecOptions(CLI::App* cmd, CodecFlags* flags, std::string_view what);
void ApplyCodec(const CodecFlags& flags, SaveOptions& options);

void RegisterInspect(CLI::App& app);  // cairn inspect CKPT [--json]
void RegisterVerify(CLI::App& app);   // cairn verify CKPT [--json]
void RegisterDemo(CLI::App& app);     // cairn demo [--size ...] [--phase ...]
void RegisterMerge(CLI::App& app);    // cairn merge CKPT [--overwrite] [--json]
void RegisterBench(CLI::App& app);
void RegisterConvert(CLI::App& app);  // cairn convert SRC DST [--dtype ...]    // cairn bench --dir DIR [--size ...]

}  // namespace cairn::tools

#endif  // CAIRN_TOOLS_COMMANDS_H_
