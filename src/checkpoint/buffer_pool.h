// A bounded pool of aligned IO buffers shared by the IO threads of one save
// or load: at most `max_buffers` buffers of `buffer_bytes` ever exist, so
// memory stays bounded however many tasks run.
#ifndef CAIRN_CHECKPOINT_BUFFER_POOL_H_
#define CAIRN_CHECKPOINT_BUFFER_POOL_H_

#include <cstddef>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/aligned_buffer.h"

namespace cairn::internal_checkpoint {

class BufferPool {
 public:
  BufferPool(size_t buffer_bytes, int max_buffers)
      : buffer_bytes_(buffer_bytes), max_buffers_(max_buffers) {}

  size_t buffer_bytes() const { return buffer_bytes_; }

  // A buffer of buffer_bytes(); waits while all max_buffers are in use.
  absl::StatusOr<internal_core::UniqueAligned> Acquire() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](BufferPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
          return !p->free_.empty() || p->allocated_ < p->max_buffers_;
        },
        this));
    if (!free_.empty()) {
      internal_core::UniqueAligned b = std::move(free_.back());
      free_.pop_back();
      return b;
    }
    ++allocated_;
    absl::StatusOr<internal_core::UniqueAligned> b =
        internal_core::AllocateAlignedUnique(buffer_bytes_);
    if (!b.ok()) --allocated_;
    return b;
  }

  void Release(internal_core::UniqueAligned buffer) {
    absl::MutexLock lock(&mu_);
    free_.push_back(std::move(buffer));
  }

 private:
  const size_t buffer_bytes_;
  const int max_buffers_;
  absl::Mutex mu_;
  int allocated_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<internal_core::UniqueAligned> free_ ABSL_GUARDED_BY(mu_);
};

// Returns a buffer to its pool when it goes out of scope.
class PooledBuffer {
 public:
  PooledBuffer(BufferPool& pool, internal_core::UniqueAligned buffer)
      : pool_(pool), buffer_(std::move(buffer)) {}
  ~PooledBuffer() { pool_.Release(std::move(buffer_)); }
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  std::byte* data() const { return buffer_.get(); }

 private:
  BufferPool& pool_;
  internal_core::UniqueAligned buffer_;
};

}  // namespace cairn::internal_checkpoint

#endif  // CAIRN_CHECKPOINT_BUFFER_POOL_H_
