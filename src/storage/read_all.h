// Storage::ReadAll for a caller that puts bytes in front of the contents.
#ifndef CAIRN_STORAGE_READ_ALL_H_
#define CAIRN_STORAGE_READ_ALL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "cairn/storage.h"

namespace cairn::internal_storage {

// Storage::ReadAll's result and errors, in a string whose capacity has room
// for `room` bytes more, so that inserting that many at its front moves the
// contents instead of reallocating: the load sends metadata.json to every
// rank behind a message header (internal_comm::SealInPlace), and the
// 16k-rank FSDP simulation's is 988 MB.
absl::StatusOr<std::string> ReadAllWithRoom(Storage& storage,
                                            std::string_view name,
                                            uint64_t max_bytes, size_t room);

}  // namespace cairn::internal_storage

#endif  // CAIRN_STORAGE_READ_ALL_H_
