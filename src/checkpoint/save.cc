// Save, one process. The protocol, in order:
//
//  1. Flatten the state dict and validate every leaf: host memory, each shard
//     inside its tensor with a view of the box's shape and the tensor's
//     dtype. Identical boxes are written once. Each tensor's boxes must cover
//     it exactly once. Nothing touches storage before all of this passes.
//  2. Lay out one data file: a safetensors header padded to a 4096-byte
//     boundary, then every chunk and object back to back (no holes).
//  3. Prepare the location. A committed checkpoint there is refused unless
//     `overwrite`; with it, the old checkpoint is un-committed first (remove
//     metadata.json, sync the directory) so that no crash from here on can
//     leave a metadata.json pointing at half-rewritten data.
//  4. Stream the file in blocks of `write_buffer_bytes`: IO threads fill
//     aligned buffers from the sources, checksum each chunk's bytes as they
//     pass (per block, combined afterwards), and write each block at its
//     offset (O_DIRECT where the filesystem allows).
//  5. Finish the file (cut the alignment padding, fdatasync) and sync the
//     directory.
//  6. Write metadata.json atomically: temp file, fsync, rename, fsync of the
//     directory. That rename is the commit.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/checkpoint.h"
#include "cairn/version.h"
#include "checkpoint/checkpoint_impl.h"
#include "core/buffer_pool.h"
#include "core/flatten.h"
#include "core/parallel.h"
#include "core/strided.h"
#include "core/status.h"
#include "format/crc32c.h"
#include "format/metadata_codec.h"
#include "format/names.h"
#include "format/safetensors.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::Annotate;

constexpr uint64_t kAlignment = internal_core::kIoAlignment;

// One entry of the data file: a stored chunk of a tensor, or an object.
struct Entry {
  std::string fqn;
  bool is_object = false;
  Box box;                             // tensors only
  size_t chunk = 0;                    // tensors: index in its chunks
  TensorView view;                     // tensors only
  const std::string* bytes = nullptr;  // objects only
  internal_format::SafetensorsEntry st;
  uint32_t crc32c = 0;
};

// What one block of the file contributed to one entry's checksum.
struct CrcPiece {
  size_t entry;
  uint64_t length;
  uint32_t crc;
};

bool IsOurDataFile(std::string_view name) {
  // data-NNNNN.safetensors, or a leftover temporary of metadata.json.
  return (name.starts_with("data-") && name.ends_with(".safetensors") &&
          name.find('/') == std::string_view::npos) ||
         name.starts_with(std::string(kMetadataFileName) + ".tmp");
}

struct Plan {
  std::vector<Entry> entries;
  Metadata metadata;  // without chunk locations yet
  std::string header;
  uint64_t data_start = 0;
  uint64_t file_size = 0;
};

