// Verify (cairn/verify.h): proves that a checkpoint's bytes are what its
// metadata says, without loading any tensor. It is the one implementation:
// `cairn verify` (tools/verify.cc) only prints what it returns.
//
//  1. Read and validate metadata.json (ReadMetadata); any error there stops
//     the check (there is nothing trustworthy to check against).
//  2. Open every data file the metadata references; a missing file is a
//     problem naming the file and the first FQN stored in it.
//  3. Check that each tensor's chunks cover it exactly once, that the
//     structure names each stored FQN at most once and nothing else, that
//     no two chunks or objects share a byte of a file, and that every chunk
//     and object lies inside its file (a truncated file is a problem naming
//     the FQN, the file, the offset and the real size).
//  4. Parse each data file's safetensors header and check that it lists
//     every chunk and object at the metadata's offset, with its length,
//     name, dtype and shape.
//  5. Read every chunk and object in pieces of at most buffer_bytes on
//     io_threads threads (memory stays bounded at threads * buffer), CRC32C
//     each piece, combine the pieces of each chunk in order and compare with
//     the stored checksum; with block checksums (format version 3), pieces
//     never cross a block's end, and each block's is compared too. A
//     compressed chunk (version 5) is read frame by frame: each frame's
//     stored CRC32C, then its raw bytes' after decompressing, then the
//     chunk's CRC32C from its frames' (CheckFrames).
//
// Every problem is reported, not only the first.
#include "cairn/verify.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/box.h"
#include "cairn/dtype.h"
#include "cairn/metadata.h"
#include "cairn/storage.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/hf_import.h"
#include "checkpoint/kv_save.h"
#include "checkpoint/referencing_storage.h"
#include "core/buffer_pool.h"
#include "core/parallel.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/frame_codec.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "format/safetensors.h"

