// cairn_gpu_bench: cairn on device tensors, one process on one GPU, next to
// bench/peers/torch_gpu_peer.py (torch.distributed.checkpoint save,
// async_save and load of the same tensors on the same GPU).
//
//   cairn_gpu_bench --dir DIR [--size 4GiB] [--device 0] [--json OUT.json]
//                   [--model-out MODEL.json] [--cold auto|none]
//                   [--device-batch 64MiB[,256MiB,...]]
//                   [--save-column-shards N]
//
// State: the demo's synthetic model (tools/synthetic_model.h) for --size,
// every tensor whole on the GPU (one rank), filled with the model's values.
// Phases, each wall time:
//   save_sync    Save() of the device state dict: the default planner copies
//                each device tensor to host memory (after the device's
//                queued work), then the usual write path with fsync.
//   async_save   AsyncSaver::Save(): blocked = until Save() returns (device
//                to pinned host staging on cairn's stream); total = until the
//                checkpoint is committed.
//   load_same    Load() into the device tensors: pinned host staging, then
//                copies to the device on cairn's stream, in batches of the
//                first --device-batch (default LoadOptions' 64 MiB); each
//                further size gives rows load_same_batch_<MiB>MiB (a size
//                below the largest tensor splits tensors into pieces);
//   load_same_host_copy
//                Load() into host tensors, then one cudaMemcpy per tensor
//                (what a caller did before device destinations). Each cold
//                (page cache dropped, when root) and warm. The device
//                tensors are zeroed first and checked bit-exact afterwards.
// --save-column-shards N: every 2-D tensor is saved as N blocks of columns
// (local shards viewing the same device tensor), so each load places every
// chunk into a strided view of its destination: a copy of many rows to the
// device.
// Built only with CAIRN_WITH_CUDA.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cairn/async_save.h"
#include "cairn/checkpoint.h"
#include "nlohmann/json.hpp"
#include "cli_util.h"
#include "synthetic_model.h"

namespace cairn::bench {
namespace {

using Clock = std::chrono::steady_clock;
using tools::SyntheticModel;
using tools::SyntheticTensor;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

uint64_t MaxRss() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_maxrss) * 1024;
}

bool DropCaches() {
  sync();
  const int fd = open("/proc/sys/vm/drop_caches", O_WRONLY);
  if (fd < 0) return false;
  const bool ok = write(fd, "3\n", 2) == 2;
  close(fd);
  return ok;
}

void Prewarm(const std::string& dir) {
  std::vector<char> buf(8 << 20);
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    while (in.read(buf.data(), buf.size()) || in.gcount() > 0) {
    }
  }
}

