// A bounded pool of aligned IO buffers shared by the IO threads of one save,
// load or verify: at most `max_buffers` buffers of `buffer_bytes` ever exist,
// so memory stays bounded however many tasks run.
#ifndef CAIRN_CORE_BUFFER_POOL_H_
#define CAIRN_CORE_BUFFER_POOL_H_

#include <cstddef>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/aligned_buffer.h"

namespace cairn::internal_core {

class BufferPool;

// A buffer on loan from a BufferPool; returns to it when destroyed.
class PooledBuffer {
 public:
  PooledBuffer(BufferPool& pool, UniqueAligned buffer)
      : pool_(&pool), buffer_(std::move(buffer)) {}
  PooledBuffer(PooledBuffer&& other) = default;
  PooledBuffer& operator=(PooledBuffer&&) = delete;
  ~PooledBuffer();
  std::byte* data() const { return buffer_.get(); }

 private:
  BufferPool* pool_;
  UniqueAligned buffer_;
};

class BufferPool {
 public:
  BufferPool(size_t buffer_bytes, int max_buffers)
      : buffer_bytes_(buffer_bytes), max_buffers_(max_buffers) {}

  size_t buffer_bytes() const { return buffer_bytes_; }

  // A buffer of buffer_bytes(), aligned to kIoAlignment; waits while all
  // max_buffers are on loan. kResourceExhausted if allocation fails.
  absl::StatusOr<PooledBuffer> Acquire() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](BufferPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
          return !p->free_.empty() || p->allocated_ < p->max_buffers_;
        },
        this));
    if (!free_.empty()) {
      UniqueAligned b = std::move(free_.back());
      free_.pop_back();
      return PooledBuffer(*this, std::move(b));
    }
    absl::StatusOr<UniqueAligned> b = AllocateAlignedUnique(buffer_bytes_);
    if (!b.ok()) return b.status();
    ++allocated_;
    return PooledBuffer(*this, *std::move(b));
  }

 private:
  friend class PooledBuffer;
  void Release(UniqueAligned buffer) {
    absl::MutexLock lock(&mu_);
    free_.push_back(std::move(buffer));
  }

  const size_t buffer_bytes_;
  const int max_buffers_;
  absl::Mutex mu_;
  int allocated_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<UniqueAligned> free_ ABSL_GUARDED_BY(mu_);
};

inline PooledBuffer::~PooledBuffer() {
  if (buffer_ != nullptr) pool_->Release(std::move(buffer_));
}

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_BUFFER_POOL_H_
