// Saving key-value tables (SaveOptions::kv_tables): the steps save.cc runs
// for them, in its phases.
//
//  1. Planning: each rank declares its tables (FQN, spec, its buckets),
//     checked locally (DeclareKvTables), and sends the declaration behind
//     its local plan; the coordinator checks that the ranks agree on every
//     table's spec, that their bucket ranges tile [0, B) (global saves) and
//     that no FQN is also a leaf of the state dict (CheckKvDeclarations).
//  4. Write: each rank pulls its rows from its sources, checks them, cuts
//     them into chunks and writes them into files of its own
//     (WriteKvTables), reporting each table's row counts and chunks.
//  5. Commit: the coordinator joins the ranks' parts into one table each
//     (AssembleKvTables) for metadata.json.
#ifndef CAIRN_CHECKPOINT_KV_SAVE_H_
#define CAIRN_CHECKPOINT_KV_SAVE_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cairn/checkpoint.h"
#include "cairn/kv_table.h"
#include "cairn/metadata.h"
#include "cairn/storage.h"

namespace cairn::internal_checkpoint {

// Chunks a table's file holds at most: its header is reserved for this
// many before the first chunk is written (the rows' count is not known
// until the source ends), and a table with more chunks gets more files.
inline constexpr int kKvChunksPerFile = 64;

// "[begin, end)", for messages.
std::string KvRangeText(KvBucketRange r);

struct KvDeclaration {
  std::string fqn;
  KvTableSpec spec;
  KvBucketRange buckets;  // this rank's
};

// This rank's tables, checked: a non-empty FQN listed once, a valid spec,
// buckets inside [0, B) (default: KvBucketsOfRank), a source when it has
// buckets, kv_chunk_bytes > 0. kInvalidArgument naming the table.
absl::StatusOr<std::vector<KvDeclaration>> DeclareKvTables(
    const SaveOptions& options, int world, int rank);

std::string EncodeKvDeclarations(const std::vector<KvDeclaration>& tables);
absl::StatusOr<std::vector<KvDeclaration>> DecodeKvDeclarations(
    std::string_view bytes, std::string what);

// Coordinator: every rank lists the same tables with the same specs; no
// table's FQN is a tensor, object or scalar of `skeleton`; with
// `require_coverage`, each table's ranges tile [0, B) (no bucket saved by
// two ranks, none by no rank). kInvalidArgument naming the table, the
// ranks and the buckets, and `operation` ("save").
absl::Status CheckKvDeclarations(
    const std::vector<std::vector<KvDeclaration>>& per_rank,
    const Metadata& skeleton, bool require_coverage,
    std::string_view operation = "save");

// What a rank wrote of a table: its buckets' row counts and its chunks
// (rows counted from buckets.begin, locations in the rank's files).
struct KvTablePart {
  std::string fqn;
  KvTableSpec spec;
  KvBucketRange buckets;
  std::vector<uint64_t> rows_per_bucket;
  std::vector<KvChunkMetadata> chunks;
};

struct KvWritten {
  std::vector<KvTablePart> parts;  // one per declared table
  uint64_t bytes_written = 0;      // file bytes, headers included
  uint64_t data_bytes = 0;         // ids and columns
  uint64_t rows = 0;
  int files = 0;
};

// Step 4: pulls every declared table's rows from its source (in
// `options.kv_tables`, matched by FQN) and writes them, durably, into
// files named internal_format::KvFileName(file_index, n, save_id) under
// `prefix`, their entries named internal_format::KvEntryName. A source
// whose rows break the rules (KvTableToSave::source) is kInvalidArgument
// naming the table, bucket, id and rank.
absl::StatusOr<KvWritten> WriteKvTables(
    Storage& storage, std::string_view prefix, int file_index, int rank,
    std::string_view save_id, const std::vector<KvDeclaration>& tables,
    const SaveOptions& options);

// Where each chunk of `md` starts: the bucket of its first row and that
// row's index among the bucket's rows (what internal_format::KvEntryName
// takes). `md` must
// be valid.
struct KvChunkStart {
  int64_t bucket = 0;
  uint64_t row = 0;
};
std::vector<KvChunkStart> KvChunkStarts(const KvTableMetadata& md);

// What a rank reports of its tables at commit: its parts and the bytes of
// its table files (the rest of KvWritten is not sent).
std::string EncodeKvWritten(const KvWritten& written);
absl::StatusOr<KvWritten> DecodeKvWritten(std::string_view bytes,
                                          std::string what);

// Coordinator, step 5: each table of the ranks' parts (indexed by rank).
// Global (`rank_local` false): the parts joined in bucket order into the
// whole table, [0, B); rank-local: the one rank's part as it is. Checked
// with ValidateKvTableMetadata (kInternal: a writer's bug).
absl::StatusOr<std::map<std::string, KvTableMetadata>> AssembleKvTables(
    const std::vector<std::vector<KvTablePart>>& per_rank, bool rank_local);

// Prefixes every file name of `tables` with `folder` and '/' (a rank
// folder's names, relative to the checkpoint).
void PrefixKvFiles(std::map<std::string, KvTableMetadata>& tables,
                   std::string_view folder);

// Merge: the tables of the rank folders' metadata (indexed by rank, file
// names relative to the checkpoint) as one global table each, with the
// checks a global save makes (kInvalidArgument naming "merge", the table
// and the ranks). `leaves` holds the merged tensors, objects and scalars.
absl::StatusOr<std::map<std::string, KvTableMetadata>> MergeKvTables(
    const std::vector<const Metadata*>& ranks, const Metadata& leaves);

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_KV_SAVE_H_
