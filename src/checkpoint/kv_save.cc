// Saving key-value tables: the declarations and their checks (step 1), the
// messages, and the coordinator's assembly of the ranks' parts (step 5).
// The write itself (step 4) is kv_write.cc. See kv_save.h.
#include "checkpoint/kv_save.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "cairn/metadata.h"
#include "core/byte_codec.h"
#include "core/status.h"
#include "kv/kv_metadata.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::ByteReader;
using internal_core::ByteWriter;

void PutSpec(ByteWriter& w, const KvTableSpec& spec) {
  w.I64(spec.num_buckets);
  w.U8(static_cast<uint8_t>(spec.bucketing));
  w.I64(spec.bucket_size);
  w.U64(spec.columns.size());
  for (const KvColumn& c : spec.columns) {
    w.Str(c.name);
    w.U8(static_cast<uint8_t>(c.dtype));
    w.I64(c.width);
  }
}

KvTableSpec GetSpec(ByteReader& r) {
  KvTableSpec spec;
  spec.num_buckets = r.I64();
  const uint8_t mode = r.U8();
  if (mode > static_cast<uint8_t>(KvBucketing::kInterleaved)) {
    r.Fail("unknown bucketing");
  }
  spec.bucketing = static_cast<KvBucketing>(mode);
  spec.bucket_size = r.I64();
  const uint64_t n = r.Count(10);
  for (uint64_t i = 0; i < n && !r.failed(); ++i) {
    KvColumn c;
    c.name = r.Str();
    const uint8_t dtype = r.U8();
    if (dtype >= AllDTypes().size()) r.Fail("unknown dtype");
    c.dtype = static_cast<DType>(dtype);
    c.width = r.I64();
    spec.columns.push_back(std::move(c));
  }
  return spec;
}

// What a declaration and a part both open with: the table's FQN, spec and
// the rank's buckets.
void PutTable(ByteWriter& w, const std::string& fqn, const KvTableSpec& spec,
              KvBucketRange buckets) {
  w.Str(fqn);
  PutSpec(w, spec);
  w.I64(buckets.begin);
  w.I64(buckets.end);
}

void GetTable(ByteReader& r, std::string& fqn, KvTableSpec& spec,
              KvBucketRange& buckets) {
  fqn = r.Str();
  spec = GetSpec(r);
  buckets.begin = r.I64();
  buckets.end = r.I64();
  if (r.failed()) return;
  // Checked as anything read from elsewhere: the coordinator sorts and
  // subtracts these ranges and sizes rows by the spec.
  if (fqn.empty()) return r.Fail("a key-value table without a name");
  if (absl::Status s = ValidateKvTableSpec(fqn, spec); !s.ok()) {
    return r.Fail(std::string(s.message()));
  }
  if (buckets.begin < 0 || buckets.end < buckets.begin ||
      buckets.end > spec.num_buckets) {
    r.Fail(absl::StrFormat("key-value table %s: buckets %s are not a range "
                           "of its %d",
                           fqn, KvRangeText(buckets), spec.num_buckets));
  }
}

void PutLocation(ByteWriter& w, const ByteLocation& loc) {
  w.Str(loc.file);
  w.U64(loc.offset);
  w.U64(loc.nbytes);
  w.U32(loc.crc32c);
  w.U64(loc.block_crc32c.size());
  for (uint32_t c : loc.block_crc32c) w.U32(c);
}

ByteLocation GetLocation(ByteReader& r) {
  ByteLocation loc;
  loc.file = r.Str();
  loc.offset = r.U64();
  loc.nbytes = r.U64();
  loc.crc32c = r.U32();
  const uint64_t n = r.Count(4);
  loc.block_crc32c.reserve(n);
  for (uint64_t i = 0; i < n && !r.failed(); ++i) {
    loc.block_crc32c.push_back(r.U32());
  }
  return loc;
}

}  // namespace

