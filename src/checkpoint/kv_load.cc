// Loading key-value tables into their sinks (kv_load.h): the requests'
// planning, the direct load of a rank's own buckets, and the routed load
// into another bucketing.
#include "checkpoint/kv_load.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/communicator.h"
#include "cairn/dtype.h"
#include "cairn/kv_table.h"
#include "cairn/metadata.h"
#include "cairn/tensor.h"
#include "checkpoint/kv_read.h"
#include "checkpoint/kv_save.h"
#include "comm/collective.h"
#include "core/byte_codec.h"
#include "core/status.h"
#include "kv/kv_metadata.h"

namespace cairn::internal_checkpoint {
namespace {

using internal_core::Annotate;
using internal_core::ByteReader;
using internal_core::ByteWriter;

// Bytes of ids and columns a load reads at a time, per table and rank.
uint64_t PieceBytes(const LoadOptions& options) {
  constexpr uint64_t kMin = uint64_t{1} << 20;
  constexpr uint64_t kMax = uint64_t{64} << 20;
  if (options.memory_budget_bytes == 0) return kMax;
  return std::clamp(options.memory_budget_bytes / 4, kMin, kMax);
}

uint64_t RowBytes(const KvTableSpec& spec, const std::vector<int>& columns) {
  uint64_t bytes = 8;
  for (int j : columns) {
    bytes += static_cast<uint64_t>(spec.columns[j].width) *
             DTypeSize(spec.columns[j].dtype);
  }
  return bytes;
}

uint64_t ColumnRowBytes(const KvColumn& c) {
  return static_cast<uint64_t>(c.width) * DTypeSize(c.dtype);
}

// `n` rows to the sink: their ids and, per requested column, a pointer to
// the first row's bytes (rows contiguous). `from` says where the rows came
// from in an error.
absl::Status ApplyToSink(const KvRequest& r, const int64_t* ids, uint64_t n,
                         std::span<const std::byte* const> columns,
                         std::string_view from, int rank,
                         LoadResult& result) {
  std::vector<TensorView> views;
  for (size_t j = 0; j < r.columns.size(); ++j) {
    const KvColumn& col = r.stored->spec.columns[r.columns[j]];
    views.emplace_back(const_cast<std::byte*>(columns[j]), col.dtype,
                       Shape{static_cast<int64_t>(n), col.width});
  }
  absl::Status s = r.sink->Apply(std::span<const int64_t>(ids, n), views);
  if (!s.ok()) {
    return Annotate(s, absl::StrFormat(
                           "load: the sink of key-value table \"%s\" on rank "
                           "%d failed on %d rows %s",
                           r.fqn, rank, n, from));
  }
  result.kv_rows += n;
  result.bytes_loaded += n * RowBytes(r.stored->spec, r.columns);
  return absl::OkStatus();
}

// The rank's own buckets, in the saved bucketing: the pieces of their rows
// read in order, the next while the sink takes this one.
absl::Status LoadDirect(Storage& storage, const Metadata& metadata,
                        const KvRequest& r, const LoadOptions& options,
                        int rank, LoadResult& result) {
  CAIRN_ASSIGN_OR_RETURN(internal_kv::KvChunkSpan span,
                         internal_kv::KvChunksOfBuckets(*r.stored, r.buckets));
  const std::vector<KvPiece> pieces =
      KvPiecesOf(*r.stored, span.first, span.last, span.rows,
                 RowBytes(r.stored->spec, r.columns), PieceBytes(options));
  KvPieceReader reader(storage, r.fqn, *r.stored,
                       metadata.crc32c_block_bytes, r.columns,
                       options.verify_checksums);
  auto read = [&](size_t i) { return reader.Read(pieces[i]); };
  std::future<absl::StatusOr<KvPieceBytes>> next;
  if (!pieces.empty()) next = std::async(std::launch::async, read, 0);
  for (size_t i = 0; i < pieces.size(); ++i) {
    absl::StatusOr<KvPieceBytes> p = next.get();
    if (i + 1 < pieces.size()) {
      next = std::async(std::launch::async, read, i + 1);
    }
    CAIRN_RETURN_IF_ERROR(Annotate(
        p.status(), absl::StrFormat("load: rank %d", rank)));
    result.bytes_read += p->bytes_read;
    CAIRN_RETURN_IF_ERROR(ApplyToSink(
        r, p->ids, p->piece.rows(), p->columns,
        absl::StrFormat("of chunk %d", p->piece.chunk), rank, result));
    reader.Recycle(*std::move(p));
  }
  return absl::OkStatus();
}

// One rank's request for a table, as the ranks exchange it.
struct Wanted {
  bool ok = true;  // the rank has not failed
  bool wants = false;
  bool same = true;
  KvTableSpec dest;  // bucketing only
  KvBucketRange buckets;
  std::vector<int> columns;
};

std::string EncodeWanted(bool ok, const KvRequest* r) {
  ByteWriter w;
  w.U8(ok ? 1 : 0);
  w.U8(r != nullptr ? 1 : 0);
  if (r != nullptr) {
    w.U8(r->same_bucketing ? 1 : 0);
    w.I64(r->dest.num_buckets);
    w.U8(static_cast<uint8_t>(r->dest.bucketing));
    w.I64(r->dest.bucket_size);
    w.I64(r->buckets.begin);
    w.I64(r->buckets.end);
    w.U64(r->columns.size());
    for (int c : r->columns) w.U64(static_cast<uint64_t>(c));
  }
  return w.Take();
}

absl::StatusOr<Wanted> DecodeWanted(std::string_view bytes, int rank,
                                    size_t stored_columns) {
  ByteReader in(bytes, absl::StrCat("rank ", rank, "'s key-value request"));
  Wanted w;
  w.ok = in.U8() == 1;
  w.wants = in.U8() == 1;
  if (w.wants) {
    w.same = in.U8() == 1;
    w.dest.num_buckets = in.I64();
    const uint8_t mode = in.U8();
    if (mode > 1) in.Fail("unknown bucketing");
    w.dest.bucketing = static_cast<KvBucketing>(mode);
    w.dest.bucket_size = in.I64();
    w.buckets.begin = in.I64();
    w.buckets.end = in.I64();
    const uint64_t n = in.Count(8);
    for (uint64_t i = 0; i < n && !in.failed(); ++i) {
      const uint64_t c = in.U64();
      if (c >= stored_columns) in.Fail("column out of range");
      w.columns.push_back(static_cast<int>(c));
    }
  }
  CAIRN_RETURN_IF_ERROR(in.status());
  return w;
}

// The ranks that want rows of a destination bucket: the wanting ranks
// grouped by bucketing, and in each by bucket range (ranks with the same
// range are replicas: each gets every row of it).
class Owners {
 public:
  absl::Status Build(std::string_view fqn, const std::vector<Wanted>& all) {
    for (size_t r = 0; r < all.size(); ++r) {
      const Wanted& w = all[r];
      if (!w.wants || w.buckets.size() <= 0) continue;
      Group* g = nullptr;
      for (Group& e : groups_) {
        if (e.spec.num_buckets == w.dest.num_buckets &&
            e.spec.bucketing == w.dest.bucketing &&
            e.spec.bucket_size == w.dest.bucket_size) {
          g = &e;
        }
      }
      if (g == nullptr) {
        groups_.emplace_back();
        g = &groups_.back();
        g->spec = w.dest;
      }
      g->ranges[{w.buckets.begin, w.buckets.end}].push_back(
          static_cast<int>(r));
    }
    for (Group& g : groups_) {
      int64_t end = 0;
      for (const auto& [range, ranks] : g.ranges) {
        if (range.first < end) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "load: key-value table \"%s\": ranks %s and others want "
              "overlapping but different bucket ranges (ranks that share "
              "buckets must want the same range)",
              fqn, absl::StrJoin(ranks, ", ")));
        }
        end = range.second;
        g.begins.push_back(range.first);
        g.ends.push_back(range.second);
        g.ranks.push_back(ranks);
      }
    }
    return absl::OkStatus();
  }

  // Calls fn(rank) for each rank that wants `id`. kInvalidArgument when a
  // bucketing has no bucket for it.
  template <typename Fn>
  absl::Status ForEach(int64_t id, Fn fn) const {
    for (const Group& g : groups_) {
      CAIRN_ASSIGN_OR_RETURN(int64_t b, KvBucketOf(g.spec, id));
      const auto it = std::upper_bound(g.begins.begin(), g.begins.end(), b);
      if (it == g.begins.begin()) continue;
      const size_t k = static_cast<size_t>(it - g.begins.begin()) - 1;
      if (b >= g.ends[k]) continue;
      for (int r : g.ranks[k]) fn(r);
    }
    return absl::OkStatus();
  }

 private:
  struct Group {
    KvTableSpec spec;
    std::map<std::pair<int64_t, int64_t>, std::vector<int>> ranges;
    std::vector<int64_t> begins, ends;
    std::vector<std::vector<int>> ranks;
  };
  std::vector<Group> groups_;
};

