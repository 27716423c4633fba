// A rank's write report: what it tells the coordinator at commit (its data
// file, the file's size, where each item of its final plan landed, and the
// scalars its plan left out). save.cc sends and reads it; the scale
// simulator (bench/scale) decodes the same bytes.
#ifndef CAIRN_CHECKPOINT_WRITE_REPORT_H_
#define CAIRN_CHECKPOINT_WRITE_REPORT_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cairn/state_dict.h"

namespace cairn::internal_checkpoint {

struct WriteReport {
  std::string file;  // empty: no file
  uint64_t file_size = 0;
  struct Loc {
    uint64_t offset;
    uint64_t nbytes;
    uint32_t crc32c;
  };
  std::vector<Loc> items;  // in final-plan order
  std::map<std::string, Scalar> scalars;
};

std::string EncodeReport(const WriteReport& r);

// Bounds-checked; errors name "write report of rank <rank>".
absl::StatusOr<WriteReport> DecodeReport(std::string_view data, int rank);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_WRITE_REPORT_H_
