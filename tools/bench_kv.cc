// The key-value table rows of `cairn bench` (bench_kv.h).
#include "bench_kv.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/kv_table.h"
#include "core/status.h"
#include "synthetic_kv.h"

namespace cairn::tools {
namespace {

using json = nlohmann::json;

constexpr char kTable[] = "emb.items";
constexpr int64_t kBuckets = 256;

double Now() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

// The span of a collective operation: the first start to the last end.
struct Span {
  std::mutex mu;
  double start = std::numeric_limits<double>::max();
  double end = 0;
  void Add(double s, double e) {
    std::lock_guard<std::mutex> lock(mu);
    start = std::min(start, s);
    end = std::max(end, e);
  }
  double seconds() const { return end - start; }
};

absl::Status FirstError(const std::vector<absl::Status>& st) {
  for (const absl::Status& s : st) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// The FBGEMM way: every row kept (ids and row bytes), applied later.
class CachingSink : public KvSink {
 public:
  absl::Status Apply(std::span<const int64_t> ids,
                     std::span<const TensorView> columns) override {
    ids_.insert(ids_.end(), ids.begin(), ids.end());
    if (cols_.empty()) cols_.resize(columns.size());
    for (size_t j = 0; j < columns.size(); ++j) {
      const auto* p = static_cast<const std::byte*>(columns[j].data());
      cols_[j].insert(cols_[j].end(), p, p + columns[j].nbytes());
    }
    return absl::OkStatus();
  }

  // Applies what was kept to `sink`, about `batch_bytes` at a time.
  absl::Status ApplyTo(KvSink& sink, const KvTableSpec& spec,
                       uint64_t batch_bytes) {
    const uint64_t row = 8 + spec.row_bytes();
    const size_t per = std::max<uint64_t>(1, batch_bytes / row);
    for (size_t at = 0; at < ids_.size(); at += per) {
      const size_t n = std::min(per, ids_.size() - at);
      std::vector<TensorView> views;
      for (size_t j = 0; j < cols_.size(); ++j) {
        const KvColumn& c = spec.columns[j];
        const size_t bytes = c.width * DTypeSize(c.dtype);
        views.emplace_back(cols_[j].data() + at * bytes, c.dtype,
                           Shape{static_cast<int64_t>(n), c.width});
      }
      CAIRN_RETURN_IF_ERROR(
          sink.Apply(std::span<const int64_t>(ids_.data() + at, n), views));
    }
    return absl::OkStatus();
  }

 private:
  std::vector<int64_t> ids_;
  std::vector<std::vector<std::byte>> cols_;
};

}  // namespace

uint64_t KvRowsFor(uint64_t bytes) {
  const uint64_t row = 8 + SyntheticKvSpec(1).row_bytes();
  return std::max<uint64_t>(1, bytes / row);
}

absl::StatusOr<json> KvSaveSample(const std::string& dir, uint64_t rows,
                                  int ranks) {
  const KvTableSpec spec = SyntheticKvSpec(kBuckets);
  Span span;
  std::atomic<uint64_t> bytes{0}, saved{0}, files{0};
  std::vector<absl::Status> st =
      RunInProcess(ranks, [&](Communicator& comm) -> absl::Status {
        const KvBucketRange mine =
            KvBucketsOfRank(kBuckets, ranks, comm.rank());
        // The rows exist before the timer, as the dense save's tensors do.
        const SyntheticKvRows held =
            MakeSyntheticKvRows(SyntheticKvIds(spec, rows, mine));
        std::unique_ptr<KvSource> source = SyntheticKvRowsSource(held, 4096);
        SaveOptions so;
        so.comm = &comm;
        so.kv_tables.push_back({kTable, spec, mine, source.get()});
        StateDict sd;
        CAIRN_RETURN_IF_ERROR(comm.Barrier());
        const double t0 = Now();
        CAIRN_ASSIGN_OR_RETURN(SaveResult r, Save(sd, dir, so));
        span.Add(t0, Now());
        bytes += r.data_bytes;
        saved += r.kv_rows;
        files += r.files;
        return absl::OkStatus();
      });
  CAIRN_RETURN_IF_ERROR(FirstError(st));
  return json{{"seconds", span.seconds()},
              {"bytes", bytes.load()},
              {"rows", saved.load()},
              {"files", files.load()}};
}

absl::StatusOr<json> KvLoadSample(const std::string& dir, uint64_t rows,
                                  int ranks, bool rebucket, bool cache_all,
                                  uint64_t memory_budget,
                                  const std::function<absl::Status()>& prepare) {
  CAIRN_RETURN_IF_ERROR(prepare());
  const int64_t buckets = rebucket ? kBuckets * 3 / 2 + 1 : kBuckets;
  const KvTableSpec dest = SyntheticKvSpec(buckets);
  Span span;
  std::atomic<uint64_t> bytes{0}, loaded{0}, read{0}, kept{0};
  std::vector<absl::Status> st =
      RunInProcess(ranks, [&](Communicator& comm) -> absl::Status {
        const KvBucketRange mine = KvBucketsOfRank(buckets, ranks, comm.rank());
        // The rows land in memory allocated and touched before the timer
        // and are checked after it, as the dense loads' destinations are.
        std::vector<int64_t> expected = SyntheticKvIds(dest, rows, mine);
        KeepingKvSink keep(expected.size());
        kept += expected.size() * (8 + dest.row_bytes());
        CachingSink cache;
        LoadOptions lo;
        lo.comm = &comm;
        lo.memory_budget_bytes = memory_budget;
        KvTableToLoad t{.fqn = kTable, .sink = &keep};
        if (cache_all) t.sink = &cache;
        t.num_buckets = buckets;
        t.bucketing = KvBucketing::kInterleaved;
        t.buckets = mine;
        lo.kv_tables.push_back(t);
        StateDict sd;
        CAIRN_RETURN_IF_ERROR(comm.Barrier());
        const double t0 = Now();
        CAIRN_ASSIGN_OR_RETURN(LoadResult r, Load(sd, dir, lo));
        if (cache_all) {
          CAIRN_RETURN_IF_ERROR(cache.ApplyTo(keep, dest, uint64_t{64} << 20));
        }
        span.Add(t0, Now());
        CAIRN_RETURN_IF_ERROR(keep.Check(dest, mine, std::move(expected)));
        bytes += r.bytes_loaded;
        loaded += keep.rows();
        read += r.bytes_read;
        return absl::OkStatus();
      });
  CAIRN_RETURN_IF_ERROR(FirstError(st));
  if (loaded.load() != rows) {
    return absl::DataLossError(absl::StrFormat(
        "the sinks got %d rows of the table's %d", loaded.load(), rows));
  }
  return json{{"seconds", span.seconds()},
              {"bytes", bytes.load()},
              {"rows", loaded.load()},
              {"storage_bytes_read", read.load()},
              {"kept_bytes", kept.load()}};
}

}  // namespace cairn::tools
