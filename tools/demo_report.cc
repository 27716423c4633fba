// cairn demo, the report (step 7 of the protocol at the top of demo.cc):
// Demo::Finish runs the direct-I/O disk probe beside the checkpoint (the
// disk's own speed to compare the save and load with), then Demo::Print
// prints the table, or Demo::PrintJson the JSON, and Finish returns the
// exit status.
#include <fcntl.h>
#include <linux/magic.h>
#include <stdlib.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cairn/cairn.h"
#include "cli_util.h"
#include "demo_internal.h"
#include "synthetic_model.h"

namespace cairn::tools {
namespace {

const char* LoadModeName(LoadMode mode) {
  switch (mode) {
    case LoadMode::kGlobal:
      return "global";
    case LoadMode::kMergeThenGlobal:
      return "merge_then_global";
    case LoadMode::kRankLocal:
      return "rank_local";
  }
  return "global";
}

// A short sequential direct-I/O probe of `dir`'s disk: a file of up to
// 256 MiB (about the state's size) written by 4 threads in 8 MiB requests
// then fdatasync'd, then read back the same way, then removed. Direct I/O
// skips the page cache both ways, so these are the disk's speeds, as fio's
// direct jobs in bench/run.sh measure them (more thoroughly).
DemoResult::DiskProbe ProbeDisk(const std::string& dir, uint64_t state_bytes) {
  DemoResult::DiskProbe p;
  constexpr uint64_t kBlock = uint64_t{8} << 20;
  constexpr int kThreads = 4;
  const uint64_t blocks = std::clamp<uint64_t>(
      (state_bytes + kBlock - 1) / kBlock, kThreads, 32);
  p.bytes = blocks * kBlock;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    p.skipped = "the checkpoint is not in a local directory";
    return p;
  }
  struct statfs fs {};
  if (statfs(dir.c_str(), &fs) == 0 &&
      (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC)) {
    p.skipped = "the checkpoint is on a RAM filesystem (no disk to probe)";
    return p;
  }
  const std::string path = dir + "/.cairn-disk-probe";
  const int fd =
      open(path.c_str(), O_CREAT | O_TRUNC | O_RDWR | O_DIRECT | O_CLOEXEC,
           0600);
  if (fd < 0) {
    p.skipped = errno == EINVAL
                    ? "its filesystem refuses direct I/O (a RAM disk?)"
                    : absl::StrCat("cannot create ", path, ": ",
                                   std::strerror(errno));
    return p;
  }
  absl::Cleanup close_and_remove = [&] {
    close(fd);
    unlink(path.c_str());
  };
  // Allocated up front: ext4 runs direct writes past the end one at a time.
  if (posix_fallocate(fd, 0, static_cast<off_t>(p.bytes)) != 0) {
    p.skipped = absl::StrFormat("no room for a %s probe file",
                                HumanBytes(p.bytes));
    return p;
  }
  std::unique_ptr<std::byte, decltype(&std::free)> buffer(
      static_cast<std::byte*>(std::aligned_alloc(4096, kBlock * kThreads)),
      &std::free);
  if (buffer == nullptr) {
    p.skipped = "out of memory";
    return p;
  }
  std::memset(buffer.get(), 0x5a, kBlock * kThreads);
  // Seconds for every block written (or read) once; 0 on an I/O error.
  auto pass = [&](bool write) -> double {
    std::atomic<bool> failed{false};
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::byte* b = buffer.get() + static_cast<uint64_t>(t) * kBlock;
        for (uint64_t i = static_cast<uint64_t>(t); i < blocks;
             i += kThreads) {
          const off_t at = static_cast<off_t>(i * kBlock);
          const ssize_t n = write ? pwrite(fd, b, kBlock, at)
                                  : pread(fd, b, kBlock, at);
          if (n != static_cast<ssize_t>(kBlock)) failed = true;
        }
      });
    }
    for (std::thread& th : threads) th.join();
    if (write && fdatasync(fd) != 0) failed = true;
    if (failed) return 0;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         t0)
        .count();
  };
  const double w = pass(/*write=*/true);
  const double r = w > 0 ? pass(/*write=*/false) : 0;
  if (w <= 0 || r <= 0) {
    p.skipped = absl::StrCat("an I/O error in ", path);
    return p;
  }
  p.write_gbps = GigabytesPerSecond(p.bytes, w);
  p.read_gbps = GigabytesPerSecond(p.bytes, r);
  return p;
}

}  // namespace

