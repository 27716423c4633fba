// Loading key-value tables (LoadOptions::kv_tables) into their sinks: the
// steps load.cc runs for them.
//
//  2. Planning (PlanKvLoads, every rank alone): each requested table is
//     found in the metadata, its columns by name, and the destination's
//     bucketing and this rank's buckets checked; the errors join the
//     rank's planning status.
//  7. After the tensors (LoadKvTables, collective when the checkpoint has
//     tables): per table, the ranks exchange their requests (one
//     AllGather). When every rank that wants it keeps the saved bucketing,
//     each reads the rows of its buckets only (the chunks that hold them,
//     in pieces of bounded size, each piece's checksum blocks checked and
//     its ids checked against their buckets) and applies them to its sink,
//     reading the next piece while the sink takes this one. Otherwise the
//     stored pieces are dealt out to the ranks, each read once, and every
//     row is sent to the ranks whose buckets hold it in the new bucketing
//     (a Scatter from each rank per round). One agreement at the end: a
//     failure anywhere fails the load on every rank.
#ifndef CAIRN_CHECKPOINT_KV_LOAD_H_
#define CAIRN_CHECKPOINT_KV_LOAD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/kv_table.h"
#include "cairn/metadata.h"
#include "cairn/storage.h"

namespace cairn::internal_checkpoint {

// A requested table, resolved against the metadata.
struct KvRequest {
  std::string fqn;
  KvSink* sink = nullptr;
  const KvTableMetadata* stored = nullptr;
  KvTableSpec dest;          // the destination's bucketing (no columns)
  KvBucketRange buckets;     // this rank's, in `dest`
  std::vector<int> columns;  // indices into the stored columns, in order
  bool same_bucketing = true;
};

// Step 2. Tables missing from the metadata are kNotFound when `strict`,
// else appended to `missing`. kInvalidArgument naming the table for an
// unknown column, a bad bucketing or a bucket range outside it.
absl::StatusOr<std::vector<KvRequest>> PlanKvLoads(
    const Metadata& metadata, const LoadOptions& options, int world,
    int rank, std::vector<std::string>& missing);

// Step 7. Collective over `comm` whenever metadata.kv_tables is not
// empty (every rank calls it, with or without requests).
absl::Status LoadKvTables(Storage& storage, const Metadata& metadata,
                          const std::vector<KvRequest>& requests,
                          const LoadOptions& options, Communicator& comm,
                          LoadResult& result);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_KV_LOAD_H_
