// Tests only: a DeviceRuntime that treats registered host memory as the
// memory of simulated CUDA devices, so the device staging paths run (and can
// fail) on machines without a GPU.
//
// It is strict where a real device would be unforgiving:
//  - copies are deferred until Synchronize, so code that reads a staging
//    buffer before waiting for its copy sees stale bytes (and a copy to a
//    device reads its host source only then, so a caller that changes or
//    frees the source early loads the wrong bytes);
//  - a copy from (to host) or into (to device) memory not registered for
//    that device is kInvalidArgument, as the CUDA runtime's pointer check
//    is;
//  - copies left unsynchronized are counted (pending()), so a test can show
//    that no copy is still in flight after an error.
// Failures can be injected per operation.
#ifndef CAIRN_CUDA_FAKE_DEVICE_RUNTIME_H_
#define CAIRN_CUDA_FAKE_DEVICE_RUNTIME_H_

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "cuda/device_runtime.h"

namespace cairn::internal_cuda {

class FakeDeviceRuntime : public DeviceRuntime {
 public:
  explicit FakeDeviceRuntime(int num_devices = 1) : num_devices_(num_devices) {}

  // [data, data + bytes) is memory of cuda:`index` from now on.
  void AddDeviceMemory(int index, const void* data, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto* p = static_cast<const char*>(data);
    regions_[index].push_back({p, p + bytes});
  }

  // Failure injection: the next calls of that operation fail.
  absl::Status fail_wait;
  absl::Status fail_copy;  // CopyToHostAsync
  absl::Status fail_copy_to_device;
  absl::Status fail_sync;
  absl::Status fail_pinned;
  // fail_pinned applies once pinned_allocations() reaches this.
  int64_t fail_pinned_after = 0;

  std::string Describe() const override { return "fake device runtime"; }

