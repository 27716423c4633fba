// Key-value embedding tables: the model, and saving and loading them.
//
// Recommendation models keep their largest embedding tables in key-value
// stores: only the ids ever seen have a row. cairn saves such a table by
// global id and reshards it by bucket:
//
//   - a table has int64 global ids, a row layout (columns: the weight,
//     optimizer state, per-row metadata, each of a dtype and a width), and
//     a bucketing fixed at creation: B buckets, id -> bucket by
//     id / bucket_size (kChunked) or id % B (kInterleaved);
//   - each rank owns a contiguous range of buckets (KvBucketsOfRank: the
//     uneven split, the first B % W ranks one bucket more);
//   - a backend exposes its rows through a KvSource (save: batches in
//     (bucket, id) order, from a snapshot) and takes rows through a KvSink
//     (load: batches in any order).
//
// This header is the model, the bucketing arithmetic, the source and sink
// interfaces, an in-memory table that is both, and what cairn::Save and
// cairn::Load take to save and load tables (SaveOptions::kv_tables,
// LoadOptions::kv_tables, include/cairn/checkpoint.h). The backends:
// InMemoryKvTable (here) and RocksDbKvTable (cairn/rocksdb_kv_table.h, a
// RocksDB database on local disk).
//
//   cairn::SaveOptions so;
//   so.kv_tables.push_back({"emb.user", spec, std::nullopt, source.get()});
//   cairn::Save(state, url, so);           // every rank, its own buckets
//   ...
//   cairn::LoadOptions lo;
//   lo.kv_tables.push_back({.fqn = "emb.user", .sink = &table});
//   cairn::Load(state, url, lo);           // any world size
#ifndef CAIRN_KV_TABLE_H_
#define CAIRN_KV_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/dtype.h"
#include "cairn/tensor.h"

namespace cairn {

// How ids map to buckets.
enum class KvBucketing : uint8_t {
  kChunked,      // bucket = id / bucket_size (ids [0, B * bucket_size))
  kInterleaved,  // bucket = id % B (any id >= 0)
};

// One column of a row: the weight (width D), an optimizer state (width D
// or 1), per-row metadata (a timestamp, a count).
struct KvColumn {
  std::string name;
  DType dtype = DType::kF32;
  int64_t width = 1;  // elements per row
  friend bool operator==(const KvColumn&, const KvColumn&) = default;
};

struct KvTableSpec {
  int64_t num_buckets = 0;  // B, fixed when the table is created
  KvBucketing bucketing = KvBucketing::kChunked;
  int64_t bucket_size = 0;  // kChunked: ids per bucket; ignored otherwise
  std::vector<KvColumn> columns;

  // Bytes of one row, every column.
  int64_t row_bytes() const;
  friend bool operator==(const KvTableSpec&, const KvTableSpec&) = default;
};

// OK when `spec` describes a table: at least one bucket; kChunked with a
// positive bucket size (and B x bucket_size within int64); at least one
// column, each named (not "ids"), unique, of positive width.
// kInvalidArgument naming `table` and what is wrong otherwise.
absl::Status ValidateKvTableSpec(std::string_view table,
                                 const KvTableSpec& spec);

// The bucket of `id`. kInvalidArgument naming the id for a negative id, or
// (kChunked) one at or past B x bucket_size. `spec` must be valid.
absl::StatusOr<int64_t> KvBucketOf(const KvTableSpec& spec, int64_t id);

// Buckets [begin, end).
struct KvBucketRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool contains(int64_t bucket) const {
    return bucket >= begin && bucket < end;
  }
  friend bool operator==(const KvBucketRange&, const KvBucketRange&) = default;
};

// The buckets rank `rank` of `world` owns by default: B split into `world`
// contiguous ranges in rank order, the first B % world of them one bucket
// larger. Empty for every rank past B when world > B. Requires
// num_buckets >= 0, world >= 1 and 0 <= rank < world.
KvBucketRange KvBucketsOfRank(int64_t num_buckets, int world, int rank);

// Rows [begin, end) of a table whose rows are stored in bucket order.
struct KvRowRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
  friend bool operator==(const KvRowRange&, const KvRowRange&) = default;
};

// The rows of buckets `range`, given every bucket's row count in bucket
// order (rows_per_bucket.size() == B). kInvalidArgument when `range` is
// not inside [0, B) or the counts overflow.
absl::StatusOr<KvRowRange> KvRowsOfBuckets(
    std::span<const uint64_t> rows_per_bucket, KvBucketRange range);

// A batch of rows: ids, and per column a [ids.size(), width] tensor of its
// dtype, row i of each belonging to ids[i].
struct KvBatch {
  std::vector<int64_t> ids;
  std::vector<Tensor> columns;
};

// Where KvSource::NextInto writes rows: room for `capacity` rows (at
// least 1), row i's id at ids[i] and its bytes of column c (the spec's
// order) at columns[c] + i x width_c x the dtype's size.
struct KvRowsRoom {
  size_t capacity = 0;
  int64_t* ids = nullptr;
  std::vector<std::byte*> columns;
};

