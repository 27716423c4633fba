// Save, step 4: a rank's data file (save_write.h).
#include "checkpoint/save_write.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/metadata.h"
#include "core/buffer_pool.h"
#include "core/checked.h"
#include "core/parallel.h"
#include "core/status.h"
#include "core/strided.h"
#include "format/chunk_digest.h"
#include "format/crc32c.h"
#include "format/names.h"
#include "format/safetensors.h"

namespace cairn::internal_checkpoint {

using internal_core::Annotate;



std::string PaddingName(uint64_t begin, const std::set<std::string>& taken) {
  std::string name = absl::StrCat("__cairn_pad_", begin);
  while (taken.contains(name)) name += "_";
  return name;
}

absl::StatusOr<const ResolvedData*> Acquire(Entry& e, SavePlanner& planner) {
  std::lock_guard<std::mutex> lock(e.mu);
  if (!e.resolved_once) {
    e.resolved_once = true;
    absl::StatusOr<ResolvedData> data = planner.ResolveData(*e.item);
    if (!data.ok()) {
      e.resolve_status = data.status();
    } else {
      e.data = *std::move(data);
      const WriteItem& item = *e.item;
      if (item.kind == ItemKind::kObject) {
        if (e.data.bytes.size() != item.nbytes) {
          e.resolve_status = absl::InvalidArgumentError(absl::StrFormat(
              "object %s has %d bytes, but the plan says %d (it changed "
              "during the save?)",
              item.fqn, e.data.bytes.size(), item.nbytes));
        }
      } else {
        e.resolve_status = CheckResolvedView(item, e.data);
      }
    }
  }
  CAIRN_RETURN_IF_ERROR(internal_core::Annotate(
      e.resolve_status, absl::StrCat("resolving ", e.st.name)));
  return &e.data;
}

void Release(Entry& e) {
  if (e.blocks_left.fetch_sub(1) == 1) {
    std::lock_guard<std::mutex> lock(e.mu);
    e.data = ResolvedData{};
  }
}

absl::Status CheckResolvedView(const WriteItem& item,
                               const ResolvedData& data) {
  const TensorView& v = data.view;
  if (v.device().is_cpu() && v.dtype() == item.dtype &&
      v.shape() == item.box.sizes &&
      (v.data() != nullptr || item.nbytes == 0)) {
    return absl::OkStatus();
  }
  return absl::InternalError(absl::StrFormat(
      "%s %s: the planner resolved it to a %s %s view on %s; expected "
      "host memory of the item's dtype and shape",
      item.fqn, item.box.ToString(), DTypeName(v.dtype()),
      absl::StrCat("[", absl::StrJoin(v.shape(), ", "), "]"),
      v.device().ToString()));
}

std::span<const std::byte> RowMajorRange(const TensorView& view,
                                         uint64_t begin, uint64_t end) {
  const size_t n = end - begin;
  if (view.is_contiguous()) {
    return {static_cast<const std::byte*>(view.data()) + begin, n};
  }
  thread_local std::vector<std::byte> scratch;
  if (scratch.size() < n) scratch.resize(n);
  internal_core::CopyRowMajorBytes(view, begin, end, scratch.data());
  return {scratch.data(), n};
}

void StartDigests(Entry& e, uint64_t block_bytes) {
  e.block_digest.clear();
  if (e.item->kind != ItemKind::kTensor || e.xxh3) return;
  e.block_digest.assign(
      (e.item->nbytes + block_bytes - 1) / block_bytes, ChunkDigest{});
  if (e.block_digest.empty()) {
    e.xxh3 = internal_format::CombineBlockDigests({});
  }
}

void FinishDigests(Entry& e) {
  if (e.block_digest.empty()) return;
  e.xxh3 = internal_format::CombineBlockDigests(e.block_digest);
  e.block_digest = {};
}

namespace {

// The CRC32C of bytes [offset, offset + length) of an entry; pieces never
// cross a boundary of the entry's checksum blocks.
struct CrcPiece {
  size_t entry;
  uint64_t offset;
  uint64_t length;
  uint32_t crc;
};

// Fills buf with file bytes [begin, end); appends the checksum pieces of the
// entries it touched, in file order, cut where the entries' checksum blocks
// of `block_bytes` (counted from each entry's start) end.
absl::Status FillBlock(FileLayout& layout, SavePlanner& planner,
                       uint64_t begin, uint64_t end, std::byte* buf,
                       uint64_t block_bytes, std::vector<CrcPiece>& pieces) {
  uint64_t pos = begin;
  if (pos < layout.data_start) {
    const uint64_t n = std::min(end, layout.data_start) - pos;
    std::memcpy(buf, layout.header.data() + pos, n);
    pos += n;
  }
  if (pos >= end) return absl::OkStatus();
  const uint64_t rel = pos - layout.data_start;
  auto it = std::upper_bound(
      layout.entries.begin(), layout.entries.end(), rel,
      [](uint64_t v, const std::unique_ptr<Entry>& e) { return v < e->st.end; });
  // Bytes between the entries (padding) are zeros; `filled` is where the
  // block's bytes so far end.
  uint64_t filled = pos;
  auto zero_until = [&](uint64_t until) {
    if (until > filled) std::memset(buf + (filled - begin), 0, until - filled);
    filled = std::max(filled, until);
  };
  for (; it != layout.entries.end() && layout.data_start + (*it)->st.begin < end;
       ++it) {
    Entry& e = **it;
    const uint64_t eb = layout.data_start + e.st.begin;
    const uint64_t lo = std::max(pos, eb) - eb;
    const uint64_t hi = std::min(end, layout.data_start + e.st.end) - eb;
    if (hi <= lo) continue;
    zero_until(eb + lo);
    filled = eb + hi;
    std::byte* dst = buf + (eb + lo - begin);
    CAIRN_ASSIGN_OR_RETURN(const ResolvedData* data, Acquire(e, planner));
    if (e.item->kind == ItemKind::kObject) {
      std::memcpy(dst, data->bytes.data() + lo, hi - lo);
    } else {
      internal_core::CopyRowMajorBytes(data->view, lo, hi, dst);
      // The digest of each checksum block that starts here, read from the
      // tensor (it may run past this write block).
      if (!e.block_digest.empty()) {
        for (uint64_t k = (lo + block_bytes - 1) / block_bytes;
             k * block_bytes < hi; ++k) {
          const uint64_t a = k * block_bytes;
          const uint64_t b = std::min(e.item->nbytes, a + block_bytes);
          const std::span<const std::byte> block =
              RowMajorRange(data->view, a, b);
          e.block_digest[k] =
              internal_format::BlockDigest(block.data(), block.size());
        }
      }
    }
    Release(e);
    const size_t index = static_cast<size_t>(it - layout.entries.begin());
    for (uint64_t a = lo; a < hi;) {
      const uint64_t b = std::min(hi, (a / block_bytes + 1) * block_bytes);
      pieces.push_back(CrcPiece{index, a, b - a,
                                internal_format::Crc32c(dst + (a - lo), b - a)});
      a = b;
    }
  }
  zero_until(end);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<FileLayout> LayOut(const SavePlan& plan,
                                  const std::string& file_name) {
  FileLayout layout;
  std::set<std::string> names;
  for (const WriteItem& item : plan.items) {
    auto e = std::make_unique<Entry>();
    e->item = &item;
    const bool object = item.kind == ItemKind::kObject;
    e->st.name = internal_format::EntryName(
        item.fqn, item.box, object || item.box == Box::Full(item.global_shape));
    if (!names.insert(e->st.name).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: two stored entries would both be named \"%s\"; rename one of "
          "the keys",
          file_name, e->st.name));
    }
    e->st.dtype = object ? DType::kU8 : item.dtype;
    e->st.shape = object ? Shape{static_cast<int64_t>(item.nbytes)}
                         : item.box.sizes;
    layout.entries.push_back(std::move(e));
  }
  uint64_t offset = 0;
  std::vector<internal_format::SafetensorsEntry> st;
  for (auto& e : layout.entries) {
    const uint64_t nbytes = e->item->nbytes;
    const uint64_t aligned = internal_core::RoundUp(offset, kAlignment);
    if (nbytes >= kAlignedEntryBytes && aligned != offset) {
      st.push_back({PaddingName(offset, names), DType::kU8,
                    Shape{static_cast<int64_t>(aligned - offset)}, offset,
                    aligned});
      offset = aligned;
    }
    e->st.begin = offset;
    if (__builtin_add_overflow(offset, nbytes, &e->st.end)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: data file size overflows", file_name));
    }
    offset = e->st.end;
    st.push_back(e->st);
  }
  layout.header = internal_format::EncodeSafetensorsHeader(
      st, {{"format", "cairn"}, {"version", std::to_string(kFormatVersion)}},
      kAlignment);
  layout.data_start = layout.header.size();
  layout.file_size = layout.data_start + offset;
  return layout;
}

absl::StatusOr<std::unique_ptr<WritableFile>> CreateDataFile(
    Storage& storage, const std::string& file_name, uint64_t* align) {
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                         storage.Create(file_name));
  *align = std::max<uint64_t>(1, file->alignment());
  if (kAlignment % *align != 0) {
    return absl::InternalError(absl::StrFormat(
        "%s: storage alignment %d is not a divisor of %d", file_name, *align,
        kAlignment));
  }
  return file;
}

