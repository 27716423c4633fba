#include "storage/s3/sigv4.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace cairn::internal_s3 {
namespace {

using Digest = std::array<unsigned char, SHA256_DIGEST_LENGTH>;

Digest Hmac(std::string_view key, std::string_view data) {
  Digest out{};
  unsigned int n = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(),
       out.data(), &n);
  return out;
}

std::string_view AsView(const Digest& d) {
  return std::string_view(reinterpret_cast<const char*>(d.data()), d.size());
}

// A header value as SigV4 canonicalizes it: outer spaces trimmed, inner
// runs of spaces one.
std::string TrimValue(std::string_view v) {
  std::string out;
  bool space = false;
  for (char c : v) {
    if (c == ' ' || c == '\t') {
      space = true;
      continue;
    }
    if (space && !out.empty()) out.push_back(' ');
    space = false;
    out.push_back(c);
  }
  return out;
}

bool HasControl(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return (u < 0x20 && c != '\t') || u == 0x7f;
  });
}

// A valid x-amz-date: YYYYMMDD'T'HHMMSS'Z'.
bool ValidDate(std::string_view d) {
  if (d.size() != 16 || d[8] != 'T' || d[15] != 'Z') return false;
  for (size_t i = 0; i < 15; ++i) {
    if (i != 8 && !absl::ascii_isdigit(static_cast<unsigned char>(d[i]))) {
      return false;
    }
  }
  return true;
}

}  // namespace

std::string UriEncode(std::string_view s, bool keep_slash) {
  static constexpr char kDigits[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (absl::ascii_isalnum(u) || c == '-' || c == '.' || c == '_' ||
        c == '~' || (keep_slash && c == '/')) {
      out.push_back(c);
    } else {
      out.push_back('%');
      out.push_back(kDigits[u >> 4]);
      out.push_back(kDigits[u & 15]);
    }
  }
  return out;
}

std::string Sha256Hex(std::span<const std::byte> data) {
  Digest d{};
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(),
         d.data());
  return absl::BytesToHexString(std::string(AsView(d)));
}

std::string Sha256Hex(std::string_view data) {
  return Sha256Hex(std::as_bytes(std::span(data.data(), data.size())));
}

std::string CanonicalRequest(const SigningRequest& request,
                             const Headers& signed_headers) {
  std::vector<std::pair<std::string, std::string>> query;
  query.reserve(request.query.size());
  for (const auto& [k, v] : request.query) {
    query.emplace_back(UriEncode(k, false), UriEncode(v, false));
  }
  std::sort(query.begin(), query.end());
  std::vector<std::string> parts;
  parts.reserve(query.size());
  for (const auto& [k, v] : query) parts.push_back(absl::StrCat(k, "=", v));
  std::string out = absl::StrCat(
      request.method, "\n",
      UriEncode(request.path.empty() ? "/" : request.path, true), "\n",
      absl::StrJoin(parts, "&"), "\n");
  std::vector<std::string> names;
  for (const auto& [name, value] : signed_headers) {
    absl::StrAppend(&out, name, ":", value, "\n");
    names.push_back(name);
  }
  absl::StrAppend(&out, "\n", absl::StrJoin(names, ";"), "\n",
                  request.payload_sha256);
  return out;
}

absl::StatusOr<Headers> SignV4(const SigningRequest& request,
                               const Credentials& credentials,
                               std::string_view region,
                               std::string_view service,
                               std::string_view amz_date) {
  if (!ValidDate(amz_date)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "SigV4: x-amz-date %s is not YYYYMMDDTHHMMSSZ", amz_date));
  }
  if (region.empty() || service.empty()) {
    return absl::InvalidArgumentError("SigV4: empty region or service");
  }
  if (credentials.access_key_id.empty() ||
      credentials.secret_access_key.empty()) {
    return absl::InvalidArgumentError(
        "SigV4: no access key id or secret access key");
  }
  if (request.payload_sha256.empty()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "SigV4: %s %s has no payload hash", request.method, request.path));
  }
  // Canonical headers: names lower-case, sorted, values trimmed; repeated
  // names joined with commas.
  std::map<std::string, std::string> canonical;
  auto add = [&](std::string_view name, std::string_view value) -> absl::Status {
    if (name.empty() || HasControl(name) || HasControl(value)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "SigV4: header %s of %s %s has an empty name or a control "
          "character",
          absl::CEscape(std::string(name)), request.method, request.path));
    }
    std::string key = absl::AsciiStrToLower(std::string(name));
    std::string trimmed = TrimValue(value);
    auto [it, inserted] = canonical.emplace(key, trimmed);
    if (!inserted) absl::StrAppend(&it->second, ",", trimmed);
    return absl::OkStatus();
  };
  for (const auto& [name, value] : request.headers) {
    const std::string lower = absl::AsciiStrToLower(name);
    if (lower == "host" || lower == "x-amz-date" || lower == "authorization" ||
        lower == "x-amz-content-sha256" || lower == "x-amz-security-token") {
      return absl::InvalidArgumentError(absl::StrFormat(
          "SigV4: header %s is the signer's to set", name));
    }
    CAIRN_RETURN_IF_ERROR(add(name, value));
  }
  Headers out;
  auto own = [&](std::string name, std::string value) -> absl::Status {
    out.emplace_back(name, value);
    return add(name, value);
  };
  CAIRN_RETURN_IF_ERROR(own("host", request.host));
  CAIRN_RETURN_IF_ERROR(own("x-amz-content-sha256", request.payload_sha256));
  CAIRN_RETURN_IF_ERROR(own("x-amz-date", std::string(amz_date)));
  if (!credentials.session_token.empty()) {
    CAIRN_RETURN_IF_ERROR(
        own("x-amz-security-token", credentials.session_token));
  }
  const Headers signed_headers(canonical.begin(), canonical.end());
  const std::string canonical_request =
      CanonicalRequest(request, signed_headers);
  const std::string date(amz_date.substr(0, 8));
  const std::string scope = absl::StrCat(date, "/", std::string(region), "/",
                                         std::string(service), "/aws4_request");
  const std::string to_sign =
      absl::StrCat("AWS4-HMAC-SHA256\n", std::string(amz_date), "\n", scope,
                   "\n", Sha256Hex(canonical_request));
  const Digest k_date =
      Hmac(absl::StrCat("AWS4", credentials.secret_access_key), date);
  const Digest k_region = Hmac(AsView(k_date), region);
  const Digest k_service = Hmac(AsView(k_region), service);
  const Digest k_signing = Hmac(AsView(k_service), "aws4_request");
  const Digest signature = Hmac(AsView(k_signing), to_sign);
  std::vector<std::string> names;
  for (const auto& [name, value] : signed_headers) names.push_back(name);
  out.emplace_back(
      "authorization",
      absl::StrCat("AWS4-HMAC-SHA256 Credential=", credentials.access_key_id,
                   "/", scope, ", SignedHeaders=", absl::StrJoin(names, ";"),
                   ", Signature=",
                   absl::BytesToHexString(std::string(AsView(signature)))));
  return out;
}

}  // namespace cairn::internal_s3
