// Save against a base (save_reuse.h).
#include "checkpoint/save_reuse.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/storage.h"
#include "checkpoint/checkpoint_impl.h"
#include "checkpoint/save_write.h"
#include "core/parallel.h"
#include "core/status.h"
#include "core/strided.h"
#include "format/chunk_digest.h"
#include "format/crc32c.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "format/references.h"
#include "storage/file_storage.h"

namespace cairn::internal_checkpoint {

using internal_core::Annotate;

absl::StatusOr<std::string> ReadBase(std::string_view own_url,
                                     const SaveOptions& options) {
  const std::string context = absl::StrCat("save: base ", options.base);
  if (options.rank_local) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, ": a rank-local save cannot have a base (merge the base, "
                 "and save globally)"));
  }
  CAIRN_ASSIGN_OR_RETURN(std::string own, CanonicalCheckpointUrl(own_url));
  absl::StatusOr<std::string> canonical = CanonicalCheckpointUrl(options.base);
  CAIRN_RETURN_IF_ERROR(Annotate(canonical.status(), context));
  const std::string& base = *canonical;
  if (own == base) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, " is the checkpoint being saved; a base must be another, "
                 "earlier checkpoint"));
  }
  absl::StatusOr<std::unique_ptr<Storage>> storage =
      Storage::Open(options.base, StorageOptions{.s3 = options.s3});
  CAIRN_RETURN_IF_ERROR(Annotate(storage.status(), context));
  absl::StatusOr<std::string> text =
      ReadMetadataText(**storage, kMetadataFileName);
  CAIRN_RETURN_IF_ERROR(Annotate(text.status(), context));
  // Validated as a load would, once, here; the ranks index the same text.
  absl::StatusOr<Metadata> md = internal_format::DecodeMetadata(
      *text, absl::StrCat(options.base, "/", kMetadataFileName));
  CAIRN_RETURN_IF_ERROR(Annotate(md.status(), context));
  if (md->rank >= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, " is a rank folder's metadata; a base is a global "
                 "checkpoint"));
  }
  CAIRN_RETURN_IF_ERROR(
      Annotate(internal_format::ValidateAllCoverage(*md), context));
  if (md->crc32c_block_bytes != options.crc32c_block_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s has checksum blocks of %d bytes, this save %d: a reused chunk "
        "keeps its block checksums, so both must be the same",
        context, md->crc32c_block_bytes, options.crc32c_block_bytes));
  }
  if (md->version < 2 ||
      !text->starts_with(internal_format::kChecksumKeyPrefix)) {
    return absl::InvalidArgumentError(absl::StrCat(
        context, " has no metadata checksum (format version ", md->version,
        "), which a reference needs to recognise it"));
  }
  return text;
}

absl::StatusOr<BaseChunks> IndexBase(std::string_view text,
                                     std::string_view own_url,
                                     std::string_view base_url) {
  const std::string context = absl::StrCat("save: base ", std::string(base_url));
  CAIRN_ASSIGN_OR_RETURN(
      Metadata md,
      internal_format::DecodeMetadata(
          text, absl::StrCat(std::string(base_url), "/", kMetadataFileName)));
  CAIRN_ASSIGN_OR_RETURN(std::string own, CanonicalCheckpointUrl(own_url));
  CAIRN_ASSIGN_OR_RETURN(std::string base, CanonicalCheckpointUrl(base_url));
  const size_t n = internal_format::kChecksumPrefixBytes;
  absl::StatusOr<uint32_t> checksum = internal_format::Crc32cFromHex(
      text.size() >= n ? text.substr(n - 10, 8) : std::string_view());
  CAIRN_RETURN_IF_ERROR(Annotate(checksum.status(), context));
  BaseChunks out;
  out.crc32c_block_bytes = md.crc32c_block_bytes;
  out.candidates.push_back(CheckpointReference{
      internal_format::ReferenceFrom(own, base), *checksum, md.save_id});
  // The base's references, as this checkpoint names them; -1: this
  // checkpoint itself (being overwritten), whose chunks are not reused.
  std::vector<int> candidate_of;
  for (const CheckpointReference& r : md.references) {
    const std::string there = internal_format::ResolveReference(base, r.url);
    absl::StatusOr<std::string> canon = CanonicalCheckpointUrl(there);
    if (!canon.ok() || *canon == own) {
      candidate_of.push_back(-1);
      continue;
    }
    candidate_of.push_back(static_cast<int>(out.candidates.size()));
    out.candidates.push_back(CheckpointReference{
        internal_format::ReferenceFrom(own, *canon), r.checksum, r.save_id});
  }
  for (auto& [fqn, tensor] : md.tensors) {
    for (ChunkMetadata& c : tensor.chunks) {
      if (!c.location.xxh3) continue;
      std::string_view name;
      absl::StatusOr<int> k =
          internal_format::ReferenceOf(c.location.file, md.references, &name);
      if (!k.ok()) continue;  // decoding refused such names already
      const int candidate = *k < 0 ? 0 : candidate_of[*k];
      if (candidate < 0) continue;
      ByteLocation loc = c.location;
      loc.file =
          absl::StrCat(out.candidates[candidate].url, "/", std::string(name));
      out.chunks.emplace(
          internal_format::EntryName(fqn, c.box, /*whole=*/false),
          BaseChunks::Chunk{tensor.dtype, tensor.shape, c.box,
                            std::move(loc)});
    }
  }
  return out;
}

