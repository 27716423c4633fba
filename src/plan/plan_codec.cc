#include "plan/plan_codec.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/checked.h"
#include "core/status.h"

namespace cairn::internal_plan {
namespace {

enum ScalarTag : uint8_t { kInt = 0, kDouble = 1, kBool = 2, kString = 3 };

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

void ByteWriter::U32(uint32_t v) {
  for (int i = 0; i < 4; ++i) out_.push_back(static_cast<char>(v >> (8 * i)));
}

void ByteWriter::U64(uint64_t v) {
  for (int i = 0; i < 8; ++i) out_.push_back(static_cast<char>(v >> (8 * i)));
}

void ByteWriter::Str(std::string_view s) {
  U64(s.size());
  out_.append(s);
}

void ByteWriter::Ints(const std::vector<int64_t>& v) {
  U64(v.size());
  for (int64_t x : v) I64(x);
}

void ByteWriter::Scalar(const cairn::Scalar& s) {
  if (const int64_t* i = std::get_if<int64_t>(&s)) {
    U8(kInt);
    I64(*i);
  } else if (const double* d = std::get_if<double>(&s)) {
    U8(kDouble);
    uint64_t bits;
    std::memcpy(&bits, d, sizeof bits);
    U64(bits);
  } else if (const bool* b = std::get_if<bool>(&s)) {
    U8(kBool);
    U8(*b ? 1 : 0);
  } else {
    U8(kString);
    Str(std::get<std::string>(s));
  }
}

bool ByteReader::Need(uint64_t n) {
  if (!error_.empty()) return false;
  if (n > data_.size() - pos_) {
    error_ = absl::StrCat("truncated at byte ", pos_, " (needs ", n,
                          " more bytes, ", data_.size() - pos_, " left)");
    return false;
  }
  return true;
}

void ByteReader::Fail(std::string_view why) {
  if (error_.empty()) {
    error_ = absl::StrCat(std::string(why), " at byte ", pos_);
  }
}

uint8_t ByteReader::U8() {
  if (!Need(1)) return 0;
  return static_cast<uint8_t>(data_[pos_++]);
}

uint32_t ByteReader::U32() {
  if (!Need(4)) return 0;
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= static_cast<uint32_t>(static_cast<uint8_t>(data_[pos_++])) << (8 * i);
  }
  return v;
}

uint64_t ByteReader::U64() {
  if (!Need(8)) return 0;
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) {
    v |= static_cast<uint64_t>(static_cast<uint8_t>(data_[pos_++])) << (8 * i);
  }
  return v;
}

uint64_t ByteReader::Count(uint64_t min_bytes) {
  const uint64_t n = U64();
  if (!error_.empty()) return 0;
  if (min_bytes > 0 && n > (data_.size() - pos_) / min_bytes) {
    Fail(absl::StrCat("count ", n, " exceeds the buffer"));
    return 0;
  }
  return n;
}

std::string ByteReader::Str() {
  const uint64_t n = Count(1);
  if (!Need(n)) return {};
  std::string s(data_.substr(pos_, n));
  pos_ += n;
  return s;
}

std::vector<int64_t> ByteReader::Ints() {
  const uint64_t n = Count(8);
  std::vector<int64_t> v;
  v.reserve(n);
  for (uint64_t i = 0; i < n && error_.empty(); ++i) v.push_back(I64());
  return v;
}

cairn::Scalar ByteReader::Scalar() {
  switch (U8()) {
    case kInt:
      return I64();
    case kDouble: {
      const uint64_t bits = U64();
      double d;
      std::memcpy(&d, &bits, sizeof d);
      return d;
    }
    case kBool:
      return U8() != 0;
    case kString:
      return Str();
    default:
      Fail("unknown scalar type");
      return int64_t{0};
  }
}

absl::Status ByteReader::status() const {
  if (!error_.empty()) {
    return absl::DataLossError(absl::StrCat(what_, ": ", error_));
  }
  if (pos_ != data_.size()) {
    return absl::DataLossError(absl::StrCat(what_, ": ", data_.size() - pos_,
                                            " unexpected trailing bytes"));
  }
  return absl::OkStatus();
}

std::string EncodeSavePlan(const SavePlan& plan, bool with_scalar_values) {
  ByteWriter w;
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
    if (dtype > static_cast<uint8_t>(DType::kBool)) r.Fail("bad dtype");
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
