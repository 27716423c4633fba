// Verify: proves that a checkpoint's bytes are what its metadata.json says,
// without loading any tensor. It checks metadata.json (its own checksum,
// every field, chunk coverage, the structure, that no two chunks or objects
// share bytes), that every data file exists, is long enough and has a
// safetensors header listing each chunk and object where the metadata
// places it, and recomputes the CRC32C of every chunk and object (and, in
// format version 3, of every block of a chunk). `cairn verify` prints what
// this returns.
//
//   CAIRN_ASSIGN_OR_RETURN(cairn::VerifyReport report,
//                          cairn::Verify("file:///ckpt/step-100"));
//   for (const cairn::VerifyProblem& p : report.problems) {
//     std::cerr << p.message << "\n";
//   }
//
// Every problem is reported, not only the first. Memory stays bounded by
// io_threads * buffer_bytes, whatever the checkpoint's size.
//
// Thread safety: Verify may be called from several threads at once, on the
// same checkpoint or different ones; it only reads. What it reports is
// only meaningful if nothing writes the checkpoint while it runs.
#ifndef CAIRN_VERIFY_H_
#define CAIRN_VERIFY_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace cairn {

struct VerifyOptions {
  // Reads in flight at once, each on its own thread; at least 1.
  // Default: 8.
  int io_threads = 8;
  // Bytes per read (one buffer of at most this size per thread); at least 1.
  // Default: 8 MiB.
  uint64_t buffer_bytes = uint64_t{8} << 20;
  // Optional. Called while the data files are read (step 5 below), after
  // each read, with the bytes of chunks and objects read so far (failed
  // reads included) and the total to read. Calls never overlap and
  // bytes_done never decreases, but they may come from different threads;
  // reads wait while it runs, so keep it short. Default: none.
  std::function<void(uint64_t bytes_done, uint64_t bytes_total)> progress;
};

// One thing wrong with a checkpoint.
struct VerifyProblem {
  // What is wrong, one of:
  //   missing_file  a data file the metadata references cannot be opened
  //   truncated     a data file is shorter than the metadata says
  //   coverage      a tensor's chunks do not cover it exactly once
  //   structure     the nesting names an FQN not stored, or one twice
  //   overlap       two chunks or objects share a byte of a file
  //   header        a data file's safetensors header is unreadable, or does
  //                 not list a chunk or object as the metadata says
  //   read          reading a chunk or object failed
  //   crc32c        a chunk's or object's checksum (or, in format version
  //                 3, one of its blocks') differs from the stored one
  //   reference     (format version 6) a checkpoint this one keeps chunks
  //                 in is missing, damaged, or not the one it was saved
  //                 against (`file` is the reference's URL)
  std::string kind;
  std::string fqn;   // the tensor or object; empty for a whole file
  std::string file;  // the data file, relative to the checkpoint; may be empty
  std::optional<uint64_t> offset;  // in `file`, where known
  // Self-contained, for people: names the FQN, the file and the offset.
  std::string message;
};

struct VerifyReport {
  // From metadata.json (0 for a Hugging Face source).
  int format_version = 0;
  // False for a Hugging Face folder or .safetensors file: its index and
  // headers were checked (every step but 5), but it holds no checksums to
  // recompute, so bytes_checked is 0.
  bool has_checksums = true;
  // Whether metadata.json opens with its own checksum (which then matched;
  // format version 2 and later always do, version 1 may).
  bool metadata_checksum = false;
  uint64_t tensors = 0;
  uint64_t chunks = 0;   // of all tensors
  uint64_t objects = 0;
  int files = 0;         // distinct data files referenced
  // Format version 6: the earlier checkpoints whose chunks it reads (an
  // incremental checkpoint), each opened and its metadata.json checked
  // whole; their chunks are checked with this one's.
  int references = 0;
  // Bytes of chunks and objects read and checksummed.
  uint64_t bytes_checked = 0;
  // Every problem found, in the order of the checks: missing files; then
  // coverage, structure, overlap, truncation; headers; reads and
  // checksums in file order.
  std::vector<VerifyProblem> problems;
  double seconds = 0;  // wall time of the whole Verify
  bool ok() const { return problems.empty(); }
};

// Verifies the checkpoint at `url` (file:///path or an absolute path):
//
//  1. Read and validate metadata.json (as ReadMetadata does).
//  2. Open every data file it references, in the checkpoints it
//     references too (format version 6: each of them must be there and be
//     the checkpoint recorded).
//  3. Check each tensor's chunk coverage, the structure, that no two
//     chunks or objects share a byte, and that each lies inside its file.
//  4. Check each data file's safetensors header: it lists every chunk and
//     object at the metadata's offset, with its length, name, dtype and
//     shape.
//  5. Read every chunk and object in pieces of at most buffer_bytes on
//     io_threads threads and compare their CRC32Cs (and, in format version
//     3, their blocks') with the stored ones.
//
// Damage found in steps 2-5 is a problem in an OK report (report.ok() is
// false). A non-OK status means verification could not start or go on:
// kInvalidArgument for bad options; kNotFound when there is no committed
// checkpoint at `url`; ReadMetadata's error (kDataLoss naming the file)
// when metadata.json is damaged; kResourceExhausted when the read buffers
// cannot be allocated; Storage::Open's error for a URL it cannot open.
absl::StatusOr<VerifyReport> Verify(std::string_view url,
                                    const VerifyOptions& options = {});

}  // namespace cairn

#endif  // CAIRN_VERIFY_H_
