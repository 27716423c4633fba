// RocksDbKvTable: a key-value table in a RocksDB database
// (include/cairn/rocksdb_kv_table.h). Rows live in the column family
// "rows" under 16-byte keys (bucket, id: big-endian), the spec in the
// default column family under "cairn.kv.spec".
#include "cairn/rocksdb_kv_table.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "cairn/tensor.h"
#include "core/status.h"
#include "kv/kv_rows.h"
#include "nlohmann/json.hpp"
#include "rocksdb/db.h"
#include "rocksdb/iterator.h"
#include "rocksdb/options.h"
#include "rocksdb/slice.h"
#include "rocksdb/snapshot.h"
#include "rocksdb/status.h"
#include "rocksdb/write_batch.h"

namespace cairn {
namespace {

constexpr char kRowsFamily[] = "rows";
constexpr char kSpecKey[] = "cairn.kv.spec";
constexpr int kSpecFormat = 1;
constexpr size_t kKeyBytes = 16;

void PutBigEndian(uint64_t v, char* out) {
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<char>(v & 0xff);
    v >>= 8;
  }
}

uint64_t GetBigEndian(const char* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<unsigned char>(in[i]);
  return v;
}

// A row's key: its bucket then its id, 8 bytes each, big-endian, so that
// bytewise order is (bucket, id) order (both are >= 0).
std::string RowKey(int64_t bucket, int64_t id) {
  std::string key(kKeyBytes, '\0');
  PutBigEndian(static_cast<uint64_t>(bucket), key.data());
  PutBigEndian(static_cast<uint64_t>(id), key.data() + 8);
  return key;
}

// The (bucket, id) of a row key; false for a key cairn did not write.
bool DecodeRowKey(const rocksdb::Slice& key, int64_t* bucket, int64_t* id) {
  if (key.size() != kKeyBytes) return false;
  const uint64_t b = GetBigEndian(key.data());
  const uint64_t i = GetBigEndian(key.data() + 8);
  if ((b >> 63) != 0 || (i >> 63) != 0) return false;
  *bucket = static_cast<int64_t>(b);
  *id = static_cast<int64_t>(i);
  return true;
}

std::string HexOf(const rocksdb::Slice& bytes) {
  return bytes.ToString(/*hex=*/true);
}

std::string_view BucketingName(KvBucketing b) {
  switch (b) {
    case KvBucketing::kChunked:
      return "chunked";
    case KvBucketing::kInterleaved:
      return "interleaved";
  }
  return "unknown";
}

std::string EncodeSpec(const KvTableSpec& spec) {
  nlohmann::ordered_json j;
  j["format"] = kSpecFormat;
  j["num_buckets"] = spec.num_buckets;
  j["bucketing"] = BucketingName(spec.bucketing);
  j["bucket_size"] = spec.bucket_size;
  nlohmann::ordered_json columns = nlohmann::ordered_json::array();
  for (const KvColumn& c : spec.columns) {
    nlohmann::ordered_json col;
    col["name"] = c.name;
    col["dtype"] = DTypeName(c.dtype);
    col["width"] = c.width;
    columns.push_back(std::move(col));
  }
  j["columns"] = std::move(columns);
  return j.dump();
}

// The spec stored by EncodeSpec; the reason it is not one otherwise.
absl::StatusOr<KvTableSpec> DecodeSpec(std::string_view text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  auto bad = [](const std::string& why) { return absl::DataLossError(why); };
  if (j.is_discarded() || !j.is_object()) return bad("the spec is not JSON");
  auto integer = [](const nlohmann::json& o, const char* key) {
    auto it = o.find(key);
    return it != o.end() && it->is_number_integer()
               ? std::optional<int64_t>(it->get<int64_t>())
               : std::nullopt;
  };
  auto text_of = [](const nlohmann::json& o, const char* key) {
    auto it = o.find(key);
    return it != o.end() && it->is_string()
               ? std::optional<std::string>(it->get<std::string>())
               : std::nullopt;
  };
  const std::optional<int64_t> format = integer(j, "format");
  if (format != kSpecFormat) {
    return bad(absl::StrFormat("the spec has format %s, not %d",
                               format ? absl::StrFormat("%d", *format)
                                      : std::string("(none)"),
                               kSpecFormat));
  }
  KvTableSpec spec;
  const std::optional<int64_t> buckets = integer(j, "num_buckets");
  const std::optional<int64_t> bucket_size = integer(j, "bucket_size");
  const std::optional<std::string> bucketing = text_of(j, "bucketing");
  if (!buckets || !bucket_size || !bucketing) {
    return bad("the spec lacks its buckets or bucketing");
  }
  spec.num_buckets = *buckets;
  spec.bucket_size = *bucket_size;
  if (*bucketing == "chunked") {
    spec.bucketing = KvBucketing::kChunked;
  } else if (*bucketing == "interleaved") {
    spec.bucketing = KvBucketing::kInterleaved;
  } else {
    return bad(absl::StrFormat("the spec has bucketing \"%s\"", *bucketing));
  }
  auto columns = j.find("columns");
  if (columns == j.end() || !columns->is_array()) {
    return bad("the spec lacks its columns");
  }
  for (const nlohmann::json& col : *columns) {
    if (!col.is_object()) return bad("a column of the spec is not an object");
    const std::optional<std::string> name = text_of(col, "name");
    const std::optional<std::string> dtype = text_of(col, "dtype");
    const std::optional<int64_t> width = integer(col, "width");
    if (!name || !dtype || !width) {
      return bad("a column of the spec lacks its name, dtype or width");
    }
    absl::StatusOr<DType> d = DTypeFromName(*dtype);
    if (!d.ok()) {
      return bad(absl::StrFormat("column \"%s\" of the spec has dtype \"%s\"",
                                 *name, *dtype));
    }
    spec.columns.push_back(KvColumn{*name, *d, *width});
  }
  return spec;
}

std::string DescribeColumn(const KvColumn& c) {
  return absl::StrFormat("\"%s\" %s x %d", c.name, DTypeName(c.dtype),
                         c.width);
}

// What differs between the stored spec and the one asked for, "" when
// nothing that matters does (a bucket size is ignored when interleaved).
std::string SpecDifference(const KvTableSpec& stored,
                           const KvTableSpec& asked) {
  if (stored.num_buckets != asked.num_buckets) {
    return absl::StrFormat("it has %d buckets, not %d", stored.num_buckets,
                           asked.num_buckets);
  }
  if (stored.bucketing != asked.bucketing) {
    return absl::StrFormat("it has %s bucketing, not %s",
                           BucketingName(stored.bucketing),
                           BucketingName(asked.bucketing));
  }
  if (stored.bucketing == KvBucketing::kChunked &&
      stored.bucket_size != asked.bucket_size) {
    return absl::StrFormat("it has buckets of %d ids, not %d",
                           stored.bucket_size, asked.bucket_size);
  }
  if (stored.columns.size() != asked.columns.size()) {
    return absl::StrFormat(
        "it has %d columns (%s), not %d (%s)", stored.columns.size(),
        absl::StrJoin(stored.columns, ", ",
                      [](std::string* out, const KvColumn& c) {
                        out->append(DescribeColumn(c));
                      }),
        asked.columns.size(),
        absl::StrJoin(asked.columns, ", ",
                      [](std::string* out, const KvColumn& c) {
                        out->append(DescribeColumn(c));
                      }));
  }
  for (size_t c = 0; c < stored.columns.size(); ++c) {
    if (stored.columns[c] != asked.columns[c]) {
      return absl::StrFormat("its column %d is %s, not %s", c,
                             DescribeColumn(stored.columns[c]),
                             DescribeColumn(asked.columns[c]));
    }
  }
  return "";
}

}  // namespace

