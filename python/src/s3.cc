#include "s3.h"

#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "storage/s3/sigv4.h"

namespace cairn::python {

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
