// cairn verify CKPT: proves that a checkpoint's bytes are what its metadata
// says, without loading any tensor.
//
//  1. Read and validate metadata.json (ReadMetadata).
//  2. Open every data file the metadata references; a missing file is a
//     problem naming the file and the first FQN stored in it.
//  3. Check that each tensor's chunks cover it exactly once, that the
//     structure names each stored FQN at most once and nothing else, that
//     no two chunks or objects share a byte of a file, and that every chunk and
//     object lies inside its file (a truncated file is a problem naming the
//     FQN, the file, the offset and the real size).
//  4. Parse each data file's safetensors header and check that it lists every
//     chunk and object at the metadata's offset, with its length, name,
//     dtype and shape.
//  5. Read every chunk and object in pieces of at most --buffer bytes on
//     --threads threads (memory stays bounded at threads * buffer), CRC32C
//     each piece, combine the pieces of each chunk in order and compare with
//     the stored checksum; with block checksums (format version 3), pieces
//     never cross a block's end, and each block's is compared too.
//
// Every problem is reported (not only the first); any problem exits 1.
#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "commands.h"
#include "core/buffer_pool.h"
#include "core/parallel.h"
#include "format/crc32c.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "format/safetensors.h"

namespace cairn::tools {
namespace {

using internal_format::Crc32c;
using internal_format::Crc32cCombine;
using internal_format::Crc32cToHex;

struct VerifyOptions {
  std::string url;
  bool json = false;
  int threads = 8;
  std::string buffer = "8MiB";
};

// One thing wrong with the checkpoint.
struct Problem {
  // missing_file, truncated, coverage, structure, overlap, header, read,
  // crc32c
  std::string kind;
  std::string fqn;   // empty when the problem is a whole file
  std::string file;
  std::optional<uint64_t> offset;
  std::string message;  // self-contained: names FQN, file and offset
};

// A chunk or an object: a run of bytes with a checksum.
struct Item {
  std::string fqn;
  std::string label;  // "fqn@[0:4, 0:8]" for chunks, fqn for objects
  const ByteLocation* location = nullptr;
  // For the safetensors cross-check.
  std::string entry_name;
  DType dtype = DType::kU8;
  Shape shape;
  bool is_object = false;
};

std::string Where(const Item& item) {
  return absl::StrFormat("%s (%s, offset %d, %d bytes)", item.label,
                         item.location->file, item.location->offset,
                         item.location->nbytes);
}

// Step 4 for one file: its header must list each of `items` where the
// metadata says.
void CheckHeader(const ReadableFile& file, const std::string& name,
                 const std::vector<const Item*>& items,
                 std::vector<Problem>& problems) {
  auto header_problem = [&](const absl::Status& s) {
    problems.push_back(
        {"header", "", name, std::nullopt,
         absl::StrCat(name, ": bad safetensors header: ", s.ToString())});
  };
  absl::StatusOr<internal_format::SafetensorsHeader> header =
      internal_format::ReadSafetensorsHeader(file, name);
  if (!header.ok()) return header_problem(header.status());
  for (const Item* item : items) {
    const ByteLocation& loc = *item->location;
    if (loc.nbytes == 0) continue;  // nothing stored, nothing to list
    const std::string wrong = internal_format::EntryMismatch(
        *header,
        {item->entry_name, item->dtype, item->shape, loc.offset, loc.nbytes});
    if (!wrong.empty()) {
      problems.push_back(
          {"header", item->fqn, name, loc.offset,
           absl::StrCat("header mismatch for ", Where(*item), ": ", wrong)});
    }
  }
}

int RunVerify(const VerifyOptions& o) {
  Stopwatch clock;
  absl::StatusOr<uint64_t> buffer_bytes = ParseByteSize(o.buffer);
  if (!buffer_bytes.ok()) {
    PrintError("verify", buffer_bytes.status());
    return 2;
  }
  if (o.threads < 1) {
    PrintError("verify", absl::InvalidArgumentError("--threads must be >= 1"));
    return 2;
  }
  absl::StatusOr<Metadata> md = ReadMetadata(NormalizeUrl(o.url));
  if (!md.ok()) {
    PrintError("verify", md.status());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<Storage>> storage =
      Storage::Open(NormalizeUrl(o.url));
  if (!storage.ok()) {
    PrintError("verify", storage.status());
    return 1;
  }

  // Whether metadata.json opens with its checksum (ReadMetadata checked it
  // then), whatever its version: version 2 must, version 1 may (a version
  // 1 text resealed by hand is checked too).
  bool sealed = md->version >= 2;
  if (absl::StatusOr<std::unique_ptr<ReadableFile>> f =
          (*storage)->OpenForRead(kMetadataFileName);
      f.ok() && (*f)->size() >= internal_format::kChecksumKeyPrefix.size()) {
    std::string head(internal_format::kChecksumKeyPrefix.size(), '\0');
    if ((*f)->ReadAt(0, std::as_writable_bytes(std::span(head))).ok()) {
      sealed = head == internal_format::kChecksumKeyPrefix;
    }
  }

  // Everything that has a checksum.
  std::vector<Item> items;
  for (const auto& [fqn, t] : md->tensors) {
    const Box full = Box::Full(t.shape);
    for (const ChunkMetadata& c : t.chunks) {
      const bool whole = c.box == full;
      items.push_back(
          {fqn, whole ? fqn : absl::StrCat(fqn, "@", c.box.ToString()),
           &c.location, internal_format::EntryName(fqn, c.box, whole), t.dtype,
           c.box.sizes, false});
    }
  }
  for (const auto& [fqn, loc] : md->objects) {
    items.push_back({fqn, fqn, &loc, fqn, DType::kU8,
                     Shape{static_cast<int64_t>(loc.nbytes)}, true});
  }
  // Read in file order, for sequential IO.
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return std::tie(a.location->file, a.location->offset) <
           std::tie(b.location->file, b.location->offset);
  });