// What a rank sends another in a round of the routed load: a flag (1: rows
// follow; 0: the sender failed, its error follows), then the row count,
// the ids and the receiver's columns, each padded to 8 bytes so that the
// receiver can view them in place.
void PadTo8(std::string& s) { s.resize((s.size() + 7) / 8 * 8, '\0'); }

std::string Failed(const absl::Status& s) {
  ByteWriter w;
  w.U8(0);
  w.Str(s.ToString());
  return w.Take();
}

// The rows of piece `p` each wanting rank takes: the messages of a round.
absl::StatusOr<std::vector<std::string>> Route(
    const KvTableMetadata& md, const KvPieceBytes& p,
    const std::vector<int>& read_columns, const std::vector<Wanted>& all,
    const Owners& owners) {
  const size_t world = all.size();
  std::vector<std::vector<uint32_t>> rows(world);
  const uint64_t n = p.piece.rows();
  for (uint64_t i = 0; i < n; ++i) {
    absl::Status s = owners.ForEach(p.ids[i], [&](int r) {
      rows[r].push_back(static_cast<uint32_t>(i));
    });
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "id %d of chunk %d has no bucket in a destination's bucketing: %s",
          p.ids[i], p.piece.chunk, s.message()));
    }
  }
  std::vector<std::string> out(world);
  for (size_t r = 0; r < world; ++r) {
    std::string& m = out[r];
    m.push_back('\1');
    PadTo8(m);
    const uint64_t k = rows[r].size();
    m.append(reinterpret_cast<const char*>(&k), 8);
    if (k == 0) continue;
    for (uint32_t i : rows[r]) {
      m.append(reinterpret_cast<const char*>(p.ids + i), 8);
    }
    for (int c : all[r].columns) {
      const size_t j = static_cast<size_t>(
          std::find(read_columns.begin(), read_columns.end(), c) -
          read_columns.begin());
      const uint64_t bytes = ColumnRowBytes(md.spec.columns[c]);
      m.reserve(m.size() + k * bytes + 8);
      for (uint32_t i : rows[r]) {
        m.append(reinterpret_cast<const char*>(p.columns[j] + i * bytes),
                 bytes);
      }
      PadTo8(m);
    }
  }
  return out;
}

