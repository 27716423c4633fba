#include "bench_location.h"

#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/storage.h"
#include "core/status.h"
#include "storage/file_storage.h"
#include "storage/s3/s3_client.h"

namespace cairn::tools {

namespace fs = std::filesystem;

bool IsObjectStoreUrl(std::string_view url) {
  return !internal_storage::IsLocalUrl(url);
}

std::string JoinLocation(std::string_view base, std::string_view name) {
  return absl::StrCat(std::string(base), "/", std::string(name));
}

absl::Status RemoveLocation(const std::string& url) {
  if (!IsObjectStoreUrl(url)) {
    CAIRN_ASSIGN_OR_RETURN(const std::string path,
                           internal_storage::LocalPathOf(url));
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) return internal_core::StatusFromErrno(ec.value(), "remove", url);
    return absl::OkStatus();
  }
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, Storage::Open(url));
  CAIRN_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->List());
  for (const std::string& name : names) {
    CAIRN_RETURN_IF_ERROR(storage->Remove(name));
  }
  return storage->Sync();
}

absl::StatusOr<LocationSize> SizeOfLocation(const std::string& url) {
  LocationSize out;
  if (!IsObjectStoreUrl(url)) {
    CAIRN_ASSIGN_OR_RETURN(const std::string path,
                           internal_storage::LocalPathOf(url));
    std::error_code ec;
    for (fs::recursive_directory_iterator it(path, ec), end; !ec && it != end;
         it.increment(ec)) {
      if (it->is_regular_file(ec)) {
        out.bytes += it->file_size(ec);
        ++out.files;
      }
    }
    if (ec) return internal_core::StatusFromErrno(ec.value(), "list", url);
    return out;
  }
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, Storage::Open(url));
  CAIRN_ASSIGN_OR_RETURN(std::vector<std::string> names, storage->List());
  for (const std::string& name : names) {
    CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> f,
                           storage->OpenForRead(name));
    out.bytes += f->size();
    ++out.files;
  }
  return out;
}

uint64_t ObjectStoreRequests() {
  return internal_s3::ProcessS3Counters().requests.load();
}

}  // namespace cairn::tools