  absl::Status CheckDevice(Device device) override {
    if (device.is_cpu() || device.index < 0 || device.index >= num_devices_) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s: no such device (the fake runtime has %d)", device.ToString(),
          num_devices_));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::shared_ptr<void>> AllocatePinned(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fail_pinned.ok() && pinned_allocations_ >= fail_pinned_after) {
      return fail_pinned;
    }
    const size_t rounded = (std::max<size_t>(bytes, 1) + 4095) / 4096 * 4096;
    void* p = std::aligned_alloc(4096, rounded);
    if (p == nullptr) return absl::ResourceExhaustedError("aligned_alloc");
    // Poisoned: bytes no copy wrote are visible as 0xAB.
    std::memset(p, 0xAB, rounded);
    ++pinned_allocations_;
    largest_pinned_ = std::max<int64_t>(largest_pinned_, bytes);
    ++*live_pinned_;
    // The counter is shared: a buffer may outlive this runtime.
    return std::shared_ptr<void>(p, [live = live_pinned_](void* q) {
      std::free(q);
      --*live;
    });
  }

  absl::Status WaitForDevice(Device device) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fail_wait.ok()) return fail_wait;
    ++waits_[device.index];
    return absl::OkStatus();
  }

  absl::Status CopyToHostAsync(Device device, const void* src, void* dst,
                               size_t bytes) override {
    return CopyRowsToHostAsync(device, src, bytes, dst, bytes, 1);
  }

  // Counted as one copy (one call), landing row by row at Synchronize.
  absl::Status CopyRowsToHostAsync(Device device, const void* src,
                                   size_t src_pitch, void* dst,
                                   size_t row_bytes, size_t rows) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fail_copy.ok()) return fail_copy;
    CAIRN_RETURN_IF_ERROR(QueueRows(device, /*to_device=*/false, src,
                                    src_pitch, dst, row_bytes, row_bytes,
                                    rows));
    ++copies_;
    to_host_bytes_ += static_cast<int64_t>(rows * row_bytes);
    return absl::OkStatus();
  }

  absl::Status CopyToDeviceAsync(Device device, const void* src, void* dst,
                                 size_t bytes) override {
    return CopyRowsToDeviceAsync(device, src, dst, bytes, 1, bytes);
  }

  // Counted as one copy (one call), landing row by row at Synchronize.
  absl::Status CopyRowsToDeviceAsync(Device device, const void* src,
                                     void* dst, size_t row_bytes, size_t rows,
                                     size_t dst_pitch) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fail_copy_to_device.ok()) return fail_copy_to_device;
    CAIRN_RETURN_IF_ERROR(QueueRows(device, /*to_device=*/true, src,
                                    row_bytes, dst, dst_pitch, row_bytes,
                                    rows));
    ++to_device_copies_;
    to_device_bytes_ += static_cast<int64_t>(rows * row_bytes);
    to_device_sources_.push_back(src);
    return absl::OkStatus();
  }

  absl::Status Synchronize(Device device) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Copy& c : pending_[device.index]) {
      std::memcpy(c.dst, c.src, c.bytes);
    }
    pending_[device.index].clear();
    ++syncs_;
    return fail_sync;
  }

  int64_t pinned_allocations() const { return Read(pinned_allocations_); }
  // The largest pinned allocation asked for.
  int64_t largest_pinned_bytes() const { return Read(largest_pinned_); }
  int64_t live_pinned() const { return live_pinned_->load(); }
  // Device-to-host copies queued (calls), and their bytes in total.
  int64_t copies() const { return Read(copies_); }
  int64_t to_host_bytes() const { return Read(to_host_bytes_); }
  // Host-to-device copies queued, and their bytes in total: a load that
  // wrote the "device" memory directly (it is host memory here) shows none.
  int64_t to_device_copies() const { return Read(to_device_copies_); }
  int64_t to_device_bytes() const { return Read(to_device_bytes_); }
  // The host source of every copy to a device, in the order queued.
  std::vector<const void*> to_device_sources() const {
    std::lock_guard<std::mutex> lock(mu_);
    return to_device_sources_;
  }
  int64_t syncs() const { return Read(syncs_); }
  int64_t waits(int index) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = waits_.find(index);
    return it == waits_.end() ? 0 : it->second;
  }
  // Copies queued and not yet synchronized, on all devices.
  int64_t pending() const {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (const auto& [index, copies] : pending_) n += copies.size();
    return n;
  }

 private:
  struct Region {
    const char* begin;
    const char* end;
  };
  struct Copy {
    const void* src;
    void* dst;
    size_t bytes;
  };
  int64_t Read(const int64_t& v) const {
    std::lock_guard<std::mutex> lock(mu_);
    return v;
  }
  // kOk when [p, p + bytes) lies in one region of `device`, else
  // kInvalidArgument naming the device. Requires mu_.
  absl::Status CheckDeviceMemory(Device device, const void* p,
                                 size_t bytes) const {
    const auto* c = static_cast<const char*>(p);
    auto it = regions_.find(device.index);
    if (it != regions_.end()) {
      for (const Region& r : it->second) {
        if (c >= r.begin && c + bytes <= r.end) return absl::OkStatus();
      }
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "%p (+%d bytes) is not memory of %s", p, bytes, device.ToString()));
  }

  // Checks that the rows on the device side (dst when `to_device`, else src)
  // lie in memory of `device` and do not overlap, and queues a copy per
  // row, to land at Synchronize. mu_ must be held.
  absl::Status QueueRows(Device device, bool to_device, const void* src,
                         size_t src_pitch, void* dst, size_t dst_pitch,
                         size_t row_bytes, size_t rows) {
    const void* device_side = to_device ? dst : src;
    const size_t pitch = to_device ? dst_pitch : src_pitch;
    if (pitch < row_bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rows of %d bytes %d bytes apart overlap", row_bytes, pitch));
    }
    if (rows == 0) return absl::OkStatus();
    CAIRN_RETURN_IF_ERROR(CheckDeviceMemory(device, device_side,
                                            (rows - 1) * pitch + row_bytes));
    const auto* from = static_cast<const char*>(src);
    auto* to = static_cast<char*>(dst);
    for (size_t k = 0; k < rows; ++k) {
      pending_[device.index].push_back(
          {from + k * src_pitch, to + k * dst_pitch, row_bytes});
    }
    return absl::OkStatus();
  }

  const int num_devices_;
  mutable std::mutex mu_;
  std::map<int, std::vector<Region>> regions_;
  std::map<int, std::vector<Copy>> pending_;
  std::map<int, int64_t> waits_;
  int64_t pinned_allocations_ = 0;
  int64_t largest_pinned_ = 0;
  std::shared_ptr<std::atomic<int64_t>> live_pinned_ =
      std::make_shared<std::atomic<int64_t>>(0);
  int64_t copies_ = 0;
  int64_t to_host_bytes_ = 0;
  int64_t to_device_copies_ = 0;
  int64_t to_device_bytes_ = 0;
  std::vector<const void*> to_device_sources_;
  int64_t syncs_ = 0;
};

// Installs a runtime for RuntimeFor for the scope's lifetime.
class ScopedRuntimeForTesting {
 public:
  explicit ScopedRuntimeForTesting(DeviceRuntime* runtime) {
    SetRuntimeForTesting(runtime);
  }
  ~ScopedRuntimeForTesting() { SetRuntimeForTesting(nullptr); }
  ScopedRuntimeForTesting(const ScopedRuntimeForTesting&) = delete;
  ScopedRuntimeForTesting& operator=(const ScopedRuntimeForTesting&) = delete;
};

}  // namespace cairn::internal_cuda

#endif  // CAIRN_CUDA_FAKE_DEVICE_RUNTIME_H_
