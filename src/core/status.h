// Status helpers used everywhere inside cairn.
#ifndef CAIRN_CORE_STATUS_H_
#define CAIRN_CORE_STATUS_H_

#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define CAIRN_STATUS_CONCAT_INNER_(a, b) a##b
#define CAIRN_STATUS_CONCAT_(a, b) CAIRN_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define CAIRN_RETURN_IF_ERROR(expr)                     \
  do {                                                  \
    if (::absl::Status cairn_status_ = (expr);          \
        !cairn_status_.ok()) {                          \
      return cairn_status_;                             \
    }                                                   \
  } while (0)

// `lhs = value of expr` (an absl::StatusOr<T>), or returns its error.
#define CAIRN_ASSIGN_OR_RETURN(lhs, expr) \
  CAIRN_ASSIGN_OR_RETURN_IMPL_(CAIRN_STATUS_CONCAT_(cairn_so_, __LINE__), lhs, expr)
#define CAIRN_ASSIGN_OR_RETURN_IMPL_(so, lhs, expr) \
  auto so = (expr);                                 \
  if (!so.ok()) return std::move(so).status();      \
  lhs = std::move(so).value()

namespace cairn::internal_core {

// The one place errno becomes a Status: "open /ckpt/x: No such file or
// directory", with the code errno implies (ENOENT -> kNotFound, EEXIST ->
// kAlreadyExists, ENOSPC -> kResourceExhausted, EACCES -> kPermissionDenied,
// EINVAL -> kInvalidArgument, others kInternal... see status.cc).
absl::Status StatusFromErrno(int errno_value, std::string_view operation,
                             std::string_view path);

// `status` with "context: " put in front of its message; same code. OK stays
// OK.
absl::Status Annotate(const absl::Status& status, std::string_view context);

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_STATUS_H_
