// The helpers of import_names.h for name maps: fusing and splitting
// imported tensors.
#include "cairn/import_names.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace cairn {
namespace {

// The index of the tensor named `fqn` that is one whole stored tensor.
absl::StatusOr<size_t> FindWhole(const std::vector<ImportedTensor>& tensors,
                                 const std::string& fqn,
                                 std::string_view what) {
  auto it = std::find_if(tensors.begin(), tensors.end(),
                         [&](const ImportedTensor& t) { return t.fqn == fqn; });
  if (it == tensors.end()) {
    return absl::NotFoundError(
        absl::StrFormat("%s: no tensor '%s' to take", what, fqn));
  }
  if (it->parts.size() != 1 || it->parts[0].source_row != 0 ||
      it->parts[0].box != Box::Full(it->shape)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: '%s' is not one whole stored tensor (fused or split before)",
        what, fqn));
  }
  return static_cast<size_t>(it - tensors.begin());
}

}  // namespace

absl::Status FuseTensors(std::vector<ImportedTensor>& tensors,
                         const std::vector<std::string>& sources,
                         const std::string& fqn, int dim) {
  const std::string what = absl::StrFormat(
      "fusing [%s] into '%s'", absl::StrJoin(sources, ", "), fqn);
  if (sources.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": no sources"));
  }
  std::vector<size_t> index;
  for (const std::string& s : sources) {
    absl::StatusOr<size_t> i = FindWhole(tensors, s, what);
    if (!i.ok()) return i.status();
    if (std::find(index.begin(), index.end(), *i) != index.end()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: '%s' named twice", what, s));
    }
    index.push_back(*i);
  }
  const ImportedTensor& first = tensors[index[0]];
  const int rank = static_cast<int>(first.shape.size());
  if (dim < 0 || dim >= rank) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: dim %d is outside a tensor of %d dimensions", what, dim, rank));
  }
  ImportedTensor fused;
  fused.fqn = fqn;
  fused.dtype = first.dtype;
  fused.shape = first.shape;
  fused.shape[dim] = 0;
  for (size_t i : index) {
    const ImportedTensor& t = tensors[i];
    bool fits = t.dtype == first.dtype && t.shape.size() == first.shape.size();
    for (int d = 0; fits && d < rank; ++d) {
      fits = d == dim || t.shape[d] == first.shape[d];
    }
    if (!fits) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: '%s' is %s [%s], which does not fit '%s' %s [%s] along dim %d",
          what, t.fqn, DTypeName(t.dtype), absl::StrJoin(t.shape, ", "),
          first.fqn, DTypeName(first.dtype), absl::StrJoin(first.shape, ", "),
          dim));
    }
    ImportPart part = t.parts[0];
    part.box.offsets[dim] = fused.shape[dim];
    fused.shape[dim] += t.shape[dim];
    fused.parts.push_back(std::move(part));
  }
  if (std::any_of(tensors.begin(), tensors.end(), [&](const ImportedTensor& t) {
        return t.fqn == fqn &&
               std::find(sources.begin(), sources.end(), fqn) == sources.end();
      })) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: a tensor '%s' exists already", what, fqn));
  }
  std::sort(index.begin(), index.end());
  for (auto it = index.rbegin(); it != index.rend(); ++it) {
    tensors.erase(tensors.begin() + static_cast<ptrdiff_t>(*it));
  }
  tensors.push_back(std::move(fused));
  return absl::OkStatus();
}

absl::Status SplitRows(
    std::vector<ImportedTensor>& tensors, const std::string& source,
    const std::vector<std::pair<std::string, int64_t>>& pieces) {
  const std::string what = absl::StrFormat("splitting '%s'", source);
  absl::StatusOr<size_t> i = FindWhole(tensors, source, what);
  if (!i.ok()) return i.status();
  const ImportedTensor whole = tensors[*i];
  if (whole.shape.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a 0-d tensor has no rows"));
  }
  int64_t total = 0;
  for (const auto& [name, rows] : pieces) {
    if (rows < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: '%s' has %d rows", what, name, rows));
    }
    total += rows;
  }
  if (total != whole.shape[0]) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: the pieces have %d rows, the tensor %d", what, total,
        whole.shape[0]));
  }
  std::vector<ImportedTensor> out;
  int64_t row = 0;
  for (const auto& [name, rows] : pieces) {
    ImportedTensor t;
    t.fqn = name;
    t.dtype = whole.dtype;
    t.shape = whole.shape;
    t.shape[0] = rows;
    ImportPart part = whole.parts[0];
    part.source_row = row;
    part.box = Box::Full(t.shape);
    t.parts.push_back(std::move(part));
    out.push_back(std::move(t));
    row += rows;
  }
  tensors.erase(tensors.begin() + static_cast<ptrdiff_t>(*i));
  for (ImportedTensor& t : out) tensors.push_back(std::move(t));
  return absl::OkStatus();
}

}  // namespace cairn
