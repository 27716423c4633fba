// cairn bench, the parent's report: the JSON object (--json) and the
// table, from the rows Bench (bench.cc) collected.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench_kv.h"
#include "bench_location.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "commands.h"
#include "core/parallel.h"
#include "core/status.h"
#include "synthetic_kv.h"
#include "rank_status.h"
#include "synthetic_model.h"
#include "bench_internal.h"

namespace cairn::tools::internal_bench {

using internal_core::Annotate;
using internal_core::StatusFromErrno;

double Bench::MemcpyLimit() const {
  const double parallel = Num(memcpy_, "parallel_gb_per_s");
  return parallel > 0 ? parallel : Num(memcpy_, "gb_per_s");
}

json Bench::ToJson() const {
  json results = json::array();
  for (const Row& row : rows_) {
    const double s = row.seconds();
    json j = {{"name", row.name},
              {"kind", row.kind},
              {"cache", row.cache ? json(*row.cache) : json()},
              {"ranks", row.ranks},
              {"seconds", s},
              {"gb_per_s", s > 0 ? json(GigabytesPerSecond(bytes_, s))
                                 : json()},
              {"peak_rss_bytes", row.peak_rss_bytes},
              {"dest_bytes", row.dest_bytes},
              {"samples", row.samples},
              {"rank_seconds", row.rank_seconds}};
    if (!row.cpu.empty()) {
      j["cpu_seconds"] = Median(row.cpu);
      j["sys_seconds"] = Median(row.sys);
    }
    if (!row.requests.empty() && IsObjectStoreUrl(dir_)) {
      const double n = Median(row.requests);
      j["requests"] = n;
      j["requests_per_gib"] =
          bytes_ > 0 ? n / (static_cast<double>(bytes_) / (1 << 30)) : 0.0;
    }
    j.update(row.extra);
    if (row.kind == "load" && row.cache == "warm" && MemcpyLimit() > 0 &&
        s > 0) {
      j["memcpy_fraction"] = GigabytesPerSecond(bytes_, s) / MemcpyLimit();
    }
    results.push_back(std::move(j));
  }
  const Row* save = FindRow("save_sync", std::nullopt);
  const Row* async = FindRow("async_save", std::nullopt);
  const Row* load = FindRow("load_same", "cold");
  if (load == nullptr) load = FindRow("load_same", "warm");
  auto seconds = [](const Row* r) { return r ? json(r->seconds()) : json(); };
  std::vector<std::string> notes = findings_;
  notes.insert(notes.end(), notes_.begin(), notes_.end());
  json j;
  j["tool"] = "cairn";
  j["version"] = CAIRN_VERSION_STRING;
  j["bytes"] = bytes_;
  j["tensors"] = tensors_.size();
  j["ranks"] = o_.ranks;
  j["repeat"] = o_.repeat;
  j["dir"] = dir_;
  j["work_dir"] = work_.string();
  j["kept"] = o_.keep;
  j["verify_checksums"] = o_.verify_checksums;
  j["share_node_reads"] = o_.node_reads;
  j["cold_method"] = can_drop_ ? "drop_caches" : "unavailable";
  j["cpus"] = DefaultThreads();
  j["model"] = {{"layers", model_.config.layers},
                {"hidden", model_.config.hidden},
                {"ffn", model_.config.ffn},
                {"vocab", model_.config.vocab}};
  j["model_out"] = o_.model_out.empty() ? json() : json(o_.model_out);
  j["save_seconds"] = seconds(save);
  j["load_seconds"] = seconds(load);
  j["load_cache"] = load ? json(*load->cache) : json();
  j["async_blocked_seconds"] =
      async ? json(Median(async->blocked)) : json();
  j["async_total_seconds"] = seconds(async);
  j["memcpy_gb_per_s"] = memcpy_.is_object() ? memcpy_["gb_per_s"] : json();
  j["memcpy_parallel_gb_per_s"] =
      memcpy_.is_object() ? memcpy_["parallel_gb_per_s"] : json();
  j["memcpy"] = memcpy_;
  j["results"] = std::move(results);
  j["notes"] = std::move(notes);
  return j;
}

void Bench::PrintTable() const {
  std::cout << absl::StrFormat(
      "cairn %s bench: %d bytes (%s) of float32 state, %d tensors, %d save "
      "ranks (threads of one process), cold=%s, repeat=%d\n",
      CAIRN_VERSION_STRING, bytes_, HumanBytes(bytes_), tensors_.size(),
      o_.ranks, can_drop_ ? "drop_caches" : "unavailable", o_.repeat);
  std::cout << absl::StrFormat("dir: %s (work folder %s%s)\n", dir_,
                               work_.filename().string(),
                               o_.keep ? ", kept" : ", removed");
  if (!o_.verify_checksums) {
    std::cout << "loads without the CRC32C check of each chunk (--no-verify)\n";
  }
  const std::string header = absl::StrFormat(
      "%-20s %-5s %-5s %5s %9s %8s %8s %9s %9s", "phase", "kind", "cache",
      "ranks", "seconds", "GB/s", "memcpy", "RSS MiB", "held MiB");
  std::cout << header << "\n" << std::string(header.size(), '-') << "\n";
  for (const Row& row : rows_) {
    const double s = row.seconds();
    const double gbps = GigabytesPerSecond(bytes_, s);
    std::string vs = "-";
    if (row.kind == "load" && row.cache == "warm" && MemcpyLimit() > 0) {
      vs = absl::StrFormat("%.0f%%", 100 * gbps / MemcpyLimit());
    }
    std::cout << absl::StrFormat(
        "%-20s %-5s %-5s %5d %9.3f %8.3f %8s %9.1f %9.1f\n", row.name,
        row.kind, row.cache.value_or("-"), row.ranks, s, gbps, vs,
        MiB(row.peak_rss_bytes), MiB(row.dest_bytes));
  }
  const int threads = static_cast<int>(Num(memcpy_, "threads"));
  if (memcpy_.is_object()) {
    std::cout << absl::StrFormat(
        "memcpy: %.2f GB/s on 1 thread%s (%s the best of %d copies of a %s "
        "buffer); the \"memcpy\" column is a warm load's GB/s relative to "
        "%s\n",
        Num(memcpy_, "gb_per_s"),
        threads > 1 ? absl::StrFormat(", %.2f GB/s on %d threads",
                                      Num(memcpy_, "parallel_gb_per_s"),
                                      threads)
                    : "",
        memcpy_samples_.size() > 1
            ? absl::StrFormat("the median of %d samples, each",
                              memcpy_samples_.size())
            : "one sample,",
        kMemcpyIterations, HumanBytes(static_cast<uint64_t>(
                               Num(memcpy_, "bytes"))),
        threads > 1 ? "the parallel figure" : "it");
  }
  const Row* save = FindRow("save_sync", std::nullopt);
  const Row* async = FindRow("async_save", std::nullopt);
  if (save && async) {
    const double blocked = Median(async->blocked);
    std::cout << absl::StrFormat(
        "async: Save() blocked %.3f s and the checkpoint committed after "
        "%.3f s; save_sync took %.3f s: blocked/sync = %.3f (%.1fx less "
        "time blocked)\n",
        blocked, async->seconds(), save->seconds(),
        save->seconds() > 0 ? blocked / save->seconds() : 0.0,
        blocked > 0 ? save->seconds() / blocked : 0.0);
  }
  for (const std::string& f : findings_) std::cout << "note: " << f << "\n";
  std::cout << std::flush;
}


}  // namespace cairn::tools::internal_bench