namespace cairn {
namespace internal_checkpoint {
namespace {

using internal_format::Crc32c;
using internal_format::Crc32cCombine;
using internal_format::Crc32cToHex;

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
  // entry_name is a source entry holding it (Metadata::source_entries).
  bool source = false;
  // A compressed chunk (its entry is U8 of its stored bytes; `dtype` is
  // then the tensor's, for the frames' byte grouping).
  DType tensor_dtype = DType::kU8;
};

std::string Where(const Item& item) {
  return absl::StrFormat("%s (%s, offset %d, %d bytes)", item.label,
                         item.location->file, item.location->offset,
                         item.location->nbytes);
}

// The state of one Verify, shared by its stages.
struct Verification {
  const Metadata& md;
  Storage& storage;
  std::vector<Item> items;  // in file order
  std::map<std::string, std::vector<const Item*>> by_file = {};
  std::map<std::string, std::unique_ptr<ReadableFile>> files = {};  // opened
  std::map<std::string, uint64_t> sizes = {};                       // of opened
  // Inside their files: step 5 reads them.
  std::vector<const Item*> readable = {};
  std::vector<VerifyProblem> problems = {};
};

// Whether metadata.json opens with its checksum (ReadMetadata checked it
// then), whatever its version: version 2 must, version 1 may (a version
// 1 text resealed by hand is checked too).
bool MetadataSealed(Storage& storage, const Metadata& md) {
  bool sealed = md.version >= 2;
  if (absl::StatusOr<std::unique_ptr<ReadableFile>> f =
          storage.OpenForRead(kMetadataFileName);
      f.ok() && (*f)->size() >= internal_format::kChecksumKeyPrefix.size()) {
    std::string head(internal_format::kChecksumKeyPrefix.size(), '\0');
    if ((*f)->ReadAt(0, std::as_writable_bytes(std::span(head))).ok()) {
      sealed = head == internal_format::kChecksumKeyPrefix;
    }
  }
  return sealed;
}

// Everything that has a checksum, in file order (for sequential IO).
std::vector<Item> CollectItems(const Metadata& md) {
  std::vector<Item> items;
  for (const auto& [fqn, t] : md.tensors) {
    const Box full = Box::Full(t.shape);
    for (size_t k = 0; k < t.chunks.size(); ++k) {
      const ChunkMetadata& c = t.chunks[k];
      const bool whole = c.box == full;
      const bool source = !t.source_entries.empty();
      const bool compressed = c.location.compressed();
      items.push_back(
          {fqn, whole ? fqn : absl::StrCat(fqn, "@", c.box.ToString()),
           &c.location,
           source ? t.source_entries[k]
                  : internal_format::EntryName(fqn, c.box, whole),
           compressed ? DType::kU8 : t.dtype,
           compressed ? Shape{static_cast<int64_t>(
                            c.location.compression.stored_nbytes)}
                      : c.box.sizes,
           false, source, t.dtype});
    }
  }
  for (const auto& [fqn, loc] : md.objects) {
    items.push_back({fqn, fqn, &loc, fqn, DType::kU8,
                     Shape{static_cast<int64_t>(loc.nbytes)}, true});
  }
  // Key-value tables: each chunk's ids and columns.
  for (const auto& [fqn, t] : md.kv_tables) {
    const std::vector<internal_checkpoint::KvChunkStart> starts =
        internal_checkpoint::KvChunkStarts(t);
    for (size_t k = 0; k < t.chunks.size(); ++k) {
      const KvChunkMetadata& c = t.chunks[k];
      const auto n = static_cast<int64_t>(c.rows.size());
      auto add = [&](const ByteLocation& loc, std::string_view what,
                     DType dtype, Shape shape) {
        items.push_back(
            {fqn, absl::StrFormat("%s chunk %d %s", fqn, k, what), &loc,
             internal_format::KvEntryName(fqn, starts[k].bucket,
                                              starts[k].row, what),
             dtype, std::move(shape), false});
      };
      add(c.ids, "ids", DType::kI64, Shape{n});
      for (size_t j = 0; j < c.columns.size(); ++j) {
        const KvColumn& col = t.spec.columns[j];
        add(c.columns[j], col.name, col.dtype, Shape{n, col.width});
      }
    }
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return std::tie(a.location->file, a.location->offset) <
           std::tie(b.location->file, b.location->offset);
  });
  return items;
}

// Step 2: open the files.
void OpenFiles(Verification& v) {
  for (const Item& item : v.items) {
    v.by_file[item.location->file].push_back(&item);
  }
  for (const auto& [name, in_file] : v.by_file) {
    absl::StatusOr<std::unique_ptr<ReadableFile>> f =
        v.storage.OpenForRead(name);
    if (!f.ok()) {
      v.problems.push_back(
          {"missing_file", in_file.front()->fqn, name, std::nullopt,
           absl::StrFormat("%s: cannot open data file (%d chunks/objects, "
                           "first %s): %s",
                           name, in_file.size(), in_file.front()->label,
                           f.status().ToString())});
      continue;
    }
    v.sizes[name] = (*f)->size();
    v.files[name] = *std::move(f);
  }
}

// Step 3: coverage, structure, overlaps and bounds; fills v.readable.
void CheckLayout(Verification& v) {
  const Metadata& md = v.md;
  std::vector<VerifyProblem>& problems = v.problems;
  for (const auto& [fqn, t] : md.tensors) {
    if (absl::Status s = internal_format::ValidateCoverage(fqn, t); !s.ok()) {
      problems.push_back({"coverage", fqn, "", std::nullopt, s.ToString()});
    }
  }
  // The structure LoadAll rebuilds the state dict from: every leaf a stored
  // FQN, none twice.
  if (absl::Status s = internal_format::ValidateStructure(md); !s.ok()) {
    problems.push_back({"structure", "", "", std::nullopt,
                        absl::StrCat("metadata.json: ", s.message())});
  }
  // Every chunk's CRC could match and the load still give wrong values if
  // two of them read the same bytes; the first such pair is reported.
  if (absl::Status s = internal_format::ValidateDisjointLocations(md);
      !s.ok()) {
    problems.push_back({"overlap", "", "", std::nullopt, s.ToString()});
  }
  // One line per short file first; the chunks it cuts off follow.
  for (const auto& [name, in_file] : v.by_file) {
    auto size = v.sizes.find(name);
    if (size == v.sizes.end()) continue;
    uint64_t needed = 0;
    size_t cut = 0;
    for (const Item* item : in_file) {
      const uint64_t end =
          item->location->offset + item->location->stored_nbytes();
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
  for (const Item& item : v.items) {
    const ByteLocation& loc = *item.location;
    auto size = v.sizes.find(loc.file);
    if (size == v.sizes.end()) continue;  // missing, reported above
    if (loc.offset > size->second ||
        loc.stored_nbytes() > size->second - loc.offset) {
      problems.push_back(
          {"truncated", item.fqn, loc.file, loc.offset,
           absl::StrFormat("truncated: %s ends past the end of %s (%d bytes)",
                           Where(item), loc.file, size->second)});
      continue;
    }
    v.readable.push_back(&item);
  }
  if (problems.empty()) {
    // Belt and braces: the library's own bounds check must agree.
    if (absl::Status s = internal_format::ValidateAgainstFileSizes(md, v.sizes);
        !s.ok()) {
      problems.push_back({"truncated", "", "", std::nullopt, s.ToString()});
    }
  }
}

// Step 4 for one file: its header must list each of `items` where the
// metadata says.
void CheckHeader(const ReadableFile& file, const std::string& name,
                 const std::vector<const Item*>& items,
                 std::vector<VerifyProblem>& problems) {
  absl::StatusOr<internal_format::SafetensorsHeader> header =
      internal_format::ReadSafetensorsHeader(file, name);
  if (!header.ok()) {
    problems.push_back({"header", "", name, std::nullopt,
                        absl::StrCat(name, ": bad safetensors header: ",
                                     header.status().ToString())});
    return;
  }
  for (const Item* item : items) {
    const ByteLocation& loc = *item->location;
    if (loc.nbytes == 0) continue;  // nothing stored, nothing to list
    const internal_format::ExpectedEntry expected{
        item->entry_name, item->dtype, item->shape, loc.offset,
        loc.stored_nbytes()};
    const std::string wrong =
        item->source ? internal_format::SourceEntryMismatch(*header, expected)
                     : internal_format::EntryMismatch(*header, expected);
    if (!wrong.empty()) {
      problems.push_back(
          {"header", item->fqn, name, loc.offset,
           absl::StrCat("header mismatch for ", Where(*item), ": ", wrong)});
    }
  }
}

// A run of bytes of one readable item that step 5 reads and checksums at
// once: at most buffer_bytes, and never across a block's end.
struct Piece {
  size_t item;  // index into Verification::readable
  uint64_t offset;
  uint64_t length;
  int64_t block = -1;  // the block it lies in, when checked by blocks
};

// Step 5: checksums, piece by piece. Adds the bytes read and checksummed
// to *bytes_checked. A non-OK status (buffers that cannot be allocated)
// stops the check.
absl::Status CheckChecksums(Verification& v, const VerifyOptions& options,
                            uint64_t* bytes_checked) {
  // A location with block checksums (format version 3) is read in pieces
  // that never cross a block's end, so each block's CRC32C is its pieces'
  // combined, as the whole one is all of them combined.
  const uint64_t block_bytes = v.md.crc32c_block_bytes;
  std::vector<Piece> pieces;
  uint64_t total_bytes = 0, largest = 0;
  for (size_t i = 0; i < v.readable.size(); ++i) {
    const ByteLocation& loc = *v.readable[i]->location;
    if (loc.compressed()) continue;  // CheckFrames
    total_bytes += loc.nbytes;
    const bool blocks = !loc.block_crc32c.empty() && block_bytes > 0;
    const uint64_t step = blocks ? block_bytes : loc.nbytes;
    for (uint64_t b = 0; b < loc.nbytes; b += step) {
      const uint64_t end = std::min(loc.nbytes, b + step);
      for (uint64_t off = b; off < end; off += options.buffer_bytes) {
        const uint64_t length = std::min(options.buffer_bytes, end - off);
        largest = std::max(largest, length);
        pieces.push_back({i, loc.offset + off, length,
                          blocks ? static_cast<int64_t>(b / block_bytes) : -1});
      }
    }
  }
  std::vector<uint32_t> piece_crc(pieces.size(), 0);
  std::vector<absl::Status> piece_status(pieces.size());
  // Buffers no larger than the largest piece: a small checkpoint needs no
  // 8 MiB of them.
  internal_core::BufferPool pool(static_cast<size_t>(largest),
                                 options.io_threads);
  std::mutex progress_mu;
  uint64_t done = 0;  // guarded by progress_mu
  CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
      static_cast<int64_t>(pieces.size()), options.io_threads,
      [&](int64_t p) -> absl::Status {
        const Piece& piece = pieces[static_cast<size_t>(p)];
        const ReadableFile& f =
            *v.files.at(v.readable[piece.item]->location->file);
        absl::StatusOr<internal_core::PooledBuffer> buf = pool.Acquire();
        if (!buf.ok()) return buf.status();  // out of memory: stop
        absl::Status rs = f.ReadAt(
            piece.offset,
            std::span<std::byte>(buf->data(),
                                 static_cast<size_t>(piece.length)));
        if (rs.ok()) {
          piece_crc[static_cast<size_t>(p)] =
              Crc32c(buf->data(), static_cast<size_t>(piece.length));
        } else {
          piece_status[static_cast<size_t>(p)] = rs;
        }
        if (options.progress) {
          std::lock_guard<std::mutex> lock(progress_mu);
          done += piece.length;
          options.progress(done, total_bytes);
        }
        return absl::OkStatus();  // a read error is a problem, not a stop
      }));

  // Combine the pieces of each item (and each block) in order.
  const size_t n = v.readable.size();
  std::vector<uint32_t> item_crc(n, 0);
  std::vector<absl::Status> item_status(n);
  std::vector<bool> started(n, false);
  // Per item, its blocks' CRC32Cs as read (for those checked by blocks).
  std::vector<std::vector<uint32_t>> block_crc(n);
  for (size_t p = 0; p < pieces.size(); ++p) {
    const size_t i = pieces[p].item;
    if (!piece_status[p].ok()) {
      if (item_status[i].ok()) item_status[i] = piece_status[p];
      continue;
    }
    *bytes_checked += pieces[p].length;
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
  for (size_t i = 0; i < n; ++i) {
    const Item& item = *v.readable[i];
    const ByteLocation& loc = *item.location;
    if (loc.compressed()) continue;
    if (!item_status[i].ok()) {
      v.problems.push_back({"read", item.fqn, loc.file, loc.offset,
                            absl::StrCat("cannot read ", Where(item), ": ",
                                         item_status[i].ToString())});
      continue;
    }
    // The first block whose checksum differs, if any.
    std::string block;
    for (size_t k = 0; k < block_crc[i].size() && block.empty(); ++k) {
      if (k < loc.block_crc32c.size() &&
          block_crc[i][k] != loc.block_crc32c[k]) {
        block = absl::StrFormat(
            "block %d (bytes [%d, %d) of it): stored %s, computed %s", k,
            k * block_bytes, std::min(loc.nbytes, (k + 1) * block_bytes),
            Crc32cToHex(loc.block_crc32c[k]), Crc32cToHex(block_crc[i][k]));
      }
    }
    if (item_crc[i] != loc.crc32c) {
      v.problems.push_back(
          {"crc32c", item.fqn, loc.file, loc.offset,
           absl::StrFormat(
               "crc32c mismatch in %s: stored %s, computed %s%s", Where(item),
               Crc32cToHex(loc.crc32c), Crc32cToHex(item_crc[i]),
               block.empty() ? "" : absl::StrCat("; first in ", block))});
    } else if (!block.empty()) {
      v.problems.push_back(
          {"crc32c", item.fqn, loc.file, loc.offset,
           absl::StrFormat("block checksum mismatch in %s, %s", Where(item),
                           block)});
    }
  }
  return absl::OkStatus();
}

// Step 5 for compressed chunks: every frame read, its stored CRC32C
// checked, decompressed, its raw CRC32C checked (the block's, or the
// chunk's for one frame), and the frames' raw CRC32Cs combined and
// compared with the chunk's. The first bad frame of a chunk is its
// problem. Adds the stored bytes read to *bytes_checked.
absl::Status CheckFrames(Verification& v, const VerifyOptions& options,
                         uint64_t* bytes_checked) {
  const uint64_t frame_bytes = v.md.crc32c_block_bytes;
  struct Frame {
    size_t item;
    uint64_t index;
    uint64_t at;  // in the file
  };
  std::vector<Frame> frames;
  for (size_t i = 0; i < v.readable.size(); ++i) {
    const ByteLocation& loc = *v.readable[i]->location;
    if (!loc.compressed()) continue;
    uint64_t at = loc.offset;
    for (uint64_t f = 0; f < loc.compression.frame_nbytes.size(); ++f) {
      frames.push_back({i, f, at});
      at += loc.compression.frame_nbytes[f];
    }
  }
  if (frames.empty()) return absl::OkStatus();
  std::vector<std::string> problem(frames.size());
  std::vector<uint32_t> raw_crc(frames.size(), 0);
  CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
      static_cast<int64_t>(frames.size()), options.io_threads,
      [&](int64_t k) -> absl::Status {
        const Frame& fr = frames[static_cast<size_t>(k)];
        const Item& item = *v.readable[fr.item];
        const ByteLocation& loc = *item.location;
        const Compression& z = loc.compression;
        const uint64_t n = z.frame_nbytes[fr.index];
        std::string& out = problem[static_cast<size_t>(k)];
        std::vector<std::byte> stored(n);
        if (absl::Status s = v.files.at(loc.file)->ReadAt(fr.at, stored);
            !s.ok()) {
          out = absl::StrCat("cannot read frame ", fr.index, " of ",
                             Where(item), ": ", s.ToString());
          return absl::OkStatus();
        }
        const uint32_t crc = Crc32c(stored.data(), stored.size());
        if (crc != z.frame_crc32c[fr.index]) {
          out = absl::StrFormat(
              "crc32c mismatch in %s, frame %d at offset %d (%d stored "
              "bytes): stored %s, computed %s",
              Where(item), fr.index, fr.at, n,
              Crc32cToHex(z.frame_crc32c[fr.index]), Crc32cToHex(crc));
          return absl::OkStatus();
        }
        const uint64_t len =
            std::min(frame_bytes, loc.nbytes - fr.index * frame_bytes);
        std::vector<std::byte> raw(len);
        internal_format::FrameDecompressor d;
        if (absl::Status s = d.Decompress(z.codec, DTypeSize(item.tensor_dtype),
                                          stored, raw);
            !s.ok()) {
          out = absl::StrFormat("cannot decompress %s, frame %d at offset %d: %s",
                                Where(item), fr.index, fr.at, s.message());
          return absl::OkStatus();
        }
        raw_crc[static_cast<size_t>(k)] = Crc32c(raw.data(), raw.size());
        const uint32_t want = loc.block_crc32c.empty()
                                  ? loc.crc32c
                                  : loc.block_crc32c[fr.index];
        if (raw_crc[static_cast<size_t>(k)] != want) {
          out = absl::StrFormat(
              "crc32c mismatch in %s, frame %d at offset %d, after "
              "decompressing: stored %s, computed %s",
              Where(item), fr.index, fr.at, Crc32cToHex(want),
              Crc32cToHex(raw_crc[static_cast<size_t>(k)]));
        }
        return absl::OkStatus();
      }));
  size_t k = 0;
  while (k < frames.size()) {
    const size_t i = frames[k].item;
    const Item& item = *v.readable[i];
    const ByteLocation& loc = *item.location;
    std::string first;
    uint32_t crc = 0;
    for (; k < frames.size() && frames[k].item == i; ++k) {
      if (first.empty()) first = problem[k];
      const uint64_t f = frames[k].index;
      const uint64_t len = std::min(frame_bytes, loc.nbytes - f * frame_bytes);
      crc = f == 0 ? raw_crc[k] : Crc32cCombine(crc, raw_crc[k], len);
      *bytes_checked += loc.compression.frame_nbytes[f];
    }
    if (first.empty() && crc != loc.crc32c) {
      first = absl::StrFormat(
          "crc32c mismatch in %s: its frames are as stored, but together "
          "have %s, not the chunk's %s",
          Where(item), Crc32cToHex(crc), Crc32cToHex(loc.crc32c));
    }
    if (!first.empty()) {
      v.problems.push_back(
          {"crc32c", item.fqn, loc.file, loc.offset, std::move(first)});
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const VerifyOptions& options) {
  if (options.io_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "VerifyOptions::io_threads must be at least 1, not ",
        options.io_threads));
  }
  if (options.buffer_bytes < 1) {
    return absl::InvalidArgumentError(
        "VerifyOptions::buffer_bytes must be at least 1");
  }
  return absl::OkStatus();
}

