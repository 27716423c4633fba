// The object storage backend: "s3://bucket/prefix" URLs, one object per
// file under "prefix/".
//
//   Create/WriteAt/Finish  a multipart upload: positional writes fill
//                          fixed-size parts in memory; each full part is
//                          uploaded at once on the storage's request threads
//                          (at most 2 x threads parts in flight, so memory
//                          stays bounded); Finish uploads the rest and
//                          completes the upload only if the object does not
//                          exist (If-None-Match: *). A file that fits in one
//                          part is one PUT. A file destroyed unfinished, or
//                          whose upload failed, is aborted.
//   OpenForRead/ReadAt     HEAD for the size and ETag, then ranged GETs
//                          (If-Match the ETag, so a replaced object is
//                          kDataLoss, never a mix); a large read is split
//                          into part_bytes ranges fetched in parallel, a
//                          small one served from a cached aligned block
//                          (S3Options::read_block_bytes), so neighbouring
//                          small reads cost one request.
//   WriteAtomically        PUT (a PUT is atomic in S3).
//   CreateAtomically       PUT with If-None-Match: * (the commit).
//   Remove / List / Exists DELETE / ListObjectsV2 / HEAD.
//   Sync                   nothing: an answered request is durable.
//   TryLock                a lock object created with If-None-Match: * and
//                          holding its holder's host, pid and time; deleted
//                          on release. A holder that dies leaves it: the
//                          error then names it for deletion by hand.
//
// A prefix has no folder of its own: CreateLocation does nothing, and List
// of a prefix without objects is empty (not kNotFound).
#ifndef CAIRN_STORAGE_S3_S3_STORAGE_H_
#define CAIRN_STORAGE_S3_S3_STORAGE_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "cairn/storage.h"
#include "storage/s3/s3_client.h"

namespace cairn::internal_s3 {

// The bucket and prefix ("" or "a/b", no trailing '/') of an s3:// URL.
struct S3Location {
  std::string bucket;
  std::string prefix;
};
absl::StatusOr<S3Location> ParseS3Url(std::string_view url);

// The client configuration that `options` and the environment give for
// `bucket` (S3Options' fallbacks).
absl::StatusOr<S3Config> ResolveS3Config(const S3Options& options,
                                         std::string bucket);

absl::StatusOr<std::unique_ptr<Storage>> OpenS3Storage(
    std::string_view url, const StorageOptions& options);

// Registers "s3" with Storage::Open; idempotent.
void RegisterS3Storage();

}  // namespace cairn::internal_s3

#endif  // CAIRN_STORAGE_S3_S3_STORAGE_H_
