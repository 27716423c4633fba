// `cairn demo --kv` (demo_kv.cc).
#ifndef CAIRN_TOOLS_DEMO_KV_H_
#define CAIRN_TOOLS_DEMO_KV_H_

#include <cstdint>
#include <string>

namespace cairn::tools {

struct KvDemoOptions {
  std::string dir;  // "": a temporary directory
  int ranks = 4;
  int load_ranks = 3;
  uint64_t rows = 1000000;
  int64_t buckets = 256;
  uint64_t memory_budget = 0;  // 0: LoadOptions' default
  bool json = false;
  bool keep = false;
  bool quiet = false;
};

// Runs the demo; the process exit code.
int RunKvDemo(const KvDemoOptions& options);

}  // namespace cairn::tools

#endif  // CAIRN_TOOLS_DEMO_KV_H_