struct RocksDbKvTable::Impl {
  std::string path;
  std::string name;
  KvTableSpec spec;
  KvBucketRange owned;
  RocksDbKvOptions options;
  size_t row_bytes = 0;
  std::unique_ptr<rocksdb::DB> db;
  // Every handle Open returned (closed before the database), and the two
  // families among them.
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::ColumnFamilyHandle* meta = nullptr;  // the default family
  rocksdb::ColumnFamilyHandle* rows = nullptr;

  ~Impl() {
    if (db == nullptr) return;
    for (rocksdb::ColumnFamilyHandle* h : handles) {
      db->DestroyColumnFamilyHandle(h).PermitUncheckedError();
    }
    db->Close().PermitUncheckedError();
  }

  // RocksDB's `s` as a Status naming the table, what it was `doing` and the
  // path. Corruption is data loss, a lock held elsewhere unavailable.
  absl::Status Error(const rocksdb::Status& s, std::string_view doing) const {
    const std::string message =
        absl::StrFormat("key-value table %s: %s the RocksDB database at %s: %s",
                        name, doing, path, s.ToString());
    if (s.IsCorruption()) return absl::DataLossError(message);
    if (s.IsNotFound() || s.IsPathNotFound()) {
      return absl::NotFoundError(message);
    }
    if (s.IsNoSpace() || s.IsMemoryLimit()) {
      return absl::ResourceExhaustedError(message);
    }
    if (s.IsInvalidArgument()) return absl::InvalidArgumentError(message);
    if (s.IsNotSupported()) return absl::UnimplementedError(message);
    if (s.IsAborted()) return absl::AbortedError(message);
    if (s.IsBusy() || s.IsTimedOut() || s.IsTryAgain() ||
        s.IsShutdownInProgress() ||
        // The LOCK file: another open table or process has the database.
        (s.IsIOError() && absl::StrContains(s.ToString(), "lock"))) {
      return absl::UnavailableError(message);
    }
    return absl::InternalError(message);
  }