void Demo::PrintJson() const {
  const SyntheticModel* m = r_.model ? &*r_.model : nullptr;
  auto opt = [](const std::optional<double>& v) {
    return v ? nlohmann::json(*v) : nlohmann::json();
  };
  auto gbps = [&](const std::optional<double>& s) {
    return s ? nlohmann::json(GigabytesPerSecond(r_.bytes, *s))
             : nlohmann::json();
  };
  const nlohmann::json load_ranks =
      r_.load_seconds ? nlohmann::json(r_.load_ranks) : nlohmann::json();
  nlohmann::json j;
  j["phase"] = o_.phase;
  j["comm"] = o_.comm;
  j["dir"] = r_.dir;
  j["kept"] = r_.kept;
  j["bytes"] = r_.bytes;
  j["step"] = r_.step;
  j["ranks"] = r_.save_ranks;
  j["load_ranks"] = load_ranks;
  if (r_.disk) {
    j["disk_probe"] = {{"bytes", r_.disk->bytes}};
    if (r_.disk->skipped.empty()) {
      j["disk_probe"]["write_gbps"] = r_.disk->write_gbps;
      j["disk_probe"]["read_gbps"] = r_.disk->read_gbps;
    } else {
      j["disk_probe"]["skipped"] = r_.disk->skipped;
    }
  }
  j["save_seconds"] = opt(r_.save_seconds);
  j["load_seconds"] = opt(r_.load_seconds);
  j["save_gbps"] = gbps(r_.save_seconds);
  j["load_gbps"] = gbps(r_.load_seconds);
  j["verify_seconds"] = opt(r_.verify_seconds);
  j["verified"] = r_.verified;
  j["elements_verified"] = r_.elements_verified;
  j["rng_objects_verified"] = r_.rng_verified;
  j["mismatch"] =
      r_.mismatch.empty() ? nlohmann::json() : nlohmann::json(r_.mismatch);
  if (m) {
    j["tensors"] = m->tensors.size();
    j["elements"] = m->total_elements();
    j["layers"] = m->config.layers;
    j["hidden"] = m->config.hidden;
    j["ffn"] = m->config.ffn;
    j["vocab"] = m->config.vocab;
  }
  // Older names of "ranks" and "load_ranks": shards per sharded weight.
  j["save_shards"] = r_.save_ranks;
  j["load_shards"] = load_ranks;
  // Data-parallel replica groups of this run (--replicas) and of the save
  // (read from the checkpoint by --phase load); "ranks" and "load_ranks"
  // are per group, "save_world" and "load_world" all the ranks.
  j["replicas"] = o_.replicas;
  j["save_replicas"] = r_.save_replicas;
  j["save_world"] = r_.save_ranks * r_.save_replicas;
  j["load_world"] = r_.load_seconds
                        ? nlohmann::json(r_.load_ranks * o_.replicas)
                        : nlohmann::json();
  j["rank_local"] = r_.rank_local;  // the checkpoint was saved rank-local
  j["broadcast"] = !o_.no_broadcast;
  if (r_.save_seconds) {
    j["save_files"] = r_.save_files;
    j["checkpoint_bytes"] = r_.checkpoint_bytes;
  }
  j["merge_seconds"] = opt(r_.merge_seconds);
  if (r_.load_seconds) {
    j["load_mode"] = LoadModeName(r_.load_mode);
    j["load_bytes_read"] = r_.load_bytes_read;
    j["load_bytes_read_per_rank"] = r_.load_bytes_read_per_rank;
    j["load_replica_group_size"] = r_.load_replica_group_size;
    j["load_phases"] = {{"metadata", r_.load_phases.metadata},
                        {"planning", r_.load_phases.planning},
                        {"read", r_.load_phases.read},
                        {"broadcast", r_.load_phases.broadcast},
                        {"copy", r_.load_phases.copy},
                        {"staging", r_.load_phases.staging}};
  }
  if (o_.async) {
    j["async_steps"] = o_.steps;
    j["save_every"] = o_.save_every;
    j["async_save_steps"] = r_.async_save_steps;
    j["blocked_seconds"] = r_.blocked_seconds;
    j["sync_save_seconds"] = opt(r_.sync_save_seconds);
  }
  std::cout << j.dump() << std::endl;
}

