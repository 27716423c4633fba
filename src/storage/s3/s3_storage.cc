#include "storage/s3/s3_storage.h"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/status.h"
#include "format/names.h"

namespace cairn::internal_s3 {
namespace {

constexpr uint64_t kMinPartBytes = 8ull << 20;
constexpr uint64_t kMaxParts = 10000;

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

// A fixed set of threads running queued requests; started on first use.
class RequestPool {
 public:
  explicit RequestPool(int threads) : threads_(std::max(1, threads)) {}
  ~RequestPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  int size() const { return threads_; }

  void Run(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    if (workers_.empty()) {
      for (int i = 0; i < threads_; ++i) {
        workers_.emplace_back([this] { Work(); });
      }
    }
    queue_.push_back(std::move(task));
    cv_.notify_one();
  }

 private:
  void Work() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  const int threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
};

// Aligned blocks of objects, fetched once however many threads ask for
// them at the same time, the most recently used kept. Keys carry the
// object's ETag, so a replaced object is never served from an old block.
class BlockCache {
 public:
  BlockCache(uint64_t block_bytes, size_t capacity)
      : block_bytes_(block_bytes), capacity_(std::max<size_t>(capacity, 1)) {}

  uint64_t block_bytes() const { return block_bytes_; }

  // Copies [offset, offset + out.size()) of the object `id` (key and ETag)
  // of `size` bytes into `out`, fetching missing blocks with `fetch`.
  absl::Status Read(
      const std::string& id, uint64_t size, uint64_t offset,
      std::span<std::byte> out,
      const std::function<absl::Status(uint64_t, std::span<std::byte>)>&
          fetch) {
    while (!out.empty()) {
      const uint64_t index = offset / block_bytes_;
      const uint64_t start = index * block_bytes_;
      std::shared_ptr<Block> block;
      bool mine = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto key = std::make_pair(id, index);
        auto it = blocks_.find(key);
        if (it == blocks_.end()) {
          block = std::make_shared<Block>();
          blocks_.emplace(key, block);
          mine = true;
        } else {
          block = it->second;
          lru_.remove(key);
        }
        lru_.push_back(key);
        Evict();
      }
      if (mine) {
        std::vector<std::byte> data(std::min(block_bytes_, size - start));
        absl::Status status = fetch(start, data);
        {
          std::lock_guard<std::mutex> lock(block->mu);
          block->status = status;
          if (status.ok()) block->data = std::move(data);
          block->done = true;
        }
        block->cv.notify_all();
        if (!status.ok()) {  // not kept: a later read tries again
          std::lock_guard<std::mutex> lock(mu_);
          auto key = std::make_pair(id, index);
          auto it = blocks_.find(key);
          if (it != blocks_.end() && it->second == block) {
            blocks_.erase(it);
            lru_.remove(key);
          }
        }
      }
      std::unique_lock<std::mutex> lock(block->mu);
      block->cv.wait(lock, [&] { return block->done; });
      CAIRN_RETURN_IF_ERROR(block->status);
      const uint64_t within = offset - start;
      const size_t n = static_cast<size_t>(
          std::min<uint64_t>(out.size(), block->data.size() - within));
      std::memcpy(out.data(), block->data.data() + within, n);
      out = out.subspan(n);
      offset += n;
    }
    return absl::OkStatus();
  }

 private:
  struct Block {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    absl::Status status;
    std::vector<std::byte> data;
  };
  using Key = std::pair<std::string, uint64_t>;

  // Drops the least recently used finished blocks beyond the capacity
  // (their readers hold them until they are done). Called under mu_.
  void Evict() {
    for (auto it = lru_.begin(); blocks_.size() > capacity_ && it != lru_.end();) {
      auto found = blocks_.find(*it);
      bool done = false;
      {
        std::lock_guard<std::mutex> lock(found->second->mu);
        done = found->second->done;
      }
      if (!done) {
        ++it;
        continue;
      }
      blocks_.erase(found);
      it = lru_.erase(it);
    }
  }

