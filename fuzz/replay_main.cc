// cairn_fuzz_replay: every fuzz target on its seeds and on every file of
// its corpus, for CTest (fuzz/README.md).
//
//   cairn_fuzz_replay CORPUS_ROOT            replay CORPUS_ROOT/<target>/*
//   cairn_fuzz_replay --write-seeds ROOT     write ROOT/<target>/seed-N
//   cairn_fuzz_replay --pack OUT DIR...      pack the files of DIRs into OUT
//   cairn_fuzz_replay --mutate TARGET N LAST
//                                            N runs of TARGET on its seeds
//                                            with random edits, each input
//                                            written to LAST first (a
//                                            crash leaves it there): a
//                                            blind fuzzer for machines
//                                            without clang's libFuzzer
//
// A corpus file named *.pack holds many inputs, each a 4-byte
// little-endian length and that many bytes: the few thousand inputs a
// fuzzing run keeps (libFuzzer's -merge=1 output) in one file per target.
//
// A broken invariant aborts with its message; a target without a corpus
// folder, or with an empty one, fails (a corpus that went missing would
// otherwise pass unseen).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
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

// Random edits of a seed: bits flipped, bytes set, inserted or erased, a
// run copied elsewhere, the end cut off.
std::string Mutate(std::string s, std::mt19937_64& rng) {
  auto below = [&](size_t n) { return n == 0 ? 0 : rng() % n; };
  const int edits = 1 + static_cast<int>(below(4));
  for (int e = 0; e < edits; ++e) {
    switch (below(6)) {
      case 0:
        if (!s.empty()) s[below(s.size())] ^= static_cast<char>(1 << below(8));
        break;
      case 1:
        if (!s.empty()) s[below(s.size())] = static_cast<char>(rng());
        break;
      case 2:
        s.insert(s.begin() + static_cast<std::ptrdiff_t>(below(s.size() + 1)),
                 static_cast<char>(rng()));
        break;
      case 3:
        if (!s.empty()) s.erase(below(s.size()), 1 + below(4));
        break;
      case 4: {
        if (s.empty()) break;
        const size_t from = below(s.size());
        const std::string run = s.substr(from, 1 + below(16));
        s.insert(below(s.size() + 1), run);
        break;
      }
      default:
        s.resize(below(s.size() + 1));
    }
  }
  return s;
}

int MutateRuns(const std::string& name, long runs, const fs::path& last) {
  for (const cairn::fuzz::Target& t : cairn::fuzz::Registry()) {
    if (name != t.name) continue;
    const std::vector<std::string> seeds = t.seeds();
    std::mt19937_64 rng(20261127);
    for (long i = 0; i < runs; ++i) {
      std::string input = seeds[rng() % seeds.size()];
      // Half the time, edits on edits.
      for (int round = 0; round < 1 + static_cast<int>(rng() % 3); ++round) {
        input = Mutate(std::move(input), rng);
      }
      std::ofstream(last, std::ios::binary | std::ios::trunc)
          .write(input.data(), static_cast<std::streamsize>(input.size()));
      t.fn(input);
    }
    std::printf("%s: %ld mutated inputs passed\n", t.name, runs);
    return 0;
  }
  std::fprintf(stderr, "no fuzz target named %s\n", name.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage =
      "usage: cairn_fuzz_replay CORPUS_ROOT | --write-seeds ROOT | "
      "--pack OUT DIR... | --mutate TARGET N LAST\n";
  if (argc == 3 && std::string(argv[1]) == "--write-seeds") {
    return WriteSeeds(argv[2]);
  }
  if (argc >= 4 && std::string(argv[1]) == "--pack") {
    return Pack(argv[2], std::vector<fs::path>(argv + 3, argv + argc));
  }
  if (argc == 5 && std::string(argv[1]) == "--mutate") {
    return MutateRuns(argv[2], std::atol(argv[3]), argv[4]);
  }
  if (argc != 2 || argv[1][0] == '-') {
    std::fputs(usage.c_str(), stderr);
    return 2;
  }
  return Replay(argv[1]);
}
