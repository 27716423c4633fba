// Reading key-value table rows back (kv_load.h): a table's stored rows cut
// into pieces of bounded size, and a reader that returns a piece's ids and
// columns checked (each file's header against the metadata, the checksum
// blocks around each piece, and every id against the bucket its row is
// stored in).
#ifndef CAIRN_CHECKPOINT_KV_READ_H_
#define CAIRN_CHECKPOINT_KV_READ_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/metadata.h"
#include "cairn/storage.h"
#include "checkpoint/kv_save.h"
#include "core/aligned_buffer.h"
#include "format/safetensors.h"

namespace cairn::internal_checkpoint {

// Rows [begin, end) of chunk `chunk` (rows counted from the first held
// bucket, as in KvChunkMetadata).
struct KvPiece {
  size_t chunk = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t rows() const { return end - begin; }
};

// The pieces of rows `rows` in chunks [first, last), each at most
// `piece_bytes` of ids and the columns read (`row_bytes` a row), at least
// one row.
std::vector<KvPiece> KvPiecesOf(const KvTableMetadata& md, size_t first,
                                size_t last, KvRowRange rows,
                                uint64_t row_bytes, uint64_t piece_bytes);

// A piece's bytes: its ids and each column read (in the reader's order),
// rows() rows each, in one buffer it owns (give it back to the reader with
// Recycle once done, so that the next piece reuses its pages).
struct KvPieceBytes {
  KvPiece piece;
  const int64_t* ids = nullptr;
  std::vector<const std::byte*> columns;
  uint64_t bytes_read = 0;  // from storage, checksum blocks' edges included
  internal_core::UniqueAligned buffer;
  size_t capacity = 0;  // of buffer
};

class KvPieceReader {
 public:
  // Reads `columns` (indices into the stored columns) of table `fqn`;
  // `verify`: check each piece's checksum blocks (or whole entries when
  // they have none). The metadata must outlive the reader.
  KvPieceReader(Storage& storage, std::string fqn, const KvTableMetadata& md,
                uint64_t block_bytes, std::vector<int> columns, bool verify);

  // The piece's bytes, checked. kDataLoss naming the table, chunk, file and
  // offset for a header that disagrees with the metadata, a checksum that
  // does not match, or an id outside the bucket its row is stored in (or
  // out of order). Safe to call from one thread while another uses an
  // earlier result.
  absl::StatusOr<KvPieceBytes> Read(const KvPiece& piece);

  // Keeps `piece`'s buffer for a later Read. Thread-safe.
  void Recycle(KvPieceBytes&& piece);

  // The absolute bucket of held row `row`.
  int64_t BucketOfRow(uint64_t row) const;

 private:
  struct File {
    std::unique_ptr<ReadableFile> file;
    internal_format::SafetensorsHeader header;
  };
  absl::StatusOr<const File*> Open(const std::string& name);
  absl::Status CheckEntries(size_t chunk);
  // The bytes of an entry a piece's rows [begin, end) of it need read:
  // with checks, the checksum blocks around them (the whole entry when it
  // has none).
  struct Span {
    uint64_t from = 0;
    uint64_t to = 0;
  };
  Span ToRead(const ByteLocation& loc, uint64_t begin, uint64_t end) const;
  absl::StatusOr<const std::byte*> ReadEntry(const ByteLocation& loc,
                                             uint64_t begin, uint64_t end,
                                             std::string_view what,
                                             size_t chunk, std::byte* into,
                                             KvPieceBytes& out);
  absl::Status CheckIds(const KvPieceBytes& piece) const;

  Storage& storage_;
  std::string fqn_;
  const KvTableMetadata& md_;
  uint64_t block_bytes_;
  std::vector<int> columns_;
  bool verify_;
  std::vector<uint64_t> first_row_;  // of each held bucket, and the total
  std::mutex mu_;                    // guards files_ and checked_
  std::map<std::string, File> files_;
  std::vector<bool> checked_;        // chunks whose entries were checked
  std::vector<KvChunkStart> starts_;  // of every chunk, once needed
  // Buffers of pieces done with, and their capacities (guarded by mu_).
  std::vector<std::pair<internal_core::UniqueAligned, size_t>> free_;
};

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_KV_READ_H_