std::string KvRangeText(KvBucketRange r) {
  return absl::StrFormat("[%d, %d)", r.begin, r.end);
}

absl::StatusOr<std::vector<KvDeclaration>> DeclareKvTables(
    const SaveOptions& options, int world, int rank) {
  std::vector<KvDeclaration> out;
  std::set<std::string_view> seen;
  for (const KvTableToSave& t : options.kv_tables) {
    auto bad = [&](std::string_view why) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "save: key-value table \"%s\" on rank %d: %s", t.fqn, rank, why));
    };
    if (t.fqn.empty()) return bad("the FQN is empty");
    if (!seen.insert(t.fqn).second) return bad("listed twice");
    CAIRN_RETURN_IF_ERROR(ValidateKvTableSpec(t.fqn, t.spec));
    const KvBucketRange b =
        t.buckets ? *t.buckets
                  : KvBucketsOfRank(t.spec.num_buckets, world, rank);
    if (b.begin < 0 || b.end < b.begin || b.end > t.spec.num_buckets) {
      return bad(absl::StrFormat("buckets %s are not a range of its %d",
                                 KvRangeText(b), t.spec.num_buckets));
    }
    if (b.size() > 0 && t.source == nullptr) {
      return bad(absl::StrFormat("buckets %s but no source", KvRangeText(b)));
    }
    out.push_back({t.fqn, t.spec, b});
  }
  if (!out.empty() && options.kv_chunk_bytes == 0) {
    return absl::InvalidArgumentError("save: kv_chunk_bytes must be positive");
  }
  return out;
}

std::string EncodeKvDeclarations(const std::vector<KvDeclaration>& tables) {
  ByteWriter w;
  w.U64(tables.size());
  for (const KvDeclaration& t : tables) PutTable(w, t.fqn, t.spec, t.buckets);
  return w.Take();
}

absl::StatusOr<std::vector<KvDeclaration>> DecodeKvDeclarations(
    std::string_view bytes, std::string what) {
  ByteReader r(bytes, std::move(what));
  std::vector<KvDeclaration> out;
  const uint64_t n = r.Count(8);
  for (uint64_t i = 0; i < n && !r.failed(); ++i) {
    KvDeclaration t;
    GetTable(r, t.fqn, t.spec, t.buckets);
    out.push_back(std::move(t));
  }
  CAIRN_RETURN_IF_ERROR(r.status());
  return out;
}

absl::Status CheckKvDeclarations(
    const std::vector<std::vector<KvDeclaration>>& per_rank,
    const Metadata& skeleton, bool require_coverage,
    std::string_view operation) {
  if (per_rank.empty()) return absl::OkStatus();
  auto bad = [&](std::string_view fqn, std::string_view why) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: key-value table \"%s\": %s", operation, fqn, why));
  };
  // Rank 0's list is the reference; each table's ranges by rank.
  std::map<std::string, std::pair<const KvDeclaration*,
                                  std::vector<std::pair<KvBucketRange, int>>>>
      tables;
  for (const KvDeclaration& t : per_rank[0]) tables[t.fqn].first = &t;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    if (per_rank[r].size() != tables.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: rank %d lists %d key-value tables, rank 0 lists %d; every "
          "rank lists every table (a rank without rows gives empty buckets)",
          operation, r, per_rank[r].size(), tables.size()));
    }
    for (const KvDeclaration& t : per_rank[r]) {
      auto it = tables.find(t.fqn);
      if (it == tables.end()) {
        return bad(t.fqn, absl::StrFormat("listed by rank %d but not by rank 0",
                                          r));
      }
      if (!(t.spec == it->second.first->spec)) {
        return bad(t.fqn, absl::StrFormat("ranks 0 and %d give different "
                                          "specs (buckets, bucketing or "
                                          "columns)",
                                          r));
      }
      it->second.second.emplace_back(t.buckets, static_cast<int>(r));
    }
  }
  for (auto& [fqn, entry] : tables) {
    if (skeleton.tensors.contains(fqn) || skeleton.objects.contains(fqn) ||
        skeleton.scalars.contains(fqn)) {
      return bad(fqn, "it names both a key-value table and a leaf of the "
                      "state dict");
    }
    if (!require_coverage) continue;
    auto& ranges = entry.second;
    std::erase_if(ranges, [](const auto& p) { return p.first.size() == 0; });
    std::sort(ranges.begin(), ranges.end(), [](const auto& a, const auto& b) {
      return a.first.begin < b.first.begin;
    });
    int64_t next = 0;
    int prev_rank = -1;
    for (const auto& [range, r] : ranges) {
      if (range.begin < next) {
        return bad(fqn, absl::StrFormat("buckets %s of rank %d overlap those "
                                        "of rank %d; each bucket is saved by "
                                        "one rank",
                                        KvRangeText(range), r, prev_rank));
      }
      if (range.begin > next) {
        return bad(fqn, absl::StrFormat("no rank saves buckets %s",
                                        KvRangeText({next, range.begin})));
      }
      next = range.end;
      prev_rank = r;
    }
    const int64_t b = entry.first->spec.num_buckets;
    if (next != b) {
      return bad(fqn, absl::StrFormat("no rank saves buckets %s",
                                      KvRangeText({next, b})));
    }
  }
  return absl::OkStatus();
}

