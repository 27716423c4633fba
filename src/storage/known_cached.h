// Views of ranges a reader has just found in memory. The loader asks
// ReadableFile::InMemory once per data file, of the span all its reads
// cover, and when that holds takes each read's view without the backend
// asking its page cache again: on a cached 91 MB model, the second
// question (cachestat over every task's span) was about 3% of a column
// shard's load (issue 37).
#ifndef CAIRN_STORAGE_KNOWN_CACHED_H_
#define CAIRN_STORAGE_KNOWN_CACHED_H_

#include <cstdint>
#include <memory>

#include "cairn/storage.h"

namespace cairn::internal_storage {

// Implemented by readable files that can skip that question (the file
// backend's).
class KnownCachedViews {
 public:
  // As ReadableFile::ViewIfInMemory for a range that InMemory said, just
  // before, lies wholly in memory, without asking again. A page evicted
  // since is read again when touched (the risk ViewIfInMemory's own check
  // leaves too, between the check and the copy). Null when the range is
  // not inside the file, or the file gives no views.
  virtual std::unique_ptr<ReadableFile::View> ViewKnownInMemory(
      uint64_t offset, uint64_t size) const = 0;

 protected:
  ~KnownCachedViews() = default;
};

// `file`'s view of [offset, offset + size): without asking again when
// `known_in_memory` and `file` can, else ViewIfInMemory.
inline std::unique_ptr<ReadableFile::View> ViewOf(const ReadableFile& file,
                                                  uint64_t offset,
                                                  uint64_t size,
                                                  bool known_in_memory) {
  if (known_in_memory) {
    if (const auto* known = dynamic_cast<const KnownCachedViews*>(&file)) {
      return known->ViewKnownInMemory(offset, size);
    }
  }
  return file.ViewIfInMemory(offset, size);
}

}  // namespace cairn::internal_storage

#endif  // CAIRN_STORAGE_KNOWN_CACHED_H_