  const uint64_t block_bytes_;
  const size_t capacity_;
  std::mutex mu_;
  std::map<Key, std::shared_ptr<Block>> blocks_;
  std::list<Key> lru_;  // least recently used first
};

// What a storage's files share.
struct Shared {
  S3Client client;
  std::string url;     // as opened
  std::string prefix;  // "" or "a/b/"
  uint64_t part_bytes;
  RequestPool pool;
  std::unique_ptr<BlockCache> cache;  // null: reads uncached

  std::string KeyOf(std::string_view name) const {
    return prefix + std::string(name);
  }
  std::string Named(std::string_view name) const {
    return url + "/" + std::string(name);
  }
};

// Counts down tasks; the first error wins.
class TaskGroup {
 public:
  void Add() {
    std::lock_guard<std::mutex> lock(mu_);
    ++pending_;
  }
  void Done(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!status.ok() && status_.ok()) status_ = std::move(status);
    --pending_;
    cv_.notify_all();
  }
  // Waits until at most `limit` tasks are pending.
  void WaitBelow(int limit) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return pending_ <= limit; });
  }
  absl::Status Wait() {
    WaitBelow(0);
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  absl::Status status() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int pending_ = 0;
  absl::Status status_;
};

class S3WritableFile : public WritableFile {
 public:
  S3WritableFile(std::shared_ptr<Shared> shared, std::string name)
      : shared_(std::move(shared)),
        name_(std::move(name)),
        key_(shared_->KeyOf(name_)),
        part_bytes_(shared_->part_bytes) {}

  ~S3WritableFile() override {
    (void)uploads_.Wait();
    if (!finished_ && !upload_id_.empty()) {
      (void)shared_->client.AbortMultipartUpload(key_, upload_id_);
    }
  }

  size_t alignment() const override { return 1; }

