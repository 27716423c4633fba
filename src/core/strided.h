// Row-major byte runs of a sub-box, and strided copies. Pure functions.
//
// A chunk stored in a file is the row-major, contiguous image of its box. The
// elements of a sub-box of it form a regular grid of contiguous runs: every
// run has the same length and the run starts are an (n-1)-dimensional
// strided pattern. RunPattern describes that grid compactly (a column slice of
// a 100k-row chunk is 100k runs but one small RunPattern).
#ifndef CAIRN_CORE_STRIDED_H_
#define CAIRN_CORE_STRIDED_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "cairn/box.h"
#include "cairn/tensor.h"

namespace cairn::internal_core {

struct RunPattern {
  int64_t first_offset = 0;  // bytes from the outer buffer's start
  int64_t run_bytes = 0;     // length of every run; 0 when the box is empty
  // Outer loops, outermost first: counts[i] repetitions, strides[i] bytes
  // apart. Dimensions merged wherever runs touch; empty when one run.
  std::vector<int64_t> counts;
  std::vector<int64_t> strides;

  int64_t num_runs() const;    // product of counts (1 if none, 0 if empty)
  int64_t total_bytes() const; // num_runs() * run_bytes
};

// The runs of `inner` (absolute coordinates, inside `outer`) in the
// row-major buffer of `outer` with elements of `elem_size` bytes. Adjacent
// runs are coalesced, so a sub-box made of whole rows is one run. Requires
// Contains(outer, inner).
RunPattern SubBoxRuns(const Box& outer, const Box& inner, size_t elem_size);

// Calls fn(offset) for the start of each run, in increasing order.
void ForEachRun(const RunPattern& pattern,
                absl::FunctionRef<void(int64_t offset)> fn);

// Copies an n-d block of `shape` elements of `elem_size` bytes from `src` to
// `dst`; strides are in bytes, one per dimension, and may differ between
// source and destination. Dimensions are merged where both sides allow, and
// the innermost contiguous span is copied with memcpy.
void CopyStrided(const void* src, const int64_t* src_strides, void* dst,
                 const int64_t* dst_strides, const int64_t* shape, int rank,
                 size_t elem_size);

// Copies the elements of `src` into `dst` (same dtype and shape, any
// non-negative strides, host memory): CopyStrided on two views.
void CopyView(const TensorView& src, const TensorView& dst);

// Copies bytes [begin, end) of the row-major image of `view` to `dst`,
// honouring the view's strides. The range may start or end inside an
// element (a save streams a file in fixed-size blocks that cut entries
// anywhere). Host memory only.
void CopyRowMajorBytes(const TensorView& view, uint64_t begin, uint64_t end,
                       std::byte* dst);

}  // namespace cairn::internal_core

#endif  // CAIRN_CORE_STRIDED_H_