  std::vector<Problem> problems;

  // Step 2: open the files.
  std::map<std::string, std::vector<const Item*>> by_file;
  for (const Item& item : items) by_file[item.location->file].push_back(&item);
  std::map<std::string, std::unique_ptr<ReadableFile>> files;
  std::map<std::string, uint64_t> sizes;
  for (const auto& [name, in_file] : by_file) {
    absl::StatusOr<std::unique_ptr<ReadableFile>> f =
        (*storage)->OpenForRead(name);
    if (!f.ok()) {
      problems.push_back(
          {"missing_file", in_file.front()->fqn, name, std::nullopt,
           absl::StrFormat("%s: cannot open data file (%d chunks/objects, "
                           "first %s): %s",
                           name, in_file.size(), in_file.front()->label,
                           f.status().ToString())});
      continue;
    }
    sizes[name] = (*f)->size();
    files[name] = *std::move(f);
  }

  // Step 3: coverage and bounds.
  for (const auto& [fqn, t] : md->tensors) {
    if (absl::Status s = internal_format::ValidateCoverage(fqn, t); !s.ok()) {
      problems.push_back({"coverage", fqn, "", std::nullopt, s.ToString()});
    }
  }
  // The structure LoadAll rebuilds the state dict from: every leaf a stored
  // FQN, none twice.
  if (absl::Status s = internal_format::ValidateStructure(*md); !s.ok()) {
    problems.push_back({"structure", "", "", std::nullopt,
                        absl::StrCat("metadata.json: ", s.message())});
  }
  // Every chunk's CRC could match and the load still give wrong values if
  // two of them read the same bytes; the first such pair is reported.
  if (absl::Status s = internal_format::ValidateDisjointLocations(*md);
      !s.ok()) {
    problems.push_back({"overlap", "", "", std::nullopt, s.ToString()});
  }
  // One line per short file first; the chunks it cuts off follow.
  for (const auto& [name, in_file] : by_file) {
    auto size = sizes.find(name);
    if (size == sizes.end()) continue;
    uint64_t needed = 0;
    size_t cut = 0;
    for (const Item* item : in_file) {
      const uint64_t end = item->location->offset + item->location->nbytes;
      needed = std::max(needed, end);
      cut += end > size->second;
    }
    if (needed > size->second) {
      problems.push_back(
          {"truncated", "", name, size->second,
           absl::StrFormat("%s: truncated: %d bytes on disk, but the metadata "
                           "places data up to byte %d (%d of its %d "
                           "chunks/objects cut off)",
                           name, size->second, needed, cut, in_file.size())});
    }
  }
  std::vector<const Item*> readable;
  for (const Item& item : items) {
    const ByteLocation& loc = *item.location;
    auto size = sizes.find(loc.file);
    if (size == sizes.end()) continue;  // missing, reported above
    if (loc.offset > size->second || loc.nbytes > size->second - loc.offset) {
      problems.push_back(
          {"truncated", item.fqn, loc.file, loc.offset,
           absl::StrFormat("truncated: %s ends past the end of %s (%d bytes)",
                           Where(item), loc.file, size->second)});
      continue;
    }
    readable.push_back(&item);
  }
  if (problems.empty()) {
    // Belt and braces: the library's own bounds check must agree.
    if (absl::Status s = internal_format::ValidateAgainstFileSizes(*md, sizes);
        !s.ok()) {
      problems.push_back({"truncated", "", "", std::nullopt, s.ToString()});
    }
  }