  absl::Status BadRow(const rocksdb::Slice& key, std::string_view why) const {
    return absl::DataLossError(absl::StrFormat(
        "key-value table %s: the RocksDB database at %s holds a bad row "
        "(key %s): %s",
        name, path, HexOf(key), why));
  }

  // The (bucket, id) of the row under `key`, checked: a key cairn wrote,
  // an id of that bucket, an owned bucket. kDataLoss otherwise.
  absl::Status CheckKey(const rocksdb::Slice& key, int64_t* bucket,
                        int64_t* id) const {
    if (!DecodeRowKey(key, bucket, id)) return BadRow(key, "not a row key");
    absl::StatusOr<int64_t> want = KvBucketOf(spec, *id);
    if (!want.ok() || *want != *bucket) {
      return BadRow(key, absl::StrFormat("id %d is not of bucket %d", *id,
                                         *bucket));
    }
    if (!owned.contains(*bucket)) {
      return BadRow(key, absl::StrFormat(
                             "bucket %d is not in this table's buckets [%d, %d)",
                             *bucket, owned.begin, owned.end));
    }
    return absl::OkStatus();
  }

  absl::Status CheckValue(const rocksdb::Slice& key,
                          const rocksdb::Slice& value) const {
    if (value.size() != row_bytes) {
      return BadRow(key, absl::StrFormat("%d bytes, not the %d of a row",
                                         value.size(), row_bytes));
    }
    return absl::OkStatus();
  }

  // Calls fn(bucket, id) for every row, in key order, reading the latest
  // state without filling the block cache.
  template <typename Fn>
  absl::Status ForEachKey(Fn fn) const {
    rocksdb::ReadOptions ro;
    ro.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(ro, rows));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      int64_t bucket = 0, id = 0;
      CAIRN_RETURN_IF_ERROR(CheckKey(it->key(), &bucket, &id));
      fn(bucket, id);
    }
    if (!it->status().ok()) return Error(it->status(), "iterating");
    return absl::OkStatus();
  }

  absl::Status Open(bool exists);
  absl::Status CheckSpec();
  absl::Status CheckOwned() const;
};

// Opens the database with its families: those it has when it `exists` (it
// must have no others), else the two a table has.
absl::Status RocksDbKvTable::Impl::Open(bool exists) {
  rocksdb::DBOptions db_options;
  db_options.create_if_missing = !exists;
  db_options.create_missing_column_families = true;
  std::vector<std::string> families = {rocksdb::kDefaultColumnFamilyName,
                                       kRowsFamily};
  if (exists) {
    std::vector<std::string> present;
    rocksdb::Status s =
        rocksdb::DB::ListColumnFamilies(db_options, path, &present);
    if (!s.ok()) return Error(s, "opening");
    for (const std::string& f : present) {
      if (f != rocksdb::kDefaultColumnFamilyName && f != kRowsFamily) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "key-value table %s: the RocksDB database at %s is not a cairn "
            "key-value table: it has a column family \"%s\"",
            name, path, f));
      }
    }
  }
  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  for (const std::string& f : families) {
    descriptors.emplace_back(f, rocksdb::ColumnFamilyOptions());
  }
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s =
      rocksdb::DB::Open(db_options, path, descriptors, &handles, &raw);
  if (!s.ok()) return Error(s, "opening");
  db.reset(raw);
  meta = handles[0];
  rows = handles[1];
  return absl::OkStatus();
}

