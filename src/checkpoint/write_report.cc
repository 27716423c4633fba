#include "checkpoint/write_report.h"

#include <atomic>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_format.h"
#include "cairn/version.h"
#include "core/byte_codec.h"
#include "core/parallel.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/names.h"
#include "format/references.h"

namespace cairn::internal_checkpoint {

using internal_core::ByteReader;
using internal_core::ByteWriter;

std::string EncodeReport(const WriteReport& r) {
  ByteWriter w;
  w.Str(r.file);
  w.U64(r.file_size);
  w.U64(r.items.size());
  for (const WriteReport::Loc& l : r.items) {
    w.U64(l.offset);
    w.U64(l.nbytes);
    w.U32(l.crc32c);
    w.U64(l.blocks.size());
    for (uint32_t b : l.blocks) w.U32(b);
    w.U8(static_cast<uint8_t>(l.compression.codec));
    if (l.compression.codec != Codec::kNone) {
      w.U64(l.compression.stored_nbytes);
      w.U64(l.compression.frame_nbytes.size());
      for (uint32_t n : l.compression.frame_nbytes) w.U32(n);
      for (uint32_t c : l.compression.frame_crc32c) w.U32(c);
    }
    w.Str(l.file);
    w.U8(l.xxh3 ? 1 : 0);
    if (l.xxh3) {
      w.U64(l.xxh3->high);
      w.U64(l.xxh3->low);
    }
  }
  w.U64(r.scalars.size());
  for (const auto& [fqn, v] : r.scalars) {
    w.Str(fqn);
    w.Scalar(v);
  }
  return w.Take();
}

absl::StatusOr<WriteReport> DecodeReport(std::string_view data, int rank) {
  ByteReader r(data, absl::StrCat("write report of rank ", rank));
  WriteReport out;
  out.file = r.Str();
  out.file_size = r.U64();
  const uint64_t n = r.Count(38);
  out.items.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    WriteReport::Loc l;
    l.offset = r.U64();
    l.nbytes = r.U64();
    l.crc32c = r.U32();
    const uint64_t blocks = r.Count(4);
    l.blocks.resize(blocks);
    for (uint32_t& b : l.blocks) b = r.U32();
    const uint8_t codec = r.U8();
    if (codec > static_cast<uint8_t>(Codec::kGroupedZstd)) {
      return absl::InternalError(absl::StrFormat(
          "write report of rank %d: item %d has codec %d", rank, i, codec));
    }
    l.compression.codec = static_cast<Codec>(codec);
    if (l.compression.codec != Codec::kNone) {
      l.compression.stored_nbytes = r.U64();
      const uint64_t frames = r.Count(8);
      l.compression.frame_nbytes.resize(frames);
      l.compression.frame_crc32c.resize(frames);
      for (uint32_t& f : l.compression.frame_nbytes) f = r.U32();
      for (uint32_t& c : l.compression.frame_crc32c) c = r.U32();
    }
    l.file = r.Str();
    if (r.U8() != 0) {
      ChunkDigest d;
      d.high = r.U64();
      d.low = r.U64();
      l.xxh3 = d;
    }
    out.items.push_back(std::move(l));
  }
  const uint64_t s = r.Count(9);
  for (uint64_t i = 0; i < s; ++i) {
    std::string fqn = r.Str();
    out.scalars[std::move(fqn)] = r.Scalar();
  }
  CAIRN_RETURN_IF_ERROR(r.status());
  return out;
}