void Demo::Print() const {
  if (o_.json) {
    PrintJson();
    return;
  }
  const SyntheticModel* m = r_.model ? &*r_.model : nullptr;
  if (m) {
    std::cout << absl::StrFormat(
        "model: %d tensors, %d layers, hidden %d, ffn %d, vocab %d, step %d\n",
        m->tensors.size(), m->config.layers, m->config.hidden, m->config.ffn,
        m->config.vocab, r_.step);
  }
  std::cout << absl::StrFormat("checkpoint: %s%s\n", r_.dir,
                               r_.kept ? "" : " (removed)");
  std::cout << absl::StrFormat(
      "ranks: %s\n", o_.comm == "mpi" ? "MPI processes (--comm mpi)"
                                      : "threads of this process (--comm "
                                        "inproc)");
  std::cout << absl::StrFormat("%-6s %5s %14s %10s %8s\n", "phase", "ranks",
                               "bytes", "seconds", "GB/s");
  const int save_world = r_.save_ranks * r_.save_replicas;
  const int load_world = r_.load_ranks * o_.replicas;
  if (r_.save_seconds) {
    std::cout << absl::StrFormat(
        "%-6s %5d %14d %10.3f %8.2f\n", "save", save_world, r_.bytes,
        *r_.save_seconds, GigabytesPerSecond(r_.bytes, *r_.save_seconds));
  }
  if (r_.load_seconds) {
    std::cout << absl::StrFormat(
        "%-6s %5d %14d %10.3f %8.2f\n", "load", load_world, r_.bytes,
        *r_.load_seconds, GigabytesPerSecond(r_.bytes, *r_.load_seconds));
  }
  if (r_.disk && r_.disk->skipped.empty()) {
    std::cout << absl::StrFormat(
        "disk: a %s direct-I/O probe beside the checkpoint (4 threads, 8 MiB "
        "requests) wrote %.2f GB/s with fdatasync and read %.2f GB/s\n",
        HumanBytes(r_.disk->bytes), r_.disk->write_gbps, r_.disk->read_gbps);
    // cairn writes data files with direct I/O, so they are not in the page
    // cache when the load runs (fincore shows none of their pages).
    std::cout << absl::StrFormat(
        "disk: the save ran at %.2fx the probe's write",
        GigabytesPerSecond(r_.bytes, *r_.save_seconds) / r_.disk->write_gbps);
    if (r_.load_seconds) {
      std::cout << absl::StrFormat(
          ", the load at %.2fx its read (from the disk: the save writes with "
          "direct I/O; with more threads and the kernel's readahead)",
          GigabytesPerSecond(r_.bytes, *r_.load_seconds) /
              r_.disk->read_gbps);
    }
    std::cout << "; bench/run.sh measures the disk with fio\n";
  } else if (r_.disk) {
    std::cout << "disk: not probed: " << r_.disk->skipped << "\n";
  }
  if (r_.save_replicas > 1 || o_.replicas > 1) {
    std::cout << absl::StrFormat(
        "replicas: save %s; load %s\n",
        LayoutText(r_.save_replicas, r_.save_ranks),
        r_.load_seconds ? LayoutText(o_.replicas, r_.load_ranks)
                        : std::string("not run"));
  }
  if (r_.save_seconds) {
    if (r_.rank_local) {
      std::cout << absl::StrFormat(
          "save: rank-local: each rank wrote its own rank-NNNNN/ folder, no "
          "collective, no dedup (replicated boxes written by every holder): "
          "%s, %s on disk\n",
          Plural(static_cast<uint64_t>(r_.save_files), "data file"),
          HumanBytes(r_.checkpoint_bytes));
    } else {
      std::cout << absl::StrFormat(
          "save: global: each replicated box written once, spread over its "
          "holders: %s, %s on disk\n",
          Plural(static_cast<uint64_t>(r_.save_files), "data file"),
          HumanBytes(r_.checkpoint_bytes));
    }
  }
  if (o_.async && r_.sync_save_seconds) {
    std::cout << absl::StrFormat(
        "async: %d training steps, a save every %d (to %s/step-<s>; the "
        "synchronous save above went to %s/sync)\n",
        o_.steps, o_.save_every, r_.dir, r_.dir);
    double total = 0;
    for (size_t i = 0; i < r_.blocked_seconds.size(); ++i) {
      total += r_.blocked_seconds[i];
      std::cout << absl::StrFormat(
          "step %d: training blocked %.3f s (sync save %.3f s)\n",
          i < r_.async_save_steps.size() ? r_.async_save_steps[i] : 0,
          r_.blocked_seconds[i], *r_.sync_save_seconds);
    }
    if (!r_.blocked_seconds.empty()) {
      const double mean =
          total / static_cast<double>(r_.blocked_seconds.size());
      std::cout << absl::StrFormat(
          "async: blocked %.3f s per save on average, %.1fx less than a "
          "synchronous save\n",
          mean, mean > 0 ? *r_.sync_save_seconds / mean : 0.0);
    }
  }
  if (r_.load_seconds) {
    switch (r_.load_mode) {
      case LoadMode::kRankLocal:
        std::cout << absl::StrFormat(
            "load: rank-local: same ranks and shards as the save; each rank "
            "read only its own rank-NNNNN/ folder (no collective, no "
            "broadcast)\n");
        break;
      case LoadMode::kMergeThenGlobal:
        std::cout << absl::StrFormat(
            "load: merged the %d rank folders into a global checkpoint in "
            "%.3f s (rank 0; %d replicated chunks kept once), then a global "
            "load resharding %d -> %d tensor-parallel ranks\n",
            r_.merged_ranks, r_.merge_seconds.value_or(0),
            r_.merge_duplicates, r_.save_ranks, r_.load_ranks);
        break;
      case LoadMode::kGlobal:
        std::cout << absl::StrFormat(
            "load: global%s, resharding %d -> %d tensor-parallel ranks\n",
            r_.merged_earlier ? " (the rank-local checkpoint was merged "
                                "earlier)"
                              : "",
            r_.save_ranks, r_.load_ranks);
        break;
    }
    const double ratio =
        r_.bytes > 0 ? static_cast<double>(r_.load_bytes_read) /
                           static_cast<double>(r_.bytes)
                     : 0;
    std::string how;
    if (r_.load_replica_group_size > 1) {
      how = absl::StrFormat(
          "; broadcast load in replica groups of %d: about %.2fx without",
          r_.load_replica_group_size, ratio * r_.load_replica_group_size);
    } else if (o_.replicas > 1) {
      how = r_.load_mode == LoadMode::kRankLocal
                ? "; rank-local: every replica read its own folder"
                : "; --no-broadcast: every replica read its own copy";
    }
    std::cout << absl::StrFormat(
        "storage read: %s by %d %s, %.2fx one copy of the state%s\n",
        HumanBytes(r_.load_bytes_read), load_world,
        load_world == 1 ? "rank" : "ranks", ratio, how);
    if (r_.load_bytes_read_per_rank.size() > 1) {
      constexpr size_t kShown = 16;
      std::vector<std::string> per;
      for (size_t i = 0;
           i < r_.load_bytes_read_per_rank.size() && i < kShown; ++i) {
        per.push_back(HumanBytes(r_.load_bytes_read_per_rank[i]));
      }
      if (r_.load_bytes_read_per_rank.size() > kShown) per.push_back("...");
      std::cout << "storage read per rank: " << absl::StrJoin(per, ", ")
                << "\n";
    }
    std::cout << absl::StrFormat(
        "load phases (slowest rank): metadata %.3f s, planning %.3f s, read "
        "%.3f s, broadcast %.3f s, copy %.3f s, staging %.3f s\n",
        r_.load_phases.metadata, r_.load_phases.planning, r_.load_phases.read,
        r_.load_phases.broadcast, r_.load_phases.copy,
        r_.load_phases.staging);
    if (r_.verified) {
      const int saved_world = r_.save_ranks * r_.save_replicas;
      std::cout << absl::StrFormat(
          "verified: yes (%d elements bit-exact, saved by %d %s, loaded by "
          "%d%s; step and %s match)\n",
          r_.elements_verified, saved_world,
          saved_world == 1 ? "rank" : "ranks", load_world,
          o_.replicas > 1 ? "; every replica checked its own copy" : "",
          Plural(static_cast<uint64_t>(r_.rng_verified), "rng object"));
    } else {
      std::cout << "verified: NO (" << r_.mismatch << ")\n";
    }
  } else {
    std::cout << "verified: not run (save phase only)\n";
  }
  std::cout << std::flush;
}

int Demo::Finish(const absl::Status& status) {
  if (!status.ok()) {
    PrintError("demo", status);
    return 1;
  }
  // The disk's own speed beside the save's (with the checkpoint still
  // there, so the probe's file sits on the same disk).
  if (r_.save_seconds && !o_.no_disk_probe) {
    if (!o_.quiet) {
      std::cerr << "cairn demo: probing the disk of " << r_.dir
                << " (direct I/O)" << std::endl;
    }
    r_.disk = ProbeDisk(r_.dir, r_.bytes);
  }
  Print();
  if (r_.load_seconds && !r_.verified) {
    PrintError("demo", absl::DataLossError(
                           absl::StrCat("verification failed: ", r_.mismatch)));
    return 1;
  }
  return 0;
}

}  // namespace cairn::tools
