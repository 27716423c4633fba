// A key-value embedding table in a RocksDB database on local disk (issue
// 36, in progress): the persistent backend next to InMemoryKvTable
// (include/cairn/kv_table.h), with the same checks and messages.
//
// The database holds one table: its rows in the column family "rows", a
// key per row, and its spec in the default column family (key
// "cairn.kv.spec", JSON), written when the database is created and checked
// on every later open. A row's key is its bucket then its id, each 8 bytes
// big-endian, so that RocksDB's bytewise order is (bucket, id) order; its
// value is the row's bytes, every column's elements one after another
// (KvTableSpec::row_bytes() long), as InMemoryKvTable keeps them.
//
// This header does not include RocksDB's: the database lives behind a
// pointer to an implementation (src/kv/rocksdb_kv_table.cc). RocksDB's
// errors come back as absl::Status naming the table, the path and what
// RocksDB said: corruption as kDataLoss, a database held by another open
// table or process as kUnavailable, other I/O errors as kInternal.
//
// Thread safety: not thread-safe, like InMemoryKvTable: one thread uses a
// table and its sources at a time.
#ifndef CAIRN_ROCKSDB_KV_TABLE_H_
#define CAIRN_ROCKSDB_KV_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"

namespace cairn {

struct RocksDbKvOptions {
  // Create the database (and the directories above it) when `path` holds
  // none. When false, a missing database is an error.
  bool create_if_missing = true;
  // Sync the write-ahead log on every Apply (RocksDB's WriteOptions::sync):
  // an applied batch survives a machine crash, at the cost of an fsync per
  // batch. When false, applied rows survive a crash of the process but may
  // be lost with the machine until Flush().
  bool sync_writes = false;
  // Write no write-ahead log: faster bulk loads, but rows applied since the
  // last Flush() are lost if the process dies before the table is closed.
  // Takes precedence over sync_writes.
  bool disable_wal = false;
};

class RocksDbKvTable : public KvSink {
 public:
  // Opens the database at `path`, or creates it (options.create_if_missing)
  // recording `spec`. kInvalidArgument for an invalid spec or `owned`
  // outside [0, B), as InMemoryKvTable::Create. kFailedPrecondition naming
  // the path when an existing database was made with another spec (saying
  // what differs), holds rows of buckets outside `owned`, or is not a
  // cairn table. kUnavailable when another open table or process holds the
  // database; other RocksDB errors as described above.
  static absl::StatusOr<std::unique_ptr<RocksDbKvTable>> Open(
      std::string path, std::string name, KvTableSpec spec,
      KvBucketRange owned, RocksDbKvOptions options = {});

  // Closes the database (memtables not yet flushed are flushed or kept in
  // the write-ahead log). Every source of the table must be gone first.
  ~RocksDbKvTable() override;
  RocksDbKvTable(const RocksDbKvTable&) = delete;
  RocksDbKvTable& operator=(const RocksDbKvTable&) = delete;

  // Inserts or overwrites the rows, as InMemoryKvTable::Apply: the same
  // checks and messages, and a refused batch changes nothing. A checked
  // batch is one atomic RocksDB write.
  absl::Status Apply(std::span<const int64_t> ids,
                     std::span<const TensorView> columns) override;

  const std::string& name() const;
  const KvTableSpec& spec() const;
  KvBucketRange owned() const;
  const std::string& path() const;

  // The number of rows. Counts them: reads every key of the database
  // (time linear in the rows; no block cache pollution).
  absl::StatusOr<uint64_t> size() const;

  // Row counts of the owned buckets, in bucket order. Reads every key,
  // like size().
  absl::StatusOr<std::vector<uint64_t>> RowsPerBucket() const;

  // Row `id`'s bytes, every column's elements one after another (row_bytes
  // long); nullopt when the table has no such id (an id of another bucket
  // included). kInvalidArgument for a negative id or one past a chunked
  // table's ids.
  absl::StatusOr<std::optional<std::string>> Find(int64_t id) const;

  // Calls fn(id) for every id held, in (bucket, id) order.
  absl::Status ForEachId(absl::FunctionRef<void(int64_t)> fn) const;

  // Makes every applied row durable: flushes RocksDB's memtables to its
  // table files and waits for them (with disable_wal, the only way short of
  // closing the table).
  absl::Status Flush();

  // A source of the rows in (bucket, id) order, at most `batch_rows` a
  // batch (values below 1 count as 1). Its Begin() takes a RocksDB
  // snapshot: rows applied afterwards are not seen by it. End(), or
  // destroying the source, releases the snapshot. The table must outlive
  // the source.
  std::unique_ptr<KvSource> Source(int64_t batch_rows) const;

 private:
  struct Impl;
  class RocksDbSource;
  explicit RocksDbKvTable(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
};

}  // namespace cairn

#endif  // CAIRN_ROCKSDB_KV_TABLE_H_
