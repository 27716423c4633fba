// One HTTP/1.1 request over libcurl, synchronously, with timeouts on
// connecting and on a stalled transfer, so that a dead or hung endpoint
// fails the request instead of hanging the job. Each thread keeps its own
// curl handle, so consecutive requests of a thread reuse its connection.
// Retries are the caller's (s3_client.cc): this layer reports what
// happened, nothing more.
#ifndef CAIRN_STORAGE_S3_HTTP_H_
#define CAIRN_STORAGE_S3_HTTP_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "storage/s3/sigv4.h"

namespace cairn::internal_s3 {

struct HttpRequest {
  std::string method;  // GET, HEAD, PUT, POST, DELETE
  std::string url;     // already encoded
  Headers headers;
  std::span<const std::byte> body;  // sent for PUT and POST
  // When non-empty, a 2xx response's body is written here and must fit
  // (HttpResponse::received says how much came); other responses' bodies
  // go to HttpResponse::body.
  std::span<std::byte> into;
  int64_t connect_timeout_ms = 5000;
  // The request fails when no byte moves for this long (rounded up to a
  // whole second, libcurl's granularity).
  int64_t stall_timeout_ms = 30000;
};

struct HttpResponse {
  long status = 0;
  Headers headers;   // names lower-cased, in the order received
  std::string body;  // at most 1 MiB is kept when `into` was not given
  uint64_t received = 0;  // bytes written into HttpRequest::into
  bool overflowed = false;  // the body did not fit in `into`

  // The last header `name` (lower case), or nullopt.
  std::optional<std::string_view> Header(std::string_view name) const;
};

// Sends `request`. An HTTP error status is a response, not an error; the
// error statuses are for transfers that failed: kDeadlineExceeded for a
// timeout, kUnavailable for anything else the transport reports (refused
// or reset connections, bodies shorter than their Content-Length), each
// naming the method and URL.
absl::StatusOr<HttpResponse> SendHttp(const HttpRequest& request);

}  // namespace cairn::internal_s3

#endif  // CAIRN_STORAGE_S3_HTTP_H_