// Save side: a backend's rows, as a pull iterator. Begin() pins a
// consistent view (a snapshot); Next() fills `batch` with the next rows in
// (bucket, id) order and returns false once there are none; End() releases
// the view. Called from one thread.
class KvSource {
 public:
  virtual ~KvSource() = default;
  virtual absl::Status Begin() { return absl::OkStatus(); }
  virtual absl::StatusOr<bool> Next(KvBatch& batch) = 0;
  // Optional, and a copy cheaper: writes the next rows (the ones Next
  // would give, at most room.capacity) straight into the save's chunk and
  // returns how many, 0 once there are none. A save asks for it first; a
  // source that does not override it (kUnimplemented) is pulled with
  // Next, whose batch the save copies.
  virtual absl::StatusOr<size_t> NextInto(const KvRowsRoom& room) {
    return absl::UnimplementedError("KvSource::NextInto");
  }
  virtual absl::Status End() { return absl::OkStatus(); }
};

// Load side: takes rows in batches, in any order. columns[c] is a
// [ids.size(), width_c] view of column c's dtype (host memory), valid only
// during the call.
class KvSink {
 public:
  virtual ~KvSink() = default;
  virtual absl::Status Apply(std::span<const int64_t> ids,
                             std::span<const TensorView> columns) = 0;
};

// A table in host memory, a hash map from id to row: the backend of the
// tests and the demo. It holds the rows of the buckets it owns; Apply
// inserts or overwrites them, and refuses (naming the table, the id, its
// bucket and the owned range) an id of another bucket, and batches whose
// columns do not match the spec. Not thread-safe.
class InMemoryKvTable : public KvSink {
 public:
  // kInvalidArgument for an invalid spec, or `owned` outside [0, B).
  static absl::StatusOr<std::unique_ptr<InMemoryKvTable>> Create(
      std::string name, KvTableSpec spec, KvBucketRange owned);

  absl::Status Apply(std::span<const int64_t> ids,
                     std::span<const TensorView> columns) override;

  const std::string& name() const { return name_; }
  const KvTableSpec& spec() const { return spec_; }
  KvBucketRange owned() const { return owned_; }
  size_t size() const { return index_.size(); }

  // Row counts of the owned buckets, in bucket order.
  std::vector<uint64_t> RowsPerBucket() const;

  // Row `id`'s bytes, every column's elements one after another (row_bytes
  // long); null when the table has no such id. Valid until the next Apply.
  const std::byte* Find(int64_t id) const;

  // Calls fn(id) for every id held, in no particular order.
  void ForEachId(absl::FunctionRef<void(int64_t)> fn) const;

  // A source of the rows in (bucket, id) order, at most `batch_rows` a
  // batch (>= 1). Its Begin() takes the snapshot (the ids then present);
  // the table must outlive it and must not change between its Begin() and
  // End().
  std::unique_ptr<KvSource> Source(int64_t batch_rows) const;

 private:
  InMemoryKvTable(std::string name, KvTableSpec spec, KvBucketRange owned);

  std::string name_;
  KvTableSpec spec_;
  KvBucketRange owned_;
  int64_t row_bytes_ = 0;
  absl::flat_hash_map<int64_t, size_t> index_;  // id -> row slot
  std::vector<std::byte> rows_;                 // row slots, row_bytes_ each
};

// A table to save (SaveOptions::kv_tables). Every rank lists every table,
// with the same spec; the ranks' bucket ranges together tile [0, B), each
// bucket saved by exactly one rank (checked before anything is written).
// The rows are stored in (bucket, id) order, in chunks of at most
// SaveOptions::kv_chunk_bytes, each chunk's ids beside its columns in one
// data file (docs/format.md 4.7).
struct KvTableToSave {
  std::string fqn;
  KvTableSpec spec;
  // This rank's buckets; nullopt: KvBucketsOfRank(B, world, rank).
  std::optional<KvBucketRange> buckets = std::nullopt;
  // The rows of those buckets: each batch checked as it is pulled (columns
  // of the spec's dtypes and widths, every id in one of the rank's buckets,
  // (bucket, id) strictly rising). May be null when the rank has no
  // buckets. Not owned.
  KvSource* source = nullptr;
};

// A table to load (LoadOptions::kv_tables) into `sink`, the rows of this
// rank's buckets in the destination's bucketing. With the saved bucketing
// (num_buckets 0, or the same B, mode and bucket size), a rank reads only
// the rows of its buckets. With another bucketing, every stored chunk is
// read once, by one rank, and each row is sent to the rank that owns it:
// slower, as every row crosses the communicator.
struct KvTableToLoad {
  std::string fqn;
  KvSink* sink = nullptr;  // not owned
  // The destination's bucketing; num_buckets 0: the saved table's.
  int64_t num_buckets = 0;
  KvBucketing bucketing = KvBucketing::kChunked;
  int64_t bucket_size = 0;  // kChunked only
  // This rank's buckets in it; nullopt: KvBucketsOfRank(B, world, rank).
  std::optional<KvBucketRange> buckets = std::nullopt;
  // The columns to load, in this order (e.g. {"weight"}: the weights
  // without optimizer state); empty: every column, as saved.
  std::vector<std::string> columns = {};
};

}  // namespace cairn

#endif  // CAIRN_KV_TABLE_H_
