// A real key-value table checkpoint, damaged on disk, loaded back: a recipe
// of edits to one of its files (a table data file, or metadata.json,
// resealed after so its checksum passes and the load reaches its content),
// then two loads, each checking every CRC32C: three ranks in the saved
// bucketing (each reads its buckets' rows) and two ranks in another (rows
// routed between them).
//
// Invariants: never a crash, a hang or a read outside a buffer; the ranks
// of a load agree on its outcome; an unedited checkpoint loads; a load that
// succeeds gives each rank exactly the saved rows of its buckets, every
// byte (a damaged byte that a load reads must fail it).
//
// Input: a byte choosing the file, then up to four edits of three bytes
// and a 4-byte offset: kind (flip a bit, set a byte, cut the file there,
// insert a byte, erase a byte) and its value.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cairn/checkpoint.h"
#include "cairn/communicator.h"
#include "cairn/kv_table.h"
#include "checkpoint/test_util.h"
#include "core/status.h"
#include "format/names.h"
#include "fuzz/fuzz_target.h"

namespace cairn::fuzz {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kBuckets = 8;
constexpr int kRows = 1500;

KvTableSpec Spec(int64_t buckets) {
  KvTableSpec s;
  s.num_buckets = buckets;
  s.bucketing = KvBucketing::kInterleaved;
  s.columns = {{"weight", DType::kBF16, 4}, {"count", DType::kI64, 1}};
  return s;
}

// Distinct ids spread over [0, 2^40), and each row's 16 bytes (weight, then
// count), a function of its id.
std::vector<int64_t> Ids() {
  std::vector<int64_t> ids;
  for (int i = 0; i < kRows; ++i) {
    ids.push_back(static_cast<int64_t>((uint64_t(i) * 0x9E3779B97F4A7C15u) &
                                       ((uint64_t{1} << 40) - 1)));
  }
  return ids;
}
std::string Row(int64_t id) {
  std::string row(16, '\0');
  for (int k = 0; k < 8; ++k) row[k] = static_cast<char>((id >> (k * 5)) + k);
  const int64_t count = id * 3 + 1;
  std::memcpy(row.data() + 8, &count, 8);
  return row;
}

absl::Status Fill(InMemoryKvTable& t) {
  const KvTableSpec& spec = t.spec();
  for (int64_t id : Ids()) {
    if (!t.owned().contains(*KvBucketOf(spec, id))) continue;
    const std::string row = Row(id);
    std::vector<TensorView> cols = {
        TensorView(const_cast<char*>(row.data()), DType::kBF16, {1, 4}),
        TensorView(const_cast<char*>(row.data() + 8), DType::kI64, {1, 1})};
    CAIRN_RETURN_IF_ERROR(t.Apply(std::span<const int64_t>(&id, 1), cols));
  }
  return absl::OkStatus();
}

std::map<std::string, std::string> ReadFolder(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    out[fs::relative(e.path(), dir).string()] =
        testing_util::ReadFile(e.path().string());
  }
  return out;
}

// The checkpoint's files, saved once per process by two ranks, in chunks
// of 300 rows (ids and weights over one 4 KiB checksum block).
const std::map<std::string, std::string>& Saved() {
  static const std::map<std::string, std::string> files = [] {
    testing_util::TempDir dir;
    std::vector<absl::Status> st =
        RunInProcess(2, [&](Communicator& comm) -> absl::Status {
          const KvBucketRange mine = KvBucketsOfRank(kBuckets, 2, comm.rank());
          CAIRN_ASSIGN_OR_RETURN(auto t, InMemoryKvTable::Create(
                                             "emb", Spec(kBuckets), mine));
          CAIRN_RETURN_IF_ERROR(Fill(*t));
          std::unique_ptr<KvSource> source = t->Source(64);
          SaveOptions o;
          o.comm = &comm;
          o.kv_chunk_bytes = 300 * 24;
          o.crc32c_block_bytes = 4096;
          o.kv_tables.push_back({"emb", Spec(kBuckets), mine, source.get()});
          StateDict sd;
          return Save(sd, dir.path(), o).status();
        });
    for (const absl::Status& s : st) {
      CAIRN_FUZZ_CHECK(s.ok(), absl::StrCat("the save failed: ", s.ToString()));
    }
    return ReadFolder(dir.path());
  }();
  return files;
}

