#include "core/status.h"

#include <cerrno>
#include <cstring>

#include <string>

namespace cairn::internal_core {

absl::Status StatusFromErrno(int errno_value, std::string_view operation,
                             std::string_view path) {
  char buf[256];
  // GNU strerror_r returns a pointer that may or may not be `buf`.
  const char* text = strerror_r(errno_value, buf, sizeof(buf));
  std::string message =
      std::string(operation) + " " + std::string(path) + ": " + text;
  switch (errno_value) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EEXIST:
    case ENOTEMPTY:
      return absl::AlreadyExistsError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
    case ENOMEM:
    case EMFILE:
    case ENFILE:
    case EFBIG:
      return absl::ResourceExhaustedError(message);
    case EINVAL:
    case ENAMETOOLONG:
    case EISDIR:
      return absl::InvalidArgumentError(message);
    case EAGAIN:
    case EINTR:
    case EBUSY:
      return absl::UnavailableError(message);
    case EIO:
      return absl::DataLossError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), std::string(context) + ": " +
                                         std::string(status.message()));
}

}  // namespace cairn::internal_core
