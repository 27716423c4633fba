// The MPI entry points of a build without MPI (CAIRN_WITH_MPI=OFF), so that
// callers link either way and learn at run time what is missing.
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "cairn/communicator.h"

namespace cairn {
namespace {

absl::Status NoMpi() {
  return absl::UnimplementedError(
      "cairn was built without MPI (configure with -DCAIRN_WITH_MPI=ON)");
}

}  // namespace

bool HasMpi() { return false; }

absl::StatusOr<std::unique_ptr<Communicator>> MpiWorldCommunicator(
    const CommunicatorOptions& options) {
  return NoMpi();
}

absl::StatusOr<std::unique_ptr<Communicator>> MpiCommunicatorFromFortran(
    int64_t fortran_handle, const CommunicatorOptions& options) {
  return NoMpi();
}

}  // namespace cairn
