// The key-value table rows of `cairn bench --phases kv` (bench_kv.cc): a
// synthetic embedding table (synthetic_kv.h) of about the dense state's
// bytes saved by W ranks and loaded by W - 1 (at least 1) into sinks that
// check every row and keep nothing, and the same load done the way
// FBGEMM's KV state dict does it (every row cached, then applied).
#ifndef CAIRN_TOOLS_BENCH_KV_H_
#define CAIRN_TOOLS_BENCH_KV_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace cairn::tools {

// Rows of the synthetic table that hold about `bytes` of ids and rows.
uint64_t KvRowsFor(uint64_t bytes);

// One save sample: `ranks` ranks save the table of `rows` rows into `dir`.
// {"seconds", "bytes", "rows", "files"}.
absl::StatusOr<nlohmann::json> KvSaveSample(const std::string& dir,
                                            uint64_t rows, int ranks);

// One load sample into `ranks` ranks, another bucket count than saved
// (rows routed between the ranks) when `rebucket`. `cache_all`: the
// FBGEMM way, each rank's rows loaded into memory whole, then applied to
// the sink in 64 MiB batches. `prepare` runs first (the page cache).
// {"seconds", "bytes", "rows", "storage_bytes_read"}.
absl::StatusOr<nlohmann::json> KvLoadSample(
    const std::string& dir, uint64_t rows, int ranks, bool rebucket,
    bool cache_all, uint64_t memory_budget,
    const std::function<absl::Status()>& prepare);

}  // namespace cairn::tools

#endif  // CAIRN_TOOLS_BENCH_KV_H_
