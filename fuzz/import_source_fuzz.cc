// What a load's coordinator sends the other ranks for a Hugging Face source
// (hf_import.h): the index's weight map and every file's header bytes,
// which each rank decodes and builds metadata from, name map included. Any
// bytes must decode to a source or an error, encoding what decoded is a
// fixed point, and building metadata from a decoded source gives metadata
// or an error: never a crash, a read outside the message, or metadata
// whose chunks leave their tensors or their files' entries.
//
// Input: one byte choosing the name map (taken modulo 3: none, prefixes,
// a fuse of the first two tensors that fit), then the message.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/import_names.h"
#include "cairn/metadata.h"
#include "checkpoint/hf_import.h"
#include "format/safetensors.h"
#include "fuzz/fuzz_target.h"

namespace cairn::fuzz {
namespace {

using internal_checkpoint::BuildImportedMetadata;
using internal_checkpoint::DecodeImportSource;
using internal_checkpoint::EncodeImportSource;
using internal_checkpoint::ImportSource;
using internal_checkpoint::SourceFile;

// A source of one file holding `entries` (names, dtypes, shapes), with
// the header cairn would write for them.
ImportSource Source(const std::vector<internal_format::SafetensorsEntry>& in,
                    bool indexed) {
  std::vector<internal_format::SafetensorsEntry> entries;
  uint64_t at = 0;
  for (internal_format::SafetensorsEntry e : in) {
    const uint64_t n =
        static_cast<uint64_t>(NumElements(e.shape)) * DTypeSize(e.dtype);
    e.begin = at;
    e.end = at + n;
    at += n;
    entries.push_back(e);
  }
  std::string header = internal_format::EncodeSafetensorsHeader(
      entries, {{"format", "pt"}}, 8);
  ImportSource s;
  s.url = "/models/m";
  s.index = indexed ? "model.safetensors.index.json" : "";
  SourceFile f;
  f.name = "model.safetensors";
  f.size = header.size() + at;
  f.header = header.substr(8);
  s.files.push_back(f);
  for (const auto& e : entries) s.tensors.emplace(e.name, 0);
  return s;
}

std::vector<std::string> Seeds() {
  const ImportSource a = Source({{"model.q", DType::kF32, {4, 6}, 0, 0},
                                 {"model.k", DType::kF32, {4, 6}, 0, 0},
                                 {"ids", DType::kI64, {1, 5}, 0, 0}},
                                false);
  const ImportSource b = Source({{"w", DType::kBF16, {3, 2}, 0, 0},
                                 {"s", DType::kF8_E8M0, {}, 0, 0}},
                                true);
  return {std::string(1, '\0') + EncodeImportSource(a),
          std::string(1, '\1') + EncodeImportSource(a),
          std::string(1, '\2') + EncodeImportSource(a),
          std::string(1, '\2') + EncodeImportSource(b)};
}

// Every chunk inside its tensor and inside its file.
void CheckMetadata(const ImportSource& source, const Metadata& md) {
  for (const auto& [fqn, t] : md.tensors) {
    CAIRN_FUZZ_CHECK(t.source_entries.size() == t.chunks.size(),
                     absl::StrCat(fqn, ": entries and chunks differ"));
    for (const ChunkMetadata& c : t.chunks) {
      CAIRN_FUZZ_CHECK(Contains(Box::Full(t.shape), c.box),
                       absl::StrCat(fqn, ": chunk outside its tensor"));
      uint64_t size = 0;
      for (const auto& f : source.files) {
        if (f.name == c.location.file) size = f.size;
      }
      CAIRN_FUZZ_CHECK(c.location.offset <= size &&
                           c.location.nbytes <= size - c.location.offset,
                       absl::StrCat(fqn, ": chunk outside its file"));
    }
  }
}

}  // namespace

CAIRN_FUZZ_TARGET(import_source, &Seeds) {
  if (data.empty()) return;
  const int map = static_cast<unsigned char>(data[0]) % 3;
  std::string_view message = data.substr(1);
  CheckFixedPoint(
      message, [](std::string_view m) { return DecodeImportSource(m); },
      [](const ImportSource& s) { return EncodeImportSource(s); },
      "import source");
  absl::StatusOr<ImportSource> source = DecodeImportSource(message);
  if (!source.ok()) return;
  ImportNames names;
  if (map == 1) {
    names.strip_prefix = "model.";
    names.add_prefix = "net.";
  } else if (map == 2) {
    names.map = [](std::vector<ImportedTensor> ts)
        -> absl::StatusOr<std::vector<ImportedTensor>> {
      if (ts.size() >= 2) {
        const std::string a = ts[0].fqn, b = ts[1].fqn;
        // Errors are fine: the tensors may not fit together.
        (void)FuseTensors(ts, {a, b}, "fused", 0);
      }
      return ts;
    };
  }
  absl::StatusOr<Metadata> md = BuildImportedMetadata(*source, names);
  if (md.ok()) CheckMetadata(*source, *md);
}

}  // namespace cairn::fuzz
