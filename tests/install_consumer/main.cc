// Saves and loads a tensor through the installed cairn package.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cairn/cairn.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::vector<float> src(1000), dst(1000, 0.0f);
  for (int i = 0; i < 1000; ++i) src[i] = static_cast<float>(i) * 0.5f;
  // Two in-process ranks save five rows each; one process loads it all.
  std::vector<absl::Status> saved = cairn::RunInProcess(
      2, [&](cairn::Communicator& comm) -> absl::Status {
        const int64_t r = comm.rank();
        cairn::StateDict sd;
        sd["w"] = cairn::ShardedTensor(
            cairn::DType::kF32, {10, 100},
            {{cairn::Box{{5 * r, 0}, {5, 100}},
              cairn::TensorView(src.data() + 500 * r, cairn::DType::kF32, {5, 100})}});
        cairn::SaveOptions options;
        options.comm = &comm;
        return cairn::Save(sd, argv[1], options).status();
      });
  for (const absl::Status& s : saved) {
    if (!s.ok()) {
      std::fprintf(stderr, "save: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  cairn::StateDict out;
  out["w"] = cairn::TensorView(dst.data(), cairn::DType::kF32, {10, 100});
  absl::StatusOr<cairn::LoadResult> loaded = cairn::Load(out, argv[1]);
  if (!loaded.ok() || dst != src) {
    std::fprintf(stderr, "load failed or data differs\n");
    return 1;
  }
  std::printf("consumer: saved and loaded %s with cairn %s\n", argv[1],
              CAIRN_VERSION_STRING);
  return 0;
}
