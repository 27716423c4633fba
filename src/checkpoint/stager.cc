// Stager. Per call:
//  1. Flatten the state dict; collect every tensor shard's byte span
//     [first byte, last byte] (non-negative strides, so the span is the view
//     origin up to the origin plus sum((size - 1) * stride) plus one element)
//     and its device.
//  2. Merge overlapping spans of one device into storages; a storage's key
//     is its device and span.
//  3. For each storage, take the cached buffer of that key when its size
//     matches and nothing else holds it; else allocate one (pinned host
//     memory from the device runtime for device storages).
//  4. Device storages: wait for each device's queued work, then queue one
//     device-to-host copy of each storage's whole span on cairn's stream.
//     Host storages: copy each view into the buffer at the same offset with
//     the same strides (while the device copies run). Then wait for the
//     device copies and rebuild the state dict around host views of the
//     buffers, at the sources' offsets and strides.
//  5. Forget buffers whose source owner expired; trim unused buffers to
//     max_cached_bytes, oldest first.
#include "cairn/stager.h"

#include <algorithm>
#include <list>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "cairn/tensor.h"
#include "core/flatten.h"
#include "core/status.h"
#include "core/strided.h"
#include "cuda/device_runtime.h"

namespace cairn {

struct Stager::Cache {
  struct Entry {
    std::shared_ptr<void> buffer;  // the staging bytes
    uint64_t size = 0;
    std::weak_ptr<void> owner;     // the source's owner, when it has one
    bool had_owner = false;
    int64_t last_used = 0;         // call number
  };
  // By (device, first byte address, length).
  using Key = std::tuple<int, int, uintptr_t, uint64_t>;
  std::map<Key, Entry> entries;
  int64_t calls = 0;
  int64_t allocations = 0;
};

Stager::Stager(StagerOptions options)
    : options_(options), cache_(std::make_unique<Cache>()) {}
Stager::~Stager() = default;

void Stager::Release() { cache_->entries.clear(); }

uint64_t Stager::cached_bytes() const {
  uint64_t total = 0;
  for (const auto& [key, e] : cache_->entries) total += e.size;
  return total;
}

int64_t Stager::allocations() const { return cache_->allocations; }

namespace {

struct Span {
  Device device;
  uintptr_t begin = 0;
  uintptr_t end = 0;  // one past the last byte
  size_t shard = 0;   // index into the collected shards
};

std::pair<int, int> DeviceKey(Device d) {
  return {static_cast<int>(d.type), d.index};
}

// The devices with copies queued; waits for all of them on every path out,
// so that no copy lands in a buffer after an error returned.
class PendingCopies {
 public:
  ~PendingCopies() {
    for (auto& [key, p] : devices_) p.runtime->Synchronize(p.device).IgnoreError();
  }
  absl::Status Add(Device device, internal_cuda::DeviceRuntime* runtime) {
    auto [it, inserted] =
        devices_.try_emplace(DeviceKey(device), Pending{device, runtime});
    if (!inserted) return absl::OkStatus();
    // The application's kernels that write these tensors must finish first.
    return runtime->WaitForDevice(device);
  }
  absl::Status WaitAll() {
    absl::Status first;
    for (auto& [key, p] : devices_) first.Update(p.runtime->Synchronize(p.device));
    devices_.clear();
    return first;
  }