  absl::Status Reserve(uint64_t size) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (started_) return absl::OkStatus();  // too late to change parts
    // Parts large enough for S3's 10,000 of them.
    const uint64_t needed = (size + kMaxParts - 1) / kMaxParts;
    part_bytes_ = std::max(part_bytes_, (needed + (1 << 20) - 1) >> 20 << 20);
    return absl::OkStatus();
  }

  absl::Status WriteAt(uint64_t offset,
                       std::span<const std::byte> data) override {
    if (finished_) {
      return absl::FailedPreconditionError(
          absl::StrCat("WriteAt on finished file ", shared_->Named(name_)));
    }
    CAIRN_RETURN_IF_ERROR(uploads_.status());
    while (!data.empty()) {
      const uint64_t index = offset / part_bytes_;
      const uint64_t within = offset % part_bytes_;
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(data.size(), part_bytes_ - within));
      if (index >= kMaxParts) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "WriteAt %s: offset %d is past S3's 10,000 parts of %d bytes",
            shared_->Named(name_), offset, part_bytes_));
      }
      std::byte* dest;
      {
        std::lock_guard<std::mutex> lock(mu_);
        started_ = true;
        Part& part = parts_[index];
        if (part.sent) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "WriteAt %s: offset %d falls in part %d, uploaded already "
              "(ranges written twice?)",
              shared_->Named(name_), offset, index + 1));
        }
        if (part.data.empty()) part.data.resize(part_bytes_);
        dest = part.data.data() + within;
      }
      std::memcpy(dest, data.data(), n);
      bool full = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        Part& part = parts_[index];
        part.filled += n;
        full = part.filled >= part_bytes_;
        if (full) part.sent = true;
      }
      if (full) {
        // Bounded memory: at most 2 x threads parts in flight per file.
        uploads_.WaitBelow(2 * shared_->pool.size() - 1);
        StartUpload(index, part_bytes_);
      }
      offset += n;
      data = data.subspan(n);
    }
    return absl::OkStatus();
  }

  absl::Status Finish(uint64_t size) override {
    if (finished_) {
      return absl::FailedPreconditionError(
          absl::StrCat("Finish called twice on ", shared_->Named(name_)));
    }
    absl::Status status = FinishUpload(size);
    finished_ = true;
    if (!status.ok()) {
      (void)uploads_.Wait();
      if (!upload_id_.empty()) {
        (void)shared_->client.AbortMultipartUpload(key_, upload_id_);
      }
    }
    return status;
  }

 private:
  struct Part {
    std::vector<std::byte> data;  // part_bytes_, zero-filled; freed once sent
    uint64_t filled = 0;
    bool sent = false;
    std::string etag;  // once uploaded
  };

  absl::Status FinishUpload(uint64_t size) {
    CAIRN_RETURN_IF_ERROR(uploads_.Wait());
    const uint64_t parts = (size + part_bytes_ - 1) / part_bytes_;
    std::unique_lock<std::mutex> lock(mu_);
    for (const auto& [index, part] : parts_) {
      if (part.sent && (index >= parts || (index + 1) * part_bytes_ > size)) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "Finish %s at %d bytes: data was written up to %d",
            shared_->Named(name_), size, (index + 1) * part_bytes_));
      }
    }
    if (upload_id_.empty() && size <= part_bytes_) {
      // One PUT, only if the object is still absent.
      std::vector<std::byte> body;
      if (auto it = parts_.find(0); it != parts_.end()) {
        body = std::move(it->second.data);
      }
      body.resize(size);
      parts_.clear();
      lock.unlock();
      return shared_->client.Put(key_, body, /*if_absent=*/true);
    }
    for (uint64_t index = 0; index < parts; ++index) {
      Part& part = parts_[index];
      if (part.sent) continue;
      part.sent = true;
      if (part.data.empty()) part.data.resize(part_bytes_);  // a hole: zeros
      lock.unlock();
      uploads_.WaitBelow(2 * shared_->pool.size() - 1);
      StartUpload(index, std::min(part_bytes_, size - index * part_bytes_));
      lock.lock();
    }
    lock.unlock();
    CAIRN_RETURN_IF_ERROR(uploads_.Wait());
    std::vector<std::string> etags(parts);
    {
      std::lock_guard<std::mutex> guard(mu_);
      for (uint64_t i = 0; i < parts; ++i) etags[i] = parts_[i].etag;
    }
    return shared_->client.CompleteMultipartUpload(key_, upload_id_, etags,
                                                   /*if_absent=*/true);
  }

  // Uploads the first `length` bytes of part `index` on the pool.
  void StartUpload(uint64_t index, uint64_t length) {
    uploads_.Add();
    shared_->pool.Run([this, index, length] {
      absl::Status status = EnsureUpload();
      std::span<const std::byte> body;
      if (status.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        body = std::span<const std::byte>(parts_[index].data).first(length);
      }
      if (status.ok()) {
        absl::StatusOr<std::string> etag = shared_->client.UploadPart(
            key_, upload_id_, static_cast<int>(index + 1), body);
        status = etag.status();
        std::lock_guard<std::mutex> lock(mu_);
        if (etag.ok()) parts_[index].etag = *std::move(etag);
        std::vector<std::byte>().swap(parts_[index].data);
      }
      uploads_.Done(std::move(status));
    });
  }

  absl::Status EnsureUpload() {
    std::lock_guard<std::mutex> lock(create_mu_);
    if (!upload_id_.empty()) return absl::OkStatus();
    CAIRN_RETURN_IF_ERROR(create_status_);
    absl::StatusOr<std::string> id =
        shared_->client.CreateMultipartUpload(key_);
    if (!id.ok()) {
      create_status_ = id.status();
      return create_status_;
    }
    upload_id_ = *std::move(id);
    return absl::OkStatus();
  }

  const std::shared_ptr<Shared> shared_;
  const std::string name_;
  const std::string key_;
  uint64_t part_bytes_;
  bool finished_ = false;

  std::mutex mu_;
  std::map<uint64_t, Part> parts_;
  bool started_ = false;

  std::mutex create_mu_;
  std::string upload_id_;  // written once under create_mu_, before any part
  absl::Status create_status_;

  TaskGroup uploads_;
};

