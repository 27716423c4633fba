// Where `cairn bench` writes its checkpoints: a local directory, or an
// object storage URL (s3://bucket/prefix, reached as Storage::Open reaches
// it: the AWS_* environment variables). The few operations the benchmark
// needs beyond cairn's own API, for both.
#ifndef CAIRN_TOOLS_BENCH_LOCATION_H_
#define CAIRN_TOOLS_BENCH_LOCATION_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cairn::tools {

// An s3:// (or other non-file) URL rather than a local path.
bool IsObjectStoreUrl(std::string_view url);

// "base/name".
std::string JoinLocation(std::string_view base, std::string_view name);

// Removes everything at `url` (a directory tree, or every object under the
// prefix); OK when there is nothing.
absl::Status RemoveLocation(const std::string& url);

struct LocationSize {
  uint64_t bytes = 0;
  int files = 0;
};
// The files (objects) at `url`, recursively, and their bytes.
absl::StatusOr<LocationSize> SizeOfLocation(const std::string& url);

// S3 requests this process has sent so far (0 without object storage).
uint64_t ObjectStoreRequests();

}  // namespace cairn::tools

#endif  // CAIRN_TOOLS_BENCH_LOCATION_H_
