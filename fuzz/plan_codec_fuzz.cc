// The binary messages ranks send the coordinator: local save plans, load
// plans and write reports. Any bytes must decode to a value or to an
// error, never a read outside the message; and encoding is a fixed point:
// what a decoded message encodes to decodes and encodes to the same bytes.
//
// Input: one byte choosing the codec (0 save plan, 1 load plan, 2 write
// report; taken modulo 3), then the message.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/write_report.h"
#include "fuzz/fuzz_target.h"
#include "plan/plan_codec.h"

namespace cairn::fuzz {
namespace {

using internal_checkpoint::DecodeReport;
using internal_checkpoint::EncodeReport;
using internal_checkpoint::WriteReport;
using internal_plan::DecodeLoadPlan;
using internal_plan::DecodeSavePlan;
using internal_plan::EncodeLoadPlan;
using internal_plan::EncodeSavePlan;


std::string Tagged(char tag, std::string message) {
  return std::string(1, tag) + message;
}

std::vector<std::string> Seeds() {
  SavePlan save;
  WriteItem t;
  t.fqn = "model.w";
  t.kind = ItemKind::kTensor;
  t.dtype = DType::kF32;
  t.global_shape = {4, 3};
  t.box = Box{{2, 0}, {2, 3}};
  t.nbytes = 24;
  t.local_index = 0;
  save.items.push_back(t);
  WriteItem o;
  o.fqn = "rng";
  o.kind = ItemKind::kObject;
  o.nbytes = 16;
  o.local_index = 1;
  save.items.push_back(o);
  save.scalars["step"] = int64_t{7};
  save.scalars["lr"] = 0.25;
  save.scalars["flag"] = true;
  save.scalars["name"] = std::string("x");
  save.structure = R"({"model":{"w":"T"}})";
  save.planner_data = "p";

  LoadPlan load;
  load.items.push_back({"model.w", ItemKind::kTensor, 0, 1, Box{{2, 1}, {2, 2}}});
  load.items.push_back({"rng", ItemKind::kObject, 1, 0, Box{}});
  load.missing = {"model.b"};
  load.unexpected = {"opt.m"};

  WriteReport report;
  report.file = "data-00001.safetensors";
  report.file_size = 4096;
  report.items = {{64, 24, 0x1234}, {88, 16, 0xdeadbeef}};
  report.scalars["step"] = int64_t{7};

  return {Tagged(0, EncodeSavePlan(save, /*with_scalar_values=*/true)),
          Tagged(0, EncodeSavePlan(save, /*with_scalar_values=*/false)),
          Tagged(1, EncodeLoadPlan(load)), Tagged(2, EncodeReport(report))};
}

}  // namespace

CAIRN_FUZZ_TARGET(plan_codec, &Seeds) {
  if (data.empty()) return;
  const int codec = static_cast<unsigned char>(data[0]) % 3;
  const std::string_view message = data.substr(1);
  switch (codec) {
    case 0:
      CheckFixedPoint(
          message,
          [](std::string_view m) { return DecodeSavePlan(m, "save plan"); },
          [&](const SavePlan& p) {
            // Keep the message's own choice of scalar values or types.
            return EncodeSavePlan(p, !message.empty() && message[0] != 0);
          },
          "save plan");
      break;
    case 1:
      CheckFixedPoint(
          message,
          [](std::string_view m) { return DecodeLoadPlan(m, "load plan"); },
          [](const LoadPlan& p) { return EncodeLoadPlan(p); }, "load plan");
      break;
    default:
      CheckFixedPoint(
          message, [](std::string_view m) { return DecodeReport(m, 3); },
          [](const WriteReport& r) { return EncodeReport(r); }, "write report");
  }
}

}  // namespace cairn::fuzz
