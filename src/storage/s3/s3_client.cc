#include "storage/s3/s3_client.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/status.h"
#include "storage/s3/xml.h"

namespace cairn::internal_s3 {

struct S3Client::Call {
  Call(std::string op, std::string method, std::string key = "")
      : op(std::move(op)), method(std::move(method)), key(std::move(key)) {}
  std::string op;  // "GetObject", for messages
  std::string method;
  std::string key;  // empty: the bucket itself
  std::vector<std::pair<std::string, std::string>> query;
  Headers headers;  // further headers, signed
  std::span<const std::byte> body;
  bool sign_payload = true;  // else UNSIGNED-PAYLOAD (large bodies)
  std::span<std::byte> into;  // a GET's destination
  uint64_t offset = 0;        // of `into`, for messages
};

namespace {

constexpr std::string_view kEmptySha256 =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

bool RetryableStatus(long status) {
  return status == 500 || status == 502 || status == 503 || status == 504 ||
         status == 429;
}

bool RetryableCode(std::string_view code) {
  return code == "SlowDown" || code == "InternalError" ||
         code == "RequestTimeout" || code == "ServiceUnavailable";
}

struct S3Error {
  std::string code;
  std::string message;
  std::string request_id;
};

S3Error ParseError(const HttpResponse& response) {
  S3Error e;
  auto text = [&](std::string_view tag) -> std::string {
    absl::StatusOr<std::optional<std::string>> t =
        XmlFirstText(response.body, tag);
    return t.ok() && t->has_value() ? **t : std::string();
  };
  e.code = text("Code");
  e.message = text("Message");
  e.request_id = text("RequestId");
  if (e.request_id.empty()) {
    if (auto id = response.Header("x-amz-request-id")) e.request_id = *id;
  }
  return e;
}

void SleepBeforeAttempt(int attempt, const S3Config& config) {
  // Full jitter: uniform in [0, min(max, base * 2^(attempt-1))].
  thread_local std::mt19937_64 rng{std::random_device{}()};
  const int64_t cap = std::min<int64_t>(
      config.retry_max_delay_ms,
      config.retry_base_delay_ms << std::min(attempt - 1, 20));
  std::uniform_int_distribution<int64_t> dist(0, std::max<int64_t>(cap, 0));
  absl::SleepFor(absl::Milliseconds(dist(rng)));
}

}  // namespace

S3Counters& ProcessS3Counters() {
  static S3Counters* counters = new S3Counters;
  return *counters;
}

absl::StatusOr<S3Client> S3Client::Create(S3Config config) {
  std::string_view ep = config.endpoint;
  std::string scheme;
  if (ep.starts_with("http://")) {
    scheme = "http";
  } else if (ep.starts_with("https://")) {
    scheme = "https";
  } else {
    return absl::InvalidArgumentError(absl::StrFormat(
        "S3 endpoint \"%s\" is not http://host[:port] or https://host[:port]",
        config.endpoint));
  }
  std::string_view host = ep.substr(scheme.size() + 3);
  while (host.ends_with('/')) host.remove_suffix(1);
  if (host.empty() || host.find_first_of("/?#@ ") != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "S3 endpoint \"%s\" must be scheme://host[:port] with no path",
        config.endpoint));
  }
  if (config.bucket.empty()) {
    return absl::InvalidArgumentError("S3 bucket name is empty");
  }
  if (config.max_attempts < 1) config.max_attempts = 1;
  return S3Client(std::move(config), std::move(scheme), std::string(host));
}

S3Client::S3Client(S3Config config, std::string scheme, std::string host)
    : config_(std::move(config)),
      scheme_(std::move(scheme)),
      host_(std::move(host)) {}

std::string S3Client::UrlOf(std::string_view key) const {
  return "s3://" + config_.bucket + "/" + std::string(key);
}

