#include "checkpoint/write_report.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/byte_codec.h"
#include "core/status.h"

namespace cairn::internal_checkpoint {

using internal_core::ByteReader;
using internal_core::ByteWriter;

std::string EncodeReport(const WriteReport& r) {
  ByteWriter w;
  w.Str(r.file);
  w.U64(r.file_size);
  w.U64(r.items.size());
  for (const WriteReport::Loc& l : r.items) {
    w.U64(l.offset);
    w.U64(l.nbytes);
    w.U32(l.crc32c);
  }
  w.U64(r.scalars.size());
  for (const auto& [fqn, v] : r.scalars) {
    w.Str(fqn);
    w.Scalar(v);
  }
  return w.Take();
}

absl::StatusOr<WriteReport> DecodeReport(std::string_view data, int rank) {
  ByteReader r(data, absl::StrCat("write report of rank ", rank));
  WriteReport out;
  out.file = r.Str();
  out.file_size = r.U64();
  const uint64_t n = r.Count(20);
  out.items.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    WriteReport::Loc l;
    l.offset = r.U64();
    l.nbytes = r.U64();
    l.crc32c = r.U32();
    out.items.push_back(l);
  }
  const uint64_t s = r.Count(9);
  for (uint64_t i = 0; i < s; ++i) {
    std::string fqn = r.Str();
    out.scalars[std::move(fqn)] = r.Scalar();
  }
  CAIRN_RETURN_IF_ERROR(r.status());
  return out;
}

}  // namespace cairn::internal_checkpoint