namespace {

// A flat chunk whose file lies in a reference: filled after the ranks'
// own (the file table grows), one at a time.
struct Deferred {
  uint32_t chunk;
  WriteReport::Loc loc;
};

// Rank r's locations in `skeleton` from its decoded report: through its
// refs, or for flat chunks its chunk_refs (rank r's data file is then
// flat.files[1 + r]). Each rank's locations are its own, so ranks may be
// filled concurrently. kInternal when the report does not match the plan.
absl::Status FillLocations(internal_plan::MetadataSkeleton& skeleton, int r,
                           WriteReport& report, std::vector<Deferred>& deferred,
                           std::atomic<bool>& digestless) {
  const std::vector<ByteLocation*>& refs = skeleton.refs[r];
  if (report.items.size() != refs.size()) {
    return absl::InternalError(absl::StrFormat(
        "rank %d reports %d written items; its plan has %d", r,
        report.items.size(), refs.size()));
  }
  internal_format::FlatChunks& flat = skeleton.flat;
  const uint32_t* chunk_refs = nullptr;
  if (skeleton.uses_flat) {
    if (skeleton.chunk_refs.size() != skeleton.refs.size() ||
        skeleton.chunk_refs[r].size() != refs.size() ||
        flat.files.size() != skeleton.refs.size() + 1) {
      return absl::InternalError(absl::StrFormat(
          "the metadata skeleton's chunk refs do not match rank %d's plan",
          r));
    }
    flat.files[r + 1] = report.file;
    chunk_refs = skeleton.chunk_refs[r].data();
  }
  const uint64_t block_bytes = skeleton.metadata.crc32c_block_bytes;
  if (skeleton.uses_flat) flat.blocks[r + 1].clear();
  for (size_t i = 0; i < refs.size(); ++i) {
    WriteReport::Loc& l = report.items[i];
    if (!l.blocks.empty() &&
        (block_bytes == 0 ||
         l.blocks.size() !=
             internal_format::Crc32cBlockCount(l.nbytes, block_bytes))) {
      return absl::InternalError(absl::StrFormat(
          "rank %d reports %d block checksums for its item %d of %d bytes "
          "(blocks of %d bytes)",
          r, l.blocks.size(), i, l.nbytes, block_bytes));
    }
    if (refs[i] != nullptr) {
      ByteLocation& loc = *refs[i];
      loc.file = l.file.empty() ? report.file : std::move(l.file);
      loc.offset = l.offset;
      loc.nbytes = l.nbytes;
      loc.crc32c = l.crc32c;
      loc.block_crc32c = std::move(l.blocks);
      loc.compression = std::move(l.compression);
      loc.xxh3 = l.xxh3;
    } else if (chunk_refs != nullptr && chunk_refs[i] < flat.num_chunks()) {
      const uint32_t c = chunk_refs[i];
      // Every chunk a save writes has a digest; a report without one
      // (a test's) leaves every flat chunk without.
      if (l.xxh3) {
        flat.xxh3[c] = *l.xxh3;
      } else {
        digestless = true;
      }
      if (!l.file.empty()) {
        deferred.push_back({c, std::move(l)});
        continue;
      }
      flat.file[c] = static_cast<uint32_t>(r + 1);
      flat.offset[c] = l.offset;
      flat.nbytes[c] = l.nbytes;
      flat.crc32c[c] = l.crc32c;
      std::vector<uint32_t>& blocks = flat.blocks[r + 1];
      flat.block_at[c] =
          l.blocks.empty() ? internal_format::FlatChunks::kNoBlocks
                           : blocks.size();
      blocks.insert(blocks.end(), l.blocks.begin(), l.blocks.end());
      if (l.compression.codec != Codec::kNone) {
        // Ranks fill their locations concurrently; the map is shared.
        static absl::Mutex mu;
        absl::MutexLock lock(&mu);
        flat.compression[c] = std::move(l.compression);
      }
    } else {
      return absl::InternalError(absl::StrFormat(
          "rank %d's item %d has no place in the metadata skeleton", r, i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<const Metadata*> AssembleMetadata(
    internal_plan::MetadataSkeleton& skeleton,
    const std::vector<std::string>& encoded_reports,
    std::string_view user_metadata, uint64_t* checkpoint_bytes,
    std::span<const CheckpointReference> references) {
  Metadata& md = skeleton.metadata;
  md.scalars.clear();
  md.created_by = "cairn " CAIRN_VERSION_STRING;
  md.user = std::string(user_metadata);
  std::map<std::string, int> scalar_from;  // first rank holding each scalar
  *checkpoint_bytes = 0;
  if (encoded_reports.size() != skeleton.refs.size()) {
    return absl::InternalError(absl::StrFormat(
        "%d write reports for a plan of %d ranks", encoded_reports.size(),
        skeleton.refs.size()));
  }
  // Each rank's report decoded and its locations filled in (each rank's
  // refs are its own locations), on several threads when there are many;
  // then, rank by rank, the errors and the scalars, so the error reported
  // is the first in rank order, as one pass would find it.
  const int world = static_cast<int>(encoded_reports.size());
  size_t items = 0;
  for (const std::vector<ByteLocation*>& refs : skeleton.refs) {
    items += refs.size();
  }
  struct Rest {
    absl::Status status;
    uint64_t file_size = 0;
    std::map<std::string, Scalar> scalars;
    std::vector<Deferred> deferred;
  };
  std::vector<Rest> rest(static_cast<size_t>(world));
  std::atomic<bool> digestless{false};
  // Each rank's block checksums go to its file's array (FillLocations).
  if (skeleton.uses_flat) {
    // Set anew (a cached skeleton's from an earlier save are stale): the
    // files past the ranks' own were references.
    skeleton.flat.files.resize(skeleton.refs.size() + 1);
    skeleton.flat.compression.clear();
    if (skeleton.flat.xxh3.size() != skeleton.flat.num_chunks()) {
      skeleton.flat.xxh3.assign(skeleton.flat.num_chunks(), ChunkDigest{});
    }
    skeleton.flat.blocks.resize(skeleton.flat.files.size());
    if (skeleton.flat.block_at.size() != skeleton.flat.num_chunks()) {
      skeleton.flat.block_at.assign(skeleton.flat.num_chunks(),
                                    internal_format::FlatChunks::kNoBlocks);
    }
  }
  (void)internal_core::ParallelFor(
      world, internal_core::ThreadsFor(items),
      [&](int64_t r) {
        Rest& out = rest[static_cast<size_t>(r)];
        absl::StatusOr<WriteReport> report =
            DecodeReport(encoded_reports[r], static_cast<int>(r));
        out.status = report.ok() ? FillLocations(skeleton,
                                                 static_cast<int>(r), *report,
                                                 out.deferred, digestless)
                                 : report.status();
        if (out.status.ok()) {
          out.file_size = report->file_size;
          out.scalars = std::move(report->scalars);
        }
        return absl::OkStatus();
      });
  if (digestless) skeleton.flat.xxh3.clear();
  // Files in references (format version 6): each a file of the flat
  // table, and its reference listed.
  std::vector<bool> used(references.size(), false);
  auto note_reference = [&](const std::string& file) -> absl::Status {
    std::string_view name;
    absl::StatusOr<int> k =
        internal_format::ReferenceOf(file, references, &name);
    if (!k.ok() || *k < 0) {
      return absl::InternalError(absl::StrFormat(
          "a rank reports the chunk file %s, in none of the save's %d "
          "references",
          file, references.size()));
    }
    used[*k] = true;
    return absl::OkStatus();
  };
  std::map<std::string, uint32_t> reference_files;
  for (int r = 0; r < world; ++r) {
    Rest& report = rest[static_cast<size_t>(r)];
    CAIRN_RETURN_IF_ERROR(report.status);
    internal_format::FlatChunks& flat = skeleton.flat;
    for (Deferred& d : report.deferred) {
      auto [it, inserted] = reference_files.try_emplace(
          d.loc.file, static_cast<uint32_t>(flat.files.size()));
      if (inserted) {
        CAIRN_RETURN_IF_ERROR(note_reference(d.loc.file));
        flat.files.push_back(d.loc.file);
        flat.blocks.emplace_back();
      }
      const uint32_t f = it->second;
      flat.file[d.chunk] = f;
      flat.offset[d.chunk] = d.loc.offset;
      flat.nbytes[d.chunk] = d.loc.nbytes;
      flat.crc32c[d.chunk] = d.loc.crc32c;
      std::vector<uint32_t>& blocks = flat.blocks[f];
      flat.block_at[d.chunk] = d.loc.blocks.empty()
                                   ? internal_format::FlatChunks::kNoBlocks
                                   : blocks.size();
      blocks.insert(blocks.end(), d.loc.blocks.begin(), d.loc.blocks.end());
      if (d.loc.compression.codec != Codec::kNone) {
        flat.compression[d.chunk] = std::move(d.loc.compression);
      }
    }
    *checkpoint_bytes += report.file_size;
    for (auto& [fqn, value] : report.scalars) {
      auto [it, inserted] = md.scalars.try_emplace(fqn, value);
      if (inserted) {
        scalar_from[fqn] = r;
      } else if (!internal_core::SameScalar(it->second, value)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "scalar %s differs between rank %d and rank %d; a scalar held "
            "by several ranks is saved once, so every copy must be equal",
            fqn, scalar_from[fqn], r));
      }
    }
  }
  if (!skeleton.uses_flat) {
    for (const std::vector<ByteLocation*>& refs : skeleton.refs) {
      for (const ByteLocation* loc : refs) {
        if (loc == nullptr ||
            internal_format::ValidateRelativeName(loc->file).ok()) {
          continue;
        }
        CAIRN_RETURN_IF_ERROR(note_reference(loc->file));
      }
    }
  }
  md.references.clear();
  for (size_t k = 0; k < references.size(); ++k) {
    if (used[k]) md.references.push_back(references[k]);
  }
  return &md;
}

}  // namespace cairn::internal_checkpoint