absl::StatusOr<Plan> MakePlan(const StateDict& state,
                              const SaveOptions& options) {
  Plan plan;
  CAIRN_ASSIGN_OR_RETURN(internal_core::Flattened flat,
                         internal_core::Flatten(state));
  plan.metadata.structure = flat.structure;
  plan.metadata.user = options.user_metadata;
  plan.metadata.created_by = "cairn " CAIRN_VERSION_STRING;
  plan.metadata.world_size = 1;

  std::set<std::string> entry_names;
  uint64_t offset = 0;
  auto add_entry = [&](Entry e, DType dtype, Shape shape, uint64_t nbytes,
                       bool whole) -> absl::Status {
    e.st.name = internal_format::EntryName(e.fqn, e.box, whole);
    if (!entry_names.insert(e.st.name).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "two stored entries would both be named \"%s\"; rename one of the "
          "keys",
          e.st.name));
    }
    e.st.dtype = dtype;
    e.st.shape = std::move(shape);
    e.st.begin = offset;
    e.st.end = offset + nbytes;
    offset = e.st.end;
    plan.entries.push_back(std::move(e));
    return absl::OkStatus();
  };

  for (const internal_core::FlatLeaf& leaf : flat.leaves) {
    const StateDict& node = *leaf.node;
    if (const Scalar* s = node.scalar()) {
      plan.metadata.scalars[leaf.fqn] = *s;
    } else if (const Object* o = node.object()) {
      Entry e;
      e.fqn = leaf.fqn;
      e.is_object = true;
      e.bytes = &o->bytes;
      const uint64_t n = o->bytes.size();
      plan.metadata.objects[leaf.fqn] = ByteLocation{};
      CAIRN_RETURN_IF_ERROR(add_entry(std::move(e), DType::kU8,
                                      {static_cast<int64_t>(n)}, n,
                                      /*whole=*/true));
    } else if (const ShardedTensor* t = node.tensor()) {
      for (int64_t d : t->global_shape()) {
        if (d < 0) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: negative dimension in shape [%s]", leaf.fqn,
              absl::StrJoin(t->global_shape(), ", ")));
        }
      }
      TensorMetadata& tm = plan.metadata.tensors[leaf.fqn];
      tm.dtype = t->dtype();
      tm.shape = t->global_shape();
      // Shards in box order; identical boxes (replicas held twice) once.
      std::vector<const Shard*> shards;
      for (const Shard& s : t->shards()) {
        CAIRN_RETURN_IF_ERROR(ValidateShard(leaf.fqn, *t, s));
        if (s.box.empty()) continue;
        shards.push_back(&s);
      }
      std::stable_sort(shards.begin(), shards.end(),
                       [](const Shard* a, const Shard* b) {
                         return a->box.offsets < b->box.offsets ||
                                (a->box.offsets == b->box.offsets &&
                                 a->box.sizes < b->box.sizes);
                       });
      shards.erase(std::unique(shards.begin(), shards.end(),
                               [](const Shard* a, const Shard* b) {
                                 return a->box == b->box;
                               }),
                   shards.end());
      for (const Shard* s : shards) {
        tm.chunks.push_back(ChunkMetadata{s->box, {}});
      }
      if (absl::Status c = internal_format::ValidateCoverage(leaf.fqn, tm);
          !c.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("cannot save: ", c.message()));
      }
      const size_t es = DTypeSize(t->dtype());
      for (size_t c = 0; c < shards.size(); ++c) {
        const Shard* s = shards[c];
        Entry e;
        e.fqn = leaf.fqn;
        e.box = s->box;
        e.chunk = c;
        e.view = s->view;
        const uint64_t n = static_cast<uint64_t>(s->box.num_elements()) * es;
        const bool whole = s->box == Box::Full(tm.shape);
        CAIRN_RETURN_IF_ERROR(
            add_entry(std::move(e), t->dtype(), s->box.sizes, n, whole));
      }
    } else {
      return absl::InternalError(
          absl::StrCat("flatten returned a non-leaf at ", leaf.fqn));
    }
  }

  std::vector<internal_format::SafetensorsEntry> st;
  st.reserve(plan.entries.size());
  for (const Entry& e : plan.entries) st.push_back(e.st);
  plan.header = internal_format::EncodeSafetensorsHeader(
      st, {{"format", "cairn"}, {"version", std::to_string(kFormatVersion)}},
      kAlignment);
  plan.data_start = plan.header.size();
  plan.file_size = plan.data_start + offset;
  return plan;
}

// Removes a committed checkpoint's commit record and its data files, or
// refuses when `overwrite` is false.
absl::Status PrepareLocation(Storage& storage, const SaveOptions& options) {
  CAIRN_RETURN_IF_ERROR(storage.CreateLocation());
  CAIRN_ASSIGN_OR_RETURN(bool committed, storage.Exists(kMetadataFileName));
  if (committed) {
    if (!options.overwrite) {
      return absl::AlreadyExistsError(absl::StrFormat(
          "%s already holds a committed checkpoint; pass overwrite to "
          "replace it",
          storage.url()));
    }
    CAIRN_RETURN_IF_ERROR(storage.Remove(kMetadataFileName));
    CAIRN_RETURN_IF_ERROR(storage.Sync());
  }
  // Left over from the old checkpoint or from a crashed save.
  CAIRN_ASSIGN_OR_RETURN(std::vector<std::string> names, storage.List());
  for (const std::string& name : names) {
    if (IsOurDataFile(name)) CAIRN_RETURN_IF_ERROR(storage.Remove(name));
  }
  return absl::OkStatus();
}

// Fills buf with file bytes [begin, end) and returns the checksum pieces of
// the entries it touched, in file order.
std::vector<CrcPiece> FillBlock(const Plan& plan, uint64_t begin, uint64_t end,
                                std::byte* buf) {
  std::vector<CrcPiece> pieces;
  uint64_t pos = begin;
  if (pos < plan.data_start) {
    const uint64_t n = std::min(end, plan.data_start) - pos;
    std::memcpy(buf, plan.header.data() + pos, n);
    pos += n;
  }
  if (pos >= end) return pieces;
  // First entry ending after pos.
  const uint64_t rel = pos - plan.data_start;
  auto it = std::upper_bound(
      plan.entries.begin(), plan.entries.end(), rel,
      [](uint64_t v, const Entry& e) { return v < e.st.end; });
  for (; it != plan.entries.end() && plan.data_start + it->st.begin < end;
       ++it) {
    const Entry& e = *it;
    const uint64_t eb = plan.data_start + e.st.begin;
    const uint64_t lo = std::max(pos, eb) - eb;
    const uint64_t hi = std::min(end, plan.data_start + e.st.end) - eb;
    if (hi <= lo) continue;
    std::byte* dst = buf + (eb + lo - begin);
    if (e.is_object) {
      std::memcpy(dst, e.bytes->data() + lo, hi - lo);
    } else {
      internal_core::CopyRowMajorBytes(e.view, lo, hi, dst);
    }
    pieces.push_back(CrcPiece{static_cast<size_t>(it - plan.entries.begin()),
                              hi - lo, internal_format::Crc32c(dst, hi - lo)});
  }
  return pieces;
}

