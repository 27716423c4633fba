#include "storage/s3/http.h"

#include <curl/curl.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace cairn::internal_s3 {
namespace {

constexpr size_t kMaxKeptBody = 1 << 20;

// A thread's curl handle, kept so that its connections are reused.
struct ThreadHandle {
  CURL* curl = nullptr;
  ~ThreadHandle() {
    if (curl != nullptr) curl_easy_cleanup(curl);
  }
};

CURL* HandleForThisThread() {
  static std::once_flag global_init;
  std::call_once(global_init, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  thread_local ThreadHandle handle;
  if (handle.curl == nullptr) {
    handle.curl = curl_easy_init();
  } else {
    curl_easy_reset(handle.curl);  // keeps the connection cache
  }
  return handle.curl;
}

struct Transfer {
  CURL* curl;
  const HttpRequest* request;
  HttpResponse* response;
};

size_t OnBody(char* data, size_t size, size_t count, void* user) {
  auto* t = static_cast<Transfer*>(user);
  const size_t n = size * count;
  long status = 0;
  curl_easy_getinfo(t->curl, CURLINFO_RESPONSE_CODE, &status);
  if (!t->request->into.empty() && status >= 200 && status < 300) {
    const uint64_t room = t->request->into.size() - t->response->received;
    if (n > room) {
      t->response->overflowed = true;
      return 0;  // not all taken: curl ends the transfer
    }
    std::memcpy(t->request->into.data() + t->response->received, data, n);
    t->response->received += n;
    return n;
  }
  std::string& body = t->response->body;
  body.append(data, std::min(n, kMaxKeptBody - std::min(kMaxKeptBody, body.size())));
  return n;
}

size_t OnHeader(char* data, size_t size, size_t count, void* user) {
  auto* response = static_cast<HttpResponse*>(user);
  const size_t n = size * count;
  std::string_view line(data, n);
  if (line.starts_with("HTTP/")) {  // a new response (after 100 Continue)
    response->headers.clear();
    return n;
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) return n;
  std::string name = absl::AsciiStrToLower(std::string(line.substr(0, colon)));
  std::string value(line.substr(colon + 1));
  absl::StripAsciiWhitespace(&value);
  response->headers.emplace_back(std::move(name), std::move(value));
  return n;
}

}  // namespace

std::optional<std::string_view> HttpResponse::Header(
    std::string_view name) const {
  for (auto it = headers.rbegin(); it != headers.rend(); ++it) {
    if (it->first == name) return it->second;
  }
  return std::nullopt;
}

absl::StatusOr<HttpResponse> SendHttp(const HttpRequest& request) {
  CURL* curl = HandleForThisThread();
  if (curl == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s %s: curl_easy_init failed", request.method,
                        request.url));
  }
  HttpResponse response;
  Transfer transfer{curl, &request, &response};
  char error[CURL_ERROR_SIZE] = {0};
  curl_easy_setopt(curl, CURLOPT_URL, request.url.c_str());
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(std::max<int64_t>(1, request.connect_timeout_ms)));
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME,
                   static_cast<long>(std::max<int64_t>(
                       1, (request.stall_timeout_ms + 999) / 1000)));
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, OnBody);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &transfer);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, OnHeader);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &response);
  curl_easy_setopt(curl, CURLOPT_FOLLOWLOCATION, 0L);

  struct curl_slist* headers = nullptr;
  for (const auto& [name, value] : request.headers) {
    headers = curl_slist_append(headers, absl::StrCat(name, ": ", value).c_str());
  }
  // No "Expect: 100-continue" round trip before large bodies, and no
  // form Content-Type for POSTFIELDS bodies.
  headers = curl_slist_append(headers, "Expect:");
  const bool has_content_type = std::any_of(
      request.headers.begin(), request.headers.end(), [](const auto& h) {
        return absl::EqualsIgnoreCase(h.first, "content-type");
      });
  if (!has_content_type) {
    headers = curl_slist_append(headers, "Content-Type:");
  }
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);

  if (request.method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else if (request.method == "PUT" || request.method == "POST") {
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS,
                     request.body.empty()
                         ? ""
                         : reinterpret_cast<const char*>(request.body.data()));
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE,
                     static_cast<curl_off_t>(request.body.size()));
    if (request.method == "PUT") {
      curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, "PUT");
    }
  } else if (request.method != "GET") {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  }

  const CURLcode rc = curl_easy_perform(curl);
  curl_slist_free_all(headers);
  if (rc != CURLE_OK) {
    if (rc == CURLE_WRITE_ERROR && response.overflowed) {
      curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
      return response;  // the caller sees `overflowed`
    }
    const std::string what = absl::StrFormat(
        "%s %s: %s", request.method, request.url,
        error[0] != '\0' ? error : curl_easy_strerror(rc));
    if (rc == CURLE_OPERATION_TIMEDOUT) {
      return absl::DeadlineExceededError(what);
    }
    return absl::UnavailableError(what);
  }
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  return response;
}

}  // namespace cairn::internal_s3