WriteReport::Loc ReusedLocation(const ByteLocation& base) {
  return WriteReport::Loc{base.offset,       base.nbytes, base.crc32c,
                          base.block_crc32c, base.compression, base.file,
                          base.xxh3};
}

namespace {

// One block of one item: its digest, and its CRC32C when the item may be
// reused.
struct BlockTask {
  size_t item;
  uint64_t begin;
  uint64_t end;
};

}  // namespace

absl::StatusOr<std::vector<ItemDigest>> DigestItems(
    const SavePlan& plan, SavePlanner& planner, const BaseChunks* base,
    uint64_t block_bytes, uint64_t batch_bytes) {
  const std::vector<WriteItem>& items = plan.items;
  std::vector<ItemDigest> out(items.size());
  std::vector<const BaseChunks::Chunk*> match(items.size(), nullptr);
  if (base != nullptr) {
    for (size_t i = 0; i < items.size(); ++i) {
      const WriteItem& item = items[i];
      if (item.kind != ItemKind::kTensor) continue;
      auto it = base->chunks.find(
          internal_format::EntryName(item.fqn, item.box, /*whole=*/false));
      if (it == base->chunks.end()) continue;
      const BaseChunks::Chunk& c = it->second;
      // A chunk of no bytes is written: its reference would keep the base
      // for nothing.
      if (item.nbytes > 0 && c.dtype == item.dtype &&
          c.shape == item.global_shape &&
          c.box == item.box && c.location.nbytes == item.nbytes) {
        match[i] = &c;
      }
    }
  }
  if (base == nullptr) return out;
  const int threads = internal_core::CpuThreads();
  std::vector<ChunkDigest> digests;
  std::vector<uint32_t> crcs;
  size_t i = 0;
  while (i < items.size()) {
    // A batch of items, resolved together, at most batch_bytes (or one).
    std::vector<size_t> batch;
    uint64_t bytes = 0;
    for (; i < items.size() && (batch.empty() || bytes < batch_bytes); ++i) {
      if (match[i] == nullptr) continue;
      batch.push_back(i);
      bytes += items[i].nbytes;
    }
    std::vector<ResolvedData> data(batch.size());
    std::vector<BlockTask> tasks;
    std::vector<size_t> first_task(batch.size() + 1, 0);
    for (size_t b = 0; b < batch.size(); ++b) {
      const WriteItem& item = items[batch[b]];
      absl::StatusOr<ResolvedData> d = planner.ResolveData(item);
      CAIRN_RETURN_IF_ERROR(Annotate(
          d.status(), absl::StrCat("resolving ", item.fqn, " ",
                                   item.box.ToString(), " to digest it")));
      data[b] = *std::move(d);
      CAIRN_RETURN_IF_ERROR(CheckResolvedView(item, data[b]));
      first_task[b] = tasks.size();
      for (uint64_t at = 0; at < item.nbytes; at += block_bytes) {
        tasks.push_back({b, at, std::min(item.nbytes, at + block_bytes)});
      }
    }
    first_task[batch.size()] = tasks.size();
    digests.assign(tasks.size(), ChunkDigest{});
    crcs.assign(tasks.size(), 0);
    CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
        static_cast<int64_t>(tasks.size()), threads,
        [&](int64_t t) -> absl::Status {
          const BlockTask& task = tasks[t];
          const std::span<const std::byte> bytes =
              RowMajorRange(data[task.item].view, task.begin, task.end);
          digests[t] = internal_format::BlockDigest(bytes.data(), bytes.size());
          crcs[t] = internal_format::Crc32c(bytes.data(), bytes.size());
          return absl::OkStatus();
        }));
    for (size_t b = 0; b < batch.size(); ++b) {
      const size_t item = batch[b];
      const size_t lo = first_task[b];
      const size_t hi = first_task[b + 1];
      out[item].xxh3 = internal_format::CombineBlockDigests(
          std::span<const ChunkDigest>(digests.data() + lo, hi - lo));
      const BaseChunks::Chunk* c = match[item];
      uint32_t crc = 0;
      for (size_t t = lo; t < hi; ++t) {
        crc = t == lo ? crcs[t]
                      : internal_format::Crc32cCombine(
                            crc, crcs[t], tasks[t].end - tasks[t].begin);
      }
      if (crc == c->location.crc32c && *out[item].xxh3 == *c->location.xxh3) {
        out[item].reuse = &c->location;
      } else {
        out[item].held = std::move(data[b]);
      }
    }
  }
  return out;
}

}  // namespace cairn::internal_checkpoint
