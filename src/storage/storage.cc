// Storage::Open's scheme registry and the helpers every backend shares.
#include "cairn/storage.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "core/status.h"
#include "storage/file_storage.h"
#include "storage/read_all.h"
#include "storage/s3/s3_storage.h"

namespace cairn {
namespace {

struct Registry {
  absl::Mutex mu;
  std::map<std::string, Storage::Factory, std::less<>> factories
      ABSL_GUARDED_BY(mu);
};

// Constructed on first use, so backends may register from static
// initialisers in any order; never destroyed, so late users are safe.
Registry& GetRegistry() {
  static Registry* registry = new Registry;
  return *registry;
}

// The scheme of "scheme://rest" (RFC 3986: a letter, then letters, digits,
// '+', '-', '.'), or empty for a bare path.
std::string_view SchemeOf(std::string_view url) {
  const size_t colon = url.find("://");
  if (colon == std::string_view::npos || colon == 0) return {};
  const std::string_view scheme = url.substr(0, colon);
  if (!absl::ascii_isalpha(static_cast<unsigned char>(scheme[0]))) return {};
  for (char c : scheme) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '+' &&
        c != '-' && c != '.') {
      return {};
    }
  }
  return scheme;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Storage>> Storage::Open(
    std::string_view url, const StorageOptions& options) {
  internal_storage::RegisterFileStorage();
  internal_s3::RegisterS3Storage();
  if (url.empty()) return absl::InvalidArgumentError("empty storage URL");
  std::string_view scheme = SchemeOf(url);
  if (scheme.empty()) {
    if (url.find("://") != std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrFormat("malformed storage URL \"%s\"", url));
    }
    scheme = "file";  // A bare path, absolute or relative.
  }
  const std::string key = absl::AsciiStrToLower(std::string(scheme));
  Factory factory;
  {
    Registry& registry = GetRegistry();
    absl::MutexLock lock(&registry.mu);
    auto it = registry.factories.find(key);
    if (it == registry.factories.end()) {
      std::vector<std::string> known;
      for (const auto& [name, unused] : registry.factories) {
        known.push_back(name);
      }
      return absl::InvalidArgumentError(absl::StrFormat(
          "unknown storage scheme \"%s\" in URL \"%s\"; registered schemes: "
          "%s (or a bare path)",
          scheme, url, absl::StrJoin(known, ", ")));
    }
    factory = it->second;
  }
  // Called outside the lock: a factory may itself open other storages.
  return factory(url, options);
}

void Storage::RegisterScheme(std::string scheme, Factory factory) {
  Registry& registry = GetRegistry();
  absl::MutexLock lock(&registry.mu);
  // A later registration replaces an earlier one (tests can stub a scheme).
  registry.factories[absl::AsciiStrToLower(scheme)] = std::move(factory);
}

absl::Status Storage::CreateAtomically(std::string_view name,
                                       std::string_view contents) {
  CAIRN_ASSIGN_OR_RETURN(bool exists, Exists(name));
  if (exists) {
    return absl::AlreadyExistsError(
        absl::StrFormat("%s/%s already exists; not replaced", url(), name));
  }
  return WriteAtomically(name, contents);
}

absl::StatusOr<std::string> Storage::ReadAll(std::string_view name,
                                             uint64_t max_bytes) {
  return internal_storage::ReadAllWithRoom(*this, name, max_bytes, 0);
}

namespace internal_storage {

absl::StatusOr<std::string> ReadAllWithRoom(Storage& storage,
                                            std::string_view name,
                                            uint64_t max_bytes, size_t room) {
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file,
                         storage.OpenForRead(name));
  const uint64_t size = file->size();
  if (size > max_bytes) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s is %d bytes, more than the %d allowed", name, size, max_bytes));
  }
  std::string contents;
  contents.reserve(static_cast<size_t>(size) + room);
  contents.resize(static_cast<size_t>(size));
  CAIRN_RETURN_IF_ERROR(file->ReadAt(
      0, std::span<std::byte>(reinterpret_cast<std::byte*>(contents.data()),
                              contents.size())));
  return contents;
}

}  // namespace internal_storage
}  // namespace cairn