  // Step 4: safetensors headers.
  for (const auto& [name, file] : files) {
    CheckHeader(*file, name, by_file[name], problems);
  }

  // Step 5: checksums, piece by piece.
  // A location with block checksums (format version 3) is read in pieces
  // that never cross a block's end, so each block's CRC32C is its pieces'
  // combined, as the whole one is all of them combined.
  struct Piece {
    size_t item;  // index into readable
    uint64_t offset;
    uint64_t length;
    int64_t block = -1;  // the block it lies in, when checked by blocks
  };
  std::vector<Piece> pieces;
  uint64_t total_bytes = 0;
  const uint64_t block_bytes = md->crc32c_block_bytes;
  for (size_t i = 0; i < readable.size(); ++i) {
    const ByteLocation& loc = *readable[i]->location;
    total_bytes += loc.nbytes;
    const bool blocks = !loc.block_crc32c.empty() && block_bytes > 0;
    const uint64_t step = blocks ? block_bytes : loc.nbytes;
    for (uint64_t b = 0; b < loc.nbytes; b += step) {
      const uint64_t end = std::min(loc.nbytes, b + step);
      for (uint64_t off = b; off < end; off += *buffer_bytes) {
        pieces.push_back({i, loc.offset + off, std::min(*buffer_bytes, end - off),
                          blocks ? static_cast<int64_t>(b / block_bytes) : -1});
      }
    }
  }
  std::vector<uint32_t> piece_crc(pieces.size(), 0);
  std::vector<absl::Status> piece_status(pieces.size());
  internal_core::BufferPool pool(static_cast<size_t>(*buffer_bytes),
                                 o.threads);
  {
    ProgressLine progress("verify", total_bytes);
    absl::Status s = internal_core::ParallelFor(
        static_cast<int64_t>(pieces.size()), o.threads,
        [&](int64_t p) -> absl::Status {
          const Piece& piece = pieces[static_cast<size_t>(p)];
          const ReadableFile& f =
              *files.at(readable[piece.item]->location->file);
          absl::StatusOr<internal_core::PooledBuffer> buf = pool.Acquire();
          if (!buf.ok()) return buf.status();  // out of memory: stop
          absl::Status rs = f.ReadAt(
              piece.offset, std::span<std::byte>(
                                buf->data(), static_cast<size_t>(piece.length)));
          if (rs.ok()) {
            piece_crc[static_cast<size_t>(p)] =
                Crc32c(buf->data(), static_cast<size_t>(piece.length));
          } else {
            piece_status[static_cast<size_t>(p)] = rs;
          }
          progress.Add(piece.length);
          return absl::OkStatus();  // a read error is a problem, not a stop
        });
    if (!s.ok()) {
      PrintError("verify", s);
      return 1;
    }
  }
  std::vector<uint32_t> item_crc(readable.size(), 0);
  std::vector<absl::Status> item_status(readable.size());
  std::vector<bool> started(readable.size(), false);
  // Per item, its blocks' CRC32Cs as read (for those checked by blocks).
  std::vector<std::vector<uint32_t>> block_crc(readable.size());
  for (size_t p = 0; p < pieces.size(); ++p) {
    const size_t i = pieces[p].item;
    if (!piece_status[p].ok()) {
      if (item_status[i].ok()) item_status[i] = piece_status[p];
      continue;
    }
    item_crc[i] =
        started[i] ? Crc32cCombine(item_crc[i], piece_crc[p], pieces[p].length)
                   : piece_crc[p];
    started[i] = true;
    if (pieces[p].block >= 0) {
      std::vector<uint32_t>& b = block_crc[i];
      const size_t k = static_cast<size_t>(pieces[p].block);
      if (b.size() <= k) {
        b.resize(k + 1, 0);
        b[k] = piece_crc[p];
      } else {
        b[k] = Crc32cCombine(b[k], piece_crc[p], pieces[p].length);
      }
    }
  }
  uint64_t num_chunks = 0, num_objects = 0;
  for (size_t i = 0; i < readable.size(); ++i) {
    const Item& item = *readable[i];
    const ByteLocation& loc = *item.location;
    ++(item.is_object ? num_objects : num_chunks);
    if (!item_status[i].ok()) {
      problems.push_back({"read", item.fqn, loc.file, loc.offset,
                          absl::StrCat("cannot read ", Where(item), ": ",
                                       item_status[i].ToString())});
    } else {
      // The first block whose checksum differs, if any.
      std::string block;
      for (size_t k = 0; k < block_crc[i].size() && block.empty(); ++k) {
        if (k < loc.block_crc32c.size() && block_crc[i][k] != loc.block_crc32c[k]) {
          block = absl::StrFormat(
              "block %d (bytes [%d, %d) of it): stored %s, computed %s", k,
              k * block_bytes, std::min(loc.nbytes, (k + 1) * block_bytes),
              Crc32cToHex(loc.block_crc32c[k]), Crc32cToHex(block_crc[i][k]));
        }
      }
      if (item_crc[i] != loc.crc32c) {
        problems.push_back(
            {"crc32c", item.fqn, loc.file, loc.offset,
             absl::StrFormat("crc32c mismatch in %s: stored %s, computed %s%s",
                             Where(item), Crc32cToHex(loc.crc32c),
                             Crc32cToHex(item_crc[i]),
                             block.empty() ? "" : absl::StrCat("; first in ", block))});
      } else if (!block.empty()) {
        problems.push_back(
            {"crc32c", item.fqn, loc.file, loc.offset,
             absl::StrFormat("block checksum mismatch in %s, %s", Where(item),
                             block)});
      }
    }
  }
  const double seconds = clock.Seconds();
  const double gbps = GigabytesPerSecond(total_bytes, seconds);

