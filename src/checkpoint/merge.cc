// Merge: a rank-local checkpoint (one folder per rank, each with its own
// metadata.json) becomes a global one. Offline, no data copied:
//
//  1. Take the location's save lock (no save or merge into the top folder
//     runs meanwhile). Find every rank-NNNNN/metadata.json; each must be
//     committed and say it was written by that rank, all with one world
//     size and one save id (folders of different saves, as a crash leaves
//     them, never pass for one checkpoint), and ranks 0..world_size-1 must
//     all be there.
//  2. Combine: each chunk and object keeps its file, now named relative to
//     the checkpoint (rank-NNNNN/data-00000.safetensors). A box or object
//     stored by several ranks (replicas: rank-local saves do not dedup) is
//     kept once, and its copies must agree (size and CRC32C). Tensors must
//     agree in dtype and shape, scalars in value; the nestings are merged.
//  3. Check every tensor is covered exactly once and every chunk lies
//     inside its (real) file.
//  4. Write metadata.json atomically (refused over an existing one unless
//     `overwrite`). That is the commit; the rank folders stay as they are.
#include <algorithm>
#include <memory>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/checkpoint.h"
#include "cairn/version.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/kv_save.h"
#include "core/byte_codec.h"
#include "core/checked.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "plan/global_plan.h"
#include "plan/plan_codec.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::Annotate;

}  // namespace