// Checks the stored spec against ours, or stores ours in a database that
// holds nothing yet.
absl::Status RocksDbKvTable::Impl::CheckSpec() {
  std::string stored;
  rocksdb::Status s = db->Get(rocksdb::ReadOptions(), meta, kSpecKey, &stored);
  if (s.ok()) {
    absl::StatusOr<KvTableSpec> theirs = DecodeSpec(stored);
    absl::Status valid = theirs.ok() ? ValidateKvTableSpec(name, *theirs)
                                     : theirs.status();
    if (!valid.ok()) {
      return absl::DataLossError(absl::StrFormat(
          "key-value table %s: the RocksDB database at %s holds a bad spec: "
          "%s",
          name, path, valid.message()));
    }
    const std::string diff = SpecDifference(*theirs, spec);
    if (!diff.empty()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "key-value table %s: the RocksDB database at %s was made with "
          "another spec: %s",
          name, path, diff));
    }
    return absl::OkStatus();
  }
  if (!s.IsNotFound()) return Error(s, "reading the spec from");
  // No spec: a new database, or one that is not a table's.
  for (rocksdb::ColumnFamilyHandle* h : {meta, rows}) {
    std::unique_ptr<rocksdb::Iterator> it(
        db->NewIterator(rocksdb::ReadOptions(), h));
    it->SeekToFirst();
    if (!it->status().ok()) return Error(it->status(), "reading");
    if (it->Valid()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "key-value table %s: the RocksDB database at %s is not a cairn "
          "key-value table: it holds keys but no table spec",
          name, path));
    }
  }
  rocksdb::WriteOptions wo;
  wo.sync = true;
  s = db->Put(wo, meta, kSpecKey, EncodeSpec(spec));
  if (!s.ok()) return Error(s, "writing the spec to");
  return absl::OkStatus();
}

// The rows held are of owned buckets: the first and the last key (in
// bucket order) tell.
absl::Status RocksDbKvTable::Impl::CheckOwned() const {
  std::unique_ptr<rocksdb::Iterator> it(
      db->NewIterator(rocksdb::ReadOptions(), rows));
  for (bool first : {true, false}) {
    if (first) {
      it->SeekToFirst();
    } else {
      it->SeekToLast();
    }
    if (!it->status().ok()) return Error(it->status(), "reading");
    if (!it->Valid()) return absl::OkStatus();
    int64_t bucket = 0, id = 0;
    if (!DecodeRowKey(it->key(), &bucket, &id)) {
      return BadRow(it->key(), "not a row key");
    }
    if (!owned.contains(bucket)) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "key-value table %s: the RocksDB database at %s holds rows of "
          "bucket %d, outside the buckets [%d, %d) it is opened with",
          name, path, bucket, owned.begin, owned.end));
    }
  }
  return absl::OkStatus();
}

// The rows of a snapshot in key order, a batch at a time.
class RocksDbKvTable::RocksDbSource : public KvSource {
 public:
  RocksDbSource(const Impl& table, int64_t batch_rows)
      : table_(table), batch_rows_(std::max<int64_t>(batch_rows, 1)) {}
  ~RocksDbSource() override { Release(); }