// Step 2 for references (format version 6): each must be there, be the
// checkpoint recorded (its metadata checksum, ReferencingStorage), decode
// as a whole (ReadMetadata's checks) and carry the save id recorded.
void CheckReferences(ReferencingStorage& storage, const Metadata& md,
                     std::vector<VerifyProblem>& problems) {
  for (size_t k = 0; k < md.references.size(); ++k) {
    const CheckpointReference& ref = md.references[k];
    absl::StatusOr<Storage*> there = storage.Reference(static_cast<int>(k));
    absl::Status s = there.status();
    if (s.ok()) {
      absl::StatusOr<Metadata> theirs = ReadMetadataFromStorage(**there);
      s = theirs.status();
      if (s.ok() && theirs->save_id != ref.save_id) {
        s = absl::DataLossError(absl::StrFormat(
            "%s was saved by save %s, where save %s was recorded",
            storage.ReferenceUrl(static_cast<int>(k)),
            theirs->save_id.empty() ? "(none)" : theirs->save_id,
            ref.save_id));
      }
    }
    if (!s.ok()) {
      problems.push_back(VerifyProblem{
          "reference", "", ref.url, std::nullopt,
          absl::StrCat("reference ", ref.url, ": ", s.message())});
    }
  }
}

// Steps 1-5 on `storage`; every check but the options'.
absl::StatusOr<VerifyReport> VerifyInStorage(Storage& own_storage,
                                             std::string_view source_file,
                                             const VerifyOptions& options) {
  // Step 1, as ReadMetadata (a Hugging Face source: its index and headers).
  CAIRN_ASSIGN_OR_RETURN(const Metadata md,
                         ReadAnyMetadata(own_storage, source_file, {}));
  // Chunks kept in references (format version 6) are read there.
  ReferencingStorage storage(own_storage, md.references, {});
  Verification v{md, storage, CollectItems(md)};
  VerifyReport report;
  report.references = static_cast<int>(md.references.size());
  CheckReferences(storage, md, v.problems);
  report.format_version = md.has_checksums ? md.version : 0;
  report.metadata_checksum = md.has_checksums && MetadataSealed(storage, md);
  report.has_checksums = md.has_checksums;
  report.tensors = md.tensors.size();
  for (const auto& [fqn, t] : md.tensors) report.chunks += t.chunks.size();
  report.objects = md.objects.size();

  OpenFiles(v);  // step 2
  report.files = static_cast<int>(v.by_file.size());
  CheckLayout(v);  // step 3
  for (const auto& [name, file] : v.files) {  // step 4
    CheckHeader(*file, name, v.by_file[name], v.problems);
  }
  if (md.has_checksums) {  // step 5
    CAIRN_RETURN_IF_ERROR(CheckChecksums(v, options, &report.bytes_checked));
    CAIRN_RETURN_IF_ERROR(CheckFrames(v, options, &report.bytes_checked));
  }
  report.problems = std::move(v.problems);
  return report;
}

}  // namespace
}  // namespace internal_checkpoint

absl::StatusOr<VerifyReport> Verify(std::string_view url,
                                    const VerifyOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  CAIRN_RETURN_IF_ERROR(internal_checkpoint::ValidateOptions(options));
  CAIRN_ASSIGN_OR_RETURN(internal_checkpoint::OpenedSource opened,
                         internal_checkpoint::OpenSourceUrl(url));
  CAIRN_ASSIGN_OR_RETURN(
      VerifyReport report,
      internal_checkpoint::VerifyInStorage(*opened.storage, opened.file,
                                           options));
  report.seconds = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - start)
                       .count();
  return report;
}

}  // namespace cairn