class S3ReadableFile : public ReadableFile {
 public:
  S3ReadableFile(std::shared_ptr<Shared> shared, std::string name,
                 ObjectInfo info)
      : shared_(std::move(shared)),
        name_(std::move(name)),
        key_(shared_->KeyOf(name_)),
        info_(std::move(info)) {}

  uint64_t size() const override { return info_.size; }

  absl::Status ReadAt(uint64_t offset,
                      std::span<std::byte> data) const override {
    uint64_t end;
    if (__builtin_add_overflow(offset, data.size(), &end) || end > info_.size) {
      return absl::DataLossError(absl::StrFormat(
          "%s: reading %d bytes at offset %d, past its end (%d bytes)",
          shared_->Named(name_), data.size(), offset, info_.size));
    }
    BlockCache* cache = shared_->cache.get();
    if (cache != nullptr && data.size() < cache->block_bytes()) {
      return cache->Read(
          absl::StrCat(key_, "\n", info_.etag), info_.size, offset, data,
          [this](uint64_t at, std::span<std::byte> out) {
            return shared_->client.GetRange(key_, at, out, info_.etag);
          });
    }
    const uint64_t range = shared_->part_bytes;
    if (data.size() <= range) {
      return shared_->client.GetRange(key_, offset, data, info_.etag);
    }
    // Ranges in parallel: the pool takes all but the first, which this
    // thread reads.
    TaskGroup group;
    for (uint64_t at = range; at < data.size(); at += range) {
      std::span<std::byte> piece =
          data.subspan(at, std::min<uint64_t>(range, data.size() - at));
      group.Add();
      shared_->pool.Run([this, &group, piece, at, offset] {
        group.Done(
            shared_->client.GetRange(key_, offset + at, piece, info_.etag));
      });
    }
    absl::Status first =
        shared_->client.GetRange(key_, offset, data.first(range), info_.etag);
    absl::Status rest = group.Wait();
    return first.ok() ? rest : first;
  }

 private:
  const std::shared_ptr<Shared> shared_;
  const std::string name_;
  const std::string key_;
  const ObjectInfo info_;
};

class S3Lock : public Storage::Lock {
 public:
  S3Lock(std::shared_ptr<Shared> shared, std::string key)
      : shared_(std::move(shared)), key_(std::move(key)) {}
  ~S3Lock() override { (void)shared_->client.Delete(key_); }

 private:
  std::shared_ptr<Shared> shared_;
  std::string key_;
};

class S3Storage : public Storage {
 public:
  explicit S3Storage(std::shared_ptr<Shared> shared)
      : shared_(std::move(shared)) {}

  std::string url() const override { return shared_->url; }

  absl::Status CreateLocation() override { return absl::OkStatus(); }

  absl::StatusOr<std::unique_ptr<WritableFile>> Create(
      std::string_view name) override {
    CAIRN_RETURN_IF_ERROR(internal_format::ValidateRelativeName(name));
    CAIRN_ASSIGN_OR_RETURN(bool exists, Exists(name));
    if (exists) {
      return absl::AlreadyExistsError(absl::StrFormat(
          "%s already exists; not overwritten", shared_->Named(name)));
    }
    return std::make_unique<S3WritableFile>(shared_, std::string(name));
  }

  absl::Status WriteAtomically(std::string_view name,
                               std::string_view contents) override {
    CAIRN_RETURN_IF_ERROR(internal_format::ValidateRelativeName(name));
    return shared_->client.Put(shared_->KeyOf(name), std::as_bytes(std::span(contents)),
                               /*if_absent=*/false);
  }

  absl::Status CreateAtomically(std::string_view name,
                                std::string_view contents) override {
    CAIRN_RETURN_IF_ERROR(internal_format::ValidateRelativeName(name));
    return shared_->client.Put(shared_->KeyOf(name), std::as_bytes(std::span(contents)),
                               /*if_absent=*/true);
  }