  absl::Status Begin() override {
    Release();
    snapshot_ = table_.db->GetSnapshot();
    rocksdb::ReadOptions ro;
    ro.snapshot = snapshot_;
    ro.fill_cache = false;  // one pass over every row
    it_.reset(table_.db->NewIterator(ro, table_.rows));
    it_->SeekToFirst();
    if (!it_->status().ok()) {
      absl::Status error = table_.Error(it_->status(), "iterating");
      Release();
      return error;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Next(KvBatch& batch) override {
    if (it_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "key-value table %s: Next() before Begin()", table_.name));
    }
    // The rows are copied out of the iterator, then into columns sized
    // for them.
    ids_.clear();
    rows_.clear();
    for (; it_->Valid() && static_cast<int64_t>(ids_.size()) < batch_rows_;
         it_->Next()) {
      int64_t bucket = 0, id = 0;
      CAIRN_RETURN_IF_ERROR(table_.CheckKey(it_->key(), &bucket, &id));
      CAIRN_RETURN_IF_ERROR(table_.CheckValue(it_->key(), it_->value()));
      ids_.push_back(id);
      rows_.append(it_->value().data(), it_->value().size());
    }
    if (!it_->status().ok()) return table_.Error(it_->status(), "iterating");
    if (ids_.empty()) return false;
    const int64_t n = static_cast<int64_t>(ids_.size());
    CAIRN_ASSIGN_OR_RETURN(batch.columns,
                           internal_kv::NewKvBatchColumns(table_.spec, n));
    batch.ids = ids_;
    const std::byte* row = reinterpret_cast<const std::byte*>(rows_.data());
    for (int64_t i = 0; i < n; ++i) {
      internal_kv::UnpackKvRow(table_.spec, row, i, batch.columns);
      row += table_.row_bytes;
    }
    return true;
  }

  absl::StatusOr<size_t> NextInto(const KvRowsRoom& room) override {
    if (it_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "key-value table %s: NextInto() before Begin()", table_.name));
    }
    size_t n = 0;
    for (; it_->Valid() && n < room.capacity; it_->Next(), ++n) {
      int64_t bucket = 0;
      CAIRN_RETURN_IF_ERROR(table_.CheckKey(it_->key(), &bucket, &room.ids[n]));
      CAIRN_RETURN_IF_ERROR(table_.CheckValue(it_->key(), it_->value()));
      internal_kv::UnpackKvRow(
          table_.spec, reinterpret_cast<const std::byte*>(it_->value().data()),
          n, room);
    }
    if (!it_->status().ok()) return table_.Error(it_->status(), "iterating");
    return n;
  }

  absl::Status End() override {
    Release();
    return absl::OkStatus();
  }

 private:
  // The iterator first: it reads from the snapshot.
  void Release() {
    it_.reset();
    if (snapshot_ != nullptr) table_.db->ReleaseSnapshot(snapshot_);
    snapshot_ = nullptr;
  }

  const Impl& table_;
  const int64_t batch_rows_;
  const rocksdb::Snapshot* snapshot_ = nullptr;
  std::unique_ptr<rocksdb::Iterator> it_;
  std::vector<int64_t> ids_;
  std::string rows_;
};

RocksDbKvTable::RocksDbKvTable(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

RocksDbKvTable::~RocksDbKvTable() = default;

absl::StatusOr<std::unique_ptr<RocksDbKvTable>> RocksDbKvTable::Open(
    std::string path, std::string name, KvTableSpec spec, KvBucketRange owned,
    RocksDbKvOptions options) {
  CAIRN_RETURN_IF_ERROR(ValidateKvTableSpec(name, spec));
  CAIRN_RETURN_IF_ERROR(internal_kv::CheckKvOwnedBuckets(name, spec, owned));
  auto impl = std::make_unique<Impl>();
  impl->path = std::move(path);
  impl->name = std::move(name);
  impl->spec = std::move(spec);
  impl->owned = owned;
  impl->options = options;
  impl->row_bytes = static_cast<size_t>(impl->spec.row_bytes());
  if (impl->path.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "key-value table %s: an empty path for its RocksDB database",
        impl->name));
  }
  // RocksDB's CURRENT file names the live manifest: a database has one.
  std::error_code ec;
  const bool exists =
      std::filesystem::exists(std::filesystem::path(impl->path) / "CURRENT", ec);
  if (!exists) {
    if (!options.create_if_missing) {
      return absl::NotFoundError(absl::StrFormat(
          "key-value table %s: no RocksDB database at %s (and "
          "create_if_missing is off)",
          impl->name, impl->path));
    }
    std::filesystem::create_directories(impl->path, ec);
    if (ec) {
      return internal_core::Annotate(
          internal_core::StatusFromErrno(ec.value(), "create directory",
                                         impl->path),
          absl::StrFormat("key-value table %s: cannot create its RocksDB "
                          "database",
                          impl->name));
    }
  }
  CAIRN_RETURN_IF_ERROR(impl->Open(exists));
  CAIRN_RETURN_IF_ERROR(impl->CheckSpec());
  CAIRN_RETURN_IF_ERROR(impl->CheckOwned());
  return std::unique_ptr<RocksDbKvTable>(new RocksDbKvTable(std::move(impl)));
}

