// AWS Signature Version 4 for S3 requests (s3_client.cc signs every
// request with it): the canonical request, the string to sign, the signing
// key (HMAC-SHA256 chain over date, region and service) and the
// Authorization header, with OpenSSL's SHA-256 and HMAC. Tested against
// botocore's signer (python/tests/test_s3_sigv4.py).
#ifndef CAIRN_STORAGE_S3_SIGV4_H_
#define CAIRN_STORAGE_S3_SIGV4_H_

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace cairn::internal_s3 {

using Headers = std::vector<std::pair<std::string, std::string>>;

struct Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty: none (long-term keys)
};

struct SigningRequest {
  std::string method;  // GET, PUT, POST, DELETE, HEAD
  std::string host;    // the Host header: "bucket.s3.eu-west-1.amazonaws.com",
                       // "127.0.0.1:5000"
  // The path as sent, not yet encoded ("/bucket/some key"): each segment is
  // URI-encoded once (S3 is not double-encoded), '/' kept.
  std::string path;
  // Query parameters, not yet encoded ("uploadId", "2~x"; "uploads", "").
  std::vector<std::pair<std::string, std::string>> query;
  // Further headers to sign (Range, Content-Type, If-None-Match, ...).
  Headers headers;
  // Hex SHA-256 of the body, or "UNSIGNED-PAYLOAD".
  std::string payload_sha256;
};

// RFC 3986 percent-encoding as SigV4 asks: unreserved characters
// (A-Z a-z 0-9 - . _ ~) stay, every other byte becomes %XX (upper-case);
// '/' stays when `keep_slash`.
std::string UriEncode(std::string_view s, bool keep_slash);

// Lower-case hex SHA-256 of `data`.
std::string Sha256Hex(std::span<const std::byte> data);
std::string Sha256Hex(std::string_view data);

// The canonical request (exposed for tests and error messages).
std::string CanonicalRequest(const SigningRequest& request,
                             const Headers& signed_headers);

// The headers to add to `request`'s own: host,
// x-amz-content-sha256, x-amz-date, x-amz-security-token (with a session
// token) and Authorization, signed for `region` and `service` ("s3") at
// `amz_date` ("20261127T213357Z"). kInvalidArgument for a malformed date,
// an empty region or key, or a header name or value with a control
// character.
absl::StatusOr<Headers> SignV4(const SigningRequest& request,
                               const Credentials& credentials,
                               std::string_view region,
                               std::string_view service,
                               std::string_view amz_date);

}  // namespace cairn::internal_s3

#endif  // CAIRN_STORAGE_S3_SIGV4_H_