  absl::Status Remove(std::string_view name) override {
    CAIRN_RETURN_IF_ERROR(internal_format::ValidateRelativeName(name));
    return shared_->client.Delete(shared_->KeyOf(name));
  }

  absl::Status Sync() override { return absl::OkStatus(); }

  absl::StatusOr<std::vector<std::string>> List() override {
    CAIRN_ASSIGN_OR_RETURN(std::vector<ListedObject> objects,
                           shared_->client.List(shared_->prefix));
    std::vector<std::string> names;
    for (ListedObject& o : objects) {
      std::string name = o.key.substr(shared_->prefix.size());
      // Keys no file name could have ("a//b", "x/"): not cairn's; skipped.
      if (internal_format::ValidateRelativeName(name).ok()) {
        names.push_back(std::move(name));
      }
    }
    return names;
  }

  absl::StatusOr<std::unique_ptr<ReadableFile>> OpenForRead(
      std::string_view name) override {
    CAIRN_RETURN_IF_ERROR(internal_format::ValidateRelativeName(name));
    absl::StatusOr<ObjectInfo> info = shared_->client.Head(shared_->KeyOf(name));
    if (absl::IsNotFound(info.status())) {
      return absl::NotFoundError(
          absl::StrFormat("%s does not exist", shared_->Named(name)));
    }
    CAIRN_RETURN_IF_ERROR(info.status());
    return std::make_unique<S3ReadableFile>(shared_, std::string(name),
                                            *std::move(info));
  }

  absl::StatusOr<bool> Exists(std::string_view name) override {
    CAIRN_RETURN_IF_ERROR(internal_format::ValidateRelativeName(name));
    absl::StatusOr<ObjectInfo> info = shared_->client.Head(shared_->KeyOf(name));
    if (absl::IsNotFound(info.status())) return false;
    CAIRN_RETURN_IF_ERROR(info.status());
    return true;
  }

  absl::StatusOr<std::unique_ptr<Lock>> TryLock(std::string_view name) override {
    CAIRN_RETURN_IF_ERROR(internal_format::ValidateRelativeName(name));
    char host[256] = {0};
    (void)::gethostname(host, sizeof(host) - 1);
    const std::string holder = absl::StrFormat(
        "host %s, pid %d, since %s", host, ::getpid(),
        absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone()));
    const std::string key = shared_->KeyOf(name);
    absl::Status put = shared_->client.Put(
        key, std::as_bytes(std::span(holder)), /*if_absent=*/true);
    if (absl::IsAlreadyExists(put)) {
      std::string current = "an unknown holder";
      absl::StatusOr<std::string> text = ReadAll(name, 4096);
      if (text.ok()) current = *text;
      return absl::AbortedError(absl::StrFormat(
          "%s is locked by %s; if that save is dead, delete %s", url(),
          current, shared_->Named(name)));
    }
    CAIRN_RETURN_IF_ERROR(put);
    return std::make_unique<S3Lock>(shared_, key);
  }

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace

absl::StatusOr<S3Location> ParseS3Url(std::string_view url) {
  constexpr std::string_view kScheme = "s3://";
  if (url.size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(std::string(url.substr(0, kScheme.size())),
                              std::string(kScheme))) {
    return absl::InvalidArgumentError(
        absl::StrFormat("\"%s\" is not an s3:// URL", url));
  }
  std::string_view rest = url.substr(kScheme.size());
  while (rest.ends_with('/')) rest.remove_suffix(1);
  const size_t slash = rest.find('/');
  S3Location out;
  out.bucket = std::string(rest.substr(0, slash));
  if (slash != std::string_view::npos) {
    out.prefix = std::string(rest.substr(slash + 1));
  }
  // Bucket names: 3-63 of [a-z0-9.-] (S3's rules, loosely).
  if (out.bucket.size() < 3 || out.bucket.size() > 63 ||
      out.bucket.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789.-") !=
          std::string::npos) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "s3 URL \"%s\": \"%s\" is not a bucket name (3 to 63 of a-z 0-9 . -)",
        url, out.bucket));
  }
  if (!out.prefix.empty()) {
    if (absl::Status s = internal_format::ValidateRelativeName(out.prefix);
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "s3 URL \"%s\": bad prefix: %s", url, s.message()));
    }
  }
  return out;
}

