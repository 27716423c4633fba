// `cairn demo --kv`: a synthetic key-value embedding table saved by one
// number of in-process ranks and loaded, verified row by row, by another:
// once in the saved bucketing (each rank reads its own buckets' rows) and
// once into another bucket count (rows routed between the ranks).
#include "demo_kv.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/kv_table.h"
#include "core/status.h"
#include "nlohmann/json.hpp"
#include "cli_util.h"
#include "synthetic_kv.h"

namespace cairn::tools {
namespace {

constexpr char kTable[] = "emb.items";

uint64_t PeakRssBytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<uint64_t>(usage.ru_maxrss) * 1024;  // KiB on Linux
}

struct Phase {
  std::string what;
  int ranks = 0;
  int64_t buckets = 0;
  uint64_t bytes = 0;  // table bytes written or read
  uint64_t rows = 0;
  double seconds = 0;
};

// The first error of `st`, or OK.
absl::Status FirstError(const std::vector<absl::Status>& st) {
  for (const absl::Status& s : st) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<Phase> SaveTable(const KvDemoOptions& o,
                                const std::string& dir) {
  const KvTableSpec spec = SyntheticKvSpec(o.buckets);
  Phase p{"save", o.ranks, o.buckets};
  std::mutex mu;
  Stopwatch clock;
  std::vector<absl::Status> st =
      RunInProcess(o.ranks, [&](Communicator& comm) -> absl::Status {
        const KvBucketRange mine =
            KvBucketsOfRank(o.buckets, o.ranks, comm.rank());
        std::unique_ptr<KvSource> source = SyntheticKvSource(
            spec, SyntheticKvIds(spec, o.rows, mine), 4096);
        SaveOptions so;
        so.comm = &comm;
        so.overwrite = true;
        so.kv_tables.push_back({kTable, spec, mine, source.get()});
        StateDict sd;
        CAIRN_ASSIGN_OR_RETURN(SaveResult r, Save(sd, dir, so));
        std::lock_guard<std::mutex> lock(mu);
        p.rows += r.kv_rows;
        p.bytes += r.data_bytes;
        return absl::OkStatus();
      });
  p.seconds = clock.Seconds();
  CAIRN_RETURN_IF_ERROR(FirstError(st));
  return p;
}

absl::StatusOr<Phase> LoadTable(const KvDemoOptions& o, const std::string& dir,
                                int64_t buckets, const std::string& what) {
  Phase p{what, o.load_ranks, buckets};
  KvTableSpec dest = SyntheticKvSpec(buckets);
  std::mutex mu;
  Stopwatch clock;
  std::vector<absl::Status> st =
      RunInProcess(o.load_ranks, [&](Communicator& comm) -> absl::Status {
        const KvBucketRange mine =
            KvBucketsOfRank(buckets, o.load_ranks, comm.rank());
        CheckingKvSink sink(dest, mine, {0, 1, 2});
        LoadOptions lo;
        lo.comm = &comm;
        if (o.memory_budget > 0) lo.memory_budget_bytes = o.memory_budget;
        KvTableToLoad t{.fqn = kTable, .sink = &sink};
        t.num_buckets = buckets;
        t.bucketing = KvBucketing::kInterleaved;
        t.buckets = mine;
        lo.kv_tables.push_back(t);
        StateDict sd;
        CAIRN_ASSIGN_OR_RETURN(LoadResult r, Load(sd, dir, lo));
        std::lock_guard<std::mutex> lock(mu);
        p.rows += sink.rows();
        p.bytes += r.bytes_loaded;
        return absl::OkStatus();
      });
  p.seconds = clock.Seconds();
  CAIRN_RETURN_IF_ERROR(FirstError(st));
  if (p.rows != o.rows) {
    return absl::DataLossError(absl::StrFormat(
        "%s: the sinks got %d rows, the table has %d", what, p.rows, o.rows));
  }
  return p;
}

}  // namespace

int RunKvDemo(const KvDemoOptions& o) {
  std::string dir = o.dir;
  bool remove = false;
  if (dir.empty()) {
    const char* base = getenv("TMPDIR");
    std::string templ = std::string(base != nullptr && *base ? base : "/tmp") +
                        "/cairn-demo-kv-XXXXXX";
    if (mkdtemp(templ.data()) == nullptr) {
      PrintError("demo", absl::InternalError("cannot make a temporary dir"));
      return 1;
    }
    dir = templ;
    remove = !o.keep;
  }
  const KvTableSpec spec = SyntheticKvSpec(o.buckets);
  if (!o.quiet) {
    std::cerr << absl::StrFormat(
        "demo --kv: %d rows of %d bytes (weight bf16[128], adagrad_sum "
        "f32[1], last_seen i64[1]) over ids in [0, 2^40), %d interleaved "
        "buckets, in %s\n",
        o.rows, spec.row_bytes(), o.buckets, dir);
  }
  std::vector<Phase> phases;
  absl::Status status;
  auto run = [&](absl::StatusOr<Phase> p) {
    if (!status.ok()) return;
    status = p.status();
    if (p.ok()) {
      if (!o.quiet) {
        std::cerr << absl::StrFormat("  %s done in %.2f s\n", p->what,
                                     p->seconds);
      }
      phases.push_back(*std::move(p));
    }
  };
  run(SaveTable(o, dir));
  run(LoadTable(o, dir, o.buckets, "load, saved bucketing"));
  run(LoadTable(o, dir, o.buckets * 3 / 2 + 1, "load, another bucketing"));
  if (remove) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  if (!status.ok()) {
    PrintError("demo", status);
    return 1;
  }
  if (o.json) {
    nlohmann::json j;
    j["rows"] = o.rows;
    j["row_bytes"] = spec.row_bytes();
    j["peak_rss_bytes"] = PeakRssBytes();
    for (const Phase& p : phases) {
      j["phases"].push_back({{"phase", p.what},
                             {"ranks", p.ranks},
                             {"buckets", p.buckets},
                             {"rows", p.rows},
                             {"bytes", p.bytes},
                             {"seconds", p.seconds}});
    }
    std::cout << j.dump() << std::endl;
    return 0;
  }
  std::cout << absl::StrFormat(
      "key-value table %s: %d rows, %s of ids and rows\n\n", kTable, o.rows,
      HumanBytes(phases[0].bytes));
  std::cout << absl::StrFormat("%-26s  %5s  %7s  %10s  %8s  %9s\n", "PHASE",
                               "RANKS", "BUCKETS", "BYTES", "SECONDS",
                               "GB/S");
  for (const Phase& p : phases) {
    std::cout << absl::StrFormat(
        "%-26s  %5d  %7d  %10s  %8.2f  %9.2f\n", p.what, p.ranks, p.buckets,
        HumanBytes(p.bytes), p.seconds,
        GigabytesPerSecond(p.bytes, p.seconds));
  }
  std::cout << absl::StrFormat(
      "\nevery row of both loads checked against the saved bytes (ids in "
      "their rank's buckets, every column byte); process peak RSS %s\n",
      HumanBytes(PeakRssBytes()));
  return 0;
}

}  // namespace cairn::tools
