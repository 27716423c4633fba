#include "s3.h"

#include "convert.h"

#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "storage/s3/sigv4.h"

namespace cairn::python {
S3Options S3OptionsFrom(py::handle value) {
  if (!py::isinstance<py::dict>(value)) {
    throw py::type_error("option 's3' takes a dict of S3Options fields");
  }
  S3Options o;
  for (auto [k, v] : py::reinterpret_borrow<py::dict>(value)) {
    const std::string key = py::cast<std::string>(k);
    if (key == "endpoint") o.endpoint = OptionAs<std::string>(key, v, "s3 option");
    else if (key == "region") o.region = OptionAs<std::string>(key, v, "s3 option");
    else if (key == "access_key_id") o.access_key_id = OptionAs<std::string>(key, v, "s3 option");
    else if (key == "secret_access_key") o.secret_access_key = OptionAs<std::string>(key, v, "s3 option");
    else if (key == "session_token") o.session_token = OptionAs<std::string>(key, v, "s3 option");
    else if (key == "part_bytes") o.part_bytes = OptionAs<uint64_t>(key, v, "s3 option");
    else if (key == "threads") o.threads = OptionAs<int>(key, v, "s3 option");
    else if (key == "read_block_bytes") o.read_block_bytes = OptionAs<uint64_t>(key, v, "s3 option");
    else if (key == "max_attempts") o.max_attempts = OptionAs<int>(key, v, "s3 option");
    else if (key == "retry_base_delay_ms") o.retry_base_delay_ms = OptionAs<int>(key, v, "s3 option");
    else if (key == "connect_timeout_ms") o.connect_timeout_ms = OptionAs<int>(key, v, "s3 option");
    else if (key == "stall_timeout_ms") o.stall_timeout_ms = OptionAs<int>(key, v, "s3 option");
    else if (key == "addressing") {
      const std::string a = OptionAs<std::string>(key, v, "s3 option");
      if (a == "auto") o.addressing = S3Options::Addressing::kAuto;
      else if (a == "path") o.addressing = S3Options::Addressing::kPath;
      else if (a == "virtual") o.addressing = S3Options::Addressing::kVirtualHost;
      else throw py::value_error(absl::StrCat(
          "s3 option 'addressing' must be 'auto', 'path' or 'virtual', not '", a, "'"));
    } else {
      throw py::type_error(absl::StrCat("unexpected s3 option '", key, "'"));
    }
  }
  return o;
}

void RegisterS3(py::module_& m) {
  using Pairs = std::vector<std::pair<std::string, std::string>>;
  m.def(
      "_sigv4_sign",
      [](std::string method, std::string host, std::string path, Pairs query,
         Pairs headers, std::string payload_sha256, std::string access_key_id,
         std::string secret_access_key, std::string session_token,
         std::string region, std::string service, std::string amz_date) {
        internal_s3::SigningRequest r{std::move(method), std::move(host),
                                      std::move(path),   std::move(query),
                                      std::move(headers),
                                      std::move(payload_sha256)};
        absl::StatusOr<internal_s3::Headers> signed_headers =
            internal_s3::SignV4(r,
                                {std::move(access_key_id),
                                 std::move(secret_access_key),
                                 std::move(session_token)},
                                region, service, amz_date);
        if (!signed_headers.ok()) {
          throw py::value_error(std::string(signed_headers.status().message()));
        }
        return *std::move(signed_headers);
      },
      "SigV4-signs a request: the headers to send (tests).");
}

}  // namespace cairn::python