absl::StatusOr<HttpResponse> S3Client::Send(const Call& call) const {
  const std::string host = config_.path_style
                               ? host_
                               : absl::StrCat(config_.bucket, ".", host_);
  const std::string path =
      config_.path_style
          ? absl::StrCat("/", config_.bucket, call.key.empty() ? "" : "/",
                         call.key)
          : absl::StrCat("/", call.key);
  std::string url = absl::StrCat(scheme_, "://", host, UriEncode(path, true));
  if (!call.query.empty()) {
    std::vector<std::string> parts;
    for (const auto& [k, v] : call.query) {
      parts.push_back(v.empty() && k == "uploads"
                          ? UriEncode(k, false)
                          : absl::StrCat(UriEncode(k, false), "=",
                                         UriEncode(v, false)));
    }
    absl::StrAppend(&url, "?", absl::StrJoin(parts, "&"));
  }
  const std::string payload_sha256 =
      call.body.empty() ? std::string(kEmptySha256)
      : call.sign_payload ? Sha256Hex(call.body)
                          : std::string("UNSIGNED-PAYLOAD");
  const std::string what =
      absl::StrFormat("%s %s", call.op, UrlOf(call.key));

  absl::Status last;
  for (int attempt = 1; attempt <= config_.max_attempts; ++attempt) {
    if (attempt > 1) {
      ProcessS3Counters().retries.fetch_add(1, std::memory_order_relaxed);
      SleepBeforeAttempt(attempt - 1, config_);
    }
    HttpRequest request;
    request.method = call.method;
    request.url = url;
    request.body = call.body;
    request.into = call.into;
    request.connect_timeout_ms = config_.connect_timeout_ms;
    request.stall_timeout_ms = config_.stall_timeout_ms;
    request.headers = call.headers;
    if (!config_.credentials.access_key_id.empty()) {
      SigningRequest signing{call.method, host, path, call.query, call.headers,
                             payload_sha256};
      const std::string amz_date = absl::FormatTime(
          "%Y%m%dT%H%M%SZ", absl::Now(), absl::UTCTimeZone());
      CAIRN_ASSIGN_OR_RETURN(Headers signed_headers,
                             SignV4(signing, config_.credentials,
                                    config_.region, "s3", amz_date));
      // SignV4 returns the headers it adds (host, x-amz-*, authorization).
      request.headers.insert(request.headers.end(), signed_headers.begin(),
                             signed_headers.end());
    } else {
      request.headers.emplace_back("x-amz-content-sha256", payload_sha256);
    }
    ProcessS3Counters().requests.fetch_add(1, std::memory_order_relaxed);
    absl::StatusOr<HttpResponse> response = SendHttp(request);
    if (!response.ok()) {
      last = response.status();  // the transport failed: try again
      continue;
    }
    if (response->status >= 200 && response->status < 300) {
      if (!call.into.empty() &&
          (response->overflowed || response->received != call.into.size())) {
        last = absl::DataLossError(absl::StrFormat(
            "%s: asked for %d bytes at offset %d, got %s", what,
            call.into.size(), call.offset,
            response->overflowed ? "more"
                                 : absl::StrCat(response->received)));
        continue;
      }
      // CompleteMultipartUpload may answer 200 and report an error in the
      // body (S3 sends the status before it knows).
      if (call.op == "CompleteMultipartUpload" &&
          response->body.find("<Error>") != std::string::npos) {
        const S3Error e = ParseError(*response);
        last = absl::UnavailableError(absl::StrFormat(
            "%s: HTTP 200 with error %s: %s (request id %s)", what, e.code,
            e.message, e.request_id));
        if (RetryableCode(e.code)) continue;
        return last;
      }
      return response;
    }
    const S3Error e = ParseError(*response);
    const std::string message = absl::StrFormat(
        "%s: HTTP %d%s%s%s%s", what, response->status,
        e.code.empty() ? "" : " ", e.code,
        e.message.empty() ? "" : absl::StrCat(": ", e.message),
        e.request_id.empty() ? ""
                             : absl::StrCat(" (request id ", std::string(e.request_id), ")"));
    if (RetryableStatus(response->status) || RetryableCode(e.code)) {
      last = absl::UnavailableError(message);
      continue;
    }
    switch (response->status) {
      case 404:
        return absl::NotFoundError(message);
      case 412:
        return absl::FailedPreconditionError(message);
      case 403:
        return absl::PermissionDeniedError(message);
      case 400:
        return absl::InvalidArgumentError(message);
      case 409:
        return absl::AbortedError(message);
      default:
        return absl::UnknownError(message);
    }
  }
  return absl::Status(
      last.code() == absl::StatusCode::kDataLoss ? absl::StatusCode::kDataLoss
                                                 : absl::StatusCode::kUnavailable,
      absl::StrFormat("%s (gave up after %d attempts)", last.message(),
                      config_.max_attempts));
}