  if (o.json) {
    nlohmann::json j;
    j["url"] = o.url;
    j["ok"] = problems.empty();
    j["tensors"] = md->tensors.size();
    j["chunks"] = num_chunks;
    j["objects"] = num_objects;
    j["format_version"] = md->version;
    j["metadata_checksum"] = sealed;
    j["files"] = by_file.size();
    j["bytes"] = total_bytes;
    j["seconds"] = seconds;
    j["gbps"] = gbps;
    nlohmann::json list = nlohmann::json::array();
    for (const Problem& p : problems) {
      nlohmann::json e = {{"kind", p.kind},
                          {"fqn", p.fqn},
                          {"file", p.file},
                          {"message", p.message}};
      e["offset"] = p.offset ? nlohmann::json(*p.offset) : nlohmann::json();
      list.push_back(std::move(e));
    }
    j["problems"] = std::move(list);
    std::cout << j.dump() << std::endl;
  } else {
    for (const Problem& p : problems) std::cout << p.message << "\n";
    if (problems.empty()) {
      std::cout << absl::StrFormat(
          "OK: metadata.json (%s), %s and %s in %s, %s (%d bytes) checked "
          "in %.3f s (%.2f GB/s)\n",
          sealed ? "its checksum matched"
                 : "format version 1: it has no checksum of its own",
          Plural(num_chunks, "chunk"), Plural(num_objects, "object"),
          Plural(by_file.size(), "data file"), HumanBytes(total_bytes),
          total_bytes, seconds, gbps);
    }
    std::cout << std::flush;
  }
  if (!problems.empty()) {
    std::map<std::string, int> kinds;
    for (const Problem& p : problems) ++kinds[p.kind];
    std::string summary;
    for (const auto& [kind, n] : kinds) {
      absl::StrAppend(&summary, summary.empty() ? "" : ", ", n, " ", kind);
    }
    PrintError("verify", absl::DataLossError(absl::StrFormat(
                             "%s: %d problem%s (%s)", o.url, problems.size(),
                             problems.size() == 1 ? "" : "s", summary)));
    return 1;
  }
  return 0;
}

}  // namespace

void RegisterVerify(CLI::App& app) {
  auto o = std::make_shared<VerifyOptions>();
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
      "shape, and reports missing or truncated files.\n"
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