absl::StatusOr<MergeResult> MergeInStorage(Storage& storage,
                                           const MergeOptions& options) {
  // 1. The lock, and the rank folders.
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage::Lock> lock,
                         storage.TryLock(internal_format::SaveLockName("")));
  CAIRN_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.List());
  std::map<int, std::string> folders;
  for (const std::string& name : names) {
    if (int rank = internal_format::RankOfMetadataName(name); rank >= 0) {
      folders[rank] = internal_format::RankFolderName(rank);
    }
  }
  if (folders.empty()) {
    return absl::NotFoundError(absl::StrFormat(
        "%s holds no rank-local checkpoint (no rank-NNNNN/%s)", storage.url(),
        kMetadataFileName));
  }
  std::vector<Metadata> parts;
  for (const auto& [rank, folder] : folders) {
    CAIRN_ASSIGN_OR_RETURN(
        Metadata md,
        ReadMetadataFile(storage, absl::StrCat(folder, "/", kMetadataFileName)));
    if (md.rank != rank) {
      return absl::DataLossError(absl::StrFormat(
          "%s/%s/%s says it was written by %s, not rank %d", storage.url(),
          folder, kMetadataFileName,
          md.rank < 0 ? "a global save" : absl::StrCat("rank ", md.rank),
          rank));
    }
    if (!parts.empty() && md.world_size != parts[0].world_size) {
      return absl::DataLossError(absl::StrFormat(
          "%s: rank %d's folder says the save had %d ranks, rank %d's says %d",
          storage.url(), folders.begin()->first, parts[0].world_size, rank,
          md.world_size));
    }
    if (!parts.empty() && md.save_id != parts[0].save_id) {
      auto id = [](const Metadata& m) {
        return m.save_id.empty() ? std::string("none recorded")
                                 : absl::StrCat("save ", m.save_id);
      };
      return absl::DataLossError(absl::StrFormat(
          "%s: rank %d's folder and rank %d's come from different saves (%s, "
          "%s); a crash or a smaller later save can leave folders of two "
          "saves side by side, which never make one checkpoint",
          storage.url(), folders.begin()->first, rank, id(parts[0]), id(md)));
    }
    parts.push_back(std::move(md));
  }
  const int world = parts[0].world_size;
  for (int r = 0; r < world; ++r) {
    if (!folders.contains(r)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: %s/%s is missing (the save had %d ranks); every rank's folder "
          "must be committed before merging",
          storage.url(), internal_format::RankFolderName(r), kMetadataFileName,
          world));
    }
  }
  if (static_cast<int>(folders.size()) != world) {
    return absl::DataLossError(absl::StrFormat(
        "%s: found %d rank folders but the save had %d ranks", storage.url(),
        folders.size(), world));
  }

  // 2. Combine.
  MergeResult result;
  result.ranks = world;
  Metadata& out = result.metadata;
  out.world_size = world;
  out.save_id = parts[0].save_id;
  out.created_by = "cairn " CAIRN_VERSION_STRING;
  out.user = parts[0].user;
  std::vector<std::string> structures;
  struct Origin {
    int rank;
    const ByteLocation* location;
  };
  std::map<std::pair<std::string, std::string>, Origin> boxes;  // (fqn, box)
  std::map<std::string, int> first_rank;  // tensors, objects, scalars
  for (int r = 0; r < world; ++r) {
    Metadata& md = parts[r];
    const std::string folder = internal_format::RankFolderName(r);
    structures.push_back(md.structure);
    auto relocate = [&](ByteLocation loc) {
      loc.file = absl::StrCat(folder, "/", loc.file);
      return loc;
    };
    auto same_copy = [&](const std::string& what, const Origin& first,
                         const ByteLocation& loc) -> absl::Status {
      if (first.location->nbytes == loc.nbytes &&
          first.location->crc32c == loc.crc32c) {
        return absl::OkStatus();
      }
      return absl::DataLossError(absl::StrFormat(
          "%s is stored by rank %d and rank %d with different contents "
          "(%d bytes crc32c %s vs %d bytes crc32c %s); replicas must be equal",
          what, first.rank, r, first.location->nbytes,
          internal_format::Crc32cToHex(first.location->crc32c), loc.nbytes,
          internal_format::Crc32cToHex(loc.crc32c)));
    };
    for (const auto& [fqn, tm] : md.tensors) {
      auto [it, inserted] = out.tensors.try_emplace(fqn);
      TensorMetadata& merged = it->second;
      if (inserted) {
        merged.dtype = tm.dtype;
        merged.shape = tm.shape;
        first_rank[fqn] = r;
      } else if (merged.dtype != tm.dtype || merged.shape != tm.shape) {
        return absl::DataLossError(absl::StrFormat(
            "%s: rank %d saved %s [%s] but rank %d saved %s [%s]", fqn,
            first_rank[fqn], DTypeName(merged.dtype),
            absl::StrJoin(merged.shape, ", "), r, DTypeName(tm.dtype),
            absl::StrJoin(tm.shape, ", ")));
      }
      for (const ChunkMetadata& chunk : tm.chunks) {
        // A rank that holds none of a tensor lists it with an empty box
        // (so that its own folder names the tensor); a global checkpoint
        // has a zero-byte chunk only for a tensor with no elements, as a
        // global save writes it (docs/format.md, 4.2).
        if (chunk.box.empty() && NumElements(tm.shape) > 0) continue;
        auto [b, fresh] = boxes.try_emplace(
            {fqn, chunk.box.ToString()}, Origin{r, &chunk.location});
        if (!fresh) {
          CAIRN_RETURN_IF_ERROR(same_copy(
              absl::StrCat(fqn, " ", chunk.box.ToString()), b->second,
              chunk.location));
          ++result.duplicates;
          continue;
        }
        merged.chunks.push_back(ChunkMetadata{chunk.box, relocate(chunk.location)});
        result.data_bytes += chunk.location.nbytes;
      }
    }
    for (const auto& [fqn, loc] : md.objects) {
      auto [it, inserted] = out.objects.try_emplace(fqn, relocate(loc));
      if (inserted) {
        first_rank[fqn] = r;
        result.data_bytes += loc.nbytes;
        continue;
      }
      const int fr = first_rank[fqn];
      CAIRN_RETURN_IF_ERROR(same_copy(absl::StrCat("object ", fqn),
                                      Origin{fr, &parts[fr].objects.at(fqn)},
                                      loc));
      ++result.duplicates;
    }
    for (const auto& [fqn, value] : md.scalars) {
      auto [it, inserted] = out.scalars.try_emplace(fqn, value);
      if (inserted) {
        first_rank[fqn] = r;
        continue;
      }
      if (!internal_core::SameScalar(it->second, value)) {
        return absl::DataLossError(absl::StrFormat(
            "scalar %s differs between rank %d and rank %d", fqn,
            first_rank[fqn], r));
      }
    }
  }
  for (auto& [fqn, tm] : out.tensors) {
    std::sort(tm.chunks.begin(), tm.chunks.end(),
              [](const ChunkMetadata& a, const ChunkMetadata& b) {
                return a.box.offsets < b.box.offsets;
              });
  }
  CAIRN_ASSIGN_OR_RETURN(out.structure,
                         internal_plan::MergeStructures(structures));
  // Key-value tables: each rank folder holds its buckets' rows.
  {
    std::vector<const Metadata*> folders;
    for (int r = 0; r < world; ++r) {
      PrefixKvFiles(parts[r].kv_tables, internal_format::RankFolderName(r));
      folders.push_back(&parts[r]);
    }
    absl::StatusOr<std::map<std::string, KvTableMetadata>> tables =
        MergeKvTables(folders, out);
    CAIRN_RETURN_IF_ERROR(Annotate(tables.status(),
                                   absl::StrCat("merging ", storage.url())));
    out.kv_tables = *std::move(tables);
    for (const auto& [fqn, table] : out.kv_tables) {
      result.data_bytes += table.nbytes();
    }
  }

  // 3. Coverage, and every chunk inside its real file.
  for (const auto& [fqn, tm] : out.tensors) {
    CAIRN_RETURN_IF_ERROR(Annotate(internal_format::ValidateCoverage(fqn, tm),
                                   absl::StrCat("merging ", storage.url())));
  }
  CAIRN_RETURN_IF_ERROR(Annotate(CheckLocationsAgainstFiles(storage, out),
                                 absl::StrCat("merging ", storage.url())));

  // 4. Commit.
  CAIRN_ASSIGN_OR_RETURN(bool exists, storage.Exists(kMetadataFileName));
  if (exists && !options.overwrite) {
    return absl::AlreadyExistsError(absl::StrFormat(
        "%s already holds a global %s; pass overwrite to replace it",
        storage.url(), kMetadataFileName));
  }
  CAIRN_ASSIGN_OR_RETURN(std::string json, internal_format::EncodeMetadata(out));
  // Without overwrite, only if still absent (another merge or save may
  // have committed since the check above).
  CAIRN_RETURN_IF_ERROR(
      exists ? storage.WriteAtomically(kMetadataFileName, json)
             : storage.CreateAtomically(kMetadataFileName, json));
  return result;
}

}  // namespace cairn::internal_checkpoint