// Applies a round's message from rank `from` to the sink.
absl::Status ApplyMessage(const KvRequest& r, const std::string& m, int from,
                          int rank, LoadResult& result) {
  auto bad = [&](std::string_view why) {
    return absl::DataLossError(absl::StrFormat(
        "load: key-value table \"%s\": rank %d's rows for rank %d: %s", r.fqn,
        from, rank, why));
  };
  if (m.size() < 16) return bad("a message too short");
  uint64_t n = 0;
  std::memcpy(&n, m.data() + 8, 8);
  if (n == 0) return absl::OkStatus();
  size_t at = 16;
  if (n > (m.size() - at) / 8) return bad("more rows than bytes");
  const auto* ids = reinterpret_cast<const int64_t*>(m.data() + at);
  at += n * 8;
  std::vector<const std::byte*> columns;
  for (int c : r.columns) {
    const uint64_t bytes = n * ColumnRowBytes(r.stored->spec.columns[c]);
    if (at > m.size() || bytes > m.size() - at) {
      return bad("fewer bytes than rows");
    }
    columns.push_back(reinterpret_cast<const std::byte*>(m.data() + at));
    at = (at + bytes + 7) / 8 * 8;
  }
  return ApplyToSink(r, ids, n, columns, absl::StrFormat("from rank %d", from),
                     rank, result);
}

