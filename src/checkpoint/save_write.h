// Save, step 4 (save.cc): a rank's data file, laid out from its final
// plan (each large entry aligned to 4096 by a padding entry) and written
// in blocks of write_buffer_bytes by IO threads that resolve each item's
// bytes when its first block is filled, checksum them as they pass (whole
// and per checksum block) and release them after its last block.
#ifndef CAIRN_CHECKPOINT_SAVE_WRITE_H_
#define CAIRN_CHECKPOINT_SAVE_WRITE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/checkpoint.h"
#include "cairn/planner.h"
#include "cairn/storage.h"
#include "core/aligned_buffer.h"
#include "format/safetensors.h"

namespace cairn::internal_checkpoint {

// One entry of a rank's data file: a final-plan item.
struct Entry {
  const WriteItem* item = nullptr;
  internal_format::SafetensorsEntry st;
  uint32_t crc32c = 0;
  // Its block checksums (format version 3), when longer than one block.
  std::vector<uint32_t> block_crc32c;
  // Blocks not yet filled; the resolved data is released when it hits 0.
  std::atomic<int64_t> blocks_left{0};
  std::mutex mu;  // guards resolved/resolve_status
  bool resolved_once = false;
  absl::Status resolve_status;
  ResolvedData data;
  // Written compressed (SaveOptions::codec; format version 5): st holds
  // the stored U8 entry, block_crc32c and crc32c the raw bytes'.
  Compression compression;
  // A tensor's digest (format version 6): given before the write (a save
  // against a base digested it already), or taken by the writer from the
  // digests of its checksum blocks as they pass (block_digest).
  std::optional<ChunkDigest> xxh3;
  std::vector<ChunkDigest> block_digest;
};

inline constexpr uint64_t kAlignment = internal_core::kIoAlignment;

// Entries of at least this many bytes start at a multiple of kAlignment in
// the byte buffer (which itself starts at one), so that a load can read
// them with O_DIRECT straight into an aligned destination. Smaller ones
// are packed: a direct read of them would not pay off.
inline constexpr uint64_t kAlignedEntryBytes = uint64_t{64} << 10;

// The name of a padding entry at buffer offset `begin`, unlike every name
// in `taken` (a tensor's FQN could be anything).
std::string PaddingName(uint64_t begin, const std::set<std::string>& taken);

// The resolved bytes of `e`, resolving them on first use; Release drops
// them after as many calls as e.blocks_left was set to.
absl::StatusOr<const ResolvedData*> Acquire(Entry& e, SavePlanner& planner);
void Release(Entry& e);

struct FileLayout {
  std::vector<std::unique_ptr<Entry>> entries;
  std::string header;
  uint64_t data_start = 0;
  uint64_t file_size = 0;
};

// The rank's data file `file_name`: its entries in plan order, each large
// one aligned by a zero-filled U8 padding entry before it (safetensors
// allows no holes in the byte buffer), and the header that lists them all.
absl::StatusOr<FileLayout> LayOut(const SavePlan& plan,
                                  const std::string& file_name);

// OK when `data`, resolved for the tensor item `item`, is host memory of
// its dtype and shape (kInternal naming the item otherwise).
absl::Status CheckResolvedView(const WriteItem& item, const ResolvedData& data);

// Bytes [begin, end) of `view`'s row-major image (host memory): in place
// when the view is contiguous, else copied into a buffer of the calling
// thread's, valid until its next call.
std::span<const std::byte> RowMajorRange(const TensorView& view,
                                         uint64_t begin, uint64_t end);
// Before an entry is written: room for its block digests when the writer
// is to take its digest (a tensor without one); after: its digest.
void StartDigests(Entry& e, uint64_t block_bytes);
void FinishDigests(Entry& e);

// Creates data file `file_name` in `storage`; *align: its WriteAt
// alignment, which must divide kAlignment (else kInternal).
absl::StatusOr<std::unique_ptr<WritableFile>> CreateDataFile(
    Storage& storage, const std::string& file_name, uint64_t* align);

// Writes the file (path `file_name` in `storage`), durably; fills each
// entry's CRC32C and block checksums, and each tensor entry's digest
// unless it has one. With SaveOptions::codec, through
// WriteCompressedDataFile.
absl::Status WriteDataFile(FileLayout& layout, SavePlanner& planner,
                           Storage& storage, const std::string& file_name,
                           const SaveOptions& options);

// WriteDataFile with SaveOptions::codec (save_compress.cc): the file is
// streamed, its header written last into room left for it, and each
// tensor entry of 4 KiB or more compressed frame by frame (frames of
// crc32c_block_bytes, on all cores, the next batch compressed while the
// last is written) unless its first 64 MiB come out larger than 0.95 of
// their raw size. Updates the layout to the stored entries: their
// offsets, `compression`, data_start and file_size.
absl::Status WriteCompressedDataFile(FileLayout& layout, SavePlanner& planner,
                                     Storage& storage,
                                     const std::string& file_name,
                                     const SaveOptions& options);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_SAVE_WRITE_H_
