"""cairn's exceptions: one class per kind of failure, each keeping the C++
library's message (which names the FQN, file, offset or rank).

Every class derives from :class:`cairn.Error`; where a built-in exception
means the same thing, the class derives from it too, so ``except
FileExistsError`` or ``except TimeoutError`` catch cairn's as well.
"""

from . import _cairn


class Error(Exception):
    """A cairn operation failed. ``code`` names the kind (absl's code)."""

    code = "UNKNOWN"


class InvalidArgumentError(Error, ValueError):
    """A bad argument or a bad state dict (names the FQN)."""

    code = "INVALID_ARGUMENT"


class NotFoundError(Error, LookupError):
    """No committed checkpoint at the path, or (strict load) a key it lacks."""

    code = "NOT_FOUND"


class AlreadyExistsError(Error, FileExistsError):
    """A committed checkpoint is already there (pass overwrite=True)."""

    code = "ALREADY_EXISTS"


class PermissionDeniedError(Error, PermissionError):
    code = "PERMISSION_DENIED"


class DataLossError(Error):
    """The checkpoint is damaged: a checksum, size or header does not match."""

    code = "DATA_LOSS"


class FailedPreconditionError(Error):
    """The checkpoint and the destination disagree (dtype, shape, kind)."""

    code = "FAILED_PRECONDITION"


class AbortedError(Error):
    """Another rank failed, or another save holds the folder's lock."""

    code = "ABORTED"


class DeadlineExceededError(Error, TimeoutError):
    """Ranks did not arrive at a collective in time (names them)."""

    code = "DEADLINE_EXCEEDED"


class ResourceExhaustedError(Error):
    code = "RESOURCE_EXHAUSTED"


class UnimplementedError(Error, NotImplementedError):
    code = "UNIMPLEMENTED"


class OutOfRangeError(Error):
    code = "OUT_OF_RANGE"


class InternalError(Error):
    code = "INTERNAL"


class UnavailableError(Error):
    code = "UNAVAILABLE"


class CancelledError(Error):
    code = "CANCELLED"


# absl::StatusCode values.
_BY_CODE = {
    -1: Error,
    1: CancelledError,
    2: Error,
    3: InvalidArgumentError,
    4: DeadlineExceededError,
    5: NotFoundError,
    6: AlreadyExistsError,
    7: PermissionDeniedError,
    8: ResourceExhaustedError,
    9: FailedPreconditionError,
    10: AbortedError,
    11: OutOfRangeError,
    12: UnimplementedError,
    13: InternalError,
    14: UnavailableError,
    15: DataLossError,
}
_cairn._error_types.update(_BY_CODE)
