#include <cstdio>
#include <cstdlib>

#include "fuzz/fuzz_target.h"

namespace cairn::fuzz {

std::vector<Target>& Registry() {
  static std::vector<Target> targets;
  return targets;
}

void Fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: fuzz invariant broken: %s\n", file, line,
               what.c_str());
  std::abort();
}

std::vector<std::string> SplitRecords(std::string_view data, size_t max) {
  std::vector<std::string> records;
  while (!data.empty() && records.size() < max) {
    if (data.size() < 2) {
      records.emplace_back(data);
      break;
    }
    const size_t n = static_cast<unsigned char>(data[0]) |
                     static_cast<size_t>(static_cast<unsigned char>(data[1])) << 8;
    data.remove_prefix(2);
    const size_t take = n < data.size() ? n : data.size();
    records.emplace_back(data.substr(0, take));
    data.remove_prefix(take);
  }
  return records;
}

std::string JoinRecords(const std::vector<std::string>& records) {
  std::string out;
  for (const std::string& r : records) {
    if (r.size() > 0xffff) Fail(__FILE__, __LINE__, "seed record over 64 KiB");
    out.push_back(static_cast<char>(r.size() & 0xff));
    out.push_back(static_cast<char>(r.size() >> 8));
    out.append(r);
  }
  return out;
}

}  // namespace cairn::fuzz
