// cairn bench: measures cairn's save and load on the user's storage, the
// cairn half of the benchmark harness. bench/peers/torch_peer.py measures
// PyTorch on the same tensors (the model JSON that --model-out writes), and
// the result rows of the two pair by name: torch_peer's dcp_load_4to2_rows
// is load_4to2_rows here, with the same "kind" and "cache".
//
// Protocol:
//  1. The parent chooses the synthetic model for --size (synthetic_model.h:
//     float32 tensors only, the same every time for a given size), checks
//     that twice the state fits in memory and on the disk under --dir,
//     creates --dir if missing and a fresh work folder in it, finds out
//     whether the page cache can be dropped (--cold), and writes
//     --model-out.
//  2. Every sample of every phase runs in a child process forked from the
//     parent. The parent never starts a thread (no cairn save or load, no
//     ParallelFor, no ProgressLine), so fork() is safe, and the child's own
//     ru_maxrss (from wait4) is the phase's peak RSS, not the sum of all
//     phases so far. The child runs the ranks as threads of itself
//     (RunInProcess, like `cairn demo --comm inproc`), writes one JSON
//     object to a pipe and leaves with _exit. A child that fails or dies
//     fails the run, naming the phase and the child's exit status or
//     signal. The parent calls sync() before each fork, so no dirty data
//     from earlier is flushed inside a timer.
//  3. Sharding, as torch_peer.py's build_sharded_state and part(): a tensor
//     of rank >= 1 is split on one dimension into W parts, rank k holding
//     [n*k/W, n*(k+1)/W) (integer division; a rank whose part is empty
//     holds no shard of it); 0-d tensors are replicated on every rank.
//     Saves split dim 0; loads split dim 0 ("rows") or dim 1 ("cols"; 1-D
//     tensors fall back to dim 0). Element i of tensor `fqn` holds
//     ElementValue(FqnSeed(fqn), i, 0), so any rank builds its own part and
//     every loaded element is checked bit for bit.
//  4. Timing: every rank waits at a barrier, reads CLOCK_MONOTONIC, runs
//     the collective operation and reads the clock again; a sample's time
//     is the last end minus the first start over the ranks (the whole
//     collective's wall time). --repeat N reports the median of N samples,
//     each in a fresh child.
//  5. Phases, in order (see the --help footer for what each measures):
//     save_sync, async_save, the loads (load_same, load_WtoW/2_rows/_cols,
//     load_WtoW-1_rows/_cols; each cold, then warm), load_sink (one rank
//     streams every stored byte into a sink that drops it once checked,
//     within --memory-budget; its peak RSS must stay within the budget +
//     128 MiB), memcpy.
//  6. The parent prints the table or the JSON object and removes the work
//     folder unless --keep.
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