#define CUDA_OR_DIE(call)                                                  \
  do {                                                                     \
    const cudaError_t err_ = (call);                                       \
    if (err_ != cudaSuccess) {                                             \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(err_));   \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

#define STATUS_OR_DIE(expr)                                                \
  do {                                                                     \
    const absl::Status s_ = (expr);                                        \
    if (!s_.ok()) {                                                        \
      std::fprintf(stderr, "%s\n", s_.ToString().c_str());                 \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

struct DeviceTensor {
  const SyntheticTensor* t;
  void* ptr = nullptr;
  Box box;
};

// A size as the cairn CLI takes it ("4GiB", "64MiB", "1G", plain bytes).
bool ParseBytes(const std::string& v, uint64_t* out) {
  absl::StatusOr<uint64_t> n = tools::ParseByteSize(v);
  if (!n.ok() || *n == 0) return false;
  *out = *n;
  return true;
}

int Main(int argc, char** argv) {
  std::string dir, json_out, model_out, cold = "auto";
  uint64_t size = uint64_t{4} << 30;
  int device = 0;
  std::vector<uint64_t> batches = {LoadOptions{}.device_batch_bytes};
  int column_shards = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--dir") {
      dir = next();
    } else if (a == "--size") {
      const std::string v = next();
      if (!ParseBytes(v, &size)) {
        std::fprintf(stderr, "--size: bad byte size %s\n", v.c_str());
        return 2;
      }
    } else if (a == "--save-column-shards") {
      if (!absl::SimpleAtoi(next(), &column_shards) || column_shards < 1) {
        std::fprintf(stderr, "--save-column-shards: a positive count\n");
        return 2;
      }
    } else if (a == "--device-batch") {
      batches.clear();
      for (absl::string_view part : absl::StrSplit(next(), ',')) {
        uint64_t b = 0;
        if (!ParseBytes(std::string(part), &b)) {
          std::fprintf(stderr, "--device-batch: bad byte size %s\n",
                       std::string(part).c_str());
          return 2;
        }
        batches.push_back(b);
      }
    } else if (a == "--device") {
      if (!absl::SimpleAtoi(next(), &device)) return 2;
    } else if (a == "--json") {
      json_out = next();
    } else if (a == "--model-out") {
      model_out = next();
    } else if (a == "--cold") {
      cold = next();
    } else {
      std::fprintf(stderr,
                   "usage: cairn_gpu_bench --dir DIR [--size 4GiB] "
                   "[--device N] [--json OUT] [--model-out MODEL.json] "
                   "[--cold auto|none] [--device-batch 64MiB[,256MiB...]] "
                   "[--save-column-shards N]\n");
      return 2;
    }
  }
  if (dir.empty()) {
    std::fprintf(stderr, "--dir is required\n");
    return 2;
  }
  CUDA_OR_DIE(cudaSetDevice(device));
  cudaDeviceProp prop{};
  CUDA_OR_DIE(cudaGetDeviceProperties(&prop, device));

  absl::StatusOr<tools::SyntheticConfig> config = tools::ChooseConfig(size);
  STATUS_OR_DIE(config.status());
  absl::StatusOr<SyntheticModel> model = tools::BuildModel(*config);
  STATUS_OR_DIE(model.status());
  const uint64_t bytes = model->tensor_bytes();

  if (!model_out.empty()) {
    nlohmann::json m;
    m["bytes"] = bytes;
    m["tensors"] = nlohmann::json::array();
    for (const SyntheticTensor& t : model->tensors) {
      m["tensors"].push_back(
          {{"fqn", t.fqn}, {"shape", t.shape}, {"dtype", "float32"}});
    }
    std::ofstream(model_out) << m.dump() << "\n";
  }

  // Device state: every tensor whole on the GPU, filled from the host.
  const Device dev = Device::Cuda(device);
  std::vector<DeviceTensor> tensors;
  StateDict state;
  {
    std::vector<float> host;
    for (const SyntheticTensor& t : model->tensors) {
      DeviceTensor d{&t, nullptr, Box{Shape(t.shape.size(), 0), t.shape}};
      CUDA_OR_DIE(cudaMalloc(&d.ptr, t.nbytes()));
      host.resize(t.num_elements());
      STATUS_OR_DIE(tools::FillBox(
          t, d.box, TensorView(host.data(), DType::kF32, t.shape), 0, 8));
      CUDA_OR_DIE(cudaMemcpy(d.ptr, host.data(), t.nbytes(),
                             cudaMemcpyHostToDevice));
      tools::InsertLeaf(state, t.fqn,
                        StateDict(TensorView(d.ptr, DType::kF32, t.shape, dev)));
      tensors.push_back(d);
    }
  }
  CUDA_OR_DIE(cudaDeviceSynchronize());
  // What is saved: the state itself, or with every 2-D tensor as blocks of
  // columns viewing the same device memory.
  StateDict saved_state;
  if (column_shards == 1) {
    saved_state = state;
  } else {
    for (const DeviceTensor& d : tensors) {
      const Shape& shape = d.t->shape;
      if (shape.size() != 2 || shape[1] < column_shards) {
        tools::InsertLeaf(saved_state, d.t->fqn,
                          StateDict(TensorView(d.ptr, DType::kF32, shape, dev)));
        continue;
      }
      std::vector<Shard> shards;
      for (int k = 0; k < column_shards; ++k) {
        const int64_t c0 = shape[1] * k / column_shards;
        const int64_t c1 = shape[1] * (k + 1) / column_shards;
        shards.push_back(
            {Box{{0, c0}, {shape[0], c1 - c0}},
             TensorView(static_cast<float*>(d.ptr) + c0, DType::kF32,
                        {shape[0], c1 - c0}, {shape[1], 1}, dev)});
      }
      tools::InsertLeaf(saved_state, d.t->fqn,
                        StateDict(ShardedTensor(DType::kF32, shape,
                                                std::move(shards))));
    }
  }
  std::filesystem::create_directories(dir);
  const std::string sync_dir = dir + "/cairn_gpu_sync";
  const std::string async_dir = dir + "/cairn_gpu_async";
  std::filesystem::remove_all(sync_dir);
  std::filesystem::remove_all(async_dir);

  nlohmann::json results = nlohmann::json::array();
  auto row = [&](const std::string& name, const std::string& kind,
                 const char* cache, double seconds) {
    nlohmann::json r = {{"name", name},
                        {"kind", kind},
                        {"seconds", seconds},
                        {"gb_per_s", bytes / seconds / 1e9},
                        {"peak_rss_bytes", MaxRss()}};
    r["cache"] = cache ? nlohmann::json(cache) : nlohmann::json(nullptr);
    results.push_back(r);
    std::fprintf(stderr, "%-12s %-5s %8.3f s %7.2f GB/s\n", name.c_str(),
                 cache ? cache : "", seconds, bytes / seconds / 1e9);
    return &results.back();
  };

  // save_sync
  sync();
  Clock::time_point t0 = Clock::now();
  absl::StatusOr<SaveResult> saved = Save(saved_state, sync_dir);
  const double save_s = Since(t0);
  STATUS_OR_DIE(saved.status());
  row("save_sync", "save", nullptr, save_s);

  // async_save: a second save, blocked vs total.
  absl::StatusOr<std::unique_ptr<AsyncSaver>> saver = AsyncSaver::Create(nullptr);
  STATUS_OR_DIE(saver.status());
  sync();
  for (int round = 0; round < 2; ++round) {
    // Round 0 allocates the pinned staging buffers; round 1 reuses them
    // (the steady state of a training run).
    std::filesystem::remove_all(async_dir);
    t0 = Clock::now();
    absl::StatusOr<std::shared_ptr<AsyncSaveHandle>> h =
        (*saver)->Save(saved_state, async_dir);
    const double blocked = Since(t0);
    STATUS_OR_DIE(h.status());
    STATUS_OR_DIE((*h)->Wait().status());
    const double total = Since(t0);
    nlohmann::json* r = row(round == 0 ? "async_save_first" : "async_save",
                            "async", nullptr, total);
    (*r)["blocked_seconds"] = blocked;
    std::fprintf(stderr, "  blocked %.3f s (%.3f of the sync save)\n", blocked,
                 blocked / save_s);
  }

  // Loads. load_same: Load() straight into the device tensors (pinned host
  // staging, copies to the device on cairn's stream). load_same_host_copy:
  // the way before device destinations existed, Load() into host tensors
  // (allocated and touched before the timer) and one cudaMemcpy per tensor.
  // Each cold (when the page cache can be dropped) and warm; the device
  // tensors are zeroed before and checked bit-exact after every load.
  StateDict host_state;
  std::vector<Tensor> host_dest;
  for (const DeviceTensor& d : tensors) {
    absl::StatusOr<Tensor> h = Tensor::Empty(DType::kF32, d.t->shape);
    STATUS_OR_DIE(h.status());
    std::memset(h->data(), 0xff, d.t->nbytes());
    tools::InsertLeaf(host_state, d.t->fqn, StateDict(h->view()));
    host_dest.push_back(*h);
  }
  bool verified = true;
  std::vector<const char*> caches;
  if (cold != "none" && DropCaches()) caches.push_back("cold");
  caches.push_back("warm");
  // (batch index, to the device): each batch size into the device tensors,
  // then the host load and copies once.
  std::vector<std::pair<size_t, bool>> runs;
  for (size_t b = 0; b < batches.size(); ++b) runs.push_back({b, true});
  runs.push_back({0, false});
  for (const auto& [batch, to_device] : runs) {
    LoadOptions options;
    options.device_batch_bytes = batches[batch];
    std::string name = to_device ? "load_same" : "load_same_host_copy";
    if (to_device && batch > 0) {
      name = absl::StrFormat("load_same_batch_%dMiB", batches[batch] >> 20);
    }
    for (const char* cache : caches) {
      for (const DeviceTensor& d : tensors) {
        CUDA_OR_DIE(cudaMemset(d.ptr, 0, d.t->nbytes()));
      }
      CUDA_OR_DIE(cudaDeviceSynchronize());
      if (std::strcmp(cache, "cold") == 0) {
        DropCaches();
      } else {
        Prewarm(sync_dir);
      }
      t0 = Clock::now();
      absl::StatusOr<LoadResult> loaded =
          Load(to_device ? state : host_state, sync_dir, options);
      STATUS_OR_DIE(loaded.status());
      if (!to_device) {
        for (size_t i = 0; i < tensors.size(); ++i) {
          CUDA_OR_DIE(cudaMemcpy(tensors[i].ptr, host_dest[i].data(),
                                 tensors[i].t->nbytes(),
                                 cudaMemcpyHostToDevice));
        }
      }
      CUDA_OR_DIE(cudaDeviceSynchronize());
      nlohmann::json* r = row(name, "load", cache, Since(t0));
      if (to_device) (*r)["device_batch_bytes"] = batches[batch];
      (*r)["chunks_verified"] = loaded->chunks_verified;
      (*r)["device_bytes"] = loaded->device_bytes;
      (*r)["read_seconds"] = loaded->phases.read;
      (*r)["copy_seconds"] = loaded->phases.copy;
      (*r)["staging_seconds"] = loaded->phases.staging;
      // Verify on the device's copy.
      std::vector<float> back;
      for (const DeviceTensor& d : tensors) {
        back.resize(d.t->num_elements());
        CUDA_OR_DIE(cudaMemcpy(back.data(), d.ptr, d.t->nbytes(),
                               cudaMemcpyDeviceToHost));
        absl::StatusOr<std::optional<tools::Mismatch>> bad = tools::VerifyBox(
            *d.t, d.box, TensorView(back.data(), DType::kF32, d.t->shape), 0,
            8);
        STATUS_OR_DIE(bad.status());
        if (bad->has_value()) {
          std::fprintf(stderr, "VERIFY FAILED: %s\n",
                       (*bad)->ToString().c_str());
          verified = false;
        }
      }
    }
  }

  nlohmann::json out = {
      {"tool", "cairn"},
      {"device", prop.name},
      {"bytes", bytes},
      {"tensors", model->tensors.size()},
      {"save_seconds", save_s},
      {"save_column_shards", column_shards},
      {"verified", verified},
      {"results", results},
      {"notes",
       {"one process, one GPU, every tensor whole on the device",
        "load_same: Load() into the device tensors (pinned host staging in "
        "batches of LoadOptions::device_batch_bytes, copies on cairn's "
        "stream); load_same_host_copy: Load() into host tensors, then "
        "cudaMemcpy of each to the device"}}};
  if (!json_out.empty()) std::ofstream(json_out) << out.dump(1) << "\n";
  std::printf("%s\n", out.dump(1).c_str());
  for (DeviceTensor& d : tensors) cudaFree(d.ptr);
  std::filesystem::remove_all(sync_dir);
  std::filesystem::remove_all(async_dir);
  return verified ? 0 : 1;
}

}  // namespace
}  // namespace cairn::bench

int main(int argc, char** argv) { return cairn::bench::Main(argc, argv); }
