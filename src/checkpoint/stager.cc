// Stager. Per call:
//  1. Flatten the state dict; collect every tensor shard's byte span
//     [first byte, last byte] (non-negative strides, so the span is the view
//     origin up to the origin plus sum((size - 1) * stride) plus one element).
//  2. Merge overlapping spans into storages; a storage's key is its span.
//  3. For each storage, take the cached buffer of that key when its size
//     matches and nothing else holds it; else allocate one.
//  4. Copy each view into its storage's buffer at the same offset with the
//     same strides, and rebuild the state dict around the staged views.
//  5. Forget buffers whose source owner expired; trim unused buffers to
//     max_cached_bytes, oldest first.
#include "cairn/stager.h"

#include <algorithm>
#include <list>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "cairn/tensor.h"
#include "core/flatten.h"
#include "core/status.h"
#include "core/strided.h"

namespace cairn {

struct Stager::Cache {
  struct Entry {
    Tensor buffer;                // the staging bytes (U8)
    std::weak_ptr<void> owner;    // the source's owner, when it has one
    bool had_owner = false;
    int64_t last_used = 0;        // call number
  };
  // By (first byte address, length).
  std::map<std::pair<uintptr_t, uint64_t>, Entry> entries;
  int64_t calls = 0;
  int64_t allocations = 0;
};

Stager::Stager(StagerOptions options)
    : options_(options), cache_(std::make_unique<Cache>()) {}
Stager::~Stager() = default;

void Stager::Release() { cache_->entries.clear(); }

uint64_t Stager::cached_bytes() const {
  uint64_t total = 0;
  for (const auto& [key, e] : cache_->entries) total += e.buffer.nbytes();
  return total;
}

int64_t Stager::allocations() const { return cache_->allocations; }

namespace {

struct Span {
  uintptr_t begin = 0;
  uintptr_t end = 0;  // one past the last byte
  size_t shard = 0;   // index into the collected shards
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
  for (internal_core::MutableFlatLeaf& leaf : flat.leaves) {
    ShardedTensor* t = leaf.node->tensor();
    if (t == nullptr) continue;
    for (size_t s = 0; s < t->shards().size(); ++s) {
      const TensorView& v = t->shards()[s].view;
      if (!v.device().is_cpu()) {
        return absl::UnimplementedError(absl::StrFormat(
            "%s: tensor on %s; this build of cairn stages host memory only "
            "(device staging needs a CUDA build)",
            leaf.fqn, v.device().ToString()));
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
      spans.push_back({begin, begin + (last + 1) * es, sources.size()});
      sources.push_back({t, s, &leaf.fqn});
    }
  }

  // 2. Storages: overlapping spans merged.
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  struct Storage {
    uintptr_t begin, end;
    std::vector<size_t> shards;  // into `sources`
    std::shared_ptr<void> owner;
  };
  std::vector<Storage> storages;
  for (const Span& s : spans) {
    if (storages.empty() || s.begin >= storages.back().end) {
      storages.push_back({s.begin, s.end, {}, nullptr});
    }
    Storage& st = storages.back();
    st.end = std::max(st.end, s.end);
    st.shards.push_back(s.shard);
    if (!st.owner) st.owner = sources[s.shard].tensor->owner();
  }

  // 3 and 4. A buffer per storage; copies.
  std::vector<Shard> staged_shards(sources.size());
  for (const Storage& st : storages) {
    const uint64_t length = st.end - st.begin;
    const auto key = std::make_pair(st.begin, length);
    Cache::Entry* entry = nullptr;
    if (auto it = cache.entries.find(key);
        it != cache.entries.end() &&
        // Reuse only a buffer nobody else holds: an earlier staged state
        // dict may still be being saved from it.
        it->second.buffer.buffer().use_count() == 1) {
      entry = &it->second;
    } else {
      CAIRN_ASSIGN_OR_RETURN(
          Tensor buffer,
          Tensor::Empty(DType::kU8, {static_cast<int64_t>(length)}));
      ++cache.allocations;
      Cache::Entry fresh;
      fresh.buffer = std::move(buffer);
      entry = &(cache.entries[key] = std::move(fresh));
    }
    entry->last_used = call;
    entry->owner = st.owner;
    entry->had_owner = st.owner != nullptr;
    auto* base = static_cast<std::byte*>(entry->buffer.data());
    for (size_t idx : st.shards) {
      const Source& src = sources[idx];
      const TensorView& v = src.tensor->shards()[src.shard].view;
      std::byte* dst = base + (reinterpret_cast<uintptr_t>(v.data()) - st.begin);
      // Same offsets and strides as the source: shared bytes stay shared.
      const TensorView staged_view(dst, v.dtype(), v.shape(), v.strides());
      internal_core::CopyView(v, staged_view);
      staged_shards[idx] = Shard{src.tensor->shards()[src.shard].box, staged_view};
    }
  }

  // Rebuild each tensor leaf around the staged views; its owner keeps every
  // buffer it uses alive.
  struct Rebuilt {
    std::vector<std::pair<size_t, Shard>> shards;  // (shard index, staged)
    std::vector<std::shared_ptr<void>> buffers;
  };
  std::map<ShardedTensor*, Rebuilt> rebuilt;
  for (const Storage& st : storages) {
    const std::shared_ptr<void>& buffer =
        cache.entries.at({st.begin, st.end - st.begin}).buffer.buffer();
    for (size_t idx : st.shards) {
      Rebuilt& r = rebuilt[sources[idx].tensor];
      r.shards.push_back({sources[idx].shard, staged_shards[idx]});
      r.buffers.push_back(buffer);
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
    total -= oldest->second.buffer.nbytes();
    cache.entries.erase(oldest);
  }
  return staged;
}

}  // namespace cairn