std::vector<KvChunkStart> KvChunkStarts(const KvTableMetadata& md) {
  std::vector<KvChunkStart> out;
  out.reserve(md.chunks.size());
  size_t b = 0;          // a held bucket
  uint64_t first = 0;    // its first row
  for (const KvChunkMetadata& c : md.chunks) {
    // The bucket holding row c.rows.begin: skip those that end before it.
    while (b < md.rows_per_bucket.size() &&
           first + md.rows_per_bucket[b] <= c.rows.begin) {
      first += md.rows_per_bucket[b];
      ++b;
    }
    out.push_back({md.buckets.begin + static_cast<int64_t>(b),
                   c.rows.begin - first});
  }
  return out;
}

std::string EncodeKvWritten(const KvWritten& written) {
  const std::vector<KvTablePart>& parts = written.parts;
  ByteWriter w;
  w.U64(written.bytes_written);
  w.U64(parts.size());
  for (const KvTablePart& p : parts) {
    PutTable(w, p.fqn, p.spec, p.buckets);
    w.U64(p.rows_per_bucket.size());
    for (uint64_t n : p.rows_per_bucket) w.U64(n);
    w.U64(p.chunks.size());
    for (const KvChunkMetadata& c : p.chunks) {
      w.U64(c.rows.begin);
      w.U64(c.rows.end);
      PutLocation(w, c.ids);
      w.U64(c.columns.size());
      for (const ByteLocation& loc : c.columns) PutLocation(w, loc);
    }
  }
  return w.Take();
}

absl::StatusOr<KvWritten> DecodeKvWritten(std::string_view bytes,
                                          std::string what) {
  ByteReader r(bytes, std::move(what));
  KvWritten written;
  written.bytes_written = r.U64();
  std::vector<KvTablePart>& parts = written.parts;
  const uint64_t n = r.Count(8);
  for (uint64_t i = 0; i < n && !r.failed(); ++i) {
    KvTablePart p;
    GetTable(r, p.fqn, p.spec, p.buckets);
    const uint64_t counts = r.Count(8);
    p.rows_per_bucket.reserve(counts);
    for (uint64_t b = 0; b < counts && !r.failed(); ++b) {
      p.rows_per_bucket.push_back(r.U64());
    }
    if (!r.failed() && counts != static_cast<uint64_t>(p.buckets.size())) {
      r.Fail(absl::StrFormat("key-value table %s: %d row counts for buckets "
                             "%s",
                             p.fqn, counts, KvRangeText(p.buckets)));
    }
    const uint64_t chunks = r.Count(16);
    for (uint64_t k = 0; k < chunks && !r.failed(); ++k) {
      KvChunkMetadata c;
      c.rows.begin = r.U64();
      c.rows.end = r.U64();
      c.ids = GetLocation(r);
      const uint64_t columns = r.Count(8);
      for (uint64_t j = 0; j < columns && !r.failed(); ++j) {
        c.columns.push_back(GetLocation(r));
      }
      p.chunks.push_back(std::move(c));
    }
    parts.push_back(std::move(p));
  }
  CAIRN_RETURN_IF_ERROR(r.status());
  return written;
}

