// cairn bench's command line: its options, their checks and --help
// (RegisterBench, commands.h); Bench (bench.cc) does the work.
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

namespace cairn::tools {

using internal_bench::Bench;
using internal_bench::BenchOptions;
using internal_bench::kMaxInProcessRanks;
using internal_bench::kMemcpyIterations;
using internal_bench::MiB;

void RegisterBench(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Measure cairn's save, async save and (resharded) loads on your "
      "storage, cold and warm, with peak memory");
  cmd->add_option("--dir", o->dir,
                  "directory on the storage to measure (created if missing); "
                  "the benchmark writes its checkpoints in a fresh folder "
                  "cairn_bench_<pid>_<time> inside it, removed at the end "
                  "unless --keep")
      ->required();
  cmd->add_option("--size", o->size,
                  "bytes of float32 state, e.g. 256MiB, 2GiB, 1G, 500M or "
                  "plain bytes; the synthetic model for a size is the same "
                  "every time (`cairn demo`'s model: embedding, transformer "
                  "layers, Adam moments)")
      ->capture_default_str()
      ->check(ByteSizeValidator(1, kMaxSyntheticBytes));
  cmd->add_option("--ranks", o->ranks,
                  "W, the ranks that save (threads of one process): every "
                  "tensor is split on dim 0, rank k holding rows "
                  "[n*k/W, n*(k+1)/W). Loads run on W, W/2 and W-1 ranks")
      ->type_name("W")
      ->capture_default_str()
      ->check(CLI::Range(1, kMaxInProcessRanks));
  cmd->add_flag("--json", o->json,
                "print one JSON object on stdout instead of the table");
  cmd->add_option("--cold", o->cold,
                  "how loads are made cold: auto (drop the page cache when "
                  "running as root and /proc/sys/vm/drop_caches can be "
                  "written, else skip the cold rows and say why), drop "
                  "(the same, but fail when it cannot), none (warm rows "
                  "only)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "drop", "none"}));
  cmd->add_option("--model-out", o->model_out,
                  "also write the model as JSON for the PyTorch peer "
                  "(bench/peers/torch_peer.py --model FILE): {\"bytes\": N, "
                  "\"tensors\": [{\"fqn\", \"shape\", \"dtype\": "
                  "\"float32\"}, ...]}")
      ->type_name("FILE");
  cmd->add_option("--repeat", o->repeat,
                  "samples of every timed phase, each in a fresh process; "
                  "the median is reported")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--io-threads", o->io_threads,
                  "IO threads per rank (SaveOptions/LoadOptions::io_threads)")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  AddCodecOptions(cmd, &o->codec,
                  "every save (the load rows then read compressed chunks)");
  cmd->add_option("--buffer", o->buffer,
                  "bytes per IO buffer: SaveOptions::write_buffer_bytes and "
                  "LoadOptions::bounce_buffer_bytes")
      ->type_name("SIZE")
      ->capture_default_str()
      ->check(ByteSizeValidator(4096));
  cmd->add_option("--memory-budget", o->memory_budget,
                  "LoadOptions::memory_budget_bytes of every load row (0: no "
                  "limit); the load_sink row (one rank loading every byte "
                  "into a sink that drops it once checked) reports its peak "
                  "RSS against it")
      ->type_name("SIZE")
      ->capture_default_str()
      ->check(ByteSizeValidator(0));
  cmd->add_option("--phases", o->phases,
                  "comma-separated phases to run: save, async, load (also "
                  "runs save, whose checkpoint it reads), sink (load_sink: "
                  "one rank streams every byte into a sink, within "
                  "--memory-budget; also runs save), memcpy, kv (not by "
                  "default: a key-value table of the state's bytes saved by "
                  "--ranks ranks and loaded by one fewer, in its bucketing, "
                  "into another, and by caching every row first as "
                  "FBGEMM does; as for the dense rows, the saved rows exist "
                  "before the timer, and loaded rows land in memory touched "
                  "before it and are checked after it)")
      ->delimiter(',')
      ->type_name("LIST")
      ->check(CLI::IsMember({"save", "async", "load", "sink", "memcpy", "kv"}));
  cmd->add_flag("--keep", o->keep,
                "keep the checkpoints (the sync one, and the last async one) "
                "in the work folder");
  cmd->add_flag("--node-reads", o->node_reads,
                "ranks of one host that need columns of the same chunk read it "
                "once and hand each other the parts (LoadOptions::"
                "share_node_reads); off by default: on page-cached local files "
                "it costs as many copies as it saves");
  cmd->add_flag("--no-verify{false}", o->verify_checksums,
                "loads skip the CRC32C check of the chunks they read "
                "(LoadOptions::verify_checksums = false), to see what the "
                "check costs; the elements are still compared afterwards");
  cmd->add_flag("-q,--quiet", o->quiet, "no progress lines on stderr");
  cmd->footer(absl::StrCat(
      "Phases, each sample in a fresh child process (ranks as its threads,\n"
      "its own peak RSS), timed as the wall time of the whole collective\n"
      "operation from a barrier to the last rank done:\n"
      "  save_sync    W ranks fill their shards, then cairn::Save to a fresh\n"
      "               folder: data fsynced, metadata committed last.\n"
      "  async_save   an AsyncSaver saves the same state twice; the second\n"
      "               (staging buffers reused, as in a training loop) is\n"
      "               reported: seconds Save() blocked the caller, and\n"
      "               seconds until Wait() saw the checkpoint committed.\n"
      "  load_same    W ranks load the save_sync checkpoint into the same\n"
      "               boxes;\n"
      "  load_WtoM_rows, load_WtoM_cols\n"
      "               M = W/2 and W-1 ranks load it split on dim 0 (rows)\n"
      "               or dim 1 (cols; 1-D tensors on dim 0): resharding.\n"
      "               Every load runs cold (page cache dropped) and warm\n"
      "               (cache dropped, then the checkpoint read twice\n"
      "               before: cached and on the active list), into\n"
      "               destinations allocated and filled with NaN before\n"
      "               the timer, and every element is checked bit for bit\n"
      "               afterwards (a wrong one is an error naming the\n"
      "               tensor and index).\n"
      "  memcpy       host memory bandwidth, one thread and all cores: the\n"
      "               limit for a warm load. --repeat samples, each the\n"
      "               best of ", kMemcpyIterations,
      " copies, one right after each warm\n"
      "               load_same sample when loads run; the median.\n"
      "GB/s is state bytes / seconds / 1e9 for every row. The rows pair by\n"
      "name with bench/peers/torch_peer.py's (dcp_load_4to2_rows there is\n"
      "load_4to2_rows here); --model-out gives the peer the same tensors.\n"
      "Exit status: 0, 1 a phase failed (its error names it), 2 usage.\n\n"
      "Examples:\n"
      "  cairn bench --dir /mnt/nvme/tmp                   256 MiB, 4 ranks\n"
      "  cairn bench --dir /mnt/nvme/tmp --size 4GiB --repeat 3 --json\n"
      "  cairn bench --dir /ckpt --size 1GiB --ranks 8 --cold none\n"
      "  cairn bench --dir /ckpt --size 5GB --model-out model.json --json \\\n"
      "      > cairn.json && python3 bench/peers/torch_peer.py \\\n"
      "      --model model.json --dir /ckpt --out torch.json"));
  cmd->callback([o] {
    o->buffer_bytes = *ParseByteSize(o->buffer);  // checked above
    o->memory_budget_bytes = *ParseByteSize(o->memory_budget);
    Bench bench(*o);
    if (int rc = bench.Run(); rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace cairn::tools