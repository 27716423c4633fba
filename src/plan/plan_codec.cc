#include "plan/plan_codec.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/checked.h"
#include "core/status.h"

namespace cairn::internal_plan {
namespace {

using internal_core::ByteReader;
using internal_core::ByteWriter;

void WriteBox(ByteWriter& w, const Box& box) {
  w.Ints(box.offsets);
  w.Ints(box.sizes);
}

Box ReadBox(ByteReader& r) {
  Box box;
  box.offsets = r.Ints();
  box.sizes = r.Ints();
  if (box.offsets.size() != box.sizes.size()) r.Fail("box rank mismatch");
  return box;
}

}  // namespace

namespace {

// Bytes EncodeSavePlan writes for `plan`'s items.
size_t ItemBytes(const SavePlan& plan) {
  size_t n = 0;
  for (const WriteItem& item : plan.items) {
    n += 8 + item.fqn.size() + 2 + 8 * (4 + item.global_shape.size() +
                                        item.box.offsets.size() +
                                        item.box.sizes.size());
  }
  return n;
}

}  // namespace

std::string EncodeSavePlan(const SavePlan& plan, bool with_scalar_values,
                           std::string_view prefix) {
  ByteWriter w;
  size_t rest = 1 + 8 + 8 + 3 * 8 + plan.structure.size() +
                plan.planner_data.size() + plan.storage_data.size();
  for (const auto& [fqn, value] : plan.scalars) {
    rest += 8 + fqn.size() + 1 + 16;
    if (const auto* text = std::get_if<std::string>(&value)) rest += text->size();
  }
  w.Reserve(prefix.size() + ItemBytes(plan) + rest);
  w.Raw(prefix);
  w.U8(with_scalar_values ? 1 : 0);
  w.U64(plan.items.size());
  for (const WriteItem& item : plan.items) {
    w.Str(item.fqn);
    w.U8(static_cast<uint8_t>(item.kind));
    w.U8(static_cast<uint8_t>(item.dtype));
    w.Ints(item.global_shape);
    WriteBox(w, item.box);
    w.U64(item.nbytes);
    w.I64(item.local_index);
  }
  w.U64(plan.scalars.size());
  for (const auto& [fqn, value] : plan.scalars) {
    w.Str(fqn);
    // Without values, only the type: the plan cache compares structure.
    if (with_scalar_values) {
      w.Scalar(value);
    } else {
      w.U8(static_cast<uint8_t>(value.index()));
    }
  }
  w.Str(plan.structure);
  w.Str(plan.planner_data);
  w.Str(plan.storage_data);
  return w.Take();
}

absl::StatusOr<SavePlan> DecodeSavePlan(std::string_view data,
                                        std::string_view what) {
  ByteReader r(data, std::string(what));
  SavePlan plan;
  const bool with_values = r.U8() != 0;
  const uint64_t n = r.Count(32);
  plan.items.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    WriteItem item;
    item.fqn = r.Str();
    const uint8_t kind = r.U8();
    if (kind > static_cast<uint8_t>(ItemKind::kObject)) r.Fail("bad item kind");
    item.kind = static_cast<ItemKind>(kind);
    const uint8_t dtype = r.U8();
    if (dtype >= AllDTypes().size()) r.Fail("bad dtype");
    item.dtype = static_cast<DType>(dtype);
    item.global_shape = r.Ints();
    item.box = ReadBox(r);
    item.nbytes = r.U64();
    item.local_index = r.I64();
    plan.items.push_back(std::move(item));
  }
  const uint64_t scalars = r.Count(9);
  for (uint64_t i = 0; i < scalars; ++i) {
    std::string fqn = r.Str();
    if (with_values) {
      plan.scalars[std::move(fqn)] = r.Scalar();
      continue;
    }
    // Only the type: a default value of it.
    switch (r.U8()) {
      case 0: plan.scalars[std::move(fqn)] = int64_t{0}; break;
      case 1: plan.scalars[std::move(fqn)] = 0.0; break;
      case 2: plan.scalars[std::move(fqn)] = false; break;
      case 3: plan.scalars[std::move(fqn)] = std::string(); break;
      default: r.Fail("unknown scalar type");
    }
  }
  plan.structure = r.Str();
  plan.planner_data = r.Str();
  plan.storage_data = r.Str();
  CAIRN_RETURN_IF_ERROR(r.status());
  return plan;
}

std::string EncodeLoadPlan(const LoadPlan& plan) {
  ByteWriter w;
  w.U64(plan.items.size());
  for (const ReadItem& item : plan.items) {
    w.Str(item.fqn);
    w.U8(static_cast<uint8_t>(item.kind));
    w.I64(item.local_index);
    w.U64(item.chunk);
    WriteBox(w, item.overlap);
  }
  for (const auto* list : {&plan.missing, &plan.unexpected}) {
    w.U64(list->size());
    for (const std::string& s : *list) w.Str(s);
  }
  w.Str(plan.planner_data);
  w.Str(plan.storage_data);
  return w.Take();
}

absl::StatusOr<LoadPlan> DecodeLoadPlan(std::string_view data,
                                        std::string_view what) {
  ByteReader r(data, std::string(what));
  LoadPlan plan;
  const uint64_t n = r.Count(41);
  plan.items.reserve(n);
  for (uint64_t i = 0; i < n; ++i) {
    ReadItem item;
    item.fqn = r.Str();
    const uint8_t kind = r.U8();
    if (kind > static_cast<uint8_t>(ItemKind::kObject)) r.Fail("bad item kind");
    item.kind = static_cast<ItemKind>(kind);
    item.local_index = r.I64();
    item.chunk = r.U64();
    item.overlap = ReadBox(r);
    plan.items.push_back(std::move(item));
  }
  for (auto* list : {&plan.missing, &plan.unexpected}) {
    const uint64_t m = r.Count(8);
    for (uint64_t i = 0; i < m; ++i) list->push_back(r.Str());
  }
  plan.planner_data = r.Str();
  plan.storage_data = r.Str();
  CAIRN_RETURN_IF_ERROR(r.status());
  return plan;
}

}  // namespace cairn::internal_plan