absl::Status RocksDbKvTable::Apply(std::span<const int64_t> ids,
                                   std::span<const TensorView> columns) {
  const Impl& t = *impl_;
  // The whole batch first, so a bad batch changes nothing; then one write.
  CAIRN_RETURN_IF_ERROR(
      internal_kv::CheckKvBatch(t.name, t.spec, t.owned, ids, columns));
  if (ids.empty()) return absl::OkStatus();
  rocksdb::WriteBatch batch;
  std::string row(t.row_bytes, '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t bucket = *KvBucketOf(t.spec, ids[i]);
    internal_kv::PackKvRow(t.spec, columns, static_cast<int64_t>(i),
                           reinterpret_cast<std::byte*>(row.data()));
    rocksdb::Status s = batch.Put(t.rows, RowKey(bucket, ids[i]), row);
    if (!s.ok()) {
      return t.Error(s, absl::StrFormat("batching %d rows for", ids.size()));
    }
  }
  rocksdb::WriteOptions wo;
  wo.disableWAL = t.options.disable_wal;
  wo.sync = t.options.sync_writes && !t.options.disable_wal;
  rocksdb::Status s = t.db->Write(wo, &batch);
  if (!s.ok()) {
    return t.Error(s, absl::StrFormat("writing %d rows to", ids.size()));
  }
  return absl::OkStatus();
}

const std::string& RocksDbKvTable::name() const { return impl_->name; }
const KvTableSpec& RocksDbKvTable::spec() const { return impl_->spec; }
KvBucketRange RocksDbKvTable::owned() const { return impl_->owned; }
const std::string& RocksDbKvTable::path() const { return impl_->path; }

absl::StatusOr<uint64_t> RocksDbKvTable::size() const {
  uint64_t n = 0;
  CAIRN_RETURN_IF_ERROR(impl_->ForEachKey([&](int64_t, int64_t) { ++n; }));
  return n;
}

absl::StatusOr<std::vector<uint64_t>> RocksDbKvTable::RowsPerBucket() const {
  const KvBucketRange owned = impl_->owned;
  std::vector<uint64_t> counts(static_cast<size_t>(owned.size()), 0);
  CAIRN_RETURN_IF_ERROR(impl_->ForEachKey([&](int64_t bucket, int64_t) {
    ++counts[static_cast<size_t>(bucket - owned.begin)];
  }));
  return counts;
}

absl::StatusOr<std::optional<std::string>> RocksDbKvTable::Find(
    int64_t id) const {
  const Impl& t = *impl_;
  absl::StatusOr<int64_t> bucket = KvBucketOf(t.spec, id);
  if (!bucket.ok()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "key-value table %s: %s", t.name, bucket.status().message()));
  }
  if (!t.owned.contains(*bucket)) return std::nullopt;
  const std::string key = RowKey(*bucket, id);
  std::string value;
  rocksdb::Status s = t.db->Get(rocksdb::ReadOptions(), t.rows, key, &value);
  if (s.IsNotFound()) return std::nullopt;
  if (!s.ok()) return t.Error(s, absl::StrFormat("reading id %d from", id));
  CAIRN_RETURN_IF_ERROR(t.CheckValue(key, value));
  return value;
}

absl::Status RocksDbKvTable::ForEachId(
    absl::FunctionRef<void(int64_t)> fn) const {
  return impl_->ForEachKey([&](int64_t, int64_t id) { fn(id); });
}

absl::Status RocksDbKvTable::Flush() {
  rocksdb::FlushOptions fo;
  fo.wait = true;
  rocksdb::Status s = impl_->db->Flush(fo, {impl_->meta, impl_->rows});
  if (!s.ok()) return impl_->Error(s, "flushing");
  return absl::OkStatus();
}

std::unique_ptr<KvSource> RocksDbKvTable::Source(int64_t batch_rows) const {
  return std::make_unique<RocksDbSource>(*impl_, batch_rows);
}

}  // namespace cairn
