// cairn_fuzz_replay: every fuzz target on its seeds and on every file of
// its corpus, for CTest (fuzz/README.md).
//
//   cairn_fuzz_replay CORPUS_ROOT            replay CORPUS_ROOT/<target>/*
//   cairn_fuzz_replay --write-seeds ROOT     write ROOT/<target>/seed-N
//   cairn_fuzz_replay --pack OUT DIR...      pack the files of DIRs into OUT
//
// A corpus file named *.pack holds many inputs, each a 4-byte
// little-endian length and that many bytes: the few thousand inputs a
// fuzzing run keeps (libFuzzer's -merge=1 output) in one file per target.
//
// A broken invariant aborts with its message; a target without a corpus
// folder, or with an empty one, fails (a corpus that went missing would
// otherwise pass unseen).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz/fuzz_target.h"

namespace fs = std::filesystem;

namespace {

std::string ReadFile(const fs::path& file, bool* ok) {
  std::ifstream in(file, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  *ok = in.good() || in.eof();
  return data;
}

// The inputs of a .pack file; false when it is cut short.
bool Unpack(std::string_view pack, std::vector<std::string>* inputs) {
  while (!pack.empty()) {
    if (pack.size() < 4) return false;
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) {
      n |= uint32_t{static_cast<unsigned char>(pack[i])} << (8 * i);
    }
    pack.remove_prefix(4);
    if (n > pack.size()) return false;
    inputs->emplace_back(pack.substr(0, n));
    pack.remove_prefix(n);
  }
  return true;
}

int Pack(const fs::path& out_path, const std::vector<fs::path>& dirs) {
  std::vector<fs::path> files;
  for (const fs::path& dir : dirs) {
    for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
  }
  std::sort(files.begin(), files.end(),
            [](const fs::path& a, const fs::path& b) {
              return a.filename() < b.filename();
            });
  std::string pack;
  for (const fs::path& file : files) {
    bool ok = false;
    const std::string data = ReadFile(file, &ok);
    if (!ok || data.size() > 0xffffffffu) {
      std::fprintf(stderr, "cannot pack %s\n", file.c_str());
      return 1;
    }
    for (int i = 0; i < 4; ++i) {
      pack.push_back(static_cast<char>(data.size() >> (8 * i)));
    }
    pack.append(data);
  }
  std::ofstream out(out_path, std::ios::binary);
  out.write(pack.data(), static_cast<std::streamsize>(pack.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", out_path.c_str());
    return 1;
  }
  std::printf("%zu inputs, %zu bytes in %s\n", files.size(), pack.size(),
              out_path.c_str());
  return 0;
}

int WriteSeeds(const fs::path& root) {
  for (const cairn::fuzz::Target& t : cairn::fuzz::Registry()) {
    const fs::path dir = root / t.name;
    fs::create_directories(dir);
    const std::vector<std::string> seeds = t.seeds();
    for (size_t i = 0; i < seeds.size(); ++i) {
      std::ofstream out(dir / ("seed-" + std::to_string(i)), std::ios::binary);
      out.write(seeds[i].data(), static_cast<std::streamsize>(seeds[i].size()));
      if (!out) {
        std::fprintf(stderr, "cannot write %s\n", dir.c_str());
        return 1;
      }
    }
    std::printf("%s: %zu seeds in %s\n", t.name, seeds.size(), dir.c_str());
  }
  return 0;
}

int Replay(const fs::path& root) {
  int failures = 0;
  for (const cairn::fuzz::Target& t : cairn::fuzz::Registry()) {
    for (const std::string& seed : t.seeds()) t.fn(seed);
    const fs::path dir = root / t.name;
    std::error_code ec;
    std::vector<fs::path> files;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
    if (ec || files.empty()) {
      std::fprintf(stderr, "%s: no corpus in %s%s%s\n", t.name, dir.c_str(),
                   ec ? ": " : "", ec ? ec.message().c_str() : "");
      ++failures;
      continue;
    }
    std::sort(files.begin(), files.end());
    size_t inputs = 0;
    for (const fs::path& file : files) {
      bool ok = false;
      const std::string data = ReadFile(file, &ok);
      std::vector<std::string> unpacked;
      if (ok && file.extension() == ".pack") ok = Unpack(data, &unpacked);
      if (!ok) {
        std::fprintf(stderr, "%s: cannot read %s\n", t.name, file.c_str());
        ++failures;
        continue;
      }
      if (file.extension() != ".pack") unpacked.push_back(data);
      for (const std::string& input : unpacked) t.fn(input);
      inputs += unpacked.size();
    }
    std::printf("%s: %zu seeds and %zu corpus inputs (%zu files) passed\n",
                t.name, t.seeds().size(), inputs, files.size());
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage =
      "usage: cairn_fuzz_replay CORPUS_ROOT | --write-seeds ROOT | "
      "--pack OUT DIR...\n";
  if (argc == 3 && std::string(argv[1]) == "--write-seeds") {
    return WriteSeeds(argv[2]);
  }
  if (argc >= 4 && std::string(argv[1]) == "--pack") {
    return Pack(argv[2], std::vector<fs::path>(argv + 3, argv + argc));
  }
  if (argc != 2 || argv[1][0] == '-') {
    std::fputs(usage.c_str(), stderr);
    return 2;
  }
  return Replay(argv[1]);
}