absl::StatusOr<S3Config> ResolveS3Config(const S3Options& options,
                                         std::string bucket) {
  S3Config c;
  c.bucket = std::move(bucket);
  auto pick = [](const std::string& set, std::initializer_list<const char*> env,
                 std::string fallback) {
    if (!set.empty()) return set;
    for (const char* name : env) {
      if (std::string v = Env(name); !v.empty()) return v;
    }
    return fallback;
  };
  c.region = pick(options.region, {"AWS_REGION", "AWS_DEFAULT_REGION"},
                  "us-east-1");
  const std::string endpoint =
      pick(options.endpoint, {"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"}, "");
  c.endpoint = endpoint.empty()
                   ? absl::StrCat("https://s3.", c.region, ".amazonaws.com")
                   : endpoint;
  c.credentials.access_key_id =
      pick(options.access_key_id, {"AWS_ACCESS_KEY_ID"}, "");
  c.credentials.secret_access_key =
      pick(options.secret_access_key, {"AWS_SECRET_ACCESS_KEY"}, "");
  c.credentials.session_token =
      pick(options.session_token, {"AWS_SESSION_TOKEN"}, "");
  if (!c.credentials.access_key_id.empty() &&
      c.credentials.secret_access_key.empty()) {
    return absl::InvalidArgumentError(
        "S3 access key id given without a secret access key "
        "(AWS_SECRET_ACCESS_KEY)");
  }
  S3Options::Addressing addressing = options.addressing;
  if (addressing == S3Options::Addressing::kAuto) {
    const std::string style =
        absl::AsciiStrToLower(Env("CAIRN_S3_ADDRESSING_STYLE"));
    if (style == "path") {
      addressing = S3Options::Addressing::kPath;
    } else if (style == "virtual") {
      addressing = S3Options::Addressing::kVirtualHost;
    } else if (!style.empty() && style != "auto") {
      return absl::InvalidArgumentError(absl::StrFormat(
          "CAIRN_S3_ADDRESSING_STYLE=\"%s\": expected path, virtual or auto",
          style));
    }
  }
  c.path_style = addressing == S3Options::Addressing::kAuto
                     ? !endpoint.empty()
                     : addressing == S3Options::Addressing::kPath;
  c.max_attempts = std::max(1, options.max_attempts);
  c.retry_base_delay_ms = std::max(0, options.retry_base_delay_ms);
  c.connect_timeout_ms = std::max(1, options.connect_timeout_ms);
  c.stall_timeout_ms = std::max(1, options.stall_timeout_ms);
  return c;
}

absl::StatusOr<std::unique_ptr<Storage>> OpenS3Storage(
    std::string_view url, const StorageOptions& options) {
  CAIRN_ASSIGN_OR_RETURN(S3Location where, ParseS3Url(url));
  CAIRN_ASSIGN_OR_RETURN(S3Config config,
                         ResolveS3Config(options.s3, where.bucket));
  CAIRN_ASSIGN_OR_RETURN(S3Client client, S3Client::Create(std::move(config)));
  auto shared = std::shared_ptr<Shared>(new Shared{
      std::move(client), std::string(url),
      where.prefix.empty() ? std::string() : absl::StrCat(where.prefix, "/"),
      std::max(kMinPartBytes, options.s3.part_bytes),
      RequestPool(std::max(1, options.s3.threads)),
      options.s3.read_block_bytes == 0
          ? nullptr
          : std::make_unique<BlockCache>(
                options.s3.read_block_bytes,
                2 * static_cast<size_t>(std::max(1, options.s3.threads)))});
  return std::make_unique<S3Storage>(std::move(shared));
}

void RegisterS3Storage() {
  static std::once_flag once;
  std::call_once(once, [] { Storage::RegisterScheme("s3", OpenS3Storage); });
}

}  // namespace cairn::internal_s3