 private:
  struct Pending {
    Device device;
    internal_cuda::DeviceRuntime* runtime;
  };
  std::map<std::pair<int, int>, Pending> devices_;
};

}  // namespace

absl::StatusOr<StateDict> Stager::Stage(const StateDict& state) {
  Cache& cache = *cache_;
  const int64_t call = ++cache.calls;
  StateDict staged = state;  // views, objects and scalars copied
  CAIRN_ASSIGN_OR_RETURN(internal_core::MutableFlattened flat,
                         internal_core::FlattenMutable(staged));

  // 1. Every shard's span.
  struct Source {
    ShardedTensor* tensor;
    size_t shard;
    const std::string* fqn;
  };
  std::vector<Source> sources;
  std::vector<Span> spans;
  std::map<std::pair<int, int>, internal_cuda::DeviceRuntime*> runtimes;
  for (internal_core::MutableFlatLeaf& leaf : flat.leaves) {
    ShardedTensor* t = leaf.node->tensor();
    if (t == nullptr) continue;
    for (size_t s = 0; s < t->shards().size(); ++s) {
      const TensorView& v = t->shards()[s].view;
      if (!v.device().is_cpu() && !runtimes.contains(DeviceKey(v.device()))) {
        absl::StatusOr<internal_cuda::DeviceRuntime*> runtime =
            internal_cuda::RuntimeFor(v.device());
        CAIRN_RETURN_IF_ERROR(
            internal_core::Annotate(runtime.status(), leaf.fqn));
        runtimes[DeviceKey(v.device())] = *runtime;
      }
      if (v.num_elements() == 0) continue;
      if (v.data() == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: a shard view has no data pointer", leaf.fqn));
      }
      const size_t es = DTypeSize(v.dtype());
      uint64_t last = 0;
      for (int d = 0; d < v.rank(); ++d) {
        if (v.strides()[d] < 0) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "%s: negative strides cannot be staged", leaf.fqn));
        }
        last += static_cast<uint64_t>(v.shape()[d] - 1) *
                static_cast<uint64_t>(v.strides()[d]);
      }
      const uintptr_t begin = reinterpret_cast<uintptr_t>(v.data());
      spans.push_back({v.device(), begin, begin + (last + 1) * es,
                       sources.size()});
      sources.push_back({t, s, &leaf.fqn});
    }
  }

  // 2. Storages: overlapping spans of one device merged.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return std::make_pair(DeviceKey(a.device), a.begin) <
           std::make_pair(DeviceKey(b.device), b.begin);
  });
  struct Storage {
    Device device;
    uintptr_t begin, end;
    std::vector<size_t> shards;  // into `sources`
    std::shared_ptr<void> owner;
    Cache::Key key() const {
      return {static_cast<int>(device.type), device.index, begin, end - begin};
    }
  };
  std::vector<Storage> storages;
  for (const Span& s : spans) {
    if (storages.empty() || !(storages.back().device == s.device) ||
        s.begin >= storages.back().end) {
      storages.push_back({s.device, s.begin, s.end, {}, nullptr});
    }
    Storage& st = storages.back();
    st.end = std::max(st.end, s.end);
    st.shards.push_back(s.shard);
    if (!st.owner) st.owner = sources[s.shard].tensor->owner();
  }

  // 3. A buffer per storage.
  std::vector<Cache::Entry*> buffers;
  buffers.reserve(storages.size());
  for (const Storage& st : storages) {
    const uint64_t length = st.end - st.begin;
    Cache::Entry* entry = nullptr;
    if (auto it = cache.entries.find(st.key());
        it != cache.entries.end() &&
        // Reuse only a buffer nobody else holds: an earlier staged state
        // dict may still be being saved from it.
        it->second.buffer.use_count() == 1) {
      entry = &it->second;
    } else {
      Cache::Entry fresh;
      fresh.size = length;
      if (st.device.is_cpu()) {
        CAIRN_ASSIGN_OR_RETURN(
            Tensor buffer,
            Tensor::Empty(DType::kU8, {static_cast<int64_t>(length)}));
        fresh.buffer = buffer.buffer();
      } else {
        absl::StatusOr<std::shared_ptr<void>> pinned =
            runtimes.at(DeviceKey(st.device))->AllocatePinned(length);
        CAIRN_RETURN_IF_ERROR(internal_core::Annotate(
            pinned.status(),
            absl::StrCat("staging ", *sources[st.shards.front()].fqn, " from ",
                         st.device.ToString())));
        fresh.buffer = *std::move(pinned);
      }
      ++cache.allocations;
      entry = &(cache.entries[st.key()] = std::move(fresh));
    }
    entry->last_used = call;
    entry->owner = st.owner;
    entry->had_owner = st.owner != nullptr;
    buffers.push_back(entry);
  }

  // 4. Copies: device storages queued first, host copies while they run.
  PendingCopies pending;
  for (size_t i = 0; i < storages.size(); ++i) {
    const Storage& st = storages[i];
    if (st.device.is_cpu()) continue;
    internal_cuda::DeviceRuntime* runtime = runtimes.at(DeviceKey(st.device));
    absl::Status s = pending.Add(st.device, runtime);
    if (s.ok()) {
      s = runtime->CopyToHostAsync(st.device,
                                   reinterpret_cast<const void*>(st.begin),
                                   buffers[i]->buffer.get(), st.end - st.begin);
    }
    CAIRN_RETURN_IF_ERROR(internal_core::Annotate(
        s, absl::StrCat("staging ", *sources[st.shards.front()].fqn, " from ",
                        st.device.ToString())));
  }
  std::vector<Shard> staged_shards(sources.size());
  for (size_t i = 0; i < storages.size(); ++i) {
    const Storage& st = storages[i];
    auto* base = static_cast<std::byte*>(buffers[i]->buffer.get());
    for (size_t idx : st.shards) {
      const Source& src = sources[idx];
      const TensorView& v = src.tensor->shards()[src.shard].view;
      std::byte* dst = base + (reinterpret_cast<uintptr_t>(v.data()) - st.begin);
      // Same offsets and strides as the source: shared bytes stay shared.
      const TensorView staged_view(dst, v.dtype(), v.shape(), v.strides());
      if (st.device.is_cpu()) internal_core::CopyView(v, staged_view);
      staged_shards[idx] = Shard{src.tensor->shards()[src.shard].box, staged_view};
    }
  }
  CAIRN_RETURN_IF_ERROR(
      internal_core::Annotate(pending.WaitAll(), "staging device tensors"));

  // Rebuild each tensor leaf around the staged views; its owner keeps every
  // buffer it uses alive.
  struct Rebuilt {
    std::vector<std::pair<size_t, Shard>> shards;  // (shard index, staged)
    std::vector<std::shared_ptr<void>> buffers;
  };
  std::map<ShardedTensor*, Rebuilt> rebuilt;
  for (size_t i = 0; i < storages.size(); ++i) {
    for (size_t idx : storages[i].shards) {
      Rebuilt& r = rebuilt[sources[idx].tensor];
      r.shards.push_back({sources[idx].shard, staged_shards[idx]});
      r.buffers.push_back(buffers[i]->buffer);
    }
  }
  for (auto& [tensor, r] : rebuilt) {
    std::vector<Shard> shards = tensor->shards();  // empty ones stay as they are
    for (auto& [index, shard] : r.shards) shards[index] = std::move(shard);
    auto owners =
        std::make_shared<std::vector<std::shared_ptr<void>>>(std::move(r.buffers));
    *tensor = ShardedTensor(tensor->dtype(), tensor->global_shape(),
                            std::move(shards),
                            std::shared_ptr<void>(owners, owners.get()));
  }

  // Empty device shards have no bytes to copy; they become empty host views
  // so that the staged state dict is host memory throughout.
  for (internal_core::MutableFlatLeaf& leaf : flat.leaves) {
    ShardedTensor* t = leaf.node->tensor();
    if (t == nullptr) continue;
    bool any = false;
    std::vector<Shard> shards = t->shards();
    for (Shard& shard : shards) {
      if (shard.view.device().is_cpu()) continue;
      shard.view = TensorView(nullptr, shard.view.dtype(), shard.view.shape());
      any = true;
    }
    if (any) {
      *t = ShardedTensor(t->dtype(), t->global_shape(), std::move(shards),
                         t->owner());
    }
  }

  // 5. Forget buffers whose source is gone; trim the unused ones.
  for (auto it = cache.entries.begin(); it != cache.entries.end();) {
    const bool gone = it->second.had_owner && it->second.owner.expired();
    it = gone ? cache.entries.erase(it) : std::next(it);
  }
  uint64_t total = cached_bytes();
  while (total > options_.max_cached_bytes) {
    auto oldest = cache.entries.end();
    for (auto it = cache.entries.begin(); it != cache.entries.end(); ++it) {
      if (it->second.last_used == call) continue;
      if (oldest == cache.entries.end() ||
          it->second.last_used < oldest->second.last_used) {
        oldest = it;
      }
    }
    if (oldest == cache.entries.end()) break;  // all used by this call
    total -= oldest->second.size;
    cache.entries.erase(oldest);
  }
  return staged;
}

}  // namespace cairn