// Into another bucketing: the stored pieces dealt out round-robin, each
// read by one rank, its rows sent to the ranks that want them, one round
// (a Scatter from every rank) per piece a rank reads. A rank that has
// failed sends its error in place of rows, and every rank stops after the
// round in which any did. `status` is this rank's (in and out).
absl::Status LoadRouted(Storage& storage, const Metadata& metadata,
                        std::string_view fqn, const KvTableMetadata& md,
                        const KvRequest* mine, const std::vector<Wanted>& all,
                        const LoadOptions& options, Communicator& comm,
                        absl::Status& status, LoadResult& result) {
  const int world = comm.size();
  const int rank = comm.rank();
  Owners owners;
  if (status.ok()) status = owners.Build(fqn, all);
  std::set<int> union_columns;
  for (const Wanted& w : all) {
    if (w.wants) union_columns.insert(w.columns.begin(), w.columns.end());
  }
  const std::vector<int> read_columns(union_columns.begin(),
                                      union_columns.end());
  const std::vector<KvPiece> pieces =
      KvPiecesOf(md, 0, md.chunks.size(), {0, md.rows()},
                 RowBytes(md.spec, read_columns), PieceBytes(options));
  KvPieceReader reader(storage, std::string(fqn), md,
                       metadata.crc32c_block_bytes, read_columns,
                       options.verify_checksums);
  const size_t rounds = (pieces.size() + world - 1) / world;
  for (size_t round = 0; round < rounds; ++round) {
    const size_t mine_at = round * world + rank;
    std::vector<std::string> out;
    if (status.ok() && mine_at < pieces.size()) {
      absl::StatusOr<KvPieceBytes> p = reader.Read(pieces[mine_at]);
      absl::StatusOr<std::vector<std::string>> routed =
          p.ok() ? Route(md, *p, read_columns, all, owners)
                 : absl::StatusOr<std::vector<std::string>>(p.status());
      if (p.ok()) {
        result.bytes_read += p->bytes_read;
        reader.Recycle(*std::move(p));
      }
      status = Annotate(routed.status(),
                        absl::StrFormat("load: rank %d, key-value table \"%s\"",
                                        rank, fqn));
      if (routed.ok()) out = *std::move(routed);
    }
    if (!status.ok()) {
      out.assign(world, Failed(status));
    } else if (out.empty()) {
      out.assign(world, std::string(16, '\0'));
      for (std::string& m : out) m[0] = '\1';
    }
    bool stop = !status.ok();
    for (int root = 0; root < world; ++root) {
      absl::StatusOr<std::string> got = comm.Scatter(out, root);
      if (!got.ok()) {
        return Annotate(got.status(),
                        "load: communicator failed while routing key-value "
                        "table rows");
      }
      if (got->empty() || (*got)[0] != '\1') {
        stop = true;  // the root failed; it reports its own error
        continue;
      }
      if (status.ok() && mine != nullptr) {
        status = ApplyMessage(*mine, *got, root, rank, result);
      }
    }
    if (stop) break;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<KvRequest>> PlanKvLoads(
    const Metadata& metadata, const LoadOptions& options, int world,
    int rank, std::vector<std::string>& missing) {
  std::vector<KvRequest> out;
  std::set<std::string_view> seen;
  for (const KvTableToLoad& t : options.kv_tables) {
    auto bad = [&](std::string_view why) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "load: key-value table \"%s\" on rank %d: %s", t.fqn, rank, why));
    };
    if (t.fqn.empty()) return bad("the FQN is empty");
    if (!seen.insert(t.fqn).second) return bad("listed twice");
    if (t.sink == nullptr) return bad("no sink");
    auto it = metadata.kv_tables.find(t.fqn);
    if (it == metadata.kv_tables.end()) {
      if (options.strict) {
        return absl::NotFoundError(absl::StrFormat(
            "load: key-value table \"%s\" is not in the checkpoint", t.fqn));
      }
      missing.push_back(t.fqn);
      continue;
    }
    const KvTableMetadata& stored = it->second;
    KvRequest r;
    r.fqn = t.fqn;
    r.sink = t.sink;
    r.stored = &stored;
    r.dest = stored.spec;
    if (t.num_buckets != 0) {
      r.dest.num_buckets = t.num_buckets;
      r.dest.bucketing = t.bucketing;
      r.dest.bucket_size = t.bucket_size;
    }
    CAIRN_RETURN_IF_ERROR(ValidateKvTableSpec(t.fqn, r.dest));
    r.dest.columns.clear();
    r.same_bucketing =
        r.dest.num_buckets == stored.spec.num_buckets &&
        r.dest.bucketing == stored.spec.bucketing &&
        (r.dest.bucketing == KvBucketing::kInterleaved ||
         r.dest.bucket_size == stored.spec.bucket_size);
    const bool rank_local = metadata.rank >= 0;
    if (rank_local && !r.same_bucketing) {
      return bad("a rank-local checkpoint loads in its saved bucketing only; "
                 "merge it (cairn merge) to load it into another");
    }
    r.buckets = t.buckets ? *t.buckets
                : rank_local
                    ? stored.buckets
                    : KvBucketsOfRank(r.dest.num_buckets, world, rank);
    if (r.buckets.begin < 0 || r.buckets.end < r.buckets.begin ||
        r.buckets.end > r.dest.num_buckets) {
      return bad(absl::StrFormat("buckets %s are not a range of its %d",
                                 KvRangeText(r.buckets), r.dest.num_buckets));
    }
    if (r.same_bucketing && r.buckets.size() > 0 &&
        (r.buckets.begin < stored.buckets.begin ||
         r.buckets.end > stored.buckets.end)) {
      return bad(absl::StrFormat(
          "buckets %s, but this checkpoint holds buckets %s of it only (a "
          "rank-local folder: merge it to load others)",
          KvRangeText(r.buckets), KvRangeText(stored.buckets)));
    }
    if (t.columns.empty()) {
      for (size_t j = 0; j < stored.spec.columns.size(); ++j) {
        r.columns.push_back(static_cast<int>(j));
      }
    }
    for (const std::string& name : t.columns) {
      const auto& cols = stored.spec.columns;
      auto c = std::find_if(cols.begin(), cols.end(),
                            [&](const KvColumn& k) { return k.name == name; });
      if (c == cols.end()) {
        std::vector<std::string> names;
        for (const KvColumn& k : cols) names.push_back(k.name);
        return bad(absl::StrFormat("no column \"%s\" (it has %s)", name,
                                   absl::StrJoin(names, ", ")));
      }
      const int j = static_cast<int>(c - cols.begin());
      if (std::find(r.columns.begin(), r.columns.end(), j) != r.columns.end()) {
        return bad(absl::StrFormat("column \"%s\" listed twice", name));
      }
      r.columns.push_back(j);
    }
    out.push_back(std::move(r));
  }
  return out;
}