absl::StatusOr<ObjectInfo> S3Client::Head(std::string_view key) const {
  Call call("HeadObject", "HEAD", std::string(key));
  CAIRN_ASSIGN_OR_RETURN(HttpResponse response, Send(call));
  ObjectInfo info;
  std::optional<std::string_view> length = response.Header("content-length");
  if (!length || !absl::SimpleAtoi(std::string(*length), &info.size)) {
    return absl::DataLossError(absl::StrFormat(
        "HeadObject %s: no valid Content-Length in the answer", UrlOf(key)));
  }
  if (auto etag = response.Header("etag")) info.etag = std::string(*etag);
  return info;
}

absl::Status S3Client::GetRange(std::string_view key, uint64_t offset,
                                std::span<std::byte> out,
                                std::string_view etag) const {
  if (out.empty()) return absl::OkStatus();
  Call call("GetObject", "GET", std::string(key));
  call.headers.emplace_back(
      "range", absl::StrFormat("bytes=%d-%d", offset, offset + out.size() - 1));
  if (!etag.empty()) call.headers.emplace_back("if-match", std::string(etag));
  call.into = out;
  call.offset = offset;
  absl::StatusOr<HttpResponse> response = Send(call);
  if (!response.ok()) {
    if (absl::IsFailedPrecondition(response.status())) {
      return absl::DataLossError(absl::StrFormat(
          "%s was replaced while it was read (ETag no longer %s): %s",
          UrlOf(key), etag, response.status().message()));
    }
    return response.status();
  }
  if (response->status == 200 && offset != 0) {
    return absl::DataLossError(absl::StrFormat(
        "GetObject %s: the store ignored the range at offset %d", UrlOf(key),
        offset));
  }
  return absl::OkStatus();
}

absl::Status S3Client::Put(std::string_view key,
                           std::span<const std::byte> body,
                           bool if_absent) const {
  Call call("PutObject", "PUT", std::string(key));
  call.body = body;
  call.sign_payload = body.size() <= (1 << 20);
  call.headers.emplace_back("content-type", "application/octet-stream");
  if (if_absent) call.headers.emplace_back("if-none-match", "*");
  absl::StatusOr<HttpResponse> response = Send(call);
  if (!response.ok() && if_absent &&
      absl::IsFailedPrecondition(response.status())) {
    return absl::AlreadyExistsError(absl::StrFormat(
        "%s already exists (conditional PUT refused: %s)", UrlOf(key),
        response.status().message()));
  }
  return response.status();
}

absl::Status S3Client::Delete(std::string_view key) const {
  Call call("DeleteObject", "DELETE", std::string(key));
  absl::StatusOr<HttpResponse> response = Send(call);
  if (!response.ok() && absl::IsNotFound(response.status()) &&
      response.status().message().find("NoSuchBucket") == std::string::npos) {
    return absl::OkStatus();
  }
  return response.status();
}

absl::StatusOr<std::vector<ListedObject>> S3Client::List(
    std::string_view prefix) const {
  std::vector<ListedObject> out;
  std::string token;
  while (true) {
    Call call("ListObjectsV2", "GET");
    call.query = {{"list-type", "2"}, {"prefix", std::string(prefix)}};
    if (!token.empty()) call.query.emplace_back("continuation-token", token);
    CAIRN_ASSIGN_OR_RETURN(HttpResponse response, Send(call));
    auto bad = [&](const absl::Status& s) {
      return absl::DataLossError(absl::StrFormat(
          "ListObjectsV2 %s: malformed answer: %s", UrlOf(prefix),
          s.message()));
    };
    absl::StatusOr<std::vector<std::string_view>> contents =
        XmlElements(response.body, "Contents");
    if (!contents.ok()) return bad(contents.status());
    for (std::string_view c : *contents) {
      absl::StatusOr<std::optional<std::string>> key = XmlFirstText(c, "Key");
      absl::StatusOr<std::optional<std::string>> size = XmlFirstText(c, "Size");
      if (!key.ok()) return bad(key.status());
      if (!size.ok()) return bad(size.status());
      ListedObject o;
      if (!key->has_value() || !size->has_value() ||
          !absl::SimpleAtoi(**size, &o.size)) {
        return bad(absl::InvalidArgumentError("an entry without Key or Size"));
      }
      o.key = **key;
      out.push_back(std::move(o));
    }
    absl::StatusOr<std::optional<std::string>> truncated =
        XmlFirstText(response.body, "IsTruncated");
    if (!truncated.ok()) return bad(truncated.status());
    if (!truncated->has_value() || **truncated != "true") break;
    absl::StatusOr<std::optional<std::string>> next =
        XmlFirstText(response.body, "NextContinuationToken");
    if (!next.ok()) return bad(next.status());
    if (!next->has_value() || (*next)->empty() || **next == token) {
      return bad(absl::InvalidArgumentError(
          "truncated without a new NextContinuationToken"));
    }
    token = **next;
  }
  std::sort(out.begin(), out.end(),
            [](const ListedObject& a, const ListedObject& b) {
              return a.key < b.key;
            });
  return out;
}