// Loads into `world` ranks of a table of `buckets`, and checks the
// outcome (see the file's comment).
void LoadAndCheck(const std::string& dir, int world, int64_t buckets,
                  bool edited) {
  const KvTableSpec dest = Spec(buckets);
  std::vector<std::unique_ptr<InMemoryKvTable>> tables;
  for (int r = 0; r < world; ++r) {
    tables.push_back(*InMemoryKvTable::Create(
        "emb", dest, KvBucketsOfRank(buckets, world, r)));
  }
  std::vector<absl::Status> st =
      RunInProcess(world, [&](Communicator& comm) -> absl::Status {
        LoadOptions o;
        o.comm = &comm;
        o.memory_budget_bytes = 1;  // the smallest pieces
        KvTableToLoad t{.fqn = "emb", .sink = tables[comm.rank()].get()};
        t.num_buckets = buckets;
        t.bucketing = KvBucketing::kInterleaved;
        o.kv_tables.push_back(t);
        StateDict sd;
        return Load(sd, dir, o).status();
      });
  for (int r = 1; r < world; ++r) {
    CAIRN_FUZZ_CHECK(st[r].ok() == st[0].ok(),
                     absl::StrCat("ranks disagree: rank 0 ", st[0].ToString(),
                                  ", rank ", r, " ", st[r].ToString()));
  }
  CAIRN_FUZZ_CHECK(edited || st[0].ok(),
                   absl::StrCat("the unedited checkpoint does not load: ",
                                st[0].ToString()));
  if (!st[0].ok()) return;
  for (int r = 0; r < world; ++r) {
    const InMemoryKvTable& t = *tables[r];
    size_t expected = 0;
    for (int64_t id : Ids()) {
      if (!t.owned().contains(*KvBucketOf(dest, id))) continue;
      ++expected;
      const std::byte* got = t.Find(id);
      CAIRN_FUZZ_CHECK(got != nullptr && std::memcmp(got, Row(id).data(), 16) == 0,
                       absl::StrCat("rank ", r, " of ", world, ": id ", id,
                                    got == nullptr ? " is missing" : " differs"));
    }
    CAIRN_FUZZ_CHECK(t.size() == expected,
                     absl::StrCat("rank ", r, " of ", world, " holds ",
                                  t.size(), " rows, not ", expected));
  }
}

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds = {std::string()};  // unedited
  for (int f = 0; f < 4; ++f) {
    // A bit of each file near its start, its middle and a cut.
    for (uint32_t at : {100u, 5000u, 9000u}) {
      std::string s(1, static_cast<char>(f));
      s += std::string{0, 1, 0};
      s.append(reinterpret_cast<const char*>(&at), 4);
      seeds.push_back(s);
    }
    std::string cut(1, static_cast<char>(f));
    cut += std::string{2, 0, 0};
    const uint32_t at = 7000;
    cut.append(reinterpret_cast<const char*>(&at), 4);
    seeds.push_back(cut);
  }
  return seeds;
}

}  // namespace

CAIRN_FUZZ_TARGET(kv_dir, &Seeds) {
  std::map<std::string, std::string> files = Saved();
  std::vector<std::string> names;
  for (const auto& [name, bytes] : files) {
    if (name == kMetadataFileName || name.find("-kv") != std::string::npos) {
      names.push_back(name);
    }
  }
  Recipe recipe(data);
  const std::string& name = names[recipe.Byte() % names.size()];
  std::string& bytes = files[name];
  for (int e = 0; e < 4 && !recipe.done(); ++e) {
    const int kind = recipe.Byte() % 5;
    const uint8_t value = recipe.Byte();
    recipe.Byte();  // reserved
    const size_t at = bytes.empty() ? 0 : recipe.U32() % bytes.size();
    switch (kind) {
      case 0:
        if (!bytes.empty()) bytes[at] ^= static_cast<char>(1 << (value % 8));
        break;
      case 1:
        if (!bytes.empty()) bytes[at] = static_cast<char>(value);
        break;
      case 2:
        bytes.resize(at);
        break;
      case 3:
        bytes.insert(bytes.begin() + static_cast<std::ptrdiff_t>(at),
                     static_cast<char>(value));
        break;
      default:
        if (!bytes.empty()) bytes.erase(at, 1);
    }
  }
  if (name == kMetadataFileName) bytes = testing_util::Resealed(bytes);
  const bool edited = files != Saved();

  static const testing_util::TempDir work;
  const std::string dir = work.Sub("ckpt");
  std::error_code ec;
  fs::remove_all(dir, ec);
  for (const auto& [n, b] : files) {
    fs::create_directories(fs::path(dir + "/" + n).parent_path());
    testing_util::WriteFile(dir + "/" + n, b);
  }
  LoadAndCheck(dir, 3, kBuckets, edited);  // direct: its own buckets' rows
  LoadAndCheck(dir, 2, 5, edited);         // routed: another bucketing
}

}  // namespace cairn::fuzz