absl::Status LoadKvTables(Storage& storage, const Metadata& metadata,
                          const std::vector<KvRequest>& requests,
                          const LoadOptions& options, Communicator& comm,
                          LoadResult& result) {
  const int rank = comm.rank();
  absl::Status status;
  for (const auto& [fqn, md] : metadata.kv_tables) {
    const KvRequest* mine = nullptr;
    for (const KvRequest& r : requests) {
      if (r.fqn == fqn) mine = &r;
    }
    absl::StatusOr<std::vector<std::string>> gathered =
        comm.AllGather(EncodeWanted(status.ok(), mine));
    if (!gathered.ok()) {
      return Annotate(gathered.status(),
                      "load: communicator failed exchanging key-value table "
                      "requests");
    }
    std::vector<Wanted> all;
    bool any_failed = false;
    bool any_wants = false;
    bool routed = false;
    for (size_t r = 0; r < gathered->size(); ++r) {
      absl::StatusOr<Wanted> w = DecodeWanted((*gathered)[r],
                                              static_cast<int>(r),
                                              md.spec.columns.size());
      if (!w.ok()) return w.status();
      any_failed |= !w->ok;
      any_wants |= w->wants;
      routed |= w->wants && !w->same;
      all.push_back(*std::move(w));
    }
    if (any_failed) break;  // each failed rank reports its error below
    if (!any_wants) continue;
    if (routed) {
      CAIRN_RETURN_IF_ERROR(LoadRouted(storage, metadata, fqn, md, mine, all,
                                       options, comm, status, result));
    } else if (mine != nullptr) {
      status = LoadDirect(storage, metadata, *mine, options, rank, result);
    }
  }
  return internal_comm::AgreeOnStatus(comm, status, "load",
                                      "loading key-value tables");
}

}  // namespace cairn::internal_checkpoint