namespace {

absl::Status WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return StatusFromErrno(n < 0 ? errno : EIO, "write", "pipe");
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ChildResult> RunInChild(
    const std::function<absl::StatusOr<json>()>& fn) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return StatusFromErrno(errno, "pipe", "");
  // Buffered output would otherwise be written twice, once by the child.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(fds[0]);
    close(fds[1]);
    return StatusFromErrno(err, "fork", "");
  }
  if (pid == 0) {
    close(fds[0]);
    json reply;
    int code = 0;
    try {
      absl::StatusOr<json> result = fn();
      if (result.ok()) {
        reply = {{"ok", *std::move(result)}};
      } else {
        reply = {{"code", static_cast<int>(result.status().code())},
                 {"message", std::string(result.status().message())}};
        code = 1;
      }
    } catch (const std::exception& e) {
      reply = {{"code", static_cast<int>(absl::StatusCode::kInternal)},
               {"message", absl::StrCat("internal error: ", e.what())}};
      code = 1;
    }
    // An error message may hold bytes that are not UTF-8 (a file name).
    (void)WriteAll(fds[1], reply.dump(-1, ' ', false,
                                      json::error_handler_t::replace));
    close(fds[1]);
    _exit(code);  // no atexit handlers, no second flush of the parent's
  }
  close(fds[1]);
  std::string text;
  char buffer[65536];
  while (true) {
    const ssize_t n = read(fds[0], buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  close(fds[0]);
  int wstatus = 0;
  struct rusage usage = {};
  while (wait4(pid, &wstatus, 0, &usage) < 0) {
    if (errno != EINTR) return StatusFromErrno(errno, "wait4", "");
  }
  ChildResult out;
  out.peak_rss_bytes = static_cast<uint64_t>(usage.ru_maxrss) * 1024;  // KiB
  const json reply = json::parse(text, nullptr, false);
  const bool has_error = reply.is_object() && reply.contains("message") &&
                         reply["message"].is_string() &&
                         reply.contains("code") &&
                         reply["code"].is_number_integer();
  if (WIFSIGNALED(wstatus)) {
    const int sig = WTERMSIG(wstatus);
    return absl::AbortedError(absl::StrFormat(
        "the phase's child process was killed by signal %d (%s)%s", sig,
        strsignal(sig),
        sig == SIGKILL ? "; out of memory? try a smaller --size" : ""));
  }
  const int exit_status = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1;
  if (has_error) {
    return absl::Status(
        static_cast<absl::StatusCode>(reply["code"].get<int>()),
        absl::StrCat(reply["message"].get<std::string>(),
                     " (child process exit status ", exit_status, ")"));
  }
  if (exit_status != 0 || !reply.is_object() || !reply.contains("ok")) {
    return absl::InternalError(absl::StrCat(
        "the phase's child process exited with status ", exit_status,
        " without a result"));
  }
  out.value = reply["ok"];
  return out;
}

std::vector<LoadTarget> LoadTargets(int w) {
  std::vector<LoadTarget> out = {{"load_same", w, 0}};
  std::set<int> others = {w / 2, w - 1};
  others.erase(0);
  others.erase(w);
  for (int w2 : others) {
    out.push_back({absl::StrCat("load_", w, "to", w2, "_rows"), w2, 0});
    out.push_back({absl::StrCat("load_", w, "to", w2, "_cols"), w2, 1});
  }
  return out;
}

uint64_t HeldBytes(const std::vector<SyntheticTensor>& tensors, int world,
                   int split_dim) {
  uint64_t total = 0;
  for (int r = 0; r < world; ++r) {
    for (const SyntheticTensor& t : tensors) {
      if (std::optional<Box> box = PartBox(t, r, world, split_dim)) {
        total += static_cast<uint64_t>(box->num_elements()) *
                 DTypeSize(t.dtype);
      }
    }
  }
  return total;
}

absl::Status Bench::Prepare() {
  // 1. The model.
  CAIRN_ASSIGN_OR_RETURN(uint64_t target, ParseByteSize(o_.size));
  CAIRN_ASSIGN_OR_RETURN(SyntheticConfig config, ChooseConfig(target));
  CAIRN_ASSIGN_OR_RETURN(model_, BuildModel(config));
  std::vector<std::string> empty;
  for (const SyntheticTensor& t : model_.tensors) {
    if (t.dtype != DType::kF32) {
      return absl::InternalError(absl::StrCat(
          t.fqn, ": the benchmark model must be float32 (torch_peer.py "
                 "reads only float32)"));
    }
    if (t.num_elements() == 0) {
      empty.push_back(t.fqn);
      continue;
    }
    tensors_.push_back(t);
    bytes_ += t.nbytes();
  }
  if (!empty.empty()) {
    // torch_peer.py rejects empty tensors; leave them out on both sides.
    findings_.push_back(absl::StrCat(
        "left out ", Plural(empty.size(), "tensor"),
        " with no elements (torch_peer.py rejects them): ", empty.front(),
        empty.size() > 1 ? ", ..." : ""));
  }

  // 2. Memory: the async phase holds the state and its staged copy.
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page_size > 0) {
    const uint64_t physical =
        static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
    const uint64_t need = 2 * bytes_ + kRssSlack;
    if (need > physical / 10 * 9) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the benchmark needs about ", HumanBytes(need),
          " of memory (the async save holds the state, ", HumanBytes(bytes_),
          ", and a staged copy of it), and this machine has ",
          HumanBytes(physical), "; pass a smaller --size"));
    }
  }

  // 3. --dir and the work folder in it.
  dir_ = NormalizeUrl(o_.dir);
  if (IsObjectStoreUrl(dir_)) {
    work_ = JoinLocation(dir_, absl::StrFormat(
                                   "cairn_bench_%d_%d", getpid(),
                                   static_cast<int64_t>(time(nullptr))));
    CAIRN_RETURN_IF_ERROR(
        Annotate(Storage::Open(work_.string()).status(), "--dir"));
    findings_.push_back(
        "object storage: every load reads from the store (there is no "
        "page cache on this side to drop or warm), so there are no cold "
        "rows and the warm rows are reads from the store; requests are "
        "counted per GiB of state");
    return absl::OkStatus();
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    return Annotate(StatusFromErrno(ec.value(), "create directory", dir_),
                    "--dir");
  }
  work_ = fs::path(dir_) / absl::StrFormat("cairn_bench_%d_%d", getpid(),
                                           static_cast<int64_t>(time(nullptr)));
  if (mkdir(work_.c_str(), 0755) != 0) {
    return Annotate(StatusFromErrno(errno, "create directory", work_.string()),
                    "--dir is not writable");
  }
  // Disk: the sync checkpoint and one async checkpoint at a time.
  struct statvfs vfs = {};
  if (statvfs(work_.c_str(), &vfs) == 0) {
    const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    const uint64_t need = 2 * (bytes_ + bytes_ / 100) + (uint64_t{64} << 20);
    if (avail < need) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the benchmark writes two checkpoints of about ", HumanBytes(bytes_),
          " under ", dir_, ", which has ", HumanBytes(avail),
          " free; pass a smaller --size or another --dir"));
    }
  }

  // 4. Cold reads: drop the page cache once now, to prove it works (a
  // container may refuse it even to root).
  if (o_.cold == "none") {
    findings_.push_back("cold rows skipped: --cold none");
  } else {
    absl::Status can;
    if (geteuid() != 0) {
      can = absl::PermissionDeniedError(
          absl::StrCat("not running as root, so ", kDropCaches,
                       " cannot be written"));
    } else {
      can = DropPageCache();
    }
    can_drop_ = can.ok();
    if (!can.ok()) {
      if (o_.cold == "drop") {
        return absl::FailedPreconditionError(absl::StrCat(
            "--cold drop: cannot drop the page cache: ", can.message()));
      }
      findings_.push_back(
          absl::StrCat("cold rows skipped: ", can.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Bench::WriteModel() const {
  json tensors = json::array();
  for (const SyntheticTensor& t : tensors_) {
    tensors.push_back(
        {{"fqn", t.fqn}, {"shape", t.shape}, {"dtype", "float32"}});
  }
  const json j = {{"bytes", bytes_}, {"tensors", std::move(tensors)}};
  const std::string tmp = o_.model_out + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << j.dump(1) << "\n";
    out.close();
    if (!out) {
      return absl::UnavailableError(
          absl::StrCat("--model-out: cannot write ", tmp));
    }
  }
  std::error_code ec;
  fs::rename(tmp, o_.model_out, ec);
  if (ec) {
    return Annotate(StatusFromErrno(ec.value(), "rename", tmp), "--model-out");
  }
  return absl::OkStatus();
}

absl::StatusOr<ChildResult> Bench::Sample(
    const std::string& what, const std::function<absl::StatusOr<json>()>& fn) {
  sync();  // no earlier dirty data is flushed inside a timer
  absl::StatusOr<ChildResult> result = RunInChild(fn);
  if (!result.ok()) return Annotate(result.status(), what);
  return result;
}

absl::Status Bench::RunSave() {
  const int w = o_.ranks;
  const fs::path dir = work_ / "sync";
  Row row("save_sync", "save", std::nullopt, w);
  row.dest_bytes = HeldBytes(tensors_, w, 0);
  for (int i = 0; i < o_.repeat; ++i) {
    // Every sample saves afresh.
    CAIRN_RETURN_IF_ERROR(RemoveLocation(dir.string()));
    const std::string what =
        absl::StrFormat("save_sync, sample %d of %d", i + 1, o_.repeat);
    CAIRN_ASSIGN_OR_RETURN(ChildResult r, Sample(what, [&] {
                             return SaveSample(tensors_, w, dir.string(),
                                               FillThreads(w), o_);
                           }));
    const double s = Num(r.value, "seconds");
    row.samples.push_back(s);
    row.rank_seconds.push_back(r.value["rank_seconds"]);
    row.cpu.push_back(Num(r.value, "cpu_seconds"));
    row.sys.push_back(Num(r.value, "sys_seconds"));
    row.requests.push_back(Num(r.value, "requests"));
    row.peak_rss_bytes = std::max(row.peak_rss_bytes, r.peak_rss_bytes);
    Log("save_sync %d/%d: %.3f s, %.3f GB/s, peak RSS %.1f MiB", i + 1,
        o_.repeat, s, GigabytesPerSecond(bytes_, s), MiB(r.peak_rss_bytes));
  }
  CAIRN_ASSIGN_OR_RETURN(LocationSize size, SizeOfLocation(dir.string()));
  row.extra = {{"disk_bytes", size.bytes},
               {"files", size.files},
               {"codec", o_.codec.name}};
  rows_.push_back(std::move(row));
  return absl::OkStatus();
}

absl::Status Bench::RunAsync() {
  const int w = o_.ranks;
  const fs::path first = work_ / "async-first";
  const fs::path dir = work_ / "async";
  // The state and its staged copy.
  Row row("async_save", "async", std::nullopt, w);
  row.dest_bytes = 2 * HeldBytes(tensors_, w, 0);
  std::vector<double> first_blocked, first_total;
  int64_t allocations = 0;
  for (int i = 0; i < o_.repeat; ++i) {
    CAIRN_RETURN_IF_ERROR(RemoveLocation(first.string()));
    CAIRN_RETURN_IF_ERROR(RemoveLocation(dir.string()));
    const std::string what =
        absl::StrFormat("async_save, sample %d of %d", i + 1, o_.repeat);
    CAIRN_ASSIGN_OR_RETURN(ChildResult r, Sample(what, [&] {
                             return AsyncSample(tensors_, w, first, dir,
                                                FillThreads(w), o_);
                           }));
    const double s = Num(r.value, "seconds");
    const double b = Num(r.value, "blocked_seconds");
    row.samples.push_back(s);
    row.blocked.push_back(b);
    row.rank_seconds.push_back(r.value["rank_seconds"]);
    row.peak_rss_bytes = std::max(row.peak_rss_bytes, r.peak_rss_bytes);
    first_blocked.push_back(Num(r.value, "first_blocked_seconds"));
    first_total.push_back(Num(r.value, "first_seconds"));
    allocations = static_cast<int64_t>(Num(r.value, "staging_allocations"));
    Log("async_save %d/%d: blocked %.3f s, committed after %.3f s (first "
        "save, allocating staging buffers: blocked %.3f s of %.3f s), peak "
        "RSS %.1f MiB",
        i + 1, o_.repeat, b, s, first_blocked.back(), first_total.back(),
        MiB(r.peak_rss_bytes));
  }
  row.extra = {{"blocked_seconds", Median(row.blocked)},
               {"blocked_samples", row.blocked},
               {"first_blocked_seconds", Median(first_blocked)},
               {"first_seconds", Median(first_total)},
               {"staging_allocations", allocations}};
  rows_.push_back(std::move(row));
  if (!o_.keep) {
    // The loads read the sync checkpoint; give the disk space back now.
    (void)RemoveLocation(dir.string());
  }
  return absl::OkStatus();
}

absl::Status Bench::RunLoads() {
  const int w = o_.ranks;
  const fs::path dir = work_ / "sync";
  std::vector<std::string> caches;
  if (can_drop_) caches.push_back("cold");
  caches.push_back("warm");
  for (const LoadTarget& target : LoadTargets(w)) {
    if (!Wanted("load")) break;
    std::vector<Row> rows;
    for (const std::string& cache : caches) {
      Row row(target.name, "load", cache, target.ranks);
      row.dest_bytes = HeldBytes(tensors_, target.ranks, target.split_dim);
      rows.push_back(std::move(row));
    }
    // Cold, then warm right after, per repetition (as torch_peer.py).
    for (int i = 0; i < o_.repeat; ++i) {
      for (Row& row : rows) {
        const bool cold = *row.cache == "cold";
        const std::string what =
            absl::StrFormat("%s (%s), sample %d of %d", target.name,
                            *row.cache, i + 1, o_.repeat);
        CAIRN_ASSIGN_OR_RETURN(ChildResult r, Sample(what, [&] {
                                 return LoadSample(tensors_, target, cold,
                                                   can_drop_, dir,
                                                   FillThreads(target.ranks),
                                                   o_);
                               }));
        if (static_cast<uint64_t>(Num(r.value, "verified_bytes")) !=
            row.dest_bytes) {
          return absl::InternalError(absl::StrFormat(
              "%s: verified %d bytes, expected %d", what,
              static_cast<uint64_t>(Num(r.value, "verified_bytes")),
              row.dest_bytes));
        }
        const double s = Num(r.value, "seconds");
        row.samples.push_back(s);
        row.rank_seconds.push_back(r.value["rank_seconds"]);
        row.cpu.push_back(Num(r.value, "cpu_seconds"));
        row.sys.push_back(Num(r.value, "sys_seconds"));
        row.requests.push_back(Num(r.value, "requests"));
        row.peak_rss_bytes = std::max(row.peak_rss_bytes, r.peak_rss_bytes);
        row.extra["storage_bytes_read"] =
            static_cast<uint64_t>(Num(r.value, "storage_bytes_read"));
        row.extra["device_bytes_read"] =
            static_cast<uint64_t>(Num(r.value, "device_bytes_read"));
        row.extra["phase_seconds"] = r.value["phase_seconds"];
        row.extra["chunks_crc_checked"] =
            static_cast<uint64_t>(Num(r.value, "chunks_crc_checked"));
        const json& ph = r.value["phase_seconds"];
        Log("%s %s %d/%d: %.3f s, %.3f GB/s (metadata %.3f, planning %.3f, "
            "read %.3f s), peak RSS %.1f MiB, verified",
            target.name, *row.cache, i + 1, o_.repeat, s,
            GigabytesPerSecond(bytes_, s), Num(ph, "metadata"),
            Num(ph, "planning"), Num(ph, "read"), MiB(r.peak_rss_bytes));
        // The warm limit, measured next to the row it bounds: host memory
        // bandwidth moves between minutes on a shared machine.
        if (!cold && target.name == "load_same" && Wanted("memcpy")) {
          CAIRN_RETURN_IF_ERROR(TakeMemcpySample(absl::StrFormat(
              "memcpy after load_same (warm) sample %d of %d", i + 1,
              o_.repeat)));
        }
      }
    }
    for (Row& row : rows) {
      row.extra["save_ranks"] = w;
      row.extra["split"] = target.split_dim == 0 ? "rows" : "cols";
      row.extra["verified"] = true;
      rows_.push_back(std::move(row));
    }
  }
  // load_sink: streaming's memory bound (one rank, every byte, no
  // destination memory).
  if (!Wanted("sink")) return absl::OkStatus();
  const std::string cache = can_drop_ ? "cold" : "warm";
  Row row("load_sink", "load", cache, 1);
  row.dest_bytes = 0;
  for (int i = 0; i < o_.repeat; ++i) {
    const std::string what = absl::StrFormat("load_sink (%s), sample %d of %d",
                                             cache, i + 1, o_.repeat);
    CAIRN_ASSIGN_OR_RETURN(ChildResult r, Sample(what, [&] {
                             return LoadSinkSample(can_drop_, can_drop_, dir,
                                                   o_);
                           }));
    const double s = Num(r.value, "seconds");
    row.samples.push_back(s);
    row.peak_rss_bytes = std::max(row.peak_rss_bytes, r.peak_rss_bytes);
    row.extra["sink_bytes"] = static_cast<uint64_t>(Num(r.value, "sink_bytes"));
    row.extra["storage_bytes_read"] =
        static_cast<uint64_t>(Num(r.value, "storage_bytes_read"));
    row.extra["chunks_crc_checked"] =
        static_cast<uint64_t>(Num(r.value, "chunks_crc_checked"));
    if (Num(r.value, "bytes_unverified") != 0) {
      return absl::InternalError(what + ": bytes reached the sink unchecked");
    }
    Log("load_sink %s %d/%d: %.3f s, %.3f GB/s, peak RSS %.1f MiB (budget "
        "%.1f MiB)",
        cache, i + 1, o_.repeat, s, GigabytesPerSecond(bytes_, s),
        MiB(r.peak_rss_bytes), MiB(o_.memory_budget_bytes));
  }
  row.extra["memory_budget_bytes"] = o_.memory_budget_bytes;
  rows_.push_back(std::move(row));
  return absl::OkStatus();
}

absl::Status Bench::TakeMemcpySample(const std::string& what) {
  const uint64_t bytes = std::min(bytes_, kMemcpyMaxBytes);
  const int threads = DefaultThreads();
  CAIRN_ASSIGN_OR_RETURN(
      ChildResult r, Sample(what, [&] { return MemcpySample(bytes, threads); }));
  r.value["peak_rss_bytes"] = r.peak_rss_bytes;
  if (threads > 1) {
    Log("%s: %.2f GB/s on 1 thread, %.2f GB/s on %d threads (%s buffer)", what,
        Num(r.value, "gb_per_s"), Num(r.value, "parallel_gb_per_s"), threads,
        HumanBytes(bytes));
  } else {
    Log("%s: %.2f GB/s (%s buffer)", what, Num(r.value, "gb_per_s"),
        HumanBytes(bytes));
  }
  memcpy_samples_.push_back(std::move(r.value));
  return absl::OkStatus();
}

// --repeat samples in all: those RunLoads took after its warm load_same
// samples, and the rest now. The reported figures are their medians, as a
// row's seconds are the median of its samples.
absl::Status Bench::RunMemcpy() {
  for (int i = static_cast<int>(memcpy_samples_.size()); i < o_.repeat; ++i) {
    CAIRN_RETURN_IF_ERROR(TakeMemcpySample(
        absl::StrFormat("memcpy sample %d of %d", i + 1, o_.repeat)));
  }
  memcpy_ = memcpy_samples_.front();
  json samples = json::array();
  std::vector<double> single, parallel;
  uint64_t peak = 0;
  for (const json& m : memcpy_samples_) {
    samples.push_back({{"gb_per_s", m["gb_per_s"]},
                       {"parallel_gb_per_s", m["parallel_gb_per_s"]}});
    single.push_back(Num(m, "gb_per_s"));
    if (m["parallel_gb_per_s"].is_number()) {
      parallel.push_back(Num(m, "parallel_gb_per_s"));
    }
    peak = std::max(peak, static_cast<uint64_t>(Num(m, "peak_rss_bytes")));
  }
  // The seconds that go with the median GB/s (bytes / GB/s).
  const double bytes = Num(memcpy_, "bytes");
  memcpy_["gb_per_s"] = Median(single);
  memcpy_["seconds"] = bytes / (Median(single) * 1e9);
  if (!parallel.empty()) {
    memcpy_["parallel_gb_per_s"] = Median(parallel);
    memcpy_["parallel_seconds"] = bytes / (Median(parallel) * 1e9);
  }
  memcpy_["peak_rss_bytes"] = peak;
  memcpy_["samples"] = std::move(samples);
  if (memcpy_samples_.size() > 1) {
    Log("memcpy: median of %d samples %.2f GB/s on 1 thread, %.2f GB/s on "
        "all cores",
        memcpy_samples_.size(), Num(memcpy_, "gb_per_s"),
        Num(memcpy_, "parallel_gb_per_s"));
  }
  return absl::OkStatus();
}

void Bench::CheckRss() {
  for (const Row& row : rows_) {
    // The kv save holds its chunk and write buffers; the cache-all load is
    // FBGEMM's way, there to be compared with.
    if (row.name == "kv_save" || row.name.ends_with("_cache_all")) continue;
    if (row.name == "load_sink" || row.name.starts_with("kv_load")) {
      // Streaming's bound: what the sinks keep (the kv rows: the table's
      // rows, in memory touched before the load), each rank's budget
      // (the ranks are threads of this process) and 128 MiB (the process
      // itself, metadata), whatever the state's size.
      const uint64_t limit = row.dest_bytes +
                             o_.memory_budget_bytes * row.ranks +
                             (uint64_t{128} << 20);
      if (o_.memory_budget_bytes != 0 && row.peak_rss_bytes > limit) {
        findings_.push_back(absl::StrFormat(
            "%s: peak RSS %.1f MiB is more than the rows kept + %d x "
            "--memory-budget + 128 MiB (%.1f MiB)",
            row.name, MiB(row.peak_rss_bytes), row.ranks, MiB(limit)));
      }
      continue;
    }
    if (row.peak_rss_bytes > row.dest_bytes + kRssSlack) {
      findings_.push_back(absl::StrFormat(
          "%s%s: peak RSS %.1f MiB is more than its tensor bytes + 256 MiB "
          "(%.1f MiB)",
          row.name, row.cache ? absl::StrCat(" (", *row.cache, ")") : "",
          MiB(row.peak_rss_bytes), MiB(row.dest_bytes + kRssSlack)));
    }
  }
}

absl::Status Bench::RunKv() {
  const std::string dir = (work_ / "kv").string();
  const uint64_t rows = KvRowsFor(bytes_);
  const int w = o_.ranks;
  const int lw = std::max(1, w - 1);
  Log("kv: a table of %d rows (%s) saved by %d ranks, loaded by %d", rows,
      HumanBytes(rows * (8 + SyntheticKvSpec(1).row_bytes())), w, lw);
  Row save("kv_save", "save", std::nullopt, w);
  for (int i = 0; i < o_.repeat; ++i) {
    // Every sample saves afresh, as save_sync's.
    CAIRN_RETURN_IF_ERROR(RemoveLocation(dir));
    const std::string what =
        absl::StrFormat("kv_save, sample %d of %d", i + 1, o_.repeat);
    CAIRN_ASSIGN_OR_RETURN(ChildResult r, Sample(what, [&] {
                             return KvSaveSample(dir, rows, w);
                           }));
    save.samples.push_back(Num(r.value, "seconds"));
    save.peak_rss_bytes = std::max(save.peak_rss_bytes, r.peak_rss_bytes);
    save.extra["table_bytes"] = r.value["bytes"];
    save.dest_bytes = static_cast<uint64_t>(Num(r.value, "bytes"));
    save.extra["files"] = r.value["files"];
    Log("%s: %.3f s, %.3f GB/s, peak RSS %.1f MiB", what,
        save.samples.back(), GigabytesPerSecond(bytes_, save.samples.back()),
        MiB(r.peak_rss_bytes));
  }
  save.extra["rows"] = rows;
  rows_.push_back(std::move(save));
  const std::string cache = can_drop_ ? "cold" : "warm";
  struct Kind {
    const char* suffix;
    bool rebucket;
    bool cache_all;
  };
  for (const Kind& k : {Kind{"", false, false}, Kind{"_rebucket", true, false},
                        Kind{"_cache_all", false, true}}) {
    Row row(absl::StrFormat("kv_load_%dto%d%s", w, lw, k.suffix), "load",
            cache, lw);
    for (int i = 0; i < o_.repeat; ++i) {
      const std::string what = absl::StrFormat("%s (%s), sample %d of %d",
                                               row.name, cache, i + 1,
                                               o_.repeat);
      CAIRN_ASSIGN_OR_RETURN(
          ChildResult r, Sample(what, [&] {
            return KvLoadSample(dir, rows, lw, k.rebucket, k.cache_all,
                                o_.memory_budget_bytes, [&] {
                                  return can_drop_ ? DropPageCache()
                                                   : Prewarm(dir, false);
                                });
          }));
      row.samples.push_back(Num(r.value, "seconds"));
      row.peak_rss_bytes = std::max(row.peak_rss_bytes, r.peak_rss_bytes);
      row.extra["storage_bytes_read"] = r.value["storage_bytes_read"];
      row.dest_bytes = static_cast<uint64_t>(Num(r.value, "kept_bytes"));
      Log("%s: %.3f s, %.3f GB/s, peak RSS %.1f MiB, every row checked", what,
          row.samples.back(), GigabytesPerSecond(bytes_, row.samples.back()),
          MiB(r.peak_rss_bytes));
    }
    row.extra["rows"] = rows;
    row.extra["memory_budget_bytes"] = o_.memory_budget_bytes;
    row.extra["verified"] = true;
    rows_.push_back(std::move(row));
  }
  // Against the targets: throughput beside a dense state of the same
  // bytes (the load row of the same ranks and split), and the memory of
  // the cache-all way.
  const Row* load = FindRow(absl::StrFormat("kv_load_%dto%d", w, lw), cache);
  const Row* all =
      FindRow(absl::StrFormat("kv_load_%dto%d_cache_all", w, lw), cache);
  const Row* dense =
      FindRow(absl::StrFormat("load_%dto%d_rows", w, lw), cache);
  const Row* dense_save = FindRow("save_sync", std::nullopt);
  const Row* kv_save = FindRow("kv_save", std::nullopt);
  if (dense != nullptr && load != nullptr) {
    findings_.push_back(absl::StrFormat(
        "kv: %s at %.2fx the throughput of the dense %s (target >= 0.8x)",
        load->name, dense->seconds() / load->seconds(), dense->name));
  }
  if (dense_save != nullptr && kv_save != nullptr) {
    findings_.push_back(absl::StrFormat(
        "kv: kv_save at %.2fx the throughput of the dense save_sync "
        "(target >= 0.8x)",
        dense_save->seconds() / kv_save->seconds()));
  }
  if (load != nullptr && all != nullptr) {
    findings_.push_back(absl::StrFormat(
        "kv: peak RSS %.1f MiB streaming (%.1f MiB of rows kept by the "
        "sinks, %d ranks of budget %.1f MiB each) vs %.1f MiB caching every "
        "row first (FBGEMM's way); %.2fx its speed",
        MiB(load->peak_rss_bytes), MiB(load->dest_bytes), load->ranks,
        MiB(o_.memory_budget_bytes), MiB(all->peak_rss_bytes),
        all->seconds() / load->seconds()));
  }
  return absl::OkStatus();
}

const Row* Bench::FindRow(const std::string& name,
                          std::optional<std::string> cache) const {
  for (const Row& row : rows_) {
    if (row.name == name && row.cache == cache) return &row;
  }
  return nullptr;
}


int Bench::Run() {
  absl::Status status = Prepare();
  absl::Cleanup remove_work = [&] {
    if (!work_.empty() && !o_.keep) (void)RemoveLocation(work_.string());
  };
  if (status.ok() && !o_.model_out.empty()) status = WriteModel();
  if (status.ok()) {
    Log("%d bytes (%s) of float32 state in %d tensors (%d layers, hidden "
        "%d); %d save ranks as threads; cold=%s; work folder %s",
        bytes_, HumanBytes(bytes_), tensors_.size(), model_.config.layers,
        model_.config.hidden, o_.ranks,
        can_drop_ ? "drop_caches" : "unavailable", work_.string());
  }
  if (status.ok() && (Wanted("save") || Wanted("load") || Wanted("sink"))) {
    status = RunSave();
  }
  if (status.ok() && Wanted("async")) status = RunAsync();
  if (status.ok() && (Wanted("load") || Wanted("sink"))) status = RunLoads();
  if (status.ok() && Wanted("memcpy")) status = RunMemcpy();
  if (status.ok() && Wanted("kv")) status = RunKv();
  if (!status.ok()) {
    PrintError("bench", status);
    if (o_.keep && !work_.empty()) Log("kept %s", work_.string());
    return 1;
  }
  CheckRss();
  notes_ = {
      "GB/s = state bytes / seconds / 1e9 for every row, resharded loads "
      "included (each reads the whole state across its ranks).",
      "seconds = wall time from a common barrier to the last rank finishing "
      "(max end - min start over the ranks, CLOCK_MONOTONIC); per-rank "
      "durations in rank_seconds; the median of --repeat samples.",
      "cpu_seconds, sys_seconds (save and load rows): CPU time (user + "
      "system, and system alone) of the whole process, all its ranks, from "
      "the barrier before the timed call to the barrier after it (getrusage); "
      "the median of the samples. Less disturbed than wall time by other "
      "load on the machine: the figure to compare two builds of cairn by.",
      "storage_bytes_read (load rows): bytes the ranks read from storage, "
      "gaps of coalesced spans included; device_bytes_read: bytes the "
      "process made the block device read over the same interval "
      "(getrusage ru_inblock x 512: O_DIRECT and page-cache misses, not "
      "hits), the last sample's. Several ranks reading one span through "
      "the page cache make the device read it once.",
      "Ranks are threads of one process with the in-process communicator. "
      "Every sample runs in a fresh child process; peak_rss_bytes is the "
      "child's ru_maxrss (wait4), the largest over the samples. dest_bytes "
      "is the tensor bytes that process holds by design: the destinations "
      "for a load, the source shards for a save, the source shards and "
      "their staged copy for async_save.",
      "save_sync: cairn::Save with default options (O_DIRECT where the "
      "filesystem allows, every data file fdatasync'ed, metadata.json "
      "written last by temp file, fsync, rename, fsync of the directory), "
      "inside the timer.",
      "async_save: cairn::AsyncSaver, two saves in a row; the second (its "
      "stager reusing the host buffers of the first, as in a training loop) "
      "is reported: blocked_seconds until Save() returned, seconds until "
      "Wait() returned with the checkpoint committed. first_* are the first "
      "save's, which allocates the staging buffers.",
      "load_*: destinations allocated and filled with NaN before the timer; "
      "every element checked bit for bit after it. Loads read the save_sync "
      "checkpoint, saved by --ranks ranks split on dim 0 (rank k of W holds "
      "[n*k//W, n*(k+1)//W)); _rows split dim 0, _cols dim 1 (1-D tensors "
      "dim 0), as torch_peer.py.",
      "cold: sync + echo 3 > /proc/sys/vm/drop_caches after the "
      "destinations are allocated, outside the timer; warm: the page cache "
      "dropped (where cold rows run) and every file of the checkpoint read "
      "twice before the timer, so its pages are cached and on the kernel's "
      "active list whatever the cold load before did (as torch_peer.py).",
      absl::StrFormat(
          "memcpy: the best of %d copies of a touched %s buffer, on one "
          "thread and on all %d cores (each a slice), in a fresh child; "
          "--repeat such samples, one right after each warm load_same "
          "sample when loads run, and the median of each figure reported "
          "(every sample in memcpy.samples): the limit for a warm load, "
          "which copies from the page cache.",
          kMemcpyIterations,
          HumanBytes(std::min(bytes_, kMemcpyMaxBytes)), DefaultThreads()),
  };
  if (o_.keep) notes_.push_back(absl::StrCat("kept ", work_.string()));
  if (!o_.verify_checksums) {
    notes_.push_back(
        "--no-verify: the loads did not check the chunks' CRC32C "
        "(cairn checks them by default); elements were still compared "
        "after each load.");
  }
  if (o_.json) {
    std::cout << ToJson().dump() << std::endl;
  } else {
    PrintTable();
  }
  return 0;
}


}  // namespace cairn::tools::internal_bench
