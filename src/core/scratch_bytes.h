// Scratch memory that grows and is never zeroed, for buffers whose bytes
// are all written before they are read (a frame's raw or stored bytes):
// std::vector's resize would zero every byte of a fresh megabyte first.
#ifndef CAIRN_CORE_SCRATCH_BYTES_H_
#define CAIRN_CORE_SCRATCH_BYTES_H_

#include <cstddef>
#include <memory>

namespace cairn::internal_core {

class ScratchBytes {
 public:
  // At least `n` bytes, uninitialised; what Get returned before is gone
  // when n is more than any size asked for before.
  std::byte* Get(size_t n) {
    if (n > size_) {
      data_.reset(new std::byte[n]);  // default-initialised: not zeroed
      size_ = n;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<std::byte[]> data_;
  size_t size_ = 0;
};

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_SCRATCH_BYTES_H_
