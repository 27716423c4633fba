// The S3 operations cairn needs, over http.h and sigv4.h: HEAD, ranged GET,
// PUT (optionally only if absent), DELETE, ListObjectsV2 and multipart
// uploads. Every request has timeouts and is retried, with exponential
// backoff and full jitter, when the transport fails or the store answers
// 500, 502, 503, 504, 429 or a SlowDown/InternalError/RequestTimeout code;
// a GET whose body comes back short or long is retried too. Errors name the
// object (s3://bucket/key), the operation, the HTTP status, S3's error code
// and message and the request id, and map onto absl codes: kNotFound (404),
// kAlreadyExists (412 on a conditional write), kPermissionDenied (403),
// kUnavailable (retries exhausted).
#ifndef CAIRN_STORAGE_S3_S3_CLIENT_H_
#define CAIRN_STORAGE_S3_S3_CLIENT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "storage/s3/http.h"
#include "storage/s3/sigv4.h"

namespace cairn::internal_s3 {

struct S3Config {
  std::string endpoint;  // "http://127.0.0.1:9000", "https://s3.amazonaws.com"
  std::string region = "us-east-1";
  std::string bucket;
  // Empty access key: requests are sent unsigned (a public bucket).
  Credentials credentials;
  bool path_style = true;  // endpoint/bucket/key; else bucket.endpoint/key
  int max_attempts = 6;
  int64_t retry_base_delay_ms = 100;
  int64_t retry_max_delay_ms = 5000;
  int64_t connect_timeout_ms = 5000;
  int64_t stall_timeout_ms = 30000;
};

struct ObjectInfo {
  uint64_t size = 0;
  std::string etag;
};

struct ListedObject {
  std::string key;
  uint64_t size = 0;
};

// Request counts, for the benchmark's requests per GiB (process-wide:
// ProcessS3Counters).
struct S3Counters {
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> retries{0};
};

// Every S3 request this process has sent, over all clients.
S3Counters& ProcessS3Counters();

class S3Client {
 public:
  // kInvalidArgument for an endpoint that is not http(s)://host[:port].
  static absl::StatusOr<S3Client> Create(S3Config config);

  const S3Config& config() const { return config_; }
  // "s3://bucket/key", for messages.
  std::string UrlOf(std::string_view key) const;

  // kNotFound when the object does not exist.
  absl::StatusOr<ObjectInfo> Head(std::string_view key) const;
  // Reads exactly out.size() bytes at `offset`. With a non-empty `etag`,
  // the object must still be that version (If-Match): kDataLoss when it
  // was replaced meanwhile.
  absl::Status GetRange(std::string_view key, uint64_t offset,
                        std::span<std::byte> out, std::string_view etag) const;
  // With `if_absent`, kAlreadyExists when the key exists (If-None-Match: *).
  absl::Status Put(std::string_view key, std::span<const std::byte> body,
                   bool if_absent) const;
  // OK when the object does not exist.
  absl::Status Delete(std::string_view key) const;
  // Every object whose key starts with `prefix`, in key order.
  absl::StatusOr<std::vector<ListedObject>> List(std::string_view prefix) const;

  absl::StatusOr<std::string> CreateMultipartUpload(std::string_view key) const;
  // The part's ETag. Parts are numbered from 1.
  absl::StatusOr<std::string> UploadPart(std::string_view key,
                                         std::string_view upload_id,
                                         int part_number,
                                         std::span<const std::byte> body) const;
  absl::Status CompleteMultipartUpload(std::string_view key,
                                       std::string_view upload_id,
                                       const std::vector<std::string>& etags,
                                       bool if_absent) const;
  absl::Status AbortMultipartUpload(std::string_view key,
                                    std::string_view upload_id) const;

  // Creates the bucket (tests and `cairn` against a fresh local server);
  // OK when this account owns it already.
  absl::Status CreateBucket() const;


 private:
  struct Call;
  S3Client(S3Config config, std::string scheme, std::string host);
  // Sends `call` until it succeeds, fails for good or runs out of attempts.
  absl::StatusOr<HttpResponse> Send(const Call& call) const;

  S3Config config_;
  std::string scheme_;  // "http" or "https"
  std::string host_;    // "127.0.0.1:9000"
};

}  // namespace cairn::internal_s3

#endif  // CAIRN_STORAGE_S3_S3_CLIENT_H_
