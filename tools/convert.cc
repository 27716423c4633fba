// cairn convert SRC DST: a Hugging Face folder (or .safetensors file) to a
// cairn checkpoint, or a cairn checkpoint to a Hugging Face folder. The
// work is the library's (ConvertToCheckpoint, ExportToHuggingFace in
// include/cairn/huggingface.h); this file parses the options, shows
// progress on stderr and prints what was written.
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "absl/strings/str_format.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "commands.h"

namespace cairn::tools {
namespace {

struct ConvertFlags {
  std::string src;
  std::string dst;
  std::string max_shard_size = "5GB";
  std::string dtype;
  std::string strip_prefix;
  std::string add_prefix;
  bool overwrite = false;
  bool json = false;
  CodecFlags codec;
  bool codec_given = false;  // --codec on the command line
  bool flatten = false;
};

int RunConvert(const ConvertFlags& o) {
  std::optional<DType> dtype;
  if (!o.dtype.empty()) {
    absl::StatusOr<DType> d = DTypeFromName(o.dtype);
    if (!d.ok()) {
      PrintError("convert", d.status());
      return 2;
    }
    dtype = *d;
  }
  absl::StatusOr<uint64_t> max_shard = ParseByteSize(o.max_shard_size);
  if (!max_shard.ok()) {
    PrintError("convert", max_shard.status());
    return 2;
  }
  const std::string src = NormalizeUrl(o.src);
  const std::string dst = NormalizeUrl(o.dst);
  absl::StatusOr<bool> from_hf = IsSafetensorsSource(src);
  if (!from_hf.ok()) {
    PrintError("convert", from_hf.status());
    return 1;
  }
  Stopwatch clock;
  nlohmann::json j = {{"src", o.src}, {"dst", o.dst}};
  std::string text;
  if (*from_hf && o.flatten) {
    PrintError("convert", absl::InvalidArgumentError(
                              "--flatten applies to a cairn checkpoint as "
                              "SRC, not a Hugging Face folder"));
    return 2;
  }
  if (!*from_hf && (o.codec_given || o.flatten)) {
    // A checkpoint to a checkpoint: recompressed, or stored raw; and
    // standalone, whatever the source references.
    if (dtype || !o.strip_prefix.empty() || !o.add_prefix.empty()) {
      PrintError("convert", absl::InvalidArgumentError(
                                "--dtype and the prefix options do not apply "
                                "when --codec or --flatten rewrites a "
                                "checkpoint"));
      return 2;
    }
    SaveOptions options;
    options.overwrite = o.overwrite;
    ApplyCodec(o.codec, options);
    std::cerr << absl::StrFormat(
        "cairn convert: reading %s (and any checkpoint it references) and "
        "saving it again, standalone, with codec %s...\n",
        o.src, o.codec.name);
    absl::StatusOr<SaveResult> r = RewriteCheckpoint(src, dst, options);
    if (!r.ok()) {
      PrintError("convert", r.status());
      return 1;
    }
    j["direction"] = "cairn_to_cairn";
    j["codec"] = o.codec.name;
    j["bytes"] = r->data_bytes;
    j["checkpoint_bytes"] = r->checkpoint_bytes;
    j["files"] = r->files;
    text = absl::StrFormat(
        "rewrote checkpoint %s as %s (codec %s): %s of data in %s on disk; "
        "%.2f s\n",
        o.src, o.dst, o.codec.name, HumanBytes(r->data_bytes),
        HumanBytes(r->checkpoint_bytes), clock.Seconds());
  } else if (*from_hf) {
    if (o.max_shard_size != "5GB") {
      std::cerr << "cairn convert: --max-shard-size applies to Hugging Face "
                   "output only; ignored\n";
    }
    ConvertOptions options;
    options.dtype = dtype;
    options.names.strip_prefix = o.strip_prefix;
    options.names.add_prefix = o.add_prefix;
    options.save.overwrite = o.overwrite;
    ApplyCodec(o.codec, options.save);
    // A save reports no progress as it goes: say what it is doing.
    absl::StatusOr<Metadata> md = ReadImportedMetadata(src, options.names);
    if (!md.ok()) {
      PrintError("convert", md.status());
      return 1;
    }
    std::cerr << absl::StrFormat(
        "cairn convert: saving %d tensors (%s) of %s as a checkpoint with "
        "checksums...\n",
        md->tensors.size(), HumanBytes(md->total_bytes()), o.src);
    absl::StatusOr<SaveResult> r = ConvertToCheckpoint(src, dst, options);
    if (!r.ok()) {
      PrintError("convert", r.status());
      return 1;
    }
    j["direction"] = "huggingface_to_cairn";
    j["tensors"] = md->tensors.size();
    j["bytes"] = r->data_bytes;
    j["files"] = r->files;
    text = absl::StrFormat(
        "converted %s (Hugging Face, no checksums) to checkpoint %s: %d "
        "tensors, %s, CRC32C per chunk; %.2f s (%.2f GB/s)\n",
        o.src, o.dst, md->tensors.size(), HumanBytes(r->data_bytes),
        clock.Seconds(), GigabytesPerSecond(r->data_bytes, clock.Seconds()));
  } else {
    if (!o.strip_prefix.empty() || !o.add_prefix.empty()) {
      PrintError("convert", absl::InvalidArgumentError(
                                "--strip-prefix and --add-prefix apply to "
                                "Hugging Face input only"));
      return 2;
    }
    HfExportOptions options;
    options.dtype = dtype;
    options.max_shard_size = *max_shard;
    options.overwrite = o.overwrite;
    std::optional<ProgressLine> line;
    uint64_t shown = 0;
    options.progress = [&](uint64_t done, uint64_t total) {
      if (!line) line.emplace("convert", total);
      line->Add(done - shown);
      shown = done;
    };
    absl::StatusOr<HfExportResult> r = ExportToHuggingFace(src, dst, options);
    if (line) line->Done();
    if (!r.ok()) {
      PrintError("convert", r.status());
      return 1;
    }
    j["direction"] = "cairn_to_huggingface";
    j["tensors"] = r->tensors;
    j["bytes"] = r->total_size;
    j["files"] = r->files.size();
    j["skipped"] = r->skipped;
    text = absl::StrFormat(
        "converted checkpoint %s to Hugging Face folder %s: %d tensors, %s "
        "in %s; %.2f s (%.2f GB/s)\n",
        o.src, o.dst, r->tensors, HumanBytes(r->total_size),
        r->files.size() == 1
            ? std::string(kHfSingleFileName)
            : absl::StrFormat("%d files and %s", r->files.size(),
                              kHfIndexFileName),
        clock.Seconds(), GigabytesPerSecond(r->total_size, clock.Seconds()));
    if (!r->skipped.empty()) {
      text += absl::StrFormat(
          "left out %s that %s no tensor (a Hugging Face folder holds "
          "tensors only)\n",
          Plural(r->skipped.size(), "leaf"),
          r->skipped.size() == 1 ? "is" : "are");
    }
  }
  j["seconds"] = clock.Seconds();
  if (o.json) {
    std::cout << j.dump() << std::endl;
  } else {
    std::cout << text << std::flush;
  }
  return 0;
}

}  // namespace

void RegisterConvert(CLI::App& app) {
  auto o = std::make_shared<ConvertFlags>();
  CLI::App* cmd = app.add_subcommand(
      "convert",
      "Convert between a Hugging Face folder and a cairn checkpoint");
  cmd->add_option("SRC", o->src,
                  "a cairn checkpoint, or a Hugging Face folder or "
                  ".safetensors file")
      ->required();
  cmd->add_option("DST", o->dst, "the folder to write")->required();
  cmd->add_option("--max-shard-size", o->max_shard_size,
                  "Hugging Face output: most tensor bytes per file")
      ->capture_default_str()
      ->check(ByteSizeValidator());
  cmd->add_option("--dtype", o->dtype,
                  "cast floating-point tensors to F64, F32, F16 or BF16");
  cmd->add_option("--strip-prefix", o->strip_prefix,
                  "Hugging Face input: remove this from the front of names");
  cmd->add_option("--add-prefix", o->add_prefix,
                  "Hugging Face input: put this in front of names");
  AddCodecOptions(cmd, &o->codec,
                  "the checkpoint written: from a Hugging Face folder, or "
                  "given with a checkpoint as SRC, rewrite it (recompress, "
                  "or 'none' to store it raw). Hugging Face output is always "
                  "raw");
  cmd->add_flag("--flatten", o->flatten,
                "with a checkpoint as SRC: write DST standalone, copying "
                "the chunks an incremental SRC keeps in earlier checkpoints "
                "(codec: --codec, else none)");
  cmd->add_flag("--overwrite", o->overwrite,
                "replace a checkpoint or model already at DST");
  cmd->add_flag("--json", o->json, "print one JSON object instead of text");
  cmd->footer(
      "The direction follows SRC. A Hugging Face folder (model.safetensors,\n"
      "or model.safetensors.index.json and its files) or a .safetensors\n"
      "file becomes a cairn checkpoint: its tensors, read once, saved with a\n"
      "CRC32C per chunk (Hugging Face files carry no checksums; loads of the\n"
      "folder itself say so). A cairn checkpoint becomes a Hugging Face\n"
      "folder: tensors in key order, split into files of at most\n"
      "--max-shard-size, each checked against its CRC32C as it is read,\n"
      "written in place and renamed when complete, the index last.\n"
      "Objects and scalars have no place in a Hugging Face folder and are\n"
      "left out (listed). With --codec and a checkpoint as SRC, DST is a\n"
      "checkpoint again: every leaf read, checked and saved with that codec\n"
      "(held in memory whole). --flatten does the same without a codec:\n"
      "an incremental checkpoint becomes one that references no other.\n\n"
      "Examples:\n"
      "  cairn convert ~/models/MiniLM /ckpt/minilm\n"
      "  cairn convert --dtype BF16 --max-shard-size 2GB /ckpt/step-100 out/\n"
      "  cairn convert --strip-prefix model. model.safetensors /ckpt/base\n"
      "  cairn convert --codec grouped-zstd /ckpt/step-100 /ckpt/step-100z\n"
      "  cairn convert --flatten /ckpt/step-0000000300 /archive/step-300");
  cmd->callback([o, cmd] {
    o->codec_given = cmd->count("--codec") > 0;
    if (int rc = RunConvert(*o); rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace cairn::tools