absl::Status WriteDataFile(Plan& plan, Storage& storage,
                           const std::string& file_name,
                           const SaveOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                         storage.Create(file_name));
  const uint64_t align = std::max<uint64_t>(1, file->alignment());
  if (kAlignment % align != 0) {
    return absl::InternalError(absl::StrFormat(
        "%s: storage alignment %d is not a divisor of %d", file_name, align,
        kAlignment));
  }
  uint64_t block = std::max<uint64_t>(options.write_buffer_bytes, kAlignment);
  block = (block + kAlignment - 1) / kAlignment * kAlignment;
  const int64_t num_blocks =
      static_cast<int64_t>((plan.file_size + block - 1) / block);
  const int threads = std::max(1, options.io_threads);
  internal_core::BufferPool pool(block, threads);
  std::vector<std::vector<CrcPiece>> pieces(num_blocks);

  CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
      num_blocks, threads, [&](int64_t i) -> absl::Status {
        const uint64_t begin = static_cast<uint64_t>(i) * block;
        const uint64_t end = std::min(plan.file_size, begin + block);
        CAIRN_ASSIGN_OR_RETURN(internal_core::PooledBuffer buf,
                               pool.Acquire());
        pieces[i] = FillBlock(plan, begin, end, buf.data());
        // O_DIRECT needs whole aligned blocks: zero-pad the tail; Finish
        // cuts the file back to its size.
        const uint64_t len = (end - begin + align - 1) / align * align;
        std::memset(buf.data() + (end - begin), 0, len - (end - begin));
        return Annotate(
            file->WriteAt(begin, std::span<const std::byte>(buf.data(), len)),
            absl::StrFormat("writing %s at offset %d", file_name, begin));
      }));
  CAIRN_RETURN_IF_ERROR(file->Finish(plan.file_size));

  // Stitch each entry's checksum together from its pieces, in file order.
  std::vector<bool> seen(plan.entries.size(), false);
  for (const std::vector<CrcPiece>& block_pieces : pieces) {
    for (const CrcPiece& p : block_pieces) {
      Entry& e = plan.entries[p.entry];
      e.crc32c = seen[p.entry] ? internal_format::Crc32cCombine(
                                     e.crc32c, p.crc, p.length)
                               : p.crc;
      seen[p.entry] = true;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SaveResult> SaveToStorage(const StateDict& state,
                                         Storage& storage,
                                         const SaveOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  CAIRN_ASSIGN_OR_RETURN(Plan plan, MakePlan(state, options));
  // Encode once before touching storage so a bad user_metadata fails early.
  CAIRN_RETURN_IF_ERROR(internal_format::EncodeMetadata(plan.metadata).status());
  CAIRN_RETURN_IF_ERROR(PrepareLocation(storage, options));

  const std::string file_name = internal_format::DataFileName(0);
  CAIRN_RETURN_IF_ERROR(WriteDataFile(plan, storage, file_name, options));
  CAIRN_RETURN_IF_ERROR(storage.Sync());

  uint64_t data_bytes = 0;
  for (const Entry& e : plan.entries) {
    ByteLocation loc{file_name, plan.data_start + e.st.begin,
                     e.st.end - e.st.begin, e.crc32c};
    data_bytes += loc.nbytes;
    if (e.is_object) {
      plan.metadata.objects[e.fqn] = loc;
    } else {
      plan.metadata.tensors[e.fqn].chunks[e.chunk].location = loc;
    }
  }
  CAIRN_ASSIGN_OR_RETURN(std::string json,
                         internal_format::EncodeMetadata(plan.metadata));
  CAIRN_RETURN_IF_ERROR(storage.WriteAtomically(kMetadataFileName, json));

  SaveResult result;
  result.bytes_written = plan.file_size;
  result.data_bytes = data_bytes;
  result.files = 1;
  result.seconds = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - start)
                       .count();
  return result;
}

}  // namespace cairn::internal_checkpoint