absl::StatusOr<std::map<std::string, KvTableMetadata>> AssembleKvTables(
    const std::vector<std::vector<KvTablePart>>& per_rank, bool rank_local) {
  // Each table's non-empty parts, in bucket order.
  std::map<std::string, std::vector<const KvTablePart*>> parts;
  for (const std::vector<KvTablePart>& mine : per_rank) {
    for (const KvTablePart& p : mine) {
      auto& list = parts[p.fqn];
      if (rank_local || p.buckets.size() > 0) list.push_back(&p);
    }
  }
  std::map<std::string, KvTableMetadata> out;
  for (auto& [fqn, list] : parts) {
    std::sort(list.begin(), list.end(), [](const auto* a, const auto* b) {
      return a->buckets.begin < b->buckets.begin;
    });
    KvTableMetadata md;
    if (list.empty()) {
      return absl::InternalError(absl::StrFormat(
          "save: key-value table \"%s\": no rank reported its buckets", fqn));
    }
    md.spec = list.front()->spec;
    md.buckets = rank_local ? list.front()->buckets
                            : KvBucketRange{0, md.spec.num_buckets};
    uint64_t rows = 0;
    for (const KvTablePart* p : list) {
      md.rows_per_bucket.insert(md.rows_per_bucket.end(),
                                p->rows_per_bucket.begin(),
                                p->rows_per_bucket.end());
      for (KvChunkMetadata c : p->chunks) {
        c.rows.begin += rows;
        c.rows.end += rows;
        md.chunks.push_back(std::move(c));
      }
      for (uint64_t n : p->rows_per_bucket) rows += n;
    }
    if (absl::Status s = internal_kv::ValidateKvTableMetadata(fqn, md);
        !s.ok()) {
      return absl::InternalError(
          absl::StrCat("save: the ranks' parts do not make a table: ",
                       s.message()));
    }
    out.emplace(fqn, std::move(md));
  }
  return out;
}

void PrefixKvFiles(std::map<std::string, KvTableMetadata>& tables,
                   std::string_view folder) {
  for (auto& [fqn, table] : tables) {
    for (KvChunkMetadata& chunk : table.chunks) {
      chunk.ids.file = absl::StrFormat("%s/%s", folder, chunk.ids.file);
      for (ByteLocation& c : chunk.columns) {
        c.file = absl::StrFormat("%s/%s", folder, c.file);
      }
    }
  }
}

absl::StatusOr<std::map<std::string, KvTableMetadata>> MergeKvTables(
    const std::vector<const Metadata*>& ranks, const Metadata& leaves) {
  std::vector<std::vector<KvDeclaration>> declared(ranks.size());
  std::vector<std::vector<KvTablePart>> parts(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const auto& [fqn, t] : ranks[r]->kv_tables) {
      declared[r].push_back({fqn, t.spec, t.buckets});
      parts[r].push_back({fqn, t.spec, t.buckets, t.rows_per_bucket, t.chunks});
    }
  }
  CAIRN_RETURN_IF_ERROR(CheckKvDeclarations(declared, leaves,
                                            /*require_coverage=*/true,
                                            "merge"));
  return AssembleKvTables(parts, /*rank_local=*/false);
}

}  // namespace cairn::internal_checkpoint
