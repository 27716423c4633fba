// Run patterns and strided copies. These sit on the load path (every chunk
// read is scattered into destination tensors through them), so the inner
// loops are kept free of per-element bookkeeping: dimensions are merged
// first, the innermost contiguous span goes to memcpy, and the odometer only
// ticks once per span.
#include "core/strided.h"

#include <cassert>
#include <cstring>

namespace cairn::internal_core {

int64_t RunPattern::num_runs() const {
  if (run_bytes == 0) return 0;
  int64_t n = 1;
  for (int64_t c : counts) n *= c;
  return n;
}

int64_t RunPattern::total_bytes() const { return num_runs() * run_bytes; }

RunPattern SubBoxRuns(const Box& outer, const Box& inner, size_t elem_size) {
  assert(Contains(outer, inner));
  RunPattern pattern;
  // An empty sub-box (or a violated precondition in a release build) has no
  // runs: run_bytes 0, no counts.
  if (inner.empty() || !Contains(outer, inner) || elem_size == 0) {
    return pattern;
  }
  const int rank = inner.rank();
  // Row-major byte strides of the outer buffer.
  std::vector<int64_t> outer_strides(rank);
  int64_t stride = static_cast<int64_t>(elem_size);
  for (int i = rank - 1; i >= 0; --i) {
    outer_strides[i] = stride;
    stride *= outer.sizes[i];
  }
  for (int i = 0; i < rank; ++i) {
    pattern.first_offset +=
        (inner.offsets[i] - outer.offsets[i]) * outer_strides[i];
  }
  // The run spans the innermost dimension plus every dimension outside it
  // for as long as the dimensions inside are full.
  int k = rank - 1;
  int64_t run_elems = rank == 0 ? 1 : inner.sizes[k];
  while (k > 0 && inner.sizes[k] == outer.sizes[k]) {
    --k;
    run_elems *= inner.sizes[k];
  }
  pattern.run_bytes = run_elems * static_cast<int64_t>(elem_size);
  // Outer loops over dimensions [0, k), skipping single repetitions and
  // merging a loop into the one outside it when they form one progression.
  for (int i = 0; i < k; ++i) {
    if (inner.sizes[i] == 1) continue;
    pattern.counts.push_back(inner.sizes[i]);
    pattern.strides.push_back(outer_strides[i]);
  }
  std::vector<int64_t> counts, strides;
  for (size_t i = 0; i < pattern.counts.size(); ++i) {
    if (!counts.empty() &&
        strides.back() == pattern.strides[i] * pattern.counts[i]) {
      counts.back() *= pattern.counts[i];
      strides.back() = pattern.strides[i];
    } else {
      counts.push_back(pattern.counts[i]);
      strides.push_back(pattern.strides[i]);
    }
  }
  // Runs that touch become one longer run.
  while (!counts.empty() && strides.back() == pattern.run_bytes) {
    pattern.run_bytes *= counts.back();
    counts.pop_back();
    strides.pop_back();
  }
  pattern.counts = std::move(counts);
  pattern.strides = std::move(strides);
  return pattern;
}

void ForEachRun(const RunPattern& pattern,
                absl::FunctionRef<void(int64_t offset)> fn) {
  if (pattern.num_runs() == 0) return;
  const size_t n = pattern.counts.size();
  if (n == 0) {
    fn(pattern.first_offset);
    return;
  }
  // Odometer over all loops but the innermost, which runs as a tight loop.
  const int64_t inner_count = pattern.counts[n - 1];
  const int64_t inner_stride = pattern.strides[n - 1];
  std::vector<int64_t> index(n - 1, 0);
  int64_t base = pattern.first_offset;
  while (true) {
    for (int64_t j = 0; j < inner_count; ++j) fn(base + j * inner_stride);
    // Advance the outer loops; done when the outermost one wraps.
    size_t d = n - 1;
    while (true) {
      if (d == 0) return;
      --d;
      base += pattern.strides[d];
      if (++index[d] < pattern.counts[d]) break;
      base -= pattern.strides[d] * pattern.counts[d];
      index[d] = 0;
    }
  }
}

namespace {

struct Dim {
  int64_t size;
  int64_t src_stride;
  int64_t dst_stride;
};

// The innermost loop: `count` chunks of `chunk` bytes. A compile-time chunk
// size lets the compiler turn memcpy into a single load/store.
template <size_t kChunk>
void CopyChunksFixed(const char* src, int64_t src_stride, char* dst,
                     int64_t dst_stride, int64_t count) {
  for (int64_t j = 0; j < count; ++j) {
    std::memcpy(dst + j * dst_stride, src + j * src_stride, kChunk);
  }
}

void CopyChunks(const char* src, int64_t src_stride, char* dst,
                int64_t dst_stride, int64_t count, size_t chunk) {
  switch (chunk) {
    case 1:
      return CopyChunksFixed<1>(src, src_stride, dst, dst_stride, count);
    case 2:
      return CopyChunksFixed<2>(src, src_stride, dst, dst_stride, count);
    case 4:
      return CopyChunksFixed<4>(src, src_stride, dst, dst_stride, count);
    case 8:
      return CopyChunksFixed<8>(src, src_stride, dst, dst_stride, count);
    case 16:
      return CopyChunksFixed<16>(src, src_stride, dst, dst_stride, count);
    default:
      for (int64_t j = 0; j < count; ++j) {
        std::memcpy(dst + j * dst_stride, src + j * src_stride, chunk);
      }
  }
}

}  // namespace

void CopyStrided(const void* src, const int64_t* src_strides, void* dst,
                 const int64_t* dst_strides, const int64_t* shape, int rank,
                 size_t elem_size) {
  for (int i = 0; i < rank; ++i) {
    if (shape[i] <= 0) return;
  }
  // Drop size-1 dimensions (their strides never matter) and merge a
  // dimension into the one inside it when both sides step through them as
  // one progression.
  std::vector<Dim> dims;
  dims.reserve(rank);
  for (int i = 0; i < rank; ++i) {
    if (shape[i] == 1) continue;
    Dim d{shape[i], src_strides[i], dst_strides[i]};
    if (!dims.empty()) {
      Dim& prev = dims.back();
      if (prev.src_stride == d.src_stride * d.size &&
          prev.dst_stride == d.dst_stride * d.size) {
        prev.size *= d.size;
        prev.src_stride = d.src_stride;
        prev.dst_stride = d.dst_stride;
        continue;
      }
    }
    dims.push_back(d);
  }
  // The innermost contiguous span: a whole dimension when both sides are
  // dense along it, else one element.
  size_t chunk = elem_size;
  const auto elem = static_cast<int64_t>(elem_size);
  if (!dims.empty() && dims.back().src_stride == elem &&
      dims.back().dst_stride == elem) {
    chunk = static_cast<size_t>(dims.back().size) * elem_size;
    dims.pop_back();
  }
  const char* s = static_cast<const char*>(src);
  char* t = static_cast<char*>(dst);
  if (dims.empty()) {
    std::memcpy(t, s, chunk);
    return;
  }
  const size_t n = dims.size();
  const Dim inner = dims[n - 1];
  if (n == 1) {
    CopyChunks(s, inner.src_stride, t, inner.dst_stride, inner.size, chunk);
    return;
  }
  // Odometer over the outer dimensions; offsets are kept as integers so no
  // pointer is ever formed outside the buffers (even transiently).
  std::vector<int64_t> index(n - 1, 0);
  int64_t src_off = 0;
  int64_t dst_off = 0;
  while (true) {
    CopyChunks(s + src_off, inner.src_stride, t + dst_off, inner.dst_stride,
               inner.size, chunk);
    size_t d = n - 1;
    while (true) {
      --d;
      src_off += dims[d].src_stride;
      dst_off += dims[d].dst_stride;
      if (++index[d] < dims[d].size) break;
      src_off -= dims[d].src_stride * dims[d].size;
      dst_off -= dims[d].dst_stride * dims[d].size;
      index[d] = 0;
      if (d == 0) return;
    }
  }
}

void CopyRowMajorBytes(const TensorView& view, uint64_t begin, uint64_t end,
                       std::byte* dst) {
  if (end <= begin) return;
  const auto* base = static_cast<const std::byte*>(view.data());
  if (view.is_contiguous()) {
    std::memcpy(dst, base + begin, end - begin);
    return;
  }
  const int rank = view.rank();
  const uint64_t es = DTypeSize(view.dtype());
  const Shape& shape = view.shape();
  const std::vector<int64_t>& strides = view.strides();
  const uint64_t inner = static_cast<uint64_t>(shape[rank - 1]);
  const uint64_t row_bytes = inner * es;
  const bool inner_contiguous = strides[rank - 1] == 1 || inner == 1;
  // Odometer over the outer dimensions, starting at the row holding `begin`.
  std::vector<int64_t> index(rank, 0);
  uint64_t row = begin / row_bytes;
  for (int d = rank - 2; d >= 0; --d) {
    index[d] = static_cast<int64_t>(row % static_cast<uint64_t>(shape[d]));
    row /= static_cast<uint64_t>(shape[d]);
  }
  uint64_t row_start = begin / row_bytes * row_bytes;
  while (row_start < end) {
    int64_t elem_offset = 0;
    for (int d = 0; d < rank - 1; ++d) elem_offset += index[d] * strides[d];
    const std::byte* row_ptr = base + elem_offset * static_cast<int64_t>(es);
    const uint64_t a = std::max(begin, row_start) - row_start;
    const uint64_t b = std::min(end, row_start + row_bytes) - row_start;
    std::byte* out = dst + (row_start + a - begin);
    if (inner_contiguous) {
      std::memcpy(out, row_ptr + a, b - a);
    } else {
      const int64_t step = strides[rank - 1] * static_cast<int64_t>(es);
      for (uint64_t e = a / es; e * es < b; ++e) {
        const uint64_t lo = std::max(a, e * es);
        const uint64_t hi = std::min(b, (e + 1) * es);
        std::memcpy(out + (lo - a), row_ptr + static_cast<int64_t>(e) * step +
                                         static_cast<int64_t>(lo - e * es),
                    hi - lo);
      }
    }
    row_start += row_bytes;
    for (int d = rank - 2; d >= 0; --d) {
      if (++index[d] < shape[d]) break;
      index[d] = 0;
    }
  }
}

void CopyView(const TensorView& src, const TensorView& dst) {
  if (src.num_elements() == 0) return;
  const auto elem = static_cast<int64_t>(DTypeSize(src.dtype()));
  const int rank = src.rank();
  std::vector<int64_t> src_strides(rank), dst_strides(rank);
  for (int i = 0; i < rank; ++i) {
    src_strides[i] = src.strides()[i] * elem;
    dst_strides[i] = dst.strides()[i] * elem;
  }
  CopyStrided(src.data(), src_strides.data(), dst.data(),
                             dst_strides.data(), src.shape().data(), rank,
                             static_cast<size_t>(elem));
}

}  // namespace cairn::internal_core