absl::Status WriteDataFile(FileLayout& layout, SavePlanner& planner,
                           Storage& storage, const std::string& file_name,
                           const SaveOptions& options) {
  if (options.codec != Codec::kNone) {
    return WriteCompressedDataFile(layout, planner, storage, file_name,
                                   options);
  }
  uint64_t align = 1;
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file,
                         CreateDataFile(storage, file_name, &align));
  uint64_t block = std::max<uint64_t>(options.write_buffer_bytes, kAlignment);
  block = internal_core::RoundUp(block, kAlignment);
  const int64_t num_blocks =
      static_cast<int64_t>((layout.file_size + block - 1) / block);
  // How many blocks each entry spans, so the last one releases its data.
  for (auto& e : layout.entries) {
    if (e->st.end == e->st.begin) continue;
    const uint64_t first = (layout.data_start + e->st.begin) / block;
    const uint64_t last = (layout.data_start + e->st.end - 1) / block;
    e->blocks_left = static_cast<int64_t>(last - first + 1);
  }
  // Whole aligned blocks are written, so the file reaches file_size
  // rounded up to the alignment before Finish cuts it back.
  CAIRN_RETURN_IF_ERROR(
      file->Reserve(internal_core::RoundUp(layout.file_size, align)));
  for (auto& e : layout.entries) StartDigests(*e, options.crc32c_block_bytes);
  const int threads = std::max(1, options.io_threads);
  internal_core::BufferPool pool(block, threads);
  std::vector<std::vector<CrcPiece>> pieces(num_blocks);

  CAIRN_RETURN_IF_ERROR(internal_core::ParallelFor(
      num_blocks, threads, [&](int64_t i) -> absl::Status {
        const uint64_t begin = static_cast<uint64_t>(i) * block;
        const uint64_t end = std::min(layout.file_size, begin + block);
        CAIRN_ASSIGN_OR_RETURN(internal_core::PooledBuffer buf,
                               pool.Acquire());
        CAIRN_RETURN_IF_ERROR(
            FillBlock(layout, planner, begin, end, buf.data(),
                      options.crc32c_block_bytes, pieces[i]));
        // O_DIRECT needs whole aligned blocks: zero-pad the tail; Finish
        // cuts the file back to its size.
        const uint64_t len = internal_core::RoundUp(end - begin, align);
        std::memset(buf.data() + (end - begin), 0, len - (end - begin));
        return Annotate(
            file->WriteAt(begin, std::span<const std::byte>(buf.data(), len)),
            absl::StrFormat("writing %s at offset %d", file_name, begin));
      }));
  CAIRN_RETURN_IF_ERROR(file->Finish(layout.file_size));
  for (auto& e : layout.entries) FinishDigests(*e);

  // Each entry's pieces come in order (write blocks in file order, pieces
  // in each in file order): its CRC32C is all of them combined, and each of
  // its checksum blocks' those inside the block.
  const uint64_t bb = options.crc32c_block_bytes;
  std::vector<bool> seen(layout.entries.size(), false);
  for (auto& e : layout.entries) {
    e->block_crc32c.assign(
        internal_format::Crc32cBlockCount(e->st.end - e->st.begin, bb), 0);
  }
  for (const std::vector<CrcPiece>& block_pieces : pieces) {
    for (const CrcPiece& p : block_pieces) {
      Entry& e = *layout.entries[p.entry];
      e.crc32c = seen[p.entry] ? internal_format::Crc32cCombine(
                                     e.crc32c, p.crc, p.length)
                               : p.crc;
      seen[p.entry] = true;
      if (e.block_crc32c.empty()) continue;
      uint32_t& block = e.block_crc32c[p.offset / bb];
      block = p.offset % bb == 0
                  ? p.crc
                  : internal_format::Crc32cCombine(block, p.crc, p.length);
    }
  }
  return absl::OkStatus();
}

}  // namespace cairn::internal_checkpoint