absl::StatusOr<std::string> S3Client::CreateMultipartUpload(
    std::string_view key) const {
  Call call("CreateMultipartUpload", "POST", std::string(key));
  call.query = {{"uploads", ""}};
  call.headers.emplace_back("content-type", "application/octet-stream");
  CAIRN_ASSIGN_OR_RETURN(HttpResponse response, Send(call));
  absl::StatusOr<std::optional<std::string>> id =
      XmlFirstText(response.body, "UploadId");
  if (!id.ok() || !id->has_value() || (*id)->empty()) {
    return absl::DataLossError(absl::StrFormat(
        "CreateMultipartUpload %s: no UploadId in the answer", UrlOf(key)));
  }
  return **id;
}

absl::StatusOr<std::string> S3Client::UploadPart(
    std::string_view key, std::string_view upload_id, int part_number,
    std::span<const std::byte> body) const {
  Call call(absl::StrCat("UploadPart ", part_number), "PUT", std::string(key));
  call.query = {{"partNumber", absl::StrCat(part_number)},
                {"uploadId", std::string(upload_id)}};
  call.body = body;
  call.sign_payload = false;
  CAIRN_ASSIGN_OR_RETURN(HttpResponse response, Send(call));
  std::optional<std::string_view> etag = response.Header("etag");
  if (!etag || etag->empty()) {
    return absl::DataLossError(absl::StrFormat(
        "UploadPart %d of %s: no ETag in the answer", part_number,
        UrlOf(key)));
  }
  return std::string(*etag);
}

absl::Status S3Client::CompleteMultipartUpload(
    std::string_view key, std::string_view upload_id,
    const std::vector<std::string>& etags, bool if_absent) const {
  std::string xml = "<CompleteMultipartUpload>";
  for (size_t i = 0; i < etags.size(); ++i) {
    absl::StrAppend(&xml, "<Part><PartNumber>", i + 1, "</PartNumber><ETag>",
                    XmlEscape(etags[i]), "</ETag></Part>");
  }
  xml += "</CompleteMultipartUpload>";
  Call call("CompleteMultipartUpload", "POST", std::string(key));
  call.query = {{"uploadId", std::string(upload_id)}};
  call.body = std::as_bytes(std::span(xml));
  call.headers.emplace_back("content-type", "application/xml");
  if (if_absent) call.headers.emplace_back("if-none-match", "*");
  absl::StatusOr<HttpResponse> response = Send(call);
  if (!response.ok() && if_absent &&
      absl::IsFailedPrecondition(response.status())) {
    return absl::AlreadyExistsError(absl::StrFormat(
        "%s already exists (conditional upload refused: %s)", UrlOf(key),
        response.status().message()));
  }
  return response.status();
}

absl::Status S3Client::AbortMultipartUpload(std::string_view key,
                                            std::string_view upload_id) const {
  Call call("AbortMultipartUpload", "DELETE", std::string(key));
  call.query = {{"uploadId", std::string(upload_id)}};
  absl::StatusOr<HttpResponse> response = Send(call);
  if (!response.ok() && absl::IsNotFound(response.status())) {
    return absl::OkStatus();  // already gone
  }
  return response.status();
}

absl::Status S3Client::CreateBucket() const {
  Call call("CreateBucket", "PUT");
  std::string body;
  if (config_.region != "us-east-1") {
    body = absl::StrCat(
        "<CreateBucketConfiguration><LocationConstraint>",
        XmlEscape(config_.region),
        "</LocationConstraint></CreateBucketConfiguration>");
  }
  call.body = std::as_bytes(std::span(body));
  absl::StatusOr<HttpResponse> response = Send(call);
  if (!response.ok() && response.status().message().find(
                            "BucketAlreadyOwnedByYou") != std::string::npos) {
    return absl::OkStatus();
  }
  return response.status();
}

}  // namespace cairn::internal_s3
