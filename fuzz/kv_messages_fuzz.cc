// What ranks send each other about key-value tables: the declarations
// behind a local save plan, the table parts behind a write report, and the
// coordinator's steps over several ranks' of them. Any bytes must decode
// to a value or an error, never a read outside the message; encoding what
// decoded is a fixed point; the coordinator's checks and its joining of
// the parts answer any decoded input with a result or an error, and a
// joined table holds exactly the rows of the parts it joined.
//
// Input: one byte choosing the step (taken modulo 4): 0 one declarations
// message, 1 one part message, 2 up to four ranks' declarations (records,
// fuzz_target.h) checked with CheckKvDeclarations, 3 up to four ranks'
// part messages joined with AssembleKvTables (a second byte: rank-local).
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/kv_table.h"
#include "cairn/metadata.h"
#include "checkpoint/kv_save.h"
#include "fuzz/fuzz_target.h"

namespace cairn::fuzz {
namespace {

using internal_checkpoint::AssembleKvTables;
using internal_checkpoint::CheckKvDeclarations;
using internal_checkpoint::DecodeKvDeclarations;
using internal_checkpoint::DecodeKvWritten;
using internal_checkpoint::EncodeKvDeclarations;
using internal_checkpoint::EncodeKvWritten;
using internal_checkpoint::KvDeclaration;
using internal_checkpoint::KvTablePart;
using internal_checkpoint::KvWritten;


KvTableSpec Spec() {
  KvTableSpec s;
  s.num_buckets = 4;
  s.bucketing = KvBucketing::kInterleaved;
  s.columns = {{"weight", DType::kBF16, 2}, {"count", DType::kI64, 1}};
  return s;
}

// Rank `rank` of two: buckets [2 rank, 2 rank + 2), `rows` rows a bucket,
// in one chunk of its file.
KvWritten Part(int rank, uint64_t rows) {
  KvTablePart p;
  p.fqn = "emb.user";
  p.spec = Spec();
  p.buckets = {2 * rank, 2 * rank + 2};
  p.rows_per_bucket = {rows, rows};
  KvChunkMetadata c;
  c.rows = {0, 2 * rows};
  const std::string file = absl::StrCat("data-0000", rank, "-kv0000-s.safetensors");
  c.ids = {file, 4096, 16 * rows, 0x1234, {}};
  c.columns = {{file, 4096 + 16 * rows, 8 * rows, 0x5678, {}},
               {file, 4096 + 24 * rows, 16 * rows, 0x9abc, {}}};
  p.chunks.push_back(c);
  KvWritten w;
  w.parts.push_back(p);
  w.bytes_written = 4096 + 40 * rows;
  return w;
}

std::string Tagged(char tag, std::string message) {
  return std::string(1, tag) + message;
}

std::vector<std::string> Seeds() {
  const std::vector<KvDeclaration> d0 = {{"emb.user", Spec(), {0, 2}}};
  const std::vector<KvDeclaration> d1 = {{"emb.user", Spec(), {2, 4}}};
  return {Tagged(0, EncodeKvDeclarations(d0)),
          Tagged(1, EncodeKvWritten(Part(0, 3))),
          Tagged(2, JoinRecords({EncodeKvDeclarations(d0),
                                 EncodeKvDeclarations(d1)})),
          Tagged(3, std::string(1, '\0') +
                        JoinRecords({EncodeKvWritten(Part(0, 3)),
                                     EncodeKvWritten(Part(1, 2))}))};
}

}  // namespace

CAIRN_FUZZ_TARGET(kv_messages, &Seeds) {
  if (data.empty()) return;
  const int step = static_cast<unsigned char>(data[0]) % 4;
  std::string_view rest = data.substr(1);
  switch (step) {
    case 0:
      CheckFixedPoint(
          rest,
          [](std::string_view m) { return DecodeKvDeclarations(m, "fuzz"); },
          [](const std::vector<KvDeclaration>& d) {
            return EncodeKvDeclarations(d);
          },
          "declarations");
      break;
    case 1:
      CheckFixedPoint(
          rest, [](std::string_view m) { return DecodeKvWritten(m, "fuzz"); },
          [](const KvWritten& w) { return EncodeKvWritten(w); }, "parts");
      break;
    case 2: {
      std::vector<std::vector<KvDeclaration>> per_rank;
      for (const std::string& m : SplitRecords(rest, 4)) {
        auto d = DecodeKvDeclarations(m, "fuzz");
        if (!d.ok()) return;
        per_rank.push_back(*std::move(d));
      }
      if (per_rank.empty()) return;
      for (bool coverage : {false, true}) {
        (void)CheckKvDeclarations(per_rank, Metadata{}, coverage);
      }
      break;
    }
    default: {
      if (rest.empty()) return;
      const bool rank_local = rest[0] % 2 == 1;
      std::vector<std::vector<KvTablePart>> per_rank;
      for (const std::string& m : SplitRecords(rest.substr(1), 4)) {
        auto w = DecodeKvWritten(m, "fuzz");
        if (!w.ok()) return;
        per_rank.push_back(std::move(w->parts));
      }
      if (per_rank.empty() || (rank_local && per_rank.size() != 1)) return;
      auto tables = AssembleKvTables(per_rank, rank_local);
      if (!tables.ok()) return;
      // A joined table holds the rows of the parts of its name.
      for (const auto& [fqn, t] : *tables) {
        uint64_t rows = 0;
        for (const auto& parts : per_rank) {
          for (const KvTablePart& p : parts) {
            if (p.fqn != fqn) continue;
            for (uint64_t n : p.rows_per_bucket) rows += n;
          }
        }
        CAIRN_FUZZ_CHECK(t.rows() == rows,
                         absl::StrCat("table ", fqn, " holds ", t.rows(),
                                      " rows, its parts ", rows));
      }
    }
  }
}

}  // namespace cairn::fuzz
